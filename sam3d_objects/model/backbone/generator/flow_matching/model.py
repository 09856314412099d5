"""Rectified-flow generator: ODE integration (Euler by default) of the backbone's velocity from noise (t = 0) to
data (t = 1); training loss and a likelihood estimate for research use."""
import math
from functools import partial
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from ..base import Base
from ..tree import map_shapes, tree_map, with_host_values
from .solver import SDE, Euler, Midpoint, ODESolver, RungeKutta4, gradient

uniform_sampler = torch.rand


def _standard_normal_logit(mean: float, std: float, batch_size: Optional[int], device: Any,
                           generator: Optional[torch.Generator], kwargs: dict) -> torch.Tensor:
    if batch_size is not None:
        kwargs = {"size": (batch_size,), **kwargs}
    return torch.randn(**kwargs, device=device, generator=generator) * std + mean


def lognorm_sampler(batch_size: Optional[int] = None, device: Any = None, mean: float = 0.0, std: float = 1.0,
                    generator: Optional[torch.Generator] = None, **kwargs: Any) -> torch.Tensor:
    """Training times t = sigmoid(N(mean, std^2)) (logit-normal, SD3). Upstream's call form is
    ``lognorm_sampler(mean=, std=, size=(B,), generator=)``; ``batch_size`` is this project's shorthand."""
    return torch.sigmoid(_standard_normal_logit(mean, std, batch_size, device, generator, kwargs))


def rev_lognorm_sampler(batch_size: Optional[int] = None, device: Any = None, mean: float = 0.0, std: float = 1.0,
                        generator: Optional[torch.Generator] = None, **kwargs: Any) -> torch.Tensor:
    """1 - lognorm_sampler (kept by upstream for old configs)."""
    return 1 - torch.sigmoid(_standard_normal_logit(mean, std, batch_size, device, generator, kwargs))


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


def right_broadcast(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """t of shape (B,) viewed as (B, 1, ..., 1) against x."""
    return t.reshape(t.shape + (1,) * (x.dim() - t.dim()))


def _first_leaf(tree: Any) -> torch.Tensor:
    while isinstance(tree, dict):
        tree = tree[sorted(tree)[0]]
    return tree


def _per_leaf(value: Any, like: Any) -> Any:
    """A scalar / callable broadcast to every leaf of `like`, or a dict matched key by key."""
    if isinstance(like, dict):
        return {k: _per_leaf(value[k] if isinstance(value, dict) else value, like[k]) for k in sorted(like)}
    return value


def _flat_leaves(tree: Any) -> list:
    if isinstance(tree, dict):
        return [leaf for k in sorted(tree) for leaf in _flat_leaves(tree[k])]
    return [tree]


class FlowMatching(Base):
    """`reverse_fn` maps (x, t * time_scale, *condition) to a velocity. Calling the module generates:
    `gen(x_shape, device, *condition_args, **condition_kwargs)` -> samples."""

    SOLVER_METHODS = {"euler": Euler, "midpoint": Midpoint, "rk4": RungeKutta4, "sde": SDE}

    def __init__(self, reverse_fn: torch.nn.Module, sigma_min: float = 0.0, inference_steps: int = 100,
                 time_scale: float = 1000.0,
                 training_time_sampler_fn: Optional[Callable] = partial(lognorm_sampler, mean=0, std=1),
                 reversed_timestamp: bool = False, rescale_t: Optional[float] = 1.0,
                 loss_fn: Any = partial(F.mse_loss, reduction="mean"), loss_weights: Any = 1.0,
                 solver_method: Union[str, ODESolver] = "euler", solver_kwargs: dict = {},  # noqa: B006 (read only)
                 batch_mode: bool = False, **kwargs: Any):
        super().__init__(**kwargs)
        self.reverse_fn = reverse_fn
        self.sigma_min = sigma_min
        self.inference_steps = inference_steps
        self.time_scale = time_scale
        self.rescale_t = rescale_t
        self.training_time_sampler_fn = training_time_sampler_fn or partial(lognorm_sampler, mean=0, std=1)
        self.loss_fn = loss_fn
        self.loss_weights = 1.0 if loss_weights is None else loss_weights
        self.batch_mode = batch_mode
        self.reversed_timestamp = reversed_timestamp
        self._solver_method, self._solver = self._get_solver(solver_method, solver_kwargs or {})

    def _get_solver(self, solver_method: Union[str, ODESolver], solver_kwargs: dict):
        # upstream loses a solver instance (stores its name); we keep the instance, the evident intent
        if isinstance(solver_method, ODESolver):
            return f"custom[{type(solver_method).__name__}]", solver_method
        if solver_method in self.SOLVER_METHODS:
            return solver_method, self.SOLVER_METHODS[solver_method](**solver_kwargs)
        raise ValueError(f"unknown solver_method {solver_method!r}: use one of {sorted(self.SOLVER_METHODS)} "
                         f"or an ODESolver instance")

    def _check_steps(self, steps: Optional[int] = None) -> int:
        steps = int(self.inference_steps if steps is None else steps)
        if steps < 1:
            raise ValueError(f"inference_steps must be >= 1, got {steps}")
        return steps

    def _prepare_t(self, steps: Optional[int] = None) -> torch.Tensor:
        t_seq = rescale_times(torch.linspace(0, 1, self._check_steps(steps) + 1), self.rescale_t)
        return 1 - t_seq if self.reversed_timestamp else t_seq

    def time_grid(self, device=None) -> torch.Tensor:
        """float32 times t_0 = 0 < ... < t_steps = 1 after the rescale warp (and reversal)."""
        return self._prepare_t().to(device)

    def _generate_noise_tensor(self, x_shape: Sequence[int], x_device: Any) -> torch.Tensor:
        """One standard-normal float32 tensor from ``noise_generator`` (on its device, then moved to x_device),
        else from the global RNG of x_device (or of ``noise_device``, then moved to x_device)."""
        if self.noise_generator is not None:
            rng = self.noise_generator
            return torch.randn(tuple(x_shape), device=rng.device, dtype=torch.float32, generator=rng).to(x_device)
        if self.noise_device is None:
            return torch.randn(tuple(x_shape), device=x_device, dtype=torch.float32)
        return torch.randn(tuple(x_shape), device=self.noise_device, dtype=torch.float32).to(x_device)

    def _generate_noise(self, x_shape: Any, device: Any) -> Any:
        """Noise for a shape or a dict of shapes (one draw per shape, keys in sorted order)."""
        return map_shapes(lambda shape: self._generate_noise_tensor(shape, device), x_shape)

    # where the initial noise is drawn: None = on x_device with its generator (upstream); "cpu" = with the CPU
    # generator, then moved, so that a seed gives the same sample on every device (the pipeline sets it per call)
    noise_device: Optional[str] = None
    # the generator the initial noise is drawn with (the pipeline sets a seeded one per run); None = the global RNG
    # of the device above. Upstream draws from the global RNG only (its seeded run seeds that); a generator seeded
    # alike gives the same numbers without touching the global state
    noise_generator: Optional[torch.Generator] = None

    def generate_noise(self, x_shape: Any, x_device) -> Any:
        return self._generate_noise(x_shape, x_device)

    def _tagged_times(self, x_device) -> list:
        """The time grid as 0-d tensors on x_device (views of one transfer), each tagged with its host value."""
        host = self.time_grid(device="cpu")
        on_device = host.to(x_device)
        return [with_host_values(on_device[i], [host[i].item()]) for i in range(host.shape[0])]

    def _scaled_time(self, t: torch.Tensor) -> torch.Tensor:
        scaled = t * self.time_scale
        known = getattr(t, "_host_values", None) if isinstance(t, torch.Tensor) else None
        if known is not None:  # the same float32 product on the host, so the guidance check needs no sync
            with_host_values(scaled, (torch.tensor(known, dtype=t.dtype) * self.time_scale).tolist())
        return scaled

    def _generate_dynamics(self, x_t: Any, t: torch.Tensor, *args_conditionals: Any,
                           **kwargs_conditionals: Any) -> Any:
        return self.reverse_fn(x_t, self._scaled_time(t), *args_conditionals, **kwargs_conditionals)

    def generate_iter(self, x_shape: Any, x_device, *args_conditionals: Any, **kwargs_conditionals: Any):
        """Yields (t, x_t, ()) after every solver step; t is the step's start time in [0, 1]."""
        x = self._generate_noise(x_shape, x_device)
        t_seq = self._tagged_times(x_device)
        for x, t in self._solver.solve_iter(self._generate_dynamics, x, t_seq, *args_conditionals,
                                            **kwargs_conditionals):
            yield t, x, ()

    @torch.no_grad()
    def generate(self, x_shape: Any, x_device, *args_conditionals: Any, **kwargs_conditionals: Any) -> Any:
        return super().generate(x_shape, x_device, *args_conditionals, **kwargs_conditionals)

    # ---- training
    def _generate_t(self, x1: Any) -> torch.Tensor:
        """Training times [B] from ``training_time_sampler_fn`` (B = batch of the first leaf of x1)."""
        leaf = _first_leaf(x1)
        t = self.training_time_sampler_fn(size=(leaf.shape[0],), generator=self.random_generator)
        return t.to(leaf.device)

    def _generate_x0_tensor(self, x1: torch.Tensor) -> torch.Tensor:
        return self._generate_noise_tensor(x1.shape, x1.device)

    def _generate_x0(self, x1: Any) -> Any:
        """Noise shaped like every leaf of x1."""
        return tree_map(self._generate_x0_tensor, x1)

    def _generate_xt_tensor(self, x0: torch.Tensor, x1: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """x_t = (1 - (1 - sigma_min) t) x0 + t x1."""
        tb = right_broadcast(t.to(x1.device), x1)
        return (1 - (1 - self.sigma_min) * tb) * x0 + tb * x1

    def _generate_xt(self, x0: Any, x1: Any, t: torch.Tensor) -> Any:
        return tree_map(lambda a, b: self._generate_xt_tensor(a, b, t), x0, x1)

    def _generate_target_tensor(self, x0: torch.Tensor, x1: torch.Tensor) -> torch.Tensor:
        """The velocity target x1 - (1 - sigma_min) x0."""
        return x1 - (1 - self.sigma_min) * x0

    def _generate_target(self, x0: Any, x1: Any) -> Any:
        return tree_map(self._generate_target_tensor, x0, x1)

    def _weighted_losses(self, prediction: Any, target: Any) -> Any:
        fns, weights = _per_leaf(self.loss_fn, target), _per_leaf(self.loss_weights, target)
        return tree_map(lambda p, y, fn, w: w * fn(p, y), prediction, target, fns, weights)

    def _total(self, losses: Any, name: str) -> tuple:
        total = sum(_flat_leaves(losses))
        detail = {name: total}
        if isinstance(losses, dict):
            detail.update(losses)
        return total, detail

    def loss(self, x1: Any, *args_conditionals: Any, **kwargs_conditionals: Any) -> tuple:
        """Flow-matching loss: (sum over leaves of weight * loss_fn(v_pred, x1 - (1 - sigma_min) x0), detail)."""
        t = self._generate_t(x1)
        x0 = self._generate_x0(x1)
        prediction = self.reverse_fn(self._generate_xt(x0, x1, t), t * self.time_scale, *args_conditionals,
                                     **kwargs_conditionals)
        return self._total(self._weighted_losses(prediction, self._generate_target(x0, x1)), "flow_matching_loss")

    # ---- likelihood
    def _tree_flatten(self, tree: Any) -> torch.Tensor:
        """Every leaf flattened per batch element and concatenated: [B, total features] (sorted dict keys)."""
        return torch.cat([leaf.flatten(start_dim=1) for leaf in _flat_leaves(tree)], dim=1)

    def _log_p0(self, x0: Any) -> torch.Tensor:
        """Standard-normal log density of the noise end, per batch element."""
        flat = self._tree_flatten(x0)
        return -(flat ** 2).sum(dim=1) / 2 - math.log(2 * math.pi) / 2 * flat.shape[1]

    def _compute_hutchinson_divergence(self, velocity: Any, x_t: Any, z_samples: int) -> torch.Tensor:
        """Hutchinson estimate of div_x v per batch element: mean over ``z_samples`` Rademacher vectors z of
        z^T (dv/dx) z (z drawn as the signs of normal samples, scaled by 1/sqrt(z_samples) and summed)."""
        flat_v = self._tree_flatten(velocity)
        z = (torch.randn(flat_v.shape + (z_samples,), dtype=flat_v.dtype, device=flat_v.device) < 0) * 2.0 - 1.0
        z = z / math.sqrt(z_samples)
        v_dot_z = torch.einsum("bd,bdk->bk", flat_v, z)
        grads = [self._tree_flatten(gradient(v_dot_z[:, k], x_t, create_graph=z_samples > 1))
                 for k in range(z_samples)]
        return torch.einsum("bdk,bdk->b", torch.stack(grads, dim=-1), z)

    def _log_likelihood_dynamics(self, state: dict, t: Any, device: Any, z_samples: int, *args_conditionals: Any,
                                 **kwargs_conditionals: Any) -> dict:
        """d/dt of {"x": the sample, "log_p": its log density} along the flow (data -> noise)."""
        t_net = torch.tensor([float(t) * self.time_scale], device=device, dtype=torch.float32)
        with torch.enable_grad():
            x_t = tree_map(lambda a: a.detach().requires_grad_(True), state["x"])
            velocity = self.reverse_fn(x_t, t_net, *args_conditionals, **kwargs_conditionals)
            div = self._compute_hutchinson_divergence(velocity, x_t, z_samples)
        return {"x": tree_map(lambda a: a.detach(), velocity), "log_p": div.detach()}

    def log_likelihood(self, x1: Any, solver: Optional[Union[str, ODESolver]] = None, steps: Optional[int] = None,
                       z_samples: int = 1, *args_conditionals: Any, **kwargs_conditionals: Any) -> torch.Tensor:
        """log p(x1) per batch element: integrate data -> noise with a Hutchinson divergence estimate, plus the
        standard-normal log density of the reached noise."""
        solver = self._solver if solver is None else self._get_solver(solver, {})[1]
        times = 1 - self._prepare_t(steps)
        leaf = _first_leaf(x1)
        state = {"x": x1, "log_p": torch.zeros(leaf.shape[0], device=leaf.device)}

        def dynamics(s: dict, t: torch.Tensor) -> dict:
            return self._log_likelihood_dynamics(s, t, leaf.device, z_samples, *args_conditionals,
                                                 **kwargs_conditionals)

        final = solver.solve(dynamics, state, times)
        return final["log_p"] + self._log_p0(final["x"])

    def forward(self, x_shape: Any, x_device, *args_conditionals: Any, **kwargs_conditionals: Any) -> Any:
        return self.generate(x_shape, x_device, *args_conditionals, **kwargs_conditionals)


def _override(x: Any, noise_override: Any) -> Any:
    if noise_override is None:
        return x
    if isinstance(x, dict):
        return {**x, **noise_override}
    return noise_override


class ConditionalFlowMatching(FlowMatching):
    """FlowMatching whose generate_iter takes `noise_override`: those latent components are held fixed (set in the
    initial noise and re-applied after every step), e.g. to condition on a known pose."""

    def generate_iter(self, x_shape: Any, x_device, *args_conditionals: Any, **kwargs_conditionals: Any):
        noise_override = kwargs_conditionals.pop("noise_override", None)
        x = _override(self._generate_noise(x_shape, x_device), noise_override)
        t_seq = self._tagged_times(x_device)
        for t0, t1 in zip(t_seq[:-1], t_seq[1:]):
            x = _override(self._solver.step(self._generate_dynamics, x, t0, t1 - t0, *args_conditionals,
                                            **kwargs_conditionals), noise_override)
            yield t0, x, ()
