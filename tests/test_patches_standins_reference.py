"""Every stand-in of `patches` against an independent reference: the real package where it installs on this CPU
(spconv's CPU build, torchvision), float64 brute force or explicit maths from the package's documented
conventions otherwise (pytorch3d, vox2seq, kaolin, torchsparse, diffoctreerast, diff_gaussian_rasterization,
gsplat have no CPU builds for this torch: each has a real-package comparison that runs where the package imports
and otherwise skips saying so).

The stand-in classes are used directly (``patches.<name>_shim``): they are what ``patches.apply()`` registers, and
no global state is touched; the registration itself is checked in a fresh interpreter at the end."""
import importlib.util
import inspect
import math

import pytest
import torch

from patches import pytorch3d_render as p3r
from patches import pytorch3d_shim as p3d

NO_CPU_BUILD = {
    "pytorch3d": "pytorch3d has no wheels for this torch and builds CUDA extensions from source",
    "vox2seq": "vox2seq is a CUDA extension (TRELLIS)",
    "kaolin": "kaolin ships CUDA builds for specific torch versions only",
    "torchsparse": "torchsparse compiles CUDA kernels",
    "diffoctreerast": "diffoctreerast is a CUDA extension",
    "diff_gaussian_rasterization": "diff_gaussian_rasterization is a CUDA extension",
    "gsplat": "gsplat compiles CUDA kernels",
}


def real(name: str):
    """The real package, or a skip saying why it cannot be compared against here."""
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"real {name} is not installed here ({NO_CPU_BUILD[name]}); the float64 references of this "
                    f"file stand in for it")
    try:
        return importlib.import_module(name)
    except Exception as error:  # noqa: BLE001  a CUDA build on a CPU machine
        pytest.skip(f"real {name} does not import here ({type(error).__name__}: {error})")


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


# ------------------------------------------------------------------------------------- pytorch3d: brute force
def _cube(center=(0.0, 0.0, 3.0), half=0.5, dtype=torch.float32):
    c = torch.tensor(center, dtype=dtype)
    corners = torch.tensor([[x, y, z] for x in (-1, 1) for y in (-1, 1) for z in (-1, 1)], dtype=dtype)
    faces = torch.tensor([[0, 1, 3], [0, 3, 2], [4, 6, 7], [4, 7, 5], [0, 4, 5], [0, 5, 1],
                          [2, 3, 7], [2, 7, 6], [0, 2, 6], [0, 6, 4], [1, 5, 7], [1, 7, 3]])
    return c + half * corners, faces


def _brute_silhouette(verts_view, faces, H, W, fx, fy, px, py, blur, sigma, k):
    """PyTorch3D's soft silhouette of a mesh seen by a screen-space camera, pixel by pixel in float64 Python:
    pixels u = px - fx X / Z, v = py - fy Y / Z (the OpenCV pixel of (-X, -Y, Z)); NDC (W - 2u) / s,
    (H - 2v) / s; a face reaches a pixel when the centre is inside or its squared distance is below ``blur``; the
    k nearest by perspective-correct depth (clipped barycentrics) count; alpha = 1 - prod(1 - sigmoid(-d/sigma))."""
    s = min(H, W)
    vv = verts_view.double().tolist()
    ndc = [((W - 2 * (px - fx * x / z)) / s, (H - 2 * (py - fy * y / z)) / s, z) for x, y, z in vv]

    def seg2(p, a, b):
        ex, ey = b[0] - a[0], b[1] - a[1]
        t = ((p[0] - a[0]) * ex + (p[1] - a[1]) * ey) / (ex * ex + ey * ey)
        t = min(max(t, 0.0), 1.0)
        return (p[0] - a[0] - t * ex) ** 2 + (p[1] - a[1] - t * ey) ** 2

    alpha = torch.zeros(H, W, dtype=torch.float64)
    for i in range(H):
        for j in range(W):
            p = ((W - 2 * j - 1) / s, (H - 2 * i - 1) / s)
            hits = []
            for f in faces.tolist():
                a, b, c = (ndc[n] for n in f)
                area = (b[0] - a[0]) * (c[1] - a[1]) - (c[0] - a[0]) * (b[1] - a[1])
                w0 = ((b[0] - p[0]) * (c[1] - p[1]) - (c[0] - p[0]) * (b[1] - p[1])) / area
                w1 = ((c[0] - p[0]) * (a[1] - p[1]) - (a[0] - p[0]) * (c[1] - p[1])) / area
                w = [w0, w1, 1 - w0 - w1]
                inside = min(w) >= 0
                d2 = min(seg2(p, a, b), seg2(p, b, c), seg2(p, c, a))
                if not inside and d2 >= blur:
                    continue
                wc = [max(x, 0.0) for x in w]
                wc = [x / sum(wc) for x in wc]
                inv = sum(x / v[2] for x, v in zip(wc, (a, b, c)))
                hits.append((1.0 / inv, -d2 if inside else d2))
            hits.sort()
            keep = 1.0
            for _, d in hits[:k]:
                keep *= 1.0 - 1.0 / (1.0 + math.exp(d / sigma))
            alpha[i, j] = 1.0 - keep
    return alpha


def _renderer(H, W, fx, fy, px, py, blur, sigma, k):
    cams = p3r.PerspectiveCameras(focal_length=torch.tensor([[fx, fy]]), principal_point=torch.tensor([[px, py]]),
                                  image_size=torch.tensor([[H, W]], dtype=torch.float32), in_ndc=False)
    settings = p3r.RasterizationSettings(image_size=(H, W), blur_radius=blur, faces_per_pixel=k,
                                         max_faces_per_bin=50000)
    return p3r.MeshRenderer(rasterizer=p3r.MeshRasterizer(cameras=cams, raster_settings=settings),
                            shader=p3r.SoftSilhouetteShader(blend_params=p3r.BlendParams(sigma=sigma, gamma=1e-4)))


@pytest.mark.parametrize("blur,sigma,k", [(1e-6, 1e-4, 50), (2e-3, 5e-4, 2)])
def test_soft_silhouette_matches_brute_force(blur, sigma, k):
    # a rotated cube (front and back faces overlap, so the top-k by depth matters for k=2), non-square image,
    # off-centre principal point: upstream's layout renderer settings and a blurrier one
    verts, faces = _cube()
    R = p3d.axis_angle_to_matrix(torch.tensor([0.4, -0.7, 0.2]))
    verts = (verts - torch.tensor([0, 0, 3.0])) @ R.T + torch.tensor([0.1, -0.05, 3.0])
    H, W, fx, fy, px, py = 18, 26, 30.0, 28.0, 12.5, 10.0
    textures = p3r.TexturesVertex(verts_features=torch.ones_like(verts)[None])
    image = _renderer(H, W, fx, fy, px, py, blur, sigma, k)(p3r.Meshes(verts=[verts], faces=[faces], textures=textures))
    assert image.shape == (1, H, W, 4) and bool((image[..., :3] == 1).all())
    ref = _brute_silhouette(verts, faces, H, W, fx, fy, px, py, blur, sigma, k)
    assert ref.max() > 0.9 and ref.min() < 1e-6  # the object and background are both in view
    assert (image[0, ..., 3].double() - ref).abs().max() < 2e-4


def test_soft_silhouette_gradients_match_finite_differences():
    from backends.soft_rasterize import sigmoid_coverage, soft_rasterize

    # blur large enough that every pixel keeps the triangle: the silhouette is smooth in the vertices
    verts = torch.tensor([[-0.5, -0.4, 2.0], [0.6, -0.3, 2.5], [0.0, 0.7, 3.0]], dtype=torch.float64,
                         requires_grad=True)
    faces = torch.tensor([[0, 1, 2]])

    def silhouette(v):
        frag = soft_rasterize(v[None], faces, (6, 7), blur_radius=100.0, faces_per_pixel=1,
                              perspective_correct=True, clip_barycentric_coords=True)
        return sigmoid_coverage(frag.dists, frag.pix_to_face, sigma=0.05)

    assert torch.autograd.gradcheck(silhouette, (verts,), eps=1e-6, atol=1e-5)


def test_layout_style_optimisation_recovers_the_translation():
    # upstream's layout post-optimisation: MSE between the rendered soft silhouette and a mask, Adam on a pose.
    # (At this low resolution upstream's sigma = 1e-4 leaves almost no pixel centre in the soft band around the
    # edges, so the band is widened to sigma = blur = 1e-3.)
    H, W = 24, 32
    verts, faces = _cube(center=(0.0, 0.0, 0.0), half=0.4)
    renderer = _renderer(H, W, 40.0, 40.0, 16.0, 12.0, 1e-3, 1e-3, 10)
    target_shift = torch.tensor([0.25, -0.15, 3.0])
    with torch.no_grad():
        mask = renderer(p3r.Meshes(verts=[verts + target_shift], faces=[faces]))[0, ..., 3]
    shift = torch.tensor([0.0, 0.0, 3.0], requires_grad=True)
    opt = torch.optim.Adam([shift], lr=0.02)
    losses = []
    for _ in range(60):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(renderer(p3r.Meshes(verts=[verts + shift], faces=[faces]))[0, ..., 3],
                                            mask)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.2 * losses[0]
    assert (shift.detach()[:2] - target_shift[:2]).abs().max() < 0.05


# ------------------------------------------------------------------------------------ pytorch3d: cameras
def test_screen_space_perspective_camera_is_opencv_on_pytorch3d_points():
    torch.manual_seed(0)
    R_cv = p3d.axis_angle_to_matrix(torch.randn(3, dtype=torch.float64) * 0.3)
    t_cv = torch.tensor([0.1, -0.2, 4.0], dtype=torch.float64)
    fx, fy, cx, cy, H, W = 300.0, 280.0, 150.0, 110.0, 240, 320
    X = torch.randn(20, 3, dtype=torch.float64)
    cam_cv = X @ R_cv.T + t_cv
    u = fx * cam_cv[:, 0] / cam_cv[:, 2] + cx
    v = fy * cam_cv[:, 1] / cam_cv[:, 2] + cy
    # the same camera in PyTorch3D's frame (x left, y up): R = R_cv^T with x, y columns negated, T likewise
    R = R_cv.T.clone()
    R[:, :2] *= -1
    T = t_cv.clone()
    T[:2] *= -1
    cams = p3r.PerspectiveCameras(focal_length=((fx, fy),), principal_point=((cx, cy),), R=R[None].float(),
                                  T=T[None].float(), in_ndc=False, image_size=((H, W),))
    scr = cams.transform_points_screen(X.float()[None])[0].double()
    assert (scr[:, 0] - u).abs().max() < 1e-3 and (scr[:, 1] - v).abs().max() < 1e-3
    ndc = cams.transform_points_ndc(X.float()[None])[0].double()
    s = min(H, W)
    assert (ndc[:, 0] - (W - 2 * u) / s).abs().max() < 1e-5 and (ndc[:, 1] - (H - 2 * v) / s).abs().max() < 1e-5
    centre = cams.get_camera_center()[0].double()
    assert (centre - (-R_cv.T @ t_cv)).abs().max() < 1e-5


def test_ndc_and_fov_cameras_follow_the_documented_projections():
    torch.manual_seed(1)
    Rl, Tl = p3d.look_at_view_transform(dist=3.0, elev=20.0, azim=35.0)
    X = torch.randn(15, 3) * 0.5
    view = X @ Rl[0] + Tl[0]  # X_view = X_world R + T
    cam = p3r.PerspectiveCameras(focal_length=((1.7, 1.9),), principal_point=((0.1, -0.2),), R=Rl, T=Tl)
    got = cam.transform_points(X[None])[0]
    ref = torch.stack([1.7 * view[:, 0] / view[:, 2] + 0.1, 1.9 * view[:, 1] / view[:, 2] - 0.2, 1 / view[:, 2]], -1)
    assert (got - ref).abs().max() < 1e-5
    assert (cam.get_full_projection_transform().transform_points(X[None])[0] - ref).abs().max() < 1e-5
    fov = p3r.FoVPerspectiveCameras(znear=0.5, zfar=20.0, aspect_ratio=1.5, fov=50.0, R=Rl, T=Tl)
    t = math.tan(math.radians(25.0))
    P = torch.tensor([[1 / (t * 1.5), 0, 0, 0], [0, 1 / t, 0, 0], [0, 0, 20 / 19.5, -20 * 0.5 / 19.5], [0, 0, 1, 0]])
    h = torch.cat([view, torch.ones(15, 1)], -1) @ P.T  # the OpenGL-style matrix on column vectors
    assert (fov.transform_points(X[None])[0] - h[:, :3] / h[:, 3:]).abs().max() < 1e-5
    assert (fov.get_full_projection_transform().transform_points(X[None])[0] - h[:, :3] / h[:, 3:]).abs().max() < 1e-5


def test_camera_to_eye_at_up_round_trips_through_look_at():
    eye = torch.tensor([[1.0, 2.0, -3.0], [0.5, -1.0, 2.0]])
    at = torch.tensor([[0.2, 0.1, 0.0], [0.0, 0.0, 0.5]])
    up = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    R, T = p3d.look_at_view_transform(eye=eye, at=at, up=up)
    cams = p3r.FoVPerspectiveCameras(R=R, T=T)
    e, a, u = p3r.camera_to_eye_at_up(cams.get_world_to_view_transform())
    assert (e - eye).abs().max() < 1e-5
    direction = torch.nn.functional.normalize(at - eye, dim=-1)
    assert (a - (eye + direction)).abs().max() < 1e-5
    R2, T2 = p3d.look_at_view_transform(eye=e, at=a, up=u)
    assert (R2 - R).abs().max() < 1e-5 and (T2 - T).abs().max() < 1e-5


# ----------------------------------------------------------------------------------- pytorch3d: structures
def test_meshes_pointclouds_and_scene_joining():
    v1, f1 = torch.rand(4, 3), torch.tensor([[0, 1, 2], [0, 2, 3]])
    v2, f2 = torch.rand(3, 3), torch.tensor([[0, 1, 2]])
    tex = p3r.TexturesVertex([torch.rand(4, 3), torch.rand(3, 3)])
    m = p3r.Meshes(verts=[v1, v2], faces=[f1, f2], textures=tex)
    assert torch.equal(m.verts_packed(), torch.cat([v1, v2]))
    assert torch.equal(m.faces_packed(), torch.cat([f1, f2 + 4]))
    assert m.verts_padded().shape == (2, 4, 3) and torch.equal(m.verts_padded()[1, 3], torch.zeros(3))
    assert torch.equal(m.faces_padded()[1, 1], torch.full((3,), -1))
    padded = p3r.Meshes(verts=m.verts_padded(), faces=m.faces_padded())
    assert torch.equal(padded.faces_list()[1], f2) and padded.num_faces_per_mesh().tolist() == [2, 1]
    scene = p3r.join_meshes_as_scene(m)
    assert len(scene) == 1 and torch.equal(scene.faces_packed(), m.faces_packed())
    assert torch.equal(scene.textures.verts_features_packed(), tex.verts_features_packed())
    a, b, c = v1[f1[:, 0]], v1[f1[:, 1]], v1[f1[:, 2]]
    assert torch.allclose(m[0].faces_areas_packed(), 0.5 * torch.cross(b - a, c - a, dim=-1).norm(dim=-1))
    pts, cols = torch.rand(1, 50, 3), torch.rand(1, 50, 3)
    pc = p3r.Pointclouds(points=pts, features=cols)
    assert torch.equal(pc.points_packed(), pts[0]) and torch.equal(pc.features_padded(), cols)
    bundle = p3r.RayBundle(origins=torch.zeros(2, 3), directions=torch.eye(3)[:2], lengths=torch.tensor(
        [[1.0, 2.0], [0.5, 1.5]]), xys=torch.zeros(2, 2))
    assert torch.equal(p3r.ray_bundle_to_ray_points(bundle)[1, 1], torch.tensor([0.0, 1.5, 0.0]))


def test_plotly_helpers():
    from patches import pytorch3d_vis as vis

    assert vis._scale_camera_to_bounds(3.0, [1.0, 5.0], True) == 0.0
    assert vis._scale_camera_to_bounds(1.0, [1.0, 5.0], False) == 0.5
    assert vis.AxisArgs(showgrid=True)._asdict()["showgrid"] is True and vis.Lighting()._asdict()["ambient"] == 0.8
    layout = {"xaxis": {"range": [-5.0, 0.0]}, "yaxis": {}, "zaxis": {}}
    vis._update_axes_bounds(torch.tensor([1.0, 2.0, 3.0]), 0.5, layout)
    assert layout["xaxis"]["range"] == [-5.0, 1.5] and layout["zaxis"]["range"] == [2.5, 3.5]
    assert vis._is_ray_bundle(p3r.RayBundle(*(torch.zeros(1, 3),) * 4)) and not vis._is_ray_bundle(torch.zeros(1))
    if importlib.util.find_spec("plotly") is None:
        pytest.skip("plotly is not installed: traces not checked")
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=1, specs=[[{"type": "scene"}]])
    pts = torch.tensor([[0.0, 0.0, 0.0], [1.0, 2.0, 3.0]])
    vis._add_pointcloud_trace(fig, p3r.Pointclouds(points=[pts], features=[torch.ones(2, 3)]), "pc", 0, 1, 100, 2)
    vis._add_camera_trace(fig, p3r.PerspectiveCameras(), "cam", 0, 1, 0.3)
    assert [t.name for t in fig.data] == ["pc", "cam"] and list(fig.data[0].z) == [0.0, 3.0]
    assert fig.layout.scene.xaxis.range[1] >= 3.0  # widened to the cloud's extent


def test_real_pytorch3d_renders_the_same_silhouette():
    real("pytorch3d")
    from pytorch3d.renderer import (BlendParams, MeshRasterizer, MeshRenderer, PerspectiveCameras,
                                    RasterizationSettings, SoftSilhouetteShader)
    from pytorch3d.structures import Meshes

    verts, faces = _cube()
    H, W = 20, 28
    cams = PerspectiveCameras(focal_length=((30.0, 30.0),), principal_point=((13.0, 9.0),), image_size=((H, W),),
                              in_ndc=False)
    rs = RasterizationSettings(image_size=(H, W), blur_radius=1e-3, faces_per_pixel=4)
    renderer = MeshRenderer(MeshRasterizer(cameras=cams, raster_settings=rs),
                            SoftSilhouetteShader(blend_params=BlendParams(sigma=1e-3)))
    ref = renderer(Meshes(verts=[verts], faces=[faces]))[0, ..., 3]
    ours = _renderer(H, W, 30.0, 30.0, 13.0, 9.0, 1e-3, 1e-3, 4)(p3r.Meshes(verts=[verts], faces=[faces]))[0, ..., 3]
    assert (ours - ref).abs().max() < 1e-3


# ------------------------------------------------------------------------------------------------- vox2seq
def _interleave_by_hand(x: int, y: int, z: int, bits: int = 10) -> int:
    code = 0
    for level in reversed(range(bits)):
        code = (code << 3) | (((x >> level) & 1) << 2) | (((y >> level) & 1) << 1) | ((z >> level) & 1)
    return code


def _hilbert_by_hand(point, bits: int = 10) -> int:
    """Skilling's axes-to-transpose on one point (Python ints), then the transposed bits read out MSB first."""
    x = list(point)
    m = 1 << (bits - 1)
    q = m
    while q > 1:
        p = q - 1
        for i in range(3):
            if x[i] & q:
                x[0] ^= p
            else:
                t = (x[0] ^ x[i]) & p
                x[0] ^= t
                x[i] ^= t
        q >>= 1
    for i in range(1, 3):
        x[i] ^= x[i - 1]
    t, q = 0, m
    while q > 1:
        if x[2] & q:
            t ^= q - 1
        q >>= 1
    x = [v ^ t for v in x]
    return _interleave_by_hand(*x, bits=bits)


def test_vox2seq_z_order_and_hilbert_codes():
    from patches.vox2seq_shim import encode

    g = torch.Generator().manual_seed(0)
    coords = torch.randint(0, 1024, (200, 3), generator=g, dtype=torch.int32)
    for permute in ([0, 1, 2], [1, 0, 2]):
        pc = coords[:, permute].tolist()
        z = encode(coords, permute=permute, mode="z_order")
        assert z.tolist() == [_interleave_by_hand(*p) for p in pc]
        h = encode(coords, permute=permute, mode="hilbert")
        assert h.tolist() == [_hilbert_by_hand(p) for p in pc]
    # the Hilbert curve visits the aligned 8^3 corner block as 512 consecutive codes, each step one face apart
    grid = torch.stack(torch.meshgrid(*(torch.arange(8),) * 3, indexing="ij"), -1).reshape(-1, 3)
    h = encode(grid, mode="hilbert")
    order = torch.argsort(h)
    assert sorted(h.tolist()) == list(range(512)) and h[0] == 0
    steps = (grid[order][1:] - grid[order][:-1]).abs().sum(-1)
    assert bool((steps == 1).all())
    with pytest.raises(ValueError, match="1024"):
        encode(torch.tensor([[0, 0, 1024]]), mode="z_order")


def test_real_vox2seq_gives_the_same_codes():
    vox2seq = real("vox2seq")
    from patches.vox2seq_shim import encode

    coords = torch.randint(0, 64, (300, 3), dtype=torch.int32, device="cuda")
    for mode in ("z_order", "hilbert"):
        for permute in ([0, 1, 2], [1, 0, 2]):
            assert torch.equal(vox2seq.encode(coords, mode=mode, permute=permute).long().cpu(),
                               encode(coords.cpu(), mode=mode, permute=permute).long())


# -------------------------------------------------------------------------------------------------- spconv
def test_spconv_tensor_and_submconv_match_the_real_cpu_build():
    spconv = pytest.importorskip("spconv.pytorch", reason="spconv's CPU build is not installed (pip install "
                                                          "spconv): the stand-in cannot be compared")
    from patches import spconv_shim as S

    ours_params = list(inspect.signature(S.SparseConvTensor.__init__).parameters)
    real_params = list(inspect.signature(spconv.SparseConvTensor.__init__).parameters)
    assert ours_params == real_params
    g = torch.Generator().manual_seed(0)
    xyz = torch.unique(torch.randint(0, 7, (80, 3), generator=g), dim=0)
    idx = torch.cat([torch.zeros(len(xyz), 1, dtype=torch.long), xyz], 1).int()
    feats = torch.randn(len(xyz), 4, generator=g)
    a = spconv.SparseConvTensor(feats, idx, [7, 7, 7], 1)
    b = S.SparseConvTensor(feats, idx, [7, 7, 7], 1)
    for name in ("features", "indices", "spatial_shape", "batch_size", "grid", "voxel_num", "indice_dict",
                 "benchmark", "benchmark_record", "thrust_allocator", "_timer", "force_algo", "int8_scale"):
        assert hasattr(b, name), name
        if name not in ("_timer", "features", "indices", "grid"):
            assert getattr(a, name) == getattr(b, name), name
    assert b.grid.numel() == a.grid.numel() == 0
    assert torch.equal(a.dense(), b.dense()) and torch.equal(a.dense(False), b.dense(False))
    # upstream's sparse tensor rebuilds its spconv tensor positionally, then sets the bookkeeping
    for cls, t in ((spconv.SparseConvTensor, a), (S.SparseConvTensor, b)):
        new = cls(t.features.reshape(t.features.shape[0], -1), t.indices, t.spatial_shape, t.batch_size, t.grid,
                  t.voxel_num, t.indice_dict)
        new._features = feats[:, None].expand(-1, 2, -1)
        new.benchmark, new.benchmark_record, new.thrust_allocator = t.benchmark, t.benchmark_record, \
            t.thrust_allocator
        new._timer, new.force_algo = t._timer, t.force_algo
        assert new.features.shape == (len(xyz), 2, 4)
    real_conv = spconv.SubMConv3d(4, 6, 3, bias=True, indice_key="k", algo=spconv.ConvAlgo.Native)
    ours_conv = S.SubMConv3d(4, 6, 3, bias=True, indice_key="k", algo=S.ConvAlgo.Native)
    ours_conv.load_state_dict(real_conv.state_dict())
    out_real, out_ours = real_conv(a), ours_conv(b)
    assert (out_real.features - out_ours.features).abs().max() < 1e-5
    assert out_ours.replace_feature(out_ours.features * 2).indice_dict is b.indice_dict


# --------------------------------------------------------------------------------------------------- gsplat
def _one_gaussian_scene():
    means = torch.tensor([[0.0, 0.0, 3.0], [0.3, -0.2, 4.0]])
    quats = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.9, 0.1, 0.3, 0.0]])
    scales = torch.tensor([[0.05, 0.05, 0.05], [0.1, 0.03, 0.06]])
    return means, quats, scales, torch.tensor([0.8, 0.6]), torch.tensor([[1.0, 0.5, 0.25], [0.2, 0.9, 0.4]])


def test_gsplat_accepts_one_background_colour():
    from patches.gsplat_shim import rasterization

    means, quats, scales, opac, colors = _one_gaussian_scene()
    K = torch.tensor([[[50.0, 0, 16], [0, 50.0, 12], [0, 0, 1]]])
    bg = torch.tensor([0.1, 0.2, 0.3])
    one, alpha, _ = rasterization(means, quats, scales, opac, colors, torch.eye(4)[None], K, 32, 24, backgrounds=bg)
    per_cam, _, _ = rasterization(means, quats, scales, opac, colors, torch.eye(4)[None], K, 32, 24,
                                  backgrounds=bg[None])
    black, _, _ = rasterization(means, quats, scales, opac, colors, torch.eye(4)[None], K, 32, 24)
    assert torch.equal(one, per_cam)
    assert (one - (black + (1 - alpha) * bg)).abs().max() < 1e-6  # composited over the background


def test_real_gsplat_renders_the_same_image():
    gsplat = real("gsplat")
    from patches.gsplat_shim import rasterization

    means, quats, scales, opac, colors = (t.cuda() for t in _one_gaussian_scene())
    K = torch.tensor([[[50.0, 0, 16], [0, 50.0, 12], [0, 0, 1]]], device="cuda")
    ref, _, _ = gsplat.rasterization(means, quats, scales, opac, colors, torch.eye(4, device="cuda")[None], K, 32,
                                     24, backgrounds=torch.ones(3, device="cuda"))
    ours, _, _ = rasterization(means, quats, scales, opac, colors, torch.eye(4, device="cuda")[None], K, 32, 24,
                               backgrounds=torch.ones(3, device="cuda"))
    assert (ours - ref).abs().max() < 1e-3


# ---------------------------------------------------------------------------------- diff_gaussian_rasterization
def test_diff_gaussian_rasterization_matches_closed_form_ewa():
    from patches.diff_gaussian_rasterization_shim import GaussianRasterizationSettings, GaussianRasterizer

    # an isotropic gaussian: its footprint is the closed-form EWA gaussian with the rasteriser's 2D dilation
    W = H = 32
    tan = 0.4
    near, far = 0.1, 10.0
    fx_n = 0.5 / tan  # normalised focal (TRELLIS' intrinsics), principal point at the centre
    view = torch.eye(4)
    proj = torch.zeros(4, 4)
    proj[0, 0], proj[1, 1] = 2 * fx_n, 2 * fx_n
    proj[2, 2], proj[2, 3], proj[3, 2] = far / (far - near), near * far / (near - far), 1.0
    settings = GaussianRasterizationSettings(image_height=H, image_width=W, tanfovx=tan, tanfovy=tan,
                                             kernel_size=0.1, bg=torch.zeros(3), scale_modifier=1.0,
                                             viewmatrix=view.T, projmatrix=(proj @ view).T, sh_degree=0,
                                             campos=torch.zeros(3), prefiltered=False, debug=False)
    mean = torch.tensor([[0.05, -0.03, 2.0]])
    sigma, opacity = 0.04, 0.7
    image, radii = GaussianRasterizer(settings)(
        means3D=mean, means2D=torch.zeros_like(mean), shs=None, colors_precomp=torch.tensor([[1.0, 1.0, 1.0]]),
        opacities=torch.tensor([[opacity]]), scales=torch.full((1, 3), sigma), rotations=torch.tensor([[1.0, 0, 0, 0]]))
    f = W / (2 * tan)
    u0, v0 = f * 0.05 / 2.0 + W / 2, f * -0.03 / 2.0 + H / 2  # continuous pixel coordinates (centres at +0.5)
    # EWA: the perspective Jacobian at the mean carries the isotropic 3D covariance to the image, plus the dilation
    x, y, z = 0.05, -0.03, 2.0
    J = torch.tensor([[f / z, 0, -f * x / z ** 2], [0, f / z, -f * y / z ** 2]], dtype=torch.float64)
    conic = torch.linalg.inv(sigma ** 2 * J @ J.T + 0.1 * torch.eye(2, dtype=torch.float64))
    jj, ii = torch.meshgrid(torch.arange(W, dtype=torch.float64) + 0.5, torch.arange(H, dtype=torch.float64) + 0.5,
                            indexing="xy")
    d = torch.stack([jj - u0, ii - v0], -1)
    q = torch.einsum("...i,ij,...j->...", d, conic, d)
    ref = opacity * torch.exp(-0.5 * q)
    assert image.shape == (3, H, W) and radii.tolist()[0] >= 3
    # within the 3-sigma footprint the EWA value; beyond it the renderer may cut (the real one cuts by tiles)
    core = q < 9
    assert (image[0].double() - ref)[core].abs().max() < 1e-4
    assert float(image[0][~core].max()) <= opacity * math.exp(-4.5) + 1e-6


# ------------------------------------------------------------------------------------------- diffoctreerast
def test_diffoctreerast_voxel_leaf_against_closed_form_absorption():
    from patches.diffoctreerast_shim import OctreeVoxelRasterizer, _camera

    # one leaf (depth 1: side 0.5 of the unit cube [-0.5, 0.5]^3) seen straight on from z = -2
    near, far, fxn = 0.5, 5.0, 1.2
    extr = torch.eye(4)
    extr[2, 3] = 2.0  # world -> camera: z + 2
    proj = torch.zeros(4, 4)
    proj[0, 0] = proj[1, 1] = 2 * fxn
    proj[0, 2], proj[1, 2] = 2 * 0.5 - 1, -2 * 0.5 + 1
    proj[2, 2], proj[2, 3], proj[3, 2] = far / (far - near), near * far / (near - far), 1.0
    settings = dict(image_height=16, image_width=16, tanfovx=0.5 / fxn, tanfovy=0.5 / fxn, bg=torch.zeros(3),
                    scale_modifier=1.0, viewmatrix=extr.T, projmatrix=(proj @ extr).T, sh_degree=0,
                    campos=torch.tensor([0.0, 0.0, -2.0]), with_distloss=False, jitter=False, debug=False)
    cam = _camera(settings, torch.device("cpu"))
    assert abs(cam.znear - near) < 1e-4 and abs(cam.zfar - far) < 1e-3
    assert torch.allclose(cam.intrinsics, torch.tensor([[fxn, 0, 0.5], [0, fxn, 0.5], [0, 0, 1.0]]))
    density = 3.0
    rgb, depth, alpha, _ = OctreeVoxelRasterizer(settings)(
        positions=torch.tensor([[0.75, 0.75, 0.75]]), densities=torch.tensor([[density]]),
        shs=torch.zeros(1, 1, 3), depths=torch.tensor([[1]]), aabb=torch.tensor([-0.5, -0.5, -0.5, 1, 1, 1.0]))
    # the leaf is [0.5, 1]^3 of the unit cube, [0, 0.5]^3 in the world, camera z in [2, 2.5]; pixel centre j looks
    # along (t_j, t_j, 1) on the image diagonal, t_j = ((j + 0.5) / 16 - 0.5) / fxn (x right, y down)
    t = ((torch.arange(16, dtype=torch.float64) + 0.5) / 16 - 0.5) / fxn
    through = (t * 2.0 > 0) & (t * 2.5 < 0.5)  # the ray enters the front face and leaves through the back
    cols = torch.nonzero(through).squeeze(1).tolist()
    assert cols
    for c in cols:
        chord = 0.5 * math.sqrt(2 * float(t[c]) ** 2 + 1)
        expected = 1 - math.exp(-density * chord)
        assert abs(float(alpha[c, c]) - expected) < 0.03 * expected  # 256 samples over [near, far]
    assert float(alpha[0, 0]) == 0.0 and float(alpha[0, 15]) == 0.0
    assert rgb.shape == (3, 16, 16) and depth.shape == (16, 16)
    assert (rgb[:, cols[0], cols[0]] - 0.5 * alpha[cols[0], cols[0]]).abs().max() < 1e-5  # SH 0 -> grey 0.5


# ---------------------------------------------------------------------------------------------- torchsparse
def test_torchsparse_tensor_against_brute_force():
    from patches.torchsparse_shim import SparseTensor

    coords = torch.tensor([[0, 1, 2, 3], [0, 0, 0, 0], [1, 2, 1, 0]], dtype=torch.int32)
    feats = torch.randn(3, 5)
    t = SparseTensor(feats=feats, coords=coords, stride=1, spatial_range=(2, 3, 3, 4))
    dense = t.dense()
    ref = torch.zeros(2, 3, 3, 4, 5)
    for (b, x, y, z), f in zip(coords.tolist(), feats):
        ref[b, x, y, z] = f
    assert torch.equal(dense, ref) and t.stride == (1, 1, 1) and t.F is feats and t.C is coords
    # upstream's replace(): a new tensor from feats/coords/stride/spatial_range, caches carried over
    new = SparseTensor(feats=feats * 2, coords=t.coords, stride=t.stride, spatial_range=t.spatial_range)
    new._caches = t._caches
    assert new._caches is t._caches and torch.equal(new.F, feats * 2)


def test_real_torchsparse_has_the_same_constructor():
    torchsparse = real("torchsparse")
    from patches.torchsparse_shim import SparseTensor

    ours = list(inspect.signature(SparseTensor.__init__).parameters)
    assert list(inspect.signature(torchsparse.SparseTensor.__init__).parameters)[:len(ours)] == ours


# --------------------------------------------------------------------------------------------------- kaolin
def test_kaolin_cameras_against_explicit_matrices():
    from patches.kaolin_shim import Camera

    eye, at, up = torch.tensor([2.0, 1.0, 3.0]), torch.tensor([0.1, -0.2, 0.0]), torch.tensor([0.0, 1.0, 0.0])
    cam = Camera.from_args(eye=eye, at=at, up=up, fov=math.radians(40), width=64, height=48, near=0.1, far=50.0)
    V = cam.view_matrix()[0].double()
    assert torch.allclose(V[:3, :3] @ V[:3, :3].T, torch.eye(3, dtype=torch.float64), atol=1e-6)
    # the eye maps to the origin, the target onto the -z axis, up stays in the upper half (y > 0)
    cam_at = V[:3, :3] @ at.double() + V[:3, 3]
    assert (V[:3, :3] @ eye.double() + V[:3, 3]).abs().max() < 1e-5
    assert cam_at[:2].abs().max() < 1e-5 and cam_at[2] < 0
    assert (V[:3, :3] @ up.double())[1] > 0
    assert (cam.cam_pos().reshape(3) - eye).abs().max() < 1e-5
    pts = torch.tensor([[0.3, 0.2, -0.1], [-0.2, 0.4, 0.5]])
    c = (V[:3, :3] @ pts.double().T).T + V[:3, 3]
    focal = 24.0 / math.tan(math.radians(20))  # vertical fov over the height
    ref_x = 2 * focal * c[:, 0] / (64 * -c[:, 2])
    ref_y = 2 * focal * c[:, 1] / (48 * -c[:, 2])
    ref_z = ((-(50.1) / 49.9) * c[:, 2] - 2 * 50 * 0.1 / 49.9) / -c[:, 2]
    got = cam.transform(pts)[0].double()
    assert (got - torch.stack([ref_x, ref_y, ref_z], -1)).abs().max() < 1e-4


def test_real_kaolin_cameras_agree():
    real("kaolin")
    from kaolin.render.camera import Camera as RealCamera
    from patches.kaolin_shim import Camera

    args = dict(eye=torch.tensor([2.0, 1.0, 3.0]), at=torch.tensor([0.1, -0.2, 0.0]), up=torch.tensor([0.0, 1.0, 0.0]),
                fov=math.radians(40), width=64, height=48, near=0.1, far=50.0)
    ours, ref = Camera.from_args(**args), RealCamera.from_args(**args)
    assert (ours.view_matrix().cpu() - ref.view_matrix().cpu()).abs().max() < 1e-5
    pts = torch.tensor([[0.3, 0.2, -0.1], [-0.2, 0.4, 0.5]])
    assert (ours.transform(pts).cpu() - ref.transform(pts.to(ref.device)).cpu()).abs().max() < 1e-4


# ---------------------------------------------------------------------- torchvision: the real package as reference
@pytest.mark.skipif(importlib.util.find_spec("torchvision") is None,
                    reason="torchvision is not installed here: the stand-ins cannot be compared with the real package")
def test_torchvision_standins_match_real_torchvision():
    from test_patches_standins import run

    out = run("""
        from patches import torchvision_shim as S
        state = patches.apply(triton=False)
        result["state"] = state["torchvision"]
        import torchvision.transforms as T
        import torchvision.transforms.functional as TF
        from torchvision.ops.misc import FrozenBatchNorm2d
        torch.manual_seed(0)
        x = torch.rand(2, 3, 17, 23, dtype=torch.float64)
        u8 = (x * 255).to(torch.uint8)
        err = {}
        err["blur"] = (S.gaussian_blur(x, [5, 3], [1.3, 0.7]) - TF.gaussian_blur(x, [5, 3], [1.3, 0.7])).abs().max()
        err["blur_default"] = (S.gaussian_blur(x, 7) - TF.gaussian_blur(x, 7)).abs().max()
        for f in ("adjust_brightness", "adjust_contrast", "adjust_saturation"):
            err[f] = (getattr(S, f)(x, 1.3) - getattr(TF, f)(x, 1.3)).abs().max()
            err[f + "_u8"] = (getattr(S, f)(u8, 0.7).int() - getattr(TF, f)(u8, 0.7).int()).abs().max()
        for h in (0.23, -0.4):
            err[f"hue{h}"] = (S.adjust_hue(x.float(), h) - TF.adjust_hue(x.float(), h)).abs().max()
        err["hue_u8"] = (S.adjust_hue(u8, 0.2).int() - TF.adjust_hue(u8, 0.2).int()).abs().max()
        err["blur_u8"] = (S.gaussian_blur(u8, 3, 1.0).int() - TF.gaussian_blur(u8, 3, 1.0).int()).abs().max()
        for seed in range(4):  # upstream's colour augmentation, same seed: the same draws in the same order
            pipe = lambda m: m.Compose([m.RandomApply([m.ColorJitter(0.2, 0.2, 0.2, 0.1)], p=0.5),
                                        m.RandomApply([m.GaussianBlur(kernel_size=3, sigma=(0.1, 2.0))], p=0.5)])
            torch.manual_seed(seed)
            a = pipe(S)(x.float())
            torch.manual_seed(seed)
            b = pipe(T)(x.float())
            err[f"augment{seed}"] = (a - b).abs().max()
        result["size"] = [S._get_image_size(x), TF._get_image_size(x)]
        mine, ref = S.FrozenBatchNorm2d(3), FrozenBatchNorm2d(3)
        for m in (mine, ref):
            for name in ("weight", "bias", "running_mean", "running_var"):
                getattr(m, name).copy_(torch.rand(3) + 0.5)
        mine.load_state_dict(ref.state_dict())
        err["frozen_bn"] = (mine(x.float()) - ref(x.float())).abs().max()
        result["err"] = {k: float(v) for k, v in err.items()}
        patches.remove()
        import torchvision.transforms.functional as TF2
        result["alias_removed"] = not hasattr(TF2, "_get_image_size")
    """)
    if out["state"] == "shim":
        pytest.skip("no working torchvision here (the stand-in was used): nothing to compare against")
    assert max(out["err"].values()) < 1e-6, out["err"]
    assert out["size"][0] == out["size"][1] == [23, 17]
    assert out["alias_removed"]


# -------------------------------------------------------------------------- registration, in a fresh process
def test_apply_registers_every_standin_and_remove_takes_them_away():
    from test_patches_standins import run

    out = run("""
        sys.modules["torchvision"] = None  # as on a machine without torchvision: the stand-in is registered
        state = patches.apply(replace_installed=True, triton=False)
        result["state"] = {k: state[k] for k in ("pytorch3d", "kaolin", "vox2seq", "torchsparse", "diffoctreerast",
                                                 "diff_gaussian_rasterization", "gsplat", "spconv", "torchvision")}
        from pytorch3d.structures import Meshes, Pointclouds, join_meshes_as_scene
        from pytorch3d.renderer import (PerspectiveCameras, RasterizationSettings, MeshRenderer, MeshRasterizer,
                                        SoftSilhouetteShader, BlendParams, TexturesVertex, TexturesAtlas, RayBundle,
                                        HeterogeneousRayBundle, ray_bundle_to_ray_points, look_at_view_transform)
        from pytorch3d.renderer.camera_utils import camera_to_eye_at_up
        from pytorch3d.renderer.cameras import CamerasBase
        from pytorch3d.renderer.mesh.textures import TexturesVertex as TV2
        from pytorch3d.vis.plotly_vis import AxisArgs, _scale_camera_to_bounds
        import vox2seq, diffoctreerast, torchsparse, diff_gaussian_rasterization
        from kaolin.render.camera import Camera, CameraExtrinsics, PinholeIntrinsics
        from torchvision.ops.misc import FrozenBatchNorm2d
        from torchvision.transforms import ColorJitter, GaussianBlur, RandomApply
        from torchvision.transforms.functional import gaussian_blur, _get_image_size
        import timm  # imports torchvision.ops / datasets / transforms at start-up
        result["same"] = TV2 is TexturesVertex
        result["code"] = vox2seq.encode(torch.tensor([[1, 0, 0]]), mode="z_order").tolist()
        patches.remove()
        result["left"] = sorted(n for n in ("pytorch3d", "vox2seq", "torchsparse", "diffoctreerast", "kaolin",
                                            "diff_gaussian_rasterization") if n in sys.modules)
    """)
    assert set(out["state"].values()) == {"shim"}
    assert out["same"] and out["code"] == [4] and out["left"] == []


def test_standins_compute_with_this_project_when_another_sam3d_objects_comes_first(tmp_path):
    # a user running Meta's package: its `sam3d_objects` shadows this project's on sys.path
    from test_patches_standins import run

    fake = tmp_path / "sam3d_objects"
    fake.mkdir()
    (fake / "__init__.py").write_text("MARK = 'someone else'\n")
    out = run(f"""
        sys.path.insert(0, {str(tmp_path)!r})
        patches.apply(replace_installed=True, triton=False)
        import sam3d_objects
        result["shadowed"] = getattr(sam3d_objects, "MARK", None)
        import gsplat, vox2seq, diffoctreerast, diff_gaussian_rasterization
        img, alpha, _ = gsplat.rasterization(torch.tensor([[0.0, 0, 3]]), torch.tensor([[1.0, 0, 0, 0]]),
                                             torch.full((1, 3), 0.05), torch.ones(1), torch.ones(1, 3),
                                             torch.eye(4)[None], torch.tensor([[[50.0, 0, 8], [0, 50, 8], [0, 0, 1]]]),
                                             16, 16, backgrounds=torch.ones(3))
        result["alpha"] = float(alpha.max())
        result["code"] = vox2seq.encode(torch.tensor([[1, 0, 0]]), mode="hilbert").tolist()
        from patches.diffoctreerast_shim import _octree_renderer
        result["octree"] = _octree_renderer().__name__
        result["still_shadowed"] = sys.modules["sam3d_objects"].MARK
    """)
    assert out["shadowed"] == out["still_shadowed"] == "someone else"
    assert out["alpha"] > 0.5 and out["code"] == [7]  # (1, 0, 0): the last voxel of the first 2^3 Hilbert run
    assert out["octree"].startswith("patches._ours.")


# ------------------------------------------------------------- Meta's own code through the stand-ins (end to end)
UPSTREAM_TARBALL = __import__("conftest").ROOT.parent / "shared" / "upstream" / "sam-3d-objects_cf06676.tar.xz"


@pytest.fixture(scope="module")
def upstream_root(tmp_path_factory):
    """Meta's unmodified package extracted to a temporary folder (run as a test target, never imported by us)."""
    import tarfile

    if not UPSTREAM_TARBALL.exists():
        pytest.skip(f"Meta's package not found at {UPSTREAM_TARBALL} (CI provides ../shared beside the checkout)")
    folder = tmp_path_factory.mktemp("upstream")
    with tarfile.open(UPSTREAM_TARBALL) as tar:
        tar.extractall(folder, filter="data")
    return folder


def test_meta_layout_post_optimization_runs_through_the_pytorch3d_standin(upstream_root):
    # upstream's render-and-compare: a box mesh posed off its true place must be pulled onto the mask by Adam
    # through MeshRenderer / SoftSilhouetteShader (sigma = gamma = 1e-4, 50 faces per pixel) at upstream's settings
    for name in ("trimesh", "cv2", "open3d", "scipy"):
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"{name} (one of upstream's layout dependencies) is not installed")
    from test_patches_standins import run

    out = run(f"""
        import os
        os.environ["LIDRA_SKIP_INIT"] = "1"
        sys.path.insert(0, {str(upstream_root)!r})
        patches.apply(triton=False)
        from sam3d_objects.pipeline.inference_utils import layout_post_optimization
        from pytorch3d.structures import Meshes
        from pytorch3d.renderer import PerspectiveCameras, RasterizationSettings, MeshRasterizer
        import trimesh
        box = trimesh.creation.box(extents=(0.6, 0.4, 0.5)).subdivide()
        H = W = 96
        K = torch.tensor([[1.1, 0, 0.5], [0, 1.1, 0.5], [0, 0, 1.0]])  # normalised intrinsics
        t_true = torch.tensor([[0.05, -0.02, 2.5]])
        # mask and point map of the box at its true pose (y-up as upstream's get_mesh turns it), hard rasterised
        v = torch.tensor(box.vertices, dtype=torch.float32) @ torch.tensor([[1.0, 0, 0], [0, 0, -1], [0, 1, 0]]).T
        cams = PerspectiveCameras(focal_length=((K[0, 0] * W, K[1, 1] * H),),
                                  principal_point=((K[0, 2] * W, K[1, 2] * H),), image_size=((H, W),), in_ndc=False)
        frag = MeshRasterizer(cams, RasterizationSettings(image_size=(H, W)))(
            Meshes([v + t_true], [torch.tensor(box.faces)]))
        mask = (frag.pix_to_face[0, ..., 0] >= 0).float()
        ys, xs = torch.meshgrid(torch.arange(H) + 0.5, torch.arange(W) + 0.5, indexing="ij")
        z = frag.zbuf[0, ..., 0].clamp(min=0)
        pm = torch.stack([-(xs - K[0, 2] * W) / (K[0, 0] * W) * z, -(ys - K[1, 2] * H) / (K[1, 1] * H) * z, z], -1)
        pm[mask == 0] = float("nan")
        quat = torch.tensor([[[1.0, 0.0, 0.0, 0.0]]])
        out = layout_post_optimization(box, quat, t_true + torch.tensor([[0.08, 0.05, 0.1]]),
                                       torch.tensor([[1.1, 1.1, 1.1]]), mask, pm, K, Enable_shape_ICP=False,
                                       min_size=96, device=torch.device("cpu"))
        result["iou"], result["optimised"] = out[3], out[5]
        result["xy"] = (out[1][0, :2] / out[1][0, 2]).tolist()  # the projected centre is what a mask fixes
        result["xy_true"] = (t_true[0, :2] / t_true[0, 2]).tolist()
    """)
    assert out["optimised"] and out["iou"] > 0.9
    assert max(abs(a - b) for a, b in zip(out["xy"], out["xy_true"])) < 0.01


@pytest.mark.slow  # a fresh interpreter importing Meta's visualisation stack
def test_meta_scene_plotter_runs_through_the_pytorch3d_standin(upstream_root):
    if importlib.util.find_spec("plotly") is None:
        pytest.skip("plotly (upstream's scene plotter needs it) is not installed")
    from test_patches_standins import run

    out = run(f"""
        import os
        os.environ["LIDRA_SKIP_INIT"] = "1"
        sys.path.insert(0, {str(upstream_root)!r})
        patches.apply(triton=False)
        import utils3d.numpy
        if not hasattr(utils3d.numpy, "depth_edge"):
            result["skip"] = "the installed utils3d is not the version upstream's image_mesh imports (depth_edge)"
        else:
            from sam3d_objects.utils.visualization.plotly.plot_scene import plot_tdfy_scene
            from sam3d_objects.utils.visualization.scene_visualizer import SceneVisualizer
            from pytorch3d.structures import Meshes
            from pytorch3d.renderer import TexturesVertex
            pm = torch.rand(8, 10, 3) + torch.tensor([0, 0, 2.0])
            cloud = SceneVisualizer.pointmap_to_pointcloud(pm, torch.rand(3, 8, 10))
            cam = SceneVisualizer.camera()
            obj = SceneVisualizer.object_pointcloud(torch.rand(50, 3), torch.tensor([[1.0, 0, 0, 0]]),
                                                    torch.tensor([[0, 0, 2.0]]), torch.tensor([[1.0, 1, 1]]))
            mesh = Meshes([torch.rand(6, 3)], [torch.tensor([[0, 1, 2], [3, 4, 5]])],
                          textures=TexturesVertex([torch.rand(6, 3)]))
            fig = plot_tdfy_scene({{"scene": {{"pm": cloud, "cam": cam, "obj": obj, "mesh": mesh}}}},
                                  viewpoint_cameras=cam)
            result["traces"] = [t.type for t in fig.data]
            result["points"] = len(fig.data[0].x)
    """)
    if "skip" in out:
        pytest.skip(out["skip"])
    assert out["traces"] == ["scatter3d", "scatter3d", "scatter3d", "mesh3d"] and out["points"] == 80


GAUSSIAN_SCENE = """
import os
os.environ["LIDRA_SKIP_INIT"] = "1"
sys.path.insert(0, {root!r})
patches.apply(triton=False)
import numpy as np
from sam3d_objects.model.backbone.tdfy_dit.representations.gaussian.gaussian_model import Gaussian
from sam3d_objects.model.backbone.tdfy_dit.renderers.gaussian_render import GaussianRenderer
torch.manual_seed(0)
g = Gaussian(aabb=[-0.5, -0.5, -0.5, 1, 1, 1], sh_degree=0, device="cpu")
n = 200
g._xyz = torch.rand(n, 3) * 0.6 + 0.2
g._features_dc = torch.randn(n, 1, 3) * 0.5
g._scaling = torch.log(torch.rand(n, 3) * 0.02 + 0.01)
g._rotation = torch.nn.functional.normalize(torch.randn(n, 4), dim=-1)
g._opacity = torch.randn(n, 1)
extr = torch.eye(4)
c, s = math.cos(0.6), math.sin(0.6)
extr[:3, :3] = torch.tensor([[c, 0, -s], [0, 1, 0], [s, 0, c]])
extr[2, 3] = 2.0
K = torch.tensor([[1.2, 0, 0.5], [0, 1.2, 0.47], [0, 0, 1.0]])
K_flipped = K.clone()
K_flipped[1, 2] = 1 - K[1, 2]
for backend in ("inria", "gsplat"):
    r = GaussianRenderer({{"resolution": 48, "near": 0.1, "far": 10, "bg_color": (0, 0, 0), "backend": backend}})
    r.pipe.kernel_size = 0.3  # inria's dilation = gsplat's default eps2d, so both backends draw the same image
    result[backend] = r.render(g, extr, K)["color"].tolist()
    result[backend + "_flipped"] = r.render(g, extr, K_flipped)["color"].tolist()
"""


@pytest.mark.slow  # two fresh interpreters (Meta's package and ours)
def test_meta_gaussian_renderer_through_standins_matches_this_projects(upstream_root):
    # Meta's renderer, "inria" backend (diff_gaussian_rasterization stand-in) and "gsplat" backend (gsplat
    # stand-in), against this project's own GaussianRenderer on the same gaussians and camera
    from test_patches_standins import run

    meta = run(GAUSSIAN_SCENE.format(root=str(upstream_root)))
    ours = run(GAUSSIAN_SCENE.format(root=str(__import__("conftest").ROOT)))
    ref, ref_flipped = torch.tensor(ours["gsplat"]), torch.tensor(ours["gsplat_flipped"])
    assert ref.abs().max() > 0.1 and (ref - ref_flipped).abs().max() > 0.1  # in view; cy = 0.47 matters
    assert (torch.tensor(meta["gsplat"]) - ref).abs().max() < 1e-5
    # the inria rasteriser maps Meta's projection (row 1: 2 fy, 1 - 2 cy) to pixels by ((ndc + 1) H - 1) / 2, which
    # puts the principal point at (1 - cy) H: the real package does the same, so the stand-in keeps it
    assert (torch.tensor(meta["inria"]) - ref_flipped).abs().max() < 1e-5


OCTREE_SCENE = """
import os
os.environ["LIDRA_SKIP_INIT"] = "1"
sys.path.insert(0, {root!r})
patches.apply(triton=False)
from sam3d_objects.model.backbone.tdfy_dit.representations.octree.octree_dfs import DfsOctree
from sam3d_objects.model.backbone.tdfy_dit.renderers.octree_renderer import OctreeRenderer
torch.manual_seed(0)
octree = DfsOctree(depth=3, aabb=[-0.5, -0.5, -0.5, 1, 1, 1], sh_degree=0, primitive="gaussian", device="cpu")
octree.features_dc = torch.randn(8, 1, 3) * 0.5
octree.opacity = torch.randn(8, 1) * 2 + 4
octree.density = octree.opacity  # upstream's get_opacity reads `density`
extr = torch.eye(4)
c, s = math.cos(0.5), math.sin(0.5)
extr[:3, :3] = torch.tensor([[c, 0, -s], [0, 1, 0], [s, 0, c]])
extr[2, 3] = 2.0
K = torch.tensor([[1.1, 0, 0.52], [0, 1.1, 0.5], [0, 0, 1.0]])
out = OctreeRenderer({{"resolution": 24, "near": 0.5, "far": 4.0, "bg_color": (0, 0, 0)}}).render(octree, extr, K)
result["color"], result["alpha"] = out["color"].tolist(), out["alpha"].tolist()
"""


@pytest.mark.slow  # two fresh interpreters (Meta's package and ours)
def test_meta_octree_renderer_through_diffoctreerast_matches_this_projects(upstream_root):
    from test_patches_standins import run

    meta = run(OCTREE_SCENE.format(root=str(upstream_root)))
    ours = run(OCTREE_SCENE.format(root=str(__import__("conftest").ROOT)))
    assert torch.tensor(ours["alpha"]).max() > 0.3  # the leaves are in view
    for key in ("color", "alpha"):
        assert (torch.tensor(meta[key]) - torch.tensor(ours[key])).abs().max() < 1e-5, key
