"""adaLN-modulated dense transformer blocks (DiT style): shift/scale/gate from the time embedding."""
from typing import Optional

import torch
import torch.nn as nn

from ..attention import MultiHeadAttention
from ..norm import LayerNorm32
from .blocks import FeedForwardNet


def modulate(h: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """h * (1 + scale) + shift with per-sample [B, C] modulation broadcast over tokens."""
    return h * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def adaln_params(block: nn.Module, mod: torch.Tensor):
    """The six [B, C] adaLN chunks (shift/scale/gate for attention, then for the MLP) of a modulated block, dense
    or sparse: ``mod`` itself when the model shares one modulation (``share_mod``), else the block's own
    ``adaLN_modulation`` of it."""
    return (mod if block.share_mod else block.adaLN_modulation(mod)).chunk(6, dim=1)


class ModulatedTransformerBlock(nn.Module):
    """Self-attention + feed-forward, both adaLN-modulated."""

    def __init__(self, channels: int, num_heads: int, mlp_ratio: float = 4.0, attn_mode: str = "full",
                 window_size: Optional[int] = None, shift_window: Optional[tuple] = None,
                 use_checkpoint: bool = False, use_rope: bool = False, qk_rms_norm: bool = False,
                 qkv_bias: bool = True, share_mod: bool = False):
        super().__init__()
        self.use_checkpoint = use_checkpoint
        self.share_mod = share_mod
        self.norm1 = LayerNorm32(channels, elementwise_affine=False, eps=1e-6)
        self.norm2 = LayerNorm32(channels, elementwise_affine=False, eps=1e-6)
        self.attn = MultiHeadAttention(channels, num_heads=num_heads, attn_mode=attn_mode, window_size=window_size,
                                       shift_window=shift_window, qkv_bias=qkv_bias, use_rope=use_rope,
                                       qk_rms_norm=qk_rms_norm)
        self.mlp = FeedForwardNet(channels, mlp_ratio=mlp_ratio)
        if not share_mod:
            self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(channels, 6 * channels, bias=True))

    def forward(self, x: torch.Tensor, mod: torch.Tensor) -> torch.Tensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = adaln_params(self, mod)
        h = self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        x = x + h * gate_msa.unsqueeze(1)
        h = self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x + h * gate_mlp.unsqueeze(1)


class ModulatedTransformerCrossBlock(nn.Module):
    """adaLN-modulated self-attention, plain (affine-norm) cross-attention, adaLN-modulated feed-forward."""

    def __init__(self, channels: int, ctx_channels: int, num_heads: int, mlp_ratio: float = 4.0,
                 attn_mode: str = "full", window_size: Optional[int] = None, shift_window: Optional[tuple] = None,
                 use_checkpoint: bool = False, use_rope: bool = False, qk_rms_norm: bool = False,
                 qk_rms_norm_cross: bool = False, qkv_bias: bool = True, share_mod: bool = False):
        super().__init__()
        self.use_checkpoint = use_checkpoint
        self.share_mod = share_mod
        self.norm1 = LayerNorm32(channels, elementwise_affine=False, eps=1e-6)
        self.norm2 = LayerNorm32(channels, elementwise_affine=True, eps=1e-6)
        self.norm3 = LayerNorm32(channels, elementwise_affine=False, eps=1e-6)
        self.self_attn = MultiHeadAttention(channels, num_heads=num_heads, type="self", attn_mode=attn_mode,
                                            window_size=window_size, shift_window=shift_window, qkv_bias=qkv_bias,
                                            use_rope=use_rope, qk_rms_norm=qk_rms_norm)
        self.cross_attn = MultiHeadAttention(channels, ctx_channels=ctx_channels, num_heads=num_heads, type="cross",
                                             attn_mode="full", qkv_bias=qkv_bias, qk_rms_norm=qk_rms_norm_cross)
        self.mlp = FeedForwardNet(channels, mlp_ratio=mlp_ratio)
        if not share_mod:
            self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(channels, 6 * channels, bias=True))

    def forward(self, x: torch.Tensor, mod: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = adaln_params(self, mod)
        h = self.self_attn(modulate(self.norm1(x), shift_msa, scale_msa))
        x = x + h * gate_msa.unsqueeze(1)
        x = x + self.cross_attn(self.norm2(x), context)
        h = self.mlp(modulate(self.norm3(x), shift_mlp, scale_mlp))
        return x + h * gate_mlp.unsqueeze(1)


def __getattr__(name: str):
    # upstream defines the mixture-of-transformers layer here; ours lives with the MoT flow model (which imports
    # this module), so it is re-exported lazily
    if name == "MOTModulatedTransformerCrossBlock":
        from ...models.mot_sparse_structure_flow import MOTModulatedTransformerCrossBlock
        return MOTModulatedTransformerCrossBlock
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
