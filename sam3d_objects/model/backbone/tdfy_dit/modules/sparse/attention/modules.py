"""Sparse multi-head attention layer (self: full or swin-windowed; cross: to a dense or sparse context)."""
from typing import Optional, Tuple, Union

import torch
import torch.nn as nn

from ...attention.modules import (MultiHeadRMSNorm, RotaryPositionEmbedder, add_attention_projections,
                                 single_token_output)
from ...attention.context_cache import project_context
from ..basic import SparseTensor
from .full_attn import sparse_scaled_dot_product_attention
from .windowed_attn import sparse_windowed_scaled_dot_product_self_attention

__all__ = ["SparseMultiHeadRMSNorm", "SparseMultiHeadAttention"]


class SparseMultiHeadRMSNorm(MultiHeadRMSNorm):
    """`MultiHeadRMSNorm` on a SparseTensor's features (or a plain [..., heads, dim] tensor)."""

    def forward(self, x: Union[SparseTensor, torch.Tensor]) -> Union[SparseTensor, torch.Tensor]:
        if isinstance(x, SparseTensor):
            return x.replace(super().forward(x.feats))
        return super().forward(x)


class SparseMultiHeadAttention(nn.Module):
    """Upstream's sparse attention layer (keys ``to_qkv`` / ``to_q`` + ``to_kv``, ``to_out``, ``q_rms_norm``,
    ``k_rms_norm``). ``attn_mode``: "full" or "windowed" (window_size, shift_window); "serialized" is not used by
    SAM 3D Objects and is not implemented."""

    def __init__(self, channels: int, num_heads: int, ctx_channels: Optional[int] = None, type: str = "self",
                 attn_mode: str = "full", window_size: Optional[int] = None, shift_sequence: Optional[int] = None,
                 shift_window: Optional[Union[int, Tuple[int, ...]]] = None, serialize_mode=None,
                 qkv_bias: bool = True, use_rope: bool = False, qk_rms_norm: bool = False):
        super().__init__()
        if attn_mode not in ("full", "windowed"):
            raise NotImplementedError(f"attn_mode {attn_mode!r} is not implemented (SAM 3D Objects uses 'full' "
                                      f"and 'windowed')")
        if type == "cross" and attn_mode != "full":
            raise ValueError("cross-attention only supports attn_mode='full'")
        if attn_mode == "windowed" and window_size is None:
            raise ValueError("windowed attention needs window_size")
        if use_rope and type != "self":
            raise ValueError("rotary embeddings are only for self-attention")
        add_attention_projections(self, channels, num_heads, ctx_channels, type, qkv_bias, qk_rms_norm,
                                  rms_norm=SparseMultiHeadRMSNorm)
        self.attn_mode = attn_mode
        self.window_size = window_size
        self.shift_sequence = shift_sequence
        self.shift_window = shift_window if shift_window is not None else 0
        self.serialize_mode = serialize_mode
        self.use_rope = use_rope
        if use_rope:  # upstream's construction (SAM 3D Objects' configs never turn it on)
            self.rope = RotaryPositionEmbedder(channels)

    _type: str  # "self" or "cross", set by add_attention_projections

    @staticmethod
    def _reshape_chs(x, shape: Tuple[int, ...]):
        """The channel part reshaped: a SparseTensor's per-voxel feats, or a dense [B, L, C] tensor's last axis."""
        if isinstance(x, SparseTensor):
            return x.reshape(*shape)
        return x.reshape(*x.shape[:2], *shape)

    def _fused_pre(self, x, num_fused: int):
        """Fused projections [..., num_fused * H * D] -> [..., num_fused, H, D] (sparse or dense [B, L, .])."""
        if isinstance(x, SparseTensor):
            return x.replace(x.feats.reshape(x.feats.shape[0], num_fused, self.num_heads, -1))
        return x.reshape(*x.shape[:2], num_fused, self.num_heads, -1)

    def _rope(self, qkv: SparseTensor) -> SparseTensor:
        """Rotary embedding of q and k by the voxels' (x, y, z) coordinates."""
        q, k, v = qkv.feats.unbind(dim=1)
        q, k = self.rope(q, k, qkv.coords[:, 1:])
        return qkv.replace(torch.stack([q, k, v], dim=1))

    @staticmethod
    def _linear(module: nn.Linear, x):
        return x.replace(module(x.feats)) if isinstance(x, SparseTensor) else module(x)

    def _split_heads(self, x, fused: int):
        """[..., fused * H * D] -> [..., fused, H, D] (fused = 1 drops that axis)."""
        return self._reshape_chs(x, (self.num_heads, -1)) if fused == 1 else self._fused_pre(x, fused)

    def _self_attention(self, x: SparseTensor) -> SparseTensor:
        qkv = self._split_heads(self._linear(self.to_qkv, x), 3)
        if self.use_rope:
            qkv = self._rope(qkv)
        if self.qk_rms_norm:
            q, k, v = qkv.feats.unbind(dim=1)
            q, k = self.q_rms_norm(q), self.k_rms_norm(k)
            if self.attn_mode == "full":  # q, k, v as they are: no repacking into one [N, 3, H, D] tensor
                return sparse_scaled_dot_product_attention(qkv.replace(q), qkv.replace(k), qkv.replace(v))
            qkv = qkv.replace(torch.stack([q, k, v], dim=1))
        if self.attn_mode == "full":
            return sparse_scaled_dot_product_attention(qkv)
        return sparse_windowed_scaled_dot_product_self_attention(qkv, self.window_size,
                                                                 shift_window=self.shift_window)

    def _cross_attention(self, x: SparseTensor, context) -> SparseTensor:
        if context is None:
            raise ValueError("cross-attention needs a context")
        ctx_width = context.feats.shape[-1] if isinstance(context, SparseTensor) else context.shape[-1]
        if ctx_width != self.ctx_channels:
            raise ValueError(f"context has {ctx_width} channels, the layer expects ctx_channels={self.ctx_channels}")
        q = self._split_heads(self._linear(self.to_q, x), 1)
        kv = self._split_heads(self._linear(self.to_kv, context) if isinstance(context, SparseTensor)
                               else project_context(self, context), 2)
        if self.qk_rms_norm:
            q = self.q_rms_norm(q)
            kv_feats = kv.feats if isinstance(kv, SparseTensor) else kv
            k, v = kv_feats.unbind(dim=-3)
            k = self.k_rms_norm(k)
            if isinstance(kv, SparseTensor):
                k, v = kv.replace(k), kv.replace(v)
            return sparse_scaled_dot_product_attention(q, k, v)
        return sparse_scaled_dot_product_attention(q, kv)

    def forward(self, x: SparseTensor, context=None) -> SparseTensor:
        if x.feats.shape[-1] != self.channels:
            raise ValueError(f"attention expects {self.channels} channels, got {x.feats.shape[-1]}")
        if self._type == "cross" and context is not None:
            row = single_token_output(self, context)  # one context token: every voxel gets its batch's row
            if row is not None:
                return x.replace(row[:, 0][x.coords[:, 0].long()])
        h = self._self_attention(x) if self._type == "self" else self._cross_attention(x, context)
        return self._linear(self.to_out, self._reshape_chs(h, (-1,)))
