#!/usr/bin/env python3
"""Meta's unmodified SAM 3D Objects package against its own golden cases, through ``patches.apply()``.

    python tests/run_upstream_golden.py [--upstream DIR | --tarball FILE] [--only case1,case2] [--verbose]

Extracts Meta's package (``../shared/upstream/sam-3d-objects_cf06676.tar.xz`` by default) into a temporary folder
(or uses ``--upstream DIR``, a checkout holding ``sam3d_objects/`` and ``notebook/``), applies the patches first,
then drives ``../shared/golden/check_cases.py`` with that folder as the implementation (``--impl``), exactly as its
``main()`` does, with one difference that its contract allows: check_cases refuses every ``torch.hub.load`` that
is not ``source='local'`` (a download would fetch full-size DINOv2); the patches' hub stand-in is re-installed
outside that guard, so upstream's ``torch.hub.load('facebookresearch/dinov2', ...)`` becomes a local one.
Prints check_cases' lines (``PASS``/``FAIL`` per case, ``cases: X/Y pass``) and exits 0 only if every case passes.

Run it with ``OMP_NUM_THREADS=1`` (the golden data were made single-threaded; spconv's CPU build reads it once).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
TARBALL = SHARED / "upstream" / "sam-3d-objects_cf06676.tar.xz"
GOLDEN = SHARED / "golden"


def extract(tarball: Path, into: Path) -> Path:
    with tarfile.open(tarball) as tar:
        tar.extractall(into, filter="data")
    return into


def load_check_cases(golden: Path):
    spec = importlib.util.spec_from_file_location("check_cases", golden / "check_cases.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_cases"] = module
    spec.loader.exec_module(module)
    return module


# what Meta's modules import at module level that is not CUDA-only (setup.py's [upstream] extra)
UPSTREAM_IMPORTS = ("loguru", "optree", "astor", "easydict", "lightning.pytorch", "utils3d", "moge", "cv2",
                    "open3d", "pyvista", "pymeshfix", "igraph", "timm", "matplotlib", "seaborn", "gradio", "spconv",
                    "hydra", "omegaconf", "torchvision")
MISSING_EXIT = 3


def missing_imports() -> list:
    missing = []
    for name in UPSTREAM_IMPORTS:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001  e.g. open3d without libusb-1.0: an OSError inside ImportError
            missing.append(f"{name} ({type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''})")
    return missing


def run(upstream: Path, golden: Path = GOLDEN, only: str = None, verbose: bool = False) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(ROOT))
    import patches

    patches.apply()  # first: e.g. a torchvision whose compiled extension does not load is repaired by it
    missing = missing_imports()
    if missing:
        print(f"MISSING upstream packages: {'; '.join(missing)} (pip install -e '.[upstream]', README)")
        return MISSING_EXIT
    cc = load_check_cases(golden)
    argv = ["--cases", str(golden), "--impl", str(upstream)] + (["--only", only] if only else []) + \
        (["--verbose"] if verbose else [])
    args = cc.parse_args(argv)
    cc.setup_implementation(args.impl)
    patches.hub_shim.install()  # outside check_cases' download guard: GitHub DINOv2 -> the local hub folder
    import torch
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True, warn_only=True)
    cc._import_libraries()
    folders = sorted(p for p in Path(args.cases).iterdir() if (p / "case.json").is_file())
    if args.only:
        folders = [p for p in folders if p.name in set(args.only.split(","))]
    passed = sum(bool(cc.run_case(folder, args)) for folder in folders)
    cc.report(f"cases: {passed}/{len(folders)} pass")
    return 0 if folders and passed == len(folders) else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--upstream", help="a checkout of Meta's package (default: extract --tarball to a temp folder)")
    p.add_argument("--tarball", default=str(TARBALL))
    p.add_argument("--golden", default=str(GOLDEN))
    p.add_argument("--only", help="comma-separated case names")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.upstream:
        return run(Path(args.upstream), Path(args.golden), args.only, args.verbose)
    with tempfile.TemporaryDirectory(prefix="sam3d_upstream_") as tmp:
        return run(extract(Path(args.tarball), Path(tmp)), Path(args.golden), args.only, args.verbose)


if __name__ == "__main__":
    sys.exit(main())
