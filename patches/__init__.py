"""Runtime shims so unmodified CUDA-era research code runs on MPS/CPU.

This is the only package of the project that patches other modules, and nothing is patched on import::

    import patches
    patches.apply()                 # before importing the research code
    print(patches.report())         # what was replaced, and why
    ...                             # torch.zeros(..., device="cuda"), x.cuda(), import spconv, flash_attn, ...
    patches.remove()                # everything back as it was

or, for a script: ``python -m patches run script.py [args]``.

Each shim is independent (a keyword of :func:`apply` turns it off):

- ``cuda_device``: explicit CUDA requests (factories' ``device=``, ``.to("cuda")``, ``.cuda()``, ``map_location``,
  safetensors ``device=``) go to ``$SAM3D_DEVICE`` if set, else MPS, else CPU; ``pin_memory()`` is a no-op
  (:mod:`patches.device_shim`).
- ``cuda``: ``torch.cuda`` queries that only log / size / sync no longer raise; CUDA autocast becomes the target's
  (:mod:`patches.cuda_shim`). ``torch.cuda.is_available()`` stays False.
- stand-ins for packages that do not import (the real package is kept when it imports, unless
  ``replace_installed=True``): ``spconv``, ``flash_attn`` (+ ``flash_attn_interface``), ``xformers``, ``triton``,
  ``pytorch3d``, ``kaolin``, ``gsplat``, ``nvdiffrast``, ``diffoctreerast``, ``diff_gaussian_rasterization``,
  ``vox2seq``, ``torchsparse``.
- ``torchvision``: kept when it imports, repaired when its compiled extension is broken, stand-in transforms when
  absent (:mod:`patches.torchvision_shim`).
- ``fixups``: targeted fix-ups of named upstream modules, applied to their syntax tree while they are imported,
  for the few places where upstream's own code crashes off-CUDA (:mod:`patches.fixups`; ``True``, ``False`` or the
  names to keep).

A real package that imports is never replaced (unless ``replace_installed=True``), and a real package must never
fail because of a stand-in: the ``triton`` stand-in lets torch record "no triton" first, so ``torch._dynamo`` /
``torch.compile`` (and a real torchvision, which imports them) keep working. :func:`report` says, for each
package, whether it is real, a stand-in or repaired, and why.

Shims import ``backends`` / ``sam3d_objects.render`` lazily, inside the functions that compute.
"""
from __future__ import annotations

import importlib
from typing import Iterable, Optional, Union

import torch

_STANDINS = {  # name -> (module of the shim, what it replaces and why)
    "spconv": ("spconv_shim", "submanifold sparse convs via backends.sparse_conv3d (spconv ships CUDA builds)"),
    "flash_attn": ("flash_attn_shim", "flash_attn / flash_attn_interface functions via backends attention "
                                      "(CUDA-only package)"),
    "xformers": ("xformers_shim", "memory_efficient_attention via backends attention (CUDA-only package)"),
    "triton": ("triton_shim", "import and @triton.jit definitions work; a kernel launch raises (needs a GPU)"),
    "pytorch3d": ("pytorch3d_shim", "transforms, structures (Meshes, Pointclouds), cameras, ray bundles, plotly_vis "
                                    "helpers and the soft silhouette renderer through backends.soft_rasterize "
                                    "(pytorch3d has no wheels for recent torch)"),
    "kaolin": ("kaolin_shim", "utils.testing.check_tensor and render.camera's pinhole cameras (CUDA builds)"),
    "gsplat": ("gsplat_shim", "rasterization() through the project's splat renderer (gsplat compiles CUDA kernels)"),
    "nvdiffrast": ("nvdiffrast_shim", "rasterize/interpolate/texture/antialias through backends.rasterize "
                                      "(CUDA/OpenGL-only package)"),
    "diffoctreerast": ("diffoctreerast_shim", "octree voxel/gaussian/trivec rasterisers through the project's octree "
                                              "ray marcher (CUDA-only package)"),
    "diff_gaussian_rasterization": ("diff_gaussian_rasterization_shim", "GaussianRasterizer through the project's "
                                                                        "splat renderer (CUDA-only package)"),
    "vox2seq": ("vox2seq_shim", "encode(): z-order / Hilbert codes of voxel coordinates in PyTorch (CUDA-only "
                                "package)"),
    "torchsparse": ("torchsparse_shim", "the SparseTensor container (torchsparse compiles CUDA kernels)"),
}
_APPLIED: dict = {}


def _shim(name: str):
    return importlib.import_module(f"{__name__}.{name}")


def apply(spconv: bool = True, flash_attn: bool = True, xformers: bool = True, triton: bool = True,
          pytorch3d: bool = True, kaolin: bool = True, gsplat: bool = True, nvdiffrast: bool = True,
          diffoctreerast: bool = True, diff_gaussian_rasterization: bool = True, vox2seq: bool = True,
          torchsparse: bool = True,
          cuda: bool = True, cuda_device: bool = True, torchvision: bool = True, replace_installed: bool = False,
          device: Optional[torch.device | str] = None, fixups: Union[bool, Iterable[str]] = True,
          hub: bool = True, utils3d: bool = True) -> dict:
    """Install the requested shims; returns ``{name: "shim" | "real" | "off"}`` saying what each name now is
    ("real": the genuine package or CUDA is used; for torchvision "repaired" when its broken build was fixed).

    ``device``: where CUDA requests go when CUDA is absent (default: ``$SAM3D_DEVICE`` / the backends default
    device, else MPS if available, else CPU: ``backends.device.redirect_target()``).
    ``hub``: ``torch.hub.load("facebookresearch/dinov2", ...)`` not in torch.hub's cache is built locally instead of
    downloaded (:mod:`patches.hub_shim`).
    ``fixups``: ``True`` (all), ``False`` (none) or the names of the :mod:`patches.fixups` entries to apply; their
    state is in :func:`fixup_status` and :func:`report`.
    """
    _shim("sam3_video")  # registers SAM 3's video-predictor entries with patches.fixups
    _shim("fixups").install(fixups)  # first: an unknown fix-up name fails before anything is patched
    wanted = dict(spconv=spconv, flash_attn=flash_attn, xformers=xformers, triton=triton, pytorch3d=pytorch3d,
                  kaolin=kaolin, gsplat=gsplat, nvdiffrast=nvdiffrast, diffoctreerast=diffoctreerast,
                  diff_gaussian_rasterization=diff_gaussian_rasterization, vox2seq=vox2seq, torchsparse=torchsparse)
    state = {}
    for name, on in wanted.items():
        state[name] = _shim(_STANDINS[name][0]).install(replace_installed) if on else "off"
    if state["spconv"] == "real" and _shim("spconv_repair").install() and not torch.cuda.is_available():
        state["spconv"] = "repaired"  # the real build, with its CPU path's eval-mode bias refusal worked around
        # (on a CUDA machine the repair is in place for CPU features too, but CUDA features never reach it)
    state["cuda_device"] = _shim("device_shim").install(device) if cuda_device else "off"
    state["cuda"] = _shim("cuda_shim").install(device) if cuda else "off"
    if torchvision:
        tv = _shim("torchvision_shim")
        state["torchvision"] = "shim" if tv.install() == "shim" else ("repaired" if tv.repaired() else "real")
    else:
        state["torchvision"] = "off"
    state["torch_hub"] = _shim("hub_shim").install() if hub else "off"
    if utils3d:
        u3d = _shim("utils3d_compat").install()
        if u3d != "absent":
            state["utils3d"] = u3d
    _APPLIED.clear()
    _APPLIED.update(state)
    return dict(state)


def remove() -> None:
    """Undo :func:`apply`: stand-in modules leave ``sys.modules``, torch functions and methods are restored."""
    for module, _ in _STANDINS.values():
        _shim(module).uninstall()
    for module in ("device_shim", "cuda_shim", "torchvision_shim", "fixups", "spconv_repair", "hub_shim",
                   "utils3d_compat"):
        _shim(module).uninstall()
    _APPLIED.clear()


_WHY = {
    "cuda_device": "explicit CUDA device requests (device='cuda', .to/.cuda(), torch.load map_location, safetensors "
                   "device=) -> {target}; pin_memory() is a no-op, because CUDA is absent",
    "cuda": "torch.cuda.current_device/set_device/get_device_name/get_device_properties/synchronize/empty_cache/"
            "mem_get_info answer for {target} instead of raising; CUDA autocast -> {target} autocast; "
            "is_available() still False",
    "spconv": {"repaired": "the installed spconv{version} is used; its CPU path refuses a conv bias in eval mode "
                           "(fused only in CUDA kernels): such calls run with training=True for that call, where "
                           "spconv adds the bias after the GEMM (same sum). Use OMP_NUM_THREADS=1 with spconv's CPU "
                           "build (its multi-threaded submanifold conv is unreliable on large inputs)"},
    "torch_hub": "torch.hub.load('facebookresearch/dinov2', ...) when that repository is not in torch.hub's cache: "
                 "the same architecture built locally (patches/hub/dinov2/hubconf.py), no download, no pretrained "
                 "weights (SAM 3D loads its checkpoint over them); a cached repository is used as it is",
    "utils3d": "the installed utils3d{version} renamed functions of the earlier API upstream imports: depth_edge, "
               "normals_edge, points_to_normals, image_uv, image_mesh added to utils3d.numpy as adapters onto "
               "depth_map_edge, normal_map_edge, point_map_to_normal_map, uv_map, build_mesh_from_map",
    "torchvision": {"repaired": "installed torchvision's C++ extension does not load: torchvision::nms/qnms "
                                "schemas defined so its pure-Python parts import",
                    "shim": "torchvision does not import: stand-in transforms (Compose, Resize, Normalize, "
                            "CenterCrop, RandomResizedCrop, Lambda, functional.resize/crop)"},
}


def fixup_status() -> dict:
    """``{fix-up name: "applied (path)" | "skipped: why" | "waiting" | "off" | ...}`` (see :mod:`patches.fixups`)."""
    return _shim("fixups").status()


def _package_version(name: str) -> str:
    import sys

    version = getattr(sys.modules.get(name), "__version__", None)
    return f" {version}" if isinstance(version, str) else ""


def report() -> str:
    """What :func:`apply` did, one line per package / shim / fix-up: ``real`` (the installed package or CUDA is
    used, untouched), ``stand-in`` (the package does not import here: the reason is given), ``repaired`` (the
    installed package is used after a repair), ``shim`` (torch's CUDA entry points answered for another device),
    ``off``; then each upstream fix-up and its state."""
    if not _APPLIED:
        return "patches: nothing applied"
    from ._modules import IMPORT_ERRORS

    target = "cpu"
    if _APPLIED.get("cuda_device") == "shim":
        target = str(_shim("device_shim").target())
    lines = []
    for name, status in _APPLIED.items():
        if status == "off":
            label, why = "off", "not patched (turned off)"
        elif name == "spconv" and status == "repaired":
            label, why = "repaired", _WHY["spconv"]["repaired"].format(version=_package_version("spconv"))
        elif name in _STANDINS:
            if status == "real":
                label, why = "real", f"the installed package{_package_version(name)} imports: used as it is"
            else:
                reason = IMPORT_ERRORS.get(name, "replace_installed=True")
                label, why = "stand-in", f"{_STANDINS[name][1]}; real package: {reason}"
        elif name == "torchvision":
            label = {"shim": "stand-in", "repaired": "repaired", "real": "real"}[status]
            why = _WHY["torchvision"].get(status, f"the installed torchvision{_package_version(name)} imports")
        elif status == "real":
            label, why = "real", "CUDA is available: torch's own CUDA is used"
        elif name == "utils3d":
            label = status
            why = (_WHY[name].format(version=_package_version("utils3d")) if status == "repaired"
                   else "the installed utils3d has every name upstream imports")
        elif name == "torch_hub":
            label, why = "stand-in", _WHY[name]
        else:
            label, why = "shim", _WHY[name].format(target=target)
        lines.append(f"{name:12s} {label:9s} {why}")
    fixups = _shim("fixups")
    for name, state in fixups.status().items():
        lines.append(f"fix-up {name} [{fixups.FIXUPS[name].module}]: {state}; {fixups.FIXUPS[name].description}")
    return "\n".join(lines)
