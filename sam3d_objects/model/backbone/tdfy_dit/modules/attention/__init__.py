"""Dense attention: `scaled_dot_product_attention` (through `backends.attention`) and attention layers."""
from .full_attn import scaled_dot_product_attention
from .modules import MultiHeadAttention, MultiHeadRMSNorm, RotaryPositionEmbedder

__all__ = ["scaled_dot_product_attention", "MultiHeadAttention", "MultiHeadRMSNorm", "RotaryPositionEmbedder"]
