"""The portable sparse-conv backend (``SPARSE_BACKEND=torch``): gather-GEMM-scatter in plain torch ops, plus the
memory-lean and child-block variants that the dispatcher (:func:`backends.sparse_conv.sparse_conv3d`) runs for
backends registered with the ``lean`` capability.

Subdivided input (``subdivided=True``): ``feats`` hold one row per parent voxel and ``coords`` are the parents'
children (child row r copies parent row r // 8), as a subdivision leaves them. The memory-lean path of the
portable arithmetic never builds the [8N, Cin] copy nor an [8N, k^3] neighbour table (neighbours are looked up
one offset at a time in a ``CoordHash``); backends with their own kernels get the materialised input.

Child blocks (``parent_map=``): when ``coords`` are all 8 children of every parent (parent-major, upstream's child
order ``c = 4 cx + 2 cy + cz``), as right after a subdivision, a child's 3^3 neighbourhood lies in its parent's
3^3 parent neighbourhood and a child exists exactly when its parent does. The portable backends then run the
convolution on the parents (:func:`blocked_sparse_conv3d`): 27 parent offsets, each one GEMM of the parent
neighbour's rows (all 8 children side by side, ``[M, 8 Cin]``) against a block of the kernel, scattered into the
children it reaches. No child-level hash or neighbour table is built, the centre offset is one large GEMM with no
gather, and a subdivided input multiplies each parent once per parent offset (8 products per child, not 27).
The sums are the same up to float rounding (weights that meet the same parent are added before the product).
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch

from ..device import accumulate_dtype
from ..hashing import CoordHash, NeighborMap, kernel_offsets, neighbor_map as _neighbor_map
from ..registry import Family, register

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def pointwise_conv(feats: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """1x1x1 submanifold conv with spconv's reading of the weight buffer: the ``[Cout, 1, 1, 1, Cin]`` buffer is
    read as a ``[Cin, Cout]`` matrix (see ``backends.sparse_conv``)."""
    out = feats @ weight.reshape(weight.shape[4], weight.shape[0])
    return out + bias if bias is not None else out


def _subdivide_rows(feats: torch.Tensor) -> torch.Tensor:
    """Per-parent rows -> 8 identical child rows (parent-major), as a subdivision lays them out."""
    return feats[:, None].expand(feats.shape[0], 8, *feats.shape[1:]).reshape(feats.shape[0] * 8, *feats.shape[1:])


def lean_sparse_conv3d(feats: torch.Tensor, coords: torch.Tensor, weight: torch.Tensor,
                       bias: Optional[torch.Tensor], subdivided: bool = False,
                       coord_hash: Optional[CoordHash] = None, chunk_rows: int = 1 << 18) -> torch.Tensor:
    """The portable backend's arithmetic (centre offset first, then the other offsets in kernel order, each over
    its neighbour pairs in output-row order; bias last) with a bounded working set: neighbours are looked up one
    kernel offset at a time in a ``CoordHash`` (no [N, k^3] table) and gathered in chunks of ``chunk_rows``.
    With ``subdivided`` the centre GEMM runs on the parents (so it may round differently from the GEMM on the
    materialised children, BLAS blocking depends on the row count) and neighbours are gathered from the parents."""
    k = weight.shape[1]
    if weight.dtype != feats.dtype:
        weight = weight.to(feats.dtype)
    w = weight.permute(1, 2, 3, 4, 0).reshape(k ** 3, weight.shape[4], weight.shape[0])
    if feats.shape[0] == 0:
        return feats.new_zeros((coords.shape[0], weight.shape[0]))
    if k == 1:
        out = pointwise_conv(feats, weight, None if bias is None else bias.to(feats.dtype))
        return _subdivide_rows(out) if subdivided else out
    centre = k ** 3 // 2
    acc = accumulate_dtype(feats.dtype)
    out = (feats @ w[centre]).to(acc)
    if subdivided:
        out = _subdivide_rows(out)
    table = coord_hash if coord_hash is not None else CoordHash(coords)
    offsets = kernel_offsets(k, coords.device)
    for off in range(k ** 3):
        if off == centre:
            continue
        shift = torch.cat([offsets.new_zeros(1), offsets[off]]).to(coords.dtype)
        neighbour = table.lookup(coords + shift)
        out_rows = torch.nonzero(neighbour >= 0).flatten()
        for start in range(0, out_rows.numel(), chunk_rows):
            rows = out_rows[start:start + chunk_rows]
            src = neighbour[rows]
            if subdivided:
                src = torch.div(src, 8, rounding_mode="floor")
            out.index_add_(0, rows, (feats.index_select(0, src) @ w[off]).to(acc))
        del neighbour, out_rows
    if bias is not None:
        out += bias.to(acc)
    return out.to(feats.dtype)


def _axis_blocks(e: int, subdivided: bool) -> tuple[list[int], list[int], list[list[int]]]:
    """For one axis and parent offset ``e`` in {-1, 0, 1}: the children of the output parent it reaches, the
    children of the neighbour parent it reads (``[0]`` for a subdivided input: one row per parent), and for
    each (input, output) child pair the kernel taps (d + 1) that connect them (possibly none or two)."""
    outs = [c for c in (0, 1) if any((c + d) // 2 == e for d in (-1, 0, 1))]
    ins = [0] if subdivided else [c for c in (0, 1) if any(2 * e + c - o in (-1, 0, 1) for o in (0, 1))]
    taps = [[[d + 1 for d in (-1, 0, 1) if ((o + d) // 2 == e if subdivided else 2 * e + i - o == d)]
             for o in outs] for i in ins]
    return outs, ins, taps


def _block_weight(w: torch.Tensor, ex: tuple, subdivided: bool) -> tuple:
    """The kernel block of parent offset ``ex`` (3 ints), [n_in * Cin, n_out * Cout], with the child slots it
    writes and reads (``_child_ids``) and the per-axis slices of the written children. ``w`` is
    [3, 3, 3, Cin, Cout]."""
    axes = [_axis_blocks(e, subdivided) for e in ex]
    cin, cout = w.shape[3], w.shape[4]
    n_in = [len(a[1]) for a in axes]
    n_out = [len(a[0]) for a in axes]
    block = w.new_zeros(*n_in, cin, *n_out, cout)
    for ix in range(n_in[0]):
        for iy in range(n_in[1]):
            for iz in range(n_in[2]):
                for ox in range(n_out[0]):
                    for oy in range(n_out[1]):
                        for oz in range(n_out[2]):
                            for tx in axes[0][2][ix][ox]:
                                for ty in axes[1][2][iy][oy]:
                                    for tz in axes[2][2][iz][oz]:
                                        block[ix, iy, iz, :, ox, oy, oz] += w[tx, ty, tz]
    out_span = tuple(slice(a[0][0], a[0][-1] + 1) for a in axes)  # an axis' reached children are contiguous
    return (block.reshape(n_in[0] * n_in[1] * n_in[2] * cin, -1), _child_ids(*(a[0] for a in axes)),
            _child_ids(*(a[1] for a in axes)), out_span)


def _child_ids(xs: list[int], ys: list[int], zs: list[int]) -> torch.Tensor:
    """Child slots ``4 cx + 2 cy + cz`` of the given per-axis children, in row-major order."""
    return torch.tensor([4 * x + 2 * y + z for x in xs for y in ys for z in zs], dtype=torch.int64)


class _ChunkScratch:
    """The gather and product buffers of one blocked convolution, reused by all its ranges and offsets.

    A fresh tensor per step costs more than the gather itself on CPU: glibc serves allocations over 32 MB with
    their own mapping and unmaps them on free, so every step's pages are faulted in anew (on the 2-core machine
    the full-size mesh decoder spent a fifth of its time in the kernel). Buffers grow to the largest step seen."""

    def __init__(self) -> None:
        self._flat: dict[str, torch.Tensor] = {}

    def _take(self, name: str, like: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        buf = self._flat.get(name)
        if buf is None or buf.numel() < rows * cols:
            self._flat.pop(name, None)  # free the smaller buffer before allocating its successor
            buf = self._flat[name] = like.new_empty(rows * cols)
        return buf[:rows * cols].view(rows, cols)

    def gather(self, feats: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
        """``feats[index]`` as ``rows`` rows (each holding ``len(index) // rows`` consecutive picks)."""
        picked = self._take("gather", feats, index.numel(), feats.shape[1])
        torch.index_select(feats, 0, index, out=picked)
        return picked.view(rows, -1)

    def product(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.mm(a, b, out=self._take("product", a, a.shape[0], b.shape[1]))


class _ParentOffset:
    """One non-centre parent offset of a blocked convolution: its kernel block, the child slots it reads and
    writes, and whether it runs over all parents (dense) or over its neighbour pairs only."""

    def __init__(self, index: int, block: torch.Tensor, out_ids: torch.Tensor, in_ids: torch.Tensor,
                 out_span: tuple, dense: bool):
        self.index, self.block, self.out_ids, self.in_ids = index, block, out_ids, in_ids
        self.out_span, self.dense = out_span, dense


class _BlockedConv:
    """A kernel-3 convolution on complete child blocks, prepared once (kernel blocks per parent offset, which
    offsets run dense) and computed for any range of output parents (:meth:`into`).

    Ranges are computed parent range by parent range, every offset for one range before the next range (output
    rows stay in cache, and the working set is bounded by the range, not by the input). Each output row sums the
    centre product, the other offsets in kernel order, then the bias, whatever the ranges: the sums do not depend
    on how the rows are split, up to the GEMM's own rounding for different row counts."""

    def __init__(self, feats: torch.Tensor, parent_map: NeighborMap, weight: torch.Tensor,
                 bias: Optional[torch.Tensor], subdivided: bool, dense_share: float):
        if weight.dtype != feats.dtype:
            weight = weight.to(feats.dtype)
        self.feats, self.table, self.subdivided = feats, parent_map.table, subdivided
        self.parents, self.cout = parent_map.num_voxels, weight.shape[0]
        self.acc = accumulate_dtype(feats.dtype)
        self.bias = None if bias is None else bias.to(self.acc)
        # taps meeting the same parent are summed once per call (a few MB), in the accumulation dtype
        w = weight.permute(1, 2, 3, 4, 0).to(self.acc)
        offsets = kernel_offsets(3)
        self.steps: list[_ParentOffset] = []
        for off in range(27):
            block, out_ids, in_ids, out_span = _block_weight(w, tuple(int(v) for v in offsets[off]), subdivided)
            block = block.to(feats.dtype)
            if off == 13:  # every parent is its own neighbour: one GEMM, no gather
                self.centre = block
                continue
            dense = int((self.table[:, off] >= 0).sum()) >= dense_share * self.parents
            self.steps.append(_ParentOffset(off, block, out_ids.to(feats.device), in_ids.to(feats.device),
                                            out_span, dense))
        self.parent_rows = feats.reshape(self.parents, -1)  # [P, Cin] or [P, 8 Cin]: a parent's inputs side by side
        self.scratch = _ChunkScratch()

    def range_parents(self, chunk_bytes: int) -> int:
        """Parents per range so that one range's gathered input and product stay near ``chunk_bytes``."""
        widest = max(max(s.block.shape) for s in self.steps) if self.steps else 1
        return max(1, chunk_bytes // max(1, 2 * widest * self.feats.element_size()))

    def into(self, lo: int, hi: int, out: torch.Tensor) -> torch.Tensor:
        """Children rows of parents [lo, hi) into ``out`` [8 (hi - lo), Cout] (accumulation dtype), bias included."""
        feats, n, cout = self.feats, hi - lo, self.cout
        flat = out.view(n, 8 * cout)
        centre = self.parent_rows[lo:hi]
        if self.acc == feats.dtype:
            torch.mm(centre, self.centre, out=flat)
        else:
            flat.copy_(centre @ self.centre)  # a half product joins the float32 sum
        slots = out.view(n, 2, 2, 2, cout)
        for step in self.steps:
            column = self.table[lo:hi, step.index]
            if step.dense:
                # missing neighbours read as zero rows: the extra products cost less than a scatter
                # (``index_add_`` runs at a fraction of memory speed on CPU)
                col = column.long()
                missing = torch.nonzero(col < 0).flatten()
                col = col.clamp(min=0)
                src = col if self.subdivided else col[:, None] * 8 + step.in_ids
                gathered = self.scratch.gather(feats, src.reshape(-1), n)
                gathered.index_fill_(0, missing, 0)  # only the missing rows are written, not a pass over all
                prod = self.scratch.product(gathered, step.block)
                part = slots[(slice(None),) + step.out_span]
                part += prod.view(part.shape)  # promotes a half product into the float32 sum
                continue
            rows = torch.nonzero(column >= 0).flatten()
            if not rows.numel():
                continue
            # Gathers and scatters address single child rows of the contiguous [rows, C] tensors: index_select /
            # index_add_ on a strided child slice are several times slower on CPU.
            src = column[rows].long()
            if not self.subdivided:
                src = src[:, None] * 8 + step.in_ids
            gathered = self.scratch.gather(feats, src.reshape(-1), rows.numel())
            prod = self.scratch.product(gathered, step.block).to(self.acc).reshape(-1, cout)
            out.index_add_(0, (rows[:, None] * 8 + step.out_ids).reshape(-1), prod)
        if self.bias is not None:
            out += self.bias
        return out


def blocked_sparse_conv3d(feats: torch.Tensor, parent_map: NeighborMap, weight: torch.Tensor,
                          bias: Optional[torch.Tensor], subdivided: bool = False,
                          chunk_bytes: int = 1 << 26, dense_share: float = 0.5) -> torch.Tensor:
    """Kernel-3 submanifold conv on complete child blocks, computed on the parents (module docstring).

    ``feats``: [8P, Cin] child rows (parent-major), or [P, Cin] parent rows with ``subdivided`` (each child copies
    its parent). ``parent_map``: kernel-3 neighbour map of the P parents. Returns [8P, Cout]. The output is
    computed range of parents by range of parents, each range's gathers and products about ``chunk_bytes``
    (bounded working set, reused buffers).

    An offset whose neighbour exists for at least ``dense_share`` of the parents runs over all parents (missing
    neighbours read as zero rows) and adds into the output's child slice in place: the extra products cost less
    than a scatter. Shells of voxels have 66-80% of their 27 parent neighbours. Sparser offsets multiply their
    neighbour pairs only and scatter them."""
    conv = _BlockedConv(feats, parent_map, weight, bias, subdivided, dense_share)
    out = feats.new_empty((8 * conv.parents, conv.cout))
    step = conv.range_parents(chunk_bytes)
    # half inputs: each range is summed in a float32 buffer of one range and rounded into the half output, so no
    # whole float32 copy of the output sits beside it
    wide = None if conv.acc == feats.dtype else feats.new_empty((8 * min(step, conv.parents), conv.cout),
                                                                dtype=conv.acc)
    for lo in range(0, conv.parents, step):
        hi = min(conv.parents, lo + step)
        if wide is None:
            conv.into(lo, hi, out[8 * lo:8 * hi])
        else:
            out[8 * lo:8 * hi].copy_(conv.into(lo, hi, wide[:8 * (hi - lo)]))
    return out


def blocked_sparse_conv3d_chunks(feats: torch.Tensor, parent_map: NeighborMap, weight: torch.Tensor,
                                 bias: Optional[torch.Tensor], subdivided: bool = False, chunk_parents: int = 8192,
                                 chunk_bytes: int = 1 << 26, dense_share: float = 0.5
                                 ) -> Iterator[tuple[int, int, torch.Tensor]]:
    """:func:`blocked_sparse_conv3d`'s output, ``chunk_parents`` parents at a time: yields (first parent, end
    parent, a new [8 (end - first), Cout] tensor of their children's rows) in row order. Only one chunk's output
    is alive at a time here, so a caller that consumes each chunk never holds the whole [8P, Cout] output. Each
    row sums the same products in the same order as in the whole output; only the GEMMs' row counts differ
    (bit-identical where the BLAS rounds a row independently of the others, as MKL does here)."""
    conv = _BlockedConv(feats, parent_map, weight, bias, subdivided, dense_share)
    step = min(conv.range_parents(chunk_bytes), max(1, chunk_parents))
    for first in range(0, conv.parents, chunk_parents):
        end = min(conv.parents, first + chunk_parents)
        out = feats.new_empty((8 * (end - first), conv.cout), dtype=conv.acc)
        for lo in range(first, end, step):
            hi = min(end, lo + step)
            conv.into(lo, hi, out[8 * (lo - first):8 * (hi - first)])
        yield first, end, out.to(feats.dtype)


def _map_for(coords, k, nmap):
    return nmap if nmap is not None else _neighbor_map(coords, k)


# On CPU the output rows are processed in blocks of about this many bytes per thread (a core's L2 cache): for
# each block, every kernel offset's pairs that write into it are gathered, multiplied and scattered while the
# block and its neighbours' rows stay in cache (rows ordered like the coordinates are spatially close). One pass
# per offset over whole tensors streams every row through memory three times (gather, GEMM, scatter): 1.3-1.4x the
# time of the same products as one dense GEMM at 20k voxels x 128 channels on one thread, against about 1.1x in
# blocks. GPUs want the opposite, one launch per offset.
CPU_BLOCK_BYTES_PER_THREAD = 1 << 20
# Pair lists of larger maps are built for this many output rows at a time (their memory stays bounded).
PAIR_SPAN_ROWS = 1 << 16


def _output_block_rows(feats: torch.Tensor, cout: int) -> int:
    """Output rows per block: cache-sized on CPU, all of them elsewhere."""
    if feats.device.type != "cpu":
        return max(1, feats.shape[0])
    # the output block is summed in the accumulation dtype (float32 for half inputs): it sets the bytes per row
    out_bytes = cout * torch.empty((), dtype=accumulate_dtype(feats.dtype)).element_size()
    row_bytes = max(1, feats.shape[1] * feats.element_size(), out_bytes)
    return max(64, CPU_BLOCK_BYTES_PER_THREAD * torch.get_num_threads() // row_bytes)


def _block_pairs(nmap: NeighborMap, lo: int, hi: int, block: int) -> list[list[tuple[int, torch.Tensor, torch.Tensor]]]:
    """For each block of ``block`` output rows in [lo, hi): (offset, input rows, output rows) of the neighbour
    pairs writing into it, for every offset but the centre, in kernel order (output rows ascending). The whole
    map's blocks are views of its per-offset pairs (kept once with the map, whatever the block size)."""
    centre = nmap.table.shape[1] // 2
    starts = torch.arange(lo, hi, block, device=nmap.table.device)
    blocks = [[] for _ in range(starts.numel())]
    for off in range(nmap.table.shape[1]):
        if off == centre:
            continue
        if lo == 0 and hi == nmap.num_voxels:
            in_rows, out_rows = nmap.pairs(off)
        else:
            column = nmap.table[lo:hi, off]
            out_rows = torch.nonzero(column >= 0).squeeze(1)
            in_rows, out_rows = column[out_rows].long(), out_rows + lo
        bounds = torch.searchsorted(out_rows, starts).tolist() + [out_rows.numel()]
        for b, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
            if e > s:
                blocks[b].append((off, in_rows[s:e], out_rows[s:e]))
    return blocks


def _pair_blocks(nmap: NeighborMap, block: int):
    """The pair lists of all output blocks (see :func:`_block_pairs`): kept with the map while its pairs are
    small enough to keep (``NeighborMap.PAIR_CACHE_MAX_VOXELS``), else built span by span on each call."""
    n = nmap.num_voxels
    if n <= nmap.PAIR_CACHE_MAX_VOXELS:
        yield from nmap.extra(("pair blocks", block), lambda m: _block_pairs(m, 0, n, block))
        return
    span = max(block, PAIR_SPAN_ROWS // block * block)
    for lo in range(0, n, span):
        yield from _block_pairs(nmap, lo, min(n, lo + span), block)


def _accumulate_pairs(out: torch.Tensor, feats: torch.Tensor, ws: tuple, blocks, block_rows: int) -> None:
    """``out[out_rows] += feats[in_rows] @ ws[off]`` for every (offset, input rows, output rows) of ``blocks``.

    On CPU a block's output rows are distinct per offset, so one block's rows bound every gather and product:
    two buffers of that size serve all steps (``out=``: no allocation per step, and they stay in cache), unless
    the inputs need gradients (``out=`` refuses them). Other devices allocate (their caching allocators reuse
    memory, and a block there is the whole input). On CPU the sum is a ``scatter_add_``, which ``index_add_``
    forwards to after per-call checks that cost it a third more time on cache-sized blocks; the sums are the
    same."""
    cpu, cout = out.device.type == "cpu", out.shape[1]
    reuse = cpu and not (torch.is_grad_enabled() and (feats.requires_grad or ws[0].requires_grad))
    widen = feats.dtype != out.dtype  # a half product joins the float32 sum
    if reuse:
        rows = min(block_rows, feats.shape[0])
        gathered, product = feats.new_empty(rows, feats.shape[1]), feats.new_empty(rows, cout)
        # its float32 copy also goes to a kept buffer: a fresh one per step would page-fault in every time
        widened = out.new_empty(rows, cout) if widen else None
    for steps in blocks:
        for off, in_rows, out_rows in steps:
            m = in_rows.numel()
            if reuse:
                prod = torch.mm(torch.index_select(feats, 0, in_rows, out=gathered[:m]), ws[off], out=product[:m])
                if widen:
                    prod = widened[:m].copy_(prod)
            else:
                prod = (feats.index_select(0, in_rows) @ ws[off]).to(out.dtype)
            if cpu:
                out.scatter_add_(0, out_rows.unsqueeze(1).expand(m, cout), prod)
            else:
                out.index_add_(0, out_rows, prod)


# Output rows per block of :func:`im2col_sparse_conv3d` (the block's gathered [rows, k^3 Cin] input is 14 MB at
# 128 bf16 channels). Measured on the 16-core host (AMX, bf16, 20k shell voxels x 128 / 256 channels, 4-16
# threads): 2048 rows beat 512 and 8192 at every thread count, and the whole input at once was the slowest.
IM2COL_BLOCK_ROWS = 2048
# Inputs wider than this keep the pairs: there the GEMM, not the gathers, is the cost, and one GEMM over all k^3
# taps multiplies the missing neighbours too. 16-core AMX host, bf16, 5,423 shell voxels at 32^3 (17.7 neighbours
# a row), medians of 7 (2026-11-28): 1024 -> 1024 channels one GEMM 98.5 ms, pairs 76.4 (4 threads 308 / 234);
# 1024 -> 128 28.0 / 18.1; 512 -> 512 24.3 / 21.9 (4 threads 37.6 / 38.8); 256 -> 256 6.4 / 10.9.
IM2COL_MAX_CHANNELS = 512


def im2col_wanted(feats: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`torch_sparse_conv3d` runs as :func:`im2col_sparse_conv3d`: half inputs on the CPU, no
    gradients. There the per-offset GEMMs are small and each one's product is rounded to half then widened and
    scattered; one GEMM over all k^3 taps (missing neighbours multiplied as zero rows, about 2x the products of
    a surface) runs at the CPU's bf16 GEMM rate and rounds once. 16-core AMX host, bf16, 20k shell voxels x
    128 / 256 channels: 2.0 / 1.6x faster at 16 threads, 1.4-1.7 / 1.1-1.2x at 4 (two hosts), 1.9 / 1.3x at 2;
    on a third host 1.14 / 0.94x at 16 threads, 1.31 / 0.92x at 2 (docs/CPU_SPEED.md). float32 keeps the
    pairs: there the doubled products cost more than the gathers and scatters they replace (1.3-1.8x slower at
    4-8 threads and on 256 channels; 1.26x faster only at 16 threads on 128). Inputs wider than
    ``IM2COL_MAX_CHANNELS`` keep the pairs as well."""
    return (feats.device.type == "cpu" and feats.dtype in (torch.float16, torch.bfloat16)
            and feats.shape[1] <= IM2COL_MAX_CHANNELS
            and not (torch.is_grad_enabled() and (feats.requires_grad or weight.requires_grad)))


def im2col_sparse_conv3d(feats: torch.Tensor, nmap: NeighborMap, weight: torch.Tensor,
                         bias: Optional[torch.Tensor], block_rows: Optional[int] = None) -> torch.Tensor:
    """Submanifold conv as one GEMM per block of ``block_rows`` output rows: each row's k^3 neighbour rows
    gathered side by side ([rows, k^3 Cin]; a missing neighbour reads a zero row) times the kernel as a
    [k^3 Cin, Cout] matrix, the bias added in the GEMM (``addmm``). Each output row is rounded once, from the
    GEMM's float32 accumulator. ``block_rows``: default ``IM2COL_BLOCK_ROWS``; one gather buffer of that many
    rows serves every block."""
    n, cin = feats.shape
    taps, cout = nmap.table.shape[1], weight.shape[0]
    w = weight.to(feats.dtype).permute(1, 2, 3, 4, 0).reshape(taps * cin, cout)
    bias = None if bias is None else bias.to(feats.dtype)
    # row n: the zero row that missing neighbours read (about half a surface's taps: zeroing them in the
    # gathered block instead was 1.3-1.7x slower for the whole convolution)
    padded = torch.cat([feats, feats.new_zeros(1, cin)])
    out = feats.new_empty(n, cout)
    rows = max(1, min(block_rows or IM2COL_BLOCK_ROWS, n))
    gathered = feats.new_empty(rows * taps, cin)
    for lo in range(0, n, rows):
        hi = min(n, lo + rows)
        index = _im2col_rows(nmap, lo, hi)
        block = torch.index_select(padded, 0, index, out=gathered[:index.numel()]).view(hi - lo, taps * cin)
        if bias is None:
            torch.mm(block, w, out=out[lo:hi])
        else:
            torch.addmm(bias, block, w, out=out[lo:hi])
    return out


# When the upsampled convolution runs on the parents. Each parent is multiplied by all k^3 taps once (against a
# surface's 9-14 present neighbours, pairs, or all 27, one GEMM, per output row; a 2x upsampling of a shell gives
# 3.5-5 rows a parent), and each output row then sums k^3 Cout-wide products where the plain convolution gathers its
# neighbours' Cin-wide rows: it pays for wide inputs only. 2-core machine, float32, 20k shell voxels from 5.4k
# parents, 2 threads: 2048 -> 128 channels 0.62 s against 1.56 s; 256 -> 128 the same (154 / 152 ms); 128 -> 128
# and 32 -> 32 slower (124 / 80 ms, 14 / 11 ms).
UPSAMPLED_MIN_CHILDREN = 2
UPSAMPLED_MIN_WIDENING = 4  # Cin / Cout


def upsampled_wanted(num_rows: int, parent_feats: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`upsampled_sparse_conv3d` runs (see :func:`backends.sparse_conv3d_upsampled`): at least
    ``UPSAMPLED_MIN_CHILDREN`` output rows a parent, an input ``UPSAMPLED_MIN_WIDENING`` times as wide as the output,
    no gradients (its buffers are written with ``out=``)."""
    return (num_rows >= UPSAMPLED_MIN_CHILDREN * parent_feats.shape[0]
            and parent_feats.shape[1] >= UPSAMPLED_MIN_WIDENING * weight.shape[0]
            and not (torch.is_grad_enabled() and (parent_feats.requires_grad or weight.requires_grad)))


def upsampled_sparse_conv3d(parent_feats: torch.Tensor, parent_index: torch.Tensor, nmap: NeighborMap,
                            weight: torch.Tensor, bias: Optional[torch.Tensor],
                            block_rows: Optional[int] = None) -> torch.Tensor:
    """Submanifold conv of ``parent_feats[parent_index]`` (a nearest-neighbour upsampling: output row i copies
    parent row ``parent_index[i]``) at the map's voxels, without the upsampled rows: every parent row times every
    tap's kernel as one GEMM ([P, Cin] @ [Cin, k^3 Cout]), then each output row sums, for each present neighbour,
    the product of that neighbour's parent for that tap (a missing neighbour reads a zero row). The products are
    the conv's own (a neighbour's row is its parent's); each row's sum over the taps runs in the accumulation dtype
    (float32 for half inputs, rounded once), then the bias. ``block_rows``: output rows per gather
    (default ``IM2COL_BLOCK_ROWS``)."""
    p, cin = parent_feats.shape
    n, taps, cout = nmap.num_voxels, nmap.table.shape[1], weight.shape[0]
    acc = accumulate_dtype(parent_feats.dtype)
    w = weight.to(parent_feats.dtype).permute(4, 1, 2, 3, 0).reshape(cin, taps * cout)
    # row p * taps + t: parent p's product for tap t; the last row is the zero that missing neighbours read
    products = w.new_empty(p * taps + 1, cout)
    torch.mm(parent_feats, w, out=products[:-1].view(p, taps * cout))
    products[-1].zero_()
    out = parent_feats.new_empty(n, cout)
    rows = max(1, min(block_rows or IM2COL_BLOCK_ROWS, n))
    gathered = products.new_empty(rows * taps, cout)
    summed = out.new_empty(rows, cout, dtype=acc) if acc != out.dtype else None
    bias = None if bias is None else bias.to(acc)
    for lo in range(0, n, rows):
        hi = min(n, lo + rows)
        index = _upsampled_rows(nmap, parent_index, p, lo, hi)
        block = torch.index_select(products, 0, index, out=gathered[:(hi - lo) * taps])
        total = torch.sum(block.view(hi - lo, taps, cout), dim=1, dtype=acc,
                          out=out[lo:hi] if summed is None else summed[:hi - lo])
        if bias is not None:
            total += bias
        if summed is not None:
            out[lo:hi] = total
    return out


def _memoised_rows(nmap: NeighborMap, key: str, build, lo: int, hi: int, source=None) -> torch.Tensor:
    """``build(table rows)`` for output rows [lo, hi): built once for the whole map and kept with it (the steps of
    a sampling run share it: converting and masking the int32 table at every call cost about 10 ms a stage-2 call
    at 16 threads) while the map is small enough to keep such a copy (``NeighborMap.PAIR_CACHE_MAX_VOXELS``),
    else built for those rows only. ``source``: another input of ``build``; the kept copy is rebuilt when a call
    brings another one."""
    if nmap.num_voxels > nmap.PAIR_CACHE_MAX_VOXELS:
        return build(nmap.table[lo:hi]).reshape(-1)
    kept = nmap.extra(key, lambda m: {})
    if "rows" not in kept or kept["source"] is not source:
        kept.update(source=source, rows=build(nmap.table))
    return kept["rows"][lo:hi].reshape(-1)


def _im2col_rows(nmap: NeighborMap, lo: int, hi: int) -> torch.Tensor:
    """For output rows [lo, hi) and each tap, the row of :func:`im2col_sparse_conv3d`'s padded input: the neighbour,
    or the zero row (``num_voxels``) for a missing one; flattened row-major."""
    return _memoised_rows(nmap, "im2col rows", lambda t: t.long().masked_fill_(t < 0, nmap.num_voxels), lo, hi)


def _upsampled_rows(nmap: NeighborMap, parent_index: torch.Tensor, num_parents: int, lo: int, hi: int) -> torch.Tensor:
    """For output rows [lo, hi) and each tap, the row of :func:`upsampled_sparse_conv3d`'s products: the neighbour's
    parent times k^3 plus the tap, or the zero row for a missing neighbour; flattened row-major."""
    taps = nmap.table.shape[1]

    def build(table: torch.Tensor) -> torch.Tensor:
        rows = parent_index.long()[table.long().clamp_(min=0)] * taps + torch.arange(taps, device=table.device)
        return rows.masked_fill_(table < 0, num_parents * taps)
    return _memoised_rows(nmap, "upsampled rows", build, lo, hi, source=parent_index)


def pairs_sparse_conv3d(feats: torch.Tensor, nmap: NeighborMap, weight: torch.Tensor,
                        bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Gather-GEMM-scatter over the neighbour pairs of each kernel offset; only existing pairs are multiplied
    (a surface has ~9-13 of 27 neighbours), and the centre offset is one dense GEMM. On CPU the output rows go in
    cache-sized blocks (``CPU_BLOCK_BYTES_PER_THREAD``), each offset's pairs into a block in turn; each output
    row sums centre, offsets in kernel order, then bias (half products in a float32 sum)."""
    k = weight.shape[1]
    cout = weight.shape[0]
    ws = weight.permute(1, 2, 3, 4, 0).reshape(k ** 3, feats.shape[1], cout).unbind(0)  # K x [Cin, Cout]
    out = (feats @ ws[(k ** 3) // 2]).to(accumulate_dtype(feats.dtype))
    block = _output_block_rows(feats, cout)
    _accumulate_pairs(out, feats, ws, _pair_blocks(nmap, block), block)
    if bias is not None:
        out += bias
    return out.to(feats.dtype)


@register(Family.SPARSE_CONV, "torch", devices=("cpu", "cuda", "mps"), dtypes=FLOAT_DTYPES + (torch.float64,),
          priority=0, lean=True)
def torch_sparse_conv3d(feats, coords, weight, bias=None, nmap=None):
    """The portable backend: :func:`im2col_sparse_conv3d` for half inputs on the CPU without gradients (see
    :func:`im2col_wanted`), :func:`pairs_sparse_conv3d` otherwise."""
    nmap = _map_for(coords, weight.shape[1], nmap)
    if im2col_wanted(feats, weight):
        return im2col_sparse_conv3d(feats, nmap, weight, bias)
    return pairs_sparse_conv3d(feats, nmap, weight, bias)
