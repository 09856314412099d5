"""``torchsparse`` stand-in: the ``SparseTensor`` container (torchsparse 2.x's constructor and attributes).

Why: torchsparse compiles CUDA kernels; code with a torchsparse sparse-tensor backend builds
``SparseTensor(feats, coords, stride=..., spatial_range=...)``, reads ``F`` / ``C`` / ``feats`` / ``coords`` /
``stride`` / ``spatial_range`` and carries ``_caches`` over when it replaces features. ``coords`` [N, 4] int are
(batch, x, y, z); ``dense()`` scatters the features into [B, X, Y, Z, C] (needs ``spatial_range`` (B, X, Y, Z)
or infers it from the coordinates). torchsparse's convolutions are not provided (the project's sparse
convolutions are ``backends.sparse_conv3d``).
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch

from ._modules import drop, install_shim, make


class TensorCache:
    """Where torchsparse keeps kernel maps and downsampled coordinates between layers (carried, not used)."""

    def __init__(self):
        self.cmaps: dict = {}
        self.kmaps: dict = {}
        self.hashmaps: dict = {}


def _triple(value) -> Tuple[int, int, int]:
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),) * 3


class SparseTensor:
    """Features ``feats`` [N, C] at integer ``coords`` [N, 4] (batch, x, y, z)."""

    def __init__(self, feats: torch.Tensor, coords: torch.Tensor, stride: Union[int, Sequence[int]] = 1,
                 spatial_range: Optional[Sequence[int]] = None):
        if feats.shape[0] != coords.shape[0]:
            raise ValueError(f"feats has {feats.shape[0]} rows but coords {coords.shape[0]}")
        self.feats, self.coords = feats, coords
        self.stride = _triple(stride)
        self.spatial_range = None if spatial_range is None else tuple(int(s) for s in spatial_range)
        self._caches = TensorCache()

    @property
    def F(self) -> torch.Tensor:  # noqa: N802 (torchsparse's name)
        return self.feats

    @F.setter
    def F(self, value: torch.Tensor) -> None:  # noqa: N802
        self.feats = value

    @property
    def C(self) -> torch.Tensor:  # noqa: N802
        return self.coords

    @C.setter
    def C(self, value: torch.Tensor) -> None:  # noqa: N802
        self.coords = value

    @property
    def s(self) -> Tuple[int, int, int]:
        return self.stride

    def _like(self, feats: torch.Tensor, coords: Optional[torch.Tensor] = None) -> "SparseTensor":
        out = SparseTensor(feats, self.coords if coords is None else coords, self.stride, self.spatial_range)
        out._caches = self._caches
        return out

    def cpu(self) -> "SparseTensor":
        return self._like(self.feats.cpu(), self.coords.cpu())

    def cuda(self) -> "SparseTensor":
        return self._like(self.feats.cuda(), self.coords.cuda())

    def to(self, device, non_blocking: bool = True) -> "SparseTensor":
        return self._like(self.feats.to(device), self.coords.to(device))

    def half(self) -> "SparseTensor":
        return self._like(self.feats.half())

    def detach(self) -> "SparseTensor":
        return self._like(self.feats.detach(), self.coords.detach())

    def dense(self) -> torch.Tensor:
        """[B, X, Y, Z, C] with zeros where there is no voxel."""
        c = self.coords.long()
        if self.spatial_range is not None:
            shape = self.spatial_range
        else:
            shape = tuple(int(v) + 1 for v in c.amax(0).tolist())
        feats = self.feats.reshape(self.feats.shape[0], -1)
        grid = feats.new_zeros((*shape, feats.shape[1]))
        grid[c[:, 0], c[:, 1], c[:, 2], c[:, 3]] = feats
        return grid

    def __add__(self, other: "SparseTensor") -> "SparseTensor":
        return self._like(self.feats + (other.feats if isinstance(other, SparseTensor) else other))


def _build():
    tensor = make("torchsparse.tensor", __doc__, SparseTensor=SparseTensor)
    return [make("torchsparse", __doc__, SparseTensor=SparseTensor, tensor=tensor, __version__="2.1+sam3d-shim"),
            tensor]


def install(replace_installed: bool = False) -> str:
    return install_shim("torchsparse", _build, replace_installed)


def uninstall() -> None:
    drop("torchsparse", only_shims=True)
