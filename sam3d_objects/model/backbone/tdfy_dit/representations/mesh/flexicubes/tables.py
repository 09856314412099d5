"""Dual-marching-cubes lookup tables, derived here from first principles (not transcribed).

Cube conventions (upstream's): corner i sits at (i & 1, i >> 1 & 1, i >> 2 & 1); the 12 edges are the corner
pairs of `CUBE_EDGES` (their order fixes the per-edge weight channels). A corner is *inside* when its SDF is
negative; the case id of a cube is sum(2^i over inside corners).

For every case the crossed edges are grouped into surface patches (one dual vertex each): two crossed edges of
one cube face are joined by an arc of the marching-cubes contour on that face. A face with all four edges
crossed is ambiguous; the rule used is "inside corners are separated" (the arcs cut off each inside corner).
The patches are the connected components of the arc graph.

A case is *problematic* when one patch passes twice through an ambiguous face (both arcs of that face belong to
the same patch): two such cubes facing each other would produce a non-manifold edge. For those cases the table
records the direction of that face and the complementary case (255 - case, i.e. the same crossed edges with the
other face rule), which the extractor switches to when the neighbour across that face is problematic as well.
"""
from typing import Dict, List, Tuple

__all__ = ["CUBE_CORNERS", "CUBE_EDGES", "surface_patches", "build_tables", "edge_directions",
           "edge_ring_faces", "EDGE_RING_PAIRS"]

CUBE_CORNERS: List[Tuple[int, int, int]] = [(i & 1, i >> 1 & 1, i >> 2 & 1) for i in range(8)]
CUBE_EDGES: List[Tuple[int, int]] = [(0, 1), (1, 5), (4, 5), (0, 4), (2, 3), (3, 7), (6, 7), (2, 6), (2, 0),
                                     (3, 1), (7, 5), (6, 4)]
MAX_PATCHES = 4
MAX_PATCH_EDGES = 7


def _faces() -> List[Tuple[List[int], List[int], Tuple[int, int, int]]]:
    """(corners, edges, outward direction) of the 6 cube faces."""
    faces = []
    for axis in range(3):
        for side in (0, 1):
            corners = [i for i in range(8) if CUBE_CORNERS[i][axis] == side]
            edges = [e for e, (a, b) in enumerate(CUBE_EDGES) if a in corners and b in corners]
            direction = [0, 0, 0]
            direction[axis] = 1 if side else -1
            faces.append((corners, edges, tuple(direction)))
    return faces


FACES = _faces()


def _patch_rank(inside: List[int], patch: List[int]) -> List[int]:
    """Sort key of a patch inside its cube: the corners it separates on the minority side (inside corners when at
    most 4 corners are inside, outside corners otherwise), smallest first. This numbers a cube's dual vertices in
    upstream's order, so the extracted mesh's vertices come out in upstream's order (and with them the faces)."""
    minority = 1 if sum(inside) <= 4 else 0
    return sorted({c for e in patch for c in CUBE_EDGES[e] if inside[c] == minority})


def surface_patches(case: int):
    """(patches: list of sorted edge lists, in `_patch_rank` order; problem face direction or None) for one
    case."""
    inside = [(case >> i) & 1 for i in range(8)]
    crossed = [e for e, (a, b) in enumerate(CUBE_EDGES) if inside[a] != inside[b]]
    parent: Dict[int, int] = {e: e for e in crossed}

    def root(e: int) -> int:
        while parent[e] != e:
            parent[e] = parent[parent[e]]
            e = parent[e]
        return e

    ambiguous = []
    for corners, edges, direction in FACES:
        face_crossed = [e for e in edges if e in parent]
        if len(face_crossed) == 2:
            parent[root(face_crossed[0])] = root(face_crossed[1])
        elif len(face_crossed) == 4:
            arcs = [[e for e in face_crossed if c in CUBE_EDGES[e]] for c in corners if inside[c]]
            for a, b in arcs:
                parent[root(a)] = root(b)
            ambiguous.append((arcs, direction))
    patches: Dict[int, List[int]] = {}
    for e in crossed:
        patches.setdefault(root(e), []).append(e)
    problem = None
    for arcs, direction in ambiguous:
        if root(arcs[0][0]) == root(arcs[1][0]):
            problem = direction
    return sorted((sorted(p) for p in patches.values()), key=lambda p: _patch_rank(inside, p)), problem


def build_tables():
    """dmc_table [256][4][7] (edge ids, -1 padded), num_vd_table [256], check_table [256][5]
    (is_problem, dx, dy, dz, alternative case)."""
    dmc_table, num_vd_table, check_table = [], [], []
    for case in range(256):
        patches, problem = surface_patches(case)
        if len(patches) > MAX_PATCHES or any(len(p) > MAX_PATCH_EDGES for p in patches):
            raise AssertionError(f"case {case}: unexpected patch layout {patches}")
        rows = [p + [-1] * (MAX_PATCH_EDGES - len(p)) for p in patches]
        rows += [[-1] * MAX_PATCH_EDGES] * (MAX_PATCHES - len(rows))
        dmc_table.append(rows)
        num_vd_table.append(len(patches))
        check_table.append([1, *problem, 255 - case] if problem else [0, 0, 0, 0, 0])
    return dmc_table, num_vd_table, check_table


def _as_tensors():
    import torch
    dmc, num_vd, check = build_tables()
    return (torch.tensor(dmc, dtype=torch.long), torch.tensor(num_vd, dtype=torch.long),
            torch.tensor(check, dtype=torch.long))


# upstream's table names: (256, 4, 7) dual-vertex edge lists, (256,) dual-vertex counts, (256, 5) ambiguity checks
dmc_table, num_vd_table, check_table = _as_tensors()


def build_tet_table() -> List[List[int]]:
    """(256, 6) per case and cube face (order -x, +x, -y, +y, -z, +z): how that face joins a tetrahedral split.

    The spec gives only tet_table's role (indices used when a cube is split into tetrahedra for tet-mesh output;
    6 entries per case; values -1..12), not its contents, so this table is derived from that role: the entry is
    -1 when all four corners of the face are outside (no tetrahedron is built on it), 12 when all four are inside
    (the face is a full solid face), otherwise the index (0-11) of the face's first crossed cube edge, whose
    dual vertex (look it up in dmc_table) is the apex the face's tetrahedra attach to.
    """
    table = []
    for case in range(256):
        inside = [(case >> i) & 1 for i in range(8)]
        row = []
        for corners, edges, _ in _faces():
            n_inside = sum(inside[c] for c in corners)
            if n_inside == 0:
                row.append(-1)
            elif n_inside == 4:
                row.append(12)
            else:
                row.append(next(e for e in edges if inside[CUBE_EDGES[e][0]] != inside[CUBE_EDGES[e][1]]))
        table.append(row)
    return table


def _tet_tensor():
    import torch
    return torch.tensor(build_tet_table(), dtype=torch.long)


tet_table = _tet_tensor()


# the 4 cubes around a cube edge, numbered by two bits (bit 0: the later of the two axes across the edge, bit 1:
# the earlier), visited as a ring 0 -> 1 -> 3 -> 2 -> 0 (upstream's adj_pairs, flattened)
EDGE_RING_PAIRS: List[Tuple[int, int]] = [(0, 1), (1, 3), (3, 2), (2, 0)]


def edge_directions() -> List[int]:
    """Per cube edge (`CUBE_EDGES` order) the axis it runs along (0 = x, 1 = y, 2 = z)."""
    return [next(axis for axis in range(3) if CUBE_CORNERS[a][axis] != CUBE_CORNERS[b][axis]) for a, b in CUBE_EDGES]


def edge_ring_faces() -> List[List[List[int]]]:
    """[3][4][2]: for an edge along each axis, per step of `EDGE_RING_PAIRS` the face (index 2 * axis + side, side 1
    = positive) the step leaves the first cube through and the face it enters the second cube through."""
    table = []
    for direction in range(3):
        first, second = [axis for axis in range(3) if axis != direction]
        bit_axis = {1: second, 2: first}
        row = []
        for i, j in EDGE_RING_PAIRS:
            axis = bit_axis[i ^ j]
            leaving_positive = bool(j & (i ^ j))
            row.append([2 * axis + 1, 2 * axis] if leaving_positive else [2 * axis, 2 * axis + 1])
        table.append(row)
    return table
