"""Square padding of images, masks and point maps."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


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
