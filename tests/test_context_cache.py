"""The condition's key / value projections reused across sampling steps (``modules.attention.context_cache``):
the backbones' outputs bit for bit those without the cache, in float32 and under CPU bfloat16 autocast, with one
projection of the condition per layer for a whole run; nothing kept after it; not with autograd."""
import pytest
import torch

from sam3d_objects.model.backbone.tdfy_dit.modules.attention.context_cache import cached_condition
from test_cuda_graphs import _tiny_mot_flow, _tiny_slat_flow


def _count_projections(model, counts):
    """Forward hooks counting each to_kv call by its context length (hooks only for counting: the test calls
    ``cached_condition`` itself, the pipeline leaves it off when hooks are present)."""
    return [m.to_kv.register_forward_hook(lambda mod, args, out: counts.append(args[0].shape[-2]))
            for m in model.modules() if getattr(m, "_type", None) == "cross" and hasattr(m, "to_kv")]


def _steps(model, call, steps=3):
    return [call(model, step) for step in range(steps)]


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("kind", ["stage1", "stage2"])
def test_cached_condition_reuses_the_projection_with_the_same_outputs(kind, autocast):
    g = torch.Generator().manual_seed(11)
    cond = torch.randn(1, 5, 16, generator=g) * 2
    if kind == "stage1":
        model = _tiny_mot_flow()
        latents = {"shape": torch.randn(1, 64, 8, generator=g), "translation": torch.randn(1, 1, 3, generator=g)}
        d = torch.tensor([0.25])

        def call(m, step):  # a conditional and an unconditional call per step, as guidance makes them
            t = torch.tensor([900.0 - 300 * step])
            return m(latents, t, cond, d=d)["shape"], m(latents, t, cond, cfg=True, d=d)["shape"]
    else:
        model, coords = _tiny_slat_flow()
        x = torch.randn(1, coords.shape[0], 8, generator=g)

        def call(m, step):
            t = torch.tensor([900.0 - 300 * step])
            return m(x, t, cond, coords), m(x, t, cond, coords, cfg=True)
    counts = []
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        hooks = _count_projections(model, counts)
        plain = _steps(model, call)
        per_run = [n for n in counts if n == cond.shape[1]]  # three steps' projections of the whole condition
        counts.clear()
        with cached_condition(model):
            cached = _steps(model, call)
        for h in hooks:
            h.remove()
        assert not any("_condition_cache" in vars(m) for m in model.modules())  # nothing kept after the run
    for a, b in zip(plain, cached):
        for x_plain, x_cached in zip(a, b):
            assert torch.equal(x_plain, x_cached)
    full = [n for n in counts if n == cond.shape[1]]
    # once per projecting layer for the three steps (stage 1's one-token pose stream goes through the condition)
    assert len(per_run) == 3 * len(full) and len(full) >= 1


def test_cached_condition_stays_off_with_autograd_and_for_a_changed_condition():
    model, coords = _tiny_slat_flow()
    g = torch.Generator().manual_seed(12)
    cond, x = torch.randn(1, 5, 16, generator=g), torch.randn(1, coords.shape[0], 8, generator=g)
    t = torch.tensor([500.0])
    counts = []
    hooks = _count_projections(model, counts)
    layers = len(hooks)
    with cached_condition(model):
        model(x, t, cond, coords)  # autograd on: no reuse
        model(x, t, cond, coords)
        assert len(counts) == 2 * layers
        with torch.no_grad():
            first = model(x, t, cond, coords)
            cond.mul_(2)  # changed in place: projected again, the result follows
            second = model(x, t, cond, coords)
            again = model(x, t, cond, coords)
    for h in hooks:
        h.remove()
    assert len(counts) == 4 * layers
    assert not torch.equal(first, second) and torch.equal(second, again)


@pytest.mark.parametrize("device,low_memory,hooked,active", [
    ("cpu", False, False, True), ("cpu", True, False, False), ("cuda", False, False, False), ("cpu", False, True, False)])
def test_pipeline_turns_the_cache_on_where_models_stay_loaded_off_the_gpu(device, low_memory, hooked, active):
    """The pipeline's sampling runs reuse the projections on the CPU (and MPS) with the models kept loaded, and
    not in low-memory mode, on CUDA (the graphs hold the projection) or with a hook on the backbone."""
    from types import SimpleNamespace

    from sam3d_objects.pipeline.inference_pipeline import InferencePipeline
    model, _ = _tiny_slat_flow()
    if hooked:
        model.blocks[0].register_forward_hook(lambda *a: None)
    pipeline = SimpleNamespace(device=torch.device(device), low_memory=low_memory)
    generator = SimpleNamespace(reverse_fn=SimpleNamespace(backbone=model))
    with InferencePipeline._condition_cache(pipeline, generator):
        assert ("_condition_cache" in vars(model)) == active
    assert "_condition_cache" not in vars(model)


def test_cached_condition_under_inference_mode_computes_as_usual():
    """Inference-mode tensors carry no version counter (an in-place change could not be told): the cache steps
    aside for them, and the calls compute as without it."""
    model, coords = _tiny_slat_flow()
    g = torch.Generator().manual_seed(13)
    x, t = torch.randn(1, coords.shape[0], 8, generator=g), torch.tensor([500.0])
    with torch.inference_mode():
        cond = torch.randn(1, 5, 16, generator=g)
        plain = model(x, t, cond, coords)
        with cached_condition(model), torch.autocast("cpu", dtype=torch.bfloat16):
            cached = [model(x, t, cond, coords) for _ in range(2)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            reference = model(x, t, cond, coords)
    assert torch.equal(cached[0], reference) and torch.equal(cached[1], reference)
    assert plain.shape == reference.shape
