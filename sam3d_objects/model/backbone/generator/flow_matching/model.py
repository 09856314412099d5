"""Rectified-flow generator: Euler integration of the backbone's velocity from noise (t = 0) to data (t = 1)."""
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from ..tree import map_shapes, tree_map


def lognorm_sampler(batch_size: int, device=None, mean: float = 0.0, std: float = 1.0,
                    generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Training times t = sigmoid(N(mean, std^2)) (logit-normal)."""
    return torch.sigmoid(torch.randn(batch_size, device=device, generator=generator) * std + mean)


def uniform_sampler(batch_size: int, device=None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    return torch.rand(batch_size, device=device, generator=generator)


def rescale_times(t, rescale_t):
    """Warp t in [0, 1] towards 0 (more steps near the noise end): t / (1 + (r - 1) * (1 - t))."""
    if not rescale_t:
        return t
    return t / (1 + (rescale_t - 1) * (1 - t))


def draw_noise(x_shape: Any, device, dtype: torch.dtype = torch.float32) -> Any:
    """One torch.randn per shape from the global RNG, dict keys in sorted order."""
    return map_shapes(lambda shape: torch.randn(shape, device=device, dtype=dtype), x_shape)


def euler_step(x: Any, v: Any, dt) -> Any:
    return tree_map(lambda a, b: a + b * dt, x, v)


class FlowMatching(nn.Module):
    """`reverse_fn` maps (x, t * time_scale, *condition) to a velocity. Calling the module generates:
    `gen(x_shape, device, *condition_args, **condition_kwargs)` -> samples."""

    def __init__(self, reverse_fn: nn.Module, sigma_min: float = 0.0, inference_steps: int = 100,
                 time_scale: float = 1000.0, rescale_t: Optional[float] = None,
                 training_time_sampler_fn: Optional[Callable] = None, loss_weights: Optional[dict] = None,
                 batch_mode: bool = False, reversed_timestamp: bool = False):
        super().__init__()
        self.reverse_fn = reverse_fn
        self.sigma_min = sigma_min
        self.inference_steps = inference_steps
        self.time_scale = time_scale
        self.rescale_t = rescale_t
        self.training_time_sampler_fn = training_time_sampler_fn or uniform_sampler
        self.loss_weights = loss_weights
        self.batch_mode = batch_mode
        self.reversed_timestamp = reversed_timestamp

    def _check_steps(self) -> int:
        steps = int(self.inference_steps)
        if steps < 1:
            raise ValueError(f"inference_steps must be >= 1, got {self.inference_steps}")
        return steps

    def time_grid(self, device=None) -> torch.Tensor:
        """float32 times t_0 = 0 < ... < t_steps = 1 after the rescale warp."""
        t_seq = torch.linspace(0, 1, self._check_steps() + 1, device=device)
        return rescale_times(t_seq, self.rescale_t)

    # where the initial noise is drawn: None = on x_device with its generator (upstream); "cpu" = with the CPU
    # generator, then moved, so that a seed gives the same sample on every device (the pipeline sets it per call)
    noise_device: Optional[str] = None

    def generate_noise(self, x_shape: Any, x_device) -> Any:
        if self.noise_device is None:
            return draw_noise(x_shape, x_device)
        return tree_map(lambda x: x.to(x_device), draw_noise(x_shape, self.noise_device))

    def generate_iter(self, x_shape: Any, x_device, *args, **kwargs):
        """Yields (t, x) after every Euler step (starting with the noise at t = 0)."""
        x = self.generate_noise(x_shape, x_device)
        t_seq = self.time_grid(device=x_device)
        yield t_seq[0], x
        for t, t_next in zip(t_seq[:-1], t_seq[1:]):
            v = self.reverse_fn(x, t * self.time_scale, *args, **kwargs)
            x = euler_step(x, v, t_next - t)
            yield t_next, x

    @torch.no_grad()
    def generate(self, x_shape: Any, x_device, *args, **kwargs) -> Any:
        x = None
        for _, x in self.generate_iter(x_shape, x_device, *args, **kwargs):
            pass
        return x

    def forward(self, x_shape: Any, x_device, *args, **kwargs) -> Any:
        return self.generate(x_shape, x_device, *args, **kwargs)
