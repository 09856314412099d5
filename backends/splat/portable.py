"""Pure-PyTorch gaussian splat renderer (previews and turntables on any device; no gsplat, no CUDA).

Each 3D gaussian (mean, covariance) is moved into the camera frame and projected with the local affine
approximation of the pinhole projection (EWA splatting): its footprint is the 2D gaussian with covariance
``J W S W^T J^T + blur * I`` where ``W`` is the camera rotation and ``J`` the Jacobian of the projection at the
mean. Footprints are cut at ``extent_sigma`` standard deviations (Mahalanobis distance), so a gaussian has an
exact, finite support. Pixels are composited front to back in order of camera depth::

    alpha_i = min(alpha_max, opacity_i * exp(-q_i / 2))   (0 where alpha_i < alpha_min or q_i > extent_sigma^2)
    C = sum_i T_i alpha_i c_i + T_n * background,   T_i = prod_{j < i} (1 - alpha_j)

Work is split like a tile rasteriser: (tile, gaussian) pairs are listed for every screen tile that a footprint's
bounding box touches (the box shrunk to where the alpha can reach ``alpha_min``), sorted by tile and depth once
per frame, and all tiles are composited together in rounds: each round takes the next chunk of every unfinished
tile's depth-ordered list (chunks double from ``FIRST_CHUNK``; batches bounded by ``max_elements``), carrying the
transmittance; tiles whose gaussians are used up or whose pixels are all opaque drop out. Results do not depend
on the tile size or the batching. For float32 on CUDA, where triton imports, one Triton kernel
(``backends.splat.triton``) composites every tile in a single launch instead: the rounds' host syncs and work
tensors dominated a frame there.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Union

import torch

from . import slabs
from .tiles import box_pairs, screen_order, tile_boxes
from . import triton as triton_splat
from .camera import Camera

__all__ = ["RenderResult", "render_gaussians", "use_compositor", "COMPOSITORS", "project_gaussians", "covariance_from_scale_rotation",
           "quaternion_to_rotation_matrix", "SH_C0"]

SH_C0 = 0.28209479177387814  # degree-0 spherical harmonic: colour = 0.5 + SH_C0 * dc
MAX_CHUNK = 4096  # gaussians per tile composited at once: crowded tiles go in chunks and can stop early
FIRST_CHUNK = 32  # the first chunk of every tile; each later one doubles (most tiles turn opaque early)
# On accelerators every round costs a host sync (which tiles go on), so fewer, larger rounds pay: 1 M gaussians at
# 512^2 on an H100 took 16.9-19.2 ms with 32 and 14.8-15.7 ms with 128 (the image differs by < 1e-5, the
# min_transmittance bound of the early stop).
ACCELERATOR_FIRST_CHUNK = 128
# slabs: smaller work tensors than the rounds' stay in cache through the chunk's eight passes
SLABS_MAX_ELEMENTS = 1 << 20


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
    half_size: Optional[torch.Tensor] = None  # [N, 2] pixels, half sides of the footprint's bounding box


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


# (i, j) entries of the symmetric camera-frame covariance that the footprint needs, in the order of
# ``_camera_covariances``' columns
_PAIRS = ((0, 0), (0, 1), (0, 2), (1, 1), (1, 2), (2, 2))


def _camera_covariances(covariances: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """[N, 6] entries (00, 01, 02, 11, 12, 22) of R Sigma R^T: (R Sigma R^T)_ij = sum_kl R_ik R_jl Sigma_kl, one
    [N, 9] x [9, 6] product (the per-gaussian 3x3 products took ~6x longer on the CPU)."""
    weights = torch.stack([torch.outer(rot[i], rot[j]).reshape(9) for i, j in _PAIRS], dim=1)
    return covariances.reshape(-1, 9) @ weights


def project_gaussians(means: torch.Tensor, covariances: torch.Tensor, camera: Camera, blur: float = 0.3,
                      extent_sigma: float = 3.0, near: float = 1e-2) -> Projected:
    """Camera-space depth and the 2D footprint (mean, inverse covariance, bounding radius) of every gaussian.
    The footprint's covariance J (R Sigma R^T) J^T + blur I, with the projection's Jacobian at the mean
    J = [[fx / z, 0, -fx x / z^2], [0, fy / z, -fy y / z^2]], is written out per entry."""
    rot = camera.rotation.to(means)
    cam = torch.addmm(camera.translation.to(means), means, rot.T)
    x, y, z = cam.unbind(-1)
    valid = z > near
    zs = torch.where(valid, z, torch.ones_like(z))
    fx, fy = float(camera.fx), float(camera.fy)
    s00, s01, s02, s11, s12, s22 = _camera_covariances(covariances, rot).unbind(-1)
    inv_z = 1.0 / zs
    tx, ty = x * inv_z, y * inv_z
    inv_z2 = inv_z * inv_z
    a = (s00 - tx * (2 * s02 - tx * s22)) * (fx * fx) * inv_z2 + blur
    b = (s01 - tx * s12 - ty * (s02 - tx * s22)) * (fx * fy) * inv_z2
    c = (s11 - ty * (2 * s12 - ty * s22)) * (fy * fy) * inv_z2 + blur
    det = a * c - b * b
    valid = valid & (det > 1e-12)
    det = torch.where(valid, det, torch.ones_like(det))
    conics = torch.stack([c / det, -b / det, a / det], dim=-1)
    # bounding square of the ellipse q = extent^2: half-sides extent * sqrt(a), extent * sqrt(c)
    half_size = extent_sigma * torch.sqrt(torch.stack([a, c], dim=-1).clamp_min(0))
    radii = half_size.amax(dim=-1)
    means2d = torch.stack([fx * tx + camera.cx, fy * ty + camera.cy], dim=-1)
    return Projected(means2d, conics, z, radii, valid, half_size)


def _tile_pairs(proj: Projected, width: int, height: int, tile: int):
    """(tile id, gaussian id) for every tile touched by a footprint's bounding box, sorted by tile then
    front-to-back depth: gaussians are put in depth order once, their pairs listed in that order, and a stable
    sort on the (small, int32) tile id keeps the depth order inside each tile."""
    tiles_x, tiles_y = math.ceil(width / tile), math.ceil(height / tile)
    ids = screen_order(proj, width, height)
    if ids.numel() == 0:
        empty = torch.zeros(0, dtype=torch.long, device=ids.device)
        return empty, empty, tiles_x, tiles_y
    tile_id, slot = box_pairs(*tile_boxes(proj, ids, tile, tiles_x, tiles_y), tiles_x)
    tile_id, order = torch.sort(tile_id, stable=True)
    return tile_id.long(), ids.index_select(0, slot.index_select(0, order)), tiles_x, tiles_y


# per-gaussian table columns gathered once per chunk: one [B, L, 11] gather instead of one per attribute
_U, _V, _NA, _NB, _NC, _LOGOP, _CUT, _R, _G, _B_, _DEPTH = range(11)


def _gaussian_table(proj: Projected, colors, opacities, alpha_min, extent_sq):
    """[N + 1, 11] rows (u, v, -a/2, -b, -c/2, log opacity, log cut-off, r, g, b, depth); row N is a null
    gaussian (log opacity -inf) that padding points at. With e = -q/2 + log(opacity) the alpha is exp(e); it is
    cut (0) where e < log cut-off = max(log(opacity) - extent^2 / 2, log(alpha_min)), i.e. where q > extent^2
    or alpha < alpha_min."""
    dtype, device = colors.dtype, colors.device
    log_op = torch.log(opacities.clamp_min(0))
    log_min = math.log(alpha_min) if alpha_min > 0 else -math.inf
    cut = torch.clamp_min(log_op - extent_sq / 2, log_min)
    con = proj.conics
    table = torch.cat([proj.means2d, -0.5 * con[:, 0:1], -con[:, 1:2], -0.5 * con[:, 2:3], log_op[:, None],
                       cut[:, None], colors, proj.depths[:, None]], dim=1).to(dtype)
    null = torch.zeros(1, 11, dtype=dtype, device=device)
    null[0, _LOGOP] = -math.inf
    return torch.cat([table, null], dim=0)


def _composite_chunk(rows, px, py, alpha_max, transmittance):
    """Front-to-back compositing of one chunk. ``rows`` [B, L, 11] gaussians in depth order, ``px`` [B, 1, 1, T]
    and ``py`` [B, 1, T, 1] pixel centres of the B tiles, ``transmittance`` [B, P]. Returns (transmittance
    after the chunk [B, P], colour and depth added [B, P, 4]).

    The exponent is separable: -q/2 = -a dx^2 / 2 - c dy^2 / 2 - b dx dy, so the per-pixel work is one
    broadcast add, one multiply-add, exp and the cut; the weights T_{i-1} alpha_i are differences of the
    running transmittance T_{i-1} - T_i."""
    b, length = rows.shape[0], rows.shape[1]
    g = rows[..., None, None]  # [B, L, 11, 1, 1]
    dx = px - g[:, :, _U]  # [B, L, 1, T]
    dy = py - g[:, :, _V]  # [B, L, T, 1]
    ex = g[:, :, _NA] * dx * dx
    ey = g[:, :, _NC] * dy * dy + g[:, :, _LOGOP]
    e = torch.addcmul(ex + ey, g[:, :, _NB] * dy, dx).reshape(b, length, -1)  # [B, L, P]
    cut = e < rows[:, :, _CUT, None]
    alpha = e.exp_().clamp_(max=alpha_max).masked_fill_(cut, 0.0)
    keep = torch.cumprod(torch.sub(1.0, alpha, out=alpha), dim=1).mul_(transmittance[:, None, :])  # T_i
    weight = torch.empty_like(keep)  # T_{i-1} - T_i
    torch.sub(transmittance, keep[:, 0], out=weight[:, 0])
    torch.sub(keep[:, :-1], keep[:, 1:], out=weight[:, 1:])
    acc = torch.bmm(weight.transpose(1, 2), rows[:, :, _R:_DEPTH + 1])  # [B, P, 4]
    return keep[:, -1], acc


def _opacity_cut(proj: Projected, opacities: torch.Tensor, alpha_min: float, extent_sigma: float) -> Projected:
    """Shrink each footprint's box to where its alpha can reach ``alpha_min`` (q <= 2 log(opacity / alpha_min));
    gaussians that never reach it are dropped. Pure culling: the image does not change."""
    if alpha_min <= 0 or proj.half_size is None:
        return proj
    reach_sq = 2.0 * torch.log(opacities.clamp_min(1e-30) / alpha_min)
    scale = torch.sqrt(reach_sq.clamp(0, extent_sigma ** 2)) / extent_sigma
    half = proj.half_size * scale[:, None]
    return Projected(proj.means2d, proj.conics, proj.depths, half.amax(-1), proj.valid & (reach_sq >= 0), half)


def _tile_pixels(tile_ids, tiles_x: int, tile: int, dtype):
    """Pixel-centre coordinates of tiles: x [B, 1, 1, T] and y [B, 1, T, 1]."""
    offs = torch.arange(tile, device=tile_ids.device, dtype=dtype) + 0.5
    px = (tile_ids % tiles_x).to(dtype)[:, None] * tile + offs[None, :]
    py = (tile_ids // tiles_x).to(dtype)[:, None] * tile + offs[None, :]
    return px[:, None, None, :], py[:, None, :, None]


def _composite_lists(proj: Projected, colors, opacities, width: int, height: int, tile: int, alpha_min: float,
                     alpha_max: float, extent_sigma: float, min_transmittance: float, max_elements: int,
                     use_triton: bool):
    """The "rounds" and "triton" compositors: every tile's whole front-to-back list, sorted once per frame ->
    (transmittance [n_tiles, tile^2], weighted colour and depth [n_tiles, tile^2, 4])."""
    dtype, device = colors.dtype, colors.device
    tile_of_pair, gauss_of_pair, tiles_x, tiles_y = _tile_pairs(proj, width, height, tile)
    n_tiles, pix = tiles_x * tiles_y, tile * tile
    acc_img = torch.zeros(n_tiles, pix, 4, dtype=dtype, device=device)  # colour and depth, weighted
    trans_img = torch.ones(n_tiles, pix, dtype=dtype, device=device)
    if gauss_of_pair.numel() == 0:
        return trans_img, acc_img
    table = _gaussian_table(proj, colors, opacities, alpha_min, extent_sigma ** 2)
    counts = torch.bincount(tile_of_pair, minlength=n_tiles)
    starts = torch.cumsum(counts, 0) - counts
    if use_triton:
        # one launch walks every tile's list front to back with no host sync (the rounds sync every round);
        # same arithmetic, and it stops each tile as soon as it is opaque
        triton_splat.composite_tiles(table, gauss_of_pair, starts, counts, tiles_x, tile, width, height, alpha_max,
                                     min_transmittance, trans_img, acc_img)
        return trans_img, acc_img
    n = colors.shape[0]
    active = torch.nonzero(counts).squeeze(1)
    last = gauss_of_pair.numel() - 1
    cap = max(1, min(max_elements // pix, MAX_CHUNK))
    first = FIRST_CHUNK if device.type == "cpu" else ACCELERATOR_FIRST_CHUNK
    length, done = min(first, cap), 0
    # rounds: every unfinished tile composites its next ``length`` gaussians (batched under max_elements);
    # tiles that are exhausted or opaque drop out, so dense tiles stop after a few hundred gaussians
    while active.numel():
        batch = max(1, max_elements // (length * pix))
        pos = done + torch.arange(length, device=device)
        for s in range(0, active.numel(), batch):
            sel = active[s:s + batch]
            index = starts[sel][:, None] + pos[None, :]
            gid = torch.where(pos[None, :] < counts[sel][:, None], gauss_of_pair[index.clamp(max=last)],
                              torch.full_like(index, n))
            px, py = _tile_pixels(sel, tiles_x, tile, dtype)
            trans, acc = _composite_chunk(table[gid], px, py, alpha_max, trans_img[sel])
            trans_img[sel] = trans
            acc_img[sel] += acc
        done += length
        more = (counts[active] > done) & (trans_img[active].amax(dim=1) >= min_transmittance)
        active = active[more]
        length = min(2 * length, cap)
    return trans_img, acc_img


COMPOSITORS = ("slabs", "rounds", "triton")
_COMPOSITOR: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("splat_compositor", default=None)


@contextlib.contextmanager
def use_compositor(name: Optional[str]) -> Iterator[None]:
    """Renders inside the block composite with ``name`` (see :func:`render_gaussians`) unless a call names
    another; None restores the device default. For comparing compositors through callers that do not pass
    renderer options (``render_video``, the stand-ins)."""
    if name is not None and name not in COMPOSITORS:
        raise ValueError(f"unknown splat compositor {name!r}; expected one of {COMPOSITORS} (or None: the default)")
    token = _COMPOSITOR.set(name)
    try:
        yield
    finally:
        _COMPOSITOR.reset(token)


def _compositor_for(name: Optional[str], device: torch.device, dtype: torch.dtype) -> str:
    name = name or _COMPOSITOR.get()
    if name is None:
        if triton_splat.compositor(device, dtype) is not None:
            return "triton"
        return "slabs" if device.type == "cpu" else "rounds"
    if name not in COMPOSITORS:
        raise ValueError(f"unknown splat compositor {name!r}; expected one of {COMPOSITORS} (or None: the default)")
    if name == "triton" and triton_splat.compositor(device, dtype) is None:
        reason = triton_splat.unavailable_reason(device, dtype) or "it runs on CUDA tensors only"
        raise RuntimeError(f"the triton splat compositor cannot run here: {reason}; use 'slabs' or 'rounds'")
    return name


def render_gaussians(means: torch.Tensor, covariances: torch.Tensor, colors: torch.Tensor,
                     opacities: torch.Tensor, camera: Camera,
                     background: Union[Sequence[float], torch.Tensor] = (1.0, 1.0, 1.0), blur: float = 0.3,
                     extent_sigma: float = 3.0, alpha_min: float = 1.0 / 255.0, alpha_max: float = 0.99,
                     tile_size: int = 8, max_elements: Optional[int] = None,
                     min_transmittance: float = 1e-5, compositor: Optional[str] = None) -> RenderResult:
    """Render gaussians (means [N, 3], covariances [N, 3, 3], colours [N, 3] in [0, 1], opacities [N]) with
    ``camera``. Runs on the device of ``means``; float32 unless the inputs are float64.

    ``max_elements`` bounds one (tiles x gaussians x pixels) work tensor (default 1M with the slabs compositor,
    8M for CPU rounds, 32M on accelerators, where fewer, larger launches pay off). A tile stops compositing once
    all its pixels let less than ``min_transmittance`` through (what is behind changes them by less than that).
    ``compositor``: "slabs" (``backends.splat.slabs``; the CPU default), "rounds" (every tile's whole sorted list
    in rounds of growing chunks; the default on MPS and on CUDA without triton), "triton" (CUDA float32 default
    where triton imports); None takes :func:`use_compositor`'s choice, else the device's default."""
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
    method = _compositor_for(compositor, device, dtype)
    means, covariances, colors = means.to(dtype), covariances.to(dtype), colors.to(dtype)
    opacities = opacities.reshape(-1).to(dtype)
    width, height, tile = int(camera.width), int(camera.height), int(tile_size)
    proj = project_gaussians(means, covariances, camera, blur=blur, extent_sigma=extent_sigma)
    proj = _opacity_cut(proj, opacities, alpha_min, extent_sigma)
    tiles_x, tiles_y = math.ceil(width / tile), math.ceil(height / tile)
    if method == "slabs":
        trans_img, acc_img = slabs.composite_slabs(
            proj, colors, opacities, width, height, tile, alpha_min, alpha_max, extent_sigma, min_transmittance,
            max_elements or SLABS_MAX_ELEMENTS)
    else:
        if max_elements is None:
            max_elements = 1 << 23 if device.type == "cpu" else 1 << 25
        trans_img, acc_img = _composite_lists(proj, colors, opacities, width, height, tile, alpha_min, alpha_max,
                                              extent_sigma, min_transmittance, max_elements, method == "triton")

    bg = torch.as_tensor(background, dtype=dtype, device=device).reshape(1, 1, 3)
    color = acc_img[..., :3] + trans_img[..., None] * bg
    depth_img = acc_img[..., 3]
    untile = lambda img: (img.reshape(tiles_y, tiles_x, tile, tile, *img.shape[2:])  # noqa: E731
                          .transpose(1, 2).reshape(tiles_y * tile, tiles_x * tile, *img.shape[2:])[:height, :width])
    alpha = 1.0 - untile(trans_img)
    depth = untile(depth_img)
    depth = torch.where(alpha > 0, depth / alpha.clamp_min(1e-12), torch.zeros_like(depth))
    return RenderResult(untile(color), alpha, depth)
