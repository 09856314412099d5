"""Make ``torchvision.transforms.Compose`` / ``Resize`` resolvable when torchvision itself does not import.

Why: the official ``pipeline.yaml`` (and every script that instantiates it with ``hydra.utils.instantiate``) names
``_target_: torchvision.transforms.Compose`` and ``torchvision.transforms.Resize``. Hydra resolves a target by
importing its module, so without torchvision the yaml cannot be instantiated at all. torchvision is optional for
this project: its only builds for recent torch are CUDA builds whose extension fails to load on CPU-only torch.

Mechanism: ``install()`` first tries the real ``import torchvision.transforms``; if that works nothing is changed
and hydra uses torchvision. If it fails (not installed, or a broken binary build raising any exception), the
half-imported ``torchvision*`` entries are dropped from ``sys.modules`` and two small placeholder modules
``torchvision`` and ``torchvision.transforms`` are registered there, exposing only ``Compose``, ``Resize`` and
``InterpolationMode`` from ``sam3d_objects.data.transforms`` (identical results on tensors: bilinear with
antialias, torch ``nearest``). The placeholder is marked ``__sam3d_torchvision_shim__ = True``; any other
attribute raises an ``AttributeError`` that says torchvision is not installed, so code probing for torchvision
features fails loudly instead of silently. ``install()`` is idempotent and is called when ``sam3d_objects.data``
or ``sam3d_objects.pipeline`` is imported (hydra imports the PreProcessor / pipeline target, and with it this
shim, before it resolves the nested torchvision targets).
"""
from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types

_SHIM_FLAG = "__sam3d_torchvision_shim__"
_state = {"result": None}


class _ShimModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"{self.__name__}.{name} is not available: torchvision does not import on this "
                             f"machine, and sam3d_objects only provides Compose, Resize and InterpolationMode in "
                             f"its place. Install a torchvision build matching your torch to use {name}.")


def real_torchvision_available() -> bool:
    mod = sys.modules.get("torchvision")
    if mod is not None:
        return not getattr(mod, _SHIM_FLAG, False)
    try:
        importlib.import_module("torchvision.transforms")
        return True
    except Exception:  # noqa: BLE001  a broken CUDA build raises RuntimeError, not ImportError
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        return False


def install() -> str:
    """Returns "torchvision" when the real package is used, "shim" when the placeholder was registered."""
    if _state["result"] is not None:
        return _state["result"]
    if real_torchvision_available():
        _state["result"] = "torchvision"
        return "torchvision"
    from sam3d_objects.data import transforms as ours

    root = _ShimModule("torchvision", "placeholder for torchvision (see patches/torchvision_shim.py)")
    sub = _ShimModule("torchvision.transforms", "Compose/Resize equivalents from sam3d_objects.data.transforms")
    for mod in (root, sub):
        setattr(mod, _SHIM_FLAG, True)
        mod.__path__ = []  # a package, so "torchvision.transforms" resolves as a submodule
        # a spec, so importlib.util.find_spec() on the placeholder answers instead of raising ValueError
        mod.__spec__ = importlib.machinery.ModuleSpec(mod.__name__, None, is_package=True)
    sub.Compose, sub.Resize, sub.InterpolationMode = ours.Compose, ours.Resize, ours.InterpolationMode
    root.transforms = sub
    sys.modules["torchvision"], sys.modules["torchvision.transforms"] = root, sub
    _state["result"] = "shim"
    return "shim"


def uninstall() -> None:
    """Remove the placeholder (tests use this to check both paths)."""
    for name in ("torchvision.transforms", "torchvision"):
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, _SHIM_FLAG, False):
            del sys.modules[name]
    _state["result"] = None
