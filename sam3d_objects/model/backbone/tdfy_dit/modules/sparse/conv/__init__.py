"""Submanifold sparse 3D convolution (spconv's weight layout and kernel-offset rule) through `backends`."""
from typing import Optional

import torch
import torch.nn as nn

import backends

from ...utils import register_fp16_module
from ..basic import SparseTensor

__all__ = ["SparseConv3d", "SparseInverseConv3d"]


class _SubMConvParams(nn.Module):
    """Holds the parameters under upstream's names: ``conv.weight`` [Cout, k, k, k, Cin], ``conv.bias`` [Cout]."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_channels, kernel_size, kernel_size, kernel_size, in_channels))
        self.bias = nn.Parameter(torch.empty(out_channels)) if bias else None
        fan_in = in_channels * kernel_size ** 3
        bound = 1.0 / fan_in ** 0.5
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)


@register_fp16_module
class SparseConv3d(nn.Module):
    """Submanifold convolution: output voxels = input voxels (same order);
    ``out[p] = bias + sum_k W[:, kx, ky, kz, :] @ in[p + (kx, ky, kz) - k//2]`` over present neighbours.

    Only stride 1 / dilation 1 exist at inference. ``indice_key`` is accepted for config compatibility: the
    neighbour map is kept with the SparseTensor per kernel size (`SparseTensor.neighbor_map`), so every layer at
    the same coordinates shares it, which is what upstream's per-key sharing achieves.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, dilation: int = 1,
                 padding: Optional[int] = None, bias: bool = True, indice_key: Optional[str] = None):
        super().__init__()
        if isinstance(kernel_size, (tuple, list)):
            if len(set(kernel_size)) != 1:
                raise ValueError(f"only cubic kernels are supported, got {kernel_size}")
            kernel_size = kernel_size[0]
        if stride not in (1, (1, 1, 1)) or dilation not in (1, (1, 1, 1)):
            raise NotImplementedError("only submanifold convolutions (stride 1, dilation 1) are implemented; "
                                      "use SparseDownsample/SparseUpsample/SparseSubdivide to change resolution")
        if kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd for a submanifold convolution, got {kernel_size}")
        self.in_channels, self.out_channels, self.kernel_size = in_channels, out_channels, kernel_size
        self.indice_key = indice_key
        self.conv = _SubMConvParams(in_channels, out_channels, kernel_size, bias)

    def forward(self, x: SparseTensor) -> SparseTensor:
        if x.feats.dim() != 2 or x.feats.shape[1] != self.in_channels:
            raise ValueError(f"SparseConv3d expects feats [N, {self.in_channels}], got {tuple(x.feats.shape)}")
        weight, bias = self.conv.weight, self.conv.bias
        nmap = x.neighbor_map(self.kernel_size) if x.coords.shape[0] and self.kernel_size > 1 else None
        return x.replace(backends.sparse_conv3d(x.feats, x.coords, weight, bias, neighbor_map=nmap))

    def forward_upsampled(self, coarse: SparseTensor, fine: SparseTensor, parent_index: torch.Tensor) -> SparseTensor:
        """``self(fine.replace(coarse.feats[parent_index]))`` (``fine``'s voxels, each with its coarse row's
        features: a nearest-neighbour upsampling) without building the upsampled features where the backend can
        convolve on the coarse rows (``backends.sparse_conv3d_upsampled``). Forward hooks are not called."""
        if coarse.feats.dim() != 2 or coarse.feats.shape[1] != self.in_channels:
            raise ValueError(f"SparseConv3d expects feats [N, {self.in_channels}], got {tuple(coarse.feats.shape)}")
        nmap = (lambda: fine.neighbor_map(self.kernel_size)) if self.kernel_size > 1 else None
        return fine.replace(backends.sparse_conv3d_upsampled(coarse.feats, parent_index, fine.coords, self.conv.weight,
                                                             self.conv.bias, neighbor_map=nmap))


class SparseInverseConv3d(nn.Module):
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("SparseInverseConv3d (strided transposed conv) is not used by SAM 3D Objects")


# upstream's spconv algorithm switch (read through the backend registry, the one place that reads the environment)
SPCONV_ALGO: str = backends.env_value("SPCONV_ALGO", "auto")
if SPCONV_ALGO not in ("auto", "implicit_gemm", "native"):
    SPCONV_ALGO = "auto"
