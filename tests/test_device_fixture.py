"""The device machinery of tests/conftest.py: which devices device-parametrised tests run on, forced absent
devices skipped with the reason, strict per-device xfails, and the per-device summary at the end of a session."""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import conftest
from conftest import ROOT, device_params, device_present, selected_devices


def test_default_devices_are_the_cpu_and_the_accelerators_present():
    names = selected_devices("")
    assert names[0] == "cpu" and all(device_present(n) for n in names)
    assert ("cuda" in names) == torch.cuda.is_available() and ("mps" in names) == conftest.mps_present()


def test_the_environment_restricts_or_forces_the_list():
    assert selected_devices("cuda") == ["cuda"]
    assert selected_devices(" CPU , mps,cpu ") == ["cpu", "mps"]  # case, spaces and repeats ignored
    with pytest.raises(pytest.UsageError, match="unknown devices"):
        selected_devices("gpu")


def test_an_absent_forced_device_is_skipped_with_the_reason():
    for name in ("cuda", "mps"):
        (param,) = device_params([name])
        marks = [m for m in param.marks if m.name == "skip"]
        assert bool(marks) != device_present(name)
        if marks:
            assert "not available on this machine" in marks[0].kwargs["reason"]


def test_session_summary_counts_outcomes_per_device(tmp_path):
    """A small suite run in a subprocess with SAM3D_TEST_DEVICES=cpu,mps,cuda: device tests run on the CPU, the
    absent devices are skipped, a strict device_xfail on the CPU turns a failure into xfailed, and the JSON
    summary says so per device."""
    folder = tmp_path / "suite"
    folder.mkdir()
    shutil.copy(ROOT / "tests" / "conftest.py", folder / "conftest.py")  # the machinery under test, as is
    (folder / "test_sample.py").write_text(textwrap.dedent("""
        import pytest

        def test_runs(device):
            assert device.type in ("cpu", "cuda", "mps")

        @pytest.mark.device_xfail("cpu", reason="a known CPU gap, for the test")
        def test_known_gap(device):
            assert device.type != "cpu"

        def test_plain():
            pass
    """))
    summary = tmp_path / "summary.json"
    env = dict(os.environ, SAM3D_TEST_DEVICES="cpu,mps,cuda", SAM3D_TEST_SUMMARY=str(summary),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(folder)],
                          capture_output=True, text=True, env=env, cwd=str(folder), timeout=300)
    assert "what ran where" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
    counts = json.loads(summary.read_text())["devices"]
    assert counts["cpu"] == {"passed": 1, "xfailed": 1}
    assert counts["not device-parametrised"] == {"passed": 1}
    for name in ("cuda", "mps"):
        if not device_present(name):
            assert counts[name] == {"skipped": 2}
