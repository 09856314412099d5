"""Automatic object masks without a segmentation model (``--mask auto``, ``batch --masks auto``).

* An image with a real alpha channel (a cut-out PNG): the object is where alpha >= 128.
* Otherwise the background is learned from the image border: its colours are clustered (a few k-means centres,
  so a wall and a two-tone floor are all background) and a pixel is foreground when its colour is far from every
  centre (threshold: Otsu's split of those distances, at least ``MIN_DISTANCE``). Works for product-style photos
  on a plain or simple background; anything else needs a mask file or SAM 3 (``--text``).

The foreground is cleaned (opening, holes filled) and split into connected components: one mask per object,
largest first, components under ``min_fraction`` of the image dropped. numpy + scipy.ndimage only.
"""
from __future__ import annotations

from typing import List

import numpy as np

MIN_DISTANCE = 30.0      # RGB distance (0..255 scale) below which a pixel is background whatever Otsu says
BORDER_FRACTION = 0.03   # border band used to learn the background (of the shorter side)
CLUSTERS = 6


class NoForegroundError(ValueError):
    """Nothing stands out from the background: a mask file or a text prompt is needed."""


def _border_pixels(rgb: np.ndarray) -> np.ndarray:
    h, w = rgb.shape[:2]
    band = max(2, int(round(min(h, w) * BORDER_FRACTION)))
    parts = [rgb[:band].reshape(-1, 3), rgb[-band:].reshape(-1, 3), rgb[:, :band].reshape(-1, 3),
             rgb[:, -band:].reshape(-1, 3)]
    return np.concatenate(parts).astype(np.float32)


def _kmeans(points: np.ndarray, k: int, iterations: int = 15, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if len(points) > 20000:
        points = points[rng.choice(len(points), 20000, replace=False)]
    centres = points[rng.choice(len(points), min(k, len(points)), replace=False)].copy()
    for _ in range(iterations):
        nearest = ((points[:, None, :] - centres[None]) ** 2).sum(-1).argmin(1)
        for j in range(len(centres)):
            members = points[nearest == j]
            if len(members):
                centres[j] = members.mean(0)
    return centres


def _otsu(values: np.ndarray, bins: int = 256) -> float:
    hist, edges = np.histogram(values, bins=bins)
    centres = (edges[:-1] + edges[1:]) / 2
    weight0 = np.cumsum(hist)
    weight1 = weight0[-1] - weight0
    mean0 = np.cumsum(hist * centres) / np.maximum(weight0, 1)
    mean1 = ((hist * centres).sum() - np.cumsum(hist * centres)) / np.maximum(weight1, 1)
    between = weight0 * weight1 * (mean0 - mean1) ** 2
    return float(centres[int(np.argmax(between))])


def background_distance(rgb: np.ndarray) -> np.ndarray:
    """Per pixel, the RGB distance to the nearest of the border's colour clusters ([H, W] float32)."""
    centres = _kmeans(_border_pixels(rgb), CLUSTERS)
    flat = rgb.reshape(-1, 3).astype(np.float32)
    best = np.full(len(flat), np.inf, dtype=np.float32)
    for c in centres:
        best = np.minimum(best, np.sqrt(((flat - c) ** 2).sum(-1)))
    return best.reshape(rgb.shape[:2])


def foreground(image: np.ndarray) -> np.ndarray:
    """bool [H, W]: alpha when the image has a meaningful one, else far from the border's colours."""
    image = np.asarray(image)
    if image.ndim == 3 and image.shape[-1] == 4:
        alpha = image[..., 3]
        if alpha.min() < 128 <= alpha.max():
            return alpha >= 128
    rgb = image[..., :3] if image.ndim == 3 else np.repeat(image[..., None], 3, -1)
    distance = background_distance(rgb)
    return distance > max(MIN_DISTANCE, _otsu(distance))


def auto_masks(image: np.ndarray, min_fraction: float = 0.005, max_objects: int = 8) -> List[np.ndarray]:
    """One bool mask per foreground object, largest first (see the module docstring). NoForegroundError when
    nothing (or everything) stands out."""
    from scipy import ndimage

    fg = foreground(image)
    h, w = fg.shape
    radius = max(1, round(min(h, w) / 256))
    fg = ndimage.binary_opening(fg, structure=np.ones((2 * radius + 1,) * 2, bool))
    fg = ndimage.binary_fill_holes(fg)
    if fg.mean() > 0.9:
        raise NoForegroundError("automatic mask: no plain background found (the 'object' covers the whole "
                                "image); give a mask file or a text prompt (SAM 3)")
    labels, count = ndimage.label(fg)
    if count == 0:
        raise NoForegroundError("automatic mask: nothing stands out from the background; give a mask file or a "
                                "text prompt (SAM 3)")
    areas = ndimage.sum_labels(np.ones_like(labels), labels, index=np.arange(1, count + 1))
    order = [int(i) + 1 for i in np.argsort(-areas) if areas[i] >= min_fraction * h * w][:max_objects]
    if not order:
        raise NoForegroundError(f"automatic mask: every foreground region is under {min_fraction:.1%} of the "
                                f"image; give a mask file or a text prompt (SAM 3)")
    return [labels == i for i in order]
