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

# ---- upstream's module-level switches. The environment is read by `backends.registry` only; these names mirror
# its choices and the setters delegate to it (so, unlike upstream, they also act after import).
import logging as _logging  # noqa: E402

import backends as _backends  # noqa: E402

logger = _logging.getLogger("sam3d_objects.sparse")
BACKEND: str = _backends.requested_backend("sparse_conv")
ATTN: str = _backends.requested_backend("sparse_attn")
DEBUG: bool = _backends.env_flag("SPARSE_DEBUG")


def set_backend(backend: str) -> None:
    """Choose the sparse-convolution backend process-wide (``backends.set_backend(sparse=...)``)."""
    global BACKEND
    import backends
    backends.set_backend(sparse=backend)
    BACKEND = backend


def set_debug(debug: bool) -> None:
    global DEBUG
    DEBUG = bool(debug)


def set_attn(attn: str) -> None:
    """Choose the sparse-attention backend process-wide (``backends.set_backend(sparse_attn=...)``)."""
    global ATTN
    import backends
    backends.set_backend(sparse_attn=attn)
    ATTN = attn
