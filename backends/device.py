"""Device and precision guards: default device, autocast that degrades to a null context, cache/peak helpers.

Every helper takes the device from the caller; nothing here assumes CUDA.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
import threading
from typing import Callable, Optional

import torch

from .registry import env_value

_DEFAULT: Optional[torch.device] = None


def mps_available() -> bool:
    return hasattr(torch.backends, "mps") and torch.backends.mps.is_available()


def available_devices() -> list[torch.device]:
    devices = [torch.device("cpu")]
    if mps_available():
        devices.append(torch.device("mps"))
    if torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    return devices


def default_device() -> torch.device:
    """cuda > mps > cpu, unless :func:`set_default_device` or ``$SAM3D_DEVICE`` says otherwise."""
    if _DEFAULT is not None:
        return _DEFAULT
    chosen = env_value("SAM3D_DEVICE")
    if chosen:
        return torch.device(chosen)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if mps_available():
        return torch.device("mps")
    return torch.device("cpu")


def redirect_target() -> torch.device:
    """Where CUDA-era code's CUDA requests go on a machine without CUDA (``patches``' device shims): the default
    device (:func:`set_default_device`, ``$SAM3D_DEVICE``), else mps > cpu; never a CUDA device."""
    chosen = default_device()
    if chosen.type != "cuda":
        return chosen
    return torch.device("mps") if mps_available() else torch.device("cpu")


def set_default_device(device: Optional[torch.device | str]) -> None:
    global _DEFAULT
    _DEFAULT = torch.device(device) if device is not None else None


def as_device(device: Optional[torch.device | str]) -> torch.device:
    """The device to build on; on MPS first checks that this torch is new enough (a clear error, not a crash
    deep inside a model)."""
    chosen = default_device() if device is None else torch.device(device)
    if chosen.type == "mps":
        require_torch_for_mps()
    return chosen


def autocast_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch.autocast(device_type, dtype)`` is meaningful here. MPS autocast has raised on some torch
    versions (it is checked, not assumed), and CPU autocast only supports bf16/fp16 on recent torch."""
    if device_type == "cuda":
        return torch.cuda.is_available()
    if device_type == "cpu":
        return dtype in (torch.bfloat16, torch.float16)
    if device_type == "mps":
        return False
    return False


def autocast(device_type: str | torch.device, dtype: torch.dtype = torch.float16, enabled: bool = True):
    """``torch.autocast`` where supported for this device/dtype, otherwise a null context."""
    device_type = torch.device(device_type).type if not isinstance(device_type, str) else device_type
    if not enabled or not autocast_supported(device_type, dtype):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype autocast casts matmul inputs to on ``device_type`` right now, or None outside autocast."""
    if device_type not in ("cuda", "cpu", "mps", "xpu") or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def matmul_input_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """What an autocast matmul on ``device`` would cast a ``dtype`` input to right now (``dtype`` itself outside
    autocast): casting a tensor that only feeds matmuls once up front gives the same values."""
    cast = autocast_dtype(torch.device(device).type)
    return cast if cast is not None and dtype == torch.float32 else dtype


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums and statistics of ``dtype`` values are computed in: float32 for the half types (their own
    sums lose bits that spconv's and GroupNorm32's float32 keeps), the dtype itself otherwise."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def half_supported(device: torch.device | str, dtype: torch.dtype = torch.float16) -> bool:
    """Whether running model blocks in ``dtype`` is sensible on ``device`` (CPU fp16 matmul is slow or missing
    on older torch; bf16 works on CPU)."""
    device = torch.device(device)
    if device.type in ("cuda", "mps"):
        return True
    return dtype == torch.bfloat16


def synchronize(device: torch.device | str) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def empty_cache(device: torch.device | str) -> None:
    """Return cached allocator memory to the system (MPS keeps it between runs otherwise)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()
    elif device.type == "mps" and mps_available():
        torch.mps.empty_cache()


@functools.lru_cache(maxsize=None)
def _libc_function(name: str, *argtypes) -> Optional[Callable[..., int]]:
    """The C library function ``name`` (returning int) from the symbols already loaded into the process, or None
    where the C library has none (glibc's ``malloc_trim`` / ``mallopt`` on macOS, Windows, musl)."""
    try:
        fn = getattr(ctypes.CDLL(None), name)
    except (OSError, TypeError, AttributeError):  # no dlopen(NULL) (Windows) or no such symbol
        return None
    fn.argtypes, fn.restype = list(argtypes), ctypes.c_int
    return fn


def release_host_memory() -> bool:
    """Hand the C allocator's free heap pages back to the system; True where that was possible (glibc).

    Why: glibc raises its mmap threshold (up to 32 MiB) once a large block has been freed, so the many
    medium-sized CPU tensors of a run are then carved from malloc arenas. Freeing them leaves the pages resident
    in the arenas (free() only shrinks a heap from its top), and a model freed in low-memory mode does not lower
    the process RSS: on the 2-core CPU run ~1.5-1.9 GiB stayed resident after stage-2 sampling and carried into
    the next run's peak. ``malloc_trim(0)`` returns every free whole page of every arena (madvise), which costs
    milliseconds. Elsewhere (macOS, Windows, musl) this does nothing and returns False."""
    trim = _libc_function("malloc_trim", ctypes.c_size_t)
    if trim is None:
        return False
    trim(0)
    return True


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt() parameter numbers
HOST_REUSE_MMAP_THRESHOLD = 32 * 2 ** 20  # the largest mmap threshold glibc accepts on 64-bit systems
HOST_REUSE_TRIM_THRESHOLD = 2 ** 30


@functools.lru_cache(maxsize=None)
def keep_freed_host_memory() -> bool:
    """Let the C allocator reuse freed CPU tensors of up to 32 MiB instead of handing their pages back to the
    system; True where that was set (glibc), False elsewhere (nothing changes there). Process-wide and once.

    Why: with glibc's defaults a CPU forward pass unmaps, or trims from the heap top, most of the activations it
    frees, and the next op's output of the same size faults the pages in again, zero-filled, one 4 KiB page at a
    time: 50-145 thousand page faults in every 4-block pass of the full-size generators (bf16, 16 threads; none
    with these settings). Sets the mmap threshold to its 32 MiB maximum (blocks above it are still mapped and
    unmapped) and the trim threshold to 1 GiB; ``release_host_memory`` still returns free pages on demand.
    Costs: up to the run's peak of freed memory stays resident between its ops (that is what is reused)."""
    fn = _libc_function("mallopt", ctypes.c_int, ctypes.c_int)
    if fn is None:
        return False
    return bool(fn(_M_MMAP_THRESHOLD, HOST_REUSE_MMAP_THRESHOLD)) and bool(
        fn(_M_TRIM_THRESHOLD, HOST_REUSE_TRIM_THRESHOLD))


_MADV_DONTNEED = 4  # Linux's value


@functools.lru_cache(maxsize=None)
def _madvise() -> Optional[Callable[..., int]]:
    """libc's ``madvise`` on Linux (None elsewhere: macOS's MADV_DONTNEED is only a hint there)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, TypeError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def drop_read_pages(tensor: torch.Tensor) -> int:
    """Drop the resident pages of a CPU tensor that lives in a read-only file mapping (a checkpoint loaded with
    ``mmap=True``) once it has been read; returns the bytes dropped (0 where that is not possible).

    Why: pages read through a file mapping count in the process RSS until the whole mapping goes away, so
    converting a checkpoint's weights one tensor at a time (e.g. to int8) would still hold every float page it
    read. Only whole pages inside the tensor are dropped (a neighbour sharing a page keeps it); a later read of
    the tensor reloads them from the file, unless it was written to (torch maps checkpoints private and
    writable: written pages would be lost, so call this only on tensors that were only read). Memory that is not
    a private file mapping (an ordinary tensor, a safetensors file read into memory) is left alone: there
    dropping would zero it."""
    madvise = _madvise()
    if madvise is None or tensor.device.type != "cpu" or tensor.numel() == 0:
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first, last = -(-start // page) * page, end // page * page
    if last <= first or not _in_read_only_file_mapping(first, last):
        return 0
    return last - first if madvise(first, last - first, _MADV_DONTNEED) == 0 else 0


def _in_read_only_file_mapping(start: int, end: int) -> bool:
    """Whether [start, end) lies in one private mapping of a file (/proc/self/maps)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                low, high = (int(v, 16) for v in fields[0].split("-"))
                if low <= start < high:
                    path = fields[5].strip() if len(fields) > 5 else ""
                    return end <= high and fields[1].endswith("p") and path.startswith("/")
    except (OSError, ValueError, IndexError):
        pass
    return False


def _cpu_has(capability: str) -> bool:
    """``torch.cpu.<capability>()`` (e.g. ``_is_amx_tile_supported``), False where this torch lacks it."""
    check = getattr(torch.cpu, capability, None)
    try:
        return bool(check()) if check is not None else False
    except (RuntimeError, AttributeError):  # older torch without the capability table
        return False


def cpu_bf16_matmul_fast() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (AVX-512 BF16 or AMX tiles): there a bf16
    matmul is about twice a float32 one; elsewhere it is emulated and slower than float32."""
    return _cpu_has("_is_avx512_bf16_supported") or cpu_amx_tiles()


@functools.lru_cache(maxsize=None)
def cpu_amx_tiles() -> bool:
    """Whether this CPU has AMX tiles (Sapphire Rapids and later Xeons): its bfloat16 kernels pack their operands
    into tiles themselves, so layout work done for them beforehand is wasted there."""
    return _cpu_has("_is_amx_tile_supported")


def bf16_fast(device: torch.device | str) -> bool:
    """Whether ``device`` runs bfloat16 matmuls and attention in hardware, faster than float32: CUDA where the
    GPU supports bf16, a CPU with AVX-512 BF16 or AMX (:func:`cpu_bf16_matmul_fast`); not MPS, whose autocast
    is not used here (:func:`autocast_supported`)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return cpu_bf16_matmul_fast()
    return False


def available_memory() -> Optional[int]:
    """Bytes of host memory available to new allocations (psutil, else Linux's /proc/meminfo), None if unknown."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (ru_maxrss is KiB on Linux, bytes on macOS; on Windows, which has
    no ``resource`` module, psutil's peak working set where installed, else 0)."""
    try:
        import resource  # Unix only: imported here so that `import backends` works on Windows
    except ImportError:
        return _peak_working_set()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _peak_working_set() -> int:
    try:
        import psutil
    except ImportError:
        return 0
    info = psutil.Process().memory_info()
    return int(getattr(info, "peak_wset", info.rss))


def current_rss_bytes() -> int:
    """Resident set size now: psutil where installed, /proc on Linux, else the peak (macOS without psutil)."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        pass
    try:
        with open("/proc/self/statm") as f:  # Linux only; elsewhere the open fails
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return peak_rss_bytes()


def recommended_max_memory(device: torch.device | str) -> Optional[int]:
    """The driver's recommended working-set size on MPS (unified memory shared with the system), else None."""
    device = torch.device(device)
    if device.type == "mps" and mps_available() and hasattr(torch.mps, "recommended_max_memory"):
        return int(torch.mps.recommended_max_memory())
    return None


def memory_budget(device: torch.device | str, share: float = 1 / 16, default: int = 512 * 2 ** 20,
                  floor: int = 128 * 2 ** 20) -> int:
    """Bytes one temporary buffer (an attention-score block, a render tile batch) may take on ``device``.

    On MPS a fixed figure is wrong both ways (8 GB and 128 GB Macs share one GPU memory with the system): the
    budget is ``share`` of ``torch.mps.recommended_max_memory()``, at least ``floor``. Elsewhere ``default``."""
    recommended = recommended_max_memory(device)
    if recommended is None:
        return default
    return max(int(recommended * share), floor)


class _PeakSampler:
    """MPS has no peak counter: a daemon thread samples the driver's allocation every ``interval`` seconds
    between :func:`reset_peak_memory` and :func:`peak_memory`, and keeps the maximum."""

    def __init__(self, read: Callable[[], int], interval: float = 0.005):
        self.read, self.interval = read, interval
        self.peak = read()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sam3d-mps-peak", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.read())

    def value(self) -> int:
        self.peak = max(self.peak, self.read())
        return self.peak

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


_SAMPLERS: dict = {}


def _mps_allocated() -> int:
    return int(torch.mps.driver_allocated_memory())


def peak_memory(device: torch.device | str) -> int:
    """Peak bytes allocated on ``device`` since the last reset (process peak RSS for the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    if device.type == "mps":
        sampler = _SAMPLERS.get("mps")
        # sampled since reset_peak_memory; without a reset only the current driver allocation is known
        return sampler.value() if sampler is not None else _mps_allocated()
    return peak_rss_bytes()


def reset_peak_memory(device: torch.device | str) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif device.type == "mps" and mps_available():
        start_peak_sampling("mps", _mps_allocated)


def start_peak_sampling(key: str, read: Callable[[], int], interval: float = 0.005) -> None:
    """(Re)start sampling ``read()`` for the peak reported under ``key`` (the MPS peak; tests use a fake)."""
    stop_peak_sampling(key)
    _SAMPLERS[key] = _PeakSampler(read, interval)


def stop_peak_sampling(key: str = "mps") -> Optional[int]:
    """Stop a sampler; returns its peak (None if none ran)."""
    sampler = _SAMPLERS.pop(key, None)
    if sampler is None:
        return None
    peak = sampler.value()
    sampler.stop()
    return peak


# ---- the torch version the MPS path needs (checked where the device is chosen)
MIN_TORCH_FOR_MPS = (2, 7)


def _version_tuple(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except (IndexError, ValueError):
        return (0, 0)


def torch_too_old_for_mps(version: Optional[str] = None) -> Optional[str]:
    """None when ``version`` (default: the installed torch) is new enough for the MPS path, else the message to
    show. Call it where the device is chosen, before any model is built on MPS."""
    version = version or torch.__version__
    if _version_tuple(version) >= MIN_TORCH_FOR_MPS:
        return None
    need = ".".join(map(str, MIN_TORCH_FOR_MPS))
    return (f"PyTorch {version} is too old for Apple MPS: this project needs torch >= {need} on macOS "
            f"(public torch.mps.compile_shader for the Metal kernels, max_pool3d/avg_pool3d on MPS, bicubic "
            f"antialias). Upgrade with `pip install -U \"torch>={need}\"`, or run on the CPU with --device cpu.")


def require_torch_for_mps(version: Optional[str] = None) -> None:
    """Raise RuntimeError with :func:`torch_too_old_for_mps`'s message when torch is too old for MPS."""
    message = torch_too_old_for_mps(version)
    if message:
        raise RuntimeError(message)
