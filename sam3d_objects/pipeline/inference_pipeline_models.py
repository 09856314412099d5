"""The pipeline's model containers: ``pipeline.models`` and ``pipeline.condition_embedders``.

Upstream keeps its seven models in a ``torch.nn.ModuleDict`` (``ss_generator``, ``slat_generator``,
``ss_encoder``, ``ss_decoder``, ``slat_decoder_gs``, ``slat_decoder_gs_4``, ``slat_decoder_mesh``; None where the
yaml names no model) and the two condition embedders in a dict. Research code indexes them, installs forward
hooks on them and changes their attributes, so both containers here always list all of upstream's keys.

``LazyModuleDict`` is a ``ModuleDict`` whose entries are built from their checkpoint on first access (``[key]``,
``.key``, ``get``, ``items``/``values``). Without low-memory mode the pipeline loads everything at construction,
so it behaves as upstream's plain ModuleDict. In low-memory mode the pipeline unloads a model after its stage;
the next access loads it again, and:

* forward / forward-pre / backward hooks (and state-dict hooks) installed on the model or any of its submodules
  are carried over to the reloaded model (the very same hook dictionaries, so ``handle.remove()`` still works),
  matched by submodule name;
* a model put in with ``models[key] = module`` (or loaded with ``pin``) is never unloaded;
* everything else done to the unloaded object is lost: changed weights, attributes set on it (the pipeline's
  own sampler settings, ``pipeline.ss_inference_steps`` and friends, are re-applied), wrapped ``forward``
  methods. Pin the model (``pipeline.models.pin(key)``) or use ``low_memory=False`` to keep such changes.

Module-level ``nn.Module`` operations (``parameters()``, ``state_dict()``, ``to()``, ``print``) see the loaded
entries only; ``loaded()`` lists them.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

# hook dictionaries of nn.Module that a reload carries over (attribute names of torch.nn.Module)
HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_call", "_forward_pre_hooks",
              "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
              "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")

Loader = Callable[[], torch.nn.Module]


def harvest_hooks(model: torch.nn.Module) -> Dict[str, Dict[str, object]]:
    """{submodule name: {hook dict attribute: the dict itself}} for every submodule that has hooks."""
    saved = {}
    for name, module in model.named_modules():
        hooks = {attr: getattr(module, attr) for attr in HOOK_DICTS if getattr(module, attr, None)}
        if hooks:
            hooks["_is_full_backward_hook"] = getattr(module, "_is_full_backward_hook", None)
            saved[name] = hooks
    return saved


def restore_hooks(model: torch.nn.Module, saved: Dict[str, Dict[str, object]]) -> List[str]:
    """Install harvested hook dicts on the same-named submodules of ``model``; returns the names not found."""
    modules = dict(model.named_modules())
    lost = []
    for name, hooks in saved.items():
        module = modules.get(name)
        if module is None:
            lost.append(name)
            continue
        for attr, value in hooks.items():
            if attr in HOOK_DICTS:
                setattr(module, attr, value)  # the same dict object: existing RemovableHandles keep working
            elif attr == "_is_full_backward_hook" and value is not None:
                module._is_full_backward_hook = value
    return lost


class LazyModuleDict(torch.nn.ModuleDict):
    """``ModuleDict`` with a fixed set of keys whose modules are built on first access (see module docstring).

    ``loaders``: key -> zero-argument callable building the module, or None for an absent model (the entry then
    reads None, as in upstream's ModuleDict). ``on_load(key, module)`` runs after each build (the pipeline's
    settings); ``on_unload(key, module)`` right before an unload.
    """

    def __init__(self, loaders: Dict[str, Optional[Loader]],
                 on_load: Optional[Callable[[str, torch.nn.Module], None]] = None,
                 on_unload: Optional[Callable[[str, torch.nn.Module], None]] = None):
        super().__init__()
        self._loaders: Dict[str, Optional[Loader]] = dict(loaders)
        self._pinned: set = set()
        self._saved_hooks: Dict[str, Dict[str, Dict[str, object]]] = {}
        self._on_load, self._on_unload = on_load, on_unload
        for key, loader in self._loaders.items():
            if loader is None:
                self._modules[key] = None  # upstream's ModuleDict holds None for a model the yaml does not name

    # ----------------------------------------------------------------------------------------------- loading
    def load(self, key: str) -> Optional[torch.nn.Module]:
        """The module ``key``, built now if it is not loaded (None for an absent model)."""
        if key in self._modules:
            return self._modules[key]
        if key not in self._loaders:
            raise KeyError(key)
        module = self._loaders[key]()
        if self._on_load is not None:
            self._on_load(key, module)
        saved = self._saved_hooks.pop(key, None)
        if saved:
            restore_hooks(module, saved)
        self._modules[key] = module
        return module

    def unload(self, key: str) -> bool:
        """Drop the loaded module ``key`` (kept when pinned or absent); its hooks wait for the next load.
        Returns whether it was unloaded."""
        module = self._modules.get(key)
        if module is None or key in self._pinned or self._loaders.get(key) is None:
            return False
        if self._on_unload is not None:
            self._on_unload(key, module)
        self._saved_hooks[key] = harvest_hooks(module)
        del self._modules[key]
        return True

    def pin(self, key: str) -> Optional[torch.nn.Module]:
        """Load ``key`` and keep it loaded (no unload after its stage); returns it."""
        module = self.load(key)
        self._pinned.add(key)
        return module

    def unpin(self, key: str) -> None:
        self._pinned.discard(key)

    def is_loaded(self, key: str) -> bool:
        return self._modules.get(key) is not None

    def loaded(self) -> Dict[str, torch.nn.Module]:
        """{key: module} of the entries loaded right now (absent models excluded)."""
        return {k: m for k, m in self._modules.items() if m is not None}

    def has_model(self, key: str) -> bool:
        """Whether the yaml names a model for ``key`` (or one was put in)."""
        return self._loaders.get(key) is not None or self._modules.get(key) is not None

    # ------------------------------------------------------------------------------------ mapping protocol
    def __getitem__(self, key: str) -> Optional[torch.nn.Module]:
        return self.load(key)

    def __setitem__(self, key: str, module: Optional[torch.nn.Module]) -> None:
        """A module put in by the caller replaces the checkpoint's and stays loaded."""
        if module is not None and not isinstance(module, torch.nn.Module):
            raise TypeError(f"models[{key!r}] must be a torch.nn.Module or None, got {type(module).__name__}")
        self._saved_hooks.pop(key, None)
        self._modules[key] = module  # not add_module: its attribute check would load the checkpoint's model
        self._loaders.setdefault(key, None)
        if module is not None:
            self._pinned.add(key)

    def __delitem__(self, key: str) -> None:
        self._pinned.discard(key)
        self.unload(key)

    def __getattr__(self, name: str):
        loaders = self.__dict__.get("_loaders")
        if loaders is not None and name in loaders and name not in self.__dict__["_modules"]:
            return self.load(name)
        return super().__getattr__(name)

    def __len__(self) -> int:
        return len(self._loaders)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._loaders))

    def __contains__(self, key) -> bool:
        return key in self._loaders

    def keys(self):
        return list(self._loaders)

    def items(self) -> List[Tuple[str, Optional[torch.nn.Module]]]:
        return [(k, self.load(k)) for k in self._loaders]

    def values(self) -> List[Optional[torch.nn.Module]]:
        return [self.load(k) for k in self._loaders]

    def get(self, key: str, default=None):
        return self.load(key) if key in self._loaders else default

    def pop(self, key: str) -> Optional[torch.nn.Module]:
        module = self.load(key)
        self._pinned.discard(key)
        self.unload(key)
        return module

    def extra_repr(self) -> str:
        idle = [k for k in self._loaders if k not in self._modules]
        return f"not loaded: {', '.join(idle)}" if idle else ""
