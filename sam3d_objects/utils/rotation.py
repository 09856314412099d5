"""Rotation maths for pose decoding (6D representation, quaternions), without pytorch3d.

Conventions: a 6D rotation (a1, a2) becomes the matrix whose COLUMNS are the Gram-Schmidt basis
(b1, b2, b1 x b2); quaternions are (w, x, y, z), standardised to w >= 0.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rotation_6d_to_matrix(d6: torch.Tensor) -> torch.Tensor:
    """[..., 6] -> [..., 3, 3] with columns b1 = a1/|a1|, b2 = unit(a2 - (b1.a2) b1), b3 = b1 x b2."""
    a1, a2 = d6[..., :3], d6[..., 3:]
    b1 = F.normalize(a1, dim=-1)
    b2 = F.normalize(a2 - (b1 * a2).sum(-1, keepdim=True) * b1, dim=-1)
    b3 = torch.cross(b1, b2, dim=-1)
    return torch.stack((b1, b2, b3), dim=-1)


def standardize_quaternion(q: torch.Tensor) -> torch.Tensor:
    return torch.where(q[..., :1] < 0, -q, q)


def matrix_to_quaternion(matrix: torch.Tensor) -> torch.Tensor:
    """[..., 3, 3] rotation -> [..., 4] (w, x, y, z), w >= 0.

    Each of the four components can be recovered from the diagonal; the one with the largest magnitude is used as
    the divisor for the other three (numerically safest branch).
    """
    m = matrix
    m00, m01, m02 = m[..., 0, 0], m[..., 0, 1], m[..., 0, 2]
    m10, m11, m12 = m[..., 1, 0], m[..., 1, 1], m[..., 1, 2]
    m20, m21, m22 = m[..., 2, 0], m[..., 2, 1], m[..., 2, 2]
    four_sq = torch.stack([1 + m00 + m11 + m22, 1 + m00 - m11 - m22,
                           1 - m00 + m11 - m22, 1 - m00 - m11 + m22], dim=-1)
    mag = torch.sqrt(four_sq.clamp_min(0.0))  # = 2|w|, 2|x|, 2|y|, 2|z|
    # candidate quaternions scaled by 2*component, one per branch
    cand = torch.stack([
        torch.stack([mag[..., 0] ** 2, m21 - m12, m02 - m20, m10 - m01], dim=-1),
        torch.stack([m21 - m12, mag[..., 1] ** 2, m10 + m01, m02 + m20], dim=-1),
        torch.stack([m02 - m20, m10 + m01, mag[..., 2] ** 2, m12 + m21], dim=-1),
        torch.stack([m10 - m01, m20 + m02, m21 + m12, mag[..., 3] ** 2], dim=-1),
    ], dim=-2)
    cand = cand / (2.0 * mag.clamp_min(0.1))[..., None]
    best = mag.argmax(dim=-1)
    q = torch.gather(cand, -2, best[..., None, None].expand(*best.shape, 1, 4)).squeeze(-2)
    return standardize_quaternion(q)


def quaternion_to_matrix(q: torch.Tensor) -> torch.Tensor:
    """[..., 4] (w, x, y, z), any norm -> [..., 3, 3]."""
    w, x, y, z = torch.unbind(q, -1)
    two_s = 2.0 / (q * q).sum(-1)
    m = torch.stack([
        1 - two_s * (y * y + z * z), two_s * (x * y - z * w), two_s * (x * z + y * w),
        two_s * (x * y + z * w), 1 - two_s * (x * x + z * z), two_s * (y * z - x * w),
        two_s * (x * z - y * w), two_s * (y * z + x * w), 1 - two_s * (x * x + y * y),
    ], dim=-1)
    return m.reshape(q.shape[:-1] + (3, 3))


def quaternion_multiply(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    aw, ax, ay, az = torch.unbind(a, -1)
    bw, bx, by, bz = torch.unbind(b, -1)
    return torch.stack([aw * bw - ax * bx - ay * by - az * bz, aw * bx + ax * bw + ay * bz - az * by,
                        aw * by - ax * bz + ay * bw + az * bx, aw * bz + ax * by - ay * bx + az * bw], dim=-1)
