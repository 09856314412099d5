"""Linear layers with low-precision stored weights as a registry family (``QUANT_LINEAR_BACKEND``,
``backends.use(quant_linear=...)``): int8 weights with one float32 scale per output channel, or bfloat16 weights.

Ops: :func:`quantize_int8` (symmetric per-output-channel int8 of a float weight, row block by row block, so a
memory-mapped checkpoint tensor is never copied whole) and :func:`quantized_linear` (``F.linear`` with such a
weight). The backend is chosen by the device and the stored weight's dtype:

* ``dequant`` (every device, int8 / bf16 / fp16 weights): the weight is widened to the input's dtype (times its
  scales) for the call and multiplied by the device's own float GEMM. Weight-only: the activations keep their
  precision, so the only difference from float32 is the weight's rounding. Memory at rest is 1/4 (int8) or 1/2
  (bf16); speed is the float GEMM's plus one pass over the weight. ``auto`` picks it where nothing faster runs.
* ``int8pack`` (``torch.ops.aten._weight_int8pack_mm``, weight-only int8 GEMM, where this torch has the kernel for
  the device): ``auto`` picks it on MPS and CUDA. On the CPU it is made for a few rows (token-by-token decoding)
  and measured 3x (bf16 inputs) to 30-60x (float32) slower than the float32 GEMM at the pipeline's 2k-8k rows, so
  there it runs only when named.
* ``int8_dynamic`` (CPU, CUDA; ``torch._int_mm``): the activations are quantized too, per row (token) to int8
  with their own absmax scale, and the int8 GEMM accumulates in int32 (VNNI / AMX on x86). 1.5-1.8x the float32
  GEMM's speed on an AVX-512 VNNI CPU (one thread), at about 1.3x the weight-only error on random data. Not
  weight-only (activation outliers cost precision), so it runs only when named.
* ``bf16`` (bf16 weights): the matmul in bfloat16 (input cast, float32 accumulation inside the GEMM, output cast
  back), on CUDA, MPS and CPUs with AVX-512 BF16 or AMX; a CPU without them warns once and widens to float32
  (``dequant``).
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .device import cpu_bf16_matmul_fast, matmul_input_dtype
from .registry import BackendSpec, Family, register, registered, requested, resolve

INT8_MAX = 127
WEIGHT_DTYPES = (torch.int8, torch.bfloat16, torch.float16)


def quantize_int8(weight: torch.Tensor, block_rows: int = 1024) -> Tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 of ``weight`` [N, K] (any float dtype, any device): ``scale[n] =
    max|w[n]| / 127`` (1 for an all-zero row), ``q = round(w / scale)`` in [-127, 127]. Returns (q int8 [N, K],
    scale float32 [N]) on the weight's device. Computed in float32 ``block_rows`` rows at a time, so the
    float32 temporaries stay small whatever the weight's size or dtype."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize_int8 expects a float [out, in] weight, got {weight.dtype} {tuple(weight.shape)}")
    n = weight.shape[0]
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(n, dtype=torch.float32, device=weight.device)
    for start in range(0, n, block_rows):
        rows = weight[start:start + block_rows]
        low, high = torch.aminmax(rows, dim=1)  # one read of the rows, no |w| temporary
        s = torch.maximum(high.float(), low.float().neg()) / INT8_MAX
        s = torch.where(s > 0, s, torch.ones_like(s))
        codes = rows.to(torch.float32) / s[:, None]
        q[start:start + block_rows] = codes.round_().clamp_(-INT8_MAX, INT8_MAX)  # cast on the copy
        scale[start:start + block_rows] = s
    return q, scale


def dequantize(weight: torch.Tensor, scale: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The float weight [N, K] in ``dtype`` that a stored (weight, scale) stands for."""
    w = weight.to(dtype)
    return w if scale is None else w.mul_(scale.to(dtype)[:, None])


def _check(x: torch.Tensor, weight: torch.Tensor, scale: Optional[torch.Tensor],
           bias: Optional[torch.Tensor]) -> None:
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight {tuple(weight.shape)} must be [out, {x.shape[-1]}] for x {tuple(x.shape)}")
    if weight.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"quantized_linear stores int8, bfloat16 or float16 weights, not {weight.dtype}")
    if (weight.dtype == torch.int8) != (scale is not None):
        raise ValueError("int8 weights need their per-channel scale (and only int8 weights have one)")
    if scale is not None and tuple(scale.shape) != (weight.shape[0],):
        raise ValueError(f"scale {tuple(scale.shape)} must be [{weight.shape[0]}]")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} must be [{weight.shape[0]}]")


def quantized_linear(x: torch.Tensor, weight: torch.Tensor, scale: Optional[torch.Tensor] = None,
                     bias: Optional[torch.Tensor] = None, packed: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` over the last axis of x, where W is stored as ``weight`` int8 [N, K] with
    ``scale`` [N] (W = weight * scale[:, None]) or as bf16 / fp16 ``weight`` (``scale`` None). The result has
    x's dtype (float32 in, float32 out), or under autocast the dtype autocast gives an ``F.linear``.
    ``packed``: the bf16 weight's :func:`prepack_bf16_weight` copy, which the ``bf16`` backend multiplies by
    where it applies (see :func:`bf16_linear`); other backends ignore it."""
    _check(x, weight, scale, bias)
    spec = backend_for(x.device, weight.dtype)
    if packed is not None and spec.fn is bf16_linear:
        return bf16_linear(x, weight, scale, bias, packed=packed)
    return spec.fn(x, weight, scale, bias)


def prepack_bf16_weight(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """A copy of a bf16 weight [N, K] in the blocked layout of oneDNN's CPU bf16 GEMM
    (``torch.ops.mkldnn._reorder_linear_weight``), for :func:`quantized_linear`'s ``packed``; None where it does not
    apply: not a 2-D bf16 CPU weight, a CPU without bf16 matmul hardware, or a torch without the ops.

    ``F.linear`` re-lays the weight out for the AMX / AVX-512 BF16 kernels at every call; the packed copy is laid
    out once. 16-core AMX host, 16 threads (2026-11-28, medians of 9): [4096, 1024] x [1024, 3072] 5.91 -> 4.45 ms,
    x [1024, 1024] 1.94 -> 1.37, [4096, 4096] x [4096, 1024] 8.83 -> 6.78, 5423 rows alike; outputs within one bf16
    rounding of ``F.linear``'s (another blocking of the same float32 sums). The copy is an opaque mkldnn tensor: no
    state dict, no device moves, and it is as large as the weight, so the caller keeps it beside the plain weight
    only where memory allows."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.numel() == 0:
        return None
    if not _onednn_packed_linear():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


@functools.lru_cache(maxsize=None)
def _onednn_packed_linear() -> bool:
    """Whether this torch packs bf16 weights for oneDNN and multiplies by them here (bf16 matmul hardware, the two
    ops present and giving F.linear's result on a tiny case): checked once."""
    if not (cpu_bf16_matmul_fast() and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        x, w = torch.ones(2, 32, dtype=torch.bfloat16), torch.ones(16, 32, dtype=torch.bfloat16)
        out = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, None), None, "none",
                                                 [], "")
        return tuple(out.shape) == (2, 16) and bool((out == 32).all())
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return False


def backend_for(device: torch.device, weight_dtype: torch.dtype) -> BackendSpec:
    """The backend that multiplies weights stored as ``weight_dtype`` on ``device``: the requested one
    (``QUANT_LINEAR_BACKEND``, ``backends.use``) for the stored dtypes it supports, the automatic choice for the
    others (an int8 model keeps some layers in bf16, see ``sam3d_objects.pipeline.weights``, so naming
    ``int8_dynamic`` must not stop those)."""
    name, _ = requested(Family.QUANT_LINEAR)
    if name != "auto":
        spec = registered(Family.QUANT_LINEAR).get(name)
        if spec is not None and weight_dtype not in spec.dtypes:
            return resolve(Family.QUANT_LINEAR, device, weight_dtype, name="auto")
    return resolve(Family.QUANT_LINEAR, device, weight_dtype)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


# --------------------------------------------------------------------------------------------------------------
# backends
# --------------------------------------------------------------------------------------------------------------
@register(Family.QUANT_LINEAR, "dequant", devices=("cpu", "mps", "cuda"), dtypes=WEIGHT_DTYPES, priority=0)
def dequant_linear(x: torch.Tensor, weight: torch.Tensor, scale: Optional[torch.Tensor],
                   bias: Optional[torch.Tensor]) -> torch.Tensor:
    compute = _compute_dtype(x)
    return F.linear(x.to(compute), dequantize(weight, scale, compute), None if bias is None else bias.to(compute))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype an ``F.linear`` of ``x`` would multiply in: the autocast dtype where autocast is on (the weight
    is widened straight to it, never to float32 first), else x's own."""
    return matmul_input_dtype(x.dtype, x.device) if x.is_floating_point() else torch.float32


def _has_kernel(op: str, device: torch.device) -> bool:
    key = {"cpu": "CPU", "cuda": "CUDA", "mps": "MPS"}.get(device.type)
    try:
        return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(op, key)
    except (RuntimeError, AttributeError):
        return False


def _int8pack_probe(device: torch.device) -> Optional[str]:
    if not _has_kernel("aten::_weight_int8pack_mm", device):
        return f"this torch ({torch.__version__}) has no _weight_int8pack_mm kernel for {device.type}"
    return None


@register(Family.QUANT_LINEAR, "int8pack", devices=("cpu", "mps", "cuda"), dtypes=(torch.int8,),
          probe=_int8pack_probe, priority=20, auto_devices=("mps", "cuda"), warn_when_skipped=True)
def int8pack_linear(x: torch.Tensor, weight: torch.Tensor, scale: Optional[torch.Tensor],
                    bias: Optional[torch.Tensor]) -> torch.Tensor:
    compute = _compute_dtype(x)
    compute = compute if compute in (torch.float32, torch.float16, torch.bfloat16) else torch.float32
    rows = _rows(x).to(compute).contiguous()
    out = torch.ops.aten._weight_int8pack_mm(rows, weight.contiguous(), scale.to(compute))
    if bias is not None:
        out = out + bias.to(compute)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _int_mm_probe(device: torch.device) -> Optional[str]:
    if not _has_kernel("aten::_int_mm", device):
        return f"this torch ({torch.__version__}) has no _int_mm kernel for {device.type}"
    return None


# cuBLASLt's int8 GEMM needs more than 16 rows and sizes that are multiples of 8; smaller calls are widened
_INT_MM_MIN_ROWS = 17


@register(Family.QUANT_LINEAR, "int8_dynamic", devices=("cpu", "cuda"), dtypes=(torch.int8,),
          probe=_int_mm_probe, priority=-10)  # below dequant, which runs everywhere: only when named
def int8_dynamic_linear(x: torch.Tensor, weight: torch.Tensor, scale: Optional[torch.Tensor],
                        bias: Optional[torch.Tensor]) -> torch.Tensor:
    rows = _rows(x).float()
    n, k = weight.shape
    if x.device.type == "cuda" and (rows.shape[0] < _INT_MM_MIN_ROWS or k % 8 or n % 8):
        return dequant_linear(x, weight, scale, bias)
    x_scale = rows.abs().amax(dim=1, keepdim=True).div_(INT8_MAX).clamp_min_(torch.finfo(torch.float32).tiny)
    q_rows = torch.round(rows / x_scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    acc = torch._int_mm(q_rows, weight.t())  # int32: |sum| <= K * 127^2, no overflow below K = 133k
    out = acc.to(torch.float32).mul_(x_scale).mul_(scale.float())
    if bias is not None:
        out.add_(bias.float())
    return out.reshape(*x.shape[:-1], n).to(x.dtype)


def _bf16_probe(device: torch.device) -> Optional[str]:
    if device.type == "cpu" and not cpu_bf16_matmul_fast():
        return "this CPU has neither AVX-512 BF16 nor AMX (bf16 matmuls would be emulated, slower than float32)"
    return None


@register(Family.QUANT_LINEAR, "bf16", devices=("cpu", "mps", "cuda"), dtypes=(torch.bfloat16,),
          probe=_bf16_probe, priority=20, warn_when_skipped=True)
def bf16_linear(x: torch.Tensor, weight: torch.Tensor, scale: Optional[torch.Tensor],
                bias: Optional[torch.Tensor], packed: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The matmul in bfloat16; by the ``packed`` copy of the weight (:func:`prepack_bf16_weight`) on the CPU
    without autograd (oneDNN's ``_linear_pointwise`` has no backward), by ``weight`` otherwise."""
    bias16 = None if bias is None else bias.to(torch.bfloat16)
    if packed is not None and x.device.type == "cpu" and x.numel() > 0 \
            and not (torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))):
        rows = _rows(x).to(torch.bfloat16).contiguous()
        out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias16, "none", [], "")
        out = out.view(*x.shape[:-1], weight.shape[0])
    else:
        out = F.linear(x.to(torch.bfloat16), weight, bias16)
    # an F.linear's dtype: x's own, or under autocast the autocast dtype (no cast back up for the next matmul)
    return out.to(matmul_input_dtype(x.dtype, x.device))
