"""Classifier-free guidance around a flow backbone: v = (1 + s) * v_cond - s * v_uncond while the (scaled)
time lies in `interval`; the unconditional call is chosen once at construction (`unconditional_handling`)."""
import random
from typing import Any, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .tree import host_values, tree_map

UNCONDITIONAL_HANDLINGS = ("add_flag", "zeros", "discard", "drop_tensors")


def guided(cond: Any, uncond: Any, strength: float) -> Any:
    return tree_map(lambda c, u: (1 + strength) * c - strength * u, cond, uncond)


def time_in_interval(t: Any, interval: Optional[Sequence[float]]) -> bool:
    """True when every entry of t lies in [interval[0], interval[1]] (inclusive); no interval = always."""
    if interval is None:
        return True
    lo, hi = float(interval[0]), float(interval[1])
    values = host_values(t)
    return all(lo <= v <= hi for v in values)


def flag_condition(args: tuple, kwargs: dict):
    """'add_flag' handling: same call plus cfg=True (the backbone zeroes its condition tokens)."""
    return tuple(args), {**kwargs, "cfg": True}


def _zeros_like(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    if isinstance(tree, dict):
        return {k: _zeros_like(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_zeros_like(v) for v in tree)
    return tree


def _drop_tensors(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _drop_tensors(v) for k, v in tree.items() if not isinstance(v, torch.Tensor)}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_drop_tensors(v) for v in tree if not isinstance(v, torch.Tensor))
    return tree


def zero_out(args: tuple, kwargs: dict):
    """Upstream's 'zeros' handler: every tensor among the conditionals replaced by zeros."""
    return _zeros_like(tuple(args)), _zeros_like(dict(kwargs))


def discard(args: tuple, kwargs: dict):
    """'discard': no conditionals at all."""
    return (), {}


def drop_tensors(args: tuple, kwargs: dict):
    """'drop_tensors': tensors removed from the conditionals, everything else kept."""
    return _drop_tensors(tuple(args)), _drop_tensors(dict(kwargs))


def add_flag(args: tuple, kwargs: dict):
    """'add_flag': the same conditionals plus kwargs['cfg'] = True (mutates and returns kwargs, as upstream)."""
    kwargs["cfg"] = True
    return args, kwargs


def _strength_leaf(strength: float, interval: Any, t: Any) -> float:
    return strength if interval is not None and time_in_interval(t, interval) else 0.0


def get_strength(strength: Any, interval: Any, t: Any) -> Any:
    """The guidance strength at (scaled) time t: each strength leaf kept while t lies in its interval (inclusive),
    else 0. No interval at all disables guidance (upstream's rule for this function)."""
    if isinstance(strength, dict):
        return {k: _strength_leaf(v, interval[k] if isinstance(interval, dict) else interval, t)
                for k, v in strength.items()}
    return _strength_leaf(strength, interval, t)


_HANDLERS = {"zeros": zero_out, "add_flag": flag_condition, "discard": discard, "drop_tensors": drop_tensors}


class ClassifierFreeGuidance(nn.Module):
    UNCONDITIONAL_HANDLING_TYPES = {"zeros": zero_out, "discard": discard, "drop_tensors": drop_tensors,
                                    "add_flag": add_flag}
    # set by cuda_graph.graphed_backbone for one sampling run: inference calls of the backbone replay CUDA graphs
    graph_runner = None

    def __init__(self, backbone: nn.Module, p_unconditional: float = 0.1, strength: float = 3.0,
                 unconditional_handling: str = "zeros", interval: Optional[Sequence[float]] = None):
        super().__init__()
        if unconditional_handling not in UNCONDITIONAL_HANDLINGS:
            raise ValueError(f"unknown unconditional_handling {unconditional_handling!r} "
                             f"(use one of {UNCONDITIONAL_HANDLINGS})")
        self.backbone = backbone
        self.p_unconditional = p_unconditional
        self.strength = strength
        self.interval = list(interval) if interval is not None else None
        self.unconditional_handling = unconditional_handling
        # bound once: reassigning `unconditional_handling` later does not change it (upstream behaves so)
        self._make_unconditional_args = _HANDLERS[unconditional_handling]

    def _cfg_step_tensor(self, y_cond: torch.Tensor, y_uncond: torch.Tensor, strength: float) -> torch.Tensor:
        """One guided output: (1 + s) * y_cond - s * y_uncond."""
        return (1 + strength) * y_cond - strength * y_uncond

    def _cfg_step(self, y_cond: Any, y_uncond: Any, strength: Any) -> Any:
        """``_cfg_step_tensor`` over the output tree; a dict strength gives each output key its own."""
        if isinstance(strength, dict):
            return {k: self._cfg_step_tensor(y_cond[k], y_uncond[k], strength[k]) for k in y_cond}
        return tree_map(lambda c, u: self._cfg_step_tensor(c, u, strength), y_cond, y_uncond)

    def call_backbone(self, x: Any, t: torch.Tensor, *args, **kwargs) -> Any:
        """One backbone call at inference: through the CUDA-graph runner while one is set, else eagerly."""
        if self.graph_runner is not None:
            return self.graph_runner(x, t, *args, **kwargs)
        return self.backbone(x, t, *args, **kwargs)

    def unconditional_call(self, x: Any, t: torch.Tensor, *args, **kwargs) -> Any:
        if self.graph_runner is not None and not self.training:
            plain = self._unconditional_as_plain_call(args, kwargs)
            if plain is not None:  # one CUDA graph then serves both branches of the guidance
                return self.graph_runner(x, t, *plain[0], **plain[1])
        args, kwargs = self._make_unconditional_args(args, kwargs)
        if self.training:
            return self.backbone(x, t, *args, **kwargs)
        return self.call_backbone(x, t, *args, **kwargs)

    def _unconditional_as_plain_call(self, args: tuple, kwargs: dict) -> Optional[Tuple[tuple, dict]]:
        """For 'add_flag': the arguments of an ordinary call of the backbone that computes its cfg=True call,
        where the backbone offers them (``unconditional_arguments``: the condition tokens times 0), else None."""
        offer = getattr(self.backbone, "unconditional_arguments", None)
        if self._make_unconditional_args is not flag_condition or offer is None:
            return None
        return offer(args, kwargs)

    def _training_forward(self, x: Any, t: torch.Tensor, *args, **kwargs) -> Any:
        if self.p_unconditional > 0 and random.random() < self.p_unconditional:
            return self.unconditional_call(x, t, *args, **kwargs)
        return self.backbone(x, t, *args, **kwargs)

    def _active_strength(self, t: Any) -> Any:
        # QUIRK kept apart: upstream's get_strength disables guidance without an interval; this project's
        # generators guide at every time then (the pipeline always sets an interval, so both agree there)
        interval = self.interval if self.interval is not None else (float("-inf"), float("inf"))
        return get_strength(self.strength, interval, t)

    def inner_forward(self, x: Any, t: torch.Tensor, is_cond: bool, strength: Any, *args_cond: Any,
                      **kwargs_cond: Any) -> Any:
        cond = self.call_backbone(x, t, *args_cond, **kwargs_cond)
        if is_cond:
            return cond
        return self._cfg_step(cond, self.unconditional_call(x, t, *args_cond, **kwargs_cond), strength)

    def forward(self, x: Any, t: torch.Tensor, *args, **kwargs) -> Any:
        if not args and not kwargs:
            if self.unconditional_handling != "discard":
                raise RuntimeError("no conditional arguments given: only unconditional_handling='discard' allows it")
            return self.backbone(x, t)
        if self.training:
            return self._training_forward(x, t, *args, **kwargs)
        strength = self._active_strength(t)
        leaves = strength.values() if isinstance(strength, dict) else [strength]
        return self.inner_forward(x, t, not any(s > 0 for s in leaves), strength, *args, **kwargs)


POINTMAP_MODALITIES = ["pointmap", "rgb_pointmap"]


def _pointmap_dropped_call(backbone: nn.Module, x: Any, t: Any, args: tuple, kwargs: dict) -> Any:
    """The backbone with its condition embedder dropping the point-map modalities for this one call."""
    embedder = getattr(backbone, "condition_embedder", None)
    if embedder is None or not hasattr(embedder, "force_drop_modalities"):
        raise RuntimeError("point-map guidance (strength_pm > 0) needs a backbone whose condition_embedder is an "
                           "EmbedderFuser (with force_drop_modalities)")
    saved = embedder.force_drop_modalities
    embedder.force_drop_modalities = list(POINTMAP_MODALITIES)
    try:
        return backbone(x, t, *args, **kwargs)
    finally:
        embedder.force_drop_modalities = saved


def pointmap_cfg_step_tensor(y_cond: torch.Tensor, y_uncond: torch.Tensor, y_unpm: torch.Tensor, strength: Any,
                             strength_pm: Any) -> torch.Tensor:
    """y_cond + s_pm (y_cond - y_pm) + s (y_pm - y_uncond) (y_pm: the point-map modalities dropped)."""
    return y_cond + strength_pm * (y_cond - y_unpm) + strength * (y_unpm - y_uncond)


def pointmap_cfg_step(y_cond: Any, y_uncond: Any, y_pm: Any, strength: Any, strength_pm: Any) -> Any:
    """``pointmap_cfg_step_tensor`` per output leaf (dict strengths per key)."""
    if isinstance(y_cond, dict):
        pick = lambda v, k: v[k] if isinstance(v, dict) else v  # noqa: E731
        return {k: pointmap_cfg_step_tensor(y_cond[k], y_uncond[k], y_pm[k], pick(strength, k), pick(strength_pm, k))
                for k in y_cond}
    return pointmap_cfg_step_tensor(y_cond, y_uncond, y_pm, strength, strength_pm)


def _pointmap_guided(cfg: "ClassifierFreeGuidance", x: Any, t: Any, is_cond: bool, strength: Any, strength_pm: Any,
                     args: tuple, kwargs: dict) -> Any:
    """The three backbone calls of point-map guidance, combined by ``pointmap_cfg_step``."""
    y_cond = cfg.backbone(x, t, *args, **kwargs)
    if is_cond:
        return y_cond
    y_pm = _pointmap_dropped_call(cfg.backbone, x, t, args, kwargs)
    y_uncond = cfg.unconditional_call(x, t, *args, **kwargs)
    return pointmap_cfg_step(y_cond, y_uncond, y_pm, strength, strength_pm)


def _pointmap_forward(cfg: "ClassifierFreeGuidance", x: Any, t: Any, args: tuple, kwargs: dict) -> Any:
    """Inference with point-map guidance: both strengths at time t, guidance skipped when both are 0."""
    interval = cfg.interval if cfg.interval is not None else (float("-inf"), float("inf"))
    strength = get_strength(cfg.strength, interval, t)
    strength_pm = get_strength(cfg.strength_pm, interval, t)
    return _pointmap_guided(cfg, x, t, not _any_positive(strength, strength_pm), strength, strength_pm, args, kwargs)


def _any_positive(*strengths: Any) -> bool:
    return any(v > 0 for s in strengths for v in (s.values() if isinstance(s, dict) else [s]))


class PointmapCFG(ClassifierFreeGuidance):
    """CFG with a second term separating the point-map condition: guidance towards the image condition (s) and,
    on top, towards the point map (s_pm)."""

    def __init__(self, *args: Any, strength_pm: Any = 0.0, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.strength_pm = strength_pm

    def _cfg_step_tensor(self, y_cond: torch.Tensor, y_uncond: torch.Tensor, y_unpm: torch.Tensor, strength: Any,
                         strength_pm: Any) -> torch.Tensor:
        return pointmap_cfg_step_tensor(y_cond, y_uncond, y_unpm, strength, strength_pm)

    def _cfg_step(self, y_cond: Any, y_uncond: Any, y_pm: Any, strength: Any, strength_pm: Any) -> Any:
        return pointmap_cfg_step(y_cond, y_uncond, y_pm, strength, strength_pm)

    def inner_forward(self, x: Any, t: torch.Tensor, is_cond: bool, strength: Any, strength_pm: Any,
                      *args_cond: Any, **kwargs_cond: Any) -> Any:
        return _pointmap_guided(self, x, t, is_cond, strength, strength_pm, args_cond, kwargs_cond)

    def forward(self, x: Any, t: torch.Tensor, *args_cond: Any, **kwargs_cond: Any) -> Any:
        if self.training or (not args_cond and not kwargs_cond):
            return super().forward(x, t, *args_cond, **kwargs_cond)
        return _pointmap_forward(self, x, t, args_cond, kwargs_cond)


class ClassifierFreeGuidanceWithExternalUnconditionalProbability(ClassifierFreeGuidance):
    """CFG whose training-time drop decision can come from the caller (kwarg `p_unconditional`, as ShortCut's
    self-consistency targets need); at inference identical to ClassifierFreeGuidance. A non-zero `strength_pm`
    (set by the pipeline) adds PointmapCFG's point-map term."""

    def __init__(self, *args: Any, use_unconditional_from_flow_matching: bool = False, strength_pm: float = 0.0,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.use_unconditional_from_flow_matching = use_unconditional_from_flow_matching
        self.strength_pm = strength_pm

    def forward(self, x: Any, t: torch.Tensor, *args, p_unconditional: Optional[float] = None, **kwargs) -> Any:
        # upstream draws from Python's RNG on every call (never from torch's); kept so that Python-RNG
        # sequences match
        draw = random.random()
        if self.training:
            p = self.p_unconditional if p_unconditional is None else p_unconditional
            if p > 0 and draw < p:
                return self.unconditional_call(x, t, *args, **kwargs)
            return self.backbone(x, t, *args, **kwargs)
        if self.strength_pm and (args or kwargs):
            return _pointmap_forward(self, x, t, args, kwargs)
        return super().forward(x, t, *args, **kwargs)

    def inner_forward(self, x: Any, t: torch.Tensor, is_cond: bool, strength: Any, *args_cond: Any,
                      **kwargs_cond: Any) -> Any:
        if self.strength_pm:  # reached through PointmapCFG.forward: strength_pm sits before the conditionals
            strength_pm, *args_cond = args_cond
            return _pointmap_guided(self, x, t, is_cond, strength, strength_pm, tuple(args_cond), kwargs_cond)
        return super().inner_forward(x, t, is_cond, strength, *args_cond, **kwargs_cond)
