"""Small helpers referenced by the released configs (``_target_: sam3d_objects.config.utils.make_dict``) and
upstream's config utilities: dotted-path lookup, partial application from a config, tiny builders."""
from __future__ import annotations

import functools
import importlib
from typing import Any, Callable, Dict, List, Union

from omegaconf import DictConfig, ListConfig, OmegaConf

TargetType = Union[str, type, Callable[..., Any]]
ClassOrCallableType = Union[type, Callable[..., Any]]


def dump_config(config: Any, path: str = "./config.yaml") -> None:
    """Write `config` as YAML with sorted keys."""
    with open(path, "w") as f:
        f.write(OmegaConf.to_yaml(config, sort_keys=True))


def _import_longest_prefix(path: str, parts: List[str]):
    """Import the longest module prefix of `parts` (never the full path); returns (module, number of parts used)."""
    error = None
    for n in range(len(parts) - 1, 0, -1):
        try:
            return importlib.import_module(".".join(parts[:n])), n
        except Exception as e:  # noqa: BLE001 - any import failure means "try a shorter prefix"
            error = e
    raise ImportError(f"Error loading module '{path}'") from error


def locate(path: str) -> Any:
    """The object at dotted `path` (module prefix imported, the rest looked up as attributes / submodules)."""
    if path == "":
        raise ImportError("Empty path")
    parts = [p for p in path.split(".") if p]
    obj, n = _import_longest_prefix(path, parts)
    module_name = ".".join(parts[:n])
    for part in parts[n:]:
        module_name = f"{module_name}.{part}"
        if not hasattr(obj, part):
            try:
                importlib.import_module(module_name)
            except Exception as e:  # noqa: BLE001
                raise ImportError(f"Encountered error: `{e}` when loading module '{path}'") from e
        obj = getattr(obj, part)
    return obj


def full_class_name(klass: type) -> str:
    module = klass.__module__
    return klass.__qualname__ if module == "builtins" else f"{module}.{klass.__qualname__}"


def full_instance_name(instance: Any) -> str:
    return full_class_name(type(instance))


def ensure_is_subclass(child_class: type, parent_class: type) -> None:
    if not issubclass(child_class, parent_class):
        raise RuntimeError(f"class {full_class_name(child_class)} should be a subclass of "
                           f"{full_class_name(parent_class)}")


def find_class_or_callable_from_target(target: TargetType) -> ClassOrCallableType:
    """`target` itself, or the object its dotted path names; it must be a class or a callable."""
    obj = locate(target) if isinstance(target, str) else target
    if not (isinstance(obj, type) or callable(obj)):
        raise ValueError(f"Invalid type ({type(obj)}) found for {target}")
    return obj


def find_and_ensure_is_subclass(target: TargetType, type_: type) -> type:
    klass = find_class_or_callable_from_target(target)
    ensure_is_subclass(klass, type_)
    return klass


class StrictPartial:
    """A partial of the callable named by `path`; `path` is positional-only so a kwarg named "path" passes through."""

    def __init__(self, path: TargetType, /, *args: Any, **kwargs: Any):
        self._partial = functools.partial(find_class_or_callable_from_target(path), *args, **kwargs)

    @property
    def partial(self) -> functools.partial:
        return self._partial

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._partial(*args, **kwargs)


class Partial(StrictPartial):
    """StrictPartial whose `path` may also be given by keyword."""

    def __init__(self, path: TargetType, *args: Any, **kwargs: Any):
        super().__init__(path, *args, **kwargs)


class RecursivePartial:
    """A deferred, repeatable instantiation of `config`, whose nested ``_rpartial_target_`` keys become
    ``_target_`` (so the inner nodes are not instantiated when the outer config is)."""

    def __init__(self, config: Any):
        self.config = RecursivePartial.replace_keys(config, {"_rpartial_target_": "_target_"})

    @staticmethod
    def replace_keys(config: Any, key_mapping: Dict[str, str]) -> Any:
        if isinstance(config, (DictConfig, dict)):
            items = config.items_ex(resolve=False) if isinstance(config, DictConfig) else config.items()
            return DictConfig({key_mapping.get(k, k): RecursivePartial.replace_keys(v, key_mapping) for k, v in items})
        if isinstance(config, (ListConfig, list, tuple)):
            return ListConfig([RecursivePartial.replace_keys(v, key_mapping) for v in config])
        if config is None or isinstance(config, (bool, str, int, float)):
            return config
        raise RuntimeError(f"unknow type found : {type(config)}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # instantiated through the allow-list (a config cannot name arbitrary callables)
        from .instantiate import safe_instantiate
        return safe_instantiate(self.config)


def subkey(mapping: Any, key: Any) -> Any:
    return mapping[key]


def get_item(data: Any, key: Any) -> Any:
    return data[key]


def get_attr(data: Any, key: str) -> Any:
    return getattr(data, key)


def make_set(*args: Any) -> set:
    return set(args)


def make_tuple(*args: Any) -> tuple:
    return tuple(args)


def make_dict(**kwargs: Any) -> Dict[str, Any]:
    """Build a plain dict from the node's keys (hydra would otherwise pass a DictConfig)."""
    return dict(kwargs)


def make_string(value: Any) -> str:
    return str(value)


def make_list_from_kwargs(**kwargs: Any) -> list:
    """The keyword values in order, None values dropped."""
    return [v for v in kwargs.values() if v is not None]
