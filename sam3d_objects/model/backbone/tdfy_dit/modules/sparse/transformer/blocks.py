"""Sparse transformer blocks (pre-norm attention + feed-forward)."""
from typing import Optional, Tuple, Union

import torch.nn as nn

from ...transformer.blocks import FeedForwardNet
from ...transformer.body import BlockBody, build_block_layers, run_block
from ..attention import SparseMultiHeadAttention
from ..basic import SparseTensor
from ..linear import SparseLinear
from ..nonlinearity import SparseGELU

__all__ = ["SparseFeedForwardNet", "SparseTransformerBlock", "SparseTransformerCrossBlock"]


class SparseFeedForwardNet(FeedForwardNet):
    """SparseLinear -> tanh-GELU -> SparseLinear (keys ``mlp.0``, ``mlp.2``)."""

    linear_layer = SparseLinear
    activation_layer = SparseGELU

    @staticmethod
    def _linear_gelu(x: SparseTensor, fc1: nn.Module) -> SparseTensor:
        return x.replace(FeedForwardNet._linear_gelu(x.feats, fc1))


def norm_feats(norm: nn.Module, x: SparseTensor) -> SparseTensor:
    return x.replace(norm(x.feats))


def sparse_self_attn_kwargs(attn_mode: str, window_size: Optional[int], shift_sequence: Optional[int], shift_window,
                            serialize_mode, use_rope: bool, qk_rms_norm: bool) -> dict:
    """The self-attention options of a sparse block, as its `SparseMultiHeadAttention` takes them."""
    return dict(attn_mode=attn_mode, window_size=window_size, shift_sequence=shift_sequence,
                shift_window=shift_window, serialize_mode=serialize_mode, use_rope=use_rope, qk_rms_norm=qk_rms_norm)


class SparseTokens(BlockBody):
    """SparseTensor tokens: norms act on the features."""

    _normed = staticmethod(norm_feats)


class SparseTransformerBlock(SparseTokens, nn.Module):
    """x + attn(norm1(x)); x + mlp(norm2(x)). Norms have no affine parameters unless ln_affine."""

    def __init__(self, channels: int, num_heads: int, mlp_ratio: float = 4.0, attn_mode: str = "full",
                 window_size: Optional[int] = None, shift_sequence: Optional[int] = None,
                 shift_window: Optional[Union[int, Tuple[int, ...]]] = None, serialize_mode=None,
                 use_checkpoint: bool = False, use_rope: bool = False, qk_rms_norm: bool = False,
                 qkv_bias: bool = True, ln_affine: bool = False):
        super().__init__()
        build_block_layers(self, channels, num_heads, mlp_ratio, attention=SparseMultiHeadAttention,
                           feed_forward=SparseFeedForwardNet, norm_affine=(ln_affine,) * 2,
                           self_attn_kwargs=sparse_self_attn_kwargs(attn_mode, window_size, shift_sequence,
                                                                    shift_window, serialize_mode, use_rope,
                                                                    qk_rms_norm),
                           qkv_bias=qkv_bias, use_checkpoint=use_checkpoint)

    def _forward(self, x: SparseTensor) -> SparseTensor:
        return self._plain_body(x)

    def forward(self, x: SparseTensor) -> SparseTensor:
        return run_block(self, x)


class SparseTransformerCrossBlock(SparseTokens, nn.Module):
    """Self-attention, cross-attention to a context, feed-forward; pre-norm residual."""

    def __init__(self, channels: int, ctx_channels: int, num_heads: int, mlp_ratio: float = 4.0,
                 attn_mode: str = "full", window_size: Optional[int] = None, shift_sequence: Optional[int] = None,
                 shift_window: Optional[Union[int, Tuple[int, ...]]] = None, serialize_mode=None,
                 use_checkpoint: bool = False, use_rope: bool = False, qk_rms_norm: bool = False,
                 qk_rms_norm_cross: bool = False, qkv_bias: bool = True, ln_affine: bool = False):
        super().__init__()
        build_block_layers(self, channels, num_heads, mlp_ratio, attention=SparseMultiHeadAttention,
                           feed_forward=SparseFeedForwardNet, norm_affine=(ln_affine,) * 3,
                           self_attn_kwargs=sparse_self_attn_kwargs(attn_mode, window_size, shift_sequence,
                                                                    shift_window, serialize_mode, use_rope,
                                                                    qk_rms_norm),
                           ctx_channels=ctx_channels, qk_rms_norm_cross=qk_rms_norm_cross, qkv_bias=qkv_bias,
                           use_checkpoint=use_checkpoint)

    def _forward(self, x: SparseTensor, context) -> SparseTensor:
        return self._plain_body(x, context)

    def forward(self, x: SparseTensor, context) -> SparseTensor:
        return run_block(self, x, context)
