"""Gaussian-splat maths: inverse sigmoid, quaternion -> rotation, covariance upper triangles."""
import torch

__all__ = ["inverse_sigmoid", "build_rotation", "build_scaling_rotation", "strip_lowerdiag", "strip_symmetric"]


def inverse_sigmoid(x: torch.Tensor) -> torch.Tensor:
    return torch.log(x / (1 - x))


def build_rotation(r: torch.Tensor) -> torch.Tensor:
    """[N, 4] quaternions (w, x, y, z), normalised here -> [N, 3, 3] rotation matrices."""
    q = r / torch.linalg.vector_norm(r, dim=1, keepdim=True)
    w, x, y, z = q.unbind(dim=1)
    rows = [
        1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y),
        2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x),
        2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y),
    ]
    return torch.stack(rows, dim=1).reshape(-1, 3, 3)


def build_scaling_rotation(s: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """L = R(r) @ diag(s), [N, 3, 3]."""
    return build_rotation(r) * s[:, None, :]


def strip_lowerdiag(L: torch.Tensor) -> torch.Tensor:
    """Upper triangle (xx, xy, xz, yy, yz, zz) of [N, 3, 3] symmetric matrices -> [N, 6]."""
    return torch.stack([L[:, 0, 0], L[:, 0, 1], L[:, 0, 2], L[:, 1, 1], L[:, 1, 2], L[:, 2, 2]], dim=1)


def strip_symmetric(sym: torch.Tensor) -> torch.Tensor:
    return strip_lowerdiag(sym)
