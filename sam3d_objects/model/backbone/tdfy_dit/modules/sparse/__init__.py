"""Sparse voxel tensors and layers (upstream's ``modules.sparse``), built on `backends` only."""
from .attention import (SparseMultiHeadAttention, SparseMultiHeadRMSNorm, calc_window_partition,
                        sparse_scaled_dot_product_attention, sparse_windowed_scaled_dot_product_self_attention)
from .basic import SparseTensor, sparse_batch_broadcast, sparse_batch_op, sparse_cat, sparse_unbind
from .conv import SparseConv3d, SparseInverseConv3d
from .linear import SparseLinear
from .nonlinearity import SparseActivation, SparseGELU, SparseReLU, SparseSiLU
from .norm import SparseGroupNorm, SparseGroupNorm32, SparseLayerNorm, SparseLayerNorm32
from .spatial import SparseDownsample, SparseSubdivide, SparseUpsample
from .transformer import (ModulatedSparseTransformerBlock, ModulatedSparseTransformerCrossBlock,
                          SparseFeedForwardNet, SparseTransformerBlock, SparseTransformerCrossBlock)

__all__ = [
    "SparseTensor", "sparse_batch_broadcast", "sparse_batch_op", "sparse_cat", "sparse_unbind",
    "SparseConv3d", "SparseInverseConv3d", "SparseLinear",
    "SparseReLU", "SparseSiLU", "SparseGELU", "SparseActivation",
    "SparseGroupNorm", "SparseLayerNorm", "SparseGroupNorm32", "SparseLayerNorm32",
    "SparseDownsample", "SparseUpsample", "SparseSubdivide",
    "SparseMultiHeadAttention", "SparseMultiHeadRMSNorm", "sparse_scaled_dot_product_attention",
    "sparse_windowed_scaled_dot_product_self_attention", "calc_window_partition",
    "SparseFeedForwardNet", "SparseTransformerBlock", "SparseTransformerCrossBlock",
    "ModulatedSparseTransformerBlock", "ModulatedSparseTransformerCrossBlock",
]
