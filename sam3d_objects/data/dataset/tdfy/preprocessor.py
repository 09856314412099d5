"""Image / mask / point-map preprocessing for the condition embedders (configured in ``pipeline.yaml``)."""
from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence

import torch


def _identity(x):
    return x


def apply_joint_transforms(transforms: Sequence[Callable], *maps):
    """(image, mask[, pointmap]) through each joint transform in turn (the point map passed as ``pointmap=``)."""
    for transform in transforms or ():
        maps = transform(*maps[:2], **({"pointmap": maps[2]} if len(maps) > 2 else {}))
    return maps


class PreProcessor:
    """Builds the cropped and full views of image, mask and (optionally) point map.

    Steps (each configurable, names as in ``pipeline.yaml``):
      1. ``pointmap_normalizer`` (when ``normalize_pointmap``) on the full-resolution point map and mask;
      2. ``img_mask_joint_transform`` on (image, mask) and ``img_mask_pointmap_joint_transform`` on
         (image, mask, pointmap), e.g. the crop around the mask;
      3. ``img_transform`` / ``mask_transform`` / ``pointmap_transform`` on the cropped maps AND on the full maps
         (the ``rgb_*`` outputs).
    Inputs are unbatched ``[C, H, W]`` tensors; outputs too (the pipeline adds the batch dimension).
    """

    def __init__(self, img_transform: Optional[Callable] = None, mask_transform: Optional[Callable] = None,
                 img_mask_joint_transform: Optional[Sequence[Callable]] = None,
                 img_mask_pointmap_joint_transform: Optional[Sequence[Callable]] = None,
                 normalize_pointmap: bool = False, pointmap_normalizer: Optional[object] = None,
                 pointmap_transform: Optional[Callable] = None):
        self.img_transform = img_transform or _identity
        self.mask_transform = mask_transform or _identity
        self.img_mask_joint_transform = list(img_mask_joint_transform or [])
        self.img_mask_pointmap_joint_transform = list(img_mask_pointmap_joint_transform or [])
        self.normalize_pointmap = normalize_pointmap
        self.pointmap_normalizer = pointmap_normalizer
        self.pointmap_transform = pointmap_transform or _identity

    def _normalise(self, pointmap: torch.Tensor, mask: torch.Tensor):
        if not self.normalize_pointmap or self.pointmap_normalizer is None:
            return pointmap, None, None
        return self.pointmap_normalizer.normalize(pointmap, mask)

    def _process_image_mask_pointmap_mess(self, rgb_image: torch.Tensor, rgb_image_mask: torch.Tensor,
                                          pointmap: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
        out = {}
        image, mask = apply_joint_transforms(self.img_mask_joint_transform, rgb_image, rgb_image_mask)
        if pointmap is not None:
            full_pointmap, scale, shift = self._normalise(pointmap, rgb_image_mask)
            image, mask, crop_pointmap = apply_joint_transforms(self.img_mask_pointmap_joint_transform, image, mask,
                                                      full_pointmap)
            out["pointmap"] = self.pointmap_transform(crop_pointmap)
            out["rgb_pointmap"] = self.pointmap_transform(full_pointmap)
            if scale is not None:
                # the full view reuses the object's moments (allow_scale_and_shift_override)
                out.update(pointmap_scale=scale, pointmap_shift=shift, rgb_pointmap_scale=scale,
                           rgb_pointmap_shift=shift)
        out["image"] = self.img_transform(image)
        out["mask"] = self.mask_transform(mask)
        out["rgb_image"] = self.img_transform(rgb_image)
        out["rgb_image_mask"] = self.mask_transform(rgb_image_mask)
        return out

    def __call__(self, rgb_image: torch.Tensor, rgb_image_mask: torch.Tensor,
                 pointmap: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
        return self._process_image_mask_pointmap_mess(rgb_image, rgb_image_mask, pointmap)
