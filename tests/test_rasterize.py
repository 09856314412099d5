"""backends.rasterize against a brute-force float64 per-pixel reference written independently below."""
import math

import numpy as np
import pytest
import torch

from backends import rasterize as R


def _reference(verts_clip: np.ndarray, faces: np.ndarray, height: int, width: int):
    """Per pixel, per triangle: solve the 3x3 system for the perspective-correct barycentrics directly."""
    rast = np.zeros((height, width, 4))
    margin = np.full((height, width), np.inf)  # distance of the winner's decision to an edge / depth tie
    best = np.full((height, width), np.inf)
    for i in range(height):
        for j in range(width):
            p = np.array([2 * (j + 0.5) / width - 1, 2 * (i + 0.5) / height - 1, 1.0])
            hits = []
            near_edge = np.inf  # how close the pixel centre is to any triangle's edge (barycentric units)
            for f, (a, b, c) in enumerate(faces):
                m = np.stack([verts_clip[[a, b, c], 0], verts_clip[[a, b, c], 1], verts_clip[[a, b, c], 3]])
                if abs(np.linalg.det(m)) < 1e-12:
                    continue
                k = np.linalg.solve(m, p)  # the ray point (x, y, w) = t * p equals sum_i lam_i V_i, lam = t * k
                t = 1.0 / k.sum()
                lam = k * t
                near_edge = min(near_edge, abs(lam.min()))
                if t <= 0 or (lam < 0).any():
                    continue
                z = lam @ verts_clip[[a, b, c], 2]
                depth = z / t
                if not -1 <= depth <= 1:
                    continue
                hits.append((depth, f, lam))
            margin[i, j] = near_edge
            if hits:
                hits.sort(key=lambda h: h[0])
                depth, f, lam = hits[0]
                gap = hits[1][0] - depth if len(hits) > 1 else np.inf
                rast[i, j] = (lam[0], lam[1], depth, f + 1)
                margin[i, j] = min(near_edge, gap)
    return rast, margin


def _random_scene(seed: int, n_faces: int = 12):
    g = np.random.default_rng(seed)
    centers = g.uniform(-0.8, 0.8, size=(n_faces, 1, 3))
    tris = centers + g.normal(scale=0.4, size=(n_faces, 3, 3))
    verts = tris.reshape(-1, 3)
    verts[:, 2] -= 3.0  # in front of a camera at the origin looking down -z
    faces = np.arange(n_faces * 3).reshape(-1, 3)
    # OpenGL perspective, fov 60 deg, near 1, far 6.
    n, f = 1.0, 6.0
    s = 1 / math.tan(math.radians(30))
    proj = np.array([[s, 0, 0, 0], [0, s, 0, 0], [0, 0, (f + n) / (n - f), 2 * f * n / (n - f)], [0, 0, -1, 0]])
    clip = np.concatenate([verts, np.ones((len(verts), 1))], 1) @ proj.T
    return clip, faces


@pytest.mark.parametrize("seed", [0, 1])
def test_matches_float64_reference(seed, device):
    clip, faces = _random_scene(seed)
    h, w = 24, 32
    ref, margin = _reference(clip, faces, h, w)
    got = R.rasterize(torch.tensor(clip, dtype=torch.float32, device=device), torch.tensor(faces, device=device),
                      (h, w))
    assert got.device.type == device.type
    got = got[0].cpu().double().numpy()
    # Pixels whose answer hinges on a near-tie (edge within 1e-4 in barycentrics, or depth within 1e-5) may
    # legitimately differ in float32; everything else must agree exactly on coverage and id.
    clear = margin > 1e-4
    assert clear.sum() > 0.5 * h * w
    assert np.array_equal(got[..., 3][clear], ref[..., 3][clear])
    covered = clear & (ref[..., 3] > 0)
    assert covered.sum() > 50
    np.testing.assert_allclose(got[..., :3][covered], ref[..., :3][covered], atol=2e-5)
    # Empty pixels are all zero.
    assert (got[clear & (ref[..., 3] == 0)] == 0).all()


def test_chunking_does_not_change_result():
    clip, faces = _random_scene(3, n_faces=40)
    v, f = torch.tensor(clip, dtype=torch.float32), torch.tensor(faces)
    a = R.rasterize(v, f, (40, 48))
    b = R.rasterize(v, f, (40, 48), max_pairs=97)  # many tiny chunks, and triangles larger than a chunk
    assert torch.equal(a, b)


def test_row_zero_is_bottom_and_batch():
    # A triangle covering only the lower half of the screen (y < 0) lands in the first rows.
    clip = torch.tensor([[-1.0, -1.0, 0.0, 1.0], [1.0, -1.0, 0.0, 1.0], [0.0, -0.1, 0.0, 1.0]])
    faces = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    rast = R.rasterize(torch.stack([clip, clip * torch.tensor([1.0, -1.0, 1.0, 1.0])]), faces, (16, 16))
    assert rast.shape == (2, 16, 16, 4)
    assert rast[0, :4, 8, 3].eq(1).all() and rast[0, 12:, :, 3].eq(0).all()
    assert rast[1, 12:, 8, 3].eq(1).all() and rast[1, :4, :, 3].eq(0).all()


def test_behind_camera_vertex_is_clipped_not_wrapped():
    # One vertex behind the eye (w < 0): only the part in front (w > 0) may be drawn, as by frustum clipping.
    clip = np.array([[-0.5, -0.5, 0.0, 1.0], [0.5, -0.5, 0.0, 1.0], [0.0, 2.0, -3.0, -1.0]])
    faces = np.array([[0, 1, 2]])
    ref, margin = _reference(clip, faces, 20, 20)
    got = R.rasterize(torch.tensor(clip, dtype=torch.float32), torch.tensor(faces), (20, 20))[0].numpy()
    clear = margin > 1e-4
    assert np.array_equal(got[..., 3][clear], ref[..., 3][clear])


def test_interpolate_reproduces_linear_field_and_grad():
    clip, faces = _random_scene(5)
    v = torch.tensor(clip, dtype=torch.float32)
    rast = R.rasterize(v, torch.tensor(faces), (24, 32))
    # Interpolating the clip-space position (perspective-correct) and dividing gives back the pixel's NDC.
    pos = R.interpolate(v, rast, torch.tensor(faces))[0]
    hit = rast[0, ..., 3] > 0
    ndc = pos[..., :2] / pos[..., 3:4]
    ii, jj = torch.meshgrid(torch.arange(24), torch.arange(32), indexing="ij")
    expect = torch.stack([(2 * jj + 1) / 32 - 1, (2 * ii + 1) / 24 - 1], -1).float()
    torch.testing.assert_close(ndc[hit], expect[hit], atol=1e-4, rtol=0)
    assert (pos[~hit] == 0).all()
    attr = torch.randn(len(clip), 2, requires_grad=True)
    R.interpolate(attr, rast, torch.tensor(faces)).sum().backward()
    assert attr.grad.abs().sum() > 0


def test_texture_texel_centres_and_wrap():
    tex = torch.arange(12, dtype=torch.float32).view(3, 4, 1)
    centres = torch.tensor([[[[(1 + 0.5) / 4, (2 + 0.5) / 3]]]])
    assert R.texture(tex, centres).item() == pytest.approx(tex[2, 1, 0].item())
    # Half way between the last and the first column (u = 0 / 1) averages them under wrap, not under clamp.
    edge = torch.tensor([[[[0.0, 0.5 / 3]]]])
    assert R.texture(tex, edge).item() == pytest.approx((tex[0, 0, 0] + tex[0, 3, 0]).item() / 2)
    assert R.texture(tex, edge, boundary_mode="clamp").item() == pytest.approx(tex[0, 0, 0].item(), abs=1e-5)


def test_barycentric_gradient_matches_finite_difference():
    clip, faces = _random_scene(7, n_faces=6)
    f = torch.tensor(faces)
    attr = torch.randn(len(clip), 3, dtype=torch.float64)

    def loss(v):
        rast = R.rasterize(v, f, (24, 32))
        return (R.interpolate(attr, rast, f) * torch.linspace(0, 1, 3, dtype=torch.float64)).sum()

    v = torch.tensor(clip, dtype=torch.float32, requires_grad=True)
    loss(v).backward()
    assert v.grad.abs().sum() > 0
    # Central differences on a few coordinates; small steps keep coverage unchanged almost everywhere.
    for idx in [(0, 0), (1, 1), (4, 3), (7, 0)]:
        step = 1e-3
        plus, minus = v.detach().clone(), v.detach().clone()
        plus[idx] += step
        minus[idx] -= step
        fd = (loss(plus) - loss(minus)).item() / (2 * step)
        assert fd == pytest.approx(v.grad[idx].item(), rel=0.05, abs=0.05)


@pytest.mark.accelerators_only
def test_accelerator_matches_cpu(device):
    clip, faces = _random_scene(2, n_faces=60)
    v, f = torch.tensor(clip, dtype=torch.float32), torch.tensor(faces)
    a = R.rasterize(v, f, (64, 80))
    b = R.rasterize(v.to(device), f.to(device), (64, 80)).cpu()
    same = a[..., 3] == b[..., 3]
    assert same.float().mean() > 0.999
    torch.testing.assert_close(a[same], b[same], atol=1e-4, rtol=0)
