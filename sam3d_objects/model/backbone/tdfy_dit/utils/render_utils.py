"""Upstream's ``tdfy_dit.utils.render_utils``: orbit cameras (z up) and frame loops over a renderer.

Cameras follow upstream's conventions: OpenCV world-to-camera extrinsics [4, 4] and intrinsics [3, 3] in
normalised image units (width = height = 1). Gaussians render with ``renderers.GaussianRenderer`` (the
project's pure-PyTorch splat renderer), octrees with ``renderers.OctreeRenderer``. Everything runs on the device
given (default: the sample's device for renders, CPU for bare cameras) instead of upstream's hard-coded CUDA.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from tqdm.auto import tqdm

from .random_utils import sphere_hammersley_sequence

__all__ = ["yaw_pitch_r_fov_to_extrinsics_intrinsics", "render_frames", "render_gaussian_color_stay_in_device",
           "render_video", "render_multiview", "render_snapshot", "extrinsics_look_at", "intrinsics_from_fov_xy"]

Device = Optional[Union[str, torch.device]]


def extrinsics_look_at(eye: torch.Tensor, target: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """OpenCV world-to-camera [4, 4] looking from ``eye`` at ``target``; the image's down axis is world -up.

    Computed in the inputs' dtype without a parallel-up check (upstream's utils3d helper does the same, so the
    float32 rounding of a pole view decides its orientation)."""
    z = target - eye
    z = z / z.norm()
    x = torch.linalg.cross(-up, z)
    x = x / x.norm()
    y = torch.linalg.cross(z, x)
    y = y / y.norm()
    rot = torch.stack([x, y, z])
    extr = torch.eye(4, dtype=eye.dtype, device=eye.device)
    extr[:3, :3] = rot
    extr[:3, 3] = -rot @ eye
    return extr


def intrinsics_from_fov_xy(fov_x: torch.Tensor, fov_y: torch.Tensor) -> torch.Tensor:
    """Normalised intrinsics [3, 3] for full fields of view in radians (principal point 0.5, 0.5)."""
    fx = 0.5 / torch.tan(fov_x / 2)
    fy = 0.5 / torch.tan(fov_y / 2)
    k = torch.zeros((3, 3), dtype=fx.dtype, device=fx.device)
    k[0, 0], k[1, 1], k[0, 2], k[1, 2], k[2, 2] = fx, fy, 0.5, 0.5, 1.0
    return k


def _orbit_views(yaws, pitchs, rs, fovs, eye_of, up: Sequence[float], device: Device):
    """Shared body of the z-up (here) and y-up (notebook) orbit helpers."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    is_list = isinstance(yaws, list)
    if not is_list:
        yaws, pitchs = [yaws], [pitchs]
    if not isinstance(rs, list):
        rs = [rs] * len(yaws)
    if not isinstance(fovs, list):
        fovs = [fovs] * len(yaws)
    up_t = torch.tensor(up, dtype=torch.float32, device=device)
    origin = torch.zeros(3, dtype=torch.float32, device=device)
    extrinsics, intrinsics = [], []
    for yaw, pitch, r, fov in zip(yaws, pitchs, rs, fovs):
        fov_t = torch.deg2rad(torch.tensor(float(fov), dtype=torch.float32, device=device))
        yaw_t = torch.tensor(float(yaw), dtype=torch.float32, device=device)
        pitch_t = torch.tensor(float(pitch), dtype=torch.float32, device=device)
        eye = eye_of(yaw_t, pitch_t) * float(r)
        extrinsics.append(extrinsics_look_at(eye, origin, up_t))
        intrinsics.append(intrinsics_from_fov_xy(fov_t, fov_t))
    if not is_list:
        return extrinsics[0], intrinsics[0]
    return extrinsics, intrinsics


def yaw_pitch_r_fov_to_extrinsics_intrinsics(yaws, pitchs, rs, fovs, device: Device = "cpu"):
    """Cameras on a z-up orbit looking at the origin: eye = r (sin yaw cos pitch, cos yaw cos pitch, sin pitch);
    yaw/pitch in radians, fov in degrees. A list of yaws gives lists of (extrinsics, intrinsics); a number gives
    one pair. ``rs`` / ``fovs`` are lists (per view) or numbers (shared)."""
    def eye_of(yaw, pitch):
        return torch.stack([torch.sin(yaw) * torch.cos(pitch), torch.cos(yaw) * torch.cos(pitch), torch.sin(pitch)])
    return _orbit_views(yaws, pitchs, rs, fovs, eye_of, (0.0, 0.0, 1.0), device)


def _is_octree(sample: Any) -> bool:
    return any(cls.__name__ == "DfsOctree" for cls in type(sample).__mro__)


def _is_gaussian(sample: Any) -> bool:
    from ..representations.gaussian.gaussian_model import Gaussian
    return isinstance(sample, Gaussian)


def _frame_uint8(color: torch.Tensor) -> np.ndarray:
    """[3, H, W] float in [0, 1] -> uint8 [H, W, 3]: *255, clip, truncate (upstream's conversion)."""
    return np.clip(color.detach().permute(1, 2, 0).float().cpu().numpy() * 255, 0, 255).astype(np.uint8)


def _depth_numpy(res: Dict[str, Any]) -> Optional[np.ndarray]:
    depth = res.get("percent_depth", res.get("depth"))
    return None if depth is None else depth.detach().float().cpu().numpy()


def _make_renderer(sample: Any, options: Dict[str, Any], **kwargs):
    if _is_octree(sample):
        from ..renderers.octree_renderer import OctreeRenderer
        renderer = OctreeRenderer()
        renderer.rendering_options.resolution = options.get("resolution", 512)
        renderer.rendering_options.near = options.get("near", 0.8)
        renderer.rendering_options.far = options.get("far", 1.6)
        renderer.rendering_options.bg_color = options.get("bg_color", (0, 0, 0))
        renderer.rendering_options.ssaa = options.get("ssaa", 4)
        renderer.pipe.primitive = sample.primitive
        return renderer
    if _is_gaussian(sample):
        from ..renderers.gaussian_render import GaussianRenderer
        renderer = GaussianRenderer()
        renderer.rendering_options.resolution = options.get("resolution", 512)
        renderer.rendering_options.near = options.get("near", 0.8)
        renderer.rendering_options.far = options.get("far", 1.6)
        renderer.rendering_options.bg_color = options.get("bg_color", (0, 0, 0))
        renderer.rendering_options.ssaa = options.get("ssaa", 1)
        renderer.rendering_options.backend = options.get("backend", "inria")
        renderer.pipe.kernel_size = kwargs.get("kernel_size", 0.1)
        renderer.pipe.use_mip_gaussian = True
        return renderer
    # upstream names a mesh renderer it does not ship (its mesh branch always fails): meshes are not renderable
    raise ValueError(f"Unsupported sample type: {type(sample)} (render_frames renders Gaussian and Octree samples)")


def _count(views) -> Optional[int]:
    """The number of views for the progress bar's total (None for an iterator of unknown length)."""
    return len(views) if hasattr(views, "__len__") else None


def _frame_loop(sample, renderer, extrinsics, intrinsics, options: Dict[str, Any], colors_overwrite, convert,
                verbose: bool):
    """``convert(renderer.render(...))`` for every view, in order. Gaussians on the CPU render several frames at
    once (``sam3d_objects.render.frame_workers``; the same frames as one by one); a "random" background draws from
    numpy's generator in frame order, so it keeps to one frame at a time."""
    from sam3d_objects.render import frame_workers, map_frames

    views = list(zip(extrinsics, intrinsics))
    workers = 1
    if _is_gaussian(sample) and not isinstance(options.get("bg_color", (0, 0, 0)), str):
        workers = frame_workers(_sample_device(sample), len(views), int(sample.get_xyz.shape[0]))

    def one(view):
        return convert(renderer.render(sample, view[0], view[1], colors_overwrite=colors_overwrite))
    yield from tqdm(map_frames(one, views, workers), desc="Rendering", total=len(views), unit="frame",
                    disable=not verbose)


def render_frames(sample, extrinsics, intrinsics, options: Dict[str, Any] = {}, colors_overwrite=None,  # noqa: B006
                  verbose: bool = True, **kwargs) -> Dict[str, list]:
    """Render ``sample`` from every (extrinsics, intrinsics) pair -> {"color": [uint8 HxWx3], "depth": [float HxW
    or None]} ({} for no views). ``options``: resolution, near, far, bg_color, ssaa, backend."""
    renderer = _make_renderer(sample, options, **kwargs)
    rets: Dict[str, list] = {}
    for color, depth in _frame_loop(sample, renderer, extrinsics, intrinsics, options, colors_overwrite,
                                    lambda res: (_frame_uint8(res["color"]), _depth_numpy(res)), verbose):
        rets.setdefault("color", []).append(color)
        rets.setdefault("depth", []).append(depth)
    return rets


def render_gaussian_color_stay_in_device(sample, extrinsics, intrinsics, options: Dict[str, Any] = {},  # noqa: B006
                                         colors_overwrite=None, verbose: bool = True, **kwargs) -> Dict[str, list]:
    """Like :func:`render_frames` for a ``Gaussian`` but the frames stay uint8 tensors [H, W, 3] on the render
    device ({"color": [...]}). Values are clamped to [0, 1] first (upstream casts out-of-range values with
    platform-dependent results)."""
    if not _is_gaussian(sample):
        raise TypeError(f"render_gaussian_color_stay_in_device renders a Gaussian, got {type(sample).__name__}")
    renderer = _make_renderer(sample, options, **kwargs)
    rets: Dict[str, list] = {}
    for color in _frame_loop(sample, renderer, extrinsics, intrinsics, options, colors_overwrite,
                             lambda res: (res["color"].clamp(0, 1).permute(1, 2, 0) * 255).to(torch.uint8), verbose):
        rets.setdefault("color", []).append(color)
    return rets


def _sample_device(sample: Any) -> torch.device:
    xyz = getattr(sample, "get_xyz", None)
    if isinstance(xyz, torch.Tensor):
        return xyz.device
    position = getattr(sample, "position", None)
    return position.device if isinstance(position, torch.Tensor) else torch.device("cpu")


def render_video(sample, resolution: int = 512, bg_color=(0, 0, 0), num_frames: int = 300, r: float = 2,
                 fov: float = 40, backend: str = "inria", **kwargs) -> Dict[str, list]:
    """z-up orbit video: yaw over [0, 2 x 3.1415] (endpoint included), pitch oscillating 0.25 + 0.5 sin(yaw)."""
    yaws = torch.linspace(0, 2 * 3.1415, num_frames)
    pitch = (0.25 + 0.5 * torch.sin(torch.linspace(0, 2 * 3.1415, num_frames))).tolist()
    extr, intr = yaw_pitch_r_fov_to_extrinsics_intrinsics(yaws.tolist(), pitch, r, fov, _sample_device(sample))
    return render_frames(sample, extr, intr, {"resolution": resolution, "bg_color": bg_color, "backend": backend},
                         **kwargs)


def render_multiview(sample, resolution: int = 512, nviews: int = 30) -> Tuple[list, list, list]:
    """(uint8 frames, extrinsics, intrinsics) of ``nviews`` Hammersley directions at r = 2, fov = 40 deg."""
    cams = [sphere_hammersley_sequence(i, nviews) for i in range(nviews)]
    yaws = [float(c[0]) for c in cams]
    pitchs = [float(c[1]) for c in cams]
    extr, intr = yaw_pitch_r_fov_to_extrinsics_intrinsics(yaws, pitchs, 2, 40, _sample_device(sample))
    res = render_frames(sample, extr, intr, {"resolution": resolution, "bg_color": (0, 0, 0)})
    return res["color"], extr, intr


def render_snapshot(samples, resolution: int = 512, bg_color=(0, 0, 0),
                    offset=(-16 / 180 * np.pi, 20 / 180 * np.pi), r: float = 10, fov: float = 8,
                    **kwargs) -> Dict[str, list]:
    """Four near-orthographic views (yaw 0, 90, 180, 270 deg plus ``offset[0]``, pitch ``offset[1]``)."""
    yaws = [0, np.pi / 2, np.pi, 3 * np.pi / 2]
    yaws = [y + offset[0] for y in yaws]
    pitch = [offset[1] for _ in range(4)]
    extr, intr = yaw_pitch_r_fov_to_extrinsics_intrinsics(yaws, pitch, r, fov, _sample_device(samples))
    return render_frames(samples, extr, intr, {"resolution": resolution, "bg_color": bg_color}, **kwargs)
