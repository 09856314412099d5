"""Benchmark the whole pipeline: wall time and peak memory per stage (low-memory mode on by default).

    python -m benchmarks.bench_pipeline --config ckpt_full/pipeline.yaml --device cpu \
        [--image image.png --mask 0.png] [--pointmap pm.npy] [--steps 25 25] [--json out.json]

Without an image a synthetic 480x640 scene (a sphere in front of a plane) with its exact point map is used, so no
depth model is needed. Peak resident memory (RSS) is sampled every 5 ms by a thread and reported per stage
(model loading happens inside the stage that first needs the model, as low-memory mode does); the device's peak
allocation comes from ``backends.device.peak_memory``. Random-weight checkpoints from
``make_random_checkpoint.py`` time the same work as the released ones (the voxel count after stage 1 varies with
the weights: it is printed).
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Dict, Optional

import numpy as np
import torch

import backends


class RssSampler:
    """Background thread tracking the peak RSS since the last ``reset``."""

    def __init__(self, interval: float = 0.005):
        self.interval, self.peak, self.window_peak, self._stop = interval, 0, 0, threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        while not self._stop.is_set():
            rss = backends.device.current_rss_bytes()
            self.peak, self.window_peak = max(self.peak, rss), max(self.window_peak, rss)
            time.sleep(self.interval)

    def reset(self) -> None:
        self.peak = backends.device.current_rss_bytes()

    def take_window(self) -> int:
        """Peak RSS since the last call (e.g. over one stage); starts the next window."""
        rss = backends.device.current_rss_bytes()
        peak, self.window_peak = max(self.window_peak, rss), rss
        return peak

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def synthetic_scene(height: int = 480, width: int = 640):
    """RGB uint8, bool mask and the exact point map (PyTorch3D frame: x left, y up, z forward) of a sphere of
    radius 0.5 at depth 2.5 in front of a plane at depth 4."""
    fy = fx = 0.9 * width
    v, u = np.meshgrid(np.arange(height) + 0.5, np.arange(width) + 0.5, indexing="ij")
    dirs = np.stack([(u - width / 2) / fx, (v - height / 2) / fy, np.ones_like(u)], -1)
    center, radius = np.array([0.0, 0.0, 2.5]), 0.5
    b = (dirs @ center)
    a = (dirs ** 2).sum(-1)
    disc = b ** 2 - a * ((center ** 2).sum() - radius ** 2)
    hit = disc > 0
    depth_sphere = np.where(hit, (b - np.sqrt(np.clip(disc, 0, None))) / a, np.inf)
    depth = np.where(hit, depth_sphere, 4.0)
    points = dirs * depth[..., None]
    points[..., :2] *= -1  # OpenCV -> PyTorch3D
    shade = np.clip(0.3 + 0.7 * (1 - (depth - 2.0) / 2.5), 0, 1)
    rgb = np.stack([shade, 0.5 * shade, 1 - shade], -1)
    rgb = np.where(hit[..., None], rgb, 0.8)
    return (rgb * 255).astype(np.uint8), hit, torch.from_numpy(points.astype(np.float32))


def run_benchmark(config: str, device: Optional[str], low_memory: bool, image=None, mask=None, pointmap=None,
                  seed: int = 42, steps=None) -> Dict:
    from sam3d_objects.inference import Inference
    if image is None:
        image, mask, pointmap = synthetic_scene()
    stats: Dict[str, Dict[str, float]] = {}
    with RssSampler() as sampler:
        t0 = time.perf_counter()
        sampler.reset()
        inference = Inference(config, compile=False, device=device, low_memory=low_memory)
        pipe = inference.pipeline
        stats["construct"] = {"seconds": time.perf_counter() - t0, "peak_rss_gib": sampler.peak / 2**30}
        if steps:
            # the pipeline's per-stage settings reach loaded generators at once and the others when they load
            pipe.ss_inference_steps, pipe.slat_inference_steps = steps

        def hook(stage, event):
            if event == "start":
                backends.device.synchronize(pipe.device)
                backends.device.reset_peak_memory(pipe.device)
                sampler.reset()
            else:
                stats.setdefault(stage, {})
                stats[stage]["peak_rss_gib"] = max(stats[stage].get("peak_rss_gib", 0), sampler.peak / 2**30)
                peak_dev = backends.device.peak_memory(pipe.device)
                if peak_dev:
                    stats[stage]["peak_device_gib"] = peak_dev / 2**30

        pipe.stage_hook = hook
        t1 = time.perf_counter()
        out = inference(image, mask, seed=seed, pointmap=pointmap)
        total = time.perf_counter() - t1
    for stage, seconds in pipe.stage_times.items():
        stats.setdefault(stage, {})["seconds"] = seconds
    return {"device": str(pipe.device), "low_memory": pipe.low_memory, "total_run_seconds": total,
            "voxels": int(out["coords"].shape[0]), "gaussians": int(out["gs"].get_xyz.shape[0]) if "gs" in out else 0,
            "mesh_vertices": int(len(out["glb"].vertices)) if "glb" in out else 0, "stages": stats}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="checkpoint folder's pipeline.yaml")
    p.add_argument("--device", default=None)
    p.add_argument("--no-low-memory", action="store_true")
    p.add_argument("--image"), p.add_argument("--mask"), p.add_argument("--pointmap", help=".npy [H, W, 3]")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--steps", type=int, nargs=2, metavar=("STAGE1", "STAGE2"))
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    image = mask = pointmap = None
    if args.image:
        from sam3d_objects.inference import load_image, load_mask
        image, mask = load_image(args.image), load_mask(args.mask)
        pointmap = torch.from_numpy(np.load(args.pointmap)) if args.pointmap else None
    result = run_benchmark(args.config, args.device, not args.no_low_memory, image, mask, pointmap, args.seed,
                           args.steps)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
