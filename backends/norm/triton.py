"""Triton kernels for the element-wise steps of a DiT block (norm backend ``"triton"``, CUDA).

A modulated block does, per token, LayerNorm -> ``* (1 + scale) + shift`` -> cast for the matmul, a per-head RMS
norm of q and k, and ``x + h * gate`` after attention and MLP. Eagerly that is about thirty memory-bound kernels a
block (each reading and writing every token, plus per-voxel copies of the per-batch modulation in the sparse
model); here it is five. Each kernel keeps the eager ops' rounding points (the LayerNorm result rounded to the
stream's dtype, ``1 + scale`` in the modulation's dtype, ``h * gate`` in its promoted dtype), so results match the
``native`` backend to the last bit or so (reduction order inside the norms differs).

``linear_gelu`` (the MLP's first layer and its tanh-GELU) is cuBLASLt's matmul with the GELU epilogue, not a
Triton kernel: it saves the separate pass over the MLP's 4x-wide hidden layer. Group norm and plain layer norm are
the native functions. The kernels also run in Triton's interpreter on CPU
tensors, which is how tests check them without a GPU (tests/test_triton_norm.py).
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import triton_jit
from ..device import matmul_input_dtype
from ..registry import Family, register
from .native import NATIVE_OPS, NORM_DTYPES, native_group_norm, native_linear_gelu

try:  # the module must import without triton (the backend then reports why it is unavailable)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

DTYPES = tuple(d for d in NORM_DTYPES if d != torch.float64)


def _tl_dtype(dtype: torch.dtype):
    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]


def _modulated_ln_kernel(x_ptr, out_ptr, w_ptr, b_ptr, shift_ptr, scale_ptr, bidx_ptr,
                         C, rows_per_batch, x_stride, bidx_stride, eps,
                         HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_SHIFT: tl.constexpr,
                         HAS_SCALE: tl.constexpr, HAS_BIDX: tl.constexpr, PER_BATCH: tl.constexpr,
                         X_DTYPE: tl.constexpr, SCALE_DTYPE: tl.constexpr, MUL_DTYPE: tl.constexpr,
                         ADD_DTYPE: tl.constexpr, BLOCK_C: tl.constexpr):
    """One row: float32 LayerNorm (two passes over registers) rounded to X_DTYPE, times (1 + scale) rounded in
    SCALE_DTYPE, product rounded to MUL_DTYPE, plus shift rounded to ADD_DTYPE, stored in out's dtype."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    ok = cols < C
    x = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0).to(tl.float32)
    # tl.reduce with the sum combiner is tl.sum without its @jit wrapper, which Triton's interpreter cannot call
    mean = tl.reduce(x, 0, tl.standard._sum_combine) / C
    centred = tl.where(ok, x - mean, 0.0)
    var = tl.reduce(centred * centred, 0, tl.standard._sum_combine) / C
    h = centred * (1.0 / tl.sqrt(var + eps))
    if HAS_W:
        h = h * tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_B:
        h = h + tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    h = h.to(X_DTYPE).to(tl.float32)
    if PER_BATCH:
        if HAS_BIDX:
            batch = tl.load(bidx_ptr + row * bidx_stride).to(tl.int64)
        else:
            batch = row // rows_per_batch
        mod_row = batch * C
    else:
        mod_row = 0
    if HAS_SCALE:
        scale = tl.load(scale_ptr + mod_row + cols, mask=ok, other=0.0).to(tl.float32)
        h = (h * (1.0 + scale).to(SCALE_DTYPE).to(tl.float32)).to(MUL_DTYPE).to(tl.float32)
    if HAS_SHIFT:
        h = (h + tl.load(shift_ptr + mod_row + cols, mask=ok, other=0.0).to(tl.float32)).to(ADD_DTYPE)
    tl.store(out_ptr + row * C + cols, h.to(out_ptr.dtype.element_ty), mask=ok)


def _gated_residual_kernel(x_ptr, h_ptr, gate_ptr, bidx_ptr, out_ptr, N, C, rows_per_batch, bidx_stride,
                           HAS_BIDX: tl.constexpr, PER_BATCH: tl.constexpr, PROD_DTYPE: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """out = x + (h * gate[batch]) with the product rounded to PROD_DTYPE, for a BLOCK_R x BLOCK_C tile."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (rows < N)[:, None] & (cols < C)[None, :]
    at = rows[:, None] * C + cols[None, :]
    if PER_BATCH:
        if HAS_BIDX:
            batch = tl.load(bidx_ptr + rows * bidx_stride, mask=rows < N, other=0).to(tl.int64)
        else:
            batch = rows // rows_per_batch
        gate_at = batch[:, None] * C + cols[None, :]
    else:
        gate_at = cols[None, :] + rows[:, None] * 0
    gate = tl.load(gate_ptr + gate_at, mask=ok, other=0.0).to(tl.float32)
    h = tl.load(h_ptr + at, mask=ok, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + at, mask=ok, other=0.0).to(tl.float32)
    prod = (h * gate).to(PROD_DTYPE).to(tl.float32)
    tl.store(out_ptr + at, (x + prod).to(out_ptr.dtype.element_ty), mask=ok)


def _head_rms_kernel(x_ptr, gamma_ptr, out_ptr, H, D, row_stride, head_stride, scale,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One token: every head's vector divided by max(its L2 norm, 1e-12) (F.normalize), times gamma and scale."""
    row = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    ok = (heads < H)[:, None] & (dims < D)[None, :]
    x = tl.load(x_ptr + row * row_stride + heads[:, None] * head_stride + dims[None, :], mask=ok,
                other=0.0).to(tl.float32)
    norm = tl.sqrt(tl.reduce(x * x, 1, tl.standard._sum_combine))
    y = x / tl.maximum(norm, 1e-12)[:, None]
    gamma = tl.load(gamma_ptr + heads[:, None] * D + dims[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * H * D + heads[:, None] * D + dims[None, :],
             (y * gamma * scale).to(out_ptr.dtype.element_ty), mask=ok)


# Row counts change with every object; Triton would otherwise compile a kernel per divisibility class of them.
_UNSPECIALIZED = {"_modulated_ln_kernel": ["rows_per_batch"], "_gated_residual_kernel": ["N", "rows_per_batch"],
                  "_head_rms_kernel": []}


def _kernel(fn, interpret: bool):
    return triton_jit.kernel(fn, interpret, do_not_specialize=_UNSPECIALIZED[fn.__name__])


def _launch_options(interpret: bool, warps: int) -> dict:
    return {} if interpret else {"num_warps": warps}


def _batching(x: torch.Tensor, batch_index: Optional[torch.Tensor], *per_batch: Optional[torch.Tensor]):
    """(PER_BATCH, rows per batch element, batch index or a dummy, its stride) for the kernels' row -> batch
    element lookup: [B, L, C] tokens map row r to r // L, [N, C] rows read ``batch_index``; a single [1, C] / [C]
    operand needs no lookup."""
    multi = any(t is not None and t.dim() == 2 and t.shape[0] > 1 for t in per_batch)
    if not multi:
        return False, 1, None, 0
    if x.dim() == 3:
        return True, x.shape[1], None, 0
    return True, 1, batch_index, batch_index.stride(0)


def _flat_rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, C] with unit stride along C (a view when possible)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def triton_modulated_layer_norm(x, shift, scale, weight, bias, eps, batch_index):
    interpret = x.device.type == "cpu"
    width = x.shape[-1]
    rows = _flat_rows(x)
    mul_dtype = torch.promote_types(x.dtype, scale.dtype) if scale is not None else x.dtype
    add_dtype = torch.promote_types(mul_dtype, shift.dtype) if shift is not None else mul_dtype
    out = torch.empty(x.shape, dtype=matmul_input_dtype(add_dtype, x.device), device=x.device)
    if rows.shape[0] == 0:
        return out
    per_batch, rows_per_batch, bidx, bidx_stride = _batching(x, batch_index, shift, scale)
    dummy = rows
    block = triton.next_power_of_2(width)
    _kernel(_modulated_ln_kernel, interpret)[(rows.shape[0],)](
        rows, out, weight if weight is not None else dummy, bias if bias is not None else dummy,
        shift.contiguous() if shift is not None else dummy, scale.contiguous() if scale is not None else dummy,
        bidx if bidx is not None else dummy, width, rows_per_batch, rows.stride(0), bidx_stride, eps,
        HAS_W=weight is not None, HAS_B=bias is not None, HAS_SHIFT=shift is not None, HAS_SCALE=scale is not None,
        HAS_BIDX=bidx is not None, PER_BATCH=per_batch, X_DTYPE=_tl_dtype(x.dtype),
        SCALE_DTYPE=_tl_dtype(scale.dtype if scale is not None else x.dtype), MUL_DTYPE=_tl_dtype(mul_dtype),
        ADD_DTYPE=_tl_dtype(add_dtype), BLOCK_C=block, **_launch_options(interpret, 4 if block <= 1024 else 8))
    return out


def triton_gated_residual(x, h, gate, batch_index):
    interpret = x.device.type == "cpu"
    width = x.shape[-1]
    prod_dtype = torch.promote_types(h.dtype, gate.dtype)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, prod_dtype), device=x.device)
    n = x.numel() // max(width, 1)
    if n == 0:
        return out
    per_batch, rows_per_batch, bidx, bidx_stride = _batching(x, batch_index, gate)
    block_c = min(triton.next_power_of_2(width), 256)
    block_r = 16 if not interpret else 4
    grid = (triton.cdiv(n, block_r), triton.cdiv(width, block_c))
    _kernel(_gated_residual_kernel, interpret)[grid](
        x.contiguous(), h.contiguous(), gate.contiguous(), bidx if bidx is not None else gate, out, n, width,
        rows_per_batch, bidx_stride, HAS_BIDX=bidx is not None, PER_BATCH=per_batch,
        PROD_DTYPE=_tl_dtype(prod_dtype), BLOCK_R=block_r, BLOCK_C=block_c, **_launch_options(interpret, 4))
    return out


def triton_head_rms_norm(x, gamma, scale):
    interpret = x.device.type == "cpu"
    heads, dim = x.shape[-2], x.shape[-1]
    flat = x.reshape(-1, heads, dim)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if flat.shape[0] == 0:
        return out
    _kernel(_head_rms_kernel, interpret)[(flat.shape[0],)](
        flat, gamma.contiguous(), out, heads, dim, flat.stride(0), flat.stride(1), float(scale),
        BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(dim),
        **_launch_options(interpret, 4))
    return out


def epilogue_linear_gelu(x, weight, bias):
    """cuBLASLt's matmul with the bias + tanh-GELU epilogue (``torch._addmm_activation``), in the dtype autocast
    would run ``F.linear`` in; GELU is applied to the float32 accumulator before the one rounding."""
    if bias is None or x.numel() == 0 or x.device.type != "cuda":
        return native_linear_gelu(x, weight, bias)
    dtype = matmul_input_dtype(torch.promote_types(x.dtype, weight.dtype), x.device)
    rows = x.reshape(-1, x.shape[-1]).to(dtype)
    with torch.autocast("cuda", enabled=False):  # the operands are already in the dtype autocast would pick
        out = torch._addmm_activation(bias.to(dtype), rows, weight.to(dtype).t(), use_gelu=True)
    return out.reshape(*x.shape[:-1], weight.shape[0])


TRITON_OPS = dict(NATIVE_OPS, modulated_layer_norm=triton_modulated_layer_norm,
                  gated_residual=triton_gated_residual, head_rms_norm=triton_head_rms_norm,
                  linear_gelu=epilogue_linear_gelu)

# Above native (10): auto picks it on CUDA wherever triton imports.
register(Family.NORM, "triton", devices=("cuda",), dtypes=DTYPES, requires=("triton",),
         probe=triton_jit.cuda_probe(triton), priority=20, **TRITON_OPS)(native_group_norm)
