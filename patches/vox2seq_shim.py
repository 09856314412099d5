"""``vox2seq`` stand-in: space-filling-curve codes of integer voxel coordinates (``encode``), in PyTorch.

Why: vox2seq is a CUDA extension; serialised sparse attention calls ``vox2seq.encode(coords, mode=..., permute=...)``
only to order voxels along a curve (it argsorts the codes). ``coords`` [N, 3] are non-negative integers below
2^10 per axis (vox2seq's 30-bit codes); ``permute`` picks which input column plays x, y and z
(``coords[:, permute]``), so ``permute=[1, 0, 2]`` is the curve with x and y swapped. Codes (int64 here, < 2^30):

- ``"z_order"``: Morton code, the bits of (x, y, z) interleaved from the most significant level down, x's bit the
  highest of each triple (code = ... x_k y_k z_k ... x_0 y_0 z_0).
- ``"hilbert"``: the 3D Hilbert index of Skilling's construction ("Programming the Hilbert curve", 2004) over 10
  bits per axis: the coordinates' transposed Hilbert form, bit-interleaved like the Morton code. Consecutive codes
  are face-adjacent voxels and code 0 is the origin.

The arithmetic is ``backends.curves``.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ._modules import drop, install_shim, make

BITS = 10  # per axis: vox2seq's codes have 30 bits


def encode(coords: torch.Tensor, permute: Sequence[int] = (0, 1, 2), mode: str = "z_order") -> torch.Tensor:
    """Curve codes [N] of ``coords`` [N, 3] (see the module docstring)."""
    from backends.curves import hilbert_encode, z_order_encode

    if coords.dim() != 2 or coords.shape[-1] != 3:
        raise ValueError(f"vox2seq.encode expects coords [N, 3], got {tuple(coords.shape)}")
    if sorted(int(p) for p in permute) != [0, 1, 2]:
        raise ValueError(f"permute must be a permutation of [0, 1, 2], got {list(permute)}")
    xyz = coords[:, [int(p) for p in permute]].long()
    if xyz.numel() and (int(xyz.min()) < 0 or int(xyz.max()) >= 1 << BITS):
        raise ValueError(f"vox2seq codes coordinates in [0, {1 << BITS}), got [{int(xyz.min())}, {int(xyz.max())}]")
    if mode == "z_order":
        return z_order_encode(xyz, BITS)
    if mode == "hilbert":
        return hilbert_encode(xyz, BITS)
    raise ValueError(f"mode must be 'z_order' or 'hilbert', got {mode!r}")


def _build():
    return [make("vox2seq", __doc__, encode=encode, __version__="0.0+sam3d-shim")]


def install(replace_installed: bool = False) -> str:
    return install_shim("vox2seq", _build, replace_installed)


def uninstall() -> None:
    drop("vox2seq", only_shims=True)
