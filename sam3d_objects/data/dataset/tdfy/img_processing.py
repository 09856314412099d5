"""Square padding of images, masks and point maps."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

import backends


def square_padding(height: int, width: int):
    """(left, right, top, bottom) that centre a HxW map in a square: the short side gets (d//2, d - d//2)."""
    diff = abs(height - width)
    before, after = diff // 2, diff - diff // 2
    return (0, 0, before, after) if height < width else (before, after, 0, 0)


def pad_chw(x: torch.Tensor, pad, value: float) -> torch.Tensor:
    if not any(pad):
        return x
    return F.pad(x, pad, mode="constant", value=value)


def pad_to_square_centered(image: torch.Tensor, value: float = 0, pointmap: Optional[torch.Tensor] = None,
                           **maps: torch.Tensor):
    """Pad ``[..., H, W]`` maps to a centred square (the short side gets diff // 2 before, the rest after).

    The image is filled with ``value``, a mask (``mask=``, ours) with 0 and a point map with NaN (no 3D point
    there). Returns the image alone, ``(image, pointmap)`` (upstream's two forms), or with a mask
    ``(image, mask[, pointmap])``.
    """
    unknown = set(maps) - {"mask"}
    if unknown:  # only ``mask=`` joins upstream's parameters
        raise TypeError(f"pad_to_square_centered got unexpected keyword arguments {sorted(unknown)}")
    mask = maps.get("mask")
    pad = square_padding(image.shape[-2], image.shape[-1])
    image_out = pad_chw(image, pad, float(value))
    if mask is None and pointmap is None:
        return image_out
    if mask is None:
        return image_out, pad_chw(pointmap, pad, float("nan"))
    out = [image_out, pad_chw(mask, pad, 0.0)]
    if pointmap is not None:
        out.append(pad_chw(pointmap, pad, float("nan")))
    return tuple(out)


def pad_to_square(image: torch.Tensor, value: float = 0) -> torch.Tensor:
    """Pad [B, C, H, W] to a square on the right (H > W) or at the bottom (W > H) only, with ``value``."""
    h, w = image.shape[-2:]
    if h == w:
        return image
    pad = (0, h - w, 0, 0) if h > w else (0, 0, 0, w - h)
    return F.pad(image, pad, mode="constant", value=value)


_IMAGENET_MEAN = (0.485, 0.456, 0.406)
_IMAGENET_STD = (0.229, 0.224, 0.225)


def resnet_img_normalization(x: torch.Tensor) -> torch.Tensor:
    """(x - ImageNet mean) / ImageNet std for [3, H, W] or [B, 3, H, W]."""
    shape = (3, 1, 1) if x.dim() == 3 else (1, 3, 1, 1)
    mean = torch.tensor(_IMAGENET_MEAN, dtype=x.dtype, device=x.device).reshape(shape)
    std = torch.tensor(_IMAGENET_STD, dtype=x.dtype, device=x.device).reshape(shape)
    return (x - mean) / std


def preprocess_img(x: torch.Tensor, mask: Optional[torch.Tensor] = None, img_target_shape: int = 224,
                   mask_target_shape: int = 256, normalize: bool = False):
    """[B, C, H, W] images (and masks) padded to squares (right/bottom) and resized (bilinear / nearest).

    Upstream compares the channel and height sizes to decide whether to pad (a slip); the evident intent, height
    against width, is used here (padding an already square image is a no-op either way)."""
    x = pad_to_square(x)
    if x.shape[-1] != img_target_shape:
        x = F.interpolate(x, size=(img_target_shape, img_target_shape), mode="bilinear", align_corners=False)
    if mask is not None:
        mask = pad_to_square(mask)
        if mask.shape[-1] != mask_target_shape:
            mask = F.interpolate(mask.float(), size=(mask_target_shape, mask_target_shape), mode="nearest")
    if normalize:
        x = resnet_img_normalization(x)
    return x, mask


def crop_img_to_obj(mask: torch.Tensor, context_size: float):
    """(left, right, top, bottom) of the mask's box grown by ``context_size`` x its size on each side, clamped to
    the mask; four Nones for an empty mask."""
    rows = torch.nonzero(mask.any(dim=1)).flatten()
    cols = torch.nonzero(mask.any(dim=0)).flatten()
    if rows.numel() == 0:
        return None, None, None, None
    top, bottom, left, right = rows.min(), rows.max(), cols.min(), cols.max()
    grow_y = int((bottom - top) * context_size)
    grow_x = int((right - left) * context_size)
    h, w = mask.shape[-2:]
    return ((left - grow_x).clamp(min=0), (right + grow_x).clamp(max=w - 1), (top - grow_y).clamp(min=0),
            (bottom + grow_y).clamp(max=h - 1))


def random_pad(img: torch.Tensor, mask: Optional[torch.Tensor] = None, max_ratio: float = 0.0,
               pointmap: Optional[torch.Tensor] = None):
    """Training augmentation: pad left / right / top / bottom by independent random amounts up to
    ``int(max(img.shape) * max_ratio)`` (0 for image and mask, NaN for the point map)."""
    limit = int(max(img.shape) * max_ratio)
    pad = tuple(int(v) for v in torch.randint(0, limit + 1, (4,)))
    img = F.pad(img, pad, value=0.0)
    mask = None if mask is None else F.pad(mask, pad, value=0.0)
    if pointmap is None:
        return img, mask
    return img, mask, F.pad(pointmap, pad, value=float("nan"))


# ----------------------------------------------------------------------------------------------------------------
# training-time augmentations (torchvision's transforms re-done in torch: torchvision is not a dependency here)
# ----------------------------------------------------------------------------------------------------------------
class Compose:
    """Apply callables in order (torchvision ``Compose``'s role)."""

    def __init__(self, transforms):
        self.transforms = list(transforms)

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x


class RandomApply:
    """Apply ``transforms`` (a callable or a list of them) with probability ``p``."""

    def __init__(self, transforms, p: float = 0.5):
        self.transforms = transforms if isinstance(transforms, (list, tuple)) else [transforms]
        self.p = p

    def __call__(self, x):
        if torch.rand(1).item() >= self.p:
            return x
        for t in self.transforms:
            x = t(x)
        return x


def _interp_mode(interpolation) -> str:
    """'bilinear' / 'bicubic' / 'nearest' from a string or an enum-like object (torchvision InterpolationMode)."""
    name = getattr(interpolation, "value", interpolation)
    return {0: "nearest", 2: "bilinear", 3: "bicubic"}.get(name, str(name).lower())


def resize_chw(x: torch.Tensor, size, interpolation="bilinear") -> torch.Tensor:
    """Resize a [..., H, W] tensor to ``size`` (H, W); bicubic output is clamped to the input's range."""
    mode = _interp_mode(interpolation)
    lead = x.shape[:-2]
    flat = x.reshape(-1, 1, *x.shape[-2:]).float()
    kwargs = {} if mode == "nearest" else {"align_corners": False}
    out = F.interpolate(flat, size=tuple(int(s) for s in size), mode=mode, **kwargs)
    if mode == "bicubic":  # cubic overshoot: keep values in the input's range, as torchvision does for images
        out = out.clamp(float(flat.min()), float(flat.max()))
    return out.reshape(*lead, *out.shape[-2:]).to(x.dtype)


def gaussian_kernel1d(kernel_size: int, sigma: float, dtype=torch.float32, device=None) -> torch.Tensor:
    return backends.filters.gaussian_kernel1d(kernel_size, sigma, dtype=dtype, device=device)


def gaussian_blur_chw(img: torch.Tensor, kernel_size: int, sigma: float, padding_mode: str = "reflect"):
    """Separable Gaussian blur of a [..., C, H, W] image, padded with ``padding_mode`` (torchvision: reflect)."""
    return backends.filters.gaussian_blur2d(img, kernel_size, sigma, padding_mode=padding_mode)


class GaussianBlur:
    """Blur with a Gaussian of sigma ~ U(sigma range) (torchvision ``GaussianBlur``'s role)."""

    def __init__(self, kernel_size: int, sigma=(0.1, 2.0)):
        self.kernel_size = kernel_size
        self.sigma = sigma if isinstance(sigma, (tuple, list)) else (sigma, sigma)

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        sigma = float(torch.empty(1).uniform_(self.sigma[0], self.sigma[1]))
        return gaussian_blur_chw(img, self.kernel_size, sigma)


def _rgb_to_hsv(img: torch.Tensor) -> torch.Tensor:
    r, g, b = img.unbind(-3)
    maxc, minc = img.max(-3).values, img.min(-3).values
    v, delta = maxc, maxc - minc
    s = torch.where(maxc > 0, delta / maxc.clamp_min(1e-12), torch.zeros_like(maxc))
    safe = delta.clamp_min(1e-12)
    h = torch.where(maxc == r, ((g - b) / safe) % 6,
                    torch.where(maxc == g, (b - r) / safe + 2, (r - g) / safe + 4)) / 6
    h = torch.where(delta > 0, h, torch.zeros_like(h))
    return torch.stack([h % 1.0, s, v], dim=-3)


def _hsv_to_rgb(img: torch.Tensor) -> torch.Tensor:
    h, s, v = img.unbind(-3)
    k = lambda n: (n + h * 6) % 6  # noqa: E731
    f = lambda n: v - v * s * torch.clamp(torch.minimum(k(n), 4 - k(n)), 0, 1)  # noqa: E731
    return torch.stack([f(5), f(3), f(1)], dim=-3)


def _grayscale(img: torch.Tensor) -> torch.Tensor:
    r, g, b = img.unbind(-3)
    return (0.299 * r + 0.587 * g + 0.114 * b).unsqueeze(-3)


class ColorJitter:
    """Random brightness, contrast, saturation (factors U(1 - x, 1 + x)) and hue shift (U(-x, x) turns), applied in
    random order on a [..., 3, H, W] image in [0, 1] (torchvision ``ColorJitter``'s role)."""

    def __init__(self, brightness: float = 0, contrast: float = 0, saturation: float = 0, hue: float = 0):
        self.brightness, self.contrast, self.saturation, self.hue = brightness, contrast, saturation, hue

    @staticmethod
    def _factor(x: float) -> float:
        return float(torch.empty(1).uniform_(max(0.0, 1 - x), 1 + x))

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        for op in torch.randperm(4).tolist():
            if op == 0 and self.brightness:
                img = (img * self._factor(self.brightness)).clamp(0, 1)
            elif op == 1 and self.contrast:
                mean = _grayscale(img).mean(dim=(-3, -2, -1), keepdim=True)
                f = self._factor(self.contrast)
                img = (f * img + (1 - f) * mean).clamp(0, 1)
            elif op == 2 and self.saturation:
                f = self._factor(self.saturation)
                img = (f * img + (1 - f) * _grayscale(img)).clamp(0, 1)
            elif op == 3 and self.hue:
                hsv = _rgb_to_hsv(img)
                shift = float(torch.empty(1).uniform_(-self.hue, self.hue))
                hsv = torch.stack([(hsv[..., 0, :, :] + shift) % 1.0, hsv[..., 1, :, :], hsv[..., 2, :, :]], -3)
                img = _hsv_to_rgb(hsv)
        return img


def get_img_color_augmentation(color_jit_prob: float = 0.5, gaussian_blur_prob: float = 0.1) -> Compose:
    """Colour jitter (0.2, 0.2, 0.2, 0.1) with probability ``color_jit_prob``, then a 3x3 Gaussian blur
    (sigma U(0.1, 2)) with probability ``gaussian_blur_prob``."""
    return Compose([RandomApply(ColorJitter(0.2, 0.2, 0.2, 0.1), p=color_jit_prob),
                    RandomApply(GaussianBlur(3, sigma=(0.1, 2.0)), p=gaussian_blur_prob)])


class RandomResizedCrop:
    """Crop a random area / aspect ratio of a [..., H, W] image and resize it to ``size``.

    Upstream subclasses torchvision's class and replaces ``get_params`` by a single draw (no retry loop); this is a
    self-contained version of that behaviour (torchvision is not a dependency).
    """

    def __init__(self, size, scale=(0.08, 1.0), ratio=(3.0 / 4.0, 4.0 / 3.0), interpolation="bilinear"):
        self.size = (size, size) if isinstance(size, int) else tuple(size)
        self.scale, self.ratio, self.interpolation = scale, ratio, interpolation

    @staticmethod
    def get_params(img: torch.Tensor, scale, ratio):
        """(top, left, h, w): area = H*W*U(scale), aspect = exp(U(log ratio)), clipped to the image."""
        height, width = img.shape[-2:]
        area = height * width
        target_area = area * float(torch.empty(1).uniform_(scale[0], scale[1]))
        log_ratio = torch.log(torch.tensor(ratio, dtype=torch.float64))
        aspect = float(torch.exp(torch.empty(1, dtype=torch.float64).uniform_(float(log_ratio[0]),
                                                                             float(log_ratio[1]))))
        w = min(max(int(round(math.sqrt(target_area * aspect))), 1), width)
        h = min(max(int(round(math.sqrt(target_area / aspect))), 1), height)
        i = int(torch.randint(0, height - h + 1, size=(1,)))
        j = int(torch.randint(0, width - w + 1, size=(1,)))
        return i, j, h, w

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        i, j, h, w = self.get_params(img, self.scale, self.ratio)
        return resize_chw(img[..., i:i + h, j:j + w], self.size, self.interpolation)

    forward = __call__
