"""Layers and forward passes shared by the dense and the sparse transformer blocks.

Upstream writes each block four times (dense/sparse x plain/adaLN-modulated) with the same submodule names, so one
builder sets those names on any block and one set of forward bodies runs them; a block family only says how its
tokens are normalized, modulated and gated (`BlockBody`'s three hooks). Submodules are created in upstream's order
(norms, attention, feed-forward, adaLN) so seeded random initialisation stays the same as well.
"""
from typing import Any, Callable, Dict, Optional, Sequence

import torch
import torch.nn as nn

import backends

from ..norm import LayerNorm32


def build_block_layers(block: nn.Module, channels: int, num_heads: int, mlp_ratio: float, *,
                       attention: Callable[..., nn.Module], feed_forward: Callable[..., nn.Module],
                       self_attn_kwargs: Dict[str, Any], norm_affine: Sequence[bool],
                       ctx_channels: Optional[int] = None, qk_rms_norm_cross: bool = False, qkv_bias: bool = True,
                       use_checkpoint: bool = False, share_mod: Optional[bool] = None) -> None:
    """Give `block` upstream's submodules: `norm1..normN` (one per entry of `norm_affine`), `attn` (no context) or
    `self_attn` + `cross_attn` (with `ctx_channels`), `mlp`, and for modulated blocks (`share_mod` not None) its own
    `adaLN_modulation` unless the model shares one."""
    block.use_checkpoint = use_checkpoint
    if share_mod is not None:
        block.share_mod = share_mod
    for index, affine in enumerate(norm_affine, start=1):
        setattr(block, f"norm{index}", LayerNorm32(channels, elementwise_affine=affine, eps=1e-6))
    if ctx_channels is None:
        block.attn = attention(channels, num_heads=num_heads, qkv_bias=qkv_bias, **self_attn_kwargs)
    else:
        block.self_attn = attention(channels, num_heads=num_heads, type="self", qkv_bias=qkv_bias,
                                    **self_attn_kwargs)
        block.cross_attn = attention(channels, ctx_channels=ctx_channels, num_heads=num_heads, type="cross",
                                     attn_mode="full", qkv_bias=qkv_bias, qk_rms_norm=qk_rms_norm_cross)
    block.mlp = feed_forward(channels, mlp_ratio=mlp_ratio)
    if share_mod is False:
        block.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(channels, 6 * channels, bias=True))


def adaln_params(block: nn.Module, mod: torch.Tensor):
    """The six [B, C] adaLN chunks (shift/scale/gate for attention, then for the MLP) of a modulated block, dense
    or sparse: ``mod`` itself when the model shares one modulation (``share_mod``), else the block's own
    ``adaLN_modulation`` of it."""
    return (mod if block.share_mod else block.adaLN_modulation(mod)).chunk(6, dim=1)


def norm_modulated(norm: nn.Module, x: torch.Tensor, shift: Optional[torch.Tensor] = None,
                   scale: Optional[torch.Tensor] = None, batch_index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``modulate(norm(x), shift, scale)`` for a `LayerNorm32` ``norm`` whose result feeds a matmul, as one
    backend op (``backends.modulated_layer_norm``); without shift/scale it is the plain (affine) pre-norm."""
    return backends.modulated_layer_norm(x, shift, scale, norm.weight, norm.bias, norm.eps, batch_index=batch_index)


def residual_add(x, branch):
    """``x + branch`` for dense tensors or SparseTensors, where ``branch`` is a sublayer's fresh output. Without
    autograd the sum goes into the branch's buffer (same bits: addition commutes), so no new [N, C] tensor is
    allocated (on the CPU a fresh one is faulted in page by page); with autograd, or when the sum's dtype or shape
    is not the branch's, a new tensor as before."""
    x_data, branch_data = getattr(x, "feats", x), getattr(branch, "feats", branch)
    if (torch.is_grad_enabled() or branch_data.shape != x_data.shape
            or torch.result_type(branch_data, x_data) != branch_data.dtype):
        return x + branch
    branch_data.add_(x_data)
    return x.replace(branch_data) if x_data is not x else branch_data  # a SparseTensor keeps x's voxels and caches


def run_block(block: nn.Module, *args):
    """A block's forward as upstream runs it: ``block._forward(*args)``, under activation checkpointing when the
    block was built with ``use_checkpoint`` and gradients are being recorded (nothing to save otherwise)."""
    if getattr(block, "use_checkpoint", False) and torch.is_grad_enabled() and block.training:
        from torch.utils.checkpoint import checkpoint
        return checkpoint(block._forward, *args, use_reentrant=False)
    return block._forward(*args)


class BlockBody:
    """Forward bodies of the four block kinds; the dense/sparse difference lives in the hooks."""

    @staticmethod
    def _normed(norm: nn.Module, x):
        return norm(x)

    @staticmethod
    def _norm_modulated(norm: nn.Module, x, shift: Optional[torch.Tensor] = None,
                        scale: Optional[torch.Tensor] = None):
        """adaLN's ``norm(x) * (1 + scale) + shift`` (plain pre-norm without them), feeding a matmul."""
        raise NotImplementedError

    @staticmethod
    def _gated_residual(x, h, gate: torch.Tensor):
        """adaLN-Zero's ``x + h * gate``."""
        raise NotImplementedError

    def _plain_body(self, x, context=None):
        """x + attn(norm1 x) [+ cross_attn(norm2 x, context)] + mlp(norm_last x), pre-norm residuals."""
        if context is None:
            x = residual_add(x, self.attn(self._normed(self.norm1, x)))
            return residual_add(x, self.mlp(self._normed(self.norm2, x)))
        x = residual_add(x, self.self_attn(self._normed(self.norm1, x)))
        x = residual_add(x, self.cross_attn(self._normed(self.norm2, x), context))
        return residual_add(x, self.mlp(self._normed(self.norm3, x)))

    def _modulated_body(self, x, mod: torch.Tensor, context=None):
        """As `_plain_body` with adaLN shift/scale before attention and MLP and gates on their outputs; the
        cross-attention (when there is a context) stays unmodulated."""
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = adaln_params(self, mod)
        attention, last_norm = (self.attn, self.norm2) if context is None else (self.self_attn, self.norm3)
        x = self._gated_residual(x, attention(self._norm_modulated(self.norm1, x, shift_msa, scale_msa)), gate_msa)
        if context is not None:
            x = x + self.cross_attn(self._norm_modulated(self.norm2, x), context)
        return self._gated_residual(x, self.mlp(self._norm_modulated(last_norm, x, shift_mlp, scale_mlp)), gate_mlp)
