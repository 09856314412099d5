"""Structured-latent VAE encoder: sparse voxel features -> a Gaussian posterior over the structured latent
(the SLat decoders' mirror; used for training and to encode assets)."""
from typing import Optional, Tuple, Union

import torch

import backends

from ...modules import sparse as sp
from ..sparse_structure_vae import gaussian_posterior, load_pretrained
from .base import SparseTransformerBase

__all__ = ["SLatEncoder", "SLatEncoderTdfyWrapper"]


class SLatEncoder(SparseTransformerBase):
    def __init__(self, resolution: int, in_channels: int, model_channels: int, latent_channels: int, num_blocks: int,
                 num_heads: Optional[int] = None, num_head_channels: int = 64, mlp_ratio: float = 4,
                 attn_mode: str = "swin", window_size: int = 8, pe_mode: str = "ape", use_fp16: bool = False,
                 use_checkpoint: bool = False, qk_rms_norm: bool = False):
        super().__init__(in_channels=in_channels, model_channels=model_channels, num_blocks=num_blocks,
                         num_heads=num_heads, num_head_channels=num_head_channels, mlp_ratio=mlp_ratio,
                         attn_mode=attn_mode, window_size=window_size, pe_mode=pe_mode, use_fp16=use_fp16,
                         use_checkpoint=use_checkpoint, qk_rms_norm=qk_rms_norm)
        self.resolution = resolution
        self.latent_channels = latent_channels
        self.out_layer = sp.SparseLinear(model_channels, 2 * latent_channels)
        self.initialize_weights()
        if use_fp16:
            self.convert_to_fp16()

    def initialize_weights(self) -> None:
        self._initialize_with_zero_output()

    def forward(self, x: sp.SparseTensor, sample_posterior: bool = True, return_raw: bool = False
                ) -> Union[sp.SparseTensor, Tuple[sp.SparseTensor, torch.Tensor, torch.Tensor]]:
        """z (a SparseTensor on x's voxels); with return_raw (z, mean, logvar) with mean/logvar [N, latent]."""
        h = super().forward(x).type(x.dtype)
        h = h.replace(backends.layer_norm(h.feats, h.feats.shape[-1:]))
        h = self.out_layer(h)
        mean, logvar = h.feats.chunk(2, dim=-1)
        z = h.replace(gaussian_posterior(mean, logvar, sample_posterior))
        return (z, mean, logvar) if return_raw else z


class SLatEncoderTdfyWrapper(SLatEncoder):
    """SLatEncoder that loads `pretrained_ckpt_path` when the file exists (a missing file is ignored, as upstream)."""

    def __init__(self, *args, pretrained_ckpt_path: Optional[str] = None, **kwargs):
        super().__init__(*args, **kwargs)
        load_pretrained(self, pretrained_ckpt_path, "SLat encoder", missing_ok=True)
