"""FLOP counting shared by the benchmarks: torch's counter, plus formulas for two CPU ops it does not count: the CPU
flash-attention op, which torch counts only on CUDA (without it a CPU rate would leave out every attention FLOP),
and oneDNN's fused linear (``mkldnn._linear_pointwise``, the MLP's linear + GELU in bfloat16 on the CPU)."""
import math

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count


def _linear_pointwise_flops(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    """2 M K N for x [..., K] and a weight [N, K] (the activation in the epilogue is not counted, as for addmm)."""
    return 2 * math.prod(x_shape[:-1]) * x_shape[-1] * w_shape[0]


def flop_counter() -> FlopCounterMode:
    """A FlopCounterMode (not entered yet) that also counts CPU SDPA like the CUDA one, and the fused CPU linear."""
    mapping = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
               lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v)}
    linear_pointwise = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if linear_pointwise is not None:
        mapping[linear_pointwise] = _linear_pointwise_flops
    return FlopCounterMode(display=False, custom_mapping=mapping)
