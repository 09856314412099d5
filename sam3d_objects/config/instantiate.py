"""Safe hydra instantiation of the released yamls.

Only ``_target_`` paths under an allow-list may be instantiated: ``sam3d_objects.*`` (this package),
``torchvision.transforms.*`` (the preprocessing transforms of ``pipeline.yaml``; served by
``patches/torchvision_shim.py`` when torchvision does not import) and ``moge.*`` (the depth model). A config
naming anything else (``os.system``, ``builtins.eval``, any other package) is refused with ``UnsafeConfigError``
before hydra imports or calls anything, so a downloaded yaml cannot run arbitrary code.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Iterator, Tuple, Union

from omegaconf import DictConfig, ListConfig, OmegaConf

ALLOWED_TARGET_PREFIXES: Tuple[str, ...] = ("sam3d_objects.", "torchvision.transforms.", "moge.")


class UnsafeConfigError(ValueError):
    pass


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


def check_targets(config: Any, allowed: Iterable[str] = ALLOWED_TARGET_PREFIXES) -> None:
    allowed = tuple(allowed)
    bad = [(p, t) for p, t in iter_targets(config) if not t.startswith(allowed)]
    if bad:
        listing = ", ".join(f"{p}: {t}" for p, t in bad[:10])
        raise UnsafeConfigError(f"refusing to instantiate config targets outside the allow-list "
                                f"{list(allowed)}: {listing}. Edit the yaml (or pass allowed=... explicitly if you "
                                f"trust it).")


def load_config(path: Union[str, Path]) -> DictConfig:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} not found")
    config = OmegaConf.load(path)
    if not isinstance(config, DictConfig):
        raise ValueError(f"{path} is not a mapping config")
    return config


def safe_instantiate(config: Any, *args: Any, allowed: Iterable[str] = ALLOWED_TARGET_PREFIXES, **kwargs: Any):
    """``hydra.utils.instantiate`` after checking every ``_target_`` against the allow-list."""
    from hydra.utils import instantiate

    import sam3d_objects.data  # noqa: F401  registers the torchvision placeholder if torchvision does not import
    if not OmegaConf.is_config(config):
        config = OmegaConf.create(config)
    check_targets(config, allowed)
    return instantiate(config, *args, **kwargs)
