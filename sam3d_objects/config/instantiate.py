"""Safe hydra instantiation of the released yamls.

Every config goes through ``sam3d_objects.config.safety`` first: its interpolations are resolved (resolvers
refused), and every ``_target_`` must be one of the exact names the released configs use
(``safety.REGISTERED_TARGETS``), with parameters its callable takes and no safety switched off. A config naming
anything else (``os.system``, ``sam3d_objects.reconstruction.shutil.rmtree``, ``${oc.create:...}``) is refused with
``UnsafeConfigError`` before hydra imports or calls anything, so a downloaded yaml cannot run code. hydra then
builds exactly the tree that was checked.

torchvision is optional (its recent builds are CUDA builds that fail to load on CPU-only torch). When it does not
import, the ``torchvision.transforms.*`` targets are remapped, in a copy of the config, to the equivalent classes
of ``sam3d_objects.data.transforms`` before hydra resolves them: nothing is patched and ``sys.modules`` is not
edited (the stand-in module in ``patches/`` is for third-party code only).
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Iterable, Iterator, Tuple, Union

from omegaconf import DictConfig, ListConfig, OmegaConf

from sam3d_objects.config.safety import (  # noqa: F401  the transform names and probe are re-exported here
    OWN_TRANSFORMS, REGISTERED_TARGETS, TORCHVISION_TRANSFORMS, UnsafeConfigError, check_config_tree,
    load_checkpoint_yaml, resolved_copy, torchvision_imports, trusted_import)


def iter_targets(node: Any, path: str = "") -> Iterator[Tuple[str, str]]:
    """Yield (config path, _target_) for every node of a config tree."""
    if isinstance(node, (DictConfig, dict)):
        items = node.items_ex(resolve=False) if isinstance(node, DictConfig) else node.items()
        for key, value in items:
            if key == "_target_":
                yield path or "<root>", str(value)
            else:
                yield from iter_targets(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, (ListConfig, list, tuple)):
        for i, value in enumerate(node):
            yield from iter_targets(value, f"{path}[{i}]")


def check_targets(config: Any, allowed: Iterable[str] = REGISTERED_TARGETS) -> None:
    """UnsafeConfigError unless every target node of ``config`` (resolved first) is valid: exact target name in
    ``allowed``, hydra keys, parameters (``safety.check_node``)."""
    if not OmegaConf.is_config(config):
        config = OmegaConf.create(config)
    check_config_tree(resolved_copy(config), allowed)


def own_transform_target(target: str) -> str:
    """``torchvision.transforms.X`` -> our ``sam3d_objects.data.transforms.X``; a clear error for what we lack."""
    from sam3d_objects.data import transforms

    name = target[len(TORCHVISION_TRANSFORMS):]
    if name not in transforms.__all__:
        raise UnsafeConfigError(f"the config needs {target}, but torchvision does not import here and "
                                f"sam3d_objects only provides {', '.join(transforms.__all__)}; install a "
                                f"torchvision build matching your torch")
    return OWN_TRANSFORMS + name


def remap_torchvision_targets(config: Any) -> Any:
    """A copy of ``config`` whose ``torchvision.transforms.*`` targets name our own transforms (see module doc)."""
    config = copy.deepcopy(config)
    _remap(config)
    return config


def _remap(node: Any) -> None:
    if isinstance(node, DictConfig):
        target = node.get("_target_", None) if "_target_" in node else None
        if isinstance(target, str) and target.startswith(TORCHVISION_TRANSFORMS):
            node["_target_"] = own_transform_target(target)
        for key, value in node.items_ex(resolve=False):
            if key != "_target_":
                _remap(value)
    elif isinstance(node, ListConfig):
        for value in node:
            _remap(value)


def load_config(path: Union[str, Path]) -> DictConfig:
    """A checkpoint folder's yaml, loaded and checked under every rule of ``config.safety`` (its interpolations
    already resolved)."""
    return load_checkpoint_yaml(path)


def safe_instantiate(config: Any, *args: Any, allowed: Iterable[str] = REGISTERED_TARGETS, **kwargs: Any):
    """``hydra.utils.instantiate`` of ``config`` with every interpolation resolved and every target node checked
    (``check_targets``): hydra builds exactly the tree that was checked."""
    from hydra.utils import instantiate

    if not OmegaConf.is_config(config):
        config = OmegaConf.create(config)
    config = resolved_copy(config)
    check_config_tree(config, allowed)
    if any(t.startswith(TORCHVISION_TRANSFORMS) for _, t in iter_targets(config)) and not torchvision_imports():
        config = remap_torchvision_targets(config)
    return instantiate(config, *args, **kwargs)
