"""Pure-PyTorch splat renderer against analytic footprints, compositing order and a float64 brute force."""
import math

import numpy as np
import pytest
import torch

from sam3d_objects.render import (Camera, covariance_from_scale_rotation, focal_from_pointmap, look_at,
                                  orbit_camera, quaternion_to_rotation_matrix, render_gaussians, save_gif)

W = H = 64
F = 100.0


def identity_camera(width=W, height=H, f=F):
    return Camera(torch.eye(4), f, f, width / 2.0, height / 2.0, width, height)


def pixel_grid(width=W, height=H):
    v, u = torch.meshgrid(torch.arange(height, dtype=torch.float64) + 0.5,
                          torch.arange(width, dtype=torch.float64) + 0.5, indexing="ij")
    return u, v


def gaussian_alpha(u, v, mean2d, cov2d, opacity, extent=3.0):
    inv = torch.linalg.inv(torch.as_tensor(cov2d, dtype=torch.float64))
    du, dv = u - mean2d[0], v - mean2d[1]
    q = inv[0, 0] * du * du + 2 * inv[0, 1] * du * dv + inv[1, 1] * dv * dv
    a = (opacity * torch.exp(-0.5 * q)).clamp(max=0.99)
    return torch.where(q > extent ** 2, torch.zeros_like(a), a)


def test_single_isotropic_gaussian_footprint_and_colour():
    z, sigma, opacity = 5.0, 0.2, 0.8
    color = torch.tensor([[0.9, 0.2, 0.1]])
    res = render_gaussians(torch.tensor([[0.0, 0.0, z]]), torch.eye(3)[None] * sigma ** 2, color,
                           torch.tensor([opacity]), identity_camera(), background=(0.0, 0.0, 1.0), blur=0.0,
                           alpha_min=0.0)
    u, v = pixel_grid()
    s_px = F * sigma / z  # on the optical axis the projected std is f * sigma / z
    expected = gaussian_alpha(u, v, (W / 2, H / 2), torch.eye(2) * s_px ** 2, opacity)
    torch.testing.assert_close(res.alpha.double(), expected, atol=1e-5, rtol=0)
    bg = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)
    want = expected[..., None] * color[0].double() + (1 - expected[..., None]) * bg
    torch.testing.assert_close(res.color.double(), want, atol=1e-5, rtol=0)
    # the footprint's spread measured independently: second moment of the alpha image
    a = res.alpha.double()
    var_u = float((a * (u - W / 2) ** 2).sum() / a.sum())
    cut = 9.0  # truncation at 3 sigma lowers the variance of a 2D gaussian by this known factor
    factor = (1 - math.exp(-cut / 2) * (1 + cut / 2)) / (1 - math.exp(-cut / 2))
    assert var_u == pytest.approx(s_px ** 2 * factor, rel=0.03)
    assert torch.allclose(res.depth[res.alpha > 0], torch.tensor(z))


def test_anisotropic_rotated_and_off_axis_gaussian():
    z, theta = 4.0, math.radians(30)
    scales = torch.tensor([[0.3, 0.1, 0.01]])
    quat = torch.tensor([[math.cos(theta / 2), 0.0, 0.0, math.sin(theta / 2)]])  # about the viewing axis
    x0, y0 = 0.2, -0.1
    cov = covariance_from_scale_rotation(scales, quat)
    res = render_gaussians(torch.tensor([[x0, y0, z]]), cov, torch.ones(1, 3), torch.tensor([0.9]),
                           identity_camera(), background=(0, 0, 0), blur=0.0, alpha_min=0.0)
    # reference: Jacobian of the projection at the mean, applied to the 3D covariance
    jac = torch.tensor([[F / z, 0, -F * x0 / z ** 2], [0, F / z, -F * y0 / z ** 2]], dtype=torch.float64)
    cov2d = jac @ cov[0].double() @ jac.T
    u, v = pixel_grid()
    mean2d = (F * x0 / z + W / 2, F * y0 / z + H / 2)
    expected = gaussian_alpha(u, v, mean2d, cov2d, 0.9)
    torch.testing.assert_close(res.alpha.double(), expected, atol=1e-5, rtol=0)
    # orientation: the long axis is turned by theta in the image (x right, y down: +30 deg about +z)
    a = res.alpha.double()
    mu = ((a * u).sum() / a.sum(), (a * v).sum() / a.sum())
    assert float(mu[0]) == pytest.approx(mean2d[0], abs=1e-3)
    assert float(mu[1]) == pytest.approx(mean2d[1], abs=1e-3)
    cuu = (a * (u - mu[0]) ** 2).sum()
    cvv = (a * (v - mu[1]) ** 2).sum()
    cuv = (a * (u - mu[0]) * (v - mu[1])).sum()
    angle = 0.5 * math.atan2(2 * float(cuv), float(cuu - cvv))
    assert angle == pytest.approx(theta, abs=0.02)


def composite(colors, alphas, bg):
    out, trans = torch.zeros(3, dtype=torch.float64), 1.0
    for c, a in zip(colors, alphas):
        out += trans * a * c
        trans *= 1 - a
    return out + trans * bg


@pytest.mark.parametrize("swap_inputs", [False, True])
def test_occlusion_follows_depth_not_input_order(swap_inputs):
    red, blue = torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 0.0, 1.0])
    means = torch.tensor([[0.0, 0.0, 3.0], [0.0, 0.0, 6.0]])  # red in front
    colors = torch.stack([red, blue])
    opac = torch.tensor([0.7, 0.95])
    covs = torch.stack([torch.eye(3) * 0.05 ** 2, torch.eye(3) * 0.1 ** 2])
    order = [1, 0] if swap_inputs else [0, 1]
    res = render_gaussians(means[order], covs[order], colors[order], opac[order], identity_camera(),
                           background=(0, 1, 0), blur=0.0, alpha_min=0.0)
    centre = res.color[H // 2 - 1:H // 2 + 1, W // 2 - 1:W // 2 + 1].double().mean(dim=(0, 1))
    # pixel centres are 0.5 px from the means: evaluate the analytic alphas there
    a_red = 0.7 * math.exp(-0.5 * 0.5 / (F * 0.05 / 3.0) ** 2)
    a_blue = 0.95 * math.exp(-0.5 * 0.5 / (F * 0.1 / 6.0) ** 2)
    want = composite([red.double(), blue.double()], [a_red, a_blue], torch.tensor([0.0, 1.0, 0.0]).double())
    torch.testing.assert_close(centre, want, atol=1e-5, rtol=0)
    assert centre[0] > centre[2]  # the nearer red one dominates
    # mean depth is the alpha-weighted blend of the two depths
    w_red, w_blue = a_red, (1 - a_red) * a_blue
    assert float(res.depth[H // 2, W // 2]) == pytest.approx((3 * w_red + 6 * w_blue) / (w_red + w_blue), rel=1e-5)


def test_moving_the_back_gaussian_forward_flips_the_colour():
    colors = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    covs = torch.eye(3)[None].repeat(2, 1, 1) * 0.1 ** 2
    opac = torch.tensor([0.98, 0.98])
    near_red = render_gaussians(torch.tensor([[0.0, 0.0, 3.0], [0.0, 0.0, 4.0]]), covs, colors, opac,
                                identity_camera())
    near_blue = render_gaussians(torch.tensor([[0.0, 0.0, 3.0], [0.0, 0.0, 2.0]]), covs, colors, opac,
                                 identity_camera())
    c = (H // 2, W // 2)
    assert near_red.color[c][0] > 0.9 and near_red.color[c][2] < 0.1
    assert near_blue.color[c][2] > 0.9 and near_blue.color[c][0] < 0.1


def brute_force(means, covs, colors, opac, camera, bg, blur, extent):
    """float64 per-pixel reference: project, sort by depth, composite every gaussian at every pixel."""
    means, covs = means.double(), covs.double()
    rot, t = camera.rotation.double(), camera.translation.double()
    cam = means @ rot.T + t
    u, v = pixel_grid(camera.width, camera.height)
    out = torch.zeros(camera.height, camera.width, 3, dtype=torch.float64)
    trans = torch.ones(camera.height, camera.width, dtype=torch.float64)
    for i in torch.argsort(cam[:, 2]).tolist():
        x, y, z = cam[i].tolist()
        if z <= 1e-2:
            continue
        jac = torch.tensor([[camera.fx / z, 0, -camera.fx * x / z ** 2],
                            [0, camera.fy / z, -camera.fy * y / z ** 2]], dtype=torch.float64)
        cov2d = jac @ rot @ covs[i] @ rot.T @ jac.T + blur * torch.eye(2, dtype=torch.float64)
        mean2d = (camera.fx * x / z + camera.cx, camera.fy * y / z + camera.cy)
        a = gaussian_alpha(u, v, mean2d, cov2d, float(opac[i]), extent)
        a = torch.where(a < 1 / 255, torch.zeros_like(a), a)
        out += (trans * a)[..., None] * colors[i].double()
        trans = trans * (1 - a)
    return out + trans[..., None] * torch.as_tensor(bg, dtype=torch.float64)


@pytest.mark.parametrize("tile_size,max_elements", [(16, 1 << 22), (8, 4096), (64, 1 << 22), (5, 300)])
def test_matches_float64_brute_force_for_any_tiling(tile_size, max_elements, device):
    g = torch.Generator().manual_seed(0)
    n = 60
    means = torch.randn(n, 3, generator=g) * 0.4
    scales = torch.rand(n, 3, generator=g) * 0.12 + 0.01
    quats = torch.randn(n, 4, generator=g)
    covs = covariance_from_scale_rotation(scales, quats)
    colors = torch.rand(n, 3, generator=g)
    opac = torch.rand(n, generator=g) * 0.9 + 0.1
    cam = orbit_camera(30.0, 20.0, 3.0, fov_deg=45.0, width=48, height=40)
    res = render_gaussians(means.to(device), covs.to(device), colors.to(device), opac.to(device), cam,
                           background=(0.2, 0.3, 0.4), tile_size=tile_size, max_elements=max_elements)
    assert res.color.device.type == device.type
    ref = brute_force(means, covs, colors, opac, cam, (0.2, 0.3, 0.4), 0.3, 3.0)
    # float32 on the device vs float64: TF32/fast-math on accelerators allowed for
    tol = 2e-5 if device.type == "cpu" else 2e-3
    torch.testing.assert_close(res.color.double().cpu(), ref, atol=tol, rtol=0)


def test_empty_and_behind_camera_give_background():
    cam = identity_camera(16, 12)
    res = render_gaussians(torch.tensor([[0.0, 0.0, -2.0]]), torch.eye(3)[None] * 0.01, torch.ones(1, 3),
                           torch.ones(1), cam, background=(0.1, 0.2, 0.3))
    assert res.color.shape == (12, 16, 3)
    torch.testing.assert_close(res.color, torch.tensor([0.1, 0.2, 0.3]).expand(12, 16, 3))
    assert float(res.alpha.abs().max()) == 0.0
    res = render_gaussians(torch.zeros(0, 3), torch.zeros(0, 3, 3), torch.zeros(0, 3), torch.zeros(0), cam)
    torch.testing.assert_close(res.color, torch.ones(12, 16, 3))


def test_bad_shapes_raise_clear_errors():
    with pytest.raises(ValueError, match="covariances"):
        render_gaussians(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), identity_camera())


def test_look_at_and_orbit_camera_conventions():
    w2c = look_at((0.0, -3.0, 0.0), (0.0, 0.0, 0.0), (0.0, 0.0, 1.0))
    cam = Camera(w2c, 50.0, 50.0, 32.0, 24.0, 64, 48)
    px = cam.project(torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]))
    torch.testing.assert_close(px[0], torch.tensor([32.0, 24.0]))
    assert px[1, 1] < 24.0  # world up is image up (smaller row)
    assert px[2, 0] > 32.0  # +x is to the right when looking along +y with z up
    orbit = orbit_camera(90.0, 30.0, 2.0, width=32)
    torch.testing.assert_close(orbit.position.norm(), torch.tensor(2.0))
    assert float(orbit.position[2]) == pytest.approx(2.0 * math.sin(math.radians(30)), abs=1e-5)
    torch.testing.assert_close(orbit.project(torch.zeros(1, 3))[0], torch.tensor([16.0, 16.0]))


def test_quaternion_matrix_is_a_rotation():
    q = torch.randn(10, 4, generator=torch.Generator().manual_seed(1))
    r = quaternion_to_rotation_matrix(q)
    torch.testing.assert_close(r @ r.transpose(1, 2), torch.eye(3).expand(10, 3, 3), atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.linalg.det(r), torch.ones(10), atol=1e-5, rtol=0)
    # 90 degrees about z maps x to y
    rz = quaternion_to_rotation_matrix(torch.tensor([[math.cos(math.pi / 4), 0, 0, math.sin(math.pi / 4)]]))
    torch.testing.assert_close(rz[0] @ torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 1.0, 0.0]),
                               atol=1e-6, rtol=0)


def test_focal_from_pointmap_recovers_pinhole_focal():
    h, w, f = 30, 40, 37.5
    v, u = torch.meshgrid(torch.arange(h) + 0.5, torch.arange(w) + 0.5, indexing="ij")
    depth = 2.0 + torch.rand(h, w, generator=torch.Generator().manual_seed(2))
    x_cv, y_cv = (u - w / 2) / f * depth, (v - h / 2) / f * depth
    pm = torch.stack([-x_cv, -y_cv, depth], dim=-1)  # PyTorch3D frame
    pm[0, 0] = float("nan")
    assert focal_from_pointmap(pm) == pytest.approx(f, rel=1e-6)


def test_gaussian_object_inputs_and_gif(tmp_path):
    from PIL import Image

    from sam3d_objects.model.backbone.tdfy_dit.representations.gaussian import Gaussian
    from sam3d_objects.render import gaussian_render_inputs, turntable
    gs = Gaussian(aabb=[-0.5, -0.5, -0.5, 1.0, 1.0, 1.0], sh_degree=0, mininum_kernel_size=0.0009,
                  scaling_bias=0.004, opacity_bias=0.1, scaling_activation="softplus")
    g = torch.Generator().manual_seed(3)
    n = 50
    gs._xyz = torch.rand(n, 3, generator=g)
    gs._features_dc = torch.randn(n, 1, 3, generator=g)
    gs._scaling = torch.randn(n, 3, generator=g) * 0.1 + 2.0
    gs._rotation = torch.randn(n, 4, generator=g)
    gs._opacity = torch.randn(n, 1, generator=g)
    means, covs, colors, opac = gaussian_render_inputs(gs)
    torch.testing.assert_close(means, gs.get_xyz)
    torch.testing.assert_close(colors, (0.5 + 0.28209479177387814 * gs._features_dc[:, 0]).clamp(0, 1))
    # covariance vs the Gaussian's own (upper-triangle) covariance
    tri = gs.get_covariance()
    full = torch.stack([tri[:, 0], tri[:, 1], tri[:, 2], tri[:, 1], tri[:, 3], tri[:, 4], tri[:, 2], tri[:, 4],
                        tri[:, 5]], dim=-1).reshape(n, 3, 3)
    torch.testing.assert_close(covs, full, atol=1e-7, rtol=1e-4)
    frames = turntable(gs, num_frames=4, resolution=24)
    assert len(frames) == 4 and frames[0].shape == (24, 24, 3) and frames[0].dtype == np.uint8
    assert not np.array_equal(frames[0], frames[1])  # the view changes
    path = save_gif(frames, tmp_path / "t.gif")
    with Image.open(path) as im:
        assert im.n_frames == 4 and im.size == (24, 24)


@pytest.mark.parametrize("min_transmittance", [0.0, 1e-5])
def test_dense_scene_many_rounds_and_early_stop_match_brute_force(min_transmittance):
    # 300 overlapping, mostly opaque gaussians: tiles need several rounds of growing chunks (32, 64, ...) and
    # most turn opaque early; stopping them changes each pixel by less than min_transmittance
    g = torch.Generator().manual_seed(3)
    n = 300
    means = torch.randn(n, 3, generator=g) * 0.15
    covs = covariance_from_scale_rotation(torch.rand(n, 3, generator=g) * 0.08 + 0.02, torch.randn(n, 4, generator=g))
    colors = torch.rand(n, 3, generator=g)
    opac = torch.rand(n, generator=g) * 0.3 + 0.7
    cam = orbit_camera(10.0, 30.0, 2.5, fov_deg=40.0, width=32, height=24)
    res = render_gaussians(means, covs, colors, opac, cam, background=(0.0, 0.0, 0.0), tile_size=8,
                           min_transmittance=min_transmittance)
    ref = brute_force(means, covs, colors, opac, cam, (0.0, 0.0, 0.0), 0.3, 3.0)
    torch.testing.assert_close(res.color.double(), ref, atol=2e-5 + min_transmittance, rtol=0)
    assert float(res.alpha.max()) > 0.999  # the scene really is opaque somewhere
