"""One cache of Triton kernels for the backends' Triton modules (sparse conv, DiT block steps, splat compositing).

A kernel function is compiled for GPUs with ``triton.jit``, or wrapped in Triton's interpreter for CPU tensors
(which is how tests run the kernels without a GPU). ``do_not_specialize`` names integer arguments that change
with the data (voxel counts, image sizes): specialising on their divisibility would only compile more variants,
some in the middle of a later run."""
from __future__ import annotations

from typing import Callable, Dict, Sequence, Tuple

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
