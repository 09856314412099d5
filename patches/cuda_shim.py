"""``.cuda()`` and CUDA autocast for machines without CUDA: they go to the default device instead.

Patched (only when CUDA is absent): ``Tensor.cuda``, ``nn.Module.cuda``, ``torch.autocast("cuda", ...)``,
``torch.cuda.amp.autocast``, ``torch.cuda.synchronize`` and ``torch.cuda.empty_cache`` (they act on the target
device). Not covered: explicit ``device="cuda"`` arguments (``torch.zeros(..., device="cuda")``) and
``torch.cuda.is_available()``, which keeps telling the truth so that code choosing a device can still choose well.
"""
from __future__ import annotations

from typing import Optional

import torch

_ORIGINALS: dict = {}
_TARGET: dict = {}


def _target() -> torch.device:
    return _TARGET["device"]


def _tensor_cuda(self, device=None, non_blocking: bool = False, memory_format=torch.preserve_format):
    return self.to(_target(), non_blocking=non_blocking, memory_format=memory_format)


def _module_cuda(self, device=None):
    return self.to(_target())


def _autocast(device_type, dtype=None, enabled: bool = True, cache_enabled=None):
    import backends

    if str(device_type).startswith("cuda"):
        return backends.device.autocast(_target().type, dtype or torch.float16, enabled=enabled)
    kwargs = {} if cache_enabled is None else {"cache_enabled": cache_enabled}
    return _ORIGINALS["autocast"](device_type, dtype=dtype, enabled=enabled, **kwargs)


def _cuda_amp_autocast(enabled: bool = True, dtype=torch.float16, cache_enabled=None):
    return _autocast("cuda", dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)


def _synchronize(device=None):
    import backends

    backends.device.synchronize(_target())


def _empty_cache():
    import backends

    backends.device.empty_cache(_target())


def install(device: Optional[torch.device | str] = None) -> str:
    """Route CUDA calls to ``device`` (default: ``backends.device.default_device()``). No-op with CUDA present."""
    import backends

    if torch.cuda.is_available():
        return "real"
    _TARGET["device"] = torch.device(device) if device is not None else backends.device.default_device()
    if _ORIGINALS:
        return "shim"
    _ORIGINALS.update(tensor_cuda=torch.Tensor.cuda, module_cuda=torch.nn.Module.cuda, autocast=torch.autocast,
                      amp_autocast=torch.cuda.amp.autocast, synchronize=torch.cuda.synchronize,
                      empty_cache=torch.cuda.empty_cache)
    torch.Tensor.cuda = _tensor_cuda
    torch.nn.Module.cuda = _module_cuda
    torch.autocast = _autocast
    torch.cuda.amp.autocast = _cuda_amp_autocast
    torch.cuda.synchronize = _synchronize
    torch.cuda.empty_cache = _empty_cache
    return "shim"


def uninstall() -> None:
    if not _ORIGINALS:
        return
    torch.Tensor.cuda = _ORIGINALS["tensor_cuda"]
    torch.nn.Module.cuda = _ORIGINALS["module_cuda"]
    torch.autocast = _ORIGINALS["autocast"]
    torch.cuda.amp.autocast = _ORIGINALS["amp_autocast"]
    torch.cuda.synchronize = _ORIGINALS["synchronize"]
    torch.cuda.empty_cache = _ORIGINALS["empty_cache"]
    _ORIGINALS.clear()
