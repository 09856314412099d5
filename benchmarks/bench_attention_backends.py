"""Which of PyTorch's SDPA kernels is fastest on the pipeline's attention shapes (CUDA only): flash, cuDNN,
memory-efficient and the dispatcher's default, fp16, 64-dim heads, timed with CUDA events (median of repeats).

    python -m benchmarks.bench_attention_backends [--heads 16] [--lengths 4101x4101 4101x5496 ...]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .cuda_check import median_ms

KERNELS = {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
           "efficient": SDPBackend.EFFICIENT_ATTENTION}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--lengths", nargs="+", default=["4100x4100", "4100x5496", "4100x7544", "16384x16384",
                                                     "32768x32768", "32768x5496"])
    args = ap.parse_args()
    h, d = args.heads, args.head_dim
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; fp16, {h} heads x {d}; ms (TFLOP/s)")
    print(f"{'Lq x Lk':>14} " + " ".join(f"{k:>18}" for k in KERNELS))
    for spec in args.lengths:
        lq, lk = (int(v) for v in spec.split("x"))
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, h, lq, d, device="cuda", dtype=torch.float16, generator=g)
        k, v = (torch.randn(1, h, lk, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(2))
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        flops = 4 * lq * lk * h * d
        cells = []
        for name, kernel in KERNELS.items():
            def call(kernel=kernel):
                if kernel is None:
                    return F.scaled_dot_product_attention(q, k, v)
                with sdpa_kernel([kernel]):
                    return F.scaled_dot_product_attention(q, k, v)
            try:
                err = (call().float() - ref).abs().max().item()
                ms = median_ms(call, torch.device("cuda"), reps=20)
                cells.append(f"{ms:7.3f} ({flops / ms / 1e9:4.0f}){'!' if err > 1e-2 else ' '}")
            except RuntimeError as e:
                cells.append(f"{'n/a':>18}")
                print(f"  {name} on {spec}: {str(e).splitlines()[0][:100]}")
        print(f"{spec:>14} " + " ".join(f"{c:>18}" for c in cells))


if __name__ == "__main__":
    main()
