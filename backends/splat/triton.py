"""Triton compositing kernel for the gaussian splat renderer (``backends/splat/portable.py``, CUDA, float32).

The renderer lists (tile, gaussian) pairs sorted by tile and, inside a tile, front to back. Its PyTorch path
composites all tiles together in rounds of growing chunks; every round costs host syncs (which tiles go on) and
[tiles, chunk, pixels] work tensors, and a frame of 1M gaussians needs many rounds. Here one program composites
one tile: it walks the tile's list once, front to back, keeping the transmittance and the accumulated colour and
depth of its pixels in registers, and stops once every pixel of the tile lets less than ``min_transmittance``
through. All tiles go in one launch with no host sync.

Per pixel and gaussian the arithmetic is the PyTorch path's (``_composite_chunk`` on ``_gaussian_table`` rows)::

    e = (na dx^2 + (nc dy^2 + log opacity)) + (nb dy) dx      (na = -a/2, nb = -b, nc = -c/2)
    alpha = 0 if e < log cut-off else min(alpha_max, exp(e))
    weight = T alpha;  T = T (1 - alpha);  acc += weight (r, g, b, depth)

The PyTorch path forms T as T_start * cumprod(1 - alpha) over a chunk and the weights as differences of it; the
running product here rounds differently in the last bits (~1e-7). It also stops only between chunks, so its
images differ from these by less than ``min_transmittance`` (times the largest colour or depth) where a tile
stopped early. The kernel also runs in Triton's interpreter on CPU tensors, which is how tests check it without a
GPU (tests/test_triton_splat.py).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .. import triton_jit

try:  # the module must import without triton (``unavailable_reason`` then says why it cannot run)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

__all__ = ["composite_tiles", "compositor", "unavailable_reason", "TABLE_COLUMNS", "CHECK_EVERY"]

# The gaussian table's columns, in this order (``_gaussian_table`` in splat.py builds it): mean (u, v) in pixels,
# -a/2, -b, -c/2 of the inverse 2D covariance [[a, b], [b, c]], log opacity, log alpha cut-off, colour, depth.
TABLE_COLUMNS = ("u", "v", "na", "nb", "nc", "log_opacity", "log_cut", "r", "g", "b", "depth")
# Gaussians composited between two early-stop tests: the test is a max over the tile's pixels (a cross-thread
# reduction). On an H100, 1M gaussians at 512^2 (8.6M pairs): 0.56 ms testing every gaussian, 0.32-0.34 ms every
# 4, 8 or 16. A few extra gaussians on an already opaque tile only bring the result closer to compositing all.
CHECK_EVERY = 8


def _composite_tiles_kernel(table_ptr, gauss_ptr, starts_ptr, counts_ptr, trans_ptr, acc_ptr,
                            tiles_x, width, height, table_stride, alpha_max, min_transmittance,
                            TILE: tl.constexpr, BLOCK: tl.constexpr, CHECK: tl.constexpr):
    """One tile (TILE x TILE pixels in a BLOCK >= TILE^2 vector, row-major like the renderer's tiles): its
    gaussians front to back, CHECK at a time between tests of the tile's largest transmittance."""
    tile_id = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, BLOCK)
    in_tile = p < TILE * TILE
    col = p % TILE
    row = p // TILE
    # pixel centres as the PyTorch path forms them: tile origin (exact in float32) + (offset + 0.5)
    tx = (tile_id % tiles_x).to(tl.int32)
    ty = (tile_id // tiles_x).to(tl.int32)
    px = (tx * TILE).to(tl.float32) + (col.to(tl.float32) + 0.5)
    py = (ty * TILE).to(tl.float32) + (row.to(tl.float32) + 0.5)
    # pixels past the image's right/bottom edge are composited (and cropped later) but must not keep a tile
    # going: the early stop looks at in-image pixels only
    counted = in_tile & (tx * TILE + col < width) & (ty * TILE + row < height)

    # continue from what the buffers hold (ones and zeros for a fresh frame), as the PyTorch path does
    pix_at = tile_id * (TILE * TILE) + p
    trans = tl.load(trans_ptr + pix_at, mask=in_tile, other=0.0)
    acc_r = tl.load(acc_ptr + pix_at * 4 + 0, mask=in_tile, other=0.0)
    acc_g = tl.load(acc_ptr + pix_at * 4 + 1, mask=in_tile, other=0.0)
    acc_b = tl.load(acc_ptr + pix_at * 4 + 2, mask=in_tile, other=0.0)
    acc_d = tl.load(acc_ptr + pix_at * 4 + 3, mask=in_tile, other=0.0)

    start = tl.load(starts_ptr + tile_id).to(tl.int64)
    end = start + tl.load(counts_ptr + tile_id).to(tl.int64)
    pos = start
    # tl.reduce with a max combiner is tl.max without its @jit wrapper, which Triton's interpreter cannot call
    brightest = tl.reduce(tl.where(counted, trans, 0.0), 0, tl.standard._elementwise_max)
    while (pos < end) & (brightest >= min_transmittance):
        for k in tl.static_range(CHECK):
            i = pos + k
            live = i < end
            gid = tl.load(gauss_ptr + i, mask=live, other=0).to(tl.int64)
            g = table_ptr + gid * table_stride
            u = tl.load(g + 0, mask=live, other=0.0)
            v = tl.load(g + 1, mask=live, other=0.0)
            na = tl.load(g + 2, mask=live, other=0.0)
            nb = tl.load(g + 3, mask=live, other=0.0)
            nc = tl.load(g + 4, mask=live, other=0.0)
            log_op = tl.load(g + 5, mask=live, other=0.0)
            log_cut = tl.load(g + 6, mask=live, other=0.0)
            r = tl.load(g + 7, mask=live, other=0.0)
            gr = tl.load(g + 8, mask=live, other=0.0)
            b = tl.load(g + 9, mask=live, other=0.0)
            depth = tl.load(g + 10, mask=live, other=0.0)
            dx = px - u
            dy = py - v
            e = (na * dx * dx + (nc * dy * dy + log_op)) + (nb * dy) * dx
            alpha = tl.minimum(tl.exp(e), alpha_max)
            # past the list's end (the last group's tail) nothing is added
            alpha = tl.where((e < log_cut) | (i >= end), 0.0, alpha)
            weight = trans * alpha
            trans = trans * (1.0 - alpha)
            acc_r += weight * r
            acc_g += weight * gr
            acc_b += weight * b
            acc_d += weight * depth
        pos += CHECK
        brightest = tl.reduce(tl.where(counted, trans, 0.0), 0, tl.standard._elementwise_max)

    tl.store(trans_ptr + pix_at, trans, mask=in_tile)
    tl.store(acc_ptr + pix_at * 4 + 0, acc_r, mask=in_tile)
    tl.store(acc_ptr + pix_at * 4 + 1, acc_g, mask=in_tile)
    tl.store(acc_ptr + pix_at * 4 + 2, acc_b, mask=in_tile)
    tl.store(acc_ptr + pix_at * 4 + 3, acc_d, mask=in_tile)


def _kernel(interpret: bool):
    # image and tile-grid sizes change per camera
    return triton_jit.kernel(_composite_tiles_kernel, interpret, do_not_specialize=["tiles_x", "width", "height"])


def _num_warps(block: int) -> int:
    """Two pixels a thread (an 8x8 tile is one warp, so the early-stop max stays inside a warp), 1 to 8 warps."""
    return max(1, min(8, block // 64))


def unavailable_reason(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """Why ``composite_tiles`` cannot run on ``device`` / ``dtype`` (None when it can). CPU tensors are
    accepted: they run in Triton's interpreter, which is slow and meant for tests."""
    if triton is None:
        return "needs the optional package 'triton' (not installed)"
    if dtype != torch.float32:
        return f"float32 only (got {dtype})"
    if device.type not in ("cuda", "cpu"):
        return f"runs on CUDA (or in Triton's interpreter on the CPU), not {device.type}"
    if device.type == "cuda" and not torch.cuda.is_available():
        return "CUDA is not available"
    return None


def compositor(device: torch.device, dtype: torch.dtype) -> Optional[Callable[..., None]]:
    """``composite_tiles`` where it is the renderer's faster path (float32 on CUDA with triton importable), else
    None: the renderer then composites in PyTorch rounds (the interpreter that also runs this on the CPU is for
    tests only)."""
    if device.type != "cuda" or unavailable_reason(device, dtype) is not None:
        return None
    return composite_tiles


def composite_tiles(table: torch.Tensor, gauss_of_pair: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor,
                    tiles_x: int, tile: int, width: int, height: int, alpha_max: float, min_transmittance: float,
                    trans_img: torch.Tensor, acc_img: torch.Tensor) -> None:
    """Composite every tile front to back in one launch, updating ``trans_img`` [n_tiles, tile^2] (transmittance)
    and ``acc_img`` [n_tiles, tile^2, 4] (weighted r, g, b, depth) in place.

    ``table`` [N(+1), 11] float32 holds one row per gaussian with the columns of ``TABLE_COLUMNS``;
    ``gauss_of_pair`` lists table rows tile after tile, each tile's front to back, the tile's run starting at
    ``starts[tile]`` and ``counts[tile]`` long. Tiles are numbered row-major over a ``tiles_x``-wide grid of
    ``tile`` x ``tile`` pixels; tile pixels are row-major. ``width`` and ``height`` (the image) only keep pixels
    past the image's edge out of the early stop: a tile stops once every in-image pixel's transmittance is below
    ``min_transmittance``. CUDA tensors run the compiled kernel, CPU tensors Triton's interpreter (tests)."""
    reason = unavailable_reason(table.device, table.dtype)
    if reason is not None:
        raise RuntimeError(f"composite_tiles: {reason}")
    n_tiles, pix = trans_img.shape
    if pix != tile * tile or acc_img.shape != (n_tiles, pix, 4) or table.shape[-1] != len(TABLE_COLUMNS):
        raise ValueError(f"composite_tiles: expected trans_img [n_tiles, {tile * tile}], acc_img [n_tiles, "
                         f"{tile * tile}, 4] and table [N, {len(TABLE_COLUMNS)}]; got {tuple(trans_img.shape)}, "
                         f"{tuple(acc_img.shape)}, {tuple(table.shape)}")
    if trans_img.dtype != torch.float32 or acc_img.dtype != torch.float32:
        raise ValueError("composite_tiles: trans_img and acc_img must be float32")
    if not (trans_img.is_contiguous() and acc_img.is_contiguous()):
        raise ValueError("composite_tiles: trans_img and acc_img must be contiguous (they are written in place)")
    if n_tiles == 0 or gauss_of_pair.numel() == 0:
        return
    interpret = table.device.type == "cpu"
    table = table if table.stride(-1) == 1 else table.contiguous()
    block = triton.next_power_of_2(pix)
    options = {} if interpret else {"num_warps": _num_warps(block)}
    _kernel(interpret)[(n_tiles,)](
        table, gauss_of_pair.contiguous(), starts.contiguous(), counts.contiguous(), trans_img, acc_img,
        int(tiles_x), int(width), int(height), table.stride(0), float(alpha_max), float(min_transmittance),
        TILE=int(tile), BLOCK=block, CHECK=CHECK_EVERY, **options)
