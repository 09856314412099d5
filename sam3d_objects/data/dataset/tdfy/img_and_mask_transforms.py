"""Joint image / mask / point-map transforms and the object-centric point-map normaliser."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .img_processing import pad_to_square_centered


def _mask_2d(mask: torch.Tensor) -> torch.Tensor:
    mask = torch.as_tensor(mask)
    while mask.dim() > 2:
        if mask.shape[0] != 1:
            raise ValueError(f"expected a single mask [H, W] or [1, H, W], got shape {tuple(mask.shape)}")
        mask = mask[0]
    return mask


def compute_mask_bbox(mask: torch.Tensor, box_size_factor: float = 1.0) -> Tuple[int, int, int, int]:
    """Square box (x1, y1, x2, y2) around the non-zero pixels of ``mask``; the crop is ``[y1:y2, x1:x2]``.

    size = int(max(w, h, 2) * box_size_factor) with w = max_x - min_x (no +1), centred on the midpoint of the
    extreme pixels; each corner is ``int(center -/+ size // 2)`` (truncation towards zero), as upstream.
    """
    nonzero = torch.nonzero(_mask_2d(mask))
    if nonzero.numel() == 0:
        raise ValueError("the mask is empty (no non-zero pixel): nothing to reconstruct. Pass a mask that covers "
                         "the object (alpha channel or mask > 0).")
    y_min, x_min = nonzero.min(0).values.tolist()
    y_max, x_max = nonzero.max(0).values.tolist()
    center_x, center_y = (x_min + x_max) / 2, (y_min + y_max) / 2
    size = int(max(x_max - x_min, y_max - y_min, 2) * box_size_factor)
    half = size // 2
    return int(center_x - half), int(center_y - half), int(center_x + half), int(center_y + half)


def crop_with_fill(x: torch.Tensor, x1: int, y1: int, x2: int, y2: int, fill: float = 0.0) -> torch.Tensor:
    """``x[..., y1:y2, x1:x2]`` where the parts outside the map are ``fill`` (torchvision's crop pads with 0)."""
    h, w = x.shape[-2:]
    pad = (max(0, -x1), max(0, x2 - w), max(0, -y1), max(0, y2 - h))
    inner = x[..., max(0, y1):min(h, y2), max(0, x1):min(w, x2)]
    if any(pad):
        inner = F.pad(inner, pad, mode="constant", value=fill)
    return inner


def crop_around_mask_with_padding(loaded_image: torch.Tensor, mask: torch.Tensor, box_size_factor: float = 1.6,
                                  padding_factor: float = 0.1, pointmap: Optional[torch.Tensor] = None):
    """Crop image / mask (/ point map) to the square box around the mask, then pad to a centred square.

    Out-of-image areas of the box are 0 in every map (torchvision crop semantics, also for the point map); the
    square padding after the crop is 0 for image and mask and NaN for the point map. ``padding_factor`` adds a
    border of ``int(padding_factor * box size)`` pixels on every side (same fill rules). Defaults are upstream's
    (box 1.6, padding 0.1); ``pipeline.yaml`` passes its own.
    """
    image = loaded_image
    x1, y1, x2, y2 = compute_mask_bbox(mask, box_size_factor)
    if padding_factor:
        border = int(padding_factor * max(x2 - x1, y2 - y1))
        x1, y1, x2, y2 = x1 - border, y1 - border, x2 + border, y2 + border
    image = crop_with_fill(image, x1, y1, x2, y2)
    mask = crop_with_fill(mask, x1, y1, x2, y2)
    if pointmap is None:
        return pad_to_square_centered(image, mask=mask)
    pointmap = crop_with_fill(pointmap, x1, y1, x2, y2)
    return pad_to_square_centered(image, mask=mask, pointmap=pointmap)


def resize_nearest(x: torch.Tensor, size: Tuple[int, int]) -> torch.Tensor:
    if tuple(x.shape[-2:]) == tuple(size):
        return x
    lead = x.shape[:-2]
    out = F.interpolate(x.reshape(-1, 1, *x.shape[-2:]).float(), size=tuple(size), mode="nearest")
    return out.reshape(*lead, *size).to(x.dtype)


def resize_all_to_same_size(rgb_image: torch.Tensor, mask: torch.Tensor, pointmap: Optional[torch.Tensor] = None,
                            target_size=None):
    """Bring mask and point map to the image's H x W (nearest): point maps from a depth model may be smaller.
    ``target_size`` (H, W) or an int (square) resizes the image too (bilinear)."""
    image = rgb_image
    if target_size is not None:
        size = (target_size, target_size) if isinstance(target_size, int) else tuple(target_size)
        if tuple(image.shape[-2:]) != size:
            image = F.interpolate(image[None].float(), size=size, mode="bilinear", align_corners=False)[0]
    size = tuple(image.shape[-2:])
    mask = resize_nearest(mask, size)
    if pointmap is None:
        return image, mask
    return image, mask, resize_nearest(pointmap, size)


class ObjectCentricSSI:
    """Scale-and-shift-invariant point-map normaliser centred on the object.

    shift = per-axis nanmedian of the points under the mask (torch ``nanmedian``: the lower middle value);
    scale = nanmedian over the object's points (or over ALL pixels with ``use_scene_scale``) of
    max_xyz |p - shift|, the same for x, y, z. The normalised map is (p - shift) / scale.
    """

    def __init__(self, use_scene_scale: bool = False, allow_scale_and_shift_override: bool = False):
        self.use_scene_scale = use_scene_scale
        self.allow_scale_and_shift_override = allow_scale_and_shift_override

    @staticmethod
    def _object_points(pointmap: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        points = pointmap.reshape(3, -1).T
        if mask is None:
            return points
        mask = resize_nearest(_mask_2d(mask).float()[None], tuple(pointmap.shape[-2:]))[0]
        return points[mask.reshape(-1) > 0.5]

    def compute_scale_and_shift(self, pointmap: torch.Tensor, mask: Optional[torch.Tensor] = None):
        """(scale [3], shift [3]) of a point map [3, H, W]."""
        obj = self._object_points(pointmap, mask)
        if obj.shape[0] == 0 or bool(obj.isnan().all()):
            raise ValueError("the mask covers no valid 3D point of the point map (all masked points are NaN or "
                             "the mask is empty at the point-map resolution): check that mask and point map "
                             "belong to the same image")
        shift = obj.nanmedian(dim=0).values
        pts = pointmap.reshape(3, -1).T if self.use_scene_scale else obj
        dist = (pts - shift).abs().max(dim=-1).values
        scale = dist.nanmedian()
        if not bool(torch.isfinite(scale)) or float(scale) <= 0:
            raise ValueError("cannot normalise the point map: its scale is zero or undefined (all points NaN or "
                             "identical)")
        return scale.expand(3).clone(), shift

    def normalize(self, pointmap: torch.Tensor, mask: Optional[torch.Tensor] = None,
                  scale: Optional[torch.Tensor] = None, shift: Optional[torch.Tensor] = None):
        """Returns (normalised point map, scale, shift); given scale/shift are used when overriding is allowed."""
        if scale is None or shift is None or not self.allow_scale_and_shift_override:
            scale, shift = self.compute_scale_and_shift(pointmap, mask)
        inv = 1.0 / scale  # applied as p * (1/s) - shift * (1/s), the inverse affine map of upstream
        out = pointmap * inv[:, None, None] + (-shift * inv)[:, None, None]
        return out, scale, shift

    def denormalize(self, pointmap: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        return pointmap * scale.reshape(3, 1, 1) + shift.reshape(3, 1, 1)

    __call__ = normalize


def rembg(image: torch.Tensor, mask: torch.Tensor, pointmap: Optional[torch.Tensor] = None):
    """Background removal with the mask: image * mask; the point map (if any) becomes NaN outside the mask.
    Returns (image, mask) or (image, mask, pointmap)."""
    keep = _mask_2d(mask) > 0
    image = image * keep.to(image.dtype)
    if pointmap is None:
        return image, mask
    return image, mask, torch.where(keep, pointmap, torch.full_like(pointmap, float("nan")))


# ----------------------------------------------------------------------------------------------------------------
# upstream's smaller helpers: normalisation constants, RGBA packing, bounding boxes
# ----------------------------------------------------------------------------------------------------------------
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class _Normalize:
    """(img - mean) / std per channel of a [3, H, W] image (torchvision's ``Normalize`` role)."""

    def __init__(self, mean, std):
        self.mean, self.std = tuple(mean), tuple(std)

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        mean = torch.tensor(self.mean, dtype=img.dtype, device=img.device).reshape(-1, 1, 1)
        std = torch.tensor(self.std, dtype=img.dtype, device=img.device).reshape(-1, 1, 1)
        return (img - mean) / std


def UNNORMALIZE(mean, std):  # noqa: N802  upstream's name
    """img [3, H, W] -> img * std + mean (inverse of the normalisation with ``mean`` / ``std``)."""
    def unnormalize(img: torch.Tensor) -> torch.Tensor:
        assert img.dim() == 3 and img.shape[0] == 3, f"expected a [3, H, W] image, got {tuple(img.shape)}"
        m = torch.as_tensor(mean, dtype=img.dtype, device=img.device).reshape(3, 1, 1)
        s = torch.as_tensor(std, dtype=img.dtype, device=img.device).reshape(3, 1, 1)
        return img * s + m
    return unnormalize


IMAGENET_NORMALIZATION = _Normalize(IMAGENET_MEAN, IMAGENET_STD)
IMAGENET_UNNORMALIZATION = UNNORMALIZE(IMAGENET_MEAN, IMAGENET_STD)


class BoundingBoxError(Exception):
    """The mask's bounding box is too small to crop around."""


def check_bounding_box(bbox_w: int, bbox_h: int) -> None:
    if bbox_w < 2 or bbox_h < 2:
        raise BoundingBoxError("Bounding box dimensions must be at least 2x2.")


def load_rgb(fpath) -> torch.Tensor:
    """Float [C, H, W] image in [0, 1] (C = 3 or 4) read with Pillow (upstream: matplotlib's imread)."""
    import numpy as np
    from PIL import Image
    with Image.open(fpath) as img:
        arr = np.asarray(img.convert("RGBA" if "A" in img.getbands() else "RGB"))
    return torch.from_numpy(arr.astype(np.float32) / 255.0).permute(2, 0, 1).contiguous()


def concat_rgba(rgb_image: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[3, H, W] + [H, W] -> [4, H, W]."""
    assert rgb_image.dim() == 3 and rgb_image.shape[0] == 3 and mask.dim() == 2, "expected [3, H, W] and [H, W]"
    assert tuple(rgb_image.shape[1:]) == tuple(mask.shape), "image and mask sizes differ"
    return torch.cat([rgb_image, mask[None].to(rgb_image.dtype)], dim=0)


def split_rgba(rgba_image: torch.Tensor):
    """[4, H, W] -> ([3, H, W], [H, W])."""
    return rgba_image[:3], rgba_image[3]


def get_mask(rgb_image: torch.Tensor, depth_image: Optional[torch.Tensor], mask_source: str):
    """The object mask from the alpha channel (``"ALPHA_CHANNEL"``: [..., 1, H, W], values as stored) or the
    depth image (``"DEPTH"``); batched [B, C, H, W] or not."""
    if mask_source == "ALPHA_CHANNEL":
        if rgb_image.shape[-3] != 4:
            raise ValueError(f"mask_source ALPHA_CHANNEL needs a 4-channel image, got {rgb_image.shape[-3]} "
                             f"channels")
        return rgb_image[..., 3:4, :, :]
    if mask_source == "DEPTH":
        return depth_image
    raise ValueError(f"unknown mask_source {mask_source!r}; expected 'ALPHA_CHANNEL' or 'DEPTH'")


def crop_and_pad(image: torch.Tensor, bbox) -> torch.Tensor:
    """``image[:, y1:y2, x1:x2]`` with zeros where the box leaves the image."""
    x1, y1, x2, y2 = (int(v) for v in bbox)
    return crop_with_fill(image, x1, y1, x2, y2, 0.0)


def crop_around_mask_with_random_box_size_factor(loaded_image: torch.Tensor, mask: torch.Tensor,
                                                 random_box_size_factor: float = 1.0,
                                                 pointmap: Optional[torch.Tensor] = None):
    """Training augmentation: the crop of :func:`crop_around_mask_with_padding` with a box 1 + U(0, 1) *
    ``random_box_size_factor`` times the mask's, no padding."""
    import random
    factor = 1.0 + random.random() * random_box_size_factor
    return crop_around_mask_with_padding(loaded_image, mask, box_size_factor=factor, padding_factor=0.0,
                                         pointmap=pointmap)
