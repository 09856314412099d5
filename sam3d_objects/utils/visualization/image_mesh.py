"""Upstream's ``visualization.image_mesh``: a triangle mesh of a point map (two triangles per valid 2x2 pixel
quad), with depth / normal discontinuities cut, for showing the scene behind reconstructed objects."""
from __future__ import annotations

from collections import namedtuple
from typing import Optional

import numpy as np

__all__ = ["MeshAndTexture", "mesh_from_pointmap", "create_textured_mesh"]

MeshAndTexture = namedtuple("mesh_and_texture", ["faces", "vertices", "vertex_colors", "vertex_uvs"])


def _neighbourhood(values: np.ndarray, reduce) -> np.ndarray:
    """``reduce`` (np.fmax / np.fmin) over the 3x3 neighbourhood of every pixel (NaN-padded edges)."""
    pad = np.pad(values.astype(np.float64), 1, constant_values=np.nan)
    h, w = values.shape
    out = pad[1:h + 1, 1:w + 1].copy()
    for dy in (0, 1, 2):
        for dx in (0, 1, 2):
            out = reduce(out, pad[dy:dy + h, dx:dx + w])
    return out


def _depth_edge(depth: np.ndarray, rtol: float, mask: np.ndarray) -> np.ndarray:
    """Pixels whose 3x3 depth spread relative to their depth exceeds ``rtol``."""
    d = np.where(mask, depth, np.nan)
    spread = _neighbourhood(d, np.fmax) - _neighbourhood(d, np.fmin)
    with np.errstate(invalid="ignore", divide="ignore"):
        return mask & (spread / np.abs(d) > rtol)


def _normals(points: np.ndarray, mask: np.ndarray):
    """Per-pixel unit normals from central differences, and where they are defined."""
    dx = np.zeros_like(points)
    dy = np.zeros_like(points)
    dx[:, 1:-1] = points[:, 2:] - points[:, :-2]
    dy[1:-1] = points[2:] - points[:-2]
    n = np.cross(dx, dy)
    norm = np.linalg.norm(n, axis=-1, keepdims=True)
    ok = mask & (norm[..., 0] > 0) & np.isfinite(norm[..., 0])
    ok[[0, -1], :] = False
    ok[:, [0, -1]] = False
    with np.errstate(invalid="ignore", divide="ignore"):
        return n / norm, ok


def _normal_edge(normals: np.ndarray, tol_deg: float, mask: np.ndarray) -> np.ndarray:
    """Pixels with a neighbour whose normal differs by more than ``tol_deg`` degrees."""
    h, w = mask.shape
    edge = np.zeros_like(mask)
    cos_tol = np.cos(np.radians(tol_deg))
    for dy, dx in ((0, 1), (1, 0), (1, 1), (1, -1)):
        a = normals[max(0, -dy):h - max(0, dy), max(0, -dx):w - max(0, dx)]
        b = normals[max(0, dy):, max(0, dx):][:a.shape[0], :a.shape[1]] if dx >= 0 else \
            normals[dy:, :w + dx][:a.shape[0], :a.shape[1]]
        ma = mask[max(0, -dy):h - max(0, dy), max(0, -dx):w - max(0, dx)]
        mb = mask[max(0, dy):, max(0, dx):][:a.shape[0], :a.shape[1]] if dx >= 0 else \
            mask[dy:, :w + dx][:a.shape[0], :a.shape[1]]
        bad = ma & mb & ((a * b).sum(-1) < cos_tol)
        edge[max(0, -dy):h - max(0, dy), max(0, -dx):w - max(0, dx)] |= bad
        sub = edge[max(0, dy):, max(0, dx):] if dx >= 0 else edge[dy:, :w + dx]
        sub[:a.shape[0], :a.shape[1]] |= bad
    return edge


def mesh_from_pointmap(pointmap: np.ndarray, image: np.ndarray, mask: Optional[np.ndarray] = None,
                       depth: Optional[np.ndarray] = None, filter_edges: bool = True,
                       depth_edge_rtol: float = 0.03, depth_edge_tol: float = 5) -> MeshAndTexture:
    """Mesh of a point map [H, W, 3] coloured by ``image`` [H, W, 3]: vertices = kept pixels' points (float64),
    two triangles per 2x2 quad of kept pixels, uvs at pixel centres (v flipped). With ``filter_edges``, pixels
    that are both a depth edge (relative 3x3 spread > ``depth_edge_rtol``) and a normal edge (> ``depth_edge_tol``
    degrees) are removed."""
    pointmap = np.asarray(pointmap, dtype=np.float64)
    image = np.asarray(image, dtype=np.float32)
    assert pointmap.ndim == 3 and pointmap.shape[-1] == 3, f"pointmap must be [H, W, 3], got {pointmap.shape}"
    assert image.shape == pointmap.shape, f"image must be [H, W, 3] like the point map, got {image.shape}"
    h, w = pointmap.shape[:2]
    mask = np.ones((h, w), bool) if mask is None else np.asarray(mask).astype(bool)
    mask = mask & np.isfinite(pointmap).all(-1)
    depth = pointmap[..., 2] if depth is None else np.asarray(depth, dtype=np.float64)
    if filter_edges:
        normals, normals_ok = _normals(pointmap, mask)
        mask = mask & ~(_depth_edge(depth, depth_edge_rtol, mask) & _normal_edge(normals, depth_edge_tol, normals_ok))
    index = np.full((h, w), -1, dtype=np.int64)
    index[mask] = np.arange(int(mask.sum()))
    a, b, c, d = index[:-1, :-1], index[:-1, 1:], index[1:, :-1], index[1:, 1:]
    quad = (a >= 0) & (b >= 0) & (c >= 0) & (d >= 0)
    faces = np.concatenate([np.stack([a[quad], c[quad], b[quad]], -1), np.stack([b[quad], c[quad], d[quad]], -1)])
    v, u = np.nonzero(mask)
    uvs = np.stack([(u + 0.5) / w, 1 - (v + 0.5) / h], -1).astype(np.float64)
    return MeshAndTexture(faces, pointmap[mask] * np.array([1.0, 1.0, 1.0]), image[mask], uvs)


def create_textured_mesh(verts, faces, vert_colors):
    """A batch-of-one PyTorch3D ``Meshes`` with vertex colours when PyTorch3D is installed, else a ``trimesh``
    mesh with the same vertices, faces and colours."""
    try:
        from pytorch3d.renderer import TexturesVertex
        from pytorch3d.structures import Meshes
    except ImportError:
        import trimesh
        colors = np.clip(np.asarray(vert_colors, dtype=np.float64) * 255, 0, 255).astype(np.uint8)
        return trimesh.Trimesh(np.asarray(verts), np.asarray(faces), vertex_colors=colors, process=False)
    return Meshes(verts=[verts], faces=[faces], textures=TexturesVertex([vert_colors]))
