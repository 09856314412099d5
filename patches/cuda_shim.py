"""``torch.cuda`` queries and CUDA autocast that do not crash code which only logs, sizes or syncs.

Why: CUDA-era code calls ``torch.cuda.current_device()`` / ``get_device_name()`` in log lines and import-time
probes, ``set_device`` / ``synchronize`` around work, and wraps blocks in ``torch.autocast("cuda")``. Without CUDA
most of these raise "Torch not compiled with CUDA enabled". The answers stay truthful where they decide anything:
``is_available()`` is False and ``device_count()`` is 0 (left unpatched), memory counters are 0, the capability is
(0, 0); the device name and properties describe the machine the work really runs on.

Patched by :func:`install` (only where CUDA is absent; undone by :func:`uninstall`):
``current_device`` (0), ``set_device`` (no-op), ``get_device_name``, ``get_device_properties``,
``get_device_capability``, ``mem_get_info`` (host memory), ``synchronize`` / ``empty_cache`` (act on the target
device), ``reset_peak_memory_stats`` (no-op) - for callers outside torch: torch's own probes (inductor asks
``get_device_properties`` and relies on it raising) keep the original behaviour; ``torch.autocast`` /
``torch.amp.autocast`` / ``torch.cuda.amp.autocast`` with a CUDA device type become the target device's autocast
where that device supports the dtype (``backends.device.autocast_supported``), else a disabled autocast.
``torch.backends.cuda.enable_*_sdp`` and ``torch.backends.cuda.matmul.allow_tf32`` only set flags and need nothing.
"""
from __future__ import annotations

import functools
import os
import sys
import types
from typing import Optional

import torch

_STATE: dict = {}


def _target() -> torch.device:
    return _STATE["target"]


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _current_device() -> int:
    return 0


def _set_device(device) -> None:
    return None


def _get_device_name(device=None) -> str:
    return f"{_target().type} (no CUDA; torch.cuda queries answered by sam3d patches)"


def _get_device_properties(device=None):
    return types.SimpleNamespace(name=_get_device_name(), total_memory=_host_memory(), major=0, minor=0,
                                 multi_processor_count=os.cpu_count() or 1, is_integrated=True,
                                 is_multi_gpu_board=False)


def _get_device_capability(device=None) -> tuple:
    return (0, 0)


def _mem_get_info(device=None) -> tuple:
    total = _host_memory()
    try:
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        free = total
    return free, total


def _synchronize(device=None) -> None:
    if _target().type == "mps":
        torch.mps.synchronize()


def _empty_cache() -> None:
    if _target().type == "mps":
        torch.mps.empty_cache()


def _reset_peak_memory_stats(device=None) -> None:
    return None


def _make_autocast(original):
    class autocast(original):  # noqa: N801  the name code sees in reprs and error messages
        """``torch.autocast``; a CUDA device type means the target device (disabled where it cannot autocast)."""

        def __init__(self, device_type: str, dtype: Optional[torch.dtype] = None, enabled: bool = True,
                     cache_enabled: Optional[bool] = None):
            if str(device_type).split(":")[0] == "cuda":
                from backends.device import autocast_supported

                device_type, dtype = _target().type, dtype or torch.float16
                enabled = enabled and autocast_supported(device_type, dtype)
            super().__init__(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    autocast.__qualname__ = "autocast"
    return autocast


def _cuda_amp_autocast_factory(autocast_cls):
    def cuda_amp_autocast(enabled: bool = True, dtype: torch.dtype = torch.float16, cache_enabled: bool = True):
        return autocast_cls("cuda", dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
    return cuda_amp_autocast


def _from_torch(depth: int = 2) -> bool:
    """Whether the caller is torch itself: its probes (e.g. inductor's cache key) rely on the CUDA queries raising
    without CUDA, so they keep getting the original behaviour."""
    name = sys._getframe(depth).f_globals.get("__name__", "")
    return name == "torch" or name.startswith("torch.")


def _for_user_code(name: str, replacement):
    original = getattr(torch.cuda, name)

    @functools.wraps(replacement)
    def query(*args, **kwargs):
        if _from_torch():
            return original(*args, **kwargs)
        return replacement(*args, **kwargs)
    return query


def _patch(owner, name: str, value) -> None:
    _STATE["originals"].append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def install(device: Optional[torch.device | str] = None) -> str:
    """Answer CUDA queries for ``device`` (default: ``backends.device.redirect_target()``: ``$SAM3D_DEVICE`` /
    the default device, else MPS if available, else CPU). "real" when CUDA is present."""
    if torch.cuda.is_available():
        return "real"
    if "originals" in _STATE:
        return "shim"
    import backends  # lazily, as every shim (the device list is backends.device's)
    _STATE["target"] = torch.device(device) if device is not None else backends.device.redirect_target()
    _STATE["originals"] = []
    cuda = torch.cuda
    for name, fn in (("current_device", _current_device), ("set_device", _set_device),
                     ("get_device_name", _get_device_name), ("get_device_properties", _get_device_properties),
                     ("get_device_capability", _get_device_capability), ("mem_get_info", _mem_get_info),
                     ("synchronize", _synchronize), ("empty_cache", _empty_cache),
                     ("reset_peak_memory_stats", _reset_peak_memory_stats)):
        _patch(cuda, name, _for_user_code(name, fn))
    autocast_cls = _make_autocast(torch.amp.autocast_mode.autocast)
    _patch(torch, "autocast", autocast_cls)
    _patch(torch.amp, "autocast", autocast_cls)
    _patch(torch.cuda.amp, "autocast", _cuda_amp_autocast_factory(autocast_cls))
    return "shim"


def uninstall() -> None:
    for owner, name, original in reversed(_STATE.pop("originals", [])):
        setattr(owner, name, original)
    _STATE.pop("target", None)
