"""`SparseTensor`: voxel features with int32 ``[batch, x, y, z]`` coordinates, rows of one batch element contiguous.

Upstream wraps spconv/torchsparse tensors; here the tensor is just ``feats`` + ``coords`` and every spatial op goes
through `backends`, so it runs wherever PyTorch runs.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

import backends

__all__ = ["SparseTensor", "sparse_batch_broadcast", "sparse_batch_op", "sparse_cat", "sparse_unbind"]


def _as_coords(coords: Any) -> torch.Tensor:
    if isinstance(coords, np.ndarray):
        coords = torch.from_numpy(np.ascontiguousarray(coords))
    if not isinstance(coords, torch.Tensor):
        raise TypeError(f"coords must be a torch.Tensor or numpy array, got {type(coords).__name__}")
    if coords.dim() != 2 or coords.shape[1] != 4:
        raise ValueError(f"coords must have shape [N, 4] (batch, x, y, z), got {tuple(coords.shape)}")
    if coords.dtype.is_floating_point or coords.dtype == torch.bool:
        raise TypeError(f"coords must be an integer tensor (int32), got {coords.dtype}")
    if coords.dtype != torch.int32:
        coords = coords.to(torch.int32)
    return coords


def batch_layout(batch_ids: torch.Tensor, batch_size: int) -> List[slice]:
    """Row range of every batch element; raises unless batch ids are non-decreasing (contiguous batches)."""
    n = batch_ids.shape[0]
    if n == 0:
        return [slice(0, 0) for _ in range(batch_size)]
    if n > 1 and bool((batch_ids[1:] < batch_ids[:-1]).any()):
        raise ValueError("SparseTensor coords must keep the rows of each batch element contiguous and in batch "
                         "order (coords[:, 0] non-decreasing); sort the rows by batch id first, e.g. "
                         "order = torch.argsort(coords[:, 0], stable=True)")
    counts = torch.bincount(batch_ids.long(), minlength=batch_size).tolist()
    layout, start = [], 0
    for c in counts:
        layout.append(slice(start, start + c))
        start += c
    return layout


def backend_tensor_parts(data: Any) -> Tuple[torch.Tensor, torch.Tensor]:
    """(feats, coords) of a backend sparse tensor object: spconv (features / indices) or torchsparse (F / C)."""
    for feats_name, coords_name in (("features", "indices"), ("F", "C")):
        feats, coords = getattr(data, feats_name, None), getattr(data, coords_name, None)
        if isinstance(feats, torch.Tensor) and coords is not None:
            return feats, coords
    raise TypeError(f"SparseTensor(data=...) needs a sparse tensor object with .features/.indices (spconv) or .F/.C "
                    f"(torchsparse), got {type(data).__name__}; or pass SparseTensor(feats=, coords=)")


class SparseTensorData:
    """What upstream's ``SparseTensor.data`` holds, the backend's tensor object (spconv's SparseConvTensor by
    default, torchsparse's SparseTensor otherwise), as a live view of a ``SparseTensor``: spconv's names
    (``features``, ``indices``, ``spatial_shape``, ``batch_size``, ``dense()``, ``replace_feature``) and
    torchsparse's (``F``, ``C``, ``s``). Writing ``features`` / ``indices`` (or ``F`` / ``C``) writes the tensor's
    feats / coords."""

    def __init__(self, tensor: "SparseTensor"):
        self._tensor = tensor

    @property
    def features(self) -> torch.Tensor:
        return self._tensor.feats

    @features.setter
    def features(self, value: torch.Tensor) -> None:
        self._tensor.feats = value

    @property
    def indices(self) -> torch.Tensor:
        return self._tensor.coords

    @indices.setter
    def indices(self, value: torch.Tensor) -> None:
        self._tensor.coords = value

    F = features
    C = indices

    @property
    def spatial_shape(self) -> List[int]:
        """Per axis the largest coordinate + 1 (upstream's spconv tensors are built with this)."""
        coords = self._tensor.coords
        if coords.shape[0] == 0:
            return [0, 0, 0]
        return [int(v) + 1 for v in coords[:, 1:].max(0).values.tolist()]

    @property
    def batch_size(self) -> int:
        return self._tensor.shape[0]

    @property
    def s(self) -> Tuple[int, ...]:
        """torchsparse's stride: the voxel size relative to the finest level."""
        return tuple(int(v) for v in self._tensor._scale)

    stride = s

    @property
    def indice_dict(self) -> Dict:
        """The coordinate-derived data shared by tensors at these coordinates (spconv keeps its indices here)."""
        return self._tensor._spatial_cache

    def dense(self) -> torch.Tensor:
        return self._tensor.dense()

    def replace_feature(self, feats: torch.Tensor) -> "SparseTensorData":
        return SparseTensorData(self._tensor.replace(feats))

    def __repr__(self) -> str:
        return f"SparseTensorData(view of {self._tensor!r})"


class SparseTensor:
    """Sparse voxel tensor.

    Args:
        feats: [N, C, ...] features, one row per voxel.
        coords: [N, 4] integer (int32) coordinates ``(batch, x, y, z)``; rows of a batch element contiguous and in
            batch order; no duplicate voxels (checked lazily by the ops that hash coordinates).
        shape: optional ``torch.Size([batch_size, C, ...])``; inferred from the coords otherwise.
        layout: optional per-batch row slices (computed from the coords otherwise).
        scale: voxel size relative to the finest level (tracks down/up-sampling; keys the spatial cache).
        spatial_cache: shared dict of per-scale cached data (window partitions, upsampling indices).
    """

    def __init__(self, *args: Any, **kwargs: Any):
        """Upstream's call forms: (feats, coords, shape=None, layout=None, scale=, spatial_cache=) positionally or
        by name, or (data, shape=None, layout=None) wrapping a backend tensor object: spconv's SparseConvTensor
        (``.features`` / ``.indices``), torchsparse's SparseTensor (``.F`` / ``.C``) or another tensor's ``.data``.
        Here the tensor always stores feats + coords; ``.data`` gives the backend-style view of them."""
        data = kwargs.pop("data", None)
        if data is None and args and not isinstance(args[0], torch.Tensor) and args[0] is not None:
            data, args = args[0], args[1:]
        if data is not None:
            feats, coords = backend_tensor_parts(data)
            self._init(feats, coords, *args, **kwargs)
            return
        self._init(*args, **kwargs)

    def _init(self, feats: Optional[torch.Tensor] = None, coords: Optional[Any] = None,
              shape: Optional[Sequence[int]] = None, layout: Optional[List[slice]] = None,
                 scale: Tuple[float, ...] = (1.0, 1.0, 1.0), spatial_cache: Optional[Dict] = None, **kwargs):
        if kwargs:
            raise TypeError(f"unexpected SparseTensor arguments {sorted(kwargs)}; use SparseTensor(feats=, coords=)")
        if feats is None or coords is None:
            raise TypeError("SparseTensor needs feats [N, C] and coords [N, 4]")
        if not isinstance(feats, torch.Tensor):
            raise TypeError(f"feats must be a torch.Tensor, got {type(feats).__name__}")
        coords = _as_coords(coords)
        if feats.dim() < 1 or feats.shape[0] != coords.shape[0]:
            raise ValueError(f"feats has {feats.shape[0] if feats.dim() else 0} rows but coords has "
                             f"{coords.shape[0]}: one feature row per voxel")
        if coords.device != feats.device:
            coords = coords.to(feats.device)
        self.feats = feats
        self.coords = coords
        if shape is None:
            batch_size = int(coords[:, 0].max()) + 1 if coords.shape[0] else 0
            shape = (batch_size, *feats.shape[1:])
        self._shape = torch.Size(shape)
        if layout is None:
            if coords.shape[0] and int(coords[:, 0].min()) < 0:
                raise ValueError("SparseTensor batch ids (coords[:, 0]) must be >= 0")
            layout = batch_layout(coords[:, 0], self._shape[0])
        self._layout = layout
        self._scale = tuple(float(s) for s in scale)
        self._spatial_cache = {} if spatial_cache is None else spatial_cache

    # ---------------------------------------------------------------------------------------------- properties
    # Upstream's surface records the setters' signatures `(self, value)`. One accessor per attribute serves as
    # getter (called with the instance only) and setter (called with the new tensor); None is never a valid
    # feats/coords tensor, so it safely means "read".
    def _feats_accessor(self, value: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        if value is None:
            return self._feats
        self._feats = value
        return None

    feats = property(_feats_accessor, _feats_accessor, doc="[N, C, ...] features (read/write)")

    def _coords_accessor(self, value: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        if value is None:
            return self._coords
        self._coords = value
        return None

    coords = property(_coords_accessor, _coords_accessor, doc="[N, 4] int32 (batch, x, y, z) coordinates (read/write)")

    @property
    def data(self) -> SparseTensorData:
        """Upstream's backend tensor object (see ``SparseTensorData``): a live view of feats and coords."""
        return SparseTensorData(self)

    @property
    def shape(self) -> torch.Size:
        return self._shape

    @property
    def layout(self) -> List[slice]:
        return self._layout

    @property
    def device(self) -> torch.device:
        return self.feats.device

    @property
    def dtype(self) -> torch.dtype:
        return self.feats.dtype

    @property
    def batch_size(self) -> int:
        return self._shape[0]

    def dim(self) -> int:
        return len(self._shape)

    def __len__(self) -> int:
        return self._shape[0]

    def __repr__(self) -> str:
        return (f"SparseTensor(shape={tuple(self.shape)}, voxels={self.coords.shape[0]}, dtype={self.dtype}, "
                f"device={self.device}, scale={self._scale})")

    # ------------------------------------------------------------------------------------------- spatial cache
    def register_spatial_cache(self, key: str, value: Any) -> None:
        self._spatial_cache.setdefault(self._scale, {})[key] = value

    def get_spatial_cache(self, key: Optional[str] = None) -> Any:
        cache = self._spatial_cache.get(self._scale, {})
        return cache if key is None else cache.get(key)

    # Coordinate-derived data lives in the spatial cache, as spconv keeps its indices with the tensor: every
    # tensor at the same coordinates (`replace`, arithmetic, layers in a row) shares them, and a tensor with new
    # coordinates (subdivision, downsampling, `replace(coords=)`, a device move) starts with none.
    def neighbor_map(self, kernel_size: int) -> "backends.NeighborMap":
        """The neighbour map of these coordinates for a cubic kernel, built once and shared."""
        key = f"neighbor_map_{kernel_size}"
        nmap = self.get_spatial_cache(key)
        if nmap is None:
            nmap = backends.neighbor_map(self.coords, kernel_size)
            self.register_spatial_cache(key, nmap)
        return nmap

    def coord_hash(self) -> "backends.CoordHash":
        """A hash of these coordinates (row lookups without a neighbour table), built once and shared."""
        table = self.get_spatial_cache("coord_hash")
        if table is None:
            table = backends.CoordHash(self.coords)
            self.register_spatial_cache("coord_hash", table)
        return table

    # ------------------------------------------------------------------------------------------- construction
    def replace(self, feats: torch.Tensor, coords: Optional[torch.Tensor] = None) -> "SparseTensor":
        """Same voxels (or the given coords, same row count), new features; shares the spatial cache."""
        if feats.shape[0] != self.coords.shape[0]:
            raise ValueError(f"replacement feats have {feats.shape[0]} rows, the tensor has {self.coords.shape[0]}")
        same_coords = coords is None
        out = SparseTensor.__new__(SparseTensor)
        out.feats = feats
        out.coords = self.coords if same_coords else _as_coords(coords).to(feats.device)
        out._shape = torch.Size((self._shape[0], *feats.shape[1:]))
        out._layout = self._layout
        out._scale = self._scale
        out._spatial_cache = self._spatial_cache if same_coords else {}
        return out

    def type(self, dtype: torch.dtype) -> "SparseTensor":
        return self.replace(self.feats.type(dtype))

    def float(self) -> "SparseTensor":
        return self.type(torch.float32)

    def half(self) -> "SparseTensor":
        return self.type(torch.float16)

    def to(self, *args, **kwargs) -> "SparseTensor":
        feats = self.feats.to(*args, **kwargs)
        if feats.device == self.coords.device:
            return self.replace(feats)
        out = self.replace(feats)
        out.coords = self.coords.to(feats.device)
        out._spatial_cache = {}
        return out

    def cpu(self) -> "SparseTensor":
        return self.to("cpu")

    def cuda(self) -> "SparseTensor":
        """The same tensor on the current CUDA device (upstream's helper; `to(device)` is the portable form)."""
        return self.to("cuda")

    @staticmethod
    def full(aabb: Sequence[int], dim: Sequence[int], value: float, dtype: torch.dtype = torch.float32,
             device: Optional[Any] = None) -> "SparseTensor":
        """Every voxel of the inclusive box aabb = (x0, y0, z0, x1, y1, z1) for each of dim[0] batch elements
        (batch-major, "ij" order), features of width dim[1] filled with `value`."""
        x0, y0, z0, x1, y1, z1 = (int(v) for v in aabb)
        axes = [torch.arange(a, b + 1, device=device) for a, b in ((x0, x1), (y0, y1), (z0, z1))]
        grid = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3)
        batch = torch.arange(int(dim[0]), device=device).repeat_interleave(grid.shape[0])[:, None]
        coords = torch.cat([batch, grid.repeat(int(dim[0]), 1)], dim=1).int()
        feats = torch.full((coords.shape[0], int(dim[1])), value, dtype=dtype, device=device)
        return SparseTensor(feats=feats, coords=coords)

    def detach(self) -> "SparseTensor":
        return self.replace(self.feats.detach())

    def clone(self) -> "SparseTensor":
        out = self.replace(self.feats.clone())
        out.coords = self.coords.clone()
        out._spatial_cache = {}
        return out

    def reshape(self, *shape) -> "SparseTensor":
        """Reshape the per-voxel part of feats (the voxel axis is kept)."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
            shape = tuple(shape[0])
        return self.replace(self.feats.reshape(self.feats.shape[0], *shape))

    def unbind(self, dim: int) -> Tuple["SparseTensor", ...]:
        """Split along a feature axis (dim >= 1), e.g. qkv [N, 3, H, C] -> q, k, v."""
        if dim == 0:
            raise ValueError("cannot unbind a SparseTensor along the voxel axis; use indexing by batch element")
        return tuple(self.replace(f) for f in self.feats.unbind(dim))

    def dense(self) -> torch.Tensor:
        """[B, C, X, Y, Z] dense copy (small tensors only: it allocates the full grid)."""
        size = (self.coords[:, 1:].max(dim=0).values + 1).tolist() if self.coords.shape[0] else [0, 0, 0]
        out = self.feats.new_zeros(self.shape[0], *size, *self.feats.shape[1:])
        c = self.coords.long()
        out[c[:, 0], c[:, 1], c[:, 2], c[:, 3]] = self.feats
        return out.permute(0, 4, 1, 2, 3).contiguous() if self.feats.dim() == 2 else out

    # ---------------------------------------------------------------------------------------------- arithmetic
    def _other_feats(self, other: Any) -> Any:
        if isinstance(other, SparseTensor):
            if other.coords is not self.coords and other.coords.shape != self.coords.shape:
                raise ValueError(f"sparse tensors with {self.coords.shape[0]} and {other.coords.shape[0]} voxels "
                                 f"cannot be combined element-wise")
            return other.feats
        if isinstance(other, torch.Tensor) and other.dim() >= 2 and other.shape[0] == self._shape[0]:
            # one row per batch element (e.g. adaLN modulation [B, C]) -> one row per voxel
            return sparse_batch_broadcast(self, other)
        return other

    def _elementwise(self, other: Any, op: Callable) -> "SparseTensor":
        other_feats = self._other_feats(other)
        try:
            return self.replace(op(self.feats, other_feats))
        except RuntimeError as e:
            theirs = tuple(other_feats.shape) if isinstance(other_feats, torch.Tensor) else type(other).__name__
            raise ValueError(f"cannot combine SparseTensor feats {tuple(self.feats.shape)} with {theirs}: feature "
                             f"widths must match (per-voxel [N, C] or per-batch [B, C] operands)") from e

    def __add__(self, other):
        return self._elementwise(other, torch.add)

    __radd__ = __add__

    def __sub__(self, other):
        return self._elementwise(other, torch.sub)

    def __rsub__(self, other):
        return self._elementwise(other, lambda a, b: torch.sub(b, a))

    def __mul__(self, other):
        return self._elementwise(other, torch.mul)

    __rmul__ = __mul__

    def __truediv__(self, other):
        return self._elementwise(other, torch.div)

    def __neg__(self):
        return self.replace(-self.feats)

    # ----------------------------------------------------------------------------------------------- indexing
    def __getitem__(self, idx: Union[int, slice, Sequence[int], torch.Tensor]) -> "SparseTensor":
        """Select batch elements; they are renumbered 0..k-1 in the given order."""
        if isinstance(idx, int):
            idx = [idx]
        elif isinstance(idx, slice):
            idx = list(range(*idx.indices(self._shape[0])))
        elif isinstance(idx, torch.Tensor):
            idx = torch.nonzero(idx).flatten().tolist() if idx.dtype == torch.bool else idx.flatten().tolist()
        if len(idx) == 1 and self._shape[0] == 1 and idx[0] in (0, -1):
            # the whole single-element batch: share the tensors (a decoder output can be large)
            return SparseTensor(feats=self.feats, coords=self.coords, shape=self._shape, layout=self._layout,
                                scale=self._scale)
        coords, feats = [], []
        for new_i, old_i in enumerate(idx):
            if not -self._shape[0] <= old_i < self._shape[0]:
                raise IndexError(f"batch index {old_i} out of range for batch size {self._shape[0]}")
            rows = self._layout[old_i]
            c = self.coords[rows].clone()
            c[:, 0] = new_i
            coords.append(c)
            feats.append(self.feats[rows])
        if not coords:
            return SparseTensor(self.feats[:0], self.coords[:0], shape=(0, *self.feats.shape[1:]))
        return SparseTensor(feats=torch.cat(feats), coords=torch.cat(coords),
                            shape=(len(idx), *self.feats.shape[1:]), scale=self._scale)


def sparse_batch_broadcast(input: SparseTensor, other: torch.Tensor) -> torch.Tensor:
    """Per-voxel copy of a per-batch tensor ``other`` [B, ...]."""
    if other.shape[0] != input.shape[0]:
        raise ValueError(f"per-batch tensor has {other.shape[0]} rows for a batch of {input.shape[0]}")
    return other[input.coords[:, 0].long()]


def sparse_batch_op(input: SparseTensor, other: torch.Tensor, op: Callable = torch.add) -> SparseTensor:
    return input.replace(op(input.feats, sparse_batch_broadcast(input, other)))


def sparse_cat(inputs: List[SparseTensor], dim: int = 0) -> SparseTensor:
    """dim 0: stack batch elements (renumbered); other dims: concatenate features of the same voxels."""
    if dim == 0:
        coords, feats, start = [], [], 0
        for t in inputs:
            c = t.coords.clone()
            c[:, 0] += start
            start += t.shape[0]
            coords.append(c)
            feats.append(t.feats)
        return SparseTensor(feats=torch.cat(feats), coords=torch.cat(coords),
                            shape=(start, *inputs[0].feats.shape[1:]))
    return inputs[0].replace(torch.cat([t.feats for t in inputs], dim=dim))


def sparse_unbind(input: SparseTensor, dim: int) -> List[SparseTensor]:
    if dim == 0:
        return [input[i] for i in range(input.shape[0])]
    return list(input.unbind(dim))
