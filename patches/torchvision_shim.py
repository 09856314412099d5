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
- torchvision is absent: placeholder ``torchvision``, ``torchvision.transforms``,
  ``torchvision.transforms.functional`` and ``torchvision.ops`` (+ ``ops.misc``, ``ops.boxes``) modules provide
  ``Compose``, ``Resize``, ``Normalize``, ``CenterCrop``, ``RandomResizedCrop``, ``Lambda``, ``ColorJitter``,
  ``GaussianBlur``, ``RandomApply``, ``InterpolationMode``, ``functional.resize / crop / center_crop / normalize /
  resized_crop / gaussian_blur / adjust_brightness / adjust_contrast / adjust_saturation / adjust_hue /
  rgb_to_grayscale / get_image_size / _get_image_size`` on tensors [..., C, H, W], and ``ops.misc.FrozenBatchNorm2d``
  (timm needs it), ``ops.nms / batched_nms / box_iou / box_area / masks_to_boxes`` ("shim"), with torchvision's
  semantics and its random draws in the same order (so a seeded run draws the same factors). Any other attribute
  raises an error naming torchvision.

In the first two cases, names a recent torchvision dropped but older research code still calls
(``transforms.functional._get_image_size``) are added as aliases of their public successors.
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

_STATE: dict = {"result": None, "library": None, "aliases": []}


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
    BOX = "box"  # PIL-only filters (torchvision resizes tensors only with the four above)
    HAMMING = "hamming"
    LANCZOS = "lanczos"


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
               InterpolationMode.BILINEAR: Image.BILINEAR, InterpolationMode.BICUBIC: Image.BICUBIC,
               InterpolationMode.BOX: Image.BOX, InterpolationMode.HAMMING: Image.HAMMING,
               InterpolationMode.LANCZOS: Image.LANCZOS}[mode]
        return img.resize((out_w, out_h), pil)
    if (out_h, out_w) == (h, w):
        return img
    if mode in (InterpolationMode.BOX, InterpolationMode.HAMMING, InterpolationMode.LANCZOS):
        raise ValueError(f"Input image tensor: interpolation {mode} is only supported for PIL images")
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


def get_image_size(img) -> List[int]:
    """[width, height] of a tensor [..., H, W] or a PIL image."""
    h, w = _hw(img)
    return [w, h]


def _get_image_size(img) -> List[int]:
    """torchvision's former private name of :func:`get_image_size` (still called by older research code)."""
    return get_image_size(img)


def _float(img: torch.Tensor) -> tuple:
    """(float image, the integer dtype to return to or None, the largest channel value)."""
    if img.is_floating_point():
        return img, None, 1.0
    return img.float(), img.dtype, float(torch.iinfo(img.dtype).max)


def _back(img: torch.Tensor, dtype, bound: float, rounded: bool = False) -> torch.Tensor:
    """Back to the input's integer dtype: truncated like torchvision's blends (rounded for its filters)."""
    if dtype is None:
        return img
    return (img.round() if rounded else img).clamp(0, bound).to(dtype)


def _gaussian_kernel1d(size: int, sigma: float, dtype, device) -> torch.Tensor:
    half = (size - 1) * 0.5
    x = torch.linspace(-half, half, size, dtype=dtype, device=device)
    pdf = torch.exp(-0.5 * (x / sigma) ** 2)
    return pdf / pdf.sum()


def gaussian_blur(img: torch.Tensor, kernel_size, sigma=None) -> torch.Tensor:
    """Separable gaussian blur of [..., C, H, W]: ``kernel_size`` (odd, int or [kx, ky]: x is the width axis),
    ``sigma`` (float or [sx, sy]; default 0.3 ((k - 1) / 2 - 1) + 0.8 per axis), reflect padding."""
    ks = [kernel_size, kernel_size] if isinstance(kernel_size, int) else list(kernel_size)
    if len(ks) == 1:
        ks = [ks[0], ks[0]]
    if any(k <= 0 or k % 2 == 0 for k in ks):
        raise ValueError(f"kernel_size should have odd and positive integers, got {kernel_size}")
    if sigma is None:
        sg = [0.3 * ((k - 1) * 0.5 - 1) + 0.8 for k in ks]
    else:
        sg = [float(sigma)] * 2 if isinstance(sigma, (int, float)) else [float(v) for v in sigma]
        sg = sg * 2 if len(sg) == 1 else sg
    if any(v <= 0 for v in sg):
        raise ValueError(f"sigma should have positive values, got {sigma}")
    x, dtype, bound = _float(img)
    shape = x.shape
    flat = x.reshape(-1, 1, shape[-2], shape[-1])
    kx = _gaussian_kernel1d(ks[0], sg[0], flat.dtype, flat.device)
    ky = _gaussian_kernel1d(ks[1], sg[1], flat.dtype, flat.device)
    flat = F.pad(flat, [ks[0] // 2, ks[0] // 2, ks[1] // 2, ks[1] // 2], mode="reflect")
    flat = F.conv2d(flat, kx.view(1, 1, 1, -1))
    flat = F.conv2d(flat, ky.view(1, 1, -1, 1))
    return _back(flat.reshape(shape), dtype, bound, rounded=True)


def rgb_to_grayscale(img: torch.Tensor, num_output_channels: int = 1) -> torch.Tensor:
    """ITU-R 601-2 luma (0.2989 R + 0.587 G + 0.114 B) of [..., 3, H, W]."""
    x, dtype, bound = _float(img)
    r, g, b = x.unbind(-3)
    gray = (0.2989 * r + 0.587 * g + 0.114 * b).unsqueeze(-3)
    if num_output_channels == 3:
        gray = gray.expand(x.shape)
    return _back(gray, dtype, bound)


def _blend(a: torch.Tensor, b: torch.Tensor, ratio: float, bound: float) -> torch.Tensor:
    return (ratio * a + (1.0 - ratio) * b).clamp(0, bound)


def adjust_brightness(img: torch.Tensor, brightness_factor: float) -> torch.Tensor:
    x, dtype, bound = _float(img)
    return _back(_blend(x, torch.zeros_like(x), brightness_factor, bound), dtype, bound)


def adjust_contrast(img: torch.Tensor, contrast_factor: float) -> torch.Tensor:
    """Blend with the mean grey level of the image (per image, over channels, rows and columns)."""
    x, dtype, bound = _float(img)
    # an integer image's grey levels are truncated to its dtype before averaging, as torchvision does
    gray = (rgb_to_grayscale(img) if img.shape[-3] == 3 else img).to(x.dtype)
    mean = gray.mean(dim=(-3, -2, -1), keepdim=True)
    return _back(_blend(x, mean, contrast_factor, bound), dtype, bound)


def adjust_saturation(img: torch.Tensor, saturation_factor: float) -> torch.Tensor:
    x, dtype, bound = _float(img)
    if x.shape[-3] == 1:
        return img
    gray = rgb_to_grayscale(img).to(x.dtype)  # an integer image's grey is truncated first, as torchvision does
    return _back(_blend(x, gray, saturation_factor, bound), dtype, bound)


def _rgb_to_hsv(img: torch.Tensor) -> torch.Tensor:
    r, g, b = img.unbind(-3)
    maxc, minc = img.amax(-3), img.amin(-3)
    delta = maxc - minc
    same = maxc == minc
    s = delta / torch.where(same, torch.ones_like(maxc), maxc)
    d = torch.where(same, torch.ones_like(delta), delta)
    rc, gc, bc = (maxc - r) / d, (maxc - g) / d, (maxc - b) / d
    h = torch.where(maxc == r, bc - gc, torch.where(maxc == g, 2.0 + rc - bc, 4.0 + gc - rc))
    h = torch.fmod(h / 6.0 + 1.0, 1.0)
    h = torch.where(same, torch.zeros_like(h), h)
    return torch.stack([h, s, maxc], -3)


def _hsv_to_rgb(img: torch.Tensor) -> torch.Tensor:
    h, s, v = img.unbind(-3)
    sector = torch.floor(h * 6.0)
    f = h * 6.0 - sector
    sector = sector.long() % 6
    p, q, t = v * (1.0 - s), v * (1.0 - s * f), v * (1.0 - s * (1.0 - f))
    table = torch.stack([torch.stack(c, -3) for c in ((v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v),
                                                     (v, p, q))], 0)  # [6, ..., 3, H, W]
    index = sector.unsqueeze(-3).expand(v.shape[:-2] + (3,) + v.shape[-2:]).unsqueeze(0)
    return torch.gather(table, 0, index)[0]


def adjust_hue(img: torch.Tensor, hue_factor: float) -> torch.Tensor:
    """Shift the hue by ``hue_factor`` (in [-0.5, 0.5], a fraction of the colour circle) in HSV space."""
    if not -0.5 <= hue_factor <= 0.5:
        raise ValueError(f"hue_factor ({hue_factor}) is not in [-0.5, 0.5].")
    x, dtype, bound = _float(img)
    if x.shape[-3] == 1:
        return img
    hsv = _rgb_to_hsv(x / bound)
    h = torch.remainder(hsv[..., 0, :, :] + hue_factor, 1.0)
    rgb = _hsv_to_rgb(torch.stack([h, hsv[..., 1, :, :], hsv[..., 2, :, :]], -3))
    # float -> integer as torchvision converts image dtypes: scale by (max + 1 - 1e-3), truncate
    return rgb if dtype is None else (rgb * (bound + 1.0 - 1e-3)).to(dtype)


def pil_to_tensor(pic) -> torch.Tensor:
    """A PIL image or an [H, W(, C)] array -> [C, H, W] tensor of the same dtype (no scaling)."""
    import numpy as np

    arr = np.array(pic, copy=True)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    return torch.from_numpy(arr).permute(2, 0, 1).contiguous()


def to_tensor(pic) -> torch.Tensor:
    """A PIL image or an [H, W(, C)] array -> float [C, H, W]; 8-bit images are scaled to [0, 1]."""
    t = pil_to_tensor(pic)
    return t.float().div(255) if t.dtype == torch.uint8 else t.float() if not t.is_floating_point() else t


class ToTensor:
    def __call__(self, pic) -> torch.Tensor:
        return to_tensor(pic)


class PILToTensor:
    def __call__(self, pic) -> torch.Tensor:
        return pil_to_tensor(pic)


class GaussianBlur(_Module):
    """Blur with a sigma drawn uniformly from ``sigma`` = (min, max) (or a fixed float) per call."""

    def __init__(self, kernel_size, sigma=(0.1, 2.0)):
        super().__init__()
        self.kernel_size = (kernel_size, kernel_size) if isinstance(kernel_size, int) else tuple(kernel_size)
        self.sigma = (float(sigma), float(sigma)) if isinstance(sigma, (int, float)) else tuple(sigma)

    @staticmethod
    def get_params(sigma_min: float, sigma_max: float) -> float:
        return torch.empty(1).uniform_(sigma_min, sigma_max).item()

    def forward(self, img):
        sigma = self.get_params(self.sigma[0], self.sigma[1])
        return gaussian_blur(img, self.kernel_size, [sigma, sigma])


def _jitter_range(value, name: str, center: float = 1.0, bound=(0.0, float("inf")), clip: bool = True):
    if value is None:
        return None
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"If {name} is a single number, it must be non negative.")
        value = [center - float(value), center + float(value)]
        if clip:
            value[0] = max(value[0], 0.0)
    value = [float(value[0]), float(value[1])]
    if not bound[0] <= value[0] <= value[1] <= bound[1]:
        raise ValueError(f"{name} values should be between {bound}, but got {value}.")
    return None if value[0] == value[1] == center else tuple(value)


class ColorJitter(_Module):
    """Random brightness, contrast, saturation and hue changes, applied in a random order. Each factor is drawn
    uniformly from [1 - v, 1 + v] (hue: [-v, v]) or from a given (min, max)."""

    def __init__(self, brightness=0, contrast=0, saturation=0, hue=0):
        super().__init__()
        self.brightness = _jitter_range(brightness, "brightness")
        self.contrast = _jitter_range(contrast, "contrast")
        self.saturation = _jitter_range(saturation, "saturation")
        self.hue = _jitter_range(hue, "hue", center=0, bound=(-0.5, 0.5), clip=False)

    @staticmethod
    def get_params(brightness, contrast, saturation, hue) -> tuple:
        """(order of the four adjustments, brightness, contrast, saturation, hue factors or None)."""
        order = torch.randperm(4)
        draw = (lambda r: None if r is None else float(torch.empty(1).uniform_(r[0], r[1])))
        return order, draw(brightness), draw(contrast), draw(saturation), draw(hue)

    def forward(self, img):
        order, b, c, s, h = self.get_params(self.brightness, self.contrast, self.saturation, self.hue)
        steps = {0: (adjust_brightness, b), 1: (adjust_contrast, c), 2: (adjust_saturation, s), 3: (adjust_hue, h)}
        for index in order.tolist():
            fn, factor = steps[index]
            if factor is not None:
                img = fn(img, factor)
        return img


class RandomApply(_Module):
    """Applies the list of ``transforms`` with probability ``p`` (all of them, or none)."""

    def __init__(self, transforms, p: float = 0.5):
        super().__init__()
        self.transforms, self.p = transforms, p

    def forward(self, img):
        if self.p < torch.rand(1):
            return img
        for transform in self.transforms:
            img = transform(img)
        return img


# ---------------------------------------------------------------------------------------------- stand-in: ops
class FrozenBatchNorm2d(torch.nn.Module):
    """BatchNorm2d with fixed statistics and affine parameters (buffers, not parameters):
    y = (x - running_mean) / sqrt(running_var + eps) * weight + bias."""

    def __init__(self, num_features: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.ones(num_features))
        self.register_buffer("bias", torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        state_dict.pop(prefix + "num_batches_tracked", None)  # a BatchNorm checkpoint has it; nothing uses it
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight * (self.running_var + self.eps).rsqrt()
        shift = self.bias - self.running_mean * scale
        return x * scale.reshape(1, -1, 1, 1) + shift.reshape(1, -1, 1, 1)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def box_area(boxes: torch.Tensor) -> torch.Tensor:
    return (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])


def box_iou(boxes1: torch.Tensor, boxes2: torch.Tensor) -> torch.Tensor:
    lt = torch.maximum(boxes1[:, None, :2], boxes2[None, :, :2])
    rb = torch.minimum(boxes1[:, None, 2:], boxes2[None, :, 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    return inter / (box_area(boxes1)[:, None] + box_area(boxes2)[None, :] - inter)


def batched_nms(boxes: torch.Tensor, scores: torch.Tensor, idxs: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """NMS within each category of ``idxs`` (boxes of different categories never suppress each other)."""
    if boxes.numel() == 0:
        return torch.empty(0, dtype=torch.long, device=boxes.device)
    offsets = idxs.to(boxes) * (boxes.max() + 1)
    return nms_kernel(boxes + offsets[:, None], scores, iou_threshold)


def masks_to_boxes(masks: torch.Tensor) -> torch.Tensor:
    """[N, H, W] masks -> [N, 4] (x0, y0, x1, y1) boxes of their non-zero pixels (inclusive)."""
    out = torch.zeros((masks.shape[0], 4), device=masks.device, dtype=torch.float)
    for i, mask in enumerate(masks):
        y, x = torch.nonzero(mask, as_tuple=True)
        if y.numel():
            out[i] = torch.stack([x.min(), y.min(), x.max(), y.max()]).float()
    return out


def _placeholder(name: str, doc: str, **attrs) -> ShimModule:
    mod = ShimModule(name, doc)
    setattr(mod, SHIM_FLAG, True)
    mod.__path__ = []
    # a spec, so importlib.util.find_spec() on the placeholder answers instead of raising ValueError
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    for key, value in attrs.items():
        setattr(mod, key, value)
    return mod


_FUNCTIONAL = dict(resize=resize, crop=crop, center_crop=center_crop, normalize=normalize, resized_crop=resized_crop,
                   gaussian_blur=gaussian_blur, get_image_size=get_image_size, _get_image_size=_get_image_size,
                   rgb_to_grayscale=rgb_to_grayscale, adjust_brightness=adjust_brightness,
                   adjust_contrast=adjust_contrast, adjust_saturation=adjust_saturation, adjust_hue=adjust_hue,
                   to_tensor=to_tensor, pil_to_tensor=pil_to_tensor, InterpolationMode=InterpolationMode)
_TRANSFORMS = dict(Compose=Compose, Resize=Resize, Normalize=Normalize, CenterCrop=CenterCrop,
                   RandomResizedCrop=RandomResizedCrop, Lambda=Lambda, InterpolationMode=InterpolationMode,
                   ColorJitter=ColorJitter, GaussianBlur=GaussianBlur, RandomApply=RandomApply, ToTensor=ToTensor,
                   PILToTensor=PILToTensor)


def nms(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    return nms_kernel(boxes, scores, iou_threshold)


def _dataset_placeholder(name: str):
    class Dataset:
        def __init__(self, *args, **kwargs):
            raise NotImplementedError(f"torchvision.datasets.{name} is not provided by the sam3d patches torchvision "
                                      "stand-in (it exists so libraries that import it at start-up, like timm, "
                                      "import); install torchvision to use it")
    Dataset.__name__ = Dataset.__qualname__ = name
    return Dataset


# what timm's data package imports at start-up (timm is imported by SAM 3D's point-map embedder)
_DATASETS = ("CIFAR100", "CIFAR10", "MNIST", "KMNIST", "FashionMNIST", "ImageFolder")


def _register_placeholder() -> None:
    functional = _placeholder("torchvision.transforms.functional", __doc__, **_FUNCTIONAL)
    transforms = _placeholder("torchvision.transforms", __doc__, functional=functional, **_TRANSFORMS)
    misc = _placeholder("torchvision.ops.misc", __doc__, FrozenBatchNorm2d=FrozenBatchNorm2d)
    boxes = _placeholder("torchvision.ops.boxes", __doc__, nms=nms, batched_nms=batched_nms, box_iou=box_iou,
                         box_area=box_area, masks_to_boxes=masks_to_boxes)
    ops = _placeholder("torchvision.ops", __doc__, misc=misc, boxes=boxes, FrozenBatchNorm2d=FrozenBatchNorm2d,
                       nms=nms, batched_nms=batched_nms, box_iou=box_iou, box_area=box_area,
                       masks_to_boxes=masks_to_boxes)
    datasets = _placeholder("torchvision.datasets", __doc__, **{n: _dataset_placeholder(n) for n in _DATASETS})
    root = _placeholder("torchvision", __doc__, transforms=transforms, ops=ops, datasets=datasets,
                        __version__="0.0+sam3d-shim")
    for mod in (root, transforms, functional, ops, misc, boxes, datasets):
        sys.modules[mod.__name__] = mod


# names older research code calls that recent torchvision releases dropped: (module, name, replacement in module)
_COMPAT_ALIASES = (("torchvision.transforms.functional", "_get_image_size", "get_image_size"),)


def _add_compat_aliases() -> None:
    """Give a real torchvision the few names it dropped that older code still calls (each an alias of the
    public successor); remembered so :func:`uninstall` takes them away again."""
    for module_name, name, target in _COMPAT_ALIASES:
        module = sys.modules.get(module_name)
        if module is None or hasattr(module, name) or not hasattr(module, target):
            continue
        setattr(module, name, getattr(module, target))
        _STATE["aliases"].append((module, name))


def compat_aliases() -> List[str]:
    """The aliases :func:`install` added to a real torchvision ("module.name")."""
    return [f"{module.__name__}.{name}" for module, name in _STATE["aliases"]]


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
        try:
            importlib.import_module("torchvision.transforms")
            _add_compat_aliases()
        except Exception:  # noqa: BLE001  someone else's half-imported torchvision: leave it as it is
            pass
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
        _add_compat_aliases()
        _STATE["result"] = "torchvision"
        return "torchvision"
    _register_placeholder()
    _STATE["result"] = "shim"
    return "shim"


def uninstall() -> None:
    """Remove the placeholder, the aliases or the repair (a repaired torchvision is dropped from ``sys.modules``
    too)."""
    for module, name in _STATE["aliases"]:
        if hasattr(module, name):
            delattr(module, name)
    _STATE["aliases"] = []
    if _STATE["library"] is not None:
        drop("torchvision")
        _STATE["library"]._destroy()
        _STATE["library"] = None
    drop("torchvision", only_shims=True)
    _STATE["result"] = None
