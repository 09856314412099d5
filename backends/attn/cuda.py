"""The CUDA attention backends: torch's varlen flash attention (``varlen``), ``flash_attn`` and ``xformers``."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..registry import Family, register
from .portable import FLOATS, HALF


def _torch_varlen_probe(device: torch.device) -> Optional[str]:
    try:
        from torch.nn.attention import varlen  # noqa: F401
    except ImportError:
        return "needs torch.nn.attention.varlen (PyTorch >= 2.10)"
    return None


def _pad_head_dim(v: torch.Tensor, d: int) -> torch.Tensor:
    # Flash kernels want one head dim for q, k and v; zero columns in v leave the wanted columns exact.
    return v if v.shape[-1] == d else F.pad(v, (0, d - v.shape[-1]))


def _fit_head_dims(q, k, v):
    d = max(q.shape[-1], v.shape[-1])
    if q.shape[-1] < d:  # zero-padding q and k leaves every dot product unchanged
        q, k = F.pad(q, (0, d - q.shape[-1])), F.pad(k, (0, d - k.shape[-1]))
    return q, k, _pad_head_dim(v, d)


@register(Family.SPARSE_ATTN, "varlen", devices=("cuda",), dtypes=HALF, probe=_torch_varlen_probe, priority=30)
def torch_varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    if cu_q.numel() == 2 and cu_k.numel() == 2:
        # One sequence (stage 2's full attention over all voxels, and its cross-attention): the dense SDPA
        # dispatcher picks the GPU's native kernel (cuDNN / flash for Hopper), faster than the varlen kernel.
        # The count is the tensor's shape: no device read.
        return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                              v.transpose(0, 1)[None], scale=scale)[0].transpose(0, 1)
    from torch.nn.attention.varlen import varlen_attn

    dv = v.shape[-1]
    q, k, v = _fit_head_dims(q, k, v)
    out = varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, max_q, max_k, scale=scale)
    return out[..., :dv]


@register(Family.ATTN, "varlen", devices=("cuda",), dtypes=HALF, probe=_torch_varlen_probe, priority=5)
def torch_varlen_dense_attention(q, k, v, scale):
    b, lq, lk = q.shape[0], q.shape[1], k.shape[1]
    cu_q = torch.arange(0, (b + 1) * lq, lq, device=q.device, dtype=torch.int32)
    cu_k = torch.arange(0, (b + 1) * lk, lk, device=q.device, dtype=torch.int32)
    out = torch_varlen_attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, lq, lk, scale)
    return out.reshape(b, lq, q.shape[2], -1)


@register(Family.SPARSE_ATTN, "flash_attn", devices=("cuda",), dtypes=HALF, requires=("flash_attn",), priority=20)
def flash_attn_varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    from flash_attn import flash_attn_varlen_func

    dv = v.shape[-1]
    q, k, v = _fit_head_dims(q, k, v)
    return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale)[..., :dv]


@register(Family.ATTN, "flash_attn", devices=("cuda",), dtypes=HALF, requires=("flash_attn",), priority=5)
def flash_attn_attention(q, k, v, scale):
    from flash_attn import flash_attn_func

    dv = v.shape[-1]
    q, k, v = _fit_head_dims(q, k, v)
    return flash_attn_func(q, k, v, softmax_scale=scale)[..., :dv]


@register(Family.SPARSE_ATTN, "xformers", devices=("cuda",), dtypes=FLOATS, requires=("xformers",), priority=15)
def xformers_varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    import xformers.ops as xops

    lq = (cu_q[1:] - cu_q[:-1]).tolist()
    lk = (cu_k[1:] - cu_k[:-1]).tolist()
    bias = xops.fmha.BlockDiagonalMask.from_seqlens(lq, lk)
    return xops.memory_efficient_attention(q[None], k[None], v[None], attn_bias=bias, scale=scale)[0]


@register(Family.ATTN, "xformers", devices=("cuda",), dtypes=FLOATS, requires=("xformers",), priority=5)
def xformers_attention(q, k, v, scale):
    import xformers.ops as xops

    return xops.memory_efficient_attention(q, k, v, scale=scale)
