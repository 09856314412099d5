"""CPU thread scaling of the two flow backbones at full width, without the 13 GB checkpoint: each sampling
backbone is built from its yaml with fewer transformer blocks (random weights), one forward pass timed per
thread count, and the full-depth (24-block) pass extrapolated from two depths. Also times the conditional and
unconditional passes separately against one batched call of both (the guidance layout question on a CPU).

    python benchmarks/bench_blocks.py --configs ckpt_full --threads 2 4 8 16 --json blocks.json
    python benchmarks/bench_blocks.py --threads 16 --blocks 1 2 --dtypes float32 bfloat16 --ops

``--dtypes float32 bfloat16`` measures every pass in both: float32, and under CPU bfloat16 autocast (what
``--weights bf16`` samples in; matmuls and attention in bfloat16, norms and softmax statistics in float32), in the
same process one after the other. ``--ops`` adds the two op families the passes are made of, at the full-size
shapes, in each dtype: attention (``F.scaled_dot_product_attention``, 16 heads of 64, self 4096 x 4096 and cross
4096 x 7528) and one linear layer (4096 x 1024 -> 4096).

Each thread count runs in its own process (``OMP_NUM_THREADS`` and ``torch.set_num_threads``), so thread pools
never carry over. Columns: seconds of one forward pass with ``--blocks`` transformer blocks, and the 24-block pass
extrapolated linearly to the yaml's depth (intercept = the non-transformer layers: stage 2's sparse-conv io blocks, embeddings).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

STAGE1_COND_TOKENS, STAGE2_COND_TOKENS = 7528, 5496  # upstream's condition token counts (UPSTREAM.md)
FULL_DEPTH = 24
BACKBONE_NODE = "module.generator.backbone.reverse_fn.backbone"


def default_configs() -> Path:
    return ROOT.parent / "shared" / "upstream_configs"


def backbone_node(yaml: Path):
    from omegaconf import OmegaConf

    from sam3d_objects.config.instantiate import load_config
    node = OmegaConf.select(load_config(yaml), BACKBONE_NODE)
    if node is None:
        raise SystemExit(f"bench_blocks: {yaml} has no {BACKBONE_NODE}")
    return node


def build_backbone(yaml: Path, blocks: int, weights: str = "default") -> torch.nn.Module:
    """The generator's flow backbone from ``yaml`` with ``blocks`` transformer blocks (random weights), its
    linear layers stored in ``weights`` format as the pipeline's ``weights=`` loads them."""
    from sam3d_objects.config.instantiate import safe_instantiate
    from sam3d_objects.pipeline.weights import convert_linear_weights
    node = backbone_node(yaml)
    node.num_blocks = blocks
    torch.manual_seed(0)
    model = safe_instantiate(node).eval()
    convert_linear_weights(model, weights)
    return model


def shell_coords(voxels: int, resolution: int = 64) -> torch.Tensor:
    """About ``voxels`` voxels [N, 4] (b, x, y, z) on a spherical shell in a resolution^3 grid: the surface-like
    occupancy that stage 2 samples on."""
    grid = torch.stack(torch.meshgrid(*[torch.arange(resolution)] * 3, indexing="ij"), -1).reshape(-1, 3)
    radius = ((grid.float() - (resolution - 1) / 2) ** 2).sum(-1).sqrt()
    order = (radius - resolution * 0.4).abs().argsort()[:voxels]
    picked = grid[order.sort().values]
    return torch.cat([torch.zeros(len(picked), 1, dtype=picked.dtype), picked], 1).int()


def best_of(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up: oneDNN primitives, neighbour maps, allocator
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def in_dtype(dtype: str):
    """The context a pass runs in for ``dtype``: nothing for float32, CPU autocast for bfloat16."""
    return torch.autocast("cpu", dtype=DTYPES[dtype], enabled=dtype != "float32")


def op_times(repeat: int, dtypes: List[str]) -> Dict[str, Dict[str, float]]:
    """{op: {dtype: s}}: the attention and linear shapes of a full-size stage-1 block, each dtype in turn."""
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 16, 4096, 64, generator=g)
    kv = torch.randn(1, 16, STAGE1_COND_TOKENS, 64, generator=g)
    x, w = torch.randn(4096, 1024, generator=g), torch.randn(4096, 1024, generator=g)
    out: Dict[str, Dict[str, float]] = {"self-attention 4096^2": {}, "cross-attention 4096x7528": {},
                                        "linear 4096x1024->4096": {}}
    for dtype in dtypes:
        cast = DTYPES[dtype]
        qd, kvd, xd, wd = q.to(cast), kv.to(cast), x.to(cast), w.to(cast)
        out["self-attention 4096^2"][dtype] = best_of(lambda: F.scaled_dot_product_attention(qd, qd, qd), repeat)
        out["cross-attention 4096x7528"][dtype] = best_of(lambda: F.scaled_dot_product_attention(qd, kvd, kvd),
                                                          repeat)
        out["linear 4096x1024->4096"][dtype] = best_of(lambda: F.linear(xd, wd), repeat)
    return out


def stage1_calls(yaml: Path, blocks: int, weights: str = "default") -> Dict[str, Callable[[], object]]:
    """One pass of the stage-1 backbone (``blocks`` blocks, random weights) each way the sampler calls it:
    "cond", "uncond" (one zeroed condition token) and "batched" (both branches as one batch of 2, the
    unconditional one on every token zeroed, as upstream)."""
    return stage1_model_calls(build_backbone(yaml, blocks, weights))


def stage1_model_calls(model: torch.nn.Module) -> Dict[str, Callable[[], object]]:
    """``stage1_calls`` of a backbone already built (e.g. with its weights packed)."""
    g = torch.Generator().manual_seed(1)
    x = {k: torch.randn(1, lm.token_len, lm.in_channels, generator=g) for k, lm in model.latent_mapping.items()}
    cond = torch.randn(1, STAGE1_COND_TOKENS, model.cond_channels, generator=g)
    t, d = torch.tensor([300.0]), torch.tensor([0.0])
    xb = {k: v.expand(2, *v.shape[1:]).contiguous() for k, v in x.items()}
    cb = torch.cat([cond, cond * 0])
    plain = type(model).__mro__[1].forward  # the backbone without the wrapper's cfg handling
    return {"cond": lambda: model(x, t, cond, d=d), "uncond": lambda: model(x, t, cond, d=d, cfg=True),
            "batched": lambda: plain(model, xb, t, cb, d=d)}


def stage2_calls(yaml: Path, blocks: int, voxels: int, weights: str = "default") -> Dict[str, Callable[[], object]]:
    """One conditional / unconditional pass of the stage-2 backbone on about ``voxels`` shell voxels."""
    return stage2_model_calls(build_backbone(yaml, blocks, weights), voxels)


def stage2_model_calls(model: torch.nn.Module, voxels: int) -> Dict[str, Callable[[], object]]:
    """``stage2_calls`` of a backbone already built."""
    coords = shell_coords(voxels, model.resolution).numpy()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, coords.shape[0], model.in_channels, generator=g)
    cond = torch.randn(1, STAGE2_COND_TOKENS, model.cond_channels, generator=g)
    t = torch.tensor([300.0])
    return {"cond": lambda: model(x, t, cond, coords), "uncond": lambda: model(x, t, cond, coords, cfg=True)}


def stage1_passes(yaml: Path, blocks: int, repeat: int, batched: bool) -> Dict[str, float]:
    calls = stage1_calls(yaml, blocks)
    names = ("cond", "uncond", "batched") if batched else ("cond", "uncond")
    return {name: best_of(calls[name], repeat) for name in names}


def stage2_passes(yaml: Path, blocks: int, repeat: int, voxels: int) -> Dict[str, float]:
    return {name: best_of(fn, repeat) for name, fn in stage2_calls(yaml, blocks, voxels).items()}


def extrapolate(times: Dict[int, float], depth: int = FULL_DEPTH) -> Optional[float]:
    """Linear in the block count through the two depths measured (None with one depth)."""
    if len(times) < 2:
        return None
    (b1, t1), (b2, t2) = sorted(times.items())[:2]
    return t1 + (t2 - t1) / (b2 - b1) * (depth - b1)


def measure(configs: Path, blocks: List[int], repeat: int, voxels: int, batched: bool,
            dtype: str = "float32") -> Dict[str, dict]:
    """{stage: {pass: {"blocks": {n: s}, "full_depth_s": s}}} in this process (its thread count), in ``dtype``
    (see :func:`in_dtype`); full depth = the yaml's ``num_blocks``."""
    result: Dict[str, dict] = {}
    with torch.inference_mode(), in_dtype(dtype):
        for stage, run in (("stage1", lambda b: stage1_passes(configs / "ss_generator.yaml", b, repeat, batched)),
                           ("stage2", lambda b: stage2_passes(configs / "slat_generator.yaml", b, repeat, voxels))):
            per_depth = {b: run(b) for b in blocks}
            passes = sorted({p for times in per_depth.values() for p in times})
            result[stage] = {p: {"blocks": {b: per_depth[b][p] for b in blocks if p in per_depth[b]}} for p in passes}
            yaml = configs / ("ss_generator.yaml" if stage == "stage1" else "slat_generator.yaml")
            for entry in result[stage].values():
                entry["full_depth_s"] = extrapolate(entry["blocks"], int(backbone_node(yaml).num_blocks))
    return result


def sampling_estimate(point: Dict[str, dict], steps=(25, 25), guided=(19, 13)) -> Optional[float]:
    """Seconds of both sampling stages at full depth: every step one conditional pass, the guided steps (inside
    the cfg interval; 19 and 13 of 25 with the release's settings) one unconditional pass more."""
    try:
        return sum(n * point[s]["cond"]["full_depth_s"] + g * point[s]["uncond"]["full_depth_s"]
                   for s, n, g in zip(("stage1", "stage2"), steps, guided))
    except (KeyError, TypeError):
        return None


def run_point(threads: int, configs: Path, blocks: List[int], repeat: int, voxels: int, batched: bool,
              dtypes: List[str] = ("float32",), ops: bool = False) -> dict:
    """One thread count in a fresh process: {dtype: measure(...)}, plus {"ops": op_times(...)} with ``ops``."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--configs", str(configs), "--one", str(threads),
           "--repeat", str(repeat), "--voxels", str(voxels), "--blocks", *map(str, blocks), "--dtypes", *dtypes]
    if batched:
        cmd.append("--batched")
    if ops:
        cmd.append("--ops")
    done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(done.stdout.strip().splitlines()[-1])


def scaling(configs: Path, threads: List[int], blocks: List[int], repeat: int = 1, voxels: int = 20000,
            batched_at: Optional[int] = None, progress: Callable[[str], None] = print,
            dtypes: List[str] = ("float32",), ops: bool = False) -> dict:
    """{"points": {threads: measure(...)}, "config": ...} for the first dtype (the table's), every dtype under
    "dtypes": {dtype: {threads: measure(...)}}; the batched A/B at ``batched_at`` threads only."""
    by_dtype: Dict[str, dict] = {d: {} for d in dtypes}
    op_points = {}
    for n in threads:
        progress(f"blocks: {n} threads")
        point = run_point(n, configs, blocks, repeat, voxels, batched=n == batched_at, dtypes=dtypes, ops=ops)
        for d in dtypes:
            by_dtype[d][n] = point[d]
        if "ops" in point:
            op_points[n] = point["ops"]
    return {"points": by_dtype[dtypes[0]], "dtypes": by_dtype, "ops": op_points,
            "config": {"blocks": blocks, "repeat": repeat, "voxels": voxels, "dtypes": list(dtypes),
                       "cond_tokens": [STAGE1_COND_TOKENS, STAGE2_COND_TOKENS]}}


def markdown(report: dict) -> str:
    """Every dtype's scaling table, then the op times."""
    parts = []
    for dtype, points in report.get("dtypes", {"float32": report["points"]}).items():
        parts += [f"**{dtype}**", "", scaling_table(points), ""]
    for n, ops in report.get("ops", {}).items():
        dtypes = list(next(iter(ops.values())))
        parts += [f"Ops at {n} threads (s): " + "; ".join(
            f"{op} " + ", ".join(f"{d} {ops[op][d]:.3f}" for d in dtypes) +
            (f" ({ops[op][dtypes[0]] / ops[op][dtypes[-1]]:.2f}x)" if len(dtypes) > 1 else "") for op in ops), ""]
    return "\n".join(parts).rstrip()


def scaling_table(points: dict) -> str:
    base_n = min(points, key=int)
    lines = ["| threads | stage-1 cond s | stage-1 uncond s | stage-2 cond s | stage-2 uncond s | 25+25 sampling s "
             "(est.) | speed-up vs " + f"{base_n} | efficiency |", "|---|---|---|---|---|---|---|---|"]
    base = sampling_estimate(points[base_n])
    for n, point in sorted(points.items(), key=lambda kv: int(kv[0])):
        cells = [f"{point[s][p]['full_depth_s']:.2f}" if point.get(s, {}).get(p, {}).get("full_depth_s") else "-"
                 for s in ("stage1", "stage2") for p in ("cond", "uncond")]
        est = sampling_estimate(point)
        speedup = base / est if est and base else None
        eff = speedup * int(base_n) / int(n) if speedup else None
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {est:.0f} | {speedup:.2f}x | {100 * eff:.0f}% |"
                     if est else f"| {n} | " + " | ".join(cells) + " | - | - | - |")
    for n, point in points.items():
        stage1 = point.get("stage1", {})
        if "batched" in stage1:
            seq = {b: stage1["cond"]["blocks"][b] + stage1["uncond"]["blocks"][b] for b in stage1["batched"]["blocks"]}
            lines.append("")
            lines.append(f"Guidance layout at {n} threads (stage 1, {', '.join(map(str, seq))} blocks): conditional + "
                         f"unconditional passes {', '.join(f'{v:.2f}' for v in seq.values())} s against one batched "
                         f"call {', '.join(f'{v:.2f}' for v in stage1['batched']['blocks'].values())} s.")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", type=Path, default=None, help="folder with ss_generator.yaml and "
                    "slat_generator.yaml (a checkpoint folder; default ../shared/upstream_configs)")
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--blocks", type=int, nargs="+", default=[2, 4], help="two depths to extrapolate from")
    ap.add_argument("--repeat", type=int, default=1, help="timed passes per measurement (best of)")
    ap.add_argument("--voxels", type=int, default=20000, help="stage-2 voxel count")
    ap.add_argument("--batched", action="store_true", help="with --one: also the batched cond+uncond call")
    ap.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["float32"],
                    help="float32 and/or bfloat16 (CPU autocast), measured side by side in each process")
    ap.add_argument("--ops", action="store_true", help="also time the attention and linear ops in each dtype")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # child: one thread count
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    configs = args.configs or default_configs()
    if args.one is not None:
        torch.set_num_threads(args.one)
        point = {d: measure(configs, args.blocks, args.repeat, args.voxels, args.batched, d) for d in args.dtypes}
        if args.ops:
            point["ops"] = op_times(args.repeat, args.dtypes)
        print(json.dumps(point))
        return 0
    report = scaling(configs, args.threads, args.blocks, args.repeat, args.voxels, batched_at=max(args.threads),
                     dtypes=args.dtypes, ops=args.ops)
    text = markdown(report)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
