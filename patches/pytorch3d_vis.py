"""``pytorch3d.vis.plotly_vis`` stand-in: the plotting helpers SAM 3D's scene plotter imports (part of
:mod:`patches.pytorch3d_shim`). Traces are plotly ``Scatter3d`` objects; plotly is imported only when a trace
is added (it is a pure-Python package: ``pip install plotly``).

Axis bounds follow PyTorch3D's plotter: each trace widens its subplot's x/y/z ranges to include
``center +- max_expand``; a camera position for plotly is expressed relative to the axis range
(``(c - mid) / half_range``, directions only scaled).
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class AxisArgs(NamedTuple):
    showgrid: bool = False
    zeroline: bool = False
    showline: bool = False
    ticks: str = ""
    showticklabels: bool = False
    backgroundcolor: str = "#fff"
    showaxeslabels: bool = False


class Lighting(NamedTuple):
    ambient: float = 0.8
    diffuse: float = 1.0
    fresnel: float = 0.0
    specular: float = 0.0
    roughness: float = 0.5
    facenormalsepsilon: float = 1e-6
    vertexnormalsepsilon: float = 1e-12


def _go():
    try:
        import plotly.graph_objects as go
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError("pytorch3d.vis.plotly_vis (stand-in) needs plotly: pip install plotly") from error
    return go


def _is_ray_bundle(struct) -> bool:
    """Whether ``struct`` is a (heterogeneous) ray bundle: it has origins, directions and lengths."""
    return all(hasattr(struct, name) for name in ("origins", "directions", "lengths"))


def _scale_camera_to_bounds(coordinate: float, axis_bounds, is_position: bool) -> float:
    """A world coordinate on one axis in plotly's camera units: the axis range maps to [-1, 1]; positions are
    also re-centred on the range's middle, directions are only scaled."""
    lo, hi = float(axis_bounds[0]), float(axis_bounds[1])
    scale = (hi - lo) / 2.0
    offset = (hi + lo) / 2.0 if is_position else 0.0
    return (coordinate - offset) / scale


def _get(layout, key):
    try:
        return layout[key]
    except (KeyError, TypeError):
        return None


def _update_axes_bounds(verts_center: torch.Tensor, max_expand, current_layout) -> None:
    """Widen the subplot's x/y/z axis ranges to include ``verts_center +- max_expand`` (the union with any
    range already set)."""
    center = torch.as_tensor(verts_center, dtype=torch.float64).reshape(3)
    expand = float(max_expand)
    updates = {}
    for i, name in enumerate(("xaxis", "yaxis", "zaxis")):
        lo, hi = float(center[i]) - expand, float(center[i]) + expand
        axis = _get(current_layout, name)
        old = _get(axis, "range") if axis is not None else None
        if old is not None and len(old) == 2 and None not in tuple(old):
            lo, hi = min(lo, float(old[0])), max(hi, float(old[1]))
        updates[name] = {"range": [lo, hi]}
    if hasattr(current_layout, "update"):
        for name, value in updates.items():
            axis = _get(current_layout, name)
            if isinstance(axis, dict):
                axis.update(value)
            elif axis is not None and hasattr(axis, "update"):
                axis.update(value)
            else:
                current_layout[name] = value
    else:  # pragma: no cover
        raise TypeError("current_layout must be a plotly layout scene or a dict")


def _xyz(points: torch.Tensor) -> dict:
    """Scatter3d's x, y, z from [P, 3] points (numpy arrays: plotly reads them without copies or warnings)."""
    p = points.detach().cpu().numpy()
    return {"x": p[:, 0], "y": p[:, 1], "z": p[:, 2]}


def _subplot(subplot_idx: int, ncols: int):
    return subplot_idx // ncols + 1, subplot_idx % ncols + 1


def _bounds_from(points: torch.Tensor, fig, subplot_idx: int) -> None:
    points = points.reshape(-1, 3).double()
    if points.shape[0] == 0:
        return
    center = points.mean(0)
    expand = (points.amax(0) - points.amin(0)).max()
    _update_axes_bounds(center, expand, fig["layout"]["scene" + str(subplot_idx + 1)])


def _add_pointcloud_trace(fig, pointclouds, trace_name: str, subplot_idx: int, ncols: int,
                          max_points_per_pointcloud: int, marker_size: int) -> None:
    """One Scatter3d of the batch's points (at most ``max_points_per_pointcloud`` per cloud, evenly subsampled),
    coloured by the clouds' RGB features when they have 3 or 4 channels."""
    go = _go()
    points, colors = [], []
    feats = pointclouds.features_list()
    for i, p in enumerate(pointclouds.points_list()):
        keep = torch.linspace(0, p.shape[0] - 1, min(p.shape[0], max_points_per_pointcloud)).long() \
            if p.shape[0] > max_points_per_pointcloud else torch.arange(p.shape[0])
        points.append(p.detach().cpu()[keep])
        if feats is not None and feats[i].shape[-1] in (3, 4):
            colors.append(feats[i].detach().cpu()[keep])
    pts = torch.cat(points, 0) if points else torch.zeros(0, 3)
    marker = {"size": marker_size}
    if colors:
        rgb = (torch.cat(colors, 0)[:, :3].clamp(0, 1) * 255).round().int()
        marker["color"] = [f"rgb({r}, {g}, {b})" for r, g, b in rgb.tolist()]
    row, col = _subplot(subplot_idx, ncols)
    fig.add_trace(go.Scatter3d(**_xyz(pts), mode="markers", marker=marker,
                               name=trace_name), row=row, col=col)
    _bounds_from(pts, fig, subplot_idx)


def _camera_wireframe(scale: float) -> torch.Tensor:
    """A camera drawn in its view frame (x left, y up, z forward): the image rectangle at z = 2 scale joined to
    the centre, and a small triangle above it marking up. One polyline [P, 3]."""
    a, b, z = 0.5 * scale, 0.3 * scale, 2 * scale
    c0, c1, c2, c3 = [-a, b, z], [a, b, z], [a, -b, z], [-a, -b, z]
    up = [0.0, 1.5 * b, z]
    origin = [0.0, 0.0, 0.0]
    path = [c0, c1, c2, c3, c0, origin, c1, c2, origin, c3, c0, up, c1]
    return torch.tensor(path, dtype=torch.float32)


def _add_camera_trace(fig, cameras, trace_name: str, subplot_idx: int, ncols: int, camera_scale: float) -> None:
    """Wireframes of every camera of the batch, placed in the world by the inverse of its world-to-view
    transform (separated by gaps in one Scatter3d)."""
    go = _go()
    frame = _camera_wireframe(camera_scale)
    to_world = cameras.get_world_to_view_transform().inverse()
    lines = to_world.transform_points(frame[None].expand(len(cameras), -1, -1).to(to_world.get_matrix()))
    lines = lines.detach().cpu().float()
    gap = torch.full((lines.shape[0], 1, 3), float("nan"))
    flat = torch.cat([lines, gap], 1).reshape(-1, 3)
    row, col = _subplot(subplot_idx, ncols)
    fig.add_trace(go.Scatter3d(**_xyz(flat), mode="lines", name=trace_name,
                               marker={"size": 1}), row=row, col=col)
    _bounds_from(lines, fig, subplot_idx)


def _add_ray_bundle_trace(fig, ray_bundle, trace_name: str, subplot_idx: int, ncols: int, max_rays: int,
                          max_points_per_ray: int, marker_size: int, line_width: int) -> None:
    """The rays of a bundle as segments from their first to their last length, and their points as markers
    (at most ``max_rays`` rays and ``max_points_per_ray`` points per ray, evenly subsampled)."""
    go = _go()
    origins = ray_bundle.origins.detach().cpu().reshape(-1, 3).float()
    directions = ray_bundle.directions.detach().cpu().reshape(-1, 3).float()
    lengths = ray_bundle.lengths.detach().cpu().reshape(origins.shape[0], -1).float()
    rays = torch.linspace(0, origins.shape[0] - 1, min(origins.shape[0], max_rays)).long()
    steps = torch.linspace(0, lengths.shape[1] - 1, min(lengths.shape[1], max_points_per_ray)).long()
    o, d, ln = origins[rays], directions[rays], lengths[rays][:, steps]
    points = o[:, None] + ln[..., None] * d[:, None]
    ends = torch.stack([o + ln[:, :1] * d, o + ln[:, -1:] * d, torch.full_like(o, float("nan"))], 1).reshape(-1, 3)
    row, col = _subplot(subplot_idx, ncols)
    fig.add_trace(go.Scatter3d(**_xyz(ends), mode="lines", name=trace_name,
                               line={"width": line_width}), row=row, col=col)
    pts = points.reshape(-1, 3)
    fig.add_trace(go.Scatter3d(**_xyz(pts), mode="markers",
                               name=trace_name + "_points", marker={"size": marker_size}), row=row, col=col)
    _bounds_from(pts, fig, subplot_idx)


PLOTLY_VIS = dict(AxisArgs=AxisArgs, Lighting=Lighting, _add_camera_trace=_add_camera_trace,
                  _add_pointcloud_trace=_add_pointcloud_trace, _add_ray_bundle_trace=_add_ray_bundle_trace,
                  _is_ray_bundle=_is_ray_bundle, _scale_camera_to_bounds=_scale_camera_to_bounds,
                  _update_axes_bounds=_update_axes_bounds)
