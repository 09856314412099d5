"""``torch.compile`` for the pipeline's dense models, with an eager fallback (``compile_model`` / ``compile=True``).

Upstream compiles with ``mode="max-autotune", fullgraph=True`` on CUDA only. Here the same wrapper runs on every
device: where compiling fails (no C++ compiler for the CPU inductor, an op the MPS inductor lacks, a graph break
under ``fullgraph``), the first call warns once per device type and the model keeps running eagerly, so
``compile=True`` never turns a working run into a crash.
"""
from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Optional, Set

import torch

logger = logging.getLogger(__name__)

# the dense models compiled by the pipeline (the sparse stage-2 models break graphs on every sparse op)
COMPILED_MODELS = ("ss_generator", "ss_condition_embedder", "slat_condition_embedder", "ss_decoder")

_warned_device_types: Set[str] = set()


def recursive_fn_factory(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Any], Any]:
    """A function applying ``fn`` to every tensor inside nested dicts / lists / tuples; None, bool, int and float
    pass through; any other type raises TypeError (as upstream)."""

    def apply(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return fn(value)
        if isinstance(value, dict):
            return {k: apply(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(apply(v) for v in value)
        if value is None or isinstance(value, (bool, int, float)):
            return value
        raise TypeError(f"Unexpected type {type(value)}")

    return apply


recursive_contiguous = recursive_fn_factory(lambda t: t.contiguous())
recursive_clone = recursive_fn_factory(lambda t: t.clone())


def _warn_fallback(device_type: str, name: str, error: BaseException) -> None:
    if device_type in _warned_device_types:
        logger.debug("compiling %s failed too (%s); eager", name, error)
        return
    _warned_device_types.add(device_type)
    warnings.warn(f"torch.compile is not usable on {device_type} here ({type(error).__name__}: "
                  f"{str(error).splitlines()[0][:200] if str(error) else ''}); {name} and the other models run "
                  f"eagerly (same results, no speed-up). Run without compile=True / --compile to silence this.",
                  RuntimeWarning, stacklevel=3)


def _device_type_of(args: tuple, kwargs: dict) -> str:
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
    return "cpu"


def compile_wrapper(fn: Callable, *, mode: Optional[str] = "max-autotune", fullgraph: bool = True,
                    dynamic: bool = False, name: Optional[str] = None, backend: Any = "inductor",
                    fallback: bool = True) -> Callable:
    """``torch.compile(fn)`` whose calls get contiguous tensor arguments, run under a profiler label (``name`` or
    ``"compiled <fn>"``) and return a clone of the result (compiled graphs may reuse output buffers).

    Ours: ``backend`` (torch.compile's) and ``fallback``: when the compiled call raises, warn once per device type
    and run ``fn`` eagerly from then on (False: re-raise)."""
    compiled = torch.compile(fn, mode=mode if backend == "inductor" else None, fullgraph=fullgraph,
                             dynamic=dynamic, backend=backend)
    label = name or f"compiled {getattr(fn, '__qualname__', fn)}"
    state = {"eager": False}

    def run(*args, **kwargs):
        args, kwargs = recursive_contiguous(args), recursive_contiguous(kwargs)
        with torch.autograd.profiler.record_function(label):
            if state["eager"]:
                return fn(*args, **kwargs)
            try:
                return recursive_clone(compiled(*args, **kwargs))
            except Exception as e:  # noqa: BLE001  any compiler failure: eager is always correct
                if not fallback:
                    raise
                state["eager"] = True
                _warn_fallback(_device_type_of(args, kwargs), label, e)
                return fn(*args, **kwargs)

    run.__wrapped__ = fn
    run.compiled = compiled
    run.state = state
    return run


def compile_model_forward(model: torch.nn.Module, device: torch.device, name: str,
                          backend: Any = "inductor") -> torch.nn.Module:
    """Route ``model``'s calls through ``compile_wrapper(model.forward)`` (hooks still run: ``__call__`` is kept).
    ``mode="default"`` and no ``fullgraph``: our models have a few data-dependent branches, and max-autotune's
    kernel search costs minutes per model; the speed-up comes from fusion either way."""
    if getattr(model.forward, "compiled", None) is not None:
        return model  # already compiled (a model shared between pipelines)
    model.forward = compile_wrapper(model.forward, mode="default", fullgraph=False, dynamic=False,
                                    name=f"compiled {name} ({device.type})", backend=backend)
    return model
