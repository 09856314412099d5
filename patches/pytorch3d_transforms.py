"""The maths of the ``pytorch3d`` stand-in (:mod:`patches.pytorch3d_shim`), in plain PyTorch: rotation
conversions, ``Transform3d`` and its subclasses, and the look-at camera helpers, with pytorch3d's conventions:
quaternions are (w, x, y, z); ``Transform3d`` uses row vectors (``p' = p M``, translation in the last row;
``a.compose(b)`` applies ``a`` first); ``look_at_view_transform`` returns (R, T) with ``X_cam = X_world R + T``.
Kept apart from the shim's module building so that :mod:`patches.pytorch3d_render` can use ``Transform3d``
without importing the shim (which imports the renderer).
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F



# ------------------------------------------------------------------------------------------------ rotations
def standardize_quaternion(q: torch.Tensor) -> torch.Tensor:
    """q and -q are the same rotation: the representative with a non-negative real part."""
    return torch.where(q[..., :1] < 0, -q, q)


def quaternion_to_matrix(quaternions: torch.Tensor) -> torch.Tensor:
    w, x, y, z = torch.unbind(quaternions, -1)
    s = 2.0 / (quaternions * quaternions).sum(-1)  # unnormalised input is normalised implicitly
    m = torch.stack([1 - s * (y * y + z * z), s * (x * y - z * w), s * (x * z + y * w),
                     s * (x * y + z * w), 1 - s * (x * x + z * z), s * (y * z - x * w),
                     s * (x * z - y * w), s * (y * z + x * w), 1 - s * (x * x + y * y)], -1)
    return m.reshape(quaternions.shape[:-1] + (3, 3))


def matrix_to_quaternion(matrix: torch.Tensor) -> torch.Tensor:
    """Rotation matrices -> unit quaternions with w >= 0 (from the best-conditioned of the four diagonals)."""
    if matrix.shape[-2:] != (3, 3):
        raise ValueError(f"expected [..., 3, 3] matrices, got {tuple(matrix.shape)}")
    m = matrix
    m00, m11, m22 = m[..., 0, 0], m[..., 1, 1], m[..., 2, 2]
    # sq[i] = 4 q_i^2; row i of ``rows`` is 4 q_i q. Dividing the row of the largest q_i by 4 q_i = 2 sqrt(sq[i])
    # is the best-conditioned of the four ways to recover q.
    sq = torch.stack([1 + m00 + m11 + m22, 1 + m00 - m11 - m22, 1 - m00 + m11 - m22, 1 - m00 - m11 + m22], -1)
    d21, d02, d10 = m[..., 2, 1] - m[..., 1, 2], m[..., 0, 2] - m[..., 2, 0], m[..., 1, 0] - m[..., 0, 1]
    s10, s02, s21 = m[..., 1, 0] + m[..., 0, 1], m[..., 0, 2] + m[..., 2, 0], m[..., 2, 1] + m[..., 1, 2]
    rows = torch.stack([torch.stack([sq[..., 0], d21, d02, d10], -1), torch.stack([d21, sq[..., 1], s10, s02], -1),
                        torch.stack([d02, s10, sq[..., 2], s21], -1), torch.stack([d10, s02, s21, sq[..., 3]], -1)],
                       -2)
    best = sq.argmax(-1)
    row = torch.gather(rows, -2, best[..., None, None].expand(*best.shape, 1, 4))[..., 0, :]
    denom = 2.0 * torch.sqrt(torch.gather(sq, -1, best[..., None]).clamp(min=1e-12))
    return standardize_quaternion(row / denom)


def axis_angle_to_quaternion(axis_angle: torch.Tensor) -> torch.Tensor:
    angle = torch.linalg.norm(axis_angle, dim=-1, keepdim=True)
    half = angle / 2
    small = angle.abs() < 1e-6
    # sin(a/2)/a, with its Taylor series near 0 where the division is ill-conditioned
    factor = torch.where(small, 0.5 - angle * angle / 48, torch.sin(half) / torch.where(small, 1.0, angle))
    return torch.cat([torch.cos(half), axis_angle * factor], -1)


def quaternion_to_axis_angle(quaternions: torch.Tensor) -> torch.Tensor:
    q = standardize_quaternion(quaternions)
    norms = torch.linalg.norm(q[..., 1:], dim=-1, keepdim=True)
    half = torch.atan2(norms, q[..., :1])
    angle = 2 * half
    small = angle.abs() < 1e-6
    factor = torch.where(small, 0.5 - angle * angle / 48, torch.sin(half) / torch.where(small, 1.0, angle))
    return q[..., 1:] / factor


def axis_angle_to_matrix(axis_angle: torch.Tensor) -> torch.Tensor:
    return quaternion_to_matrix(axis_angle_to_quaternion(axis_angle))


def matrix_to_axis_angle(matrix: torch.Tensor) -> torch.Tensor:
    return quaternion_to_axis_angle(matrix_to_quaternion(matrix))


def quaternion_raw_multiply(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Hamilton product a * b (rotation b, then a)."""
    aw, ax, ay, az = torch.unbind(a, -1)
    bw, bx, by, bz = torch.unbind(b, -1)
    return torch.stack([aw * bw - ax * bx - ay * by - az * bz, aw * bx + ax * bw + ay * bz - az * by,
                        aw * by - ax * bz + ay * bw + az * bx, aw * bz + ax * by - ay * bx + az * bw], -1)


def quaternion_multiply(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return standardize_quaternion(quaternion_raw_multiply(a, b))


def quaternion_invert(quaternion: torch.Tensor) -> torch.Tensor:
    return quaternion * quaternion.new_tensor([1, -1, -1, -1])


def quaternion_apply(quaternion: torch.Tensor, point: torch.Tensor) -> torch.Tensor:
    pure = torch.cat([point.new_zeros(point.shape[:-1] + (1,)), point], -1)
    return quaternion_raw_multiply(quaternion_raw_multiply(quaternion, pure), quaternion_invert(quaternion))[..., 1:]


def _axis_rotation(axis: str, angle: torch.Tensor) -> torch.Tensor:
    c, s, one, zero = torch.cos(angle), torch.sin(angle), torch.ones_like(angle), torch.zeros_like(angle)
    rows = {"X": (one, zero, zero, zero, c, -s, zero, s, c),
            "Y": (c, zero, s, zero, one, zero, -s, zero, c),
            "Z": (c, -s, zero, s, c, zero, zero, zero, one)}[axis]
    return torch.stack(rows, -1).reshape(angle.shape + (3, 3))


def euler_angles_to_matrix(euler_angles: torch.Tensor, convention: str) -> torch.Tensor:
    """``convention`` like "XYZ": R = R_X(a0) @ R_Y(a1) @ R_Z(a2)."""
    if len(convention) != 3 or any(c not in "XYZ" for c in convention):
        raise ValueError(f"convention must be three of X, Y, Z, got {convention!r}")
    mats = [_axis_rotation(c, a) for c, a in zip(convention, torch.unbind(euler_angles, -1))]
    return functools.reduce(torch.matmul, mats)


def rotation_6d_to_matrix(d6: torch.Tensor) -> torch.Tensor:
    """The first two rows, Gram-Schmidt orthonormalised; the third is their cross product."""
    a1, a2 = d6[..., :3], d6[..., 3:]
    b1 = F.normalize(a1, dim=-1)
    b2 = F.normalize(a2 - (b1 * a2).sum(-1, keepdim=True) * b1, dim=-1)
    return torch.stack([b1, b2, torch.cross(b1, b2, dim=-1)], -2)


def matrix_to_rotation_6d(matrix: torch.Tensor) -> torch.Tensor:
    return matrix[..., :2, :].clone().reshape(matrix.shape[:-2] + (6,))


# ----------------------------------------------------------------------------------------------- Transform3d
def _batch(matrix: torch.Tensor) -> torch.Tensor:
    return matrix[None] if matrix.dim() == 2 else matrix


class Transform3d:
    """A batch of 4x4 row-vector transforms (``p' = p M``); chains apply left to right."""

    def __init__(self, dtype: torch.dtype = torch.float32, device="cpu", matrix: Optional[torch.Tensor] = None):
        if matrix is None:
            matrix = torch.eye(4, dtype=dtype, device=device)[None]
        self._matrix = _batch(matrix)
        self.device, self.dtype = self._matrix.device, self._matrix.dtype

    def __len__(self) -> int:
        return self._matrix.shape[0]

    def get_matrix(self) -> torch.Tensor:
        return self._matrix

    def compose(self, *others: "Transform3d") -> "Transform3d":
        m = self._matrix
        for other in others:
            m = m @ other.get_matrix().to(m)  # broadcasts a batch of 1 against N
        return Transform3d(matrix=m)

    def inverse(self, invert_composed: bool = False) -> "Transform3d":
        return Transform3d(matrix=torch.linalg.inv(self._matrix))

    def transform_points(self, points: torch.Tensor, eps: Optional[float] = None) -> torch.Tensor:
        squeeze = points.dim() == 2
        p = points[None] if squeeze else points
        out = torch.cat([p, torch.ones_like(p[..., :1])], -1) @ self._matrix.to(p)
        denom = out[..., 3:]
        if eps is not None:
            denom = torch.where(denom.abs() < eps, torch.where(denom < 0, -eps, eps) * torch.ones_like(denom), denom)
        out = out[..., :3] / denom
        return out[0] if squeeze and out.shape[0] == 1 else out

    def transform_normals(self, normals: torch.Tensor) -> torch.Tensor:
        squeeze = normals.dim() == 2
        n = normals[None] if squeeze else normals
        out = n @ torch.linalg.inv(self._matrix).transpose(1, 2)[:, :3, :3].to(n)
        return out[0] if squeeze and out.shape[0] == 1 else out

    def translate(self, *args, **kwargs) -> "Transform3d":
        return self.compose(Translate(*args, dtype=self.dtype, device=self.device, **kwargs))

    def scale(self, *args, **kwargs) -> "Transform3d":
        return self.compose(Scale(*args, dtype=self.dtype, device=self.device, **kwargs))

    def rotate(self, *args, **kwargs) -> "Transform3d":
        return self.compose(Rotate(*args, dtype=self.dtype, device=self.device, **kwargs))

    def to(self, device=None, copy: bool = False, dtype: Optional[torch.dtype] = None) -> "Transform3d":
        return Transform3d(matrix=self._matrix.to(device=device, dtype=dtype))

    def cpu(self) -> "Transform3d":
        return self.to("cpu")

    def clone(self) -> "Transform3d":
        return Transform3d(matrix=self._matrix.clone())

    def __getitem__(self, index) -> "Transform3d":
        if isinstance(index, int):
            index = [index]
        return Transform3d(matrix=self._matrix[index])


def _xyz(x, y, z, dtype, device) -> torch.Tensor:
    """(x, y, z) scalars or tensors, or an [N, 3] tensor as ``x`` -> [N, 3]."""
    if torch.is_tensor(x) and x.dim() == 2 and y is None and z is None:
        return x.to(dtype=dtype if not x.is_floating_point() else x.dtype)
    parts = [torch.as_tensor(v, dtype=dtype, device=device).reshape(-1) for v in (x, y, z)]
    return torch.stack(torch.broadcast_tensors(*parts), -1)


class Translate(Transform3d):
    def __init__(self, x, y=None, z=None, dtype: torch.dtype = torch.float32, device="cpu"):
        t = _xyz(x, y, z, dtype, device)
        m = torch.eye(4, dtype=t.dtype, device=t.device).repeat(t.shape[0], 1, 1)
        m[:, 3, :3] = t
        super().__init__(matrix=m)


class Scale(Transform3d):
    def __init__(self, x, y=None, z=None, dtype: torch.dtype = torch.float32, device="cpu"):
        if y is None and z is None and not (torch.is_tensor(x) and x.dim() == 2):
            y = z = x  # one factor for all axes
        s = _xyz(x, y, z, dtype, device)
        m = torch.eye(4, dtype=s.dtype, device=s.device).repeat(s.shape[0], 1, 1)
        m[:, [0, 1, 2], [0, 1, 2]] = s
        super().__init__(matrix=m)


class Rotate(Transform3d):
    def __init__(self, R: torch.Tensor, dtype: torch.dtype = torch.float32, device="cpu", orthogonal_tol=1e-5):
        r = _batch(torch.as_tensor(R, dtype=dtype, device=device) if not torch.is_tensor(R) else R)
        m = torch.eye(4, dtype=r.dtype, device=r.device).repeat(r.shape[0], 1, 1)
        m[:, :3, :3] = r
        super().__init__(matrix=m)


class RotateAxisAngle(Rotate):
    def __init__(self, angle, axis: str = "X", degrees: bool = True, dtype: torch.dtype = torch.float32,
                 device="cpu"):
        a = torch.as_tensor(angle, dtype=dtype, device=device).reshape(-1)
        a = a * math.pi / 180.0 if degrees else a
        # row-vector convention: the matrix is the transpose of the column-vector rotation
        super().__init__(_axis_rotation(axis.upper(), a).transpose(1, 2))


# ------------------------------------------------------------------------------------------------- cameras
def camera_position_from_spherical_angles(distance, elevation, azimuth, degrees: bool = True,
                                          device="cpu") -> torch.Tensor:
    d, e, a = (torch.as_tensor(v, dtype=torch.float32, device=device).reshape(-1)
               for v in (distance, elevation, azimuth))
    if degrees:
        e, a = e * math.pi / 180.0, a * math.pi / 180.0
    d, e, a = torch.broadcast_tensors(d, e, a)
    return torch.stack([d * torch.cos(e) * torch.sin(a), d * torch.sin(e), d * torch.cos(e) * torch.cos(a)], -1)


def look_at_rotation(camera_position, at=((0, 0, 0),), up=((0, 1, 0),), device="cpu") -> torch.Tensor:
    """World-to-view rotation (row vectors) for cameras at ``camera_position`` looking at ``at``: its columns are
    the camera's x (left), y (up) and z (forward) axes in world coordinates."""
    c, at_t, up_t = (torch.as_tensor(v, dtype=torch.float32, device=device).reshape(-1, 3)
                     for v in (camera_position, at, up))
    c, at_t, up_t = torch.broadcast_tensors(c, at_t, up_t)
    z = F.normalize(at_t - c, dim=-1, eps=1e-5)
    x = F.normalize(torch.cross(up_t, z, dim=-1), dim=-1, eps=1e-5)
    y = F.normalize(torch.cross(z, x, dim=-1), dim=-1, eps=1e-5)
    return torch.stack([x, y, z], -1)


def look_at_view_transform(dist=1.0, elev=0.0, azim=0.0, degrees: bool = True, eye=None, at=((0, 0, 0),),
                           up=((0, 1, 0),), device="cpu"):
    """(R [N, 3, 3], T [N, 3]) with ``X_view = X_world R + T``."""
    if eye is not None:
        c = torch.as_tensor(eye, dtype=torch.float32, device=device).reshape(-1, 3)
    else:
        c = camera_position_from_spherical_angles(dist, elev, azim, degrees, device) + \
            torch.as_tensor(at, dtype=torch.float32, device=device).reshape(-1, 3)
    R = look_at_rotation(c, at, up, device)
    T = -(R.transpose(1, 2) @ c[..., None])[..., 0]
    return R, T


_TRANSFORMS = dict(standardize_quaternion=standardize_quaternion, quaternion_to_matrix=quaternion_to_matrix,
                   matrix_to_quaternion=matrix_to_quaternion, axis_angle_to_quaternion=axis_angle_to_quaternion,
                   quaternion_to_axis_angle=quaternion_to_axis_angle, axis_angle_to_matrix=axis_angle_to_matrix,
                   matrix_to_axis_angle=matrix_to_axis_angle, quaternion_raw_multiply=quaternion_raw_multiply,
                   quaternion_multiply=quaternion_multiply, quaternion_invert=quaternion_invert,
                   quaternion_apply=quaternion_apply, euler_angles_to_matrix=euler_angles_to_matrix,
                   rotation_6d_to_matrix=rotation_6d_to_matrix, matrix_to_rotation_6d=matrix_to_rotation_6d,
                   Transform3d=Transform3d, Translate=Translate, Scale=Scale, Rotate=Rotate,
                   RotateAxisAngle=RotateAxisAngle)
_CAMERAS = dict(look_at_rotation=look_at_rotation, look_at_view_transform=look_at_view_transform,
                camera_position_from_spherical_angles=camera_position_from_spherical_angles)
