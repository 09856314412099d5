"""Shortcut-model generator (stage 1, arXiv:2410.12557): flow matching whose backbone also takes a step size d.
With `no_shortcut=True` it is plain flow matching that still passes d = 0 (the d-embedding of 0 is part of
the time embedding). Times are numpy float64; t*time_scale and d*time_scale reach the backbone as float32
1-element tensors."""
import random
from typing import Any, Optional, Sequence, Tuple

import numpy as np
import torch

from ..flow_matching.model import FlowMatching, _first_leaf, rescale_times
from ..tree import tree_map, with_host_values

SHORTCUT_STEP_SIZES = [1.0 / 2 ** k for k in range(8)]  # 1, 1/2, ..., 1/128


def _slice_tensors(tree: Any, index: torch.Tensor) -> Any:
    """Every tensor of a condition tree (tuples / lists / dicts) restricted to the batch rows `index`."""
    if isinstance(tree, torch.Tensor):
        return tree[index]
    if isinstance(tree, dict):
        return {k: _slice_tensors(v, index) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_slice_tensors(v, index) for v in tree)
    return tree


def _concat(first: Any, second: Any) -> Any:
    return tree_map(lambda a, b: torch.cat([a, b], dim=0), first, second)


class ShortCut(FlowMatching):
    # reverse_fn first (upstream passes it through **kwargs): existing callers give it positionally
    def __init__(self, reverse_fn: torch.nn.Module, no_shortcut: bool = False, self_consistency_prob: float = 0.25,
                 shortcut_loss_weight: float = 1.0, self_consistency_cfg_strength: float = 3.0,
                 ratio_cfg_samples_in_self_consistency_target: float = 0.5, fm_in_shortcut_target_prob: float = 0.0,
                 fm_eps_max: float = 0, batch_mode: bool = False, cfg_modalities: Optional[Sequence[str]] = ["shape"],  # noqa: B006 (copied)
                 **kwargs: Any):
        super().__init__(reverse_fn, batch_mode=batch_mode, **kwargs)
        self.no_shortcut = no_shortcut
        self.shortcut_loss_weight = shortcut_loss_weight
        self.self_consistency_prob = self_consistency_prob
        self.self_consistency_cfg_strength = self_consistency_cfg_strength
        self.ratio_cfg_samples_in_self_consistency_target = ratio_cfg_samples_in_self_consistency_target
        self.fm_in_shortcut_target_prob = fm_in_shortcut_target_prob
        self.fm_eps_max = fm_eps_max
        self.cfg_modalities = list(cfg_modalities) if cfg_modalities is not None else None

    # ---- inference
    def _prepare_t_and_d(self, steps: Optional[int] = None):
        steps = self._check_steps(steps)
        t_seq = rescale_times(np.linspace(0.0, 1.0, steps + 1), self.rescale_t)
        if self.reversed_timestamp:
            t_seq = 1 - t_seq
        return t_seq, 0.0 if self.no_shortcut else 1.0 / steps

    def time_grid(self, device=None) -> np.ndarray:
        return self._prepare_t_and_d()[0]

    def step_size(self) -> float:
        return self._prepare_t_and_d()[1]

    # per-run cache of the scaled times on the device (filled by generate_iter): made in one transfer instead of
    # a host-to-device copy per backbone call
    _scaled_times: Optional[dict] = None

    def _scaled(self, value: float, device) -> torch.Tensor:
        cached = (self._scaled_times or {}).get((float(value), torch.device(device)))
        if cached is not None:
            return cached
        scaled = torch.tensor([value * self.time_scale], dtype=torch.float32)
        return with_host_values(scaled.to(device), scaled.tolist())

    def _cache_scaled_times(self, values: list, device) -> dict:
        """{(value, device): float32 [1] tensor of value * time_scale, tagged with its host value}."""
        host = torch.tensor([v * self.time_scale for v in values], dtype=torch.float32)
        on_device = host.to(device)
        return {(float(v), torch.device(device)): with_host_values(on_device[i:i + 1], [host[i].item()])
                for i, v in enumerate(values)}

    def _generate_dynamics(self, x_t: Any, t: Any, d: float, *args_conditionals: Any,
                           **kwargs_conditionals: Any) -> Any:
        device = _first_leaf(x_t).device
        return self.reverse_fn(x_t, self._scaled(float(t), device), *args_conditionals,
                               d=self._scaled(float(d), device), **kwargs_conditionals)

    def generate_iter(self, x_shape: Any, x_device, *args_conditionals: Any, **kwargs_conditionals: Any):
        x = self._generate_noise(x_shape, x_device)
        t_seq, d = self._prepare_t_and_d()
        # python-float step sizes: the update is x + v * dt in the latent's own dtype
        times = [float(t) for t in t_seq]
        device = _first_leaf(x).device
        self._scaled_times = self._cache_scaled_times(sorted(set(times) | {float(d)}), device)
        try:
            for x, t in self._solver.solve_iter(self._generate_dynamics, x, times, d, *args_conditionals,
                                                **kwargs_conditionals):
                yield t, x, ()
        finally:
            self._scaled_times = None

    # ---- training
    def _count(self, batch: int, ratio: float) -> int:
        if self.batch_mode:
            return batch if random.random() < ratio else 0
        return int(batch * ratio)

    def _generate_d(self, x1: Any) -> torch.Tensor:
        leaf = _first_leaf(x1)
        batch = leaf.shape[0]
        k = self._count(batch, self.self_consistency_prob)
        d = torch.zeros(batch, device=leaf.device)
        if k:
            d[:k] = torch.tensor(random.choices(SHORTCUT_STEP_SIZES, k=k), device=leaf.device)
        return d[torch.randperm(batch, device=leaf.device)]

    def _generate_t_and_d(self, x1: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        """(t, d) sampled together (the shortcut-model paper's scheme; upstream keeps it, its loss samples t and d
        independently): d first, then t from the training sampler where d = 0 and t = k d with k uniform in
        0..floor((1 - d) / d) where d > 0, so that t + d <= 1."""
        leaf = _first_leaf(x1)
        d = self._generate_d(x1)
        t = torch.zeros(leaf.shape[0], device=leaf.device)
        flow = d == 0
        if bool(flow.any()):
            t[flow] = self.training_time_sampler_fn(size=(int(flow.sum()),),
                                                    generator=self.random_generator).to(leaf.device)
        shortcut = d > 0
        if bool(shortcut.any()):
            step = d[shortcut]
            most = torch.floor((1.0 - step) / step).clamp(min=0)
            t[shortcut] = torch.floor(torch.rand_like(step) * (most + 1)) * step
        return t, d

    def _velocity(self, x_t: Any, t: torch.Tensor, d: torch.Tensor, p_unconditional: float, args: tuple,
                  kwargs: dict) -> Any:
        ts = self.time_scale
        return self.reverse_fn(x_t, t * ts, *args, d=d * ts, p_unconditional=p_unconditional, **kwargs)

    def _guided_velocity(self, x_t: Any, t: torch.Tensor, d: torch.Tensor, n_cfg: int, args: tuple,
                         kwargs: dict) -> Any:
        cond = self._velocity(x_t, t, d, 0.0, args, kwargs)
        if n_cfg == 0:
            return cond
        batch = t.shape[0]
        idx = torch.arange(n_cfg, device=t.device)
        sliced = (args, kwargs) if self.batch_mode else (_slice_tensors(args, idx), _slice_tensors(kwargs, idx))
        x_cfg = x_t if self.batch_mode else tree_map(lambda a: a[:n_cfg], x_t)
        uncond = self._velocity(x_cfg, t[:n_cfg], d[:n_cfg], 1.0, *sliced)
        w = self.self_consistency_cfg_strength
        blend = tree_map(lambda c, u: (1 + w) * c[:n_cfg] - w * u, cond, uncond)
        if n_cfg < batch:
            return _concat(blend, tree_map(lambda c: c[n_cfg:], cond))
        if isinstance(cond, dict) and self.cfg_modalities is not None:
            return {k: blend[k] if k in self.cfg_modalities else cond[k] for k in cond}
        return blend

    @torch.no_grad()
    def compute_self_consistency_target(self, x_t: Any, t: torch.Tensor, d: torch.Tensor, *args_conditionals: Any,
                                        **kwargs_conditionals: Any) -> Any:
        """Average of two d-steps' velocities (CFG-blended on a fraction of the samples): the target for a 2d step."""
        n_cfg = self._count(t.shape[0], self.ratio_cfg_samples_in_self_consistency_target)
        d_net = d * 0 if random.random() < self.fm_in_shortcut_target_prob else d
        s_t = self._guided_velocity(x_t, t, d_net, n_cfg, args_conditionals, kwargs_conditionals)
        x_td = tree_map(lambda x, s: x + s * d[..., None, None], x_t, s_t)
        s_td = self._guided_velocity(x_td, t + d, d_net, n_cfg, args_conditionals, kwargs_conditionals)
        return tree_map(lambda a, b: ((a + b) / 2).detach(), s_t, s_td)

    def loss(self, x1: Any, *args_conditionals: Any, **kwargs_conditionals: Any) -> tuple:
        """Flow-matching loss on the d == 0 samples + shortcut_loss_weight * self-consistency loss on d > 0."""
        t = self._generate_t(x1)
        d = self._generate_d(x1)
        x0 = self._generate_x0(x1)
        x_t = self._generate_xt(x0, x1, t)
        fm, sc = d == 0, d > 0
        d = torch.where(fm, torch.rand_like(d) * self.fm_eps_max, d)
        if hasattr(torch, "clear_autocast_cache"):
            torch.clear_autocast_cache()
        prediction = self.reverse_fn(x_t, t * self.time_scale, *args_conditionals, d=2 * d * self.time_scale,
                                     **kwargs_conditionals)
        zero = torch.zeros((), device=t.device)
        fm_loss = sc_loss = zero
        if fm.any():
            fm_loss = self._total(self._weighted_losses(tree_map(lambda p: p[fm], prediction),
                                                        tree_map(lambda y: y[fm], self._generate_target(x0, x1))), "fm")[0]
        if sc.any():
            idx = sc.nonzero()[:, 0]
            args, kwargs = ((args_conditionals, kwargs_conditionals) if self.batch_mode else
                            (_slice_tensors(args_conditionals, idx), _slice_tensors(kwargs_conditionals, idx)))
            target = self.compute_self_consistency_target(tree_map(lambda a: a[idx], x_t), t[idx], d[idx],
                                                          *args, **kwargs)
            sc_loss = self._total(self._weighted_losses(tree_map(lambda p: p[idx], prediction), target), "sc")[0]
        total = fm_loss + self.shortcut_loss_weight * sc_loss
        return total, {"flow_matching_loss": fm_loss, "self_consistency_loss": sc_loss}
