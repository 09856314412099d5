"""Resolution changes of a SparseTensor: downsample (scatter-mean quirk), cached upsample, subdivision."""
from typing import Optional, Tuple, Union

import torch
import torch.nn as nn

import backends

from .basic import SparseTensor, batch_layout

__all__ = ["SparseDownsample", "SparseUpsample", "SparseSubdivide", "subdivide_coords", "subdivide_feats"]

# The 8 children of a voxel in upstream's order: nonzero(ones(2, 2, 2)) = (0,0,0), (0,0,1), ..., (1,1,1).
CHILD_OFFSETS = torch.tensor([[i >> 2 & 1, i >> 1 & 1, i & 1] for i in range(8)], dtype=torch.int32)


def _factor3(factor: Union[int, Tuple[int, ...]]) -> Tuple[int, int, int]:
    f = tuple(factor) if isinstance(factor, (tuple, list)) else (factor,) * 3
    if len(f) != 3 or any(int(v) < 1 for v in f):
        raise ValueError(f"factor must be a positive int or 3 positive ints, got {factor}")
    return tuple(int(v) for v in f)


def _linear_code(coords: torch.Tensor, extent) -> torch.Tensor:
    """b*X*Y*Z + x*Y*Z + y*Z + z in int64 (extent = (X, Y, Z))."""
    c = coords.long()
    x, y, z = extent
    return ((c[:, 0] * x + c[:, 1]) * y + c[:, 2]) * z + c[:, 3]


def downsample_mapping(coords: torch.Tensor, factor: Tuple[int, int, int]):
    """Coarse coords (unique, sorted by the linear code) and the coarse row of every fine voxel."""
    coarse = coords.clone()
    coarse[:, 1:] = torch.div(coarse[:, 1:], torch.tensor(factor, dtype=coords.dtype, device=coords.device),
                              rounding_mode="floor")
    extent = (coarse[:, 1:].max(dim=0).values + 1).tolist()
    code = _linear_code(coarse, extent)
    unique_code, inverse = backends.unique(code, return_inverse=True)
    x, y, z = extent
    new_coords = torch.stack([unique_code // (x * y * z), unique_code // (y * z) % x, unique_code // z % y,
                              unique_code % z], dim=-1).to(torch.int32)
    return new_coords, inverse


def scatter_mean_with_zero(feats: torch.Tensor, index: torch.Tensor, num: int,
                           counts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """sum / (count + 1): upstream averages into a zero buffer that takes part in the mean (include_self=True).
    ``counts`` (fine voxels per coarse voxel) may be passed when known: counting them syncs with the device."""
    sums = feats.new_zeros((num, *feats.shape[1:]))
    sums.index_add_(0, index, feats)
    if counts is None:
        counts = torch.bincount(index, minlength=num)
    counts = counts.to(feats.dtype) + 1
    return sums / counts.reshape(-1, *([1] * (feats.dim() - 1)))


class SparseDownsample(nn.Module):
    """Coarsen by `factor` (coords // factor). Features: sum / (count + 1) (upstream's scatter-mean quirk).
    The fine coords/layout and the fine->coarse index are cached in the result for `SparseUpsample`."""

    def __init__(self, factor: Union[int, Tuple[int, ...]]):
        super().__init__()
        self.factor = tuple(factor) if isinstance(factor, (tuple, list)) else factor

    def forward(self, input: SparseTensor) -> SparseTensor:
        factor = _factor3(self.factor)
        if input.coords.shape[0] == 0:
            raise ValueError("SparseDownsample got an empty SparseTensor (0 voxels)")
        new_coords, idx, counts, layout = self._mapping(input, factor)
        new_feats = scatter_mean_with_zero(input.feats, idx, new_coords.shape[0], counts)
        out = SparseTensor(feats=new_feats, coords=new_coords, shape=input.shape, layout=layout,
                           scale=tuple(s * f for s, f in zip(input._scale, factor)),
                           spatial_cache=input._spatial_cache)
        out.register_spatial_cache(f"upsample_{factor}_coords", input.coords)
        out.register_spatial_cache(f"upsample_{factor}_layout", input.layout)
        out.register_spatial_cache(f"upsample_{factor}_idx", idx)
        return out


    @staticmethod
    def _mapping(input: SparseTensor, factor: Tuple[int, int, int]):
        """(coarse coords, fine->coarse index, fine voxels per coarse voxel, coarse layout), derived from the
        coordinates alone (unique / counts / layout read the device): built once and kept in the input's spatial
        cache, so the steps of a sampling run (and a CUDA-graph capture) reuse it."""
        key = f"downsample_{factor}_mapping"
        mapping = input.get_spatial_cache(key)
        if mapping is None:
            new_coords, idx = downsample_mapping(input.coords, factor)
            counts = torch.bincount(idx, minlength=new_coords.shape[0])
            mapping = (new_coords, idx, counts, batch_layout(new_coords[:, 0], input.shape[0]))
            input.register_spatial_cache(key, mapping)
        return mapping


class SparseUpsample(nn.Module):
    """Inverse of the matching `SparseDownsample`: each fine voxel takes its coarse voxel's features; the fine
    coords and order come from the cache the downsample left in the tensor."""

    def __init__(self, factor: Union[int, Tuple[int, ...]]):
        super().__init__()
        self.factor = tuple(factor) if isinstance(factor, (tuple, list)) else factor

    def forward(self, input: SparseTensor) -> SparseTensor:
        return self.upsampled(input, input.feats[self.parent_index(input)])

    def parent_index(self, input: SparseTensor) -> torch.Tensor:
        """For each fine voxel, its coarse row of ``input`` (the index the matching downsample left)."""
        return self._left_by_downsample(input, "idx")

    def upsampled(self, input: SparseTensor, feats: torch.Tensor) -> SparseTensor:
        """The fine SparseTensor of ``input`` with ``feats`` (one row per fine voxel) as its features."""
        return SparseTensor(feats=feats, coords=self._left_by_downsample(input, "coords"), shape=input.shape,
                            layout=self._left_by_downsample(input, "layout"),
                            scale=tuple(s / f for s, f in zip(input._scale, _factor3(self.factor))),
                            spatial_cache=input._spatial_cache)

    def _left_by_downsample(self, input: SparseTensor, what: str):
        value = input.get_spatial_cache(f"upsample_{_factor3(self.factor)}_{what}")
        if value is None:
            raise ValueError("SparseUpsample found no cache: it must follow a SparseDownsample of the same factor "
                             "on this tensor (or a tensor derived from it with .replace / arithmetic)")
        return value


def subdivide_coords(input: SparseTensor) -> SparseTensor:
    """The coords/layout SparseSubdivide produces, with empty (0-channel) features: child row r of the result
    belongs to parent row r // 8."""
    n = input.coords.shape[0]
    coords = input.coords.clone()
    coords[:, 1:] *= 2
    new_coords = coords[:, None, :].repeat(1, 8, 1)
    new_coords[:, :, 1:] += CHILD_OFFSETS.to(input.device)[None]
    layout = [slice(s.start * 8, s.stop * 8) for s in input.layout]
    return SparseTensor(feats=input.feats.new_zeros(n * 8, 0), coords=new_coords.reshape(n * 8, 4),
                        shape=(input.shape[0], 0), layout=layout, scale=tuple(s / 2 for s in input._scale))


def subdivide_feats(feats: torch.Tensor) -> torch.Tensor:
    """Per-parent rows -> 8 identical child rows (parent-major)."""
    return feats[:, None].expand(feats.shape[0], 8, *feats.shape[1:]).reshape(feats.shape[0] * 8,
                                                                              *feats.shape[1:])


class SparseSubdivide(nn.Module):
    """Each voxel -> its 8 children at 2 * coord + {0,1}^3, parent-major, children in upstream's order;
    children copy the parent's features. Coords are not re-sorted (batches stay contiguous)."""

    def forward(self, input: SparseTensor) -> SparseTensor:
        children = subdivide_coords(input)
        return children.replace(subdivide_feats(input.feats))
