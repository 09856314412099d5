"""Normalisation and adaLN modulation as a registry family (``NORM_BACKEND``, ``backends.use(norm=...)``).

Ops: ``group_norm``, ``layer_norm``, ``float32_layer_norm`` (``LayerNorm32``: half input normalised in float32),
and the three element-wise steps every DiT block repeats around its matmuls:
``modulated_layer_norm`` (LayerNorm in float32, then ``* (1 + scale) + shift``), ``gated_residual``
(``x + h * gate``) and ``head_rms_norm`` (the per-head RMS norm of queries and keys).

The family also holds ``linear_gelu``, the first half of the block's MLP (a tanh-GELU after a linear layer), so a
backend can compute the activation in the matmul's epilogue.

``native`` composes torch ops with the rounding steps the models always had (the eager arithmetic); ``auto``
picks it on CPU and MPS. Its ``group_norm`` of a sparse tensor's features, passed as the [1, C, L] view of their
[L, C] rows, normalises the rows as they lie on the CPU (``group_norm_voxel_major``) instead of
transposing them twice (``native.py``). ``triton`` (``triton.py``) computes the three block ops as one kernel each on CUDA,
rounding where the eager ops round, so each block reads and writes its tokens a third as often, and
``linear_gelu`` as one cuBLASLt matmul with its GELU epilogue (no separate pass over the MLP's wide hidden layer). ``reference``
re-states the CPU float32 rounding of PyTorch 2.5.1, the kernel that recorded upstream's parity data (see
``reference.py``); it is a reference backend: only used when named.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..device import accumulate_dtype
from ..registry import Family, resolve
from .native import (NATIVE_OPS, NORM_DTYPES, compose_modulated_layer_norm, cpu_fused_linear_gelu,  # noqa: F401
                     group_norm_voxel_major,
                     native_gated_residual, native_group_norm, native_head_rms_norm, native_layer_norm,
                     native_linear_gelu, per_row)
from .reference import reference_group_norm, reference_layer_norm  # noqa: F401
from . import triton  # noqa: F401  (registers the CUDA backend where triton imports)


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


def group_norm_rows_(rows: torch.Tensor, num_groups: int, weight: Optional[torch.Tensor] = None,
                     bias: Optional[torch.Tensor] = None, eps: float = 1e-5) -> torch.Tensor:
    """GroupNorm of one batch element's voxel rows [L, C] (statistics over all L rows), the values of
    ``group_norm(rows.t()[None], ...)[0].t()``, written over ``rows`` where the backend can (the native CPU path
    for float rows); elsewhere a new tensor. Half rows are normalised in float32 (statistics and arithmetic,
    rounded once to their type) on every path. Returns the normalised rows; the caller owns ``rows`` and uses
    the result (either way)."""
    x = rows.t()[None]
    _check_group_norm(x, num_groups)
    spec = resolve(Family.NORM, x.device, x.dtype)
    in_place = spec.extra.get("group_norm_rows_")
    done = in_place(rows, num_groups, weight, bias, eps) if in_place is not None else None
    if done is not None:
        return done
    if accumulate_dtype(rows.dtype) != rows.dtype:
        # a float32 copy, as the in-place path computes: half values meet float32 parameters (a decoder's
        # GroupNorm32), which CUDA's group_norm refuses in one call
        out = resolve(Family.NORM, x.device, torch.float32).fn(x.float(), num_groups, _float32(weight),
                                                                 _float32(bias), eps)
        return out[0].t().to(rows.dtype)
    return spec.fn(x, num_groups, weight, bias, eps)[0].t()


def _float32(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.float()


def layer_norm(x: torch.Tensor, normalized_shape, weight: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None, eps: float = 1e-5) -> torch.Tensor:
    """``F.layer_norm`` over the last dimensions through the selected norm backend."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    return resolve(Family.NORM, x.device, x.dtype).extra["layer_norm"](x, shape, weight, bias, eps)


def float32_layer_norm(x: torch.Tensor, normalized_shape, weight: Optional[torch.Tensor] = None,
                       bias: Optional[torch.Tensor] = None, eps: float = 1e-5) -> torch.Tensor:
    """``LayerNorm32``: ``F.layer_norm`` over the last dimensions computed in float32 whatever x's dtype, the result
    rounded to x's dtype. A backend may skip the float32 copies where its kernel computes half input in float32."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    return resolve(Family.NORM, x.device, x.dtype).extra["float32_layer_norm"](x, shape, weight, bias, eps)


def _check_per_batch(x: torch.Tensor, name: str, t: Optional[torch.Tensor],
                     batch_index: Optional[torch.Tensor]) -> None:
    """``t`` must be [B, C] against x [B, L, C], or against x [N, C] either [1, C] / [C] or, with ``batch_index``
    [N] (each row's batch element), [B, C]."""
    if t is None:
        return
    width = x.shape[-1]
    if t.shape[-1] != width or t.dim() > 2:
        raise ValueError(f"{name} must be [B, {width}] (one row per batch element), got {tuple(t.shape)}")
    if x.dim() == 3:
        if batch_index is not None:
            raise ValueError("batch_index is for [N, C] rows; [B, L, C] tokens carry their batch axis")
        if t.dim() != 2 or t.shape[0] not in (1, x.shape[0]):
            raise ValueError(f"{name} {tuple(t.shape)} does not match a batch of {x.shape[0]} ([B, L, C] tokens)")
    elif x.dim() == 2:
        if batch_index is None and t.dim() == 2 and t.shape[0] != 1:
            raise ValueError(f"{name} has {t.shape[0]} rows; pass batch_index (each row's batch element) for "
                             f"[N, C] rows of several batch elements")
        if batch_index is not None and batch_index.shape != x.shape[:1]:
            raise ValueError(f"batch_index must be [N] = [{x.shape[0]}], got {tuple(batch_index.shape)}")
    else:
        raise ValueError(f"expected [B, L, C] tokens or [N, C] rows, got shape {tuple(x.shape)}")


def modulated_layer_norm(x: torch.Tensor, shift: Optional[torch.Tensor] = None,
                         scale: Optional[torch.Tensor] = None, weight: Optional[torch.Tensor] = None,
                         bias: Optional[torch.Tensor] = None, eps: float = 1e-6,
                         batch_index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """adaLN's pre-norm: LayerNorm over the last axis computed in float32 and rounded to ``x.dtype`` (as
    ``LayerNorm32``), then ``* (1 + scale) + shift`` with torch's type promotion.

    ``x``: [B, L, C] tokens with ``shift``/``scale`` [B, C], or [N, C] rows with [1, C] (or [C]) modulation, or
    [B, C] modulation and ``batch_index`` [N] (integer batch element of each row; a strided view such as
    ``coords[:, 0]`` is fine). The result only feeds a matmul, so under autocast on ``x``'s device a float32
    result comes back in the autocast dtype: the values that matmul would have cast it to."""
    _check_per_batch(x, "shift", shift, batch_index)
    _check_per_batch(x, "scale", scale, batch_index)
    return resolve(Family.NORM, x.device, x.dtype).extra["modulated_layer_norm"](
        x, shift, scale, weight, bias, eps, batch_index)


def gated_residual(x: torch.Tensor, h: torch.Tensor, gate: torch.Tensor,
                   batch_index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """adaLN-Zero's gated residual ``x + h * gate``: ``h * gate`` is rounded to its own promoted dtype before the
    sum (as the two eager ops do). Shapes as in :func:`modulated_layer_norm` (``gate`` per batch element)."""
    if h.shape != x.shape:
        raise ValueError(f"residual branch {tuple(h.shape)} does not match the stream {tuple(x.shape)}")
    _check_per_batch(x, "gate", gate, batch_index)
    return resolve(Family.NORM, x.device, x.dtype).extra["gated_residual"](x, h, gate, batch_index)


def head_rms_norm(x: torch.Tensor, gamma: torch.Tensor, scale: float) -> torch.Tensor:
    """Per-head RMS norm of x [..., H, D]: ``normalize(x, dim=-1) * gamma * scale`` in float32 (``gamma``
    [H, D]), returned contiguous in ``x.dtype``. ``x`` may be a strided view (e.g. q out of a packed qkv)."""
    if x.dim() < 2 or tuple(gamma.shape) != tuple(x.shape[-2:]):
        raise ValueError(f"gamma {tuple(gamma.shape)} must be [heads, head_dim] of x {tuple(x.shape)}")
    return resolve(Family.NORM, x.device, x.dtype).extra["head_rms_norm"](x, gamma, scale)


def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The first half of a DiT MLP: ``gelu(linear(x, weight, bias), approximate="tanh")`` over the last axis of x
    (autocast applies as to ``F.linear``). A backend may compute the GELU in the matmul's epilogue, on the
    float32 accumulator before rounding (one rounding instead of two: at most one unit of the last place apart)."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight {tuple(weight.shape)} must be [out, {x.shape[-1]}] for x {tuple(x.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} must be [{weight.shape[0]}]")
    return resolve(Family.NORM, x.device, x.dtype).extra["linear_gelu"](x, weight, bias)


