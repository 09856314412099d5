"""Linear + tanh-GELU on CUDA (the DiT MLP's first half): separate GEMM and GELU kernels vs cuBLASLt's GELU
epilogue (``torch._addmm_activation(..., use_gelu=True)``), fp16, timed with CUDA events (median).

    python -m benchmarks.bench_linear_gelu
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .cuda_check import median_ms

CUDA = torch.device("cuda")


def main() -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; fp16 x [M, 1024] -> [M, 4096]")
    print(f"{'M':>7} {'separate ms':>12} {'epilogue ms':>12} {'ratio':>6} {'err sep':>9} {'err epi':>9}")
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(4096, 1024, device="cuda", dtype=torch.float16, generator=g) / 32
    b = torch.randn(4096, device="cuda", dtype=torch.float16, generator=g) / 10
    for m in (4, 4096, 8192, 16384, 32768):
        x = torch.randn(m, 1024, device="cuda", dtype=torch.float16, generator=g)
        ref = F.gelu(F.linear(x.double(), w.double(), b.double()), approximate="tanh")
        sep = lambda: F.gelu(F.linear(x, w, b), approximate="tanh")  # noqa: E731
        epi = lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True)  # noqa: E731
        e_sep = (sep().double() - ref).abs().max().item()
        e_epi = (epi().double() - ref).abs().max().item()
        t_sep, t_epi = median_ms(sep, CUDA, reps=30), median_ms(epi, CUDA, reps=30)
        print(f"{m:>7} {t_sep:12.4f} {t_epi:12.4f} {t_epi / t_sep:6.2f} {e_sep:9.2e} {e_epi:9.2e}")


if __name__ == "__main__":
    main()
