"""Parity with upstream: every golden case of ../shared/golden through its own harness, check_cases.py.

One test per case (and per backend variant), each a subprocess running ``check_cases.py --only <case>`` so a
failing case shows by name and module-level state (global hooks, backend choices) cannot leak between cases.
"""
import os
import subprocess
import sys

import pytest

from conftest import GOLDEN, ROOT

CASES = ["sparse_ops", "ss_decoder", "embedder_fuser", "point_patch_embed", "ss_flow_mot", "samplers",
         "slat_flow", "slat_decoder_gs", "slat_decoder_gs_4", "slat_decoder_mesh", "preprocess", "pose_decode",
         "pipeline_tiny"]

# Cases that contain attention, re-run with the float reference backend to show backend independence.
ATTENTION_CASES = ["sparse_ops", "embedder_fuser", "point_patch_embed", "ss_flow_mot", "slat_flow",
                   "slat_decoder_gs", "slat_decoder_mesh"]
# Cases that contain sparse convolutions, re-run through the spconv package (single thread) when installed.
SPCONV_CASES = ["sparse_ops", "slat_flow", "slat_decoder_mesh"]

# Cases that cannot pass yet, with the reason; remove an entry once it passes. (Empty: every case passes.)
NOT_YET: dict = {}
# The harness compares face normals with a tolerance that follows each face's conditioning, so the naive
# (explicit-softmax) attention reference passes the mesh case too. (Empty: every case passes with it.)
NAIVE_ATTENTION_NOT_BITWISE: dict = {}


def run_case(case: str, env_overrides: dict) -> None:
    if not (GOLDEN / "check_cases.py").exists():
        pytest.skip(f"golden data not found at {GOLDEN}")
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", **env_overrides)
    # the harness is third-party code that instantiates torchvision targets with plain hydra: it gets the
    # torchvision stand-in of patches/ explicitly (sam3d_objects installs nothing on import)
    cmd = [sys.executable, str(ROOT / "tests" / "tools" / "run_check_cases.py"), str(GOLDEN / "check_cases.py"),
           "--cases", str(GOLDEN), "--impl", str(ROOT), "--only", case]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert proc.returncode == 0 and lines and lines[0].startswith(f"PASS {case}"), (
        "\n".join(lines) or proc.stdout[-2000:]) + "\n" + proc.stderr[-3000:]


def _marks(case, expected_failures=None):
    reasons = {**NOT_YET, **(expected_failures or {})}
    return [pytest.mark.xfail(reason=reasons[case], strict=False)] if case in reasons else []


@pytest.mark.parametrize("case", [pytest.param(c, marks=_marks(c)) for c in CASES])
def test_golden_case(case):
    run_case(case, {})


@pytest.mark.parametrize("case", [pytest.param(c, marks=_marks(c, NAIVE_ATTENTION_NOT_BITWISE))
                                  for c in ATTENTION_CASES])
def test_golden_case_naive_attention(case):
    run_case(case, {"ATTN_BACKEND": "naive", "SPARSE_ATTN_BACKEND": "naive"})


@pytest.mark.parametrize("case", [pytest.param(c, marks=_marks(c)) for c in SPCONV_CASES])
def test_golden_case_spconv_single_thread(case):
    pytest.importorskip("spconv.pytorch", reason="spconv (CPU build) not installed")
    # spconv on CPU is only correct with one thread; the adapter refuses otherwise, so pin the process to one.
    run_case(case, {"SPARSE_BACKEND": "spconv", "OMP_NUM_THREADS": "1"})
