"""FlexiCubes surface extraction (inference path) on an explicit list of cubes.

Upstream runs FlexiCubes on a dense (res+1)^3 vertex / res^3 cube grid. Here the caller passes only the cubes
that can hold surface (any list, sorted by their linear (x, y, z) code so that the output matches the dense
run face for face), each as 8 indices into a vertex list, plus the cubes' integer positions, which replace the
dense-grid indexing of the ambiguity check. Nothing of size res^3 is allocated.
"""
from typing import Any, Optional, Tuple

import torch

import backends

from .tables import CUBE_CORNERS, CUBE_EDGES, EDGE_RING_PAIRS, build_tables, edge_directions, edge_ring_faces
from .tables import tet_table as TET_TABLE

# unit offsets (x, y, z) sorted by their grid code (x * S + y) * S + z
EDGE_DIRECTION_ORDER = ((-1, 0, 0), (0, -1, 0), (0, 0, -1), (0, 0, 1), (0, 1, 0), (1, 0, 0))

__all__ = ["FlexiCubes"]

QUAD_SPLIT_1 = (0, 1, 2, 0, 2, 3)
QUAD_SPLIT_2 = (0, 1, 3, 3, 1, 2)
QUAD_SPLIT_TRAIN = (0, 1, 1, 2, 2, 3, 3, 0)  # training mode: the quad's 4 edges, each fanned to a centre vertex


def dense_cube_coords(num_cubes: int, resolution, device: Any) -> torch.Tensor:
    """[F, 3] integer positions of the cubes of a dense grid enumerated x-major (z fastest)."""
    res = resolution if isinstance(resolution, (tuple, list)) else (resolution,) * 3
    idx = torch.arange(num_cubes, device=device)
    return torch.stack([idx // (res[1] * res[2]), idx // res[2] % res[1], idx % res[2]], dim=-1)


def _index_dtype(count: int) -> torch.dtype:
    """int32 for indices below 2^31 (half the memory of the per-edge index arrays), else int64."""
    return torch.int32 if count < 2 ** 31 else torch.int64


def linear_interp(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Zero crossing along edges: (v0 * w1 - v1 * w0) / (w1 - w0); weights [..., 2, 1], values [..., 2, C]."""
    w0, w1 = weights[..., 0, :], weights[..., 1, :]
    return (values[..., 0, :] * w1 - values[..., 1, :] * w0) / (w1 - w0)


def vd_slots_in_upstream_order(has_vd: torch.Tensor, cube_num_vd: torch.Tensor) -> torch.Tensor:
    """(cube, slot) of every dual vertex, numbered as upstream numbers them: the cubes emitting one vertex first,
    then those emitting two, ... (upstream batches the cubes by their vertex count), cube-major and slot-minor
    inside each group. Code that indexes the mesh's vertices (and the faces that refer to them) then gets the
    same vertices as with upstream."""
    vd_cube = torch.nonzero(has_vd)  # cube-major, slot-minor
    if vd_cube.shape[0]:
        _, order = backends.sort(cube_num_vd[vd_cube[:, 0]], stable=True)
        vd_cube = vd_cube[order]
    return vd_cube


class FlexiCubes:
    """Dual-marching-cubes extraction with FlexiCubes weights (beta per edge, alpha per corner, gamma per cube).

    `weight_scale` keeps the weights in (1 - ws, 1 + ws) (beta, alpha: tanh) and (0.5 - ws/2, 0.5 + ws/2)
    (gamma: sigmoid), as upstream.
    """

    # integer positions [F, 3] of the cubes of the current call (sparse input), read by _get_case_id
    _cube_coords: Optional[torch.Tensor] = None

    def __init__(self, device: torch.device = "cpu", qef_reg_scale: float = 1e-3, weight_scale: float = 0.99):
        self.device = torch.device(device)
        self.qef_reg_scale = qef_reg_scale
        self.weight_scale = weight_scale
        dmc, num_vd, check = build_tables()
        self.dmc_table = torch.tensor(dmc, dtype=torch.long, device=self.device)
        self.dmc_table_small = self.dmc_table.to(torch.int8)  # gathered per surface cube: keep it compact
        self.num_vd_table = torch.tensor(num_vd, dtype=torch.long, device=self.device)
        self.check_table = torch.tensor(check, dtype=torch.long, device=self.device)
        self.cube_edges = torch.tensor(CUBE_EDGES, dtype=torch.long, device=self.device).reshape(-1)
        # each table edge's direction (second corner - first), numbered in grid-code order of the offset
        self.edge_direction = torch.tensor(
            [EDGE_DIRECTION_ORDER.index(tuple(q - p for p, q in zip(CUBE_CORNERS[a], CUBE_CORNERS[b])))
             for a, b in CUBE_EDGES], dtype=torch.int8, device=self.device)
        self.cube_corners_idx = 2 ** torch.arange(8, device=self.device)
        # upstream's other tables (the quad splits are used by _triangulate; the rest serve tetrahedral output
        # and training code, which inference does not run)
        self.cube_corners = torch.tensor(CUBE_CORNERS, dtype=torch.float, device=self.device)
        self.quad_split_1 = torch.tensor(QUAD_SPLIT_1, dtype=torch.long, device=self.device)
        self.quad_split_2 = torch.tensor(QUAD_SPLIT_2, dtype=torch.long, device=self.device)
        self.quad_split_train = torch.tensor(QUAD_SPLIT_TRAIN, dtype=torch.long, device=self.device)
        self.edge_dir_table = torch.tensor(edge_directions(), dtype=torch.long, device=self.device)
        self.dir_faces_table = torch.tensor(edge_ring_faces(), dtype=torch.long, device=self.device)
        self.adj_pairs = torch.tensor(EDGE_RING_PAIRS, dtype=torch.long, device=self.device).reshape(-1)
        self.tet_table = TET_TABLE.to(self.device)

    def _tables_on(self, device: torch.device) -> None:
        if self.dmc_table.device != device:
            for name in ("dmc_table", "dmc_table_small", "num_vd_table", "check_table", "cube_edges",
                         "edge_direction", "cube_corners_idx", "quad_split_1", "quad_split_2"):
                setattr(self, name, getattr(self, name).to(device))
            self.device = device

    # ------------------------------------------------------------------------------------------------ weights
    def _normalize_weights(self, beta, alpha, gamma_f, surf_cubes: torch.Tensor, weight_scale: float):
        """The surface cubes' weights: beta and alpha in (1 - ws, 1 + ws) (tanh), gamma in (0.5 - ws/2, 0.5 + ws/2)
        (sigmoid); ones where not given. Returns (beta [S, 12], alpha [S, 8], gamma_f [S]) for S = surf_cubes."""
        n_cubes = surf_cubes.shape[0]
        ones = dict(dtype=torch.float32, device=surf_cubes.device)
        beta = torch.tanh(beta) * weight_scale + 1 if beta is not None else torch.ones(n_cubes, 12, **ones)
        alpha = torch.tanh(alpha) * weight_scale + 1 if alpha is not None else torch.ones(n_cubes, 8, **ones)
        gamma_f = (torch.sigmoid(gamma_f) * weight_scale + (1 - weight_scale) / 2 if gamma_f is not None
                   else torch.ones(n_cubes, **ones))
        return beta[surf_cubes], alpha[surf_cubes], gamma_f[surf_cubes]

    def _identify_surf_cubes(self, scalar_field: torch.Tensor, cube_idx: torch.Tensor):
        """(surf_cubes [F] bool: corners of both signs, occ_fx8 [F, 8] bool: corner inside, SDF < 0)."""
        occ_fx8 = (scalar_field < 0)[cube_idx]
        occ_sum = occ_fx8.sum(-1)
        return (occ_sum > 0) & (occ_sum < 8), occ_fx8

    def _linear_interp(self, edges_weight: torch.Tensor, edges_x: torch.Tensor) -> torch.Tensor:
        """Zero crossings along edges (see ``linear_interp``): weights [..., 2, 1], values [..., 2, C]."""
        return linear_interp(edges_weight, edges_x)

    def _solve_vd_QEF(self, p_bxnx3: torch.Tensor, norm_bxnx3: torch.Tensor, c_bx3: torch.Tensor,  # noqa: N802
                      qef_reg_scale: float) -> torch.Tensor:
        """Dual vertices minimising the quadric error of up to 7 (point, normal) pairs per vertex, regularised
        towards c by ``qef_reg_scale`` (least squares). Upstream keeps it for QEF-placed vertices; the extraction
        uses the weighted mean of the crossings."""
        p = p_bxnx3.reshape(-1, 7, 3)
        normals = norm_bxnx3.reshape(-1, 7, 3)
        centre = c_bx3.reshape(-1, 3)
        rhs = (p * normals).sum(-1, keepdim=True)
        reg = torch.eye(3, device=p.device, dtype=p.dtype).expand(p.shape[0], 3, 3) * qef_reg_scale
        a = torch.cat([normals, reg], dim=1)
        b = torch.cat([rhs, (qef_reg_scale * centre).unsqueeze(-1)], dim=1)
        return torch.linalg.lstsq(a, b).solution.squeeze(-1)

    def _compute_reg_loss(self, vd: torch.Tensor, ue: torch.Tensor, edge_group_to_vd: torch.Tensor,
                          vd_num_edges: torch.Tensor) -> torch.Tensor:
        """FlexiCubes' L_dev per crossing: |distance to its dual vertex - the vertex's mean such distance|."""
        dist = torch.norm(ue - vd[edge_group_to_vd], dim=-1)
        mean = torch.zeros_like(vd[:, 0]).index_add_(0, edge_group_to_vd, dist) / vd_num_edges.reshape(-1).float()
        return (dist - mean[edge_group_to_vd]).abs()

    # -------------------------------------------------------------------------------------------------- cases
    @torch.no_grad()
    def _get_case_id(self, occ_fx8: torch.Tensor, surf_cubes: torch.Tensor, res) -> torch.Tensor:
        """Case ids of the surface cubes (``occ_fx8`` [F, 8] of all cubes, ``surf_cubes`` [F] mask); a problematic
        cube whose neighbour across its ambiguous face is problematic too switches to its alternative case
        (upstream's manifoldness fix). Neighbours are found by the cubes' integer positions: those of the sparse
        cube list of the current call, else of the dense grid (cube i x-major), as upstream's input."""
        coords = self._cube_coords
        if coords is None:
            coords = dense_cube_coords(occ_fx8.shape[0], res, occ_fx8.device)
        cube_coords = coords[surf_cubes]
        case_ids = (occ_fx8[surf_cubes].long() * self.cube_corners_idx.unsqueeze(0)).sum(-1)
        problem = self.check_table[case_ids]
        to_check = problem[:, 0] == 1
        if not bool(to_check.any()):
            return case_ids
        res = list(res) if isinstance(res, (list, tuple)) else [res] * 3
        idx = torch.nonzero(to_check).flatten()
        pos = cube_coords[idx].long()
        adj = pos + problem[idx, 1:4]
        extent = torch.tensor(res, dtype=torch.long, device=pos.device)
        in_range = ((adj >= 0) & (adj < extent)).all(dim=1)
        zeros = torch.zeros_like(pos[:, :1])
        problem_hash = backends.CoordHash(torch.cat([zeros, pos], dim=1).int())
        found = problem_hash.lookup(torch.cat([zeros, adj], dim=1)) >= 0
        flip = in_range & found
        case_ids[idx[flip]] = problem[idx[flip], 4]
        return case_ids

    # ------------------------------------------------------------------------------------------------- edges
    @torch.no_grad()
    def _identify_surf_edges(self, scalar_field: torch.Tensor, cube_idx: torch.Tensor, surf_cubes: torch.Tensor):
        """Unique edges of the surface cubes (as vertex pairs in the table's endpoint order, sorted) and which of
        them the surface crosses. Returns (surf_edges [E, 2], idx_map [S * 12]: surface-edge index of every
        surface-cube edge or -1, edge_counts [S * 12]: how many surface cubes share that edge, surf_edges_mask
        [S * 12] bool). The per-(cube, edge) arrays are narrow (int32 indices while they fit, int8 counts): at
        the mesh decoder's full size they are the extraction's largest tensors."""
        num_vertices = scalar_field.shape[0]
        cube_fx8 = cube_idx[surf_cubes].long()
        ends = self.cube_edges.reshape(12, 2)
        # the edges as codes first * V + second; with the vertices in grid order (the sparse extractor's), an
        # edge's first vertex and its direction fix the second, which spares the sort of the codes
        unique_codes, inverse, counts = backends.unique_pairs(
            cube_fx8[:, ends[:, 0]], cube_fx8[:, ends[:, 1]], num_vertices,
            self.edge_direction.expand(cube_fx8.shape[0], -1), len(EDGE_DIRECTION_ORDER),
            return_inverse=True, return_counts=True)
        inverse = inverse.reshape(-1)
        del cube_fx8
        occ_n = scalar_field < 0
        mask_edges = occ_n[unique_codes // num_vertices] != occ_n[unique_codes % num_vertices]
        surf_codes = unique_codes[mask_edges]
        del unique_codes
        surf_edges = torch.stack([surf_codes // num_vertices, surf_codes % num_vertices], dim=1)
        index = _index_dtype(surf_codes.shape[0])
        mapping = torch.full((mask_edges.shape[0],), -1, dtype=index, device=cube_idx.device)
        mapping[mask_edges] = torch.arange(surf_codes.shape[0], dtype=index, device=cube_idx.device)
        idx_map = mapping[inverse]
        edge_counts = counts.to(torch.int8)[inverse]  # at most 4 cubes share an edge
        return surf_edges, idx_map, edge_counts, idx_map >= 0

    # -------------------------------------------------------------------------------------- dual vertices
    def _compute_vd(self, voxelgrid_vertices, surf_cubes_fx8, surf_edges, scalar_field, case_ids, beta, alpha,
                    gamma_f, idx_map, qef_reg_scale, voxelgrid_colors, chunk: int = 1 << 18):
        """Dual vertices: per patch, the beta-weighted mean of its edges' crossings, each crossing interpolated
        with the alpha-scaled SDF (colours the same way). Work is chunked over (patch, edge) entries; the
        summation order per vertex is the entry order either way. Returns upstream's (vd, L_dev, vd_gamma,
        vd_idx_map, vd_color); L_dev, the training regulariser (``_compute_reg_loss``), is not computed at
        inference: a 0-d zero. ``surf_cubes_fx8`` and ``qef_reg_scale`` are accepted as upstream's (the crossings
        come from ``surf_edges`` / ``idx_map``; no QEF placement)."""
        x_nx3, s_n, colors = voxelgrid_vertices, scalar_field, voxelgrid_colors
        num_cubes = case_ids.shape[0]
        entries = self.dmc_table_small[case_ids]  # [F, 4, 7] int8
        cube_num_vd = self.num_vd_table[case_ids]
        has_vd = torch.arange(entries.shape[1], device=case_ids.device)[None] < cube_num_vd[:, None]
        vd_cube = vd_slots_in_upstream_order(has_vd, cube_num_vd)  # [V, 2] (cube, slot)
        num_vd = vd_cube.shape[0]
        index = _index_dtype(num_vd)
        vd_ids = torch.full(has_vd.shape, -1, dtype=index, device=case_ids.device)
        vd_ids[vd_cube[:, 0], vd_cube[:, 1]] = torch.arange(num_vd, dtype=index, device=case_ids.device)
        member = entries >= 0
        # entry_of: the entry's place in its (cube, slot): an entry's rank among the entries summed into the
        # same dual vertex (they are consecutive), which lets the sums below run in parallel in entry order
        cube_of, slot_of, entry_of = torch.nonzero(member, as_tuple=True)
        edge_group = entries[member].long()
        del entries, member
        group_vd = vd_ids[cube_of, slot_of]
        del vd_ids, slot_of
        flat = cube_of * 12 + edge_group
        ends = self.cube_edges.reshape(12, 2)

        # one accumulator: columns 0-2 the position sums, 3 the beta sum, then the colours' (each column is
        # summed on its own, so the sums are those of three separate index_add_ calls)
        width = 4 + (0 if colors is None else colors.shape[-1])
        sums = x_nx3.new_zeros(num_vd, width)
        for start in range(0, flat.shape[0], chunk):
            part = slice(start, start + chunk)
            cube, edge, target = cube_of[part], edge_group[part], group_vd[part]
            verts = surf_edges[idx_map[flat[part]]]  # [c, 2] vertex ids of each crossed edge
            alpha_ends = torch.stack([alpha[cube, ends[edge, 0]], alpha[cube, ends[edge, 1]]], dim=1)
            weights = (s_n[verts] * alpha_ends).unsqueeze(-1)  # [c, 2, 1]
            beta_group = beta[cube, edge].unsqueeze(-1)
            terms = x_nx3.new_empty(target.shape[0], width)
            terms[:, :3] = self._linear_interp(weights, x_nx3[verts]) * beta_group
            terms[:, 3:4] = beta_group
            if colors is not None:
                terms[:, 4:] = self._linear_interp(weights, colors[verts]) * beta_group
            backends.index_add_ranked_(sums, target, terms, entry_of[part], self.dmc_table_small.shape[-1])
        beta_sum = sums[:, 3:4]
        vd = sums[:, :3] / beta_sum
        vd_color = None if colors is None else sums[:, 4:] / beta_sum
        vd_gamma = gamma_f[vd_cube[:, 0]]
        vd_idx_map = torch.zeros(num_cubes * 12, dtype=index, device=case_ids.device)
        vd_idx_map[flat] = group_vd
        return vd, x_nx3.new_zeros(()), vd_gamma, vd_idx_map, vd_color

    # ------------------------------------------------------------------------------------------- triangles
    def _triangulate(self, scalar_field, surf_edges, vd, vd_gamma, edge_counts, idx_map, vd_idx_map, surf_edges_mask,
                     training: bool = False, vd_color=None):
        """One quad per crossed edge shared by 4 surface cubes, wound towards positive SDF, split along the
        diagonal with the larger gamma product. Returns upstream's (vd, faces, s_edges, edge_indices, vd_color)
        (vertices and colours unchanged at inference; training mode's quad-centre vertices are not
        implemented)."""
        if training:
            raise NotImplementedError("FlexiCubes training mode (quad centre vertices) is not implemented")
        s_n = scalar_field
        with torch.no_grad():
            group_mask = (edge_counts == 4) & surf_edges_mask
            group = idx_map[group_mask]
            vd_idx = vd_idx_map[group_mask]
            edge_indices, order = backends.sort(group, stable=True)
            quad_vd_idx = vd_idx[order].reshape(-1, 4)
            s_edges = s_n[surf_edges[edge_indices.reshape(-1, 4)[:, 0]].reshape(-1)].reshape(-1, 2)
            flip = s_edges[:, 0] > 0
            quad_vd_idx = torch.cat((quad_vd_idx[flip][:, [0, 1, 3, 2]], quad_vd_idx[~flip][:, [2, 3, 1, 0]]))
        quad_gamma = vd_gamma[quad_vd_idx.reshape(-1)].reshape(-1, 4)
        use_02 = quad_gamma[:, 0] * quad_gamma[:, 2] > quad_gamma[:, 1] * quad_gamma[:, 3]
        faces = torch.where(use_02[:, None], quad_vd_idx[:, self.quad_split_1.to(quad_vd_idx.device)],
                            quad_vd_idx[:, self.quad_split_2.to(quad_vd_idx.device)])
        return vd, faces.reshape(-1, 3).long(), s_edges, edge_indices.long(), vd_color

    def __call__(self, voxelgrid_vertices: torch.Tensor, scalar_field: torch.Tensor, cube_idx: torch.Tensor,
                 resolution, qef_reg_scale: Any = 1e-3, weight_scale: float = 0.99,
                 beta: Optional[torch.Tensor] = None,
                 alpha: Optional[torch.Tensor] = None, gamma_f: Optional[torch.Tensor] = None,
                 voxelgrid_colors: Optional[torch.Tensor] = None, training: bool = False, **kwargs: Any
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """Extract the mesh.

        Args:
            voxelgrid_vertices: [V, 3] (deformed) vertex positions; scalar_field: [V] SDF (negative = inside).
            cube_idx: [F, 8] vertex indices of each cube's corners (corner order of `tables.CUBE_CORNERS`).
            resolution: cubes per axis; cube_coords: [F, 3] integer cube positions (ambiguity neighbours).
            beta [F, 12], alpha [F, 8], gamma_f [F]: raw FlexiCubes weights; voxelgrid_colors [V, C] optional.
        Returns: (vertices [N, 3], faces [M, 3] int64, L_dev (0: no regulariser at inference), colors [N, C]).
        """
        # keyword `cube_coords` [F, 3]: integer positions of sparse cubes (upstream's input is always dense)
        cube_coords = kwargs.pop("cube_coords", None)
        if kwargs:
            raise TypeError(f"FlexiCubes got unexpected arguments {sorted(kwargs)}")
        if isinstance(qef_reg_scale, torch.Tensor):  # this package's older call form: cube_coords 5th
            cube_coords, qef_reg_scale = qef_reg_scale, self.qef_reg_scale
        self.qef_reg_scale, self.weight_scale = qef_reg_scale, weight_scale
        if cube_coords is None:  # upstream's dense input: cube i of a resolution^3 grid, x-major
            cube_coords = dense_cube_coords(cube_idx.shape[0], resolution, cube_idx.device)
        if training:
            raise NotImplementedError("FlexiCubes training mode (regularisers, quad centre vertices) is not "
                                      "implemented; call the mesh decoder in eval mode")
        self._tables_on(cube_idx.device)
        x_nx3, s_n = voxelgrid_vertices, scalar_field
        surf, occ_fx8 = self._identify_surf_cubes(s_n, cube_idx)
        zero = x_nx3.new_zeros(())
        if not bool(surf.any()):
            colors = None if voxelgrid_colors is None else x_nx3.new_zeros(0, voxelgrid_colors.shape[-1])
            return x_nx3.new_zeros(0, 3), torch.zeros(0, 3, dtype=torch.long, device=x_nx3.device), zero, colors
        beta, alpha, gamma_f = self._normalize_weights(beta, alpha, gamma_f, surf, weight_scale)
        self._cube_coords = cube_coords
        try:
            case_ids = self._get_case_id(occ_fx8, surf, resolution)
        finally:
            self._cube_coords = None
        del occ_fx8
        surf_edges, idx_map, edge_counts, surf_edges_mask = self._identify_surf_edges(s_n, cube_idx, surf)
        vd, _, vd_gamma, vd_idx_map, vd_color = self._compute_vd(x_nx3, None, surf_edges, s_n, case_ids, beta, alpha,
                                                                 gamma_f, idx_map, qef_reg_scale, voxelgrid_colors)
        vd, faces, _, _, vd_color = self._triangulate(s_n, surf_edges, vd, vd_gamma, edge_counts, idx_map, vd_idx_map,
                                                      surf_edges_mask, training, vd_color)
        return vd, faces, zero, vd_color
