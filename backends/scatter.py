"""Scatter-sums into narrow rows and the unique of bounded integer codes: torch's results, faster on the CPU.

* ``index_add_ranked_``: ``out.index_add_(0, index, src)`` bit for bit. PyTorch's CPU ``index_add_`` adds one
  source row at a time on one thread (targets repeat, so rows cannot be split over threads), which is all of its
  cost for rows of 1-10 floats: the mesh extraction's corner and dual-vertex sums took 1.9 s of a 9 s full-size
  mesh decode on 16 threads, 1.2 s of it for one [1.75 M, 10] sum of 11.8 M rows. Given each row's *rank* (the
  number of earlier rows with the same target), no two rows of one rank share a target, so each rank is one
  parallel gather, add and scatter; ranks taken in increasing order add every target's rows in row order, the
  order ``index_add_`` uses, so the float sums round the same. Other devices, and CPUs with fewer than 4 threads
  (where the passes gain nothing), run ``index_add_``.
* ``slot_ranks``: those ranks for an [M, S] index in which a target appears at most once per row and once per
  column (the eight corners of distinct voxels: the vertex of corner k of voxel i), with each target's count.
* ``SlotScatter``: both together for an [M, S] index whose rows' values arrive in row chunks (the mesh
  extraction's corner values, voxel chunk by voxel chunk): ranks computed once where the passes run.
* ``unique_codes``: ``torch.unique`` (sorted values, inverse, counts) of integer codes known to lie in
  ``[0, size)``. Where ``size`` is not much larger than the number of codes (voxel-grid codes at 256^3), a
  presence map over all codes replaces the sort, whose CPU kernel runs on one thread (230 ms for 11.8 M codes on
  16 threads, against about 50 ms for the map).
* ``unique_pairs``: the same for pair codes ``first * size + second`` whose range is far larger (grid edges as
  vertex pairs), given a class per pair that, with ``first``, fixes ``second`` (the edge's direction): the map runs
  over ``first * num_classes + class``; where the input does not have that structure it falls back to the sort.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from .sorting import unique

# Below this many rows one index_add_ costs less than the passes' per-op overhead (same result either way).
RANKED_MIN_ROWS = 4096
# Below this many threads the passes gain nothing (2 threads, idle: ranks 100 ms + passes 145 ms against 237 ms of
# index_add_ for 3 M rows) and lose much when the cores are shared (12x slower with both cores of a 2-core machine
# busy elsewhere: many short parallel regions); from 4 threads they gain 2.4x (4) to 8x (16).
RANKED_MIN_THREADS = 4
# The presence map is used while the code range is at most this many times the number of codes.
DENSE_UNIQUE_FACTOR = 4
# Voxels whose corner ranks are computed together (bounds the [n, S, S] comparison).
_RANK_CHUNK = 1 << 17


def index_add_ranked_(out: torch.Tensor, index: torch.Tensor, src: torch.Tensor, ranks: torch.Tensor,
                      num_ranks: int, passes: Optional[bool] = None) -> torch.Tensor:
    """``out.index_add_(0, index, src)`` (same values bit for bit), where ``ranks[i]`` (< ``num_ranks``) is the
    number of rows before row i, in this call and in earlier calls adding into ``out``, whose target is
    ``index[i]``. ``passes``: True / False forces the ranked passes (CPU) / ``index_add_``; None picks (see the
    module docstring). Returns ``out``."""
    if index.dim() != 1 or ranks.shape != index.shape or src.shape[0] != index.shape[0]:
        raise ValueError(f"index {tuple(index.shape)}, ranks {tuple(ranks.shape)} and src {tuple(src.shape)} "
                         "must have one entry per row")
    if not _use_passes(out.device, index.numel(), passes):
        return out.index_add_(0, index, src)
    for rank in range(num_ranks):
        rows = torch.nonzero(ranks == rank).squeeze(1)
        if rows.numel() == 0:
            continue
        targets = index.index_select(0, rows).long()
        # targets are distinct within a rank: a plain (parallel) scatter, no accumulation
        out.index_put_((targets,), out.index_select(0, targets) + src.index_select(0, rows))
    return out


def _use_passes(device: torch.device, rows: int, passes: Optional[bool]) -> bool:
    """Whether to run the ranked passes: on the CPU only; ``passes`` forces, else where they beat ``index_add_``
    (the result is the same either way)."""
    if device.type != "cpu":
        return False
    if passes is not None:
        return passes
    return rows >= RANKED_MIN_ROWS and torch.get_num_threads() >= RANKED_MIN_THREADS


def slot_ranks(index: torch.Tensor, num_targets: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """For ``index`` [M, S] (a target at most once per row and once per column): ``(ranks, counts)``, ranks
    [M, S] int8 the number of entries before each (in row-major order) with the same target, counts
    [num_targets] int64 the entries of each target. Raises where a target repeats within a column."""
    if index.dim() != 2 or index.shape[1] > 127:
        raise ValueError(f"slot_ranks wants an [M, S] index with S <= 127, got {tuple(index.shape)}")
    rows, slots = index.shape
    dtype = torch.int32 if rows < 2 ** 31 - 1 else torch.int64
    # table[t, s]: the row whose column s holds target t, `rows` where none does
    table = torch.full((num_targets, slots), rows, dtype=dtype, device=index.device)
    row_ids = torch.arange(rows, dtype=dtype, device=index.device)
    for s in range(slots):
        column = index[:, s].long()
        table[column, s] = row_ids
        if not bool((table[column, s] == row_ids).all()):
            raise ValueError(f"slot_ranks: a target repeats within column {s}")
    counts = (table < rows).sum(dim=1)
    ranks = torch.empty(rows, slots, dtype=torch.int8, device=index.device)
    for start in range(0, rows, _RANK_CHUNK):
        part = index[start:start + _RANK_CHUNK]
        holders = table[part.reshape(-1).long()].view(part.shape[0], slots, slots)  # each target's rows
        # entries of a target come from distinct rows: those of smaller rows come first
        ranks[start:start + part.shape[0]] = (holders < row_ids[start:start + part.shape[0], None, None]).sum(
            dim=-1, dtype=torch.int8)
    return ranks, counts


def unique_codes(codes: torch.Tensor, size: int, return_inverse: bool = False, return_counts: bool = False
                 ) -> Union[torch.Tensor, Tuple[torch.Tensor, ...]]:
    """``torch.unique(codes, sorted=True, return_inverse=..., return_counts=...)`` for integer ``codes`` in
    ``[0, size)`` (the values, inverse and counts are the same; codes outside the range raise)."""
    flat = codes.reshape(-1)
    if flat.dtype.is_floating_point or flat.dtype == torch.bool:
        raise TypeError(f"unique_codes wants integer codes, got {codes.dtype}")
    if size > DENSE_UNIQUE_FACTOR * flat.numel() or flat.numel() == 0:
        return unique(codes, return_inverse=return_inverse, return_counts=return_counts)
    if bool((flat < 0).any()) or bool((flat >= size).any()):
        raise ValueError(f"unique_codes: codes outside [0, {size})")
    present = torch.zeros(size, dtype=torch.bool, device=flat.device)
    present[flat.long()] = True
    values = torch.nonzero(present).squeeze(1).to(codes.dtype)
    result = [values]
    if return_inverse:
        slot_dtype = torch.int32 if values.numel() < 2 ** 31 else torch.int64
        slot = torch.cumsum(present, 0, dtype=slot_dtype)  # 1 + the unique's index at present codes
        result.append((slot[flat.long()].long() - 1).reshape(codes.shape))
    if return_counts:
        result.append(torch.bincount(flat.long(), minlength=size)[values.long()])
    return values if len(result) == 1 else tuple(result)


class SlotScatter:
    """``out.index_add_(0, index.reshape(-1), values)`` for an [M, S] ``index`` (see :func:`slot_ranks`) whose
    values arrive in row chunks: ``add_(out, start, values)`` adds rows ``start:start + n`` of the index, the
    values [n, S, C...] (or [n * S, C...]) in row-major order. The sums equal one ``index_add_`` over all rows bit for
    bit whatever the chunks, as long as the chunks come in row order. ``counts``: entries per target. ``passes``
    as for :func:`index_add_ranked_` (decided here, once)."""

    def __init__(self, index: torch.Tensor, num_targets: int, passes: Optional[bool] = None):
        if index.dim() != 2:
            raise ValueError(f"SlotScatter wants an [M, S] index, got {tuple(index.shape)}")
        self.index = index
        self.ranks = None
        if _use_passes(index.device, index.numel(), passes):
            self.ranks, self.counts = slot_ranks(index, num_targets)
        else:
            self.counts = torch.bincount(index.reshape(-1).long(), minlength=num_targets)

    def add_(self, out: torch.Tensor, start: int, values: torch.Tensor) -> torch.Tensor:
        slots = self.index.shape[1]
        values = values.reshape(-1, *out.shape[1:])  # [n * S, C...]: the entries of rows start:start + n
        end = start + values.shape[0] // slots
        if values.shape[0] % slots or start < 0 or end > self.index.shape[0]:
            raise ValueError(f"{values.shape[0]} values for rows from {start} of an [{self.index.shape[0]}, "
                             f"{slots}] index")
        index = self.index[start:end].reshape(-1)
        if self.ranks is None:
            return out.index_add_(0, index, values)
        return index_add_ranked_(out, index, values, self.ranks[start:end].reshape(-1), slots, passes=True)


def unique_pairs(first: torch.Tensor, second: torch.Tensor, size: int, classes: torch.Tensor, num_classes: int,
                 return_inverse: bool = False, return_counts: bool = False
                 ) -> Union[torch.Tensor, Tuple[torch.Tensor, ...]]:
    """``torch.unique(first.long() * size + second, sorted=True, ...)`` (int64 codes) for ``first`` in ``[0, n)``, ``second`` in
    ``[0, size)`` and ``classes`` in ``[0, num_classes)`` (same shapes). Fast where ``(first, class)`` determines
    ``second`` and, for each ``first``, a larger class means a larger ``second`` (grid edges from each vertex: one
    per direction, vertices numbered in grid order); otherwise (checked) the codes go through :func:`unique`."""
    def by_sort():
        return unique(first.long() * size + second, return_inverse=return_inverse, return_counts=return_counts)

    flat_first, flat_second, flat_class = first.reshape(-1), second.reshape(-1), classes.reshape(-1)
    if not flat_first.numel():
        return by_sort()
    bound = int(flat_first.max()) + 1
    keys, inverse, counts = unique_codes(flat_first.long() * num_classes + flat_class, bound * num_classes,
                                         return_inverse=True, return_counts=True)
    pair_second = torch.empty(keys.shape[0], dtype=flat_second.dtype, device=flat_second.device)
    pair_second[inverse] = flat_second  # any member's: equal for all members where the structure holds
    pair_first = keys // num_classes
    same_first = pair_first[1:] == pair_first[:-1]
    structured = bool((pair_second[inverse] == flat_second).all()) and \
        bool((pair_second[1:][same_first] > pair_second[:-1][same_first]).all())
    if not structured:
        return by_sort()
    # distinct pairs, sorted by (first, second): the sorted unique codes, with the keys' inverse and counts
    result = [pair_first * size + pair_second]
    if return_inverse:
        result.append(inverse.reshape(first.shape))
    if return_counts:
        result.append(counts)
    return result[0] if len(result) == 1 else tuple(result)
