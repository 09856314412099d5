"""Dense attention layers (self / cross, optional per-head RMS norm on queries and keys, optional RoPE)."""
from typing import Callable, Literal, Optional

import torch
import torch.nn as nn

import backends

from .full_attn import scaled_dot_product_attention


class MultiHeadRMSNorm(nn.Module):
    """RMS norm over the head dimension with a per-head gain `gamma` [heads, dim] (computed in float32)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones(heads, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return backends.head_rms_norm(x, self.gamma, self.scale)


class RotaryPositionEmbedder(nn.Module):
    """Rotary embedding of integer/float positions [..., in_channels] for heads of size `hidden_size`."""

    def __init__(self, hidden_size: int, in_channels: int = 3):
        super().__init__()
        if hidden_size % 2:
            raise ValueError(f"RoPE needs an even head size, got {hidden_size}")
        self.hidden_size = hidden_size
        self.in_channels = in_channels
        self.freq_dim = hidden_size // in_channels // 2

    @property
    def freqs(self) -> torch.Tensor:
        """[freq_dim] float32 frequencies 1 / 10000^(i / freq_dim) (CPU; computed on use, so that no frequency
        tensor is left on the meta device after an assign=True load)."""
        return self._frequencies("cpu")

    def _frequencies(self, device) -> torch.Tensor:
        exponents = torch.arange(self.freq_dim, dtype=torch.float32, device=device) / self.freq_dim
        return 1.0 / (10000 ** exponents)

    def _get_phases(self, indices: torch.Tensor) -> torch.Tensor:
        phases = torch.outer(indices.float(), self._frequencies(indices.device))
        return torch.polar(torch.ones_like(phases), phases)

    @staticmethod
    def _rotary_embedding(x: torch.Tensor, phases: torch.Tensor) -> torch.Tensor:
        """x [..., D] rotated pairwise by the unit complex phases [..., D / 2]."""
        x_complex = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(x_complex * phases).reshape(*x.shape).to(x.dtype)

    _rotate = _rotary_embedding

    def forward(self, q: torch.Tensor, k: torch.Tensor, indices: Optional[torch.Tensor] = None):
        """q, k: [B, L, H, D]; indices: [B, L, in_channels] positions (default: 0..L-1 on one axis)."""
        if indices is None:
            indices = torch.arange(q.shape[1], device=q.device, dtype=torch.float32)
            indices = indices.reshape(1, -1, 1).expand(q.shape[0], -1, 1)
        phases = self._get_phases(indices.reshape(-1)).reshape(*indices.shape[:-1], -1)
        if phases.shape[-1] < self.hidden_size // 2:
            pad = torch.polar(torch.ones(*phases.shape[:-1], self.hidden_size // 2 - phases.shape[-1],
                                         device=phases.device),
                              torch.zeros(*phases.shape[:-1], self.hidden_size // 2 - phases.shape[-1],
                                          device=phases.device))
            phases = torch.cat([phases, pad], dim=-1)
        phases = phases.unsqueeze(-2)  # broadcast over heads
        return self._rotary_embedding(q, phases), self._rotary_embedding(k, phases)


def add_attention_projections(layer: nn.Module, channels: int, num_heads: int, ctx_channels: Optional[int],
                              type: str, qkv_bias: bool, qk_rms_norm: bool, rms_norm: Callable[..., nn.Module]) -> None:
    """Upstream's attention projections on `layer`, dense or sparse: `to_qkv` (self) or `to_q` + `to_kv` (cross),
    optional `q_rms_norm` / `k_rms_norm` (built by `rms_norm(head_dim, heads)`), `to_out`; plus the size attributes
    the forward passes read. Raises on a head count that does not divide `channels` or an unknown `type`."""
    if channels % num_heads:
        raise ValueError(f"channels ({channels}) must be divisible by num_heads ({num_heads})")
    if type not in ("self", "cross"):
        raise ValueError(f"unknown attention type {type!r} (use 'self' or 'cross')")
    layer.channels = channels
    layer.head_dim = channels // num_heads
    layer.ctx_channels = ctx_channels if ctx_channels is not None else channels
    layer.num_heads = num_heads
    layer._type = type
    layer.qk_rms_norm = qk_rms_norm
    if type == "self":
        layer.to_qkv = nn.Linear(channels, channels * 3, bias=qkv_bias)
    else:
        layer.to_q = nn.Linear(channels, channels, bias=qkv_bias)
        layer.to_kv = nn.Linear(layer.ctx_channels, channels * 2, bias=qkv_bias)
    if qk_rms_norm:
        layer.q_rms_norm = rms_norm(layer.head_dim, num_heads)
        layer.k_rms_norm = rms_norm(layer.head_dim, num_heads)
    layer.to_out = nn.Linear(channels, channels)


class MultiHeadAttention(nn.Module):
    _type: str  # "self" or "cross", set by add_attention_projections

    """Self- or cross-attention on dense [B, L, C] tokens.

    State-dict names: self -> `to_qkv`; cross -> `to_q`, `to_kv`; both -> `to_out`, optional
    `q_rms_norm.gamma` / `k_rms_norm.gamma` [heads, head_dim].
    """

    def __init__(self, channels: int, num_heads: int, ctx_channels: Optional[int] = None,
                 type: Literal["self", "cross"] = "self", attn_mode: Literal["full", "windowed"] = "full",
                 window_size: Optional[int] = None, shift_window: Optional[tuple] = None, qkv_bias: bool = True,
                 use_rope: bool = False, qk_rms_norm: bool = False):
        super().__init__()
        if attn_mode != "full":
            raise NotImplementedError("dense MultiHeadAttention supports attn_mode='full' only")
        if type == "cross" and use_rope:
            raise ValueError("RoPE is only defined for self-attention")
        add_attention_projections(self, channels, num_heads, ctx_channels, type, qkv_bias, qk_rms_norm,
                                  rms_norm=MultiHeadRMSNorm)
        self.attn_mode = attn_mode
        self.window_size = window_size
        self.shift_window = shift_window
        self.use_rope = use_rope
        if use_rope:
            self.rope = RotaryPositionEmbedder(channels)

    def forward(self, x: torch.Tensor, context: Optional[torch.Tensor] = None,
                indices: Optional[torch.Tensor] = None) -> torch.Tensor:
        b, l, c = x.shape
        if self._type == "self":
            qkv = self.to_qkv(x).reshape(b, l, 3, self.num_heads, self.head_dim)
            q, k, v = qkv.unbind(dim=2)
            if self.use_rope:
                q, k = self.rope(q, k, indices)
        else:
            if context is None:
                raise ValueError("cross-attention needs a context tensor [B, L_ctx, ctx_channels]")
            q = self.to_q(x).reshape(b, l, self.num_heads, self.head_dim)
            kv = self.to_kv(context).reshape(b, context.shape[1], 2, self.num_heads, self.head_dim)
            k, v = kv.unbind(dim=2)
        if self.qk_rms_norm:
            q = self.q_rms_norm(q)
            k = self.k_rms_norm(k)
        h = scaled_dot_product_attention(q, k, v)
        return self.to_out(h.reshape(b, l, -1))


def __getattr__(name: str):
    # upstream defines the mixture-of-transformers layer here; ours lives with the MoT flow model (which imports
    # this module), so it is re-exported lazily
    if name == "MOTMultiHeadSelfAttention":
        from ...models.mot_sparse_structure_flow import MOTMultiHeadSelfAttention
        return MOTMultiHeadSelfAttention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
