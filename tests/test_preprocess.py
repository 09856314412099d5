"""Preprocessing: torchvision-equivalent transforms, mask box, crops, point-map normalisation, intrinsics.

References: the golden `preprocess` case (upstream outputs) and float64 / hand-computed values.
"""
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from sam3d_objects.data import transforms as T
from sam3d_objects.data.dataset.tdfy.img_and_mask_transforms import (ObjectCentricSSI, compute_mask_bbox,
                                                                     crop_around_mask_with_padding, crop_with_fill,
                                                                     resize_all_to_same_size)
from sam3d_objects.data.dataset.tdfy.img_processing import pad_to_square_centered
from sam3d_objects.utils.focal import infer_intrinsics_from_pointmap, recover_focal_shift


@pytest.fixture(scope="module")
def golden_pre(golden_dir):
    return load_file(str(golden_dir / "preprocess" / "inputs.safetensors")), \
        load_file(str(golden_dir / "preprocess" / "outputs.safetensors"))


def test_full_image_transform_matches_upstream_bitwise(golden_pre):
    inp, out = golden_pre
    rgba = inp["rgba_image"].permute(2, 0, 1).float() / 255.0
    img = T.Compose([pad_to_square_centered, T.Resize(518)])(rgba[:3])
    mask = T.Compose([pad_to_square_centered, T.Resize(518, interpolation=0)])(rgba[3:])
    assert torch.equal(img, out["ss.rgb_image"][0])
    assert torch.equal(mask, out["ss.rgb_image_mask"][0])


def test_resize_output_size_rule_and_modes():
    x = torch.rand(3, 480, 640)
    assert T.Resize(518)(x).shape == (3, 518, int(518 * 640 / 480))
    assert T.Resize((100, 50))(x).shape == (3, 100, 50)
    # nearest on an integer ramp picks source pixels floor(i * in / out)
    ramp = torch.arange(10.0).reshape(1, 1, 10).expand(1, 10, 10)
    near = T.Resize(5, interpolation=T.InterpolationMode.NEAREST)(ramp)
    assert torch.equal(near[0, 0], torch.tensor([0.0, 2.0, 4.0, 6.0, 8.0]))
    # antialiased bilinear downsampling by 2 of a constant stays constant, of a ramp averages neighbours
    assert torch.allclose(T.Resize(5)(torch.ones(1, 10, 10)), torch.ones(1, 5, 5))
    assert T.Resize(5, interpolation=2).interpolation is T.InterpolationMode.BILINEAR
    u8 = (torch.rand(3, 20, 20) * 255).to(torch.uint8)
    assert T.Resize(10)(u8).dtype == torch.uint8


def test_pad_to_square_centered_fill_values():
    img, mask, pm = torch.ones(3, 2, 5), torch.ones(1, 2, 5), torch.ones(3, 2, 5)
    p_img, p_mask, p_pm = pad_to_square_centered(img, mask=mask, pointmap=pm)
    assert p_img.shape == (3, 5, 5)
    # diff 3 -> 1 row before, 2 after
    assert p_img[:, 0].abs().sum() == 0 and p_img[:, 1:3].min() == 1 and p_img[:, 3:].abs().sum() == 0
    assert torch.isnan(p_pm[:, 0]).all() and torch.isnan(p_pm[:, 3:]).all()
    assert torch.equal(pad_to_square_centered(pm)[:, 0], torch.zeros(3, 5))  # single-argument: zero padding


def test_compute_mask_bbox_rule(golden_pre):
    inp, out = golden_pre
    alpha = inp["rgba_image"][..., 3].float() / 255.0
    assert list(compute_mask_bbox(alpha, 1.2)) == out["debug.crop_bbox_x1y1x2y2"].tolist()
    m = torch.zeros(20, 30)
    m[2:5, 0:9] = 1  # x 0..8 (w = 8), y 2..4 (h = 2): size int(8 * 1.5) = 12, centre (4, 3)
    assert compute_mask_bbox(m, 1.5) == (int(4 - 6), int(3 - 6), int(4 + 6), int(3 + 6))
    assert compute_mask_bbox(m, 1.5)[1] == -3
    with pytest.raises(ValueError, match="empty"):
        compute_mask_bbox(torch.zeros(4, 4))


def test_crop_zero_fills_outside_and_keeps_content():
    x = torch.arange(1.0, 17.0).reshape(1, 4, 4)
    c = crop_with_fill(x, -1, -1, 3, 3)
    assert c.shape == (1, 4, 4)
    assert c[0, 0].abs().sum() == 0 and c[0, :, 0].abs().sum() == 0
    assert torch.equal(c[0, 1:, 1:], x[0, :3, :3])
    img, mask, pm = torch.rand(3, 40, 40), torch.zeros(1, 40, 40), torch.rand(3, 40, 40)
    mask[0, 10:20, 5:30] = 1
    ci, cm, cp = crop_around_mask_with_padding(img, mask, pointmap=pm, box_size_factor=1.2, padding_factor=0.0)
    assert ci.shape[-1] == ci.shape[-2] == cp.shape[-1]
    assert cm.sum() == mask.sum()


def test_resize_all_to_same_size_nearest():
    img, mask, pm = torch.rand(3, 8, 8), torch.rand(1, 4, 4), torch.rand(3, 4, 4)
    _, m2, p2 = resize_all_to_same_size(img, mask, pointmap=pm)
    assert m2.shape == (1, 8, 8) and torch.equal(p2[:, ::2, ::2], pm)


def _lower_median(x: np.ndarray) -> float:
    x = np.sort(x[~np.isnan(x)])
    return float(x[(len(x) - 1) // 2])


def test_object_centric_ssi_against_numpy_reference():
    g = torch.Generator().manual_seed(0)
    pm = torch.randn(3, 12, 10, generator=g) + torch.tensor([0.5, -1.0, 3.0])[:, None, None]
    pm[:, 0, :4] = float("nan")
    mask = torch.zeros(1, 12, 10)
    mask[0, 2:8, 3:9] = 1
    out, scale, shift = ObjectCentricSSI(use_scene_scale=True).normalize(pm, mask)
    p = pm.double().numpy().reshape(3, -1)
    sel = mask.numpy().reshape(-1) > 0.5
    ref_shift = np.array([_lower_median(p[i, sel]) for i in range(3)])
    dist = np.abs(p - ref_shift[:, None]).max(axis=0)
    ref_scale = _lower_median(dist)
    np.testing.assert_allclose(shift.numpy(), ref_shift, rtol=1e-6)
    np.testing.assert_allclose(scale.numpy(), [ref_scale] * 3, rtol=1e-6)
    ref = (p - ref_shift[:, None]) / ref_scale
    np.testing.assert_allclose(out.reshape(3, -1).numpy(), ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="no valid 3D point"):
        ObjectCentricSSI(raise_on_no_valid_points=True).normalize(torch.full((3, 4, 4), float("nan")),
                                                          torch.ones(1, 4, 4))


def _pinhole_pointmap(h, w, focal, shift):
    """Points whose projection with `focal` (relative to the half diagonal) after adding `shift` to z is exact."""
    from sam3d_objects.utils.focal import normalized_view_plane_uv
    uv = normalized_view_plane_uv(w, h).double()
    z = 2.0 + torch.linspace(0, 1, h * w, dtype=torch.float64).reshape(h, w)
    xy = uv / focal * z[..., None]
    return torch.cat([xy, (z - shift)[..., None]], -1).float()


def test_focal_shift_solver_recovers_a_pinhole_camera():
    focal, shift = recover_focal_shift(_pinhole_pointmap(48, 64, 1.3, 0.4))
    assert abs(focal - 1.3) < 1e-3 and abs(shift - 0.4) < 1e-3


def test_intrinsics_quirk_uses_the_shift(golden_pre):
    """Upstream feeds the fitted shift where the focal belongs (golden intrinsics are ~0); we match it."""
    inp, out = golden_pre
    k = infer_intrinsics_from_pointmap(inp["pointmap_hw3"])
    assert torch.allclose(k, out["debug.intrinsics_from_pointmap"], atol=1e-6)
    k2 = infer_intrinsics_from_pointmap(_pinhole_pointmap(48, 64, 1.3, 0.4))
    aspect = 64 / 48
    assert abs(k2[1, 1].item() - 0.4 / 2 * (1 + aspect ** 2) ** 0.5) < 1e-3
    assert k2[0, 2].item() == 0.5 and k2[2, 2].item() == 1.0


def test_torchvision_targets_resolve_through_safe_instantiate():
    from sam3d_objects.config.instantiate import safe_instantiate
    resize = {"_target_": "torchvision.transforms.Resize", "size": 8, "interpolation": 0}
    compose = safe_instantiate({"_target_": "torchvision.transforms.Compose", "transforms": [resize]})
    y = compose(torch.rand(1, 16, 16))
    assert y.shape == (1, 8, 8)


def test_focal_solver_without_scipy(monkeypatch, golden_pre):
    import sys
    monkeypatch.setitem(sys.modules, "scipy.optimize", None)  # import fails -> Gauss-Newton fallback
    focal, shift = recover_focal_shift(_pinhole_pointmap(48, 64, 1.3, 0.4))
    assert abs(focal - 1.3) < 1e-3 and abs(shift - 0.4) < 1e-3
    inp, out = golden_pre
    assert torch.allclose(infer_intrinsics_from_pointmap(inp["pointmap_hw3"]), out["debug.intrinsics_from_pointmap"],
                          atol=1e-6)
