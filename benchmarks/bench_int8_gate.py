"""Quality gate and memory of the ``--weights`` formats: each format against the default (float32 on the CPU) run on
the same inputs and seed, side by side in one run.

    python -m benchmarks.bench_int8_gate --make-random ckpt_full --steps 25 25 --json gate.json   # full size
    python -m benchmarks.bench_int8_gate --config DIR/pipeline.yaml --formats default int8 bf16
    python -m benchmarks.bench_int8_gate --small        # tiny random checkpoint, 2 + 2 steps: checks the script

Every format runs in its own process (low-memory mode, as a default CPU run), so each peak RSS is that run's own:
the kernel's high-water mark of the child (``ru_maxrss``), model loading included. Inputs: the synthetic sphere
scene of ``bench_pipeline`` with its exact point map. Compared with the default run:

* ``occupancy_iou``: intersection over union of the sparse structure's voxels (stage 1's ``coords``), with each
  run's occupied fraction of the 64^3 grid; ``degenerate`` says when the structure is (nearly) empty or full,
  where the IoU says little about the weights (random weights can do that);
* ``render_mae``: mean absolute error of the gaussians rendered from ``--views`` orbit views (colour in [0, 1]);
* ``seconds`` (construction + run) and ``peak_rss_gib``.

Gate (the weight-format issue's): IoU >= 0.98 and render MAE <= 0.01; ``passes`` is printed per format. A format
``FMT:BACKEND`` runs FMT with ``QUANT_LINEAR_BACKEND=BACKEND`` (e.g. ``int8:int8_dynamic``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

GATE_IOU, GATE_MAE = 0.98, 0.01
GRID = 64
# fewer voxels than this, or more than this fraction of the grid: a degenerate structure (about empty or full)
DEGENERATE_VOXELS, DEGENERATE_FRACTION = 32, 0.9


# --------------------------------------------------------------------------------------------------------------
# comparisons (also used by tests/test_weights_quantized.py)
# --------------------------------------------------------------------------------------------------------------
def occupancy_iou(coords_a: np.ndarray, coords_b: np.ndarray) -> float:
    """IoU of two voxel sets given as integer [N, 4] (batch, x, y, z) rows; 1.0 for two empty sets."""
    a = {tuple(r) for r in np.asarray(coords_a).tolist()}
    b = {tuple(r) for r in np.asarray(coords_b).tolist()}
    union = a | b
    return len(a & b) / len(union) if union else 1.0


def occupied_fraction(coords: np.ndarray, grid: int = GRID) -> float:
    return len(np.asarray(coords)) / float(grid ** 3)


def render_views(gaussian, views: int = 4, resolution: int = 128) -> np.ndarray:
    """[views, H, W, 3] float colours in [0, 1] of ``gaussian`` from an orbit (the project's CPU renderer)."""
    from sam3d_objects.render.gaussians import render_video
    frames = render_video(gaussian, resolution=resolution, num_frames=views, r=2.0, fov=40.0)["color"]
    return np.stack([np.asarray(f, dtype=np.float32)[..., :3] / 255.0 for f in frames])


def compare(reference: Dict[str, np.ndarray], other: Dict[str, np.ndarray]) -> Dict[str, object]:
    """Gate numbers of ``other`` against ``reference``: both {"coords": [N, 4], "views": [V, H, W, 3]}."""
    frac = occupied_fraction(other["coords"]), occupied_fraction(reference["coords"])
    result = {"occupancy_iou": occupancy_iou(reference["coords"], other["coords"]),
              "occupied_fraction": frac[0], "reference_occupied_fraction": frac[1],
              "degenerate": any(len(c) < DEGENERATE_VOXELS or occupied_fraction(c) > DEGENERATE_FRACTION
                                for c in (other["coords"], reference["coords"]))}
    if "views" in reference and "views" in other and reference["views"].shape == other["views"].shape:
        result["render_mae"] = float(np.abs(reference["views"] - other["views"]).mean())
    result["passes"] = bool(result["occupancy_iou"] >= GATE_IOU and result.get("render_mae", 1.0) <= GATE_MAE)
    return result


# --------------------------------------------------------------------------------------------------------------
# one run (child process)
# --------------------------------------------------------------------------------------------------------------
def run_one(config: str, weights: str, out: Path, steps: Optional[List[int]], seed: int, views: int,
            resolution: int, device: Optional[str]) -> Dict[str, object]:
    import torch

    import backends
    from benchmarks.bench_pipeline import synthetic_scene
    from sam3d_objects.inference import Inference

    rgb, mask, pointmap = synthetic_scene()
    start = time.perf_counter()
    inference = Inference(config, device=device or "auto", weights=weights)
    constructed = time.perf_counter()
    options = {}
    if steps:
        options = dict(stage1_inference_steps=steps[0], stage2_inference_steps=steps[1])
    output = inference(rgb, mask, seed=seed, pointmap=pointmap, **options)
    finished = time.perf_counter()
    coords = output["coords"].cpu().numpy()
    views_arr = render_views(output["gaussian"][0], views, resolution)
    np.savez(out / "result.npz", coords=coords, views=views_arr)
    backend = None
    if weights != "default":  # what the converted layers ran on
        stored = torch.int8 if weights == "int8" else torch.bfloat16
        backend = backends.resolve(backends.Family.QUANT_LINEAR, inference.pipeline.device, stored).name
    info = {"weights": weights, "device": str(inference.pipeline.device), "quant_linear_backend": backend,
            "threads": torch.get_num_threads(),
            "seconds_construct": constructed - start, "seconds_run": finished - constructed,
            "seconds": finished - start, "voxels": int(len(coords)),
            "peak_rss_gib": backends.device.peak_rss_bytes() / 2 ** 30,
            "stage_seconds": dict(getattr(inference.pipeline, "stage_times", {}))}
    (out / "result.json").write_text(json.dumps(info, indent=1))
    return info


def _child(args) -> int:
    run_one(args.config, args.child, Path(args.out), args.steps, args.seed, args.views, args.resolution,
            args.device)
    return 0


# --------------------------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------------------------
def _run_child(config: str, spec: str, folder: Path, args) -> Dict[str, object]:
    weights, _, backend = spec.partition(":")
    env = dict(os.environ)
    if backend:
        env["QUANT_LINEAR_BACKEND"] = backend
    cmd = [sys.executable, "-m", "benchmarks.bench_int8_gate", "--child", weights, "--out", str(folder),
           "--config", config, "--seed", str(args.seed), "--views", str(args.views),
           "--resolution", str(args.resolution)]
    if args.steps:
        cmd += ["--steps", *map(str, args.steps)]
    if args.device:
        cmd += ["--device", args.device]
    print(f"[{spec}] running ...", flush=True)
    proc = subprocess.run(cmd, env=env, cwd=Path(__file__).resolve().parents[1])
    if proc.returncode != 0:
        return {"weights": spec, "error": f"exit code {proc.returncode}"}
    info = json.loads((folder / "result.json").read_text())
    info["weights"] = spec
    data = np.load(folder / "result.npz")
    info["_arrays"] = {"coords": data["coords"], "views": data["views"]}
    return info


def _config_path(args) -> str:
    if args.config:
        return args.config
    from benchmarks.bench_speed import make_random_checkpoint, tiny_checkpoint
    if args.small:
        return str(tiny_checkpoint())
    return str(make_random_checkpoint(Path(args.make_random), args.manifests, args.configs))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", help="pipeline.yaml of a checkpoint folder")
    src.add_argument("--make-random", default=None, help="build (once) full-size random weights into this folder")
    src.add_argument("--small", action="store_true", help="tiny random checkpoint, 2 + 2 steps (a quick check)")
    p.add_argument("--manifests", type=Path, default=None)
    p.add_argument("--configs", type=Path, default=None)
    p.add_argument("--formats", nargs="+", default=["default", "int8", "bf16"],
                   help="weight formats after the default (FMT or FMT:QUANT_LINEAR_BACKEND)")
    p.add_argument("--steps", type=int, nargs=2, default=None, help="stage-1 and stage-2 steps (default: 25 25)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--views", type=int, default=4)
    p.add_argument("--resolution", type=int, default=256)
    p.add_argument("--device", default=None)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return _child(args)
    if not (args.config or args.make_random or args.small):
        p.error("give --config, --make-random DIR or --small")
    if args.small and args.steps is None:
        args.steps = [2, 2]
    config = _config_path(args)
    formats = ["default"] + [f for f in args.formats if f != "default"]
    results = {}
    with tempfile.TemporaryDirectory(prefix="int8_gate_") as tmp:
        for spec in formats:
            folder = Path(tmp) / spec.replace(":", "_")
            folder.mkdir()
            results[spec] = _run_child(config, spec, folder, args)
    reference = results["default"].get("_arrays")
    for spec, info in results.items():
        arrays = info.pop("_arrays", None)
        if spec != "default" and arrays is not None and reference is not None:
            info["gate"] = compare(reference, arrays)
    report = {"config": config, "steps": args.steps or "pipeline.yaml's", "seed": args.seed,
              "threads": int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)), "cpus": os.cpu_count(),
              "gate": {"occupancy_iou_min": GATE_IOU, "render_mae_max": GATE_MAE}, "runs": results}
    print(json.dumps(report, indent=1, default=str))
    print(f"{'weights':<22}{'seconds':>9}{'peak RSS GiB':>14}{'IoU':>8}{'voxels':>8}{'render MAE':>12}  gate")
    nan = float("nan")
    for spec, info in results.items():
        gate = info.get("gate", {})
        verdict = "reference" if spec == "default" else ("PASS" if gate.get("passes") else "FAIL")
        notes = (" (degenerate structure)" if gate.get("degenerate") else "") + \
            (f" {info['error']}" if "error" in info else "")
        print(f"{spec:<22}{info.get('seconds', nan):>9.1f}{info.get('peak_rss_gib', nan):>14.2f}"
              f"{gate.get('occupancy_iou', nan):>8.4f}{info.get('voxels', -1):>8}{gate.get('render_mae', nan):>12.5f}"
              f"  {verdict}{notes}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
