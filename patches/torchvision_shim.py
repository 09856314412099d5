"""torchvision for third-party CUDA-era code: keep a working one, repair a broken one, stand in for a missing one.

Why: torchvision's only builds for recent torch on Linux are CUDA builds. On a CPU-only torch their C++ extension
does not load, and ``import torchvision`` then dies in ``_meta_registrations`` with "operator torchvision::nms
does not exist", although almost all of torchvision (transforms, ``ops.masks_to_boxes``, datasets) is pure Python.

:func:`install` acts in three cases, and is independent of ``sam3d_objects`` (it must work whichever
``sam3d_objects`` is on the path):

- torchvision imports: nothing is changed ("torchvision").
- torchvision is installed but its extension is broken: the operator schemas its import registers fakes for
  (``torchvision::nms``, ``torchvision::qnms``) are defined in a ``torch.library`` fragment, with a pure-PyTorch
  ``nms`` kernel (greedy, like the C++ one) so ``torchvision.ops.nms`` / ``batched_nms`` compute; the real
  torchvision then imports and is used ("torchvision"; :func:`repaired` says True). Other compiled ops
  (``roi_align``, ``deform_conv2d``, ...) still raise torch's "operator does not exist" error when called.
- torchvision is absent: placeholder ``torchvision``, ``torchvision.transforms`` and
  ``torchvision.transforms.functional`` modules provide ``Compose``, ``Resize``, ``Normalize``, ``CenterCrop``,
  ``RandomResizedCrop``, ``Lambda``, ``InterpolationMode`` and ``functional.resize / crop / center_crop /
  normalize / resized_crop`` on tensors [..., H, W] ("shim"). Any other attribute raises an error naming
  torchvision.
"""
from __future__ import annotations

import enum
import importlib
import importlib.machinery
import math
import sys
from typing import Callable, List, Optional, Sequence

import torch
import torch.nn.functional as F

from ._modules import SHIM_FLAG, ShimModule, drop

_STATE: dict = {"result": None, "library": None}


# ----------------------------------------------------------------------------------------------- repair: schemas
def nms_kernel(dets: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """Greedy non-maximum suppression: indices of kept boxes (x0, y0, x1, y1), by decreasing score."""
    if dets.numel() == 0:
        return torch.empty(0, dtype=torch.long, device=dets.device)
    order = torch.argsort(scores, descending=True, stable=True)
    boxes = dets[order]
    area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    lt = torch.maximum(boxes[:, None, :2], boxes[None, :, :2])
    rb = torch.minimum(boxes[:, None, 2:], boxes[None, :, 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    iou = inter / (area[:, None] + area[None, :] - inter)
    overlaps = (iou > iou_threshold).cpu()
    suppressed = torch.zeros(len(order), dtype=torch.bool)
    keep: List[int] = []
    for i in range(len(order)):  # greedy by construction: each kept box suppresses the lower-scored overlaps
        if suppressed[i]:
            continue
        keep.append(i)
        suppressed |= overlaps[i]
    return order[torch.tensor(keep, dtype=torch.long, device=dets.device)]


def _qnms_kernel(dets, scores, iou_threshold):
    raise NotImplementedError("torchvision::qnms (quantized nms) is not provided by the sam3d patches repair of a "
                              "broken torchvision build; install a torchvision matching your torch")


def _define_schemas() -> None:
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for name, kernel in (("nms", nms_kernel), ("qnms", _qnms_kernel)):
        lib.define(f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        lib.impl(name, kernel, "CompositeExplicitAutograd")
    _STATE["library"] = lib


def _missing_schema(error: BaseException) -> bool:
    return "torchvision::" in str(error) and "does not exist" in str(error)


# ---------------------------------------------------------------------------------------- stand-in: transforms
class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"


def _hw(img) -> tuple:
    if isinstance(img, torch.Tensor):
        return int(img.shape[-2]), int(img.shape[-1])
    return img.size[1], img.size[0]  # PIL: (width, height)


def _output_size(h: int, w: int, size, max_size: Optional[int]) -> tuple:
    if isinstance(size, (list, tuple)) and len(size) == 2:
        return int(size[0]), int(size[1])
    edge = int(size[0] if isinstance(size, (list, tuple)) else size)
    short, long = (h, w) if h <= w else (w, h)
    new_short, new_long = edge, int(edge * long / short)
    if max_size is not None:
        if max_size <= edge:
            raise ValueError(f"max_size ({max_size}) must be larger than size ({edge})")
        if new_long > max_size:
            new_short, new_long = int(max_size * new_short / new_long), max_size
    return (new_short, new_long) if h <= w else (new_long, new_short)


# torchvision's legacy integer codes (PIL's resampling constants), as configs write ``interpolation: 0``
_LEGACY_CODES = {0: "nearest", 2: "bilinear", 3: "bicubic"}


def _mode(interpolation) -> InterpolationMode:
    if isinstance(interpolation, int) and not isinstance(interpolation, bool):
        if interpolation not in _LEGACY_CODES:
            raise NotImplementedError(f"torchvision stand-in: interpolation code {interpolation} is not provided "
                                      "(0 nearest, 2 bilinear, 3 bicubic)")
        return InterpolationMode(_LEGACY_CODES[interpolation])
    value = getattr(interpolation, "value", interpolation)  # ours, or a real torchvision enum
    return InterpolationMode(value.lower() if isinstance(value, str) else value)


def resize(img, size, interpolation=InterpolationMode.BILINEAR, max_size: Optional[int] = None, antialias=True):
    """torchvision.transforms.functional.resize: an int ``size`` matches the shorter edge, keeping the aspect;
    every channel is resized on its own; integer images are resized in float and rounded back."""
    mode = _mode(interpolation)
    h, w = _hw(img)
    out_h, out_w = _output_size(h, w, size, max_size)
    if not isinstance(img, torch.Tensor):
        from PIL import Image

        pil = {InterpolationMode.NEAREST: Image.NEAREST, InterpolationMode.NEAREST_EXACT: Image.NEAREST,
               InterpolationMode.BILINEAR: Image.BILINEAR, InterpolationMode.BICUBIC: Image.BICUBIC}[mode]
        return img.resize((out_w, out_h), pil)
    if (out_h, out_w) == (h, w):
        return img
    x = img.reshape(-1, 1, h, w)
    dtype = x.dtype
    x = x if x.is_floating_point() else x.float()
    smooth = mode in (InterpolationMode.BILINEAR, InterpolationMode.BICUBIC)
    kwargs = {"align_corners": False, "antialias": bool(antialias)} if smooth else {}
    y = F.interpolate(x, size=(out_h, out_w), mode=mode.value, **kwargs)
    if dtype == torch.bool:
        y = y > 0.5
    elif not dtype.is_floating_point:
        y = (y.round() if smooth else y).clamp(torch.iinfo(dtype).min, torch.iinfo(dtype).max).to(dtype)
    return y.reshape(*img.shape[:-2], out_h, out_w)


def crop(img, top: int, left: int, height: int, width: int):
    """Crop [top, top + height) x [left, left + width); outside the image is zero (as torchvision pads)."""
    if not isinstance(img, torch.Tensor):
        return img.crop((left, top, left + width, top + height))
    h, w = _hw(img)
    out = img.new_zeros((*img.shape[:-2], height, width))
    y0, y1, x0, x1 = max(top, 0), min(top + height, h), max(left, 0), min(left + width, w)
    if y1 > y0 and x1 > x0:
        out[..., y0 - top:y1 - top, x0 - left:x1 - left] = img[..., y0:y1, x0:x1]
    return out


def center_crop(img, output_size):
    th, tw = (output_size, output_size) if isinstance(output_size, int) else \
        (output_size[0], output_size[-1])
    h, w = _hw(img)
    return crop(img, int(round((h - th) / 2.0)), int(round((w - tw) / 2.0)), th, tw)


def normalize(tensor: torch.Tensor, mean: Sequence[float], std: Sequence[float], inplace: bool = False):
    mean_t = torch.as_tensor(mean, dtype=tensor.dtype, device=tensor.device).view(-1, 1, 1)
    std_t = torch.as_tensor(std, dtype=tensor.dtype, device=tensor.device).view(-1, 1, 1)
    return tensor.sub_(mean_t).div_(std_t) if inplace else (tensor - mean_t) / std_t


def resized_crop(img, top: int, left: int, height: int, width: int, size,
                 interpolation=InterpolationMode.BILINEAR, antialias=True):
    return resize(crop(img, top, left, height, width), size, interpolation, antialias=antialias)


class Compose:
    def __init__(self, transforms: Sequence[Callable]):
        self.transforms = list(transforms)

    def __call__(self, img):
        for transform in self.transforms:
            img = transform(img)
        return img


class _Module(torch.nn.Module):
    pass


class Resize(_Module):
    def __init__(self, size, interpolation=InterpolationMode.BILINEAR, max_size=None, antialias=True):
        super().__init__()
        self.size, self.interpolation, self.max_size, self.antialias = size, _mode(interpolation), max_size, antialias

    def forward(self, img):
        return resize(img, self.size, self.interpolation, self.max_size, self.antialias)


class CenterCrop(_Module):
    def __init__(self, size):
        super().__init__()
        self.size = size

    def forward(self, img):
        return center_crop(img, self.size)


class Normalize(_Module):
    def __init__(self, mean, std, inplace: bool = False):
        super().__init__()
        self.mean, self.std, self.inplace = mean, std, inplace

    def forward(self, tensor):
        return normalize(tensor, self.mean, self.std, self.inplace)


class Lambda:
    def __init__(self, lambd: Callable):
        self.lambd = lambd

    def __call__(self, img):
        return self.lambd(img)


class RandomResizedCrop(_Module):
    """A random crop of ``scale`` area fraction and ``ratio`` aspect (10 tries, then a centred crop), resized."""

    def __init__(self, size, scale=(0.08, 1.0), ratio=(3.0 / 4.0, 4.0 / 3.0),
                 interpolation=InterpolationMode.BILINEAR, antialias=True):
        super().__init__()
        self.size = (size, size) if isinstance(size, int) else tuple(size)
        self.scale, self.ratio, self.interpolation, self.antialias = scale, ratio, interpolation, antialias

    @staticmethod
    def get_params(img, scale, ratio) -> tuple:
        h, w = _hw(img)
        area = h * w
        log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
        for _ in range(10):
            target = area * float(torch.empty(1).uniform_(scale[0], scale[1]))
            aspect = math.exp(float(torch.empty(1).uniform_(*log_ratio)))
            cw, ch = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
            if 0 < cw <= w and 0 < ch <= h:
                top = int(torch.randint(0, h - ch + 1, (1,)))
                left = int(torch.randint(0, w - cw + 1, (1,)))
                return top, left, ch, cw
        aspect = w / h
        if aspect < min(ratio):
            cw, ch = w, int(round(w / min(ratio)))
        elif aspect > max(ratio):
            ch, cw = h, int(round(h * max(ratio)))
        else:
            cw, ch = w, h
        return (h - ch) // 2, (w - cw) // 2, ch, cw

    def forward(self, img):
        top, left, h, w = self.get_params(img, self.scale, self.ratio)
        return resized_crop(img, top, left, h, w, self.size, self.interpolation, self.antialias)


def _placeholder(name: str, doc: str, **attrs) -> ShimModule:
    mod = ShimModule(name, doc)
    setattr(mod, SHIM_FLAG, True)
    mod.__path__ = []
    # a spec, so importlib.util.find_spec() on the placeholder answers instead of raising ValueError
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    for key, value in attrs.items():
        setattr(mod, key, value)
    return mod


def _register_placeholder() -> None:
    functional = _placeholder("torchvision.transforms.functional", __doc__, resize=resize, crop=crop,
                              center_crop=center_crop, normalize=normalize, resized_crop=resized_crop,
                              InterpolationMode=InterpolationMode)
    transforms = _placeholder("torchvision.transforms", __doc__, Compose=Compose, Resize=Resize,
                              Normalize=Normalize, CenterCrop=CenterCrop, RandomResizedCrop=RandomResizedCrop,
                              Lambda=Lambda, InterpolationMode=InterpolationMode, functional=functional)
    root = _placeholder("torchvision", __doc__, transforms=transforms, __version__="0.0+sam3d-shim")
    for mod in (root, transforms, functional):
        sys.modules[mod.__name__] = mod


# ------------------------------------------------------------------------------------------------ install
def _try_import() -> Optional[BaseException]:
    try:
        importlib.import_module("torchvision")
        importlib.import_module("torchvision.transforms")
        return None
    except Exception as error:  # noqa: BLE001  a broken CUDA build raises RuntimeError/OSError, not ImportError
        drop("torchvision")
        return error


def repaired() -> bool:
    """Whether :func:`install` defined missing torchvision operator schemas (a broken build was repaired)."""
    return _STATE["library"] is not None


def install() -> str:
    """"torchvision" when the real package is used (as is, or repaired), "shim" for the placeholder."""
    if _STATE["result"] is not None:
        return _STATE["result"]
    current = sys.modules.get("torchvision")
    if current is not None and not getattr(current, SHIM_FLAG, False):
        _STATE["result"] = "torchvision"
        return "torchvision"
    error = _try_import()
    if error is not None and _missing_schema(error) and _STATE["library"] is None:
        _define_schemas()
        error = _try_import()
        if error is not None:  # the repair did not help: leave torch's operator table as it was
            _STATE["library"]._destroy()
            _STATE["library"] = None
    if error is None:
        _STATE["result"] = "torchvision"
        return "torchvision"
    _register_placeholder()
    _STATE["result"] = "shim"
    return "shim"


def uninstall() -> None:
    """Remove the placeholder or the repair (a repaired torchvision is dropped from ``sys.modules`` too)."""
    if _STATE["library"] is not None:
        drop("torchvision")
        _STATE["library"]._destroy()
        _STATE["library"] = None
    drop("torchvision", only_shims=True)
    _STATE["result"] = None
