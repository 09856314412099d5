"""Upstream-compatible notebook entry point: ``sys.path.append("notebooks"); from inference import Inference``.

Everything lives in ``sam3d_objects.inference``; this file only re-exports it (upstream's ``notebook/inference.py``
names, same signatures).
"""
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # run from a checkout without installing the package
    sys.path.append(_ROOT)

from sam3d_objects.inference import (BLACKLIST_FILTERS, WHITELIST_FILTERS, Inference,  # noqa: E402,F401
                                     check_hydra_safety, check_target, display_image, interactive_visualizer,
                                     load_image, load_mask, load_masks, load_single_mask, make_scene,
                                     normalized_gaussian, ready_gaussian_for_video_rendering, render_video)

__all__ = ["Inference"]  # upstream's star-export; the notebooks import the other names explicitly
