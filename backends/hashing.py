"""Coordinate hashing and neighbour maps built from a sort, with no dense grid and no Python loop over voxels.

A voxel ``(b, x, y, z)`` is linearised into one integer key; the keys are sorted once and every lookup is a
``searchsorted`` into them. The same code runs on CPU, MPS and CUDA because it only uses tensor ops.

Keys are int32 whenever the linearised extent fits (always for one or a few 64^3 / 256^3 grids): half the memory,
and int64 sort is broken on MPS on some macOS versions (see ``sorting.py``, which does the sort). Key arithmetic
stays in int64; only the stored, sorted and searched keys are narrowed.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional

import torch

from .sorting import sort as _safe_sort

INT32_KEY_LIMIT = 2 ** 31 - 1


def check_coords(coords: torch.Tensor, name: str = "coords", values: bool = True) -> None:
    """Validate a coordinate tensor: integer [N, 4] (batch, x, y, z), and (``values``) non-negative."""
    if not isinstance(coords, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(coords).__name__}")
    if coords.dim() != 2 or coords.shape[1] != 4:
        raise ValueError(f"{name} must have shape [N, 4] (batch, x, y, z), got {tuple(coords.shape)}")
    if coords.dtype.is_floating_point or coords.dtype == torch.bool or coords.is_complex():
        raise TypeError(f"{name} must be an integer tensor (int32 as upstream), got {coords.dtype}")
    if values and coords.numel() and bool((coords < 0).any()):
        raise ValueError(f"{name} has negative entries; sparse coordinates must be >= 0 (shift them first)")


class CoordHash:
    """Sorted-key hash of ``coords`` [N, 4]: ``lookup(query)`` returns the row index of each query or -1.

    Duplicated rows are an error: a submanifold sparse tensor holds each voxel once.
    """

    def __init__(self, coords: torch.Tensor, *, check_duplicates: bool = True,
                 key_dtype: Optional[torch.dtype] = None):
        check_coords(coords)
        self.device = coords.device
        self.num = coords.shape[0]
        c = coords.to(torch.int64)
        if self.num:
            self.extent = (c.max(dim=0).values + 1).tolist()
        else:
            self.extent = [1, 1, 1, 1]
        b, x, y, z = self.extent
        if b * x * y * z >= 2 ** 62:
            raise ValueError(f"coordinate extent {self.extent} is too large to linearise into int64 keys")
        fits = b * x * y * z <= INT32_KEY_LIMIT
        if key_dtype is None:
            key_dtype = torch.int32 if fits else torch.int64
        elif key_dtype == torch.int32 and not fits:
            raise ValueError(f"coordinate extent {self.extent} does not fit int32 keys; use int64")
        self.key_dtype = key_dtype
        self._strides = torch.tensor([x * y * z, y * z, z, 1], dtype=torch.int64, device=self.device)
        keys = (c * self._strides).sum(dim=1).to(key_dtype)
        self.sorted_keys, self.order = _safe_sort(keys)
        if check_duplicates and self.num > 1 and bool((self.sorted_keys[1:] == self.sorted_keys[:-1]).any()):
            dup = int(self.sorted_keys[1:][self.sorted_keys[1:] == self.sorted_keys[:-1]][0])
            at = self._unravel(dup)
            raise ValueError(f"coords contain duplicate rows (e.g. {at}); each voxel must appear once")

    def _unravel(self, key: int) -> list[int]:
        out = []
        for s in self._strides.tolist():
            out.append(key // s)
            key %= s
        return out

    def keys_of(self, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(int64 keys, in-range mask) of query rows under this hash's linearisation."""
        q = query.to(device=self.device, dtype=torch.int64)
        extent = torch.tensor(self.extent, dtype=torch.int64, device=self.device)
        inside = ((q >= 0) & (q < extent)).all(dim=-1)
        return (q * self._strides).sum(dim=-1), inside

    def lookup_keys(self, keys: torch.Tensor, inside: torch.Tensor) -> torch.Tensor:
        """Row of each int64 key (from :meth:`keys_of`), -1 where absent or not ``inside``."""
        if self.num == 0:
            return torch.full(keys.shape, -1, dtype=torch.int64, device=self.device)
        if keys.dtype != self.key_dtype:
            # keys of out-of-range queries may not fit; they are masked by `inside`, so clamp before narrowing
            keys = torch.where(inside, keys, torch.zeros_like(keys)).to(self.key_dtype)
        pos = torch.searchsorted(self.sorted_keys, keys.reshape(-1)).reshape(keys.shape)
        pos = pos.clamp_(max=self.num - 1)
        found = inside & (self.sorted_keys[pos] == keys)
        return torch.where(found, self.order[pos], torch.full_like(pos, -1))

    def lookup(self, query: torch.Tensor) -> torch.Tensor:
        """Row index in the hashed coords of every query row ([..., 4]), -1 where absent or out of range."""
        if query.shape[-1] != 4:
            raise ValueError(f"query must have shape [..., 4], got {tuple(query.shape)}")
        keys, inside = self.keys_of(query)
        return self.lookup_keys(keys, inside)


def kernel_offsets(kernel_size: int, device=None) -> torch.Tensor:
    """[k^3, 3] offsets in spconv's weight order: (kx, ky, kz) row-major, offset = index - k // 2."""
    r = kernel_size // 2
    grid = list(itertools.product(range(kernel_size), repeat=3))
    return torch.tensor(grid, dtype=torch.int64, device=device) - r


@dataclass
class NeighborMap:
    """For each voxel and kernel offset, the row of the neighbour or -1 (``table`` [N, k^3], int32: half the
    memory of int64, and what GPU kernels read).

    Backends derive what they need from the table (e.g. a row order for a GPU kernel) through :meth:`extra`,
    memoised here so layers at the same coordinates share it.
    """

    table: torch.Tensor
    kernel_size: int
    _extras: dict = field(default_factory=dict, repr=False)

    @property
    def num_voxels(self) -> int:
        return self.table.shape[0]

    # Maps up to this many voxels keep their pair lists (a few MB); larger ones recompute them per use, since
    # storing every pair would cost another ~N x 27 indices on exactly the inputs where memory is tight.
    PAIR_CACHE_MAX_VOXELS = 1 << 18

    def pairs(self, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input rows, output rows) of the neighbour pairs of one kernel offset, output rows ascending."""
        if self.num_voxels <= self.PAIR_CACHE_MAX_VOXELS:
            return self.extra(("pairs", offset), lambda m: m._pairs_of(offset))
        return self._pairs_of(offset)

    def _pairs_of(self, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        column = self.table[:, offset]
        out_rows = torch.nonzero(column >= 0).squeeze(1)
        return column[out_rows].long(), out_rows

    def extra(self, key, build):
        """Memoised derived data for backends (e.g. an int32 copy for a GPU kernel)."""
        if key not in self._extras:
            self._extras[key] = build(self)
        return self._extras[key]


def build_neighbor_map(coords: torch.Tensor, kernel_size: int, coord_hash: Optional[CoordHash] = None) -> NeighborMap:
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"kernel_size must be a positive odd integer, got {kernel_size}")
    h = coord_hash or CoordHash(coords)
    offsets = kernel_offsets(kernel_size, coords.device)
    c = coords.to(torch.int64)
    # Keys are linear in the coordinates, so a neighbour's key is the voxel's key plus the offset's key; the
    # per-axis range test keeps neighbours from wrapping into the next row of the grid. One offset at a time
    # keeps the temporaries at O(N) (1.3 M voxels x 27 offsets x int64 would be ~0.3 GB each).
    base_keys = (c * h._strides).sum(dim=1)
    extent = torch.tensor(h.extent[1:], dtype=torch.int64, device=coords.device)
    table = torch.empty((c.shape[0], offsets.shape[0]), dtype=torch.int32, device=coords.device)
    for j, off in enumerate(offsets):
        moved = c[:, 1:] + off
        inside = ((moved >= 0) & (moved < extent)).all(dim=1)
        table[:, j] = h.lookup_keys(base_keys + (off * h._strides[1:]).sum(), inside).to(torch.int32)
    return NeighborMap(table, kernel_size)


def neighbor_map(coords: torch.Tensor, kernel_size: int = 3) -> NeighborMap:
    """The neighbour map of ``coords`` for a cubic kernel. Not cached here: the owner of the coordinates keeps it
    (``SparseTensor.neighbor_map``) and passes it to ``sparse_conv3d(..., neighbor_map=)``, so layers at the same
    coordinates share it and derived coordinates get their own. Coordinate values are validated here."""
    check_coords(coords, values=False)
    return build_neighbor_map(coords, kernel_size)


def clear_cache() -> None:
    """Kept for callers of the earlier global map cache; maps now live with their SparseTensor (nothing to clear)."""
