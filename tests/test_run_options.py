"""Run options in one object (``sam3d_objects.pipeline.run_options``): the CLI's and the API's ``seed`` and
``steps`` reach the sampler inside one ``RunOptions``; a seeded run draws upstream's numbers from its own
generator and leaves the global random state alone; one spelling of the noise device; defaults written once."""
import ast
import inspect
import warnings

import numpy as np
import pytest
import torch

from conftest import ROOT
from test_pipeline_tiny import SEED, case, tiny_folder  # noqa: F401  module-scoped fixtures

from sam3d_objects.pipeline import run_options as ro
from sam3d_objects.pipeline.run_options import NOTEBOOK_RUN_OPTIONS, RunOptions, resolve_noise_device


@pytest.fixture(scope="module")
def pipe(tiny_folder):  # noqa: F811
    from sam3d_objects.inference import Inference
    return Inference(str(tiny_folder / "pipeline.yaml"), low_memory=False).pipeline


def spy_sampler(monkeypatch):
    """Records (stage, options, rng) of every sampler set-up (the pipeline's ``_sampler``)."""
    from sam3d_objects.pipeline.inference_pipeline import InferencePipeline
    seen = []
    original = InferencePipeline._sampler

    def recording(self, name, options, rng=None):
        seen.append((name, options, rng))
        return original(self, name, options, rng)
    monkeypatch.setattr(InferencePipeline, "_sampler", recording)
    return seen


def stage1(pipe, case, **options):  # noqa: F811
    inp, _ = case
    return pipe.run(inp["image_rgb"].numpy(), inp["mask"].numpy(), stage1_only=True, pointmap=inp["pointmap"].clone(),
                    stage1_inference_steps=2, **options)


# ---------------------------------------------------------------------------------------------------------------
# the parameter walk: CLI / API -> one RunOptions -> sampler
# ---------------------------------------------------------------------------------------------------------------
def test_cli_seed_and_steps_reach_the_sampler_in_one_object(tiny_folder, tmp_path, monkeypatch):  # noqa: F811
    from sam3d_objects import cli, reconstruction
    from sam3d_objects.assets.example import EXAMPLE_DIR
    seen = spy_sampler(monkeypatch)
    runs = []
    build = reconstruction.run_options

    def recording_build(*args, **kwargs):
        runs.append(build(*args, **kwargs))
        return runs[-1]
    monkeypatch.setattr(reconstruction, "run_options", recording_build)
    code = cli.main(["reconstruct", str(EXAMPLE_DIR / "image.png"), "--mask", str(EXAMPLE_DIR / "0.png"), "--out",
                     str(tmp_path / "out"), "--checkpoints", str(tiny_folder), "--pointmap", "flat", "--seed", "7",
                     "--steps", "2,3", "--formats", "gaussian", "--no-progress"])
    assert code == 0
    assert [name for name, _, _ in seen] == ["ss_generator", "slat_generator"]
    (options,) = runs  # built once from the command line ...
    assert isinstance(options, RunOptions)
    # ... handed to upstream's run() as its keywords, which holds them as one RunOptions again down to both samplers
    assert seen[0][1] is seen[1][1] and seen[0][1] == options
    assert (options.seed, options.stage1_inference_steps, options.stage2_inference_steps) == (7, 2, 3)
    assert options.decode_formats == ("gaussian",) and options.use_vertex_color  # the notebook's keywords
    assert seen[0][2] is seen[1][2] is not None  # one seeded generator for both stages
    assert seen[0][2].initial_seed() == 7


def test_api_keywords_become_one_run_options(monkeypatch):
    from sam3d_objects.inference import Inference

    class Pipeline:
        def run(self, image, mask=None, pointmap=None, **keywords):
            self.options, self.pointmap = RunOptions(**keywords), pointmap
            return {}
    inference = object.__new__(Inference)
    inference._pipeline = Pipeline()
    image, mask = np.zeros((8, 8, 3), np.uint8), np.ones((8, 8), bool)
    inference(image, mask, seed=3, stage1_inference_steps=2, use_stage1_distillation=True)
    got = inference._pipeline.options
    assert got == NOTEBOOK_RUN_OPTIONS.replace(seed=3, stage1_inference_steps=2, use_stage1_distillation=True)
    inference(image, mask, preset="fast")
    assert inference._pipeline.options.seed is None  # upstream's Inference.__call__ default: no reseeding
    assert inference._pipeline.options.stage2_inference_steps == 4
    given = RunOptions(seed=5, stage1_only=True)
    inference(image, mask, options=given)
    assert inference._pipeline.options == given
    inference(image, mask, seed=9, options=given)
    assert inference._pipeline.options == given.replace(seed=9)
    with pytest.raises(TypeError, match="unknown run option"):
        inference(image, mask, stage_1_steps=3)
    with pytest.raises(TypeError, match="seed must be an int"):
        inference(image, mask, seed=1.5)


def test_run_keywords_and_run_with_options_are_the_same_run(pipe, case, monkeypatch):  # noqa: F811
    seen = spy_sampler(monkeypatch)
    inp, _ = case
    by_keywords = stage1(pipe, case, seed=SEED)
    by_options = pipe.run_with_options(inp["image_rgb"].numpy(), inp["mask"].numpy(),
                                       RunOptions(seed=SEED, stage1_only=True, stage1_inference_steps=2),
                                       pointmap=inp["pointmap"].clone())
    assert seen[0][1] == seen[1][1]
    for key in ("shape", "translation", "rotation", "scale"):
        assert torch.equal(by_keywords[key], by_options[key]), key


# ---------------------------------------------------------------------------------------------------------------
# the run's generator
# ---------------------------------------------------------------------------------------------------------------
def global_states(device: torch.device):
    """The global random states of the CPU and of ``device``."""
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    elif device.type == "mps":
        states.append(torch.mps.get_rng_state())
    return states


def same_states(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_seeded_run_gives_upstreams_numbers_and_leaves_the_global_rng_alone(pipe, case):  # noqa: F811
    torch.manual_seed(1234)
    states = global_states(pipe.device)
    seeded = stage1(pipe, case, seed=SEED)
    assert same_states(global_states(pipe.device), states)  # the global generators were not touched
    # upstream: torch.manual_seed(seed), then the global generator's draws (seed=None reseeds nothing)
    torch.manual_seed(SEED)
    upstream_way = stage1(pipe, case, seed=None)
    for key in ("shape", "translation", "rotation", "scale", "coords"):
        assert torch.equal(seeded[key], upstream_way[key]), key
    torch.manual_seed(1234)
    stage1(pipe, case, seed=None)
    assert not same_states(global_states(pipe.device), states)  # an unseeded run draws from the global generator


def test_unseeded_runs_follow_torch_manual_seed(pipe, case):  # noqa: F811
    torch.manual_seed(5)
    first = stage1(pipe, case, seed=None)
    torch.manual_seed(5)
    again = stage1(pipe, case, seed=None)
    other = stage1(pipe, case, seed=None)  # the global generator moved on
    assert torch.equal(first["shape"], again["shape"]) and not torch.equal(first["shape"], other["shape"])


def test_portable_noise_run_uses_a_cpu_generator(pipe, case, monkeypatch):  # noqa: F811
    seen = spy_sampler(monkeypatch)
    states = global_states(pipe.device)
    stage1(pipe, case, seed=SEED, noise_device="cpu")
    assert seen[0][2].device.type == "cpu" and seen[0][2].initial_seed() == SEED
    assert same_states(global_states(pipe.device), states)


def test_flow_matching_draws_from_the_given_generator():
    from sam3d_objects.model.backbone.generator.flow_matching.model import FlowMatching
    gen = FlowMatching(torch.nn.Identity())
    gen.noise_generator = torch.Generator().manual_seed(11)
    state = torch.get_rng_state()
    noise = gen.generate_noise({"b": (2, 3), "a": (4,)}, "cpu")
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(11)
    assert torch.equal(noise["a"], torch.randn(4)) and torch.equal(noise["b"], torch.randn(2, 3))  # sorted keys


def test_generator_is_seeded_on_the_noise_device():
    assert RunOptions(seed=None).generator("cpu") is None
    g = RunOptions(seed=2 ** 40 + 3).generator("cpu")
    torch.manual_seed(2 ** 40 + 3)
    assert torch.equal(torch.randn(5, generator=g), torch.randn(5))


# ---------------------------------------------------------------------------------------------------------------
# noise device spellings
# ---------------------------------------------------------------------------------------------------------------
def test_one_spelling_of_the_noise_device():
    assert resolve_noise_device("cpu") == "cpu" and resolve_noise_device("device") == "device"
    assert resolve_noise_device("auto", "cpu") == "cpu" and resolve_noise_device(None, "device") == "device"
    with pytest.warns(DeprecationWarning, match="pipeline"):
        assert resolve_noise_device("pipeline", "cpu") == "cpu"
    with pytest.raises(ValueError, match="'device'.*'cpu'"):
        resolve_noise_device("gpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert RunOptions(noise_device=None).noise_device == "auto"
    with pytest.warns(DeprecationWarning):
        assert RunOptions(noise_device="pipeline").noise_device == "auto"


def test_pipeline_and_run_noise_device(pipe, case, monkeypatch):  # noqa: F811
    assert pipe.noise_device == "device"
    seen = spy_sampler(monkeypatch)
    stage1(pipe, case, seed=SEED)
    with pytest.warns(DeprecationWarning):
        stage1(pipe, case, seed=SEED, noise_device="pipeline")
    assert seen[0][1].noise_device == seen[1][1].noise_device == "auto"
    assert pipe._noise_device(seen[0][1]) == "device"


# ---------------------------------------------------------------------------------------------------------------
# defaults written once
# ---------------------------------------------------------------------------------------------------------------
def _default(function, name):
    return inspect.signature(function).parameters[name].default


def test_defaults_come_from_one_place():
    from sam3d_objects import batch, cli
    from sam3d_objects.pipeline.inference_pipeline import InferencePipeline
    from sam3d_objects.pipeline.inference_pipeline_pointmap import InferencePipelinePointMap
    assert RunOptions().seed == ro.DEFAULT_SEED == _default(InferencePipeline.run, "seed") == \
        _default(cli.reconstruct, "seed") == 42  # upstream's InferencePipeline.run and demo.py
    # upstream's API and point-map run do not reseed unless asked
    assert _default(InferencePipelinePointMap.run, "seed") is None and NOTEBOOK_RUN_OPTIONS.seed is None
    parser = cli.build_parser()
    assert parser.parse_args(["reconstruct", "x.png", "--mask", "m.png", "--out", "o"]).seed == ro.DEFAULT_SEED
    import argparse
    sub = argparse.ArgumentParser().add_subparsers()
    assert batch.add_parser(sub).parse_args(["photos", "--out", "o"]).seed == ro.DEFAULT_SEED
    for name in ("ss_inference_steps", "slat_inference_steps"):
        assert _default(InferencePipeline.__init__, name) == ro.DEFAULT_INFERENCE_STEPS == 25
    assert _default(InferencePipeline.sample_slat, "inference_steps") == ro.DEFAULT_INFERENCE_STEPS
    # the run keywords of both run()s are RunOptions fields with the same defaults (seed aside, see above)
    for run in (InferencePipeline.run, InferencePipelinePointMap.run):
        for name, parameter in inspect.signature(run).parameters.items():
            if name in ro.FIELD_NAMES and name != "seed":
                assert parameter.default == getattr(RunOptions(), name), (run.__qualname__, name)


def test_no_literal_seed_or_step_defaults_outside_run_options():
    """42 (seed) and 25 (steps) as defaults are written in run_options.py only."""
    found = []
    for rel in ("sam3d_objects/cli.py", "sam3d_objects/batch.py", "sam3d_objects/app.py",
                "sam3d_objects/inference.py", "sam3d_objects/pipeline/inference_pipeline.py",
                "sam3d_objects/pipeline/inference_pipeline_pointmap.py"):
        tree = ast.parse((ROOT / rel).read_text())
        for node in ast.walk(tree):
            defaults = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defaults = node.args.defaults + [d for d in node.args.kw_defaults if d is not None]
            elif isinstance(node, ast.Call):
                defaults = [k.value for k in node.keywords if k.arg in ("default", "value")]
            found += [f"{rel}:{d.lineno}" for d in defaults
                      if isinstance(d, ast.Constant) and type(d.value) is int and d.value in (25, 42)]
    assert not found, found


def test_keywords_of_a_run():
    from sam3d_objects.pipeline.inference_pipeline import InferencePipeline
    from sam3d_objects.pipeline.inference_pipeline_pointmap import InferencePipelinePointMap
    options = RunOptions(seed=3, stage2_inference_steps=5)
    keywords = options.keywords(InferencePipeline.run)
    assert "estimate_plane" not in keywords and keywords["seed"] == 3 and keywords["stage2_inference_steps"] == 5
    assert RunOptions.from_call(InferencePipeline.run, keywords) == options
    assert set(options.keywords(InferencePipelinePointMap.run)) == set(ro.FIELD_NAMES)
    with pytest.raises(TypeError, match="estimate_plane"):
        RunOptions(estimate_plane=True).keywords(InferencePipeline.run)


def test_a_wrapped_run_keeps_the_callers_options(monkeypatch):
    """A research script that wraps ``run`` with a plain decorator (no functools.wraps) still runs with the
    options it passes: run reads them from its own locals, not from the (now wrapped) class attribute."""
    from sam3d_objects.pipeline.inference_pipeline_pointmap import InferencePipelinePointMap
    seen = []
    real = InferencePipelinePointMap.run

    def timed(self, *args, **kwargs):
        return real(self, *args, **kwargs)
    monkeypatch.setattr(InferencePipelinePointMap, "run", timed)
    monkeypatch.setattr(InferencePipelinePointMap, "run_with_options",
                        lambda self, image, mask=None, options=None, pointmap=None: seen.append(options))
    InferencePipelinePointMap.run(object.__new__(InferencePipelinePointMap), None, seed=7,
                                  with_texture_baking=False, with_mesh_postprocess=False, stage2_inference_steps=3)
    (options,) = seen
    assert (options.seed, options.with_texture_baking, options.with_mesh_postprocess,
            options.stage2_inference_steps) == (7, False, False, 3)
