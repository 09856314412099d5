"""Sparse attention."""
from .full_attn import sparse_scaled_dot_product_attention
from .modules import SparseMultiHeadAttention, SparseMultiHeadRMSNorm
from .windowed_attn import calc_window_partition, sparse_windowed_scaled_dot_product_self_attention

__all__ = ["sparse_scaled_dot_product_attention", "sparse_windowed_scaled_dot_product_self_attention",
           "calc_window_partition", "SparseMultiHeadAttention", "SparseMultiHeadRMSNorm"]
from .masked_sdpa import block_diag_attn_mask, masked_sdpa  # noqa: E402  (upstream's surface)
from .serialized_attn import sparse_serialized_scaled_dot_product_self_attention  # noqa: E402
