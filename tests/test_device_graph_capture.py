"""What a CUDA-graph capture of stage 2 reads from the host, checked on every device.

A capture cannot copy device values to the host (``Cannot copy between CPU and CUDA tensors during CUDA graph
capture unless the CPU tensor is pinned``): once the coordinate-derived tensors are built, a stage-2 backbone call
must not read a device value on the host anywhere, the attention backend included. The tiny pipeline runs stage 2
in float32, where the sparse attention is the portable ``sdpa`` backend (the CUDA varlen kernels are half only):
its sequence lengths must come from the shapes, not from ``cu_seqlens.tolist()``.

On the CPU the check is emulated: every host read of a tensor value is recorded (``_local_scalar_dense`` and
friends through a dispatch mode, ``Tensor.tolist`` by a wrapper) while the CPU-only validation of ``cu_seqlens``
(which an accelerator skips) is switched off. On CUDA the real capture runs.
"""
import warnings

import pytest
import torch

import backends
from backends import attn as attn_module
from test_cuda_graphs import HostSyncRecorder, _tiny_slat_flow


class _ToListRecorder:
    """Records ``Tensor.tolist`` calls (a device-to-host copy on an accelerator; invisible to dispatch modes)."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = torch.Tensor.tolist

        def tolist(t):
            self.calls.append(tuple(t.shape))
            return real(t)
        monkeypatch.setattr(torch.Tensor, "tolist", tolist)


def _inputs(coords, device, seed=2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, coords.shape[0], 8, generator=g).to(device)
    return x, torch.tensor([500.0], device=device), torch.randn(1, 5, 16, generator=g).to(device)


def test_stage2_float32_cached_call_reads_nothing_on_the_host(monkeypatch):
    """The float32 backbone call after the eager warm-up, attention backend included (portable sdpa), reads no
    device value on the host: what a CUDA-graph capture of the tiny pipeline's stage 2 needs."""
    monkeypatch.setattr(attn_module, "_check_cu", lambda cu, total, name: None)  # the CPU-only validation
    model, coords = _tiny_slat_flow()
    x, t, cond = _inputs(coords, "cpu")
    with torch.no_grad(), backends.use(sparse_attn="sdpa"):
        model(x, t, cond, coords)  # warm-up: builds maps, downsampling index, sequence lengths
        tolist = _ToListRecorder(monkeypatch)
        with HostSyncRecorder() as rec:
            cached = [model(x, t, cond, coords), model(x, t, cond, coords, cfg=True)]
        monkeypatch.undo()
        fresh = [model(x, t, cond, coords.copy()), model(x, t, cond, coords.copy(), cfg=True)]
    assert rec.seen == [] and tolist.calls == []
    for a, b in zip(cached, fresh):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_sdpa_varlen_lengths_come_from_the_shapes_when_they_imply_them(monkeypatch):
    """One sequence, or n sequences of the longest length: no host read; ragged lengths still read them (and
    the results match the float64 per-sequence reference either way)."""
    g = torch.Generator().manual_seed(0)
    for lengths, reads in (([37], 0), ([8, 8, 8], 0), ([5, 9, 2], 2)):
        total = sum(lengths)
        q, k, v = (torch.randn(total, 2, 16, generator=g) for _ in range(3))
        cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
        recorder = _ToListRecorder(monkeypatch)
        out = attn_module.sdpa_varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), 0.25)
        monkeypatch.undo()
        assert len(recorder.calls) == reads, lengths
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            qs, ks, vs = (t[s:e].double().transpose(0, 1) for t in (q, k, v))
            ref = torch.softmax(qs @ ks.transpose(1, 2) * 0.25, -1) @ vs
            torch.testing.assert_close(out[s:e].double(), ref.transpose(0, 1), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a real graph capture)")
def test_cuda_stage2_float32_is_captured_like_the_tiny_pipeline():
    """The tiny pipeline's stage 2 (float32, no autocast): captured and replayed, no eager fall-back warning,
    replays equal to eager calls."""
    from sam3d_objects.model.backbone.generator import cuda_graph as cg
    model, coords = _tiny_slat_flow()
    model = model.cuda()
    x, t, cond = _inputs(coords, "cuda")
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner = cg.GraphedCalls(model)
        outs = [runner(x * s, t, cond, coords) for s in (1.0, 0.5, 2.0)]
    fallbacks = [str(w.message) for w in caught if "CUDA-graph capture" in str(w.message)]
    assert fallbacks == []  # "CUDA-graph capture of ... failed, running it eagerly: <why>"
    assert (runner.warm_ups, runner.captures, runner.replays) == (1, 1, 2)
    with torch.no_grad():
        for s, out in zip((1.0, 0.5, 2.0), outs):
            torch.testing.assert_close(out, model(x * s, t, cond, coords.copy()), rtol=1e-5, atol=1e-5)


class _HostReadingModule(torch.nn.Module):
    """Reads a device value on the host in its forward: its CUDA-graph capture fails."""

    def forward(self, x):
        return x * float(x.abs().sum().item() > 0) + torch.randn_like(x) * 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a real graph capture)")
def test_cuda_failed_capture_leaves_random_draws_working():
    """A capture that fails falls back to eager calls, and the default generator still draws afterwards (a
    failed capture used to leave it marked as capturing: "Offset increment outside graph capture")."""
    from sam3d_objects.model.backbone.generator import cuda_graph as cg
    runner = cg.GraphedCalls(_HostReadingModule().eval())  # graphs are for inference: eval mode, no grad
    x = torch.ones(4, device="cuda")
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [runner(x * s) for s in (1.0, 2.0, 3.0)]
    assert any("CUDA-graph capture" in str(w.message) for w in caught)
    assert runner.captures == 0
    for s, out in zip((1.0, 2.0, 3.0), outs):
        torch.testing.assert_close(out, x * s)
    torch.manual_seed(0)
    first = torch.randn(8, device="cuda")
    torch.manual_seed(0)
    torch.testing.assert_close(torch.randn(8, device="cuda"), first)
