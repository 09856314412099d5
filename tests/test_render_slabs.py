"""The splat renderer's CPU compositor ("slabs": depth slabs culled by live tiles, live-pixel compaction, the
exponent as a matrix product) against a float64 brute force and against the rounds compositor; compositor
selection; the camera-independent covariances that upstream's renderer keeps across a turntable's frames."""
import math

import pytest
import torch

from backends.splat import slabs, use_compositor
from backends.splat import portable
from sam3d_objects.render import covariance_from_scale_rotation, orbit_camera, render_gaussians
from test_render import brute_force


def shell_object(n, seed, radius=0.4, opacity=(0.4, 1.0), size=(0.02, 0.07)):
    """Gaussians on a sphere's surface: a closed, mostly opaque object, so the back half is hidden."""
    g = torch.Generator().manual_seed(seed)
    means = torch.nn.functional.normalize(torch.randn(n, 3, generator=g), dim=-1) * radius
    scales = size[0] + (size[1] - size[0]) * torch.rand(n, 3, generator=g)
    covs = covariance_from_scale_rotation(scales, torch.randn(n, 4, generator=g))
    colors = torch.rand(n, 3, generator=g)
    opac = opacity[0] + (opacity[1] - opacity[0]) * torch.rand(n, generator=g)
    return means, covs, colors, opac


def test_slabs_cull_compact_and_match_float64_brute_force(monkeypatch):
    means, covs, colors, opac = shell_object(1500, seed=4, opacity=(0.7, 1.0), size=(0.05, 0.12))
    cam = orbit_camera(25.0, 20.0, 2.2, fov_deg=45.0, width=48, height=40)
    slab_pairs, widths = [], []
    rounds, composite = slabs._rounds, slabs._composite

    def spy_rounds(canvas, table, tile_of_pair, *args):
        slab_pairs.append(tile_of_pair.numel())
        return rounds(canvas, table, tile_of_pair, *args)

    def spy_composite(s, *args):
        widths.append(s.shape[-1])
        return composite(s, *args)
    monkeypatch.setattr(slabs, "_rounds", spy_rounds)
    monkeypatch.setattr(slabs, "_composite", spy_composite)
    res = render_gaussians(means, covs, colors, opac, cam, background=(0.1, 0.2, 0.3), compositor="slabs")
    ref = brute_force(means, covs, colors, opac, cam, (0.1, 0.2, 0.3), 0.3, 3.0)
    torch.testing.assert_close(res.color.double(), ref, atol=3e-5, rtol=0)
    # the machinery really ran: several slabs, the back ones culled to a fraction of the front's pairs, and
    # chunks over live pixels only (fewer than a tile's 64)
    assert len(slab_pairs) >= 3 and slab_pairs[-1] < 0.5 * slab_pairs[0]
    assert min(widths) < 64 and max(widths) == 64


def test_slabs_float64_match_brute_force_tightly():
    means, covs, colors, opac = shell_object(300, seed=5)
    cam = orbit_camera(-40.0, 10.0, 2.5, fov_deg=40.0, width=40, height=32)
    res = render_gaussians(means.double(), covs.double(), colors.double(), opac.double(), cam,
                           background=(0.0, 0.5, 1.0), compositor="slabs", min_transmittance=0.0)
    assert res.color.dtype == torch.float64
    ref = brute_force(means, covs, colors, opac, cam, (0.0, 0.5, 1.0), 0.3, 3.0)
    torch.testing.assert_close(res.color, ref, atol=1e-9, rtol=0)


def test_slabs_and_rounds_agree_on_a_dense_object():
    # 20k gaussians at 96^2: many rounds, compaction and culled slabs; differences come only from where each
    # stops a tile (< min_transmittance) and from float32 rounding at the cut-offs (rare, < 1/255 + 1e-5)
    means, covs, colors, opac = shell_object(20000, seed=6, radius=0.45)
    covs = covs * 0.1
    cam = orbit_camera(10.0, 15.0, 2.0, fov_deg=40.0, width=96, height=96)
    a = render_gaussians(means, covs, colors, opac, cam, background=(0.0, 0.0, 0.0), compositor="rounds")
    b = render_gaussians(means, covs, colors, opac, cam, background=(0.0, 0.0, 0.0), compositor="slabs")
    diff = (a.color - b.color).abs().amax(-1)
    assert float(a.alpha.max()) > 0.999
    assert float(diff.max()) <= 1 / 255 + 1e-5
    assert float((diff > 1e-4).float().mean()) < 1e-3
    torch.testing.assert_close(a.alpha, b.alpha, atol=1e-4, rtol=0)


def test_compositor_choice(monkeypatch):
    means, covs, colors, opac = shell_object(40, seed=7)
    cam = orbit_camera(0.0, 0.0, 2.0, width=16)
    used = []
    lists, slabs_fn = portable._composite_lists, slabs.composite_slabs
    monkeypatch.setattr(portable, "_composite_lists", lambda *a: used.append("rounds") or lists(*a))
    monkeypatch.setattr(slabs, "composite_slabs", lambda *a: used.append("slabs") or slabs_fn(*a))
    render_gaussians(means, covs, colors, opac, cam)  # the CPU default
    with use_compositor("rounds"):
        render_gaussians(means, covs, colors, opac, cam)
        render_gaussians(means, covs, colors, opac, cam, compositor="slabs")  # an explicit choice wins
    render_gaussians(means, covs, colors, opac, cam)  # the context is over
    assert used == ["slabs", "rounds", "slabs", "slabs"]
    with pytest.raises(ValueError, match="unknown splat compositor"):
        render_gaussians(means, covs, colors, opac, cam, compositor="fast")
    with pytest.raises(ValueError, match="unknown splat compositor"):
        with use_compositor("fast"):
            pass
    with pytest.raises(RuntimeError, match="triton splat compositor cannot run here.*'slabs' or 'rounds'"):
        render_gaussians(means, covs, colors, opac, cam, compositor="triton")


def test_upstream_renderer_reuses_covariances_until_the_gaussians_change():
    from sam3d_objects.model.backbone.tdfy_dit.renderers import gaussian_render
    from sam3d_objects.model.backbone.tdfy_dit.representations.gaussian.gaussian_model import Gaussian
    from sam3d_objects.model.backbone.tdfy_dit.utils import render_utils

    def make():
        g = torch.Generator().manual_seed(8)
        gs = Gaussian([-0.5, -0.5, -0.5, 1.0, 1.0, 1.0], mininum_kernel_size=0.0009, scaling_activation="softplus")
        gs._xyz = torch.rand(60, 3, generator=g) * 0.6 + 0.2
        gs._features_dc = torch.randn(60, 1, 3, generator=g)
        gs._scaling = torch.rand(60, 3, generator=g) * 2 - 4.5
        gs._rotation = torch.randn(60, 4, generator=g)
        gs._opacity = torch.randn(60, 1, generator=g) + 2.0
        return gs

    def frames(gs):
        return render_utils.render_video(gs, resolution=32, num_frames=3, verbose=False)["color"]

    gs = make()
    first = frames(gs)
    assert gaussian_render._COVARIANCES[gs][2] is gaussian_render._covariances(gs, 1.0)  # kept, not recomputed
    gs._scaling.add_(0.7)  # in place: the cached covariances are stale
    gs._rotation = gs._rotation.flip(0)  # a new tensor
    fresh = make()
    fresh._scaling.add_(0.7)
    fresh._rotation = fresh._rotation.flip(0)
    changed, want = frames(gs), frames(fresh)
    assert all((a == b).all() for a, b in zip(changed, want))
    assert any((a != b).any() for a, b in zip(first, changed))
    assert math.isfinite(float(changed[0].mean()))
