"""What every SAM 3 front end (``segment``, ``segment_folder``, ``segment_video``) shares: the error carrying the
fix, the install check, the BPE vocabulary lookup, the box conversion and the fill of parameters a random-weight
model leaves uninitialised. A module below them all, so that none imports another for it (``segment``
re-exports these names)."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import List, Optional, Sequence

BPE_NAME = "bpe_simple_vocab_16e6.txt.gz"
INSTALL_HINT = "make extras EXTRAS=sam3"


class SegmentError(RuntimeError):
    """A segmentation request that cannot run, with the fix in its message."""


def _package_dir(name: str) -> Optional[Path]:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def find_bpe_vocabulary(explicit: Optional[str] = None) -> Path:
    """CLIP's BPE vocabulary, which SAM 3's tokenizer needs and its wheel does not ship: ``explicit``, else SAM 3's
    own ``assets`` folder (source checkouts), else the copy shipped by open-clip-torch (part of the extra)."""
    candidates = [Path(explicit)] if explicit else []
    for package, sub in (("sam3", Path("..") / "assets"), ("open_clip", Path("."))):
        folder = _package_dir(package)
        if folder is not None:
            candidates.append((folder / sub / BPE_NAME).resolve())
    for path in candidates:
        if path.is_file():
            return path
    raise SegmentError(f"SAM 3's BPE vocabulary {BPE_NAME} was not found (looked at: "
                       f"{', '.join(map(str, candidates)) or 'nothing'}); `{INSTALL_HINT}` installs open-clip-torch, "
                       f"which ships it, or pass --bpe PATH")


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules, or a broken parent package
        return False


def require_sam3() -> None:
    missing = [n for n in ("sam3", "timm", "einops", "ftfy", "regex", "iopath", "pycocotools", "psutil")
               if not _installed(n)]
    if missing:
        raise SegmentError(f"`segment` needs SAM 3 and its dependencies (missing: {', '.join(missing)}): "
                           f"`{INSTALL_HINT}`")


def parse_box(text: str) -> List[float]:
    """``x0,y0,x1,y1`` in pixels."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) != 4 or values[2] <= values[0] or values[3] <= values[1]:
        raise SegmentError(f"--box must be x0,y0,x1,y1 in pixels with x1 > x0 and y1 > y0, got {text!r}")
    return values


def box_to_sam3(box: Sequence[float], width: int, height: int) -> List[float]:
    """Pixel corners -> SAM 3's normalised (centre x, centre y, width, height)."""
    x0, y0, x1, y1 = box
    return [(x0 + x1) / 2 / width, (y0 + y1) / 2 / height, (x1 - x0) / width, (y1 - y0) / height]


def fill_uninitialised_parameters(model, limit: float = 1e3, std: float = 0.02) -> List[str]:
    """Give small random values to parameters left as ``torch.empty`` garbage (non-finite or above ``limit``).

    SAM 3 fills some parameters (the text encoder's projection and positional embedding) only from a checkpoint;
    with random weights they hold uninitialised memory and every output becomes NaN. Returns the names filled."""
    import torch

    filled = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.is_floating_point() and not (torch.isfinite(param).all() and param.abs().max() <= limit):
                param.normal_(0.0, std)
                filled.append(name)
    return filled
