"""Sparse transformer blocks (pre-norm attention + feed-forward)."""
from typing import Optional, Tuple, Union

import torch.nn as nn

from ...norm import LayerNorm32
from ..attention import SparseMultiHeadAttention
from ..basic import SparseTensor
from ..linear import SparseLinear
from ..nonlinearity import SparseGELU

__all__ = ["SparseFeedForwardNet", "SparseTransformerBlock", "SparseTransformerCrossBlock"]


class SparseFeedForwardNet(nn.Module):
    """SparseLinear -> tanh-GELU -> SparseLinear (keys ``mlp.0``, ``mlp.2``)."""

    def __init__(self, channels: int, mlp_ratio: float = 4.0):
        super().__init__()
        hidden = int(channels * mlp_ratio)
        self.mlp = nn.Sequential(SparseLinear(channels, hidden), SparseGELU(approximate="tanh"),
                                 SparseLinear(hidden, channels))

    def forward(self, x: SparseTensor) -> SparseTensor:
        return self.mlp(x)


def norm_feats(norm: nn.Module, x: SparseTensor) -> SparseTensor:
    return x.replace(norm(x.feats))


class SparseTransformerBlock(nn.Module):
    """x + attn(norm1(x)); x + mlp(norm2(x)). Norms have no affine parameters unless ln_affine."""

    def __init__(self, channels: int, num_heads: int, mlp_ratio: float = 4.0, attn_mode: str = "full",
                 window_size: Optional[int] = None, shift_sequence: Optional[int] = None,
                 shift_window: Optional[Union[int, Tuple[int, ...]]] = None, serialize_mode=None,
                 use_checkpoint: bool = False, use_rope: bool = False, qk_rms_norm: bool = False,
                 qkv_bias: bool = True, ln_affine: bool = False):
        super().__init__()
        self.use_checkpoint = use_checkpoint
        self.norm1 = LayerNorm32(channels, elementwise_affine=ln_affine, eps=1e-6)
        self.norm2 = LayerNorm32(channels, elementwise_affine=ln_affine, eps=1e-6)
        self.attn = SparseMultiHeadAttention(channels, num_heads=num_heads, attn_mode=attn_mode,
                                             window_size=window_size, shift_sequence=shift_sequence,
                                             shift_window=shift_window, serialize_mode=serialize_mode,
                                             qkv_bias=qkv_bias, use_rope=use_rope, qk_rms_norm=qk_rms_norm)
        self.mlp = SparseFeedForwardNet(channels, mlp_ratio=mlp_ratio)

    def forward(self, x: SparseTensor) -> SparseTensor:
        x = x + self.attn(norm_feats(self.norm1, x))
        return x + self.mlp(norm_feats(self.norm2, x))


class SparseTransformerCrossBlock(nn.Module):
    """Self-attention, cross-attention to a context, feed-forward; pre-norm residual."""

    def __init__(self, channels: int, ctx_channels: int, num_heads: int, mlp_ratio: float = 4.0,
                 attn_mode: str = "full", window_size: Optional[int] = None, shift_sequence: Optional[int] = None,
                 shift_window: Optional[Union[int, Tuple[int, ...]]] = None, serialize_mode=None,
                 use_checkpoint: bool = False, use_rope: bool = False, qk_rms_norm: bool = False,
                 qk_rms_norm_cross: bool = False, qkv_bias: bool = True, ln_affine: bool = False):
        super().__init__()
        self.use_checkpoint = use_checkpoint
        self.norm1 = LayerNorm32(channels, elementwise_affine=ln_affine, eps=1e-6)
        self.norm2 = LayerNorm32(channels, elementwise_affine=ln_affine, eps=1e-6)
        self.norm3 = LayerNorm32(channels, elementwise_affine=ln_affine, eps=1e-6)
        self.self_attn = SparseMultiHeadAttention(channels, num_heads=num_heads, type="self", attn_mode=attn_mode,
                                                  window_size=window_size, shift_sequence=shift_sequence,
                                                  shift_window=shift_window, serialize_mode=serialize_mode,
                                                  qkv_bias=qkv_bias, use_rope=use_rope, qk_rms_norm=qk_rms_norm)
        self.cross_attn = SparseMultiHeadAttention(channels, ctx_channels=ctx_channels, num_heads=num_heads,
                                                   type="cross", attn_mode="full", qkv_bias=qkv_bias,
                                                   qk_rms_norm=qk_rms_norm_cross)
        self.mlp = SparseFeedForwardNet(channels, mlp_ratio=mlp_ratio)

    def forward(self, x: SparseTensor, context) -> SparseTensor:
        x = x + self.self_attn(norm_feats(self.norm1, x))
        x = x + self.cross_attn(norm_feats(self.norm2, x), context)
        return x + self.mlp(norm_feats(self.norm3, x))
