"""adaLN-modulated sparse transformer blocks (the SLat flow's blocks)."""
from typing import Optional, Tuple, Union

import torch
import torch.nn as nn

import backends

from ...transformer.body import build_block_layers, norm_modulated, run_block
from ..attention import SparseMultiHeadAttention
from ..basic import SparseTensor
from .blocks import SparseFeedForwardNet, SparseTokens, sparse_self_attn_kwargs

__all__ = ["ModulatedSparseTransformerBlock", "ModulatedSparseTransformerCrossBlock"]


def modulate(x: SparseTensor, shift: torch.Tensor, scale: torch.Tensor) -> SparseTensor:
    """x * (1 + scale) + shift with per-batch [B, C] scale/shift."""
    return x * (1 + scale) + shift


def _batch_index(x: SparseTensor) -> Optional[torch.Tensor]:
    """Each voxel's batch element (the coords' first column, a strided view), or None for a batch of one."""
    return x.coords[:, 0] if x.shape[0] > 1 else None


class SparseModulation(SparseTokens):
    """SparseTensor tokens: [B, C] shift/scale/gate applied per batch element."""

    @staticmethod
    def _norm_modulated(norm: nn.Module, x: SparseTensor, shift: Optional[torch.Tensor] = None,
                        scale: Optional[torch.Tensor] = None) -> SparseTensor:
        return x.replace(norm_modulated(norm, x.feats, shift, scale, batch_index=_batch_index(x)))

    @staticmethod
    def _gated_residual(x: SparseTensor, h: SparseTensor, gate: torch.Tensor) -> SparseTensor:
        return x.replace(backends.gated_residual(x.feats, h.feats, gate, batch_index=_batch_index(x)))


class ModulatedSparseTransformerBlock(SparseModulation, nn.Module):
    def __init__(self, channels: int, num_heads: int, mlp_ratio: float = 4.0, attn_mode: str = "full",
                 window_size: Optional[int] = None, shift_sequence: Optional[int] = None,
                 shift_window: Optional[Union[int, Tuple[int, ...]]] = None, serialize_mode=None,
                 use_checkpoint: bool = False, use_rope: bool = False, qk_rms_norm: bool = False,
                 qkv_bias: bool = True, share_mod: bool = False):
        super().__init__()
        build_block_layers(self, channels, num_heads, mlp_ratio, attention=SparseMultiHeadAttention,
                           feed_forward=SparseFeedForwardNet, norm_affine=(False, False),
                           self_attn_kwargs=sparse_self_attn_kwargs(attn_mode, window_size, shift_sequence,
                                                                    shift_window, serialize_mode, use_rope,
                                                                    qk_rms_norm),
                           qkv_bias=qkv_bias, use_checkpoint=use_checkpoint, share_mod=share_mod)

    def _forward(self, x: SparseTensor, mod: torch.Tensor) -> SparseTensor:
        return self._modulated_body(x, mod)

    def forward(self, x: SparseTensor, mod: torch.Tensor) -> SparseTensor:
        return run_block(self, x, mod)


class ModulatedSparseTransformerCrossBlock(SparseModulation, nn.Module):
    """Modulated self-attention, plain cross-attention (affine norm2), modulated feed-forward."""

    def __init__(self, channels: int, ctx_channels: int, num_heads: int, mlp_ratio: float = 4.0,
                 attn_mode: str = "full", window_size: Optional[int] = None, shift_sequence: Optional[int] = None,
                 shift_window: Optional[Union[int, Tuple[int, ...]]] = None, serialize_mode=None,
                 use_checkpoint: bool = False, use_rope: bool = False, qk_rms_norm: bool = False,
                 qk_rms_norm_cross: bool = False, qkv_bias: bool = True, share_mod: bool = False):
        super().__init__()
        build_block_layers(self, channels, num_heads, mlp_ratio, attention=SparseMultiHeadAttention,
                           feed_forward=SparseFeedForwardNet, norm_affine=(False, True, False),
                           self_attn_kwargs=sparse_self_attn_kwargs(attn_mode, window_size, shift_sequence,
                                                                    shift_window, serialize_mode, use_rope,
                                                                    qk_rms_norm),
                           ctx_channels=ctx_channels, qk_rms_norm_cross=qk_rms_norm_cross, qkv_bias=qkv_bias,
                           use_checkpoint=use_checkpoint, share_mod=share_mod)

    def _forward(self, x: SparseTensor, mod: torch.Tensor, context) -> SparseTensor:
        return self._modulated_body(x, mod, context)

    def forward(self, x: SparseTensor, mod: torch.Tensor, context) -> SparseTensor:
        return run_block(self, x, mod, context)
