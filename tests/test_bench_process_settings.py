"""The paired-process benchmark harness (benchmarks/bench_process_settings.py): its two processes take turns
call by call (no two timed calls overlap, A and B alternate) and each process runs with its own setting."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import bench_process_settings as bps  # noqa: E402

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the harness passes pipe descriptors to its children")


def test_settings_parse_and_typos_fail():
    assert bps.parse_setting("keep_freed_memory+threads:3") == [("keep_freed_memory", 0), ("threads", 3)]
    assert bps.parse_setting("default") == [("default", 0)]
    for bad in ("thread:2", "threads:0", "threads:x", "flush_denormal:1", ""):
        with pytest.raises(ValueError):
            bps.parse_setting(bad)


def test_processes_take_turns_each_with_its_own_setting(tmp_path):
    out = tmp_path / "pair.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_process_settings", "--work", "matmul",
                           "--a", "default", "--b", "flush_denormal+threads:2", "--rounds", "4", "--json", str(out)],
                          cwd=str(ROOT), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    a, b = report["results"]["a"], report["results"]["b"]
    assert not a["denormals_flushed"] and b["denormals_flushed"]
    assert b["threads"] == 2
    spans = sorted([(start, end, "a") for start, end in a["spans"]] + [(start, end, "b") for start, end in b["spans"]])
    assert "".join(label for _, _, label in spans) == "ab" * 4
    assert all(spans[i][1] <= spans[i + 1][0] for i in range(len(spans) - 1)), "two timed calls overlapped"
    assert report["summary"]["matmul"]["b_over_a"] > 0
    assert "| matmul |" in proc.stdout


def test_a_process_that_cannot_start_ends_the_run_with_its_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_process_settings", "--configs",
                           str(tmp_path / "missing"), "--rounds", "1"],
                          cwd=str(ROOT), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "ended before it was ready" in proc.stderr and "ss_generator.yaml" in proc.stderr


FLUSH_CHECK = """
import sys, torch
sys.path.insert(0, {root!r})
from benchmarks.bench_process_settings import denormals_flushed
torch.set_num_threads(2)
if {late}:
    torch.ones(1 << 22).mul_(2)  # the OpenMP threads start before the flag
torch.set_flush_denormal(True)
print(denormals_flushed())
"""


@pytest.mark.parametrize("late", [False, True])
def test_the_flush_check_sees_threads_that_started_before_the_flag(late):
    """Why the harness sets the flush mode first: threads started earlier keep reading denormals, and the check
    that the report prints sees them (a product split over both threads)."""
    proc = subprocess.run([sys.executable, "-c", FLUSH_CHECK.format(root=str(ROOT), late=late)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == str(not late)
