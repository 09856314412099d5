"""``sam3d-objects segment FOLDER``: auto-labelling a folder of images with SAM 3 (text prompts for several classes
and/or boxes from a file) into a YOLO segmentation dataset, COCO instances and mask PNGs.

Output layout (``--out DIR``)::

    classes.txt, data.yaml          class names (line number = YOLO class id; COCO category id = line + 1)
    labels/<stem>.txt               YOLO segmentation: "class x1 y1 x2 y2 ..." normalised polygons, one object a line
    annotations.json                COCO instances (polygons, or compressed RLE with --coco-rle), written at the end
    masks/<stem>/<k>.png            one 0/255 PNG per object, by decreasing score (what `reconstruct --mask` reads)
    previews/<stem>.jpg             --preview: the image with its masks tinted by class
    records/<file name>.json        per-image results; an image with a record is done (resume = run again)
    run.json                        the settings; resuming with other settings is refused

Each image's files are written before its record, and every file through a temporary name, so an interrupted run
resumes at the first image without a record and never leaves half a file.
"""
from __future__ import annotations

import csv
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from sam3d_objects import labels
from sam3d_objects.sam3_support import SegmentError, box_to_sam3

IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff")
DEFAULT_BOX_CLASS = "object"


@dataclass
class Detection:
    """One object found on an image: a boolean ``[H, W]`` mask, its score and its class index."""
    mask: np.ndarray
    score: float
    class_id: int


@dataclass
class LabelSettings:
    """What decides the labels; stored in ``run.json`` so a resumed run cannot mix two settings."""
    classes: List[str]
    texts: List[str]
    boxes_file_sha1: Optional[str] = None
    threshold: float = 0.5
    mask_threshold: float = 0.5
    min_area: int = 16
    tolerance: float = 1.0
    coco_format: str = "polygon"
    checkpoint: Optional[str] = None
    extra: Dict[str, str] = field(default_factory=dict)


def list_images(folder: Path) -> List[Path]:
    """The folder's images (not recursive), by name; two files with the same stem are refused (YOLO names labels
    by stem)."""
    if not folder.is_dir():
        raise SegmentError(f"{folder} is not a folder")
    images = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTS)
    if not images:
        raise SegmentError(f"no images ({', '.join(IMAGE_EXTS)}) in {folder}")
    stems: Dict[str, Path] = {}
    for path in images:
        if path.stem in stems:
            raise SegmentError(f"{stems[path.stem].name} and {path.name} share the label name {path.stem}.txt: "
                               f"rename one of them")
        stems[path.stem] = path
    return images


def read_boxes_file(path: str) -> Dict[str, List[Tuple[List[float], str]]]:
    """Boxes per image file name: ``{"img.jpg": [([x0, y0, x1, y1], class), ...]}`` from

    - CSV / text lines ``image,x0,y0,x1,y1[,class]`` (pixels; blank lines and ``#`` comments skipped), or
    - JSON ``{"img.jpg": [[x0, y0, x1, y1], [x0, y0, x1, y1, "class"], ...]}``.

    A box without a class is of class "object"."""
    file = Path(path)
    if not file.is_file():
        raise SegmentError(f"boxes file {path} does not exist")
    rows: List[Tuple[str, List, int]] = []
    if file.suffix.lower() == ".json":
        try:
            data = json.loads(file.read_text())
        except json.JSONDecodeError as error:
            raise SegmentError(f"boxes file {path} is not valid JSON: {error}") from error
        if not isinstance(data, dict):
            raise SegmentError(f"boxes file {path}: expected {{\"image name\": [[x0, y0, x1, y1, class?], ...]}}")
        rows = [(name, list(box), k + 1) for k, (name, boxes) in enumerate(data.items()) for box in boxes]
    else:
        with open(file, newline="") as handle:
            for number, row in enumerate(csv.reader(handle), start=1):
                if not row or not row[0].strip() or row[0].lstrip().startswith("#"):
                    continue
                rows.append((row[0].strip(), [v.strip() for v in row[1:]], number))
    boxes: Dict[str, List[Tuple[List[float], str]]] = {}
    for name, values, number in rows:
        try:
            corners = [float(v) for v in values[:4]]
        except (TypeError, ValueError):
            corners = []
        cls = str(values[4]) if len(values) > 4 and str(values[4]) else DEFAULT_BOX_CLASS
        if len(corners) != 4 or len(values) > 5 or corners[2] <= corners[0] or corners[3] <= corners[1]:
            raise SegmentError(f"boxes file {path}, entry {number}: expected image,x0,y0,x1,y1[,class] with "
                               f"x1 > x0 and y1 > y0 (pixels), got {[name] + list(values)}")
        boxes.setdefault(name, []).append((corners, cls))
    return boxes


def parse_classes(texts: Optional[Sequence[str]]) -> List[str]:
    """``--text person --text "red car"`` and ``--text person,car`` both give class names, in order, once each."""
    classes: List[str] = []
    for text in texts or []:
        for name in text.split(","):
            name = name.strip()
            if name and name not in classes:
                classes.append(name)
    return classes


def _sha1(path: str) -> str:
    return hashlib.sha1(Path(path).read_bytes()).hexdigest()


def _box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


class Sam3Labeler:
    """Masks for several text classes and boxes on one image, from a ``Sam3Processor``: the image is encoded once;
    each text class gives every instance above the confidence threshold; each box gives the one mask whose box
    overlaps it most (SAM 3 treats a box as an exemplar and may return look-alikes elsewhere)."""

    def __init__(self, processor, mask_threshold: float = 0.5):
        self.processor, self.mask_threshold = processor, mask_threshold

    def _masks(self, state) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        probs = state["masks_logits"][:, 0].float().cpu().numpy()  # sigmoid probabilities at image size
        return probs > self.mask_threshold, state["scores"].float().cpu().numpy(), state["boxes"].float().cpu().numpy()

    def __call__(self, image, texts: Sequence[Tuple[int, str]], boxes: Sequence[Tuple[int, List[float]]]
                 ) -> List[Detection]:
        state = self.processor.set_image(image)
        found: List[Detection] = []
        for class_id, text in texts:
            self.processor.reset_all_prompts(state)
            masks, scores, _ = self._masks(self.processor.set_text_prompt(prompt=text, state=state))
            found += [Detection(m, float(s), class_id) for m, s in zip(masks, scores)]
        for class_id, corners in boxes:
            self.processor.reset_all_prompts(state)
            out = self.processor.add_geometric_prompt(box=box_to_sam3(corners, *image.size), label=True, state=state)
            masks, scores, found_boxes = self._masks(out)
            if len(masks):
                best = max(range(len(masks)), key=lambda k: (_box_iou(found_boxes[k], corners), scores[k]))
                found.append(Detection(masks[best], float(scores[best]), class_id))
        return found


@dataclass
class FolderSummary:
    images: int = 0
    labelled: int = 0
    resumed: int = 0
    failed: Dict[str, str] = field(default_factory=dict)
    objects: Dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def text(self, out: Path) -> str:
        per = f", {self.seconds / self.labelled:.1f} s per image" if self.labelled else ""
        counts = ", ".join(f"{name}: {n}" for name, n in self.objects.items()) or "none"
        lines = [f"{self.images} image(s): {self.labelled} labelled now, {self.resumed} already done (resumed), "
                 f"{len(self.failed)} failed{per}",
                 f"objects per class (whole dataset): {counts}",
                 f"YOLO labels in {out / 'labels'} (classes.txt, data.yaml), COCO in {out / 'annotations.json'}, "
                 f"masks in {out / 'masks'}"]
        lines += [f"  failed: {name}: {why}" for name, why in self.failed.items()]
        return "\n".join(lines)


def _prepare_out(out: Path, settings: LabelSettings, overwrite: bool) -> None:
    run = out / "run.json"
    wanted = json.dumps(settings.__dict__, sort_keys=True)
    if run.is_file() and not overwrite:
        if json.dumps(json.loads(run.read_text()), sort_keys=True) != wanted:
            raise SegmentError(f"{out} holds labels made with other settings ({run}): pass --overwrite to redo "
                               f"them, or choose another --out")
    elif overwrite:
        for name in ("records", "labels", "masks", "previews"):
            shutil.rmtree(out / name, ignore_errors=True)
    for name in ("records", "labels", "masks"):
        (out / name).mkdir(parents=True, exist_ok=True)
    labels.write_text_atomic(run, json.dumps(settings.__dict__, indent=1, sort_keys=True))
    labels.write_classes(out, settings.classes)


def _save_png(array: np.ndarray, path: Path, **kwargs) -> None:
    from PIL import Image

    tmp = path.with_name(path.stem + ".tmp" + path.suffix)
    Image.fromarray(array).save(tmp, **kwargs)
    os.replace(tmp, path)


def write_image_outputs(out: Path, image_path: Path, rgb: np.ndarray, detections: Sequence[Detection],
                        settings: LabelSettings, preview: bool = False) -> dict:
    """Labels, masks (and preview) of one image, then its record (the "done" mark); returns the record."""
    h, w = rgb.shape[:2]
    kept = sorted((d for d in detections if int(d.mask.sum()) >= settings.min_area), key=lambda d: -d.score)
    folder = out / "masks" / image_path.stem
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    yolo, annotations = [], []
    for index, det in enumerate(kept):
        _save_png(det.mask.astype(np.uint8) * 255, folder / f"{index}.png")
        line = labels.yolo_line(det.class_id, det.mask, settings.tolerance, settings.min_area)
        if line is not None:
            yolo.append(line)
        ann = labels.coco_annotation(det.mask, det.class_id + 1, det.score, settings.coco_format,
                                     settings.tolerance, settings.min_area)
        if ann is not None:
            annotations.append({**ann, "mask_png": f"masks/{image_path.stem}/{index}.png"})
    labels.write_text_atomic(out / "labels" / f"{image_path.stem}.txt", "".join(f"{line}\n" for line in yolo))
    if preview:
        (out / "previews").mkdir(exist_ok=True)
        tinted = labels.overlay(rgb, [d.mask for d in kept], [d.class_id for d in kept])
        _save_png(tinted, out / "previews" / f"{image_path.stem}.jpg", quality=90)
    record = {"file_name": image_path.name, "width": w, "height": h, "annotations": annotations}
    labels.write_text_atomic(out / "records" / f"{image_path.name}.json", json.dumps(record))
    return record


def label_folder(folder: str, out_dir: str, settings: LabelSettings,
                 labeler: Callable[..., List[Detection]] | None = None,
                 boxes: Optional[Dict[str, List[Tuple[List[float], str]]]] = None,
                 preview: bool = False, overwrite: bool = False, progress: bool = True,
                 make_labeler: Optional[Callable[[], Callable[..., List[Detection]]]] = None) -> FolderSummary:
    """Label every image of ``folder`` into ``out_dir`` (see the module docstring); resumes where a previous run
    with the same settings stopped. ``labeler(image, texts, boxes) -> [Detection]`` (or ``make_labeler()``, called
    only if an image is left to label, so a finished run does not load SAM 3)."""
    from PIL import Image
    from tqdm.auto import tqdm

    images = list_images(Path(folder))
    out = Path(out_dir)
    boxes = boxes or {}
    unknown = sorted(set(boxes) - {p.name for p in images})
    if unknown:
        raise SegmentError(f"the boxes file names images that are not in {folder}: {', '.join(unknown[:5])}")
    _prepare_out(out, settings, overwrite)
    class_index = {c: i for i, c in enumerate(settings.classes)}
    texts = [(class_index[t], t) for t in settings.texts]
    summary = FolderSummary(images=len(images))
    todo = [p for p in images if not (out / "records" / f"{p.name}.json").is_file()]
    summary.resumed = len(images) - len(todo)
    start = time.perf_counter()
    for path in tqdm(todo, desc="labelling", unit="image", disable=not progress or not todo):
        try:
            image = Image.open(path).convert("RGB")
        except OSError as error:
            summary.failed[path.name] = f"cannot read the image ({error})"
            continue
        if labeler is None:
            labeler = make_labeler()
        prompts = [(class_index[c], corners) for corners, c in boxes.get(path.name, [])]
        detections = labeler(image, texts, prompts)
        write_image_outputs(out, path, np.asarray(image), detections, settings, preview)
        summary.labelled += 1
    summary.seconds = time.perf_counter() - start
    records = [json.loads((out / "records" / f"{p.name}.json").read_text()) for p in images
               if (out / "records" / f"{p.name}.json").is_file()]
    for record in records:
        for ann in record["annotations"]:
            name = settings.classes[ann["category_id"] - 1]
            summary.objects[name] = summary.objects.get(name, 0) + 1
    document = labels.coco_document(records, settings.classes)
    labels.write_text_atomic(out / "annotations.json", json.dumps(document))
    return summary
