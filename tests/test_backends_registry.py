"""Backend selection: environment variables, upstream aliases, overrides, and the errors for bad requests."""
import subprocess
import sys

import pytest
import torch

import backends
from backends.registry import Family, requested


def test_auto_on_cpu_picks_portable_backends(monkeypatch):
    for var in ("SPARSE_BACKEND", "SPARSE_ATTN_BACKEND", "ATTN_BACKEND", "NORM_BACKEND", "QUANT_LINEAR_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    # quant_linear without a weight dtype: bf16 matmuls where the CPU has them in hardware
    quant = "bf16" if backends.device.cpu_bf16_matmul_fast() else "dequant"
    assert backends.current("cpu") == {"sparse_conv": "torch", "sparse_attn": "sdpa", "attn": "sdpa",
                                       "norm": "native", "quant_linear": quant}


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


def test_resolve_is_cached_and_invalidated_by_overrides(monkeypatch):
    from backends import registry

    monkeypatch.delenv("ATTN_BACKEND", raising=False)
    registry._RESOLVED.clear()
    calls = []
    original = registry._resolve_uncached
    monkeypatch.setattr(registry, "_resolve_uncached", lambda *a: calls.append(a[3]) or original(*a))
    for _ in range(3):
        assert registry.resolve(Family.ATTN, torch.device("cpu"), torch.float32).name == "sdpa"
    assert calls == ["auto"]  # one real resolution, then a dict lookup
    registry.resolve(Family.ATTN, torch.device("cpu"), torch.float64)  # another dtype: its own entry
    assert len(calls) == 2
    with backends.use(attn="naive"):
        assert registry.resolve(Family.ATTN, torch.device("cpu"), torch.float32).name == "naive"
    backends.set_backend(attn="naive")
    try:
        assert registry.resolve(Family.ATTN, torch.device("cpu"), torch.float32).name == "naive"
    finally:
        backends.reset_backends()
    assert registry.resolve(Family.ATTN, torch.device("cpu"), torch.float32).name == "sdpa"
    monkeypatch.setenv("ATTN_BACKEND", "naive")  # the environment is part of the key: no stale answer
    assert registry.resolve(Family.ATTN, torch.device("cpu"), torch.float32).name == "naive"


def test_volatile_probe_is_asked_every_time(monkeypatch):
    """spconv's probe depends on the thread count, so its choice is never cached (a fake probe stands in)."""
    spec = backends.registered(Family.SPARSE_CONV)["spconv"]
    assert spec.volatile
    state = {"reason": None}
    monkeypatch.setattr(spec, "requires", ())
    monkeypatch.setattr(spec, "probe", lambda device: state["reason"])
    with backends.use(sparse="spconv"):
        assert backends.resolve(Family.SPARSE_CONV, torch.device("cpu"), torch.float32).name == "spconv"
        state["reason"] = "only correct with one thread"
        with pytest.raises(backends.BackendUnavailableError, match="one thread"):
            backends.resolve(Family.SPARSE_CONV, torch.device("cpu"), torch.float32)


def test_every_environment_name_is_in_the_one_table():
    import ast
    import pathlib

    from backends.registry import _ENV_VARS, ENVIRONMENT, SETTINGS, env_value

    with pytest.raises(KeyError, match="not a documented setting"):
        env_value("SAM3D_SOMETHING_NEW")
    root = pathlib.Path(__file__).resolve().parents[1]
    used, readers = set(), []
    for path in list((root / "backends").rglob("*.py")) + list((root / "sam3d_objects").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in (
                    "env_value", "env_flag") and node.args and isinstance(node.args[0], ast.Constant):
                used.add(node.args[0].value)
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and \
                    getattr(node.value, "id", "") == "os" and path.name != "registry.py":
                readers.append(f"{path.relative_to(root)}:{node.lineno}")
    used |= {name for names in _ENV_VARS.values() for name in names}  # the backend families' variables
    assert used <= set(ENVIRONMENT) | set(SETTINGS), used - set(ENVIRONMENT) - set(SETTINGS)
    assert not set(ENVIRONMENT) & set(SETTINGS)
    assert {"SPARSE_BACKEND", "ATTN_BACKEND", "NORM_BACKEND", "SAM3D_DEVICE", "SAM3D_ATTN_MAX_MB"} <= used
    assert not readers, f"only backends/registry.py reads the environment: {readers}"
    assert backends.registry.checkpoints_env.__doc__


def test_a_request_naming_a_stand_in_package_runs_the_automatic_choice(monkeypatch):
    """CUDA-era code sets ATTN_BACKEND=flash_attn on GPUs it knows; under patches.apply() flash_attn is a
    stand-in that runs this registry's attention. The request then means the automatic choice (with a warning),
    not an error, both for direct calls and through the stand-in's own function (which calls the registry)."""
    import types
    from backends.registry import STANDIN_FLAG
    from patches.flash_attn_shim import flash_attn_func

    standin = types.ModuleType("flash_attn")
    setattr(standin, STANDIN_FLAG, True)
    monkeypatch.setitem(sys.modules, "flash_attn", standin)
    monkeypatch.setenv("ATTN_BACKEND", "flash_attn")
    monkeypatch.setattr("backends.registry._WARNED", set())
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 7, 3, 8, generator=g) for _ in range(3))
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * 0.3
    reference = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.double())
    with pytest.warns(RuntimeWarning, match="stand-in"):
        direct = backends.attention(q, k, v, scale=0.3)
    torch.testing.assert_close(direct.double(), reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(flash_attn_func(q, k, v, softmax_scale=0.3).double(), reference, rtol=1e-5, atol=1e-6)
    monkeypatch.delitem(sys.modules, "flash_attn")  # no stand-in: the explicit request is an error again
    backends.reset_backends()
    with pytest.raises(backends.BackendUnavailableError, match="flash_attn"):
        backends.attention(q, k, v, scale=0.3)
