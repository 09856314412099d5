"""Where the package finds its checkout and keeps its generated tiny checkpoint (no torch import: the CLI's
``--help`` stays fast). Used by the CLI, the demo, the app, the self-check and the benchmarks."""
from __future__ import annotations

from pathlib import Path
from typing import Optional


def repo_root() -> Optional[Path]:
    """The source checkout holding this package (None when installed elsewhere)."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "setup.py").is_file() else None


def default_tiny_dir() -> Path:
    """Where the generated tiny checkpoint lives: ``checkpoints/tiny_random`` of the checkout, else a user cache."""
    root = repo_root()
    if root is not None:
        return root / "checkpoints" / "tiny_random"
    return Path.home() / ".cache" / "sam3d-objects" / "tiny_random"
