"""Pose maths (6D rotation, quaternions) and the ScaleShiftInvariant decoder against float64 references."""
import math

import torch

from sam3d_objects.pipeline.inference_utils import (ROTATION_6D_MEAN, ROTATION_6D_STD, get_pose_decoder)
from sam3d_objects.utils.rotation import (matrix_to_quaternion, quaternion_multiply, quaternion_to_matrix,
                                          rotation_6d_to_matrix)


def _axis_angle_matrix(axis, angle):
    """Rodrigues in float64 (independent reference)."""
    axis = torch.as_tensor(axis, dtype=torch.float64)
    axis = axis / axis.norm()
    k = torch.tensor([[0, -axis[2], axis[1]], [axis[2], 0, -axis[0]], [-axis[1], axis[0], 0]], dtype=torch.float64)
    return torch.eye(3, dtype=torch.float64) + math.sin(angle) * k + (1 - math.cos(angle)) * k @ k


def test_rotation_6d_gram_schmidt_columns():
    d6 = torch.randn(50, 6, dtype=torch.float64)
    r = rotation_6d_to_matrix(d6)
    eye = torch.eye(3, dtype=torch.float64).expand(50, 3, 3)
    assert torch.allclose(r.transpose(1, 2) @ r, eye, atol=1e-12)
    assert torch.allclose(torch.linalg.det(r), torch.ones(50, dtype=torch.float64))
    assert torch.allclose(r[..., 0], d6[:, :3] / d6[:, :3].norm(dim=-1, keepdim=True))


def test_quaternion_round_trip_including_half_turns():
    cases = [(torch.randn(3), float(a)) for a in torch.rand(40) * math.pi]
    cases += [([1, 0, 0], math.pi), ([0, 1, 1], math.pi), ([1, 2, 3], math.pi - 1e-6), ([0, 0, 1], 0.0)]
    for axis, angle in cases:
        m = _axis_angle_matrix(axis, angle)
        q = matrix_to_quaternion(m)
        assert q[0] >= 0 and abs(q.norm().item() - 1) < 1e-9
        assert torch.allclose(quaternion_to_matrix(q), m, atol=1e-9)
        half = angle / 2
        axis_n = torch.as_tensor(axis, dtype=torch.float64) / torch.as_tensor(axis, dtype=torch.float64).norm()
        ref = torch.cat([torch.tensor([math.cos(half)], dtype=torch.float64), math.sin(half) * axis_n])
        assert torch.allclose(q, ref, atol=1e-6) or torch.allclose(q, -ref, atol=1e-6)


def test_quaternion_multiply_composes_matrices():
    a, b = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    a, b = a / a.norm(), b / b.norm()
    assert torch.allclose(quaternion_to_matrix(quaternion_multiply(a, b)),
                          quaternion_to_matrix(a) @ quaternion_to_matrix(b), atol=1e-12)


def test_scale_shift_invariant_formulas(device):
    """The decoder on the device (its mean / std constants follow the latents there) against float64 on the host."""
    g = torch.Generator().manual_seed(3)
    sample = {k: torch.randn(1, 1, c, generator=g) for k, c in
              (("6drotation_normalized", 6), ("translation", 3), ("scale", 3), ("translation_scale", 1))}
    scene_scale, scene_shift = torch.tensor([[0.7, 0.7, 0.7]]), torch.tensor([[0.1, -0.2, 2.0]])
    out = get_pose_decoder("ScaleShiftInvariant")({k: v.to(device) for k, v in sample.items()},
                                                  scene_scale=scene_scale.to(device),
                                                  scene_shift=scene_shift.to(device))
    assert out["translation"].device.type == device.type
    out = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in out.items()}
    t = sample["translation"].reshape(1, 3).double()
    assert torch.allclose(out["translation"].double(), t * 0.7 + scene_shift.double(), atol=1e-6)
    s = sample["scale"].double().exp().mean() * 0.7
    assert torch.allclose(out["scale"].double(), s.expand(1, 3), atol=1e-6)
    d6 = sample["6drotation_normalized"].reshape(6).double() * ROTATION_6D_STD.double() + ROTATION_6D_MEAN.double()
    r = rotation_6d_to_matrix(d6)
    assert torch.allclose(quaternion_to_matrix(out["rotation"][0].double()), r, atol=1e-5)
    plain = get_pose_decoder("ScaleShiftInvariant")(dict(sample))
    assert torch.allclose(plain["translation"], sample["translation"].reshape(1, 3))


def test_unknown_pose_decoder_is_a_clear_error():
    import pytest
    with pytest.raises(ValueError, match="ScaleShiftInvariant"):
        get_pose_decoder("nope")
