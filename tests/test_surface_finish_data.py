"""Surface finish: data.dataset.tdfy pose targets, point-map normalisers and training augmentations,
checked against the behaviour in models_generators_data.md (sections 29-31) with float64 numpy references."""
import colorsys
import random

import numpy as np
import pytest
import torch

from sam3d_objects.data.dataset.tdfy import img_and_mask_transforms as imt
from sam3d_objects.data.dataset.tdfy import img_processing as ip
from sam3d_objects.data.dataset.tdfy import pose_target as ptm


def _quat(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(1, n, 4, generator=g), dim=-1)
    return q * q[..., :1].sign()


def _pose(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ptm.InstancePose(instance_scale_l2c=torch.rand(1, n, 3, generator=g) + 0.5,
                            instance_position_l2c=torch.randn(1, n, 3, generator=g) + torch.tensor([0, 0, 4.0]),
                            instance_quaternion_l2c=_quat(n, seed), scene_scale=torch.tensor([[2.0, 2.0, 2.0]]),
                            scene_shift=torch.tensor([[0.1, -0.2, 1.5]]))


def test_ssi_target_is_metric_minus_shift_over_scale_and_normalised():
    ip_ = _pose()
    pt = ptm.ScaleShiftInvariant.from_instance_pose(ip_)
    ref_t = (ip_.instance_position_l2c - ip_.scene_shift[:, None]) / 2
    torch.testing.assert_close(pt.x_instance_translation, ref_t, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pt.x_instance_scale, ip_.instance_scale_l2c / 2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pt.x_instance_rotation, ip_.instance_quaternion_l2c, atol=1e-5, rtol=1e-5)
    ptn = ptm.ScaleShiftInvariant.from_instance_pose(ip_, normalize=True)
    c = ptm.ScaleShiftInvariant
    torch.testing.assert_close(ptn.x_instance_translation, (ref_t - c.translation_mean) / c.translation_std)
    assert ptn.pose_target_convention == "ScaleShiftInvariant"


@pytest.mark.parametrize("name", ["ScaleShiftInvariant", "ScaleShiftInvariantWTranslationScale", "DisparitySpace",
                                  "NormalizedSceneScale", "Naive", "NormalizedSceneScaleAndTranslation",
                                  "ApparentSize", "Identity"])
def test_every_convention_round_trips(name):
    ip_ = _pose()
    if name == "DisparitySpace":  # needs unit scene scale
        ip_.scene_scale = torch.ones(1, 3)
    d = ptm.PoseTargetConverter.dicts_instance_pose_to_pose_target(name, **vars(ip_))
    assert d["pose_target_convention"] == name
    back = ptm.PoseTargetConverter.dicts_pose_target_to_instance_pose(**d)
    for k in ("instance_scale_l2c", "instance_position_l2c", "instance_quaternion_l2c"):
        torch.testing.assert_close(back[k], getattr(ip_, k), atol=1e-5, rtol=1e-5)


def test_disparity_space_formulas():
    ip_ = _pose()
    ip_.scene_scale = torch.ones(1, 3)
    pt = ptm.DisparitySpace.from_instance_pose(ip_)
    t, s = ip_.instance_position_l2c, ip_.instance_scale_l2c
    z = t[..., 2:]
    torch.testing.assert_close(pt.x_instance_translation[..., :2], t[..., :2] / z - ip_.scene_shift[:, None, :2])
    torch.testing.assert_close(pt.x_translation_scale, z / np.exp(1.5), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pt.x_instance_scale, s / z, rtol=1e-5, atol=1e-6)


def test_invariant_pose_target_model_and_validation():
    ip_ = _pose()
    inv = ptm.InvariantPoseTarget.from_instance_pose(ip_)
    t_rel = ip_.instance_position_l2c / 2
    torch.testing.assert_close(inv.t_rel_norm, t_rel.norm(dim=-1, keepdim=True))
    torch.testing.assert_close(inv.s_tilde * inv.t_rel_norm, ip_.instance_scale_l2c / 2)
    derived = ptm.InvariantPoseTarget(q=inv.q, t_unit=inv.t_unit, s_scene=inv.s_scene, s_tilde=inv.s_tilde,
                                      t_rel_norm=inv.t_rel_norm)
    torch.testing.assert_close(derived.s_rel, inv.s_rel)
    with pytest.raises(ValueError):
        ptm.InvariantPoseTarget(q=None, t_unit=inv.t_unit, s_scene=inv.s_scene, s_rel=inv.s_rel)
    with pytest.raises(ValueError):
        ptm.InvariantPoseTarget.from_instance_pose(ptm.InstancePose(torch.ones(3), torch.ones(3), torch.ones(4),
                                                                    torch.ones(3), torch.zeros(3)))


def test_log_scale_shift_normalizer_keeps_upstream_precedence():
    n = ptm.LogScaleShiftNormalizer(shift_log=1.0, scale_log=2.0)
    v = torch.tensor([0.5, 2.0])
    torch.testing.assert_close(n.normalize(v), torch.log(v) - 0.5)
    torch.testing.assert_close(n.denormalize(v), torch.exp(v * 2.0 + 1.0))
    unit = ptm.LogScaleShiftNormalizer(shift_log=0.3)
    torch.testing.assert_close(unit.denormalize(unit.normalize(v)), v)


def _pointmap(h=12, w=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    pm = torch.randn(3, h, w, generator=g, dtype=torch.float64) + torch.tensor([0.5, -1.0, 3.0],
                                                                               dtype=torch.float64)[:, None, None]
    pm[:, 0, :3] = float("nan")
    mask = torch.zeros(1, h, w)
    mask[0, 2:8, 3:9] = 1
    return pm, mask


def test_ssi_pointmap_normalizer_and_normalize_pointmap_ssi():
    pm, mask = _pointmap()
    p = pm.numpy().reshape(3, -1)
    z = p[2][~np.isnan(p[2])]
    shift = np.array([0, 0, np.sort(z)[(len(z) - 1) // 2]])  # torch nanmedian: lower middle
    scale = np.nanmean(np.abs(p - shift[:, None]))
    out = imt.SSIPointmapNormalizer().normalize(pm, mask)
    assert isinstance(out, imt.SSINormalizedPointmap)
    np.testing.assert_allclose(out.shift.numpy(), shift)
    np.testing.assert_allclose(out.scale.numpy(), [scale] * 3)
    np.testing.assert_allclose(out.pointmap.numpy().reshape(3, -1), (p - shift[:, None]) / scale, rtol=1e-10)
    hwc, s2, sh2 = imt.normalize_pointmap_ssi(pm.permute(1, 2, 0))  # (H, W, 3) layout kept
    torch.testing.assert_close(hwc.permute(2, 0, 1), out.pointmap, equal_nan=True)
    back = imt.SSIPointmapNormalizer().denormalize(out.pointmap, out.scale, out.shift)
    torch.testing.assert_close(back, pm, equal_nan=True)


def test_object_centric_ssi_upstream_modes():
    pm, mask = _pointmap()
    p = pm.numpy().reshape(3, -1)
    obj = p[:, mask.numpy().reshape(-1) > 0.5]
    lower_median = lambda a: np.sort(a[~np.isnan(a)])[(np.sum(~np.isnan(a)) - 1) // 2]  # noqa: E731
    shift = np.array([lower_median(obj[i]) for i in range(3)])
    r = np.linalg.norm(obj - shift[:, None], axis=0)
    assert imt.ObjectCentricSSI().use_scene_scale is True  # upstream default
    quant = imt.ObjectCentricSSI(use_scene_scale=False, quantile_drop_threshold=0.2, scale_factor=3.0)
    out = quant.normalize(pm, mask)
    ref_scale = 3.0 * 2 * (np.nanquantile(r, 0.8) - np.nanquantile(r, 0.2))
    np.testing.assert_allclose(out.scale.numpy(), [ref_scale] * 3, rtol=1e-6)
    med = imt.ObjectCentricSSI(use_scene_scale="object_norm_median").normalize(pm, mask)
    np.testing.assert_allclose(med.scale.numpy(), [lower_median(r)] * 3, rtol=1e-6)
    clipped = imt.ObjectCentricSSI(clip_beyond_scale=0.5).normalize(pm, mask).pointmap
    far = clipped.isnan().any(0) & ~pm.isnan().any(0)
    ref_far = (imt.ObjectCentricSSI().normalize(pm, mask).pointmap.norm(dim=0) > 0.5)
    assert torch.equal(far, ref_far) and bool(far.any())
    with pytest.warns(UserWarning):
        fb = imt.ObjectCentricSSI(scale_factor=2.0).normalize(torch.full((3, 4, 4), float("nan")), torch.ones(4, 4))
    assert fb.scale.tolist() == [2.0] * 3 and fb.shift.tolist() == [0.0] * 3
    with pytest.raises(ValueError):
        imt.ObjectCentricSSI(use_scene_scale="bogus")


def test_apparent_size_and_disparity_normalisers():
    pm, mask = _pointmap()
    pm = pm.abs() + 0.5  # positive depth for the log
    z = pm[2].reshape(-1)
    out = imt.ObjectApparentSizeSSI(clip_beyond_scale=1.2).normalize(pm, mask)
    zmed = float(z.nanmedian())
    np.testing.assert_allclose(out.scale.numpy(), [zmed] * 3)
    assert torch.equal(out.pointmap[2].isnan(), (pm[2] / zmed > 1.2) | pm[2].isnan())
    nd = imt.NormalizedDisparitySpaceSSI(log_disparity_shift=0.25)
    res = nd.normalize(pm, mask)
    ref = torch.stack([pm[0] / pm[2], pm[1] / pm[2], torch.log(pm[2]) - (torch.log(z).nanmedian() + 0.25)])
    torch.testing.assert_close(res.pointmap, ref, equal_nan=True)
    torch.testing.assert_close(nd.denormalize(res.pointmap, res.scale, res.shift), pm, equal_nan=True)


def test_resize_and_make_square_and_rgba_processor():
    img = torch.rand(3, 20, 40)
    t = imt.resize_and_make_square(10)["img_transform"]
    assert tuple(t(img).shape) == (3, 10, 20)  # shorter side only
    assert tuple(imt.resize_and_make_square(10, "PAD")["img_transform"](img).shape) == (3, 10, 10)
    assert tuple(imt.resize_and_make_square(10, "crop")["mask_transform"](img[:1]).shape) == (1, 10, 10)
    with pytest.raises(AssertionError):
        imt.resize_and_make_square(10, "stretch")
    const = torch.full((3, 20, 40), 0.25)  # a constant image stays constant through pad-free resizing
    torch.testing.assert_close(t(const), torch.full((3, 10, 20), 0.25))
    mask = torch.zeros(20, 40)
    mask[5:15, 10:30] = 1
    proc = imt.RGBAImageProcessor({"img_size": 8, "make_square": "pad"}, {"box_size_factor": 1.0,
                                                                          "padding_factor": 0.0},
                                  remove_background=True, imagenet_normalization=True)
    image, m = proc(torch.cat([img, mask[None]]))
    assert tuple(image.shape) == (3, 8, 8) and tuple(m.shape) == (1, 8, 8)
    plain = imt.RGBAImageProcessor({"img_size": 8, "make_square": "pad"}, {"box_size_factor": 1.0,
                                                                           "padding_factor": 0.0})
    raw, m2 = plain(img * mask, mask)  # removing the background = masking the image before resizing
    torch.testing.assert_close(m, m2)
    torch.testing.assert_close(imt.IMAGENET_UNNORMALIZATION(image), raw, atol=1e-5, rtol=1e-5)
    # crop box (compute_mask_bbox, factor 1): 18 x 18 px holding the 10 x 18 object -> mask mean ~ 10 / 18
    assert abs(float(m.mean()) - 10 / 18) < 0.03


def test_mask_translation_and_boundary():
    img = torch.rand(3, 16, 16)
    mask = torch.zeros(1, 16, 16)
    mask[0, 4:10, 5:11] = 1
    random.seed(3)
    for _ in range(5):
        _, out = imt.perturb_mask_translation(img, mask, max_px_delta=3)
        assert float(out.sum()) == 36.0  # the square stays inside: a pure shift
        ys, xs = torch.nonzero(out[0], as_tuple=True)
        assert int(ys.max() - ys.min()) == 5 and abs(int(ys.min()) - 4) <= 3 and abs(int(xs.min()) - 5) <= 3
    _, edge = imt.perturb_mask_translation(img, torch.ones(1, 6, 6), max_px_delta=2)
    assert float(edge.sum()) <= 36 and float(edge.sum()) >= 16  # wrapped-in rows/cols are zeroed
    from scipy import ndimage
    for p_erode, p_dilate, op in ((1.0, 0.0, ndimage.binary_erosion), (0.0, 1.0, ndimage.binary_dilation)):
        random.seed(0)
        _, out = imt.perturb_mask_boundary(img, mask, kernel_range=(3, 3), p_erode=p_erode, p_dilate=p_dilate)
        ref = op(mask[0].numpy() > 0, structure=np.ones((3, 3)))
        np.testing.assert_array_equal(out[0].numpy() > 0, ref)


def test_blurs():
    g = torch.Generator().manual_seed(0)
    img = torch.rand(3, 12, 14, generator=g)
    mask = torch.ones(1, 12, 14)
    random.seed(1)
    out, m = imt.gaussian_blur(img, mask, kernel_range=(5, 5), sigma_range=(1.0, 1.0))
    assert m is mask
    from scipy import ndimage
    ref = np.stack([ndimage.gaussian_filter(c.numpy().astype(np.float64), 1.0, mode="nearest", truncate=2.0)
                    for c in img])
    np.testing.assert_allclose(out.numpy(), ref, atol=1e-5)
    small, _ = imt.resolution_blur(img, mask, scale_range=(0.5, 0.5))
    assert small.shape == img.shape and float((small - img).abs().mean()) > 0.01
    const = torch.full((3, 12, 14), 0.3)
    torch.testing.assert_close(imt.resolution_blur(const, mask)[0], const)
    assert imt.apply_blur_augmentation(img, mask, p_resolution=0.0, p_gaussian=0.0)[0] is img
    with pytest.raises(AssertionError):
        imt.apply_blur_augmentation(img, mask, p_resolution=0.8, p_gaussian=0.8)


def test_random_resized_crop_and_color_augmentation():
    img = torch.rand(3, 30, 40)
    torch.manual_seed(0)
    for _ in range(20):
        i, j, h, w = ip.RandomResizedCrop.get_params(img, (0.2, 0.6), (0.5, 2.0))
        assert 0 <= i <= 30 - h and 0 <= j <= 40 - w and h >= 1 and w >= 1
        assert 0.1 * 1200 <= h * w <= 0.7 * 1200
    assert tuple(ip.RandomResizedCrop(16)(img).shape) == (3, 16, 16)
    assert ip.get_img_color_augmentation(0.0, 0.0)(img) is img
    jit = ip.get_img_color_augmentation(1.0, 0.0)(img)
    assert jit.shape == img.shape and not torch.equal(jit, img) and float(jit.min()) >= 0 and float(jit.max()) <= 1
    px = torch.rand(3, 4, 5, dtype=torch.float64)
    hsv = ip._rgb_to_hsv(px)
    ref = np.array([colorsys.rgb_to_hsv(*px[:, y, x].tolist()) for y in range(4) for x in range(5)])
    np.testing.assert_allclose(hsv.permute(1, 2, 0).reshape(-1, 3).numpy(), ref, atol=1e-9)
    torch.testing.assert_close(ip._hsv_to_rgb(hsv), px)
