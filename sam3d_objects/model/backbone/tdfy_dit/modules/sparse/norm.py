"""Normalisation of SparseTensor features.

GroupNorm statistics are per batch element over all of its voxels (upstream's rule). LayerNorm normalises each
voxel over its channels; upstream's SparseLayerNorm instead feeds a [1, C, N] view to nn.LayerNorm(C), which only
runs when N == C and is used by no released model, so the per-voxel form is given here.
"""
import torch
import torch.nn as nn

from .basic import SparseTensor

__all__ = ["SparseGroupNorm", "SparseLayerNorm", "SparseGroupNorm32", "SparseLayerNorm32"]


class SparseGroupNorm(nn.GroupNorm):
    def forward(self, input: SparseTensor) -> SparseTensor:
        feats = input.feats
        if feats.shape[-1] != self.num_channels:
            raise ValueError(f"SparseGroupNorm expects {self.num_channels} channels, got {feats.shape[-1]}")
        out = torch.empty_like(feats)
        for rows in input.layout:
            if rows.stop == rows.start:
                continue
            # [n, C] -> [1, C, n]: GroupNorm over channel groups and all voxels of this batch element
            block = feats[rows].transpose(0, 1).reshape(1, feats.shape[1], -1).contiguous()
            out[rows] = super().forward(block).squeeze(0).transpose(0, 1)
        return input.replace(out)


class SparseLayerNorm(nn.LayerNorm):
    def forward(self, input: SparseTensor) -> SparseTensor:
        return input.replace(super().forward(input.feats))


class SparseGroupNorm32(SparseGroupNorm):
    """SparseGroupNorm computed in float32 whatever the feature dtype."""

    def forward(self, input: SparseTensor) -> SparseTensor:
        return super().forward(input.float()).type(input.dtype)


class SparseLayerNorm32(SparseLayerNorm):
    """SparseLayerNorm computed in float32 whatever the feature dtype."""

    def forward(self, input: SparseTensor) -> SparseTensor:
        return super().forward(input.float()).type(input.dtype)
