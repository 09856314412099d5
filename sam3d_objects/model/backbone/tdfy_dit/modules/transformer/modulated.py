"""adaLN-modulated dense transformer blocks (DiT style): shift/scale/gate from the time embedding."""
from typing import Optional

import torch
import torch.nn as nn

from ..attention import MultiHeadAttention
import backends

from .blocks import FeedForwardNet, dense_self_attn_kwargs
from .body import BlockBody, build_block_layers, norm_modulated, run_block


def modulate(h: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """h * (1 + scale) + shift with per-sample [B, C] modulation broadcast over tokens."""
    return h * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class DenseModulation(BlockBody):
    """Dense [B, L, C] tokens: per-sample [B, C] shift/scale/gate broadcast over the token axis."""

    _norm_modulated = staticmethod(norm_modulated)
    _gated_residual = staticmethod(backends.gated_residual)


class ModulatedTransformerBlock(DenseModulation, nn.Module):
    """Self-attention + feed-forward, both adaLN-modulated."""

    def __init__(self, channels: int, num_heads: int, mlp_ratio: float = 4.0, attn_mode: str = "full",
                 window_size: Optional[int] = None, shift_window: Optional[tuple] = None,
                 use_checkpoint: bool = False, use_rope: bool = False, qk_rms_norm: bool = False,
                 qkv_bias: bool = True, share_mod: bool = False):
        super().__init__()
        build_block_layers(self, channels, num_heads, mlp_ratio, attention=MultiHeadAttention,
                           feed_forward=FeedForwardNet, norm_affine=(False, False),
                           self_attn_kwargs=dense_self_attn_kwargs(attn_mode, window_size, shift_window, use_rope,
                                                                   qk_rms_norm),
                           qkv_bias=qkv_bias, use_checkpoint=use_checkpoint, share_mod=share_mod)

    def _forward(self, x: torch.Tensor, mod: torch.Tensor) -> torch.Tensor:
        return self._modulated_body(x, mod)

    def forward(self, x: torch.Tensor, mod: torch.Tensor) -> torch.Tensor:
        return run_block(self, x, mod)


class ModulatedTransformerCrossBlock(DenseModulation, nn.Module):
    """adaLN-modulated self-attention, plain (affine-norm) cross-attention, adaLN-modulated feed-forward."""

    def __init__(self, channels: int, ctx_channels: int, num_heads: int, mlp_ratio: float = 4.0,
                 attn_mode: str = "full", window_size: Optional[int] = None, shift_window: Optional[tuple] = None,
                 use_checkpoint: bool = False, use_rope: bool = False, qk_rms_norm: bool = False,
                 qk_rms_norm_cross: bool = False, qkv_bias: bool = True, share_mod: bool = False):
        super().__init__()
        build_block_layers(self, channels, num_heads, mlp_ratio, attention=MultiHeadAttention,
                           feed_forward=FeedForwardNet, norm_affine=(False, True, False),
                           self_attn_kwargs=dense_self_attn_kwargs(attn_mode, window_size, shift_window, use_rope,
                                                                   qk_rms_norm),
                           ctx_channels=ctx_channels, qk_rms_norm_cross=qk_rms_norm_cross, qkv_bias=qkv_bias,
                           use_checkpoint=use_checkpoint, share_mod=share_mod)

    def _forward(self, x: torch.Tensor, mod: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return self._modulated_body(x, mod, context)

    def forward(self, x: torch.Tensor, mod: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return run_block(self, x, mod, context)


def __getattr__(name: str):
    # upstream defines the mixture-of-transformers layer here; ours lives with the MoT flow model (which imports
    # this module), so it is re-exported lazily
    if name == "MOTModulatedTransformerCrossBlock":
        from ...models.mot_sparse_structure_flow import MOTModulatedTransformerCrossBlock
        return MOTModulatedTransformerCrossBlock
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
