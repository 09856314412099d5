"""Upstream's ``sam3d_objects.data.utils``: nested-structure (pytree) helpers, batch extractors and tensor stats.

Built on ``torch.utils._pytree`` (upstream also uses optree; the behaviour needed here is the same)."""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch
import torch.utils._pytree as pytree

__all__ = ["ChildPathType", "ArgsType", "KwargsType", "ArgsKwargsType", "MappingType", "tree_transpose_level_one",
           "tree_tensor_map", "to_device", "expand_right", "expand_as_right", "as_keys", "get_child", "set_child",
           "build_args_batch_extractor", "build_kwargs_batch_extractor", "empty_mapping", "kwargs_identity_mapping",
           "build_batch_extractor", "right_broadcasting", "get_stats", "print_stats", "tree_reduce_unique"]

ChildPathType = Union[None, Iterable[Any], Any]  # None = root, iterable = path of keys, other = one key
ArgsType = Iterable[ChildPathType]
KwargsType = Mapping[str, ChildPathType]
ArgsKwargsType = Tuple[ArgsType, KwargsType]
MappingType = Union[None, ArgsKwargsType, ArgsType, KwargsType]

empty_mapping = object()  # sentinel: the model takes no input from the batch
kwargs_identity_mapping = object()  # sentinel: the batch (a dict) is the model's keyword arguments


def _children(structure: Any):
    if isinstance(structure, Mapping):
        return list(structure.values()), lambda vals: type(structure)(zip(structure.keys(), vals))
    if isinstance(structure, tuple) and hasattr(structure, "_fields"):
        return list(structure), lambda vals: type(structure)(*vals)
    if isinstance(structure, (list, tuple)):
        return list(structure), lambda vals: type(structure)(vals)
    raise TypeError(f"tree_transpose_level_one needs a list, tuple or dict, got {type(structure).__name__}")


def tree_transpose_level_one(structure: Any, check_children: bool = False, map_fn: Optional[Callable] = None,
                             is_leaf: Optional[Callable] = None) -> Any:
    """Swap the first two levels of a nested structure (e.g. a list of dicts -> a dict of lists); ``map_fn`` is
    applied to every regrouped outer container. None counts as a leaf."""
    children, rebuild_outer = _children(structure)
    if not children:
        return structure
    leaf = (lambda x: x is None or (is_leaf is not None and is_leaf(x)))
    flat = [pytree.tree_flatten(c, is_leaf=leaf) for c in children]
    inner_spec = flat[0][1]
    if check_children:
        for _, spec in flat[1:]:
            assert spec == inner_spec, f"children differ in structure: {spec} != {inner_spec}"
    groups = []
    for j in range(len(flat[0][0])):
        group = rebuild_outer([leaves[j] for leaves, _ in flat])
        groups.append(map_fn(group) if map_fn is not None else group)
    return pytree.tree_unflatten(groups, inner_spec)


def tree_tensor_map(fn: Callable, tree: Any, *rest: Any) -> Any:
    """Map ``fn`` over the tensor leaves of ``tree`` (and the matching leaves of ``rest``); None stays None."""
    leaves, spec = pytree.tree_flatten(tree)
    others = [pytree.tree_flatten(r)[0] for r in rest]
    out = [fn(x, *(o[i] for o in others)) if isinstance(x, torch.Tensor) else x for i, x in enumerate(leaves)]
    return pytree.tree_unflatten(out, spec)


def to_device(obj: Any, device: Union[str, torch.device]) -> Any:
    """Every tensor of a nested list / tuple / dict moved to ``device`` (other leaves kept)."""
    return tree_tensor_map(lambda t: t.to(device), obj)


def expand_right(tensor: torch.Tensor, target_shape: Sequence[int]) -> torch.Tensor:
    """Add trailing singleton dims up to ``len(target_shape)`` and expand only those new dims (a view)."""
    extra = len(target_shape) - tensor.dim()
    view = tensor.reshape(*tensor.shape, *([1] * extra))
    return view.expand(*tensor.shape, *target_shape[tensor.dim():])


def expand_as_right(tensor: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return expand_right(tensor, target.shape)


def as_keys(path: ChildPathType) -> tuple:
    if path is None:
        return ()
    if isinstance(path, Iterable) and not isinstance(path, str):
        return tuple(path)
    return (path,)


def get_child(obj: Any, *keys: Any) -> Any:
    for key in keys:
        obj = obj[key]
    return obj


def set_child(obj: Any, value: Any, *keys: Any) -> Any:
    """Set ``obj[k1]...[kn] = value`` and return the replaced child; with no keys return ``value`` (the root
    cannot be replaced in place)."""
    if not keys:
        return value
    parent = get_child(obj, *keys[:-1])
    old = parent[keys[-1]]
    parent[keys[-1]] = value
    return old


def build_args_batch_extractor(args_mapping: ArgsType) -> Callable:
    paths = [as_keys(p) for p in args_mapping]
    return lambda batch: tuple(get_child(batch, *p) for p in paths)


def build_kwargs_batch_extractor(kwargs_mapping: KwargsType) -> Callable:
    paths = {name: as_keys(p) for name, p in kwargs_mapping.items()}
    return lambda batch: {name: get_child(batch, *p) for name, p in paths.items()}


def build_batch_extractor(mapping: MappingType) -> Callable:
    """batch -> (args, kwargs) for a model call, from a mapping of batch paths (see the module docstring)."""
    if mapping is None:
        return lambda batch: ((batch,), {})
    if mapping is empty_mapping:
        return lambda batch: ((), {})
    if mapping is kwargs_identity_mapping:
        return lambda batch: ((), batch)
    if isinstance(mapping, Sequence) and not isinstance(mapping, str):
        if len(mapping) == 2 and isinstance(mapping[0], Sequence) and isinstance(mapping[1], dict):
            args, kwargs = build_args_batch_extractor(mapping[0]), build_kwargs_batch_extractor(mapping[1])
            return lambda batch: (args(batch), kwargs(batch))
        args = build_args_batch_extractor(mapping)
        return lambda batch: (args(batch), {})
    if isinstance(mapping, Mapping):
        kwargs = build_kwargs_batch_extractor(mapping)
        return lambda batch: ((), kwargs(batch))
    path = as_keys(mapping)
    return lambda batch: ((get_child(batch, *path),), {})


def right_broadcasting(arr: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return arr.reshape(*arr.shape, *([1] * (target.dim() - arr.dim())))


def get_stats(tensor: torch.Tensor) -> Dict[str, Any]:
    as_float = tensor.float()
    return {"shape": tuple(tensor.shape), "min": tensor.min().item(), "max": tensor.max().item(),
            "median": tensor.median().item(), "mean": as_float.mean().item(), "std": as_float.std().item()}


def print_stats(tensor: torch.Tensor, label: Optional[str] = None) -> None:
    """Print the stats of ``tensor`` under ``label`` (default: the source text of the caller's argument)."""
    if label is None:
        label = _caller_argument_text() or "{label}"
    print(f"{label}:")
    for key, value in get_stats(tensor).items():
        print(f"- {key}: {value}")


def _caller_argument_text() -> Optional[str]:
    import ast
    import inspect
    try:
        frame = inspect.stack()[2]
        call = next(n for n in ast.walk(ast.parse(frame.code_context[0].strip())) if isinstance(n, ast.Call))
        return ast.unparse(call.args[0])
    except Exception:  # noqa: BLE001  a label is cosmetic
        return None


def tree_reduce_unique(fn: Callable, tree: Any, ensure_unique: bool = True, **kwargs: Any) -> Any:
    """``fn`` of the first leaf; with ``ensure_unique`` every leaf must give the same value (e.g. one dtype)."""
    leaves, _ = pytree.tree_flatten(tree, **kwargs)
    values = [fn(x) for x in leaves]
    if ensure_unique:
        for v in values[1:]:
            if v != values[0]:
                raise RuntimeError(f"different values found, {values[0]} and {v} should be the same")
    return values[0]
