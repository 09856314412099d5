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


# ---- host mirrors of time tensors: the guidance-interval check reads a time's value on the host; reading it from
# a CUDA tensor would synchronise with the GPU once per step, so the generators attach the value they already know
HOST_VALUES = "_host_values"


def with_host_values(tensor: torch.Tensor, values: list) -> torch.Tensor:
    """`tensor` tagged with its flattened values as Python floats (exactly the tensor's own float32 values)."""
    setattr(tensor, HOST_VALUES, [float(v) for v in values])
    return tensor


def host_values(t: Any) -> list:
    """The flattened values of a time (tensor or number) as Python floats, without a device sync when tagged."""
    if isinstance(t, torch.Tensor):
        tagged = getattr(t, HOST_VALUES, None)
        return list(tagged) if tagged is not None else t.reshape(-1).tolist()
    return [float(t)]
