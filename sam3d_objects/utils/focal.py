"""Camera intrinsics from a point map (focal/shift fit of a pinhole camera, MoGe's formulation).

The fit: on a nearest-downsampled 64x64 grid of valid points, find the z shift minimising
|f * xy / (z + shift) - uv| where uv is the normalised view-plane coordinate (corners at +-W/diag, +-H/diag,
pixel centres) and f is the optimal focal for that shift in closed form; Levenberg-Marquardt from shift = 0
(scipy ``least_squares``, ftol 1e-3), as MoGe does.
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F


def normalized_view_plane_uv(width: int, height: int, dtype=torch.float32) -> torch.Tensor:
    """[H, W, 2] view-plane coordinates, left-top (-W/diag, -H/diag) .. right-bottom (W/diag, H/diag)."""
    aspect = width / height
    span_x = aspect / (1 + aspect ** 2) ** 0.5
    span_y = 1 / (1 + aspect ** 2) ** 0.5
    u = torch.linspace(-span_x * (width - 1) / width, span_x * (width - 1) / width, width, dtype=dtype)
    v = torch.linspace(-span_y * (height - 1) / height, span_y * (height - 1) / height, height, dtype=dtype)
    uu, vv = torch.meshgrid(u, v, indexing="xy")
    return torch.stack([uu, vv], dim=-1)


def _optimal_focal(uv: np.ndarray, xy: np.ndarray, z: np.ndarray, shift) -> Tuple[np.ndarray, np.ndarray]:
    proj = xy / (z + shift)[:, None]
    focal = (proj * uv).sum() / np.square(proj).sum()
    return focal, proj


def _solve_shift(uv: np.ndarray, xy: np.ndarray, z: np.ndarray) -> float:
    def residual(shift):
        focal, proj = _optimal_focal(uv, xy, z, shift)
        return (focal * proj - uv).ravel()

    try:
        from scipy.optimize import least_squares
    except ImportError:  # plain Gauss-Newton with a numeric derivative
        shift = 0.0
        for _ in range(50):
            r = residual(np.float32(shift))
            eps = 1e-4 * max(1.0, abs(shift))
            j = (residual(np.float32(shift + eps)) - r) / eps
            step = -(j @ r) / max(j @ j, 1e-20)
            shift += step
            if abs(step) < 1e-7 * max(1.0, abs(shift)):
                break
        return float(np.float32(shift))
    solution = least_squares(residual, x0=0, ftol=1e-3, method="lm")
    return float(solution["x"].squeeze().astype(np.float32))


def recover_focal_shift(points: torch.Tensor, mask: Optional[torch.Tensor] = None,
                        downsample_size: Tuple[int, int] = (64, 64)) -> Tuple[float, float]:
    """(focal relative to the half diagonal, z shift) of a point map [H, W, 3]; (1, 0) with < 2 valid points."""
    height, width = points.shape[:2]
    points = points.detach().float().cpu()
    uv = normalized_view_plane_uv(width, height)
    pts_lr = F.interpolate(points.permute(2, 0, 1)[None], downsample_size, mode="nearest")[0].permute(1, 2, 0)
    uv_lr = F.interpolate(uv.permute(2, 0, 1)[None], downsample_size, mode="nearest")[0].permute(1, 2, 0)
    if mask is not None:
        mask_lr = F.interpolate(mask.float().cpu()[None, None], downsample_size, mode="nearest")[0, 0] > 0
        pts_lr, uv_lr = pts_lr[mask_lr], uv_lr[mask_lr]
    pts_np, uv_np = pts_lr.reshape(-1, 3).numpy(), uv_lr.reshape(-1, 2).numpy()
    if uv_np.shape[0] < 2:
        return 1.0, 0.0
    shift = _solve_shift(uv_np, pts_np[:, :2], pts_np[:, 2])
    focal, _ = _optimal_focal(uv_np, pts_np[:, :2], pts_np[:, 2], np.float32(shift))
    return float(focal), shift


def intrinsics_from_focal_center(fx, fy, cx, cy, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor([[fx, 0.0, cx], [0.0, fy, cy], [0.0, 0.0, 1.0]], dtype=dtype)


def infer_intrinsics_from_pointmap(points: torch.Tensor) -> torch.Tensor:
    """Normalised intrinsics [3, 3] (cx = cy = 0.5) inferred from a point map [H, W, 3] (NaN = invalid).

    Parity note: upstream reads the solver's two results in swapped order, so the value it uses as the focal
    is the fitted z *shift* (about 0 for a point map that already is a pinhole projection). We reproduce that,
    because the golden data record it; the intrinsics are not used downstream unless layout post-optimisation runs.
    """
    height, width = points.shape[:2]
    valid = torch.isfinite(points).all(dim=-1)
    _focal, shift = recover_focal_shift(points, valid)
    aspect = width / height
    used = shift  # see parity note
    fx = used / 2 * (1 + aspect ** 2) ** 0.5 / aspect
    fy = used / 2 * (1 + aspect ** 2) ** 0.5
    return intrinsics_from_focal_center(fx, fy, 0.5, 0.5)
