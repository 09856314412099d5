"""Fast mode (upstream's use_stage1/2_distillation), portable noise (noise_device) and compile=True, on the tiny
checkpoint. The stage-1 backbone is spied on with a forward pre-hook, as the golden samplers case does."""
import warnings

import pytest
import torch

from test_pipeline_tiny import SEED, case, tiny_folder  # noqa: F401  module-scoped fixtures

STEPS = 2


@pytest.fixture(scope="module")
def pipe(tiny_folder):  # noqa: F811
    from sam3d_objects.inference import Inference
    return Inference(str(tiny_folder / "pipeline.yaml"), low_memory=False).pipeline


def spy(module):
    """Records (x, t, d, cfg flag) of every call of ``module``."""
    calls = []

    def hook(_, args, kwargs):
        d = kwargs.get("d")
        calls.append({"x": {k: v.clone() for k, v in args[0].items()} if isinstance(args[0], dict) else args[0],
                      "t": float(args[1].reshape(-1)[0]), "d": None if d is None else float(d.reshape(-1)[0]),
                      "cfg": bool(kwargs.get("cfg", False))})

    return calls, module.register_forward_pre_hook(hook, with_kwargs=True)


def run_stage1(pipe, case, **options):  # noqa: F811
    inp, _ = case
    return pipe.run(inp["image_rgb"].numpy(), inp["mask"].numpy(), seed=SEED, stage1_only=True,
                    pointmap=inp["pointmap"].clone(), stage1_inference_steps=STEPS, **options)


def settings(generator):
    g = generator.reverse_fn
    return (generator.inference_steps, generator.no_shortcut, g.strength, g.strength_pm,
            getattr(generator, "noise_device", None))


def test_fast_mode_is_a_shortcut_without_guidance(pipe, case):  # noqa: F811
    generator = pipe._get("ss_generator")
    before = settings(generator)
    assert before[1] is True and before[2] > 0  # the yaml's plain flow matching with guidance
    calls, handle = spy(generator.reverse_fn.backbone)
    try:
        run_stage1(pipe, case)
        default_calls = list(calls)
        calls.clear()
        run_stage1(pipe, case, use_stage1_distillation=True)
    finally:
        handle.remove()
    # default: d = 0 and an unconditional (cfg) pass in the guidance interval
    assert all(c["d"] == 0.0 for c in default_calls) and any(c["cfg"] for c in default_calls)
    # fast mode: one conditional call per step with d = 1/steps (scaled by time_scale 1000), no unconditional pass
    assert len(calls) == STEPS
    assert all(c["d"] == pytest.approx(1000.0 / STEPS) and not c["cfg"] for c in calls)
    assert settings(generator) == before  # put back


def test_settings_restored_after_an_error(pipe, case):  # noqa: F811
    generator = pipe._get("ss_generator")
    before = settings(generator)

    def fail(*_):
        raise RuntimeError("boom")

    handle = generator.reverse_fn.backbone.register_forward_pre_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            run_stage1(pipe, case, use_stage1_distillation=True, noise_device="cpu")
    finally:
        handle.remove()
    assert settings(generator) == before


def test_stage2_distillation_turns_guidance_off(pipe, case):  # noqa: F811
    inp, _ = case
    generator = pipe._get("slat_generator")
    strength = generator.reverse_fn.strength
    assert strength > 0
    calls, handle = spy(generator.reverse_fn.backbone)
    try:
        out = pipe.run(inp["image_rgb"].numpy(), inp["mask"].numpy(), seed=SEED, pointmap=inp["pointmap"].clone(),
                       with_mesh_postprocess=False, with_texture_baking=False, decode_formats=["gaussian"],
                       stage1_inference_steps=1, stage2_inference_steps=2, use_stage1_distillation=True,
                       use_stage2_distillation=True)
    finally:
        handle.remove()
    assert len(calls) == 2 and not any(c["cfg"] for c in calls)
    assert generator.reverse_fn.strength == strength
    assert out["gs"].get_xyz.shape[0] > 0 and out["glb"] is None


def test_portable_noise_is_the_cpu_drawn_noise(pipe, case):  # noqa: F811
    generator = pipe._get("ss_generator")
    calls, handle = spy(generator.reverse_fn.backbone)
    try:
        run_stage1(pipe, case, noise_device="cpu")
    finally:
        handle.remove()
    torch.manual_seed(SEED)
    shapes = pipe.latent_shapes(generator)
    expected = {k: torch.randn(shapes[k], device="cpu") for k in sorted(shapes)}  # one draw per key, sorted
    for k, v in expected.items():
        assert torch.equal(calls[0]["x"][k].cpu(), v), k


def test_noise_device_draws_with_the_cpu_generator():
    """Independent of the device at hand: noise for a 'meta' model comes from the CPU generator only when asked."""
    from sam3d_objects.model.backbone.generator.flow_matching.model import FlowMatching
    gen = FlowMatching(torch.nn.Identity())
    state = torch.get_rng_state()
    assert gen.generate_noise((2, 3), "meta").device.type == "meta"
    assert torch.equal(torch.get_rng_state(), state)  # upstream: the device's own generator
    gen.noise_device = "cpu"
    torch.manual_seed(3)
    noise = gen.generate_noise({"a": (2, 3)}, "cpu")["a"]
    torch.manual_seed(3)
    assert torch.equal(noise, torch.randn(2, 3)) and not torch.equal(torch.get_rng_state(), state)


def test_inference_passes_fast_mode_through(tiny_folder, case):  # noqa: F811
    from sam3d_objects.inference import Inference
    inference = Inference(str(tiny_folder / "pipeline.yaml"), noise_device="cpu")
    assert inference.pipeline.noise_device == "cpu" and inference.pipeline.compile_model is False
    inp, _ = case
    out = inference(inp["image_rgb"].numpy(), inp["mask"].numpy(), seed=SEED, pointmap=inp["pointmap"].clone(),
                    stage1_only=True, use_stage1_distillation=True, stage1_inference_steps=1)
    assert "voxel" in out and out["voxel"].shape[1] == 3


# ------------------------------------------------------------------------------------------------------------
# compile
# ------------------------------------------------------------------------------------------------------------
def tiny_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def graph_only(gm, example_inputs):
    """A torch.compile backend that runs the captured graph (fast: no code generation)."""
    return gm.forward


def broken_backend(gm, example_inputs):
    raise RuntimeError("no compiler here")


def test_compile_wrapper_runs_the_captured_graph():
    from sam3d_objects.pipeline.compile_utils import compile_wrapper
    model, x = tiny_model(), torch.randn(3, 8)
    counted = []
    compiled = compile_wrapper(model.forward, backend=lambda gm, ex: counted.append(1) or gm.forward)
    with torch.no_grad():
        assert torch.allclose(compiled(x.t().contiguous().t()), model(x), atol=1e-6)
    assert counted == [1] and not compiled.state["eager"]


def test_compile_falls_back_with_exactly_one_warning():
    from sam3d_objects.pipeline import compile_utils
    compile_utils._warned_device_types.discard("cpu")
    models = [tiny_model(), tiny_model()]
    x = torch.randn(3, 8)
    eager = [m(x) for m in models]
    for i, m in enumerate(models):
        compile_utils.compile_model_forward(m, torch.device("cpu"), f"m{i}", backend=broken_backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = [m(x) for m in models] + [m(x) for m in models]
    assert len([w for w in caught if "torch.compile" in str(w.message)]) == 1
    assert all(torch.equal(o, e) for o, e in zip(out, eager + eager))


def test_compile_model_wraps_the_dense_models(tiny_folder):  # noqa: F811
    from sam3d_objects.inference import Inference
    pipe = Inference(str(tiny_folder / "pipeline.yaml"), compile=True).pipeline
    assert pipe.compile_model is True
    assert getattr(pipe._get("ss_decoder").forward, "compiled", None) is not None
    assert getattr(pipe._get("ss_generator").reverse_fn.backbone.forward, "compiled", None) is not None
    assert getattr(pipe._get("slat_decoder_gs").forward, "compiled", None) is None  # sparse: eager


@pytest.mark.slow
def test_compiled_stage1_matches_eager(tiny_folder, pipe, case):  # noqa: F811
    """Real inductor compile of the tiny models (minutes on a 2-core CPU)."""
    from sam3d_objects.inference import Inference
    compiled = Inference(str(tiny_folder / "pipeline.yaml"), compile=True, low_memory=False).pipeline
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run_stage1(compiled, case)
    assert len([w for w in caught if "torch.compile" in str(w.message)]) <= 1
    ref = run_stage1(pipe, case)
    for key in ("shape", "translation", "rotation", "scale"):
        assert torch.allclose(out[key], ref[key], rtol=1e-3, atol=1e-3), key


def test_cli_fast_and_portable_seed_reach_reconstruct(tiny_folder, tmp_path, monkeypatch):  # noqa: F811
    import numpy as np
    from PIL import Image
    from sam3d_objects import cli
    image = np.full((32, 32, 3), 128, np.uint8)
    mask = np.zeros((32, 32), np.uint8)
    mask[8:24, 8:24] = 255
    Image.fromarray(image).save(tmp_path / "image.png")
    Image.fromarray(mask).save(tmp_path / "mask.png")
    seen = []
    monkeypatch.setattr(cli, "reconstruct", lambda *a, **k: seen.append(k))
    base = ["reconstruct", str(tmp_path / "image.png"), "--mask", str(tmp_path / "mask.png"), "--out",
            str(tmp_path / "out"), "--checkpoints", str(tiny_folder), "--pointmap", "flat"]
    assert cli.main(base + ["--fast", "--portable-seed"]) == 0
    assert cli.main(base + ["--fast", "--steps", "2,3"]) == 0
    assert cli.main(base) == 0
    assert seen[0]["fast"] and seen[0]["portable_seed"] and seen[0]["steps"] == (4, None)
    assert not seen[0]["compile"]
    assert seen[1]["fast"] and seen[1]["steps"] == (2, 3) and not seen[1]["portable_seed"]
    assert not seen[2]["fast"] and seen[2]["steps"] == (None, None)
