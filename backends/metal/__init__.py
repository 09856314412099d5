"""The Metal runtime shared by the Apple-GPU kernels of each op family: MSL sources, compilation, launch bounds.

The kernels themselves are registered by their op family (``backends.sparse_conv.metal``: ``SPARSE_BACKEND=metal``;
``backends.attn.metal``: ``SPARSE_ATTN_BACKEND=metal`` and ``ATTN_BACKEND=metal``), picked by ``auto`` on MPS when
the shaders compile. This package holds what they share.

The kernels are MSL sources kept next to this file (``*.metal``, package data). Each source is compiled once per
process with ``torch.mps.compile_shader`` and the library is cached; kernels are dispatched on MPS tensors with
explicit ``threads=`` / ``group_size=``, so nothing goes through the CPU and no PyObjC is needed. A compile
failure is remembered too: the probe reports it, so ``auto`` falls back to the torch backends with one warning,
and an explicit ``metal`` request fails with the reason.

Every launch is bounded (:data:`LAUNCH_WORK_LIMIT` multiply-adds, worst case) and big problems are split into
several launches, because the macOS GPU watchdog kills command buffers that run too long; since torch may encode
several launches into one command buffer, the stream is also flushed after :data:`FLUSH_WORK_LIMIT`. Both limits
are settings (:func:`set_launch_limits`): they were chosen on paper, not timed on every Apple GPU.

The probe also checks that each kernel's threadgroup memory fits the GPU's limit (32 KiB on every Apple GPU
family that runs macOS 14+; :func:`set_threadgroup_memory_limit` changes it).

Tests run these exact sources as C++ on the CPU (tests/metal_emulator) through :func:`set_compiler`.
"""
from __future__ import annotations

import threading
from importlib import resources
from typing import Any, Callable, Optional

import torch

from ..device import (MIN_TORCH_FOR_MPS, require_torch_for_mps,  # noqa: F401  (re-exported)
                      synchronize, torch_too_old_for_mps)
from ..registry import env_value

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}

# Worst-case multiply-adds per launch: ~2^34 keeps a launch in the tens of milliseconds on Apple GPUs, far from
# the watchdog's seconds, while big layers still need only a handful of launches.
LAUNCH_WORK_LIMIT = 2 ** 34
# torch's MPS stream may encode several launches into one command buffer, and the watchdog times command
# buffers: after this much work the stream is flushed (a wait, not a data copy) so none grows past it.
FLUSH_WORK_LIMIT = 2 ** 37

_SOURCES = {"sparse_conv": "sparse_conv.metal", "varlen_attention": "varlen_attention.metal"}

# MTLDevice.maxThreadgroupMemoryLength of Apple GPUs (torch exposes no query for it)
THREADGROUP_MEMORY_LIMIT = 32 * 1024

# torch.mps.compile_shader became public in 2.7; MPS max_pool3d / avg_pool3d and bicubic antialias also need it.


def set_launch_limits(launch_work: Optional[int] = None, flush_work: Optional[int] = None) -> None:
    """Change the watchdog bounds (worst-case multiply-adds per launch / per flushed command buffer); ``None``
    keeps a value. The registry passes its settings here; lower them if macOS reports GPU timeouts."""
    global LAUNCH_WORK_LIMIT, FLUSH_WORK_LIMIT
    for name, value in (("launch_work", launch_work), ("flush_work", flush_work)):
        if value is not None and int(value) < 1:
            raise ValueError(f"{name} must be a positive number of multiply-adds, got {value}")
    if launch_work is not None:
        LAUNCH_WORK_LIMIT = int(launch_work)
    if flush_work is not None:
        FLUSH_WORK_LIMIT = int(flush_work)


def set_threadgroup_memory_limit(limit_bytes: int) -> None:
    """Threadgroup memory available per threadgroup on this GPU (forgets earlier probe results)."""
    global THREADGROUP_MEMORY_LIMIT
    THREADGROUP_MEMORY_LIMIT = int(limit_bytes)
    _PROBED.clear()


def _mps_compile(source: str):
    if not hasattr(torch, "mps") or not hasattr(torch.mps, "compile_shader"):
        raise RuntimeError(f"torch {torch.__version__} has no torch.mps.compile_shader (needs PyTorch >= 2.7)")
    return torch.mps.compile_shader(source)


_compiler: Callable[[str], Any] = _mps_compile
_LIBS: dict[str, Any] = {}
_ERRORS: dict[str, str] = {}
_PROBED: dict = {}
_LOCK = threading.Lock()


def set_compiler(compile_fn: Optional[Callable[[str], Any]]) -> None:
    """Use another shader compiler (``None`` restores ``torch.mps.compile_shader``) and forget compiled
    libraries. The tests pass the CPU emulator here."""
    global _compiler
    with _LOCK:
        _compiler = compile_fn or _mps_compile
        _LIBS.clear()
        _ERRORS.clear()
        _PROBED.clear()


def shader_source(name: str) -> str:
    """The MSL text of one of the package's ``.metal`` files."""
    return resources.files(__package__).joinpath(_SOURCES[name]).read_text(encoding="utf-8")


def library(name: str):
    """The compiled library for ``name`` (compiled on first use, then cached; failures are cached too)."""
    with _LOCK:
        if name in _LIBS:
            return _LIBS[name]
        if name in _ERRORS:
            raise RuntimeError(_ERRORS[name])
        try:
            lib = _compiler(shader_source(name))
        except Exception as e:  # any compiler/driver failure makes the backend unavailable, with the reason
            _ERRORS[name] = f"compiling backends/metal/{_SOURCES[name]} failed: {type(e).__name__}: {e}"
            raise RuntimeError(_ERRORS[name]) from e
        _LIBS[name] = lib
        return lib


def _kernel(lib, name: str):
    try:
        return getattr(lib, name)
    except Exception:  # torch raises its own error type for unknown kernel names
        return None


def kernel_for(lib_name: str, stem: str, dtype: torch.dtype):
    """(kernel, compute dtype). bf16 kernels need Metal 3.1; without them bf16 runs through the fp32 kernel."""
    lib = library(lib_name)
    kernel = _kernel(lib, f"{stem}_{_SUFFIX[dtype]}")
    if kernel is None and dtype == torch.bfloat16:
        return _kernel(lib, f"{stem}_f32"), torch.float32
    if kernel is None:
        raise RuntimeError(f"kernel {stem}_{_SUFFIX[dtype]} is missing from backends/metal/{_SOURCES[lib_name]}")
    return kernel, dtype


def _flush(device: torch.device) -> None:
    synchronize(device)


class WorkMeter:
    """Counts worst-case work of consecutive launches and flushes the stream when it passes the limit."""

    def __init__(self, device: torch.device):
        self.device, self.pending = device, 0

    def add(self, work: int) -> None:
        if self.pending and self.pending + work > FLUSH_WORK_LIMIT:
            _flush(self.device)
            self.pending = 0
        self.pending += work


def _check_group_size(kernel, needed: int, name: str) -> None:
    limit = getattr(kernel, "max_threads_per_threadgroup", needed)
    if limit < needed:
        raise RuntimeError(f"Metal kernel {name} allows {limit} threads per threadgroup on this GPU but needs "
                           f"{needed}")


def _check_threadgroup_memory(kernel, declared: int, name: str) -> None:
    """The kernel's threadgroup memory (as Metal reports it when torch exposes it, else what the source
    declares) must fit the GPU's limit, or the launch fails or corrupts results."""
    used = max(int(getattr(kernel, "static_thread_group_memory_length", 0) or 0), declared)
    if used > THREADGROUP_MEMORY_LIMIT:
        raise RuntimeError(f"Metal kernel {name} needs {used} bytes of threadgroup memory but this GPU allows "
                           f"{THREADGROUP_MEMORY_LIMIT}")


def probe_for(lib_name: str, stem: str, threads: int, memory: int = 0) -> Callable[[torch.device], Optional[str]]:
    """A registry probe: None when the library compiles and its kernel fits (threads and threadgroup memory),
    else the reason (cached, because the registry asks on every call)."""
    def probe(device: torch.device) -> Optional[str]:
        key = (lib_name, _compiler)
        if key not in _PROBED:
            try:
                kernel, _ = kernel_for(lib_name, stem, torch.float32)
                _check_group_size(kernel, threads, f"{stem}_f32")
                _check_threadgroup_memory(kernel, memory, f"{stem}_f32")
                _PROBED[key] = None
            except Exception as e:
                _PROBED[key] = str(e)
        return _PROBED[key]

    return probe


def _apply_environment_settings() -> None:
    """The watchdog and threadgroup-memory settings of the registry's environment table (read there)."""
    launch, flush = env_value("SAM3D_METAL_LAUNCH_WORK"), env_value("SAM3D_METAL_FLUSH_WORK")
    if launch or flush:
        set_launch_limits(int(float(launch)) if launch else None, int(float(flush)) if flush else None)
    memory = env_value("SAM3D_METAL_THREADGROUP_MEMORY")
    if memory:
        set_threadgroup_memory_limit(int(memory))


_apply_environment_settings()
