"""Activations applied to SparseTensor features."""
import torch.nn as nn

from .basic import SparseTensor

__all__ = ["SparseReLU", "SparseSiLU", "SparseGELU", "SparseActivation"]


class FeaturewiseActivation:
    """Mixed in before a dense activation: runs it on a SparseTensor's features, keeping the coords."""

    def forward(self, input: SparseTensor) -> SparseTensor:
        return input.replace(super().forward(input.feats))


class SparseReLU(FeaturewiseActivation, nn.ReLU):
    """`nn.ReLU` on SparseTensor features."""


class SparseSiLU(FeaturewiseActivation, nn.SiLU):
    """`nn.SiLU` on SparseTensor features."""


class SparseGELU(FeaturewiseActivation, nn.GELU):
    """`nn.GELU` on SparseTensor features."""


class SparseActivation(nn.Module):
    """Wraps any dense activation module."""

    def __init__(self, activation: nn.Module):
        super().__init__()
        self.activation = activation

    def forward(self, input: SparseTensor) -> SparseTensor:
        return input.replace(self.activation(input.feats))
