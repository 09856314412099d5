"""One cache of Triton kernels for the backends' Triton modules (sparse conv, DiT block steps, splat compositing).

A kernel function is compiled for GPUs with ``triton.jit``, or wrapped in Triton's interpreter for CPU tensors
(which is how tests run the kernels without a GPU). ``do_not_specialize`` names integer arguments that change
with the data (voxel counts, image sizes): specialising on their divisibility would only compile more variants,
some in the middle of a later run."""
from __future__ import annotations

import functools
from typing import Callable, Dict, Optional, Sequence, Tuple

_KERNELS: Dict[Tuple[Callable, bool], object] = {}


def kernel(fn: Callable, interpret: bool, do_not_specialize: Sequence[str] = ()):
    """The jitted ``fn`` (``interpret=False``) or its interpreted form for CPU tensors, made once per process."""
    key = (fn, interpret)
    if key not in _KERNELS:
        if interpret:
            from triton.runtime.interpreter import InterpretedFunction

            _KERNELS[key] = InterpretedFunction(fn)
        else:
            import triton

            _KERNELS[key] = triton.jit(fn, do_not_specialize=list(do_not_specialize))
    return _KERNELS[key]


@functools.lru_cache(maxsize=None)
def interpreter_takes_runtime_loop_bounds() -> bool:
    """Whether Triton's interpreter can run ``for i in range(0, n)`` with ``n`` a loaded value or a runtime int
    argument. Triton 3.6's interpreter turns the bound into a Python int with ``int(array)`` on a one-element
    array, which NumPy >= 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars"); Triton
    3.9's works. Kernels whose loop bound is data take a static bound (and mask the extra steps) where it is
    False; compiled GPU kernels are unaffected."""
    import torch
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    def probe(n_ptr, out_ptr):
        count = tl.load(n_ptr)
        total = tl.full((1,), 0, tl.int32)
        for _ in range(0, count):
            total += 1
        tl.store(out_ptr + tl.arange(0, 1), total)

    out = torch.zeros(1, dtype=torch.int32)
    try:
        InterpretedFunction(probe)[(1,)](torch.tensor([3], dtype=torch.int32), out)
    except Exception:  # noqa: BLE001  any failure means: do not rely on it
        return False
    return int(out[0]) == 3


def cuda_probe(triton_module) -> Callable:
    """The registry probe of a Triton backend whose module imported ``triton_module`` (None where that import
    failed): None when it can run on the device, else why not."""
    def probe(device) -> Optional[str]:
        import torch

        if triton_module is None:
            return "needs the optional package 'triton' (not installed)"
        if device.type == "cuda" and not torch.cuda.is_available():
            return "CUDA is not available"
        return None

    return probe
