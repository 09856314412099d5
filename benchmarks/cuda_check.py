"""``python -m benchmarks.cuda_check``: parity and side-by-side timings of the CUDA fast paths, in one run.

1. Parity: the Triton sparse conv against the torch gather backend (fp32 and fp16, plus spconv when it imports)
   on a shell-shaped 20k-voxel input and a small ragged one.
2. Sparse conv timings on the pipeline's four shapes (``benchmarks/shapes.py``: surface-shell occupancy; the
   neighbour map is built once and reused, as layers do): triton vs torch gather vs spconv (map rebuilt per call, as the
   ``spconv`` backend does, and map reused), fp16 and fp32 (fp32 also with TF32 allowed).
3. Windowed attention (12 heads x 64, fp16): 40 windows of <= 400 tokens and 300 windows, through every
   sparse-attention backend that runs here.

Times are medians of ``--reps`` (>= 10) calls after warm-up, each bracketed by CUDA events. Prints one table.
Exit status: 0, or 2 when a parity check failed. Without CUDA it says so and exits 0 (``--device cpu
--scale 0.002`` is a dry run of the script itself on tiny shapes, with Triton's interpreter).
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from typing import Callable, Optional

import torch

from backends import neighbor_map
from backends.attn import naive_varlen_attention
from backends.registry import Family, registered
from backends.sparse_conv import torch_sparse_conv3d

from .shapes import CONV_SHAPES, WINDOW_SETS, shell_coords, window_lengths

NOTES: list[str] = []  # non-fatal problems (e.g. spconv refusing a shape), printed after the table


# ---------------------------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------------------------
# ---------------------------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------------------------
def median_ms(fn: Callable[[], object], device: torch.device, reps: int, warmup: int = 3) -> float:
    warmup = warmup if device.type == "cuda" else 1
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize(device)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------------------------------
# spconv (optional)
# ---------------------------------------------------------------------------------------------------------------
def spconv_runners(feats, coords, weight) -> Optional[tuple[Callable, Callable]]:
    """(map rebuilt every call, map reused) spconv callables, or None when spconv does not import."""
    try:
        import spconv.pytorch as spconv
    except Exception:
        return None
    k, c_in, c_out = weight.shape[1], weight.shape[4], weight.shape[0]
    conv = spconv.SubMConv3d(c_in, c_out, k, bias=False, indice_key="check").to(feats.device, feats.dtype)
    with torch.no_grad():
        conv.weight.copy_(weight)
    shape = (coords[:, 1:].max(dim=0).values + k).tolist()

    def fresh():
        x = spconv.SparseConvTensor(feats, coords, shape, 1)
        return conv(x).features

    with torch.no_grad():
        built = conv(spconv.SparseConvTensor(feats, coords, shape, 1))  # carries the map under "check"
    reused_input = built.replace_feature(feats)

    def reused():
        return conv(reused_input).features

    return fresh, reused


# ---------------------------------------------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------------------------------------------
def conv_parity(device: torch.device, scale: float, triton_conv) -> list[tuple[str, str, float, float, bool]]:
    rows = []
    cases = [("shell 20k x128", shell_coords(max(int(20_000 * scale), 50), 64, device, seed=1), 128, 128),
             ("ragged 3k 13->21", shell_coords(max(int(3_000 * scale), 40), 32, device, seed=2), 13, 21)]
    for name, coords, cin, cout in cases:
        nmap = neighbor_map(coords, 3)
        gen = torch.Generator().manual_seed(cin)
        feats32 = torch.randn(coords.shape[0], cin, generator=gen).to(device)
        weight32 = (torch.randn(cout, 3, 3, 3, cin, generator=gen) / math.sqrt(27 * cin)).to(device)
        bias32 = torch.randn(cout, generator=gen).to(device)
        ref = torch_sparse_conv3d(feats32.double(), coords, weight32.double(), bias32.double(), nmap)
        for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 5e-3)):
            f, w, b = feats32.to(dtype), weight32.to(dtype), bias32.to(dtype)
            # one fixed tiling: parity does not need the per-shape tuning (and its compiles)
            config = (64, 64, 32, 4, 3) if device.type == "cuda" else None
            out_torch = torch_sparse_conv3d(f, coords, w, b, nmap)
            try:
                out_triton = triton_conv(f, coords, w, b, nmap, config=config)
            except Exception as e:  # keep going: the rest of the run is still worth the device time
                NOTES.append(f"triton {name} {_dt(dtype)} raised {type(e).__name__}: {e}"[:600])
                out_triton = torch.full_like(out_torch, float("nan"))
            err = rel_err(out_triton, out_torch)
            rows.append((f"triton vs torch backend, {name}", _dt(dtype), err, tol, err < tol))
            err = rel_err(out_triton, ref)
            rows.append((f"triton vs float64, {name}", _dt(dtype), err, tol, err < tol))
            err_t = rel_err(out_torch, ref)
            rows.append((f"torch  vs float64, {name}", _dt(dtype), err_t, tol, err_t < tol))
            try:  # spconv is only a comparison: its failures are reported, not fatal
                runners = spconv_runners(f, coords, w) if device.type == "cuda" else None
                if runners is not None:
                    err_s = rel_err(runners[0]() + b, ref)
                    rows.append((f"spconv vs float64, {name}", _dt(dtype), err_s, tol, err_s < tol))
            except Exception as e:
                NOTES.append(f"spconv parity {name} {_dt(dtype)} failed: {type(e).__name__}: {e}"[:300])
    return rows


def conv_timings(device: torch.device, scale: float, reps: int, triton_conv) -> list[list[str]]:
    table = []
    for name, n, channels, resolution in CONV_SHAPES:
        n_scaled = max(int(n * scale), 64)
        coords = shell_coords(n_scaled, max(int(resolution * scale ** (1 / 2)), 16), device)
        nmap = neighbor_map(coords, 3)
        gen = torch.Generator().manual_seed(n)
        base_f = torch.randn(coords.shape[0], channels, generator=gen).to(device)
        base_w = (torch.randn(channels, 3, 3, 3, channels, generator=gen) / math.sqrt(27 * channels)).to(device)
        variants = [("fp16", torch.float16, False), ("fp32", torch.float32, False),
                    ("fp32+tf32", torch.float32, True)]
        spconv_ms: dict = {}
        for label, dtype, tf32 in variants:
            previous = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = tf32
            try:
                f, w = base_f.to(dtype), base_w.to(dtype)
                try:
                    t_triton = median_ms(lambda: triton_conv(f, coords, w, None, nmap), device, reps)
                except Exception as e:
                    NOTES.append(f"triton timing {name} {label} raised {type(e).__name__}: {e}"[:600])
                    t_triton = float("nan")
                t_torch = median_ms(lambda: torch_sparse_conv3d(f, coords, w, None, nmap), device, reps) \
                    if not tf32 else float("nan")
                if dtype not in spconv_ms:  # spconv ignores torch's TF32 switch: time it once per dtype
                    spconv_ms[dtype] = (float("nan"), float("nan"))
                    try:
                        runners = spconv_runners(f, coords, w) if device.type == "cuda" else None
                        if runners is not None:
                            spconv_ms[dtype] = (median_ms(runners[0], device, reps),
                                                median_ms(runners[1], device, reps))
                    except Exception as e:
                        NOTES.append(f"spconv timing {name} {label} failed: {type(e).__name__}: {e}"[:300])
                t_fresh, t_reused = spconv_ms[dtype]
            finally:
                torch.backends.cuda.matmul.allow_tf32 = previous
            unsorted_row = None
            if label == "fp16":  # the same kernel with rows in the caller's spatial order: which order wins?
                from backends.sparse_conv import triton as triton_kernels

                triton_kernels.SORT_ROWS_BY_MASK = False
                try:
                    t_plain = median_ms(lambda: triton_conv(f, coords, w, None, nmap), device, reps)
                except Exception as e:
                    NOTES.append(f"triton (rows unsorted) {name} raised {type(e).__name__}: {e}"[:600])
                    t_plain = float("nan")
                finally:
                    triton_kernels.SORT_ROWS_BY_MASK = True
                unsorted_row = [f"conv {name}", f"{coords.shape[0]}x{channels}", "fp16 rows unsorted",
                                _ms(t_plain), "", "", "", _x(t_plain / t_reused), ""]
            ratio = t_triton / t_reused if t_reused == t_reused else float("nan")
            target = {"fp16": 1.2, "fp32": 1.0, "fp32+tf32": 1.0}[label]
            met = ratio <= target if label == "fp16" else ratio < target  # fp32: strictly faster than spconv
            bound = f"{'<=' if label == 'fp16' else '<'} {target}"
            verdict = "-" if ratio != ratio else ("ok" if met else f"MISS ({bound})")
            table.append([f"conv {name}", f"{coords.shape[0]}x{channels}", label, _ms(t_triton), _ms(t_torch),
                          _ms(t_fresh), _ms(t_reused), _x(ratio), verdict])
            if unsorted_row is not None:
                table.append(unsorted_row)
    return table


def attention_timings(device: torch.device, scale: float, reps: int) -> tuple[list[list[str]], list]:
    table, parity = [], []
    heads, dim = 12, 64
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    specs = [s for s in registered(Family.SPARSE_ATTN).values()
             if not s.reference and s.why_not(device, dtype) is None]
    for name, count, total in WINDOW_SETS:
        count_s = max(int(count * scale ** 0.5), 2)
        lengths = window_lengths(count_s, max(int(total * scale), count_s * 4))
        cu = torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32)
        t = int(cu[-1])
        gen = torch.Generator().manual_seed(count)
        q, k, v = (torch.randn(t, heads, dim, generator=gen).to(device, dtype) for _ in range(3))
        scale_qk = dim ** -0.5
        ref = naive_varlen_attention(q.float(), k.float(), v.float(), cu, cu, max(lengths), max(lengths), scale_qk)
        times = {}
        for spec in specs:
            fn = spec.fn
            try:
                out = fn(q, k, v, cu, cu, max(lengths), max(lengths), scale_qk)
            except Exception as e:  # an optional backend that fails here is reported, the others still run
                NOTES.append(f"{spec.name} attention {name} failed: {type(e).__name__}: {e}"[:300])
                continue
            err = rel_err(out, ref)
            parity.append((f"{spec.name} attention vs fp32 naive, {name}", _dt(dtype), err, 1e-2, err < 1e-2))
            times[spec.name] = median_ms(lambda: fn(q, k, v, cu, cu, max(lengths), max(lengths), scale_qk),
                                         device, reps)
        base = times.get("varlen")
        for backend, ms in times.items():
            ratio = ms / base if base else float("nan")
            table.append([f"attn {name} ({backend})", f"{t} tok", _dt(dtype), _ms(ms), "", "", "",
                          _x(ratio) + " vs varlen" if base else "-", ""])
    return table, parity


# ---------------------------------------------------------------------------------------------------------------
def _dt(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _ms(v: float) -> str:
    return "-" if v != v else f"{v:.3f}"


def _x(v: float) -> str:
    return "-" if v != v else f"{v:.2f}x"


def print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = " | ".join(h.ljust(w) for h, w in zip(header, widths))
    print(line)
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(str(c).ljust(w) for c, w in zip(r, widths)))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--scale", type=float, default=1.0, help="shrink every shape (dry runs)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available: nothing to check (python -m benchmarks.cuda_check runs on a CUDA machine)")
        return 0
    reps = max(args.reps, 10) if device.type == "cuda" else max(args.reps, 1)
    started = time.perf_counter()
    from backends.sparse_conv.triton import triton, triton_sparse_conv3d

    if triton is None:
        print("triton is not installed: the triton sparse-conv backend cannot run here")
        return 0
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, triton {triton.__version__}")
    with torch.no_grad():
        parity = conv_parity(device, args.scale, triton_sparse_conv3d)
        print(f"parity checks done at {time.perf_counter() - started:.0f} s", flush=True)
        conv_rows = conv_timings(device, args.scale, reps, triton_sparse_conv3d)
        print(f"conv timings done at {time.perf_counter() - started:.0f} s", flush=True)
        attn_rows, attn_parity = attention_timings(device, args.scale, reps)
    parity += attn_parity
    print("parity (relative L2 error):")
    for name, dtype, err, tol, ok in parity:
        print(f"  {'ok  ' if ok else 'FAIL'} {name} [{dtype}]: {err:.2e} (tol {tol:.0e})")
    print(f"\nmedian ms of {reps} after warm-up; ratio = triton / spconv(map reused); "
          f"targets: fp16 <= 1.2x, fp32 < 1x; attention <= 1.1x varlen")
    print_table(["case", "size", "dtype", "triton/backend ms", "torch gather ms", "spconv built ms",
                 "spconv reused ms", "ratio", "target"], conv_rows + attn_rows)
    for note in NOTES:
        print(f"note: {note}")
    print(f"\ntotal {time.perf_counter() - started:.1f} s")
    return 0 if all(p[4] for p in parity) else 2


if __name__ == "__main__":
    sys.exit(main())
