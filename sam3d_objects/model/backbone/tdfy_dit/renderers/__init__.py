"""Upstream's ``tdfy_dit.renderers``: renderers for the octree / radiance-field and Gaussian representations.

Imported lazily so that importing one renderer does not import the other's dependencies.
"""
from importlib import import_module

_EXPORTS = {"OctreeRenderer": ".octree_renderer", "GaussianRenderer": ".gaussian_render"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
