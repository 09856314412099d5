"""Weights by name: ``--checkpoints facebook/sam-3d-objects`` / ``Inference.from_pretrained(repo_id)``.

A Hugging Face repo id is resolved with ``huggingface_hub.snapshot_download`` into the standard cache
(``~/.cache/huggingface/hub``, ``$HF_HOME`` / ``$HF_HUB_CACHE``), downloading only what the pipeline needs: first
the yaml files, then the checkpoint files that ``pipeline.yaml`` names. ``revision`` pins a branch, tag or commit;
``HF_TOKEN`` (or ``hf auth login``) authenticates; ``HF_HUB_OFFLINE=1`` uses the cache only. huggingface_hub reads
those variables itself.

The downloaded folder is treated like any other checkpoint folder the user points at: its ``pipeline.yaml`` goes
through the same checks and the same safe loader (``validation.check_checkpoint_folder``,
``config.instantiate``); this module only reads the yaml as data to list the files to fetch.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, List, Optional

OFFICIAL_REPO = "facebook/sam-3d-objects"
LICENCE_PAGE = f"https://huggingface.co/{OFFICIAL_REPO}"
PIPELINE_FILE = "pipeline.yaml"
# a repo id: "name" is not accepted (too easily a mistyped folder); "org/name" with the Hub's characters
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class HubError(RuntimeError):
    """The weights could not be fetched: the message is one line naming the fix."""


def looks_like_repo_id(spec: str) -> bool:
    """``org/name`` that is not an existing local path (a local folder always wins)."""
    spec = str(spec)
    return bool(_REPO_ID.match(spec)) and not spec.endswith((".yaml", ".yml")) and not Path(spec).expanduser().exists()


def _hub():
    try:
        import huggingface_hub
    except ImportError as e:
        raise HubError("weights by name need huggingface_hub: `make extras EXTRAS=hub` in the clone (or pip install "
                       "huggingface_hub), or download the folder yourself and pass --checkpoints DIR") from e
    return huggingface_hub


def _offline() -> bool:
    _hub()
    import huggingface_hub.constants as constants
    return bool(getattr(constants, "HF_HUB_OFFLINE", False))


def _errors():
    _hub()
    import huggingface_hub.errors as errors  # since 0.23 (the hub extra's minimum)
    return errors


def _access_hint(repo_id: str) -> str:
    licence = LICENCE_PAGE if repo_id == OFFICIAL_REPO else f"https://huggingface.co/{repo_id}"
    return (f"accept the licence on {licence} with your Hugging Face account, then `hf auth login` (or set "
            f"HF_TOKEN) and try again")


def _snapshot(repo_id: str, patterns: List[str], revision: Optional[str], cache_dir: Optional[str],
              token: Optional[str], local_files_only: bool) -> Path:
    """``snapshot_download`` of ``patterns``, its failures turned into one-line HubErrors."""
    hub = _hub()
    errors = _errors()
    where = f"{repo_id}" + (f" (revision {revision})" if revision else "")
    # offline (HF_HUB_OFFLINE=1): the cache only, also for a commit revision, which would otherwise list the tree
    local_files_only = local_files_only or _offline()
    try:
        folder = hub.snapshot_download(repo_id=repo_id, revision=revision, allow_patterns=patterns,
                                       cache_dir=cache_dir, token=token, local_files_only=local_files_only)
    except errors.GatedRepoError as e:
        raise HubError(f"{where} is gated and this account has no access yet: {_access_hint(repo_id)}") from e
    except errors.RevisionNotFoundError as e:
        raise HubError(f"{where}: no such revision (give a branch, tag or commit of the repo)") from e
    except errors.RepositoryNotFoundError as e:
        raise HubError(f"{where}: no such Hugging Face repo, or it is private or gated and this machine is not "
                       f"logged in: {_access_hint(repo_id)}. A local folder must exist (--checkpoints DIR)") from e
    except errors.LocalEntryNotFoundError as e:
        raise HubError(f"{where} is not in the Hugging Face cache and cannot be downloaded now (offline: "
                       f"HF_HUB_OFFLINE=1, or no connection). Run once online to fill the cache") from e
    except errors.HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            raise HubError(f"{where}: access refused (HTTP {status}): {_access_hint(repo_id)}") from e
        raise HubError(f"{where}: download failed ({type(e).__name__}: {str(e).splitlines()[0]})") from e
    except OSError as e:  # disk full, cache not writable; offline (OfflineModeIsEnabled is a ConnectionError)
        if type(e).__name__ == "OfflineModeIsEnabled":
            raise HubError(f"{where} is not in the Hugging Face cache and HF_HUB_OFFLINE=1 forbids the download: "
                           f"run once online to fill the cache") from e
        raise HubError(f"{where}: cannot write the Hugging Face cache ({e}); set HF_HUB_CACHE to a writable "
                       f"folder") from e
    return Path(folder)


def _find_pipeline_yaml(folder: Path) -> Path:
    """The shallowest ``pipeline.yaml`` of a snapshot (the release keeps its files under ``checkpoints/``)."""
    found = sorted(folder.rglob(PIPELINE_FILE), key=lambda p: (len(p.relative_to(folder).parts), str(p)))
    if not found:
        raise HubError(f"{folder}: the repo holds no {PIPELINE_FILE}: it is not a SAM 3D Objects checkpoint repo")
    return found[0]


def referenced_files(pipeline_yaml: Path) -> List[str]:
    """Relative paths of the files ``pipeline.yaml`` names (``*_config_path`` / ``*_ckpt_path`` keys, any depth),
    read as plain data: nothing is instantiated here."""
    import yaml

    from sam3d_objects.config.safety import UnsafeConfigError, check_yaml_text
    try:
        text = Path(pipeline_yaml).read_text(encoding="utf-8")
        check_yaml_text(text, str(pipeline_yaml))  # size / alias-expansion caps before walking it
        data = yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, UnsafeConfigError) as e:
        raise HubError(f"{pipeline_yaml}: cannot read it as yaml ({e})") from e

    def walk(node) -> Iterable[str]:
        if isinstance(node, dict):
            for key, value in node.items():
                if isinstance(key, str) and key.endswith(("_ckpt_path", "_config_path")) and isinstance(value, str):
                    yield value
                else:
                    yield from walk(value)
        elif isinstance(node, list):
            for value in node:
                yield from walk(value)
    names = []
    for value in walk(data):
        if value and not Path(value).is_absolute() and ".." not in Path(value).parts and value not in names:
            names.append(value)
    return names


def download_checkpoint(repo_id: str, revision: Optional[str] = None, cache_dir: Optional[str] = None,
                        token: Optional[str] = None, local_files_only: bool = False) -> Path:
    """Fetch (or find in the cache) what the pipeline of ``repo_id`` needs; returns the snapshot's pipeline.yaml.

    Only yaml files and the checkpoint files named by pipeline.yaml are downloaded. Everything in the folder is
    untrusted: callers load it through the checkpoint checks and the safe config loader, as any user folder."""
    yamls = _snapshot(repo_id, ["*.yaml", "*.yml"], revision, cache_dir, token, local_files_only)
    pipeline_yaml = _find_pipeline_yaml(yamls)
    prefix = pipeline_yaml.parent.relative_to(yamls).as_posix()
    needed = [f"{prefix}/{name}" if prefix != "." else name for name in referenced_files(pipeline_yaml)]
    folder = _snapshot(repo_id, needed, revision, cache_dir, token, local_files_only) if needed else yamls
    result = folder / pipeline_yaml.relative_to(yamls)
    missing = [n for n in needed if not (folder / n).is_file()]
    if missing:
        offline = local_files_only or _offline()
        raise HubError(f"{repo_id}: {', '.join(missing[:3])} not in the Hugging Face cache"
                       + (" (offline mode: run once without HF_HUB_OFFLINE=1 to fetch them)" if offline else
                          " nor in the repo"))
    return result
