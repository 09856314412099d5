"""Classifier-free guidance around a flow backbone: v = (1 + s) * v_cond - s * v_uncond while the (scaled)
time lies in `interval`; the unconditional call is chosen once at construction (`unconditional_handling`)."""
import random
from typing import Any, Optional, Sequence

import torch
import torch.nn as nn

from .tree import tree_map

UNCONDITIONAL_HANDLINGS = ("add_flag", "zeros")


def guided(cond: Any, uncond: Any, strength: float) -> Any:
    return tree_map(lambda c, u: (1 + strength) * c - strength * u, cond, uncond)


def time_in_interval(t: Any, interval: Optional[Sequence[float]]) -> bool:
    """True when every entry of t lies in [interval[0], interval[1]] (inclusive); no interval = always."""
    if interval is None:
        return True
    lo, hi = float(interval[0]), float(interval[1])
    values = t.reshape(-1).tolist() if isinstance(t, torch.Tensor) else [float(t)]
    return all(lo <= v <= hi for v in values)


def zero_condition(args: tuple, kwargs: dict):
    """'zeros' handling: the first positional condition tensor replaced by zeros."""
    if not args or not isinstance(args[0], torch.Tensor):
        raise ValueError("unconditional_handling='zeros' needs the condition tensor as first positional argument")
    return (torch.zeros_like(args[0]),) + tuple(args[1:]), dict(kwargs)


def flag_condition(args: tuple, kwargs: dict):
    """'add_flag' handling: same call plus cfg=True (the backbone zeroes its condition tokens)."""
    return tuple(args), {**kwargs, "cfg": True}


class ClassifierFreeGuidance(nn.Module):
    def __init__(self, backbone: nn.Module, p_unconditional: float = 0.0, strength: float = 3.0,
                 interval: Optional[Sequence[float]] = None, unconditional_handling: str = "zeros"):
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
        self._make_unconditional = zero_condition if unconditional_handling == "zeros" else flag_condition

    def unconditional_call(self, x: Any, t: torch.Tensor, *args, **kwargs) -> Any:
        args, kwargs = self._make_unconditional(args, kwargs)
        return self.backbone(x, t, *args, **kwargs)

    def _training_forward(self, x: Any, t: torch.Tensor, *args, **kwargs) -> Any:
        if self.p_unconditional > 0 and random.random() < self.p_unconditional:
            return self.unconditional_call(x, t, *args, **kwargs)
        return self.backbone(x, t, *args, **kwargs)

    def forward(self, x: Any, t: torch.Tensor, *args, **kwargs) -> Any:
        if self.training:
            return self._training_forward(x, t, *args, **kwargs)
        if self.strength > 0 and time_in_interval(t, self.interval):
            cond = self.backbone(x, t, *args, **kwargs)
            uncond = self.unconditional_call(x, t, *args, **kwargs)
            return guided(cond, uncond, self.strength)
        return self.backbone(x, t, *args, **kwargs)


class ClassifierFreeGuidanceWithExternalUnconditionalProbability(ClassifierFreeGuidance):
    """CFG whose training-time drop decision can come from the caller (kwarg `p_unconditional`); at inference
    identical to ClassifierFreeGuidance. `strength_pm` (a second guidance term) is kept as an attribute; only 0
    (what the pipeline sets) is supported."""

    def __init__(self, backbone: nn.Module, p_unconditional: float = 0.0, strength: float = 3.0,
                 interval: Optional[Sequence[float]] = None, unconditional_handling: str = "zeros",
                 strength_pm: float = 0.0):
        super().__init__(backbone, p_unconditional=p_unconditional, strength=strength, interval=interval,
                         unconditional_handling=unconditional_handling)
        self.strength_pm = strength_pm

    def forward(self, x: Any, t: torch.Tensor, *args, p_unconditional: Optional[float] = None, **kwargs) -> Any:
        # upstream draws from Python's RNG on every call (never from torch's); kept so that Python-RNG
        # sequences match
        draw = random.random()
        if self.strength_pm:
            raise NotImplementedError(f"strength_pm={self.strength_pm} is not supported; set reverse_fn.strength_pm"
                                      f" = 0 (the pipeline does)")
        if self.training:
            p = self.p_unconditional if p_unconditional is None else p_unconditional
            if p > 0 and draw < p:
                return self.unconditional_call(x, t, *args, **kwargs)
            return self.backbone(x, t, *args, **kwargs)
        return super().forward(x, t, *args, **kwargs)
