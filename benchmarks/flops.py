"""FLOP counting shared by the benchmarks: torch's counter, plus a formula for the CPU flash-attention op, which
torch counts only on CUDA (without it a CPU rate would leave out every attention FLOP)."""
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count


def flop_counter() -> FlopCounterMode:
    """A FlopCounterMode (not entered yet) that also counts CPU SDPA like the CUDA one."""
    cpu_sdpa = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
                lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v)}
    return FlopCounterMode(display=False, custom_mapping=cpu_sdpa)
