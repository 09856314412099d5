"""Surface finish: property accessors with upstream's setter signatures, postprocess_mesh's device default,
flexicubes tet_table, and inference_utils' voxelize_mesh / trimesh2o3d_mesh / o3d_plane_estimation."""
import inspect
import sys

import numpy as np
import pytest
import torch

from sam3d_objects.model.backbone.generator.base import Base
from sam3d_objects.model.backbone.tdfy_dit.modules.sparse.basic import SparseTensor
from sam3d_objects.model.backbone.tdfy_dit.representations.mesh.flexicubes import tables
from sam3d_objects.model.backbone.tdfy_dit.utils import postprocessing_utils as pu
from sam3d_objects.pipeline import inference_utils as iu


def test_generator_seed_and_random_generator_accessors():
    assert list(inspect.signature(Base.seed.fget).parameters) == ["self", "value"]
    assert list(inspect.signature(Base.random_generator.fget).parameters) == ["self", "generator"]
    b = Base(seed_or_generator=7)
    first = torch.randn(3, generator=b.random_generator)
    b.seed = 7  # reseeding restarts the stream
    torch.testing.assert_close(torch.randn(3, generator=b.random_generator), first)
    with pytest.raises(AttributeError, match="Cannot read attribute 'seed'"):
        _ = b.seed
    g = torch.Generator().manual_seed(1)
    b.random_generator = g
    assert b.random_generator is g
    assert Base().random_generator is torch.default_generator


def test_sparse_tensor_feats_coords_accessors():
    assert list(inspect.signature(SparseTensor.feats.fget).parameters) == ["self", "value"]
    coords = torch.tensor([[0, 0, 0, 0], [0, 1, 0, 0]], dtype=torch.int32)
    st = SparseTensor(feats=torch.ones(2, 3), coords=coords)
    assert torch.equal(st.feats, torch.ones(2, 3)) and torch.equal(st.coords, coords)
    st.feats = torch.zeros(2, 3)
    st.coords = coords + 1
    assert torch.equal(st.feats, torch.zeros(2, 3)) and torch.equal(st.coords, coords + 1)


def test_postprocess_mesh_device_has_a_device_agnostic_default():
    assert inspect.signature(pu.postprocess_mesh).parameters["device"].default == "cpu"


def test_tet_table_matches_its_documented_role():
    tet = tables.tet_table
    assert tet.shape == (256, 6) and tet.dtype == torch.long
    assert int(tet.min()) == -1 and int(tet.max()) == 12
    corners = np.array([[i & 1, i >> 1 & 1, i >> 2 & 1] for i in range(8)])
    faces = [(axis, side) for axis in range(3) for side in (0, 1)]
    rng = np.random.default_rng(0)
    for case in rng.choice(256, 40, replace=False).tolist() + [0, 255, 1, 129]:
        inside = np.array([(case >> i) & 1 for i in range(8)])
        for f, (axis, side) in enumerate(faces):
            on_face = corners[:, axis] == side
            n = int(inside[on_face].sum())
            e = int(tet[case, f])
            if n == 0:
                assert e == -1
            elif n == 4:
                assert e == 12
            else:  # a crossed edge of this face, used by one of the case's dual vertices
                a, b = tables.CUBE_EDGES[e]
                assert on_face[a] and on_face[b] and inside[a] != inside[b]
                assert e in tables.dmc_table[case].flatten().tolist()


def test_voxelize_mesh_marks_the_surface_and_normalises_in_place():
    import trimesh
    box = trimesh.creation.box(extents=(1.0, 2.0, 1.0))  # y-up, longest side 2 -> scale 0.5
    occ, scale, center = iu.voxelize_mesh(box, resolution=16)
    assert occ.shape == (1, 16, 16, 16) and occ.dtype == torch.long
    assert scale == 0.5 and np.allclose(center, 0)
    # in place: the vertices are now the z-up unit-box version (y extent 2 -> z extent 1)
    np.testing.assert_allclose(np.ptp(np.asarray(box.vertices), axis=0), [0.5, 0.5, 1.0], atol=1e-5)
    g = occ[0]
    assert int(g[8, 8, 8]) == 0  # hollow inside: a surface voxelisation
    pts = box.sample(2000, seed=0) if "seed" in inspect.signature(box.sample).parameters else box.sample(2000)
    idx = np.clip(((pts + 0.5) * 16).astype(int), 0, 15)
    assert int(g[idx[:, 0], idx[:, 1], idx[:, 2]].min()) == 1  # every surface sample lies in an occupied voxel
    unit = trimesh.creation.box(extents=(1.0, 1.0, 1.0))
    _, s2, c2 = iu.voxelize_mesh(unit)
    assert s2 is None and c2 is None


def test_trimesh2o3d_mesh(monkeypatch):
    import trimesh
    box = trimesh.creation.box()
    try:
        import open3d  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install open3d"):
            iu.trimesh2o3d_mesh(box)
        return
    m = iu.trimesh2o3d_mesh(box)
    np.testing.assert_allclose(np.asarray(m.vertices), box.vertices)
    np.testing.assert_array_equal(np.asarray(m.triangles), box.faces)


def test_o3d_plane_estimation_finds_the_floor():
    rng = np.random.default_rng(1)
    floor = np.c_[rng.uniform(-1, 1, 600), -1.0 + rng.normal(0, 0.003, 600), rng.uniform(2, 4, 600)]
    clutter = rng.uniform(-1, 1, (150, 3)) + [0, 0.5, 3]
    quad = iu.o3d_plane_estimation(np.r_[floor, clutter])
    v = np.asarray(quad.vertices)
    assert v.shape == (4, 3) and len(quad.faces) == 2
    np.testing.assert_allclose(v[:, 2], 1.0, atol=0.02)  # camera y = -1 -> GLB frame (x, z, -y): third coord 1
    assert np.all(np.asarray(quad.visual.face_colors)[:, :3] == 128)
    # extends beyond the inliers, more on the side away from the camera
    assert v[:, 1].max() > 4.0 and v[:, 1].min() < 2.0 and v[:, 0].max() > 1.0
