"""Upstream's checkpoint helpers: load a (Lightning) checkpoint into an existing module, prefix-rewriting state-dict
functions, latest-checkpoint lookup, suffix-matching key renaming. Files are read with ``weights_only=True``
(tensors and plain containers only), unlike upstream, so a downloaded checkpoint cannot run code."""
from __future__ import annotations

import glob
import logging
import os
import re
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Optional, Sequence, Union

import torch

logger = logging.getLogger(__name__)

StateDict = Dict[str, Any]


def _get_child(obj: Any, *keys: Any) -> Any:
    for key in keys:
        obj = obj[key]
    return obj


def _set_child(obj: Any, value: Any, *keys: Any) -> Any:
    """obj with obj[k0]...[kn] = value (the value itself when there are no keys)."""
    if not keys:
        return value
    _get_child(obj, *keys[:-1])[keys[-1]] = value
    return obj


def _load_file(path: Union[str, Path], device: Any = None) -> Any:
    if str(path).endswith(".safetensors"):
        from safetensors.torch import load_file
        return load_file(str(path), device=str(device) if device is not None else "cpu")
    return torch.load(path, map_location=device, weights_only=True)


def _common_prefix_length(a: str, b: str) -> int:
    # upstream's count: when one string is a prefix of the other it returns min(len) - 1 (kept: it decides matches)
    count = 0
    for count in range(min(len(a), len(b))):
        if a[count] != b[count]:
            break
    return count


def rename_checkpoint_weights_using_suffix_matching(checkpoint_path_in: Union[str, Path],
                                                     checkpoint_path_out: Union[str, Path], model: torch.nn.Module,
                                                     strict: bool = True, keys: Sequence[Any] = ()) -> None:
    """Rewrite the state dict at `keys` inside the checkpoint so its names are the model's, pairing names by the
    longest common suffix (one merge sweep over the suffix-sorted name lists); saved to `checkpoint_path_out`."""
    model_names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    content = _load_file(checkpoint_path_in)
    state = _get_child(content, *keys)
    model_rev = sorted(n[::-1] for n in model_names)
    state_rev = sorted(n[::-1] for n in state)
    if strict and len(model_rev) != len(state_rev):
        raise RuntimeError("model and state do not have the same number of parameters (use strict=False to match "
                           "a subset)")
    mapping, i, j, last = {}, 0, 0, 0
    while i < len(model_rev):
        n = _common_prefix_length(model_rev[i], state_rev[j]) if j < len(state_rev) else 0
        if n >= last:
            last = n
            j += 1
        else:
            last = 0
            mapping[model_rev[i][::-1]] = state_rev[j - 1][::-1]
            i += 1
        if j > len(state_rev):
            break
    if i < len(model_rev):
        raise RuntimeError("could not suffix match parameter names")
    for model_name, state_name in mapping.items():
        logger.debug("%s <- %s", model_name, state_name)
    new_state = {m: state[s] for m, s in mapping.items()}
    torch.save(_set_child(content, new_state, *keys), checkpoint_path_out)


def remove_prefix_state_dict_fn(prefix: str) -> Callable[[StateDict], StateDict]:
    def fn(state_dict: StateDict) -> StateDict:
        return {(k[len(prefix):] if k.startswith(prefix) else k): v for k, v in state_dict.items()}
    return fn


def add_prefix_state_dict_fn(prefix: str) -> Callable[[StateDict], StateDict]:
    def fn(state_dict: StateDict) -> StateDict:
        return {prefix + k: v for k, v in state_dict.items()}
    return fn


def filter_and_remove_prefix_state_dict_fn(prefix: str) -> Callable[[StateDict], StateDict]:
    def fn(state_dict: StateDict) -> StateDict:
        return {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
    return fn


def get_last_checkpoint(path: Union[str, Path]) -> str:
    """The `epoch=E-step=S.ckpt` file of `path` with the highest (epoch, step)."""
    found = []
    for full in glob.glob(os.path.join(str(path), "epoch=*-step=*.ckpt")):
        m = re.match(r"epoch=(\d+)-step=(\d+).ckpt", os.path.basename(full))
        if m:
            found.append((int(m.group(1)), int(m.group(2)), full))
    if not found:
        raise RuntimeError(f"no checkpoint has been found at path : {path}")
    return sorted(found)[-1][2]


def load_sharded_checkpoint(path: Union[str, Path], device: Any) -> Dict[str, Any]:
    """A Lightning distributed (directory) checkpoint consolidated into one dict; CPU only, needs `lightning`."""
    if str(device) != "cpu":
        raise RuntimeError(f"loading a sharded checkpoint on device {device!r} is unavailable: use device='cpu'")
    try:
        from lightning.pytorch.utilities.consolidate_checkpoint import _format_checkpoint, _load_distributed_checkpoint
    except ImportError as e:
        raise ImportError("sharded (directory) checkpoints need lightning: pip install lightning") from e
    return _format_checkpoint(_load_distributed_checkpoint(Path(path)))


def _state_dict_keys(state_dict_key: Any) -> tuple:
    if state_dict_key is None:
        return ()
    if isinstance(state_dict_key, str):
        return (state_dict_key,)
    return tuple(state_dict_key)


def load_model_from_checkpoint(model: torch.nn.Module, checkpoint_path: Union[str, Path], strict: bool = True,
                               device: Any = None, freeze: bool = False, eval: bool = False,
                               map_name: Optional[Dict[str, str]] = None, remove_name: Optional[Iterable[str]] = None,
                               state_dict_key: Any = "state_dict",
                               state_dict_fn: Optional[Callable[[StateDict], StateDict]] = None) -> torch.nn.Module:
    """Load `checkpoint_path` (a file, or a sharded directory on CPU) into `model`: pick the state dict at
    `state_dict_key`, delete `remove_name` keys, rename `map_name` keys, apply `state_dict_fn`, load, move to
    `device`, optionally freeze (implies eval) / eval. Returns the model."""
    logger.info("Loading checkpoint from %s", checkpoint_path)
    if os.path.isfile(checkpoint_path):
        checkpoint = _load_file(checkpoint_path, device)
    elif os.path.isdir(checkpoint_path):
        checkpoint = load_sharded_checkpoint(checkpoint_path, device=device)
    else:
        raise FileNotFoundError(checkpoint_path)
    if any(c.__name__ == "LightningModule" for c in type(model).__mro__):  # lightning itself is optional
        model.on_load_checkpoint(checkpoint)
    state_dict = _get_child(checkpoint, *_state_dict_keys(state_dict_key))
    for name in remove_name or ():
        del state_dict[name]
    for src, dst in (map_name or {}).items():
        if src in state_dict:
            state_dict[dst] = state_dict.pop(src)
    if state_dict_fn is not None:
        state_dict = state_dict_fn(state_dict)
    model.load_state_dict(state_dict, strict=strict)
    if device is not None:
        model = model.to(device)
    if freeze:
        for p in model.parameters():
            p.requires_grad = False
        eval = True
    if eval:
        model.eval()
    return model
