"""Upstream's ``renderers.gaussian_render``: render a ``Gaussian`` from OpenCV extrinsics and normalised intrinsics.

Upstream rasterises with gsplat or the Inria CUDA rasteriser; here both ``backend`` names run the project's
pure-PyTorch EWA splat renderer (``sam3d_objects.render.render_gaussians``: 2D covariance + 0.3 px^2,
3-sigma footprint, front-to-back compositing, alpha in [1/255, 0.99]), which reproduces gsplat's classic mode on
any device. Colours come from the spherical harmonics of ``active_sh_degree`` as ``max(0, 0.5 + SH(dir))``.
"""
from __future__ import annotations

import math
import weakref
from typing import Any, Dict, Optional

import numpy as np
import torch
import torch.nn.functional as F

from sam3d_objects.render import Camera, covariance_from_scale_rotation, render_gaussians

from .sh_utils import eval_sh

__all__ = ["intrinsics_to_projection", "render", "GaussianRenderer"]

BACKENDS = ("inria", "gsplat")


class AttrDict(dict):
    """A dict whose keys read and write as attributes (upstream passes ``EasyDict`` objects around)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value


def intrinsics_to_projection(intrinsics: torch.Tensor, near: float, far: float) -> torch.Tensor:
    """OpenGL-style 4x4 projection (depth mapped to [0, 1], w = camera z) of normalised OpenCV intrinsics."""
    fx, fy = intrinsics[0, 0], intrinsics[1, 1]
    cx, cy = intrinsics[0, 2], intrinsics[1, 2]
    proj = torch.zeros((4, 4), dtype=intrinsics.dtype, device=intrinsics.device)
    proj[0, 0] = 2 * fx
    proj[1, 1] = 2 * fy
    proj[0, 2] = 2 * cx - 1
    proj[1, 2] = -2 * cy + 1
    proj[2, 2] = far / (far - near)
    proj[2, 3] = near * far / (near - far)
    proj[3, 2] = 1.0
    return proj


def _pixel_camera(extrinsics: torch.Tensor, intrinsics: torch.Tensor, width: int, height: int) -> Camera:
    """Our renderer's camera: normalised intrinsics scaled by the image size (cx = W/2 is the image centre)."""
    k = intrinsics.detach().double().cpu()
    return Camera(extrinsics.detach().float(), float(k[0, 0]) * width, float(k[1, 1]) * height,
                  float(k[0, 2]) * width, float(k[1, 2]) * height, int(width), int(height))


def _sh_colors(pc, camera_center: torch.Tensor) -> torch.Tensor:
    """Per-gaussian colour max(0, 0.5 + SH(view direction)) as the rasterisers evaluate it."""
    features = pc.get_features
    degree = int(getattr(pc, "active_sh_degree", 0))
    xyz = pc.get_xyz
    sh = features.transpose(1, 2)  # [N, 3, K]
    if degree == 0:  # the constant band: no view directions needed (a 1M-point normalisation every frame)
        return torch.clamp_min(eval_sh(0, sh, xyz) + 0.5, 0.0)
    dirs = F.normalize(xyz - camera_center.to(xyz).reshape(1, 3), dim=-1)
    return torch.clamp_min(eval_sh(degree, sh, dirs) + 0.5, 0.0)


# per Gaussian object: (the raw tensors and settings the covariances came from, the covariances)
_COVARIANCES: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()


def _covariances(pc, scaling_modifier: float) -> torch.Tensor:
    """World covariances of ``pc``'s gaussians. They do not depend on the camera, so the frames of a turntable
    (``render_frames``) compute them once: they are kept per Gaussian object while its ``_scaling`` and
    ``_rotation`` are the same tensors, unmodified in place, with the same activation settings (the cached entry
    holds those tensors, so a freed one cannot be mistaken for a new one at the same address)."""
    raw = (pc._scaling, pc._rotation)
    settings = (getattr(raw[0], "_version", None), getattr(raw[1], "_version", None), float(scaling_modifier),
                float(pc.mininum_kernel_size), getattr(pc, "scaling_activation_type", None),
                str(getattr(pc, "scale_bias", None)))
    try:
        cached = _COVARIANCES.get(pc)
    except TypeError:  # an object that cannot be weakly referenced: computed every time
        cached = ()
    if cached and cached[0][0] is raw[0] and cached[0][1] is raw[1] and cached[1] == settings:
        return cached[2]
    covs = covariance_from_scale_rotation(pc.get_scaling.detach() * scaling_modifier, pc.get_rotation.detach())
    if cached != ():
        _COVARIANCES[pc] = (raw, settings, covs)
    return covs


def render(viewpoint_camera, pc, pipe, bg_color: torch.Tensor, scaling_modifier: float = 1.0,
           override_color: Optional[torch.Tensor] = None, backend: str = "inria") -> AttrDict:
    """Render gaussians ``pc`` for ``viewpoint_camera`` (attributes ``image_height``, ``image_width``,
    ``world_view_transform`` = extrinsics^T, ``intrinsics`` normalised, ``camera_center``) -> {"render": [3, H, W]}
    (not clamped). ``pipe.kernel_size`` (Inria's mip filter) has no counterpart here: both backends splat like
    gsplat's classic mode."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown gaussian backend {backend!r}; expected one of {BACKENDS}")
    width, height = int(viewpoint_camera.image_width), int(viewpoint_camera.image_height)
    extrinsics = viewpoint_camera.world_view_transform.T
    camera = _pixel_camera(extrinsics, viewpoint_camera.intrinsics, width, height)
    means = pc.get_xyz.detach()
    covs = _covariances(pc, scaling_modifier)
    if override_color is not None:
        colors = override_color.detach().reshape(means.shape[0], 3)
    else:
        colors = _sh_colors(pc, viewpoint_camera.camera_center).detach()
    opacities = pc.get_opacity.detach().reshape(-1)
    background = torch.as_tensor(bg_color, dtype=torch.float32, device=means.device).reshape(3)
    result = render_gaussians(means.float(), covs.float(), colors.float(), opacities.float(), camera,
                              background=background)
    return AttrDict(render=result.color.permute(2, 0, 1))


class GaussianRenderer:
    """Upstream's renderer object: options ``resolution``, ``near``, ``far``, ``ssaa``, ``bg_color``
    ("random" = black or white at random, else an RGB triple in [0, 1]) and ``backend``."""

    def __init__(self, rendering_options: Dict[str, Any] = {}) -> None:  # noqa: B006  upstream's signature
        self.pipe = AttrDict(kernel_size=0.1, convert_SHs_python=False, compute_cov3D_python=False,
                             scale_modifier=1.0, debug=False)
        self.rendering_options = AttrDict(resolution=None, near=None, far=None, ssaa=1, bg_color="random",
                                          backend="inria")
        self.rendering_options.update(rendering_options)
        self.bg_color = None

    def render(self, gausssian, extrinsics: torch.Tensor, intrinsics: torch.Tensor,
               colors_overwrite: Optional[torch.Tensor] = None) -> AttrDict:
        """{"color": [3, resolution, resolution]} of ``gausssian`` (upstream's spelling) seen from OpenCV
        world-to-camera ``extrinsics`` [4, 4] with normalised ``intrinsics`` [3, 3]."""
        opts = self.rendering_options
        if opts.resolution is None or opts.near is None or opts.far is None:
            raise ValueError("GaussianRenderer needs rendering_options resolution, near and far")
        device = gausssian.get_xyz.device
        if isinstance(opts.bg_color, str) and opts.bg_color == "random":
            white = np.random.rand() < 0.5
            self.bg_color = torch.full((3,), 1.0 if white else 0.0, dtype=torch.float32, device=device)
        else:
            self.bg_color = torch.tensor(opts.bg_color, dtype=torch.float32, device=device)
        ssaa = int(opts.ssaa)
        side = int(opts.resolution) * ssaa
        fx, fy = float(intrinsics[0, 0]), float(intrinsics[1, 1])
        view = torch.as_tensor(extrinsics, dtype=torch.float32, device=device)
        camera = AttrDict(image_height=side, image_width=side, FoVx=2 * math.atan(0.5 / fx),
                          FoVy=2 * math.atan(0.5 / fy), znear=opts.near, zfar=opts.far,
                          world_view_transform=view.T.contiguous(),
                          projection_matrix=intrinsics_to_projection(torch.as_tensor(intrinsics).float(),
                                                                     opts.near, opts.far).T.to(device),
                          camera_center=torch.inverse(view)[:3, 3], intrinsics=intrinsics)
        camera.full_proj_transform = camera.world_view_transform @ camera.projection_matrix
        out = render(camera, gausssian, self.pipe, self.bg_color, scaling_modifier=self.pipe.scale_modifier,
                     override_color=colors_overwrite, backend=opts.backend)
        color = out.render
        if ssaa > 1:
            color = F.interpolate(color[None], size=(int(opts.resolution),) * 2, mode="bilinear",
                                  align_corners=False, antialias=True).squeeze()
        return AttrDict(color=color)
