"""Space-filling-curve codes of non-negative integer 3D coordinates (what serialised sparse attention sorts by).

Both codes read the bits of the three axes from the most significant level down, axis 0's bit first in each
triple (code = ... a0_k a1_k a2_k ... a0_0 a1_0 a2_0), over ``bits`` bits per axis:

- :func:`z_order_encode`: the Morton code of the coordinates themselves.
- :func:`hilbert_encode`: the Hilbert index of J. Skilling's construction ("Programming the Hilbert curve",
  AIP Conf. Proc. 707, 2004): the coordinates are turned into the curve's "transposed" form (undoing the
  excess rotations level by level, then Gray decoding), whose bit interleaving is the index. Consecutive indices
  are face-adjacent voxels; index 0 is the origin; every aligned cube of side 2^k is visited in one run.

Vectorised over the points with int64 tensors on their device.
"""
from __future__ import annotations

from typing import List

import torch

__all__ = ["z_order_encode", "hilbert_encode"]


def _interleave(axes: List[torch.Tensor], bits: int) -> torch.Tensor:
    code = torch.zeros_like(axes[0])
    for level in range(bits - 1, -1, -1):
        for a in axes:
            code = (code << 1) | ((a >> level) & 1)
    return code


def z_order_encode(xyz: torch.Tensor, bits: int) -> torch.Tensor:
    """Morton codes [N] (int64) of integer coordinates [N, 3]."""
    return _interleave([xyz[:, i].long() for i in range(3)], bits)


def hilbert_encode(xyz: torch.Tensor, bits: int) -> torch.Tensor:
    """Hilbert indices [N] (int64) of integer coordinates [N, 3] (see the module docstring)."""
    x = [xyz[:, i].long().clone() for i in range(3)]
    q = 1 << (bits - 1)
    while q > 1:  # from the top level down: invert axis 0's low bits, or exchange them with axis i's
        low = q - 1
        for i in range(3):
            on = (x[i] & q) != 0
            swap = (x[0] ^ x[i]) & low
            x0 = torch.where(on, x[0] ^ low, x[0] ^ swap)
            if i:
                x[i] = torch.where(on, x[i], x[i] ^ swap)
            x[0] = x0
        q >>= 1
    for i in range(1, 3):  # Gray decode across the axes
        x[i] = x[i] ^ x[i - 1]
    flip = torch.zeros_like(x[0])
    q = 1 << (bits - 1)
    while q > 1:
        flip = torch.where((x[2] & q) != 0, flip ^ (q - 1), flip)
        q >>= 1
    return _interleave([v ^ flip for v in x], bits)
