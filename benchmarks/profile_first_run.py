"""Where the first run of a fresh process spends its time (not a test): builds the pipeline, then runs one object
under cProfile and prints the functions with the most cumulative and own time, and the stage times.

    python benchmarks/profile_first_run.py --config ckpt_full/pipeline.yaml [--device cuda] [--top 30]

Run it once with empty caches (Triton, Inductor, ``SAM3D_CACHE_DIR``) and once with warm ones to see what the
on-disk caches remove.
"""
import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    from bench_pipeline import synthetic_scene
    from sam3d_objects.inference import Inference
    t0 = time.perf_counter()
    inference = Inference(args.config, compile=False, device=args.device)
    print(f"construct {time.perf_counter() - t0:.2f} s")
    image, mask, pointmap = synthetic_scene()
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    inference(image, mask, seed=42, pointmap=pointmap)
    profiler.disable()
    print(f"first run {time.perf_counter() - t0:.2f} s; stages: " + ", ".join(
        f"{k} {v:.2f}" for k, v in inference.pipeline.stage_times.items()))
    for order in ("cumulative", "tottime"):
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats(order).print_stats(args.top)
        print(f"\n== by {order}\n" + "\n".join(line[:180] for line in out.getvalue().splitlines()[6:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
