"""CPU compositing for the splat renderer (``portable.render_gaussians``): depth slabs, live pixels only, and one
small matrix product per chunk for the footprints' exponents.

Same image model as the rounds of ``portable`` (EWA footprints cut at ``extent_sigma`` and ``alpha_min``, alpha
capped at ``alpha_max``, front-to-back compositing, a tile stops once its pixels let less than
``min_transmittance`` through); what changes is how much work a frame does. Profiles of a 1M-gaussian object at
512^2 showed three wastes in the rounds, and each has its answer here:

* Most (tile, gaussian) pairs lie behind an opaque surface (78% of 6.5M pairs were never composited), yet all
  were listed and sorted. Here the gaussians, in depth order, go in slabs (``SLABS``, front first): a later slab
  lists only gaussians whose box still reaches a live tile (a summed-area table of the live tiles answers that
  per gaussian) and only their pairs in live tiles, so the hidden back of an object is dropped before any sort.
* Inside a tile, pixels turn opaque at different depths (a slanted surface), but a tile went on with all its
  pixels until every one was opaque: 62% of the pixel evaluations were at opaque pixels. Once fewer than
  ``COMPACT_BELOW`` of an unfinished tile's pixels are live, each tile composites its live pixels only (tiles
  are batched by live count, padding goes to one dummy pixel).
* The exponent e = -q/2 + log(opacity) of a footprint is a quadratic in the pixel's offset (x, y) from the tile
  centre: e - cut = f0 x^2 + f1 y^2 + f2 xy + f3 x + f4 y + f5. One [chunk, 6] x [6, pixels] product per tile
  forms it (for any subset of pixels), instead of five broadcast passes; ``cut`` is the log alpha cut-off, so
  the cut is one threshold at 0.

Then alpha = min(alpha_max, exp(e)) (0 past the cut), T_i = T_in prod_{j <= i} (1 - alpha_j) by one cumprod,
and the weighted sum of colour and depth sum_i (T_{i-1} - T_i) c_i is formed by summation by parts as
T_in c_0 + sum_{i < L-1} T_i (c_{i+1} - c_i) - T_{L-1} c_{L-1}: one batched product with T, no weight tensor.
Cut-off pixels get the exponent ``CULL_EXPONENT`` instead of -inf: exp(-30) < 1e-13, so 1 - alpha is exactly
1 in float32 as for a zero alpha, and exp stays clear of its slow underflow inputs (-inf, denormal results:
5-50x slower per element than ordinary inputs).

Rounding: the expanded quadratic rounds differently from the per-pixel form (its terms grow with the distance
of the gaussian from the tile centre; about 1e-5 absolute in e for footprints of a few pixels), which can move
a gaussian sitting within that of the 3-sigma or 1/255 cut across it: a rare single-pixel change of at most
that gaussian's alpha there (<= 1/255 at the opacity cut; e^-4.5 x opacity at the 3-sigma cut). Elsewhere the
images match the rounds' to ~1e-5.
"""
from __future__ import annotations

import math
from typing import Tuple

import torch

from .tiles import box_pairs, screen_order, tile_boxes

__all__ = ["composite_slabs", "SLABS", "COMPACT_BELOW"]

SLABS = 8  # depth slabs of the on-screen gaussians (equal counts); later ones list only what live tiles can see
# (4 -> 8 took 12% off close views of a 1M object, r 1 and fov 60: the front slab lists fewer hidden pairs)
FIRST_CHUNK = 32  # gaussians per tile in a slab's first round; later rounds double it up to MAX_CHUNK
MAX_CHUNK = 4096
COMPACT_BELOW = 0.75  # composite live pixels only once fewer than this share of the unfinished tiles' are live
CULL_EXPONENT = -30.0

# table columns: quadratic coefficients need the mean and the conic; the cut, colour and depth follow
_U, _V, _NA, _NB, _NC, _SHIFT, _CUT, _R, _DEPTH = 0, 1, 2, 3, 4, 5, 6, 7, 10
_COLUMNS = 11


def _table(proj, colors: torch.Tensor, opacities: torch.Tensor, alpha_min: float, extent_sq: float) -> torch.Tensor:
    """[N + 1, 11] rows (u, v, -a/2, -b, -c/2, log opacity - cut, cut, r, g, b, depth); ``cut`` is the log alpha
    below which a gaussian is cut (max(log opacity - extent^2 / 2, log alpha_min)). Row N is the padding
    gaussian: e - cut = -1 at every pixel, so it is always cut."""
    dtype = colors.dtype
    log_op = torch.log(opacities.clamp_min(0))
    log_min = math.log(alpha_min) if alpha_min > 0 else -math.inf
    cut = torch.clamp_min(log_op - extent_sq / 2, log_min)
    table = torch.zeros(proj.means2d.shape[0] + 1, _COLUMNS, dtype=dtype, device=colors.device)
    con = proj.conics.to(dtype)
    table[:-1, _U:_V + 1] = proj.means2d
    table[:-1, _NA] = -0.5 * con[:, 0]
    table[:-1, _NB] = -con[:, 1]
    table[:-1, _NC] = -0.5 * con[:, 2]
    # opacity 0 (log -inf): never drawn; a finite shift keeps NaNs out of the products
    table[:-1, _SHIFT] = torch.clamp_min(log_op - cut, -1e4) if alpha_min > 0 else (log_op - cut).nan_to_num(-1e4)
    table[:-1, _CUT] = cut.clamp_min(-1e4)
    table[:-1, _R:_R + 3] = colors
    table[:-1, _DEPTH] = proj.depths
    table[-1, _SHIFT] = -1.0
    return table


def _monomials(tile: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[6, tile^2] (x^2, y^2, xy, x, y, 1) of the tile's pixel centres relative to the tile centre (row-major)."""
    offs = torch.arange(tile, dtype=dtype, device=device) + 0.5 - tile / 2
    y, x = torch.meshgrid(offs, offs, indexing="ij")
    x, y = x.reshape(-1), y.reshape(-1)
    return torch.stack([x * x, y * y, x * y, x, y, torch.ones_like(x)])


def _coefficients(rows: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """[B, L, 6] coefficients of e - cut as a quadratic in the pixel offset from each tile's centre [B, 2].
    (Few, whole-tensor calls: a frame makes some hundred chunks, and with frames rendered side by side the
    Python time between ops is shared by all of them.)"""
    u, v = (rows[..., _U:_V + 1] - centres[:, None, :]).unbind(-1)
    na, nb, nc, shift = rows[..., _NA:_SHIFT + 1].unbind(-1)
    bu, bv = nb * u, nb * v
    constant = (na * u + bv) * u + nc * v * v + shift
    return torch.stack([na, nc, nb, -2 * na * u - bv, -2 * nc * v - bu, constant], dim=-1)


def _tile_centres(n_tiles: int, tiles_x: int, tile: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[n_tiles, 2] pixel coordinates (x, y) of the tile centres (tiles row-major)."""
    ids = torch.arange(n_tiles, device=device)
    return torch.stack([(ids % tiles_x).to(dtype) * tile + tile / 2,
                        torch.div(ids, tiles_x, rounding_mode="floor").to(dtype) * tile + tile / 2], dim=-1)


def _composite(s: torch.Tensor, rows: torch.Tensor, t_in: torch.Tensor, alpha_max: float):
    """Front-to-back compositing of one chunk: ``s`` [B, L, P] = e - cut (overwritten), ``rows`` [B, L, 11],
    ``t_in`` [B, P] -> (transmittance after the chunk [B, P], weighted colour and depth [B, P, 4])."""
    torch.nn.functional.threshold(s, 0.0, CULL_EXPONENT, inplace=True)
    s.add_(rows[..., _CUT, None]).clamp_(max=math.log(alpha_max)).exp_()
    keep = torch.sub(1.0, s, out=s)
    keep[:, 0].mul_(t_in)
    keep.cumprod_(dim=1)  # T_i
    values = rows[..., _R:_DEPTH + 1]
    step = torch.empty_like(values)  # c_{i+1} - c_i, and -c_{L-1} last
    torch.sub(values[:, 1:], values[:, :-1], out=step[:, :-1])
    torch.neg(values[:, -1], out=step[:, -1])
    # [4, L] x [L, P] per tile reads T row by row (4-6x faster on the CPU than [P, L] x [L, 4] with T transposed)
    acc = torch.bmm(step.transpose(1, 2), keep).transpose(1, 2) + t_in[..., None] * values[:, None, 0]
    return keep[:, -1], acc


class _Canvas:
    """Transmittance and weighted colour/depth of every tile pixel, flat, plus one dummy pixel (index
    ``dummy``) that padded work reads and writes."""

    def __init__(self, n_tiles: int, pix: int, dtype: torch.dtype, device: torch.device):
        self.n_tiles, self.pix, self.dummy = n_tiles, pix, n_tiles * pix
        self.trans = torch.ones(n_tiles * pix + 1, dtype=dtype, device=device)
        self.acc = torch.zeros(n_tiles * pix + 1, 4, dtype=dtype, device=device)

    def tiles(self, ids: torch.Tensor) -> torch.Tensor:
        return self.trans[:-1].view(self.n_tiles, self.pix).index_select(0, ids)

    def live_tiles(self, min_transmittance: float) -> torch.Tensor:
        return self.trans[:-1].view(self.n_tiles, self.pix).amax(dim=1) >= min_transmittance


def _rounds(canvas: _Canvas, table: torch.Tensor, tile_of_pair: torch.Tensor, gauss_of_pair: torch.Tensor,
            tiles_x: int, tile: int, alpha_max: float, min_transmittance: float, max_elements: int) -> None:
    """Composite sorted (tile, gaussian-row) pairs onto ``canvas`` in rounds of growing chunks per tile."""
    device, dtype, pix = table.device, table.dtype, canvas.pix
    null = table.shape[0] - 1
    counts = torch.bincount(tile_of_pair, minlength=canvas.n_tiles)
    starts = torch.cumsum(counts, 0) - counts
    active = torch.nonzero(counts).squeeze(1)
    last = gauss_of_pair.numel() - 1
    mono = _monomials(tile, dtype, device)
    pixel = torch.arange(pix, device=device)
    centres = _tile_centres(canvas.n_tiles, tiles_x, tile, dtype, device)
    length, done = FIRST_CHUNK, 0
    while active.numel():
        live = canvas.tiles(active) >= min_transmittance
        n_live = live.sum(dim=1)
        compact = int(n_live.sum()) < COMPACT_BELOW * active.numel() * pix
        if compact:  # tiles by live count (batches pad little); each tile's live pixels first
            order = torch.argsort(n_live, descending=True)
            active, n_live = active.index_select(0, order), n_live.index_select(0, order)
            live_first = torch.argsort((~live.index_select(0, order)).to(torch.uint8), dim=1, stable=True)
        pos = done + torch.arange(length, device=device)
        per_tile = max(1, max_elements // length)
        s0 = 0
        while s0 < active.numel():
            width = int(n_live[s0]) if compact else pix
            batch = max(1, per_tile // max(width, 1))
            sel = active[s0:s0 + batch]
            index = starts.index_select(0, sel)[:, None] + pos[None, :]
            gid = torch.where(pos[None, :] < counts.index_select(0, sel)[:, None],
                              gauss_of_pair[index.clamp(max=last)], torch.full_like(index, null))
            rows = table.index_select(0, gid.reshape(-1)).view(sel.numel(), length, _COLUMNS)
            coef = _coefficients(rows, centres.index_select(0, sel))
            if compact:
                local = live_first[s0:s0 + batch, :width]
                flat = torch.where(pixel[None, :width] < n_live[s0:s0 + batch, None], sel[:, None] * pix + local,
                                   torch.full_like(local, canvas.dummy))
                s = torch.bmm(coef, mono[:, local].permute(1, 0, 2))
            else:
                flat = sel[:, None] * pix + pixel[None, :]
                s = torch.matmul(coef, mono)
            t_out, acc = _composite(s, rows, canvas.trans[flat], alpha_max)
            canvas.trans[flat] = t_out
            canvas.acc.index_put_((flat.reshape(-1),), acc.reshape(-1, 4), accumulate=True)
            s0 += sel.numel()
        done += length
        active = active[counts.index_select(0, active) > done]
        active = active[canvas.tiles(active).amax(dim=1) >= min_transmittance]
        length = min(2 * length, MAX_CHUNK)


def _reaches_live_tile(live: torch.Tensor, x0, x1, y0, y1) -> torch.Tensor:
    """Per box (inclusive tile ranges): does it contain a live tile? ``live`` [tiles_y, tiles_x] bool; one
    summed-area table, four lookups per box."""
    tiles_y, tiles_x = live.shape
    sat = torch.zeros(tiles_y + 1, tiles_x + 1, dtype=torch.int32, device=live.device)
    sat[1:, 1:] = live.int().cumsum(0).cumsum(1)
    flat = sat.reshape(-1)
    w = tiles_x + 1
    x1, y1 = x1 + 1, y1 + 1
    inside = (flat[(y1 * w + x1).long()] - flat[(y0 * w + x1).long()] - flat[(y1 * w + x0).long()]
              + flat[(y0 * w + x0).long()])
    return inside > 0


def composite_slabs(proj, colors: torch.Tensor, opacities: torch.Tensor, width: int, height: int, tile: int,
                    alpha_min: float, alpha_max: float, extent_sigma: float, min_transmittance: float,
                    max_elements: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Transmittance [n_tiles, tile^2] and weighted (r, g, b, depth) [n_tiles, tile^2, 4] of every tile pixel
    (tiles row-major over the image, pixels row-major in a tile) for projected gaussians ``proj``."""
    tiles_x, tiles_y = math.ceil(width / tile), math.ceil(height / tile)
    canvas = _Canvas(tiles_x * tiles_y, tile * tile, colors.dtype, colors.device)
    ids = screen_order(proj, width, height)
    if ids.numel():
        table = _table(proj, colors, opacities, alpha_min, extent_sigma ** 2)
        boxes = tile_boxes(proj, ids, tile, tiles_x, tiles_y)
        bounds = torch.linspace(0, ids.numel(), SLABS + 1).round().long().tolist()
        for a, b in zip(bounds[:-1], bounds[1:]):
            slab_ids, slab_boxes = ids[a:b], [t[a:b] for t in boxes]
            live = None
            if a > 0:
                live = canvas.live_tiles(min_transmittance)
                if not bool(live.any()):
                    break
                reach = torch.nonzero(_reaches_live_tile(live.view(tiles_y, tiles_x), *slab_boxes)).squeeze(1)
                slab_ids, slab_boxes = slab_ids[reach], [t[reach] for t in slab_boxes]
            tile_id, slot = box_pairs(*slab_boxes, tiles_x)
            if live is not None:  # pairs in opaque tiles go before the sort
                keep = torch.nonzero(live[tile_id.long()]).squeeze(1)
                tile_id, slot = tile_id[keep], slot[keep]
            if tile_id.numel() == 0:
                continue
            tile_id, order = torch.sort(tile_id, stable=True)
            _rounds(canvas, table, tile_id.long(), slab_ids.index_select(0, slot.index_select(0, order)), tiles_x,
                    tile, alpha_max, min_transmittance, max_elements)
    return canvas.trans[:-1].view(canvas.n_tiles, canvas.pix), canvas.acc[:-1].view(canvas.n_tiles, canvas.pix, 4)
