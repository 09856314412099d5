"""Structured latent -> radiance field: one Strivec voxel (rank x 3 x dim tri-vectors, densities, DC colours) per
active voxel, through the decoders' swin sparse transformer."""
import math
from typing import Dict, List, Optional

import torch

import backends

from ...modules import sparse as sp
from ...representations import Strivec
from .base import SparseTransformerBase

__all__ = ["SLatRadianceFieldDecoder"]


class SLatRadianceFieldDecoder(SparseTransformerBase):
    def __init__(self, resolution: int, model_channels: int, latent_channels: int, num_blocks: int,
                 num_heads: Optional[int] = None, num_head_channels: int = 64, mlp_ratio: float = 4,
                 attn_mode: str = "swin", window_size: int = 8, pe_mode: str = "ape", use_fp16: bool = False,
                 use_checkpoint: bool = False, qk_rms_norm: bool = False,
                 representation_config: Optional[Dict] = None):
        super().__init__(in_channels=latent_channels, model_channels=model_channels, num_blocks=num_blocks,
                         num_heads=num_heads, num_head_channels=num_head_channels, mlp_ratio=mlp_ratio,
                         attn_mode=attn_mode, window_size=window_size, pe_mode=pe_mode, use_fp16=use_fp16,
                         use_checkpoint=use_checkpoint, qk_rms_norm=qk_rms_norm)
        if representation_config is None or "rank" not in representation_config or "dim" not in representation_config:
            raise ValueError("SLatRadianceFieldDecoder needs representation_config={'rank': ..., 'dim': ...}")
        self.resolution = resolution
        self.rep_config = representation_config
        self._calc_layout()
        self.out_layer = sp.SparseLinear(model_channels, self.out_channels)
        self.initialize_weights()
        if use_fp16:
            self.convert_to_fp16()

    def initialize_weights(self) -> None:
        self._initialize_with_zero_output()

    def _calc_layout(self) -> None:
        rank, dim = self.rep_config["rank"], self.rep_config["dim"]
        shapes = {"trivec": (rank, 3, dim), "density": (rank,), "features_dc": (rank, 1, 3)}
        self.layout = {}
        start = 0
        for name, shape in shapes.items():
            size = math.prod(shape)
            self.layout[name] = {"shape": shape, "size": size, "range": (start, start + size)}
            start += size
        self.out_channels = start

    def to_representation(self, x: sp.SparseTensor) -> List[Strivec]:
        """One Strivec per batch element, its leaves at the voxel centres."""
        result = []
        for i in range(x.shape[0]):
            rep = Strivec(sh_degree=0, resolution=self.resolution, aabb=[-0.5, -0.5, -0.5, 1, 1, 1],
                          rank=self.rep_config["rank"], dim=self.rep_config["dim"], device=x.device)
            rep.density_shift = 0.0
            rows = x.layout[i]
            rep.position = (x.coords[rows][:, 1:].float() + 0.5) / self.resolution
            rep.depth = torch.full((rep.position.shape[0], 1), int(math.log2(self.resolution)), dtype=torch.uint8,
                                   device=x.device)
            feats = x.feats[rows]
            for name, spec in self.layout.items():
                setattr(rep, name, feats[:, spec["range"][0]:spec["range"][1]].reshape(-1, *spec["shape"]))
            rep.trivec = rep.trivec + 1
            result.append(rep)
        return result

    def forward(self, x: sp.SparseTensor) -> List[Strivec]:
        h = super().forward(x).type(x.dtype)
        h = h.replace(backends.layer_norm(h.feats, h.feats.shape[-1:]))
        return self.to_representation(self.out_layer(h))
