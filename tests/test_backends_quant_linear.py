"""backends.quantized_linear / quantize_int8 (the quant_linear family) against float64 references."""
import mmap
import warnings

import pytest
import torch

import backends
from backends import registry
from backends.quant_linear import INT8_MAX


def _reference(x, q, scale, bias):
    """float64 x @ (q * scale)^T + bias."""
    w = q.double() if scale is None else q.double() * scale.double()[:, None]
    out = x.double() @ w.t()
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantize_int8_is_per_channel_absmax_rounding(dtype):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(37, 50, generator=g) * torch.linspace(0.01, 3, 37)[:, None]).to(dtype)
    w[5] = 0  # an all-zero row keeps a usable scale
    q, scale = backends.quantize_int8(w, block_rows=8)  # several row blocks
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and q.shape == w.shape
    w64 = w.double()
    expected_scale = w64.abs().amax(1) / INT8_MAX
    expected_scale[5] = 1.0
    assert torch.allclose(scale.double(), expected_scale, rtol=1e-6, atol=0)
    assert int(q.abs().max()) == INT8_MAX and torch.all(q[5] == 0)
    # round to nearest: every weight within half a step of its code
    assert torch.all((q.double() * scale.double()[:, None] - w64).abs() <= scale.double()[:, None] * 0.5 + 1e-7)


def _available(dtype):
    return [name for name, spec in registry.registered(registry.Family.QUANT_LINEAR).items()
            if spec.why_not(torch.device("cpu"), dtype) is None]


TOL = {"dequant": 1e-5, "int8pack": 1e-5, "int8_dynamic": 2.5e-2, "bf16": 1.5e-2}


@pytest.mark.parametrize("weight_dtype", [torch.int8, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_every_cpu_backend_matches_float64(weight_dtype, with_bias):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 33, 64, generator=g)
    w = torch.randn(48, 64, generator=g) / 8
    bias = torch.randn(48, generator=g) if with_bias else None
    if weight_dtype == torch.int8:
        q, scale = backends.quantize_int8(w)
    else:
        q, scale = w.to(torch.bfloat16), None
    ref = _reference(x, q, scale, bias)
    names = _available(weight_dtype)
    assert "dequant" in names
    for name in names:
        with backends.use(quant_linear=name):
            out = backends.quantized_linear(x, q, scale, bias)
        assert out.dtype == x.dtype and out.shape == (2, 33, 48), name
        err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        assert err <= TOL[name], (name, err)


def test_weight_only_int8_error_is_the_weight_rounding_only():
    """dequant = float GEMM on the rounded weight: against the float weight the error is the int8 rounding's
    (about 1% of the output's scale), against the rounded weight float32 rounding only."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(64, 256, generator=g), torch.randn(128, 256, generator=g) / 16
    q, scale = backends.quantize_int8(w)
    with backends.use(quant_linear="dequant"):
        out = backends.quantized_linear(x, q, scale).double()
    exact = x.double() @ w.double().t()
    rel = ((out - exact).norm() / exact.norm()).item()
    assert 1e-4 < rel < 2e-2
    assert torch.allclose(out, _reference(x, q, scale, None), rtol=1e-5, atol=1e-5)


def test_auto_choice_and_explicit_errors_on_cpu():
    cpu = torch.device("cpu")
    assert registry.resolve(registry.Family.QUANT_LINEAR, cpu, torch.int8).name == "dequant"  # weight-only
    # a named backend runs the stored dtypes it supports, the others take the automatic choice (an int8 model
    # keeps some layers in bf16): int8_dynamic names int8 weights only
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(3, 8, generator=g), torch.randn(4, 8, generator=g) / 4
    q, scale = backends.quantize_int8(w)
    with backends.use(quant_linear="int8_dynamic"):
        assert backends.quant_linear.backend_for(cpu, torch.int8).name == "int8_dynamic"
        auto = registry.resolve(registry.Family.QUANT_LINEAR, cpu, torch.bfloat16, name="auto").name
        assert backends.quant_linear.backend_for(cpu, torch.bfloat16).name == auto
        out = backends.quantized_linear(x, w.bfloat16())
    ref = _reference(x, w.bfloat16(), None, None)
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 1.5e-2
    with pytest.raises(ValueError, match="scale"):
        backends.quantized_linear(torch.randn(3, 8), torch.zeros(4, 8, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"\[out, 8\]"):
        backends.quantized_linear(torch.randn(3, 8), torch.zeros(4, 9, dtype=torch.bfloat16))


def test_bf16_falls_back_with_a_warning_where_the_cpu_lacks_bf16(monkeypatch):
    import backends.quant_linear as ql
    monkeypatch.setattr(ql, "cpu_bf16_matmul_fast", lambda: False)
    registry._RESOLVED.clear()
    registry._WARNED.clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            spec = registry.resolve(registry.Family.QUANT_LINEAR, torch.device("cpu"), torch.bfloat16)
        assert spec.name == "dequant"
        assert any("AVX-512 BF16" in str(w.message) for w in caught)
        # named for the dtype it is made for, where it cannot run: an error naming the fallback
        with pytest.raises(backends.BackendUnavailableError, match="use 'dequant'"):
            with backends.use(quant_linear="bf16"):
                backends.quantized_linear(torch.randn(3, 8), torch.zeros(4, 8, dtype=torch.bfloat16))
        # int8 weights never mention the bf16 path (it is not meant for them), nor does a question without inputs
        # (the CLI's start-up check and backend report resolve every family with no dtype: a float32 run on an
        # AVX2 machine printed this warning at every start)
        registry._RESOLVED.clear()
        registry._WARNED.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            registry.resolve(registry.Family.QUANT_LINEAR, torch.device("cpu"), torch.int8)
            assert registry.resolve(registry.Family.QUANT_LINEAR, torch.device("cpu")).name != "bf16"
            backends.current("cpu")
        assert not caught
    finally:
        registry._RESOLVED.clear()


def test_drop_read_pages_keeps_values_of_a_file_mapping(tmp_path):
    path = tmp_path / "t.pt"
    t = torch.arange(3 << 20, dtype=torch.float32)  # 12 MiB
    torch.save({"t": t}, path)
    mapped = torch.load(path, mmap=True, weights_only=True)["t"]
    assert float(mapped.sum()) == float(t.sum())  # read: pages resident
    dropped = backends.device.drop_read_pages(mapped)
    if not hasattr(mmap, "MADV_DONTNEED"):
        assert dropped == 0
    else:
        page = mmap.PAGESIZE
        assert dropped >= t.numel() * 4 - 2 * page
    assert torch.equal(mapped, t)  # read again from the file


def test_dequant_under_autocast_multiplies_in_the_autocast_dtype():
    """As F.linear: under CPU bf16 autocast the result is bf16, the weight widened straight to bf16."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(16, 64, generator=g), torch.randn(32, 64, generator=g) / 8
    q, scale = backends.quantize_int8(w)
    with torch.autocast("cpu", dtype=torch.bfloat16), backends.use(quant_linear="dequant"):
        out = backends.quantized_linear(x, q, scale)
    assert out.dtype == torch.bfloat16
    ref = _reference(x, q, scale, None)
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 2e-2


def test_drop_read_pages_leaves_ordinary_memory_alone():
    t = torch.arange(3 << 20, dtype=torch.float32)
    assert backends.device.drop_read_pages(t) == 0
    assert torch.equal(t, torch.arange(3 << 20, dtype=torch.float32))  # not zeroed


def test_prepack_packs_only_cpu_bf16_weights_where_the_cpu_multiplies_bf16(monkeypatch):
    """``prepack_bf16_weight``: None for float32 / int8 / non-matrix weights, and for every weight on a CPU without
    bf16 matmul hardware (where the packed ops would be emulated, or refuse)."""
    import backends.quant_linear as ql
    w = torch.randn(16, 32)
    for other in (w, w.to(torch.int8), w.bfloat16()[0], w.bfloat16()[:0]):
        assert backends.prepack_bf16_weight(other) is None
    monkeypatch.setattr(ql, "cpu_bf16_matmul_fast", lambda: False)
    ql._onednn_packed_linear.cache_clear()
    try:
        assert backends.prepack_bf16_weight(w.bfloat16()) is None
    finally:
        ql._onednn_packed_linear.cache_clear()


@pytest.mark.skipif(not backends.device.cpu_bf16_matmul_fast(), reason="no bf16 matmul hardware on this CPU: "
                    "nothing is packed (the device suite's AMX host runs this)")
@pytest.mark.parametrize("with_bias", [True, False])
def test_packed_bf16_weight_multiplies_as_the_plain_one(monkeypatch, with_bias):
    """Where it packs: the product by the packed copy (no ``F.linear`` call) is within bf16 rounding of the
    float64 product and of the plain weight's, in x's dtype, or autocast's under autocast; inputs that need
    gradients take the plain weight (oneDNN's op has no backward) and get them."""
    import backends.quant_linear as ql
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 37, 64, generator=g)
    w = (torch.randn(48, 64, generator=g) / 8).bfloat16()
    bias = torch.randn(48, generator=g) if with_bias else None
    packed = backends.prepack_bf16_weight(w)
    assert packed is not None and packed.layout == torch._mkldnn
    ref = _reference(x, w, None, bias)
    plain = backends.quantized_linear(x, w, None, bias)
    calls = []
    real = ql.F.linear
    monkeypatch.setattr(ql.F, "linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    with backends.use(quant_linear="bf16"):
        out = backends.quantized_linear(x, w, None, bias, packed=packed)
        assert not calls and out.dtype == torch.float32 and out.shape == (2, 37, 48)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            half = backends.quantized_linear(x, w, None, bias, packed=packed)
        assert not calls and half.dtype == torch.bfloat16
        xg = x.clone().requires_grad_()
        graded = backends.quantized_linear(xg, w, None, bias, packed=packed)
        assert len(calls) == 1
        graded.sum().backward()
        assert xg.grad is not None and xg.grad.abs().sum() > 0
    scale = ref.abs().max()
    for got in (out, half, graded.detach()):
        assert ((got.double() - ref).abs().max() / scale).item() <= TOL["bf16"]
    assert ((out.double() - plain.double()).abs().max() / scale).item() <= 1e-2
