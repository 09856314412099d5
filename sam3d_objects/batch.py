"""``sam3d-objects batch IMAGES --out DIR``: reconstruct every photo of a folder, resumably.

    sam3d-objects batch photos/ --out results/ [--masks DIR | --masks auto | --text PROMPT] [reconstruct options]

Each image ``photos/<stem>.<ext>`` becomes ``results/<stem>/`` (the layout of ``reconstruct``: the files of one
object, or ``object_<i>/`` per object plus ``scene.ply``). Masks, per image:

* ``--masks DIR`` (default: the sibling folder ``<images>_masks/`` when it exists): ``DIR/<stem>.png`` (one
  object) or ``DIR/<stem>/`` holding ``0.png, 1.png, ...``;
* ``--masks auto``: automatic foreground (``sam3d_objects.foreground``: the alpha channel, else the object against
  the border's colours);
* ``--text PROMPT``: SAM 3 (the ``segment`` path), its masks kept in ``results/.masks/<stem>/``.

The models are loaded once. An image whose ``results/<stem>/summary.json`` records a complete run is skipped, so an
interrupted batch continues where it stopped when the same command is run again. One image failing (an empty mask,
no foreground, ...) is recorded and the batch goes on. Progress: one line per image with the elapsed time and an
ETA from the images processed so far; the end prints one table and writes ``results/batch_summary.json``.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from sam3d_objects import errors
from sam3d_objects.pipeline.run_options import DEFAULT_SEED

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")
SUMMARY = "batch_summary.json"


def list_images(folder: Path) -> List[Path]:
    """The images of ``folder`` (not recursive), sorted by name."""
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES
                  and not p.name.startswith("."))


def default_mask_dir(images: Path) -> Optional[Path]:
    """``<images>_masks`` beside the images folder, when it exists."""
    sibling = images.with_name(images.name + "_masks")
    return sibling if sibling.is_dir() else None


def mask_paths(mask_dir: Path, image: Path) -> List[str]:
    """``DIR/<stem>/`` (a folder of <index>.png) or ``DIR/<stem>.png``; [] when the image has none."""
    folder = mask_dir / image.stem
    if folder.is_dir():
        return [str(folder)]
    for suffix in (".png", ".PNG"):
        if (mask_dir / f"{image.stem}{suffix}").is_file():
            return [str(mask_dir / f"{image.stem}{suffix}")]
    return []


def is_finished(folder: Path) -> bool:
    """A complete earlier run: summary.json with objects, no failure, and every file it lists present."""
    try:
        summary = json.loads((folder / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    objects = summary.get("objects") or []
    return bool(objects) and not summary.get("failed") and all(
        Path(f).is_file() for obj in objects for f in obj.get("files", []))


def format_table(rows: Sequence[Dict[str, Any]]) -> str:
    """One line per image: name, objects, seconds, status."""
    width = max([len("image")] + [len(r["image"]) for r in rows])
    lines = [f"{'image':<{width}}  objects  seconds  status"]
    for r in rows:
        seconds = f"{r['seconds']:7.1f}" if r.get("seconds") is not None else "      -"
        objects = str(r.get("objects", "-")) if r.get("objects") is not None else "-"
        lines.append(f"{r['image']:<{width}}  {objects:>7}  {seconds}  {r['status']}")
    done = sum(r["status"] == "done" for r in rows)
    skipped = sum(r["status"] == "skipped (finished earlier)" for r in rows)
    failed = sum(r["status"].startswith("failed") for r in rows)
    lines.append(f"{len(rows)} image(s): {done} reconstructed, {skipped} skipped, {failed} failed")
    return "\n".join(lines)


def _fmt_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else \
        f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class MaskSource:
    """Where each image's masks come from (folder, automatic, or SAM 3 text)."""

    def __init__(self, mode: str, mask_dir: Optional[Path] = None, text: Optional[str] = None,
                 sam3_checkpoint: Optional[str] = None, cache: Optional[Path] = None, device: Optional[str] = None):
        self.mode, self.mask_dir, self.text = mode, mask_dir, text
        self.sam3_checkpoint, self.cache, self.device = sam3_checkpoint, cache, device

    def describe(self) -> str:
        return {"folder": f"masks from {self.mask_dir}", "auto": "automatic foreground masks",
                "text": f"SAM 3 masks for the text prompt {self.text!r}"}[self.mode]

    def masks(self, image_path: Path, image: np.ndarray) -> List[Tuple[str, np.ndarray]]:
        from sam3d_objects import reconstruction
        if self.mode == "auto":
            return reconstruction.auto_masks(image)
        if self.mode == "folder":
            paths = mask_paths(self.mask_dir, image_path)
            if not paths:
                raise errors.UserError(f"no mask for {image_path.name}: expected {self.mask_dir / image_path.stem}.png "
                                    f"or {self.mask_dir / image_path.stem}/0.png")
            return reconstruction.read_masks(paths, image.shape[:2])
        return self._sam3(image_path, image)

    def _sam3(self, image_path: Path, image: np.ndarray) -> List[Tuple[str, np.ndarray]]:
        from sam3d_objects import reconstruction, segment
        folder = self.cache / image_path.stem
        if not (folder / "0.png").is_file():  # resumable: masks of an earlier run are reused
            try:
                written = segment.segment(str(image_path), str(folder), text=self.text,
                                          checkpoint=self.sam3_checkpoint, device=self.device)
            except segment.SegmentError as e:
                raise errors.UserError(str(e)) from e
            if not written:
                raise errors.UserError(f"SAM 3 found no {self.text!r} in {image_path.name}")
        return reconstruction.read_masks([str(folder)], image.shape[:2])


def run_batch(images_dir: Path, out_dir: Path, masks: MaskSource, config: Path, pointmap: Optional[str] = None,
              device: Optional[str] = None, low_memory: Optional[bool] = None, random_weights: bool = False,
              progress: bool = True, log: Callable[[str], None] = print,
              **reconstruct_options) -> List[Dict[str, Any]]:
    """Reconstruct every image; returns the table rows (also written to ``out_dir/batch_summary.json``)."""
    from sam3d_objects import reconstruction

    images = list_images(images_dir)
    if not images:
        raise errors.UserError(f"{images_dir}: no images ({', '.join(IMAGE_SUFFIXES)})")
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: List[Dict[str, Any]] = []
    todo = [p for p in images if not is_finished(out_dir / p.stem)]
    log(f"batch: {len(images)} image(s) in {images_dir}, {len(images) - len(todo)} finished earlier, "
        f"{masks.describe()}")
    inference = None
    durations: List[float] = []
    start = time.perf_counter()
    try:
        for image_path in images:
            folder = out_dir / image_path.stem
            if image_path not in todo:
                rows.append({"image": image_path.name, "objects": None, "seconds": None,
                             "status": "skipped (finished earlier)", "folder": str(folder)})
                continue
            index = len(durations) + 1
            t0 = time.perf_counter()
            try:
                image = reconstruction.read_image(str(image_path))
                image_masks = masks.masks(image_path, image)
                image_pointmap = _pointmap_for(pointmap, image_path, image.shape[:2])
                image, image_masks, image_pointmap = reconstruction.input_warnings(image, image_masks,
                                                                                   image_pointmap, log=log)
                if pointmap == "flat":
                    image_pointmap = reconstruction.flat_pointmap(*image.shape[:2])
                if inference is None:  # built once, on the first image that needs it
                    inference = reconstruction.build_inference(
                        config, device=device, low_memory=low_memory,
                        portable_seed=reconstruct_options.pop("portable_seed", False),
                        compile=reconstruct_options.pop("compile", False),
                        weights=reconstruct_options.pop("weights", "default"),
                        dtype=reconstruct_options.pop("dtype", "auto"))
                log(f"[{index}/{len(todo)}] {image_path.name}: {len(image_masks)} object(s)")
                summary = reconstruction.reconstruct(config, image, image_masks, folder, pointmap=image_pointmap,
                                                     random_weights=random_weights, progress=progress,
                                                     log=_quiet(log), inference=inference, **reconstruct_options)
                status, objects = "done", len(summary["objects"])
            except errors.UserError as e:
                status, objects = f"failed: {e}", None
            seconds = time.perf_counter() - t0
            durations.append(seconds)
            rows.append({"image": image_path.name, "objects": objects, "seconds": seconds, "status": status,
                         "folder": str(folder)})
            left = len(todo) - len(durations)
            eta = f", ETA {_fmt_duration(left * sum(durations) / len(durations))}" if left else ""
            log(f"[{len(durations)}/{len(todo)}] {image_path.name}: {status} in {_fmt_duration(seconds)} "
                f"(elapsed {_fmt_duration(time.perf_counter() - start)}{eta})")
    except KeyboardInterrupt:
        rows.append({"image": "(interrupted)", "objects": None, "seconds": None,
                     "status": "failed: interrupted; run the same command again to continue"})
        _finish(out_dir, rows, log)
        raise
    _finish(out_dir, rows, log)
    return rows


def _quiet(log: Callable[[str], None]) -> Callable[[str], None]:
    """reconstruct's per-run summary block is long; the batch keeps its one-line messages only."""
    def filtered(message: str) -> None:
        if not str(message).startswith("\nsummary"):
            log(message)
    return filtered


def _pointmap_for(spec: Optional[str], image_path: Path, shape) -> Optional[np.ndarray]:
    from sam3d_objects import reconstruction
    if spec is None or spec == "flat":
        return None
    folder = Path(spec)
    if not folder.is_dir():
        raise errors.UserError(f"--pointmap {spec}: give 'flat' or a folder of <image name>.npy point maps")
    return reconstruction.read_pointmap(str(folder / f"{image_path.stem}.npy"), shape)


def _finish(out_dir: Path, rows: List[Dict[str, Any]], log: Callable[[str], None]) -> None:
    table = format_table(rows)
    log("\n" + table)
    path = out_dir / SUMMARY
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(json.dumps({"images": rows}, indent=2) + "\n")
    tmp.replace(path)


# ------------------------------------------------------------------------------------------------------------ CLI
def add_parser(sub) -> argparse.ArgumentParser:
    from sam3d_objects import reconstruction
    p = sub.add_parser("batch", help="reconstruct every image of a folder (resumable, one summary table)",
                       description=__doc__.split("\n\n")[0] + " Masks from a folder, automatic, or SAM 3 text.")
    p.add_argument("images", help="folder of images (png/jpg/webp/...)")
    p.add_argument("--out", required=True, help="output folder: <image name>/ per image, batch_summary.json")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--masks", default=None, metavar="DIR|auto",
                        help="DIR/<image name>.png or DIR/<image name>/<index>.png; 'auto' = automatic foreground "
                             "(default: <images>_masks/ beside the images folder)")
    source.add_argument("--text", default=None, help="SAM 3 text prompt, e.g. 'mug' (extra `sam3`)")
    p.add_argument("--sam3-checkpoint", default=None, help="SAM 3 checkpoint for --text (default: random weights, "
                                                           "a plumbing check)")
    p.add_argument("--checkpoints", default=None, help="checkpoint folder or Hugging Face repo id (as reconstruct)")
    p.add_argument("--revision", default=None, help="branch, tag or commit of a Hugging Face repo")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N or mps (default: cuda > mps > cpu)")
    p.add_argument("--preset", choices=("fast", "balanced", "quality"), default=None)
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--steps", default=None, help="N or N1,N2 (default: the preset's or the yaml's)")
    p.add_argument("--fast", action="store_true", help="upstream's distilled mode")
    p.add_argument("--low-memory", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--weights", choices=("default", "int8", "bf16"), default="default",
                   help="the large transformers' linear weights (see reconstruct --weights)")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="what the sampling stages run in (see reconstruct --dtype)")
    p.add_argument("--formats", default="gaussian,mesh", help=f"from {','.join(reconstruction.FORMATS)}")
    p.add_argument("--pointmap", default=None, metavar="DIR|flat",
                   help="folder of <image name>.npy point maps, or 'flat' (plumbing checks); default: depth model")
    p.add_argument("--turntable", type=int, nargs="?", const=36, default=0, metavar="FRAMES")
    p.add_argument("--turntable-format", choices=reconstruction.TURNTABLE_FORMATS, default="gif")
    p.add_argument("--texture", action="store_true", help="textured mesh.glb (see reconstruct --texture)")
    p.add_argument("--no-progress", action="store_true")
    return p


def run_cli(args) -> int:
    from sam3d_objects import reconstruction
    from sam3d_objects.assets.tiny_checkpoint import is_random_checkpoint
    images = Path(args.images)
    if not images.is_dir():
        raise errors.UserError(f"{args.images}: not a folder of images (one image: sam3d-objects reconstruct)")
    formats = reconstruction.parse_formats(args.formats)
    fast, steps = reconstruction.apply_preset(args.preset, args.fast, reconstruction.parse_steps(args.steps))
    out = reconstruction.check_out_dir(args.out)
    if args.text:
        masks = MaskSource("text", text=args.text, sam3_checkpoint=args.sam3_checkpoint, cache=out / ".masks",
                           device=args.device)
    elif args.masks == "auto":
        masks = MaskSource("auto")
    else:
        mask_dir = Path(args.masks) if args.masks else default_mask_dir(images)
        if mask_dir is None or not mask_dir.is_dir():
            raise errors.UserError(f"no masks for {images}: give --masks DIR (DIR/<image name>.png), create "
                                f"{images.name}_masks/ beside it, or use --masks auto / --text PROMPT")
        masks = MaskSource("folder", mask_dir=mask_dir)
    config, source = reconstruction.find_checkpoint(args.checkpoints, args.revision)
    if config is None:
        raise errors.UserError(f"no checkpoint found (looked at {source}): pass --checkpoints facebook/sam-3d-objects "
                            f"(README: weights by name) or a folder", errors.EXIT_CHECKPOINT)
    device = reconstruction.check_device(args.device)
    reconstruction.check_checkpoint_folder(config)
    random_weights = is_random_checkpoint(config)
    if random_weights:
        print(f"NOTE: {config.parent} holds random weights (plumbing check): the outputs are not a reconstruction.")
    rows = run_batch(images, out, masks, config, pointmap=args.pointmap, device=device, low_memory=args.low_memory,
                     random_weights=random_weights, progress=not args.no_progress, seed=args.seed, steps=steps,
                     formats=formats, turntable_frames=args.turntable, fast=fast, texture=args.texture,
                     turntable_format=args.turntable_format, weights=args.weights, dtype=args.dtype)
    return errors.EXIT_OK if not any(r["status"].startswith("failed") for r in rows) else errors.EXIT_RUN
