"""Views, turntables and previews of the pipeline's outputs with the pure-PyTorch splat renderer.

Upstream's notebook helpers ``ready_gaussian_for_video_rendering`` and ``render_video`` are provided here with the
same roles: the first turns a scene from :func:`sam3d_objects.inference.make_scene` (PyTorch3D camera frame of the
input image) into an object-centred, z-up, unit-size scene; the second renders an orbit around it.
"""
from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from backends.splat import (SH_C0, Camera, RenderResult, covariance_from_scale_rotation, frame_workers, map_frames,
                            orbit_camera, pytorch3d_to_opencv, render_gaussians)

__all__ = ["gaussian_render_inputs", "render_gaussian", "object_extent", "turntable", "render_video",
           "ready_gaussian_for_video_rendering", "save_gif", "render_input_view", "preview_image", "mask_overlay"]

# camera frame (PyTorch3D: x left, y up, z forward) -> z-up world with the input camera looking along +y
_CAMERA_TO_ZUP = torch.tensor([[-1.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])


def gaussian_render_inputs(gs, device: Optional[torch.device] = None):
    """(means [N, 3], covariances [N, 3, 3], colours [N, 3] in [0, 1], opacities [N]) of a ``Gaussian``.

    Colour is the degree-0 spherical-harmonic term: 0.5 + SH_C0 * features_dc (higher degrees are ignored: the
    decoders emit degree 0)."""
    means = gs.get_xyz.detach().float()
    device = device or means.device
    scales = gs.get_scaling.detach().float()
    rotations = gs.get_rotation.detach().float()
    dc = gs._features_dc.detach().float().reshape(means.shape[0], -1)[:, :3]
    colors = (0.5 + SH_C0 * dc).clamp(0.0, 1.0)
    opacities = gs.get_opacity.detach().float().reshape(-1)
    covs = covariance_from_scale_rotation(scales, rotations)
    return means.to(device), covs.to(device), colors.to(device), opacities.to(device)


def render_gaussian(gs, camera: Camera, background=(1.0, 1.0, 1.0), device: Optional[torch.device] = None,
                    **kwargs) -> RenderResult:
    """Render a ``Gaussian`` (its activated attributes) with ``camera``; kwargs go to ``render_gaussians``."""
    means, covs, colors, opacities = gaussian_render_inputs(gs, device)
    return render_gaussians(means, covs, colors, opacities, camera, background=background, **kwargs)


def object_extent(means: torch.Tensor, opacities: Optional[torch.Tensor] = None,
                  quantile: float = 0.98) -> Tuple[torch.Tensor, float]:
    """(centre [3], radius) of the bulk of the gaussians: the centre of the 1%-99% box and the ``quantile`` of
    the distances to it (robust to a few stray gaussians)."""
    pts = means.detach().float().cpu()
    if opacities is not None and pts.shape[0] > 16:
        dense = opacities.detach().float().cpu().reshape(-1) > 0.05
        if int(dense.sum()) >= 8:
            pts = pts[dense]
    if pts.shape[0] == 0:
        return torch.zeros(3), 1.0
    lo = torch.quantile(pts, 0.01, dim=0) if pts.shape[0] > 1 else pts[0]
    hi = torch.quantile(pts, 0.99, dim=0) if pts.shape[0] > 1 else pts[0]
    centre = (lo + hi) / 2
    dist = (pts - centre).norm(dim=-1)
    radius = float(torch.quantile(dist, quantile)) if pts.shape[0] > 1 else 0.0
    return centre, max(radius, 1e-3)


def _fit_radius(radius: float, fov_deg: float, margin: float = 1.15) -> float:
    """Camera distance at which a sphere of ``radius`` fills the field of view (with a margin)."""
    return margin * radius / math.sin(math.radians(fov_deg) / 2)


def turntable(gs, num_frames: int = 36, resolution: int = 256, fov_deg: float = 40.0, pitch_deg: float = 20.0,
              radius: Optional[float] = None, yaw_start_deg: float = 0.0, background=(1.0, 1.0, 1.0),
              up: str = "z", device: Optional[torch.device] = None, progress: bool = False,
              **kwargs) -> List[np.ndarray]:
    """uint8 frames [H, W, 3] of a full orbit around the object (object frame: z up by default)."""
    means, covs, colors, opacities = gaussian_render_inputs(gs, device)
    centre, extent = object_extent(means, opacities)
    dist = radius if radius is not None else _fit_radius(extent, fov_deg)
    yaws = [yaw_start_deg + 360.0 * i / num_frames for i in range(num_frames)]

    def frame(yaw: float) -> np.ndarray:
        cam = orbit_camera(yaw, pitch_deg, dist, fov_deg, resolution, target=centre, up=up)
        return render_gaussians(means, covs, colors, opacities, cam, background=background, **kwargs).to_uint8()
    return _frames(frame, yaws, means, "turntable", progress)


def _frames(frame, yaws: List[float], means: torch.Tensor, desc: str, progress: bool) -> List[np.ndarray]:
    """``frame(yaw)`` for every yaw, in order; several at once on the CPU (``backends.splat.frame_workers``)."""
    workers = frame_workers(means.device, len(yaws), int(means.shape[0]))
    frames = map_frames(frame, yaws, workers)
    if progress:
        from tqdm.auto import tqdm
        frames = tqdm(frames, desc=desc, total=len(yaws), unit="frame")
    return list(frames)


def ready_gaussian_for_video_rendering(scene_gs, in_place: bool = False, fix_alignment: bool = True):
    """Scene in the input camera's frame (from ``make_scene``) -> a copy centred on the objects, rotated z-up
    (the input camera looks along +y, so yaw 0 of :func:`render_video` is roughly the input view) and scaled so
    the objects fit in a sphere of radius 0.5."""
    gs = scene_gs if in_place else copy.copy(scene_gs)
    xyz = scene_gs.get_xyz.detach()
    rot = _CAMERA_TO_ZUP.to(xyz) if fix_alignment else torch.eye(3, device=xyz.device, dtype=xyz.dtype)
    xyz = xyz @ rot.T
    centre, radius = object_extent(xyz, scene_gs.get_opacity)
    factor = 0.5 / radius
    from sam3d_objects.utils.rotation import matrix_to_quaternion, quaternion_multiply
    q_rot = matrix_to_quaternion(rot.cpu()).to(xyz)
    rotations = quaternion_multiply(q_rot[None].expand(xyz.shape[0], 4),
                                    torch.nn.functional.normalize(scene_gs.get_rotation.detach(), dim=-1))
    scaling = scene_gs.get_scaling.detach() * factor
    opacity = scene_gs._opacity.detach().clone()
    features = scene_gs._features_dc.detach().clone()
    gs.aabb = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0], device=xyz.device)
    gs.from_xyz((xyz - centre.to(xyz)) * factor)
    gs.from_rotation(rotations)
    gs.from_scaling(scaling)
    gs._opacity, gs._features_dc = opacity, features
    return gs


def render_video(gs, resolution: int = 512, num_frames: int = 120, r: float = 2.0, fov: float = 40.0,
                 pitch_deg: float = 15.0, yaw_start_deg: float = 0.0, bg_color=(0.0, 0.0, 0.0),
                 device: Optional[torch.device] = None, progress: bool = False, **kwargs) -> Dict[str, list]:
    """{"color": [uint8 frames]}: an orbit at distance ``r`` around the origin (z up), as upstream's helper
    returns; pair it with :func:`ready_gaussian_for_video_rendering` for a scene."""
    means, covs, colors, opacities = gaussian_render_inputs(gs, device)
    yaws = [yaw_start_deg + 360.0 * i / num_frames for i in range(num_frames)]

    def frame(yaw: float) -> np.ndarray:
        cam = orbit_camera(yaw, pitch_deg, r, fov, resolution)
        return render_gaussians(means, covs, colors, opacities, cam, background=bg_color, **kwargs).to_uint8()
    return {"color": _frames(frame, yaws, means, "render_video", progress)}


def save_gif(frames: Sequence[np.ndarray], path: Union[str, Path], fps: float = 15.0) -> Path:
    """Animated GIF (looping) from uint8 frames, with Pillow (no imageio needed)."""
    from PIL import Image
    if not frames:
        raise ValueError("save_gif: no frames")
    path = Path(path)
    images = [Image.fromarray(np.asarray(f)) for f in frames]
    images[0].save(path, save_all=True, append_images=images[1:], duration=max(1, int(round(1000 / fps))),
                   loop=0, optimize=False)
    return path


def render_input_view(scene_gs, width: int, height: int, focal: float, background=(0.0, 0.0, 0.0),
                      device: Optional[torch.device] = None, **kwargs) -> RenderResult:
    """Render gaussians placed in the input camera's PyTorch3D frame (``make_scene``) from that camera
    (``focal`` in pixels, principal point at the image centre): overlays on the input image."""
    means, covs, colors, opacities = gaussian_render_inputs(scene_gs, device)
    flip = torch.diag(torch.tensor([-1.0, -1.0, 1.0], device=means.device))
    cam = Camera(torch.eye(4), focal, focal, width / 2.0, height / 2.0, width, height)
    return render_gaussians(pytorch3d_to_opencv(means), flip @ covs @ flip, colors, opacities, cam,
                            background=background, **kwargs)


def preview_image(gs, image: Optional[np.ndarray] = None, mask: Optional[np.ndarray] = None,
                  resolution: int = 256, views: Sequence[Tuple[float, float]] = ((0.0, 15.0), (135.0, 25.0)),
                  background=(1.0, 1.0, 1.0), device: Optional[torch.device] = None, **kwargs) -> np.ndarray:
    """One uint8 strip: [input image with the mask tinted] | the object from each (yaw, pitch) view."""
    means, covs, colors, opacities = gaussian_render_inputs(gs, device)
    centre, extent = object_extent(means, opacities)
    fov = 40.0
    dist = _fit_radius(extent, fov)
    panels = []
    if image is not None:
        panels.append(mask_overlay(image, mask, resolution))
    for yaw, pitch in views:
        cam = orbit_camera(yaw, pitch, dist, fov, resolution, target=centre, up="z")
        panels.append(render_gaussians(means, covs, colors, opacities, cam, background=background,
                                       **kwargs).to_uint8())
    gap = np.full((resolution, 4, 3), 255, dtype=np.uint8)
    strip = []
    for i, p in enumerate(panels):
        strip += [gap, p] if i else [p]
    return np.concatenate(strip, axis=1)


def mask_overlay(image: np.ndarray, mask: Optional[np.ndarray], size: int) -> np.ndarray:
    """uint8 [size, size, 3]: the image letterboxed into a square, the masked object tinted red, the rest dimmed."""
    from PIL import Image
    img = np.asarray(image)[..., :3].astype(np.float32)
    if mask is not None:
        m = np.asarray(mask).astype(bool)[..., None]
        img = np.where(m, 0.6 * img + 0.4 * np.array([255.0, 64.0, 64.0]), 0.55 * img)
    pil = Image.fromarray(img.clip(0, 255).astype(np.uint8))
    scale = size / max(pil.width, pil.height)
    pil = pil.resize((max(1, round(pil.width * scale)), max(1, round(pil.height * scale))), Image.BILINEAR)
    canvas = Image.new("RGB", (size, size), (255, 255, 255))
    canvas.paste(pil, ((size - pil.width) // 2, (size - pil.height) // 2))
    return np.asarray(canvas)
