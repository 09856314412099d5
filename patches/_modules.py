"""Registering stand-in modules in ``sys.modules`` (shared by the shims)."""
from __future__ import annotations

import importlib
import sys
import types
from typing import Iterable

from backends.registry import STANDIN_FLAG as SHIM_FLAG  # the registry tells stand-ins from packages by it

IMPORT_ERRORS: dict = {}  # package -> why its real import failed (patches.report() says it)


class ShimModule(types.ModuleType):
    """A stand-in package. Unknown attributes raise an error that names the shim, not a silent None.

    It has no ``__spec__``, so ``importlib.util.find_spec`` (which the backends registry uses to find optional
    packages) never mistakes the shim for the real package and routes back into itself.
    """

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"{self.__name__}.{name} is not provided by the sam3d patches shim (only what SAM 3D "
                             f"style code uses is). Install the real package on CUDA, or use `backends` directly.")


def real_module_available(name: str) -> bool:
    """Whether the real package imports (a broken binary build counts as absent; its half-import is dropped)."""
    mod = sys.modules.get(name)
    if mod is not None:
        return not getattr(mod, SHIM_FLAG, False)
    try:
        importlib.import_module(name)
        return True
    except Exception as e:  # noqa: BLE001  CUDA-only builds raise OSError/RuntimeError, not ImportError
        IMPORT_ERRORS[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
        drop(name)
        return False


def make(name: str, doc: str, **attrs) -> ShimModule:
    mod = ShimModule(name, doc)
    setattr(mod, SHIM_FLAG, True)
    mod.__path__ = []  # a package, so submodules resolve through sys.modules
    mod.__spec__ = None
    for key, value in attrs.items():
        setattr(mod, key, value)
    return mod


def register(modules: Iterable[ShimModule]) -> None:
    for mod in modules:
        sys.modules[mod.__name__] = mod


def drop(root: str, only_shims: bool = False) -> None:
    for name in [n for n in list(sys.modules) if n == root or n.startswith(root + ".")]:
        if not only_shims or getattr(sys.modules[name], SHIM_FLAG, False):
            del sys.modules[name]


def install_shim(root: str, build, replace_installed: bool) -> str:
    """"real" if the real package stays, else build() the shim modules and register them: "shim"."""
    current = sys.modules.get(root)
    if current is not None and getattr(current, SHIM_FLAG, False):
        return "shim"
    if not replace_installed and real_module_available(root):
        return "real"
    drop(root)
    register(build())
    return "shim"
