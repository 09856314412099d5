"""``spconv`` / ``spconv.pytorch`` stand-in: submanifold convolutions through ``backends.sparse_conv3d``.

Covers what SAM 3D / TRELLIS-style code uses: ``SparseConvTensor`` (features, indices (b, x, y, z), spatial_shape,
batch_size, ``replace_feature``), ``SubMConv3d`` (spconv's weight layout [out, k, k, k, in], so checkpoints load
unchanged), ``SparseSequential``, ``SparseModule`` and ``ConvAlgo``. Strided / transposed convolutions are not
provided (SAM 3D runs only submanifold ones at inference) and raise an error saying so.
"""
from __future__ import annotations

import enum
import math
from typing import Optional, Sequence

import torch
from torch import nn

from ._modules import drop, install_shim, make


class ConvAlgo(enum.Enum):
    Native = 0
    MaskImplicitGemm = 1
    MaskSplitImplicitGemm = 2


class SparseConvTensor:
    """spconv's sparse tensor: ``features`` [N, C] at ``indices`` [N, 4] int32 (batch, x, y, z).

    The constructor takes spconv 2.x's parameters in spconv's order (code that rebuilds a tensor passes ``grid``,
    ``voxel_num`` and ``indice_dict`` positionally) and the instance carries spconv's bookkeeping attributes
    (``grid`` an empty tensor when not given, ``benchmark``, ``benchmark_record``, ``thrust_allocator``,
    ``_timer``, ``force_algo``, ``int8_scale``), which only matter to spconv's CUDA kernels and are carried along.
    """

    def __init__(self, features: torch.Tensor, indices: torch.Tensor, spatial_shape: Sequence[int],
                 batch_size: int, grid: Optional[torch.Tensor] = None, voxel_num: Optional[torch.Tensor] = None,
                 indice_dict: Optional[dict] = None, benchmark: bool = False,
                 permanent_thrust_allocator: bool = False, enable_timer: bool = False, force_algo=None):
        if features.shape[0] != indices.shape[0]:
            raise ValueError(f"features has {features.shape[0]} rows but indices {indices.shape[0]}")
        self._features = features
        self.indices = indices
        self.spatial_shape = [int(s) for s in spatial_shape]
        self.batch_size = int(batch_size)
        self.indice_dict = {} if indice_dict is None else indice_dict
        self.grid = torch.empty(0) if grid is None else grid
        self.voxel_num = voxel_num
        self.benchmark = benchmark
        self.benchmark_record: dict = {}
        self.thrust_allocator = None
        self._timer = _NullTimer(enable_timer)
        self.force_algo = force_algo
        self.int8_scale = None

    @property
    def features(self) -> torch.Tensor:
        return self._features

    @features.setter
    def features(self, value: torch.Tensor) -> None:
        self._features = value

    @property
    def spatial_size(self) -> int:
        return math.prod(self.spatial_shape)

    def replace_feature(self, features: torch.Tensor) -> "SparseConvTensor":
        """A tensor with new features at the same indices; the bookkeeping (and the same ``indices`` object, so
        backends' neighbour-map cache is shared across layers) is carried over, as spconv does."""
        out = SparseConvTensor(features, self.indices, self.spatial_shape, self.batch_size, self.grid,
                               self.voxel_num, self.indice_dict, self.benchmark, force_algo=self.force_algo)
        out.benchmark_record, out.thrust_allocator, out._timer = self.benchmark_record, self.thrust_allocator, \
            self._timer
        out.int8_scale = self.int8_scale
        return out

    def dense(self, channels_first: bool = True) -> torch.Tensor:
        feats = self._features.reshape(self._features.shape[0], -1)
        grid = feats.new_zeros((self.batch_size, *self.spatial_shape, feats.shape[1]))
        c = self.indices.long()
        grid[c[:, 0], c[:, 1], c[:, 2], c[:, 3]] = feats
        return grid.permute(0, 4, 1, 2, 3).contiguous() if channels_first else grid


class _NullTimer:
    """Stands for spconv's CUDA kernel timer (``_timer``): nothing to time without CUDA kernels."""

    def __init__(self, enable: bool = False):
        self.enable = enable

    def get_all_pair_time(self) -> dict:
        return {}


class SparseModule(nn.Module):
    """Marker base class, as in spconv."""


class SparseSequential(nn.Sequential):
    """Runs sparse and dense modules in order; dense ones are applied to the features."""

    def forward(self, x):
        for module in self:
            if isinstance(x, SparseConvTensor) and not isinstance(module, (SparseModule, SparseSequential)):
                x = x.replace_feature(module(x.features))
            else:
                x = module(x)
        return x


def _triple(value) -> tuple:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,) * 3


class SubMConv3d(SparseModule):
    """Submanifold 3D convolution with spconv's parameters and weight layout."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size=3, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, indice_key=None, algo=None, fp32_accum=None, name=None,
                 **unused):
        super().__init__()
        k = _triple(kernel_size)
        if len(set(k)) != 1 or k[0] % 2 == 0:
            raise NotImplementedError(f"the spconv shim supports odd cubic kernels, got {kernel_size}")
        if _triple(stride) != (1, 1, 1) or _triple(dilation) != (1, 1, 1) or groups != 1:
            raise NotImplementedError("the spconv shim supports submanifold convs with stride 1, dilation 1, "
                                      "groups 1 (what SAM 3D uses); install spconv for others")
        self.in_channels, self.out_channels, self.kernel_size = in_channels, out_channels, k
        self.indice_key = indice_key
        self.weight = nn.Parameter(torch.empty(out_channels, *k, in_channels))
        self.bias = nn.Parameter(torch.empty(out_channels)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        fan_in = self.in_channels * math.prod(self.kernel_size)
        bound = 1.0 / math.sqrt(fan_in)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: SparseConvTensor) -> SparseConvTensor:
        import backends

        out = backends.sparse_conv3d(x.features, x.indices, self.weight, self.bias)
        return x.replace_feature(out)


def _unsupported(name):
    class Unsupported(SparseModule):
        def __init__(self, *args, **kwargs):
            raise NotImplementedError(f"spconv.pytorch.{name} is not provided by the shim (only submanifold "
                                      f"convolutions are); install spconv on CUDA for it")
    Unsupported.__name__ = name
    return Unsupported


def _build():
    pytorch = make("spconv.pytorch", __doc__, SparseConvTensor=SparseConvTensor, SubMConv3d=SubMConv3d,
                   SparseSequential=SparseSequential, SparseModule=SparseModule, ConvAlgo=ConvAlgo,
                   SparseConv3d=_unsupported("SparseConv3d"),
                   SparseInverseConv3d=_unsupported("SparseInverseConv3d"))
    root = make("spconv", __doc__, pytorch=pytorch, ConvAlgo=ConvAlgo, __version__="2.3.8+sam3d-shim")
    return [root, pytorch]


def install(replace_installed: bool = False) -> str:
    return install_shim("spconv", _build, replace_installed)


def uninstall() -> None:
    drop("spconv", only_shims=True)
