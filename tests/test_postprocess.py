"""postprocessing_utils: simplification, interior removal / hole filling, UV bake and GLB export on small meshes."""
import io
import math

import numpy as np
import pytest
import torch

trimesh = pytest.importorskip("trimesh")
from scipy.spatial import cKDTree  # noqa: E402

from sam3d_objects.model.backbone.tdfy_dit.utils import postprocessing_utils as P  # noqa: E402


def _sphere(subdivisions=4, radius=0.5):
    m = trimesh.creation.icosphere(subdivisions=subdivisions, radius=radius)
    return np.asarray(m.vertices, np.float32), np.asarray(m.faces, np.int64)


def _surface_samples(v, f, n, seed=0):
    return trimesh.sample.sample_surface(trimesh.Trimesh(v, f, process=False), n, seed=seed)[0]


def _hausdorff(a_v, a_f, b_v, b_f):
    # Dense samples: the nearest-sample distance overestimates the true one by about the spacing (~0.005).
    a, b = _surface_samples(a_v, a_f, 100000), _surface_samples(b_v, b_f, 100000, seed=1)
    return max(cKDTree(b).query(a)[0].max(), cKDTree(a).query(b)[0].max())


def _field(p: np.ndarray) -> np.ndarray:
    """A smooth procedural colour field on the sphere (values well inside (0, 1))."""
    p = np.asarray(p, dtype=np.float64)
    return np.stack([0.5 + 0.35 * np.sin(6 * p[:, 0]), 0.5 + 0.35 * np.cos(5 * p[:, 1] + 1),
                     0.45 + 0.3 * np.sin(4 * p[:, 2] + 4 * p[:, 0])], 1)


def test_simplify_keeps_surface():
    pytest.importorskip("fast_simplification", reason="mesh simplification needs fast-simplification")
    # A sphere with a bump, so the decimation has curvature to respect.
    v, f = _sphere(5)
    v = v * (1 + 0.2 * np.exp(-((v[:, :1] - 0.5) ** 2) / 0.02))
    v2, f2 = P.postprocess_mesh(v, f, simplify=True, simplify_ratio=0.9, fill_holes=False)
    assert v2.dtype == np.float32 and f2.dtype == np.int32
    assert abs(len(f2) - 0.1 * len(f)) < 0.02 * len(f)
    assert _hausdorff(v, f, v2, f2) < 0.02  # object ~1 unit across; the input's edges are ~0.02 long
    assert trimesh.Trimesh(v2, f2).is_watertight


def test_interior_faces_removed():
    outer_v, outer_f = _sphere(3)
    inner_v, inner_f = _sphere(2, radius=0.2)
    v = np.concatenate([outer_v, inner_v])
    f = np.concatenate([outer_f, inner_f + len(outer_v)])
    v2, f2 = P.postprocess_mesh(v, f, simplify=False, fill_holes=True, fill_holes_resolution=96,
                                fill_holes_num_views=24)
    assert len(f2) == len(outer_f)
    assert np.allclose(np.linalg.norm(v2, axis=1), 0.5, atol=1e-5)  # only the outer shell is left


def test_fill_holes_closes_punched_hole():
    v, f = _sphere(3)
    top = np.argmax(v[:, 2])
    punched = f[~(f == top).any(1)]  # the fan of faces around the top vertex: a hole with one edge per face
    hole_edges = len(f) - len(punched)
    assert hole_edges in (5, 6)
    assert not trimesh.Trimesh(v, punched, process=False).is_watertight
    v2, f2 = P.postprocess_mesh(v, punched, simplify=False, fill_holes=True, fill_holes_resolution=64,
                                fill_holes_num_views=12, fill_holes_max_hole_nbe=32)
    closed = trimesh.Trimesh(v2, f2, process=False)
    assert closed.is_watertight and closed.is_winding_consistent
    assert _hausdorff(v, f, v2, f2) < 0.02
    # A hole larger than max_hole_nbe stays open.
    v3, f3 = P.postprocess_mesh(v, punched, simplify=False, fill_holes=True, fill_holes_resolution=64,
                                fill_holes_num_views=12, fill_holes_max_hole_nbe=hole_edges - 1)
    assert len(f3) == len(punched)


def _splat_sphere(n=5000, radius=0.5, scale=0.02):
    """Duck-typed Gaussians covering a sphere, coloured by ``_field``."""
    from sam3d_objects.render import SH_C0

    i = np.arange(n) + 0.5
    phi, theta = np.arccos(1 - 2 * i / n), math.pi * (1 + 5 ** 0.5) * i
    xyz = radius * np.stack([np.cos(theta) * np.sin(phi), np.sin(theta) * np.sin(phi), np.cos(phi)], 1)

    class Splats:
        get_xyz = torch.tensor(xyz, dtype=torch.float32)
        get_scaling = torch.full((n, 3), scale)
        get_rotation = torch.tensor([[1.0, 0, 0, 0]]).repeat(n, 1)
        get_opacity = torch.full((n, 1), 0.99)
        _features_dc = torch.tensor((_field(xyz) - 0.5) / SH_C0, dtype=torch.float32).view(n, 1, 3)

    return Splats()


@pytest.fixture(scope="module")
def baked():
    pytest.importorskip("xatlas", reason="UV unwrapping needs xatlas")
    from sam3d_objects.model.backbone.tdfy_dit.representations.mesh.cube2mesh import MeshExtractResult

    v, f = _sphere(3, radius=0.5)
    mesh = MeshExtractResult(torch.tensor(v), torch.tensor(f), torch.rand(len(v), 6))
    gs = _splat_sphere()
    out = P.to_glb(gs, mesh, with_mesh_postprocess=False, texture_size=256, verbose=False, bake_views=12,
                   bake_resolution=96, bake_steps=60)
    return gs, out


@pytest.mark.slow  # ~20 s: renders the splats from 12 + 3 views on the CPU
def test_bake_matches_gaussian_renders_on_held_out_views(baked):
    from sam3d_objects.render import orbit_camera, render_gaussian

    gs, out = baked
    errors, biases = [], []
    for yaw, pitch in [(17, 33), (200, -25), (290, 5)]:  # not among the bake's Hammersley views
        cam = orbit_camera(yaw, pitch, 2.0, fov_deg=40.0, width=96)
        ref = render_gaussian(gs, cam, background=(0.0, 0.0, 0.0))
        img, hit = P.render_textured_mesh(out, cam)
        inner = hit & (ref.alpha.numpy() > 0.99)
        # Interior pixels only: the silhouettes of a sphere of splats and of a polygonal sphere differ slightly.
        errors.append(np.abs(img[inner] - ref.color.numpy()[inner]).mean(0))
        biases.append((img[inner] - ref.color.numpy()[inner]).mean(0))
    mae, bias = np.mean(errors, 0), np.mean(biases, 0)
    print("held-out mean abs error per channel (0-1 scale):", mae, "mean signed error:", bias)
    # The floor (~0.03) is view dependence of the splat renders (blobs blend differently at other angles).
    assert (mae < 0.05).all(), mae
    assert (np.abs(bias) < 0.015).all(), bias  # washed-out / sRGB-linear mix-ups show up as a bias
    # Not washed out: the baked texture keeps the field's contrast.
    tex = np.asarray(out.visual.material.baseColorTexture.convert("RGB")) / 255.0
    assert tex.std(axis=(0, 1)).min() > 0.1


def test_bake_reproduces_procedural_field_directly():
    pytest.importorskip("xatlas", reason="UV unwrapping needs xatlas")
    v, f = _sphere(3)
    v2, f2, uv = P.parametrize_mesh(v, f)
    assert len(f2) == len(f) and uv.min() >= 0 and uv.max() <= 1
    cams = P.sphere_hammersley_cameras(12, 96)
    obs, masks = [], []
    for cam in cams:
        rast = P.rasterize_view(torch.tensor(v2), torch.tensor(f2.astype(np.int64)), cam)
        pos = P.R.interpolate(torch.tensor(v2), rast.unsqueeze(0), torch.tensor(f2.astype(np.int64)))[0]
        hit = (rast[..., 3] > 0).numpy()
        img = np.zeros((96, 96, 3))
        img[hit] = _field(pos.numpy()[hit])
        obs.append((img * 255 + 0.5).astype(np.uint8))
        masks.append(hit)
    tex = P.bake_texture(v2, f2, uv, obs, masks, [c.world_to_camera.numpy() for c in cams],
                         [P._normalized_intrinsics(c) for c in cams], texture_size=128, mode="fast", device="cpu")
    assert tex.shape == (128, 128, 3) and tex.dtype == np.uint8
    # Texel -> surface point through the UV layout; compare the texel with the field there.
    rast = P.R.rasterize(torch.tensor(np.c_[uv * 2 - 1, np.zeros((len(uv), 1)), np.ones((len(uv), 1))],
                                      dtype=torch.float32), torch.tensor(f2.astype(np.int64)), (128, 128))
    pos = P.R.interpolate(torch.tensor(v2), rast, torch.tensor(f2.astype(np.int64)))[0].numpy()
    inside = rast[0, ..., 3].numpy() > 0
    baked_rgb = tex[::-1][inside] / 255.0  # texture row 0 is v = 1
    err = np.abs(baked_rgb - _field(pos[inside])).mean(0)
    assert (err < 0.03).all(), err
    with pytest.raises(ValueError, match="Unknown mode"):
        P.bake_texture(v2, f2, uv, obs, masks, [], [], mode="nope")


def test_glb_round_trip_with_texture():
    pytest.importorskip("xatlas", reason="UV unwrapping needs xatlas")
    from sam3d_objects.model.backbone.tdfy_dit.representations.mesh.cube2mesh import MeshExtractResult

    v, f = _sphere(2)
    mesh = MeshExtractResult(torch.tensor(v), torch.tensor(f), torch.rand(len(v), 6))
    out = P.to_glb(_splat_sphere(n=800, scale=0.05), mesh, with_mesh_postprocess=False, texture_size=256,
                   verbose=False, bake_views=4, bake_resolution=48, bake_steps=5)
    assert isinstance(out, trimesh.Trimesh)
    data = out.export(file_type="glb")
    loaded = trimesh.load(io.BytesIO(data), file_type="glb", force="mesh")
    assert loaded.visual.uv is not None and loaded.visual.uv.shape == (len(loaded.vertices), 2)
    image = loaded.visual.material.baseColorTexture
    assert image is not None and image.size == (256, 256)
    assert np.array_equal(np.asarray(image.convert("RGB")), np.asarray(out.visual.material.baseColorTexture))
    # z-up -> y-up as upstream: (x, y, z) -> (x, z, -y).
    vz = np.array([[0.0, 0.0, 1.0]]) @ P._ZUP_TO_YUP
    assert np.allclose(vz, [[0, 1, 0]])


def test_vertex_colour_path_is_unchanged():
    from sam3d_objects.model.backbone.tdfy_dit.representations.mesh.cube2mesh import MeshExtractResult

    v, f = _sphere(1)
    colours = torch.rand(len(v), 6)
    mesh = MeshExtractResult(torch.tensor(v), torch.tensor(f), colours)
    out = P.to_glb(None, mesh, with_mesh_postprocess=False, with_texture_baking=False, use_vertex_color=True)
    assert len(out.vertices) == len(v)
    assert np.allclose(out.vertices, v @ P._ZUP_TO_YUP, atol=1e-6)
    assert np.abs(out.visual.vertex_colors[:, :3] / 255.0 - colours[:, :3].numpy()).max() < 1 / 255 + 1e-6
