"""Dataset labels from binary masks: YOLO segmentation, COCO instances (polygons or RLE) and mask PNGs.

Written for ``sam3d-objects segment`` over a folder, usable on its own::

    polygons = mask_to_polygons(mask)                   # outer boundaries, pixel-corner coordinates
    line = yolo_line(class_id, mask)                    # "3 x1 y1 x2 y2 ..." normalised to [0, 1]
    rle = encode_rle(mask)                              # COCO compressed RLE {"size": [H, W], "counts": "..."}

Conventions: pixel ``(row r, column c)`` covers ``[c, c + 1] x [r, r + 1]``; polygons run along pixel edges, so a
polygon with no simplification contains exactly the mask's pixel centres (8-connected components; holes are not
part of a polygon, they are kept by RLE). YOLO coordinates are ``x / width, y / height`` of those corners.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

Polygon = np.ndarray  # [N, 2] float (x, y) vertices of a closed loop, first vertex not repeated


# ------------------------------------------------------------------------------------------------ contour tracing

def _boundary_edges(mask: np.ndarray) -> Dict[Tuple[int, int], List[Tuple[int, int]]]:
    """Directed pixel-edge segments between foreground and background, clockwise on screen around foreground
    (outer boundaries come out with positive shoelace area in x-right / y-down coordinates, holes negative):
    ``{start corner (x, y): [end corners]}``."""
    padded = np.pad(mask.astype(bool), 1)
    fg = padded[1:-1, 1:-1]
    starts: Dict[Tuple[int, int], List[Tuple[int, int]]] = {}
    # (neighbour offset (dr, dc), edge start (dx, dy), edge end (dx, dy)) relative to the pixel's top-left corner
    sides = (((-1, 0), (0, 0), (1, 0)),   # top: left -> right
             ((0, 1), (1, 0), (1, 1)),    # right: top -> bottom
             ((1, 0), (1, 1), (0, 1)),    # bottom: right -> left
             ((0, -1), (0, 1), (0, 0)))   # left: bottom -> top
    h, w = fg.shape
    for (dr, dc), (sx, sy), (ex, ey) in sides:
        neighbour = padded[1 + dr:1 + dr + h, 1 + dc:1 + dc + w]
        rows, cols = np.nonzero(fg & ~neighbour)
        for r, c in zip(rows.tolist(), cols.tolist()):
            starts.setdefault((c + sx, r + sy), []).append((c + ex, r + ey))
    return starts


def _left_of(direction: Tuple[int, int]) -> Tuple[int, int]:
    dx, dy = direction
    return (dy, -dx)  # turning left on screen (y down): facing south (0, 1), left is east (1, 0)


def trace_loops(mask: np.ndarray) -> List[Polygon]:
    """Every boundary loop of ``mask`` (outer boundaries and holes), collinear vertices removed. Where two
    foreground pixels touch only at a corner the loop turns left, which keeps them in one component
    (8-connectivity, as SAM 3's own connected components)."""
    edges = _boundary_edges(mask)
    loops = []
    while edges:
        # start at a corner with one way out (every loop has convex corners): a loop through a saddle corner then
        # passes it twice and is not cut there
        start = next((v for v, ends in edges.items() if len(ends) == 1), next(iter(edges)))
        loop = [start]
        current, previous = start, None
        while True:
            ends = edges[current]
            end = ends[0]
            if len(ends) > 1 and previous is not None:  # a saddle corner: take the left turn
                left = _left_of((current[0] - previous[0], current[1] - previous[1]))
                end = next((e for e in ends if (e[0] - current[0], e[1] - current[1]) == left), ends[0])
            ends.remove(end)
            if not ends:
                del edges[current]
            previous, current = current, end
            if current == start:
                break
            loop.append(current)
        loops.append(_drop_collinear(np.asarray(loop, dtype=np.float64)))
    return loops


def _drop_collinear(loop: np.ndarray) -> np.ndarray:
    before, after = np.roll(loop, 1, axis=0), np.roll(loop, -1, axis=0)
    cross = (loop[:, 0] - before[:, 0]) * (after[:, 1] - loop[:, 1]) - \
            (loop[:, 1] - before[:, 1]) * (after[:, 0] - loop[:, 0])
    return loop[cross != 0]


def signed_area(polygon: Polygon) -> float:
    """Shoelace area; positive for the outer boundaries :func:`trace_loops` returns (negative for holes)."""
    x, y = polygon[:, 0], polygon[:, 1]
    return 0.5 * float(np.dot(x, np.roll(y, -1)) - np.dot(np.roll(x, -1), y))


def simplify(polygon: Polygon, tolerance: float) -> Polygon:
    """Douglas-Peucker on a closed loop: vertices closer than ``tolerance`` pixels to the simplified outline go.
    Loops that would collapse below a triangle are returned unchanged."""
    if tolerance <= 0 or len(polygon) <= 4:
        return polygon
    # split the loop at its two mutually farthest-apart vertices (approximately: first vertex and its farthest)
    far = int(np.argmax(((polygon - polygon[0]) ** 2).sum(1)))
    halves = (np.vstack([polygon[:far + 1]]), np.vstack([polygon[far:], polygon[:1]]))
    kept = []
    for half in halves:
        keep = _douglas_peucker(half, tolerance)
        kept.append(half[keep][:-1])
    out = np.vstack(kept)
    return out if len(out) >= 3 else polygon


def _douglas_peucker(points: np.ndarray, tolerance: float) -> np.ndarray:
    keep = np.zeros(len(points), bool)
    keep[0] = keep[-1] = True
    stack = [(0, len(points) - 1)]
    while stack:
        a, b = stack.pop()
        if b - a < 2:
            continue
        seg = points[b] - points[a]
        rel = points[a + 1:b] - points[a]
        length = float(np.hypot(*seg))
        if length == 0:
            dist = np.hypot(rel[:, 0], rel[:, 1])
        else:
            dist = np.abs(seg[0] * rel[:, 1] - seg[1] * rel[:, 0]) / length
        k = int(np.argmax(dist))
        if dist[k] > tolerance:
            keep[a + 1 + k] = True
            stack += [(a, a + 1 + k), (a + 1 + k, b)]
    return keep


def mask_to_polygons(mask: np.ndarray, tolerance: float = 0.0, min_area: float = 1.0) -> List[Polygon]:
    """Outer boundary of each 8-connected component of ``mask`` (largest first), simplified to ``tolerance``
    pixels; components whose polygon area is below ``min_area`` pixels are dropped. Holes are not represented."""
    outer = [p for p in trace_loops(mask) if signed_area(p) > 0]
    outer = [simplify(p, tolerance) for p in outer]
    outer = [p for p in outer if len(p) >= 3 and abs(signed_area(p)) >= min_area]
    return sorted(outer, key=lambda p: -abs(signed_area(p)))


def join_polygons(polygons: Sequence[Polygon]) -> Polygon:
    """One vertex loop through several polygons (YOLO has one polygon per object): each next polygon is entered
    from the previous one's first vertex and the path returns along the same bridges, so the bridges enclose no
    area and every polygon keeps its own inside."""
    if len(polygons) == 1:
        return polygons[0]
    parts, bridge = [], []
    for k, poly in enumerate(polygons):
        if k > 0:  # start this loop at its vertex nearest to the previous loop's entry vertex
            entry = parts[-1][0] if len(parts[-1]) else polygons[0][0]
            start = int(np.argmin(((poly - entry) ** 2).sum(1)))
            poly = np.roll(poly, -start, axis=0)
        parts.append(np.vstack([poly, poly[:1]]))
        bridge.append(poly[0])
    back = [b[None] for b in reversed(bridge[1:-1])]
    return np.vstack(parts + back)


# ------------------------------------------------------------------------------------------------ YOLO

def yolo_line(class_id: int, mask: np.ndarray, tolerance: float = 1.0, min_area: float = 1.0) -> Optional[str]:
    """``class x1 y1 x2 y2 ...`` (coordinates normalised by the image's width and height, 6 decimals), or None
    when nothing of the mask is left after ``min_area``."""
    polygons = mask_to_polygons(mask, tolerance, min_area)
    if not polygons:
        return None
    h, w = mask.shape
    xy = join_polygons(polygons) / np.array([w, h], np.float64)
    return f"{class_id} " + " ".join(f"{v:.6f}" for v in xy.clip(0, 1).ravel())


def read_yolo_labels(path: str | os.PathLike) -> List[Tuple[int, np.ndarray]]:
    """``(class_id, [N, 2] normalised vertices)`` per line of a YOLO segmentation label file."""
    out = []
    for line in Path(path).read_text().splitlines():
        values = line.split()
        if values:
            out.append((int(values[0]), np.asarray(values[1:], np.float64).reshape(-1, 2)))
    return out


def write_text_atomic(path: Path, text: str) -> None:
    """Write via a temporary file and rename: an interrupted run never leaves half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_classes(folder: Path, classes: Sequence[str]) -> Path:
    """``classes.txt`` (one name a line, line number = class id) and ``data.yaml`` for Ultralytics-style
    trainers (images beside ``labels/`` in ``images/``)."""
    write_text_atomic(folder / "classes.txt", "".join(f"{c}\n" for c in classes))
    names = "".join(f"  {i}: {json.dumps(c)}\n" for i, c in enumerate(classes))
    write_text_atomic(folder / "data.yaml", f"path: {json.dumps(str(folder.resolve()))}\ntrain: images\n"
                                            f"val: images\nnames:\n{names}")
    return folder / "classes.txt"


# ------------------------------------------------------------------------------------------------ COCO

def encode_rle(mask: np.ndarray) -> dict:
    """COCO compressed RLE: run lengths of the column-major flattened mask, starting with a background run,
    each count written as COCO's 5-bit-group text (counts after the first two are stored as differences)."""
    flat = np.asarray(mask, bool).ravel(order="F")
    change = np.flatnonzero(flat[1:] != flat[:-1]) + 1
    bounds = np.concatenate([[0], change, [flat.size]])
    runs = np.diff(bounds).tolist()
    if flat.size and flat[0]:
        runs = [0] + runs
    return {"size": [int(mask.shape[0]), int(mask.shape[1])], "counts": _rle_string(runs)}


def _rle_string(runs: Sequence[int]) -> str:
    chars = []
    for i, run in enumerate(runs):
        value = run - runs[i - 2] if i > 2 else run
        more = True
        while more:
            group = value & 0x1F
            value >>= 5
            more = not ((value == 0 and not group & 0x10) or (value == -1 and group & 0x10))
            chars.append(chr(group + (0x20 if more else 0) + 48))
    return "".join(chars)


def decode_rle(rle: dict) -> np.ndarray:
    """The mask of a COCO compressed RLE (inverse of :func:`encode_rle`)."""
    h, w = rle["size"]
    runs, text, pos = [], rle["counts"], 0
    while pos < len(text):
        value, shift, more = 0, 0, True
        while more:
            c = ord(text[pos]) - 48
            value |= (c & 0x1F) << (5 * shift)
            more = bool(c & 0x20)
            pos, shift = pos + 1, shift + 1
            if not more and c & 0x10:
                value |= -1 << (5 * shift)
        if len(runs) > 2:
            value += runs[-2]
        runs.append(value)
    flat = np.repeat(np.arange(len(runs)) % 2 == 1, runs)
    return flat.reshape((w, h)).T.copy()


def mask_bbox(mask: np.ndarray) -> List[float]:
    """COCO ``[x, y, width, height]`` of the pixels' extent."""
    rows, cols = np.nonzero(mask)
    if rows.size == 0:
        return [0.0, 0.0, 0.0, 0.0]
    return [float(cols.min()), float(rows.min()), float(cols.max() - cols.min() + 1),
            float(rows.max() - rows.min() + 1)]


def coco_annotation(mask: np.ndarray, category_id: int, score: Optional[float] = None, fmt: str = "polygon",
                    tolerance: float = 1.0, min_area: float = 1.0) -> Optional[dict]:
    """One COCO instance (``id`` / ``image_id`` filled in by :func:`coco_document`); None when empty."""
    area = float(np.count_nonzero(mask))
    if area == 0:
        return None
    if fmt == "rle":
        segmentation = encode_rle(mask)
    elif fmt == "polygon":
        polygons = mask_to_polygons(mask, tolerance, min_area)
        if not polygons:
            return None
        segmentation = [[round(float(v), 2) for v in p.ravel()] for p in polygons]
    else:
        raise ValueError(f"COCO segmentation format must be 'polygon' or 'rle', got {fmt!r}")
    ann = {"category_id": int(category_id), "segmentation": segmentation, "area": area, "bbox": mask_bbox(mask),
           "iscrowd": 0}
    if score is not None:
        ann["score"] = float(score)
    return ann


def coco_document(images: Iterable[dict], classes: Sequence[str]) -> dict:
    """A COCO instances document from per-image records ``{"file_name", "width", "height", "annotations"}``:
    image ids count from 1 in the given order, category ids are class index + 1 (COCO reserves 0)."""
    doc = {"images": [], "annotations": [], "categories": [{"id": i + 1, "name": c, "supercategory": "object"}
                                                          for i, c in enumerate(classes)]}
    for image_id, record in enumerate(images, start=1):
        doc["images"].append({"id": image_id, "file_name": record["file_name"], "width": record["width"],
                              "height": record["height"]})
        for ann in record["annotations"]:
            doc["annotations"].append({**ann, "id": len(doc["annotations"]) + 1, "image_id": image_id})
    return doc


# ------------------------------------------------------------------------------------------------ previews

PALETTE = np.array([[230, 25, 75], [60, 180, 75], [255, 225, 25], [0, 130, 200], [245, 130, 48], [145, 30, 180],
                    [70, 240, 240], [240, 50, 230], [210, 245, 60], [250, 190, 212]], np.float32)


def overlay(image: np.ndarray, masks: Sequence[np.ndarray], class_ids: Sequence[int], alpha: float = 0.5
            ) -> np.ndarray:
    """RGB ``image`` with each mask tinted in its class's colour and its outline drawn solid."""
    out = image.astype(np.float32).copy()
    for mask, cls in zip(masks, class_ids):
        colour = PALETTE[cls % len(PALETTE)]
        m = mask.astype(bool)
        out[m] = (1 - alpha) * out[m] + alpha * colour
        edge = m & ~(np.pad(m, 1)[:-2, 1:-1] & np.pad(m, 1)[2:, 1:-1] & np.pad(m, 1)[1:-1, :-2]
                     & np.pad(m, 1)[1:-1, 2:])
        out[edge] = colour
    return out.clip(0, 255).astype(np.uint8)
