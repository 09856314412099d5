"""Pinhole cameras for the preview renderer.

Convention (OpenCV): camera x right, y down, z forward; pixel (column j, row i) covers [j, j+1) x [i, i+1), so
its centre is (j + 0.5, i + 0.5) and ``cx = width / 2`` is the middle of the image. ``world_to_camera`` is a
4x4 rigid transform applied to column vectors: p_cam = R @ p_world + t.

SAM 3D's poses live in the PyTorch3D camera frame (x left, y up, z forward): :func:`pytorch3d_to_opencv`
converts points between the two (negate x and y).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

Vec3 = Union[Sequence[float], torch.Tensor]

__all__ = ["Camera", "look_at", "orbit_camera", "intrinsics_from_fov", "pytorch3d_to_opencv",
           "focal_from_pointmap"]


@dataclass
class Camera:
    """Intrinsics in pixels plus a world-to-camera transform."""

    world_to_camera: torch.Tensor  # [4, 4]
    fx: float
    fy: float
    cx: float
    cy: float
    width: int
    height: int

    @property
    def rotation(self) -> torch.Tensor:
        return self.world_to_camera[:3, :3]

    @property
    def translation(self) -> torch.Tensor:
        return self.world_to_camera[:3, 3]

    @property
    def position(self) -> torch.Tensor:
        """Camera centre in world coordinates (-R^T t)."""
        return -self.rotation.T @ self.translation

    def project(self, points: torch.Tensor) -> torch.Tensor:
        """World points [N, 3] -> pixel coordinates [N, 2] (continuous, see the module docstring)."""
        cam = points @ self.rotation.T.to(points) + self.translation.to(points)
        return torch.stack([self.fx * cam[:, 0] / cam[:, 2] + self.cx,
                            self.fy * cam[:, 1] / cam[:, 2] + self.cy], dim=-1)


def intrinsics_from_fov(fov_deg: float, width: int, height: int):
    """(fx, fy, cx, cy) for a horizontal field of view in degrees and square pixels."""
    if not 0.0 < fov_deg < 180.0:
        raise ValueError(f"fov_deg must be in (0, 180), got {fov_deg}")
    fx = 0.5 * width / math.tan(math.radians(fov_deg) / 2)
    return fx, fx, width / 2.0, height / 2.0


def _as_vec(v: Vec3, dtype=torch.float32) -> torch.Tensor:
    return torch.as_tensor(v, dtype=dtype).reshape(3)


def look_at(eye: Vec3, target: Vec3 = (0.0, 0.0, 0.0), up: Vec3 = (0.0, 0.0, 1.0)) -> torch.Tensor:
    """World-to-camera [4, 4] for a camera at ``eye`` looking at ``target``; ``up`` points up in the image."""
    eye, target, up = _as_vec(eye, torch.float64), _as_vec(target, torch.float64), _as_vec(up, torch.float64)
    forward = target - eye
    if forward.norm() < 1e-12:
        raise ValueError("look_at: eye and target coincide")
    forward = forward / forward.norm()
    right = torch.linalg.cross(forward, up)
    if right.norm() < 1e-9:
        raise ValueError("look_at: the up vector is parallel to the viewing direction; pick another up")
    right = right / right.norm()
    down = torch.linalg.cross(forward, right)  # image y grows downwards
    rot = torch.stack([right, down, forward])  # rows: camera axes in world coordinates
    w2c = torch.eye(4, dtype=torch.float64)
    w2c[:3, :3] = rot
    w2c[:3, 3] = -rot @ eye
    return w2c.float()


def orbit_camera(yaw_deg: float, pitch_deg: float, radius: float, fov_deg: float = 40.0,
                 width: int = 512, height: Optional[int] = None, target: Vec3 = (0.0, 0.0, 0.0),
                 up: str = "z") -> Camera:
    """Camera on a sphere around ``target``: yaw about the up axis, pitch above the horizontal plane.

    ``up="z"`` (object frame of the decoders, z up): yaw 0 looks along +y. ``up="y"``: yaw 0 looks along +z.
    """
    height = width if height is None else height
    yaw, pitch = math.radians(yaw_deg), math.radians(pitch_deg)
    horizontal = (math.sin(yaw) * math.cos(pitch), -math.cos(yaw) * math.cos(pitch))
    vertical = math.sin(pitch)
    if up == "z":
        offset, up_vec = (horizontal[0], horizontal[1], vertical), (0.0, 0.0, 1.0)
    elif up == "y":
        offset, up_vec = (horizontal[0], vertical, horizontal[1]), (0.0, 1.0, 0.0)
    else:
        raise ValueError(f"up must be 'z' or 'y', got {up!r}")
    target_t = _as_vec(target)
    eye = target_t + radius * torch.tensor(offset)
    fx, fy, cx, cy = intrinsics_from_fov(fov_deg, width, height)
    return Camera(look_at(eye, target_t, up_vec), fx, fy, cx, cy, width, height)


def pytorch3d_to_opencv(points: torch.Tensor) -> torch.Tensor:
    """PyTorch3D camera frame (x left, y up, z forward) -> OpenCV (x right, y down, z forward); its own inverse."""
    return points * torch.tensor([-1.0, -1.0, 1.0], dtype=points.dtype, device=points.device)


def focal_from_pointmap(pointmap: torch.Tensor, frame: str = "pytorch3d") -> float:
    """Least-squares focal length in pixels of a point map [H, W, 3] (NaN = unknown) taken by a centred pinhole
    camera: u - cx = f * x / z over all finite points with z > 0."""
    # a host-side fit returning a float: float64 on the CPU (MPS has no float64), whatever the point map's device
    pm = torch.as_tensor(pointmap).detach().to(device="cpu", dtype=torch.float64)
    if pm.dim() != 3 or pm.shape[-1] != 3:
        raise ValueError(f"pointmap must be [H, W, 3], got {tuple(pm.shape)}")
    if frame == "pytorch3d":
        pm = pytorch3d_to_opencv(pm)
    elif frame != "opencv":
        raise ValueError(f"frame must be 'pytorch3d' or 'opencv', got {frame!r}")
    height, width = pm.shape[:2]
    v, u = torch.meshgrid(torch.arange(height, dtype=torch.float64) + 0.5,
                          torch.arange(width, dtype=torch.float64) + 0.5, indexing="ij")
    ok = torch.isfinite(pm).all(-1) & (pm[..., 2] > 1e-6)
    if int(ok.sum()) < 2:
        raise ValueError("the point map has fewer than two finite points in front of the camera")
    x = torch.cat([pm[..., 0][ok] / pm[..., 2][ok], pm[..., 1][ok] / pm[..., 2][ok]])
    d = torch.cat([u[ok] - width / 2.0, v[ok] - height / 2.0])
    return float((x * d).sum() / (x * x).sum().clamp_min(1e-12))
