"""The default settings' sampling arithmetic and the least time this host's PyTorch kernels need for it.

    python benchmarks/bench_floor.py --dtype bfloat16 --json out/floor.json
    python benchmarks/bench_floor.py --configs ckpt_full --dtype float32 --voxels 20000

For each flow backbone (built from its yaml at full width with 1 and 2 transformer blocks, random weights, as
``bench_blocks.py`` does; no checkpoint read), one conditional and one unconditional pass are run under torch's
FLOP counter (``benchmarks.flops``) and timed (best of ``--repeat``), and both are extrapolated to the yaml's depth.
The FLOPs are split in two families: attention (the SDPA kernels) and matrix products (everything else the counter
sees: linear layers, the sparse convolutions' products, the pose tokens' attention through the condition).

The host's rates for the two families are measured in the same process, at the models' shapes: the linear layers
of a full-size block (4096 x 1024 -> 4096, 4096 x 4096 -> 1024, 4096 x 1024 -> 3072, 7528 x 1024 -> 2048) and the
attention of one (16 heads of 64; 4096 x 4096, 4096 x 7528), in ``--dtype`` (bfloat16: CPU autocast, as
``--dtype bfloat16`` samples; the passes with the linear weights in the format the pipeline stores them in for
that dtype, ``--weights auto``), best of ``--repeat`` each. The floor of one pass is its matmul FLOPs at the linear
rate plus its attention FLOPs at the attention rate; the floor of the sampling is the release's call counts
(25 conditional + 19 unconditional stage-1 passes, 25 + 13 stage-2 passes: the cfg interval, see
docs/CPU_SPEED.md) times the passes' floors, and likewise the ``fast`` preset's 4 + 4 conditional passes (distilled,
no guidance: the same backbone passes). Norms, casts, element-wise ops, gathers and the sparse convolutions'
index work are not in the floor, so a measured pass is slower than it: the "kernel share" column is floor /
measured. A goal below the floor needs faster kernels than PyTorch's on that host (or less arithmetic), not less
overhead.

The host's peak product rate is measured too (a square GEMM of ``PEAK_GEMM_SIZE``, in ``--dtype``: the best rate
its matmul kernels reach), and each setting's sampling is bounded by all of its arithmetic at that rate, attention
included: no implementation on these kernels, however fused, samples faster, since attention does its two
products and a softmax besides. A goal below that bound needs less arithmetic or other hardware.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_blocks import (DTYPES, STAGE1_COND_TOKENS, backbone_node, best_of,  # noqa: E402
                                     default_configs, extrapolate, in_dtype, stage1_calls, stage2_calls)
from benchmarks.flops import flop_counter  # noqa: E402

# backbone calls per sampling stage (conditional passes, unconditional passes): the release's settings (25 steps,
# guidance inside the cfg interval: 19 / 13 guided steps) and the `fast` preset (4 + 4 distilled steps, no guidance)
RELEASE_CALLS = {"stage1": (25, 19), "stage2": (25, 13)}
SETTING_CALLS = {"release": RELEASE_CALLS, "fast": {"stage1": (4, 0), "stage2": (4, 0)}}
PEAK_GEMM_SIZE = 4096
ATTENTION_OPS = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
LINEAR_SHAPES = ((4096, 1024, 4096), (4096, 4096, 1024), (4096, 1024, 3072), (STAGE1_COND_TOKENS, 1024, 2048))
ATTENTION_SHAPES = ((4096, 4096), (4096, STAGE1_COND_TOKENS))


def split_flops(counter) -> Dict[str, int]:
    """{"attention": n, "matmul": n} from a FlopCounterMode's global counts."""
    counts = counter.get_flop_counts().get("Global", {})
    attention = sum(n for op, n in counts.items() if any(name in str(op) for name in ATTENTION_OPS))
    return {"attention": int(attention), "matmul": int(sum(counts.values()) - attention)}


def counted(fn: Callable[[], object]) -> Dict[str, int]:
    counter = flop_counter()
    with counter:
        fn()
    return split_flops(counter)


def stage_passes(stage: str, configs: Path, blocks: int, voxels: int,
                 weights: str = "default") -> Dict[str, Callable[[], object]]:
    """{"cond": fn, "uncond": fn}: one pass of the stage's backbone with ``blocks`` blocks, as the sampler calls it."""
    if stage == "stage1":
        calls = stage1_calls(configs / "ss_generator.yaml", blocks, weights)
        return {name: calls[name] for name in ("cond", "uncond")}
    return stage2_calls(configs / "slat_generator.yaml", blocks, voxels, weights)


def pipeline_weights(dtype: str, weights: str) -> str:
    """``auto``: the format the pipeline stores the transformers' linear weights in for ``dtype`` (bf16 under
    bfloat16 sampling on the CPU: autocast's products from the float32 weights, bit for bit, without casting
    every weight at every call); any other value as given."""
    if weights != "auto":
        return weights
    return "bf16" if dtype == "bfloat16" else "default"


def kernel_rates(dtype: str, repeat: int) -> Dict[str, float]:
    """FLOP/s of the linear layers and of the attention at a full-size block's shapes, in ``dtype``."""
    g = torch.Generator().manual_seed(3)
    cast = DTYPES[dtype]
    flops = seconds = 0.0
    for m, k, n in LINEAR_SHAPES:
        x, w = torch.randn(m, k, generator=g).to(cast), torch.randn(n, k, generator=g).to(cast)
        seconds += best_of(lambda: F.linear(x, w), repeat)
        flops += 2.0 * m * k * n
    linear = flops / seconds
    flops = seconds = 0.0
    for lq, lk in ATTENTION_SHAPES:
        # the model's layout: heads of a fused projection, [B, L, H, D] viewed as [B, H, L, D]
        q = torch.randn(1, lq, 16, 64, generator=g).to(cast).transpose(1, 2)
        kv = torch.randn(1, lk, 2, 16, 64, generator=g).to(cast)
        k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
        seconds += best_of(lambda: F.scaled_dot_product_attention(q, k, v), repeat)
        flops += 4.0 * 16 * lq * lk * 64
    n = PEAK_GEMM_SIZE
    a, b = torch.randn(n, n, generator=g).to(cast), torch.randn(n, n, generator=g).to(cast)
    peak = 2.0 * n ** 3 / best_of(lambda: torch.mm(a, b), repeat)
    return {"linear_flops_per_s": linear, "attention_flops_per_s": flops / seconds,
            "peak_gemm_flops_per_s": max(peak, linear)}


def sampling_bounds(stages: Dict[str, dict], rates: Dict[str, float],
                    calls: Dict[str, Tuple[int, int]]) -> Dict[str, float]:
    """One setting's sampling from the passes' rows (``stages[stage]["passes"][cond|uncond]`` with ``floor_s``,
    ``measured_s``, ``tflop_attention``, ``tflop_matmul``) and its call counts per stage: the floor (each family at
    its kernel rate), the passes as measured, the TFLOP in all, and that arithmetic at the peak GEMM rate
    (``rates`` in FLOP/s)."""
    floor = measured = tflop = 0.0
    for stage, (cond_calls, uncond_calls) in calls.items():
        for name, count in (("cond", cond_calls), ("uncond", uncond_calls)):
            p = stages[stage]["passes"][name]
            floor += count * p["floor_s"]
            measured += count * p["measured_s"]
            tflop += count * (p["tflop_attention"] + p["tflop_matmul"])
    return {"floor_s": floor, "estimate_s": measured, "tflop": tflop,
            "at_peak_gemm_s": tflop * 1e12 / rates["peak_gemm_flops_per_s"]}


def measure(configs: Path, dtype: str, blocks: Tuple[int, int], voxels: int, repeat: int,
            weights: str = "auto") -> dict:
    rates = kernel_rates(dtype, repeat)
    weights = pipeline_weights(dtype, weights)
    stages = {}
    for stage, yaml in (("stage1", "ss_generator.yaml"), ("stage2", "slat_generator.yaml")):
        depth = int(backbone_node(configs / yaml).num_blocks)
        per = {"cond": {"flops": {}, "s": {}}, "uncond": {"flops": {}, "s": {}}}
        for b in blocks:
            with torch.inference_mode(), in_dtype(dtype):
                passes = stage_passes(stage, configs, b, voxels, weights)
                for name, fn in passes.items():
                    per[name]["flops"][b] = counted(fn)
                    per[name]["s"][b] = best_of(fn, repeat)
            del passes
        rows = {}
        for name, entry in per.items():
            fam = {f: extrapolate({b: entry["flops"][b][f] for b in blocks}, depth) for f in ("attention", "matmul")}
            floor = fam["matmul"] / rates["linear_flops_per_s"] + fam["attention"] / rates["attention_flops_per_s"]
            measured = extrapolate(entry["s"], depth)
            rows[name] = {"tflop_attention": fam["attention"] / 1e12, "tflop_matmul": fam["matmul"] / 1e12,
                          "floor_s": floor, "measured_s": measured, "kernel_share": floor / measured,
                          "blocks_s": entry["s"]}
        stages[stage] = {"depth": depth, "passes": rows}
    settings = {name: sampling_bounds(stages, rates, calls) for name, calls in SETTING_CALLS.items()}
    return {"dtype": dtype, "weights": weights, "threads": torch.get_num_threads(), "voxels": voxels,
            "blocks": list(blocks),
            "rates": {k: v / 1e12 for k, v in rates.items()}, "stages": stages, "settings": settings,
            "release_sampling_floor_s": settings["release"]["floor_s"],
            "release_sampling_estimate_s": settings["release"]["estimate_s"]}


def markdown(r: dict) -> str:
    rates = r["rates"]
    lines = [f"{r['threads']} threads, {r['dtype']} ({r.get('weights', 'default')} weights): linear layers "
             f"{rates['linear_flops_per_s']:.2f} TFLOP/s, "
             f"attention {rates['attention_flops_per_s']:.2f} TFLOP/s (full-size block shapes); peak GEMM "
             f"({PEAK_GEMM_SIZE}^3) {rates['peak_gemm_flops_per_s']:.2f} TFLOP/s", "",
             "| pass (full depth) | attention TFLOP | matmul TFLOP | floor s | measured s (extrapolated) | kernel share |",
             "|---|---|---|---|---|---|"]
    for stage, s in r["stages"].items():
        for name, p in s["passes"].items():
            lines.append(f"| {stage} {name} ({s['depth']} blocks) | {p['tflop_attention']:.2f} | {p['tflop_matmul']:.2f}"
                         f" | {p['floor_s']:.2f} | {p['measured_s']:.2f} | {100 * p['kernel_share']:.0f}% |")
    lines += ["", "| sampling | passes (stage 1, stage 2; conditional + unconditional) | TFLOP "
              "| all at the peak GEMM rate s | floor s | passes as measured s |", "|---|---|---|---|---|---|"]
    for name, b in r["settings"].items():
        calls = SETTING_CALLS[name]
        passes = ", ".join(f"{c} + {u}" if u else f"{c}" for c, u in (calls["stage1"], calls["stage2"]))
        lines.append(f"| {name} | {passes} | {b['tflop']:.1f} | {b['at_peak_gemm_s']:.0f} | {b['floor_s']:.0f} "
                     f"| {b['estimate_s']:.0f} |")
    lines += ["", "Floor: matmul FLOPs at the linear rate plus attention FLOPs at the attention rate. All at the "
              "peak GEMM rate: no sampling on this host's kernels is faster (attention costs more than its "
              "products)."]
    return "\n".join(lines)


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", type=Path, default=None, help="folder with ss_generator.yaml and "
                    "slat_generator.yaml (a checkpoint folder; default ../shared/upstream_configs)")
    ap.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    ap.add_argument("--weights", choices=["auto", "default", "bf16", "int8"], default="auto",
                    help="the linear layers' weight format (auto: the pipeline's for --dtype)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--blocks", type=int, nargs=2, default=[2, 4], help="two depths to extrapolate from")
    ap.add_argument("--voxels", type=int, default=20000, help="stage-2 voxel count")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per measurement (best of)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    report = measure(args.configs or default_configs(), args.dtype, tuple(args.blocks), args.voxels, args.repeat,
                     args.weights)
    report["wall_s"] = time.perf_counter() - t0
    print(markdown(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
