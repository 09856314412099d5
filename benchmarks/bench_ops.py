"""``python -m benchmarks.bench_ops``: side-by-side timings of the registry's ops on every device present.

Not a test: numbers depend on the machine. Each row times the candidates in one process, one after the other,
median of several runs after a warm-up, so ratios are comparable. Shapes are the pipeline's (``benchmarks/shapes.py``):
sparse convs on surface-like occupancy (unions of sphere shells), windowed attention with swin-like window sizes.

``--floor`` times only the CPU sparse conv against its GEMM floor (the same products as one dense GEMM), the two
interleaved, with the thread count and load average printed: ``OMP_NUM_THREADS=1 python -m benchmarks.bench_ops
--floor --threads 1``; ``--dtype bfloat16`` times the pipeline's bfloat16 path (one GEMM over all taps) with the
per-offset pairs it replaced beside it (and, for stage 2's 1024-channel convolution at 32^3, which keeps the pairs,
the one GEMM beside them).

``--scatter`` times the mesh extraction's scatter-sums and uniques on the CPU (full size by default: 1.48 M fine
voxels at 256^3 in the decoder's parent-major order, 11.8 M corner rows in 23 chunks): torch's ``index_add_``
against ``backends.SlotScatter`` (its ranks once, then the passes, at any thread count; the pipeline takes them
from 4 threads), ``torch.unique`` against
``backends.unique_codes``, interleaved, each pair's results compared bit for bit.

``--packed`` times the CPU bf16 linear layers of a full-size transformer block by their plain bf16 weight
(``F.linear``) and by the oneDNN-packed copy the pipeline keeps where the models stay loaded
(``backends.prepack_bf16_weight``), interleaved, with the largest difference of the outputs.

``--norms`` times ``LayerNorm32`` of the decoders' bf16 tokens on the CPU (a full-size decoder's 32,429 x 768, no
affine, as its blocks have; the allocator setting of a pipeline whose models stay loaded): the composed op (float32
copy, ``F.layer_norm``, rounded back) against ``backends.float32_layer_norm`` (one kernel call on the half input),
interleaved, with the share of outputs that differ and the largest difference.
"""
from __future__ import annotations

import argparse
import math
import os
from typing import Optional

import torch
import torch.nn.functional as F

from backends.attn import block_diagonal_mask, varlen_attention
from backends.device import available_devices
from backends.hashing import neighbor_map
from backends.registry import BackendUnavailableError, Family, module_available, resolve, use
from backends.sparse_conv import portable, sparse_conv3d

from .shapes import CONV_SHAPES, shell_coords, timeit, timeit_interleaved

# the CPU rows are the pipeline's shapes cut to what a laptop CPU times in seconds
CPU_CONV_SHAPES = [("SLAT flow io", 20_000, 128, 64), ("small", 5_000, 128, 64), ("mesh dec 128^3", 60_000, 192, 128)]
CUDA_CONV_SHAPES = list(CONV_SHAPES)
# bf16 --floor only: stage 2's widest convolution (1024 channels on the shell's coarse voxels at 32^3)
CPU_WIDE_CONV_SHAPES = [("SLAT flow 32^3", 5_400, 1024, 32)]
# --packed: a full-size block's linear layers (rows, in, out): stage 1's 4096 tokens, stage 2's ~5.4k coarse voxels
PACKED_LINEAR_SHAPES = [(4096, 1024, 3072), (4096, 1024, 1024), (4096, 4096, 1024), (5400, 1024, 3072),
                        (5400, 4096, 1024)]


def _spconv_runner(feats, coords, weight, resolution):
    """spconv with its index cache reused across calls (its fastest mode), or None if not installed."""
    if not module_available("spconv"):
        return None
    import spconv.pytorch as spconv

    conv = spconv.SubMConv3d(weight.shape[4], weight.shape[0], weight.shape[1], bias=False,
                             indice_key="bench").to(feats.device, feats.dtype)
    with torch.no_grad():
        conv.weight.copy_(weight)
    x = spconv.SparseConvTensor(feats, coords, [resolution] * 3, 1)
    conv(x)  # builds and caches the indices in x
    return lambda: conv(x)


def _threads(n: Optional[int]):
    class _Ctx:
        def __enter__(self):
            self.old = torch.get_num_threads()
            if n:
                torch.set_num_threads(n)

        def __exit__(self, *exc):
            torch.set_num_threads(self.old)
    return _Ctx()


def _conv_inputs(n: int, ch: int, res: int, device: torch.device, dtype: torch.dtype):
    """Shell coords, random features and a 3^3 kernel scaled to keep activations O(1)."""
    coords = shell_coords(n, res, device=device)
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(n, ch, generator=g).to(device, dtype)
    weight = (torch.randn(ch, 3, 3, 3, ch, generator=g) / math.sqrt(27 * ch)).to(device, dtype)
    return coords, feats, weight


def bench_conv_floor(device: torch.device, dtype: torch.dtype, shapes, repeat: int) -> list[str]:
    """The portable conv against its GEMM floor: the same products (one row per neighbour pair, the centre
    included) as one dense ``torch.mm`` into preallocated buffers. Both run in turn, ``repeat`` times (medians of
    wall and process CPU time), so load on a shared machine falls on both; the ratio is the conv's overhead over
    the arithmetic it cannot avoid (gathers, scatters, dispatch). Where the backend runs the input as one GEMM
    over all taps (half inputs on the CPU, ``im2col_wanted``), the per-offset pairs it replaced run beside it."""
    rows = []
    for name, n, ch, res in shapes:
        coords, feats, weight = _conv_inputs(n, ch, res, device, dtype)
        nmap = neighbor_map(coords, 3)
        pairs = int((nmap.table >= 0).sum())
        g = torch.Generator().manual_seed(2)
        a = torch.randn(pairs, ch, generator=g).to(device, dtype)
        b = weight[:, 0, 0, 0, :].t().contiguous()
        c = a.new_empty(pairs, weight.shape[0])
        fns = {"conv": lambda: sparse_conv3d(feats, coords, weight, neighbor_map=nmap),
               "floor": lambda: torch.mm(a, b, out=c)}
        one_gemm = portable.im2col_wanted(feats, weight)
        half_cpu = device.type == "cpu" and dtype in (torch.float16, torch.bfloat16)
        other = "pairs" if one_gemm else "one GEMM" if half_cpu else None
        if other == "pairs":
            fns[other] = lambda: portable.pairs_sparse_conv3d(feats, nmap, weight, None)
        elif other == "one GEMM":
            fns[other] = lambda: portable.im2col_sparse_conv3d(feats, nmap, weight, None)
        with use(sparse="torch"):
            t = timeit_interleaved(fns, device, repeat)
        (conv_wall, conv_cpu), (floor_wall, floor_cpu) = t["conv"], t["floor"]
        path = "one GEMM" if one_gemm else "pairs"
        row = (f"{name:<15} | {n:>8,} x {ch:>4} | {pairs:>9,} pairs | torch ({path}) {conv_wall:8.2f} ms "
               f"(CPU {conv_cpu:8.2f}) | GEMM floor {floor_wall:8.2f} ms (CPU {floor_cpu:8.2f}) | "
               f"ratio wall {conv_wall / floor_wall:5.2f} CPU {conv_cpu / floor_cpu:5.2f}")
        if other is not None:
            label = "per-offset pairs" if other == "pairs" else "one GEMM over all taps"
            row += f" | {label} {t[other][0]:8.2f} ms (ratio {t[other][0] / floor_wall:5.2f})"
        rows.append(row)
    return rows


def bench_packed_linear(shapes, repeat: int) -> list[str]:
    """``backends.quantized_linear`` of a bf16 weight (``F.linear``) against the same call with its packed copy
    (``backends.prepack_bf16_weight``), on the CPU, interleaved; a note instead where this CPU or torch packs
    nothing."""
    from backends.quant_linear import prepack_bf16_weight, quantized_linear
    rows = []
    device = torch.device("cpu")
    for m, k, n in shapes:
        g = torch.Generator().manual_seed(4)
        x = torch.randn(m, k, generator=g).bfloat16()
        w = (torch.randn(n, k, generator=g) / math.sqrt(k)).bfloat16()
        b = torch.randn(n, generator=g).bfloat16()
        packed = prepack_bf16_weight(w)
        if packed is None:
            return ["no packed copy here (needs a CPU with AVX-512 BF16 or AMX and torch's oneDNN ops)"]
        fns = {"plain": lambda: quantized_linear(x, w, None, b),
               "packed": lambda: quantized_linear(x, w, None, b, packed=packed)}
        diff = (fns["plain"]().float() - fns["packed"]().float()).abs().max().item()
        t = timeit_interleaved(fns, device, repeat)
        rows.append(f"[{m:>5} x {k:>4}] x [{k:>4} x {n:>4}] | F.linear {t['plain'][0]:7.2f} ms | packed "
                    f"{t['packed'][0]:7.2f} ms | ratio {t['plain'][0] / t['packed'][0]:5.2f} | max difference {diff:.3g}")
    return rows


def bench_norms(rows: int, width: int, repeat: int) -> list[str]:
    """``LayerNorm32`` of bf16 tokens [rows, width]: the composed op against ``backends.float32_layer_norm``."""
    import backends
    from backends.norm.native import compose_float32_layer_norm, native_layer_norm
    backends.device.keep_freed_host_memory()  # the kept-loaded pipeline's setting, where the decoders run bf16
    x = (torch.randn(rows, width, generator=torch.Generator().manual_seed(2)) * 3).bfloat16()
    composed = compose_float32_layer_norm(native_layer_norm)
    fns = {"composed": lambda: composed(x, (width,), None, None, 1e-6),
           "one call": lambda: backends.float32_layer_norm(x, width, None, None, 1e-6)}
    a, b = (fn() for fn in fns.values())
    differ = float((a != b).float().mean())
    worst = float((a.float() - b.float()).abs().max())  # the outputs are normalised: about unit scale
    t = timeit_interleaved(fns, torch.device("cpu"), repeat)
    return [f"[{rows} x {width}] bf16 | composed {t['composed'][0]:7.2f} ms | one call {t['one call'][0]:7.2f} ms | "
            f"ratio {t['composed'][0] / t['one call'][0]:5.2f} | outputs apart {100 * differ:.3f} %, largest "
            f"difference {worst:.3g} (bf16's unit in the last place at 1: {torch.finfo(torch.bfloat16).eps:.3g})"]


def bench_scatter(voxels: int, repeat: int) -> list[str]:
    """The streamed corner sums and the corner-code unique of the mesh extraction, torch's ops against ours."""
    import backends
    from sam3d_objects.model.backbone.tdfy_dit.representations.mesh.utils_cube import cube_corners, grid_code
    device = torch.device("cpu")
    coords = shell_coords(voxels, 256, thickness=3.0, exact=False)[:, 1:].long()
    size = int(coords.max()) + 2
    # the decoder emits children parent by parent: not the lexicographic order
    parent_major = grid_code(coords // 2, size) * 8 + ((coords % 2) * torch.tensor([4, 2, 1])).sum(1)
    coords = coords[torch.argsort(parent_major)]
    codes = (grid_code(coords, size)[:, None] + grid_code(cube_corners, size)[None]).reshape(-1)
    unique = {"torch.unique": lambda: torch.unique(codes, return_inverse=True),
              "unique_codes": lambda: backends.unique_codes(codes, size ** 3, return_inverse=True)}
    same = all(torch.equal(a, b) for a, b in zip(unique["torch.unique"](), unique["unique_codes"]()))
    t = timeit_interleaved(unique, device, repeat)
    rows = [f"{coords.shape[0]} voxels, {codes.numel()} corner codes | torch.unique {t['torch.unique'][0]:7.1f} ms | "
            f"unique_codes {t['unique_codes'][0]:7.1f} ms | ratio {t['torch.unique'][0] / t['unique_codes'][0]:5.2f} "
            f"| equal {same}"]
    values, cubes = unique["unique_codes"]()
    cubes = cubes.view(-1, 8).to(torch.int32)
    num_verts = values.numel()
    corner = torch.randn(cubes.numel(), 10, generator=torch.Generator().manual_seed(0))
    chunk = 65536
    scatter = {}

    def plain():
        out = torch.zeros(num_verts, 10)
        for start in range(0, cubes.shape[0], chunk):
            out.index_add_(0, cubes[start:start + chunk].reshape(-1), corner[start * 8:(start + chunk) * 8])
        return out

    def ranked():
        out = torch.zeros(num_verts, 10)
        for start in range(0, cubes.shape[0], chunk):
            scatter["sums"].add_(out, start, corner[start * 8:(start + chunk) * 8])
        return out

    # the passes at any thread count (the pipeline takes them from 4 threads)
    ranks = {"SlotScatter (ranks)": lambda: scatter.update(sums=backends.SlotScatter(cubes, num_verts, passes=True))}
    t_ranks = timeit_interleaved(ranks, device, repeat)
    sums = {"index_add_": plain, "passes": ranked}
    same = torch.equal(plain(), ranked())
    t = timeit_interleaved(sums, device, repeat)
    rows.append(f"corner sums into [{num_verts}, 10], {-(-cubes.shape[0] // chunk)} chunks | index_add_ "
                f"{t['index_add_'][0]:7.1f} ms | ranks {t_ranks['SlotScatter (ranks)'][0]:7.1f} ms + passes "
                f"{t['passes'][0]:7.1f} ms | ratio {t['index_add_'][0] / (t['passes'][0] + t_ranks['SlotScatter (ranks)'][0]):5.2f} "
                f"| equal {same}")
    return rows


def bench_conv(device: torch.device, dtype: torch.dtype, shapes, repeat: int) -> list[str]:
    rows = []
    for name, n, ch, res in shapes:
        coords, feats, weight = _conv_inputs(n, ch, res, device, dtype)
        nmap = neighbor_map(coords, 3)
        ours_name = resolve(Family.SPARSE_CONV, device, dtype).name
        t_map = timeit(lambda: sparse_conv3d(feats, coords.clone(), weight), device, max(repeat // 2, 2), 1)
        t_ours = timeit(lambda: sparse_conv3d(feats, coords, weight, neighbor_map=nmap), device, repeat)
        cells = [f"{name:<15}", f"{n:>8,}", f"{ch:>4}", f"{ours_name}: {t_ours:8.2f} ms (map built {t_map:8.2f})"]
        if device.type != "cuda" or resolve(Family.SPARSE_CONV, device, dtype).name != "torch":
            with use(sparse="torch"):
                t_torch = timeit(lambda: sparse_conv3d(feats, coords, weight, neighbor_map=nmap), device, repeat)
            cells.append(f"torch: {t_torch:8.2f} ms")
        one_thread = 1 if device.type == "cpu" else None
        with _threads(one_thread):
            runner = _spconv_runner(feats, coords, weight, res) if dtype != torch.bfloat16 else None
            if runner is not None:
                t_sp = timeit(runner, device, repeat)
                label = "spconv 1 thread" if device.type == "cpu" else "spconv"
                cells.append(f"{label}: {t_sp:8.2f} ms  ratio ours/spconv {t_ours / t_sp:5.2f}")
            else:
                cells.append("spconv: not installed")
        rows.append(" | ".join(cells))
    return rows


def _windows(num: int, max_len: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(max_len // 2, max_len + 1, (num,), generator=g)).tolist()


def _dense_mask_sdpa(q, k, v, cu):
    """Upstream's sdpa path: one block-diagonal additive mask over all tokens (quadratic memory), at any size."""
    same_window = block_diagonal_mask(cu, cu, q.shape[0], k.shape[0])
    mask = torch.where(same_window, 0.0, float("-inf")).to(q.dtype)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask[None, None])
    return out[0].transpose(0, 1)


def bench_attention(device: torch.device, dtype: torch.dtype, configs, repeat: int) -> list[str]:
    rows = []
    for label, num, max_len, with_dense in configs:
        lens = _windows(num, max_len)
        total = sum(lens)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=device)
        g = torch.Generator().manual_seed(2)
        q, k, v = (torch.randn(total, 12, 64, generator=g).to(device, dtype) for _ in range(3))
        cells = [f"{label:<22}", f"{total:>7,} tok"]
        results = {}
        for name in ("sdpa", "varlen", "flash_attn", "xformers", "metal"):
            try:
                with use(sparse_attn=name):
                    resolve(Family.SPARSE_ATTN, device, dtype)
                    results[name] = timeit(lambda: varlen_attention(q, k, v, cu, cu, max_len, max_len),
                                           device, repeat)
            except BackendUnavailableError:
                continue
        for name, t in results.items():
            cells.append(f"{name}: {t:8.2f} ms")
        if with_dense:
            t_dense = timeit(lambda: _dense_mask_sdpa(q, k, v, cu), device, max(repeat // 3, 2), 1)
            best = min(results.values())
            cells.append(f"dense block mask: {t_dense:8.2f} ms  speed-up {t_dense / best:5.1f}x")
        if "varlen" in results:
            cells.append(f"best/varlen {min(results.values()) / results['varlen']:4.2f}")
        rows.append(" | ".join(cells))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small shapes only (for `make demo`)")
    p.add_argument("--repeat", type=int, default=None)
    p.add_argument("--device", action="append", help="device(s) to run on (default: all present)")
    p.add_argument("--floor", action="store_true",
                   help="only the CPU sparse conv against its GEMM floor (interleaved repeats, default 15)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="with --floor: the inputs' dtype (bfloat16: the pipeline's --dtype bfloat16 path)")
    p.add_argument("--packed", action="store_true",
                   help="only the CPU bf16 linear layers by plain and by packed weights (interleaved, default 9)")
    p.add_argument("--norms", action="store_true",
                   help="only LayerNorm32 of the decoders' bf16 tokens on the CPU, composed against one call")
    p.add_argument("--scatter", action="store_true",
                   help="only the mesh extraction's scatter-sums and uniques on the CPU, torch's against ours")
    args = p.parse_args(argv)
    devices = [torch.device(d) for d in args.device] if args.device else available_devices()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.norms:
        print(f"\n== cpu: LayerNorm32 of bf16 tokens, {torch.get_num_threads()} threads, medians of "
              f"{args.repeat or 9} interleaved runs")
        for row in bench_norms(4096 if args.quick else 32_429, 768, args.repeat or 9):
            print(row)
        return 0
    if args.scatter:
        voxels = 60_000 if args.quick else 1_400_000
        print(f"\n== cpu: mesh extraction's sums and uniques, {torch.get_num_threads()} threads, medians of "
              f"{args.repeat or 3} interleaved runs")
        for row in bench_scatter(voxels, args.repeat or 3):
            print(row)
        return 0
    if args.packed:
        print(f"\n== cpu: bf16 linear layers, F.linear against the packed weight, {torch.get_num_threads()} threads, "
              f"medians of {args.repeat or 9} interleaved runs")
        for row in bench_packed_linear(PACKED_LINEAR_SHAPES[:1] if args.quick else PACKED_LINEAR_SHAPES,
                                       args.repeat or 9):
            print(row)
        return 0
    if args.floor:
        shapes = CPU_CONV_SHAPES[:1] if args.quick else CPU_CONV_SHAPES
        if args.dtype == "bfloat16" and not args.quick:
            shapes = shapes + CPU_WIDE_CONV_SHAPES
        print(f"\n== cpu: submanifold 3^3 conv (torch backend) vs its GEMM floor, {args.dtype}, "
              f"{torch.get_num_threads()} threads, medians of {args.repeat or 15} interleaved runs")
        for row in bench_conv_floor(torch.device("cpu"), getattr(torch, args.dtype), shapes, args.repeat or 15):
            print(row)
        return 0
    for device in devices:
        if device.type == "cpu":
            shapes = CPU_CONV_SHAPES[1:2] if args.quick else CPU_CONV_SHAPES
            repeat = args.repeat or (3 if args.quick else 5)
            print(f"\n== {device}: submanifold 3^3 conv, float32 (ours with {torch.get_num_threads()} threads)")
            for row in bench_conv(device, torch.float32, shapes, repeat):
                print(row)
            print(f"\n== {device}: the torch backend against its GEMM floor (same products as one torch.mm)")
            for row in bench_conv_floor(device, torch.float32, shapes, repeat):
                print(row)
            print(f"\n== {device}: windowed attention, 12 heads x 64, float32")
            configs = [("20 windows <=400", 20, 400, True)] if not args.quick else [("8 windows <=200", 8, 200, True)]
            for row in bench_attention(device, torch.float32, configs, repeat):
                print(row)
        else:
            repeat = args.repeat or 10
            for dtype in (torch.float16, torch.float32):
                print(f"\n== {device}: submanifold 3^3 conv, {dtype}")
                for row in bench_conv(device, dtype, CUDA_CONV_SHAPES, repeat):
                    print(row)
            print(f"\n== {device}: attention, 12 heads x 64, float16")
            configs = [("40 swin windows <=400", 40, 400, True), ("300 swin windows", 300, 400, False),
                       ("1 sequence", 1, 6908, True), ("4 sequences", 4, 8000, True)]
            for row in bench_attention(device, torch.float16, configs, repeat):
                print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
