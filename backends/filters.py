"""Image filters used by the data transforms (training-time augmentations and preprocessing helpers).

Kept here, not in the data modules, because a blur is a convolution: all op arithmetic lives in ``backends``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def gaussian_kernel1d(kernel_size: int, sigma: float, dtype: torch.dtype = torch.float32,
                      device: Optional[torch.device] = None) -> torch.Tensor:
    """Normalised 1D Gaussian weights at the ``kernel_size`` integer offsets around 0 (torchvision's kernel)."""
    half = (kernel_size - 1) * 0.5
    x = torch.linspace(-half, half, kernel_size, dtype=dtype, device=device)
    k = torch.exp(-0.5 * (x / sigma) ** 2)
    return k / k.sum()


def gaussian_blur2d(img: torch.Tensor, kernel_size: int, sigma: float, padding_mode: str = "reflect") -> torch.Tensor:
    """Separable Gaussian blur of a [..., C, H, W] image (two depthwise 1D convolutions), borders padded with
    ``padding_mode`` ("reflect" as torchvision, "replicate", "constant"); same shape and dtype out."""
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"kernel_size must be a positive odd number, got {kernel_size}")
    lead, (c, h, w) = img.shape[:-3], img.shape[-3:]
    x = img.reshape(-1, c, h, w).float()
    k = gaussian_kernel1d(kernel_size, sigma, dtype=torch.float32, device=x.device)
    half = kernel_size // 2
    x = F.pad(x, (half, half, half, half), mode=padding_mode)
    x = F.conv2d(x, k.view(1, 1, 1, -1).expand(c, 1, 1, kernel_size), groups=c)
    x = F.conv2d(x, k.view(1, 1, -1, 1).expand(c, 1, kernel_size, 1), groups=c)
    return x.reshape(*lead, c, h, w).to(img.dtype)
