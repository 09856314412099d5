"""Upstream-compatible notebook entry point: ``sys.path.append("notebooks"); from inference import Inference``.

Everything lives in ``sam3d_objects.inference``; this file only re-exports it.
"""
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # run from a checkout without installing the package
    sys.path.append(_ROOT)

from sam3d_objects.inference import (Inference, load_image, load_mask, load_masks, load_single_mask,  # noqa: E402,F401
                                     make_scene, ready_gaussian_for_video_rendering, render_video)
