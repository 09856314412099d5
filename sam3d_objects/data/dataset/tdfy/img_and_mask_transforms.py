"""Joint image / mask / point-map transforms and the object-centric point-map normaliser."""
from __future__ import annotations

import random
import warnings
from collections import namedtuple
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .img_processing import Compose, gaussian_blur_chw, pad_to_square_centered, resize_chw


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


SSINormalizedPointmap = namedtuple("SSINormalizedPointmap", ["pointmap", "scale", "shift"])


def _apply_metric_to_ssi(pointmap: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
                         apply_inverse: bool = False) -> torch.Tensor:
    """(p - shift) / scale (or p * scale + shift with ``apply_inverse``) on a (3, H, W) or (H, W, 3) map."""
    channels_first = pointmap.shape[0] == 3
    view = (3, 1, 1) if channels_first else (1, 1, 3)
    scale = scale.to(pointmap).reshape(view)
    shift = shift.to(pointmap).reshape(view)
    if apply_inverse:
        return pointmap * scale + shift
    inv = 1.0 / scale  # applied as p * (1/s) - shift * (1/s), the inverse affine map of upstream
    return pointmap * inv + (-shift * inv)


def normalize_pointmap_ssi(pointmap: torch.Tensor):
    """(normalised, scale, shift) with ScaleShiftInvariant's statistics (shift (0, 0, nanmedian z), scale =
    nanmean |p - shift|); (3, H, W) or (H, W, 3) in, same layout out."""
    from .pose_target import ScaleShiftInvariant
    hw3 = pointmap.permute(1, 2, 0) if pointmap.shape[0] == 3 else pointmap
    scale, shift = ScaleShiftInvariant.get_scale_and_shift(hw3)
    return _apply_metric_to_ssi(pointmap, scale, shift), scale, shift


class SSIPointmapNormalizer:
    """Scene-level scale-and-shift normalisation of a point map (the mask is not used)."""

    def normalize(self, pointmap: torch.Tensor, mask: Optional[torch.Tensor], scale: Optional[torch.Tensor] = None,
                  shift: Optional[torch.Tensor] = None) -> SSINormalizedPointmap:
        if scale is None or shift is None:
            out, scale, shift = normalize_pointmap_ssi(pointmap)
            return SSINormalizedPointmap(out, scale, shift)
        assert tuple(scale.shape) == (3,) and tuple(shift.shape) == (3,), "scale and shift must have shape (3,)"
        return SSINormalizedPointmap(_apply_metric_to_ssi(pointmap, scale, shift), scale, shift)

    def denormalize(self, pointmap: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        return _apply_metric_to_ssi(pointmap, scale, shift, apply_inverse=True)

    def __call__(self, pointmap: torch.Tensor, mask: Optional[torch.Tensor] = None, scale=None, shift=None):
        return self.normalize(pointmap, mask, scale, shift)


def _mask_pixels(pointmap: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(N, 3) points of a (3, H, W) map under the mask (resized nearest to the map, > 0.5)."""
    mask = resize_nearest(_mask_2d(mask).float()[None], tuple(pointmap.shape[-2:]))[0]
    return pointmap.reshape(3, -1).T[mask.reshape(-1) > 0.5]


def _clip_norm(normalized: torch.Tensor, too_far: torch.Tensor) -> torch.Tensor:
    return torch.where(too_far[None], torch.full_like(normalized, float("nan")), normalized)


class ObjectCentricSSI(SSIPointmapNormalizer):
    """Scale-and-shift-invariant point-map normaliser centred on the object.

    shift = per-axis nanmedian of the points under the mask (torch ``nanmedian``: the lower middle value).
    scale: ``use_scene_scale=True`` (upstream's default, the official config) -> nanmedian over ALL pixels of
    max_xyz |p - shift|; ``False`` -> 2 * (q(1 - t) - q(t)) of the object's L2 distances |p - shift| with
    t = ``quantile_drop_threshold``; ``"OBJECT_NORM_MEDIAN"`` -> nanmedian of those distances. The scale is the
    same for x, y, z, times ``scale_factor``. The normalised map is (p - shift) / scale.
    """

    def __init__(self, use_scene_scale=True, quantile_drop_threshold: float = 0.1,
                 clip_beyond_scale: Optional[float] = None, scale_factor: float = 1.0,
                 allow_scale_and_shift_override: bool = False, raise_on_no_valid_points: bool = False):
        if isinstance(use_scene_scale, str) and use_scene_scale.upper() != "OBJECT_NORM_MEDIAN":
            raise ValueError(f"use_scene_scale must be True, False or 'OBJECT_NORM_MEDIAN', got {use_scene_scale!r}")
        self.use_scene_scale = use_scene_scale
        self.quantile_drop_threshold = quantile_drop_threshold
        self.clip_beyond_scale = clip_beyond_scale
        self.scale_factor = scale_factor
        self.allow_scale_and_shift_override = allow_scale_and_shift_override
        self.raise_on_no_valid_points = raise_on_no_valid_points

    def compute_scale_and_shift(self, pointmap: torch.Tensor, mask: Optional[torch.Tensor] = None):
        """(scale [3], shift [3]) of a point map [3, H, W]."""
        return self._compute_scale_and_shift(pointmap, mask)

    def _compute_scale_and_shift(self, pointmap: torch.Tensor, mask: Optional[torch.Tensor] = None):
        """Upstream's name of ``compute_scale_and_shift``."""
        obj = pointmap.reshape(3, -1).T if mask is None else _mask_pixels(pointmap, mask)
        if obj.shape[0] == 0 or not bool(torch.isfinite(obj).any()):
            msg = ("the mask covers no valid 3D point of the point map (all masked points are NaN or the mask is "
                   "empty at the point-map resolution): check that mask and point map belong to the same image")
            if self.raise_on_no_valid_points:
                raise ValueError(msg)
            warnings.warn(msg + "; using scale = scale_factor, shift = 0")
            return (self.scale_factor * torch.ones(3, dtype=pointmap.dtype, device=pointmap.device),
                    torch.zeros(3, dtype=pointmap.dtype, device=pointmap.device))
        shift = obj.nanmedian(dim=0).values
        mode = self.use_scene_scale
        if isinstance(mode, str):  # "OBJECT_NORM_MEDIAN"
            scale = (obj - shift).norm(dim=-1).nanmedian()
        elif mode:
            scale = (pointmap.reshape(3, -1).T - shift).abs().max(dim=-1).values.nanmedian()
        else:
            r = (obj - shift).norm(dim=-1)
            q = self.quantile_drop_threshold
            scale = 2 * (r.nanquantile(1 - q) - r.nanquantile(q))
        return scale.expand(3).clone() * self.scale_factor, shift

    def normalize(self, pointmap: torch.Tensor, mask: Optional[torch.Tensor], scale: Optional[torch.Tensor] = None,
                  shift: Optional[torch.Tensor] = None) -> SSINormalizedPointmap:
        """Returns (normalised point map, scale, shift); given scale/shift are used when overriding is allowed."""
        assert pointmap.dim() == 3 and pointmap.shape[0] == 3, "expected a (3, H, W) point map"
        if scale is None or shift is None or not self.allow_scale_and_shift_override:
            scale, shift = self._compute_scale_and_shift(pointmap, mask)
        out = _apply_metric_to_ssi(pointmap, scale, shift)
        if self.clip_beyond_scale is not None and self.clip_beyond_scale > 0:
            out = _clip_norm(out, out.norm(dim=0) > self.clip_beyond_scale)
        return SSINormalizedPointmap(out, scale, shift)


class ObjectApparentSizeSSI(SSIPointmapNormalizer):
    """scale = nanmedian depth z (over all pixels with ``use_scene_scale``, else over the mask) * scale_factor,
    shift = 0: the map is expressed in units of the typical depth."""

    def __init__(self, clip_beyond_scale: Optional[float] = None, use_scene_scale: bool = True,
                 scale_factor: float = 1.0):
        self.clip_beyond_scale = clip_beyond_scale
        self.use_scene_scale = use_scene_scale
        self.scale_factor = scale_factor

    def compute_scale_and_shift(self, pointmap: torch.Tensor, mask: Optional[torch.Tensor]):
        return self._get_scale_and_shift(pointmap, mask)

    def _get_scale_and_shift(self, pointmap: torch.Tensor, mask: Optional[torch.Tensor]):
        """(scale [3], shift [3] = 0) of a point map [3, H, W] (upstream's name)."""
        pts = pointmap.reshape(3, -1).T if self.use_scene_scale or mask is None else _mask_pixels(pointmap, mask)
        scale = (pts[:, 2].nanmedian() * self.scale_factor).expand(3).clone()
        return scale, torch.zeros(3, dtype=pointmap.dtype, device=pointmap.device)

    def normalize(self, pointmap: torch.Tensor, mask: Optional[torch.Tensor], scale: Optional[torch.Tensor] = None,
                  shift: Optional[torch.Tensor] = None) -> SSINormalizedPointmap:
        if scale is None or shift is None:
            scale, shift = self._get_scale_and_shift(pointmap, mask)
        else:
            assert tuple(scale.shape) == (3,) and tuple(shift.shape) == (3,), "scale and shift must have shape (3,)"
        out = _apply_metric_to_ssi(pointmap, scale, shift)
        if self.clip_beyond_scale is not None and self.clip_beyond_scale > 0:
            out = _clip_norm(out, out[2] > self.clip_beyond_scale)
        return SSINormalizedPointmap(out, scale, shift)


class NormalizedDisparitySpaceSSI(SSIPointmapNormalizer):
    """Remaps points to (x/z, y/z, log z) ("exp_disparity") and shifts log-depth by its median (scene, plus
    ``log_disparity_shift``) or by the per-axis median of the object (``use_scene_scale=False``); scale is 1."""

    def __init__(self, clip_beyond_scale: Optional[float] = None, use_scene_scale: bool = True,
                 log_disparity_shift: float = 0.0):
        from sam3d_objects.model.backbone.dit.embedder.point_remapper import PointRemapper
        self.clip_beyond_scale = clip_beyond_scale
        self.use_scene_scale = use_scene_scale
        self.log_disparity_shift = log_disparity_shift
        self.remapper = PointRemapper("exp_disparity")

    def _remap(self, pointmap: torch.Tensor) -> torch.Tensor:
        return self.remapper(pointmap.permute(1, 2, 0)).permute(2, 0, 1)

    def normalize(self, pointmap: torch.Tensor, mask: Optional[torch.Tensor], scale: Optional[torch.Tensor] = None,
                  shift: Optional[torch.Tensor] = None) -> SSINormalizedPointmap:
        remapped = self._remap(pointmap)
        if scale is None or shift is None:
            scale, shift = self._get_scale_and_shift(remapped, mask)
        out = _apply_metric_to_ssi(remapped, scale, shift)
        if self.clip_beyond_scale is not None and self.clip_beyond_scale > 0:
            out = _clip_norm(out, out[2].abs() > self.clip_beyond_scale)
        return SSINormalizedPointmap(out, scale, shift)

    def _get_scale_and_shift(self, pointmap: torch.Tensor, mask: Optional[torch.Tensor]):
        """(scale = 1, shift) of a map already in disparity space [3, H, W]: the scene's median log-depth (+
        ``log_disparity_shift``) on z, or the object's per-axis median without ``use_scene_scale``."""
        scale = torch.ones(3, dtype=pointmap.dtype, device=pointmap.device)
        if self.use_scene_scale or mask is None:
            shift = torch.zeros(3, dtype=pointmap.dtype, device=pointmap.device)
            shift[2] = pointmap[2].reshape(-1).nanmedian() + self.log_disparity_shift
        else:
            shift = _mask_pixels(pointmap, mask).nanmedian(dim=0).values
        return scale, shift

    def denormalize(self, pointmap: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        remapped = _apply_metric_to_ssi(pointmap, scale, shift, apply_inverse=True)
        return self.remapper.inverse(remapped.permute(1, 2, 0)).permute(2, 0, 1)


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


# ----------------------------------------------------------------------------------------------------------------
# resizing to the model's input and the RGBA processor
# ----------------------------------------------------------------------------------------------------------------
class _ResizeShorterSide:
    """Resize [..., H, W] so the shorter side is ``size`` (an int; torchvision ``Resize(int)``) or to (H, W)."""

    def __init__(self, size, interpolation: str = "bilinear"):
        self.size, self.interpolation = size, interpolation

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        if isinstance(self.size, int):
            short, long = (h, w) if h <= w else (w, h)
            new_long = int(self.size * long / short)
            out_hw = (self.size, new_long) if h <= w else (new_long, self.size)
        else:
            out_hw = tuple(self.size)
        if tuple(out_hw) == (h, w):
            return x
        lead = x.shape[:-2]
        out = F.interpolate(x.reshape(-1, 1, h, w).float(), size=out_hw, mode=self.interpolation,
                            align_corners=False, antialias=True)
        return out.reshape(*lead, *out_hw).to(x.dtype)


class _CenterCrop:
    def __init__(self, size):
        self.size = (size, size) if isinstance(size, int) else tuple(size)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        th, tw = self.size
        top, left = int(round((h - th) / 2.0)), int(round((w - tw) / 2.0))
        return crop_with_fill(x, left, top, left + tw, top + th)


def resize_and_make_square(img_size, make_square=False) -> dict:
    """{"img_transform", "mask_transform"}: optional centred square padding (``"pad"``), a resize of the shorter
    side to ``img_size`` (bilinear, antialiased, for image and mask alike) and an optional centre crop to
    ``img_size`` x ``img_size`` (``"crop"``)."""
    mode = make_square.lower() if isinstance(make_square, str) else make_square
    assert mode in (False, "pad", "crop"), f"make_square must be False, 'pad' or 'crop', got {make_square!r}"

    def build():
        steps = []
        if mode == "pad":
            steps.append(pad_to_square_centered)
        steps.append(_ResizeShorterSide(img_size, "bilinear"))
        if mode == "crop":
            steps.append(_CenterCrop(img_size))
        return Compose(steps)

    return {"img_transform": build(), "mask_transform": build()}


class RGBAImageProcessor:
    """Image (+ mask) -> model-ready (image [3, S, S], mask [1, S, S]): optional object crop, background removal,
    resize / square, ImageNet normalisation."""

    def __init__(self, resize_and_make_square_kwargs: Optional[dict] = None, object_crop_kwargs=None,
                 remove_background: bool = False, imagenet_normalization: bool = False):
        self.resize_and_make_square_kwargs = resize_and_make_square_kwargs
        self.resize_and_pad_kwargs = resize_and_make_square_kwargs  # upstream's attribute name
        self.object_crop_kwargs = object_crop_kwargs
        self.remove_background = remove_background
        self.imagenet_normalization = imagenet_normalization
        # upstream leaves `transforms` unset without resize kwargs (and then fails in __call__): identity here
        identity = Compose([])
        self.transforms = (resize_and_make_square(**resize_and_make_square_kwargs)
                           if resize_and_make_square_kwargs is not None
                           else {"img_transform": identity, "mask_transform": identity})

    def __call__(self, image: torch.Tensor, mask: Optional[torch.Tensor] = None):
        if mask is None:
            assert image.shape[0] == 4, "without a mask the image must be RGBA [4, H, W]"
            image, mask = split_rgba(image)
        else:
            assert image.shape[0] == 3 and mask.dim() == 2, "expected an RGB [3, H, W] image and a [H, W] mask"
        if self.object_crop_kwargs not in (None, False):
            image, mask = crop_around_mask_with_padding(image, mask, **self.object_crop_kwargs)
        if self.remove_background:
            image, mask = rembg(image, mask)
        image = self.transforms["img_transform"](image)
        mask = self.transforms["mask_transform"](mask[None])
        if self.imagenet_normalization:
            image = IMAGENET_NORMALIZATION(image)
        return image, mask


# ----------------------------------------------------------------------------------------------------------------
# training-time mask / blur augmentations (python `random`, as upstream)
# ----------------------------------------------------------------------------------------------------------------
def perturb_mask_translation(image: torch.Tensor, mask: torch.Tensor, max_px_delta: int = 5):
    """Shift the (1, H, W) mask by integer dx, dy in [-max_px_delta, max_px_delta]; uncovered rows/cols are 0."""
    dx, dy = random.randint(-max_px_delta, max_px_delta), random.randint(-max_px_delta, max_px_delta)
    out = torch.roll(mask, shifts=(dy, dx), dims=(-2, -1))
    if dy > 0:
        out[..., :dy, :] = 0
    elif dy < 0:
        out[..., dy:, :] = 0
    if dx > 0:
        out[..., :, :dx] = 0
    elif dx < 0:
        out[..., :, dx:] = 0
    return image, out


def _morph(mask: torch.Tensor, k: int, dilate: bool, iterations: int = 1) -> torch.Tensor:
    """Binary erosion/dilation of (1, H, W) with a k x k square, anchor at k // 2 (OpenCV's convention);
    pixels beyond the border never win."""
    x = mask[None].float()
    left, right = k // 2, k - 1 - k // 2
    for _ in range(iterations):
        src = x if dilate else -x
        src = F.pad(src, (left, right, left, right), mode="constant", value=-float("inf"))
        y = F.max_pool2d(src, kernel_size=k, stride=1)
        x = y if dilate else -y
    return x[0]


def perturb_mask_boundary(image: torch.Tensor, mask: torch.Tensor, kernel_range=(2, 5), p_erode: float = 0.1,
                          p_dilate: float = 0.8, **kwargs):
    """Erode (p_erode), dilate (p_dilate) or keep a binary float (1, H, W) mask, square kernel of size
    randint(kernel_range); ``iterations`` may be passed (as to OpenCV). Returns (image, float mask on CPU)."""
    assert mask.dtype == torch.float32 and mask.dim() == 3 and mask.shape[0] == 1, "expected a float32 (1, H, W) mask"
    assert bool(((mask == 0) | (mask == 1)).all()), "the mask must be binary"
    choice = random.choices(["erode", "dilate", "none"], weights=[p_erode, p_dilate, 1 - p_erode - p_dilate])[0]
    if choice == "none":
        return image, mask.cpu()
    k = random.randint(kernel_range[0], kernel_range[1])
    return image, _morph(mask.cpu(), k, dilate=choice == "dilate", iterations=int(kwargs.get("iterations", 1)))


def resolution_blur(image: torch.Tensor, mask: torch.Tensor, scale_range=(0.05, 0.95),
                    interpolation_down="bicubic", interpolation_up="bicubic"):
    """Downscale the image by U(scale_range) (at least 1 px) and back: the loss of detail of a low-res photo.
    Interpolations are names or torchvision ``InterpolationMode`` values (upstream's default: BICUBIC)."""
    h, w = image.shape[-2:]
    f = random.uniform(*scale_range)
    small = resize_chw(image, (max(1, int(h * f)), max(1, int(w * f))), interpolation_down)
    return resize_chw(small, (h, w), interpolation_up), mask


def gaussian_blur(image: torch.Tensor, mask: torch.Tensor, kernel_range=(3, 15), sigma_range=(0.1, 4.0)):
    """Gaussian blur with an odd kernel from ``kernel_range`` and sigma ~ U(sigma_range); borders replicate."""
    odd = [k for k in range(kernel_range[0], kernel_range[1] + 1) if k % 2 == 1]
    k = random.choice(odd)
    sigma = random.uniform(*sigma_range)
    return gaussian_blur_chw(image, k, sigma, padding_mode="replicate"), mask


def apply_blur_augmentation(image: torch.Tensor, mask: torch.Tensor, p_resolution: float = 0.33,
                            p_gaussian: float = 0.33, gaussian_kwargs: Optional[dict] = None,
                            resolution_kwargs: Optional[dict] = None):
    """One of Gaussian blur (p_gaussian), resolution blur (p_resolution) or nothing."""
    rest = 1 - p_resolution - p_gaussian
    assert 0 <= rest <= 1, "p_resolution + p_gaussian must lie in [0, 1]"
    choice = random.choices(["gaussian", "resolution", "none"], weights=[p_gaussian, p_resolution, rest])[0]
    if choice == "gaussian":
        return gaussian_blur(image, mask, **(gaussian_kwargs or {}))
    if choice == "resolution":
        return resolution_blur(image, mask, **(resolution_kwargs or {}))
    return image, mask
