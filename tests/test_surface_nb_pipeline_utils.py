"""Upstream's pipeline utilities (pointmap intrinsics, default preprocessor, DepthModel, inference_utils helpers)
against closed-form references and the spec."""
import math

import numpy as np
import pytest
import torch

from sam3d_objects.pipeline import inference_utils as iu
from sam3d_objects.utils.rotation import quaternion_to_matrix


def pinhole_pointmap(height=30, width=40, f=35.0):
    v, u = torch.meshgrid(torch.arange(height) + 0.5, torch.arange(width) + 0.5, indexing="ij")
    z = 2 + 0.2 * torch.rand(height, width, generator=torch.Generator().manual_seed(0))
    return torch.stack([(u - width / 2) / f * z, (v - height / 2) / f * z, z], -1), z


def test_infer_intrinsics_with_known_fov_recovers_the_camera():
    from sam3d_objects.pipeline.utils.pointmap import infer_intrinsics_from_pointmap
    pm, z = pinhole_pointmap()
    fov_x = math.degrees(2 * math.atan(20 / 35.0))
    out = infer_intrinsics_from_pointmap(pm, fov_x=fov_x)
    k = out["intrinsics"]
    assert k[0, 0].item() == pytest.approx(35 / 40, rel=1e-4) and k[1, 1].item() == pytest.approx(35 / 30, rel=1e-4)
    assert k[0, 2] == 0.5 and k[1, 2] == 0.5
    torch.testing.assert_close(out["depth"], z, atol=1e-3, rtol=0)  # an exact pinhole map needs no shift
    masked = pm.clone()
    masked[0, 0] = float("nan")
    res = infer_intrinsics_from_pointmap(masked[None], fov_x=fov_x, apply_mask=True)
    assert res["points"].shape == (1, 30, 40, 3) and not bool(res["mask"][0, 0, 0])
    assert torch.isinf(res["depth"][0, 0, 0])
    proj = infer_intrinsics_from_pointmap(pm, fov_x=fov_x, force_projection=True)["points"]
    torch.testing.assert_close(proj, pm, atol=2e-3, rtol=0)  # re-projection with the recovered camera


def test_default_preprocessor_crops_and_removes_background():
    from sam3d_objects.pipeline.preprocess_utils import get_default_preprocessor
    img = torch.rand(3, 40, 60) + 0.1
    mask = torch.zeros(1, 40, 60)
    mask[0, 10:20, 20:35] = 1
    out = get_default_preprocessor()(img, mask)
    assert out["image"].shape == (3, 518, 518) and out["mask"].shape == (1, 518, 518)
    assert out["rgb_image"].shape == (3, 518, 518)
    # the 14 px crop box has 2 background rows on top (mask rows 10..19 of 8..21): zero after rembg; the first
    # output rows sample only them (bicubic support 2 source pixels at 37x upsampling)
    assert float(out["mask"][:, :10].max()) == 0 and float(out["image"][:, :10].abs().max()) < 1e-6
    assert float(out["image"][:, 200:300, 200:300].min()) > 0  # object pixels kept
    assert float(out["mask"].mean()) > 0.3  # object fills the crop (box 1.0 + 10% padding)


def test_depth_model_base():
    from sam3d_objects.pipeline.depth_models.base import DepthModel
    net = torch.nn.Linear(2, 2).train()
    dm = DepthModel(net, device="cpu")
    assert dm.model is net and not net.training and dm(torch.zeros(3, 4, 4)) is None


def test_inference_utils_constants_and_decoders():
    assert iu.SLAT_MEAN.shape == (8,) and iu.SLAT_STD.shape == (8,)
    assert iu.get_default_pose_decoder()({"x": 1}) == {}
    assert set(iu.POSE_DECODERS) >= {"default", "ScaleShiftInvariant", "ZeroPredictionScaleShiftInvariant"}
    with pytest.raises(NotImplementedError):
        iu.get_pose_decoder("nope")
    out = {"6drotation_normalized": torch.randn(1, 1, 6), "scale": torch.randn(1, 1, 3),
           "translation": torch.randn(1, 1, 3), "translation_scale": torch.randn(1, 1, 1)}
    zero = iu.zero_prediction_decoder()(out)
    torch.testing.assert_close(zero["translation"], torch.zeros(1, 3))
    torch.testing.assert_close(zero["scale"], torch.full((1, 3), math.exp(1.337)))
    assert out["translation"].abs().sum() > 0  # the caller's dict is untouched
    assert iu.pose_decoder("ScaleShiftInvariant")(out)["rotation"].shape == (1, 4)


def test_mesh_and_layout_helpers():
    verts = np.array([[0.0, 0, 0], [2, 1, 0], [1, 4, 2]])
    norm, scale, center = iu.normalize_mesh_verts(verts)
    np.testing.assert_allclose(center, [1, 2, 1])
    assert scale == pytest.approx(0.25) and np.ptp(norm, axis=0).max() == pytest.approx(1.0)
    assert iu.normalize_mesh_verts(np.ones((3, 3)))[1] == 1
    mask = torch.zeros(10, 20)
    mask[2:5, 3:11] = 1
    assert iu.estimate_plane_area(mask) == pytest.approx(3 * 8 / 200)
    assert iu.estimate_plane_area(torch.zeros(4, 4)) == 0.0
    # Euler angles: R^T = Rx(a) Ry(b) Rz(c) convention -> rebuild and compare
    q = torch.nn.functional.normalize(torch.tensor([0.9, 0.2, -0.3, 0.1], dtype=torch.float64), dim=0)
    a, b, c = (-v for v in iu.quat_wxyz_to_euler_XYZ(q))
    rx = torch.tensor([[1, 0, 0], [0, math.cos(a), -math.sin(a)], [0, math.sin(a), math.cos(a)]], dtype=torch.float64)
    ry = torch.tensor([[math.cos(b), 0, math.sin(b)], [0, 1, 0], [-math.sin(b), 0, math.cos(b)]], dtype=torch.float64)
    rz = torch.tensor([[math.cos(c), -math.sin(c), 0], [math.sin(c), math.cos(c), 0], [0, 0, 1]], dtype=torch.float64)
    torch.testing.assert_close(rz @ ry @ rx, quaternion_to_matrix(q).T, atol=1e-9, rtol=0)
    halo = iu.format_to_halo({"quaternion": q[None, None], "translation": torch.tensor([[1.0, 2, 3]]),
                              "scale": torch.tensor([[0.5, 0.5, 0.5]])})
    assert halo["pred_transform"][0][3] == 1.0 and halo["pred_scale"] == [0.5] * 3
    payload = iu.json_to_halo_payloads(halo)
    assert payload["positions"] == {"x": 1.0, "y": 2.0, "z": 2.0} and payload["scale"]["x"] == 0.5


def test_update_layout_and_halo_frame():
    q = torch.nn.functional.normalize(torch.tensor([[0.9, 0.1, 0.3, -0.2]], dtype=torch.float64), dim=-1)
    t = torch.tensor([[0.2, -0.1, 2.0]], dtype=torch.float64)
    s = torch.full((1, 3), 0.5, dtype=torch.float64)
    assert iu.update_layout(t, s, q, None, None, to_halo=False) == (t, s, q)
    center = np.array([0.1, 0.2, -0.3])
    trans, scale, quat = iu.update_layout(t, s, q, center, 2.0, to_halo=True)
    # reference: mesh point p -> normalised (p - c) * 2 -> posed (row vectors) -> camera frame flipped to OpenCV,
    # with the GLB->z-up axis change applied first
    p = torch.randn(6, 3, dtype=torch.float64)
    a = torch.tensor([[1.0, 0, 0], [0, 0, 1], [0, -1, 0]], dtype=torch.float64)
    r = quaternion_to_matrix(q[0])
    want = ((((p @ a) - torch.as_tensor(center)) * 2.0 * 0.5) @ r + t) * torch.tensor([-1.0, -1.0, 1.0]).double()
    got = ((p * scale) @ quaternion_to_matrix(quat[0])) + trans
    torch.testing.assert_close(got, want)
