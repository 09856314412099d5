"""``diff_gaussian_rasterization`` stand-in: the 3D Gaussian Splatting rasteriser through the project's splat
renderer (``backends.splat.render_gaussians``).

Why: the package is a CUDA extension; upstream's gaussian renderer ("inria" backend) builds
``GaussianRasterizationSettings(...)`` and calls ``GaussianRasterizer(raster_settings)(means3D=..., means2D=...,
shs=... or colors_precomp=..., opacities=..., scales=..., rotations=... or cov3D_precomp=...)``, getting
``(image [3, H, W], radii [N])``. Conventions are the rasteriser's: ``viewmatrix`` is world-to-camera^T (camera x
right, y down, z forward), ``projmatrix`` = (projection @ world-to-camera)^T; the pixel of a point is
``((ndc + 1) * size - 1) / 2`` (pixel centres at integers), so the principal point comes from the projection and
the focal length from ``tanfovx/y`` (``size / (2 tan)``); ``kernel_size`` (when given, else 0.3) is added to the
2D covariance; colours are ``max(0, 0.5 + C0 * sh_0)`` for degree-0 SH or ``colors_precomp``; quaternions are
(w, x, y, z); ``cov3D_precomp`` rows are the upper triangles (xx, xy, xz, yy, yz, zz). SH degrees above 0 raise.
"""
from __future__ import annotations

from typing import Optional

import torch

from ._modules import drop, install_shim, make

_FIELDS = ("image_height", "image_width", "tanfovx", "tanfovy", "bg", "scale_modifier", "viewmatrix",
           "projmatrix", "sh_degree", "campos", "prefiltered", "debug", "kernel_size", "subpixel_offset",
           "antialiasing")


class GaussianRasterizationSettings:
    """The rasteriser's settings (keyword arguments; forks add ``kernel_size``, ``subpixel_offset``, ...)."""

    def __init__(self, image_height: int, image_width: int, tanfovx: float, tanfovy: float, bg: torch.Tensor,
                 scale_modifier: float, viewmatrix: torch.Tensor, projmatrix: torch.Tensor, sh_degree: int,
                 campos: torch.Tensor, prefiltered: bool = False, debug: bool = False,
                 kernel_size: Optional[float] = None, subpixel_offset=None, antialiasing: bool = False, **extra):
        self.image_height, self.image_width, self.tanfovx, self.tanfovy = image_height, image_width, tanfovx, tanfovy
        self.bg, self.scale_modifier, self.viewmatrix, self.projmatrix = bg, scale_modifier, viewmatrix, projmatrix
        self.sh_degree, self.campos, self.prefiltered, self.debug = sh_degree, campos, prefiltered, debug
        self.kernel_size, self.subpixel_offset, self.antialiasing = kernel_size, subpixel_offset, antialiasing
        self.extra = extra

    def _replace(self, **changes) -> "GaussianRasterizationSettings":
        values = {name: getattr(self, name) for name in _FIELDS}
        values.update(changes)
        return GaussianRasterizationSettings(**values, **self.extra)


def _strip_to_matrix(cov6: torch.Tensor) -> torch.Tensor:
    xx, xy, xz, yy, yz, zz = cov6.unbind(-1)
    return torch.stack([xx, xy, xz, xy, yy, yz, xz, yz, zz], -1).reshape(-1, 3, 3)


def _camera(s: GaussianRasterizationSettings, device):
    from backends.splat import Camera

    w, h = int(s.image_width), int(s.image_height)
    view = s.viewmatrix.to(device=device, dtype=torch.float32)
    world_to_camera = view.T
    proj = s.projmatrix.to(device=device, dtype=torch.float32).T @ torch.inverse(world_to_camera)
    # ndc x = P00 x / z + P02 -> pixel ((ndc + 1) w - 1) / 2, i.e. (ndc + 1) w / 2 with centres at + 0.5
    cx, cy = float(proj[0, 2] + 1) * w / 2, float(proj[1, 2] + 1) * h / 2
    fx, fy = w / (2 * float(s.tanfovx)), h / (2 * float(s.tanfovy))
    return Camera(world_to_camera=world_to_camera, fx=fx, fy=fy, cx=cx, cy=cy, width=w, height=h)


class GaussianRasterizer(torch.nn.Module):
    def __init__(self, raster_settings: GaussianRasterizationSettings):
        super().__init__()
        self.raster_settings = raster_settings

    def markVisible(self, positions: torch.Tensor) -> torch.Tensor:  # noqa: N802 (the package's name)
        """Whether each point is in front of the camera's near plane (0.2, as the rasteriser's frustum test)."""
        cam = positions @ self.raster_settings.viewmatrix[:3, :3].to(positions) + \
            self.raster_settings.viewmatrix[3, :3].to(positions)
        return cam[:, 2] > 0.2

    def forward(self, means3D, means2D=None, opacities=None, shs=None, colors_precomp=None, scales=None,  # noqa: N803
                rotations=None, cov3D_precomp=None):  # noqa: N803
        from backends.splat import SH_C0, covariance_from_scale_rotation, project_gaussians, render_gaussians

        s = self.raster_settings
        if (shs is None) == (colors_precomp is None):
            raise ValueError("Please provide exactly one of either SHs or precomputed colors!")
        if (scales is None or rotations is None) and cov3D_precomp is None:
            raise ValueError("Please provide exactly one of either scale/rotation pair or precomputed 3D covariance!")
        if colors_precomp is None:
            if int(s.sh_degree) != 0:
                raise NotImplementedError(f"diff_gaussian_rasterization stand-in: sh_degree={s.sh_degree} is not "
                                          "provided (only 0)")
            colors = (0.5 + SH_C0 * shs.reshape(shs.shape[0], -1, 3)[:, 0]).clamp_min(0.0)
        else:
            colors = colors_precomp
        if cov3D_precomp is not None:
            cov = _strip_to_matrix(cov3D_precomp)
        else:
            cov = covariance_from_scale_rotation(scales * float(s.scale_modifier), rotations)
        camera = _camera(s, means3D.device)
        blur = 0.3 if s.kernel_size is None else float(s.kernel_size)
        bg = torch.as_tensor(s.bg, device=means3D.device, dtype=torch.float32).reshape(-1)[:3]
        out = render_gaussians(means3D, cov, colors, opacities.reshape(-1), camera, background=bg, blur=blur)
        proj = project_gaussians(means3D.detach().float(), cov.detach().float(), camera, blur=blur)
        radii = torch.where(proj.valid, torch.ceil(proj.radii), torch.zeros_like(proj.radii)).int()
        return out.color.permute(2, 0, 1), radii


def _build():
    return [make("diff_gaussian_rasterization", __doc__, GaussianRasterizationSettings=GaussianRasterizationSettings,
                 GaussianRasterizer=GaussianRasterizer, __version__="0.0+sam3d-shim")]


def install(replace_installed: bool = False) -> str:
    return install_shim("diff_gaussian_rasterization", _build, replace_installed)


def uninstall() -> None:
    drop("diff_gaussian_rasterization", only_shims=True)
