"""Benchmark (not a test): the full-size mesh decoder of two or more source trees, interleaved, on the CPU.

    git archive d1e5b3e^ | (mkdir -p .ab/old && tar -x -C .ab/old)      # an earlier revision, as plain files
    python -m benchmarks.ab_mesh_decoder --tree old=.ab/old:child --tree new=.:blocked --rounds 2 --threads 16
    python -m benchmarks.ab_mesh_decoder --tree old=.ab/old --tree new=. --dtype bfloat16 --keep-freed-memory

Host speed drifts (noisy neighbours, clocks), so single runs in different hours do not compare: each round runs
every tree once, each in a fresh process, one after the other, and one large ``torch.mm`` is timed before and
after each run. Every tree decodes the same voxels (shell coords made here) with weights drawn the same way
(``bench_mesh_decoder.randomize_``); only ``sam3d_objects`` / ``backends`` come from the tree. ``CONVS`` picks the
subdivision convolutions where the tree has the switch (``child`` or ``blocked``; trees without it ignore it).
Prints one row per run (network and mesh-extraction seconds, matmul rate, peak RSS) and the mean ratios.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

from benchmarks.bench_mesh_decoder import matmul_gflops, randomize_, shell_voxels


def run_tree(tree: str, convs: str, coords_path: str, threads: int, channels: int, blocks: int,
             dtype: str = "float32", keep_freed_memory: bool = False) -> dict:
    """One decode in this process with the package of ``tree`` (benchmark helpers were imported from ours).
    ``dtype`` bfloat16: the torso as ``--dtype bfloat16`` leaves it (bf16 weights; norms, output layer and
    extraction in float32); ``keep_freed_memory``: the allocator setting of a pipeline whose models stay loaded."""
    sys.path.insert(0, os.path.abspath(tree))
    for name in [m for m in sys.modules if m.split(".")[0] in ("sam3d_objects", "backends")]:
        del sys.modules[name]
    from sam3d_objects.model.backbone.tdfy_dit.models.structured_latent_vae import decoder_mesh
    from sam3d_objects.model.backbone.tdfy_dit.modules.sparse import SparseTensor
    from sam3d_objects.model.backbone.tdfy_dit.modules.utils import set_torso_half_dtype, settle_torso_dtypes
    import backends

    if not decoder_mesh.__file__.startswith(os.path.abspath(tree)):
        raise RuntimeError(f"imported {decoder_mesh.__file__}, not the tree {tree}")
    torch.set_num_threads(threads)
    if hasattr(decoder_mesh.SparseSubdivideBlock3d, "blocked_convs"):
        decoder_mesh.SparseSubdivideBlock3d.blocked_convs = convs == "blocked"
    coords = torch.load(coords_path)
    feats = torch.randn(coords.shape[0], 8, generator=torch.Generator().manual_seed(0))
    model = decoder_mesh.SLatMeshDecoderTdfyWrapper(
        resolution=64, model_channels=channels, latent_channels=8, num_blocks=blocks, num_heads=channels // 64,
        mlp_ratio=4, attn_mode="swin", window_size=8, representation_config={"use_color": True},
        use_fp16=dtype == "bfloat16")
    settle_torso_dtypes(model, torch.device("cpu"))  # float32 on the CPU, as the loader leaves it
    randomize_(model, 0)
    if dtype == "bfloat16":
        set_torso_half_dtype(model, torch.bfloat16)
        settle_torso_dtypes(model, torch.device("cpu"))
    if keep_freed_memory:
        backends.device.keep_freed_host_memory()
    model.eval()
    extractor, spent = model.mesh_extractor, {"extract_s": 0.0}

    def timed(method):
        def call(*a, **k):
            t0 = time.perf_counter()
            result = method(*a, **k)
            spent["extract_s"] += time.perf_counter() - t0
            return result
        return call

    class TimedStream:  # the streamed extraction (the CPU default): its chunk sums and the final mesh, timed
        def __init__(self, stream):
            self.add, self.finish, self.num_voxels = timed(stream.add), timed(stream.finish), stream.num_voxels

    class TimedExtractor:  # the extraction's share of the call, whole (older trees) or streamed
        def __call__(self, x, training=False):
            return timed(extractor)(x, training=training)

        def stream(self, coords):
            return TimedStream(timed(extractor.stream)(coords))

        def __getattr__(self, name):
            return getattr(extractor, name)

    model.mesh_extractor = TimedExtractor()
    mm_before = matmul_gflops(threads)
    with torch.no_grad():
        t0 = time.perf_counter()
        meshes = model(SparseTensor(feats=feats, coords=coords))
        total = time.perf_counter() - t0
    return {"network_s": round(total - spent["extract_s"], 2), "extract_s": round(spent["extract_s"], 2),
            "faces": int(meshes[0].faces.shape[0]), "mm_before": round(mm_before, 1),
            "mm_after": round(matmul_gflops(threads), 1),
            "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 3)}


def parse_tree(spec: str):
    label, _, rest = spec.partition("=")
    path, _, convs = rest.partition(":")
    if not label or not path:
        raise argparse.ArgumentTypeError(f"--tree wants LABEL=PATH[:CONVS], got {spec!r}")
    return label, path, convs or "blocked"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", type=parse_tree, action="append", default=[], metavar="LABEL=PATH[:CONVS]")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--voxels", type=int, default=20000, help="approximate surface voxels at 64^3")
    p.add_argument("--channels", type=int, default=768)
    p.add_argument("--blocks", type=int, default=12)
    p.add_argument("--voxels-file", help="decode these voxels instead (torch.save'd int [N, 4] coords at 64^3, "
                                          "e.g. a pipeline run's structured latent)")
    p.add_argument("--coords", default="/tmp/ab_mesh_decoder_coords.pt", help="where the shared voxels go")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the torso's dtype (bfloat16: as --dtype bfloat16 runs the decoder)")
    p.add_argument("--keep-freed-memory", action="store_true",
                   help="the C allocator setting of a pipeline whose models stay loaded (glibc)")
    p.add_argument("--run", nargs=2, metavar=("PATH", "CONVS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.run:
        print(json.dumps(run_tree(args.run[0], args.run[1], args.coords, args.threads, args.channels,
                                  args.blocks, args.dtype, args.keep_freed_memory)), flush=True)
        return 0
    if len(args.tree) < 2:
        p.error("name at least two trees")
    coords = torch.load(args.voxels_file).int() if args.voxels_file else shell_voxels(args.voxels, 64, 0)
    torch.save(coords, args.coords)
    print(f"{coords.shape[0]} voxels, {args.channels} channels, {args.blocks} blocks, {args.dtype} torso, "
          f"keep freed memory {args.keep_freed_memory}, {args.threads} threads, "
          f"{os.cpu_count()} CPUs, THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}")
    print(f"{'round':>5} {'tree':10} {'network s':>10} {'extract s':>10} {'faces':>9} {'mm GFLOP/s':>15} "
          f"{'peak RSS GB':>12}", flush=True)
    results = {label: [] for label, _, _ in args.tree}
    for round_ in range(1, args.rounds + 1):
        for label, path, convs in args.tree:
            cmd = [sys.executable, "-m", "benchmarks.ab_mesh_decoder", "--run", path, convs, "--coords", args.coords,
                   "--threads", str(args.threads), "--channels", str(args.channels), "--blocks", str(args.blocks),
                   "--dtype", args.dtype] + (["--keep-freed-memory"] if args.keep_freed_memory else [])
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                print(done.stderr.strip()[-3000:], flush=True)
                return done.returncode
            r = json.loads(done.stdout.strip().splitlines()[-1])
            results[label].append(r)
            print(f"{round_:5d} {label:10} {r['network_s']:10.2f} {r['extract_s']:10.2f} {r['faces']:9d} "
                  f"{r['mm_before']:7.1f}/{r['mm_after']:<7.1f} {r['peak_rss_gb']:12.3f}", flush=True)
    base_label = args.tree[0][0]
    base = sum(r["network_s"] for r in results[base_label]) / args.rounds
    for label, runs in results.items():
        mean = sum(r["network_s"] for r in runs) / args.rounds
        whole = sum(r["network_s"] + r["extract_s"] for r in runs) / args.rounds
        print(f"{label}: network mean {mean:.2f} s ({base / mean:.2f}x vs {base_label}), network + extraction "
              f"{whole:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
