"""Image / mask / point-map preprocessing for the condition embedders (configured in ``pipeline.yaml``)."""
from __future__ import annotations

import warnings
from typing import Callable, Dict, Optional, Sequence

import torch


def _identity(x):
    return x


def apply_joint_transforms(transforms: Sequence[Callable], *maps):
    """(image, mask[, pointmap]) through each joint transform in turn (the point map passed as ``pointmap=``)."""
    for transform in transforms or ():
        maps = transform(*maps[:2], **({"pointmap": maps[2]} if len(maps) > 2 else {}))
    return maps


def _given(value) -> bool:
    """Upstream marks an unset transform with the default ``(None,)``; None and empty lists mean unset too."""
    return value is not None and not (isinstance(value, tuple) and value == (None,))


class PreProcessor:
    """Builds the cropped and full views of image, mask and (optionally) point map.

    Steps (each configurable, names as in ``pipeline.yaml``; upstream's order):
      1. the point map is normalised with ``pointmap_normalizer`` on the full-resolution map and mask (without
         ``normalize_pointmap`` the map stays as is and only its scale / shift are returned);
      2. ``rgb_img_mask_joint_transform`` on the full (image, mask);
      3. the crop view: ``img_mask_pointmap_joint_transform`` on (image, mask, pointmap) when there is a point map
         and such transforms, else ``img_mask_joint_transform`` on (image, mask);
      4. ``img_transform`` / ``mask_transform`` / ``pointmap_transform`` on the cropped maps AND on the full maps
         (the ``rgb_*`` outputs; the full point map normalised with ``rgb_pointmap_normalizer`` given the crop's
         scale and shift).
    Inputs are unbatched ``[C, H, W]`` tensors; outputs too (the pipeline adds the batch dimension).
    """

    def __init__(self, img_transform: Optional[Callable] = None, mask_transform: Optional[Callable] = None,
                 img_mask_joint_transform: Optional[Sequence[Callable]] = None,
                 img_mask_pointmap_joint_transform: Optional[Sequence[Callable]] = None,
                 normalize_pointmap: bool = False, pointmap_normalizer: Optional[object] = None,
                 pointmap_transform: Optional[Callable] = None,
                 rgb_img_mask_joint_transform: Optional[Sequence[Callable]] = None,
                 rgb_pointmap_normalizer: Optional[object] = None):
        self.img_transform = img_transform if _given(img_transform) else _identity
        self.mask_transform = mask_transform if _given(mask_transform) else _identity
        self.img_mask_joint_transform = list(img_mask_joint_transform) if _given(img_mask_joint_transform) else []
        self.img_mask_pointmap_joint_transform = (list(img_mask_pointmap_joint_transform)
                                                  if _given(img_mask_pointmap_joint_transform) else [])
        self.rgb_img_mask_joint_transform = (list(rgb_img_mask_joint_transform)
                                             if _given(rgb_img_mask_joint_transform) else [])
        self.normalize_pointmap = normalize_pointmap
        if pointmap_normalizer is None:  # upstream's default: scene-level scale and shift
            from .img_and_mask_transforms import SSIPointmapNormalizer
            pointmap_normalizer = SSIPointmapNormalizer()
        self.pointmap_normalizer = pointmap_normalizer
        self.rgb_pointmap_normalizer = (rgb_pointmap_normalizer if rgb_pointmap_normalizer is not None
                                        else pointmap_normalizer)
        self.pointmap_transform = pointmap_transform if _given(pointmap_transform) else _identity

    def _normalize_pointmap(self, pointmap: Optional[torch.Tensor], mask: torch.Tensor, pointmap_normalizer,
                            scale: Optional[torch.Tensor] = None, shift: Optional[torch.Tensor] = None):
        """(point map, scale, shift): normalised with ``pointmap_normalizer`` (given scale / shift passed on), or
        unchanged with its moments when ``normalize_pointmap`` is off; (None, None, None) without a map."""
        if pointmap is None:
            return None, None, None
        if not self.normalize_pointmap:
            _, scale, shift = pointmap_normalizer.normalize(pointmap, mask)
            return pointmap, scale, shift
        if scale is not None or shift is not None:
            return tuple(pointmap_normalizer.normalize(pointmap, mask, scale, shift))
        return tuple(pointmap_normalizer.normalize(pointmap, mask))

    def _apply_transform(self, input: Optional[torch.Tensor], transform: Optional[Callable]):  # noqa: A002
        """``transform(input)``; None input or an unset transform leave the input as is."""
        if input is not None and _given(transform):
            input = transform(input)  # noqa: A001
        return input

    def _preprocess_rgb_image_mask(self, rgb_image: torch.Tensor, rgb_image_mask: torch.Tensor):
        """The full view's joint transforms (``rgb_img_mask_joint_transform``)."""
        return tuple(apply_joint_transforms(self.rgb_img_mask_joint_transform, rgb_image, rgb_image_mask))

    def _preprocess_image_mask_pointmap(self, rgb_image: torch.Tensor, mask_image: torch.Tensor,
                                        pointmap: Optional[torch.Tensor] = None):
        """The crop view's joint transforms: the (image, mask, pointmap) ones when there are both a point map and
        such transforms, else the (image, mask) ones (the point map then passes unchanged)."""
        if pointmap is not None and self.img_mask_pointmap_joint_transform:
            return tuple(apply_joint_transforms(self.img_mask_pointmap_joint_transform, rgb_image, mask_image,
                                                pointmap))
        rgb_image, mask_image = apply_joint_transforms(self.img_mask_joint_transform, rgb_image, mask_image)
        return rgb_image, mask_image, pointmap

    def _preprocess_image_and_mask(self, rgb_image: torch.Tensor, mask_image: torch.Tensor):
        """The crop view's (image, mask) joint transforms only."""
        rgb_image, mask_image, _ = self._preprocess_image_mask_pointmap(rgb_image, mask_image, None)
        return rgb_image, mask_image

    def _preprocess_image_and_mask_inference(self, rgb_image: torch.Tensor, mask_image: torch.Tensor):
        """Deprecated upstream name of ``_preprocess_image_and_mask``."""
        warnings.warn("_preprocess_image_and_mask_inference is deprecated; use _preprocess_image_and_mask",
                      DeprecationWarning, stacklevel=2)
        return self._preprocess_image_and_mask(rgb_image, mask_image)

    def _process_image_mask_pointmap_mess(self, rgb_image: torch.Tensor, rgb_image_mask: torch.Tensor,
                                          pointmap: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
        """All views (see the class docstring): image, mask, rgb_image, rgb_image_mask, and with a point map
        pointmap, rgb_pointmap, pointmap_scale / _shift, rgb_pointmap_scale / _shift."""
        crop_pointmap, scale, shift = self._normalize_pointmap(pointmap, rgb_image_mask, self.pointmap_normalizer)
        rgb_image, rgb_image_mask = self._preprocess_rgb_image_mask(rgb_image, rgb_image_mask)
        image, mask, crop_pointmap = self._preprocess_image_mask_pointmap(rgb_image, rgb_image_mask, crop_pointmap)
        out = {"mask": self._apply_transform(mask, self.mask_transform),
               "image": self._apply_transform(image, self.img_transform),
               "rgb_image": self._apply_transform(rgb_image, self.img_transform),
               "rgb_image_mask": self._apply_transform(rgb_image_mask, self.mask_transform)}
        if crop_pointmap is not None:
            full_pointmap, rgb_scale, rgb_shift = self._normalize_pointmap(
                pointmap, out["rgb_image_mask"], self.rgb_pointmap_normalizer, scale, shift)
            out["pointmap"] = self._apply_transform(crop_pointmap, self.pointmap_transform)
            out["rgb_pointmap"] = self._apply_transform(full_pointmap, self.pointmap_transform)
            if scale is not None and shift is not None:
                out.update(pointmap_scale=scale, pointmap_shift=shift, rgb_pointmap_scale=rgb_scale,
                           rgb_pointmap_shift=rgb_shift)
        return out

    def _process_image_and_mask_mess(self, rgb_image: torch.Tensor, rgb_image_mask: torch.Tensor):
        """The views without a point map."""
        return self._process_image_mask_pointmap_mess(rgb_image, rgb_image_mask, None)

    def __call__(self, rgb_image: torch.Tensor, rgb_image_mask: torch.Tensor,
                 pointmap: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
        return self._process_image_mask_pointmap_mess(rgb_image, rgb_image_mask, pointmap)
