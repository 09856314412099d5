"""The ``native`` norm backend: the eager torch compositions (``auto`` on CPU and MPS), which the ``reference`` and
``triton`` backends reuse for the ops they do not replace. See ``backends.norm`` for the ops."""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from ..device import accumulate_dtype, cpu_bf16_matmul_fast, matmul_input_dtype
from ..registry import Family, register

NORM_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


# ------------------------------------------------------------------------------------------------------------------
# The eager compositions (native and reference backends); the Triton kernels reproduce their rounding steps.
# ------------------------------------------------------------------------------------------------------------------
def per_row(t: Optional[torch.Tensor], x: torch.Tensor, batch_index: Optional[torch.Tensor]):
    """A per-batch [B, C] operand broadcastable against ``x`` ([B, L, C] tokens or [N, C] rows)."""
    if t is None:
        return None
    if x.dim() == 3:
        return t.unsqueeze(1)
    return t[batch_index.long()] if batch_index is not None else t


def _records_grad(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether autograd records an op on these tensors: the fused CPU paths (no backward, or written in place)
    step aside then."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def compose_modulated_layer_norm(layer_norm_fn):
    def modulated(x, shift, scale, weight, bias, eps, batch_index):
        # float32 statistics as LayerNorm32; affine parameters follow (they may arrive in half from a .half() model)
        w, b = (None if t is None else t.float() for t in (weight, bias))
        h = layer_norm_fn(x.float(), (x.shape[-1],), w, b, eps).type(x.dtype)
        if scale is not None:
            h = h * (1 + per_row(scale, x, batch_index))
        if shift is not None:
            h = h + per_row(shift, x, batch_index)
        return h.to(matmul_input_dtype(h.dtype, x.device))
    return modulated


def _single_modulation(x, t, batch_index) -> bool:
    """Whether the per-batch operand ``t`` is one row for every token of ``x`` (one batch element)."""
    return t is None or (t.dim() == 1 or t.shape[0] == 1) and (x.dim() == 3 or batch_index is None)


def native_modulated_layer_norm(x, shift, scale, weight, bias, eps, batch_index):
    """``compose_modulated_layer_norm(F.layer_norm)``, except that one modulation row for all tokens (a batch of
    one: the sampler's calls) is folded into the LayerNorm's own affine, ``weight * (1 + scale)`` and
    ``bias * (1 + scale) + shift``: one pass over the tokens in place of three (the norm, the product, the sum;
    0.32 against 0.98 ms at stage 1's [4096, 1024] on 16 threads), the same values up to float32 rounding (one
    rounding where there were three)."""
    if (scale is None and shift is None) or not (_single_modulation(x, scale, batch_index)
                                                and _single_modulation(x, shift, batch_index)):
        return _composed_modulated_layer_norm(x, shift, scale, weight, bias, eps, batch_index)
    width = x.shape[-1]
    w = None if weight is None else weight.float()
    b = None if bias is None else bias.float()
    if scale is not None:
        gain = (1 + scale).float().reshape(width)  # 1 + scale in the modulation's dtype, as the composed op
        w = gain if w is None else w * gain
        b = None if b is None else b * gain
    if shift is not None:
        b = shift.float().reshape(width) if b is None else b + shift.float().reshape(width)
    h = F.layer_norm(x.float(), (width,), w, b, eps)
    # the composed op's dtype (x's, promoted with the modulation's), then what a matmul would cast it to
    out_dtype = torch.result_type(x, scale if scale is not None else shift)
    return h.to(matmul_input_dtype(out_dtype, x.device))


def native_gated_residual(x, h, gate, batch_index):
    return x + h * per_row(gate, x, batch_index)


def eager_head_rms_norm(x, gamma, scale):
    """The per-head RMS norm as upstream writes it (the reference backend's)."""
    return (F.normalize(x.float(), dim=-1) * gamma * scale).to(x.dtype)


def native_head_rms_norm(x, gamma, scale):
    """``eager_head_rms_norm`` on a float32 copy of x normalised in place, with ``gamma * scale`` multiplied once
    on the [H, D] weight: two passes and two [.., H, D] float32 tensors fewer (same values up to float32
    rounding)."""
    out = x.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    norm = torch.linalg.vector_norm(out, dim=-1, keepdim=True).clamp_min_(1e-12)  # F.normalize's eps
    return out.div_(norm).mul_(gamma.float() * scale).to(x.dtype)


@functools.lru_cache(maxsize=None)
def _onednn_linear_pointwise() -> bool:
    """Whether this torch has oneDNN's fused CPU linear (``torch.ops.mkldnn._linear_pointwise``, the op inductor
    emits for linear + activation) and it runs here in bfloat16 on bf16 matmul hardware: one tiny call, checked
    once (the MLPs ask at every call)."""
    if not (cpu_bf16_matmul_fast() and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        x = torch.ones(2, 4, dtype=torch.bfloat16)
        out = torch.ops.mkldnn._linear_pointwise(x, torch.ones(3, 4, dtype=torch.bfloat16), None, "gelu", [], "tanh")
        return tuple(out.shape) == (2, 3) and bool(torch.isfinite(out).all())
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return False


def cpu_fused_linear_gelu(x, weight, bias):
    """``linear_gelu`` as one oneDNN call on the CPU when it multiplies in bfloat16 (bf16 tensors, or float32 ones
    under bfloat16 autocast, cast as autocast casts an ``F.linear``'s inputs and bias) on hardware with bf16
    matmuls: the GELU runs in the GEMM's epilogue on the float32 accumulator, so the 4x-wide hidden layer is
    written once, not written, read and written again (16 threads of the 16-core host: 11.7 ms against 18.5-20.1
    for 4096 x 1024 -> 4096, 37 against 53-64 ms for 20000 x 768 -> 3072; 2 cores: 94 against 107 ms). None
    where it does not apply (other devices and dtypes, autograd, no oneDNN op): the caller composes."""
    if x.device.type != "cpu" or x.dim() < 2 or _records_grad(x, weight, bias):
        return None
    compute = matmul_input_dtype(x.dtype, x.device)
    if compute != torch.bfloat16 or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if not _onednn_linear_pointwise():
        return None
    rows = x.reshape(-1, x.shape[-1]).to(compute).contiguous()
    hidden = torch.ops.mkldnn._linear_pointwise(rows, weight.to(compute), None if bias is None else bias.to(compute),
                                                "gelu", [], "tanh")
    return hidden.view(*x.shape[:-1], hidden.shape[-1])


def native_linear_gelu(x, weight, bias):
    fused = cpu_fused_linear_gelu(x, weight, bias)
    if fused is not None:
        return fused
    hidden = F.linear(x, weight, bias)
    if torch.is_grad_enabled() and hidden.requires_grad:
        return F.gelu(hidden, approximate="tanh")  # autograd keeps the pre-activation
    # the same kernel in place: no second 4x-wide buffer to allocate (and, on the CPU, to fault in page by page)
    return torch.ops.aten.gelu_(hidden, approximate="tanh")


def native_layer_norm(x, shape, weight, bias, eps):
    return F.layer_norm(x, shape, weight, bias, eps)


def compose_float32_layer_norm(layer_norm_fn):
    """``LayerNorm32``'s arithmetic from a plain layer norm: x's float32 copy normalised, rounded to x's dtype."""
    def float32_layer_norm(x, shape, weight, bias, eps):
        return layer_norm_fn(x.float(), shape, weight, bias, eps).type(x.dtype)
    return float32_layer_norm


_composed_float32_layer_norm = compose_float32_layer_norm(native_layer_norm)


def native_float32_layer_norm(x, shape, weight, bias, eps):
    """The composed op, except for half x on the CPU without autograd: torch's CPU kernel takes half input with
    float32 parameters, computes the statistics and the affine in float32 and rounds once, so neither the float32
    copy of x nor the rounding pass over the float32 result is made (the decoders' bf16 torsos: 4 of their 6
    [N, C] copies a block). The same float32 arithmetic in another order: 0.001-0.01 % of the bf16 outputs (float16
    about 0.01 %) one unit of the last place apart."""
    if x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float16) or _records_grad(x, weight, bias):
        return _composed_float32_layer_norm(x, shape, weight, bias, eps)
    w, b = (None if t is None else t.float() for t in (weight, bias))
    return F.layer_norm(x, shape, w, b, eps)


_composed_modulated_layer_norm = compose_modulated_layer_norm(native_layer_norm)
NATIVE_OPS = dict(layer_norm=native_layer_norm, float32_layer_norm=native_float32_layer_norm,
                  modulated_layer_norm=native_modulated_layer_norm,
                  gated_residual=native_gated_residual, head_rms_norm=native_head_rms_norm,
                  linear_gelu=native_linear_gelu)


def native_group_norm_rows_(rows, num_groups, weight, bias, eps):
    """``native_group_norm`` of voxel rows [L, C] written over them where it normalises rows as they lie (float
    rows on the CPU: the same values, no second [L, C] tensor); None elsewhere (the caller takes the new-tensor
    path)."""
    if not _voxel_major(rows.t()[None]) or _records_grad(rows, weight, bias):
        return None  # out= does not record autograd
    return group_norm_voxel_major(rows, num_groups, weight, bias, eps, out=rows)


@register(Family.NORM, "native", devices=("cpu", "mps", "cuda"), dtypes=NORM_DTYPES, priority=10,
          group_norm_rows_=native_group_norm_rows_, **NATIVE_OPS)
def native_group_norm(x, num_groups, weight, bias, eps):
    if _voxel_major(x):
        return group_norm_voxel_major(x[0].t(), num_groups, weight, bias, eps).t()[None]
    # other layouts (a sparse view on CUDA / MPS) get the contiguous copy the sparse modules always handed over
    return F.group_norm(x.contiguous(), num_groups, weight, bias, eps)


def _voxel_major(x: torch.Tensor) -> bool:
    """x [1, C, L] viewing float rows [L, C] (a sparse tensor's features) on the CPU (half rows too: they are
    normalised in float32)."""
    return (x.device.type == "cpu" and x.dtype in NORM_DTYPES and x.dim() == 3
            and x.shape[0] == 1 and x.shape[2] > 1 and x.stride(1) == 1 and x.stride(2) == x.shape[1])


def group_norm_voxel_major(rows: torch.Tensor, num_groups: int, weight: Optional[torch.Tensor],
                           bias: Optional[torch.Tensor], eps: float, chunk_rows: int = 8192,
                           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """GroupNorm of one batch element held as rows [L, C] (channels contiguous), returned as new [L, C] rows
    (or written into ``out``, which may be ``rows`` itself: the last step is element-wise).

    Why: torch's CPU kernels want [1, C, L]. The transposed copy in and out cost 4x the normalisation on the mesh
    decoder's 1.5 M x 96 features, and the channels-last kernel sums in a way that loses 1e-3 at that size.
    Statistics: per-channel sums of the deviations from a float32 mean and of their squares, summed chunk by chunk
    into float64 (which also corrects that mean's rounding), merged into groups (mean of the channel means; second
    moments plus the spread of the channel means); then one multiply-add per element. Half rows are computed in
    float32 chunk by chunk and rounded once (GroupNorm32's values without a float32 copy of the whole input)."""
    length, channels = rows.shape
    per_group = channels // num_groups
    work = accumulate_dtype(rows.dtype)
    rough = rows.sum(0, dtype=work) / length
    shifted = torch.zeros(2, channels, dtype=torch.float64, device=rows.device)  # sums of (x - rough), (x - rough)^2
    # reused: fresh chunks would be page-faulted in
    centred = torch.empty(min(chunk_rows, length), channels, dtype=work, device=rows.device)
    for start in range(0, length, chunk_rows):
        block = rows[start:start + chunk_rows]
        d = torch.sub(block, rough, out=centred[:block.shape[0]])
        shifted[0] += d.sum(0)
        shifted[1] += d.square_().sum(0)
    correction = shifted[0] / length  # the float32 mean's rounding error, recovered in float64
    mean64 = (rough.double() + correction).view(num_groups, per_group)
    m2 = shifted[1] - length * correction.square()
    group_mean = mean64.mean(1, keepdim=True)
    group_m2 = m2.view(num_groups, per_group).sum(1, keepdim=True) + length * (mean64 - group_mean).square().sum(
        1, keepdim=True)
    rstd = torch.rsqrt(group_m2 / (length * per_group) + eps)
    scale = rstd.expand(num_groups, per_group)
    if weight is not None:
        scale = scale * weight.double().view(num_groups, per_group)
    shift = -group_mean * scale
    if bias is not None:
        shift = shift + bias.double().view(num_groups, per_group)
    shift, scale = shift.reshape(channels).to(work), scale.reshape(channels).to(work)
    if work == rows.dtype:
        return torch.addcmul(shift, rows, scale, out=out)
    result = torch.empty_like(rows) if out is None else out
    for start in range(0, length, chunk_rows):
        block = rows[start:start + chunk_rows]
        result[start:start + block.shape[0]].copy_(torch.addcmul(shift, block, scale, out=centred[:block.shape[0]]))
    return result
