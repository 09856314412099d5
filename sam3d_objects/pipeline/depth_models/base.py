"""Upstream's ``depth_models.base``: the common base of depth / point-map models."""
from __future__ import annotations

from typing import Any, Optional, Union

import torch


class DepthModel:
    """Holds a network on ``device`` in eval mode; subclasses turn an image into a point map in ``__call__``.

    The base call returns None, as upstream's (it has no network of its own to run)."""

    def __init__(self, model: Any, device: Optional[Union[str, torch.device]] = "cpu") -> None:
        self.device = torch.device(device if device is not None else "cpu")
        self.model = model.to(self.device) if hasattr(model, "to") else model
        if hasattr(self.model, "eval"):
            self.model.eval()

    def __call__(self, image: Any) -> Optional[dict]:
        return None
