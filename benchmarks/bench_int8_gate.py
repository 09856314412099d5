"""Quality gate and memory of the ``--weights`` formats: each format against the default (float32 on the CPU) run on
the same inputs and seed, side by side, with a format-free noise floor beside them.

    python -m benchmarks.bench_int8_gate --small                  # tiny random checkpoint, 2 + 2 steps: a quick check
    python -m benchmarks.bench_int8_gate --golden                 # the golden tiny pipeline (its inputs, seed 42)
    python -m benchmarks.bench_int8_gate --make-random ckpt_full --preset fast --work /tmp/gate --formats int8
    python -m benchmarks.bench_int8_gate --config DIR/pipeline.yaml --formats int8 bf16 noise --json gate.json

Every format runs in its own process (low-memory mode, as a default CPU run), so each peak RSS is that run's own:
the kernel's high-water mark of the child (``ru_maxrss``), model loading included. Inputs: the synthetic sphere
scene of ``bench_pipeline`` with its exact point map (``--golden``: the golden case's image, mask and point map).
Each child does two things:

1. **end to end**: the whole run in that format, as a user gets it (``Inference(..., weights=FMT)``);
2. **stage 2 alone**: stage 2 and the Gaussian decoder of that format on the *reference's* sparse structure
   (``pipeline.sample_slat`` on the default run's voxels, noise from ``torch.manual_seed(seed)``), rendered.

Compared with the default run (the reference child does both parts in float32):

* ``end_to_end``: ``occupancy_iou`` of the sparse structure's voxels (stage 1's ``coords``, with each run's occupied
  fraction of the 64^3 grid; ``degenerate`` when a structure is (nearly) empty or full, where the IoU says little)
  and ``render_mae`` of the Gaussians rendered from ``--views`` orbit views (colour in [0, 1]);
* ``per_stage``: ``stage1_iou`` (stage 1 in that format alone: the end-to-end structure, as nothing after stage 1
  feeds back into it) and ``stage2_render_mae`` (stage 2 in that format alone, on the float32 structure). The
  end-to-end MAE mixes both: where a few voxels flip, every stage-2 token sees a different structure through
  attention, and the object's rendering changes far more than the per-layer rounding would change it.
* the **noise floor**: pseudo-formats that change the float32 run without any format: ``noise`` / ``noise=REL``
  (the weights of the layers a conversion would replace, times ``1 + REL * N(0, 1)``, REL 1e-4 by default; all
  models loaded up front for that, so its RSS is not a low-memory run's) and ``threads=N`` (float32 with N torch
  threads). A format is only as meaningful as its distance above this floor.
* ``seconds`` (construction + end-to-end run), ``peak_rss_gib`` (the end-to-end run's) and where it was reached:
  ``peak_stage`` and ``stage_rss_gib`` (per stage: the peak resident memory during the stage, sampled every 5 ms).

Gate (the weight-format issue's): IoU >= 0.98 and render MAE <= 0.01, printed end to end and per stage. A format
``FMT:BACKEND`` runs FMT with ``QUANT_LINEAR_BACKEND=BACKEND`` (e.g. ``int8:int8_dynamic``); ``dtype=bfloat16``
runs the default weights with the condition and sampling stages under bfloat16 autocast (``Inference(dtype=)``).

``--work DIR`` keeps each format's result in ``DIR/<format>/`` and reuses it in later calls with the same settings
(``--rerun`` ignores them): on a machine with a time limit per command the formats can run in separate calls,
the default first, and the last call prints the whole table.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
GOLDEN_TINY = ROOT.parent / "shared" / "golden" / "pipeline_tiny"
GATE_IOU, GATE_MAE = 0.98, 0.01
GRID = 64
# fewer voxels than this, or more than this fraction of the grid: a degenerate structure (about empty or full)
DEGENERATE_VOXELS, DEGENERATE_FRACTION = 32, 0.9
NOISE_REL = 1e-4  # the default relative weight noise of the ``noise`` floor


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


def render_mae(views_a: np.ndarray, views_b: np.ndarray) -> Optional[float]:
    """Mean absolute colour difference of two [V, H, W, 3] renders (None when their shapes differ)."""
    if views_a is None or views_b is None or views_a.shape != views_b.shape:
        return None
    return float(np.abs(views_a - views_b).mean())


def compare(reference: Dict[str, np.ndarray], other: Dict[str, np.ndarray]) -> Dict[str, object]:
    """Gate numbers of ``other`` against ``reference``: both {"coords": [N, 4], "views": [V, H, W, 3]} of an
    end-to-end run, optionally "stage2_views" (stage 2 alone on the reference's structure, see the module doc)."""
    frac = occupied_fraction(other["coords"]), occupied_fraction(reference["coords"])
    result = {"occupancy_iou": occupancy_iou(reference["coords"], other["coords"]),
              "occupied_fraction": frac[0], "reference_occupied_fraction": frac[1],
              "degenerate": any(len(c) < DEGENERATE_VOXELS or occupied_fraction(c) > DEGENERATE_FRACTION
                                for c in (other["coords"], reference["coords"]))}
    mae = render_mae(reference.get("views"), other.get("views"))
    if mae is not None:
        result["render_mae"] = mae
    result["passes"] = bool(result["occupancy_iou"] >= GATE_IOU and result.get("render_mae", 1.0) <= GATE_MAE)
    stage2 = render_mae(reference.get("stage2_views"), other.get("stage2_views"))
    if stage2 is not None:
        result["per_stage"] = {"stage1_iou": result["occupancy_iou"], "stage2_render_mae": stage2,
                               "passes": bool(result["occupancy_iou"] >= GATE_IOU and stage2 <= GATE_MAE)}
    return result


# --------------------------------------------------------------------------------------------------------------
# formats and their pseudo-formats
# --------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    """One column of the gate: ``weights`` (a ``--weights`` format), the quant_linear ``backend`` to force, the
    sampling ``dtype`` (``Inference(dtype=)``: the condition and sampling stages under autocast), and the noise
    floor's ``noise_rel`` / ``threads`` (pseudo-formats: float32 weights)."""
    text: str
    weights: str = "default"
    backend: Optional[str] = None
    noise_rel: float = 0.0
    threads: Optional[int] = None
    dtype: Optional[str] = None

    @property
    def is_floor(self) -> bool:
        return self.noise_rel > 0 or self.threads is not None


def parse_spec(text: str) -> Spec:
    """``default``, ``int8``, ``bf16``, ``FMT:BACKEND``, ``dtype=NAME``, ``noise``, ``noise=REL``, ``threads=N``."""
    name, _, value = text.partition("=")
    if name == "dtype":
        from sam3d_objects.pipeline.inference_pipeline import check_sampling_dtype
        if check_sampling_dtype(value) is None:
            raise ValueError(f"{text}: give dtype=bfloat16 / float16 / float32")
        return Spec(text, dtype=check_sampling_dtype(value))
    if name == "noise":
        rel = float(value) if value else NOISE_REL
        if not rel > 0:
            raise ValueError(f"{text}: the noise floor needs a relative noise > 0")
        return Spec(text, noise_rel=rel)
    if name == "threads":
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"{text}: give threads=N with N >= 1")
        return Spec(text, threads=int(value))
    from sam3d_objects.pipeline.weights import check_weights
    weights, _, backend = text.partition(":")
    return Spec(text, check_weights(weights), backend or None)


def perturb_converted_layers(pipeline, rel: float, seed: int = 0) -> int:
    """The noise floor: every layer a ``--weights`` conversion would replace (in every loaded model it converts)
    gets weight ``w * (1 + rel * N(0, 1))``, drawn from its own generator; returns how many layers."""
    import torch
    import torch.nn as nn

    from sam3d_objects.pipeline.weights import CONVERTED_MODELS, selected_linears
    g = torch.Generator().manual_seed(seed)
    count = 0
    for name, model in sorted(pipeline.loaded_models().items()):
        if name not in CONVERTED_MODELS:
            continue
        for layer_name in selected_linears(model):
            layer = model.get_submodule(layer_name)
            w = layer.weight.detach()
            noise = torch.randn(w.shape, generator=g, dtype=torch.float32).to(w.device)
            layer.weight = nn.Parameter((w.float() * (1 + rel * noise)).to(w.dtype), requires_grad=False)
            count += 1
    return count


# --------------------------------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------------------------------
def golden_inputs() -> Tuple[np.ndarray, np.ndarray, "object"]:
    """(rgb, mask, point map) of the golden tiny pipeline case."""
    from safetensors.torch import load_file
    inp = load_file(str(GOLDEN_TINY / "inputs.safetensors"))
    return inp["image_rgb"].numpy(), inp["mask"].numpy(), inp["pointmap"].clone()


def golden_checkpoint(folder: Path) -> Path:
    """The golden tiny checkpoint copied into ``folder`` with its DINO sizes written into the yamls (the case
    builds DINOv2 through torch.hub with tiny sizes, ``case.json``'s ``sizes.dino``); returns its pipeline.yaml."""
    from omegaconf import OmegaConf
    if not (GOLDEN_TINY / "tiny_checkpoint" / "pipeline.yaml").is_file():
        raise SystemExit(f"--golden needs the golden tiny pipeline ({GOLDEN_TINY} not found); use --small")
    sizes = json.loads((GOLDEN_TINY / "case.json").read_text())["tiny_checkpoint"]["sizes"]["dino"]

    def with_sizes(node):
        if isinstance(node, dict):
            node = {k: with_sizes(v) for k, v in node.items()}
            if str(node.get("_target_", "")).endswith(".Dino"):
                node["backbone_kwargs"] = dict(sizes)
            return node
        return [with_sizes(v) for v in node] if isinstance(node, list) else node

    target = folder / "golden_tiny"
    if not (target / "pipeline.yaml").is_file():
        shutil.copytree(GOLDEN_TINY / "tiny_checkpoint", target, dirs_exist_ok=True)
        for y in target.glob("*.yaml"):
            OmegaConf.save(OmegaConf.create(with_sizes(OmegaConf.to_container(OmegaConf.load(y)))), y)
    return target / "pipeline.yaml"


# --------------------------------------------------------------------------------------------------------------
# one format (child process)
# --------------------------------------------------------------------------------------------------------------
def run_options(steps: Optional[List[int]], preset: Optional[str]) -> Dict[str, object]:
    """The run keywords of the gate's runs: the preset's, then explicit steps."""
    options: Dict[str, object] = {}
    if preset:
        from sam3d_objects import presets
        options.update(presets.run_options(preset))
    if steps:
        options.update(stage1_inference_steps=steps[0], stage2_inference_steps=steps[1])
    return options


def stage2_alone(inference, rgb, mask, coords: np.ndarray, seed: int, options: Dict[str, object]):
    """Stage 2 and the Gaussian decoder of ``inference``'s pipeline on the given sparse structure ``coords``
    (int [N, 4]), with the noise of ``torch.manual_seed(seed)`` (the same numbers for every format): the
    Gaussian. Stage 1 does not run."""
    import torch
    pipeline = inference.pipeline
    image = pipeline.merge_image_and_mask(inference.merge_mask_to_rgba(rgb, mask), None)
    slat_input = pipeline.preprocess_image(image, pipeline.slat_preprocessor)
    torch.manual_seed(seed)
    with torch.no_grad():
        slat = pipeline.sample_slat(slat_input, torch.as_tensor(coords).int().to(pipeline.device),
                                    inference_steps=options.get("stage2_inference_steps"),
                                    use_distillation=bool(options.get("use_stage2_distillation", False)))
        return pipeline.decode_slat(slat, ["gaussian"])["gaussian"][0]


def run_one(config: str, spec: Spec, out: Path, options: Dict[str, object], seed: int, views: int,
            resolution: int, device: Optional[str], golden: bool = False,
            structure: Optional[Path] = None) -> Dict[str, object]:
    """One child: the end-to-end run of ``spec`` and stage 2 alone on ``structure`` (the reference's
    result.npz; None: this run's own structure), written to ``out`` (result.npz, result.json)."""
    import torch

    import backends
    from sam3d_objects.inference import Inference

    if spec.threads:
        torch.set_num_threads(spec.threads)
    if golden:
        rgb, mask, pointmap = golden_inputs()
    else:
        from benchmarks.bench_pipeline import synthetic_scene
        rgb, mask, pointmap = synthetic_scene()
    start = time.perf_counter()
    inference = Inference(config, device=device or "auto", weights=spec.weights,
                          low_memory=False if spec.noise_rel else "auto", dtype=spec.dtype or "auto")
    perturbed = perturb_converted_layers(inference.pipeline, spec.noise_rel) if spec.noise_rel else 0
    stage_rss = stage_memory(inference.pipeline)
    constructed = time.perf_counter()
    output = inference(rgb, mask, seed=seed, pointmap=pointmap.clone(), **options)
    finished = time.perf_counter()
    peak = backends.device.peak_rss_bytes()  # the end-to-end run's, before the stage-2-alone part
    coords = output["coords"].cpu().numpy()
    views_arr = render_views(output["gaussian"][0], views, resolution)
    stage_seconds = dict(getattr(inference.pipeline, "stage_times", {}))
    inference.pipeline.stage_hook = None  # the memory profile is the end-to-end run's
    del output
    ref_coords = coords if structure is None else np.load(structure)["coords"]
    stage2_views = render_views(stage2_alone(inference, rgb, mask, ref_coords, seed, options), views, resolution)
    np.savez(out / "result.npz", coords=coords, views=views_arr, stage2_views=stage2_views)
    backend = None
    if spec.weights != "default":  # what the converted layers ran on
        stored = torch.int8 if spec.weights == "int8" else torch.bfloat16
        backend = backends.quant_linear.backend_for(inference.pipeline.device, stored).name
    info = {"weights": spec.text, "device": str(inference.pipeline.device), "quant_linear_backend": backend,
            "sampling_dtype": str(inference.pipeline.dtype).replace("torch.", ""),
            "threads": torch.get_num_threads(), "low_memory": inference.pipeline.low_memory,
            "perturbed_layers": perturbed,
            "seconds_construct": constructed - start, "seconds_run": finished - constructed,
            "seconds": finished - start, "voxels": int(len(coords)),
            "peak_rss_gib": peak / 2 ** 30, "peak_stage": peak_stage(stage_rss, peak),
            "stage_rss_gib": stage_rss, "stage_seconds": stage_seconds}
    (out / "result.json").write_text(json.dumps(info, indent=1))
    return info


def stage_memory(pipeline) -> Dict[str, float]:
    """Filled during the pipeline's runs: {stage: peak resident memory during the stage, GiB}, sampled every 5 ms
    by ``bench_pipeline.RssSampler`` through the pipeline's ``stage_hook`` (a thread that stops with the process)."""
    from benchmarks.bench_pipeline import RssSampler
    sampler = RssSampler().__enter__()
    record: Dict[str, float] = {}

    def hook(stage: str, when: str) -> None:
        peak = sampler.take_window()  # at "start" this only opens the stage's window
        if when == "end":
            record[stage] = max(record.get(stage, 0.0), peak / 2 ** 30)
    pipeline.stage_hook = hook
    return record


def peak_stage(stage_rss: Dict[str, float], peak_bytes: int) -> str:
    """The stage with the highest sampled peak ("construction" when the process peak came before the stages:
    more than 2% above every stage's)."""
    if not stage_rss:
        return "construction"
    stage = max(stage_rss, key=stage_rss.get)
    return stage if stage_rss[stage] >= 0.98 * peak_bytes / 2 ** 30 else "construction"


def _child(args) -> int:
    run_one(args.config, parse_spec(args.child), Path(args.out), run_options(args.steps, args.preset), args.seed,
            args.views, args.resolution, args.device, args.inputs == "golden",
            Path(args.structure) if args.structure else None)
    return 0


# --------------------------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------------------------
def _settings(config: str, args) -> Dict[str, object]:
    """What a stored result must have been run with to be reused (``--work``)."""
    return {"config": str(Path(config).resolve()), "steps": args.steps, "preset": args.preset, "seed": args.seed,
            "views": args.views, "resolution": args.resolution, "device": args.device, "golden": args.golden}


def _reusable(folder: Path, settings: Dict[str, object]) -> bool:
    try:
        stored = json.loads((folder / "settings.json").read_text())
    except (OSError, ValueError):
        return False
    return stored == settings and (folder / "result.npz").is_file() and (folder / "result.json").is_file()


def _run_child(config: str, spec: Spec, folder: Path, args, settings: Dict[str, object],
               structure: Optional[Path]) -> Dict[str, object]:
    if not args.rerun and _reusable(folder, settings):
        print(f"[{spec.text}] reusing {folder}", flush=True)
    else:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        env = dict(os.environ)
        if spec.backend:
            env["QUANT_LINEAR_BACKEND"] = spec.backend
        cmd = [sys.executable, "-m", "benchmarks.bench_int8_gate", "--child", spec.text, "--out", str(folder),
               "--config", config, "--seed", str(args.seed), "--views", str(args.views),
               "--resolution", str(args.resolution)]
        for flag, value in (("--steps", args.steps), ("--preset", args.preset), ("--device", args.device),
                            ("--structure", structure)):
            if value:
                cmd += [flag, *map(str, value if isinstance(value, list) else [value])]
        if args.golden:
            cmd += ["--inputs", "golden"]
        print(f"[{spec.text}] running ...", flush=True)
        proc = subprocess.run(cmd, env=env, cwd=ROOT)
        if proc.returncode != 0:
            shutil.rmtree(folder, ignore_errors=True)  # nothing half-written is reused later
            return {"weights": spec.text, "error": f"exit code {proc.returncode}"}
        (folder / "settings.json").write_text(json.dumps(settings))
    info = json.loads((folder / "result.json").read_text())
    info["weights"] = spec.text
    data = np.load(folder / "result.npz")
    info["_arrays"] = {k: data[k] for k in data.files}
    return info


def _config_path(args, scratch: Path) -> str:
    if args.config:
        return args.config
    if args.golden:
        return str(golden_checkpoint(scratch))
    from benchmarks.bench_speed import make_random_checkpoint, tiny_checkpoint
    if args.small:
        return str(tiny_checkpoint())
    return str(make_random_checkpoint(Path(args.make_random), args.manifests, args.configs))


def _table(results: Dict[str, Dict[str, object]]) -> str:
    nan = float("nan")
    lines = [f"{'weights':<20}{'seconds':>8}{'peak RSS GiB':>13}{'peak in':>17}{'voxels':>7}{'IoU':>8}{'MAE':>9}"
             f"  {'e2e':<5}{'stage-2 MAE':>12}  per-stage"]
    for spec, info in results.items():
        gate = info.get("gate", {})
        per = gate.get("per_stage", {})
        if spec == "default":
            verdicts = ("ref", "ref")
        else:
            verdicts = tuple("PASS" if g.get("passes") else ("FAIL" if g else "-") for g in (gate, per))
        notes = (" (degenerate structure)" if gate.get("degenerate") else "") + \
            (" (noise floor)" if parse_spec(spec).is_floor else "") + \
            (f" {info['error']}" if "error" in info else "")
        lines.append(f"{spec:<20}{info.get('seconds', nan):>8.1f}{info.get('peak_rss_gib', nan):>13.2f}"
                     f"{info.get('peak_stage', '-'):>17}{info.get('voxels', -1):>7}{gate.get('occupancy_iou', nan):>8.4f}"
                     f"{gate.get('render_mae', nan):>9.5f}  {verdicts[0]:<5}"
                     f"{per.get('stage2_render_mae', nan):>12.5f}  {verdicts[1]}{notes}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", help="pipeline.yaml of a checkpoint folder")
    src.add_argument("--make-random", default=None,
                     help="full-size random weights in this folder (built once, ~13 GB; an existing complete build "
                          "of bench_speed.py --make-random is reused)")
    src.add_argument("--small", action="store_true", help="tiny random checkpoint, 2 + 2 steps (a quick check)")
    src.add_argument("--golden", action="store_true",
                     help="the golden tiny pipeline: its checkpoint, inputs and steps (3 + 3), seed 42")
    p.add_argument("--manifests", type=Path, default=None)
    p.add_argument("--configs", type=Path, default=None)
    p.add_argument("--formats", nargs="+", default=["int8", "bf16", "noise"],
                   help="formats after the default: FMT, FMT:QUANT_LINEAR_BACKEND, dtype=bfloat16 (sampling under "
                        "bf16 autocast), or the noise floor's noise[=REL] and threads=N")
    p.add_argument("--steps", type=int, nargs=2, default=None,
                   help="stage-1 and stage-2 steps (default: the preset's, else the yaml's)")
    p.add_argument("--preset", default=None, help="run preset (sam3d_objects.presets), e.g. fast: distilled 4 + 4")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--views", type=int, default=4)
    p.add_argument("--resolution", type=int, default=256)
    p.add_argument("--device", default=None)
    p.add_argument("--work", type=Path, default=None,
                   help="keep each format's result in WORK/<format>/ and reuse it in later calls (same settings)")
    p.add_argument("--rerun", action="store_true", help="with --work: run every format again")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--structure", default=None, help=argparse.SUPPRESS)
    p.add_argument("--inputs", default="synthetic", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return _child(args)
    if not (args.config or args.make_random or args.small or args.golden):
        p.error("give --config, --make-random DIR, --small or --golden")
    if args.small and args.steps is None and args.preset is None:
        args.steps = [2, 2]
    specs = [parse_spec("default")] + [parse_spec(f) for f in dict.fromkeys(args.formats) if f != "default"]
    with tempfile.TemporaryDirectory(prefix="int8_gate_") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        config = _config_path(args, work)
        settings = _settings(config, args)
        results: Dict[str, Dict[str, object]] = {}
        for spec in specs:
            folder = work / spec.text.replace(":", "_").replace("=", "_")
            reference = work / "default" / "result.npz" if spec.text != "default" else None
            if reference is not None and "error" in results["default"]:
                results[spec.text] = {"weights": spec.text, "error": "no reference (the default run failed)"}
                continue
            results[spec.text] = _run_child(config, spec, folder, args, settings, reference)
    reference = results["default"].get("_arrays")
    for spec, info in results.items():
        arrays = info.pop("_arrays", None)
        if spec != "default" and arrays is not None and reference is not None:
            info["gate"] = compare(reference, arrays)
    report = {"config": config, "steps": args.steps or "the preset's / pipeline.yaml's", "preset": args.preset,
              "seed": args.seed, "golden": args.golden,
              "threads": int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)), "cpus": os.cpu_count(),
              "gate": {"occupancy_iou_min": GATE_IOU, "render_mae_max": GATE_MAE}, "runs": results}
    print(json.dumps(report, indent=1, default=str))
    print("IoU / MAE: end to end against the default run; stage-2 MAE: stage 2 alone on the default run's "
          "structure; per-stage gate: IoU (stage 1) and stage-2 MAE")
    print(_table(results))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
