"""Sparse FlexiCubes extraction (no dense grid) against the dense-grid extraction upstream performs, and mesh
sanity on analytic SDFs. Meshes are compared as SETS: vertex order and face order are implementation-defined
(the sparse path enumerates only the cubes next to voxels), so vertices are matched by position and faces are
compared as sets of (rotation-normalised, so winding counts) vertex triples."""
import torch

from sam3d_objects.model.backbone.tdfy_dit.modules.sparse import SparseTensor
from sam3d_objects.model.backbone.tdfy_dit.representations.mesh import SparseFeatures2Mesh
from sam3d_objects.model.backbone.tdfy_dit.representations.mesh.flexicubes import FlexiCubes
from sam3d_objects.model.backbone.tdfy_dit.representations.mesh.flexicubes.tables import (CUBE_EDGES,
                                                                                          build_tables)
from sam3d_objects.model.backbone.tdfy_dit.representations.mesh.utils_cube import construct_dense_grid
from benchmarks.bench_mesh_decoder import dense_extract



def oriented_faces(vertices: torch.Tensor, faces: torch.Tensor, reference: torch.Tensor):
    """Faces re-indexed to reference vertex ids (nearest position) as rotation-normalised tuples."""
    match = torch.cdist(vertices.double(), reference.double()).argmin(dim=1)
    out = set()
    for a, b, c in match[faces].tolist():
        rot = min((a, b, c), (b, c, a), (c, a, b))
        out.add(rot)
    return out, match


def random_cubefeats(res: int, n: int, seed: int) -> SparseTensor:
    g = torch.Generator().manual_seed(seed)
    xyz = torch.unique(torch.randint(0, res, (n, 3), generator=g), dim=0)
    coords = torch.cat([torch.zeros(xyz.shape[0], 1, dtype=torch.long), xyz], 1).int()
    feats = torch.randn(coords.shape[0], 101, generator=g)
    feats[:, :8] = feats[:, :8] * 0.1 + 0.02  # sdf around 0 so that many cubes hold surface
    return SparseTensor(feats=feats, coords=coords)


def test_sparse_equals_dense_grid_extraction():
    res = 12
    extractor = SparseFeatures2Mesh(res=res, use_color=True)
    for seed in range(3):
        x = random_cubefeats(res, 500, seed)
        sparse = extractor(x)
        dense = dense_extract(extractor, x)
        assert sparse.vertices.shape == dense.vertices.shape and sparse.faces.shape == dense.faces.shape
        dist = torch.cdist(sparse.vertices.double(), dense.vertices.double())
        assert float(dist.min(dim=1).values.max()) < 1e-6
        faces_sparse, match = oriented_faces(sparse.vertices, sparse.faces, dense.vertices)
        faces_dense, _ = oriented_faces(dense.vertices, dense.faces, dense.vertices)
        assert faces_sparse == faces_dense
        torch.testing.assert_close(sparse.vertex_attrs, dense.vertex_attrs[match], rtol=1e-5, atol=1e-6)


def sphere_mesh(res: int, radius: float):
    verts, cubes = construct_dense_grid(res)
    pos = verts.float() / res - 0.5
    sdf = pos.norm(dim=1) - radius
    ids = torch.arange(res ** 3)
    cube_coords = torch.stack([ids // (res * res), ids // res % res, ids % res], 1)
    return FlexiCubes()(pos, sdf, cubes, res, cube_coords)


def test_sphere_is_closed_manifold_with_outward_winding():
    v, f, _, _ = sphere_mesh(16, 0.3)
    edges = torch.cat([f[:, [0, 1]], f[:, [1, 2]], f[:, [2, 0]]])
    undirected = torch.unique(edges.sort(dim=1).values, dim=0, return_counts=True)[1]
    assert bool((undirected == 2).all()), "every edge must be shared by exactly two faces"
    assert v.shape[0] - undirected.shape[0] + f.shape[0] == 2  # Euler characteristic of a sphere
    assert float((v.norm(dim=1) - 0.3).abs().max()) < 1.0 / 16
    normals = torch.cross(v[f[:, 1]] - v[f[:, 0]], v[f[:, 2]] - v[f[:, 0]], dim=1)
    centres = v[f].mean(dim=1)
    assert bool(((normals * centres).sum(dim=1) > 0).all()), "faces wind towards positive SDF (outward)"


def test_tables_are_consistent():
    dmc, num_vd, check = build_tables()
    for case in range(256):
        inside = [(case >> i) & 1 for i in range(8)]
        crossed = sorted(e for e, (a, b) in enumerate(CUBE_EDGES) if inside[a] != inside[b])
        groups = [[e for e in row if e >= 0] for row in dmc[case][:num_vd[case]]]
        assert sorted(e for g in groups for e in g) == crossed  # every crossed edge in exactly one patch
        assert all(len(g) >= 3 for g in groups)
        if check[case][0]:
            assert check[case][4] == 255 - case and sum(abs(d) for d in check[case][1:4]) == 1
    assert num_vd[0] == num_vd[255] == 0 and max(num_vd) == 4


def test_empty_inputs_give_empty_meshes():
    extractor = SparseFeatures2Mesh(res=8, use_color=True)
    empty = SparseTensor(feats=torch.zeros(0, 101), coords=torch.zeros(0, 4, dtype=torch.int32))
    mesh = extractor(empty)
    assert mesh.vertices.shape == (0, 3) and mesh.faces.shape == (0, 3) and not mesh.success
    outside = SparseTensor(feats=torch.ones(3, 101), coords=torch.tensor([[0, 1, 1, 1], [0, 2, 2, 2], [0, 5, 5, 5]],
                                                                          dtype=torch.int32))
    mesh = extractor(outside)  # all SDF > 0: no surface
    assert mesh.faces.shape[0] == 0 and not mesh.success
