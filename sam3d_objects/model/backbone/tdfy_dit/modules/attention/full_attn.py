"""Dense multi-head attention entry point: every dense attention goes through `backends.attention`."""
from typing import Optional

import torch

import backends


def scaled_dot_product_attention(*args: torch.Tensor, scale: Optional[float] = None) -> torch.Tensor:
    """Softmax attention on [B, L, H, D] tensors, called with packed or separate projections:

    * (qkv [B, L, 3, H, D])
    * (q [B, Lq, H, D], kv [B, Lk, 2, H, D])
    * (q [B, Lq, H, D], k [B, Lk, H, D], v [B, Lk, H, Dv])

    Returns [B, Lq, H, Dv].
    """
    if len(args) == 1:
        qkv = args[0]
        if qkv.dim() != 5 or qkv.shape[2] != 3:
            raise ValueError(f"packed qkv must be [B, L, 3, H, D], got {tuple(qkv.shape)}")
        q, k, v = qkv.unbind(dim=2)
    elif len(args) == 2:
        q, kv = args
        if kv.dim() != 5 or kv.shape[2] != 2:
            raise ValueError(f"packed kv must be [B, L, 2, H, D], got {tuple(kv.shape)}")
        k, v = kv.unbind(dim=2)
    elif len(args) == 3:
        q, k, v = args
    else:
        raise TypeError(f"scaled_dot_product_attention takes 1, 2 or 3 tensors, got {len(args)}")
    if q.dim() != 4:
        raise ValueError(f"q must be [B, L, H, D], got {tuple(q.shape)}")
    return backends.attention(q, k, v, scale=scale)
