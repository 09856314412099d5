"""Tiny pytree helpers for latents that are tensors or (nested) dicts of tensors. Dict leaves are visited in
SORTED key order (as optree does), which fixes the order in which noise is drawn from the global RNG."""
from typing import Any, Callable

import torch


def is_shape(x: Any) -> bool:
    return isinstance(x, (tuple, list, torch.Size)) and all(isinstance(v, int) for v in x)


def tree_map(fn: Callable, tree: Any, *rest: Any) -> Any:
    """Apply fn leaf-wise over tensors / dicts; several trees must share the dict structure."""
    if isinstance(tree, dict):
        for other in rest:
            if not isinstance(other, dict) or set(other) != set(tree):
                raise ValueError(f"latent dicts differ: {sorted(tree)} vs "
                                 f"{sorted(other) if isinstance(other, dict) else type(other).__name__}")
        return {k: tree_map(fn, tree[k], *(o[k] for o in rest)) for k in sorted(tree)}
    return fn(tree, *rest)


def map_shapes(fn: Callable, shapes: Any) -> Any:
    """Apply fn to every shape of a shape tree (a shape, or dicts of shapes), dict keys in sorted order."""
    if is_shape(shapes):
        return fn(tuple(shapes))
    if isinstance(shapes, dict):
        return {k: map_shapes(fn, shapes[k]) for k in sorted(shapes)}
    raise TypeError(f"expected a shape tuple or a dict of shapes, got {type(shapes).__name__}: {shapes!r}")
