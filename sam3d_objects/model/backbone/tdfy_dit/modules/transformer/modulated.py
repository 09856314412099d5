"""adaLN-modulated dense transformer blocks (DiT style): shift/scale/gate from the time embedding."""
from typing import Dict, Optional, Sequence

import torch
import torch.nn as nn

from ..attention import MultiHeadAttention
from ..attention.modules import MOTMultiHeadSelfAttention
from ..norm import LayerNorm32
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


class MOTModulatedTransformerCrossBlock(nn.Module):
    """DiT cross block with one adaLN modulation shared by all streams and per-stream everything else
    (`latent_names` = the token streams; norms, cross-attention and MLP are ModuleDicts keyed by stream, as
    upstream's). The per-stream steps are upstream's helpers (``_apply_msa``, ``_apply_cross_attn``, ...); the
    norm + modulation and the gated residuals run as fused backend ops with the same arithmetic."""

    def __init__(self, channels: int, ctx_channels: int, num_heads: int, mlp_ratio: float = 4.0,
                 attn_mode: str = "full", window_size: Optional[int] = None, shift_window=None,
                 use_checkpoint: bool = False, use_rope: bool = False, qk_rms_norm: bool = False,
                 qk_rms_norm_cross: bool = False, qkv_bias: bool = True, share_mod: bool = False,
                 latent_names: Optional[Sequence[str]] = None, freeze_shared_parameters: bool = False):
        super().__init__()
        streams = list(latent_names or [])
        self.freeze_shared_parameters = freeze_shared_parameters
        self.streams = list(streams)
        self.use_checkpoint = use_checkpoint
        self.share_mod = share_mod
        self.norm1 = nn.ModuleDict({s: LayerNorm32(channels, elementwise_affine=False, eps=1e-6) for s in streams})
        self.norm2 = nn.ModuleDict({s: LayerNorm32(channels, elementwise_affine=True, eps=1e-6) for s in streams})
        self.norm3 = nn.ModuleDict({s: LayerNorm32(channels, elementwise_affine=False, eps=1e-6) for s in streams})
        self.self_attn = MOTMultiHeadSelfAttention(channels, num_heads, attn_mode=attn_mode, qkv_bias=qkv_bias,
                                                   use_rope=use_rope, qk_rms_norm=qk_rms_norm, latent_names=streams)
        self.cross_attn = nn.ModuleDict({
            s: MultiHeadAttention(channels, ctx_channels=ctx_channels, num_heads=num_heads, type="cross",
                                  qkv_bias=qkv_bias, qk_rms_norm=qk_rms_norm_cross) for s in streams})
        self.mlp = nn.ModuleDict({s: FeedForwardNet(channels, mlp_ratio=mlp_ratio) for s in streams})
        if not share_mod:
            self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(channels, 6 * channels, bias=True))
            if freeze_shared_parameters:
                self.adaLN_modulation.eval()
                self.adaLN_modulation.requires_grad_(False)

    # upstream's per-stream helpers --------------------------------------------------------------------------
    def _apply_module(self, h: torch.Tensor, module: nn.Module) -> torch.Tensor:
        return module(h)

    def _apply_cross_attn(self, h: torch.Tensor, cross_attn: nn.Module, context: torch.Tensor) -> torch.Tensor:
        return cross_attn(h, context)

    def _apply_msa(self, h: torch.Tensor, scale_msa: torch.Tensor, shift_msa: torch.Tensor) -> torch.Tensor:
        """adaLN modulation before self-attention: h (1 + scale) + shift (per batch element)."""
        return h * (1 + scale_msa.unsqueeze(1)) + shift_msa.unsqueeze(1)

    def _apply_mlp(self, h: torch.Tensor, scale_mlp: torch.Tensor, shift_mlp: torch.Tensor) -> torch.Tensor:
        """adaLN modulation before the MLP."""
        return h * (1 + scale_mlp.unsqueeze(1)) + shift_mlp.unsqueeze(1)

    def _apply_add(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return x + h

    def _apply_multiplication(self, h: torch.Tensor, multiplier: torch.Tensor) -> torch.Tensor:
        """adaLN-Zero gate (per batch element)."""
        return h * multiplier.unsqueeze(1)

    def _moduledict_to_dict(self, module: nn.ModuleDict) -> Dict[str, nn.Module]:
        return dict(module.items())

    def _forward(self, x: Dict[str, torch.Tensor], mod: torch.Tensor, context: torch.Tensor
                 ) -> Dict[str, torch.Tensor]:
        # norm_modulated(norm, h, shift, scale) = _apply_msa / _apply_mlp of norm(h); gated_residual(x, h, g) =
        # _apply_add(x, _apply_multiplication(h, g)): one backend op each, same rounding as the separate ops
        chunks = (mod if self.share_mod else self.adaLN_modulation(mod)).chunk(6, dim=1)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = chunks
        attn = self.self_attn({n: norm_modulated(self.norm1[n], h, shift_msa, scale_msa) for n, h in x.items()})
        cross = self._moduledict_to_dict(self.cross_attn)
        out = {}
        for name, h in x.items():
            h = backends.gated_residual(h, attn[name], gate_msa)
            h = self._apply_add(h, self._apply_cross_attn(norm_modulated(self.norm2[name], h), cross[name], context))
            mlp = self._apply_module(norm_modulated(self.norm3[name], h, shift_mlp, scale_mlp), self.mlp[name])
            out[name] = backends.gated_residual(h, mlp, gate_mlp)
        return out

    def forward(self, x: Dict[str, torch.Tensor], mod: torch.Tensor, context: torch.Tensor) -> Dict[str, torch.Tensor]:
        return run_block(self, x, mod, context)
