"""Structured latent -> 3D Gaussians (``num_gaussians`` per voxel) through a swin sparse transformer."""
from typing import Dict, List, Optional

import torch

import backends

from ...modules import sparse as sp
from ...representations.gaussian import Gaussian
from ..structured_latent_flow import check_sparse_input
from ..sparse_structure_vae import load_pretrained
from .base import SparseTransformerBase

__all__ = ["SLatGaussianDecoder", "SLatGaussianDecoderTdfyWrapper", "hammersley_sequence"]

PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53)


def radical_inverse(base: int, n: int) -> float:
    """Digits of n in `base` mirrored behind the radix point."""
    value, inv_base, scale = 0.0, 1.0 / base, 1.0 / base
    while n > 0:
        value += (n % base) * scale
        n //= base
        scale *= inv_base
    return value


def hammersley_sequence(dim: int, n: int, num_samples: int) -> List[float]:
    """n-th point of the `dim`-D Hammersley set: [n / num_samples, radical inverses in bases 2, 3, ...]."""
    return [n / num_samples] + [radical_inverse(PRIMES[d], n) for d in range(dim - 1)]


class SLatGaussianDecoder(SparseTransformerBase):
    """Output per voxel: _xyz (ng*3) | _features_dc (ng*3) | _scaling (ng*3) | _rotation (ng*4) | _opacity (ng)."""

    def initialize_weights(self) -> None:
        """Training initialisation (not run at construction: checkpoints overwrite it): xavier Linear weights,
        zero biases, zero output layer."""
        self._initialize_with_zero_output()

    def __init__(self, resolution: int, model_channels: int, latent_channels: int, num_blocks: int,
                 num_heads: Optional[int] = None, num_head_channels: int = 64, mlp_ratio: float = 4,
                 attn_mode: str = "swin", window_size: int = 8, pe_mode: str = "ape", use_fp16: bool = False,
                 use_checkpoint: bool = False, qk_rms_norm: bool = False,
                 representation_config: Optional[Dict] = None):
        super().__init__(in_channels=latent_channels, model_channels=model_channels, num_blocks=num_blocks,
                         num_heads=num_heads, num_head_channels=num_head_channels, mlp_ratio=mlp_ratio,
                         attn_mode=attn_mode, window_size=window_size, pe_mode=pe_mode, use_fp16=use_fp16,
                         use_checkpoint=use_checkpoint, qk_rms_norm=qk_rms_norm)
        if representation_config is None:
            raise ValueError("SLatGaussianDecoder needs representation_config (num_gaussians, voxel_size, lr, ...)")
        self.resolution = resolution
        self.rep_config = representation_config
        self._calc_layout()
        self.out_layer = sp.SparseLinear(model_channels, self.out_channels)
        self._build_perturbation()
        if use_fp16:
            self.convert_to_fp16()

    def _build_perturbation(self) -> None:
        """Fixed per-Gaussian offsets: atanh((Hammersley point * 2 - 1) / voxel_size)."""
        n = self.rep_config["num_gaussians"]
        points = torch.tensor([hammersley_sequence(3, i, n) for i in range(n)]).float() * 2 - 1
        self.register_buffer("offset_perturbation", torch.atanh(points / self.rep_config["voxel_size"]))

    def _calc_layout(self) -> None:
        n = self.rep_config["num_gaussians"]
        shapes = {"_xyz": (n, 3), "_features_dc": (n, 1, 3), "_scaling": (n, 3), "_rotation": (n, 4),
                  "_opacity": (n, 1)}
        self.layout = {}
        start = 0
        for name, shape in shapes.items():
            size = 1
            for s in shape:
                size *= s
            self.layout[name] = {"shape": shape, "size": size, "range": (start, start + size)}
            start += size
        self.out_channels = start

    def to_representation(self, x: sp.SparseTensor) -> List[Gaussian]:
        """One Gaussian object per batch element."""
        cfg = self.rep_config
        result = []
        for i in range(x.shape[0]):
            gaussian = Gaussian(sh_degree=0, aabb=[-0.5, -0.5, -0.5, 1.0, 1.0, 1.0],
                                mininum_kernel_size=cfg["3d_filter_kernel_size"], scaling_bias=cfg["scaling_bias"],
                                opacity_bias=cfg["opacity_bias"], scaling_activation=cfg["scaling_activation"],
                                device=x.device)
            rows = x.layout[i]
            feats = x.feats[rows]
            centers = (x.coords[rows][:, 1:].float() + 0.5) / self.resolution
            for name, spec in self.layout.items():
                part = feats[:, spec["range"][0]:spec["range"][1]].reshape(-1, *spec["shape"]) * cfg["lr"][name]
                if name == "_xyz":
                    if cfg["perturb_offset"]:
                        part = part + self.offset_perturbation
                    offset = torch.tanh(part) / self.resolution * 0.5 * cfg["voxel_size"]
                    part = centers.unsqueeze(1) + offset
                setattr(gaussian, name, part.flatten(0, 1))
            result.append(gaussian)
        return result

    def forward(self, x: sp.SparseTensor) -> List[Gaussian]:
        """Empty input (0 voxels) -> an empty list."""
        if x.coords.shape[0] == 0:
            return []
        check_sparse_input(x, self.in_channels, self.resolution, type(self).__name__)
        h = super().forward(x).type(x.dtype)
        h = h.replace(backends.layer_norm(h.feats, h.feats.shape[-1:]))
        return self.to_representation(self.out_layer(h))


class SLatGaussianDecoderTdfyWrapper(SLatGaussianDecoder):
    """The class named by the released configs (same arguments and behaviour); `pretrained_ckpt_path` loads weights
    (a missing file is an error, as upstream)."""

    def __init__(self, *args, pretrained_ckpt_path: Optional[str] = None, **kwargs):
        super().__init__(*args, **kwargs)
        load_pretrained(self, pretrained_ckpt_path, "SLatGaussianDecoder", missing_ok=False)
