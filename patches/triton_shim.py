"""``triton`` stand-in: module-level ``import triton`` and ``@triton.jit`` definitions work, a launch raises.

Why: CUDA-era code imports triton at module level (e.g. a kernel file imported by a model package) even when the
kernel is only launched on CUDA. Without triton the whole package fails to import. The stand-in lets the module
import; ``kernel[grid](...)`` (or a direct call) raises an error saying that Triton kernels need triton and a GPU,
so nothing computes silently wrong. ``cdiv`` and ``next_power_of_2`` compute (host-side helpers).

torch itself must not mistake the stand-in for triton: ``torch.utils._triton.has_triton_package()`` only tries
``import triton``, and once it says yes, ``import torch._dynamo`` imports ``triton.backends.compiler`` (and a real
torchvision, which imports ``torch._dynamo``, fails with it). So before the stand-in is registered,
:func:`settle_torch_probes` lets torch answer its triton probes while triton is truly absent (they are cached), and
imports torch's module-level ``try: import triton`` sites, so ``torch._dynamo`` and ``torch.compile`` keep working
(without Triton kernels, as on any machine without triton). With ``replace_installed=True`` over an importable
triton, torch binds the real triton first (``torch._dynamo`` is imported before the stand-in); ``torch.compile``'s
inductor backend is then not supported (it imports triton submodules the stand-in does not have).
"""
from __future__ import annotations

import importlib
import sys

from ._modules import drop, install_shim, make, real_module_available

# torch's answers to "is triton there?": cached functions, and modules binding the answer when first imported
_TORCH_PROBES = ("has_triton_package", "has_triton", "get_triton_version", "has_triton_tma",
                 "has_triton_tma_device", "has_triton_stable_tma_api", "has_triton_tensor_descriptor_host_tma")
_TORCH_PROBE_MODULES = ("torch._inductor.runtime.triton_compat", "torch.utils.flop_counter")


class TritonKernelUnavailable(RuntimeError):
    """A Triton kernel was launched while triton is only the sam3d patches stand-in."""


class JITFunction:
    """What ``@triton.jit`` returns: keeps the Python function, refuses to launch."""

    def __init__(self, fn, **options):
        self.fn, self.options = fn, options
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__doc__ = getattr(fn, "__doc__", None)

    def _refuse(self, *args, **kwargs):
        raise TritonKernelUnavailable(
            f"Triton kernel {self.__name__!r} was launched, but triton is not installed (the sam3d patches "
            "stand-in only lets modules import). Install triton on a CUDA machine, or use the code's non-Triton "
            "path / `backends`.")

    def __getitem__(self, grid):
        return self._refuse

    __call__ = _refuse

    def run(self, *args, **kwargs):
        self._refuse()


def jit(fn=None, **options):
    if fn is None:
        return lambda f: JITFunction(f, **options)
    return JITFunction(fn, **options)


def _passthrough_decorator(*args, **kwargs):
    return lambda fn: fn if isinstance(fn, JITFunction) else JITFunction(fn)


class Config:
    def __init__(self, kwargs=None, num_warps: int = 4, num_stages: int = 2, **extra):
        self.kwargs, self.num_warps, self.num_stages = dict(kwargs or {}), num_warps, num_stages


def cdiv(x: int, y: int) -> int:
    return (x + y - 1) // y


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


class constexpr:  # noqa: N801  triton's name; used in kernel signatures, evaluated at definition
    def __init__(self, value=None):
        self.value = value


class _dtype:  # noqa: N801
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"triton.language.{self.name}"


_DTYPES = {n: _dtype(n) for n in ("float16", "bfloat16", "float32", "float64", "int1", "int8", "int16", "int32",
                                 "int64", "uint8", "uint32")}


def _build():
    language = make("triton.language", __doc__, constexpr=constexpr, dtype=_dtype, **_DTYPES)
    runtime = make("triton.runtime", __doc__, JITFunction=JITFunction)
    root = make("triton", __doc__, jit=jit, autotune=_passthrough_decorator, heuristics=_passthrough_decorator,
                Config=Config, cdiv=cdiv, next_power_of_2=next_power_of_2, language=language, runtime=runtime,
                JITFunction=JITFunction, TritonKernelUnavailable=TritonKernelUnavailable,
                __version__="0.0+sam3d-shim")
    return [root, language, runtime]


def settle_torch_probes() -> None:
    """Let torch record that triton is absent before the stand-in appears (see the module docstring)."""
    try:
        probes = importlib.import_module("torch.utils._triton")
    except ImportError:  # an older torch without the cached probes
        return
    for name in _TORCH_PROBES:
        probe = getattr(probes, name, None)
        if callable(probe):
            try:
                probe()
            except Exception:  # noqa: BLE001  a probe that fails off-GPU still caches nothing harmful
                pass
    for module in _TORCH_PROBE_MODULES:
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001  absent in this torch version
            pass
    _run_queued_cuda_triton_registration()


def _run_queued_cuda_triton_registration() -> None:
    """A CUDA build of torch queues a lazy call that asks ``importlib.util.find_spec("triton")`` at CUDA's first
    use; with the stand-in in ``sys.modules`` (``__spec__`` None) that raises ``ValueError`` and CUDA fails to
    initialise. The call only registers sparse Triton kernels when triton exists, so run it now, while the real
    situation holds, and take it off the queue."""
    cuda = sys.modules.get("torch.cuda")
    queued = getattr(cuda, "_queued_calls", None)
    if not isinstance(queued, list):
        return
    for entry in list(queued):
        call = entry[0] if isinstance(entry, tuple) else entry
        if getattr(call, "__name__", "") == "_register_triton_kernels":
            queued.remove(entry)
            try:
                call()
            except Exception:  # noqa: BLE001  an import blocker standing for "no triton": nothing to register
                pass


def install(replace_installed: bool = False) -> str:
    real = real_module_available("triton")
    if replace_installed and real:
        importlib.import_module("torch._dynamo")  # torch binds the real triton's pieces before the stand-in
    settle_torch_probes()  # torch keeps the answers of the real situation, whatever the stand-in says later
    return install_shim("triton", _build, replace_installed)


def uninstall() -> None:
    drop("triton", only_shims=True)
