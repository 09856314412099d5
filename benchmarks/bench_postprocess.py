"""Time and peak memory of mesh post-processing and texture baking (postprocessing_utils.to_glb's stages).

    python benchmarks/bench_postprocess.py --run-dir OUT_OF_RECONSTRUCT [--device cuda] [--json result.json]
    python benchmarks/bench_postprocess.py --synthetic 7 [--device cpu]     # icosphere, 20 * 4^7 = 327k faces

``--run-dir`` takes the folder `sam3d-objects reconstruct` wrote (mesh.glb with the raw vertex-coloured mesh and
splat.ply). Upstream's settings are the defaults (simplify 0.95, hole filling 1000 views at 1024, baking 100
views at 1024, texture 1024, 2500 steps); ``--fill-views``, ``--bake-views``, ``--resolution``, ``--steps`` scale
them down for quick looks. Prints one line per stage and a JSON summary (seconds, peak RSS / device memory, face
counts before/after); ``--out DIR`` also writes the textured GLB and its preview there.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import backends  # noqa: E402
from sam3d_objects.model.backbone.tdfy_dit.utils import postprocessing_utils as P  # noqa: E402


class PlySplats:
    """The activated attributes of a 3DGS PLY (what render_gaussian reads)."""

    def __init__(self, path: Path, device: torch.device):
        from plyfile import PlyData

        v = PlyData.read(str(path))["vertex"].data

        def cols(prefix):
            names = sorted((n for n in v.dtype.names if n.startswith(prefix)), key=lambda n: int(n.split("_")[-1]))
            return torch.tensor(np.stack([v[n] for n in names], 1), dtype=torch.float32, device=device)

        self.get_xyz = torch.tensor(np.stack([v["x"], v["y"], v["z"]], 1), dtype=torch.float32, device=device)
        self.get_scaling = torch.exp(cols("scale_"))
        self.get_rotation = torch.nn.functional.normalize(cols("rot_"), dim=-1)
        self.get_opacity = torch.sigmoid(torch.tensor(v["opacity"], dtype=torch.float32, device=device))[:, None]
        self._features_dc = cols("f_dc_")[:, None, :3]


def synthetic(level: int, device: torch.device):
    """Icosphere of radius 0.4 with a smooth colour field, and splats on it."""
    import trimesh

    from sam3d_objects.render import SH_C0

    m = trimesh.creation.icosphere(subdivisions=level, radius=0.4)
    v = np.asarray(m.vertices, np.float32)
    colours = 0.5 + 0.35 * np.sin(np.stack([6 * v[:, 0], 5 * v[:, 1] + 1, 4 * v[:, 2]], 1))

    class Splats:
        get_xyz = torch.tensor(v, device=device)
        get_scaling = torch.full((len(v), 3), 0.004, device=device)
        get_rotation = torch.tensor([[1.0, 0, 0, 0]], device=device).repeat(len(v), 1)
        get_opacity = torch.full((len(v), 1), 0.99, device=device)
        _features_dc = torch.tensor((colours - 0.5) / SH_C0, dtype=torch.float32, device=device)[:, None]

    return v, np.asarray(m.faces), Splats()


class Stages:
    def __init__(self, device: torch.device):
        self.device, self.rows = device, {}

    def __call__(self, name, fn, *args, **kwargs):
        backends.device.synchronize(self.device)
        t = time.perf_counter()
        result = fn(*args, **kwargs)
        backends.device.synchronize(self.device)
        self.rows[name] = time.perf_counter() - t
        print(f"{name:>12}: {self.rows[name]:8.1f} s   peak RSS {backends.device.peak_rss_bytes() / 2**30:.2f} GiB"
              f"   peak device {backends.device.peak_memory(self.device) / 2**30:.2f} GiB", flush=True)
        return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--run-dir", type=Path, help="folder with mesh.glb (raw, vertex-coloured) and splat.ply")
    src.add_argument("--synthetic", type=int, metavar="LEVEL", help="icosphere subdivision level")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--simplify", type=float, default=0.95)
    ap.add_argument("--fill-views", type=int, default=1000)
    ap.add_argument("--fill-resolution", type=int, default=1024)
    ap.add_argument("--bake-views", type=int, default=100)
    ap.add_argument("--resolution", type=int, default=1024, help="bake view resolution")
    ap.add_argument("--texture-size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=2500)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    if args.run_dir is not None:
        import trimesh

        mesh = trimesh.load(args.run_dir / "mesh.glb", force="mesh", process=False)
        vertices = (np.asarray(mesh.vertices) @ P._ZUP_TO_YUP.T).astype(np.float32)  # y-up GLB -> z-up object
        faces = np.asarray(mesh.faces)
        splats = PlySplats(args.run_dir / "splat.ply", device)
    else:
        vertices, faces, splats = synthetic(args.synthetic, device)
    backends.device.reset_peak_memory(device)
    stage = Stages(device)
    summary = {"device": str(device), "faces_in": int(len(faces)), "vertices_in": int(len(vertices)),
               "gaussians": int(splats.get_xyz.shape[0]), "settings": vars(args) | {"run_dir": str(args.run_dir),
                                                                                   "out": str(args.out)}}
    v, f = stage("decimate", P.postprocess_mesh, vertices, faces, simplify=True, simplify_ratio=args.simplify,
                 fill_holes=False)
    summary["faces_simplified"] = int(len(f))
    v, f = stage("fill_holes", P.postprocess_mesh, v, f, simplify=False, fill_holes=True,
                 fill_holes_max_hole_nbe=int(250 * math.sqrt(1 - args.simplify)),
                 fill_holes_resolution=args.fill_resolution, fill_holes_num_views=args.fill_views, verbose=True,
                 device=device)
    summary["faces_out"] = int(len(f))
    v, f, uv = stage("xatlas", P.parametrize_mesh, v, f)
    cams = P.sphere_hammersley_cameras(args.bake_views, args.resolution)
    obs, masks = stage("render", P._render_gaussian_views, splats, cams, True)
    tex = stage("bake", P.bake_texture, v, f, uv, obs, masks, [c.world_to_camera.numpy() for c in cams],
                [P._normalized_intrinsics(c) for c in cams], texture_size=args.texture_size, verbose=True,
                device=device, num_steps=args.steps)
    summary["seconds"] = stage.rows
    summary["total_seconds"] = sum(stage.rows.values())
    summary["peak_rss_bytes"] = backends.device.peak_rss_bytes()
    summary["peak_device_bytes"] = backends.device.peak_memory(device)
    if args.out is not None:
        import trimesh
        from PIL import Image

        args.out.mkdir(parents=True, exist_ok=True)
        material = trimesh.visual.material.PBRMaterial(roughnessFactor=1.0, metallicFactor=0.0,
                                                       baseColorTexture=Image.fromarray(tex))
        glb = trimesh.Trimesh(np.asarray(v, np.float64) @ P._ZUP_TO_YUP, f,
                              visual=trimesh.visual.TextureVisuals(uv=uv, material=material))
        glb.export(str(args.out / "mesh_textured.glb"))
        P.write_preview(glb, args.out / "mesh_textured_preview.png")
    text = json.dumps(summary, indent=2, default=str)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
