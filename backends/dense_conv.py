"""Dense stride-1 3D convolution with the device workaround it needs.

MPS ``Conv3d`` in the default NCDHW layout returns wrong values for most channel counts (PyTorch issue
197114), so there the convolution runs as one batched 2D convolution per kernel depth offset. MPS ``conv2d``
in turn ignored the strides of non-contiguous weights up to torch 2.13 (PyTorch issue 192212: errors ~200 for exactly
this "Conv3d as Conv2d slices" use), so the depth slices of the weight are made contiguous, once per call, before
any of them reaches ``conv2d``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F


def conv3d_as_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     padding: Sequence[int]) -> torch.Tensor:
    """Stride-1 3D convolution of x [B, C, D, H, W] as 2D convolutions over depth slices (the slices go into the
    batch dimension), summed over the kernel depth. Same result as ``F.conv3d`` up to summation order."""
    pd, ph, pw = padding
    kd = weight.shape[2]
    depth_slices = weight.permute(2, 0, 1, 3, 4).contiguous()  # [kd, Cout, Cin, kh, kw]: each slice contiguous
    x = F.pad(x, (0, 0, 0, 0, pd, pd))
    b, c, d_in, h, w = x.shape
    d_out = d_in - kd + 1
    out = None
    for k in range(kd):
        slices = x[:, :, k:k + d_out].permute(0, 2, 1, 3, 4).reshape(b * d_out, c, h, w)
        y = F.conv2d(slices, depth_slices[k], None, padding=(ph, pw))
        out = y if out is None else out + y
    out = out.reshape(b, d_out, *out.shape[1:]).permute(0, 2, 1, 3, 4)
    if bias is not None:
        out = out + bias.reshape(1, -1, 1, 1, 1)
    return out.contiguous()


def needs_conv3d_workaround(device: torch.device) -> bool:
    """Whether dense Conv3d on ``device`` must run as 2D slices (MPS, see the module docstring)."""
    return torch.device(device).type == "mps"


def dense_conv3d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 padding: Sequence[int]) -> torch.Tensor:
    """Stride-1 dense 3D convolution (``F.conv3d`` semantics) that is correct on every device."""
    if needs_conv3d_workaround(x.device):
        return conv3d_as_conv2d(x, weight, bias, padding)
    return F.conv3d(x, weight, bias, stride=1, padding=tuple(padding))
