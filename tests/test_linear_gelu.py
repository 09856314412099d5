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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_linear_gelu_is_the_eager_composition(dtype):
    x, w, b = _operands(dtype=dtype)
    want = F.gelu(F.linear(x, w, b), approximate="tanh")
    assert torch.equal(backends.linear_gelu(x, w, b), want)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast applies as to F.linear
        x32, w32, b32 = _operands()
        got = backends.linear_gelu(x32, w32, b32)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, F.gelu(F.linear(x32, w32, b32), approximate="tanh"))
    assert (backends.linear_gelu(x.double(), w.double(), b.double()) - tanh_gelu64(x, w, b)).abs().max() < 1e-12


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
