"""Graph vs eager on the real pipeline (CUDA): runs the same seeded object three times - eager, eager again (the
run-to-run noise floor) and with stage-1 CUDA graphs - and prints the largest differences of every output tensor.

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
    return {k: v.detach().float().cpu() for k, v in out.items() if isinstance(v, torch.Tensor)}


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
    image, mask, pointmap = synthetic_scene()
    inference = Inference(args.config, compile=False, device="cuda")
    runs = {}
    for name, graphs in (("eager", False), ("eager2", False), ("graphs", True)):
        inference.pipeline.cuda_graphs = graphs
        runs[name] = _tensors(inference(image, mask, seed=42, pointmap=pointmap))
    print("eager vs eager :", _diff(runs["eager"], runs["eager2"]))
    print("eager vs graphs:", _diff(runs["eager"], runs["graphs"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
