"""A Hugging Face hub cache laid out as huggingface_hub lays it out, built from a local checkpoint folder, so the
real loading code (``snapshot_download`` in offline mode, our checks, the safe loader) runs without a network:

    <cache>/models--<org>--<name>/blobs/<sha256>
    <cache>/models--<org>--<name>/snapshots/<commit>/<subdir>/<file> -> ../../blobs/<sha256> (relative symlink)
    <cache>/models--<org>--<name>/refs/<branch or tag>          (the commit hash, no newline)
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Dict, Optional, Sequence


def repo_folder(cache: Path, repo_id: str) -> Path:
    return Path(cache) / ("models--" + repo_id.replace("/", "--"))


def add_snapshot(cache: Path, repo_id: str, source: Path, ref: str = "main", commit: Optional[str] = None,
                 subdir: str = "checkpoints", skip: Sequence[str] = (), extra: Optional[Dict[str, bytes]] = None,
                 symlinks: bool = True) -> Path:
    """Put every file of ``source`` (minus ``skip``) plus ``extra`` {relative path: bytes} into a snapshot of
    ``repo_id`` under ``subdir``; point ``refs/<ref>`` at it. Returns the snapshot folder."""
    repo = repo_folder(cache, repo_id)
    commit = commit or hashlib.sha1(f"{repo_id}:{ref}:{source}".encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    files = {f"{subdir}/{f.name}" if subdir else f.name: f.read_bytes()
             for f in sorted(Path(source).iterdir()) if f.is_file() and f.name not in skip}
    files.update(extra or {})
    for rel, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        target = snapshot / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if symlinks:
            os.symlink(os.path.relpath(blob, target.parent), target)
        else:
            shutil.copyfile(blob, target)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot
