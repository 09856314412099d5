"""``nvdiffrast.torch`` stand-in: ``rasterize``, ``interpolate``, ``texture``, ``antialias`` through
``backends.rasterize`` (the project's one triangle rasteriser, shared with mesh post-processing).

Why: nvdiffrast needs CUDA or OpenGL; SAM 3D bakes textures and renders meshes with it. Conventions are
nvdiffrast's (clip-space ``pos`` [B, V, 4], ``tri`` [F, 3] int32, ``rast`` [B, H, W, 4] = (u, v, z/w,
triangle_id + 1), row 0 at the bottom), so the results feed the calling code unchanged.

Differences, knowingly: ``rasterize`` returns an all-zero ``rast_db`` (no screen-space derivatives), so
``interpolate(..., diff_attrs=...)`` returns zero derivatives and ``texture`` has no mip-mapping ("auto" and the
mipmap filter modes sample bilinearly, level 0); ``antialias`` returns the colour unchanged (no edge
antialiasing); ``ranges`` (instanced mode with per-batch triangle ranges) is not provided and raises.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ._modules import drop, install_shim, make


class RasterizeContext:
    """Stands for ``RasterizeCudaContext`` / ``RasterizeGLContext``: holds nothing (no GPU state is needed)."""

    def __init__(self, output_db: bool = True, mode: str = "automatic", device=None):
        self.output_db, self.device = output_db, device


def rasterize(glctx, pos: torch.Tensor, tri: torch.Tensor, resolution: Sequence[int],
              ranges: Optional[torch.Tensor] = None, grad_db: bool = True):
    """-> (rast [B, H, W, 4], rast_db [B, H, W, 4] of zeros)."""
    from backends import rasterize as raster

    if ranges is not None:
        raise NotImplementedError("nvdiffrast stand-in: rasterize(ranges=...) (instanced range mode) is not provided")
    rast = raster.rasterize(pos, tri, resolution)
    return rast, torch.zeros_like(rast)


def interpolate(attr: torch.Tensor, rast: torch.Tensor, tri: torch.Tensor, rast_db=None, diff_attrs=None):
    """-> (attributes [B, H, W, C], derivatives: zeros [B, H, W, 2 * len(diff_attrs)] or an empty tensor)."""
    from backends import rasterize as raster

    out = raster.interpolate(attr, rast, tri)
    if diff_attrs is None:
        return out, torch.empty(0, dtype=out.dtype, device=out.device)
    n = out.shape[-1] if diff_attrs == "all" else len(diff_attrs)
    return out, out.new_zeros((*out.shape[:-1], 2 * n))


def texture(tex: torch.Tensor, uv: torch.Tensor, uv_da=None, mip_level_bias=None, mip=None,
            filter_mode: str = "auto", boundary_mode: str = "wrap", max_mip_level=None) -> torch.Tensor:
    from backends import rasterize as raster

    if boundary_mode not in ("wrap", "clamp"):
        raise NotImplementedError(f"nvdiffrast stand-in: boundary_mode={boundary_mode!r} is not provided "
                                  "(wrap, clamp)")
    mode = "nearest" if filter_mode == "nearest" else "linear"  # no mip pyramid: mipmap modes sample level 0
    return raster.texture(tex, uv, filter_mode=mode, boundary_mode=boundary_mode)


def antialias(color: torch.Tensor, rast: torch.Tensor, pos: torch.Tensor, tri: torch.Tensor, topology_hash=None,
              pos_gradient_boost: float = 1.0) -> torch.Tensor:
    """No edge antialiasing: the colour is returned as is."""
    return color


def _build():
    api = dict(RasterizeCudaContext=RasterizeContext, RasterizeGLContext=RasterizeContext, rasterize=rasterize,
               interpolate=interpolate, texture=texture, antialias=antialias)
    torch_mod = make("nvdiffrast.torch", __doc__, **api)
    root = make("nvdiffrast", __doc__, torch=torch_mod, __version__="0.3+sam3d-shim")
    return [root, torch_mod]


def install(replace_installed: bool = False) -> str:
    return install_shim("nvdiffrast", _build, replace_installed)


def uninstall() -> None:
    drop("nvdiffrast", only_shims=True)
