"""Pure-PyTorch gaussian splat renderer (previews and turntables on any device; no gsplat, no CUDA).

Each 3D gaussian (mean, covariance) is moved into the camera frame and projected with the local affine
approximation of the pinhole projection (EWA splatting): its footprint is the 2D gaussian with covariance
``J W S W^T J^T + blur * I`` where ``W`` is the camera rotation and ``J`` the Jacobian of the projection at the
mean. Footprints are cut at ``extent_sigma`` standard deviations (Mahalanobis distance), so a gaussian has an
exact, finite support. Pixels are composited front to back in order of camera depth::

    alpha_i = min(alpha_max, opacity_i * exp(-q_i / 2))   (0 where alpha_i < alpha_min or q_i > extent_sigma^2)
    C = sum_i T_i alpha_i c_i + T_n * background,   T_i = prod_{j < i} (1 - alpha_j)

Work is split like a tile rasteriser: (tile, gaussian) pairs are listed for every screen tile that a footprint's
bounding box touches, sorted by tile and depth, and tiles are evaluated in padded batches whose size is bounded
by ``max_elements`` (and, for crowded tiles, in chunks along the depth order, carrying the transmittance).
Results do not depend on the tile size or the batching.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from .camera import Camera

__all__ = ["RenderResult", "render_gaussians", "project_gaussians", "covariance_from_scale_rotation",
           "quaternion_to_rotation_matrix", "SH_C0"]

SH_C0 = 0.28209479177387814  # degree-0 spherical harmonic: colour = 0.5 + SH_C0 * dc
MAX_CHUNK = 4096  # gaussians per tile composited at once: crowded tiles go in chunks and can stop early


@dataclass
class RenderResult:
    color: torch.Tensor  # [H, W, 3] float in [0, 1] (composited over the background)
    alpha: torch.Tensor  # [H, W] accumulated opacity 1 - T_n
    depth: torch.Tensor  # [H, W] alpha-weighted mean camera depth (0 where alpha is 0)

    def to_uint8(self):
        """[H, W, 3] uint8 numpy image."""
        return (self.color.clamp(0, 1) * 255.0 + 0.5).to(torch.uint8).cpu().numpy()


@dataclass
class Projected:
    means2d: torch.Tensor  # [N, 2] pixels
    conics: torch.Tensor  # [N, 3] (a, b, c) of the inverse 2D covariance [[a, b], [b, c]]
    depths: torch.Tensor  # [N]
    radii: torch.Tensor  # [N] pixels, half side of the footprint's bounding square
    valid: torch.Tensor  # [N] bool: in front of the near plane with a proper footprint


def quaternion_to_rotation_matrix(q: torch.Tensor) -> torch.Tensor:
    """Unit quaternions [N, 4] (w, x, y, z; normalised here) -> rotation matrices [N, 3, 3]."""
    q = torch.nn.functional.normalize(q, dim=-1)
    w, x, y, z = q.unbind(-1)
    return torch.stack([
        1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y),
        2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x),
        2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y),
    ], dim=-1).reshape(q.shape[:-1] + (3, 3))


def covariance_from_scale_rotation(scales: torch.Tensor, quaternions: torch.Tensor) -> torch.Tensor:
    """Sigma = R diag(s)^2 R^T for per-axis standard deviations [N, 3] and quaternions [N, 4] (w, x, y, z)."""
    rs = quaternion_to_rotation_matrix(quaternions) * scales[:, None, :]
    return rs @ rs.transpose(1, 2)


def project_gaussians(means: torch.Tensor, covariances: torch.Tensor, camera: Camera, blur: float = 0.3,
                      extent_sigma: float = 3.0, near: float = 1e-2) -> Projected:
    """Camera-space depth and the 2D footprint (mean, inverse covariance, bounding radius) of every gaussian."""
    rot = camera.rotation.to(means)
    cam = means @ rot.T + camera.translation.to(means)
    x, y, z = cam.unbind(-1)
    valid = z > near
    zs = torch.where(valid, z, torch.ones_like(z))
    fx, fy = float(camera.fx), float(camera.fy)
    zero = torch.zeros_like(zs)
    jac = torch.stack([fx / zs, zero, -fx * x / zs ** 2,
                       zero, fy / zs, -fy * y / zs ** 2], dim=-1).reshape(-1, 2, 3)
    jw = jac @ rot
    cov2d = jw @ covariances @ jw.transpose(1, 2)
    a = cov2d[:, 0, 0] + blur
    b = cov2d[:, 0, 1]
    c = cov2d[:, 1, 1] + blur
    det = a * c - b * b
    valid = valid & (det > 1e-12)
    det = torch.where(valid, det, torch.ones_like(det))
    conics = torch.stack([c / det, -b / det, a / det], dim=-1)
    # bounding square of the ellipse q = extent^2: half-sides extent * sqrt(a), extent * sqrt(c)
    radii = extent_sigma * torch.sqrt(torch.maximum(a, c).clamp_min(0))
    means2d = torch.stack([fx * x / zs + camera.cx, fy * y / zs + camera.cy], dim=-1)
    return Projected(means2d, conics, z, radii, valid)


def _tile_pairs(proj: Projected, width: int, height: int, tile: int):
    """(tile id, gaussian id) for every tile touched by a footprint, sorted by tile then front-to-back depth."""
    tiles_x, tiles_y = math.ceil(width / tile), math.ceil(height / tile)
    u, v = proj.means2d.unbind(-1)
    r = proj.radii
    x0 = torch.floor((u - r) / tile).clamp(0, tiles_x - 1)
    x1 = torch.floor((u + r) / tile).clamp(0, tiles_x - 1)
    y0 = torch.floor((v - r) / tile).clamp(0, tiles_y - 1)
    y1 = torch.floor((v + r) / tile).clamp(0, tiles_y - 1)
    on_screen = proj.valid & (u + r >= 0) & (u - r < width) & (v + r >= 0) & (v - r < height)
    ids = torch.nonzero(on_screen).squeeze(1)
    if ids.numel() == 0:
        empty = torch.zeros(0, dtype=torch.long, device=u.device)
        return empty, empty, tiles_x, tiles_y
    x0, x1, y0, y1 = (t[ids].long() for t in (x0, x1, y0, y1))
    span_x = x1 - x0 + 1
    counts = span_x * (y1 - y0 + 1)
    gauss = torch.repeat_interleave(ids, counts)
    first = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    local = torch.arange(gauss.numel(), device=u.device) - first
    sx = torch.repeat_interleave(span_x, counts)
    tx = torch.repeat_interleave(x0, counts) + local % sx
    ty = torch.repeat_interleave(y0, counts) + local // sx
    tile_id = ty * tiles_x + tx
    depth_rank = torch.empty_like(proj.depths, dtype=torch.long)
    depth_rank[torch.argsort(proj.depths, stable=True)] = torch.arange(proj.depths.numel(), device=u.device)
    order = torch.argsort(tile_id * proj.depths.numel() + depth_rank[gauss])
    return tile_id[order], gauss[order], tiles_x, tiles_y


def _composite_batch(tile_ids, index, proj: Projected, colors, opacities, tiles_x, tile, chunk, alpha_min,
                     alpha_max, extent_sq, min_transmittance, transmittance, color_acc, depth_acc):
    """Front-to-back compositing of a padded batch: ``index`` [B, L] gaussian ids (-1 = padding). Stops early
    once every pixel of the batch is opaque (transmittance below ``min_transmittance``)."""
    device = colors.device
    offs = torch.arange(tile, device=device, dtype=colors.dtype) + 0.5
    px = (tile_ids % tiles_x).to(colors.dtype)[:, None] * tile + offs[None, :]  # [B, tile]
    py = (tile_ids // tiles_x).to(colors.dtype)[:, None] * tile + offs[None, :]
    pix_x = px[:, None, :].expand(-1, tile, -1).reshape(len(tile_ids), 1, -1)  # [B, 1, P] row-major in the tile
    pix_y = py[:, :, None].expand(-1, -1, tile).reshape(len(tile_ids), 1, -1)
    for start in range(0, index.shape[1], chunk):
        idx = index[:, start:start + chunk]
        pad = idx < 0
        safe = idx.clamp_min(0)
        mu = proj.means2d[safe]  # [B, L, 2]
        con = proj.conics[safe]
        dx = pix_x - mu[..., 0:1]
        dy = pix_y - mu[..., 1:2]
        q = con[..., 0:1] * dx * dx + 2 * con[..., 1:2] * dx * dy + con[..., 2:3] * dy * dy
        alpha = (opacities[safe][..., None] * torch.exp(-0.5 * q)).clamp(max=alpha_max)
        alpha = torch.where((q > extent_sq) | (alpha < alpha_min) | pad[..., None], torch.zeros_like(alpha), alpha)
        keep = torch.cumprod(1.0 - alpha, dim=1)  # [B, L, P] transmittance after each gaussian
        before = torch.cat([torch.ones_like(keep[:, :1]), keep[:, :-1]], dim=1) * transmittance[:, None, :]
        weight = before * alpha
        color_acc += torch.einsum("blp,blc->bpc", weight, colors[safe])
        depth_acc += torch.einsum("blp,bl->bp", weight, proj.depths[safe])
        transmittance = transmittance * keep[:, -1]
        if start + chunk < index.shape[1] and float(transmittance.max()) < min_transmittance:
            break
    return transmittance, color_acc, depth_acc


def render_gaussians(means: torch.Tensor, covariances: torch.Tensor, colors: torch.Tensor,
                     opacities: torch.Tensor, camera: Camera,
                     background: Union[Sequence[float], torch.Tensor] = (1.0, 1.0, 1.0), blur: float = 0.3,
                     extent_sigma: float = 3.0, alpha_min: float = 1.0 / 255.0, alpha_max: float = 0.99,
                     tile_size: int = 16, max_elements: Optional[int] = None,
                     min_transmittance: float = 1e-5) -> RenderResult:
    """Render gaussians (means [N, 3], covariances [N, 3, 3], colours [N, 3] in [0, 1], opacities [N]) with
    ``camera``. Runs on the device of ``means``; float32 unless the inputs are float64.

    ``max_elements`` bounds one (tiles x gaussians x pixels) work tensor (default 4M on the CPU, 32M on
    accelerators, where fewer, larger launches pay off). A tile stops compositing once all its pixels let
    less than ``min_transmittance`` through (what is behind changes them by less than that)."""
    if means.dim() != 2 or means.shape[-1] != 3:
        raise ValueError(f"means must be [N, 3], got {tuple(means.shape)}")
    n = means.shape[0]
    if covariances.shape != (n, 3, 3) or colors.shape != (n, 3) or opacities.reshape(-1).shape != (n,):
        raise ValueError(f"expected covariances [N, 3, 3], colors [N, 3], opacities [N] for N = {n}; got "
                         f"{tuple(covariances.shape)}, {tuple(colors.shape)}, {tuple(opacities.shape)}")
    if tile_size < 1:
        raise ValueError("tile_size must be >= 1")
    dtype = means.dtype if means.dtype == torch.float64 else torch.float32
    device = means.device
    if max_elements is None:
        max_elements = 1 << 22 if device.type == "cpu" else 1 << 25
    means, covariances, colors = means.to(dtype), covariances.to(dtype), colors.to(dtype)
    opacities = opacities.reshape(-1).to(dtype)
    width, height, tile = int(camera.width), int(camera.height), int(tile_size)
    proj = project_gaussians(means, covariances, camera, blur=blur, extent_sigma=extent_sigma)
    tile_of_pair, gauss_of_pair, tiles_x, tiles_y = _tile_pairs(proj, width, height, tile)

    n_tiles, pix = tiles_x * tiles_y, tile * tile
    color_img = torch.zeros(n_tiles, pix, 3, dtype=dtype, device=device)
    depth_img = torch.zeros(n_tiles, pix, dtype=dtype, device=device)
    trans_img = torch.ones(n_tiles, pix, dtype=dtype, device=device)
    if gauss_of_pair.numel():
        counts = torch.bincount(tile_of_pair, minlength=n_tiles)
        starts = torch.cumsum(counts, 0) - counts
        busy = torch.nonzero(counts).squeeze(1)
        busy = busy[torch.argsort(counts[busy], descending=True)]  # similar lengths share a batch: little padding
        busy_counts = counts[busy].tolist()
        i = 0
        while i < len(busy):
            longest = busy_counts[i]
            chunk = max(1, min(longest, max_elements // pix, MAX_CHUNK))
            batch = max(1, max_elements // (chunk * pix))
            sel = busy[i:i + batch]
            lengths = counts[sel]
            pos = torch.arange(longest, device=device)
            index = starts[sel][:, None] + pos[None, :]
            index = torch.where(pos[None, :] < lengths[:, None], gauss_of_pair[index.clamp(max=len(gauss_of_pair) - 1)],
                                torch.full_like(index, -1))
            t, c, d = _composite_batch(sel, index, proj, colors, opacities, tiles_x, tile, chunk, alpha_min,
                                       alpha_max, extent_sigma ** 2, min_transmittance, trans_img[sel],
                                       color_img[sel], depth_img[sel])
            trans_img[sel], color_img[sel], depth_img[sel] = t, c, d
            i += len(sel)

    bg = torch.as_tensor(background, dtype=dtype, device=device).reshape(1, 1, 3)
    color = color_img + trans_img[..., None] * bg
    untile = lambda img: (img.reshape(tiles_y, tiles_x, tile, tile, *img.shape[2:])  # noqa: E731
                          .transpose(1, 2).reshape(tiles_y * tile, tiles_x * tile, *img.shape[2:])[:height, :width])
    alpha = 1.0 - untile(trans_img)
    depth = untile(depth_img)
    depth = torch.where(alpha > 0, depth / alpha.clamp_min(1e-12), torch.zeros_like(depth))
    return RenderResult(untile(color), alpha, depth)
