"""Generators and classifier-free guidance with analytic backbones: noise order, time grids, Euler updates,
CFG formula and interval, the values of t and d handed to the backbone."""
import random

import numpy as np
import pytest
import torch
import torch.nn as nn

from sam3d_objects.model.backbone.generator.classifier_free_guidance import (
    ClassifierFreeGuidance, ClassifierFreeGuidanceWithExternalUnconditionalProbability)
from sam3d_objects.model.backbone.generator.flow_matching.model import FlowMatching, lognorm_sampler
from sam3d_objects.model.backbone.generator.shortcut.model import ShortCut

SHAPES = {"shape": (1, 4, 2), "scale": (1, 1, 3), "6drotation_normalized": (1, 1, 6), "translation": (1, 1, 3)}


class Recorder(nn.Module):
    """Velocity = cond_value (a number) + 0 * x, or 10 for the unconditional call; records every call."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, x, t, cond, d=None, cfg=False):
        self.calls.append({"t": t.clone(), "d": None if d is None else d.clone(), "cfg": cfg})
        value = 10.0 if cfg else float(cond)
        if isinstance(x, dict):
            return {k: torch.full_like(v, value) for k, v in x.items()}
        return torch.full_like(x, value)


def warp(t, r):
    return t / (1 + (r - 1) * (1 - t))


def test_noise_is_drawn_in_sorted_key_order():
    backbone = Recorder()
    gen = ShortCut(ClassifierFreeGuidance(backbone, strength=0.0, p_unconditional=0.0), inference_steps=1, no_shortcut=True)
    torch.manual_seed(7)
    x0 = gen.generate_noise(SHAPES, torch.device("cpu"))
    torch.manual_seed(7)
    expected = {k: torch.randn(SHAPES[k]) for k in sorted(SHAPES)}  # not the insertion order of SHAPES
    assert list(x0) == sorted(SHAPES)
    for k in SHAPES:
        torch.testing.assert_close(x0[k], expected[k], rtol=0, atol=0)


@pytest.mark.parametrize("steps,rescale", [(3, 3), (5, 3), (4, None)])
def test_shortcut_times_d_and_euler(steps, rescale):
    backbone = Recorder()
    gen = ShortCut(ClassifierFreeGuidance(backbone, strength=0.0, p_unconditional=0.0), inference_steps=steps, rescale_t=rescale,
                   no_shortcut=True)
    torch.manual_seed(0)
    out = gen(SHAPES, torch.device("cpu"), 2.0)
    torch.manual_seed(0)
    noise = {k: torch.randn(SHAPES[k]) for k in sorted(SHAPES)}
    grid = np.linspace(0, 1, steps + 1)
    grid = warp(grid, rescale) if rescale else grid
    assert [c["t"].dtype for c in backbone.calls] == [torch.float32] * steps
    np.testing.assert_allclose([c["t"].item() for c in backbone.calls], grid[:-1] * 1000, rtol=1e-6)
    assert all(c["d"].item() == 0.0 and c["d"].shape == (1,) for c in backbone.calls)  # d = 0 still passed
    for k in SHAPES:  # constant velocity 2 over t in [0, 1]
        torch.testing.assert_close(out[k], noise[k] + 2.0, rtol=1e-6, atol=1e-6)


def test_shortcut_mode_passes_step_size():
    backbone = Recorder()
    gen = ShortCut(ClassifierFreeGuidance(backbone, strength=0.0, p_unconditional=0.0), inference_steps=4, rescale_t=3,
                   no_shortcut=False)
    gen(SHAPES, torch.device("cpu"), 1.0)
    assert [c["d"].item() for c in backbone.calls] == [250.0] * 4


def test_flow_matching_times_are_float32_scalars():
    backbone = Recorder()
    gen = FlowMatching(ClassifierFreeGuidance(backbone, strength=0.0, p_unconditional=0.0), inference_steps=3)
    torch.manual_seed(1)
    out = gen((1, 5, 8), torch.device("cpu"), 0.5)
    torch.manual_seed(1)
    noise = torch.randn(1, 5, 8)
    assert all(c["t"].dim() == 0 and c["t"].dtype == torch.float32 for c in backbone.calls)
    assert all(c["d"] is None for c in backbone.calls)
    np.testing.assert_allclose([c["t"].item() for c in backbone.calls], [0, 1000 / 3, 2000 / 3], rtol=1e-6)
    torch.testing.assert_close(out, noise + 0.5)


@pytest.mark.parametrize("cls", [ClassifierFreeGuidance, ClassifierFreeGuidanceWithExternalUnconditionalProbability])
def test_cfg_formula_and_inclusive_interval(cls):
    backbone = Recorder()
    cfg = cls(backbone, strength=7.0, interval=[0, 500], unconditional_handling="add_flag").eval()
    x = torch.zeros(1, 2)
    out = cfg(x, torch.tensor([500.0]), 1.0)  # inside (inclusive edge)
    torch.testing.assert_close(out, torch.full((1, 2), (1 + 7.0) * 1.0 - 7.0 * 10.0))
    assert [c["cfg"] for c in backbone.calls] == [False, True]  # conditional first
    backbone.calls.clear()
    out = cfg(x, torch.tensor([500.001]), 1.0)  # outside
    torch.testing.assert_close(out, torch.full((1, 2), 1.0))
    assert [c["cfg"] for c in backbone.calls] == [False]


def test_cfg_dict_outputs_all_guided():
    backbone = Recorder()
    cfg = ClassifierFreeGuidance(backbone, strength=2.0, unconditional_handling="add_flag").eval()
    out = cfg({"a": torch.zeros(1), "b": torch.zeros(2)}, torch.tensor([0.0]), 3.0)
    for v in out.values():
        torch.testing.assert_close(v, torch.full_like(v, 3 * 3.0 - 2 * 10.0))


def test_cfg_zero_strength_makes_one_call():
    backbone = Recorder()
    cfg = ClassifierFreeGuidance(backbone, strength=0.0, unconditional_handling="add_flag").eval()
    cfg(torch.zeros(1), torch.tensor([0.0]), 1.0)
    assert len(backbone.calls) == 1


def test_unconditional_handling_is_bound_at_construction():
    class Zeros(nn.Module):
        def forward(self, x, t, cond, cfg=False):
            return torch.full_like(x, 100.0 if cfg else float(cond.sum()))

    cfg = ClassifierFreeGuidance(Zeros(), strength=1.0, unconditional_handling="zeros").eval()
    cfg.unconditional_handling = "add_flag"  # the pipeline does this; the bound handler stays "zeros"
    out = cfg(torch.zeros(1), torch.tensor([0.0]), torch.ones(3))
    torch.testing.assert_close(out, torch.full((1,), 2 * 3.0 - 0.0))


def test_external_probability_wrapper_uses_python_rng_only():
    backbone = Recorder()
    cfg = ClassifierFreeGuidanceWithExternalUnconditionalProbability(backbone, strength=1.0,
                                                                     unconditional_handling="add_flag").eval()
    random.seed(3)
    torch.manual_seed(3)
    cfg(torch.zeros(1), torch.tensor([0.0]), 1.0)
    after_call = torch.randn(2)
    reference = random.Random(3)
    reference.random()
    assert random.random() == reference.random()  # exactly one Python draw happened
    torch.manual_seed(3)
    assert torch.equal(after_call, torch.randn(2))  # torch RNG untouched


def test_unknown_handling_and_steps_are_refused():
    with pytest.raises(ValueError, match="unconditional_handling"):
        ClassifierFreeGuidance(Recorder(), unconditional_handling="drop")
    gen = FlowMatching(ClassifierFreeGuidance(Recorder()), inference_steps=0)
    with pytest.raises(ValueError, match="inference_steps"):
        gen((1, 2), torch.device("cpu"), 0.0)


def test_lognorm_sampler_range():
    torch.manual_seed(0)
    t = lognorm_sampler(1000, mean=-1.0, std=1.0)
    assert t.shape == (1000,) and (t > 0).all() and (t < 1).all()
    assert abs(torch.logit(t).mean().item() + 1.0) < 0.15


@pytest.mark.parametrize("stage, guided", [("ss", 19), ("slat", 13)])
def test_release_defaults_guide_only_inside_the_interval(stage, guided):
    """25 steps with upstream's pipeline settings: the unconditional pass runs only where t * 1000 <= 500, i.e. at
    the first 19 stage-1 times (warp r = 3: i / 25 <= 0.75) and the first 13 stage-2 times (no warp: i / 25 <=
    0.5); every other step is one conditional call. That is upstream's whole saving from its cfg interval."""
    backbone = Recorder()
    cfg = ClassifierFreeGuidance(backbone, strength=7.0 if stage == "ss" else 1.0, interval=[0, 500],
                                 unconditional_handling="add_flag").eval()
    if stage == "ss":
        gen = ShortCut(cfg, inference_steps=25, rescale_t=3, no_shortcut=True)
        gen(SHAPES, torch.device("cpu"), 1.0)
    else:
        gen = FlowMatching(cfg, inference_steps=25, rescale_t=1)
        gen((1, 5, 8), torch.device("cpu"), 1.0)
    flags = [c["cfg"] for c in backbone.calls]
    assert flags.count(False) == 25 and flags.count(True) == guided
    unconditional_times = [c["t"].item() for c in backbone.calls if c["cfg"]]
    assert max(unconditional_times) <= 500 and len(flags) == 25 + guided
