"""``sam3d-objects segment``: object masks from SAM 3 (text or box prompt), written as ``<index>.png``.

The masks folder is what ``sam3d-objects reconstruct --mask DIR`` reads. SAM 3 is optional (``make extras
EXTRAS=sam3``); it is CUDA-era code and runs here unmodified through ``patches.apply()``.
"""
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


def build_processor(checkpoint: Optional[str] = None, bpe: Optional[str] = None,
                    confidence_threshold: float = 0.5, device: Optional[str] = None):
    """SAM 3's image model and processor; random weights without ``checkpoint`` (plumbing checks only)."""
    require_sam3()
    import patches

    patches.apply(device=device)
    import backends
    from sam3.model.sam3_image_processor import Sam3Processor
    from sam3.model_builder import build_sam3_image_model

    if checkpoint is not None and not Path(checkpoint).is_file():
        raise SegmentError(f"SAM 3 checkpoint {checkpoint} does not exist")
    target = device or str(backends.device.default_device())
    model = build_sam3_image_model(bpe_path=str(find_bpe_vocabulary(bpe)), checkpoint_path=checkpoint,
                                   load_from_HF=False, device=target)
    if checkpoint is None:
        fill_uninitialised_parameters(model)
    return Sam3Processor(model, device=target, confidence_threshold=confidence_threshold)


def segment(image_path: str, out_dir: str, text: Optional[str] = None, box: Optional[str] = None,
            checkpoint: Optional[str] = None, bpe: Optional[str] = None, confidence_threshold: float = 0.5,
            max_masks: Optional[int] = None, device: Optional[str] = None) -> List[Path]:
    """Masks for ``text`` or ``box`` on the image, by decreasing score, as ``out_dir/<index>.png`` (0/255)."""
    import numpy as np
    from PIL import Image

    if (text is None) == (box is None):
        raise SegmentError("give exactly one of --text and --box")
    corners = parse_box(box) if box is not None else None
    if not Path(image_path).is_file():
        raise SegmentError(f"image {image_path} does not exist")
    image = Image.open(image_path).convert("RGB")
    processor = build_processor(checkpoint, bpe, confidence_threshold, device)
    state = processor.set_image(image)
    if text is not None:
        state = processor.set_text_prompt(prompt=text, state=state)
    else:
        state = processor.add_geometric_prompt(box=box_to_sam3(corners, *image.size), label=True, state=state)
    order = state["scores"].argsort(descending=True).tolist()[:max_masks]
    masks = state["masks"][:, 0].cpu().numpy()
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for index, k in enumerate(order):
        path = folder / f"{index}.png"
        Image.fromarray(masks[k].astype(np.uint8) * 255).save(path)
        written.append(path)
    return written


def add_parser(sub):
    """Register ``segment`` on the CLI's subparsers."""
    seg = sub.add_parser("segment", help="image + text or box prompt -> object masks (SAM 3) for reconstruct",
                         description="Segment IMAGE with SAM 3 and write <index>.png masks (by decreasing score) "
                                     "that `reconstruct --mask DIR` reads. Needs `make extras EXTRAS=sam3`.")
    seg.add_argument("image", help="RGB image (png/jpg)")
    prompt = seg.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--text", help='what to segment, e.g. "chair"')
    prompt.add_argument("--box", help="x0,y0,x1,y1 in pixels around the object")
    seg.add_argument("--out", required=True, help="folder for the <index>.png masks")
    seg.add_argument("--checkpoint", default=None, help="SAM 3 checkpoint file (default: random weights, plumbing "
                                                         "checks only)")
    seg.add_argument("--bpe", default=None, help=f"path to {BPE_NAME} (default: found in sam3 / open_clip)")
    seg.add_argument("--threshold", type=float, default=0.5, help="confidence threshold (default 0.5)")
    seg.add_argument("--max-masks", type=int, default=None, help="keep at most this many masks")
    seg.add_argument("--device", default=None, help="cpu, cuda or mps (default: cuda if available, else cpu)")
    return seg


def run_cli(args) -> int:
    """``sam3d-objects segment``: errors the user can fix become the CLI's input errors."""
    from sam3d_objects.cli import EXIT_OK, UserError

    try:
        if args.checkpoint is None:
            print("NOTE: no --checkpoint: SAM 3 runs with random weights (plumbing check): the masks are noise.")
        written = segment(args.image, args.out, text=args.text, box=args.box, checkpoint=args.checkpoint,
                          bpe=args.bpe, confidence_threshold=args.threshold, max_masks=args.max_masks,
                          device=args.device)
    except SegmentError as error:
        raise UserError(str(error)) from error
    print(f"{len(written)} mask(s) written to {args.out}" + ("" if written else
          f" (none above --threshold {args.threshold})"))
    return EXIT_OK
