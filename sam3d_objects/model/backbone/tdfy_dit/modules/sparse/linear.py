"""Per-voxel linear layer."""
import torch.nn as nn

from ..utils import register_fp16_module
from .basic import SparseTensor

__all__ = ["SparseLinear"]


@register_fp16_module
class SparseLinear(nn.Linear):
    """`nn.Linear` applied to the features of a SparseTensor (same parameter names as nn.Linear)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **factory_kwargs):
        # upstream's signature; device= / dtype= still reach nn.Linear
        super().__init__(in_features, out_features, bias=bias, **factory_kwargs)

    def forward(self, input: SparseTensor) -> SparseTensor:
        if input.feats.shape[-1] != self.in_features:
            raise ValueError(f"SparseLinear expects {self.in_features} input channels, got {input.feats.shape[-1]}")
        return input.replace(super().forward(input.feats))
