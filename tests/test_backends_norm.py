"""backends.group_norm / layer_norm: native kernels by default (exactly F.group_norm / F.layer_norm; voxel-major
rows on the CPU normalised without transposing, against float64), the explicit
`reference` backend against float64 references, its cascade against a sequential re-statement, and upstream's
recorded GroupNorm outputs bit for bit with it."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import backends
import backends.norm.reference as norm_impl
from conftest import AtenOpLog, assert_close_to_reference

f32 = np.float32


def _fma(a, b, c):
    return f32(np.float64(a) * np.float64(b) + np.float64(c))


def _absorb(acc, add):
    """Welford merge, acc absorbs add; (count, mean, m2) with numpy float32 scalars."""
    n_a, mean_a, m2_a = acc
    n_b, mean_b, m2_b = add
    n = n_a + n_b
    ratio = f32(0) if n == 0 else f32(f32(n_b) / f32(n))
    delta = f32(mean_b - mean_a)
    return n, _fma(ratio, delta, mean_a), f32(m2_a + _fma(f32(f32(delta * delta) * ratio), f32(n_a), m2_b))


def sequential_moments(row, lanes=8, chunk=16):
    """The cascade as a running stack (one chunk after the other), written independently of backends/norm/."""
    row = np.asarray(row, dtype=f32)
    n = len(row) // lanes
    m = -(-n // chunk)
    depth = int(np.ceil(np.log2(m))) if m > 1 else 0
    empty = [(0, f32(0), f32(0))] * lanes
    stack = [list(empty) for _ in range(max(depth, 1))]
    for i in range(m):
        steps = min(chunk, n - i * chunk)
        for lane in range(lanes):
            mean = m2 = f32(0)
            for j in range(steps):
                x = row[(i * chunk + j) * lanes + lane]
                delta = f32(x - mean)
                mean = _fma(delta, f32(1.0 / (j + 1)), mean)
                m2 = _fma(delta, f32(x - mean), m2)
            stack[0][lane] = _absorb(stack[0][lane], (steps, mean, m2))
        carry, level = i + 1, 1
        while level < depth and carry % 2 == 0:
            stack[level] = [_absorb(a, b) for a, b in zip(stack[level], stack[level - 1])]
            stack[level - 1] = list(empty)
            carry //= 2
            level += 1
    for level in range(1, depth):
        stack[0] = [_absorb(a, b) for a, b in zip(stack[0], stack[level])]
    acc = (0, f32(0), f32(0))
    for x in row[n * lanes:]:
        count, mean, m2 = acc
        delta = f32(x - mean)
        mean = f32(mean + f32(delta / f32(count + 1)))
        acc = (count + 1, mean, _fma(delta, f32(x - mean), m2))
    for lane in range(lanes):
        acc = _absorb(acc, stack[0][lane])
    return acc[1], f32(acc[2] / f32(len(row)))


@pytest.mark.parametrize("length", [1, 7, 8, 9, 127, 128, 129, 136, 383, 640, 1030, 2056, 4607, 8200])
def test_vectorised_cascade_equals_the_sequential_one(length):
    g = torch.Generator().manual_seed(length)
    rows = torch.randn(3, length, generator=g) * 2 + 0.5
    mean, var = norm_impl.welford_moments(rows)
    for r in range(3):
        ref_mean, ref_var = sequential_moments(rows[r].numpy())
        assert mean[r].item() == ref_mean and var[r].item() == ref_var, (length, r)


@pytest.fixture
def reference_norms():
    with backends.use(norm="reference"):
        yield


def test_native_norms_are_the_default(monkeypatch):
    monkeypatch.delenv("NORM_BACKEND", raising=False)
    assert backends.current("cpu")["norm"] == "native"
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 32, 4, 5, 6, generator=g) * 3 + 1  # float32 on the CPU: the case the emulation used to take
    w, b = torch.randn(32, generator=g), torch.randn(32, generator=g)
    assert torch.equal(backends.group_norm(x, 8, w, b, 1e-5), F.group_norm(x, 8, w, b, 1e-5))
    rows = torch.randn(3, 77, 1024, generator=g)
    lw, lb = torch.randn(1024, generator=g), torch.randn(1024, generator=g)
    assert torch.equal(backends.layer_norm(rows, 1024, lw, lb, 1e-6), F.layer_norm(rows, (1024,), lw, lb, 1e-6))
    assert torch.equal(backends.layer_norm(rows, (77, 1024)), F.layer_norm(rows, (77, 1024)))


def test_norm_backend_switches_by_environment_and_context(monkeypatch):
    calls = []
    spec = backends.registered(backends.Family.NORM)["reference"]
    original = spec.fn
    spec.fn = lambda *a: calls.append("reference") or original(*a)
    try:
        x = torch.randn(1, 8, 10)
        monkeypatch.setenv("NORM_BACKEND", "reference")
        backends.group_norm(x, 2)
        monkeypatch.delenv("NORM_BACKEND")
        backends.group_norm(x, 2)
        with backends.use(norm="reference"):
            backends.group_norm(x, 2)
    finally:
        spec.fn = original
    assert calls == ["reference", "reference"]
    with pytest.raises(ValueError, match="valid names: auto, native, triton, reference"):
        with backends.use(norm="welford"):
            pass


@pytest.mark.parametrize("shape,groups", [((1, 6, 37), 2), ((2, 32, 250), 4), ((1, 16, 1, 5, 3), 16),
                                          ((3, 12, 1), 3)])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("norm", ["auto", "reference"])
@pytest.mark.device_xfail("mps", when={"norm": "reference"}, reason="the reference backend keeps its statistics in float64, "
                          "which MPS does not have (PLATFORMS.md: no float64 on MPS)")
def test_group_norm_matches_float64(shape, groups, affine, norm, device):
    """The device's automatic norm backend and the reference one against float64."""
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g) * 3 + 1
    w = torch.randn(shape[1], generator=g) if affine else None
    b = torch.randn(shape[1], generator=g) if affine else None
    on = (lambda t: None if t is None else t.to(device))
    with backends.use(norm=norm):
        out = backends.group_norm(on(x), groups, on(w), on(b), 1e-5)
    ref = F.group_norm(x.double(), groups, None if w is None else w.double(), None if b is None else b.double(),
                       1e-5)
    assert out.dtype == torch.float32 and out.shape == x.shape and out.device.type == device.type
    assert_close_to_reference(out, ref)


@pytest.mark.parametrize("shape", [(5, 7), (3, 1000), (2, 3, 256), (4, 1)])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("norm", ["auto", "reference"])
@pytest.mark.device_xfail("mps", when={"norm": "reference"}, reason="the reference backend keeps its statistics in float64, "
                          "which MPS does not have (PLATFORMS.md: no float64 on MPS)")
def test_layer_norm_matches_float64(shape, affine, norm, device):
    """The device's automatic norm backend and the reference one against float64."""
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g) * 3 + 1
    w = torch.randn(shape[-1], generator=g) if affine else None
    b = torch.randn(shape[-1], generator=g) if affine else None
    on = (lambda t: None if t is None else t.to(device))
    with backends.use(norm=norm):
        out = backends.layer_norm(on(x), shape[-1], on(w), on(b), 1e-6)
    ref = F.layer_norm(x.double(), shape[-1:], None if w is None else w.double(), None if b is None else b.double(),
                       1e-6)
    assert out.device.type == device.type
    assert_close_to_reference(out, ref)


def test_reference_uses_the_native_kernels_for_other_dtypes(reference_norms):
    x = torch.randn(2, 8, 30, dtype=torch.float64)
    assert torch.equal(backends.group_norm(x, 4), F.group_norm(x, 4))
    assert torch.equal(backends.layer_norm(x, 30), F.layer_norm(x, (30,)))
    h = torch.randn(2, 8, 30).bfloat16()
    assert torch.equal(backends.group_norm(h, 4), F.group_norm(h, 4))


def test_fused_and_emulated_multiply_add_agree(monkeypatch, reference_norms):
    if not norm_impl._addcmul_is_fused(torch.device("cpu")):
        pytest.skip("torch's addcmul is not fused on this CPU build: only the emulation runs here")
    x = torch.randn(2, 24, 77) * 2
    w, b, gamma = torch.randn(24), torch.randn(24), torch.randn(77)
    fused = backends.group_norm(x, 6, w, b), backends.layer_norm(x, 77, gamma, None)
    monkeypatch.setattr(norm_impl, "_FUSED", {"cpu": False})  # the float64 emulation, as where addcmul is not fused
    assert torch.equal(backends.group_norm(x, 6, w, b), fused[0])
    assert torch.equal(backends.layer_norm(x, 77, gamma, None), fused[1])


def test_reference_group_norm_reproduces_upstreams_recorded_outputs(golden_dir, reference_norms):
    """The golden GroupNorm cases, bit for bit with the reference backend (this is why it is kept: the native
    kernel of this torch differs by an ulp in ~25% of entries); native stays within float32 tolerance of them."""
    from safetensors.torch import load_file

    case = golden_dir / "sparse_ops"
    inputs, outputs = load_file(str(case / "inputs.safetensors")), load_file(str(case / "outputs.safetensors"))
    weights = load_file(str(case / "weights.safetensors"))
    sizes = torch.bincount(inputs["coords"][:, 0].long()).tolist()
    for name, groups in (("groupnorm", 4), ("groupnorm32", 8)):
        parts = []
        for feats in inputs["feats"].split(sizes):
            block = feats.t().reshape(1, feats.shape[1], -1).contiguous()
            parts.append(backends.group_norm(block, groups, weights[f"{name}.weight"], weights[f"{name}.bias"],
                                             1e-5)[0].t())
        assert torch.equal(torch.cat(parts), outputs[f"{name}.feats"]), name
        with backends.use(norm="native"):
            native = torch.cat([backends.group_norm(f.t().reshape(1, f.shape[1], -1).contiguous(), groups,
                                                    weights[f"{name}.weight"], weights[f"{name}.bias"], 1e-5)[0].t()
                                for f in inputs["feats"].split(sizes)])
        torch.testing.assert_close(native, outputs[f"{name}.feats"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("length,channels,groups,chunk_rows", [(5000, 96, 32, 333), (700, 64, 8, 8192), (2, 4, 2, 1)])
@pytest.mark.parametrize("affine", [True, False])
def test_voxel_major_group_norm_matches_float64(length, channels, groups, chunk_rows, affine):
    """Rows [L, C] (a sparse tensor's features) normalised without transposing, over several chunks, against
    float64 F.group_norm; means far from zero (300 +- 3) test the float32 mean's correction."""
    from backends.norm import group_norm_voxel_major

    g = torch.Generator().manual_seed(length)
    rows = torch.randn(length, channels, generator=g) * 3 + 300 * torch.rand(channels, generator=g)
    w = torch.randn(channels, generator=g) if affine else None
    b = torch.randn(channels, generator=g) if affine else None
    ref = F.group_norm(rows.double().t()[None], groups, None if w is None else w.double(),
                       None if b is None else b.double(), 1e-5)[0].t()
    out = group_norm_voxel_major(rows, groups, w, b, 1e-5, chunk_rows=chunk_rows)
    assert out.dtype == torch.float32 and out.is_contiguous()
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=4e-6)


def test_native_group_norm_of_a_voxel_major_view_returns_rows():
    """backends.group_norm on rows.t()[None] ([1, C, L] viewing [L, C]): the result's [0].t() is contiguous rows
    (no transposed copies), within float32 rounding of F.group_norm; the reference backend gives the same bits for
    the view as for a contiguous copy."""
    g = torch.Generator().manual_seed(9)
    rows = torch.randn(3000, 64, generator=g) * 2 + 1
    w, b = torch.randn(64, generator=g), torch.randn(64, generator=g)
    out = backends.group_norm(rows.t()[None], 16, w, b)
    assert out.shape == (1, 64, 3000) and out[0].t().is_contiguous()
    torch.testing.assert_close(out, F.group_norm(rows.t().contiguous()[None], 16, w, b), rtol=0, atol=5e-6)
    with backends.use(norm="reference"):
        assert torch.equal(backends.group_norm(rows.t()[None], 16, w, b),
                           backends.group_norm(rows.t().contiguous()[None], 16, w, b))


def test_bad_group_norm_input_is_a_clear_error():
    with pytest.raises(ValueError, match=r"\[N, C, \*\]"):
        backends.group_norm(torch.randn(8), 2)
    with pytest.raises(ValueError, match="cannot be split into 4 groups"):
        backends.group_norm(torch.randn(1, 6, 10), 4)


def _modulated_float64(x, shift, scale, weight, bias, eps):
    """adaLN's pre-norm by its definition in float64: LayerNorm (affine when given), * (1 + scale) + shift."""
    h = F.layer_norm(x.double(), x.shape[-1:], None if weight is None else weight.double(),
                     None if bias is None else bias.double(), eps)
    # 1 + scale is a tensor op in the modulation's dtype (part of the definition, as in the models)
    return h * (1 + scale).double().reshape(-1) + shift.double().reshape(-1)


@pytest.mark.parametrize("x_dtype,mod_dtype,rows,affine", [
    (torch.float32, torch.float32, False, False),   # the float32 default
    (torch.float32, torch.bfloat16, False, False),  # stage 1 under bf16 sampling: float32 stream
    (torch.bfloat16, torch.bfloat16, True, False),  # stage 2's bf16 voxel rows, [1, C] modulation
    (torch.float32, torch.float32, True, True),     # an affine norm under modulation
])
def test_native_modulated_layer_norm_of_one_batch_element(x_dtype, mod_dtype, rows, affine):
    """One modulation row for all tokens (the sampler's calls) folds into the norm's affine: the definition in
    float64 within the output dtype's rounding, the composed op's dtype, the input untouched."""
    from backends.norm.native import NATIVE_OPS, compose_modulated_layer_norm, native_layer_norm
    gen = torch.Generator().manual_seed(7)
    width = 96
    x = (2 * torch.randn(*((50,) if rows else (1, 50)), width, generator=gen) + 0.5).to(x_dtype)
    shift, scale = (torch.randn(1, width, generator=gen).to(mod_dtype) for _ in range(2))
    weight, bias = ((torch.rand(width, generator=gen) + 0.5, torch.randn(width, generator=gen)) if affine
                    else (None, None))
    before = x.clone()
    out = NATIVE_OPS["modulated_layer_norm"](x, shift, scale, weight, bias, 1e-6, None)
    composed = compose_modulated_layer_norm(native_layer_norm)(x, shift, scale, weight, bias, 1e-6, None)
    assert torch.equal(x, before)
    assert out.dtype == composed.dtype and out.shape == composed.shape
    ref = _modulated_float64(x, shift, scale, weight, bias, 1e-6)
    ulp = 2 ** -7 if out.dtype == torch.bfloat16 else 2 ** -23
    # error scale: the size of the two terms summed (the modulated norm and the shift), not of their sum
    size = ((ref - shift.double().reshape(-1)).abs() + shift.double().abs().reshape(-1)).clamp_min(1)
    # one rounding of the result (the composed op rounds three times, so it may stand a little further off)
    assert float(((out.double() - ref).abs() / size).max()) <= 6 * ulp
    assert float(((composed.double() - ref).abs() / size).max()) <= 8 * ulp


def test_native_head_rms_norm_copies_and_matches_the_definition():
    """The in-place normalisation works on its own float32 copy: a float32 input (which .float() would hand back
    as it is) stays untouched; values as the definition in float64, an all-zero head stays zero."""
    gen = torch.Generator().manual_seed(8)
    heads, dim = 4, 16
    for dtype in (torch.float32, torch.bfloat16):
        qkv = torch.randn(1, 10, 3, heads, dim, generator=gen).to(dtype)
        qkv[0, 0, 0, 1] = 0
        q = qkv.unbind(2)[0]
        gamma = torch.rand(heads, dim, generator=gen) + 0.5
        before = qkv.clone()
        out = backends.head_rms_norm(q, gamma, dim ** 0.5)
        assert torch.equal(qkv, before) and out.dtype == dtype and out.is_contiguous()
        qd = q.double()
        ref = qd / qd.norm(dim=-1, keepdim=True).clamp_min(1e-12) * gamma.double() * dim ** 0.5
        ulp = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -23
        assert float(((out.double() - ref).abs() / ref.abs().clamp_min(1)).max()) <= 4 * ulp
        assert not out[0, 0, 1].any()
    plain = torch.randn(1, 10, heads, dim, generator=gen)  # contiguous float32
    before = plain.clone()
    backends.head_rms_norm(plain, gamma, dim ** 0.5)
    assert torch.equal(plain, before)


def _float32_layer_norm_float64(x, weight, bias, eps=1e-6):
    return F.layer_norm(x.double(), x.shape[-1:], None if weight is None else weight.double(),
                        None if bias is None else bias.double(), eps)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("shape", [(3000, 768), (2, 333, 96)])
def test_float32_layer_norm_of_half_input(device, dtype, affine, shape):
    """LayerNorm32's arithmetic for half input: float32 statistics and affine, rounded once to x's dtype. On the
    CPU the kernel takes the half input as it is (no float32 copy in or out); every device's result is the float64
    definition rounded once (within one unit of the last place), and the composed op differs from it at most by
    that unit, in a few elements."""
    from backends.norm.native import compose_float32_layer_norm, native_layer_norm
    gen = torch.Generator().manual_seed(11)
    x = (3 * torch.randn(*shape, generator=gen) + 2 * torch.randn(*shape[:-1], 1, generator=gen)).to(dtype)
    weight, bias = ((torch.rand(shape[-1], generator=gen) + 0.5, torch.randn(shape[-1], generator=gen)) if affine
                    else (None, None))
    on = (lambda t: None if t is None else t.to(device))
    before = x.clone()
    log = AtenOpLog()
    with log:
        out = backends.float32_layer_norm(on(x), shape[-1], on(weight), on(bias), 1e-6)
    assert out.dtype == dtype and out.shape == x.shape and out.device.type == device.type
    assert torch.equal(x, before)
    if device.type == "cpu":
        assert "_to_copy.default" not in log.ops and "native_layer_norm.default" in log.ops
    ref = _float32_layer_norm_float64(x, weight, bias)
    ulp = (2 ** -7 if dtype == torch.bfloat16 else 2 ** -10) * ref.abs().clamp_min(2 ** -10)
    err = (out.cpu().double() - ref).abs()
    assert bool((err <= ulp).all()), float((err / ulp).max())
    composed = compose_float32_layer_norm(native_layer_norm)(on(x), (shape[-1],), on(weight), on(bias), 1e-6).cpu()
    differ = composed != out.cpu()
    assert float(differ.float().mean()) < 0.01
    assert bool(((composed.double() - out.cpu().double()).abs() <= 2 * ulp).all())


def test_float32_layer_norm_keeps_float32_autograd_and_the_reference():
    """float32 input is F.layer_norm itself; with autograd the half input takes the float32 copy (the composed op,
    bit for bit, gradients through it); the reference backend composes its own float32 kernel."""
    from backends.norm.native import compose_float32_layer_norm, native_layer_norm
    from sam3d_objects.model.backbone.tdfy_dit.modules.norm import LayerNorm32
    gen = torch.Generator().manual_seed(5)
    x32 = torch.randn(40, 64, generator=gen) * 2
    w, b = torch.randn(64, generator=gen), torch.randn(64, generator=gen)
    assert torch.equal(backends.float32_layer_norm(x32, 64, w, b, 1e-6), F.layer_norm(x32, (64,), w, b, 1e-6))
    norm = LayerNorm32(64, elementwise_affine=True, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(w), norm.bias.copy_(b)
    half = x32.bfloat16()
    with torch.no_grad():
        assert torch.equal(norm(half), backends.float32_layer_norm(half, 64, w, b, 1e-6))
    leaf = half.clone().requires_grad_()
    out = norm(leaf)
    composed = compose_float32_layer_norm(native_layer_norm)(half, (64,), w, b, 1e-6)
    assert torch.equal(out.detach(), composed)
    out.float().sum().backward()
    assert leaf.grad is not None and leaf.grad.dtype == torch.bfloat16 and norm.weight.grad is not None
    with backends.use(norm="reference"):
        got = backends.float32_layer_norm(half, 64, w, b, 1e-6)
    assert torch.equal(got, norm_impl.reference_layer_norm(half.float(), 64, w, b, 1e-6).bfloat16())
