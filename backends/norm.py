"""Group and layer normalisation as a registry family (``NORM_BACKEND``, ``backends.use(norm=...)``).

``native`` (``F.group_norm`` / ``F.layer_norm``) is what ``auto`` picks everywhere. ``reference`` re-states the
CPU float32 rounding of PyTorch 2.5.1, the kernel that recorded upstream's parity data (see ``norm_reference.py``);
it is a reference backend: only used when named.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .norm_reference import reference_group_norm, reference_layer_norm
from .registry import Family, register, resolve

NORM_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _check_group_norm(x: torch.Tensor, num_groups: int) -> None:
    if x.dim() < 2:
        raise ValueError(f"group_norm expects [N, C, *] input, got shape {tuple(x.shape)}")
    if x.shape[1] % num_groups:
        raise ValueError(f"{x.shape[1]} channels cannot be split into {num_groups} groups")


def group_norm(x: torch.Tensor, num_groups: int, weight: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None, eps: float = 1e-5) -> torch.Tensor:
    """``F.group_norm`` for x [N, C, *] through the selected norm backend."""
    _check_group_norm(x, num_groups)
    return resolve(Family.NORM, x.device, x.dtype).fn(x, num_groups, weight, bias, eps)


def layer_norm(x: torch.Tensor, normalized_shape, weight: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None, eps: float = 1e-5) -> torch.Tensor:
    """``F.layer_norm`` over the last dimensions through the selected norm backend."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    return resolve(Family.NORM, x.device, x.dtype).extra["layer_norm"](x, shape, weight, bias, eps)


def native_layer_norm(x, shape, weight, bias, eps):
    return F.layer_norm(x, shape, weight, bias, eps)


@register(Family.NORM, "native", devices=("cpu", "mps", "cuda"), dtypes=NORM_DTYPES, priority=10,
          layer_norm=native_layer_norm)
def native_group_norm(x, num_groups, weight, bias, eps):
    return F.group_norm(x, num_groups, weight, bias, eps)


register(Family.NORM, "reference", devices=("cpu", "mps", "cuda"), dtypes=NORM_DTYPES, reference=True,
         layer_norm=reference_layer_norm)(reference_group_norm)
