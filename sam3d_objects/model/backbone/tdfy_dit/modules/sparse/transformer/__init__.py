"""Sparse transformer blocks."""
from .blocks import SparseFeedForwardNet, SparseTransformerBlock, SparseTransformerCrossBlock
from .modulated import ModulatedSparseTransformerBlock, ModulatedSparseTransformerCrossBlock

__all__ = ["SparseFeedForwardNet", "SparseTransformerBlock", "SparseTransformerCrossBlock",
           "ModulatedSparseTransformerBlock", "ModulatedSparseTransformerCrossBlock"]
