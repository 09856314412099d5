"""Benchmark (not a test): full-size mesh decoder on CPU, sparse vs dense-grid FlexiCubes extraction.

    python -m benchmarks.bench_mesh_decoder                      # both modes, one process each
    python -m benchmarks.bench_mesh_decoder --voxels 2000 --channels 256 --blocks 2   # quick run
    python -m benchmarks.bench_mesh_decoder --mode sparse --convs both --voxels 3000 --threads 2   # conv paths

``--tail``: the decoder end to end (network + extraction, as the pipeline calls it) with its last subdivision
block, output layer and mesh extraction streamed in row chunks (``stream``, the default at inference) or on whole
tensors (``whole``, the earlier path); ``both`` runs each in its own process (interleaved ``--repeat`` times)
and prints peak RSS, time and whether the meshes are identical:

    python -m benchmarks.bench_mesh_decoder --tail both --voxels 20000 --threads 2

``--convs``: ``blocked`` (default) convolves the subdivision blocks' child voxels on their parents; ``child`` is the
earlier child-level lean path; ``both`` runs each in its own process and prints a table with the decoder's
achieved GFLOP/s (its GEMMs, attention and convolutions) next to one large ``torch.mm`` measured in each process.

The decoder (random weights, model_channels 768, 12 blocks, 12 heads, swin window 8, fp32) runs on ~N surface
voxels at 64^3 (a union of sphere shells); its 101-channel output at 256^3 goes to the mesh extractor:
* ``sparse``: ours (`SparseFeatures2Mesh`: hash lookups on the cubes next to voxels only);
* ``dense``: upstream's layout, rebuilt here for comparison: (res+1)^3 vertex attributes and all res^3 cubes.
Each mode runs in its own process so that peak RSS (``ru_maxrss``) belongs to that mode alone.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time

import torch

from benchmarks.shapes import shell_coords


def shell_voxels(target: int, resolution: int, seed: int = 0) -> torch.Tensor:
    """int32 [N, 4] voxels (batch 0) of whole sphere shells (closed surfaces), about `target` of them."""
    return shell_coords(target, resolution, seed=seed, thickness=0.9, exact=False)


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Weights ~ N(0, 1/fan_in), biases ~ N(0, 0.01), norm weights ~ 1: every branch is live (no zero init)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                fan_in = p.numel() // p.shape[0]
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in))
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            else:
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.1)


def dense_extract(extractor, cubefeats):
    """Upstream-style extraction: dense (res+1)^3 attribute grid and all res^3 cubes."""
    from sam3d_objects.model.backbone.tdfy_dit.representations.mesh.cube2mesh import MeshExtractResult
    from sam3d_objects.model.backbone.tdfy_dit.representations.mesh.utils_cube import (construct_dense_grid,
                                                                                      get_defomed_verts)

    res = extractor.res
    coords = cubefeats.coords[:, 1:].long()
    verts, v_attrs = extractor._corner_attributes(coords, cubefeats.feats.float())
    grid_v, cube_fx8 = construct_dense_grid(res, coords.device)
    dense = torch.zeros((res + 1) ** 3, v_attrs.shape[1])
    dense[:, 0] = 1.0
    dense[(verts[:, 0] * (res + 1) + verts[:, 1]) * (res + 1) + verts[:, 2]] = v_attrs
    weights = torch.zeros(res ** 3, 21)
    weights[(coords[:, 0] * res + coords[:, 1]) * res + coords[:, 2]] = extractor.get_layout(cubefeats.feats, "weights")
    cube_ids = torch.arange(res ** 3)
    cube_coords = torch.stack([cube_ids // (res * res), cube_ids // res % res, cube_ids % res], 1)
    x_nx3 = get_defomed_verts(grid_v.float(), dense[:, 1:4], res)
    colors = torch.sigmoid(dense[:, 4:]) if extractor.use_color else None
    v, f, _, c = extractor.mesh_extractor(voxelgrid_vertices=x_nx3, scalar_field=dense[:, 0], cube_idx=cube_fx8,
                                          resolution=res, cube_coords=cube_coords, beta=weights[:, :12],
                                          alpha=weights[:, 12:20], gamma_f=weights[:, 20], voxelgrid_colors=colors)
    return MeshExtractResult(vertices=v, faces=f, vertex_attrs=c, res=res)


def fine_features(coords: torch.Tensor, seed: int):
    """Decoder-like input for the extractor alone: the voxels subdivided twice (4x resolution), random
    101-channel features with SDF values around 0."""
    from sam3d_objects.model.backbone.tdfy_dit.modules.sparse import SparseSubdivide, SparseTensor

    x = SparseTensor(feats=torch.zeros(coords.shape[0], 1), coords=coords)
    x = SparseSubdivide()(SparseSubdivide()(x))
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(x.coords.shape[0], 101, generator=g)
    feats[:, :8] = feats[:, :8] * 0.02
    return SparseTensor(feats=feats, coords=x.coords)


def run_extract_only(args) -> dict:
    import backends
    from sam3d_objects.model.backbone.tdfy_dit.representations.mesh import SparseFeatures2Mesh

    torch.set_num_threads(args.threads)
    cubefeats = fine_features(shell_voxels(args.voxels, args.resolution, args.seed), args.seed)
    extractor = SparseFeatures2Mesh(res=args.resolution * 4, use_color=True)
    rss_start = backends.device.current_rss_bytes()
    t0 = time.perf_counter()
    with torch.no_grad():
        mesh = extractor(cubefeats) if args.mode == "sparse" else dense_extract(extractor, cubefeats)
    return {"mode": args.mode, "extract_only": True, "fine_voxels": int(cubefeats.coords.shape[0]),
            "extract_s": round(time.perf_counter() - t0, 2), "mesh_vertices": int(mesh.vertices.shape[0]),
            "mesh_faces": int(mesh.faces.shape[0]), "rss_before_extract_gb": round(rss_start / 2 ** 30, 3),
            "peak_rss_gb": round(backends.device.peak_rss_bytes() / 2 ** 30, 3)}


def random_decoder(args):
    """The decoder at the benchmark's size with random weights (eval mode), its surface voxels and latent."""
    from sam3d_objects.model.backbone.tdfy_dit.models.structured_latent_vae.decoder_mesh import (
        SLatMeshDecoderTdfyWrapper)

    coords = shell_voxels(args.voxels, args.resolution, args.seed)
    feats = torch.randn(coords.shape[0], 8, generator=torch.Generator().manual_seed(args.seed))
    model = SLatMeshDecoderTdfyWrapper(resolution=args.resolution, model_channels=args.channels, latent_channels=8,
                                       num_blocks=args.blocks, num_heads=args.heads, mlp_ratio=4, attn_mode="swin",
                                       window_size=8, representation_config={"use_color": True}, use_fp16=False)
    randomize_(model, args.seed)
    model.eval()
    return coords, feats, model


def run_mode(args) -> dict:
    import backends
    from sam3d_objects.model.backbone.tdfy_dit.models.structured_latent_vae.decoder_mesh import SparseSubdivideBlock3d
    from sam3d_objects.model.backbone.tdfy_dit.modules.sparse import SparseTensor

    torch.set_num_threads(args.threads)
    SparseSubdivideBlock3d.blocked_convs = args.convs == "blocked"
    coords, feats, model = random_decoder(args)
    # this mode times the network and the extraction apart on the whole output (``--tail`` times the stream)
    model.stream_tail = False
    captured = {}
    model.out_layer.register_forward_hook(lambda m, i, o: captured.setdefault("feats", o))
    rss_start = backends.device.current_rss_bytes()
    with torch.no_grad():
        extractor = model.mesh_extractor
        model.mesh_extractor = lambda x, training=False: None  # network only first
        t0 = time.perf_counter()
        model(SparseTensor(feats=feats, coords=coords))
        t_net = time.perf_counter() - t0
        if args.network_only:
            peak = backends.device.peak_rss_bytes()
            gflop = decoder_flops(model, SparseTensor(feats=feats, coords=coords)) / 1e9
            return {"convs": args.convs, "voxels": int(coords.shape[0]),
                    "fine_voxels": int(captured["feats"].coords.shape[0]), "decoder_s": round(t_net, 2),
                    "gflop": gflop, "mm_gflops": matmul_gflops(args.threads),
                    "peak_rss_decoder_gb": round(peak / 2 ** 30, 3)}
        model.mesh_extractor = extractor
        rss_after_net = backends.device.current_rss_bytes()
        peak_after_net = backends.device.peak_rss_bytes()
        out = captured["feats"][0]
        t0 = time.perf_counter()
        mesh = extractor(out) if args.mode == "sparse" else dense_extract(extractor, out)
        t_extract = time.perf_counter() - t0
    return {"mode": args.mode, "voxels": int(coords.shape[0]), "fine_voxels": int(out.coords.shape[0]),
            "channels": args.channels, "blocks": args.blocks, "decoder_s": round(t_net, 2),
            "extract_s": round(t_extract, 2), "mesh_vertices": int(mesh.vertices.shape[0]),
            "mesh_faces": int(mesh.faces.shape[0]), "rss_start_gb": round(rss_start / 2 ** 30, 3),
            "rss_after_decoder_gb": round(rss_after_net / 2 ** 30, 3),
            "peak_rss_decoder_gb": round(peak_after_net / 2 ** 30, 3),
            "peak_rss_gb": round(backends.device.peak_rss_bytes() / 2 ** 30, 3)}


def matmul_gflops(threads: int, n: int = 2048, repeat: int = 3) -> float:
    """fp32 rate of one large square torch.mm (best of ``repeat``), the CPU's reference GEMM speed."""
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeat))
    return 2 * n ** 3 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def decoder_flops(model, x) -> float:
    """FLOPs of the decoder network's matmuls, attention and convolutions on input ``x`` (counted by
    torch.utils.flop_counter on the ops the forward runs; sparse convs by their neighbour pairs)."""
    from benchmarks.flops import flop_counter

    with flop_counter() as counter, torch.no_grad():
        model(x)
    return float(counter.get_total_flops())


def run_tail(args) -> dict:
    """The decoder end to end (``model(x)``) with the streamed or the whole-tensor tail; peak RSS of this process."""
    import backends
    from sam3d_objects.model.backbone.tdfy_dit.modules.sparse import SparseTensor

    torch.set_num_threads(args.threads)
    coords, feats, model = random_decoder(args)
    model.stream_tail = args.tail == "stream"
    rss_start = backends.device.current_rss_bytes()
    t0 = time.perf_counter()
    with torch.no_grad():
        mesh = model(SparseTensor(feats=feats, coords=coords))[0]
    seconds = time.perf_counter() - t0
    if args.save:
        torch.save({"vertices": mesh.vertices, "faces": mesh.faces, "colors": mesh.vertex_attrs}, args.save)
    return {"tail": args.tail, "voxels": int(coords.shape[0]), "fine_voxels": 64 * int(coords.shape[0]),
            "threads": args.threads, "decoder_s": round(seconds, 2), "mesh_vertices": int(mesh.vertices.shape[0]),
            "mesh_faces": int(mesh.faces.shape[0]), "rss_start_gb": round(rss_start / 2 ** 30, 3),
            "peak_rss_gb": round(backends.device.peak_rss_bytes() / 2 ** 30, 3)}


def compare_tails(args) -> int:
    """Streamed vs whole-tensor tail, each run in its own process, interleaved; one table, and whether the meshes
    of the two paths are identical."""
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeat):
            for tail in ("whole", "stream"):
                cmd = [sys.executable, "-m", "benchmarks.bench_mesh_decoder", "--tail", tail,
                       "--save", os.path.join(tmp, f"{tail}.pt")]
                for name in ("voxels", "resolution", "channels", "blocks", "heads", "threads", "seed"):
                    cmd += [f"--{name}", str(getattr(args, name))]
                load = os.getloadavg()[0]
                result = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
                if result.returncode:
                    print(result.stderr.strip()[-2000:], flush=True)
                    return result.returncode
                rows.append(dict(json.loads(result.stdout.strip().splitlines()[-1]), load=round(load, 1)))
                print(json.dumps(rows[-1]), flush=True)
        a, b = (torch.load(os.path.join(tmp, f"{t}.pt")) for t in ("whole", "stream"))
        same = all(torch.equal(a[k], b[k]) for k in a)
        close = same or (a["faces"].shape == b["faces"].shape and torch.equal(a["faces"], b["faces"]) and
                         float((a["vertices"] - b["vertices"]).abs().max()) <= 1e-5)
    print(f"{rows[0]['voxels']} voxels -> {rows[0]['fine_voxels']} fine, {args.channels} ch, {args.blocks} blocks, "
          f"threads {args.threads}, {rows[0]['mesh_faces']} faces")
    print(f"{'tail':8} {'decoder s':>10} {'peak RSS GiB':>13} {'load':>5}")
    for r in rows:
        print(f"{r['tail']:8} {r['decoder_s']:10.2f} {r['peak_rss_gb']:13.3f} {r['load']:5.1f}")
    print("meshes: " + ("bit-identical" if same else "same faces, vertices within 1e-5" if close else "DIFFERENT"),
          flush=True)
    return 0 if close else 1


def compare_convs(args) -> int:
    """Old (child-level) vs new (blocked) subdivision convs, each in its own process, as one table."""
    rows = []
    for convs in ("child", "blocked"):
        cmd = [sys.executable, "-m", "benchmarks.bench_mesh_decoder", "--mode", "sparse", "--convs", convs,
               "--network-only"]
        for name in ("voxels", "resolution", "channels", "blocks", "heads", "threads", "seed"):
            cmd += [f"--{name}", str(getattr(args, name))]
        result = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
        if result.returncode:
            print(result.stderr.strip()[-2000:], flush=True)
            return result.returncode
        rows.append(json.loads(result.stdout.strip().splitlines()[-1]))
    print(f"threads {args.threads}, {rows[0]['voxels']} voxels -> {rows[0]['fine_voxels']} fine, "
          f"{args.channels} ch, {args.blocks} blocks, load {os.getloadavg()[0]:.1f}, "
          f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}")
    print(f"{'convs':8} {'decoder s':>10} {'GFLOP':>8} {'GFLOP/s':>8} {'mm GFLOP/s':>11} {'peak RSS GB':>12}")
    for r in rows:
        print(f"{r['convs']:8} {r['decoder_s']:10.2f} {r['gflop']:8.1f} {r['gflop'] / r['decoder_s']:8.1f} "
              f"{r['mm_gflops']:11.1f} {r['peak_rss_decoder_gb']:12.3f}")
    print(f"speed-up {rows[0]['decoder_s'] / rows[1]['decoder_s']:.2f}x", flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["sparse", "dense", "both"], default="both")
    p.add_argument("--voxels", type=int, default=20000, help="approximate number of surface voxels at 64^3")
    p.add_argument("--resolution", type=int, default=64)
    p.add_argument("--channels", type=int, default=768)
    p.add_argument("--blocks", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--convs", choices=["blocked", "child", "both"], default="blocked",
                   help="subdivision-block convolutions on parents (blocked) or on children (child, the old path)")
    p.add_argument("--tail", choices=["stream", "whole", "both"],
                   help="decoder end to end with the streamed / whole-tensor last block + extraction (see above)")
    p.add_argument("--repeat", type=int, default=1, help="with --tail both: interleaved runs of each")
    p.add_argument("--save", help=argparse.SUPPRESS)
    p.add_argument("--network-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--extract-only", action="store_true",
                   help="skip the network: random features on the twice-subdivided voxels, extraction only")
    args = p.parse_args(argv)
    if args.tail == "both":
        return compare_tails(args)
    if args.tail:
        print(json.dumps(run_tail(args)), flush=True)
        return 0
    if args.convs == "both":
        return compare_convs(args)
    if args.mode != "both":
        print(json.dumps(run_extract_only(args) if args.extract_only else run_mode(args)), flush=True)
        return 0
    for mode in ("sparse", "dense"):
        cmd = [sys.executable, "-m", "benchmarks.bench_mesh_decoder", "--mode", mode]
        for name in ("voxels", "resolution", "channels", "blocks", "heads", "threads", "seed"):
            cmd += [f"--{name}", str(getattr(args, name))]
        cmd += ["--extract-only"] if args.extract_only else []
        cmd += ["--convs", args.convs]
        result = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
        print(result.stdout.strip() or result.stderr.strip()[-2000:], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
