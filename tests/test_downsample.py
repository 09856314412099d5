"""sam3d_objects.tools.downsample: counts, attribute preservation, determinism, meshes."""
import argparse

import numpy as np
import pytest
from plyfile import PlyData, PlyElement

from sam3d_objects.tools import downsample as D


def _splat_ply(path, n=1000, seed=0):
    g = np.random.default_rng(seed)
    names = ["x", "y", "z", "nx", "ny", "nz", "f_dc_0", "f_dc_1", "f_dc_2", "opacity", "scale_0", "scale_1",
             "scale_2", "rot_0", "rot_1", "rot_2", "rot_3"]
    data = np.empty(n, dtype=[(k, "f4") for k in names])
    for k in names:
        data[k] = g.normal(size=n).astype(np.float32)
    PlyData([PlyElement.describe(data, "vertex")]).write(str(path))
    return data


def _read(path):
    return PlyData.read(str(path))["vertex"].data


def test_random_counts_attributes_and_seed(tmp_path):
    src = tmp_path / "splat.ply"
    data = _splat_ply(src)
    a, b, c = tmp_path / "a.ply", tmp_path / "b.ply", tmp_path / "c.ply"
    assert D.downsample(src, a, fraction=0.25, seed=3) == 250
    D.downsample(src, b, fraction=0.25, seed=3)
    D.downsample(src, c, fraction=0.25, seed=4)
    ra, rb, rc = _read(a), _read(b), _read(c)
    assert ra.dtype.names == data.dtype.names and len(ra) == 250
    assert np.array_equal(ra, rb) and not np.array_equal(ra, rc)
    # Every kept row is an unchanged row of the input (all 17 attributes).
    rows = {r.tobytes() for r in data}
    assert all(r.tobytes() in rows for r in ra)


def test_uniform_and_voxel(tmp_path):
    src = tmp_path / "splat.ply"
    data = _splat_ply(src, n=997)
    out = tmp_path / "u.ply"
    assert D.downsample(src, out, uniform=10) == 100
    assert np.array_equal(_read(out), data[::10])
    # Voxel: one gaussian per occupied cell, the most opaque one.
    assert D.downsample(src, out, voxel=1.0) > 0
    kept = _read(out)
    xyz = np.stack([data["x"], data["y"], data["z"]], 1)
    cells = {tuple(c) for c in np.floor(xyz / 1.0).astype(int)}
    assert len(kept) == len(cells)
    for row in kept[:50]:
        cell = np.floor(np.array([row["x"], row["y"], row["z"]]) / 1.0).astype(int)
        same = (np.floor(xyz / 1.0).astype(int) == cell).all(1)
        assert row["opacity"] == data["opacity"][same].max()


def test_mesh_point_cloud_and_faces(tmp_path):
    trimesh = pytest.importorskip("trimesh")
    sphere = trimesh.creation.icosphere(subdivisions=3)
    sphere.visual.vertex_colors = np.tile([10, 200, 30, 255], (len(sphere.vertices), 1)).astype(np.uint8)
    src = tmp_path / "mesh.glb"
    sphere.export(str(src))
    pts = tmp_path / "pts.ply"
    n = D.downsample(src, pts, fraction=0.5, seed=0)
    cloud = trimesh.load(str(pts))
    assert len(cloud.vertices) == n == round(0.5 * len(sphere.vertices))
    pytest.importorskip("fast_simplification", reason="mesh decimation needs fast-simplification")
    dec = tmp_path / "dec.glb"
    nf = D.downsample(src, dec, faces=200)
    assert abs(nf - 200) <= 20
    assert len(trimesh.load(str(dec), force="mesh").faces) == nf


def test_cli_parser_and_errors(tmp_path):
    parser = argparse.ArgumentParser()
    D.add_downsample_parser(parser.add_subparsers(dest="command"))
    src = tmp_path / "splat.ply"
    _splat_ply(src, n=100)
    args = parser.parse_args(["downsample", str(src), "-o", str(tmp_path / "o.ply"), "--random", "0.5", "--seed",
                              "1"])
    assert args.handler(args) == 0 and len(_read(tmp_path / "o.ply")) == 50
    with pytest.raises(SystemExit):
        parser.parse_args(["downsample", str(src), "-o", "x.ply", "--random", "0.5", "--uniform", "2"])
    with pytest.raises(ValueError, match="--faces applies to meshes"):
        D.downsample(src, tmp_path / "x.ply", faces=10)
    with pytest.raises(ValueError, match="--random"):
        D.downsample(src, tmp_path / "x.ply", fraction=1.5)
    assert not (tmp_path / "x.ply").exists() and not (tmp_path / "x.partial.ply").exists()
