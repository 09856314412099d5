"""The portable attention backends (every device): SDPA with a memory bound (``sdpa``) and the explicit-softmax
reference (``naive``). See ``backends.attn`` for the memory bound and the entry points."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..device import cpu_amx_tiles, memory_budget
from ..registry import Family, env_value, register

HALF = (torch.float16, torch.bfloat16)
FLOATS = (torch.float32,) + HALF
ALL_DEVICES = ("cpu", "mps", "cuda")

_MAX_BYTES: Optional[int] = None


def max_attention_bytes(device: Optional[torch.device] = None) -> int:
    """Upper bound, in bytes, for one attention-score tensor built by the portable backends on ``device``."""
    if _MAX_BYTES is not None:
        return _MAX_BYTES
    mb = env_value("SAM3D_ATTN_MAX_MB")
    if mb:
        return int(float(mb) * 2 ** 20)
    return memory_budget(device) if device is not None else 512 * 2 ** 20


def set_max_attention_bytes(value: Optional[int]) -> None:
    """Set the bound (``None`` restores the default / environment value)."""
    global _MAX_BYTES
    if value is not None and value < 1:
        raise ValueError("the attention memory bound must be positive")
    _MAX_BYTES = value


def _attend_packed(fn, q, k, v, rows: torch.Tensor, *args) -> torch.Tensor:
    """``fn`` on the packed copies ``q/k/v[rows]``, its output put back in q's row order."""
    packed = fn(q[rows], k[rows], v[rows], *args)
    return torch.empty_like(packed).index_copy_(0, rows, packed)


# ---------------------------------------------------------------------------------------------------------------
# SDPA (CPU / MPS / CUDA)
# ---------------------------------------------------------------------------------------------------------------
try:  # the number torch._fused_sdp_choice returns for the flash kernel (looked up once: _sdpa_bhld is per call)
    from torch.nn.attention import SDPBackend
    _FLASH_BACKEND: Optional[int] = int(SDPBackend.FLASH_ATTENTION)
except (ImportError, AttributeError):  # a torch without the backend enum: keep the split
    _FLASH_BACKEND = None


def _cpu_flash_kernel(q, k, v, mask) -> bool:
    """Whether CPU SDPA runs its flash kernel on these inputs. That kernel works through blocks of queries and keys
    and never builds the [Lq, Lk] score tensor the memory bound is about, so splitting its call only costs time
    (4-10 % of a bfloat16 attention at 16 threads, 2-6 % at 2). torch's own choice is asked, so a disabled
    flash kernel (``sdpa_kernel(SDPBackend.MATH)``) or a torch without the query keeps the split."""
    if _FLASH_BACKEND is None:
        return False
    try:
        return torch._fused_sdp_choice(q, k, v, attn_mask=mask) == _FLASH_BACKEND
    except (AttributeError, RuntimeError, TypeError):
        return False


def _contiguous_keys_pay(k: torch.Tensor) -> bool:
    """Whether the CPU's flash kernel should get keys / values as contiguous copies rather than as the model's views
    (slices of a fused projection, [B, L, H, D] transposed). The kernel reads every key and value block once per
    block of queries, so the strided reads repeat; the one copy measured faster in float32 (0-19 % of a 4k x 4-8k
    attention, 2 and 16 threads) and in bfloat16 without AMX (10-12 %, AVX-512 BF16, 2 threads), and slower in
    bfloat16 with AMX tiles (3-9 %, 16 threads), so it is skipped there."""
    return not k.is_contiguous() and (k.dtype not in HALF or not cpu_amx_tiles())


def _sdpa_bhld(q, k, v, scale, mask=None):
    """SDPA on [B, H, L, D] tensors, splitting the batch and the queries to respect the memory bound where the
    kernel would build the score tensor (not CUDA's fused kernels nor the CPU's flash kernel)."""
    if q.device.type == "mps" and q.dtype == torch.float16:
        # fp16 attention scores overflowed in the SAM 3D mesh decoder on MPS (a Mac port of upstream had to force
        # fp32 there); CUDA kernels keep softmax statistics in fp32 internally, so do the same here.
        return _sdpa_bhld(q.float(), k.float(), v.float(), scale, mask).to(q.dtype)
    b, h, lq, _ = q.shape
    lk = k.shape[2]
    if q.device.type == "cuda":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    if q.device.type == "cpu" and _cpu_flash_kernel(q, k, v, mask):
        if _contiguous_keys_pay(k):
            k, v = k.contiguous(), v.contiguous()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    per_query = h * lk * max(q.element_size(), 4)
    budget = max(max_attention_bytes(q.device) // per_query, 1)  # query rows (over all batch items) per call
    if b * lq <= budget:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    out = q.new_empty(q.shape[:-1] + (v.shape[-1],))
    if lq <= budget:
        step = max(budget // lq, 1)
        for s in range(0, b, step):
            m = mask[s:s + step] if mask is not None else None
            out[s:s + step] = F.scaled_dot_product_attention(q[s:s + step], k[s:s + step], v[s:s + step],
                                                             attn_mask=m, scale=scale)
        return out
    for i in range(b):
        m = mask[i:i + 1] if mask is not None else None
        for s in range(0, lq, budget):
            # a key-padding mask broadcasts over the queries; a per-query mask is cut with them
            m_s = m[..., s:s + budget, :] if m is not None and m.shape[-2] > 1 else m
            out[i:i + 1, :, s:s + budget] = F.scaled_dot_product_attention(
                q[i:i + 1, :, s:s + budget], k[i:i + 1], v[i:i + 1], attn_mask=m_s, scale=scale)
    return out


@register(Family.ATTN, "sdpa", devices=ALL_DEVICES, dtypes=FLOATS + (torch.float64,), priority=10)
def sdpa_attention(q, k, v, scale):
    out = _sdpa_bhld(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale)
    return out.transpose(1, 2)


def _host_lengths(lengths: torch.Tensor, total: int, longest: int) -> list[int]:
    """The sequence lengths as host ints, read from the device only when the shapes do not imply them: one
    sequence holds every row, and n sequences of at most ``longest`` rows that hold ``n * longest`` rows all hold
    ``longest``. A CUDA-graph capture (stage 2, batch 1: full and cross attention over one sequence) cannot copy
    device values to the host, and an eager call saves the sync."""
    n = lengths.numel()
    if n == 1:
        return [int(total)]
    if n > 1 and longest * n == total:
        return [int(longest)] * n
    return lengths.tolist()


def _length_buckets(lq: list[int], lk: list[int], slack: float = 0.9) -> list[list[int]]:
    """Group sequence ids so that padding each group to its longest member wastes at most ``1 - slack``."""
    order = sorted(range(len(lq)), key=lambda i: (lk[i], lq[i]), reverse=True)
    buckets: list[list[int]] = []
    top_q = top_k = 0
    for i in order:
        if buckets and lk[i] >= slack * top_k and lq[i] >= slack * top_q:
            buckets[-1].append(i)
        else:
            buckets.append([i])
            top_q, top_k = lq[i], lk[i]
    return buckets


def _padded_index(starts: torch.Tensor, lengths: torch.Tensor, width: int):
    steps = torch.arange(width, device=starts.device)
    valid = steps[None, :] < lengths[:, None]
    index = torch.where(valid, starts[:, None] + steps[None, :], torch.zeros_like(steps)[None, :])
    return index, valid


# Packed sequences up to this many (query x key) pairs are attended in ONE SDPA call with a block-diagonal mask,
# which is exactly upstream's SDPA path: the CPU kernel's summation order depends on where a key sits in the packed
# row, and with the same call the golden Gaussian-decoder and sparse-op attention outputs are reproduced bit for
# bit (and the golden mesh decoder only passes with bit-identical decoder output). Its cost is quadratic in the
# token count: on the 2-core CPU, 12 heads x 64, it beats padded buckets up to ~256 tokens and costs 5.9 vs 2.1 ms
# at 512 and 21 vs 3.6 ms at this limit (1,024 tokens); larger inputs always take the buckets.
PACKED_MASK_MAX_ENTRIES = 1 << 20


def block_diagonal_mask(cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int) -> torch.Tensor:
    """[Tq, Tk] bool: query row i may attend key row j iff both belong to the same sequence."""
    ids = torch.arange(cu_q.numel() - 1, device=cu_q.device)
    seq_q = torch.repeat_interleave(ids, (cu_q[1:] - cu_q[:-1]).long(), output_size=total_q)
    seq_k = torch.repeat_interleave(ids, (cu_k[1:] - cu_k[:-1]).long(), output_size=total_k)
    return seq_q[:, None] == seq_k[None, :]


@register(Family.SPARSE_ATTN, "sdpa", devices=ALL_DEVICES, dtypes=FLOATS + (torch.float64,), priority=10,
          takes_rows=True)
def sdpa_varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, scale, rows=None):
    """Equal lengths: one reshaped batch. Few tokens: one call with a block-diagonal mask (upstream's path).
    Otherwise per-bucket padded SDPA: sequences of similar length share one batched call with a key-padding mask.
    ``rows`` (see `varlen_attention`): the buckets gather their tokens from q/k/v through it and write their
    results back to those rows, so neither the inputs nor the output are copied in packed order (the same values
    reach the same SDPA calls); the two single-call paths take packed copies."""
    lq_t = cu_q[1:] - cu_q[:-1]
    lk_t = cu_k[1:] - cu_k[:-1]
    lq, lk = _host_lengths(lq_t, q.shape[0], max_q), _host_lengths(lk_t, k.shape[0], max_k)
    n_seq = len(lq)
    equal_lengths = len(set(lq)) == 1 and len(set(lk)) == 1 and lk[0] > 0
    # a sequence with queries but no keys would leave fully masked rows (NaN in SDPA); buckets give it zeros
    keys_everywhere = all(b > 0 for a, b in zip(lq, lk) if a > 0)
    pairs = q.shape[0] * k.shape[0]
    one_masked_call = (pairs <= PACKED_MASK_MAX_ENTRIES and pairs * 4 <= max_attention_bytes(q.device)
                       and keys_everywhere)
    if rows is not None and (equal_lengths or one_masked_call):
        return _attend_packed(sdpa_varlen_attention, q, k, v, rows, cu_q, cu_k, max_q, max_k, scale)
    out_shape = (q.shape[0], q.shape[1], v.shape[-1])
    if equal_lengths:
        # Equal lengths (e.g. full windows, or a batch of equal sequences): a plain reshape, no gather.
        h = q.shape[1]
        qb = q.reshape(n_seq, lq[0], h, -1).transpose(1, 2)
        kb = k.reshape(n_seq, lk[0], h, -1).transpose(1, 2)
        vb = v.reshape(n_seq, lk[0], h, -1).transpose(1, 2)
        return _sdpa_bhld(qb, kb, vb, scale).transpose(1, 2).reshape(out_shape)
    if one_masked_call:
        mask = block_diagonal_mask(cu_q, cu_k, q.shape[0], k.shape[0])[None, None]
        res = _sdpa_bhld(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale, mask)
        return res[0].transpose(0, 1)
    # zeros: the rows of sequences without queries or keys stay zero (the buckets write only the others)
    out = q.new_zeros(out_shape)
    for bucket in _length_buckets(lq, lk):
        ids = torch.tensor([i for i in bucket if lq[i] > 0 and lk[i] > 0], device=q.device, dtype=torch.long)
        if ids.numel() == 0:
            continue  # sequences without queries or keys produce zeros, as flash_attn does
        width_q, width_k = max(lq[i] for i in bucket), max(lk[i] for i in bucket)
        iq, vq = _padded_index(cu_q[ids].long(), lq_t[ids].long(), width_q)
        ik, vk = _padded_index(cu_k[ids].long(), lk_t[ids].long(), width_k)
        if rows is not None:  # packed position -> the token's own row (padding slots read row rows[0], masked)
            iq, ik = rows[iq], rows[ik]
        qb = q[iq].permute(0, 2, 1, 3)
        kb = k[ik].permute(0, 2, 1, 3)
        vb = v[ik].permute(0, 2, 1, 3)
        mask = None if bool(vk.all()) else vk[:, None, None, :]
        res = _sdpa_bhld(qb, kb, vb, scale, mask).permute(0, 2, 1, 3)
        out[iq[vq]] = res[vq]
    return out


# ---------------------------------------------------------------------------------------------------------------
# naive reference (explicit softmax; any device, any float dtype; computes in at least float32)
# ---------------------------------------------------------------------------------------------------------------
def _naive_core(q, k, v, scale):
    """q [Lq, H, D], k [Lk, H, D], v [Lk, H, Dv] -> [Lq, H, Dv]."""
    work = torch.promote_types(q.dtype, torch.float32)
    scores = torch.einsum("qhd,khd->hqk", q.to(work), k.to(work)) * scale
    weights = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, v.to(work)).to(q.dtype)


@register(Family.ATTN, "naive", devices=ALL_DEVICES, dtypes=FLOATS + (torch.float64,), reference=True)
def naive_attention(q, k, v, scale):
    return torch.stack([_naive_core(q[i], k[i], v[i], scale) for i in range(q.shape[0])])


@register(Family.SPARSE_ATTN, "naive", devices=ALL_DEVICES, dtypes=FLOATS + (torch.float64,), reference=True)
def naive_varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    out = q.new_zeros((q.shape[0], q.shape[1], v.shape[-1]))
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for i in range(len(bq) - 1):
        if bq[i + 1] > bq[i] and bk[i + 1] > bk[i]:
            out[bq[i]:bq[i + 1]] = _naive_core(q[bq[i]:bq[i + 1]], k[bk[i]:bk[i + 1]], v[bk[i]:bk[i + 1]], scale)
    return out
