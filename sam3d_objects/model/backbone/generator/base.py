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

    @property
    def seed(self):
        raise AttributeError("Cannot read attribute 'seed'.")

    def __getattr__(self, name: str):
        # nn.Module turns a property's AttributeError into a generic "no attribute": keep upstream's message
        if name == "seed":
            raise AttributeError("Cannot read attribute 'seed'.")
        return super().__getattr__(name)

    @seed.setter
    def seed(self, value: int) -> None:
        self._random_generator = torch.Generator().manual_seed(int(value))

    @property
    def random_generator(self) -> torch.Generator:
        return self._random_generator

    @random_generator.setter
    def random_generator(self, value: torch.Generator) -> None:
        self._random_generator = value

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
