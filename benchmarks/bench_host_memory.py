"""The C allocator's reuse of freed CPU tensors (``backends.device.keep_freed_host_memory``, what a pipeline run
with the models kept loaded sets) against glibc's defaults: the two flow backbones' forward passes at full width
(fewer blocks, random weights), seconds and page faults a pass.

    python -m benchmarks.bench_host_memory --blocks 4 --weights bf16 --dtype bfloat16 --rounds 2
    OMP_NUM_THREADS=2 python -m benchmarks.bench_host_memory --blocks 1 --reps 3

Each mode runs in its own process (the setting is process-wide and cannot be undone), the modes alternating
over ``--rounds`` (A B, then B A, ...). Per pass: median and best seconds of ``--reps`` timed calls after two
warm-up calls, and the median minor page faults of a call. Stage 1: conditional and unconditional passes (4096
shape tokens, 7528 condition tokens); stage 2: the same on a 20k-voxel shell (5496 condition tokens). The
condition's key / value projections are cached and, with bf16 weights on a CPU that has the hardware, the
linear weights packed, as the pipeline runs them.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_blocks import build_backbone, default_configs  # noqa: E402

MODES = ("default", "keep")
STAGE2_VOXELS = 20000  # a shell of about this many voxels: the stage-2 object size the release samples


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def time_pass(fn: Callable[[], object], reps: int) -> Dict[str, float]:
    """Median / best seconds and median page faults of ``reps`` calls after two warm-up calls."""
    fn()
    fn()
    seconds: List[float] = []
    faults: List[int] = []
    for _ in range(reps):
        before = _faults()
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
        faults.append(_faults() - before)
    return {"median_s": sorted(seconds)[reps // 2], "best_s": min(seconds), "faults": sorted(faults)[reps // 2]}


@contextmanager
def passes_as_run(configs: Path, stage: str, blocks: int, weights: str, dtype: str
                  ) -> Iterator[Dict[str, Callable[[], object]]]:
    """{"cond": fn, "uncond": fn}: one stage's backbone passes as the pipeline runs them: linear weights packed
    where the CPU has bf16 hardware, the condition's key / value projections cached, each call under
    ``torch.no_grad`` and the dtype's autocast. ``stage``: "stage1" or "stage2" (20k shell voxels)."""
    from benchmarks.bench_blocks import stage1_model_calls, stage2_model_calls
    from sam3d_objects.model.backbone.tdfy_dit.modules.attention.context_cache import cached_condition
    from sam3d_objects.pipeline.weights import prepack_linear_weights

    def as_run(fn: Callable[[], object]) -> Callable[[], object]:
        def call():
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
                return fn()
        return call

    yaml = configs / ("ss_generator.yaml" if stage == "stage1" else "slat_generator.yaml")
    with torch.no_grad():
        model = build_backbone(yaml, blocks, weights)
        prepack_linear_weights(model)
    calls = stage1_model_calls(model) if stage == "stage1" else stage2_model_calls(model, STAGE2_VOXELS)
    with cached_condition(model):
        yield {name: as_run(calls[name]) for name in ("cond", "uncond")}


def passes(configs: Path, blocks: int, weights: str, dtype: str, reps: int) -> Dict[str, Dict[str, float]]:
    """Both backbones' conditional and unconditional passes, timed (one stage's model alive at a time)."""
    out = {}
    for stage in ("stage1", "stage2"):
        with passes_as_run(configs, stage, blocks, weights, dtype) as calls:
            for name, fn in calls.items():
                out[f"{stage}_{name}"] = time_pass(fn, reps)
    return out


def child(args: argparse.Namespace) -> None:
    import backends
    applied = backends.device.keep_freed_host_memory() if args.child == "keep" else False
    result = {"mode": args.child, "applied": applied, "threads": torch.get_num_threads(),
              "passes": passes(args.configs, args.blocks, args.weights, args.dtype, args.reps),
              "peak_rss_gib": backends.device.peak_rss_bytes() / 2 ** 30}
    print("RESULT " + json.dumps(result), flush=True)


def run_mode(mode: str, argv: List[str]) -> dict:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_host_memory", *argv, "--child", mode],
                          capture_output=True, text=True, cwd=str(ROOT))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"bench_host_memory: the {mode} run failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def table(results: List[dict]) -> str:
    names = list(results[0]["passes"])
    rows = ["| run | mode | " + " | ".join(f"{n} s (faults)" for n in names) + " | peak RSS GiB |",
            "|---|---|" + "---|" * len(names) + "---|"]
    for i, r in enumerate(results):
        cells = [f"{r['passes'][n]['median_s']:.3f} ({r['passes'][n]['faults']})" for n in names]
        rows.append(f"| {i + 1} | {r['mode']} | " + " | ".join(cells) + f" | {r['peak_rss_gib']:.2f} |")
    for mode in MODES:
        runs = [r for r in results if r["mode"] == mode]
        cells = [f"{sorted(r['passes'][n]['median_s'] for r in runs)[len(runs) // 2]:.3f}" for n in names]
        rows.append(f"| median | {mode} | " + " | ".join(cells) + " | |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", type=Path, default=default_configs(), help="folder with the generators' yamls")
    ap.add_argument("--blocks", type=int, default=1, help="transformer blocks per backbone")
    ap.add_argument("--weights", default="default", help="linear weight format: default, bf16, int8")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="autocast dtype")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1, help="pairs of runs, alternating the order")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", choices=MODES, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    argv = ["--configs", str(args.configs), "--blocks", str(args.blocks), "--weights", args.weights,
            "--dtype", args.dtype, "--reps", str(args.reps)]
    results = []
    for r in range(args.rounds):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            results.append(run_mode(mode, argv))
            print(f"round {r + 1} {mode}: " + json.dumps(results[-1]["passes"]), flush=True)
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
