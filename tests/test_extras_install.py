"""Every documented extra installs without replacing the environment's torch: `pip install --dry-run --report` of
what `make extras EXTRAS=<name>` runs (the extra with the generated keep-torch constraints, then the --no-deps
packages) must install no torch, torchvision of another torch, or CUDA (nvidia-*) wheel. Needs the package index
(slow: `make test-slow`)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from sam3d_objects import extras

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTED = ["hub", "app", "moge", "sam3", "post", "video", "notebook", "browser"]
FORBIDDEN = ("torch", "torchaudio", "triton")  # torchvision is allowed only for the installed torch (constraint)


def dry_run(args, tmp_path, name):
    report = tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report),
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 and ("Could not find" in proc.stderr or "No matching distribution" in proc.stderr
                                 or "connection" in proc.stderr.lower()):
        pytest.skip(f"package index not reachable or incomplete here: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [(item["metadata"]["name"].lower(), item["metadata"]["version"])
            for item in json.loads(report.read_text())["install"]]


def test_documented_extras_exist_in_setup():
    known = extras.extras()
    assert all(name in known for name in DOCUMENTED)
    assert extras.no_deps_packages(["moge"]) == ["dlr-moge==2.0.0", "dlr-utils3d==1.3"]
    lines = extras.keep_torch_constraints()
    assert any(line.startswith("torch==") and "+" not in line for line in lines)


@pytest.mark.slow
@pytest.mark.parametrize("name", DOCUMENTED)
def test_extra_keeps_the_installed_torch(name, tmp_path):
    constraints = tmp_path / "keep-torch.txt"
    constraints.write_text("\n".join(extras.keep_torch_constraints()) + "\n")
    installed = dry_run(["-e", f".[{name}]", "-c", str(constraints)], tmp_path, name)
    nodeps = extras.no_deps_packages([name])
    if nodeps:
        installed += dry_run(["--no-deps", *nodeps], tmp_path, name + "-nodeps")
    bad = [f"{n}=={v}" for n, v in installed if n in FORBIDDEN or n.startswith("nvidia-")]
    assert not bad, f"`make extras EXTRAS={name}` would install {bad}"
    import torch
    pinned = torch.__version__.split("+")[0]
    for n, v in installed:
        if n == "torchvision":  # allowed, but it must be a build for the installed torch (pip checked the pin)
            assert constraints.read_text().count(f"torch=={pinned}") == 1
