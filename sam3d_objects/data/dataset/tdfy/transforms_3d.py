"""Upstream's ``transforms_3d``: similarity transforms in PyTorch3D's row-vector convention (p' = p M, translation
in the last row), built from / split into (scale, rotation, translation).

``compose_transform`` returns PyTorch3D's ``Transform3d`` when PyTorch3D is installed, else :class:`RowTransform`,
a small stand-in with the methods the pose code uses (``get_matrix``, ``transform_points``, ``compose``)."""
from __future__ import annotations

import math
from collections import namedtuple
from typing import Union

import torch

__all__ = ["DecomposedTransform", "compose_transform", "decompose_transform", "get_rotation_about_x_axis",
           "RowTransform"]

DecomposedTransform = namedtuple("DecomposedTransform", ["scale", "rotation", "translation"])


class RowTransform:
    """Batched 4x4 matrices [N, 4, 4] applied to row vectors: p' = [p, 1] M."""

    def __init__(self, matrix: torch.Tensor) -> None:
        self._matrix = matrix if matrix.dim() == 3 else matrix[None]

    def get_matrix(self) -> torch.Tensor:
        return self._matrix

    def compose(self, *others: "RowTransform") -> "RowTransform":
        """This transform, then each of ``others`` (matrix product left to right)."""
        m = self._matrix
        for other in others:
            m = m @ other.get_matrix()
        return RowTransform(m)

    def transform_points(self, points: torch.Tensor) -> torch.Tensor:
        """points [N, P, 3] or [P, 3]."""
        m = self._matrix
        homo = torch.cat([points, torch.ones_like(points[..., :1])], dim=-1)
        out = homo @ (m if points.dim() == 3 else m[0])
        return out[..., :3] / out[..., 3:]


def _similarity_matrix(scale: torch.Tensor, rotation: torch.Tensor, translation: torch.Tensor) -> torch.Tensor:
    scale = scale.reshape(-1, 3)
    rotation = rotation.reshape(-1, 3, 3)
    translation = translation.reshape(-1, 3)
    n = max(scale.shape[0], rotation.shape[0], translation.shape[0])
    m = torch.zeros(n, 4, 4, dtype=scale.dtype, device=scale.device)
    m[:, :3, :3] = scale[:, :, None] * rotation.to(scale)  # diag(s) R: scale first, then rotate (row vectors)
    m[:, 3, :3] = translation.to(scale)
    m[:, 3, 3] = 1
    return m


def compose_transform(scale: torch.Tensor, rotation: torch.Tensor, translation: torch.Tensor):
    """Scale -> rotate (right-multiplied ``rotation``) -> translate: p' = (p * s) R + t."""
    matrix = _similarity_matrix(scale, rotation, translation)
    try:
        from pytorch3d.transforms import Transform3d
    except ImportError:
        return RowTransform(matrix)
    return Transform3d(matrix=matrix, dtype=matrix.dtype, device=matrix.device)


def decompose_transform(transform) -> DecomposedTransform:
    """(scale = row norms of the 3x3 block, rotation = the block with unit rows, translation = last row);
    valid for positive scales."""
    m = transform.get_matrix()
    block = m[:, :3, :3]
    scale = block.norm(dim=-1)
    return DecomposedTransform(scale, block / scale[..., None], m[:, 3, :3])


def get_rotation_about_x_axis(angle: float = math.pi / 2, device: Union[str, torch.device] = "cpu") -> torch.Tensor:
    """Quaternion (w, x, y, z) of a rotation by ``angle`` about +x."""
    return torch.tensor([math.cos(angle / 2), math.sin(angle / 2), 0.0, 0.0], device=device)
