"""Soft triangle rasterisation (SoftRas-style fragments) in plain PyTorch, on any device PyTorch runs on.

Public API::

    frags = soft_rasterize(verts, faces, (H, W), blur_radius=1e-6, faces_per_pixel=8)
    alpha = sigmoid_coverage(frags.dists, frags.pix_to_face, sigma=1e-4)      # [B, H, W]

Conventions (PyTorch3D's mesh rasteriser, so its renderer can be stood in for):
- ``verts`` [B, V, 3] hold (x_ndc, y_ndc, z): NDC x points left and y up, z is the view-space depth used for the
  depth order (and for perspective-correct barycentrics). The shorter image side spans [-1, 1], the longer one
  [-u, u] with u the aspect ratio; pixel (row i, column j) samples NDC ((W - 2 j - 1) / s, (H - 2 i - 1) / s),
  s = min(H, W), so row 0 is the top of the image.
- A face reaches a pixel when the pixel centre is inside it or its squared NDC distance to the face is below
  ``blur_radius``; faces seen edge-on (zero screen area) and pixels with interpolated depth below 0 (behind the
  camera) are skipped. The ``faces_per_pixel`` nearest such faces (by depth) are kept per pixel, nearest first.
- ``dists`` are squared NDC distances from the pixel centre to the face's closest edge, negative inside.
- ``sigmoid_coverage``: alpha = 1 - prod_k (1 - sigmoid(-dists_k / sigma)) over the kept faces (SoftRas's
  silhouette blend).

Method: faces are binned by their screen bounding box (grown by sqrt(blur_radius)) and (face, pixel) candidates
are evaluated in bounded chunks without autograd; the kept (pixel, face) pairs are ordered per pixel by depth; the
outputs (distances, barycentrics, depths) are then recomputed for the kept pairs only, differentiably in ``verts``.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch

__all__ = ["soft_rasterize", "sigmoid_coverage", "SoftFragments", "pixel_centers_ndc"]

# (face, pixel) candidates evaluated at once (memory bound, ~100 bytes each in flight)
DEFAULT_MAX_PAIRS = 1 << 21


class SoftFragments(NamedTuple):
    pix_to_face: torch.Tensor  # [B, H, W, K] int64 face index (into ``faces``), -1 where unused
    zbuf: torch.Tensor  # [B, H, W, K] interpolated depth, -1 where unused
    bary_coords: torch.Tensor  # [B, H, W, K, 3] barycentrics (perspective-correct if asked), -1 where unused
    dists: torch.Tensor  # [B, H, W, K] signed squared NDC distance, -1 where unused


def pixel_centers_ndc(height: int, width: int, device=None, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """NDC x of every column [W] and y of every row [H] (x left, y up, the shorter side spanning [-1, 1])."""
    s = float(min(height, width))
    cols = torch.arange(width, device=device, dtype=dtype)
    rows = torch.arange(height, device=device, dtype=dtype)
    return (width - 2 * cols - 1) / s, (height - 2 * rows - 1) / s


def _segment_dist2(px, py, ax, ay, bx, by):
    """Squared distance from points (px, py) to the segments a-b (broadcasting)."""
    ex, ey = bx - ax, by - ay
    len2 = ex * ex + ey * ey
    t = ((px - ax) * ex + (py - ay) * ey) / torch.where(len2 > 0, len2, torch.ones_like(len2))
    t = t.clamp(0, 1)
    dx, dy = px - (ax + t * ex), py - (ay + t * ey)
    return dx * dx + dy * dy


def _face_geometry(tri: torch.Tensor, px: torch.Tensor, py: torch.Tensor, perspective_correct: bool,
                   clip_barycentrics: bool):
    """For pairs of faces ``tri`` [P, 3, 3] (x, y, z per corner) and pixel centres px, py [P]: screen-space
    barycentrics [P, 3], whether the centre is inside, signed squared distance [P], depth [P] and the output
    barycentrics [P, 3] (perspective-corrected and/or clipped to the face as asked)."""
    x, y, z = tri[..., 0], tri[..., 1], tri[..., 2]
    x0, x1, x2 = x.unbind(-1)
    y0, y1, y2 = y.unbind(-1)
    area = (x1 - x0) * (y2 - y0) - (x2 - x0) * (y1 - y0)
    safe = torch.where(area == 0, torch.ones_like(area), area)
    w0 = ((x1 - px) * (y2 - py) - (x2 - px) * (y1 - py)) / safe
    w1 = ((x2 - px) * (y0 - py) - (x0 - px) * (y2 - py)) / safe
    w2 = 1 - w0 - w1
    bary = torch.stack([w0, w1, w2], -1)
    inside = (bary >= 0).all(-1)
    d2 = torch.minimum(torch.minimum(_segment_dist2(px, py, x0, y0, x1, y1), _segment_dist2(px, py, x1, y1, x2, y2)),
                       _segment_dist2(px, py, x2, y2, x0, y0))
    dist = torch.where(inside, -d2, d2)
    out = bary
    if clip_barycentrics:
        out = out.clamp(min=0)
        out = out / out.sum(-1, keepdim=True).clamp(min=1e-12)
    if perspective_correct:
        safe_z = torch.where(z == 0, torch.full_like(z, 1e-12), z)
        out = out / safe_z
        out = out / torch.where(out.sum(-1, keepdim=True) == 0, torch.ones_like(out[..., :1]),
                                out.sum(-1, keepdim=True))
    depth = (out * z).sum(-1)
    return inside, dist, depth, out, area


def _pixel_ranges(tri: torch.Tensor, height: int, width: int, grow: float) -> torch.Tensor:
    """Inclusive (col0, col1, row0, row1) [F, 4] of the pixels whose centres lie in the face's NDC bounding box
    grown by ``grow``; empty ranges have col0 > col1."""
    s = float(min(height, width))
    lo, hi = tri[..., :2].amin(1) - grow, tri[..., :2].amax(1) + grow
    # x = (W - 2 j - 1) / s decreases with j: the box's largest x gives the first column
    col0 = torch.ceil((width - 1 - s * hi[:, 0]) / 2).clamp(min=0)
    col1 = torch.floor((width - 1 - s * lo[:, 0]) / 2).clamp(max=width - 1)
    row0 = torch.ceil((height - 1 - s * hi[:, 1]) / 2).clamp(min=0)
    row1 = torch.floor((height - 1 - s * lo[:, 1]) / 2).clamp(max=height - 1)
    return torch.stack([col0, col1, row0, row1], -1).long()


def _candidates(tri: torch.Tensor, height: int, width: int, blur_radius: float, max_pairs: int):
    """Yield (face ids [P], pixel ids [P]) of (face, pixel) candidate pairs in chunks of at most max_pairs."""
    bounds = _pixel_ranges(tri, height, width, math.sqrt(max(blur_radius, 0.0)))
    bw = (bounds[:, 1] - bounds[:, 0] + 1).clamp(min=0)
    bh = (bounds[:, 3] - bounds[:, 2] + 1).clamp(min=0)
    # faces entirely behind the camera never show
    counts = torch.where((tri[..., 2] > 0).any(-1), bw * bh, torch.zeros_like(bw))
    live = torch.nonzero(counts > 0).squeeze(1)
    if live.numel() == 0:
        return
    ends = torch.cumsum(counts[live], 0).cpu()
    start, done = 0, 0
    while start < len(ends):
        stop = max(int(torch.searchsorted(ends, done + max_pairs, right=True)), start + 1)
        ids = live[start:stop]
        n = counts[ids]
        face = torch.repeat_interleave(ids, n)
        offsets = torch.cumsum(n, 0) - n
        local = torch.arange(face.numel(), device=tri.device) - torch.repeat_interleave(offsets, n)
        col = bounds[face, 0] + local % bw[face]
        row = bounds[face, 2] + torch.div(local, bw[face], rounding_mode="floor")
        yield face, row * width + col
        done, start = int(ends[stop - 1]), stop


def _keep_nearest(pix: torch.Tensor, depth: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Order (pixel, depth) pairs by pixel then depth; returns the order and each kept pair's rank (< k)."""
    by_depth = torch.argsort(depth, stable=True)
    order = by_depth[torch.argsort(pix[by_depth], stable=True)]
    sorted_pix = pix[order]
    first = torch.ones_like(sorted_pix, dtype=torch.bool)
    first[1:] = sorted_pix[1:] != sorted_pix[:-1]
    position = torch.arange(order.numel(), device=pix.device)
    group_start = torch.cummax(torch.where(first, position, torch.zeros_like(position)), 0).values
    rank = position - group_start
    keep = rank < k
    return order[keep], rank[keep]


def _rasterize_one(tri: torch.Tensor, height: int, width: int, blur_radius: float, k: int, perspective_correct: bool,
                   clip_barycentrics: bool, max_pairs: int):
    device = tri.device
    xs, ys = pixel_centers_ndc(height, width, device, tri.dtype)
    faces_kept, pix_kept, depth_kept = [], [], []
    with torch.no_grad():
        work = tri.detach()
        for face, pix in _candidates(work, height, width, blur_radius, max_pairs):
            px, py = xs[pix % width], ys[torch.div(pix, width, rounding_mode="floor")]
            inside, dist, depth, _, area = _face_geometry(work[face], px, py, perspective_correct,
                                                          clip_barycentrics)
            hit = (area != 0) & (inside | (dist < blur_radius)) & (depth >= 0)
            faces_kept.append(face[hit])
            pix_kept.append(pix[hit])
            depth_kept.append(depth[hit])
    n_pix = height * width
    if not faces_kept or sum(f.numel() for f in faces_kept) == 0:
        return _empty(n_pix, 1, tri.dtype, device)
    face, pix, depth = torch.cat(faces_kept), torch.cat(pix_kept), torch.cat(depth_kept)
    order, rank = _keep_nearest(pix, depth, k)
    face, pix = face[order], pix[order]
    px, py = xs[pix % width], ys[torch.div(pix, width, rounding_mode="floor")]
    # the kept pairs again, with autograd, so gradients reach the vertices through distances and depths
    _, dist, depth, out_bary, _ = _face_geometry(tri[face], px, py, perspective_correct, clip_barycentrics)
    # only as many slots as the most crowded pixel needs (the caller pads to faces_per_pixel once)
    used = int(rank.max()) + 1
    pix_to_face, zbuf, bary, dists = _empty(n_pix, used, tri.dtype, device)
    pix_to_face[pix, rank] = face
    return (pix_to_face, zbuf.index_put((pix, rank), depth), bary.index_put((pix, rank), out_bary),
            dists.index_put((pix, rank), dist))


def _empty(n_pix: int, k: int, dtype, device):
    return (torch.full((n_pix, k), -1, dtype=torch.long, device=device),
            torch.full((n_pix, k), -1.0, dtype=dtype, device=device),
            torch.full((n_pix, k, 3), -1.0, dtype=dtype, device=device),
            torch.full((n_pix, k), -1.0, dtype=dtype, device=device))


def _pad_slots(t: torch.Tensor, k: int, dim: int) -> torch.Tensor:
    """Pad the slot dimension ``dim`` of ``t`` with -1 up to ``k`` entries."""
    missing = k - t.shape[dim]
    if missing <= 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - (dim % t.dim())) + [0, missing]
    return torch.nn.functional.pad(t, pad, value=-1)


def soft_rasterize(verts: torch.Tensor, faces: torch.Tensor, image_size: Sequence[int], blur_radius: float = 0.0,
                   faces_per_pixel: int = 1, perspective_correct: bool = False, clip_barycentric_coords: bool = False,
                   max_pairs: int = DEFAULT_MAX_PAIRS) -> SoftFragments:
    """Rasterise ``verts`` [B, V, 3] (or [V, 3]) (x_ndc, y_ndc, view depth) with ``faces`` [F, 3] (shared by the
    batch, or [B, F, 3] with -1 rows for padding) into the ``faces_per_pixel`` nearest faces per pixel of an
    ``image_size`` = (H, W) image. See the module docstring for the conventions. Differentiable in ``verts``
    through ``dists``, ``zbuf`` and ``bary_coords`` (not through which faces are kept)."""
    height, width = int(image_size[0]), int(image_size[1])
    if height <= 0 or width <= 0 or faces_per_pixel < 1:
        raise ValueError(f"image_size must be positive (H, W) and faces_per_pixel >= 1, got {tuple(image_size)}, "
                         f"{faces_per_pixel}")
    v = verts[None] if verts.dim() == 2 else verts
    if v.shape[-1] != 3:
        raise ValueError(f"verts must be [B, V, 3] (x_ndc, y_ndc, depth), got {tuple(verts.shape)}")
    f = faces.to(device=v.device, dtype=torch.long)
    f = f[None].expand(v.shape[0], -1, -1) if f.dim() == 2 else f
    k = int(faces_per_pixel)
    outs = []
    for b in range(v.shape[0]):
        valid = (f[b] >= 0).all(-1)
        ids = torch.nonzero(valid).squeeze(1)
        tri = v[b][f[b][ids]]
        p2f, zbuf, bary, dists = _rasterize_one(tri, height, width, float(blur_radius), k, perspective_correct,
                                                clip_barycentric_coords, max_pairs)
        if ids.numel() != f.shape[1]:  # back to the caller's face numbering
            p2f = torch.where(p2f >= 0, ids[p2f.clamp(min=0)], p2f)
        outs.append((p2f, zbuf, bary, dists))
    used = max(o[0].shape[1] for o in outs)
    parts = []
    for i, dim in ((0, 1), (1, 1), (2, 1), (3, 1)):
        items = [_pad_slots(o[i], used, dim) for o in outs]
        parts.append(items[0][None] if len(items) == 1 else torch.stack(items))
    p2f, zbuf, bary, dists = (_pad_slots(t, k, 2) for t in parts)
    return SoftFragments(p2f.view(-1, height, width, k), zbuf.view(-1, height, width, k),
                         bary.view(-1, height, width, k, 3), dists.view(-1, height, width, k))


def sigmoid_coverage(dists: torch.Tensor, pix_to_face: torch.Tensor, sigma: float) -> torch.Tensor:
    """Soft silhouette [...]: 1 - prod over the last axis of (1 - sigmoid(-dists / sigma)), unused slots
    (pix_to_face < 0) contributing nothing."""
    # slots are filled nearest first, so the used ones are a prefix: skip the trailing all-empty slots
    used = int((pix_to_face >= 0).flatten(0, -2).any(0).sum()) if pix_to_face.numel() else 0
    dists, pix_to_face = dists[..., :max(used, 1)], pix_to_face[..., :max(used, 1)]
    prob = torch.sigmoid(-dists / sigma) * (pix_to_face >= 0).to(dists.dtype)
    return 1.0 - torch.prod(1.0 - prob, dim=-1)
