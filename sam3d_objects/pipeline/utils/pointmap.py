"""Upstream's ``pipeline.utils.pointmap``: pinhole intrinsics (and depth) recovered from a camera-frame point map."""
from __future__ import annotations

import math
from typing import Dict, Optional, Union

import torch

from sam3d_objects.utils.focal import recover_focal_shift

__all__ = ["infer_intrinsics_from_pointmap"]


def _focal_for_fov(fov_x_deg: float, aspect: float) -> float:
    """Focal relative to the half diagonal for a horizontal field of view (MoGe's convention)."""
    return (aspect / math.sqrt(1 + aspect ** 2)) / math.tan(math.radians(fov_x_deg) / 2)


def infer_intrinsics_from_pointmap(points: torch.Tensor, mask: Optional[torch.Tensor] = None,
                                   fov_x: Optional[float] = None, mask_threshold: float = 0.5,
                                   force_projection: bool = False, apply_mask: bool = False,
                                   device: Optional[Union[str, torch.device]] = None) -> Dict[str, torch.Tensor]:
    """{"points", "intrinsics" (normalised, cx = cy = 0.5), "depth", "mask"} of a point map [H, W, 3] or
    [B, H, W, 3] (NaN / inf = invalid). Valid pixels: finite, and ``mask > mask_threshold`` when a mask is given.

    Parity note (as upstream): without ``fov_x`` the solver's (focal, shift) pair is read in swapped order, so
    the "focal" used is the fitted z shift and the points are shifted by the fitted focal. With ``fov_x`` (degrees)
    the focal follows from the field of view and the shift is fitted for it.
    ``force_projection`` re-projects the points from the shifted depth; ``apply_mask`` sets invalid points and
    depths to +inf. Runs in float32 on ``device`` (default: the points' device)."""
    device = torch.device(device) if device is not None else points.device
    batched = points.dim() == 4
    pts = (points if batched else points[None]).to(device=device, dtype=torch.float32)
    masks = None if mask is None else (mask if batched else mask[None]).to(device)
    height, width = pts.shape[1:3]
    aspect = width / height
    out = {"points": [], "intrinsics": [], "depth": [], "mask": []}
    for b in range(pts.shape[0]):
        p = pts[b]
        valid = torch.isfinite(p).all(dim=-1)
        if masks is not None:
            valid = valid & (masks[b].float() > mask_threshold)
        fitted_focal, fitted_shift = recover_focal_shift(p, valid)
        if fov_x is None:
            focal, shift = fitted_shift, fitted_focal  # upstream's swapped reading, see the docstring
        else:
            focal = _focal_for_fov(float(fov_x), aspect)
            shift = _shift_for_focal(p, valid, focal)
        fx = focal / 2 * math.sqrt(1 + aspect ** 2) / aspect
        fy = focal / 2 * math.sqrt(1 + aspect ** 2)
        k = torch.tensor([[fx, 0.0, 0.5], [0.0, fy, 0.5], [0.0, 0.0, 1.0]], dtype=torch.float32, device=device)
        depth = p[..., 2] + shift
        if force_projection:
            p = _depth_to_points(depth, k)
        else:
            p = p + torch.tensor([0.0, 0.0, shift], dtype=torch.float32, device=device)
        if apply_mask:
            p = torch.where(valid[..., None], p, torch.full_like(p, float("inf")))
            depth = torch.where(valid, depth, torch.full_like(depth, float("inf")))
        for key, value in (("points", p), ("intrinsics", k), ("depth", depth), ("mask", valid)):
            out[key].append(value)
    stacked = {k: torch.stack(v) for k, v in out.items()}
    return stacked if batched else {k: v[0] for k, v in stacked.items()}


def _shift_for_focal(points: torch.Tensor, valid: torch.Tensor, focal: float) -> float:
    """z shift minimising |focal * xy / (z + shift) - uv| for a known focal (1-D least squares)."""
    import numpy as np

    from sam3d_objects.utils.focal import normalized_view_plane_uv
    uv = normalized_view_plane_uv(points.shape[1], points.shape[0]).to(points.device)
    xy, z, uv = points[valid][:, :2].double().cpu(), points[valid][:, 2].double().cpu(), uv[valid].double().cpu()
    if z.numel() < 1:
        return 0.0

    def residual(shift):
        return (focal * xy / (z + float(np.ravel(shift)[0]))[:, None] - uv).reshape(-1).numpy()

    from scipy.optimize import least_squares
    return float(np.float32(least_squares(residual, x0=0.0, ftol=1e-3, method="lm").x[0]))


def _depth_to_points(depth: torch.Tensor, intrinsics: torch.Tensor) -> torch.Tensor:
    """Camera-frame points [H, W, 3] of a depth map seen with normalised intrinsics (pixel centres)."""
    height, width = depth.shape
    v, u = torch.meshgrid((torch.arange(height, device=depth.device, dtype=depth.dtype) + 0.5) / height,
                          (torch.arange(width, device=depth.device, dtype=depth.dtype) + 0.5) / width, indexing="ij")
    x = (u - intrinsics[0, 2]) / intrinsics[0, 0] * depth
    y = (v - intrinsics[1, 2]) / intrinsics[1, 1] * depth
    return torch.stack([x, y, depth], dim=-1)
