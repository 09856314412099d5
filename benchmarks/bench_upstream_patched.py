"""Meta's unmodified pipeline through ``patches.apply()`` beside this project's pipeline: seconds per run.

    # CUDA machine (real spconv, no flash_attn), full-size random weights built once (see bench_speed.py):
    python benchmarks/bench_upstream_patched.py --make-random checkpoints/random_full --runs 3
    # plumbing check on any machine (tiny checkpoint of the golden data, 2 + 2 steps):
    python benchmarks/bench_upstream_patched.py --quick --runs 1

Variants, each in a fresh interpreter (Meta's package and this project share the module name ``sam3d_objects``):

- ``upstream+standin-attn``: Meta's package, ``patches.apply()`` keeping every real package; upstream picks
  flash_attn on A100/H100/H200, and with flash_attn absent the project's attention stand-in serves it.
- ``upstream+sdpa``: Meta's package, ``patches.apply(flash_attn=False, xformers=False)``, upstream's own SDPA
  attention (``ATTN_BACKEND=sdpa``, ``SPARSE_ATTN_BACKEND=sdpa`` read by its attention modules, imported before its
  pipeline module overrides the variables on those GPUs).
- ``project``: this project's pipeline (``notebooks/inference.py``), same checkpoint, same inputs.

Packages Meta's modules import at module level but never call on the timed path, and that cannot be installed
(the GPU host has no package registry and open3d / vtk / gradio are too big to carry): ``--import-only`` names
them (default: ``open3d,pyvista,vtk,pymeshfix,igraph,gradio,plotly,seaborn,xatlas``); each one that does not
import gets a placeholder module whose attributes raise when used, and the table says which were placeholders.

Each variant loads the checkpoint once, then times ``pipeline.run`` (stage 1 + stage 2 + Gaussian and mesh
decoding, no layout post-optimisation, no texture baking) on the bundled example image with its point map (no
depth model): the first run, then the median of ``--runs`` warm runs. Meta's package comes from ``--upstream DIR``
or is extracted from ``--tarball``. ``patches.report()`` of each upstream variant is printed with ``--report``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
TARBALL = SHARED / "upstream" / "sam-3d-objects_cf06676.tar.xz"
TINY = SHARED / "golden" / "pipeline_tiny" / "tiny_checkpoint"
VARIANTS = ("upstream+standin-attn", "upstream+sdpa", "project")
RESULT_TAG = "BENCH_RESULT "
IMPORT_ONLY = "open3d,pyvista,vtk,pymeshfix,igraph,gradio,plotly,seaborn,xatlas"


# ---------------------------------------------------------------------------------------------------------------
# parent: inputs, checkpoint, one child per variant, table
# ---------------------------------------------------------------------------------------------------------------
def prepare_inputs(folder: Path) -> Path:
    """The example image + mask (RGBA uint8) and its point map, saved for the children."""
    sys.path.insert(0, str(ROOT))
    import numpy as np
    import torch
    from PIL import Image
    from sam3d_objects.assets.example import EXAMPLE_DIR, example_pointmap

    image = np.asarray(Image.open(Path(EXAMPLE_DIR) / "image.png").convert("RGB"))
    mask = np.asarray(Image.open(sorted(Path(EXAMPLE_DIR).glob("[0-9]*.png"))[0])) > 0
    if mask.ndim == 3:
        mask = mask[..., -1]
    path = folder / "inputs.pt"
    pointmap = example_pointmap()
    pointmap = pointmap if torch.is_tensor(pointmap) else torch.from_numpy(np.asarray(pointmap))
    torch.save({"image": torch.from_numpy(image.copy()), "mask": torch.from_numpy(mask.copy()),
                "pointmap": pointmap}, path)
    return path


def pointmap_given_config(config: Path, into: Path) -> Path:
    """A copy of ``pipeline.yaml`` with ``depth_model: null`` beside the original (checkpoint paths are relative
    to the yaml's folder); the point map is given, so no depth network (and no weight download) is needed. On a
    CUDA machine ``device`` is ``cuda``."""
    from omegaconf import OmegaConf
    import torch
    node = OmegaConf.load(config)
    node.depth_model = None
    if torch.cuda.is_available() and "device" in node:
        node.device = "cuda"  # the golden tiny yaml says cpu; upstream's released yaml already says cuda
    out = config.with_name("pipeline_pointmap_given.yaml")
    if not os.access(config.parent, os.W_OK):  # read-only folder: copy it whole
        shutil.copytree(config.parent, into / "ckpt")
        out = into / "ckpt" / "pipeline_pointmap_given.yaml"
    OmegaConf.save(node, out)
    return out


def checkpoint_config(args, tmp: Path) -> Path:
    if args.quick:
        if not TINY.is_dir():
            raise SystemExit(f"--quick needs the golden tiny checkpoint ({TINY} not found); use --config")
        shutil.copytree(TINY, tmp / "tiny")
        return pointmap_given_config(tmp / "tiny" / "pipeline.yaml", tmp)
    if args.make_random:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from bench_speed import make_random_checkpoint
        return pointmap_given_config(make_random_checkpoint(Path(args.make_random)), tmp)
    return pointmap_given_config(Path(args.config).resolve(), tmp)


def run_child(variant: str, config: Path, inputs: Path, upstream: Path, args) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", variant, "--config", str(config),
           "--inputs", str(inputs), "--upstream", str(upstream), "--runs", str(args.runs),
           "--steps", str(args.steps[0]), str(args.steps[1]), "--import-only", args.import_only] + \
        (["--report"] if args.report else [])
    # the repo first, then the caller's path (packages carried to a machine without a registry live there)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    env.pop("LIDRA_SKIP_INIT", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    if args.log_dir:  # the children's whole output (the table keeps only the end of a failure)
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        log = Path(args.log_dir) / f"{variant.replace('+', '_')}.log"
        log.write_text(f"$ {' '.join(cmd)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
    return {"error": f"exit {proc.returncode}: " + " | ".join(tail)[-1500:]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", help="pipeline.yaml of a checkpoint folder (upstream layout)")
    ap.add_argument("--make-random", metavar="DIR", help="full-size random weights in DIR (built once)")
    ap.add_argument("--quick", action="store_true", help="the golden tiny checkpoint (plumbing check)")
    ap.add_argument("--upstream", help="a checkout of Meta's package (default: extract --tarball)")
    ap.add_argument("--tarball", default=str(TARBALL))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--runs", type=int, default=3, help="warm runs after the first")
    ap.add_argument("--steps", type=int, nargs=2, default=None, metavar=("STAGE1", "STAGE2"),
                    help="sampling steps (default: 25 25 full size, 2 2 with --quick)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per variant")
    ap.add_argument("--report", action="store_true", help="print patches.report() of the upstream variants")
    ap.add_argument("--log-dir", help="write each variant's whole output to DIR/<variant>.log")
    ap.add_argument("--import-only", default=IMPORT_ONLY,
                    help="packages given a placeholder when they do not import (comma-separated; '' for none)")
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--inputs", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.steps = args.steps or ([2, 2] if args.quick else [25, 25])
    if args.child:
        return child(args)
    if sum(bool(x) for x in (args.config, args.make_random, args.quick)) != 1:
        ap.error("give exactly one of --config, --make-random DIR, --quick")
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variant(s) {sorted(unknown)}; choose from {VARIANTS}")
    with tempfile.TemporaryDirectory(prefix="bench_upstream_") as tmp:
        tmp = Path(tmp)
        upstream = Path(args.upstream).resolve() if args.upstream else tmp / "upstream"
        if not args.upstream:
            with tarfile.open(args.tarball) as tar:
                tar.extractall(upstream, filter="data")
        config = checkpoint_config(args, tmp)
        inputs = prepare_inputs(tmp)
        import torch
        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        print(f"device: {device}; checkpoint: {config.parent}; steps {args.steps[0]} + {args.steps[1]}; "
              f"runs: 1 first + {args.runs} warm", flush=True)
        rows = []
        for variant in variants:
            result = run_child(variant, config, inputs, upstream, args)
            rows.append((variant, result))
            if "report" in result:
                print(f"--- patches.report() [{variant}]\n{result['report']}")
            print(f"{variant}: " + (result["error"] if "error" in result else "done"), flush=True)
    print(f"\n{'variant':24s} {'load s':>8s} {'first s':>9s} {'warm median s':>14s}  warm runs / backends")
    for variant, r in rows:
        if "error" in r:
            print(f"{variant:24s} {'-':>8s} {'-':>9s} {'-':>14s}  FAILED: {r['error'][:200]}")
            continue
        warm = r["warm"]
        median = f"{statistics.median(warm):.2f}" if warm else "-"
        print(f"{variant:24s} {r['load']:8.2f} {r['first']:9.2f} {median:>14s}  "
              f"{', '.join(f'{w:.2f}' for w in warm)} / {r.get('backends', '')}"
              + (f" / placeholders: {','.join(r['placeholders'])}" if r.get("placeholders") else ""))
    return 0 if all("error" not in r for _, r in rows) else 1


# ---------------------------------------------------------------------------------------------------------------
# child: one variant
# ---------------------------------------------------------------------------------------------------------------
def _sync():
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _Placeholder:
    """Stands for an attribute of a package that is only imported: any use raises, naming the package."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} is an import-only placeholder of bench_upstream_patched.py (the package "
                           f"is not installed); this code path needs the real package")


def install_import_only(names) -> list:
    """Placeholder modules for each of ``names`` that does not import (submodules resolve too)."""
    import importlib
    import importlib.abc
    import importlib.machinery
    import types

    absent = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001
            sys.modules.pop(name, None)
            absent.append(name)
    if not absent:
        return []

    class Loader(importlib.abc.Loader):
        def create_module(self, spec):
            module = types.ModuleType(spec.name)
            module.__path__ = []
            module.__getattr__ = _Placeholder(spec.name).__getattr__  # module-level __getattr__ (PEP 562)
            return module

        def exec_module(self, module):
            pass

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname.split(".")[0] in absent:
                return importlib.machinery.ModuleSpec(fullname, Loader(), is_package=True)
            return None

    sys.meta_path.insert(0, Finder())
    return absent


def child(args) -> int:
    import torch
    data = torch.load(args.inputs)
    image, mask, pointmap = data["image"].numpy(), data["mask"].numpy(), data["pointmap"]
    result = {}
    if args.child == "project":
        sys.path[:0] = [str(ROOT), str(ROOT / "notebooks")]
        backends_line = "project backends"
    else:
        sys.path[:0] = [str(Path(args.upstream)), str(Path(args.upstream) / "notebook"), str(ROOT)]
        result["placeholders"] = install_import_only([n for n in args.import_only.split(",") if n])
        import patches
        if args.child == "upstream+sdpa":
            os.environ["ATTN_BACKEND"] = os.environ["SPARSE_ATTN_BACKEND"] = "sdpa"
            patches.apply(flash_attn=False, xformers=False)
            # upstream's attention modules read the variables when imported; import them before its pipeline
            # module sets flash_attn for A100/H100/H200
            import sam3d_objects.model.backbone.tdfy_dit.modules.attention  # noqa: F401
            import sam3d_objects.model.backbone.tdfy_dit.modules.sparse  # noqa: F401
        else:
            patches.apply()
        if args.report:
            result["report"] = patches.report()
        from loguru import logger
        logger.remove()
        logger.add(sys.stderr, level="WARNING")
    import numpy as np
    from inference import Inference

    t0 = time.perf_counter()
    inference = Inference(args.config, compile=False)
    _sync()
    result["load"] = time.perf_counter() - t0
    if args.child != "project":
        result["backends"] = (f"ATTN_BACKEND={os.environ.get('ATTN_BACKEND')}, "
                              f"SPARSE_ATTN_BACKEND={os.environ.get('SPARSE_ATTN_BACKEND')}")
    rgba = np.concatenate([image[..., :3], (mask.astype(np.uint8) * 255)[..., None]], axis=-1)
    times = []
    for _ in range(1 + args.runs):
        t0 = time.perf_counter()
        out = inference._pipeline.run(rgba, None, 42, stage1_only=False, with_mesh_postprocess=False,
                                      with_texture_baking=False, with_layout_postprocess=False,
                                      use_vertex_color=True, stage1_inference_steps=args.steps[0],
                                      stage2_inference_steps=args.steps[1], pointmap=pointmap.clone())
        _sync()
        times.append(time.perf_counter() - t0)
    result.update(first=times[0], warm=times[1:], gaussians=int(out["gaussian"][0].get_xyz.shape[0]))
    print(RESULT_TAG + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
