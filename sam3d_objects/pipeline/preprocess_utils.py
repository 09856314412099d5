"""Upstream's ``pipeline.preprocess_utils``: the default preprocessor of ``InferencePipeline`` (``pipeline.yaml``
replaces it with its own configuration)."""
from __future__ import annotations

from functools import partial

from sam3d_objects.data.dataset.tdfy.img_and_mask_transforms import crop_around_mask_with_padding, rembg
from sam3d_objects.data.dataset.tdfy.img_processing import pad_to_square_centered
from sam3d_objects.data.dataset.tdfy.preprocessor import PreProcessor
from sam3d_objects.data.transforms import Compose, InterpolationMode, Resize

__all__ = ["get_default_preprocessor"]


def get_default_preprocessor() -> PreProcessor:
    """Square-pad then resize to 518 (bicubic image, nearest mask), after cropping around the mask (box 1.0,
    padding 0.1) and removing the background (image * mask; point map NaN outside the mask)."""
    return PreProcessor(
        img_transform=Compose([pad_to_square_centered, Resize(518, interpolation=InterpolationMode.BICUBIC)]),
        mask_transform=Compose([pad_to_square_centered, Resize(518, interpolation=InterpolationMode.NEAREST)]),
        img_mask_joint_transform=[partial(crop_around_mask_with_padding, box_size_factor=1.0, padding_factor=0.1),
                                  rembg],
    )
