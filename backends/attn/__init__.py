"""Attention: dense ``attention`` (batch of equal-length sequences) and ``varlen_attention`` (packed sequences in
flash_attn's layout), each dispatched through the registry; the backends live one module per technology:
``portable`` (SDPA and the naive reference, every device), ``cuda`` (torch varlen, flash_attn, xformers) and
``metal`` (Apple GPUs). ``varlen_attention`` reads a backend's ``takes_rows`` capability, never its name.

Memory bound. No backend here builds a (sum_q x sum_k) matrix or mask beyond ``PACKED_MASK_MAX_ENTRIES``
entries (1,024 tokens, see ``sdpa_varlen_attention``). On CPU/MPS, the portable SDPA backend groups
sequences of similar length into padded batches and splits batches and queries so that one attention score tensor
never exceeds ``max_attention_bytes(device)`` (set with ``set_max_attention_bytes`` or ``$SAM3D_ATTN_MAX_MB``;
by default 512 MiB, on MPS a share of ``torch.mps.recommended_max_memory()``, see ``device.memory_budget``). CUDA kernels
(flash / memory-efficient) and the CPU's flash kernel never materialise the scores, so no split is done there.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from ..registry import Family, resolve
from .portable import (ALL_DEVICES, FLOATS, HALF, PACKED_MASK_MAX_ENTRIES, _attend_packed,  # noqa: F401
                       block_diagonal_mask, max_attention_bytes, naive_attention, naive_varlen_attention,
                       sdpa_attention, sdpa_varlen_attention, set_max_attention_bytes)
from .cuda import (flash_attn_attention, flash_attn_varlen_attention, torch_varlen_attention,  # noqa: F401
                   torch_varlen_dense_attention, xformers_attention, xformers_varlen_attention)
from . import metal  # noqa: F401  (registers the Metal backends; they can run where the shaders compile)


def _check_qkv(q, k, v, rank: int, layout: str) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != rank:
            raise ValueError(f"{name} must be a {rank}-D tensor {layout}, got {getattr(t, 'shape', type(t))}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be floating point, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k head dims differ: {q.shape[-1]} vs {k.shape[-1]}")
    if q.shape[-2] != k.shape[-2] or k.shape[-2] != v.shape[-2]:
        raise ValueError(f"q, k, v must have the same number of heads, got {q.shape[-2]}, {k.shape[-2]}, {v.shape[-2]}")
    if k.shape[:-2] != v.shape[:-2]:
        raise ValueError(f"k and v must have the same leading shape, got {tuple(k.shape)} and {tuple(v.shape)}")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None,
              backend: Optional[str] = None) -> torch.Tensor:
    """Softmax attention for q [B, Lq, H, D], k [B, Lk, H, D], v [B, Lk, H, Dv] -> [B, Lq, H, Dv].

    ``scale`` defaults to 1/sqrt(D). The backend comes from ``backend`` when given (a backend name or "auto"),
    else from ``ATTN_BACKEND`` / ``backends.use(attn=...)``.
    """
    _check_qkv(q, k, v, 4, "[B, L, H, D]")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k batch sizes differ: {q.shape[0]} vs {k.shape[0]}")
    spec = resolve(Family.ATTN, q.device, q.dtype, backend)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if q.shape[1] == 0 or q.shape[0] == 0:
        return q.new_zeros(q.shape[:-1] + (v.shape[-1],))
    if k.shape[1] == 0:
        return q.new_zeros(q.shape[:-1] + (v.shape[-1],))
    return spec.fn(q, k, v, scale)


def context_shortcut_pays(device: torch.device) -> bool:
    """Whether :func:`attention_through_context` is the faster way on ``device``: measured on the CPU (4.5x on
    stage 1's pose-token cross-attention); CUDA runs the plain projection inside its captured graphs, and MPS was
    not measured, so both keep it."""
    return torch.device(device).type == "cpu"


def attention_through_context(q: torch.Tensor, context: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor,
                              bv: Optional[torch.Tensor] = None, scale: Optional[float] = None) -> torch.Tensor:
    """Cross-attention of projected queries q [B, Lq, H, D] to the keys context @ wk.T + bk and values
    context @ wv.T + bv (context [B, Lk, C], wk / wv [H * D, C], bv [H * D]) without projecting the context: each
    head's query is taken into context space instead (q_h @ wk_h), which costs Lq * H context-width rows in place
    of Lk * 2 H D, so it pays when Lq * H is much smaller than H * D (a few pose tokens against thousands of
    condition tokens). The key bias adds the same number to every key of a query, which the softmax drops, and the
    softmax rows sum to 1, so the value bias is added once after; the result equals ``attention`` on the projected
    keys and values up to rounding (summation order). Returns [B, Lq, H, D]."""
    b, lq, h, d = q.shape
    c = context.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    # Explicit bmm throughout: torch.matmul folds a transposed batch operand with reshape, which copies it (the
    # [C, Lk] context view at every block: 4x the time of the whole route in bf16 on the CPU); bmm reads the
    # transposed operands in place. Heads are the bmm batch for the weights (each head its own [D, C] slice).
    q_ctx = torch.bmm(q.permute(2, 0, 1, 3).reshape(h, b * lq, d), wk.view(h, d, c))      # [H, B Lq, C]
    q_ctx = q_ctx.view(h, b, lq, c).transpose(0, 1).reshape(b, h * lq, c)             # [B, H Lq, C]
    # heads and queries as the rows of one product against the context each way: the context is read twice
    scores = torch.bmm(q_ctx, context.transpose(1, 2)) * scale                        # [B, H Lq, Lk]
    mixed = torch.bmm(torch.softmax(scores, dim=-1), context)                         # [B, H Lq, C]
    mixed = mixed.view(b, h, lq, c).transpose(0, 1).reshape(h, b * lq, c)             # [H, B Lq, C]
    out = torch.bmm(mixed, wv.view(h, d, c).transpose(1, 2)).view(h, b, lq, d)         # [H, B, Lq, D]
    if bv is not None:
        out = out + bv.view(h, 1, 1, d)
    return out.permute(1, 2, 0, 3)


def _check_cu(cu: torch.Tensor, total: int, name: str) -> None:
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must be a 1-D tensor [B + 1] of cumulative lengths")
    if cu.dtype.is_floating_point:
        raise TypeError(f"{name} must be an integer tensor (int32 as flash_attn), got {cu.dtype}")
    if cu.device.type != "cpu":
        return  # reading values on an accelerator would stall it at every call (flash_attn does not check either)
    first, last = int(cu[0]), int(cu[-1])
    if first != 0 or last != total:
        raise ValueError(f"{name} must start at 0 and end at the token count {total}, got {first}..{last}")
    if cu.numel() > 1 and bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing")


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: Optional[int] = None,
                     max_seqlen_k: Optional[int] = None, scale: Optional[float] = None,
                     rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention over packed sequences (flash_attn's varlen layout): q [Tq, H, D], k [Tk, H, D], v [Tk, H, Dv];
    sequence i owns rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` of q and the matching rows of k/v.
    Returns [Tq, H, Dv]. The backend comes from ``SPARSE_ATTN_BACKEND`` (falling back to ``ATTN_BACKEND``).
    Pass ``max_seqlen_q/k`` when known: computing them from device-resident ``cu_seqlens`` costs a sync. The
    values of ``cu_seqlens`` are validated when they are on the CPU.

    ``rows`` (self-attention on unsorted tokens, e.g. voxels grouped by window): an int64 permutation of the
    T rows; the packed sequences are then ``q[rows]``, ``k[rows]``, ``v[rows]`` and the output comes back in q's
    own row order (the same as ``out_packed[inverse(rows)]``). Backends that take the permutation gather each
    batch of sequences straight from q/k/v and write their rows back in place; the others get packed copies.
    """
    _check_qkv(q, k, v, 3, "[T, H, D]")
    _check_cu(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
    _check_cu(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k describe {cu_seqlens_q.numel() - 1} and "
                         f"{cu_seqlens_k.numel() - 1} sequences; they must match")
    if rows is not None:
        _check_rows(rows, q, k)
    spec = resolve(Family.SPARSE_ATTN, q.device, q.dtype)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if q.shape[0] == 0:
        return q.new_zeros((0, q.shape[1], v.shape[-1]))
    cu_q = cu_seqlens_q.to(device=q.device, dtype=torch.int32)
    cu_k = cu_seqlens_k.to(device=q.device, dtype=torch.int32)
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_q[1:] - cu_q[:-1]).max())
    if max_seqlen_k is None:
        max_seqlen_k = int((cu_k[1:] - cu_k[:-1]).max())
    if rows is None:
        return spec.fn(q, k, v, cu_q, cu_k, int(max_seqlen_q), int(max_seqlen_k), scale)
    if spec.has("takes_rows"):
        return spec.fn(q, k, v, cu_q, cu_k, int(max_seqlen_q), int(max_seqlen_k), scale, rows=rows)
    return _attend_packed(spec.fn, q, k, v, rows, cu_q, cu_k, int(max_seqlen_q), int(max_seqlen_k), scale)


def _check_rows(rows: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"rows= is for self-attention: q has {q.shape[0]} rows, k {k.shape[0]}")
    if not isinstance(rows, torch.Tensor) or rows.dim() != 1 or rows.shape[0] != q.shape[0]:
        raise ValueError(f"rows must be a 1-D permutation of the {q.shape[0]} rows, got {getattr(rows, 'shape', rows)}")
    if rows.dtype != torch.int64:
        raise TypeError(f"rows must be int64, got {rows.dtype}")
    if rows.device != q.device:
        raise ValueError(f"rows must be on q's device ({q.device}), got {rows.device}")
