"""Upstream's folder name: scripts written for Meta's package do ``sys.path.append("notebook")`` and then
``from inference import Inference``. This file is an alias of ``notebooks/inference.py`` (the one maintained
copy): it loads that file by path and re-exports every name it defines, so both folders give the same objects.
"""
import importlib.util
import os
import sys

_TARGET = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks", "inference.py")
_NAME = "_sam3d_objects_notebooks_inference"


def _load():
    module = sys.modules.get(_NAME)
    if module is None:
        spec = importlib.util.spec_from_file_location(_NAME, _TARGET)
        if spec is None or spec.loader is None:
            raise ImportError(f"notebook/inference.py re-exports {_TARGET}, which is missing: restore the "
                              f"notebooks/ folder of the checkout")
        module = importlib.util.module_from_spec(spec)
        sys.modules[_NAME] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[_NAME]  # nothing half-loaded stays behind
            raise
    return module


_module = _load()
globals().update({k: v for k, v in vars(_module).items() if not (k.startswith("__") and k.endswith("__"))})
__all__ = list(getattr(_module, "__all__", [k for k in vars(_module) if not k.startswith("_")]))
del _load, _module
