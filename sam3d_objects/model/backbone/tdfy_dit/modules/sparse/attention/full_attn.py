"""Variable-length attention over the voxels of each batch element (through `backends.varlen_attention`)."""
from typing import Optional, Tuple, Union

import torch

import backends

from ...attention.full_attn import attention_args
from ..basic import SparseTensor

__all__ = ["sparse_scaled_dot_product_attention", "varlen_layout"]


def _cu_seqlens(tensor: SparseTensor) -> Tuple[torch.Tensor, int]:
    """(cumulative lengths, longest sequence) from the layout, which lives on the host: no device sync. Kept with
    the coordinates, so that the blocks of a model (and a CUDA-graph capture) do not copy it to the device again."""
    cached = tensor.get_spatial_cache("varlen_cu_seqlens")
    if cached is not None:  # the cache belongs to these coords, hence to their device
        return cached
    lengths = [s.stop - s.start for s in tensor.layout]
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32)
    result = (cu.to(tensor.device), max(lengths, default=0))
    tensor.register_spatial_cache("varlen_cu_seqlens", result)
    return result


def varlen_layout(tensor: SparseTensor) -> Tuple[torch.Tensor, int]:
    """(device cu_seqlens, longest sequence) of attention over each batch element of ``tensor``, kept with its
    coordinates (built at the first call)."""
    return _cu_seqlens(tensor)


def _dense_cu_seqlens(batch: int, length: int, device) -> Tuple[torch.Tensor, int]:
    return (torch.arange(batch + 1, dtype=torch.int32, device=device) * length).to(torch.int32), length


def _split_kv(kv: Union[SparseTensor, torch.Tensor], batch: int):
    """(k [T, H, D], v [T, H, D], cu_seqlens) from a sparse [N, 2, H, D] or dense [B, L, 2, H, D] kv."""
    if isinstance(kv, SparseTensor):
        k, v = kv.feats.unbind(dim=1)
        return (k, v, *_cu_seqlens(kv))
    if kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError(f"dense kv must be [B, L, 2, H, D], got {tuple(kv.shape)}")
    if kv.shape[0] != batch:
        raise ValueError(f"the context has {kv.shape[0]} batch elements, the sparse tensor {batch}")
    b, length = kv.shape[:2]
    k, v = kv.reshape(b * length, 2, *kv.shape[3:]).unbind(dim=1)
    return (k, v, *_dense_cu_seqlens(b, length, kv.device))


def _dense_q(q: torch.Tensor):
    b, length = q.shape[:2]
    return (q.reshape(b * length, *q.shape[2:]), *_dense_cu_seqlens(b, length, q.device))


def sparse_scaled_dot_product_attention(*args, scale: Optional[float] = None, **kwargs):
    """Softmax attention, each batch element attending only to itself.

    Forms (upstream's): ``(qkv)`` sparse [N, 3, H, D] self-attention; ``(q, kv)`` with q sparse [N, H, D] (or dense
    [B, L, H, D]) and kv sparse [M, 2, H, D] or dense [B, L, 2, H, D]; ``(q, k, v)`` likewise. The result has q's
    type (SparseTensor replaced feats [N, H, D], or dense [B, L, H, D]).
    """
    args = attention_args(args, kwargs)
    if len(args) == 1:
        qkv = args[0]
        if not isinstance(qkv, SparseTensor) or qkv.feats.dim() != 4 or qkv.feats.shape[1] != 3:
            raise ValueError("self-attention expects a SparseTensor qkv with feats [N, 3, H, D]")
        q, k, v = qkv.feats.unbind(dim=1)
        cu, longest = _cu_seqlens(qkv)
        return qkv.replace(backends.varlen_attention(q, k, v, cu, cu, longest, longest, scale=scale))
    if len(args) == 2:
        q_in, kv = args
        batch = q_in.shape[0]
        k, v, cu_k, max_k = _split_kv(kv, batch)
    elif len(args) == 3:
        q_in, k_in, v_in = args
        batch = q_in.shape[0]
        if isinstance(k_in, SparseTensor):
            k, v, (cu_k, max_k) = k_in.feats, v_in.feats, _cu_seqlens(k_in)
        else:
            k, cu_k, max_k = _dense_q(k_in)
            v, _, _ = _dense_q(v_in)
    else:
        raise TypeError("sparse_scaled_dot_product_attention takes (qkv), (q, kv) or (q, k, v)")
    if isinstance(q_in, SparseTensor):
        q, (cu_q, max_q) = q_in.feats, _cu_seqlens(q_in)
    else:
        q, cu_q, max_q = _dense_q(q_in)
    if cu_q.numel() != cu_k.numel():
        raise ValueError(f"q has {cu_q.numel() - 1} batch elements, k/v {cu_k.numel() - 1}")
    out = backends.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale)
    if isinstance(q_in, SparseTensor):
        return q_in.replace(out)
    return out.reshape(*q_in.shape[:2], *out.shape[1:])
