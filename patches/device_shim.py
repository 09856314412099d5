"""Explicit CUDA requests go to the available device (MPS, else CPU) when CUDA is absent.

Why: CUDA-era code hard-codes ``device="cuda"`` in factories and constructors, calls ``.cuda()`` / ``.to("cuda")``,
loads CUDA-saved checkpoints and pins memory. On a machine without CUDA each of these raises. This shim rewrites
the *request*, not the answers: ``torch.cuda.is_available()`` stays False, so code that chooses a device still
chooses well.

Mechanism (installed by :func:`install`, undone by :func:`uninstall`; never on import):

- a ``TorchFunctionMode`` that, for every torch function and Tensor method, replaces a CUDA ``device`` argument
  (``"cuda"``, ``"cuda:1"``, ``torch.device("cuda")``, an int index) by the target device, turns ``Tensor.cuda()``
  into ``.to(target)`` and ``Tensor.pin_memory()`` into a no-op (pinned memory only exists with an accelerator's
  host allocator). ``torch.device("cuda")`` itself stays a CUDA device object (it is a type, not a function); it is
  rewritten wherever it is used. ``nn.Module.to("cuda")`` / ``.cuda()`` go through ``Tensor.to`` and are covered.
- ``torch.load``: a CUDA ``map_location`` (or none, for CUDA-saved tensors) restores CUDA storages on the target.
- ``safetensors.torch.load_file`` / ``safe_open``: a CUDA ``device`` becomes the target (only if safetensors
  imports).
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode

_STATE: dict = {}


def target() -> torch.device:
    """Where CUDA requests go while the shim is installed."""
    return _STATE["target"]


def is_cuda_request(device: Any) -> bool:
    """Whether ``device`` names CUDA (an int means a CUDA index in torch's device arguments)."""
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return False


def redirect(device: Any) -> Any:
    return target() if is_cuda_request(device) else device


def _redirect_to_args(args: tuple) -> tuple:
    # Tensor.to(self, device, ...) / Tensor.to(self, other) / Tensor.to(self, dtype): only a device is rewritten
    if len(args) >= 2 and is_cuda_request(args[1]) and not isinstance(args[1], torch.Tensor):
        return (args[0], target(), *args[2:])
    return args


class CudaRedirectMode(TorchFunctionMode):
    """Rewrites CUDA device requests of torch calls to the target device."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            kwargs.pop("device", None)
            return args[0].to(target(), **kwargs)
        if func is torch.Tensor.pin_memory:
            return args[0]
        if "device" in kwargs:
            kwargs["device"] = redirect(kwargs["device"])
        if func is torch.Tensor.to:
            args = _redirect_to_args(args)
        return func(*args, **kwargs)


def _restore_location(storage, location: str):
    from torch.serialization import default_restore_location

    if location.startswith("cuda"):
        location = str(target())
    return default_restore_location(storage, location)


def _wrap_torch_load(original):
    @functools.wraps(original)
    def load(*args, map_location=None, **kwargs):
        if map_location is None:
            map_location = _restore_location
        elif is_cuda_request(map_location):
            map_location = target()
        elif isinstance(map_location, dict):
            map_location = {k: (str(target()) if is_cuda_request(v) else v) for k, v in map_location.items()}
        return original(*args, map_location=map_location, **kwargs)
    return load


def _redirect_str(device: Any) -> Any:
    return str(target()) if is_cuda_request(device) else device  # safetensors takes device names, not objects


def _wrap_device_kwarg(original, position: int):
    """A callable whose ``device`` argument (keyword, or positional at ``position``) is redirected."""
    @functools.wraps(original)
    def call(*args, **kwargs):
        if len(args) > position:
            args = (*args[:position], _redirect_str(args[position]), *args[position + 1:])
        if "device" in kwargs:
            kwargs["device"] = _redirect_str(kwargs["device"])
        return original(*args, **kwargs)
    return call


def _patch(owner, name: str, value) -> None:
    _STATE["originals"].append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def _patch_safetensors() -> None:
    try:
        import safetensors
        import safetensors.torch as st
    except ImportError:
        return
    _patch(st, "load_file", _wrap_device_kwarg(st.load_file, 1))  # load_file(filename, device="cpu")
    _patch(safetensors, "safe_open", _wrap_device_kwarg(safetensors.safe_open, 2))  # safe_open(f, framework, device)
    if hasattr(st, "safe_open"):
        _patch(st, "safe_open", safetensors.safe_open)


def install(device: Optional[torch.device | str] = None) -> str:
    """Redirect CUDA requests to ``device`` (default: ``backends.device.redirect_target()``: ``$SAM3D_DEVICE`` /
    the default device, else MPS if available, else CPU). "real" when CUDA is present."""
    if torch.cuda.is_available():
        return "real"
    if "mode" in _STATE:
        return "shim"
    import backends  # lazily, as every shim (the device list is backends.device's)
    _STATE["target"] = torch.device(device) if device is not None else backends.device.redirect_target()
    _STATE["originals"] = []
    _patch(torch, "load", _wrap_torch_load(torch.load))
    _patch_safetensors()
    mode = CudaRedirectMode()
    mode.__enter__()
    _STATE["mode"] = mode
    return "shim"


def uninstall() -> None:
    mode = _STATE.pop("mode", None)
    if mode is None:
        return
    mode.__exit__(None, None, None)
    for owner, name, original in reversed(_STATE.pop("originals")):
        setattr(owner, name, original)
