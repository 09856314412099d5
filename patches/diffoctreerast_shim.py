"""``diffoctreerast`` stand-in: the octree rasterisers through the project's octree renderer (ray marching).

Why: diffoctreerast is a CUDA extension; upstream's octree renderer builds ``Octree*Rasterizer(raster_settings)``
and calls it with the octree's leaves. Each stand-in rasteriser takes diffoctreerast's arguments (``positions``
[N, 3] leaf centres in the unit cube, ``depths`` [N, 1] leaf levels, ``aabb`` (x0, y0, z0, sx, sy, sz), the
primitive's fields, ``shs`` [N, (R,) K, 3] or ``colors_precomp``) and settings (``image_height/width``,
``tanfovx/y``, ``viewmatrix`` = world-to-camera^T, ``projmatrix`` = (projection @ world-to-camera)^T, ``campos``,
``bg``, ``jitter``, ``density_shift``, ``used_rank``), recovers the normalised intrinsics and near/far planes
from the projection (the inverse of ``intrinsics_to_projection``), and renders with
``sam3d_objects...renderers.octree_renderer.render``: front-to-back compositing of samples along each pixel's
ray, colours from the degree-0 SH coefficient. Returns what diffoctreerast returns: (rgb [3, H, W], depth [H, W],
alpha [H, W]) plus ``distloss`` (0: no distortion loss is computed) for voxels and ``percent_depth`` for trivecs.
The decoupoly primitive is not provided (no model of the project produces it).
"""
from __future__ import annotations

import warnings
from types import SimpleNamespace

import torch

from . import _ours
from ._modules import drop, install_shim, make

SAMPLES_PER_RAY = 256
_WARNED: list = []


def _octree_renderer():
    return _ours.module("sam3d_objects.model.backbone.tdfy_dit.renderers.octree_renderer")


def _setting(settings, name: str, default=None):
    if isinstance(settings, dict):
        return settings.get(name, default)
    return getattr(settings, name, default)


def _camera(settings, device):
    """The project renderer's camera from diffoctreerast's settings."""
    _AttrDict = _octree_renderer()._AttrDict  # noqa: N806

    view = _setting(settings, "viewmatrix").to(device=device, dtype=torch.float32)
    full = _setting(settings, "projmatrix").to(device=device, dtype=torch.float32)
    extrinsics = view.T
    proj = full.T @ torch.inverse(extrinsics)  # projection = (proj @ extr)^T^T @ extr^-1
    fx, fy = proj[0, 0] / 2, proj[1, 1] / 2
    cx, cy = (proj[0, 2] + 1) / 2, (1 - proj[1, 2]) / 2
    a, b = float(proj[2, 2]), float(proj[2, 3])  # far / (far - near), near far / (near - far)
    near = -b / a
    far = a * near / (a - 1) if a != 1 else float("inf")
    intrinsics = torch.tensor([[float(fx), 0.0, float(cx)], [0.0, float(fy), float(cy)], [0.0, 0.0, 1.0]],
                              device=device)
    campos = _setting(settings, "campos")
    center = campos.to(device) if campos is not None else torch.inverse(extrinsics)[:3, 3]
    return _AttrDict(image_height=int(_setting(settings, "image_height")),
                     image_width=int(_setting(settings, "image_width")), world_view_transform=view,
                     camera_center=center, intrinsics=intrinsics, znear=near, zfar=far)


def _render(settings, primitive: str, positions, depths, aabb, shs, colors_precomp, **fields):
    _AttrDict, render = _octree_renderer()._AttrDict, _octree_renderer().render  # noqa: N806

    device = positions.device
    if shs is not None and shs.shape[-2] > 1 and colors_precomp is None and not _WARNED:
        _WARNED.append(True)
        warnings.warn("diffoctreerast stand-in: leaves are coloured by their degree-0 SH coefficient only (the real "
                      "rasteriser adds the view-dependent higher degrees)", stacklevel=3)
    features_dc = None if shs is None else shs[..., :1, :]
    octree = SimpleNamespace(primitive=primitive, get_xyz=positions, get_depth=depths,
                             aabb=torch.as_tensor(aabb, device=device, dtype=torch.float32),
                             features_dc=features_dc, opacity_activation=lambda x: x,
                             density_shift=_setting(settings, "density_shift", 0.0), **fields)
    pipe = _AttrDict(num_samples=SAMPLES_PER_RAY, jitter=bool(_setting(settings, "jitter", False)))
    bg = _setting(settings, "bg")
    bg = torch.zeros(3, device=device) if bg is None else torch.as_tensor(bg, device=device)
    used_rank = _setting(settings, "used_rank")
    return render(_camera(settings, device), octree, pipe, bg, used_rank=used_rank, colors_overwrite=colors_precomp)


class _Rasterizer(torch.nn.Module):
    def __init__(self, raster_settings):
        super().__init__()
        self.raster_settings = raster_settings


class OctreeVoxelRasterizer(_Rasterizer):
    """Constant-density voxel leaves -> (rgb, depth, alpha, distloss)."""

    def forward(self, positions, densities, shs=None, colors_precomp=None, depths=None, aabb=None, aux=None):
        out = _render(self.raster_settings, "voxel", positions, depths, aabb, shs, colors_precomp,
                      get_density=densities)
        return out["rgb"], out["depth"], out["alpha"], torch.zeros((), device=positions.device)


class OctreeGaussianRasterizer(_Rasterizer):
    """Gaussian leaves (opacity as a constant density over the leaf) -> (rgb, depth, alpha)."""

    def forward(self, positions, opacities, shs=None, colors_precomp=None, depths=None, aabb=None, aux=None):
        out = _render(self.raster_settings, "gaussian", positions, depths, aabb, shs, colors_precomp,
                      opacity=opacities)
        return out["rgb"], out["depth"], out["alpha"]


class OctreeTrivecRasterizer(_Rasterizer):
    """Tri-vector (Strivec) leaves -> (rgb, depth, alpha, percent_depth)."""

    def forward(self, positions, trivecs, densities, shs=None, colors_precomp=None, colors_overwrite=None,
                depths=None, aabb=None, aux=None, halton_sampler=None):
        colors = colors_overwrite if colors_overwrite is not None else colors_precomp
        out = _render(self.raster_settings, "trivec", positions, depths, aabb, shs, colors, trivec=trivecs,
                      density=densities, get_density=densities)
        return out["rgb"], out["depth"], out["alpha"], out["percent_depth"]


class OctreeDecoupolyRasterizer(_Rasterizer):
    """Decoupoly leaves: not provided (raises when called)."""

    def forward(self, *args, **kwargs):
        raise NotImplementedError("diffoctreerast.OctreeDecoupolyRasterizer is not provided by the sam3d patches "
                                  "stand-in (no model of this project produces decoupoly octrees); install "
                                  "diffoctreerast on CUDA")


def _build():
    return [make("diffoctreerast", __doc__, OctreeVoxelRasterizer=OctreeVoxelRasterizer,
                 OctreeGaussianRasterizer=OctreeGaussianRasterizer, OctreeTrivecRasterizer=OctreeTrivecRasterizer,
                 OctreeDecoupolyRasterizer=OctreeDecoupolyRasterizer, __version__="0.0+sam3d-shim")]


def install(replace_installed: bool = False) -> str:
    return install_shim("diffoctreerast", _build, replace_installed)


def uninstall() -> None:
    drop("diffoctreerast", only_shims=True)
