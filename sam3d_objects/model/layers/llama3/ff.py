"""Llama-3 SwiGLU feed-forward (w2(silu(w1 x) * w3 x)), the projection block of the condition-embedder fuser."""
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


def swiglu_hidden_dim(hidden_dim: int, multiple_of: int = 256, ffn_dim_multiplier: Optional[float] = None) -> int:
    """Llama's hidden size: 2/3 of `hidden_dim`, optionally scaled, rounded up to a multiple of `multiple_of`."""
    h = int(2 * hidden_dim / 3)
    if ffn_dim_multiplier is not None:
        h = int(ffn_dim_multiplier * h)
    return multiple_of * ((h + multiple_of - 1) // multiple_of)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, multiple_of: int = 256, ffn_dim_multiplier: Optional[float] = None,
                 output_dim: Optional[int] = None, skip_w2: bool = False):
        super().__init__()
        h = swiglu_hidden_dim(hidden_dim, multiple_of, ffn_dim_multiplier)
        output_dim = dim if output_dim is None else output_dim
        self.skip_w2 = skip_w2
        self.w1 = nn.Linear(dim, h, bias=False)
        if not skip_w2:
            self.w2 = nn.Linear(h, output_dim, bias=False)
        self.w3 = nn.Linear(dim, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = F.silu(self.w1(x)) * self.w3(x)
        return g if self.skip_w2 else self.w2(g)
