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


def pad_to_square_centered(image: torch.Tensor, mask: Optional[torch.Tensor] = None,
                           pointmap: Optional[torch.Tensor] = None):
    """Pad ``[..., H, W]`` maps to a centred square.

    Image and mask are padded with 0, a point map passed as ``pointmap=`` with NaN (no 3D point there). Called with
    the image alone (as a single-argument transform in ``pipeline.yaml``, also for point maps) it returns the padded
    tensor padded with 0; otherwise a tuple ``(image, mask[, pointmap])``.
    """
    pad = square_padding(image.shape[-2], image.shape[-1])
    image_out = pad_chw(image, pad, 0.0)
    if mask is None and pointmap is None:
        return image_out
    out = [image_out, None if mask is None else pad_chw(mask, pad, 0.0)]
    if pointmap is not None:
        out.append(pad_chw(pointmap, pad, float("nan")))
    return tuple(out)
