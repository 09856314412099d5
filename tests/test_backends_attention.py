"""Attention backends against a float64 explicit-softmax reference written here (not the naive backend)."""
import copy
import math

import pytest
import torch

import backends
import backends.attn.portable as attn_impl
from conftest import AtenOpLog, assert_close_to_reference, device_backend_params


def reference(q, k, v, scale):
    """float64 softmax(q k^T * scale) v for one sequence: q [Lq,H,D], k [Lk,H,D], v [Lk,H,Dv]."""
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v.double())


def varlen_reference(q, k, v, lq, lk, scale):
    out, sq, sk = [], 0, 0
    for a, b in zip(lq, lk):
        out.append(reference(q[sq:sq + a], k[sk:sk + b], v[sk:sk + b], scale) if b else
                   torch.zeros(a, q.shape[1], v.shape[2], dtype=torch.float64))
        sq, sk = sq + a, sk + b
    return torch.cat(out)


def cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def available(family):
    return [name for name, spec in backends.registered(family).items() if spec.why_not(torch.device("cpu")) is None]


SPARSE = available(backends.Family.SPARSE_ATTN)
DENSE = available(backends.Family.ATTN)

LENGTH_CASES = {
    "ones": ([1, 1, 1], [1, 1, 1]),
    "mixed": ([1, 7, 64, 3, 130, 2], [1, 7, 64, 3, 130, 2]),
    "very_unequal": ([1, 500, 2], [1, 500, 2]),
    "cross": ([5, 40, 1], [17, 3, 90]),
    "equal": ([16, 16, 16, 16], [16, 16, 16, 16]),
    "empty_seq": ([4, 0, 6], [3, 5, 0]),
}


def _float_dtypes(backend_family, backend, device):
    spec = backends.registered(backend_family)[backend]
    return [d for d in (torch.float32, torch.float16) if d in spec.dtypes]


@pytest.mark.parametrize("device,backend", device_backend_params(backends.Family.SPARSE_ATTN), indirect=["device"])
@pytest.mark.parametrize("case", sorted(LENGTH_CASES))
def test_varlen_matches_float64_reference(device, backend, case):
    """Every backend usable on the device, in each float dtype it takes, against the CPU float64 reference."""
    lq, lk = LENGTH_CASES[case]
    g = torch.Generator().manual_seed(len(case))
    q = torch.randn(sum(lq), 3, 16, generator=g)
    k = torch.randn(sum(lk), 3, 16, generator=g)
    v = torch.randn(sum(lk), 3, 8, generator=g)  # Dv != D on purpose
    ref = varlen_reference(q, k, v, lq, lk, 1 / 4.0)
    for dtype in _float_dtypes(backends.Family.SPARSE_ATTN, backend, device):
        with backends.use(sparse_attn=backend):
            out = backends.varlen_attention(*(t.to(device, dtype) for t in (q, k, v)), cu(lq).to(device),
                                            cu(lk).to(device))
        assert out.device.type == device.type and out.dtype == dtype
        assert_close_to_reference(out, ref)


@pytest.mark.parametrize("backend", SPARSE)
def test_varlen_explicit_scale_and_float64(backend):
    lq = [3, 9, 30]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lq), 2, 5, generator=g, dtype=torch.float64) for _ in range(3))
    with backends.use(sparse_attn=backend):
        out = backends.varlen_attention(q, k, v, cu(lq), cu(lq), scale=0.37)
    torch.testing.assert_close(out, varlen_reference(q, k, v, lq, lq, 0.37), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("device,backend", device_backend_params(backends.Family.ATTN), indirect=["device"])
@pytest.mark.parametrize("lq,lk", [(1, 1), (13, 13), (7, 300), (250, 3)])
def test_dense_attention_matches_reference(device, backend, lq, lk):
    g = torch.Generator().manual_seed(lq + lk)
    q = torch.randn(2, lq, 4, 16, generator=g)
    k = torch.randn(2, lk, 4, 16, generator=g)
    v = torch.randn(2, lk, 4, 24, generator=g)
    ref = torch.stack([reference(q[i], k[i], v[i], 0.2) for i in range(2)])
    for dtype in _float_dtypes(backends.Family.ATTN, backend, device):
        with backends.use(attn=backend):
            out = backends.attention(*(t.to(device, dtype) for t in (q, k, v)), scale=0.2)
        assert out.device.type == device.type and out.dtype == dtype
        assert_close_to_reference(out, ref)


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 3e-3), (torch.bfloat16, 2e-2)])
def test_half_precision_sdpa(dtype, tol, device):
    """The automatic backend of the device in half precision (bf16 on every device PyTorch supports it)."""
    lq = [5, 33, 100]
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(sum(lq), 2, 32, generator=g) for _ in range(3))
    out = backends.varlen_attention(q.to(device, dtype), k.to(device, dtype), v.to(device, dtype),
                                    cu(lq).to(device), cu(lq).to(device))
    assert out.dtype == dtype and out.device.type == device.type
    ref = varlen_reference(q, k, v, lq, lq, 1 / math.sqrt(32))
    assert (out.cpu().double() - ref).abs().max() < tol


def test_memory_bound_is_respected(monkeypatch):
    """With a tiny bound, no single SDPA call may see more score elements than the bound allows, and the result
    must not change. (A sum_q x sum_k mask would blow the bound immediately.) The kernel that builds the scores
    (SDPA's math path: MPS's, or the CPU's with its flash kernel disabled) is the one the bound is for."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    lq = [300, 17, 290, 1, 64]
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(sum(lq), 2, 8, generator=g) for _ in range(3))
    ref = varlen_reference(q, k, v, lq, lq, 1 / math.sqrt(8))
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q_, k_, v_, **kw):
        seen.append(q_.shape[0] * q_.shape[1] * q_.shape[2] * k_.shape[2] * 4)
        return real(q_, k_, v_, **kw)

    monkeypatch.setattr(attn_impl.F, "scaled_dot_product_attention", spy)
    bound = 64 * 1024
    backends.set_max_attention_bytes(bound)
    try:
        with backends.use(sparse_attn="sdpa"), sdpa_kernel(SDPBackend.MATH):
            out = backends.varlen_attention(q, k, v, cu(lq), cu(lq))
        with backends.use(attn="sdpa"), sdpa_kernel(SDPBackend.MATH):
            dense = backends.attention(q[None, :300], k[None, :300], v[None, :300])
    finally:
        backends.set_max_attention_bytes(None)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dense[0].double(), reference(q[:300], k[:300], v[:300], 1 / math.sqrt(8)),
                               rtol=1e-5, atol=1e-5)
    assert seen and max(seen) <= bound, f"an SDPA call used {max(seen)} bytes of scores (bound {bound})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_flash_kernel_is_not_split_and_gives_the_split_result(monkeypatch, dtype):
    """The CPU's flash kernel never builds the score tensor, so a call over the bound stays one SDPA call there
    (splitting it only cost time), with the split path's values bit for bit (each query row is computed alone);
    with the flash kernel disabled the same call is split again."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 300, 2, 16, generator=g).to(dtype) for _ in range(3))
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(attn_impl.F, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(a[0].shape[2]) or real(*a, **kw))
    backends.set_max_attention_bytes(2 * 300 * 4 * 64)  # 64 query rows of scores a call
    try:
        with backends.use(attn="sdpa"):
            whole = backends.attention(q, k, v)
            assert calls == [300], calls
            calls.clear()
            monkeypatch.setattr(attn_impl, "_cpu_flash_kernel", lambda *a: False)
            split = backends.attention(q, k, v)
            assert len(calls) == 5 and max(calls) == 64, calls
            calls.clear()
            monkeypatch.undo()
            monkeypatch.setattr(attn_impl.F, "scaled_dot_product_attention",
                                lambda *a, **kw: calls.append(a[0].shape[2]) or real(*a, **kw))
            with sdpa_kernel(SDPBackend.MATH):
                backends.attention(q, k, v)
            assert len(calls) == 5, calls
    finally:
        backends.set_max_attention_bytes(None)
    assert torch.equal(whole, split)
    ref = reference(q[0].double(), k[0].double(), v[0].double(), 1 / math.sqrt(16))
    assert (whole[0].double() - ref).abs().max() < (1e-5 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_keys_copied_where_it_pays_with_the_same_values(monkeypatch, dtype, amx):
    """Keys / values that are views of a fused projection reach the CPU's flash kernel as contiguous copies in
    float32, and in bfloat16 only without AMX tiles; either way the values are the views' own, bit for bit."""
    monkeypatch.setattr(attn_impl, "cpu_amx_tiles", lambda: amx)
    g = torch.Generator().manual_seed(6)
    q, k, v = torch.randn(1, 200, 3, 2, 16, generator=g).to(dtype).unbind(2)  # [B, L, H, D] views, as models make
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(attn_impl.F, "scaled_dot_product_attention",
                        lambda *a, **kw: seen.append((a[1].is_contiguous(), a[2].is_contiguous())) or real(*a, **kw))
    with backends.use(attn="sdpa"):
        out = backends.attention(q, k, v)
    copied = dtype == torch.float32 or not amx
    assert seen == [(copied, copied)]
    plain = real(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    assert torch.equal(out, plain)
    ref = reference(q[0].double(), k[0].double(), v[0].double(), 1 / math.sqrt(16))
    assert (out[0].double() - ref).abs().max() < (1e-5 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("call,match", [
    (lambda: backends.varlen_attention(torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8),
                                       cu([2, 2]), cu([4])), "describe 2 and 1 sequences"),
    (lambda: backends.varlen_attention(torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8),
                                       cu([2, 1]), cu([2, 2])), "end at the token count 4"),
    (lambda: backends.varlen_attention(torch.randn(4, 2, 8), torch.randn(4, 3, 8), torch.randn(4, 3, 8),
                                       cu([4]), cu([4])), "same number of heads"),
    (lambda: backends.varlen_attention(torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8),
                                       cu([4]), cu([4])), "3-D"),
    (lambda: backends.attention(torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 6), torch.randn(1, 4, 2, 8)),
     "head dims differ"),
    (lambda: backends.attention(torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8).double(),
                                torch.randn(1, 4, 2, 8)), "share a dtype"),
    (lambda: backends.varlen_attention(torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8),
                                       torch.tensor([0.0, 4.0]), cu([4])), "integer"),
])
def test_bad_input_errors(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


@pytest.mark.parametrize("case", sorted(LENGTH_CASES))
@pytest.mark.parametrize("limit", [0, 1 << 40], ids=["buckets", "packed"])
def test_sdpa_varlen_both_paths_match_reference(case, limit, monkeypatch):
    """The portable backend attends short packs in one masked call and long ones in padded buckets; force each."""
    monkeypatch.setattr(attn_impl, "PACKED_MASK_MAX_ENTRIES", limit)
    lq, lk = LENGTH_CASES[case]
    g = torch.Generator().manual_seed(7 + len(case))
    q, k = torch.randn(sum(lq), 3, 16, generator=g), torch.randn(sum(lk), 3, 16, generator=g)
    v = torch.randn(sum(lk), 3, 8, generator=g)
    with backends.use(sparse_attn="sdpa"):
        out = backends.varlen_attention(q, k, v, cu(lq), cu(lk))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), varlen_reference(q, k, v, lq, lk, 1 / 4.0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lengths,limit", [([64, 64], 0), ([64], 0), ([5, 40, 1], 1 << 40)],
                         ids=["equal", "one", "packed"])
def test_sdpa_varlen_single_call_paths_fill_no_buffer(lengths, limit, monkeypatch):
    """Equal lengths (stage 2's self- and cross-attention: one sequence) and short packs are one SDPA call whose
    result is returned as it is: no zero-filled output buffer is made for them (a [4096, 16, 64] fill a call at
    stage 2's size); the buckets' path, which leaves rows of empty sequences zero, still fills one."""
    monkeypatch.setattr(attn_impl, "PACKED_MASK_MAX_ENTRIES", limit)
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(sum(lengths), 2, 16, generator=g) for _ in range(3))
    log = AtenOpLog()
    with backends.use(sparse_attn="sdpa"), log:
        out = backends.varlen_attention(q, k, v, cu(lengths), cu(lengths))
    assert not [op for op in log.ops if op.startswith(("zero", "fill", "new_zeros"))], log.ops
    torch.testing.assert_close(out.double(), varlen_reference(q, k, v, lengths, lengths, 1 / 4.0), rtol=1e-5,
                               atol=1e-5)
    if limit == 0 and len(set(lengths)) == 1:
        return
    monkeypatch.setattr(attn_impl, "PACKED_MASK_MAX_ENTRIES", 0)
    log = AtenOpLog()
    with backends.use(sparse_attn="sdpa"), log:
        bucketed = backends.varlen_attention(q, k, v, cu(lengths), cu(lengths))
    assert [op for op in log.ops if op.startswith(("zero", "fill", "new_zeros"))]
    torch.testing.assert_close(bucketed, out, rtol=1e-5, atol=1e-6)


def test_short_packs_take_upstreams_single_masked_call(monkeypatch):
    """Below PACKED_MASK_MAX_ENTRIES the result is bitwise that of one SDPA call over the packed sequence with a
    block-diagonal mask (upstream's call), made in exactly one call; above it, buckets are used."""
    lq = [12, 3, 5, 7, 6, 8, 4, 5]
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(sum(lq), 4, 64, generator=g) for _ in range(3))
    seq = torch.repeat_interleave(torch.arange(len(lq)), torch.tensor(lq))
    upstream = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=seq[:, None] == seq[None, :])[0].transpose(0, 1)
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(attn_impl.F, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    with backends.use(sparse_attn="sdpa"):
        out = backends.varlen_attention(q, k, v, cu(lq), cu(lq))
        assert torch.equal(out, upstream) and len(calls) == 1
        monkeypatch.setattr(attn_impl, "PACKED_MASK_MAX_ENTRIES", sum(lq) ** 2 - 1)
        calls.clear()
        bucketed = backends.varlen_attention(q, k, v, cu(lq), cu(lq))
    assert len(calls) > 1
    torch.testing.assert_close(bucketed, upstream, rtol=1e-5, atol=1e-6)


def test_packed_call_splits_queries_under_the_memory_bound(monkeypatch):
    """On the kernel that builds the scores (SDPA's math path); the CPU's flash kernel is not split (above)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    lq = [5, 40, 1, 70]
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(sum(lq), 2, 8, generator=g) for _ in range(3))
    # the packed mask (as float) just fits; the scores of 2 heads do not: queries are split in halves
    backends.set_max_attention_bytes(sum(lq) * sum(lq) * 4)
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(attn_impl.F, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(tuple(a[0].shape)) or real(*a, **kw))
    try:
        with backends.use(sparse_attn="sdpa"), sdpa_kernel(SDPBackend.MATH):
            out = backends.varlen_attention(q, k, v, cu(lq), cu(lq))
    finally:
        backends.set_max_attention_bytes(None)
    torch.testing.assert_close(out.double(), varlen_reference(q, k, v, lq, lq, 1 / math.sqrt(8)), rtol=1e-5,
                               atol=1e-5)
    assert calls == [(1, 2, sum(lq) // 2, 8)] * 2


def test_varlen_backend_sends_one_sequence_to_dense_sdpa():
    """The CUDA varlen backend hands a single sequence (stage 2's full and cross attention) to dense SDPA; that
    branch needs no CUDA kernel, so its arithmetic is checked here on CPU tensors (Dv != D, Lq != Lk)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(37, 2, 16, generator=g), torch.randn(20, 2, 16, generator=g), torch.randn(20, 2, 8, generator=g)
    out = backends.attn.torch_varlen_attention(q, k, v, cu([37]), cu([20]), 37, 20, 0.3)
    assert out.shape == (37, 2, 8)
    torch.testing.assert_close(out.double(), reference(q, k, v, 0.3), rtol=1e-5, atol=1e-5)


SELF_CASES = {name: lengths for name, (lengths, lk) in LENGTH_CASES.items() if lengths == lk}


@pytest.mark.parametrize("backend", SPARSE)
@pytest.mark.parametrize("case", sorted(SELF_CASES))
@pytest.mark.parametrize("limit", [0, 1 << 40], ids=["buckets", "packed"])
def test_varlen_rows_attend_the_permuted_tokens_in_place(backend, case, limit, monkeypatch):
    """rows=: sequence i is q/k/v[rows[cu[i]:cu[i+1]]] and the output is in q's row order: compare with the
    float64 reference of the packed copies, scattered back by hand, and with the packed call bit for bit."""
    monkeypatch.setattr(attn_impl, "PACKED_MASK_MAX_ENTRIES", limit)
    lengths = SELF_CASES[case]
    g = torch.Generator().manual_seed(11 + len(case))
    total = sum(lengths)
    q, k = torch.randn(total, 3, 16, generator=g), torch.randn(total, 3, 16, generator=g)
    v = torch.randn(total, 3, 8, generator=g)
    rows = torch.randperm(total, generator=g)
    expected = torch.empty(total, 3, 8, dtype=torch.float64)
    expected[rows] = varlen_reference(q[rows], k[rows], v[rows], lengths, lengths, 1 / 4.0)
    with backends.use(sparse_attn=backend):
        out = backends.varlen_attention(q, k, v, cu(lengths), cu(lengths), rows=rows)
        packed = backends.varlen_attention(q[rows], k[rows], v[rows], cu(lengths), cu(lengths))
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[rows], packed)  # the same values reach the same kernel calls


def test_varlen_rows_reads_strided_views_of_one_qkv_tensor(monkeypatch):
    """The windowed attention passes q, k, v as unbound views of one [N, 3, H, D] tensor."""
    monkeypatch.setattr(attn_impl, "PACKED_MASK_MAX_ENTRIES", 0)
    lengths = [5, 40, 1, 33, 36]
    qkv = torch.randn(sum(lengths), 3, 2, 16, generator=torch.Generator().manual_seed(3))
    rows = torch.randperm(sum(lengths), generator=torch.Generator().manual_seed(4))
    out = backends.varlen_attention(*qkv.unbind(1), cu(lengths), cu(lengths), rows=rows)
    expected = torch.empty(sum(lengths), 2, 16, dtype=torch.float64)
    q, k, v = qkv[rows].unbind(1)
    expected[rows] = varlen_reference(q, k, v, lengths, lengths, 1 / 4.0)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,match", [
    (torch.arange(3), "permutation of the 4 rows"),
    (torch.arange(4, dtype=torch.int32), "int64"),
])
def test_varlen_rows_bad_input(rows, match):
    with pytest.raises((ValueError, TypeError), match=match):
        backends.varlen_attention(torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8), cu([4]), cu([4]),
                                  rows=rows)


def test_varlen_rows_is_for_self_attention():
    with pytest.raises(ValueError, match="self-attention"):
        backends.varlen_attention(torch.randn(4, 2, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8), cu([4]), cu([5]),
                                  rows=torch.arange(4))


@pytest.mark.parametrize("with_bias", [True, False])
def test_attention_through_context_matches_projected_keys_and_values(with_bias):
    """Few queries against a long context: the context never projected gives float64 brute force's answer
    (keys and values projected with their biases, softmax, weighted sum), key bias included."""
    g = torch.Generator().manual_seed(3)
    b, lq, lk, h, d, c = 2, 3, 300, 4, 8, 24
    q = torch.randn(b, lq, h, d, generator=g, dtype=torch.float64)
    context = torch.randn(b, lk, c, generator=g, dtype=torch.float64)
    wk, wv = (torch.randn(h * d, c, generator=g, dtype=torch.float64) / 4 for _ in range(2))
    bk, bv = (torch.randn(h * d, generator=g, dtype=torch.float64) for _ in range(2))
    k = (context @ wk.T + (bk if with_bias else 0)).view(b, lk, h, d)
    v = (context @ wv.T + (bv if with_bias else 0)).view(b, lk, h, d)
    weights = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q, k) / d ** 0.5, dim=-1)
    ref = torch.einsum("bhqk,bkhd->bqhd", weights, v)
    out = backends.attention_through_context(q, context, wk, wv, bv if with_bias else None)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    out32 = backends.attention_through_context(q.float(), context.float(), wk.float(), wv.float(),
                                               bv.float() if with_bias else None)
    torch.testing.assert_close(out32.double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_through_context_reads_the_context_in_place(dtype):
    """The route reads the context where it lies: no copy of it (torch.matmul folds a transposed batch operand
    with a reshape that copies it; in bf16 that copy was 4x the route's own time at stage 1's shapes)."""
    from torch.profiler import ProfilerActivity, profile
    g = torch.Generator().manual_seed(4)
    b, lq, lk, h, d = 1, 4, 512, 4, 16
    q = torch.randn(b, lq, h, d, generator=g).to(dtype)
    context = torch.randn(b, lk, h * d, generator=g).to(dtype)
    wk, wv = (torch.randn(h * d, h * d, generator=g).to(dtype) for _ in range(2))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        backends.attention_through_context(q, context, wk, wv)
    copied = [e.input_shapes for e in prof.events() if e.name == "aten::copy_"]
    assert not [s for s in copied if s and sum(math.prod(x) for x in s[:1] if x) >= lk * h * d], copied


def test_dense_cross_attention_of_few_queries_skips_the_context_projection():
    """MultiHeadAttention(type='cross') with 4 queries on the CPU takes the through-context route and agrees with
    the projected keys / values; many queries, or a key norm, keep the projection."""
    from sam3d_objects.model.backbone.tdfy_dit.modules.attention import MultiHeadAttention
    torch.manual_seed(0)
    layer = MultiHeadAttention(64, 2, ctx_channels=48, type="cross").eval()
    normed = MultiHeadAttention(64, 2, ctx_channels=48, type="cross", qk_rms_norm=True).eval()
    x, context = torch.randn(1, 4, 64), torch.randn(1, 500, 48)
    assert layer._attends_through_context(4, context) and not layer._attends_through_context(16, context)
    assert not normed._attends_through_context(4, context)
    with torch.no_grad():
        q = layer.to_q(x).reshape(1, 4, 2, 32)
        k, v = layer.to_kv(context).reshape(1, 500, 2, 2, 32).unbind(dim=2)
        expected = layer.to_out(backends.attention(q, k, v).reshape(1, 4, -1))
        torch.testing.assert_close(layer(x, context), expected, rtol=1e-5, atol=1e-6)


def test_bfloat16_sampling_takes_the_context_route_too():
    """Under CPU bfloat16 autocast (``--dtype bfloat16``: the context arrives in bfloat16), the pose tokens'
    cross-attention skips the context projection with float32 weights and with the bfloat16 weight format
    alike, and the two give the same values bit for bit (autocast rounds the float32 weight to the stored
    bfloat16 one); the result is within bfloat16 rounding of float64 brute force on the projected keys and
    values. int8 codes (scaled) keep the projection."""
    from sam3d_objects.model.backbone.tdfy_dit.modules.attention import MultiHeadAttention
    from sam3d_objects.model.backbone.tdfy_dit.modules.quantized import QuantizedLinear
    torch.manual_seed(0)
    plain = MultiHeadAttention(64, 2, ctx_channels=48, type="cross").eval()
    bf16 = copy.deepcopy(plain)
    bf16.to_kv = QuantizedLinear.from_weight(plain.to_kv.weight.detach(), plain.to_kv.bias.detach(), "bf16")
    int8 = copy.deepcopy(plain)
    int8.to_kv = QuantizedLinear.from_weight(plain.to_kv.weight.detach(), plain.to_kv.bias.detach(), "int8")
    x, context = torch.randn(1, 4, 64), torch.randn(1, 500, 48)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ctx = context.to(torch.bfloat16)  # as the stage-1 backbone casts its condition for autocast's matmuls
        assert plain._attends_through_context(4, ctx) and bf16._attends_through_context(4, ctx)
        assert not int8._attends_through_context(4, ctx)
        assert not plain._attends_through_context(4, context.to(torch.float16))
        out_plain, out_bf16 = plain(x, ctx), bf16(x, ctx)
    assert torch.equal(out_plain, out_bf16)
    with torch.no_grad():  # float64 brute force on the bfloat16-rounded inputs and weights, projected
        d = {k: v.double() for k, v in plain.state_dict().items()}
        x64, c64 = x.bfloat16().double(), ctx.double()
        wk, wv = d["to_kv.weight"].bfloat16().double().chunk(2)
        bk, bv = d["to_kv.bias"].chunk(2)
        q = (x64 @ d["to_q.weight"].bfloat16().double().T + d["to_q.bias"]).view(1, 4, 2, 32)
        k, v = (c64 @ wk.T + bk).view(1, 500, 2, 32), (c64 @ wv.T + bv).view(1, 500, 2, 32)
        h = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q, k) / 32 ** 0.5, -1)
        h = torch.einsum("bhqk,bkhd->bqhd", h, v).reshape(1, 4, 64)
        ref = h @ d["to_out.weight"].T + d["to_out.bias"]
    err = (out_bf16.double() - ref).abs().max() / ref.abs().max()
    assert err < 3e-2, err


def test_flow_backbones_cast_their_condition_once_for_the_matmuls():
    """Stage 2's backbone (as stage 1's) hands its blocks the condition tokens in the dtype their key / value
    matmuls read: bfloat16 under CPU bfloat16 autocast (cast once, not at every block's projection), float32
    without autocast; the outputs are those of the float32 condition (autocast's own cast, bit for bit)."""
    from test_cuda_graphs import _tiny_slat_flow
    slat, coords = _tiny_slat_flow()
    g = torch.Generator().manual_seed(6)
    x, cond = torch.randn(1, coords.shape[0], 8, generator=g), torch.randn(1, 5, 16, generator=g)
    t = torch.tensor([300.0])
    seen = []
    hooks = [b.register_forward_pre_hook(lambda m, args: seen.append(args[2].dtype)) for b in slat.blocks]
    with torch.no_grad():
        plain = slat(x, t, cond, coords)
        assert seen == [torch.float32] * len(slat.blocks)
        seen.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = slat(x, t, cond, coords)
            again = slat(x, t, cond.bfloat16().float(), coords)
    for h in hooks:
        h.remove()
    assert seen == [torch.bfloat16] * (2 * len(slat.blocks))
    assert torch.equal(out, again) and not torch.equal(out, plain)


@pytest.mark.parametrize("qk_rms_norm", [False, True])
def test_cross_attention_to_one_token_is_that_tokens_value(qk_rms_norm):
    """A context of one token per batch element (the unconditional call's zeroed token): every query gets that
    token's projected value, so the layers return ``to_out(v)`` without projecting the queries (to_q is never
    called); dense and sparse (two batch elements) agree with the attention computed in full within rounding."""
    from sam3d_objects.model.backbone.tdfy_dit.modules.attention import MultiHeadAttention
    from sam3d_objects.model.backbone.tdfy_dit.modules.sparse import SparseTensor
    from sam3d_objects.model.backbone.tdfy_dit.modules.sparse.attention import SparseMultiHeadAttention
    torch.manual_seed(1)
    dense = MultiHeadAttention(32, 2, ctx_channels=24, type="cross", qk_rms_norm=qk_rms_norm).eval()
    sparse = SparseMultiHeadAttention(32, 2, ctx_channels=24, type="cross", qk_rms_norm=qk_rms_norm).eval()
    sparse.load_state_dict(dense.state_dict())
    x, context = torch.randn(2, 7, 32), torch.randn(2, 1, 24)
    d = {k: v.double() for k, v in dense.state_dict().items()}

    def full(layer_x):  # the attention over the one key, in float64
        q = (layer_x.double() @ d["to_q.weight"].T + d["to_q.bias"]).view(2, -1, 2, 16)
        k, v = (context.double() @ d["to_kv.weight"].T + d["to_kv.bias"]).view(2, 1, 2, 2, 16).unbind(2)
        w = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q, k) / 4, -1)
        h = torch.einsum("bhqk,bkhd->bqhd", w, v).reshape(2, -1, 32)
        return h @ d["to_out.weight"].T + d["to_out.bias"]

    class Unused(torch.nn.Module):
        def forward(self, *args):
            raise AssertionError("the queries were projected")

    dense.to_q, sparse.to_q = Unused(), Unused()
    with torch.no_grad():
        out = dense(x, context)
        torch.testing.assert_close(out.double(), full(x), rtol=1e-5, atol=1e-6)
        coords = torch.tensor([[0, 0, 0, i] for i in range(3)] + [[1, 0, 0, i] for i in range(4)], dtype=torch.int32)
        feats = torch.randn(7, 32)
        got = sparse(SparseTensor(feats=feats, coords=coords), context).feats
        ref = torch.cat([full(feats[None, :3].expand(2, 3, 32))[0], full(feats[None, 3:].expand(2, 4, 32))[1]])
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)
