"""DINOv2 image / mask embedder.

Upstream fetches the backbone with `torch.hub.load("facebookresearch/dinov2", dino_model, **backbone_kwargs)` and
then overwrites every weight from the generator checkpoint; here the same architecture is built locally (no hub,
no network), so constructing the module only allocates the tensors the checkpoint fills.
"""
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .dinov2 import build_dinov2

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class Dino(nn.Module):
    """Images [B, 3, H, W] or masks [B, 1, H, W] (float, 0..1) -> DINOv2 tokens.

    Output: CLS + patch tokens after the backbone's final norm [B, 1 + P, D]; with `prenorm_features=True`:
    CLS + register + patch tokens before that norm, through a non-affine layer norm [B, 1 + R + P, D].
    """

    def __init__(self, input_size: int = 224, repo_or_dir: str = "facebookresearch/dinov2",
                 dino_model: str = "dinov2_vitb14", source: str = "github", backbone_kwargs: Optional[dict] = None,
                 normalize_images: bool = True, freeze_backbone: bool = True, prune_network: bool = False,
                 prenorm_features: bool = False):
        super().__init__()
        self.input_size = input_size
        self.dino_model = dino_model
        self.normalize_images = normalize_images
        self.freeze_backbone = freeze_backbone
        self.prune_network = prune_network
        self.prenorm_features = prenorm_features
        self.backbone = build_dinov2(dino_model, **dict(backbone_kwargs or {}))
        patch = self.backbone.patch_size
        if input_size % patch:
            raise ValueError(f"input_size {input_size} must be a multiple of the patch size {patch}")
        self.embed_dim = self.backbone.embed_dim
        self.resize_input_size = (input_size, input_size)
        self.input_channels = 3
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).reshape(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(IMAGENET_STD).reshape(1, 3, 1, 1), persistent=False)
        if freeze_backbone:
            for p in self.backbone.parameters():
                p.requires_grad_(False)
        if prune_network:
            self._prune_network()

    def _prune_network(self) -> None:
        """Drop what the embedder never uses (upstream's option, for training without unused parameters): the
        backbone's mask token and, with ``prenorm_features``, its final norm. Their checkpoint keys go too."""
        self.backbone.mask_token = None
        if self.prenorm_features:
            self.backbone.norm = nn.Identity()

    def _preprocess_input(self, x: torch.Tensor) -> torch.Tensor:
        """Resize to ``resize_input_size`` (bilinear), masks repeated to 3 channels, ImageNet normalisation."""
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[1] not in (1, 3):
            raise ValueError(f"Dino expects images [B, 3, H, W] or masks [B, 1, H, W], got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if not x.dtype.is_floating_point:
            raise TypeError(f"Dino expects float images in [0, 1], got {x.dtype} (convert with x.float() / 255)")
        x = F.interpolate(x, size=tuple(self.resize_input_size), mode="bilinear", align_corners=False)
        if x.shape[1] == 1:
            x = x.repeat(1, self.input_channels, 1, 1)
        if self.normalize_images:
            mean, std = self._normalization(x)
            x = (x - mean) / std
        return x

    def preprocess(self, x: torch.Tensor) -> torch.Tensor:
        """Same as ``_preprocess_input`` (upstream's private name)."""
        return self._preprocess_input(x)

    def _normalization(self, x: torch.Tensor):
        """ImageNet mean/std; the non-persistent buffers are rebuilt when the module was built on the meta device
        (an assign=True load never fills them)."""
        if self.mean.is_meta or self.std.is_meta:
            self.mean = torch.tensor(IMAGENET_MEAN, device=x.device).reshape(1, 3, 1, 1)
            self.std = torch.tensor(IMAGENET_STD, device=x.device).reshape(1, 3, 1, 1)
        return self.mean.to(x.device, x.dtype), self.std.to(x.device, x.dtype)

    def _forward_intermediate_layers(self, input_img: torch.Tensor, intermediate_layers, cls_token: bool = True):
        """The backbone's ``get_intermediate_layers`` on a preprocessed image (pairs with the CLS token)."""
        return self.backbone.get_intermediate_layers(input_img, intermediate_layers, return_class_token=cls_token)

    def _forward_last_layer(self, input_img: torch.Tensor) -> torch.Tensor:
        """Tokens of a preprocessed image: CLS + patch tokens after the final norm, or with ``prenorm_features``
        all tokens before it through a non-affine layer norm."""
        features = self.backbone.forward_features(input_img.to(self.backbone.patch_embed.proj.weight.dtype))
        if self.prenorm_features:
            tokens = features["x_prenorm"]
            return F.layer_norm(tokens, tokens.shape[-1:])
        return torch.cat([features["x_norm_clstoken"].unsqueeze(1), features["x_norm_patchtokens"]], dim=1)

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:  # extra keywords ignored, as upstream
        """Tokens in the input's dtype (as upstream)."""
        return self._forward_last_layer(self._preprocess_input(x)).to(x.dtype)


class DinoForMasks(nn.Module):
    """Embeds the mask (not the image) with a Dino backbone: forward(image, mask) = backbone(mask), the 1-channel
    mask repeated to RGB by Dino."""

    def __init__(self, backbone: Dino):
        super().__init__()
        self.backbone = backbone
        self.embed_dim = backbone.embed_dim

    def forward(self, image: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.backbone(mask)
