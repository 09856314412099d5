"""Invertible remappings of point-map coordinates (..., 3) applied before embedding: compress far depths."""
import torch
import torch.nn as nn


class PointRemapper(nn.Module):
    VALID_TYPES = ["linear", "sinh", "exp", "sinh_exp", "exp_disparity"]

    def __init__(self, remap_type: str = "exp"):
        super().__init__()
        if remap_type not in self.VALID_TYPES:
            raise ValueError(f"unknown remap_type {remap_type!r}: use one of {self.VALID_TYPES}")
        self.remap_type = remap_type

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        xy, z = points[..., :2], points[..., 2:3]
        kind = self.remap_type
        if kind == "linear":
            return points
        if kind == "sinh":
            return torch.asinh(points)
        if kind == "exp":
            return torch.cat([xy / (1 + z), torch.log1p(z)], dim=-1)
        if kind == "exp_disparity":
            return torch.cat([xy / z, torch.log(z)], dim=-1)
        return torch.cat([torch.asinh(xy), torch.log(torch.clamp(z, min=1e-8))], dim=-1)  # sinh_exp

    def inverse(self, points: torch.Tensor) -> torch.Tensor:
        xy, z = points[..., :2], points[..., 2:3]
        kind = self.remap_type
        if kind == "linear":
            return points
        if kind == "sinh":
            return torch.sinh(points)
        if kind == "exp":
            z = torch.expm1(z)
            return torch.cat([xy * (1 + z), z], dim=-1)
        if kind == "exp_disparity":
            z = torch.exp(z)
            return torch.cat([xy * z, z], dim=-1)
        return torch.cat([torch.sinh(xy), torch.exp(z)], dim=-1)  # sinh_exp

    def extra_repr(self) -> str:
        return f"remap_type='{self.remap_type}'"
