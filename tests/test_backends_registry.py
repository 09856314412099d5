"""Backend selection: environment variables, upstream aliases, overrides, and the errors for bad requests."""
import subprocess
import sys

import pytest
import torch

import backends
from backends.registry import Family, requested


def test_auto_on_cpu_picks_portable_backends(monkeypatch):
    for var in ("SPARSE_BACKEND", "SPARSE_ATTN_BACKEND", "ATTN_BACKEND", "NORM_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    assert backends.current("cpu") == {"sparse_conv": "torch", "sparse_attn": "sdpa", "attn": "sdpa",
                                       "norm": "native"}


def test_environment_variables_and_fallback(monkeypatch):
    monkeypatch.delenv("SPARSE_ATTN_BACKEND", raising=False)
    monkeypatch.setenv("ATTN_BACKEND", "naive")
    assert backends.current("cpu")["attn"] == "naive"
    assert backends.current("cpu")["sparse_attn"] == "naive"  # SPARSE_ATTN_BACKEND falls back to ATTN_BACKEND
    monkeypatch.setenv("SPARSE_ATTN_BACKEND", "sdpa")
    assert backends.current("cpu")["sparse_attn"] == "sdpa"
    monkeypatch.setenv("SPARSE_BACKEND", "torch")
    assert requested(Family.SPARSE_CONV) == ("torch", "$SPARSE_BACKEND")


def test_upstream_aliases(monkeypatch):
    monkeypatch.setenv("ATTN_BACKEND", "torch_flash_attn")
    assert requested(Family.ATTN)[0] == "sdpa"


def test_unknown_name_lists_valid_names(monkeypatch):
    monkeypatch.setenv("SPARSE_BACKEND", "cudnn")
    with pytest.raises(ValueError, match="valid names: auto, torch, metal, triton, spconv, torchsparse"):
        backends.sparse_conv3d(torch.randn(1, 1), torch.zeros(1, 4, dtype=torch.int32), torch.randn(1, 3, 3, 3, 1))
    with pytest.raises(ValueError, match="unknown attn backend 'flash3'"):
        with backends.use(attn="flash3"):
            pass


def test_explicit_unavailable_backend_says_why_and_what_to_use():
    q = torch.randn(4, 2, 8)
    with backends.use(sparse_attn="flash_attn"):
        with pytest.raises(backends.BackendUnavailableError, match="runs on cuda, not cpu; use 'sdpa'"):
            backends.varlen_attention(q, q, q, torch.tensor([0, 4]), torch.tensor([0, 4]))
    with backends.use(sparse="metal"):
        with pytest.raises(backends.BackendUnavailableError, match="cannot run here"):
            backends.sparse_conv3d(torch.randn(1, 1), torch.zeros(1, 4, dtype=torch.int32), torch.randn(1, 3, 3, 3, 1))


def test_context_manager_beats_set_backend_beats_environment(monkeypatch):
    monkeypatch.setenv("ATTN_BACKEND", "sdpa")
    backends.set_backend(attn="naive")
    assert backends.current("cpu")["attn"] == "naive"
    with backends.use(attn="sdpa"):
        assert backends.current("cpu")["attn"] == "sdpa"
        with backends.use(attn="naive"):
            assert backends.current("cpu")["attn"] == "naive"
        assert backends.current("cpu")["attn"] == "sdpa"
    backends.reset_backends()
    assert backends.current("cpu")["attn"] == "sdpa"


def test_dispatch_really_switches_implementation():
    # naive and sdpa agree numerically, so prove the switch by what each one calls.
    calls = []
    spec = backends.registered(Family.SPARSE_ATTN)["naive"]
    original = spec.fn
    spec.fn = lambda *a: calls.append("naive") or original(*a)
    try:
        q = torch.randn(3, 1, 4)
        with backends.use(sparse_attn="naive"):
            backends.varlen_attention(q, q, q, torch.tensor([0, 3]), torch.tensor([0, 3]))
        backends.varlen_attention(q, q, q, torch.tensor([0, 3]), torch.tensor([0, 3]))
    finally:
        spec.fn = original
    assert calls == ["naive"]


def test_device_helpers_are_null_where_unsupported():
    from backends import device

    assert device.default_device().type in ("cpu", "cuda", "mps")
    with device.autocast("mps", torch.float16):  # must not raise even without MPS
        pass
    with device.autocast("cpu", torch.float32):
        assert not torch.is_autocast_enabled("cpu")
    device.empty_cache("cpu")
    device.synchronize("cpu")
    assert device.peak_memory("cpu") > 0


def test_report_command_lists_every_backend():
    out = subprocess.run([sys.executable, "-m", "backends"], capture_output=True, text=True, check=True).stdout
    for word in ("device cpu", "sparse_conv", "sparse_attn", "spconv", "metal", "naive", "selected:"):
        assert word in out
