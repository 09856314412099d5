"""``torch.hub.load("facebookresearch/dinov2", ...)`` without a download: served by a local hub folder.

Why: SAM 3D's condition embedders build their DINOv2 backbone with ``torch.hub.load`` from GitHub, then load every
backbone weight from the generator checkpoint. On a machine that is offline (or a CI box), the download fails
before the checkpoint is read. When the repository is not already in torch.hub's cache, the call is answered by
``patches/hub/dinov2/hubconf.py`` (``source="local"``), which builds the same architecture (the hub's module and
parameter names, the caller's size overrides) from this project's DINOv2 code, without pretrained weights. A cached
hub repository is used as it is (the real code), and so is every other repository.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

LOCAL_REPOS = {"facebookresearch/dinov2": Path(__file__).resolve().parent / "hub" / "dinov2"}
_STATE: dict = {}


def local_folder(repo_or_dir: str):
    """The local hub folder standing in for a GitHub ``owner/name[:ref]``, or None (cached, or not served)."""
    repo, _, ref = str(repo_or_dir).partition(":")
    if repo not in LOCAL_REPOS:
        return None
    cached = Path(torch.hub.get_dir()) / f"{repo.replace('/', '_')}_{ref or 'main'}"
    return None if cached.is_dir() else LOCAL_REPOS[repo]


def _wrap(original):
    @functools.wraps(original)
    def load(repo_or_dir, model, *args, source: str = "github", **kwargs):
        folder = local_folder(repo_or_dir) if source == "github" else None
        if folder is not None:
            _STATE["served"] = _STATE.get("served", 0) + 1
            kwargs.pop("force_reload", None), kwargs.pop("skip_validation", None), kwargs.pop("trust_repo", None)
            return original(str(folder), model, *args, source="local", **kwargs)
        return original(repo_or_dir, model, *args, source=source, **kwargs)
    load.__sam3d_hub_shim__ = True
    return load


def install() -> str:
    """Wrap the current ``torch.hub.load`` (again, if something wrapped it since: the stand-in must be the outermost
    wrapper to turn a GitHub call into a local one). Returns "shim"."""
    current = torch.hub.load
    if getattr(current, "__sam3d_hub_shim__", False):
        return "shim"
    _STATE.setdefault("originals", []).append(current)
    torch.hub.load = _wrap(current)
    return "shim"


def uninstall() -> None:
    originals = _STATE.pop("originals", [])
    if originals:
        torch.hub.load = originals[0]
    _STATE.pop("served", None)


def served() -> int:
    """How many hub calls the local folders answered."""
    return _STATE.get("served", 0)
