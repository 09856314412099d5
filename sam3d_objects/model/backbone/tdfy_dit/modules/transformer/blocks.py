"""Dense transformer building blocks: absolute sin/cos position embedding, feed-forward net, plain blocks."""
from typing import Optional

import torch
import torch.nn as nn

from ..attention import MultiHeadAttention
from ..norm import LayerNorm32


def sincos_frequencies(freq_dim: int, device=None) -> torch.Tensor:
    """1 / 10000^(i / freq_dim), i = 0..freq_dim-1."""
    exponents = torch.arange(freq_dim, dtype=torch.float32, device=device) / freq_dim
    return 1.0 / (10000 ** exponents)


class AbsolutePositionEmbedder(nn.Module):
    """Fixed sin/cos embedding of N-D positions: per axis [sin | cos] of `channels // in_channels // 2`
    frequencies, axes concatenated, zero-padded to `channels`."""

    def __init__(self, channels: int, in_channels: int = 3):
        super().__init__()
        self.channels = channels
        self.in_channels = in_channels
        self.freq_dim = channels // in_channels // 2

    def _sin_cos_embed(self, x: torch.Tensor) -> torch.Tensor:
        # frequencies are rebuilt per call (cheap) rather than kept as a buffer, so a model built on the meta
        # device and loaded with assign=True has nothing left on meta
        phases = torch.outer(x, sincos_frequencies(self.freq_dim, device=x.device))
        return torch.cat([torch.sin(phases), torch.cos(phases)], dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, in_channels] positions -> [N, channels]."""
        n, d = x.shape
        if d != self.in_channels:
            raise ValueError(f"expected positions with {self.in_channels} coordinates, got {d}")
        embed = self._sin_cos_embed(x.reshape(-1).float()).reshape(n, -1)
        if embed.shape[1] < self.channels:
            embed = torch.cat([embed, embed.new_zeros(n, self.channels - embed.shape[1])], dim=-1)
        return embed


class FeedForwardNet(nn.Module):
    """Linear -> tanh-GELU -> Linear (keys `mlp.0`, `mlp.2`)."""

    def __init__(self, channels: int, mlp_ratio: float = 4.0):
        super().__init__()
        hidden = int(channels * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(channels, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


class TransformerBlock(nn.Module):
    """Pre-norm self-attention + feed-forward block."""

    def __init__(self, channels: int, num_heads: int, mlp_ratio: float = 4.0,
                 attn_mode: str = "full", window_size: Optional[int] = None, shift_window: Optional[int] = None,
                 use_checkpoint: bool = False, use_rope: bool = False, qk_rms_norm: bool = False,
                 qkv_bias: bool = True, ln_affine: bool = False):
        super().__init__()
        self.use_checkpoint = use_checkpoint
        self.norm1 = LayerNorm32(channels, elementwise_affine=ln_affine, eps=1e-6)
        self.norm2 = LayerNorm32(channels, elementwise_affine=ln_affine, eps=1e-6)
        self.attn = MultiHeadAttention(channels, num_heads=num_heads, attn_mode=attn_mode, window_size=window_size,
                                       shift_window=shift_window, qkv_bias=qkv_bias, use_rope=use_rope,
                                       qk_rms_norm=qk_rms_norm)
        self.mlp = FeedForwardNet(channels, mlp_ratio=mlp_ratio)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TransformerCrossBlock(nn.Module):
    """Pre-norm self-attention + cross-attention + feed-forward block."""

    def __init__(self, channels: int, ctx_channels: int, num_heads: int, mlp_ratio: float = 4.0,
                 attn_mode: str = "full", window_size: Optional[int] = None, shift_window: Optional[int] = None,
                 use_checkpoint: bool = False, use_rope: bool = False, qk_rms_norm: bool = False,
                 qk_rms_norm_cross: bool = False, qkv_bias: bool = True, ln_affine: bool = False):
        super().__init__()
        self.use_checkpoint = use_checkpoint
        self.norm1 = LayerNorm32(channels, elementwise_affine=ln_affine, eps=1e-6)
        self.norm2 = LayerNorm32(channels, elementwise_affine=ln_affine, eps=1e-6)
        self.norm3 = LayerNorm32(channels, elementwise_affine=ln_affine, eps=1e-6)
        self.self_attn = MultiHeadAttention(channels, num_heads=num_heads, type="self", attn_mode=attn_mode,
                                            window_size=window_size, shift_window=shift_window, qkv_bias=qkv_bias,
                                            use_rope=use_rope, qk_rms_norm=qk_rms_norm)
        self.cross_attn = MultiHeadAttention(channels, ctx_channels=ctx_channels, num_heads=num_heads, type="cross",
                                             attn_mode="full", qkv_bias=qkv_bias, qk_rms_norm=qk_rms_norm_cross)
        self.mlp = FeedForwardNet(channels, mlp_ratio=mlp_ratio)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.norm1(x))
        x = x + self.cross_attn(self.norm2(x), context)
        return x + self.mlp(self.norm3(x))
