"""Normalisation of SparseTensor features.

GroupNorm statistics are per batch element over all of its voxels (upstream's rule). LayerNorm normalises each
voxel over its channels; upstream's SparseLayerNorm instead feeds a [1, C, N] view to nn.LayerNorm(C), which only
runs when N == C and is used by no released model, so the per-voxel form is given here.
"""
import torch
import torch.nn as nn

import backends

from .basic import SparseTensor

__all__ = ["SparseGroupNorm", "SparseLayerNorm", "SparseGroupNorm32", "SparseLayerNorm32"]


class SparseGroupNorm(nn.GroupNorm):
    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True,
                 **factory_kwargs):
        super().__init__(num_groups, num_channels, eps=eps, affine=affine, **factory_kwargs)

    def forward(self, input: SparseTensor) -> SparseTensor:
        feats = input.feats
        if feats.shape[-1] != self.num_channels:
            raise ValueError(f"SparseGroupNorm expects {self.num_channels} channels, got {feats.shape[-1]}")
        if len(input.layout) == 1:  # one batch element: no output buffer, the [C, N] result is viewed back
            return input.replace(self._normalize(feats).t())
        out = torch.empty_like(feats)
        for rows in input.layout:
            if rows.stop > rows.start:
                out[rows] = self._normalize(feats[rows]).t()
        return input.replace(out)

    def normalize_(self, input: SparseTensor) -> SparseTensor:
        """The forward's values, written over ``input``'s features where the norm backend can (the caller gives
        them up: no second feature tensor at the peak of a large decoder); elsewhere, and under autograd (whose
        backward reads the input), as the forward."""
        if torch.is_grad_enabled():
            return self(input)
        feats = input.feats
        if feats.shape[-1] != self.num_channels:
            raise ValueError(f"SparseGroupNorm expects {self.num_channels} channels, got {feats.shape[-1]}")
        if len(input.layout) == 1:
            return input.replace(backends.group_norm_rows_(feats, self.num_groups, self.weight, self.bias, self.eps))
        for rows in input.layout:
            if rows.stop > rows.start:
                part = feats[rows]
                got = backends.group_norm_rows_(part, self.num_groups, self.weight, self.bias, self.eps)
                if got is not part:
                    part.copy_(got)
        return input

    def _normalize(self, feats: torch.Tensor) -> torch.Tensor:
        """[n, C] voxels of one batch element -> normalised [C, n] (GroupNorm over groups and all voxels)."""
        return backends.group_norm(feats.t()[None], self.num_groups, self.weight, self.bias, self.eps)[0]


class SparseLayerNorm(nn.LayerNorm):
    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, **factory_kwargs):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, **factory_kwargs)

    def forward(self, input: SparseTensor) -> SparseTensor:
        return input.replace(backends.layer_norm(input.feats, self.normalized_shape, self.weight, self.bias,
                                                 self.eps))


class SparseGroupNorm32(SparseGroupNorm):
    """SparseGroupNorm computed in float32 whatever the feature dtype."""

    def forward(self, x: SparseTensor) -> SparseTensor:
        return super().forward(x.float()).type(x.dtype)

    def normalize_(self, x: SparseTensor) -> SparseTensor:
        # the norm backend computes half rows in float32 chunk by chunk: float32 statistics and arithmetic, as the
        # forward's float32 copy gives, without that copy
        return super().normalize_(x)


class SparseLayerNorm32(SparseLayerNorm):
    """SparseLayerNorm computed in float32 whatever the feature dtype."""

    def forward(self, x: SparseTensor) -> SparseTensor:
        return x.replace(backends.float32_layer_norm(x.feats, self.normalized_shape, self.weight, self.bias,
                                                     self.eps))
