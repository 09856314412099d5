"""Decoder features on fine voxels -> mesh (FlexiCubes on the sparse set of cubes that can hold surface)."""
from typing import Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F

import backends

from ...modules.sparse import SparseTensor
from .flexicubes import FlexiCubes
from .utils_cube import (candidate_cubes, construct_dense_grid, construct_voxel_grid, cube_corner_indices,
                         cube_corners, get_defomed_verts, grid_code, grid_decode, lookup_vertices, sparse_cube2verts)

__all__ = ["MeshExtractResult", "SparseFeatures2Mesh", "CubeFeatureStream"]


class MeshExtractResult:
    """vertices [V, 3], faces [F, 3] int64, vertex_attrs [V, C] or None, face_normal [F, 3, 3]."""

    def __init__(self, vertices: torch.Tensor, faces: torch.Tensor, vertex_attrs: Optional[torch.Tensor] = None,
                 res: int = 64):
        self.vertices = vertices
        self.faces = faces.long()
        self.vertex_attrs = vertex_attrs
        self.face_normal = self.comput_face_normals(vertices, self.faces)
        self.res = res
        self.success = vertices.shape[0] != 0 and faces.shape[0] != 0
        self.tsdf_v = None
        self.tsdf_s = None
        self.reg_loss = None

    @staticmethod
    def comput_face_normals(verts: torch.Tensor, faces: torch.Tensor) -> torch.Tensor:
        v0, v1, v2 = (verts[faces[:, i]] for i in range(3))
        normals = F.normalize(torch.cross(v1 - v0, v2 - v0, dim=-1), dim=1)
        return normals[:, None, :].repeat(1, 3, 1)

    @staticmethod
    def comput_v_normals(verts: torch.Tensor, faces: torch.Tensor) -> torch.Tensor:
        v0, v1, v2 = (verts[faces[:, i]] for i in range(3))
        face_normals = torch.cross(v1 - v0, v2 - v0, dim=-1)
        v_normals = torch.zeros_like(verts)
        for i in range(3):
            v_normals.index_add_(0, faces[:, i], face_normals)
        return F.normalize(v_normals, dim=1)


class SparseFeatures2Mesh:
    """Per fine voxel: sdf(8) | deform(8x3) | weights(21) | color(8x6) (the layout's insertion order).

    Corner values are averaged over the voxels sharing a grid vertex; vertices no voxel touches keep SDF 1
    (outside), no deformation and zero colour logits; colours (and normal-map channels) pass through a sigmoid
    on the grid, before FlexiCubes interpolates them like the dual vertices; cubes without a voxel use zero raw
    weights. That is exactly what upstream's dense (res+1)^3 grid holds, but only the cubes that touch a voxel
    are ever built (hash lookups through `backends.CoordHash`), so memory follows the surface, not res^3.
    """

    def __init__(self, device: Union[str, torch.device] = "cpu", res: int = 64, use_color: bool = True):
        self.device = torch.device(device)
        self.res = res
        self.mesh_extractor = FlexiCubes(device=self.device)
        self.sdf_bias = -1.0 / res
        self.use_color = use_color
        self._calc_layout()

    @property
    def reg_v(self) -> torch.Tensor:
        """Upstream's dense grid vertices [(res+1)^3, 3] (integer positions, x-major), built on access: the
        extraction here never builds the dense grid."""
        return construct_dense_grid(self.res, self.device)[0]

    @property
    def reg_c(self) -> torch.Tensor:
        """Upstream's dense grid cubes [res^3, 8]: corner indices into ``reg_v``, built on access."""
        return construct_dense_grid(self.res, self.device)[1]

    def _calc_layout(self) -> None:
        layouts: Dict[str, Dict] = {"sdf": {"shape": (8, 1), "size": 8}, "deform": {"shape": (8, 3), "size": 24},
                                    "weights": {"shape": (21,), "size": 21}}
        if self.use_color:
            layouts["color"] = {"shape": (8, 6), "size": 48}  # 3 colour + 3 normal-map channels
        start = 0
        for v in layouts.values():
            v["range"] = (start, start + v["size"])
            start += v["size"]
        self.layouts = layouts
        self.feats_channels = start

    def get_layout(self, feats: torch.Tensor, name: str) -> Optional[torch.Tensor]:
        if name not in self.layouts:
            return None
        lo, hi = self.layouts[name]["range"]
        return feats[:, lo:hi].reshape(-1, *self.layouts[name]["shape"])

    def _corner_values(self, feats: torch.Tensor) -> torch.Tensor:
        """Per-voxel corner values [M, 8, 1 + 3 (+ 6)] = sdf + bias | deform | colour logits (float32 feats)."""
        width = 10 if self.use_color else 4
        corner = feats.new_empty(feats.shape[0], 8, width)  # filled in place: no per-part copies + concat
        corner[..., :1] = self.get_layout(feats, "sdf")
        corner[..., :1] += self.sdf_bias
        corner[..., 1:4] = self.get_layout(feats, "deform")
        if self.use_color:
            corner[..., 4:] = self.get_layout(feats, "color")
        return corner

    def _corner_attributes(self, coords: torch.Tensor, feats: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Per-voxel corner values [M, 8, 1 + 3 (+ 6)] = sdf + bias | deform | colour logits, averaged onto the
        shared grid vertices."""
        verts, averaged, _ = sparse_cube2verts(coords, self._corner_values(feats), training=False)
        return verts, averaged

    def stream(self, coords: torch.Tensor) -> "CubeFeatureStream":
        """A collector of one batch element's features, fed in row chunks (see :class:`CubeFeatureStream`):
        ``coords`` [M, 3] are the voxels' (x, y, z) at resolution ``res``."""
        return CubeFeatureStream(self, coords)

    def __call__(self, cubefeats: SparseTensor, training: bool = False) -> MeshExtractResult:
        """cubefeats: one batch element at resolution `res`. No voxel / no surface -> an empty result."""
        feats = cubefeats.feats
        if feats.shape[-1] != self.feats_channels:
            raise ValueError(f"mesh extractor expects {self.feats_channels} channels per voxel, got {feats.shape[-1]}")
        if feats.shape[0] == 0:
            return self._empty(feats)
        stream = self.stream(cubefeats.coords[:, 1:])
        stream.add(feats)
        return stream.finish(training=training)

    def _extract(self, parts: Dict[str, torch.Tensor], training: bool) -> MeshExtractResult:
        """The mesh from ``parts`` (taken out of the dict, so that each is freed as soon as it is done with):
        ``v_attrs`` [V, 4 (+ 6)], the voxels' attributes averaged onto the grid vertices ``verts`` [V, 3], and
        ``weights`` [M, 21], the raw FlexiCubes weights of the voxels at ``coords`` [M, 3] (float32)."""
        coords, verts, v_attrs = parts.pop("coords"), parts.pop("verts"), parts.pop("v_attrs")
        num_attr = v_attrs.shape[1]

        # default attributes of grid vertices no voxel touches: outside (sdf 1), no deformation, zero logits
        default = v_attrs.new_zeros(num_attr)
        default[0] = 1.0
        cubes = candidate_cubes(verts, self.res)
        corner_idx = cube_corner_indices(verts, cubes)  # [F, 8], -1 where no voxel touches the corner
        corner_sdf = torch.where(corner_idx >= 0, v_attrs[:, 0][corner_idx.clamp(min=0)], default[0])
        occupied = (corner_sdf < 0).sum(dim=1)
        surface = (occupied > 0) & (occupied < 8)
        cubes, corner_idx = cubes[surface], corner_idx[surface]  # only surface cubes matter from here on
        del corner_sdf, occupied, surface
        missing = corner_idx < 0
        extra_pos = (cubes[:, None, :] + cube_corners.to(cubes)[None])[missing]
        extra, extra_inverse = backends.unique(grid_code(extra_pos, self.res + 1), return_inverse=True)
        corner_idx[missing] = verts.shape[0] + extra_inverse
        del missing, extra_pos, extra_inverse
        voxel_row = lookup_vertices(coords, cubes)
        del coords
        weights = v_attrs.new_zeros(cubes.shape[0], 21)
        has_voxel = voxel_row >= 0
        weights[has_voxel] = parts.pop("weights")[voxel_row[has_voxel]]
        del voxel_row, has_voxel

        all_attrs = torch.cat([v_attrs, default.expand(extra.shape[0], -1)])
        del v_attrs
        all_verts = torch.cat([verts, grid_decode(extra, self.res + 1)])
        del verts, extra
        all_verts, all_attrs, corner_idx = self._in_grid_order(all_verts, all_attrs, corner_idx)
        all_verts = all_verts.float()
        x_nx3 = get_defomed_verts(all_verts, all_attrs[:, 1:4], self.res)
        del all_verts
        sdf = all_attrs[:, 0].contiguous()
        # the sigmoid comes after the grid fill: vertices no voxel touches get colour sigmoid(0) = 0.5
        colors = torch.sigmoid(all_attrs[:, 4:]) if self.use_color else None
        del all_attrs
        vertices, faces, _, vertex_colors = self.mesh_extractor(
            voxelgrid_vertices=x_nx3, scalar_field=sdf, cube_idx=corner_idx, resolution=self.res,
            cube_coords=cubes, beta=weights[:, :12], alpha=weights[:, 12:20], gamma_f=weights[:, 20],
            voxelgrid_colors=colors, training=training)
        return MeshExtractResult(vertices=vertices, faces=faces, vertex_attrs=vertex_colors, res=self.res)

    def _in_grid_order(self, grid_verts: torch.Tensor, attrs: torch.Tensor, corner_idx: torch.Tensor):
        """The vertex list re-sorted by grid position (the voxels' vertices, then the untouched ones, are sorted
        separately): cube edges are then numbered as on upstream's dense grid, which fixes the order FlexiCubes
        emits the faces in (upstream's order)."""
        _, order = backends.sort(grid_code(grid_verts, self.res + 1))
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.shape[0], device=order.device)
        return grid_verts[order], attrs[order], rank[corner_idx]

    def _empty(self, feats: torch.Tensor) -> MeshExtractResult:
        colors = feats.new_zeros(0, 6) if self.use_color else None
        return MeshExtractResult(feats.new_zeros(0, 3), torch.zeros(0, 3, dtype=torch.long, device=feats.device),
                                 colors, res=self.res)


class CubeFeatureStream:
    """One batch element's decoder features for :class:`SparseFeatures2Mesh`, fed in row chunks.

    What the extraction needs of the [M, 101] features is small: the corner values averaged onto the shared grid
    vertices ([V, 4 (+ 6)] sums, V about 1.4 M for the 1.3 M fine voxels of a typical object) and the 21 raw
    FlexiCubes weights per voxel. Each chunk adds its corner values into the vertex sums and copies its weights,
    so a caller that produces the features chunk by chunk (the mesh decoder on the CPU) never holds all of them,
    nor the [M, 8, 10] corner values. The sums run in row order, (voxel, corner) by (voxel, corner) as one pass
    over all rows would (``cubes_to_verts``): the mesh is the same whatever the chunks, and the same as
    ``SparseFeatures2Mesh.__call__`` on the whole features (which runs through one chunk of this class)."""

    def __init__(self, extractor: SparseFeatures2Mesh, coords: torch.Tensor):
        if coords.dtype.is_floating_point:
            coords = coords.long()
        if bool((coords < 0).any()) or bool((coords >= extractor.res).any()):
            raise ValueError(f"voxel coords must lie in [0, {extractor.res}) for the mesh extractor")
        self.extractor, self.coords = extractor, coords  # kept as given (the decoder's int32 view: no copy)
        verts, cubes = construct_voxel_grid(coords)
        self.verts = verts.to(torch.int32)  # positions below res + 1: int32 while the features stream in
        # [M, 8] vertex of each voxel corner (int32 halves what is held while the features stream in), summed
        # into in row order whatever the chunks
        self.corner_sums = backends.SlotScatter(cubes.to(torch.int32) if verts.shape[0] < 2 ** 31 else cubes,
                                                verts.shape[0])
        del cubes
        width = 10 if extractor.use_color else 4
        self.sums = torch.zeros(verts.shape[0], width, dtype=torch.float32, device=coords.device)
        self.weights: Optional[torch.Tensor] = None  # [M, 21], allocated by the first chunk
        self.rows = 0

    @property
    def num_voxels(self) -> int:
        return self.coords.shape[0]

    def add(self, feats: torch.Tensor) -> None:
        """The next rows [n, C] of the features, in voxel order."""
        ex = self.extractor
        if feats.dim() != 2 or feats.shape[-1] != ex.feats_channels:
            raise ValueError(f"mesh extractor expects {ex.feats_channels} channels per voxel, got "
                             f"{tuple(feats.shape)}")
        end = self.rows + feats.shape[0]
        if end > self.num_voxels:
            raise ValueError(f"{end} feature rows for {self.num_voxels} voxels")
        feats = feats.float()
        corner = ex._corner_values(feats)
        self.corner_sums.add_(self.sums, self.rows, corner)
        del corner
        if self.rows == 0 and end == self.num_voxels:
            self.weights = ex.get_layout(feats, "weights")  # all rows at once: a view, no copy
        else:
            if self.weights is None:
                self.weights = feats.new_empty(self.num_voxels, 21)
            self.weights[self.rows:end] = ex.get_layout(feats, "weights")
        self.rows = end

    def finish(self, training: bool = False) -> MeshExtractResult:
        """The mesh (all rows added). The collector is spent afterwards."""
        if self.rows != self.num_voxels:
            raise ValueError(f"{self.rows} of {self.num_voxels} feature rows were added before finish()")
        ex = self.extractor
        if self.num_voxels == 0:
            return ex._empty(self.sums.new_zeros(0, ex.feats_channels))
        counts = self.corner_sums.counts.to(self.sums.dtype)
        del self.corner_sums
        parts = dict(v_attrs=self.sums / counts.clamp(min=1)[:, None])  # the mean of cubes_to_verts
        del self.sums, counts
        for name in ("coords", "verts", "weights"):  # handed over: the extraction frees each when done with it
            parts[name] = vars(self).pop(name)
        parts["verts"] = parts["verts"].long()
        return ex._extract(parts, training)
