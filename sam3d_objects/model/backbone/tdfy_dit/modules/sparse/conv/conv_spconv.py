"""Upstream's spconv-backed sparse convolutions (strided / padded convolutions and their inverse), for scripts that
need them. Needs the optional `spconv` package (CPU or CUDA builds); the models' submanifold convolutions go
through `backends` instead (`modules.sparse.conv.SparseConv3d`)."""
from typing import Any, Optional

import torch
import torch.nn as nn

from ..basic import SparseTensor

__all__ = ["SparseConv3d", "SparseInverseConv3d"]


def _load_package():
    try:
        import spconv.pytorch as spconv
    except ImportError as e:
        raise ImportError("conv_spconv needs spconv: pip install spconv (CPU) or spconv-cu12x (CUDA)") from e
    return spconv


def _algo(spconv) -> Any:
    from . import SPCONV_ALGO
    return {"auto": None, "native": spconv.ConvAlgo.Native,
            "implicit_gemm": spconv.ConvAlgo.MaskImplicitGemm}[SPCONV_ALGO]


def _triple(value) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * 3


def to_sparse_package_tensor(x: SparseTensor) -> Any:
    """Our SparseTensor as a spconv SparseConvTensor (spatial shape = max coordinate + 1 per axis)."""
    spconv = _load_package()
    coords = x.coords.int()
    shape = (coords[:, 1:].max(0).values + 1).tolist() if coords.shape[0] else [1, 1, 1]
    return spconv.SparseConvTensor(x.feats.reshape(x.feats.shape[0], -1), coords, shape, x.shape[0])


class SparseConv3d(nn.Module):
    """stride 1 without padding: submanifold conv (same voxels); otherwise a regular (strided) sparse conv whose
    output is re-sorted by batch index. State-dict keys conv.weight / conv.bias in spconv's layout."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, dilation: int = 1,
                 padding: Optional[int] = None, bias: bool = True, indice_key: Optional[str] = None):
        super().__init__()
        spconv = _load_package()
        algo = _algo(spconv)
        if stride == 1 and padding is None:
            self.conv = spconv.SubMConv3d(in_channels, out_channels, kernel_size, dilation=dilation, bias=bias,
                                          indice_key=indice_key, algo=algo)
        else:
            self.conv = spconv.SparseConv3d(in_channels, out_channels, kernel_size, stride=stride, dilation=dilation,
                                            padding=padding or 0, bias=bias, indice_key=indice_key, algo=algo)
        self.stride = _triple(stride)
        self.padding = padding

    def forward(self, x: SparseTensor) -> SparseTensor:
        spatial_changed = any(s != 1 for s in self.stride) or self.padding is not None
        data = x.get_spatial_cache("spconv_data") if not spatial_changed else None
        new = self.conv(to_sparse_package_tensor(x) if data is None else data)
        feats, coords = new.features, new.indices
        scale = tuple(s * st for s, st in zip(x._scale, self.stride))
        if not spatial_changed:
            return x.replace(feats)
        order = torch.argsort(coords[:, 0].long(), stable=True)  # keep each batch element's rows together
        bwd = torch.empty_like(order)
        bwd[order] = torch.arange(order.shape[0], device=order.device)
        out = SparseTensor(feats=feats[order], coords=coords[order], scale=scale, spatial_cache=x._spatial_cache)
        out.register_spatial_cache(f"conv_{self.stride}_unsorted_data", new)
        out.register_spatial_cache(f"conv_{self.stride}_sort_bwd", bwd)
        return out


class SparseInverseConv3d(nn.Module):
    """Inverse of a strided SparseConv3d with the same indice_key: back to that conv's input voxels."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, dilation: int = 1,
                 bias: bool = True, indice_key: Optional[str] = None):
        super().__init__()
        spconv = _load_package()
        self.conv = spconv.SparseInverseConv3d(in_channels, out_channels, kernel_size, bias=bias,
                                               indice_key=indice_key, algo=_algo(spconv))
        self.stride = _triple(stride)

    def forward(self, x: SparseTensor) -> SparseTensor:
        if any(s != 1 for s in self.stride):
            data = x.get_spatial_cache(f"conv_{self.stride}_unsorted_data")
            bwd = x.get_spatial_cache(f"conv_{self.stride}_sort_bwd")
            if data is None:
                raise RuntimeError("SparseInverseConv3d needs the output of the matching strided SparseConv3d")
            data = data.replace_feature(x.feats[bwd])
        else:
            data = to_sparse_package_tensor(x)
        new = self.conv(data)
        scale = tuple(s // st for s, st in zip(x._scale, self.stride))
        return SparseTensor(feats=new.features, coords=new.indices, scale=scale, spatial_cache=x._spatial_cache)
