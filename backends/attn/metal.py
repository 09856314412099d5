"""The Metal attention backends (Apple GPUs): flash-style varlen attention (``SPARSE_ATTN_BACKEND=metal``,
``backends/metal/varlen_attention.metal``) and dense attention through the same kernel (``ATTN_BACKEND=metal``),
compiled and launched through the shared Metal runtime (``backends.metal``)."""
from __future__ import annotations

import torch

from .. import metal as shaders
from ..registry import Family, register
from .portable import sdpa_varlen_attention

# Tile shapes: these must match the #defines in backends/metal/varlen_attention.metal.
ATTN_TILE_Q, ATTN_THREADS, ATTN_MAX_HEAD_DIM = 16, 128, 128
# Threadgroup memory the kernel declares (bytes, from the tile #defines; fp32 tiles).
ATTN_THREADGROUP_BYTES = 4 * (ATTN_TILE_Q * ATTN_MAX_HEAD_DIM + 32 * (ATTN_MAX_HEAD_DIM + 1) + ATTN_TILE_Q * (32 + 1))


def attention_launches(n_seq: int, max_q: int, max_k: int, heads: int, d: int, dv: int) -> list[tuple]:
    """(first query tile, query tiles, first sequence, sequences) of each launch, bounded in worst-case work."""
    q_tiles = max(1, -(-max_q // ATTN_TILE_Q))
    per_tile = ATTN_TILE_Q * heads * max(max_k, 1) * (d + dv)
    tiles_per_launch = max(1, shaders.LAUNCH_WORK_LIMIT // per_tile)
    if q_tiles <= tiles_per_launch:
        seqs = max(1, tiles_per_launch // q_tiles)
        return [(0, q_tiles, s, min(seqs, n_seq - s)) for s in range(0, n_seq, seqs)]
    return [(t, min(tiles_per_launch, q_tiles - t), s, 1)
            for s in range(n_seq) for t in range(0, q_tiles, tiles_per_launch)]


def metal_varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """Flash-style varlen attention (see ``backends.varlen_attention``); head dims above 128 use SDPA."""
    if q.shape[-1] > ATTN_MAX_HEAD_DIM or v.shape[-1] > ATTN_MAX_HEAD_DIM:
        return sdpa_varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, scale)
    kernel, work = shaders.kernel_for("varlen_attention", "varlen_attention", q.dtype)
    heads, d, dv = q.shape[1], q.shape[2], v.shape[2]
    qc, kc, vc = (t.to(work).contiguous() for t in (q, k, v))
    cq = cu_q.to(torch.int32).contiguous()
    ck = cu_k.to(torch.int32).contiguous()
    out = torch.empty((q.shape[0], heads, dv), dtype=work, device=q.device)
    n_seq = cq.numel() - 1
    meter = shaders.WorkMeter(q.device)
    for tile0, tiles, seq0, seqs in attention_launches(n_seq, max_q, max_k, heads, d, dv):
        meter.add(tiles * seqs * ATTN_TILE_Q * heads * max(max_k, 1) * (d + dv))
        kernel(qc, kc, vc, cq, ck, out, heads, d, dv, float(scale), tile0, seq0,
               threads=[ATTN_THREADS * tiles, heads, seqs], group_size=[ATTN_THREADS, 1, 1])
    return out if work == q.dtype else out.to(q.dtype)


def metal_dense_attention(q, k, v, scale):
    """Dense [B, L, H, D] attention through the varlen kernel (equal lengths)."""
    b, lq, lk = q.shape[0], q.shape[1], k.shape[1]
    cu_q = torch.arange(0, (b + 1) * lq, lq, device=q.device, dtype=torch.int32)
    cu_k = torch.arange(0, (b + 1) * lk, lk, device=q.device, dtype=torch.int32)
    out = metal_varlen_attention(q.reshape(b * lq, *q.shape[2:]), k.reshape(b * lk, *k.shape[2:]),
                                 v.reshape(b * lk, *v.shape[2:]), cu_q, cu_k, lq, lk, scale)
    return out.reshape(b, lq, q.shape[2], -1)


_attn_probe = shaders.probe_for("varlen_attention", "varlen_attention", ATTN_THREADS, ATTN_THREADGROUP_BYTES)
register(Family.SPARSE_ATTN, "metal", devices=("mps",), dtypes=shaders.DTYPES, probe=_attn_probe, priority=30,
         warn_when_skipped=True)(metal_varlen_attention)
# Dense attention: MPS's own SDPA (priority 10) stays the automatic choice; `ATTN_BACKEND=metal` selects this.
register(Family.ATTN, "metal", devices=("mps",), dtypes=shaders.DTYPES, probe=_attn_probe, priority=-10)(
    metal_dense_attention)
