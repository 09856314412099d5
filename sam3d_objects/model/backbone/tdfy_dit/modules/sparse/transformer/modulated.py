"""adaLN-modulated sparse transformer blocks (the SLat flow's blocks)."""
from typing import Optional, Tuple, Union

import torch
import torch.nn as nn

from ...norm import LayerNorm32
from ...transformer.modulated import adaln_params
from ..attention import SparseMultiHeadAttention
from ..basic import SparseTensor
from .blocks import SparseFeedForwardNet, norm_feats

__all__ = ["ModulatedSparseTransformerBlock", "ModulatedSparseTransformerCrossBlock"]


def modulate(x: SparseTensor, shift: torch.Tensor, scale: torch.Tensor) -> SparseTensor:
    """x * (1 + scale) + shift with per-batch [B, C] scale/shift."""
    return x * (1 + scale) + shift


class ModulatedSparseTransformerBlock(nn.Module):
    def __init__(self, channels: int, num_heads: int, mlp_ratio: float = 4.0, attn_mode: str = "full",
                 window_size: Optional[int] = None, shift_sequence: Optional[int] = None,
                 shift_window: Optional[Union[int, Tuple[int, ...]]] = None, serialize_mode=None,
                 use_checkpoint: bool = False, use_rope: bool = False, qk_rms_norm: bool = False,
                 qkv_bias: bool = True, share_mod: bool = False):
        super().__init__()
        self.use_checkpoint = use_checkpoint
        self.share_mod = share_mod
        self.norm1 = LayerNorm32(channels, elementwise_affine=False, eps=1e-6)
        self.norm2 = LayerNorm32(channels, elementwise_affine=False, eps=1e-6)
        self.attn = SparseMultiHeadAttention(channels, num_heads=num_heads, attn_mode=attn_mode,
                                             window_size=window_size, shift_sequence=shift_sequence,
                                             shift_window=shift_window, serialize_mode=serialize_mode,
                                             qkv_bias=qkv_bias, use_rope=use_rope, qk_rms_norm=qk_rms_norm)
        self.mlp = SparseFeedForwardNet(channels, mlp_ratio=mlp_ratio)
        if not share_mod:
            self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(channels, 6 * channels, bias=True))

    def forward(self, x: SparseTensor, mod: torch.Tensor) -> SparseTensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = adaln_params(self, mod)
        x = x + self.attn(modulate(norm_feats(self.norm1, x), shift_msa, scale_msa)) * gate_msa
        return x + self.mlp(modulate(norm_feats(self.norm2, x), shift_mlp, scale_mlp)) * gate_mlp


class ModulatedSparseTransformerCrossBlock(nn.Module):
    """Modulated self-attention, plain cross-attention (affine norm2), modulated feed-forward."""

    def __init__(self, channels: int, ctx_channels: int, num_heads: int, mlp_ratio: float = 4.0,
                 attn_mode: str = "full", window_size: Optional[int] = None, shift_sequence: Optional[int] = None,
                 shift_window: Optional[Union[int, Tuple[int, ...]]] = None, serialize_mode=None,
                 use_checkpoint: bool = False, use_rope: bool = False, qk_rms_norm: bool = False,
                 qk_rms_norm_cross: bool = False, qkv_bias: bool = True, share_mod: bool = False):
        super().__init__()
        self.use_checkpoint = use_checkpoint
        self.share_mod = share_mod
        self.norm1 = LayerNorm32(channels, elementwise_affine=False, eps=1e-6)
        self.norm2 = LayerNorm32(channels, elementwise_affine=True, eps=1e-6)
        self.norm3 = LayerNorm32(channels, elementwise_affine=False, eps=1e-6)
        self.self_attn = SparseMultiHeadAttention(channels, num_heads=num_heads, type="self", attn_mode=attn_mode,
                                                  window_size=window_size, shift_sequence=shift_sequence,
                                                  shift_window=shift_window, serialize_mode=serialize_mode,
                                                  qkv_bias=qkv_bias, use_rope=use_rope, qk_rms_norm=qk_rms_norm)
        self.cross_attn = SparseMultiHeadAttention(channels, ctx_channels=ctx_channels, num_heads=num_heads,
                                                   type="cross", attn_mode="full", qkv_bias=qkv_bias,
                                                   qk_rms_norm=qk_rms_norm_cross)
        self.mlp = SparseFeedForwardNet(channels, mlp_ratio=mlp_ratio)
        if not share_mod:
            self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(channels, 6 * channels, bias=True))

    def forward(self, x: SparseTensor, mod: torch.Tensor, context) -> SparseTensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = adaln_params(self, mod)
        x = x + self.self_attn(modulate(norm_feats(self.norm1, x), shift_msa, scale_msa)) * gate_msa
        x = x + self.cross_attn(norm_feats(self.norm2, x), context)
        return x + self.mlp(modulate(norm_feats(self.norm3, x), shift_mlp, scale_mlp)) * gate_mlp
