"""``kaolin`` stand-in: the subset SAM 3D code touches.

Why: kaolin ships CUDA builds only for specific torch versions; SAM 3D imports it for input assertions
(``kaolin.utils.testing.check_tensor``) and, in its notebook helper, for a turntable visualiser and camera classes
it never uses. ``check_tensor`` is implemented; ``kaolin.visualize`` / ``kaolin.render.camera`` names import, and
constructing one raises an error that names kaolin.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ._modules import drop, install_shim, make


def check_tensor(tensor: torch.Tensor, shape: Optional[Sequence[Optional[int]]] = None,
                 dtype: Optional[torch.dtype] = None, device=None, throw: bool = True) -> bool:
    """Whether ``tensor`` has ``shape`` (None entries match any size), ``dtype`` and ``device``; with ``throw``
    a mismatch raises ValueError instead of returning False."""
    problem = None
    if shape is not None:
        if len(shape) != tensor.dim() or any(s is not None and s != t for s, t in zip(shape, tensor.shape)):
            problem = f"tensor shape is {tuple(tensor.shape)}, should be {tuple(shape)}"
    if problem is None and dtype is not None and tensor.dtype != dtype:
        problem = f"tensor dtype is {tensor.dtype}, should be {dtype}"
    if problem is None and device is not None and tensor.device != torch.device(device):
        problem = f"tensor device is {tensor.device}, should be {device}"
    if problem is not None and throw:
        raise ValueError(problem)
    return problem is None


def _import_only(qualname: str):
    class ImportOnly:
        def __init__(self, *args, **kwargs):
            raise NotImplementedError(f"{qualname} is only importable through the sam3d patches kaolin stand-in; "
                                      f"install kaolin (CUDA) to use it")
    ImportOnly.__name__ = ImportOnly.__qualname__ = qualname.rsplit(".", 1)[-1]
    return ImportOnly


def _build():
    testing = make("kaolin.utils.testing", __doc__, check_tensor=check_tensor)
    utils = make("kaolin.utils", __doc__, testing=testing)
    visualize = make("kaolin.visualize", __doc__, **{n: _import_only(f"kaolin.visualize.{n}") for n in (
        "IpyTurntableVisualizer", "IpyFlyingVisualizer")})
    camera = make("kaolin.render.camera", __doc__, **{n: _import_only(f"kaolin.render.camera.{n}") for n in (
        "Camera", "CameraExtrinsics", "CameraIntrinsics", "PinholeIntrinsics", "OrthographicIntrinsics")})
    render = make("kaolin.render", __doc__, camera=camera)
    root = make("kaolin", __doc__, utils=utils, visualize=visualize, render=render, __version__="0.0+sam3d-shim")
    return [root, utils, testing, visualize, render, camera]


def install(replace_installed: bool = False) -> str:
    return install_shim("kaolin", _build, replace_installed)


def uninstall() -> None:
    drop("kaolin", only_shims=True)
