"""backends.dense_conv3d: F.conv3d semantics everywhere; the MPS workaround (2D slices) checked on the CPU against
a float64 F.conv3d, with non-contiguous weights, and never handing conv2d a non-contiguous weight (PyTorch issue 192212)."""
import pytest
import torch
import torch.nn.functional as F

import backends
import backends.dense_conv as dense_conv


def _noncontiguous_weight(cout, cin, k, g):
    w = torch.randn(cin, cout, k, k, k, generator=g, dtype=torch.float64).transpose(0, 1)  # a transposed view
    assert not w.is_contiguous()
    return w


@pytest.mark.parametrize("kernel,padding", [(3, (1, 1, 1)), (3, (0, 1, 2)), (1, (0, 0, 0))])
def test_workaround_equals_conv3d_with_noncontiguous_weights(kernel, padding, monkeypatch):
    g = torch.Generator().manual_seed(kernel)
    x = torch.randn(2, 4, 5, 6, 7, generator=g, dtype=torch.float64)
    w = _noncontiguous_weight(3, 4, kernel, g)
    b = torch.randn(3, generator=g, dtype=torch.float64)
    seen = []
    conv2d = F.conv2d
    monkeypatch.setattr(F, "conv2d", lambda inp, weight, *a, **k: seen.append(weight.is_contiguous()) or
                        conv2d(inp, weight, *a, **k))
    monkeypatch.setattr(dense_conv, "needs_conv3d_workaround", lambda device: True)  # as on MPS
    out = backends.dense_conv3d(x, w, b, padding)
    assert seen and all(seen)
    torch.testing.assert_close(out, F.conv3d(x, w.contiguous(), b, padding=padding), rtol=1e-12, atol=1e-12)


def test_cpu_takes_the_native_kernel():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 4, 4, 4, generator=g)
    w = torch.randn(3, 2, 3, 3, 3, generator=g)
    assert not dense_conv.needs_conv3d_workaround(torch.device("cpu"))
    assert dense_conv.needs_conv3d_workaround(torch.device("mps"))
    assert torch.equal(backends.dense_conv3d(x, w, None, (1, 1, 1)), F.conv3d(x, w, None, padding=1))
