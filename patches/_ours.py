"""This project's own modules for the stand-ins to compute with, whichever ``sam3d_objects`` is importable.

Why: a user runs Meta's package, whose top-level package is also named ``sam3d_objects``, through
``patches.apply()``. The stand-ins must then still reach this project's renderers, not Meta's modules (which
import the very packages being stood in for). :func:`module` imports the project's module normally when
``sam3d_objects`` is this project's, and otherwise loads it from this checkout's file under a private name
(``patches._ours.<dotted name with __>``), leaving ``sys.modules["sam3d_objects"]`` alone. Only modules that
import nothing from ``sam3d_objects`` at import time can be loaded this way (the renderers are such modules).
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def _project_is_importable() -> bool:
    """Whether ``import sam3d_objects`` gives this checkout's package."""
    current = sys.modules.get("sam3d_objects")
    origin = getattr(current, "__file__", None) if current is not None else None
    if current is None:
        try:
            spec = importlib.util.find_spec("sam3d_objects")
        except (ImportError, ValueError):
            return False
        origin = spec.origin if spec is not None else None
    return origin is not None and Path(origin).resolve().parent == ROOT / "sam3d_objects"


def module(dotted: str) -> ModuleType:
    """``module("sam3d_objects.render")``: this project's module (see the module docstring)."""
    if _project_is_importable():
        return importlib.import_module(dotted)
    alias = f"{__name__}.{dotted.replace('.', '__')}"
    if alias in sys.modules:
        return sys.modules[alias]
    path = ROOT.joinpath(*dotted.split("."))
    if path.is_dir():
        spec = importlib.util.spec_from_file_location(alias, path / "__init__.py",
                                                      submodule_search_locations=[str(path)])
    else:
        spec = importlib.util.spec_from_file_location(alias, path.with_suffix(".py"))
    if spec is None or spec.loader is None:
        raise ImportError(f"this project's {dotted} was not found under {ROOT}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[alias] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        for name in [n for n in list(sys.modules) if n == alias or n.startswith(alias + ".")]:
            del sys.modules[name]
        raise
    return mod
