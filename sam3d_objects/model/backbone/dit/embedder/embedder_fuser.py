"""Condition embedder of both generators: several embedders (DINOv2 for image and mask, the point-map embedder),
each applied to one or more named inputs; per embedder a projection net to a common width; a learned embedding
per position group ('cropped' / 'full'); all token groups concatenated."""
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
    concatenated projected tokens [B, sum L_i, D] in embedder-major, input-list order (D = widest embedder,
    ``embed_dims``). A position group of None adds no position embedding.

    Upstream's attributes: ``embed_dims`` (common width), ``concate_embed_dims`` (sum of the embedders' widths over
    all inputs: the compression projector's input), ``positional_embed_map`` ({group: row of ``idx_emb``}, by
    first appearance), ``projection_net_hidden_dim_multiplier``."""

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
            inputs = [(str(name), None if group is None else str(group)) for name, group in kwargs_info]
            pairs.append((embedder, inputs))
        self.embedder_list = pairs
        self.module_list = nn.ModuleList([embedder for embedder, _ in pairs])
        self.use_pos_embedding = use_pos_embedding
        self.dropout_prob = dropout_prob
        self.drop_modalities_weight = [(list(mods), float(w)) for mods, w in (drop_modalities_weight or [])]
        self.force_drop_modalities = list(force_drop_modalities) if force_drop_modalities else None
        self.freeze = freeze

        widths = [embedder_width(embedder) for embedder, _ in pairs]
        self.embed_dims = max(widths)
        self.embed_dim = self.embed_dims  # the width other modules read from an embedder
        # tokens of every input side by side in the channels (compression): the embedders' own widths summed
        self.concate_embed_dims = sum(widths[i] for i, (_, inputs) in enumerate(pairs) for _ in inputs)
        self.projection_pre_norm = projection_pre_norm
        self.projection_net_hidden_dim_multiplier = projection_net_hidden_dim_multiplier
        self.compression_projection_multiplier = compression_projection_multiplier
        if projection_net_hidden_dim_multiplier > 0:
            self.projection_nets = nn.ModuleList([
                self._make_projection_net(w, self.embed_dims, projection_net_hidden_dim_multiplier) for w in widths])
        else:
            self.projection_nets = None
        if compression_projection_multiplier > 0:
            self.compression_projector = self._make_projection_net(self.concate_embed_dims, self.embed_dims,
                                                                   compression_projection_multiplier)
        # position groups numbered by first appearance ('cropped' = 0, 'full' = 1); one spare row, as upstream
        self.positional_embed_map: Dict[str, int] = {}
        for _, inputs in pairs:
            for _, group in inputs:
                if group is not None:
                    self.positional_embed_map.setdefault(group, len(self.positional_embed_map))
        rows = len(self.positional_embed_map) + 1
        if use_pos_embedding == "learned":
            self.idx_emb = nn.Parameter(torch.zeros(rows, self.embed_dims))
        elif use_pos_embedding == "random":  # fixed random rows, saved with the weights
            self.register_buffer("idx_emb", torch.randn(rows, 1, self.embed_dims))
        elif use_pos_embedding not in (None, "none", False):
            raise ValueError(f"unknown use_pos_embedding {use_pos_embedding!r} (use 'learned', 'random' or None)")
        if freeze:
            for p in self.parameters():
                p.requires_grad_(False)

    @property
    def pos_group_index(self) -> Dict[str, int]:
        """Former name of ``positional_embed_map``."""
        return self.positional_embed_map

    @property
    def input_names(self) -> List[str]:
        return [name for _, inputs in self.embedder_list for name, _ in inputs]

    def _make_projection_net(self, input_embed_dim: int, output_embed_dim: int, multiplier: float) -> nn.Sequential:
        """[LayerNorm if ``projection_pre_norm``] -> SwiGLU FeedForward (hidden = multiplier * output width)."""
        return make_projection_net(input_embed_dim, output_embed_dim, multiplier, self.projection_pre_norm)

    # ------------------------------------------------------------------------------------ modality dropout
    def _build_dropout_distribution(self, device) -> Tuple[List[set], torch.Tensor]:
        """Training-time modality dropout: (configurations = sets of input names to drop, the first one empty;
        cumulative probabilities). Nothing is dropped with probability 1 - dropout_prob; the configured sets
        share dropout_prob in proportion to their weights."""
        total = sum(w for _, w in self.drop_modalities_weight)
        if total <= 0:
            raise ValueError("drop_modalities_weight needs a positive total weight when dropout_prob > 0")
        configs = [set()] + [set(mods) for mods, _ in self.drop_modalities_weight]
        weights = [1.0 - self.dropout_prob] + [self.dropout_prob * w / total for _, w in self.drop_modalities_weight]
        return configs, torch.tensor(weights, dtype=torch.float64).cumsum(0).to(device)

    def _apply_force_drop(self, kwarg_names: List[str], tokens: List[torch.Tensor]) -> List[torch.Tensor]:
        """``force_drop_modalities``: those inputs' tokens multiplied by 0 (always, also in eval)."""
        if not self.force_drop_modalities:
            return tokens
        forced = set(self.force_drop_modalities)
        return [t * (0.0 if name in forced else 1.0) for name, t in zip(kwarg_names, tokens)]

    def _dropout_modalities(self, kwarg_names: List[str], tokens: List[torch.Tensor]) -> List[torch.Tensor]:
        """Forced drops, then (training only) one dropout configuration drawn per batch element."""
        tokens = self._apply_force_drop(kwarg_names, tokens)
        if not self.training or self.dropout_prob <= 0 or not self.drop_modalities_weight:
            return tokens
        batch, device = tokens[0].shape[0], tokens[0].device
        configs, cumulative = self._build_dropout_distribution(device)
        chosen = torch.searchsorted(cumulative, torch.rand(batch, device=device, dtype=cumulative.dtype))
        chosen = chosen.clamp(max=len(configs) - 1)
        out = []
        for name, t in zip(kwarg_names, tokens):
            dropping = [i for i, config in enumerate(configs) if name in config]
            keep = ~torch.isin(chosen, torch.tensor(dropping, dtype=chosen.dtype, device=device))
            out.append(t * keep.to(t.dtype).view(batch, *([1] * (t.dim() - 1))))
        return out

    def _position_embedding(self, group: Optional[str]) -> Optional[torch.Tensor]:
        if group is None or self.use_pos_embedding not in ("learned", "random"):
            return None
        row = self.idx_emb[self.positional_embed_map[group]]
        return row.reshape(-1)  # "random" rows are stored [1, D]

    def forward(self, *args, **inputs: torch.Tensor) -> torch.Tensor:
        if args:
            raise TypeError("EmbedderFuser takes its inputs as keyword arguments only, e.g. "
                            f"fuser({', '.join(n + '=...' for n in self.input_names)})")
        missing = [n for n in self.input_names if n not in inputs or inputs[n] is None]
        if missing:
            raise ValueError(f"condition inputs {missing} are missing; this embedder needs {self.input_names}")
        self._check_inputs(inputs)
        names, groups = [], []
        for i, (embedder, entries) in enumerate(self.embedder_list):
            for name, group in entries:
                tokens = embedder(inputs[name])
                if self.projection_nets is not None:
                    tokens = self.projection_nets[i](tokens)
                position = self._position_embedding(group)
                if position is not None:
                    tokens = tokens + position
                groups.append(tokens)
                names.append(name)
        groups = self._dropout_modalities(names, groups)
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
