"""backends.linear_gelu (the DiT MLP's first layer + tanh-GELU): the native composition is exactly the eager
layers, the feed-forward nets of both transformer kinds call it (and run swapped layers as they are), and on CUDA
the cuBLASLt epilogue of the triton norm backend matches a float64 evaluation of the tanh-GELU definition."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import backends
from backends import norm as norm_ops


def tanh_gelu64(x, weight, bias):
    """gelu(xW^T + b) with the tanh approximation, written from its formula in float64."""
    h = x.double() @ weight.double().t() + bias.double()
    return 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))


def _operands(rows=37, width=24, out=96, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, rows, width, generator=g) * 2
    w = torch.randn(out, width, generator=g) / width ** 0.5
    b = torch.randn(out, generator=g)
    return x.to(device, dtype), w.to(device, dtype), b.to(device, dtype)


def test_native_linear_gelu_is_the_eager_composition_in_float32():
    x, w, b = _operands()
    assert torch.equal(backends.linear_gelu(x, w, b), F.gelu(F.linear(x, w, b), approximate="tanh"))
    assert norm_ops.cpu_fused_linear_gelu(x, w, b) is None  # the CPU's default float32 path keeps its rounding
    assert (backends.linear_gelu(x.double(), w.double(), b.double()) - tanh_gelu64(x, w, b)).abs().max() < 1e-12


def _fused_runs_here() -> bool:
    return backends.device.cpu_bf16_matmul_fast() and norm_ops.native._onednn_linear_pointwise()


@pytest.mark.parametrize("mode", ["bfloat16 tensors", "float32 under bfloat16 autocast"])
def test_cpu_bfloat16_linear_gelu_is_the_definition_within_one_rounding(mode):
    """In bfloat16 on the CPU (``--dtype bfloat16``'s blocks and decoders) the GELU runs in oneDNN's epilogue where
    the CPU multiplies bf16 in hardware: the float64 tanh-GELU of the bf16 operands within one bf16 rounding, no
    further from it than the eager composition (which rounds the pre-activation too) and close to that; elsewhere
    it is the composition."""
    x, w, b = _operands(rows=300, width=64, out=256)
    ref = tanh_gelu64(x.bfloat16(), w.bfloat16(), b.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode != "bfloat16 tensors"):
        args = (x.bfloat16(), w.bfloat16(), b.bfloat16()) if mode == "bfloat16 tensors" else (x, w, b)
        got = backends.linear_gelu(*args)
        eager = F.gelu(F.linear(*args), approximate="tanh")
        fused = norm_ops.cpu_fused_linear_gelu(*args)
    assert got.dtype == eager.dtype == torch.bfloat16 and got.shape == (2, 300, 256)
    if not _fused_runs_here():
        assert fused is None and torch.equal(got, eager)
        return
    assert fused is not None and torch.equal(got, fused)
    half_ulp = 2 ** -8 * ref.abs() + 1e-6  # bf16 keeps 8 significant bits: one rounding is within 2^-8
    assert ((got.double() - ref).abs() <= half_ulp).all()
    # the eager composition rounds the pre-activation as well (an error the GELU's slope carries on, several
    # roundings of the output where the GELU is steep relative to its value): the fused op is never less exact
    assert (got.double() - ref).abs().max() <= (eager.double() - ref).abs().max()
    assert ((got.double() - eager.double()).abs() <= 2 ** -5 * ref.abs() + 1e-3).all()
    erf = F.gelu(x.bfloat16().double() @ w.bfloat16().double().t() + b.bfloat16().double())
    assert ((erf - ref).abs() > half_ulp).any()  # the check can tell the two GELUs apart


def test_cpu_fused_linear_gelu_leaves_autograd_and_other_dtypes_alone():
    x, w, b = _operands()
    assert norm_ops.cpu_fused_linear_gelu(x.half(), w.half(), b.half()) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert norm_ops.cpu_fused_linear_gelu(x, w.requires_grad_(True), b) is None  # autograd: the composition


def test_native_linear_gelu_keeps_gradients():
    """The in-place activation is only taken without autograd: with a weight that needs gradients the backward
    pass still sees the pre-activation and matches the eager composition's gradients."""
    x, w, b = _operands()
    w.requires_grad_(True)
    backends.linear_gelu(x, w, b).square().sum().backward()
    got = w.grad.clone()
    w.grad = None
    F.gelu(F.linear(x, w, b), approximate="tanh").square().sum().backward()
    assert torch.equal(got, w.grad)


def test_linear_gelu_checks_its_operands():
    x, w, b = _operands()
    with pytest.raises(ValueError, match="weight"):
        backends.linear_gelu(x, w.t(), b)
    with pytest.raises(ValueError, match="bias"):
        backends.linear_gelu(x, w, b[:5])


def _counted(monkeypatch):
    spec = backends.registered("norm")["native"]
    calls = []

    def run(*args):
        calls.append(args[0].shape)
        return norm_ops.native_linear_gelu(*args)
    monkeypatch.setattr(spec, "extra", dict(spec.extra, linear_gelu=run))
    return calls


def test_feed_forward_nets_call_the_op_and_give_the_layers_results(monkeypatch):
    from sam3d_objects.model.backbone.tdfy_dit.modules.sparse import SparseTensor
    from sam3d_objects.model.backbone.tdfy_dit.modules.sparse.transformer.blocks import SparseFeedForwardNet
    from sam3d_objects.model.backbone.tdfy_dit.modules.transformer.blocks import FeedForwardNet
    calls = _counted(monkeypatch)
    torch.manual_seed(0)
    dense, sparse = FeedForwardNet(16, mlp_ratio=4.0).eval(), SparseFeedForwardNet(16, mlp_ratio=2.0).eval()
    x = torch.randn(2, 9, 16)
    coords = torch.tensor([[0, i, 0, 0] for i in range(7)], dtype=torch.int32)
    feats = torch.randn(7, 16)
    with torch.no_grad():
        want_dense = dense.mlp[2](F.gelu(dense.mlp[0](x), approximate="tanh"))
        assert torch.equal(dense(x), want_dense)
        out = sparse(SparseTensor(feats=feats, coords=coords))
        want = F.linear(F.gelu(F.linear(feats, sparse.mlp[0].weight, sparse.mlp[0].bias), approximate="tanh"),
                        sparse.mlp[2].weight, sparse.mlp[2].bias)
        assert isinstance(out, SparseTensor) and torch.equal(out.feats, want) and torch.equal(out.coords, coords)
        assert [tuple(s) for s in calls] == [(2, 9, 16), (7, 16)]
        # a user's exact-erf GELU in place of the tanh one is run as it is, not through the op
        dense.mlp[1] = nn.GELU()
        assert torch.equal(dense(x), dense.mlp[2](F.gelu(dense.mlp[0](x))))
        assert len(calls) == 2


def test_feed_forward_nets_take_the_bf16_weight_format_through_the_op(monkeypatch):
    """With ``--dtype bfloat16`` the MLP's first layer holds bf16 weights (``QuantizedLinear`` without scales): the
    nets still call the op, and give bit for bit what the float32 layer gives under the same autocast (autocast
    rounds its weight and bias to the stored bf16 ones). int8 codes, or bf16 weights outside autocast (float32
    features), run the layers as they are."""
    import copy

    from sam3d_objects.model.backbone.tdfy_dit.modules.quantized import QuantizedLinear
    from sam3d_objects.model.backbone.tdfy_dit.modules.transformer.blocks import FeedForwardNet
    calls = _counted(monkeypatch)
    torch.manual_seed(0)
    plain = FeedForwardNet(16, mlp_ratio=4.0).eval()
    bf16, int8 = copy.deepcopy(plain), copy.deepcopy(plain)
    for net, fmt in ((bf16, "bf16"), (int8, "int8")):
        net.mlp[0] = QuantizedLinear.from_weight(plain.mlp[0].weight.detach(), plain.mlp[0].bias.detach(), fmt)
    x = torch.randn(2, 9, 16)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = plain(x)
            assert len(calls) == 1
            assert torch.equal(bf16(x), want) and len(calls) == 2
            int8(x)
            assert len(calls) == 2
        bf16(x)  # float32 features, bf16 weights: the layer's own cast, not the op
        assert len(calls) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (cuBLASLt's GELU epilogue)")
def test_cuda_epilogue_matches_the_tanh_gelu_definition():
    from backends.norm import triton as triton_norm
    x, w, b = _operands(rows=300, width=64, out=256, device="cuda")
    ref = tanh_gelu64(x, w, b)
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        got = triton_norm.epilogue_linear_gelu(x, w, b)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    assert got.dtype == torch.float32 and got.shape == (2, 300, 256)
    assert (got.double() - ref).abs().max() < 1e-5
    erf = F.gelu(x.double() @ w.double().t() + b.double())
    assert (erf - ref).abs().max() > 1e-4  # the check can tell the two GELUs apart
    # under fp16 autocast with float32 weights: the fp16 operands autocast would make, one rounding at the end
    with torch.autocast("cuda", dtype=torch.float16):
        half = triton_norm.epilogue_linear_gelu(x, w, b)
        eager = norm_ops.native_linear_gelu(x, w, b)
    ref16 = tanh_gelu64(x.half(), w.half(), b.half())
    assert half.dtype == eager.dtype == torch.float16
    assert ((half.double() - ref16).abs() <= 2 ** -10 * ref16.abs() + 1e-3).all()
    assert (half.float() - eager.float()).abs().max() <= 2 * 2 ** -10 * eager.float().abs().max()
    assert backends.resolve("norm", torch.device("cuda"), torch.float16).extra["linear_gelu"] is \
        triton_norm.epilogue_linear_gelu
