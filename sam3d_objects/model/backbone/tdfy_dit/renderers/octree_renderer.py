"""Octree / radiance-field renderer (upstream's OctreeRenderer) in plain PyTorch: volume ray marching through the
octree's leaves on any device, instead of the CUDA-only `diffoctreerast` rasterizer.

Per leaf: "voxel" / "gaussian" primitives have a constant density (`get_density` / `get_opacity`) and DC colour;
"trivec" (Strivec) leaves a TensoRF-style tri-vector field: density(u) = sum_r density[r] * prod_axis
line[r, axis](u_axis) + density_shift and colour = sum_r weight_r(u) * (0.5 + C0 * features_dc[r]) / sum_r
weight_r, with u the position inside the leaf (lines linearly interpolated, `dim` samples over the leaf). This is
our reading of the representation (diffoctreerast's kernels are not part of the spec); colours are view
independent (degree-0 SH). Samples are composited front to back: alpha_i = 1 - exp(-sigma_i * delta_i).
"""
import math
from typing import Any, Dict, Optional

import numpy as np
import torch
import torch.nn.functional as F

SH_C0 = 0.28209479177387814
PRIMITIVES = ("voxel", "gaussian", "trivec", "decoupoly")


class _AttrDict(dict):
    """dict with attribute access (upstream returns easydict objects)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError as e:
            raise AttributeError(name) from e

    __setattr__ = dict.__setitem__


def intrinsics_to_projection(intrinsics: torch.Tensor, near: float, far: float) -> torch.Tensor:
    """Normalised OpenCV intrinsics (3, 3) -> (4, 4) projection with depth mapped to [0, 1] and w = camera z."""
    fx, fy, cx, cy = intrinsics[0, 0], intrinsics[1, 1], intrinsics[0, 2], intrinsics[1, 2]
    ret = torch.zeros((4, 4), dtype=intrinsics.dtype, device=intrinsics.device)
    ret[0, 0], ret[1, 1] = 2 * fx, 2 * fy
    ret[0, 2], ret[1, 2] = 2 * cx - 1, -2 * cy + 1
    ret[2, 2] = far / (far - near)
    ret[2, 3] = near * far / (near - far)
    ret[3, 2] = 1.0
    return ret


def octree_device(octree) -> torch.device:
    """The device of the octree's leaves (where it is rendered)."""
    return octree.get_xyz.device


def _leaf_index(octree, points: torch.Tensor) -> torch.Tensor:
    """Row of the leaf containing each unit-cube point (-1 outside every leaf)."""
    depth = octree.get_depth[:, 0].long()
    out = torch.full((points.shape[0],), -1, dtype=torch.long, device=points.device)
    for d in torch.unique(depth).tolist():
        rows = torch.nonzero(depth == d)[:, 0]
        side = 2 ** d
        cells = torch.floor(octree.get_xyz[rows] * side).long().clamp(0, side - 1)
        codes = (cells[:, 0] * side + cells[:, 1]) * side + cells[:, 2]
        codes, order = torch.sort(codes)
        q = torch.floor(points * side).long()
        inside = ((q >= 0) & (q < side)).all(dim=1)
        qc = (q[:, 0].clamp(0, side - 1) * side + q[:, 1].clamp(0, side - 1)) * side + q[:, 2].clamp(0, side - 1)
        pos = torch.searchsorted(codes, qc).clamp(max=codes.shape[0] - 1)
        hit = inside & (codes[pos] == qc)
        out[hit] = rows[order[pos[hit]]]
    return out


def _line_values(lines: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """lines [S, R, 3, dim] sampled at u [S, 3] in [0, 1] (linear, end points at the leaf faces) -> [S, R, 3]."""
    dim = lines.shape[-1]
    x = (u.clamp(0, 1) * (dim - 1))[:, None, :, None]  # [S, 1, 3, 1]
    lo = torch.floor(x).long().clamp(max=dim - 2) if dim > 1 else torch.zeros_like(x, dtype=torch.long)
    w = (x - lo).clamp(0, 1)
    lo = lo.expand(-1, lines.shape[1], -1, -1)
    a = torch.gather(lines, -1, lo)
    b = torch.gather(lines, -1, (lo + 1).clamp(max=dim - 1))
    return (a * (1 - w) + b * w)[..., 0]


def _sample_fields(octree, leaf: torch.Tensor, u: torch.Tensor, colors_overwrite: Optional[torch.Tensor],
                   used_rank: Optional[int]):
    """(density [S], rgb [S, 3]) at samples in leaves `leaf` (all valid) with in-leaf coordinates u [S, 3]."""
    prim = octree.primitive
    if prim == "trivec":
        rank = used_rank or octree.trivec.shape[1]
        lines = octree.trivec[leaf, :rank]
        weights = _line_values(lines, u).prod(dim=-1)  # [S, R]
        density = (octree.density[leaf, :rank] * weights).sum(-1) + getattr(octree, "density_shift", 0.0)
        if colors_overwrite is not None:
            rgb = colors_overwrite[leaf]
        else:
            rank_rgb = 0.5 + SH_C0 * octree.features_dc[leaf, :rank, 0]  # [S, R, 3]
            w = weights.abs() + 1e-8
            rgb = (rank_rgb * w[..., None]).sum(1) / w.sum(1, keepdim=True)
        return F.relu(density), rgb.clamp(0, 1)
    if prim in ("voxel", "gaussian"):
        # (upstream's get_opacity reads `density`; a gaussian octree stores `opacity`)
        density = (octree.opacity_activation(octree.opacity) if prim == "gaussian"
                   else octree.get_density)[leaf].reshape(-1)
        rgb = colors_overwrite[leaf] if colors_overwrite is not None else 0.5 + SH_C0 * octree.features_dc[leaf, 0]
        return density, rgb.clamp(0, 1)
    if prim == "decoupoly":
        raise ValueError("the decoupoly primitive has no renderer here (no model in this project produces it)")
    raise ValueError(f"Unknown primitive {prim}")


def _march(octree, origin: torch.Tensor, dirs: torch.Tensor, near: float, far: float, num_samples: int,
           colors_overwrite: Optional[torch.Tensor], used_rank: Optional[int], bg: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Front-to-back compositing of `num_samples` samples per ray over [near, far] (world units)."""
    aabb = octree.aabb.to(dirs)
    t = torch.linspace(near, far, num_samples + 1, device=dirs.device, dtype=dirs.dtype)
    mids = (t[:-1] + t[1:]) / 2
    delta = (t[1:] - t[:-1])[None]
    pts = origin[None, None] + dirs[:, None] * mids[None, :, None]  # [R, N, 3]
    unit = ((pts - aabb[:3]) / aabb[3:]).reshape(-1, 3)
    leaf = _leaf_index(octree, unit)
    density = torch.zeros(unit.shape[0], device=dirs.device, dtype=dirs.dtype)
    rgb = torch.zeros(unit.shape[0], 3, device=dirs.device, dtype=dirs.dtype)
    valid = leaf >= 0
    if valid.any():
        lv = leaf[valid]
        size = 2.0 ** -octree.get_depth[lv].to(dirs.dtype)  # leaf side in unit coordinates
        u = (unit[valid] - (octree.get_xyz[lv].to(dirs.dtype) - size / 2)) / size
        d, c = _sample_fields(octree, lv, u, colors_overwrite, used_rank)
        density[valid], rgb[valid] = d.to(dirs.dtype), c.to(dirs.dtype)
    density, rgb = density.reshape(pts.shape[:2]), rgb.reshape(*pts.shape[:2], 3)
    alpha = 1 - torch.exp(-density * delta)
    trans = torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1 - alpha[:, :-1]], dim=1), dim=1)
    w = alpha * trans
    acc = w.sum(1)
    color = (w[..., None] * rgb).sum(1) + (1 - acc)[:, None] * bg
    depth = (w * mids[None]).sum(1)
    # depth where the accumulated opacity first reaches half (0 when it never does)
    reached = torch.cumsum(w, 1) >= 0.5
    first = torch.where(reached.any(1), reached.float().argmax(1), torch.zeros_like(acc, dtype=torch.long))
    percent_depth = torch.where(reached.any(1), mids[first], torch.zeros_like(acc))
    return {"rgb": color, "depth": depth, "alpha": acc, "percent_depth": percent_depth}


def render(viewpoint_camera, octree, pipe, bg_color: torch.Tensor, scaling_modifier: float = 1.0,
           used_rank: Optional[int] = None, colors_overwrite: Optional[torch.Tensor] = None, aux=None,
           halton_sampler=None) -> _AttrDict:
    """Render `octree` for `viewpoint_camera` (image_height/width, world_view_transform = extrinsics^T,
    camera_center, normalised intrinsics, znear/zfar). Returns rgb (3, H, W), depth and alpha (H, W) (+
    percent_depth for trivec). `pipe.num_samples` (default 256) sets the samples per ray."""
    if octree.primitive not in PRIMITIVES:
        raise ValueError(f"Unknown primitive {octree.primitive}")
    h, w = int(viewpoint_camera.image_height), int(viewpoint_camera.image_width)
    device = octree_device(octree)  # the rays meet the octree's tensors: the camera comes to the octree
    K = viewpoint_camera.intrinsics.to(device)
    extr = viewpoint_camera.world_view_transform.transpose(0, 1).float().to(device)
    ys, xs = torch.meshgrid(torch.arange(h, device=device, dtype=torch.float32),
                            torch.arange(w, device=device, dtype=torch.float32), indexing="ij")
    if pipe.get("jitter", False) and halton_sampler is not None:
        offset = torch.tensor(halton_sampler.random(1)[0], device=device, dtype=torch.float32)
    else:
        offset = torch.tensor([0.5, 0.5], device=device)
    cam = torch.stack([((xs + offset[0]) / w - K[0, 2]) / K[0, 0], ((ys + offset[1]) / h - K[1, 2]) / K[1, 1],
                       torch.ones_like(xs)], dim=-1).reshape(-1, 3)
    dirs = cam @ extr[:3, :3]  # camera -> world rotation (R^T applied to row vectors)
    dirs = dirs / dirs.norm(dim=-1, keepdim=True)
    origin = viewpoint_camera.camera_center.float().to(device)
    near = float(viewpoint_camera.get("znear", 0.1))
    far = float(viewpoint_camera.get("zfar", 10.0))
    samples = int(pipe.get("num_samples", 256))
    bg = bg_color.to(device=device, dtype=torch.float32)
    chunks = [_march(octree, origin, d, near, far, samples, colors_overwrite, used_rank, bg)
              for d in dirs.split(max(1, (1 << 22) // samples))]
    out = {k: torch.cat([c[k] for c in chunks]) for k in chunks[0]}
    result = _AttrDict(rgb=out["rgb"].reshape(h, w, 3).permute(2, 0, 1), depth=out["depth"].reshape(h, w),
                       alpha=out["alpha"].reshape(h, w))
    if octree.primitive == "trivec":
        result["percent_depth"] = out["percent_depth"].reshape(h, w)
    return result


class OctreeRenderer:
    """Renders DfsOctree / Strivec representations: render(octree, extrinsics (4, 4), normalised intrinsics
    (3, 3)) -> {"color" (3, res, res), "depth", "alpha"} on the octree's device."""

    def __init__(self, rendering_options: Dict[str, Any] = {}):  # noqa: B006 (read only)
        self.pipe = _AttrDict(with_distloss=False, with_aux=False, scale_modifier=1.0, used_rank=None,
                              jitter=False, debug=False, num_samples=256)
        self.rendering_options = _AttrDict(resolution=None, near=None, far=None, ssaa=1, bg_color="random")
        self.rendering_options.update(rendering_options)
        self.bg_color = None
        self.unsupported = False  # every device is supported (no CUDA rasterizer needed)
        try:
            from scipy.stats import qmc
            self.halton_sampler = qmc.Halton(2, scramble=False)
        except ImportError:  # scipy only matters for jittered (training) renders
            self.halton_sampler = None

    def render(self, octree, extrinsics: torch.Tensor, intrinsics: torch.Tensor,
               colors_overwrite: Optional[torch.Tensor] = None) -> _AttrDict:
        opts = self.rendering_options
        if opts["resolution"] is None or opts["near"] is None or opts["far"] is None:
            raise ValueError("set rendering_options resolution, near and far before rendering")
        resolution, ssaa = int(opts["resolution"]), int(opts["ssaa"])
        device = octree_device(octree)  # rendered where the octree lives, whatever device the camera is on
        extrinsics, intrinsics = extrinsics.to(device), intrinsics.to(device)
        if opts["bg_color"] == "random":
            self.bg_color = torch.zeros(3, dtype=torch.float32, device=device)
            if np.random.rand() < 0.5:
                self.bg_color += 1
        else:
            self.bg_color = torch.tensor(opts["bg_color"], dtype=torch.float32, device=device)
        camera = _AttrDict(image_height=resolution * ssaa, image_width=resolution * ssaa,
                           FoVx=2 * math.atan(0.5 / float(intrinsics[0, 0])),
                           FoVy=2 * math.atan(0.5 / float(intrinsics[1, 1])),
                           world_view_transform=extrinsics.T.contiguous(),
                           full_proj_transform=(intrinsics_to_projection(intrinsics, opts["near"], opts["far"])
                                                @ extrinsics).T.contiguous(),
                           camera_center=torch.inverse(extrinsics)[:3, 3], intrinsics=intrinsics,
                           znear=opts["near"], zfar=opts["far"])
        out = render(camera, octree, self.pipe, self.bg_color, scaling_modifier=self.pipe.scale_modifier,
                     used_rank=self.pipe.used_rank, colors_overwrite=colors_overwrite,
                     halton_sampler=self.halton_sampler)
        if ssaa > 1:
            def down(x: torch.Tensor) -> torch.Tensor:
                batch = x[None] if x.dim() == 3 else x[None, None]
                y = F.interpolate(batch, size=(resolution, resolution), mode="bilinear", align_corners=False,
                                  antialias=True)
                return y[0] if x.dim() == 3 else y[0, 0]
            out = _AttrDict({k: down(v) for k, v in out.items()})
        result = _AttrDict(color=out["rgb"], depth=out["depth"], alpha=out["alpha"])
        if "percent_depth" in out:
            result["percent_depth"] = out["percent_depth"]
        return result
