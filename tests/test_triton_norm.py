"""The Triton adaLN kernels (norm backend "triton"), run by Triton's interpreter on CPU tensors, against float64
evaluations of the ops' definitions and against the native (eager) backend's rounding.

Kept small: the interpreter executes every program of the grid in NumPy. Skips when triton is not importable.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton", reason="triton is not installed (pip install --no-deps triton)")

import backends  # noqa: E402
from backends import norm as norm_ops  # noqa: E402
from backends.norm import triton as triton_norm  # noqa: E402

ULP = {torch.float32: 2 ** -23, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}


def modulated_reference(x, shift, scale, weight, bias, eps, rows_batch):
    """float64 LayerNorm, affine, then * (1 + scale) + shift of each row's batch element (``1 + scale`` is a
    tensor op in the modulation's dtype and the norm is rounded to the stream's dtype: both are part of the
    definition, as in the models)."""
    xd = x.double()
    h = (xd - xd.mean(-1, keepdim=True)) / torch.sqrt(xd.var(-1, unbiased=False, keepdim=True) + eps)
    if weight is not None:
        h = h * weight.double()
    if bias is not None:
        h = h + bias.double()
    h = h.to(x.dtype).double()  # LayerNorm32 hands back the stream's dtype
    if scale is not None:
        h = h * (1 + scale).double()[rows_batch]
    if shift is not None:
        h = h + shift.double()[rows_batch]
    return h


def assert_close_to(out, ref, dtype, ulps=4.0):
    err = (out.double() - ref).abs()
    bound = ulps * ULP[dtype] * ref.abs().clamp_min(1.0)
    assert bool((err <= bound).all()), f"max error {err.max():.3g} for {dtype}"


@pytest.mark.parametrize("x_dtype,mod_dtype,width", [
    (torch.float32, torch.float16, 80),    # stage 1: float32 stream, fp16 modulation (autocast), odd width
    (torch.float16, torch.float16, 64),    # stage 2: fp16 torso
    (torch.bfloat16, torch.float32, 48),
])
def test_modulated_layer_norm_dense_tokens(x_dtype, mod_dtype, width):
    gen = torch.Generator().manual_seed(width)
    x = (3 * torch.randn(3, 7, width, generator=gen) + 1).to(x_dtype)
    shift, scale = (torch.randn(3, width, generator=gen).to(mod_dtype) for _ in range(2))
    out = triton_norm.triton_modulated_layer_norm(x, shift, scale, None, None, 1e-6, None)
    native = norm_ops.NATIVE_OPS["modulated_layer_norm"](x, shift, scale, None, None, 1e-6, None)
    assert out.dtype == native.dtype == torch.promote_types(x_dtype, mod_dtype) and out.shape == x.shape
    rows_batch = torch.arange(3)[:, None].expand(3, 7)
    ref = modulated_reference(x, shift, scale, None, None, 1e-6, rows_batch)
    # the rounding of an intermediate can flip by one ulp of the coarsest dtype involved
    coarse = max(x_dtype, mod_dtype, key=lambda d: ULP[d])
    assert_close_to(out, ref, coarse, ulps=8)
    assert_close_to(native, ref, coarse, ulps=8)
    if out.dtype != torch.float32:  # same rounding points as eager: half-precision results mostly identical
        assert (out == native).double().mean() > 0.9


def test_modulated_layer_norm_sparse_rows_read_a_strided_batch_index():
    gen = torch.Generator().manual_seed(1)
    batches = torch.tensor([0] * 5 + [1] * 9 + [2] * 4, dtype=torch.int32)
    coords = torch.cat([batches[:, None], torch.randint(0, 9, (18, 3), generator=gen, dtype=torch.int32)], 1)
    x = torch.randn(18, 32, generator=gen).half()
    shift, scale = (torch.randn(3, 32, generator=gen).half() for _ in range(2))
    out = triton_norm.triton_modulated_layer_norm(x, shift, scale, None, None, 1e-6, coords[:, 0])
    native = backends.modulated_layer_norm(x, shift, scale, batch_index=coords[:, 0])
    assert out.dtype == torch.float16
    assert_close_to(out, modulated_reference(x, shift, scale, None, None, 1e-6, batches.long()), torch.float16,
                    ulps=8)
    assert (out.double() - native.double()).abs().max() <= 2 * 2 ** -10 * native.double().abs().max()


def test_affine_layer_norm_under_autocast_returns_the_matmul_dtype():
    """No modulation, affine weights: the cross-attention's pre-norm. Under autocast the float32 result comes
    back in the autocast dtype, exactly what the next matmul would have cast it to."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 5, 40, generator=gen)
    weight, bias = torch.randn(40, generator=gen), torch.randn(40, generator=gen)
    with torch.autocast("cpu", torch.bfloat16):
        out = triton_norm.triton_modulated_layer_norm(x, None, None, weight, bias, 1e-6, None)
        native = backends.modulated_layer_norm(x, weight=weight, bias=bias)
    assert out.dtype == native.dtype == torch.bfloat16
    eager = F.layer_norm(x, (40,), weight, bias, 1e-6).to(torch.bfloat16)
    assert torch.equal(native, eager)
    assert_close_to(out, modulated_reference(x, None, None, weight, bias, 1e-6, None), torch.bfloat16, ulps=1)
    outside = backends.modulated_layer_norm(x, weight=weight, bias=bias)
    assert outside.dtype == torch.float32


@pytest.mark.parametrize("x_dtype,h_dtype,gate_dtype", [
    (torch.float32, torch.float16, torch.float16),   # stage 1
    (torch.float16, torch.float16, torch.float16),   # stage 2
    (torch.float32, torch.float32, torch.float32),
])
def test_gated_residual_matches_the_eager_rounding(x_dtype, h_dtype, gate_dtype):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 9, 300, generator=gen).to(x_dtype)  # 300 columns: two column tiles, the second ragged
    h = torch.randn(2, 9, 300, generator=gen).to(h_dtype)
    gate = torch.randn(2, 300, generator=gen).to(gate_dtype)
    out = triton_norm.triton_gated_residual(x, h, gate, None)
    eager = x + h * gate.unsqueeze(1)
    assert out.dtype == eager.dtype
    assert torch.equal(out, eager)  # one product rounding and one sum rounding, as eager: bit for bit


def test_gated_residual_sparse_rows_and_single_batch():
    gen = torch.Generator().manual_seed(4)
    bidx = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2], dtype=torch.int32)
    x, h = (torch.randn(11, 24, generator=gen).half() for _ in range(2))
    gate = torch.randn(3, 24, generator=gen).half()
    assert torch.equal(triton_norm.triton_gated_residual(x, h, gate, bidx), x + h * gate[bidx.long()])
    one = gate[:1]
    assert torch.equal(triton_norm.triton_gated_residual(x, h, one, None), x + h * one)
    assert torch.equal(backends.gated_residual(x, h, gate, batch_index=bidx), x + h * gate[bidx.long()])


def test_head_rms_norm_of_a_strided_query_view():
    gen = torch.Generator().manual_seed(5)
    heads, dim = 3, 24
    qkv = torch.randn(2, 6, 3, heads, dim, generator=gen).half()
    q = qkv.unbind(2)[0]  # a strided view, as the attention layers produce it
    q[0, 0, 1] = 0  # an all-zero head: F.normalize's clamp keeps it zero
    gamma = torch.rand(heads, dim, generator=gen) + 0.5
    out = triton_norm.triton_head_rms_norm(q, gamma, dim ** 0.5)
    assert out.is_contiguous() and out.dtype == torch.float16 and out.shape == q.shape
    qd = q.double()
    ref = qd / qd.norm(dim=-1, keepdim=True).clamp_min(1e-12) * gamma.double() * dim ** 0.5
    assert_close_to(out, ref, torch.float16, ulps=1)
    assert torch.equal(out[0, 0, 1], torch.zeros(dim, dtype=torch.float16))
    native = backends.head_rms_norm(q, gamma, dim ** 0.5)
    assert (out.float() - native.float()).abs().max() <= 2 ** -10 * native.float().abs().max()


def test_triton_norm_backend_is_cuda_only_and_auto_there():
    spec = backends.registered("norm")["triton"]
    assert spec.devices == ("cuda",)
    assert "not cpu" in spec.why_not(torch.device("cpu"), torch.float32)
    from backends.registry import Family, _auto_candidates
    assert [s.name for s in _auto_candidates(Family.NORM, torch.device("cuda"))][:2] == ["triton", "native"]
    assert backends.resolve("norm", torch.device("cpu"), torch.float32).name == "native"


def test_per_batch_operands_are_checked():
    x = torch.randn(10, 8)
    with pytest.raises(ValueError, match="batch_index"):
        backends.modulated_layer_norm(x, torch.randn(2, 8), torch.randn(2, 8))
    with pytest.raises(ValueError, match=r"\[B, 8\]"):
        backends.gated_residual(x, x, torch.randn(2, 5), batch_index=torch.zeros(10, dtype=torch.int32))
    with pytest.raises(ValueError, match="gamma"):
        backends.head_rms_norm(torch.randn(4, 2, 8), torch.ones(3, 8), 1.0)


def _run_blocks(make, run, swap):
    torch.manual_seed(0)
    block = make().eval()
    with torch.no_grad():
        eager = run(block)
        swap()
        return eager, run(block)


def test_models_run_their_blocks_through_the_triton_ops(monkeypatch):
    """A stage-1 MoT block (float32 stream, two token streams) and a stage-2 sparse block (fp16 torso, two batch
    elements of different sizes) give the eager results when their element-wise steps run as Triton kernels."""
    from sam3d_objects.model.backbone.tdfy_dit.models.mot_sparse_structure_flow import (
        MOTModulatedTransformerCrossBlock)
    from sam3d_objects.model.backbone.tdfy_dit.modules.sparse import SparseTensor
    from sam3d_objects.model.backbone.tdfy_dit.modules.sparse.transformer.modulated import (
        ModulatedSparseTransformerCrossBlock)

    # the CPU's backend runs eagerly first, then with the Triton kernels (interpreted) in place of its block ops
    spec = backends.registered("norm")["native"]
    calls = []

    def counted(op):
        def run(*args):
            calls.append(op)
            return triton_norm.TRITON_OPS[op](*args)
        return run

    kernels = dict(norm_ops.NATIVE_OPS, **{op: counted(op) for op in
                                          ("modulated_layer_norm", "gated_residual", "head_rms_norm")})
    monkeypatch.setattr(spec, "extra", dict(norm_ops.NATIVE_OPS))
    swap = lambda: monkeypatch.setattr(spec, "extra", kernels)  # noqa: E731

    gen = torch.Generator().manual_seed(1)
    streams = {"shape": torch.randn(2, 12, 64, generator=gen), "6drotation_normalized": torch.randn(2, 1, 64,
                                                                                                 generator=gen)}
    mod, ctx = torch.randn(2, 64, generator=gen), torch.randn(2, 5, 64, generator=gen)
    eager, fused = _run_blocks(
        lambda: MOTModulatedTransformerCrossBlock(64, 64, num_heads=2, qk_rms_norm=True,
                                                  latent_names=["shape", "6drotation_normalized"]),
        lambda b: b(streams, mod, ctx), swap)
    for name in streams:
        assert (fused[name] - eager[name]).abs().max() <= 1e-5 * eager[name].abs().max()
    # per stream: 3 norms, 2 gated residuals; per stream 2 head norms (q, k) in self-attention
    assert sorted(set(calls)) == ["gated_residual", "head_rms_norm", "modulated_layer_norm"]
    assert calls.count("modulated_layer_norm") == 6 and calls.count("gated_residual") == 4
    calls.clear()

    monkeypatch.setattr(spec, "extra", dict(norm_ops.NATIVE_OPS))
    coords = torch.tensor([[b, i, i % 3, 0] for b, n in ((0, 7), (1, 4)) for i in range(n)], dtype=torch.int32)
    x = SparseTensor(feats=torch.randn(11, 64, generator=gen).half(), coords=coords)
    mod_h, ctx_h = torch.randn(2, 64, generator=gen).half(), torch.randn(2, 5, 64, generator=gen).half()

    def make_sparse():
        block = ModulatedSparseTransformerCrossBlock(64, 64, num_heads=2, qk_rms_norm=True)
        return block.half().apply(lambda m: m.float() if isinstance(m, torch.nn.LayerNorm) else None)

    eager, fused = _run_blocks(make_sparse, lambda b: b(x, mod_h, ctx_h).feats, swap)
    assert fused.dtype == eager.dtype == torch.float16
    assert (fused.float() - eager.float()).abs().max() <= 4 * 2 ** -10 * eager.float().abs().max()
    assert calls.count("modulated_layer_norm") == 3 and calls.count("gated_residual") == 2
    assert calls.count("head_rms_norm") == 2


@pytest.mark.parametrize("kernel", ["_modulated_ln_kernel", "_gated_residual_kernel", "_head_rms_kernel"])
def test_kernels_compile_for_hopper_without_a_gpu(kernel):
    """Ahead-of-time compile for sm_90 (Triton ships ptxas) with stage 1's dtypes: the GPU code path parses,
    type-checks and lowers, although this machine has no GPU to run it."""
    import inspect

    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(triton_norm, kernel)
    names = list(inspect.signature(fn).parameters)
    pointers = {"x_ptr": "*fp32", "out_ptr": "*fp16", "h_ptr": "*fp16", "gate_ptr": "*fp16", "shift_ptr": "*fp16",
                "scale_ptr": "*fp16", "w_ptr": "*fp32", "b_ptr": "*fp32", "bidx_ptr": "*i32", "gamma_ptr": "*fp32"}
    if kernel == "_head_rms_kernel":
        pointers["x_ptr"] = "*fp16"
    consts = {"HAS_W": False, "HAS_B": False, "HAS_SHIFT": True, "HAS_SCALE": True, "HAS_BIDX": True,
              "PER_BATCH": True, "X_DTYPE": tl.float32, "SCALE_DTYPE": tl.float16, "MUL_DTYPE": tl.float32,
              "ADD_DTYPE": tl.float32, "PROD_DTYPE": tl.float16, "BLOCK_C": 1024, "BLOCK_R": 16, "BLOCK_H": 16,
              "BLOCK_D": 64}
    consts = {k: v for k, v in consts.items() if k in names}
    sig = {n: pointers[n] if n.endswith("_ptr") else "constexpr" if n in consts
           else "fp32" if n in ("eps", "scale") else "i32" for n in names}
    src = ASTSource(fn=triton.jit(fn), signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n.endswith("_ptr")})
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    except (FileNotFoundError, PermissionError) as e:  # pragma: no cover - a triton build without its ptxas
        pytest.skip(f"triton cannot compile for CUDA here: {e}")
    assert "ld.global" in compiled.asm["ptx"] and "st.global" in compiled.asm["ptx"]
