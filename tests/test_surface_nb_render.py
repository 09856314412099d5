"""Upstream's render_utils / renderers / random_utils / sh_utils surface, on the pure-PyTorch splat renderer,
against independent references (float64 brute-force splatting, closed-form camera geometry, SH orthonormality)."""
import math

import numpy as np
import pytest
import torch

from sam3d_objects.model.backbone.tdfy_dit.renderers import sh_utils
from sam3d_objects.model.backbone.tdfy_dit.renderers.gaussian_render import GaussianRenderer, intrinsics_to_projection
from sam3d_objects.model.backbone.tdfy_dit.representations.gaussian.gaussian_model import Gaussian
from sam3d_objects.model.backbone.tdfy_dit.utils import random_utils as ru
from sam3d_objects.model.backbone.tdfy_dit.utils import render_utils
from sam3d_objects.render import Camera, covariance_from_scale_rotation
from test_render import brute_force


def make_gaussian(n=40, seed=0, opacity_shift=2.0):
    g = torch.Generator().manual_seed(seed)
    gs = Gaussian([-0.5, -0.5, -0.5, 1.0, 1.0, 1.0], mininum_kernel_size=0.0009, scaling_activation="softplus")
    gs._xyz = torch.rand(n, 3, generator=g) * 0.6 + 0.2
    gs._features_dc = torch.randn(n, 1, 3, generator=g)
    gs._scaling = torch.rand(n, 3, generator=g) * 2 - 4.5
    gs._rotation = torch.randn(n, 4, generator=g)
    gs._opacity = torch.randn(n, 1, generator=g) + opacity_shift
    return gs


def test_orbit_cameras_match_closed_form_geometry():
    yaws, pitchs = [0.3, 2.0, -1.1], [0.2, -0.4, 1.0]
    extr, intr = render_utils.yaw_pitch_r_fov_to_extrinsics_intrinsics(yaws, pitchs, 2.5, 40)
    assert len(extr) == len(intr) == 3
    for e, k, a, b in zip(extr, intr, yaws, pitchs):
        rot, t = e[:3, :3].double(), e[:3, 3].double()
        eye = -rot.T @ t
        want = 2.5 * torch.tensor([math.sin(a) * math.cos(b), math.cos(a) * math.cos(b), math.sin(b)]).double()
        torch.testing.assert_close(eye, want, atol=1e-5, rtol=0)
        torch.testing.assert_close(rot @ rot.T, torch.eye(3, dtype=torch.float64), atol=1e-5, rtol=0)
        torch.testing.assert_close(rot[2], -eye / eye.norm(), atol=1e-5, rtol=0)  # looks at the origin
        assert float(rot[1] @ torch.tensor([0.0, 0, 1]).double()) < 0  # image down = world -z (z up)
        f = 0.5 / math.tan(math.radians(40) / 2)
        torch.testing.assert_close(k, torch.tensor([[f, 0, 0.5], [0, f, 0.5], [0, 0, 1]]), atol=1e-6, rtol=0)
    # scalar mode gives single tensors; the pole view is defined (float32 rounding, x axis = world +x)
    e, k = render_utils.yaw_pitch_r_fov_to_extrinsics_intrinsics(0.0, -math.pi / 2, 2, 40)
    assert e.shape == (4, 4) and k.shape == (3, 3) and torch.isfinite(e).all()
    torch.testing.assert_close(e[0, :3], torch.tensor([1.0, 0, 0]), atol=1e-6, rtol=0)


def test_intrinsics_to_projection_maps_to_pixels_and_unit_depth():
    k = torch.tensor([[1.3, 0, 0.45], [0, 1.1, 0.55], [0, 0, 1]])
    near, far = 0.8, 1.6
    proj = intrinsics_to_projection(k, near, far)
    for x, y, z in [(0.1, -0.2, near), (0.3, 0.1, far), (-0.2, 0.05, 1.2)]:
        clip = proj @ torch.tensor([x, y, z, 1.0])
        ndc = clip[:3] / clip[3]
        torch.testing.assert_close((ndc[0] + 1) / 2, torch.tensor(1.3 * x / z + 0.45))
        # y: the Inria rasteriser's convention, pixel v = (ndc_y + 1) / 2 -> fy y / z + 1 - cy (= cy at cy = 0.5)
        torch.testing.assert_close((ndc[1] + 1) / 2, torch.tensor(1.1 * y / z + 1 - 0.55))
        if z in (near, far):
            torch.testing.assert_close(ndc[2], torch.tensor(0.0 if z == near else 1.0), atol=1e-6, rtol=0)


def test_gaussian_renderer_matches_float64_brute_force():
    gs = make_gaussian()
    extr, intr = render_utils.yaw_pitch_r_fov_to_extrinsics_intrinsics(0.7, 0.3, 2.0, 40)
    renderer = GaussianRenderer({"resolution": 24, "near": 0.8, "far": 1.6, "bg_color": (0.1, 0.2, 0.3)})
    out = renderer.render(gs, extr, intr)["color"]
    assert out.shape == (3, 24, 24)
    f = 0.5 / math.tan(math.radians(20)) * 24
    cam = Camera(extr, f, f, 12.0, 12.0, 24, 24)
    covs = covariance_from_scale_rotation(gs.get_scaling.double(), gs.get_rotation.double())
    colors = torch.clamp_min(0.5 + sh_utils.C0 * gs._features_dc[:, 0].double(), 0)
    ref = brute_force(gs.get_xyz.double(), covs, colors, gs.get_opacity.reshape(-1).double(), cam,
                      (0.1, 0.2, 0.3), 0.3, 3.0)
    torch.testing.assert_close(out.permute(1, 2, 0).double(), ref, atol=2e-5, rtol=0)
    # "random" background: black or white
    renderer = GaussianRenderer({"resolution": 8, "near": 0.8, "far": 1.6})
    renderer.render(gs, extr, intr)
    assert renderer.bg_color.tolist() in ([0.0] * 3, [1.0] * 3)


def test_render_frames_truncates_to_uint8_and_reports_no_depth():
    gs = make_gaussian()
    extr, intr = render_utils.yaw_pitch_r_fov_to_extrinsics_intrinsics([0.0, 1.0], [0.1, 0.1], 2.0, 40)
    grey = torch.full((gs._xyz.shape[0], 3), 0.5)
    # grey over a grey background: 0.5 everywhere whatever the coverage
    res = render_utils.render_frames(gs, extr, intr, {"resolution": 16, "bg_color": (0.5, 0.5, 0.5)},
                                     colors_overwrite=grey, verbose=False)
    assert set(res) == {"color", "depth"} and res["depth"] == [None, None]
    frame = res["color"][0]
    assert frame.dtype == np.uint8 and frame.shape == (16, 16, 3)
    assert frame[8, 8].tolist() == [127, 127, 127]  # 0.5 * 255 = 127.5 truncated, as upstream
    assert render_utils.render_frames(gs, [], [], {"resolution": 8}, verbose=False) == {}
    with pytest.raises(ValueError, match="Unsupported sample type"):
        render_utils.render_frames(object(), extr, intr, verbose=False)
    stay = render_utils.render_gaussian_color_stay_in_device(gs, extr, intr, {"resolution": 16,
                                                                              "bg_color": (0.5, 0.5, 0.5)}, grey,
                                                             verbose=False)
    assert list(stay) == ["color"] and stay["color"][0].dtype == torch.uint8
    assert stay["color"][0][8, 8].tolist() == [127, 127, 127]


def test_render_video_multiview_snapshot_shapes():
    gs = make_gaussian(n=20)
    video = render_utils.render_video(gs, resolution=12, num_frames=3, verbose=False)
    assert len(video["color"]) == 3 and video["color"][0].shape == (12, 12, 3)
    colors, extr, intr = render_utils.render_multiview(gs, resolution=8, nviews=5)
    assert len(colors) == len(extr) == len(intr) == 5
    assert len(render_utils.render_snapshot(gs, resolution=8, verbose=False)["color"]) == 4


def test_radical_inverse_and_hammersley():
    assert ru.radical_inverse(2, 0) == 0
    assert ru.radical_inverse(2, 1) == 0.5 and ru.radical_inverse(2, 3) == 0.75 and ru.radical_inverse(2, 6) == 0.375
    assert ru.radical_inverse(3, 5) == pytest.approx(2 / 3 + 1 / 9)  # 5 = 12 in base 3 -> 0.21
    assert ru.halton_sequence(3, 4) == [ru.radical_inverse(2, 4), ru.radical_inverse(3, 4), ru.radical_inverse(5, 4)]
    assert ru.hammersley_sequence(2, 3, 8) == [3 / 8, 0.75]
    yaw, pitch = ru.sphere_hammersley_sequence(0, 10)
    assert pitch == pytest.approx(-math.pi / 2) and yaw == 0
    dirs = []
    for i in range(400):  # evenly spread: the mean direction is near 0
        yaw, pitch = ru.sphere_hammersley_sequence(i, 400)
        dirs.append([math.cos(pitch) * math.sin(yaw), math.cos(pitch) * math.cos(yaw), math.sin(pitch)])
    assert np.abs(np.mean(dirs, axis=0)).max() < 0.01


def test_sh_basis_is_orthonormal_on_the_sphere():
    n = 40000  # Fibonacci sphere quadrature
    i = torch.arange(n, dtype=torch.float64) + 0.5
    z = 1 - 2 * i / n
    phi = math.pi * (1 + 5 ** 0.5) * i
    dirs = torch.stack([torch.sqrt(1 - z * z) * torch.cos(phi), torch.sqrt(1 - z * z) * torch.sin(phi), z], -1)
    basis = []
    for k in range(25):
        sh = torch.zeros(1, 1, 25, dtype=torch.float64)
        sh[..., k] = 1
        basis.append(sh_utils.eval_sh(4, sh.expand(n, 1, 25), dirs)[:, 0])
    b = torch.stack(basis, -1)
    gram = b.T @ b * (4 * math.pi / n)
    torch.testing.assert_close(gram, torch.eye(25, dtype=torch.float64), atol=2e-3, rtol=0)
    rgb = torch.rand(5, 3)
    torch.testing.assert_close(sh_utils.SH2RGB(sh_utils.RGB2SH(rgb)), rgb)
    with pytest.raises(AssertionError):
        sh_utils.eval_sh(2, torch.zeros(1, 3, 4), torch.zeros(1, 3))
