"""Low-discrepancy sequences (upstream's ``tdfy_dit.utils.random_utils``): radical inverse, Halton and Hammersley
points, and Hammersley camera directions on the sphere (used by ``render_utils.render_multiview``)."""
from __future__ import annotations

import math
from typing import List, Sequence

import numpy as np

__all__ = ["PRIMES", "radical_inverse", "halton_sequence", "hammersley_sequence", "sphere_hammersley_sequence"]

PRIMES = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53]


def radical_inverse(base: int, n: int):
    """Digits of ``n`` in ``base`` mirrored about the radix point (van der Corput): 0 for n = 0."""
    value, scale = 0, 1.0 / base
    while n > 0:
        n, digit = divmod(n, base)
        value += digit * scale
        scale /= base
    return value


def halton_sequence(dim: int, n: int) -> List[float]:
    """The ``n``-th Halton point in ``dim`` (<= 16) dimensions."""
    return [radical_inverse(PRIMES[d], n) for d in range(dim)]


def hammersley_sequence(dim: int, n: int, num_samples: int) -> List[float]:
    """The ``n``-th of ``num_samples`` Hammersley points: n / num_samples then a (dim - 1)-D Halton point."""
    return [n / num_samples] + halton_sequence(dim - 1, n)


def sphere_hammersley_sequence(n: int, num_samples: int, offset: Sequence[float] = (0, 0),
                               remap: bool = False) -> List[float]:
    """[yaw, pitch] in radians of the ``n``-th of ``num_samples`` directions spread evenly over the sphere
    (pitch -pi/2 for n = 0). ``remap`` packs more samples into the upper hemisphere."""
    u, v = hammersley_sequence(2, n, num_samples)
    u += offset[0] / num_samples
    v += offset[1]
    if remap:
        u = 2 * u if u < 0.25 else 2 / 3 * u + 1 / 3
    theta = np.arccos(1 - 2 * u) - np.pi / 2
    phi = v * 2 * math.pi
    return [phi, theta]
