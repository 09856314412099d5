"""Shared fixtures: the golden parity data, the devices every behaviour test runs on, per-dtype tolerances.

Golden data and the other reference material live in ``../shared`` beside the checkout (CI has it there);
``SAM3D_SHARED_DIR`` points elsewhere (e.g. a copy carried inside the repo to a GPU machine).

Devices: a test that takes the ``device`` fixture runs once per device of ``TEST_DEVICES``: the CPU and every
accelerator present (``cuda``, ``mps``), so a CPU-only machine runs exactly what it ran before and an accelerator
machine runs the same checks on its device too. ``SAM3D_TEST_DEVICES`` (comma-separated, e.g. ``cuda`` or
``cpu,mps``) restricts or forces the list; a forced device that is absent is skipped with that reason, never
silently dropped. While a device-parametrised test runs, that device is also the project's default device
(``backends.device.default_device()``), so code that picks the default device follows the parameter. Known gaps
of one device are marked with ``@pytest.mark.device_xfail("mps", reason=...)`` (strict: the test must fail
there; when it starts passing the mark has to go). At the end of a session the terminal summary lists what ran
where (passed / failed / skipped / xfailed per device); ``SAM3D_TEST_SUMMARY=path.json`` also writes it as JSON.
"""
from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from pathlib import Path
from typing import Optional

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ["SAM3D_SHARED_DIR"]).resolve() if os.environ.get("SAM3D_SHARED_DIR") else (
    ROOT.parent / "shared")
GOLDEN = SHARED / "golden"
KNOWN_DEVICES = ("cpu", "cuda", "mps")


# ---------------------------------------------------------------------------------------------------------------
# devices
# ---------------------------------------------------------------------------------------------------------------
def root_pythonpath() -> str:
    """PYTHONPATH for a subprocess that must import this checkout: the repo root first, then whatever the caller's
    PYTHONPATH already holds (e.g. a device machine's carried site folder with the dependencies)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


def mps_present() -> bool:
    return getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()


def device_present(name: str) -> bool:
    return name == "cpu" or (name == "cuda" and torch.cuda.is_available()) or (name == "mps" and mps_present())


def selected_devices(spec: Optional[str] = None) -> list[str]:
    """The device names device-parametrised tests run on: ``spec`` / ``$SAM3D_TEST_DEVICES`` (comma-separated),
    else the CPU and the accelerators present."""
    spec = os.environ.get("SAM3D_TEST_DEVICES", "") if spec is None else spec
    if spec.strip():
        names = [s.strip().lower() for s in spec.split(",") if s.strip()]
        unknown = [n for n in names if n not in KNOWN_DEVICES]
        if unknown:
            raise pytest.UsageError(f"SAM3D_TEST_DEVICES names unknown devices {unknown}; use {KNOWN_DEVICES}")
        return list(dict.fromkeys(names))
    return [n for n in KNOWN_DEVICES if device_present(n)]


TEST_DEVICES = selected_devices()
ACCELERATORS = [d for d in TEST_DEVICES if d != "cpu"]


def device_params(names=None) -> list:
    """``pytest.param`` per device (absent forced devices skip with the reason), for explicit parametrisation."""
    return [pytest.param(n, id=n, marks=() if device_present(n) else pytest.mark.skip(
        reason=f"{n} requested by SAM3D_TEST_DEVICES but not available on this machine"))
        for n in (TEST_DEVICES if names is None else names)]


def device_backend_params(family, names=None) -> list:
    """``pytest.param((device, backend))`` for every test device and every backend of ``family`` usable there
    (for an absent forced device: the backends declared for it, skipped with the reason). Use with
    ``@pytest.mark.parametrize("device,backend", device_backend_params(F), indirect=["device"])``."""
    import backends
    params = []
    for name in (TEST_DEVICES if names is None else names):
        present = device_present(name)
        for backend, spec in sorted(backends.registered(family).items()):
            usable = spec.why_not(torch.device(name)) is None if present else name in spec.devices
            if usable:
                params.append(pytest.param(name, backend, id=f"{name}-{backend}", marks=() if present else
                                           pytest.mark.skip(reason=f"{name} requested by SAM3D_TEST_DEVICES but "
                                                                   f"not available on this machine")))
    return params


def pytest_configure(config):
    config.addinivalue_line("markers", "device_xfail(device, reason, condition=True, when={}): a known gap of that "
                                       "device (where condition holds, for the parameters in when); the test "
                                       "must fail there (strict xfail) until the gap is closed")
    config.addinivalue_line("markers", "accelerators_only: run the test on each accelerator of the test devices "
                                       "only (full-size checks that the CPU tests cover at small sizes)")
    config.addinivalue_line("markers", "cpu_only(reason): the test's subject is CPU-specific; it is not "
                                       "parametrised over devices")


def pytest_generate_tests(metafunc):
    """Every test that takes ``device`` (and does not parametrise it itself) runs on each test device."""
    if "device" not in metafunc.fixturenames:
        return
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0] if mark.args else mark.kwargs.get("argnames", "")
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        if "device" in names:
            return
    only_accelerators = metafunc.definition.get_closest_marker("accelerators_only") is not None
    metafunc.parametrize("device", device_params(ACCELERATORS if only_accelerators else None), indirect=True)


@pytest.fixture
def device(request) -> torch.device:
    """The device under test; also the project's default device for the duration of the test."""
    import backends
    dev = torch.device(getattr(request, "param", "cpu"))
    backends.device.set_default_device(dev)
    try:
        yield dev
    finally:
        backends.device.set_default_device(None)


# ---------------------------------------------------------------------------------------------------------------
# tolerances: comparisons with CPU float64 references that hold on every x86 / ARM CPU and accelerator
# ---------------------------------------------------------------------------------------------------------------
# (rtol, atol) for one op's result in ``dtype`` against a float64 reference of the same inputs: a few units of
# the dtype's rounding plus the reduction-order differences of another CPU's SIMD width or a GPU's tiling. TF32
# (off by default in torch for matmuls) would need the half-precision row.
TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
# accelerator kernels (tiled reductions, fused multiply-adds, MPS's fast math) round differently from the CPU's
ACCELERATOR_SCALE = 4.0


def tolerance(dtype: torch.dtype, device=None, scale: float = 1.0) -> dict:
    """``dict(rtol=, atol=)`` for a result in ``dtype`` computed on ``device`` (``scale`` widens it for deep
    compositions of ops), for comparisons with a float64 reference of the same inputs."""
    rtol, atol = TOLERANCES[dtype]
    if device is not None and torch.device(device).type != "cpu":
        scale *= ACCELERATOR_SCALE
    return {"rtol": rtol * scale, "atol": atol * scale}


@pytest.fixture
def exact_float32(monkeypatch):
    """No TF32 (cuDNN convolutions default to it on CUDA): the float32 tolerances then hold on every device."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(precision)


def host(x):
    """A tensor (or nested tuple / list / dict of them) on the CPU, detached: safe for numpy and comparisons."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, (list, tuple)):
        return type(x)(host(v) for v in x)
    if isinstance(x, dict):
        return type(x)({k: host(v) for k, v in x.items()})
    return x


class AtenOpLog(torch.utils._python_dispatch.TorchDispatchMode):
    """The names of the aten ops run inside it (``.ops``): to see which path a backend op took (a copy made, a
    buffer filled) on whatever device the tensors are."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


def assert_close_to_reference(actual: torch.Tensor, reference: torch.Tensor, dtype: Optional[torch.dtype] = None,
                              scale: float = 1.0) -> None:
    """``actual`` (any device, any float dtype) against a reference (usually CPU float64) with the tolerance of
    ``dtype`` (default: actual's) on actual's device, compared on the host in float64."""
    where = actual.device
    actual, reference = host(actual), host(reference)
    torch.testing.assert_close(actual.double(), reference.double(),
                               **tolerance(dtype or actual.dtype, where, scale))


# ---------------------------------------------------------------------------------------------------------------
# what ran where: per-device outcome counts at the end of the session
# ---------------------------------------------------------------------------------------------------------------
_OUTCOMES: dict = defaultdict(Counter)
_UNPARAMETRISED = "not device-parametrised"
_DEVICE_KEY = pytest.StashKey[str]()


def _device_of(item) -> str:
    callspec = getattr(item, "callspec", None)
    param = callspec.params.get("device") if callspec is not None else None
    if isinstance(param, torch.device):
        return param.type
    if isinstance(param, str):
        return param.split(":")[0]
    return _UNPARAMETRISED  # absent, or an empty device list (no accelerator for accelerators_only)


def pytest_collection_modifyitems(config, items):
    for item in items:
        where = item.stash[_DEVICE_KEY] = _device_of(item)
        for mark in item.iter_markers("device_xfail"):
            devices = (mark.args[0],) if isinstance(mark.args[0], str) else tuple(mark.args[0])
            params = getattr(getattr(item, "callspec", None), "params", {})
            when = mark.kwargs.get("when", {})  # other parameters the gap depends on, e.g. {"norm": "reference"}
            if where in devices and mark.kwargs.get("condition", True) and all(
                    params.get(k) == v for k, v in when.items()):
                item.add_marker(pytest.mark.xfail(reason=mark.kwargs["reason"], strict=True))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.sam3d_device = item.stash.get(_DEVICE_KEY, _UNPARAMETRISED)


def pytest_runtest_logreport(report):
    where = getattr(report, "sam3d_device", _UNPARAMETRISED)
    if report.when == "call" or (report.when == "setup" and not report.passed):
        if hasattr(report, "wasxfail"):
            kind = "xfailed" if report.skipped else "xpassed"
        elif report.skipped:
            kind = "skipped"
        elif report.when == "setup":
            kind = "error"  # a fixture failed
        else:
            kind = report.outcome  # passed / failed
        _OUTCOMES[where][kind] += 1
    elif report.when == "teardown" and report.failed:
        _OUTCOMES[where]["error"] += 1


def device_summary() -> dict:
    """{device: {outcome: count}} of this session so far, plus what the machine has."""
    import backends
    return {"devices": {k: dict(v) for k, v in sorted(_OUTCOMES.items())},
            "test_devices": TEST_DEVICES,
            "default_device": str(backends.device.default_device()),
            "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "mps": mps_present()}


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _OUTCOMES:
        return
    summary = device_summary()
    tr = terminalreporter
    tr.section("what ran where (sam3d devices)")
    tr.write_line(f"test devices: {', '.join(TEST_DEVICES)}; default device of unparametrised tests: "
                  f"{summary['default_device']}; torch {summary['torch']}"
                  + (f"; GPU: {summary['cuda']}" if summary["cuda"] else ""))
    kinds = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
    tr.write_line(f"{'device':<26}" + "".join(f"{k:>9}" for k in kinds))
    for where, counts in summary["devices"].items():
        tr.write_line(f"{where:<26}" + "".join(f"{counts.get(k, 0):>9}" for k in kinds))
    path = os.environ.get("SAM3D_TEST_SUMMARY")
    if path:
        Path(path).write_text(json.dumps(summary, indent=1))


# ---------------------------------------------------------------------------------------------------------------
# golden data and per-test state
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def golden_dir() -> Path:
    if not (GOLDEN / "check_cases.py").exists():
        pytest.skip(f"golden parity data not found at {GOLDEN} (CI provides ../shared beside the checkout; "
                    f"SAM3D_SHARED_DIR points elsewhere)")
    return GOLDEN


@pytest.fixture(autouse=True)
def _fresh_backend_choice():
    """Each test starts from automatic backend selection and the process's thread count, whatever a previous
    test set."""
    import backends

    threads = torch.get_num_threads()
    backends.reset_backends()
    yield
    backends.reset_backends()
    torch.set_num_threads(threads)


def random_coords(n: int, resolution: int, batch: int = 0, seed: int = 0) -> torch.Tensor:
    """Up to n unique voxels (sorted) of one batch element as int32 [M, 4]."""
    g = torch.Generator().manual_seed(seed)
    xyz = torch.unique(torch.randint(0, resolution, (n, 3), generator=g), dim=0)
    return torch.cat([torch.full((xyz.shape[0], 1), batch), xyz], 1).to(torch.int32)


def dense_conv3d_float64(feats: torch.Tensor, coords: torch.Tensor, weight: torch.Tensor,
                         bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Reference submanifold conv: the voxels scattered into a dense grid per batch element, ``F.conv3d`` in
    float64 (spconv weight layout [out, k, k, k, in]), read back at the occupied sites."""
    import torch.nn.functional as F

    c = coords.long()
    k = weight.shape[1]
    batch, res = int(c[:, 0].max()) + 1, int(c[:, 1:].max()) + 1
    grid = torch.zeros(batch, feats.shape[1], res, res, res, dtype=torch.float64)
    grid[c[:, 0], :, c[:, 1], c[:, 2], c[:, 3]] = feats.double()
    w = weight.double().permute(0, 4, 1, 2, 3)  # spconv [out, kx, ky, kz, in] -> conv3d [out, in, kx, ky, kz]
    out = F.conv3d(grid, w, None if bias is None else bias.double(), padding=k // 2)
    return out[c[:, 0], :, c[:, 1], c[:, 2], c[:, 3]]
