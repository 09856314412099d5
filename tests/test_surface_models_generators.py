"""Upstream-surface generators and config helpers: Base RNG handling, ODE solvers vs hand-computed steps,
flow-matching / shortcut training losses on small inputs, likelihood of a known flow, noise overrides, CFG
handlers and strength schedule, point-map guidance formula, config.utils."""
import math
import random

import pytest
import torch
import torch.nn as nn
from omegaconf import OmegaConf

from sam3d_objects.config import utils as cu
from sam3d_objects.model.backbone.generator import classifier_free_guidance as cfgm
from sam3d_objects.model.backbone.generator.base import Base
from sam3d_objects.model.backbone.generator.flow_matching import solver as S
from sam3d_objects.model.backbone.generator.flow_matching.model import (
    ConditionalFlowMatching, FlowMatching, lognorm_sampler, rev_lognorm_sampler)
from sam3d_objects.model.backbone.generator.shortcut.model import ShortCut


def test_base_seed_and_generator():
    b = Base(5)
    with pytest.raises(AttributeError, match="Cannot read"):
        b.seed
    a = torch.rand(3, generator=b.random_generator)
    assert torch.equal(a, torch.rand(3, generator=torch.Generator().manual_seed(5)))
    assert Base().random_generator is torch.default_generator
    with pytest.raises(RuntimeError, match="cannot use argument"):
        Base("seed")
    with pytest.raises(NotImplementedError):
        Base().generate((1,), "cpu")


def f_linear(x, t, *args, **kwargs):
    return -2.0 * x + t


@pytest.mark.parametrize("solver", [S.Euler(), S.Midpoint(), S.RungeKutta4()])
def test_solvers_single_step_by_hand(solver):
    x, t, dt = torch.tensor([1.5, -0.5]), 0.2, 0.1
    k1 = f_linear(x, t)
    if isinstance(solver, S.Euler):
        expected = x + dt * k1
    elif isinstance(solver, S.Midpoint):
        expected = x + dt * f_linear(x + dt / 2 * k1, t + dt / 2)
    else:
        k2 = f_linear(x + dt / 2 * k1, t + dt / 2)
        k3 = f_linear(x + dt / 2 * k2, t + dt / 2)
        k4 = f_linear(x + dt * k3, t + dt)
        expected = x + dt * (k1 + 2 * k2 + 2 * k3 + k4) / 6
    torch.testing.assert_close(solver.step(f_linear, x, t, dt), expected)
    steps = list(solver.solve_iter(lambda s, t: {"a": f_linear(s["a"], t)}, {"a": x}, torch.tensor([0.0, 0.5, 1.0])))
    assert [float(t0) for _, t0 in steps] == [0.0, 0.5]  # the start time of each step


def test_rk4_integrates_exponential_accurately():
    out = S.RungeKutta4().solve(lambda x, t: x, torch.tensor([1.0], dtype=torch.float64),
                                torch.linspace(0, 1, 11, dtype=torch.float64))
    assert abs(out.item() - math.e) < 1e-5


def test_gradient_and_sde_step():
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    torch.testing.assert_close(S.gradient((x ** 2).sum(), x), 2 * x.detach())
    torch.manual_seed(0)
    y = S.SDE(sde_strength=0.0).step(lambda x, t: torch.ones_like(x), torch.zeros(4), 0.5, 0.1)
    torch.testing.assert_close(y, torch.full((4,), 0.1))  # zero strength = Euler


def test_samplers():
    t = lognorm_sampler(mean=0.0, std=1.0, size=(500,), generator=torch.Generator().manual_seed(0))
    r = rev_lognorm_sampler(mean=0.0, std=1.0, size=(500,), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(t + r, torch.ones(500))


class Linear(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(0.5))

    def forward(self, x, t, *args, d=None, p_unconditional=None, **kwargs):
        return {k: v * self.w for k, v in x.items()} if isinstance(x, dict) else x * self.w


def test_flow_matching_loss_matches_formula():
    torch.manual_seed(0)
    fm = FlowMatching(Linear(), training_time_sampler_fn=lambda size, generator: torch.full(size, 0.25),
                      loss_weights={"a": 2.0, "b": 0.5})
    x1 = {"a": torch.randn(3, 2, 4), "b": torch.randn(3, 1, 2)}
    torch.manual_seed(1)
    total, detail = fm.loss(x1)
    torch.manual_seed(1)
    x0 = {k: torch.randn_like(x1[k]) for k in sorted(x1)}
    expected = 0
    for k, w in (("a", 2.0), ("b", 0.5)):
        xt = 0.75 * x0[k] + 0.25 * x1[k]
        expected = expected + w * ((0.5 * xt - (x1[k] - x0[k])) ** 2).mean()
    torch.testing.assert_close(total, expected)
    assert set(detail) == {"flow_matching_loss", "a", "b"}
    total.backward()
    assert fm.reverse_fn.w.grad is not None


def test_log_likelihood_of_a_gaussian_flow():
    # v(x, t) = x * s / (1 + s t) carries N(0, 1) at t=0 to N(0, (1 + s)^2) at t=1: exact log density known
    s = 1.0

    class Scale(nn.Module):
        def forward(self, x, t):
            tt = t / 1000.0
            return x * s / (1 + s * tt)
    fm = FlowMatching(Scale(), solver_method="rk4")
    x1 = torch.tensor([[0.3, -1.2], [2.0, 0.1]])
    logp = fm.log_likelihood(x1, steps=50, z_samples=1)
    sigma = 1 + s
    exact = (-0.5 * (x1 / sigma) ** 2 - math.log(sigma) - 0.5 * math.log(2 * math.pi)).sum(1)
    torch.testing.assert_close(logp, exact, atol=1e-3, rtol=1e-3)


def test_conditional_flow_matching_holds_overridden_latents():
    gen = ConditionalFlowMatching(Linear(), inference_steps=3)
    fixed = torch.ones(1, 2)
    out = gen({"a": (1, 2), "b": (1, 3)}, "cpu", noise_override={"a": fixed})
    assert torch.equal(out["a"], fixed) and out["b"].shape == (1, 3)
    with pytest.raises(ValueError, match="solver_method"):
        FlowMatching(Linear(), solver_method="heun")


class CondNet(nn.Module):
    """Velocity: cond for conditional calls (p_unconditional < 1), 0 for unconditional ones; x-independent."""

    def forward(self, x, t, cond, d=None, p_unconditional=None):
        value = 0.0 if p_unconditional == 1.0 else 1.0
        return {k: torch.full_like(v, value) * cond[:, None, None] for k, v in x.items()}


def test_shortcut_self_consistency_target_and_loss():
    random.seed(0)
    torch.manual_seed(0)
    sc = ShortCut(CondNet(), self_consistency_cfg_strength=2.0, ratio_cfg_samples_in_self_consistency_target=0.5,
                  cfg_modalities=["shape"])
    x = {"shape": torch.zeros(4, 2, 3), "pose": torch.zeros(4, 1, 3)}
    cond = torch.tensor([1.0, 2.0, 3.0, 4.0])
    target = sc.compute_self_consistency_target(x, torch.full((4,), 0.1), torch.full((4,), 0.25), cond)
    # two CFG samples: (1 + 2) * c - 2 * 0 = 3c; the rest conditional: c (both half steps equal)
    expected = torch.tensor([3.0, 6.0, 3.0, 4.0])
    torch.testing.assert_close(target["shape"][:, 0, 0], expected)
    sc.self_consistency_prob = 0.5
    total, detail = sc.loss({"shape": torch.randn(4, 2, 3), "pose": torch.randn(4, 1, 3)}, cond)
    assert set(detail) == {"flow_matching_loss", "self_consistency_loss"} and torch.isfinite(total)
    assert sc.no_shortcut is False and sc.cfg_modalities == ["shape"]


def test_cfg_handlers():
    args, kwargs = (torch.ones(2), "keep", [torch.ones(1)]), {"c": torch.ones(3), "n": 4}
    z_args, z_kwargs = cfgm.zero_out(args, kwargs)
    assert not z_args[0].any() and z_args[1] == "keep" and not z_args[2][0].any() and z_kwargs["n"] == 4
    assert cfgm.discard(args, kwargs) == ((), {})
    d_args, d_kwargs = cfgm.drop_tensors(args, kwargs)
    assert d_args == ("keep", []) and d_kwargs == {"n": 4}
    kw = {}
    assert cfgm.add_flag((), kw)[1] is kw and kw == {"cfg": True}


def test_get_strength_schedule():
    assert cfgm.get_strength(3.0, None, 10.0) == 0.0  # no interval: guidance off (upstream's rule)
    assert cfgm.get_strength(3.0, (0, 500), torch.tensor([500.0])) == 3.0
    assert cfgm.get_strength({"a": 1.0, "b": 2.0}, {"a": (0, 5), "b": (6, 9)}, 5.0) == {"a": 1.0, "b": 0.0}


def test_pointmap_cfg_formula():
    class Fuser:
        force_drop_modalities = None

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.condition_embedder = Fuser()

        def forward(self, x, t, cond, cfg=False):
            if cfg:
                return torch.full_like(x, 1.0)
            return torch.full_like(x, 5.0 if self.condition_embedder.force_drop_modalities else 10.0)

    cfg = cfgm.PointmapCFG(Net(), strength=2.0, strength_pm=3.0, interval=(0, 1000),
                           unconditional_handling="add_flag").eval()
    out = cfg(torch.zeros(2), torch.tensor([1.0]), torch.ones(1))
    # y_cond + s_pm (y_cond - y_pm) + s (y_pm - y_uncond) = 10 + 3 * 5 + 2 * 4
    torch.testing.assert_close(out, torch.full((2,), 33.0))
    assert cfg.backbone.condition_embedder.force_drop_modalities is None  # restored
    ext = cfgm.ClassifierFreeGuidanceWithExternalUnconditionalProbability(
        Net(), strength=2.0, interval=(0, 1000), unconditional_handling="add_flag",
        use_unconditional_from_flow_matching=True).eval()
    ext.strength_pm = 3.0  # as the pipeline sets it
    torch.testing.assert_close(ext(torch.zeros(2), torch.tensor([1.0]), torch.ones(1)), torch.full((2,), 33.0))
    with pytest.raises(RuntimeError, match="discard"):
        cfg(torch.zeros(2), torch.tensor([1.0]))


def test_config_utils():
    assert cu.locate("sam3d_objects.config.utils.make_tuple") is cu.make_tuple
    assert cu.locate("torch.nn.Linear") is nn.Linear
    with pytest.raises(ImportError):
        cu.locate("")
    with pytest.raises(ImportError):
        cu.locate("no_such_package_xyz.thing")
    assert cu.full_class_name(nn.Linear) == "torch.nn.modules.linear.Linear"
    assert cu.full_class_name(int) == "int" and cu.full_instance_name(3) == "int"
    with pytest.raises(RuntimeError, match="should be a subclass"):
        cu.find_and_ensure_is_subclass("torch.nn.Linear", nn.Conv2d)
    with pytest.raises(ValueError, match="Invalid type"):
        cu.find_class_or_callable_from_target("math.pi")
    p = cu.StrictPartial("sam3d_objects.config.utils.make_dict", path="kept")
    assert p(a=1) == {"path": "kept", "a": 1}
    assert cu.Partial(path="sam3d_objects.config.utils.make_tuple")(1, 2) == (1, 2)
    rp = cu.RecursivePartial(OmegaConf.create({"_target_": "sam3d_objects.config.utils.make_dict",
                                               "inner": {"_rpartial_target_": "sam3d_objects.config.utils.make_set"}}))
    assert rp.config.inner._target_ == "sam3d_objects.config.utils.make_set"
    assert cu.make_list_from_kwargs(a=1, b=None, c=3) == [1, 3] and cu.make_set(1, 1, 2) == {1, 2}
    assert cu.subkey({"k": 1}, "k") == 1 and cu.get_attr(nn.Linear, "__name__") == "Linear"
    assert cu.make_string(3) == "3" and cu.get_item([4, 5], 1) == 5


def test_dump_config(tmp_path):
    cu.dump_config(OmegaConf.create({"b": 1, "a": 2}), str(tmp_path / "c.yaml"))
    assert (tmp_path / "c.yaml").read_text() == "a: 2\nb: 1\n"
