"""Upstream's generator base class: a module that owns a random generator and turns an iterative sampler
(`generate_iter`) into a one-shot `generate` / `forward`."""
from typing import Any, Iterator, Optional, Union

import torch
import torch.nn as nn


class Base(nn.Module):
    def __init__(self, seed_or_generator: Optional[Union[int, torch.Generator]] = None):
        super().__init__()
        if isinstance(seed_or_generator, torch.Generator):
            self.random_generator = seed_or_generator
        elif isinstance(seed_or_generator, int) and not isinstance(seed_or_generator, bool):
            self.seed = seed_or_generator
        elif seed_or_generator is None:
            self.random_generator = torch.default_generator
        else:
            raise RuntimeError(f"cannot use argument of type {type(seed_or_generator)} to set random generator")

    # Upstream declares `seed` / `random_generator` as properties whose setters take `value` / `generator`.
    # One accessor function serves as both getter (called with the instance only) and setter (called with the
    # new value), so the public signature is upstream's and reading/writing behave as upstream's properties.
    def _seed_accessor(self, value: Optional[int] = None) -> None:
        if value is None:  # read: seed is write-only upstream
            raise AttributeError("Cannot read attribute 'seed'.")
        self._random_generator = torch.Generator().manual_seed(int(value))

    seed = property(_seed_accessor, _seed_accessor, doc="write-only: assigning an int reseeds a new CPU generator")

    def __getattr__(self, name: str):
        # nn.Module turns a property's AttributeError into a generic "no attribute": keep upstream's message
        if name == "seed":
            raise AttributeError("Cannot read attribute 'seed'.")
        return super().__getattr__(name)

    def _random_generator_accessor(self, generator: Optional[torch.Generator] = None) -> Optional[torch.Generator]:
        if generator is None:  # read
            return self._random_generator
        self._random_generator = generator
        return None

    random_generator = property(_random_generator_accessor, _random_generator_accessor,
                                doc="the torch.Generator used for sampling noise (read/write)")

    def forward(self, x_shape: Any, x_device: Any, *args_conditionals: Any, **kwargs_conditionals: Any) -> Any:
        return self.generate(x_shape, x_device, *args_conditionals, **kwargs_conditionals)

    def generate(self, x_shape: Any, x_device: Any, *args_conditionals: Any, **kwargs_conditionals: Any) -> Any:
        """The last x_t of generate_iter's (t, x_t, extra) items."""
        x_t = None
        for item in self.generate_iter(x_shape, x_device, *args_conditionals, **kwargs_conditionals):
            x_t = item[1]
        return x_t

    def generate_iter(self, x_shape: Any, x_device: Any, *args_conditionals: Any,
                      **kwargs_conditionals: Any) -> Iterator:
        raise NotImplementedError(f"{type(self).__name__} must implement generate_iter (abstract base method)")

    def loss(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement loss (abstract base method)")
