"""Condition embedder of both generators: several embedders (DINOv2 for image and mask, the point-map embedder),
each applied to one or more named inputs; per embedder a projection net to a common width; a learned embedding
per position group ('cropped' / 'full'); all token groups concatenated."""
import math
import random
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F


def llama_hidden_dim(dim: int, multiplier: float, multiple_of: int = 256) -> int:
    """Hidden width of the SwiGLU projection: 2/3 of multiplier*dim, rounded up to a multiple of 256."""
    hidden = int(2 * multiplier * dim / 3)
    return multiple_of * math.ceil(hidden / multiple_of)


class FeedForward(nn.Module):
    """SwiGLU feed-forward without biases: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int, out_dim: Optional[int] = None):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, out_dim or dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def embedder_width(embedder: nn.Module) -> int:
    for name in ("embed_dim", "out_dim", "output_dim"):
        if isinstance(getattr(embedder, name, None), int):
            return getattr(embedder, name)
    raise ValueError(f"cannot tell the token width of {type(embedder).__name__}: give it an `embed_dim` attribute")


class EmbedderFuser(nn.Module):
    """`embedder_list`: [(embedder, [(input_name, position_group), ...]), ...]. forward(**inputs) returns the
    concatenated projected tokens [B, sum L_i, D] in embedder-major, input-list order (D = widest embedder)."""

    def __init__(self, embedder_list: Sequence[Tuple[nn.Module, Sequence[Sequence[str]]]],
                 use_pos_embedding: Optional[str] = "learned", projection_net_hidden_dim_multiplier: float = 4.0,
                 dropout_prob: float = 0.0, drop_modalities_weight: Optional[Sequence] = None,
                 force_drop_modalities: Optional[Sequence[str]] = None, freeze: bool = False):
        super().__init__()
        if not embedder_list:
            raise ValueError("embedder_list must hold at least one (embedder, inputs) pair")
        pairs = []
        for entry in embedder_list:
            embedder, kwargs_info = entry
            inputs = [(str(name), str(group)) for name, group in kwargs_info]
            pairs.append((embedder, inputs))
        self.embedder_list = pairs
        self.module_list = nn.ModuleList([embedder for embedder, _ in pairs])
        self.use_pos_embedding = use_pos_embedding
        self.dropout_prob = dropout_prob
        self.drop_modalities_weight = [(list(mods), float(w)) for mods, w in (drop_modalities_weight or [])]
        self.force_drop_modalities = list(force_drop_modalities) if force_drop_modalities else None
        self.freeze = freeze

        widths = [embedder_width(embedder) for embedder, _ in pairs]
        self.embed_dim = max(widths)
        self.projection_nets = nn.ModuleList([
            nn.Sequential(nn.LayerNorm(w),
                          FeedForward(w, llama_hidden_dim(self.embed_dim, projection_net_hidden_dim_multiplier),
                                      self.embed_dim))
            for w in widths])
        # position groups numbered by first appearance ('cropped' = 0, 'full' = 1); one spare row, as upstream
        self.pos_group_index: Dict[str, int] = {}
        for _, inputs in pairs:
            for _, group in inputs:
                self.pos_group_index.setdefault(group, len(self.pos_group_index))
        if use_pos_embedding == "learned":
            self.idx_emb = nn.Parameter(torch.zeros(len(self.pos_group_index) + 1, self.embed_dim))
        elif use_pos_embedding not in (None, "none", False):
            raise ValueError(f"unknown use_pos_embedding {use_pos_embedding!r} (use 'learned' or None)")
        if freeze:
            for p in self.parameters():
                p.requires_grad_(False)

    @property
    def input_names(self) -> List[str]:
        return [name for _, inputs in self.embedder_list for name, _ in inputs]

    def _dropped_in_training(self) -> set:
        """Modalities dropped for this training batch (classifier-free guidance dropout); none in eval."""
        if not self.training or not self.drop_modalities_weight or random.random() >= self.dropout_prob:
            return set()
        groups, weights = zip(*self.drop_modalities_weight)
        return set(random.choices(groups, weights=weights, k=1)[0])

    def forward(self, *args, **inputs: torch.Tensor) -> torch.Tensor:
        if args:
            raise TypeError("EmbedderFuser takes its inputs as keyword arguments only, e.g. "
                            f"fuser({', '.join(n + '=...' for n in self.input_names)})")
        missing = [n for n in self.input_names if n not in inputs or inputs[n] is None]
        if missing:
            raise ValueError(f"condition inputs {missing} are missing; this embedder needs {self.input_names}")
        self._check_inputs(inputs)
        dropped = set(self.force_drop_modalities or ()) | self._dropped_in_training()
        groups = []
        for (embedder, names), projection in zip(self.embedder_list, self.projection_nets):
            for name, group in names:
                tokens = projection(embedder(inputs[name]))
                if self.use_pos_embedding == "learned":
                    tokens = tokens + self.idx_emb[self.pos_group_index[group]]
                if name in dropped:
                    tokens = tokens * 0
                groups.append(tokens)
        return torch.cat(groups, dim=1)

    def _check_inputs(self, inputs: Dict[str, torch.Tensor]) -> None:
        batch = {}
        for name in self.input_names:
            x = inputs[name]
            if not isinstance(x, torch.Tensor) or x.dim() != 4:
                raise ValueError(f"condition input {name!r} must be a [B, C, H, W] tensor, got "
                                 f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
            if "mask" in name and x.shape[1] != 1:
                raise ValueError(f"condition input {name!r} is a mask and must have 1 channel [B, 1, H, W], "
                                 f"got {tuple(x.shape)}")
            batch[name] = x.shape[0]
        if len(set(batch.values())) > 1:
            raise ValueError(f"condition inputs have different batch sizes: {batch}")
