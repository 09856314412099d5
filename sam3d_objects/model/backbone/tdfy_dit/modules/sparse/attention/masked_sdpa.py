"""Variable-length attention over packed sequences with an explicit block-diagonal mask (the xformers
BlockDiagonalMask emulation upstream uses without xformers). O(Lq * Lkv) memory: for small inputs and tests;
the models go through `backends.varlen_attention`."""
from typing import Optional, Sequence

import torch
import torch.nn.functional as F


def block_diag_attn_mask(q_seqlens: Sequence[int], kv_seqlens: Sequence[int], device: Optional[torch.device] = None,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive mask (sum q, sum kv): 0 inside the k-th (query sequence, key sequence) block, -inf elsewhere."""
    q_seqlens, kv_seqlens = [int(n) for n in q_seqlens], [int(n) for n in kv_seqlens]
    mask = torch.full((sum(q_seqlens), sum(kv_seqlens)), float("-inf"), device=device, dtype=dtype)
    q0 = k0 = 0
    for nq, nk in zip(q_seqlens, kv_seqlens):
        mask[q0:q0 + nq, k0:k0 + nk] = 0
        q0, k0 = q0 + nq, k0 + nk
    return mask


def masked_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_seqlen: Sequence[int],
                kv_seqlen: Sequence[int]) -> torch.Tensor:
    """q, k, v: (1, total, H, C) packed sequences -> (total_q, H, C), attention within each sequence pair."""
    mask = block_diag_attn_mask(q_seqlen, kv_seqlen, device=q.device, dtype=q.dtype)[None, None]
    out = F.scaled_dot_product_attention(q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3),
                                         attn_mask=mask)
    return out.permute(0, 2, 1, 3)[0]
