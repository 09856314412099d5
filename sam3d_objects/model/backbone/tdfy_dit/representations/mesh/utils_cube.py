"""Cube/vertex bookkeeping for sparse FlexiCubes input, with no dense grid (hash lookups via `backends`)."""
from typing import Tuple

import torch

import backends

__all__ = ["cube_corners", "cube_neighbor", "construct_voxel_grid", "cubes_to_verts", "sparse_cube2verts",
           "candidate_cubes", "lookup_vertices", "cube_corner_indices", "grid_code", "grid_decode",
           "get_defomed_verts", "construct_dense_grid", "cube_edges", "get_dense_attrs"]

cube_corners = torch.tensor([[i & 1, i >> 1 & 1, i >> 2 & 1] for i in range(8)], dtype=torch.int)
cube_neighbor = torch.tensor([[1, 0, 0], [-1, 0, 0], [0, 1, 0], [0, -1, 0], [0, 0, 1], [0, 0, -1]])
# the 12 cube edges as corner-index pairs (corner order of `cube_corners`), flattened
cube_edges = torch.tensor([0, 1, 1, 5, 4, 5, 0, 4, 2, 3, 3, 7, 6, 7, 2, 6, 2, 0, 3, 1, 7, 5, 6, 4], dtype=torch.long)


def _with_batch0(xyz: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.zeros_like(xyz[:, :1]), xyz], dim=1).int()


def grid_code(xyz: torch.Tensor, size: int) -> torch.Tensor:
    """Linear int64 code (x * size + y) * size + z; sorting codes sorts positions lexicographically."""
    xyz = xyz.long()
    return (xyz[..., 0] * size + xyz[..., 1]) * size + xyz[..., 2]


def grid_decode(code: torch.Tensor, size: int) -> torch.Tensor:
    return torch.stack([code // (size * size), code // size % size, code % size], dim=-1)


def construct_voxel_grid(coords: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Corner vertices of voxels [M, 3] -> (unique vertices [V, 3] sorted lexicographically, cubes [M, 8])."""
    size = int(coords.max()) + 2 if coords.numel() else 1
    corner_codes = grid_code(cube_corners.to(coords.device), size)
    codes = (grid_code(coords, size)[:, None] + corner_codes[None]).reshape(-1)
    unique_codes, inverse = backends.unique_codes(codes, size ** 3, return_inverse=True)
    return grid_decode(unique_codes, size), inverse.reshape(-1, 8)


def cubes_to_verts(num_verts: int, cubes: torch.Tensor, value: torch.Tensor, reduce: str = "mean") -> torch.Tensor:
    """Mean (or sum, reduce="sum") over every (cube, corner) touching a vertex: value [M, 8, C] -> [V, C]."""
    if reduce not in ("mean", "sum"):
        raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")
    channels = value.shape[-1]
    # one pass in (cube, corner) order: the summation order upstream's scatter-mean uses
    sums = value.new_zeros(num_verts, channels).index_add_(0, cubes.reshape(-1), value.reshape(-1, channels))
    if reduce == "sum":
        return sums
    counts = torch.bincount(cubes.reshape(-1), minlength=num_verts).to(value.dtype)
    return sums / counts.clamp(min=1)[:, None]


def sparse_cube2verts(coords: torch.Tensor, feats: torch.Tensor, training: bool = True):
    """Per-voxel corner attributes [M, 8, C] -> (shared vertices [V, 3], averaged attributes [V, C], consistency
    loss): upstream's three values. The loss (training only, else 0.0) is the mean squared difference between
    each voxel's corner values and the averaged vertex values."""
    verts, cubes = construct_voxel_grid(coords)
    averaged = cubes_to_verts(verts.shape[0], cubes, feats)
    con_loss = torch.mean((feats - averaged[cubes]) ** 2) if training else 0.0
    return verts, averaged, con_loss


def candidate_cubes(verts: torch.Tensor, res: int) -> torch.Tensor:
    """Every cube of the res^3 grid with a corner among `verts` (the only cubes whose corners are not all at the
    default, outside SDF), sorted by the linear code x * res^2 + y * res + z like the dense grid."""
    codes = []
    for corner in cube_corners.tolist():
        cube = verts.long() - torch.tensor(corner, device=verts.device)
        inside = ((cube >= 0) & (cube < res)).all(dim=1)
        codes.append(grid_code(cube[inside], res))
    return grid_decode(backends.unique_codes(torch.cat(codes), res ** 3), res)


def lookup_vertices(verts: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """Row of each query position [..., 3] in verts [V, 3] or -1 (sort-based hash, no grid)."""
    table = backends.CoordHash(_with_batch0(verts))
    flat = query.reshape(-1, 3)
    return table.lookup(_with_batch0(flat)).reshape(query.shape[:-1])


def cube_corner_indices(verts: torch.Tensor, cubes: torch.Tensor) -> torch.Tensor:
    """[F, 8] row in verts of each cube corner, -1 where absent (one corner at a time to bound memory)."""
    table = backends.CoordHash(_with_batch0(verts))
    out = torch.empty(cubes.shape[0], 8, dtype=torch.long, device=cubes.device)
    for k, corner in enumerate(cube_corners.tolist()):
        out[:, k] = table.lookup(_with_batch0(cubes + torch.tensor(corner, device=cubes.device, dtype=cubes.dtype)))
    return out


def get_defomed_verts(v_pos: torch.Tensor, deform: torch.Tensor, res: int) -> torch.Tensor:
    """Grid vertex -> [-0.5, 0.5]^3, moved by at most half a cube: v / res - 0.5 + tanh(deform) / (2 res)."""
    return v_pos / res - 0.5 + (1 - 1e-8) / (res * 2) * torch.tanh(deform)


def construct_dense_grid(res: int, device="cpu") -> Tuple[torch.Tensor, torch.Tensor]:
    """Dense (res+1)^3 vertices and res^3 cubes (reference/benchmark only: ~1.5 GB at res 256)."""
    res_v = res + 1
    vertsid = torch.arange(res_v ** 3, device=device)
    coordsid = vertsid.reshape(res_v, res_v, res_v)[:res, :res, :res].flatten()
    bias = (cube_corners[:, 0] * res_v + cube_corners[:, 1]) * res_v + cube_corners[:, 2]
    cube_fx8 = coordsid.unsqueeze(1) + bias.unsqueeze(0).to(device)
    verts = torch.stack([vertsid // (res_v ** 2), (vertsid // res_v) % res_v, vertsid % res_v], dim=1)
    return verts, cube_fx8


def get_dense_attrs(coords: torch.Tensor, feats: torch.Tensor, res: int, sdf_init: bool = True) -> torch.Tensor:
    """Dense [res^3, F] attributes (x-major): zeros, channel 0 = 1 ("outside") when sdf_init, then the rows of
    `feats` at their `coords` (x, y, z). The dense path; the sparse extractor never calls it."""
    dense = torch.zeros(res, res, res, feats.shape[-1], device=feats.device, dtype=feats.dtype)
    if sdf_init:
        dense[..., 0] = 1
    c = coords.long()
    dense[c[:, 0], c[:, 1], c[:, 2]] = feats
    return dense.reshape(-1, feats.shape[-1])
