"""Sort, argsort and unique on device data, through one path that avoids the known silent MPS failures.

* MPS ``sort`` / ``argsort`` ignored the strides of non-contiguous inputs (PyTorch issue 175187): every input is
  made contiguous first.
* int64 ``sort`` on MPS returns garbage beyond element 256 on macOS >= 15.4 (PyTorch issue 155560): integer data whose
  range fits in int32 is sorted as int32 (coordinate keys of 64^3 / 256^3 grids always fit), and the first sort
  of each dtype on an MPS device is checked once at run time (a random tensor must come back non-decreasing and
  a permutation); if the check fails, that dtype is sorted on the CPU from then on, with a warning.

Results equal ``torch.sort`` / ``torch.argsort`` / ``torch.unique`` on the same values.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch

# Device types whose sort is checked at run time (the CPU and CUDA kernels are trusted).
CHECKED_DEVICES = ("mps",)
CHECK_LENGTH = 4099  # well beyond the 256 elements after which the MPS int64 bug shows
_TRUSTED: dict = {}  # (device type, dtype) -> whether the device's sort passed the check

_INT32 = torch.iinfo(torch.int32)


def _raw_sort(x: torch.Tensor, stable: bool, descending: bool):
    return torch.sort(x, stable=stable, descending=descending)


def sort_is_trustworthy(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether sorting ``dtype`` on ``device`` gives a correct result (checked once per device type and dtype)."""
    device = torch.device(device)
    if device.type not in CHECKED_DEVICES:
        return True
    key = (device.type, dtype)
    if key not in _TRUSTED:
        g = torch.Generator().manual_seed(0)
        if dtype.is_floating_point:
            probe = torch.randn(CHECK_LENGTH, generator=g).to(dtype)
        else:
            high = min(torch.iinfo(dtype).max, 2 ** 40)
            probe = torch.randint(0, high, (CHECK_LENGTH,), generator=g, dtype=torch.int64).to(dtype)
        values, order = _raw_sort(probe.to(device), stable=True, descending=False)
        values, order = values.cpu(), order.cpu()
        ok = bool((values[1:] >= values[:-1]).all()) and torch.equal(values, probe[order]) and \
            torch.equal(torch.sort(order).values, torch.arange(CHECK_LENGTH))
        _TRUSTED[key] = ok
        if not ok:
            warnings.warn(f"torch.sort of {dtype} on {device.type} returned a wrong result in a self-check "
                          f"(a known MPS bug on some macOS versions); sorting {dtype} on the CPU instead "
                          f"(slower, correct). Please report your macOS and torch versions.",
                          RuntimeWarning, stacklevel=3)
    return _TRUSTED[key]


def _narrowed(x: torch.Tensor) -> torch.Tensor:
    """int64 data whose values fit in int32 as int32 (order-preserving), elsewhere unchanged."""
    if x.dtype != torch.int64 or x.device.type not in CHECKED_DEVICES or x.numel() == 0:
        return x
    low, high = int(x.min()), int(x.max())
    return x.to(torch.int32) if _INT32.min <= low and high <= _INT32.max else x


def sort(x: torch.Tensor, dim: int = -1, descending: bool = False, stable: bool = False):
    """``torch.sort`` (values, indices) that is correct on every device (see the module docstring)."""
    x = x.contiguous()
    if x.dim() != 1:
        if not sort_is_trustworthy(x.device, x.dtype):
            values, order = torch.sort(x.cpu(), dim=dim, descending=descending, stable=stable)
            return values.to(x.device), order.to(x.device)
        return torch.sort(x, dim=dim, descending=descending, stable=stable)
    keys = _narrowed(x)
    if not sort_is_trustworthy(keys.device, keys.dtype):
        values, order = _raw_sort(keys.cpu(), stable=stable, descending=descending)
        values, order = values.to(x.device), order.to(x.device)
    else:
        values, order = _raw_sort(keys, stable=stable, descending=descending)
    return values.to(x.dtype), order


def argsort(x: torch.Tensor, dim: int = -1, descending: bool = False, stable: bool = False) -> torch.Tensor:
    """``torch.argsort`` through :func:`sort`."""
    return sort(x, dim=dim, descending=descending, stable=stable)[1]


def unique(x: torch.Tensor, sorted: bool = True, return_inverse: bool = False, return_counts: bool = False,
           dim: Optional[int] = None):
    """``torch.unique`` (always sorted) that is correct on every device: flat data go through :func:`sort`
    (so the int32 narrowing and the runtime check apply); ``dim=`` unique runs on the CPU where the sort of
    that dtype failed the check."""
    x = x.contiguous()
    if x.device.type not in CHECKED_DEVICES:
        return torch.unique(x, sorted=True, return_inverse=return_inverse, return_counts=return_counts, dim=dim)
    if dim is not None:
        if sort_is_trustworthy(x.device, x.dtype):
            return torch.unique(x, sorted=True, return_inverse=return_inverse, return_counts=return_counts, dim=dim)
        out = torch.unique(x.cpu(), sorted=True, return_inverse=return_inverse, return_counts=return_counts, dim=dim)
        return tuple(t.to(x.device) for t in out) if isinstance(out, tuple) else out.to(x.device)
    flat = x.reshape(-1)
    values, order = sort(flat)
    if flat.numel():
        starts = torch.ones_like(values, dtype=torch.bool)
        starts[1:] = values[1:] != values[:-1]
    else:
        starts = torch.zeros_like(values, dtype=torch.bool)
    uniques = values[starts]
    result = [uniques]
    if return_inverse:
        group = torch.cumsum(starts.to(torch.int64), 0) - 1
        inverse = torch.empty_like(group)
        inverse[order] = group
        result.append(inverse.reshape(x.shape))
    if return_counts:
        bounds = torch.nonzero(starts).flatten()
        ends = torch.cat([bounds[1:], bounds.new_tensor([flat.numel()])])
        result.append(ends - bounds)
    return result[0] if len(result) == 1 else tuple(result)
