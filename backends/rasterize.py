"""Pure-PyTorch triangle rasteriser with nvdiffrast's conventions, on any device PyTorch runs on.

Public API::

    rast = rasterize(verts_clip, faces, (H, W))        # [B, H, W, 4] = (u, v, z/w, triangle_id + 1)
    out = interpolate(attr, rast, faces)               # [B, H, W, C]
    img = texture(tex, uv, boundary_mode="wrap")        # bilinear lookup, texel centres at (i + 0.5) / size
    img = antialias_free_mask(rast)                    # float coverage mask [B, H, W, 1]

Conventions (as nvdiffrast's, so code written for it ports unchanged):
- ``verts_clip`` are OpenGL clip-space positions (x, y, z, w); the visible volume is -w <= x, y, z <= w.
- Pixel (row i, column j) samples NDC (2 (j + 0.5) / W - 1, 2 (i + 0.5) / H - 1): row 0 is the *bottom* (y = -1).
- ``u``/``v`` are the perspective-correct barycentric weights of the triangle's first and second vertex
  (``faces[:, 0]`` and ``faces[:, 1]``); the third vertex gets ``1 - u - v``.
- ``z/w`` is NDC depth; the depth test keeps the smallest. Empty pixels are all zero.
- Both windings are drawn (no back-face culling); pixels whose depth leaves [-1, 1] are clipped (near/far).

Method: homogeneous 2D rasterisation (edge functions of the 3x3 matrix of the vertices' (x, y, w)), which handles
vertices behind the camera without polygon clipping. Triangles are binned by their screen bounding box and
processed in chunks of at most ``max_pairs`` (triangle, pixel) candidates, so memory stays bounded whatever the
mesh and resolution. The winner per pixel is found with one scatter-min over a packed (depth, id) int64 key; the
output barycentrics are then recomputed for the winners only, differentiably with respect to ``verts_clip``.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

__all__ = ["rasterize", "interpolate", "texture", "antialias_free_mask", "DEFAULT_MAX_PAIRS"]

# (triangle, pixel) candidates evaluated at once; ~40 bytes each in flight, so ~200 MB per chunk at this size.
DEFAULT_MAX_PAIRS = 1 << 22
_EDGE_TOL = 1e-6


def _as_batched(t: torch.Tensor, rank: int, name: str) -> torch.Tensor:
    if t.dim() == rank - 1:
        return t.unsqueeze(0)
    if t.dim() != rank:
        raise ValueError(f"{name} must have {rank - 1} or {rank} dimensions, got shape {tuple(t.shape)}")
    return t


def _edge_coefficients(tri: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-triangle linear functions of the pixel's NDC (x, y, 1).

    tri: [F, 3, 4] clip-space vertices. Returns ``edges`` [F, 3, 3] (rows of adj(M) for M = [x; y; w] columns
    per vertex, so k = edges @ (x, y, 1) are unnormalised barycentrics), ``depth`` [F, 3] (z/w = depth @ (x, y, 1))
    and ``det`` [F] (det M; its sign is the winding, 0 for triangles seen edge-on).
    """
    x, y, z, w = tri.unbind(-1)  # each [F, 3]
    x0, x1, x2 = x.unbind(-1)
    y0, y1, y2 = y.unbind(-1)
    w0, w1, w2 = w.unbind(-1)
    # adj(M) rows: the cofactors of M = [[x0, x1, x2], [y0, y1, y2], [w0, w1, w2]].
    row0 = torch.stack([y1 * w2 - y2 * w1, x2 * w1 - x1 * w2, x1 * y2 - x2 * y1], -1)
    row1 = torch.stack([y2 * w0 - y0 * w2, x0 * w2 - x2 * w0, x2 * y0 - x0 * y2], -1)
    row2 = torch.stack([y0 * w1 - y1 * w0, x1 * w0 - x0 * w1, x0 * y1 - x1 * y0], -1)
    edges = torch.stack([row0, row1, row2], 1)  # [F, 3, 3]
    det = (edges[:, :, 2] * w).sum(-1)  # sum_i k_i w_i = det M (independent of the pixel)
    safe = torch.where(det == 0, torch.ones_like(det), det)
    # z/w at the pixel = sum_i k_i z_i / det: linear in screen space.
    depth = (edges * z.unsqueeze(-1)).sum(1) / safe.unsqueeze(-1)
    return edges, depth, det


def _pixel_bounds(tri: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Inclusive pixel bounding boxes [F, 4] = (col0, col1, row0, row1); empty boxes have col0 > col1."""
    w = tri[..., 3]
    front = (w > 0).all(-1)
    safe_w = torch.where(w > 0, w, torch.ones_like(w))
    ndc = tri[..., :2] / safe_w.unsqueeze(-1)
    lo = ndc.amin(1)
    hi = ndc.amax(1)
    # A triangle crossing w = 0 projects to an unbounded region: be conservative and take the whole screen.
    lo = torch.where(front.unsqueeze(-1), lo, torch.full_like(lo, -1.0))
    hi = torch.where(front.unsqueeze(-1), hi, torch.full_like(hi, 1.0))
    size = torch.tensor([width, height], device=tri.device, dtype=tri.dtype)
    first = torch.ceil((lo + 1) * size / 2 - 0.5).clamp(min=0)
    last = torch.floor((hi + 1) * size / 2 - 0.5)
    last = torch.minimum(last, size - 1)
    # Frustum culling: all three vertices beyond the same clip plane.
    xyz = tri[..., :3]
    outside = ((xyz > w.unsqueeze(-1)).all(1) | (xyz < -w.unsqueeze(-1)).all(1)).any(-1) | (w <= 0).all(-1)
    first = torch.where(outside.unsqueeze(-1), torch.ones_like(first), first)
    last = torch.where(outside.unsqueeze(-1), torch.zeros_like(last), last)
    return torch.stack([first[:, 0], last[:, 0], first[:, 1], last[:, 1]], -1).long()


def _depth_key(depth: torch.Tensor, tri_id: torch.Tensor) -> torch.Tensor:
    """Pack (depth in [-1, 1], triangle id) into an int64 whose minimum is the nearest triangle (ties: lowest id)."""
    unit = ((depth.float() + 1) * 0.5).clamp(0, 1)
    # Non-negative float32 bit patterns order like the floats themselves.
    bits = unit.view(torch.int32).long()
    return (bits << 32) | tri_id


def _raster_one(tri: torch.Tensor, height: int, width: int, max_pairs: int) -> torch.Tensor:
    """Winning triangle index per pixel ([H * W] int64, -1 where empty) for one view."""
    device = tri.device
    n_pix = height * width
    sentinel = torch.iinfo(torch.int64).max
    best = torch.full((n_pix,), sentinel, dtype=torch.int64, device=device)
    with torch.no_grad():
        edges, depth, det = _edge_coefficients(tri.double() if tri.device.type != "mps" else tri.float())
        # Scaling a row by a positive factor keeps the inside test; unit rows make _EDGE_TOL a distance in NDC.
        sign = torch.sign(det)
        edges = edges * (sign.view(-1, 1, 1) / edges.abs().amax(-1, keepdim=True).clamp(min=1e-30))
        edges, depth, sign = edges.float(), depth.float(), sign.float()
        bounds = _pixel_bounds(tri.float(), height, width)
        bw = (bounds[:, 1] - bounds[:, 0] + 1).clamp(min=0)
        bh = (bounds[:, 3] - bounds[:, 2] + 1).clamp(min=0)
        counts = torch.where(det != 0, bw * bh, torch.zeros_like(bw))
        live = torch.nonzero(counts > 0).squeeze(1)
        if live.numel() == 0:
            return best.fill_(-1)
        for chunk in _chunks(counts[live], max_pairs):
            ids = live[chunk]
            _raster_chunk(ids, counts[ids], bounds, bw, edges, depth, width, height, best)
    best = torch.where(best == sentinel, torch.full_like(best, -1), best & 0xFFFFFFFF)
    return best


def _chunks(counts: torch.Tensor, max_pairs: int) -> list[slice]:
    """Consecutive slices of ``counts`` whose sums stay within ``max_pairs`` (a bigger single entry stands alone)."""
    ends = torch.cumsum(counts, 0).cpu()
    total = len(ends)
    slices, a, done = [], 0, 0
    while a < total:
        b = int(torch.searchsorted(ends, done + max_pairs, right=True))
        b = max(b, a + 1)
        slices.append(slice(a, b))
        done = int(ends[b - 1])
        a = b
    return slices


def _raster_chunk(ids: torch.Tensor, counts: torch.Tensor, bounds: torch.Tensor, bw: torch.Tensor,
                  edges: torch.Tensor, depth: torch.Tensor, width: int, height: int,
                  best: torch.Tensor) -> None:
    device = ids.device
    pair_tri = torch.repeat_interleave(ids, counts)
    offsets = torch.cumsum(counts, 0) - counts
    local = torch.arange(pair_tri.numel(), device=device) - torch.repeat_interleave(offsets, counts)
    box_w = bw[pair_tri]
    col = bounds[pair_tri, 0] + local % box_w
    row = bounds[pair_tri, 2] + torch.div(local, box_w, rounding_mode="floor")
    px = (2 * col.float() + 1) / width - 1
    py = (2 * row.float() + 1) / height - 1
    e = edges[pair_tri]  # [P, 3, 3]
    k = e[..., 0] * px.unsqueeze(-1) + e[..., 1] * py.unsqueeze(-1) + e[..., 2]
    d = depth[pair_tri]
    z = d[:, 0] * px + d[:, 1] * py + d[:, 2]
    # Edges are already oriented by the winding; the small tolerance keeps shared edges crack-free in float32
    # (a pixel centre on an edge may then be claimed by both neighbours; the depth test picks one).
    inside = (k >= -_EDGE_TOL).all(-1) & (k.sum(-1) > 0) & (z >= -1) & (z <= 1)
    if not bool(inside.any()):
        return
    pix = (row * width + col)[inside]
    key = _depth_key(z[inside], pair_tri[inside])
    best.scatter_reduce_(0, pix, key, reduce="amin")


def _barycentrics(tri: torch.Tensor, face_idx: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(u, v, z/w) for the winning triangles ([H*W] indices, -1 empty), differentiable in ``tri``."""
    n_pix = height * width
    device = tri.device
    hit = face_idx >= 0
    out = torch.zeros(n_pix, 3, dtype=torch.float32, device=device)
    if not bool(hit.any()):
        return out
    pix = torch.nonzero(hit).squeeze(1)
    fid = face_idx[pix]
    col = pix % width
    row = torch.div(pix, width, rounding_mode="floor")
    px = (2 * col.to(tri.dtype) + 1) / width - 1
    py = (2 * row.to(tri.dtype) + 1) / height - 1
    edges, depth, det = _edge_coefficients(tri[fid])
    k = edges[..., 0] * px.unsqueeze(-1) + edges[..., 1] * py.unsqueeze(-1) + edges[..., 2]
    lam = k / k.sum(-1, keepdim=True)
    z = depth[:, 0] * px + depth[:, 1] * py + depth[:, 2]
    vals = torch.stack([lam[:, 0], lam[:, 1], z], -1).float()
    return out.index_put((pix,), vals)


def rasterize(verts_clip: torch.Tensor, faces: torch.Tensor, resolution: Sequence[int],
              max_pairs: int = DEFAULT_MAX_PAIRS) -> torch.Tensor:
    """Rasterise triangles given in clip space; returns ``[B, H, W, 4]`` float32 ``(u, v, z/w, triangle_id + 1)``.

    verts_clip: ``[B, V, 4]`` or ``[V, 4]`` (the batch dimension is then 1). faces: ``[F, 3]`` integer indices
    shared by every batch entry. resolution: ``(H, W)``. ``max_pairs`` bounds the (triangle, pixel) candidates
    evaluated at once (memory). Row 0 is the bottom of the image (OpenGL). Gradients flow into ``verts_clip``
    through u, v and z/w (not through coverage).
    """
    height, width = int(resolution[0]), int(resolution[1])
    if height <= 0 or width <= 0:
        raise ValueError(f"resolution must be positive (H, W), got {tuple(resolution)}")
    verts = _as_batched(verts_clip, 3, "verts_clip")
    if verts.shape[-1] != 4:
        raise ValueError(f"verts_clip must hold homogeneous (x, y, z, w) positions, got shape {tuple(verts.shape)}")
    if faces.dim() != 2 or faces.shape[-1] != 3:
        raise ValueError(f"faces must be [F, 3], got shape {tuple(faces.shape)}")
    faces = faces.to(device=verts.device, dtype=torch.long)
    outs = []
    for b in range(verts.shape[0]):
        tri = verts[b][faces]  # [F, 3, 4]
        face_idx = _raster_one(tri, height, width, max_pairs)
        bary = _barycentrics(tri.double() if tri.device.type != "mps" else tri.float(), face_idx, height, width)
        ids = (face_idx + 1).float().unsqueeze(-1)
        outs.append(torch.cat([bary, ids], -1).view(height, width, 4))
    return torch.stack(outs, 0)


def interpolate(attr: torch.Tensor, rast: torch.Tensor, faces: torch.Tensor) -> torch.Tensor:
    """Barycentric interpolation of per-vertex ``attr`` ([B, V, C] or [V, C]) over ``rast``; zero where empty.

    Returns ``[B, H, W, C]`` in ``attr``'s dtype, differentiable in ``attr`` and in the rast's u, v.
    """
    attr_b = _as_batched(attr, 3, "attr")
    faces = faces.to(device=rast.device, dtype=torch.long)
    batch, height, width, _ = rast.shape
    if attr_b.shape[0] not in (1, batch):
        raise ValueError(f"attr batch {attr_b.shape[0]} does not match rast batch {batch}")
    tri_id = rast[..., 3].long() - 1  # [B, H, W]
    hit = (tri_id >= 0).unsqueeze(-1)
    safe = tri_id.clamp(min=0)
    corner = faces[safe]  # [B, H, W, 3]
    u = rast[..., 0:1].to(attr_b.dtype)
    v = rast[..., 1:2].to(attr_b.dtype)
    if attr_b.shape[0] == 1:
        a = attr_b[0]
        a0, a1, a2 = a[corner[..., 0]], a[corner[..., 1]], a[corner[..., 2]]
    else:
        bidx = torch.arange(batch, device=rast.device).view(batch, 1, 1)
        a0, a1, a2 = attr_b[bidx, corner[..., 0]], attr_b[bidx, corner[..., 1]], attr_b[bidx, corner[..., 2]]
    out = u * a0 + v * a1 + (1 - u - v) * a2
    return torch.where(hit, out, torch.zeros_like(out))


def texture(tex: torch.Tensor, uv: torch.Tensor, filter_mode: str = "linear",
            boundary_mode: str = "wrap") -> torch.Tensor:
    """Sample ``tex`` [B, Ht, Wt, C] (or [Ht, Wt, C]) at ``uv`` [B, H, W, 2] -> [B, H, W, C] (nvdiffrast layout).

    Texel (i, j) is centred at uv ((j + 0.5) / Wt, (i + 0.5) / Ht): u runs along columns, v along rows, row 0 at
    v = 0 (as nvdiffrast; no flip). ``filter_mode`` "linear" (bilinear, no mip-mapping) or "nearest";
    ``boundary_mode`` "wrap" (repeat) or "clamp".
    """
    tex_b = _as_batched(tex, 4, "tex")
    uv_b = _as_batched(uv, 4, "uv")
    if filter_mode not in ("linear", "nearest"):
        raise ValueError(f"filter_mode must be 'linear' or 'nearest', got {filter_mode!r}")
    if boundary_mode not in ("wrap", "clamp"):
        raise ValueError(f"boundary_mode must be 'wrap' or 'clamp', got {boundary_mode!r}")
    img = tex_b.permute(0, 3, 1, 2)  # [B, C, Ht, Wt]
    if img.shape[0] == 1 and uv_b.shape[0] > 1:
        img = img.expand(uv_b.shape[0], -1, -1, -1)
    ht, wt = img.shape[-2:]
    coords = uv_b.to(img.dtype)
    if boundary_mode == "wrap":
        # Pad one texel of the opposite edge on every side, then map the wrapped uv into the padded grid.
        img = F.pad(img, (1, 1, 1, 1), mode="circular")
        coords = torch.remainder(coords, 1.0)
        scale = torch.tensor([wt / (wt + 2), ht / (ht + 2)], dtype=coords.dtype, device=coords.device)
        shift = torch.tensor([1 / (wt + 2), 1 / (ht + 2)], dtype=coords.dtype, device=coords.device)
        coords = coords * scale + shift
    grid = coords * 2 - 1
    mode = "bilinear" if filter_mode == "linear" else "nearest"
    out = F.grid_sample(img, grid, mode=mode, padding_mode="border", align_corners=False)
    return out.permute(0, 2, 3, 1)


def antialias_free_mask(rast: torch.Tensor) -> torch.Tensor:
    """Coverage mask [B, H, W, 1] float (1 where a triangle was drawn); no edge antialiasing is done."""
    return (rast[..., 3:4] > 0).float()
