"""Dense multi-head attention entry point: every dense attention goes through `backends.attention`."""
from typing import Optional

import torch

import backends


def scaled_dot_product_attention(*args: torch.Tensor, scale: Optional[float] = None, **kwargs) -> torch.Tensor:
    """Softmax attention on [B, L, H, D] tensors, called with packed or separate projections:

    * (qkv [B, L, 3, H, D])
    * (q [B, Lq, H, D], kv [B, Lk, 2, H, D])
    * (q [B, Lq, H, D], k [B, Lk, H, D], v [B, Lk, H, Dv])

    Returns [B, Lq, H, Dv].
    """
    args = attention_args(args, kwargs)
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


_ARG_NAMES = {1: ("qkv",), 2: ("q", "kv"), 3: ("q", "k", "v")}


def attention_args(args: tuple, kwargs: dict) -> tuple:
    """Upstream's call forms: the inputs positionally and/or by name (qkv | q, kv | q, k, v)."""
    if not kwargs:
        return args
    total = len(args) + len(kwargs)
    names = _ARG_NAMES.get(total)
    if names is None or set(kwargs) != set(names[len(args):]):
        raise TypeError(f"attention inputs must be (qkv), (q, kv) or (q, k, v), positionally or by those names; "
                        f"got {len(args)} positional and {sorted(kwargs)}")
    return tuple(args) + tuple(kwargs[n] for n in names[len(args):])
