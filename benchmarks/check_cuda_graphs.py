"""Graph vs eager on the real pipeline (CUDA): runs the same seeded object eagerly twice (the run-to-run noise
floor), with CUDA graphs twice (captured, then stage 1's kept graphs replayed), and eagerly with stage 1's Linear
weights kept in float32 (``half_weights`` off), and prints the largest differences of every output tensor
(stage-1 latents, Gaussians, mesh vertices).

    python benchmarks/check_cuda_graphs.py --config ckpt_full/pipeline.yaml
"""
import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def _tensors(out: dict) -> dict:
    """Stage-1 tensors of the output and the stage-2 results (Gaussians, mesh)."""
    found = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
    gs = out.get("gs")
    if gs is not None:
        found.update(gs_xyz=gs.get_xyz, gs_features=gs.get_features, gs_opacity=gs.get_opacity)
    mesh = (out.get("mesh") or [None])[0]
    if mesh is not None:
        found.update(mesh_vertices=mesh.vertices)
    return {k: torch.as_tensor(v).detach().float().cpu() for k, v in found.items()}


def _diff(a: dict, b: dict) -> dict:
    return {k: (a[k] - b[k]).abs().max().item() if a[k].shape == b[k].shape else f"shape {tuple(a[k].shape)} vs "
            f"{tuple(b[k].shape)}" for k in a if k in b}


def main() -> int:
    from bench_pipeline import synthetic_scene
    from sam3d_objects.inference import Inference
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from sam3d_objects.pipeline.inference_pipeline import InferencePipeline
    image, mask, pointmap = synthetic_scene()
    runs = {}
    for half_weights in (True, False):
        InferencePipeline.half_weights = half_weights  # read when the stage-1 generator loads
        inference = Inference(args.config, compile=False, device="cuda")
        modes = (("eager", False), ("eager2", False), ("graphs", True), ("graphs2", True)) if half_weights else \
            (("fp32 weights", False),)
        for name, graphs in modes:
            inference.pipeline.cuda_graphs = graphs
            runs[name] = _tensors(inference(image, mask, seed=42, pointmap=pointmap))
        del inference
        torch.cuda.empty_cache()
    InferencePipeline.half_weights = True
    print("eager vs eager        :", _diff(runs["eager"], runs["eager2"]))
    print("eager vs graphs       :", _diff(runs["eager"], runs["graphs"]))
    print("eager vs kept graphs  :", _diff(runs["eager"], runs["graphs2"]))
    print("fp16 vs fp32 weights  :", _diff(runs["eager"], runs["fp32 weights"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
