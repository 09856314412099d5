"""Dense transformer building blocks: absolute sin/cos position embedding, feed-forward net, plain blocks."""
from typing import Optional

import torch
import torch.nn as nn

import backends

from ..attention import MultiHeadAttention
from ..quantized import dense_weight
from .body import BlockBody, build_block_layers, run_block


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

    @property
    def freqs(self) -> torch.Tensor:
        """[freq_dim] float32 frequencies (CPU; rebuilt on use rather than kept as a buffer, so a model built on
        the meta device and loaded with assign=True has nothing left on meta)."""
        return sincos_frequencies(self.freq_dim, device="cpu")

    def _sin_cos_embedding(self, x: torch.Tensor) -> torch.Tensor:
        """[N] positions -> [N, 2 freq_dim] = [sin | cos] of position * frequency."""
        phases = torch.outer(x, sincos_frequencies(self.freq_dim, device=x.device))
        return torch.cat([torch.sin(phases), torch.cos(phases)], dim=-1)

    _sin_cos_embed = _sin_cos_embedding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, in_channels] positions -> [N, channels]."""
        n, d = x.shape
        if d != self.in_channels:
            raise ValueError(f"expected positions with {self.in_channels} coordinates, got {d}")
        embed = self._sin_cos_embedding(x.reshape(-1).float()).reshape(n, -1)
        if embed.shape[1] < self.channels:
            embed = torch.cat([embed, embed.new_zeros(n, self.channels - embed.shape[1])], dim=-1)
        return embed


class FeedForwardNet(nn.Module):
    """Linear -> tanh-GELU -> Linear (keys `mlp.0`, `mlp.2`). The layer types are class attributes so the sparse
    net (`SparseFeedForwardNet`) is this one with per-voxel layers."""

    linear_layer = nn.Linear
    activation_layer = nn.GELU

    def __init__(self, channels: int, mlp_ratio: float = 4.0):
        super().__init__()
        hidden = int(channels * mlp_ratio)
        self.mlp = nn.Sequential(self.linear_layer(channels, hidden), self.activation_layer(approximate="tanh"),
                                 self.linear_layer(hidden, channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc1, activation, fc2 = self.mlp
        if not (isinstance(activation, nn.GELU) and activation.approximate == "tanh" and self._fusable(fc1, x)):
            return self.mlp(x)  # layers swapped by the user (or int8 codes): run them as they are
        return fc2(self._linear_gelu(x, fc1))

    @staticmethod
    def _fusable(fc1: nn.Module, x) -> bool:
        """Whether ``linear_gelu`` can take fc1's weight as it is stored: a Linear's always; the bf16 weight format's
        (``QuantizedLinear`` without scales) where the features' matmuls run in that dtype (bfloat16 sampling)."""
        weight = dense_weight(fc1)
        if weight is None:
            return False
        feats = getattr(x, "feats", x)  # a SparseTensor's features
        return isinstance(fc1, nn.Linear) or backends.device.matmul_input_dtype(feats.dtype, feats.device) == weight.dtype

    @staticmethod
    def _linear_gelu(x: torch.Tensor, fc1: nn.Module) -> torch.Tensor:
        # one backend op, so a backend can fold the GELU into the matmul (the hidden layer is 4x the width)
        weight = dense_weight(fc1)
        bias = None if fc1.bias is None else fc1.bias.to(weight.dtype)  # the bf16 format keeps a float32 bias
        return backends.linear_gelu(x, weight, bias)


def dense_self_attn_kwargs(attn_mode: str, window_size: Optional[int], shift_window, use_rope: bool,
                           qk_rms_norm: bool) -> dict:
    """The self-attention options of a dense block, as its `MultiHeadAttention` takes them."""
    return dict(attn_mode=attn_mode, window_size=window_size, shift_window=shift_window, use_rope=use_rope,
                qk_rms_norm=qk_rms_norm)


class TransformerBlock(BlockBody, nn.Module):
    """Pre-norm self-attention + feed-forward block."""

    def __init__(self, channels: int, num_heads: int, mlp_ratio: float = 4.0,
                 attn_mode: str = "full", window_size: Optional[int] = None, shift_window: Optional[int] = None,
                 use_checkpoint: bool = False, use_rope: bool = False, qk_rms_norm: bool = False,
                 qkv_bias: bool = True, ln_affine: bool = False):
        super().__init__()
        build_block_layers(self, channels, num_heads, mlp_ratio, attention=MultiHeadAttention,
                           feed_forward=FeedForwardNet, norm_affine=(ln_affine,) * 2,
                           self_attn_kwargs=dense_self_attn_kwargs(attn_mode, window_size, shift_window, use_rope,
                                                                   qk_rms_norm),
                           qkv_bias=qkv_bias, use_checkpoint=use_checkpoint)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._plain_body(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_block(self, x)


class TransformerCrossBlock(BlockBody, nn.Module):
    """Pre-norm self-attention + cross-attention + feed-forward block."""

    def __init__(self, channels: int, ctx_channels: int, num_heads: int, mlp_ratio: float = 4.0,
                 attn_mode: str = "full", window_size: Optional[int] = None, shift_window: Optional[int] = None,
                 use_checkpoint: bool = False, use_rope: bool = False, qk_rms_norm: bool = False,
                 qk_rms_norm_cross: bool = False, qkv_bias: bool = True, ln_affine: bool = False):
        super().__init__()
        build_block_layers(self, channels, num_heads, mlp_ratio, attention=MultiHeadAttention,
                           feed_forward=FeedForwardNet, norm_affine=(ln_affine,) * 3,
                           self_attn_kwargs=dense_self_attn_kwargs(attn_mode, window_size, shift_window, use_rope,
                                                                   qk_rms_norm),
                           ctx_channels=ctx_channels, qk_rms_norm_cross=qk_rms_norm_cross, qkv_bias=qkv_bias,
                           use_checkpoint=use_checkpoint)

    def _forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return self._plain_body(x, context)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return run_block(self, x, context)
