"""YOLO / COCO label writing, read back by independent readers and compared with the masks that were written.

Readers: pycocotools (the COCO reference implementation) where it installs, and a polygon rasteriser written here
(even-odd rule at pixel centres, no code shared with the writer)."""
import json

import numpy as np
import pytest
from scipy import ndimage

from sam3d_objects import labels

try:
    import pycocotools.mask as coco_mask
except ImportError:  # optional: the rasteriser below still checks every polygon
    coco_mask = None

needs_pycocotools = pytest.mark.skipif(coco_mask is None, reason="pycocotools is not installed (pip install "
                                                                 "pycocotools, part of the test extra)")


def rasterise(polygon_xy: np.ndarray, height: int, width: int) -> np.ndarray:
    """Pixels whose centre lies inside the closed polygon (even-odd crossings of a ray to the right)."""
    yc, xc = np.mgrid[0:height, 0:width] + 0.5
    inside = np.zeros((height, width), bool)
    x0, y0 = polygon_xy[:, 0], polygon_xy[:, 1]
    x1, y1 = np.roll(x0, -1), np.roll(y0, -1)
    for ax, ay, bx, by in zip(x0, y0, x1, y1):
        if ay == by:
            continue
        crosses = (ay > yc) != (by > yc)
        x_at = ax + (yc - ay) * (bx - ax) / (by - ay)
        inside ^= crosses & (xc < x_at)
    return inside


def parse_yolo(text: str) -> list:
    """(class, [N, 2] normalised vertices) per line: the YOLO segmentation format, read independently."""
    out = []
    for line in text.splitlines():
        if line.strip():
            values = line.split()
            out.append((int(values[0]), np.array([float(v) for v in values[1:]]).reshape(-1, 2)))
    return out


def iou(a: np.ndarray, b: np.ndarray) -> float:
    return float((a & b).sum() / max(1, (a | b).sum()))


def blobs(seed: int, shape=(72, 96), count: int = 6) -> list:
    """Smooth random masks (several components, some with holes) as SAM 3 masks look like."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        field = ndimage.gaussian_filter(rng.random(shape), 3 + 3 * rng.random())
        out.append(field > np.quantile(field, 0.6 + 0.3 * rng.random()))
    return out


def filled(mask: np.ndarray) -> np.ndarray:
    return ndimage.binary_fill_holes(mask)


def test_traced_polygons_contain_exactly_the_mask_pixels():
    """Unsimplified pixel-edge polygons reproduce each 8-connected component with its holes filled exactly."""
    for mask in blobs(0) + [np.eye(7, dtype=bool), np.ones((5, 4), bool)]:
        polygons = labels.mask_to_polygons(mask, tolerance=0.0)
        union = np.zeros_like(mask)
        for poly in polygons:
            union |= rasterise(poly, *mask.shape)
        np.testing.assert_array_equal(union, filled(mask) | mask)
        # one polygon per 8-connected component
        assert len(polygons) == ndimage.label(mask, structure=np.ones((3, 3)))[1]


def test_diagonal_pixels_are_one_component_and_holes_are_loops():
    mask = np.zeros((5, 5), bool)
    mask[1, 1] = mask[2, 2] = True
    assert len(labels.mask_to_polygons(mask)) == 1
    ring = np.zeros((6, 6), bool)
    ring[1:5, 1:5] = True
    ring[2:4, 2:4] = False
    areas = sorted(labels.signed_area(p) for p in labels.trace_loops(ring))
    assert areas == [-4.0, 16.0]  # the hole's loop runs the other way round


def test_simplified_polygons_stay_close_to_the_mask():
    for mask in blobs(1):
        for poly in labels.mask_to_polygons(mask, tolerance=1.0):
            assert len(poly) >= 3
        raster = np.zeros_like(mask)
        for poly in labels.mask_to_polygons(mask, tolerance=1.0, min_area=0):
            raster |= rasterise(poly, *mask.shape)
        assert iou(raster, filled(mask)) > 0.9


def test_yolo_lines_round_trip(tmp_path):
    masks = blobs(2)
    h, w = masks[0].shape
    lines = [labels.yolo_line(k % 3, m, tolerance=0.0, min_area=0) for k, m in enumerate(masks)]
    (tmp_path / "a.txt").write_text("\n".join(lines) + "\n")
    read = parse_yolo((tmp_path / "a.txt").read_text())
    assert [(c, xy.tolist()) for c, xy in labels.read_yolo_labels(tmp_path / "a.txt")] == \
        [(c, xy.tolist()) for c, xy in read]
    assert [c for c, _ in read] == [k % 3 for k in range(len(masks))]
    for (cls, xy), mask in zip(read, masks):
        assert xy.min() >= 0 and xy.max() <= 1
        raster = rasterise(xy * [w, h], h, w)  # joined components: the bridges add no area
        assert iou(raster, filled(mask)) > 0.995  # exact up to the 6-decimal rounding
    # the default simplification (1 px) still matches well
    for mask in masks:
        (_, xy), = parse_yolo(labels.yolo_line(0, mask))
        assert iou(rasterise(xy * [w, h], h, w), filled(mask)) > 0.9


def test_empty_mask_gives_no_label():
    assert labels.yolo_line(0, np.zeros((4, 4), bool)) is None
    assert labels.coco_annotation(np.zeros((4, 4), bool), 1) is None


def test_rle_matches_pycocotools_and_round_trips():
    rng = np.random.default_rng(3)
    for mask in blobs(3) + [rng.random((13, 7)) > 0.5, np.ones((3, 5), bool), np.zeros((2, 2), bool)]:
        rle = labels.encode_rle(mask)
        np.testing.assert_array_equal(labels.decode_rle(rle), mask)
        if coco_mask is not None:
            reference = coco_mask.encode(np.asfortranarray(mask.astype(np.uint8)))
            assert rle["counts"] == reference["counts"].decode() and rle["size"] == list(reference["size"])


@needs_pycocotools
def test_coco_document_read_back_by_pycocotools(tmp_path):
    from pycocotools.coco import COCO

    masks = blobs(4)
    h, w = masks[0].shape
    records = []
    for fmt, name in (("polygon", "a.png"), ("rle", "b.png")):
        anns = [labels.coco_annotation(m, 1 + k % 2, score=0.5, fmt=fmt, tolerance=0.0, min_area=0)
                for k, m in enumerate(masks)]
        records.append({"file_name": name, "width": w, "height": h, "annotations": anns})
    doc = labels.coco_document(records, ["cat", "dog"])
    path = tmp_path / "annotations.json"
    path.write_text(json.dumps(doc))
    coco = COCO(str(path))
    assert [c["name"] for c in coco.loadCats(coco.getCatIds())] == ["cat", "dog"]
    for image_id, (fmt, exact) in enumerate((("polygon", False), ("rle", True)), start=1):
        anns = coco.loadAnns(coco.getAnnIds(imgIds=[image_id]))
        assert len(anns) == len(masks)
        for ann, mask in zip(anns, masks):
            decoded = coco.annToMask(ann).astype(bool)
            if exact:
                np.testing.assert_array_equal(decoded, mask)
            else:  # pycocotools' own polygon rasteriser: corners-on-pixel-edges polygons, holes filled
                assert iou(decoded, filled(mask)) > 0.97
            assert ann["area"] == mask.sum() and ann["bbox"] == list(coco_mask.toBbox(
                coco_mask.encode(np.asfortranarray(mask.astype(np.uint8)))).astype(float))


@needs_pycocotools
def test_pycocotools_rasterises_a_traced_square_exactly():
    mask = np.zeros((8, 8), bool)
    mask[1:5, 2:6] = True
    poly = labels.mask_to_polygons(mask)[0]
    decoded = coco_mask.decode(coco_mask.frPyObjects([poly.ravel().tolist()], 8, 8))[:, :, 0].astype(bool)
    np.testing.assert_array_equal(decoded, mask)


def test_overlay_tints_only_masked_pixels():
    image = np.full((6, 6, 3), 100, np.uint8)
    mask = np.zeros((6, 6), bool)
    mask[1:5, 1:5] = True
    out = labels.overlay(image, [mask], [1])
    assert (out[~mask] == 100).all() and (out[mask] != 100).any(axis=-1).all()
