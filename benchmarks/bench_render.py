"""Splat-renderer benchmark: one frame of N random gaussians at several resolutions, per device; prints a table.
With ``--video``: the renderer as users call it, through ``render_video``, CPU render paths side by side.

    python benchmarks/bench_render.py                      # 1M gaussians, 512x512, CPU (+ CUDA/MPS if present)
    python benchmarks/bench_render.py --gaussians 100000 --resolution 256 512 --devices cpu --repeat 3
    python benchmarks/bench_render.py --video --frames 20 --repeat 2 --json out.json   # old and new CPU paths

``--video`` times each render path of ``--paths`` (default all three: "rounds", the renderer's first CPU path;
"slabs", the slabs compositor frame by frame, the CPU path before frame-parallel turntables; "slabs-parallel",
the CPU default: slabs with ``frames at once`` frames rendered side by side, one per torch thread,
``backends.splat.frames``), interleaved so that load changes hit all alike, ``--repeat`` times each:
- ``render_utils.render_video(gs, resolution=512, num_frames=1)`` (upstream's module path; z-up orbit, r 2,
  fov 40), one frame (frame-by-frame paths only: one frame has nothing to render side by side);
- the notebook's call: ``sam3d_objects.inference.render_video`` of ``ready_gaussian_for_video_rendering(gs)``
  with the demo notebook's camera (r 1, fov 60, pitch 15, yaw from -45), one frame;
- a turntable: the same notebook call with ``num_frames=--frames`` (300 in the notebook): seconds a frame and
  the 300-frame time at that rate (``--frames 300`` measures it directly).
``--workers 1 2 4 8 16`` adds turntable rows with exactly that many frames at once (the scaling curve). Printed
with the torch thread count, CPU count and load average before and after; ``--json`` keeps the rows.
The object (``pipeline_object``) is shaped like the gaussian decoder's output: gaussians clustered on the
surface voxels of a solid (a rounded box, a sphere on it, a ring handle) on a 64^3 grid, voxel-sized scales,
random rotations, 70% of opacities in [0.5, 1]. Wall and process-CPU seconds are reported (median, min, max);
the CPU seconds say more on a loaded machine.

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


def pipeline_object(n: int = 1_000_000, seed: int = 0, grid: int = 64):
    """A ``Gaussian`` of ``n`` gaussians shaped like a decoded object (see the module docstring), in the unit
    box centred on the origin as ``ready_gaussian_for_video_rendering`` leaves an object."""
    from sam3d_objects.model.backbone.tdfy_dit.representations.gaussian.gaussian_model import Gaussian

    g = torch.Generator().manual_seed(seed)
    c = (torch.arange(grid) + 0.5) / grid - 0.5
    p = torch.stack(torch.meshgrid(c, c, c, indexing="ij"), -1)
    q = (p - torch.tensor([0.0, 0.0, -0.15])).abs() - torch.tensor([0.3, 0.22, 0.15])
    box = q.clamp_min(0).norm(dim=-1) + q.amax(-1).clamp_max(0) - 0.05
    ball = (p - torch.tensor([0.05, 0.0, 0.22])).norm(dim=-1) - 0.2
    h = p - torch.tensor([-0.36, 0.0, -0.1])
    ring = torch.stack([torch.stack([h[..., 0], h[..., 2]], -1).norm(dim=-1) - 0.14, h[..., 1]], -1).norm(dim=-1)
    distance = torch.minimum(torch.minimum(box, ball), ring - 0.035)
    surface = torch.nonzero(distance.abs() < 0.75 / grid).float()
    voxel = 1.0 / grid
    which = torch.randint(0, surface.shape[0], (n,), generator=g)
    means = (surface[which] + 0.5) * voxel - 0.5 + (torch.rand(n, 3, generator=g) - 0.5) * 1.5 * voxel
    scales = voxel * torch.exp(torch.randn(n, 3, generator=g) * 0.5 - 1.2)
    opaque = torch.rand(n, generator=g) < 0.7
    opacity = torch.where(opaque, 0.5 + 0.5 * torch.rand(n, generator=g), 0.5 * torch.rand(n, generator=g))
    gs = Gaussian([-0.5, -0.5, -0.5, 1.0, 1.0, 1.0], mininum_kernel_size=0.0009, scaling_activation="softplus")
    gs.from_xyz(means)
    gs.from_scaling(scales)
    gs.from_rotation(torch.nn.functional.normalize(torch.randn(n, 4, generator=g), dim=-1))
    gs.from_opacity(opacity[:, None])
    gs._features_dc = torch.randn(n, 1, 3, generator=g) * 0.8
    return gs


def _timed(fn) -> Dict[str, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}


# CPU render paths compared by --video: (compositor, frames rendered at once: 1 = frame by frame, None = the
# default, one frame per torch thread)
VIDEO_PATHS = {
    "rounds": ("rounds", 1),  # the renderer's first CPU path: every tile's list in rounds, frame by frame
    "slabs": ("slabs", 1),  # the slabs compositor, frame by frame (the CPU path before frame-parallel turntables)
    "slabs-parallel": ("slabs", None),  # the CPU default: slabs, frames side by side (backends.splat.frames)
}


def _path(name: str):
    """(compositor, frames at once) of a --paths name: one of VIDEO_PATHS or "slabs-xN" (N frames at once)."""
    if name in VIDEO_PATHS:
        return VIDEO_PATHS[name]
    return "slabs", int(name.rsplit("-x", 1)[1])


def video_table(n: int, resolution: int, repeat: int, frames: int, paths: List[str]) -> List[dict]:
    """Seconds of render_video calls per render path (see the module docstring), interleaved; CPU tensors.
    One-frame calls run each compositor once (a single frame has nothing to render side by side)."""
    from backends.splat import frame_workers, use_compositor, use_frame_workers
    from sam3d_objects.inference import ready_gaussian_for_video_rendering
    from sam3d_objects.inference import render_video as notebook_video
    from sam3d_objects.model.backbone.tdfy_dit.utils import render_utils

    gs = pipeline_object(n)
    scene = ready_gaussian_for_video_rendering(gs)
    single = [p for p in paths if p in VIDEO_PATHS and VIDEO_PATHS[p][1] == 1] or paths[:1]
    calls = {
        "render_utils.render_video, 1 frame": (single, 1, lambda: render_utils.render_video(
            gs, resolution=resolution, num_frames=1, verbose=False)),
        "notebook render_video, 1 frame": (single, 1, lambda: notebook_video(
            scene, resolution=resolution, num_frames=1, r=1, fov=60, pitch_deg=15, yaw_start_deg=-45,
            verbose=False)),
        f"notebook turntable, {frames} frames": (paths, frames, lambda: notebook_video(
            scene, resolution=resolution, num_frames=frames, r=1, fov=60, pitch_deg=15, yaw_start_deg=-45,
            verbose=False)),
    }
    for path in paths:  # warm-up: first calls pay for lazy initialisation
        with use_compositor(_path(path)[0]):
            render_utils.render_video(gs, resolution=64, num_frames=1, verbose=False)
    times: Dict[tuple, List[Dict[str, float]]] = {}
    for name, (call_paths, n_frames, call) in calls.items():
        for _ in range(repeat):
            for path in call_paths:
                compositor, workers = _path(path)
                with use_compositor(compositor), use_frame_workers(workers):
                    times.setdefault((name, path, n_frames), []).append(_timed(call))
    rows = []
    for (name, path, n_frames), ts in times.items():
        compositor, workers = _path(path)
        with use_frame_workers(workers):
            at_once = frame_workers(torch.device("cpu"), n_frames)
        walls, cpus = [t["wall"] for t in ts], [t["cpu"] for t in ts]
        wall = statistics.median(walls)
        rows.append({"call": name, "path": path, "compositor": compositor, "frames": n_frames,
                     "frames_at_once": at_once, "threads": torch.get_num_threads(), "runs": len(ts), "wall": wall,
                     "wall_min": min(walls), "wall_max": max(walls), "cpu": statistics.median(cpus),
                     "s_per_frame": wall / n_frames, "s_300_frames": 300 * wall / n_frames})
    return rows


def print_video_table(rows: List[dict]) -> None:
    print(f"{'call':36} {'path':15} {'at once':>7} {'runs':>4} {'wall s':>8} {'min':>7} {'max':>7} {'cpu s':>8}"
          f" {'s/frame':>8} {'300 frames s':>13}")
    for r in rows:
        print(f"{r['call']:36} {r['path']:15} {r['frames_at_once']:>7} {r['runs']:>4} {r['wall']:8.3f}"
              f" {r['wall_min']:7.3f} {r['wall_max']:7.3f} {r['cpu']:8.3f} {r['s_per_frame']:8.3f}"
              f" {r['s_300_frames']:13.1f}")
    base = {r["call"]: r for r in rows if r["path"] == "slabs"}
    for r in rows:
        if r["path"] != "slabs" and r["call"] in base:
            print(f"  {r['call']}: {r['path']} / slabs wall = {r['wall'] / base[r['call']]['wall']:.2f}")


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
    ap.add_argument("--repeat", type=int, default=3, help="timed frames after the first (--video: calls)")
    ap.add_argument("--video", action="store_true", help="through render_video, compositors side by side")
    ap.add_argument("--frames", type=int, default=12, help="--video: turntable frames (the notebook's: 300)")
    ap.add_argument("--paths", nargs="+", default=list(VIDEO_PATHS), choices=list(VIDEO_PATHS),
                    help="--video: CPU render paths compared (compositor, frame by frame or side by side)")
    ap.add_argument("--workers", type=int, nargs="*", default=[],
                    help="--video: also time the turntable with exactly these frames at once (rows slabs-xN): the "
                         "scaling curve of frame-parallel rendering")
    ap.add_argument("--json", default=None, help="--video: also write the rows (and machine facts) here")
    args = ap.parse_args(argv)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"torch {torch.__version__}, {torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs, load average "
          f"{load[0]:.2f}" if load else "")
    if args.video:
        paths = args.paths + [f"slabs-x{w}" for w in args.workers]
        rows = video_table(args.gaussians[0], args.resolution[0], args.repeat, args.frames, paths)
        print_video_table(rows)
        load_after = os.getloadavg() if load else None
        print(f"load average after: {load_after[0]:.2f}" if load_after else "")
        if args.json:
            import json
            facts = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                     "load_before": load[0] if load else None, "load_after": load_after[0] if load else None,
                     "gaussians": args.gaussians[0], "resolution": args.resolution[0]}
            with open(args.json, "w") as f:
                json.dump({"machine": facts, "rows": rows}, f, indent=1)
        return
    print_table(render_table(args.gaussians, args.resolution, args.devices or available_devices(), args.repeat))


if __name__ == "__main__":
    main()
