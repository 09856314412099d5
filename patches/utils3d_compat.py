"""The installed ``utils3d`` (``dlr-utils3d`` 1.x, the one MoGe 2 needs), repaired with the earlier names.

Why: upstream was written against the earlier utils3d API; ``sam3d_objects.utils.visualization.image_mesh``
(imported by ``notebook/inference.py``) does ``from utils3d.numpy import depth_edge, normals_edge,
points_to_normals, image_uv, image_mesh``, names that utils3d 1.x renamed, so the notebook does not import. Each
missing earlier name is added to ``utils3d.numpy`` as a thin adapter onto its renamed function, keeping the
earlier parameter names (per utils3d 1.x's documentation the computations are the same):

- ``depth_edge(depth, atol, rtol, kernel_size, mask)`` -> ``depth_map_edge``
- ``normals_edge(normals, tol, kernel_size, mask)`` -> ``normal_map_edge``
- ``points_to_normals(point, mask)`` -> ``point_map_to_normal_map`` (``(normals, mask)`` when a mask is given)
- ``image_uv(height, width, left, top, right, bottom, dtype)`` -> ``uv_map`` (pixel-centre uv, (0, 0) top-left)
- ``image_mesh(*maps, mask, tri)`` -> ``build_mesh_from_map`` (``faces, *attributes``)

Names the installed utils3d already has are never replaced; the real utils3d computes.
"""
from __future__ import annotations

import importlib

import numpy as np

_ADDED: dict = {}


def _adapters(new) -> dict:
    def depth_edge(depth, atol=None, rtol=None, kernel_size=3, mask=None):
        return new.depth_map_edge(depth, atol=atol, rtol=rtol, kernel_size=kernel_size, mask=mask)

    def normals_edge(normals, tol, kernel_size=3, mask=None):
        return new.normal_map_edge(normals, tol, kernel_size=kernel_size, mask=mask)

    def points_to_normals(point, mask=None):
        return new.point_map_to_normal_map(point, mask=mask)

    def image_uv(height, width, left=None, top=None, right=None, bottom=None, dtype=np.float32):
        bounds = dict(left=left, top=top, right=right, bottom=bottom)
        return new.uv_map(height, width, dtype=dtype, **{k: v for k, v in bounds.items() if v is not None})

    def image_mesh(*maps, mask=None, tri=False):
        return new.build_mesh_from_map(*maps, mask=mask, tri=tri)

    targets = dict(depth_edge="depth_map_edge", normals_edge="normal_map_edge",
                   points_to_normals="point_map_to_normal_map", image_uv="uv_map", image_mesh="build_mesh_from_map")
    local = dict(depth_edge=depth_edge, normals_edge=normals_edge, points_to_normals=points_to_normals,
                 image_uv=image_uv, image_mesh=image_mesh)
    return {old: local[old] for old, renamed in targets.items() if hasattr(new, renamed)}


def install() -> str:
    """"repaired" when earlier names were added, "real" when nothing was missing, "absent" without utils3d."""
    try:
        numpy_api = importlib.import_module("utils3d.numpy")
    except Exception:  # noqa: BLE001  not installed: upstream's imports of it fail as they would anyway
        return "absent"
    for name, fn in _adapters(numpy_api).items():
        if name not in dir(numpy_api):
            setattr(numpy_api, name, fn)
            _ADDED[name] = numpy_api
    return "repaired" if _ADDED else "real"


def uninstall() -> None:
    for name, module in list(_ADDED.items()):
        if getattr(module, name, None) is not None:
            delattr(module, name)
        del _ADDED[name]
