"""Condition embedder of both generators: several embedders (DINOv2 for image and mask, the point-map embedder),
each applied to one or more named inputs; per embedder a projection net to a common width; a learned embedding
per position group ('cropped' / 'full'); all token groups concatenated."""
import random
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ....layers.llama3.ff import FeedForward, swiglu_hidden_dim


def llama_hidden_dim(dim: int, multiplier: float, multiple_of: int = 256) -> int:
    """Hidden width of the SwiGLU projection: 2/3 of multiplier*dim, rounded up to a multiple of 256."""
    return swiglu_hidden_dim(int(multiplier * dim), multiple_of)


def make_projection_net(input_dim: int, output_dim: int, multiplier: float, pre_norm: bool = True) -> nn.Sequential:
    """[LayerNorm or Identity] -> llama3 FeedForward(input_dim -> output_dim); keys `0.*` and `1.w{1,2,3}`."""
    return nn.Sequential(nn.LayerNorm(input_dim) if pre_norm else nn.Identity(),
                         FeedForward(input_dim, int(multiplier * output_dim), output_dim=output_dim))


def embedder_width(embedder: nn.Module) -> int:
    for name in ("embed_dim", "out_dim", "output_dim"):
        if isinstance(getattr(embedder, name, None), int):
            return getattr(embedder, name)
    raise ValueError(f"cannot tell the token width of {type(embedder).__name__}: give it an `embed_dim` attribute")


class EmbedderFuser(nn.Module):
    """`embedder_list`: [(embedder, [(input_name, position_group), ...]), ...]. forward(**inputs) returns the
    concatenated projected tokens [B, sum L_i, D] in embedder-major, input-list order (D = widest embedder)."""

    def __init__(self, embedder_list: Sequence[Tuple[nn.Module, Sequence[Sequence[str]]]],
                 use_pos_embedding: Optional[str] = "learned", projection_pre_norm: bool = True,
                 projection_net_hidden_dim_multiplier: float = 4.0, compression_projection_multiplier: float = 0,
                 freeze: bool = False, drop_modalities_weight: Optional[Sequence] = None, dropout_prob: float = 0.0,
                 force_drop_modalities: Optional[Sequence[str]] = None):
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
        self.projection_pre_norm = projection_pre_norm
        self.compression_projection_multiplier = compression_projection_multiplier
        if projection_net_hidden_dim_multiplier > 0:
            self.projection_nets = nn.ModuleList([
                make_projection_net(w, self.embed_dim, projection_net_hidden_dim_multiplier, projection_pre_norm)
                for w in widths])
        else:
            self.projection_nets = None
        if compression_projection_multiplier > 0:
            # tokens of every input side by side in the channels: upstream sizes the projector with the sum of
            # the embedders' own widths (equal to the projected width when all embedders share one width)
            concat_dims = sum(widths[i] for i, (_, inputs) in enumerate(pairs) for _ in inputs)
            self.compression_projector = make_projection_net(concat_dims, self.embed_dim,
                                                             compression_projection_multiplier, projection_pre_norm)
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
        projections = self.projection_nets if self.projection_nets is not None else [nn.Identity()] * len(
            self.embedder_list)
        for (embedder, names), projection in zip(self.embedder_list, projections):
            for name, group in names:
                tokens = projection(embedder(inputs[name]))
                if self.use_pos_embedding == "learned":
                    tokens = tokens + self.idx_emb[self.pos_group_index[group]]
                if name in dropped:
                    tokens = tokens * 0
                groups.append(tokens)
        if self.compression_projection_multiplier > 0:  # all inputs side by side per token, then compressed
            return self.compression_projector(torch.cat(groups, dim=-1))
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
