"""Splat-renderer benchmark: one frame of N random gaussians at several resolutions, per device; prints a table.

    python benchmarks/bench_render.py                      # 1M gaussians, 512x512, CPU (+ CUDA/MPS if present)
    python benchmarks/bench_render.py --gaussians 100000 --resolution 256 512 --devices cpu --repeat 3

The scene is an object-sized cloud (like the pipeline's output after ``ready_gaussian_for_video_rendering``):
means uniform in a ball of radius 0.5, per-axis scales log-uniform in [1/512, 1/64], random rotations, opacities
uniform in [0.05, 1], seen from ``orbit_camera`` at distance 2 with a 40 degree field of view (render_video's view).
Reported: first frame (includes warm-up), then median / min / max of the following frames (different yaws).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sam3d_objects.render import covariance_from_scale_rotation, orbit_camera, render_gaussians  # noqa: E402


def random_object(n: int, seed: int = 0):
    """(means, covariances, colours, opacities) of an object-sized random cloud (float32, CPU)."""
    g = torch.Generator().manual_seed(seed)
    direction = torch.nn.functional.normalize(torch.randn(n, 3, generator=g), dim=-1)
    means = direction * 0.5 * torch.rand(n, 1, generator=g) ** (1 / 3)
    scales = torch.exp(torch.empty(n, 3).uniform_(torch.log(torch.tensor(1 / 512)).item(),
                                                  torch.log(torch.tensor(1 / 64)).item(), generator=g))
    quats = torch.randn(n, 4, generator=g)
    covs = covariance_from_scale_rotation(scales, quats)
    colors = torch.rand(n, 3, generator=g)
    opacities = 0.05 + 0.95 * torch.rand(n, generator=g)
    return means, covs, colors, opacities


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def time_frames(scene, device: torch.device, resolution: int, repeat: int) -> Dict[str, float]:
    """Seconds for the first frame and the following ``repeat`` frames (each at another yaw)."""
    means, covs, colors, opacities = (t.to(device) for t in scene)
    times: List[float] = []
    for i in range(repeat + 1):
        cam = orbit_camera(360.0 * i / (repeat + 1), 15.0, 2.0, 40.0, resolution)
        _sync(device)
        t0 = time.perf_counter()
        render_gaussians(means, covs, colors, opacities, cam, background=(0.0, 0.0, 0.0))
        _sync(device)
        times.append(time.perf_counter() - t0)
    warm = times[1:] or times
    return {"first": times[0], "median": statistics.median(warm), "min": min(warm), "max": max(warm)}


def available_devices() -> List[str]:
    found = ["cpu"]
    if torch.cuda.is_available():
        found.append("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        found.append("mps")
    return found


def render_table(gaussians: List[int], resolutions: List[int], devices: List[str], repeat: int) -> List[dict]:
    rows = []
    for n in gaussians:
        scene = random_object(n)
        for dev in devices:
            for res in resolutions:
                r = time_frames(scene, torch.device(dev), res, repeat)
                rows.append({"device": dev, "gaussians": n, "resolution": res, **r})
    return rows


def print_table(rows: List[dict]) -> None:
    print(f"{'device':6} {'gaussians':>10} {'res':>5} {'first s':>9} {'median s':>9} {'min s':>8} {'max s':>8}"
          f" {'300 frames s':>13}")
    for r in rows:
        print(f"{r['device']:6} {r['gaussians']:>10,} {r['resolution']:>5} {r['first']:9.3f} {r['median']:9.3f}"
              f" {r['min']:8.3f} {r['max']:8.3f} {300 * r['median']:13.1f}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gaussians", type=int, nargs="+", default=[1_000_000])
    ap.add_argument("--resolution", type=int, nargs="+", default=[512])
    ap.add_argument("--devices", nargs="+", default=None, help="default: every available device")
    ap.add_argument("--repeat", type=int, default=3, help="timed frames after the first")
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, load average "
          f"{os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "")
    print_table(render_table(args.gaussians, args.resolution, args.devices or available_devices(), args.repeat))


if __name__ == "__main__":
    main()
