"""Runtime shims so unmodified CUDA-era research code runs on MPS/CPU through ``backends``.

This is the only package of the project that patches other modules, and nothing is patched on import::

    import patches
    patches.apply()                 # before importing the research code
    import spconv.pytorch as spconv # -> backends.sparse_conv3d
    from flash_attn import flash_attn_varlen_func      # -> backends.varlen_attention
    import xformers.ops as xops     # memory_efficient_attention -> backends
    model.cuda(); x.cuda()          # -> the default device (cuda > mps > cpu) when CUDA is absent
    with torch.autocast("cuda"): ...  # -> autocast of the default device, or a null context

``apply()`` installs a shim only for a package that does not import, unless ``replace_installed=True`` (e.g. to
route an installed CPU spconv, which is only correct single-threaded, through ``backends``). The shims are small
and cover what SAM 3D / TRELLIS-style code calls; anything else raises an error naming the missing piece.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import cuda_shim, flash_attn_shim, spconv_shim, xformers_shim
from .torchvision_shim import install as install_torchvision

_SHIMS = {"spconv": spconv_shim, "flash_attn": flash_attn_shim, "xformers": xformers_shim}


def apply(spconv: bool = True, flash_attn: bool = True, xformers: bool = True, cuda: bool = True,
          torchvision: bool = True, replace_installed: bool = False,
          device: Optional[torch.device | str] = None) -> dict:
    """Install the requested shims; returns ``{name: "shim" | "real" | "off"}`` saying what each name now is.

    ``device``: where ``.cuda()`` sends tensors and modules when CUDA is absent (default: the default device).
    """
    state = {}
    for name, wanted in (("spconv", spconv), ("flash_attn", flash_attn), ("xformers", xformers)):
        state[name] = _SHIMS[name].install(replace_installed) if wanted else "off"
    state["cuda"] = cuda_shim.install(device) if cuda else "off"
    state["torchvision"] = ("real" if install_torchvision() == "torchvision" else "shim") if torchvision else "off"
    return state


def remove() -> None:
    """Undo :func:`apply` (shim modules are dropped from ``sys.modules``; torch methods restored)."""
    for shim in _SHIMS.values():
        shim.uninstall()
    cuda_shim.uninstall()
