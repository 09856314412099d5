"""``plot_tdfy_scene``: 3-D plotly subplots of cameras, point clouds and meshes.

Upstream adapts PyTorch3D's ``plot_scene``; here the structures are this package's light ones (``PointCloud``,
``CameraPose`` from ``scene_visualizer``), trimesh meshes, or PyTorch3D ``Meshes`` / ``Pointclouds`` when those
are passed. plotly is imported lazily: without it the functions raise an ImportError naming ``pip install plotly``.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Dict, Optional, Union

import numpy as np
import torch

# upstream's alias for "anything plot_tdfy_scene draws" (PyTorch3D structures there; ours / trimesh here)
Struct = Union[Any]

default_axisargs = {
    "xaxis": {"backgroundcolor": "rgb(200, 200, 230)"},
    "yaxis": {"backgroundcolor": "rgb(230, 200, 200)"},
    "zaxis": {"backgroundcolor": "rgb(200, 230, 200)"},
    "axis_args": {"showgrid": True},
}

NO_BACKGROUND = {
    "xaxis": {"backgroundcolor": "rgb(255, 255, 255)", "visible": False},
    "yaxis": {"backgroundcolor": "rgb(255, 255, 255)", "visible": False},
    "zaxis": {"backgroundcolor": "rgb(255, 255, 255)", "visible": False},
}


def require_plotly():
    try:
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots
    except ImportError as err:
        raise ImportError("scene plots need plotly: install it with `pip install plotly` "
                          "(or `make extras EXTRAS=notebook` in the clone)") from err
    return go, make_subplots


def _np(x) -> np.ndarray:
    return x.detach().cpu().double().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.float64)


def _rgb_strings(colors: np.ndarray):
    c = (np.clip(colors, 0, 1) * 255).astype(np.uint8)
    return [f"rgb({r}, {g}, {b})" for r, g, b in c[:, :3]]


def _points_trace(go, name, points, colors, max_points, marker_size):
    points = _np(points).reshape(-1, 3)
    keep = np.isfinite(points).all(axis=1)
    colors = None if colors is None else _np(colors).reshape(-1, 3)[keep]
    points = points[keep]
    if len(points) > max_points:  # random subsample, as PyTorch3D's trace does
        idx = np.random.default_rng(0).choice(len(points), max_points, replace=False)
        points = points[idx]
        colors = None if colors is None else colors[idx]
    marker = {"size": marker_size}
    if colors is not None:
        marker["color"] = _rgb_strings(colors)
    return go.Scatter3d(x=points[:, 0], y=points[:, 1], z=points[:, 2], mode="markers", marker=marker, name=name)


def _mesh_trace(go, name, verts, faces, colors, lighting=None):
    verts, faces = _np(verts).reshape(-1, 3), np.asarray(_np(faces), dtype=np.int64).reshape(-1, 3)
    used = np.zeros(len(verts), dtype=bool)
    used[faces.reshape(-1)] = True
    if used.any() and not used.all():  # unused vertices would stretch the axes: park them on the used centroid
        verts = verts.copy()
        verts[~used] = verts[used].mean(axis=0)
    kwargs = {}
    if colors is not None:
        kwargs["vertexcolor"] = _rgb_strings(_np(colors).reshape(-1, 3))
    if lighting is not None:
        kwargs["lighting"] = lighting
    return go.Mesh3d(x=verts[:, 0], y=verts[:, 1], z=verts[:, 2], i=faces[:, 0], j=faces[:, 1], k=faces[:, 2],
                     name=name, **kwargs)


def _camera_trace(go, name, rotation, translation, scale, width):
    """Wireframe pyramid of a camera with world-to-view x_view = x_world @ R + T (PyTorch3D's convention)."""
    R, T = _np(rotation).reshape(-1, 3, 3)[0], _np(translation).reshape(-1, 3)[0]
    s = scale
    local = np.array([[0, 0, 0], [-s, -s, 2 * s], [s, -s, 2 * s], [s, s, 2 * s], [-s, s, 2 * s]], dtype=np.float64)
    world = (local - T) @ R.T  # invert x_view = x_world @ R + T
    order = [1, 2, 3, 4, 1, 0, 2, 0, 3, 0, 4]
    pts = world[order]
    return go.Scatter3d(x=pts[:, 0], y=pts[:, 1], z=pts[:, 2], mode="lines", line={"width": width}, name=name)


def _trace(go, name, struct, kw):
    from .structures import CameraPose, PointCloud
    if isinstance(struct, PointCloud):
        return _points_trace(go, name, struct.points, struct.features, kw["pointcloud_max_points"],
                             kw["pointcloud_marker_size"])
    if isinstance(struct, CameraPose):
        return _camera_trace(go, name, struct.R, struct.T, kw["camera_scale"], kw["camera_wireframe_width"])
    if hasattr(struct, "verts_packed"):  # PyTorch3D Meshes
        tex = getattr(struct, "textures", None)
        colors = tex.verts_features_packed() if tex is not None and hasattr(tex, "verts_features_packed") else None
        return _mesh_trace(go, name, struct.verts_packed(), struct.faces_packed(), colors, kw.get("lighting"))
    if hasattr(struct, "points_packed"):  # PyTorch3D Pointclouds
        feats = struct.features_packed() if struct.features_packed() is not None else None
        return _points_trace(go, name, struct.points_packed(), feats, kw["pointcloud_max_points"],
                             kw["pointcloud_marker_size"])
    if hasattr(struct, "vertices") and hasattr(struct, "faces"):  # trimesh
        colors = None
        visual = getattr(struct, "visual", None)
        if visual is not None and getattr(visual, "kind", None) == "vertex":
            colors = np.asarray(visual.vertex_colors)[:, :3] / 255.0
        return _mesh_trace(go, name, struct.vertices, struct.faces, colors, kw.get("lighting"))
    raise ValueError(f"plot_tdfy_scene cannot draw {type(struct).__name__} ({name!r}): pass a PointCloud, "
                     f"CameraPose, trimesh mesh or PyTorch3D Meshes/Pointclouds")


def _trace_bounds(trace) -> Optional[np.ndarray]:
    xyz = [np.asarray(getattr(trace, a), dtype=np.float64) for a in ("x", "y", "z")]
    if any(v.size == 0 for v in xyz):
        return None
    return np.stack([[np.nanmin(v), np.nanmax(v)] for v in xyz])


@torch.no_grad()
def plot_tdfy_scene(plots: Dict[str, Dict[str, Struct]], *, viewpoint_cameras=None, ncols: int = 1,
                    camera_scale: float = 0.3, camera_wireframe_width: int = 3, pointcloud_max_points: int = 20000,
                    pointcloud_marker_size: int = 1, raybundle_max_rays: int = 20000,
                    raybundle_max_points_per_ray: int = 1000, raybundle_ray_point_marker_size: int = 1,
                    raybundle_ray_line_width: int = 1, boxes_wireframe_width: int = 1,
                    boxes_add_cross_face_bars: bool = False, boxes_name_int_to_display_name_dict=None,
                    boxes_plot_together: bool = False, height: Optional[int] = None, width: Optional[int] = None,
                    use_orthographic: bool = False, equalticks: bool = True, ticklen: float = 1.0,
                    aspectmode: str = "cube", **kwargs):
    """A plotly Figure with one 3-D subplot per key of ``plots`` ({subplot title: {trace name: struct}}).

    Each subplot's axes become equal-length cubes around the data (``nticks = ceil(length / ticklen)``), styled
    by ``xaxis`` / ``yaxis`` / ``zaxis`` / ``axis_args`` kwargs (defaults: ``default_axisargs``), camera up +z.
    ``viewpoint_cameras`` (our ``CameraPose``; 1 or one per subplot) place the plotly eye. Ray-bundle and box
    parameters are accepted for upstream compatibility (no such structures exist here).
    """
    go, make_subplots = require_plotly()
    titles = list(plots)
    nrows = max(1, math.ceil(len(titles) / ncols))
    fig = make_subplots(rows=nrows, cols=ncols, specs=[[{"type": "scene"}] * ncols] * nrows,
                        subplot_titles=titles)
    kw = {"pointcloud_max_points": pointcloud_max_points, "pointcloud_marker_size": pointcloud_marker_size,
          "camera_scale": camera_scale, "camera_wireframe_width": camera_wireframe_width,
          "lighting": kwargs.get("lighting")}
    axis_args = dict(kwargs.get("axis_args", default_axisargs["axis_args"]))
    cams = None
    if viewpoint_cameras is not None:
        from .structures import CameraPose
        single = isinstance(viewpoint_cameras, CameraPose) or not isinstance(viewpoint_cameras, (list, tuple))
        cams = [viewpoint_cameras] if single else list(viewpoint_cameras)
        if len(cams) not in (1, len(titles)):
            warnings.warn("viewpoint_cameras must hold 1 camera or one per subplot: ignored")
            cams = None
    for idx, title in enumerate(titles):
        row, col = idx // ncols + 1, idx % ncols + 1
        bounds = []
        for name, struct in plots[title].items():
            trace = _trace(go, name, struct, kw)
            fig.add_trace(trace, row=row, col=col)
            b = _trace_bounds(trace)
            if b is not None:
                bounds.append(b)
        scene = {"aspectmode": aspectmode, "camera": {"up": {"x": 0, "y": 0, "z": 1}}}
        center, length = np.zeros(3), 2.0  # plotly's normalised scene spans [-1, 1] around the data centre
        if bounds:
            lo = np.min([b[:, 0] for b in bounds], axis=0)
            hi = np.max([b[:, 1] for b in bounds], axis=0)
            center, length = (lo + hi) / 2, max(float((hi - lo).max()), 1e-6)
            for axis, c in zip(("xaxis", "yaxis", "zaxis"), center):
                settings = dict(axis_args)
                settings.update(kwargs.get(axis, default_axisargs[axis]))
                settings.update(range=[c - length / 2, c + length / 2], nticks=max(1, math.ceil(length / ticklen)))
                scene[axis] = settings
        if cams is not None:
            cam = cams[0] if len(cams) == 1 else cams[idx]
            R, T = _np(cam.R).reshape(-1, 3, 3)[0], _np(cam.T).reshape(-1, 3)[0]
            eye = -T @ R.T  # camera centre in world coordinates (x_view = x_world @ R + T)
            look = eye + R[:, 2]  # one unit along the viewing direction (+z view axis)
            to_plotly = lambda v: ((v - center) / (length / 2)).tolist()  # noqa: E731
            scene["camera"] = {"eye": dict(zip("xyz", to_plotly(eye))), "center": dict(zip("xyz", to_plotly(look))),
                               "up": dict(zip("xyz", R[:, 1].tolist())),
                               "projection": {"type": "orthographic"}}
        if use_orthographic and idx == 0:
            scene["camera"]["projection"] = {"type": "orthographic"}
        fig.update_layout(**{("scene" if idx == 0 else f"scene{idx + 1}"): scene})
    if height is not None or width is not None:
        fig.update_layout(height=height, width=width)
    return fig
