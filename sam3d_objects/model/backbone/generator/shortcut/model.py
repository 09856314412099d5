"""Shortcut-model generator (stage 1): flow matching whose backbone also takes a step size d. With
`no_shortcut=True` it is plain Euler flow matching that still passes d = 0 (the d-embedding of 0 is part of
the time embedding). Times are numpy float64; t*time_scale and d*time_scale reach the backbone as float32
1-element tensors."""
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn as nn

from ..flow_matching.model import FlowMatching, euler_step, rescale_times


class ShortCut(FlowMatching):
    def __init__(self, reverse_fn: nn.Module, sigma_min: float = 0.0, inference_steps: int = 100,
                 time_scale: float = 1000.0, rescale_t: Optional[float] = None,
                 training_time_sampler_fn: Optional[Callable] = None, loss_weights: Optional[dict] = None,
                 batch_mode: bool = False, no_shortcut: bool = False, shortcut_loss_weight: float = 1.0,
                 self_consistency_prob: float = 0.25, self_consistency_cfg_strength: float = 0.0,
                 ratio_cfg_samples_in_self_consistency_target: float = 0.0,
                 cfg_modalities: Optional[Sequence[str]] = None):
        super().__init__(reverse_fn, sigma_min=sigma_min, inference_steps=inference_steps, time_scale=time_scale,
                         rescale_t=rescale_t, training_time_sampler_fn=training_time_sampler_fn,
                         loss_weights=loss_weights, batch_mode=batch_mode)
        self.no_shortcut = no_shortcut
        self.shortcut_loss_weight = shortcut_loss_weight
        self.self_consistency_prob = self_consistency_prob
        self.self_consistency_cfg_strength = self_consistency_cfg_strength
        self.ratio_cfg_samples_in_self_consistency_target = ratio_cfg_samples_in_self_consistency_target
        self.cfg_modalities = list(cfg_modalities) if cfg_modalities is not None else None

    def time_grid(self, device=None) -> np.ndarray:
        t_seq = np.linspace(0.0, 1.0, self._check_steps() + 1)
        return rescale_times(t_seq, self.rescale_t)

    def step_size(self) -> float:
        return 0.0 if self.no_shortcut else 1.0 / self._check_steps()

    def _scaled(self, value: float, device) -> torch.Tensor:
        return torch.tensor([value * self.time_scale], dtype=torch.float32, device=device)

    def generate_iter(self, x_shape: Any, x_device, *args, **kwargs):
        x = self.generate_noise(x_shape, x_device)
        t_seq = self.time_grid()
        d = self.step_size()
        yield t_seq[0], x
        for t, t_next in zip(t_seq[:-1], t_seq[1:]):
            v = self.reverse_fn(x, self._scaled(t, x_device), *args, d=self._scaled(d, x_device), **kwargs)
            x = euler_step(x, v, float(t_next - t))
            yield t_next, x
