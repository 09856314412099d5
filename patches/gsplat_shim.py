"""``gsplat`` stand-in: ``rasterization`` through the project's pure-PyTorch splat renderer.

Why: gsplat compiles CUDA kernels; SAM 3D's notebook renders its gaussians with ``gsplat.rasterization``. The
stand-in takes gsplat's arguments (means [N, 3], quats [N, 4] (w, x, y, z), scales [N, 3], opacities [N],
colors [N, 3] or SH coefficients [N, K, 3] with ``sh_degree`` 0, viewmats [C, 4, 4] world-to-camera, Ks [C, 3, 3],
width, height, backgrounds [C, 3] or one colour [3] for every camera (gsplat broadcasts it), eps2d) and renders
each camera with the project's splat renderer (``backends.splat.render_gaussians``, imported on use): EWA
projection, ``eps2d`` added to the 2D covariance, 3-sigma footprints, front-to-back compositing with
``alpha = min(0.99, o exp(-q/2))`` and ``alpha < 1/255`` skipped. Returns (colors [C, H, W, 3], alphas
[C, H, W, 1], meta) like gsplat. SH degrees above 0, ``render_mode`` other than "RGB"/"RGB+D"/"RGB+ED",
``rasterize_mode="antialiased"`` and packed/sparse gradients are not provided and raise.
"""
from __future__ import annotations

from typing import Optional

import torch

from ._modules import drop, install_shim, make


def _colors(colors: torch.Tensor, sh_degree: Optional[int]) -> torch.Tensor:
    if sh_degree is None:
        return colors
    if sh_degree != 0:
        raise NotImplementedError(f"gsplat stand-in: sh_degree={sh_degree} is not provided (only 0 / None)")
    from backends.splat import SH_C0

    return (0.5 + SH_C0 * colors[:, 0]).clamp_min(0.0)  # gsplat: max(0, SH(dir) + 0.5)


def _background(backgrounds, camera: int, means: torch.Tensor) -> torch.Tensor:
    """Camera ``camera``'s background: ``backgrounds`` [C, 3] per camera, or [3] (or [1, 3]) broadcast over the
    cameras as gsplat's compositing broadcasts it; black when None."""
    if backgrounds is None:
        return torch.zeros(3, dtype=means.dtype, device=means.device)
    bg = torch.as_tensor(backgrounds, dtype=means.dtype, device=means.device)
    if bg.dim() == 1:
        return bg
    return bg[camera] if bg.shape[0] > 1 else bg[0]


def rasterization(means, quats, scales, opacities, colors, viewmats, Ks, width: int, height: int,
                  near_plane: float = 0.01, far_plane: float = 1e10, radius_clip: float = 0.0, eps2d: float = 0.3,
                  sh_degree: Optional[int] = None, packed: bool = True, tile_size: int = 16, backgrounds=None,
                  render_mode: str = "RGB", rasterize_mode: str = "classic", **unused):
    from backends.splat import Camera, covariance_from_scale_rotation, render_gaussians

    if render_mode not in ("RGB", "RGB+D", "RGB+ED"):
        raise NotImplementedError(f"gsplat stand-in: render_mode={render_mode!r} is not provided")
    if rasterize_mode != "classic":
        raise NotImplementedError("gsplat stand-in: only rasterize_mode='classic' is provided")
    rgb = _colors(colors, sh_degree)
    cov = covariance_from_scale_rotation(scales, quats)
    images, alphas = [], []
    for c in range(viewmats.shape[0]):
        K = Ks[c]
        camera = Camera(world_to_camera=viewmats[c], fx=float(K[0, 0]), fy=float(K[1, 1]), cx=float(K[0, 2]),
                        cy=float(K[1, 2]), width=int(width), height=int(height))
        bg = _background(backgrounds, c, means)
        out = render_gaussians(means, cov, rgb, opacities, camera, background=bg, blur=eps2d, tile_size=tile_size)
        image = out.color
        if render_mode != "RGB":
            image = torch.cat([image, out.depth[..., None] * (out.alpha[..., None] if render_mode == "RGB+D" else 1)],
                              -1)
        images.append(image)
        alphas.append(out.alpha[..., None])
    meta = {"width": int(width), "height": int(height), "tile_size": tile_size, "n_cameras": viewmats.shape[0]}
    return torch.stack(images), torch.stack(alphas), meta


def _build():
    rendering = make("gsplat.rendering", __doc__, rasterization=rasterization)
    root = make("gsplat", __doc__, rasterization=rasterization, rendering=rendering, __version__="1.0+sam3d-shim")
    return [root, rendering]


def install(replace_installed: bool = False) -> str:
    return install_shim("gsplat", _build, replace_installed)


def uninstall() -> None:
    drop("gsplat", only_shims=True)
