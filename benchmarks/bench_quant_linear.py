"""Time every ``quant_linear`` backend against the float32 ``F.linear`` at the pipeline's layer shapes (one run, side
by side, as ratios to float32).

    python -m benchmarks.bench_quant_linear [--device cpu] [--threads 1 16] [--repeat 5] [--json out.json]

Shapes (rows x in -> out): the stage-1 flow model's tokens with guidance (8192 x 1024 -> 4096 / 4096 -> 1024), a
DINOv2 image (1374 x 1024 -> 3072) and the adaLN modulation (2 x 1024 -> 6144: a few rows, where widening the
weight dominates). The best of ``--repeat`` calls is reported.
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Dict, List

import torch
import torch.nn.functional as F

import backends
from backends import registry

RATIO = "_vs_float32"
SHAPES = ((8192, 1024, 4096), (8192, 4096, 1024), (1374, 1024, 3072), (2, 1024, 6144))


def _best(fn, device: torch.device, repeat: int) -> float:
    fn()
    backends.device.synchronize(device)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        backends.device.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def bench(device: torch.device, repeat: int, skip: List[str]) -> List[Dict[str, object]]:
    rows = []
    for m, k, n in SHAPES:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(m, k, generator=g).to(device)
        w = (torch.randn(n, k, generator=g) / k ** 0.5).to(device)
        q, scale = backends.quantize_int8(w)
        row = {"shape": f"{m}x{k}->{n}", "float32_ms": 1e3 * _best(lambda: F.linear(x, w), device, repeat)}
        for weight, s in ((q, scale), (w.to(torch.bfloat16), None)):
            fmt = "int8" if s is not None else "bf16"
            for name, spec in registry.registered(registry.Family.QUANT_LINEAR).items():
                if name in skip or spec.why_not(device, weight.dtype) is not None:
                    continue

                def call(name=name, weight=weight, s=s):
                    with backends.use(quant_linear=name):
                        return backends.quantized_linear(x, weight, s)
                seconds = _best(call, device, repeat)
                row[f"{fmt}/{name}_ms"] = 1e3 * seconds
                row[f"{fmt}/{name}{RATIO}"] = row["float32_ms"] / (1e3 * seconds)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, nargs="*", default=None, help="torch thread counts to run (CPU)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--skip", nargs="*", default=[], help="backends to leave out (e.g. int8pack: slow on CPUs)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    report = {"device": str(device), "torch": torch.__version__,
              "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "cpu_bf16_matmul_fast": backends.device.cpu_bf16_matmul_fast(), "runs": {}}
    for threads in args.threads or [torch.get_num_threads()]:
        torch.set_num_threads(threads)
        rows = bench(device, args.repeat, args.skip)
        report["runs"][str(threads)] = rows
        print(f"threads {threads}")
        for row in rows:
            ratios = "  ".join(f"{k[:-len(RATIO)]} {v:.2f}x" for k, v in row.items() if k.endswith(RATIO))
            print(f"  {row['shape']:<18} float32 {row['float32_ms']:8.1f} ms  {ratios}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
