"""Speed/quality presets shared by the CLI (``--preset``), the API (``Inference(...)(..., preset="fast")``), the
batch mode and the web app, and the texture-bake settings sized for the device.

* ``fast``: upstream's distilled mode (stage 1 as a shortcut model, no classifier-free guidance in either stage)
  with 4 + 4 steps;
* ``balanced``: distilled mode with 4 + 12 steps;
* ``quality``: the release's defaults (the yaml's steps, 25 + 25, with guidance); the same as no preset.

Times per preset and device: README, "What to expect".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

Steps = Tuple[Optional[int], Optional[int]]


@dataclass(frozen=True)
class Preset:
    name: str
    fast: bool          # upstream's distillation mode in both stages
    steps: Steps        # (stage 1, stage 2); None = the yaml's
    description: str


PRESETS: Dict[str, Preset] = {
    "fast": Preset("fast", True, (4, 4), "distilled mode, 4 + 4 steps, no guidance"),
    "balanced": Preset("balanced", True, (4, 12), "distilled mode, 4 + 12 steps, no guidance"),
    "quality": Preset("quality", False, (None, None), "the release's defaults: 25 + 25 steps with guidance"),
}


def get(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}") from None


def resolve(preset: Optional[str], fast: bool = False, steps: Steps = (None, None)) -> Tuple[bool, Steps]:
    """(fast, steps) after applying ``preset``: an explicit ``fast`` flag or explicit steps win over the preset."""
    if preset is None:
        return fast, steps
    p = get(preset)
    return (fast or p.fast), tuple(s if s is not None else d for s, d in zip(steps, p.steps))


def run_options(preset: str) -> Dict[str, Any]:
    """The pipeline ``run`` keywords of a preset (for ``Inference.__call__``'s run options)."""
    p = get(preset)
    options: Dict[str, Any] = {"use_stage1_distillation": p.fast, "use_stage2_distillation": p.fast}
    if p.steps[0] is not None:
        options["stage1_inference_steps"] = p.steps[0]
    if p.steps[1] is not None:
        options["stage2_inference_steps"] = p.steps[1]
    return options


# Texture bake (--texture): upstream's settings on CUDA; on CPU/MPS fewer, smaller views and fewer optimisation
# steps (measured on a 2-core CPU for a full-size object: about 2 minutes instead of roughly half an hour).
BAKE_UPSTREAM = {"fill_holes_num_views": 1000, "fill_holes_resolution": 1024, "bake_views": 100,
                 "bake_resolution": 1024, "bake_steps": 2500, "texture_size": 1024}
BAKE_CPU = {"fill_holes_num_views": 100, "fill_holes_resolution": 512, "bake_views": 24,
            "bake_resolution": 512, "bake_steps": 300, "texture_size": 1024}


def bake_settings(device_type: str, views: Optional[int] = None, texture_size: Optional[int] = None,
                  steps: Optional[int] = None) -> Dict[str, int]:
    """``to_glb`` keywords for the device type ("cuda", "mps", "cpu"), with the user's knobs applied."""
    settings = dict(BAKE_UPSTREAM if device_type == "cuda" else BAKE_CPU)
    for key, value in (("bake_views", views), ("texture_size", texture_size), ("bake_steps", steps)):
        if value is not None:
            if int(value) < 1:
                raise ValueError(f"{key.replace('_', '-')} must be a positive integer, got {value}")
            settings[key] = int(value)
    return settings
