"""Shared sparse transformer torso of the structured-latent decoders."""
from typing import Iterator, Optional, Tuple

import torch.nn as nn

from ...modules import sparse as sp
from ...modules.transformer import AbsolutePositionEmbedder
from ...modules.utils import Fp16Torso

__all__ = ["SparseTransformerBase", "block_attn_config"]


def block_attn_config(self, *layout_args) -> Iterator[Tuple]:
    """Upstream's per-block attention settings of a model `self` (reads its num_blocks, attn_mode, window_size):
    (attn_mode, window_size, shift_sequence, shift_window, serialize_mode) per block; unknown modes yield nothing.
    Called as (attn_mode, num_blocks, window_size) it yields this package's (attn_mode, window_size, shift_window)."""
    if isinstance(self, str):
        yield from _block_layout(self, *layout_args)
        return
    from ...modules.sparse.attention.serialized_attn import SerializeMode, SerializeModes
    mode, ws = self.attn_mode, self.window_size
    for i in range(self.num_blocks):
        if mode == "shift_window":
            yield "serialized", ws, 0, (16 * (i % 2),) * 3, SerializeMode.Z_ORDER
        elif mode == "shift_sequence":
            yield "serialized", ws, (ws // 2) * (i % 2), (0, 0, 0), SerializeMode.Z_ORDER
        elif mode == "shift_order":
            yield "serialized", ws, 0, (0, 0, 0), SerializeModes[i % 4]
        elif mode == "full":
            yield "full", None, None, None, None
        elif mode == "swin":
            yield "windowed", ws, None, (ws // 2) * (i % 2), None


def _block_layout(attn_mode: str, num_blocks: int, window_size: Optional[int]) -> Iterator[Tuple]:
    """(attn_mode, window_size, shift_window) per block. "swin": windowed, shift window_size//2 on odd blocks."""
    for i in range(num_blocks):
        if attn_mode == "full":
            yield "full", None, None
        elif attn_mode == "swin":
            yield "windowed", window_size, window_size // 2 * (i % 2)
        else:
            raise NotImplementedError(f"attn_mode {attn_mode!r} is not implemented (SAM 3D Objects decoders use "
                                      f"'swin')")


class SparseTransformerBase(Fp16Torso, nn.Module):
    """input_layer (SparseLinear) + absolute position embedding + SparseTransformerBlocks."""

    def __init__(self, in_channels: int, model_channels: int, num_blocks: int, num_heads: Optional[int] = None,
                 num_head_channels: int = 64, mlp_ratio: float = 4.0, attn_mode: str = "full",
                 window_size: Optional[int] = None, pe_mode: str = "ape", use_fp16: bool = False,
                 use_checkpoint: bool = False, qk_rms_norm: bool = False):
        super().__init__()
        if pe_mode != "ape":
            raise NotImplementedError(f"pe_mode {pe_mode!r} is not implemented (the released decoders use 'ape')")
        self.in_channels = in_channels
        self.model_channels = model_channels
        self.num_blocks = num_blocks
        self.window_size = window_size
        self.num_heads = num_heads or model_channels // num_head_channels
        self.mlp_ratio = mlp_ratio
        self.attn_mode = attn_mode
        self.pe_mode = pe_mode
        self.use_fp16 = use_fp16
        self.use_checkpoint = use_checkpoint
        self.qk_rms_norm = qk_rms_norm
        self.input_layer = sp.SparseLinear(in_channels, model_channels)
        self.pos_embedder = AbsolutePositionEmbedder(model_channels)
        self.blocks = nn.ModuleList([
            sp.SparseTransformerBlock(model_channels, num_heads=self.num_heads, mlp_ratio=mlp_ratio,
                                      attn_mode=mode, window_size=ws, shift_window=shift,
                                      use_checkpoint=use_checkpoint, qk_rms_norm=qk_rms_norm)
            for mode, ws, shift in _block_layout(attn_mode, num_blocks, window_size)])

    def torso(self) -> Tuple[nn.Module, ...]:
        return (self.blocks,)

    def initialize_weights(self) -> None:
        """Training initialisation: xavier-uniform weights and zero biases for every Linear (SparseLinear too)."""
        def init(module: nn.Module) -> None:
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        self.apply(init)

    def _initialize_with_zero_output(self) -> None:
        SparseTransformerBase.initialize_weights(self)
        nn.init.zeros_(self.out_layer.weight)
        nn.init.zeros_(self.out_layer.bias)

    def forward(self, x: sp.SparseTensor) -> sp.SparseTensor:
        h = self.input_layer(x)
        h = h + self.pos_embedder(x.coords[:, 1:])
        h = h.type(self.compute_dtype(x.device))
        for block in self.blocks:
            h = block(h)
        return h
