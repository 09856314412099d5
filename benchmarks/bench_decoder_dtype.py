"""Benchmark (not a test): the structured-latent decoders at full width on the CPU, float32 against bfloat16.

    python -m benchmarks.bench_decoder_dtype --decoder mesh --voxels 20000 --threads 2 --json out/mesh.json
    python -m benchmarks.bench_decoder_dtype --decoder gs --voxels 20000 --threads 16 --modes float32 bfloat16
    python -m benchmarks.bench_decoder_dtype --decoder mesh --voxels 3000 --blocks 2   # quick run

The decoder (upstream's yaml: 768 channels, 12 swin blocks of 12 heads, window 8, ``use_fp16``; random weights
~ N(0, 1/fan_in), every branch live) runs on about ``--voxels`` surface voxels at 64^3 (sphere shells), once per
mode, the modes interleaved ``--repeat`` times in one process (same weights, same input):

* ``float32``: the CPU default (the torso's fp16 weights cast up once, as the loader does);
* ``bfloat16``: what ``--dtype bfloat16`` does on the CPU: the torso's weights stored in bfloat16
  (`set_torso_half_dtype`), norms and the output layer in float32, the mesh extraction in float32;
* ``autocast``: the float32 model under CPU bfloat16 autocast (the alternative, for comparison).

Quality, each half mode against the float32 run (the reference): mesh: vertex and face counts and the symmetric
Chamfer distance between the vertex sets (mean nearest-neighbour distance both ways, scipy's cKDTree, in units of
the 256^3 extraction cell and relative to the vertex bounding box's diagonal); Gaussians: the mean absolute
error of each parameter (positions relative to the bounding box's diagonal, the others raw), next to the float32
values' mean absolute deviation. Timings: the whole decoder call (network and extraction) and its transformer
blocks alone (until the last block's output; the mesh decoder's subdivision blocks, output layer and extraction
follow), the growth of the RSS during each call (sampled peak minus the RSS before it: the decoder's working
memory), and the torso's compute dtype seen by its first linear layer (what actually ran). The machine's load
average is printed with the results: numbers from a shared machine are indicative only. ``--json`` writes
everything.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import time
from pathlib import Path

import torch

from benchmarks.bench_mesh_decoder import randomize_, shell_voxels
from benchmarks.bench_pipeline import RssSampler

MODES = ("float32", "bfloat16", "autocast")
GS_CONFIG = {  # upstream's slat_decoder_gs.yaml representation_config
    "lr": {"_xyz": 1.0, "_features_dc": 1.0, "_opacity": 1.0, "_scaling": 1.0, "_rotation": 0.1},
    "perturb_offset": True, "voxel_size": 1.5, "num_gaussians": 32, "2d_filter_kernel_size": 0.1,
    "3d_filter_kernel_size": 0.0009, "scaling_bias": 0.004, "opacity_bias": 0.1, "scaling_activation": "softplus"}
GS_PARAMS = ("_xyz", "_features_dc", "_scaling", "_rotation", "_opacity")


def build_decoder(kind: str, args) -> torch.nn.Module:
    """The float32 CPU decoder with random weights (built with ``use_fp16`` as upstream's yaml, settled on the
    CPU, so the torso holds float32 as the loader leaves it)."""
    from sam3d_objects.model.backbone.tdfy_dit.models.structured_latent_vae.decoder_gs import SLatGaussianDecoder
    from sam3d_objects.model.backbone.tdfy_dit.models.structured_latent_vae.decoder_mesh import SLatMeshDecoder
    from sam3d_objects.model.backbone.tdfy_dit.modules.utils import settle_torso_dtypes
    common = dict(resolution=args.resolution, model_channels=args.channels, latent_channels=8,
                  num_blocks=args.blocks, num_heads=args.heads, mlp_ratio=4, attn_mode="swin", window_size=8,
                  use_fp16=True)
    if kind == "mesh":
        model = SLatMeshDecoder(representation_config={"use_color": True}, **common)
    else:
        model = SLatGaussianDecoder(representation_config=dict(GS_CONFIG), **common)
    settle_torso_dtypes(model, torch.device("cpu"))
    randomize_(model, args.seed)
    return model.eval()


def half_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder as ``--dtype bfloat16`` leaves it: torso weights in bfloat16, the rest float32."""
    from sam3d_objects.model.backbone.tdfy_dit.modules.utils import set_torso_half_dtype, settle_torso_dtypes
    half = copy.deepcopy(model)
    set_torso_half_dtype(half, torch.bfloat16)
    settle_torso_dtypes(half, torch.device("cpu"))
    return half


def torso_dtype_seen(model: torch.nn.Module):
    """A hook recording the output dtype of the torso's first linear layer; returns (record, handle)."""
    seen = {}
    first = next(m for m in model.blocks.modules() if isinstance(m, torch.nn.Linear))
    def record(module, inputs, output) -> None:  # a hook returning a value would replace the output
        seen.setdefault("dtype", str(output.dtype).replace("torch.", ""))
    return seen, first.register_forward_hook(record)


def run_once(model, x, mode: str):
    """(output, seconds of the whole call, seconds until the last transformer block ended, torso dtype). The
    rest is the mesh decoder's subdivision blocks and extraction (streamed together in chunks on the CPU) or the
    Gaussian decoder's output layer and representation."""
    seen, handle = torso_dtype_seen(model)
    marks = []
    out_hook = model.blocks[-1].register_forward_hook(lambda m, i, o: marks.append(time.perf_counter()) and None)
    t0 = time.perf_counter()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
        out = model(x)[0]
    seconds = time.perf_counter() - t0
    handle.remove()
    out_hook.remove()
    return out, seconds, (marks[-1] - t0 if marks else seconds), seen.get("dtype")


def chamfer(a: torch.Tensor, b: torch.Tensor, sample: int = 200_000, seed: int = 0) -> float:
    """Symmetric mean nearest-neighbour distance between point sets ``a`` and ``b`` (up to ``sample`` query
    points each way, against all points of the other set)."""
    from scipy.spatial import cKDTree
    g = torch.Generator().manual_seed(seed)

    def one_way(p: torch.Tensor, q: torch.Tensor) -> float:
        if p.shape[0] > sample:
            p = p[torch.randperm(p.shape[0], generator=g)[:sample]]
        dist, _ = cKDTree(q.double().numpy()).query(p.double().numpy(), k=1)
        return float(dist.mean())
    return 0.5 * (one_way(a, b) + one_way(b, a))


def mesh_quality(ref, out, resolution: int) -> dict:
    va, vb = ref.vertices.detach().float().cpu(), out.vertices.detach().float().cpu()
    result = {"vertices": int(vb.shape[0]), "faces": int(out.faces.shape[0])}
    if va.shape[0] and vb.shape[0]:
        diag = float((va.max(0).values - va.min(0).values).norm())
        c = chamfer(va, vb)
        cell = 1.0 / (resolution * 4)  # the extraction grid's cell (positions span [-0.5, 0.5])
        result.update(chamfer=c, chamfer_cells=c / cell, chamfer_rel_bbox=c / diag)
    return result


def gaussian_quality(ref, out) -> dict:
    xyz = ref._xyz.float()
    diag = float((xyz.max(0).values - xyz.min(0).values).norm())
    result = {"gaussians": int(out._xyz.shape[0])}
    for name in GS_PARAMS:
        a, b = getattr(ref, name).float(), getattr(out, name).float()
        mae = float((a - b).abs().mean())
        result[f"{name}_mae"] = mae
        result[f"{name}_mad_f32"] = float((a - a.mean(0)).abs().mean())  # the float32 values' spread
        if name == "_xyz":
            result["_xyz_mae_rel_bbox"] = mae / diag
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decoder", choices=("mesh", "gs"), default="mesh")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--voxels", type=int, default=20_000)
    p.add_argument("--resolution", type=int, default=64)
    p.add_argument("--channels", type=int, default=768)
    p.add_argument("--blocks", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", 0)) or os.cpu_count())
    p.add_argument("--repeat", type=int, default=1, help="rounds of all modes (interleaved)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    import backends
    from sam3d_objects.model.backbone.tdfy_dit.modules.sparse import SparseTensor

    torch.set_num_threads(args.threads)
    coords = shell_voxels(args.voxels, args.resolution, args.seed)
    feats = torch.randn(coords.shape[0], 8, generator=torch.Generator().manual_seed(args.seed))
    x = SparseTensor(feats=feats, coords=coords)
    rss = RssSampler(interval=0.02).__enter__()
    base = build_decoder(args.decoder, args)
    models = {m: (half_copy(base) if m == "bfloat16" else base) for m in args.modes}
    load = [os.getloadavg()[0]]
    times = {m: [] for m in args.modes}
    network_times = {m: [] for m in args.modes}  # until the last transformer block's output
    outputs, seen = {}, {}
    if "float32" not in args.modes and "autocast" not in args.modes:
        del base  # a bfloat16-only run holds the bfloat16 copy alone (its peak RSS is that mode's)
    peaks = {m: [] for m in args.modes}  # RSS peak during each call (sampled), minus the RSS before it
    for r in range(args.repeat):
        order = args.modes if r % 2 == 0 else list(reversed(args.modes))  # ABC CBA: drift hits both
        for mode in order:
            gc.collect()
            backends.device.release_host_memory()
            rss.take_window()  # starts this call's window
            before = backends.device.current_rss_bytes()
            out, seconds, network, dtype = run_once(models[mode], x, mode)
            peaks[mode].append(round((rss.take_window() - before) / 2 ** 30, 3))
            times[mode].append(round(seconds, 2))
            network_times[mode].append(round(network, 2))
            outputs.setdefault(mode, out)
            seen[mode] = dtype
            print(f"{args.decoder} {mode:9} {seconds:8.2f} s (transformer {network:.2f} s)  torso {dtype}  "
                  f"RSS +{peaks[mode][-1]:.2f} GiB  load {os.getloadavg()[0]:.1f}", flush=True)
        load.append(os.getloadavg()[0])
    rows = {}
    for mode in args.modes:
        row = {"seconds": times[mode], "best_s": min(times[mode]), "transformer_s": network_times[mode],
               "call_rss_growth_gb": peaks[mode],
               "torso_dtype": seen[mode]}
        if "float32" in outputs:
            ref, out = outputs["float32"], outputs[mode]
            row.update(mesh_quality(ref, out, args.resolution) if args.decoder == "mesh"
                       else gaussian_quality(ref, out))
        rows[mode] = row
    result = {"decoder": args.decoder, "voxels": int(coords.shape[0]), "channels": args.channels,
              "blocks": args.blocks, "heads": args.heads, "threads": args.threads, "repeat": args.repeat,
              "load_avg_1min": [round(v, 2) for v in load], "cpu_bf16_fast": backends.device.bf16_fast("cpu"),
              "torch": torch.__version__, "peak_rss_gb": round(backends.device.peak_rss_bytes() / 2 ** 30, 3),
              "modes": rows}
    if "float32" in rows:
        for mode, row in rows.items():
            row["speedup_vs_float32"] = round(rows["float32"]["best_s"] / row["best_s"], 3)
    print(json.dumps(result, indent=1), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
