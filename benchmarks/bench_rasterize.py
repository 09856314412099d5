"""Time per view of backends.rasterize (and peak memory) for a sphere of F faces at H x W.

    python benchmarks/bench_rasterize.py [--device cuda] [--level 7] [--resolution 1024] [--views 20]

Level L gives 20 * 4^L faces (7: 327k, 8: 1.3M). The camera circles the sphere at the post-processing's
distance (r = 2, fov 40 deg), so the sphere fills about the same share of the image as a decoded object.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import backends  # noqa: E402
from sam3d_objects.model.backbone.tdfy_dit.utils import postprocessing_utils as P  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--level", type=int, default=6)
    ap.add_argument("--resolution", type=int, default=1024)
    ap.add_argument("--views", type=int, default=10)
    ap.add_argument("--max-pairs", type=int, default=None)
    args = ap.parse_args()
    import trimesh

    device = torch.device(args.device)
    m = trimesh.creation.icosphere(subdivisions=args.level, radius=0.5)
    v = torch.tensor(np.asarray(m.vertices), dtype=torch.float32, device=device)
    f = torch.tensor(np.asarray(m.faces), device=device)
    homo = torch.cat([v, torch.ones_like(v[:, :1])], -1)
    cams = P.sphere_hammersley_cameras(args.views + 1, args.resolution)
    kwargs = {} if args.max_pairs is None else {"max_pairs": args.max_pairs}
    clips = [homo @ P.camera_clip_matrix(c, 1.0, 3.0).to(device, torch.float32).T for c in cams]
    backends.rasterize.rasterize(clips[0], f, (args.resolution,) * 2, **kwargs)  # warm-up
    backends.device.reset_peak_memory(device)
    backends.device.synchronize(device)
    t = time.perf_counter()
    for clip in clips[1:]:
        rast = backends.rasterize.rasterize(clip, f, (args.resolution,) * 2, **kwargs)
    backends.device.synchronize(device)
    per_view = (time.perf_counter() - t) / args.views
    print(f"{len(m.faces)} faces, {args.resolution}^2, {device}: {per_view * 1000:.1f} ms/view, "
          f"coverage {(rast[..., 3] > 0).float().mean().item():.3f}, "
          f"peak device {backends.device.peak_memory(device) / 2**20:.0f} MiB, "
          f"peak RSS {backends.device.peak_rss_bytes() / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
