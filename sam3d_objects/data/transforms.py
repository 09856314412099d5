"""Torchvision-equivalent image transforms used by the official ``pipeline.yaml``.

The released ``pipeline.yaml`` names ``torchvision.transforms.Compose`` and ``torchvision.transforms.Resize``.
torchvision is optional for this project (its only builds for recent torch are CUDA builds that fail to load on
CPU-only torch), so these classes reproduce exactly what torchvision 0.20 does on *tensors*:

* ``Resize(size, interpolation=BILINEAR, max_size=None, antialias=True)``: an ``int`` size resizes the shorter
  edge to ``size`` and the longer one to ``int(size * long / short)``; bilinear/bicubic use
  ``F.interpolate(..., align_corners=False, antialias=antialias)``; nearest uses torch's legacy ``"nearest"`` mode
  (not ``nearest-exact``), exactly as torchvision does. Integer inputs are resized in float and rounded back.
* ``interpolation`` accepts an ``InterpolationMode`` or torchvision's legacy integer codes
  (0 nearest, 2 bilinear, 3 bicubic), as the yaml writes ``interpolation: 0``.

How the yaml's ``torchvision.transforms.*`` targets reach these classes: ``safe_instantiate`` remaps them here
when the real torchvision does not import (sam3d_objects/config/instantiate.py).
"""
from __future__ import annotations

import enum
from typing import Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F

__all__ = ["Compose", "Resize", "InterpolationMode"]


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


# torchvision's legacy integer codes (PIL's resampling constants)
_LEGACY_INT_MODES = {0: InterpolationMode.NEAREST, 2: InterpolationMode.BILINEAR, 3: InterpolationMode.BICUBIC,
                     4: InterpolationMode.BOX, 5: InterpolationMode.HAMMING, 1: InterpolationMode.LANCZOS}


def _as_mode(interpolation) -> InterpolationMode:
    if isinstance(interpolation, InterpolationMode):
        return interpolation
    if isinstance(interpolation, int):
        return _LEGACY_INT_MODES[interpolation]
    if isinstance(interpolation, str):
        return InterpolationMode(interpolation.lower())
    # a real torchvision InterpolationMode (other enum class) maps by value
    return InterpolationMode(getattr(interpolation, "value", interpolation))


class Compose:
    """Apply ``transforms`` one after the other."""

    def __init__(self, transforms: Sequence[Callable]):
        self.transforms = list(transforms)

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x

    def __repr__(self) -> str:
        inner = "".join(f"\n    {t}" for t in self.transforms)
        return f"{type(self).__name__}({inner}\n)"


def output_size(height: int, width: int, size: Union[int, Sequence[int]], max_size: Optional[int] = None):
    """Target (h, w) following torchvision's rule (shorter edge = size for an int or 1-element size)."""
    if isinstance(size, (list, tuple)) and len(size) == 2:
        return int(size[0]), int(size[1])
    size = int(size[0] if isinstance(size, (list, tuple)) else size)
    short, long = (height, width) if height <= width else (width, height)
    new_short, new_long = size, int(size * long / short)
    if max_size is not None:
        if max_size <= size:
            raise ValueError(f"max_size ({max_size}) must be larger than size ({size})")
        if new_long > max_size:
            new_short, new_long = int(max_size * new_short / new_long), max_size
    return (new_short, new_long) if height <= width else (new_long, new_short)


def resize(img: torch.Tensor, size, interpolation=InterpolationMode.BILINEAR, max_size: Optional[int] = None,
           antialias: Optional[bool] = True) -> torch.Tensor:
    """Resize a ``[..., H, W]`` tensor as torchvision's functional ``resize`` does."""
    if not isinstance(img, torch.Tensor):
        raise TypeError(f"Resize expects a torch.Tensor [..., H, W], got {type(img).__name__}; convert PIL images "
                        f"or arrays with torch.from_numpy(...).permute(2, 0, 1) first")
    mode = _as_mode(interpolation)
    h, w = img.shape[-2:]
    new_h, new_w = output_size(h, w, size, max_size)
    if (new_h, new_w) == (h, w):
        return img
    if mode not in (InterpolationMode.NEAREST, InterpolationMode.NEAREST_EXACT, InterpolationMode.BILINEAR,
                    InterpolationMode.BICUBIC):
        raise ValueError(f"interpolation {mode} is only supported for PIL images by torchvision; use nearest, "
                         f"bilinear or bicubic for tensors")
    lead = img.shape[:-2]
    x = img.reshape(-1, 1, h, w)  # every channel is resized independently
    out_dtype = x.dtype
    if not x.is_floating_point():
        x = x.float()
    kwargs = {}
    if mode in (InterpolationMode.BILINEAR, InterpolationMode.BICUBIC):
        kwargs = {"align_corners": False, "antialias": bool(antialias)}
    y = F.interpolate(x, size=(new_h, new_w), mode=mode.value, **kwargs)
    if not torch.empty((), dtype=out_dtype).is_floating_point():
        if mode in (InterpolationMode.BILINEAR, InterpolationMode.BICUBIC):
            y = y.round()
        info = torch.iinfo(out_dtype) if out_dtype != torch.bool else None
        y = (y > 0.5) if info is None else y.clamp(info.min, info.max).to(out_dtype)
    return y.reshape(*lead, new_h, new_w)


class Resize(torch.nn.Module):
    """``torchvision.transforms.Resize`` for tensors (same arguments, same output)."""

    def __init__(self, size, interpolation=InterpolationMode.BILINEAR, max_size: Optional[int] = None,
                 antialias: Optional[bool] = True):
        super().__init__()
        self.size = size
        self.interpolation = _as_mode(interpolation)
        self.max_size = max_size
        self.antialias = antialias

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        return resize(img, self.size, self.interpolation, self.max_size, self.antialias)

    def extra_repr(self) -> str:
        return f"size={self.size}, interpolation={self.interpolation.value}, max_size={self.max_size}, " \
               f"antialias={self.antialias}"
