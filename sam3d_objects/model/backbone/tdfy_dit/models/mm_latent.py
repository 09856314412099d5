"""Per-modality latent adapters of the multi-modal (MoT) flow: input projection, position embedding, output head.

`LearntPositionEmbedder` / `ShapePositionEmbedder` build the position-embedding tensor; `Latent` owns it directly
as `pos_emb` (a parameter for learnt embeddings, a persistent buffer for the fixed sin/cos table), which is why the
checkpoint keys are `latent_mapping.<name>.pos_emb` with no embedder level.
"""
import torch
import torch.nn as nn

import backends

from ..modules.transformer import AbsolutePositionEmbedder
from .sparse_structure_flow import grid_positions


def LearntPositionEmbedder(model_channels: int, token_len: int) -> nn.Parameter:  # noqa: N802 (hydra target)
    """Learnt embedding [token_len, model_channels] (a parameter)."""
    return nn.Parameter(torch.zeros(token_len, model_channels))


def ShapePositionEmbedder(model_channels: int, resolution: int, patch_size: int) -> torch.Tensor:  # noqa: N802
    """Fixed sin/cos embedding [(resolution/patch)^3, model_channels] of the grid positions (x slowest)."""
    if resolution % patch_size:
        raise ValueError(f"resolution {resolution} is not divisible by patch_size {patch_size}")
    coords = grid_positions(resolution // patch_size)
    return AbsolutePositionEmbedder(model_channels, 3)(coords)


def RandomPositionEmbedder(model_channels: int, token_len: int) -> torch.Tensor:  # noqa: N802
    """Random fixed embedding [token_len, model_channels] (a buffer: checkpoints hold its values)."""
    return torch.randn(token_len, model_channels)


class Latent(nn.Module):
    """One modality: tokens [B, L, in_channels] <-> model tokens [B, L, model_channels]."""

    def __init__(self, in_channels: int, model_channels: int, pos_embedder=None):
        super().__init__()
        self.in_channels = in_channels
        self.model_channels = model_channels
        if callable(pos_embedder) and not isinstance(pos_embedder, torch.Tensor):
            pos_embedder = pos_embedder()  # upstream's factories return a zero-argument builder
        if isinstance(pos_embedder, nn.Parameter):
            self.pos_emb = pos_embedder
        elif isinstance(pos_embedder, torch.Tensor):
            self.register_buffer("pos_emb", pos_embedder)
        elif pos_embedder is None:
            self.pos_emb = None
        else:
            raise TypeError(f"pos_embedder must be a tensor from LearntPositionEmbedder/ShapePositionEmbedder, "
                            f"got {type(pos_embedder).__name__}")
        self.input_layer = nn.Linear(in_channels, model_channels)
        self.out_layer = nn.Linear(model_channels, in_channels)

    def initialize_weights(self) -> None:
        """Training initialisation: xavier-uniform weights, zero biases (pos_emb untouched)."""
        for layer in (self.input_layer, self.out_layer):
            nn.init.xavier_uniform_(layer.weight)
            nn.init.zeros_(layer.bias)

    @property
    def token_len(self):
        return None if self.pos_emb is None else self.pos_emb.shape[0]

    def to_input(self, x: torch.Tensor) -> torch.Tensor:
        """[B, L, in_channels] -> [B, L, model_channels] (+ position embedding)."""
        if x.dim() != 3 or x.shape[-1] != self.in_channels:
            raise ValueError(f"expected latent [B, L, {self.in_channels}], got {tuple(x.shape)}")
        h = self.input_layer(x)
        if self.pos_emb is not None:
            if x.shape[1] != self.pos_emb.shape[0]:
                raise ValueError(f"latent has {x.shape[1]} tokens, the position embedding {self.pos_emb.shape[0]}")
            h = h + self.pos_emb[None]  # no cast: under autocast the sum promotes to float32, as upstream
        return h

    def to_output(self, h: torch.Tensor) -> torch.Tensor:
        """[B, L, model_channels] -> [B, L, in_channels] (non-affine layer norm then linear)."""
        return self.out_layer(backends.layer_norm(h, h.shape[-1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.to_input(x)
