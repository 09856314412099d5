"""Research-code access to the pipeline's internals, on the tiny upstream-format checkpoint: forward hooks on
``pipeline.models[...]`` / ``pipeline.condition_embedders[...]`` (also across low-memory unloads), per-stage
attributes changed between runs (step counts asserted by counting backbone calls), upstream's private helpers,
and the hooked intermediates and the mesh's vertex / face order against the golden pipeline_tiny case (recorded
from Meta's package)."""
import numpy as np
import pytest
import torch

from test_pipeline_tiny import SEED, case, tiny_folder  # noqa: F401  module-scoped fixtures

UPSTREAM_MODEL_KEYS = ["ss_generator", "slat_generator", "ss_encoder", "ss_decoder", "slat_decoder_gs",
                       "slat_decoder_gs_4", "slat_decoder_mesh"]
UPSTREAM_EMBEDDER_KEYS = ["ss_condition_embedder", "slat_condition_embedder"]
TOL = dict(rtol=1e-3, atol=1e-3)  # the golden case's tolerance


def build(folder, low_memory):
    from sam3d_objects.inference import Inference
    return Inference(str(folder / "pipeline.yaml"), low_memory=low_memory).pipeline


@pytest.fixture(scope="module")
def eager(tiny_folder):  # noqa: F811
    return build(tiny_folder, False)


def run(pipe, case, **options):  # noqa: F811
    inp, _ = case
    rgba = pipe.merge_image_and_mask(inp["image_rgb"].numpy(), inp["mask"].numpy())
    return pipe.run(rgba, None, SEED, pointmap=inp["pointmap"].clone(), **options)


def run_stage1(pipe, case, **options):  # noqa: F811
    return run(pipe, case, stage1_only=True, **options)


def count_calls(module):
    """Conditional / unconditional (cfg=True) calls of a generator backbone, via a forward pre-hook."""
    calls = {"cond": 0, "uncond": 0}

    def hook(_, args, kwargs):
        calls["uncond" if kwargs.get("cfg") else "cond"] += 1

    return calls, module.register_forward_pre_hook(hook, with_kwargs=True)


# ------------------------------------------------------------------------------------------------ containers
def test_models_is_a_module_dict_with_upstreams_keys_in_both_modes(tiny_folder, eager):  # noqa: F811
    low = build(tiny_folder, True)
    for pipe in (low, eager):
        assert isinstance(pipe.models, torch.nn.ModuleDict)
        assert list(pipe.models.keys()) == UPSTREAM_MODEL_KEYS and len(pipe.models) == 7
        assert list(pipe.condition_embedders.keys()) == UPSTREAM_EMBEDDER_KEYS
        assert pipe.models["ss_encoder"] is None  # the released yaml names no encoder: None, as upstream
    assert low.loaded_models() == {}  # nothing loaded until it is used
    generator = low.models["ss_generator"]  # first access loads it
    assert low.models.is_loaded("ss_generator") and low.models.ss_generator is generator
    assert hasattr(generator, "reverse_fn") and generator.inference_steps == low.ss_inference_steps
    assert len(eager.loaded_models()) == 8
    assert eager.models["ss_generator"] is eager._get("ss_generator")
    assert dict(eager.models.named_children()).keys() >= {"ss_generator", "slat_decoder_mesh"}
    assert eager.is_mm_dit()


def test_forward_hooks_survive_low_memory_unload_and_match_golden(tiny_folder, case):  # noqa: F811
    """Hooks installed on the models as research code does; low-memory mode unloads every model after its
    stage, the second run loads them again and the same hooks fire. What they capture is upstream's numbers."""
    _, ref = case
    pipe = build(tiny_folder, True)
    seen = {}

    def keep(name):
        def hook(_, args, output):
            seen.setdefault(name, []).append(output.detach().clone())
        return hook

    def keep_slat(_, args):
        seen.setdefault("slat", []).append((args[0].coords.clone(), args[0].feats.clone()))

    handles = [pipe.condition_embedders["ss_condition_embedder"].register_forward_hook(keep("ss_tokens")),
               pipe.condition_embedders["slat_condition_embedder"].register_forward_hook(keep("slat_tokens")),
               pipe.models["ss_decoder"].register_forward_hook(keep("ss_logits")),
               pipe.models["slat_decoder_mesh"].register_forward_pre_hook(keep_slat)]
    out = run(pipe, case, with_mesh_postprocess=False, with_texture_baking=False, with_layout_postprocess=False)
    assert not pipe.models.is_loaded("ss_decoder") and not pipe.condition_embedders.is_loaded(
        "ss_condition_embedder")  # unloaded after their stage
    torch.testing.assert_close(seen["ss_tokens"][0], ref["debug.ss_condition_tokens"], **TOL)
    torch.testing.assert_close(seen["slat_tokens"][0], ref["debug.slat_condition_tokens"], **TOL)
    torch.testing.assert_close(seen["ss_logits"][0], ref["debug.ss_decoder_logits"], **TOL)
    coords, feats = seen["slat"][0]
    assert torch.equal(coords.cpu().int(), ref["debug.slat.coords"].int())
    torch.testing.assert_close(feats, ref["debug.slat.feats"], **TOL)

    # the mesh in upstream's vertex and face order (not only the same sets)
    mesh = out["mesh"][0]
    torch.testing.assert_close(mesh.vertices.float(), ref["mesh.vertices"], **TOL)
    assert torch.equal(mesh.faces.long(), ref["mesh.faces"].long())
    torch.testing.assert_close(mesh.vertex_attrs.float(), ref["mesh.vertex_attrs"], **TOL)

    again = run_stage1(pipe, case)  # reloads ss embedder and decoder: the hooks come along
    assert len(seen["ss_tokens"]) == 2 and len(seen["ss_logits"]) == 2
    assert torch.equal(seen["ss_logits"][1], seen["ss_logits"][0]) and torch.equal(again["coords"], out["coords"])
    for handle in handles:  # the handles still remove the carried-over hooks
        handle.remove()
    run_stage1(pipe, case)
    assert len(seen["ss_tokens"]) == 2 and len(seen["ss_logits"]) == 2


def test_low_memory_keeps_settings_made_on_the_model_and_pinned_models(tiny_folder, case):  # noqa: F811
    pipe = build(tiny_folder, True)
    pipe.models["ss_generator"].inference_steps = 2  # upstream-style: on the model itself
    calls, handle = count_calls(pipe.models["ss_generator"].reverse_fn.backbone)
    run_stage1(pipe, case)
    handle.remove()
    assert calls["cond"] == 2
    assert not pipe.models.is_loaded("ss_generator") and pipe.ss_inference_steps == 2  # read back at unload
    pipe.ss_inference_steps = 3  # set while unloaded: applied when it loads
    assert pipe.models["ss_generator"].inference_steps == 3
    decoder = pipe.models.pin("ss_decoder")
    run_stage1(pipe, case)
    assert pipe.models["ss_decoder"] is decoder  # pinned: never unloaded
    replacement = torch.nn.Identity()
    pipe.models["slat_decoder_gs_4"] = replacement  # a module put in by the user stays
    assert pipe.models["slat_decoder_gs_4"] is replacement


# ----------------------------------------------------------------------------------------- per-stage settings
STAGE1_SETTINGS = ("ss_inference_steps", "ss_cfg_strength", "ss_cfg_interval", "ss_rescale_t")
STAGE2_SETTINGS = ("ss_inference_steps", "slat_inference_steps", "slat_cfg_strength")


def saved(pipe, names):
    return {name: getattr(pipe, name) for name in names}


def restore(pipe, values):
    for name, value in values.items():
        setattr(pipe, name, value)
    pipe.models["ss_generator"].inference_steps = pipe.ss_inference_steps


def test_stage1_attributes_change_the_next_run(eager, case):  # noqa: F811
    before = saved(eager, STAGE1_SETTINGS)
    backbone = eager.models["ss_generator"].reverse_fn.backbone
    calls, handle = count_calls(backbone)
    try:
        eager.ss_inference_steps = 3
        run_stage1(eager, case)
        assert calls["cond"] == 3 and calls["uncond"] > 0  # guided inside the interval
        calls.update(cond=0, uncond=0)
        eager.ss_cfg_strength = 0.0  # read at every run, as upstream: no unconditional pass
        eager.ss_inference_steps = 2
        run_stage1(eager, case)
        assert calls == {"cond": 2, "uncond": 0}
        calls.update(cond=0, uncond=0)
        eager.models["ss_generator"].inference_steps = 4  # upstream's way: the model's own attribute
        run_stage1(eager, case, stage1_inference_steps=1)  # the run argument wins for this run only
        assert calls["cond"] == 1 and eager.models["ss_generator"].inference_steps == 4
        calls.update(cond=0, uncond=0)
        eager.ss_cfg_strength = 7.0
        eager.ss_cfg_interval = [1000, 1001]  # outside every scaled time: no guidance
        eager.ss_rescale_t = 1.0
        run_stage1(eager, case)
        assert calls == {"cond": 4, "uncond": 0}
        generator = eager.models["ss_generator"]
        assert generator.reverse_fn.interval == [1000, 1001] and generator.rescale_t == 1.0
    finally:
        handle.remove()
        restore(eager, before)


def test_stage2_steps_attribute(eager, case):  # noqa: F811
    before = saved(eager, STAGE2_SETTINGS)
    calls, handle = count_calls(eager.models["slat_generator"].reverse_fn.backbone)
    try:
        eager.ss_inference_steps = 2
        eager.slat_inference_steps = 3
        eager.slat_cfg_strength = 0.0
        out = run(eager, case, decode_formats=["gaussian"], with_mesh_postprocess=False, with_texture_baking=False,
                  with_layout_postprocess=False)
    finally:
        handle.remove()
        restore(eager, before)
    assert calls == {"cond": 3, "uncond": 0}
    assert out["gs"].get_xyz.shape[0] > 0


# ----------------------------------------------------------------------------------------- private helpers
def test_private_helpers_share_the_public_path(eager, case, tiny_folder):  # noqa: F811
    from omegaconf import OmegaConf
    inp, _ = case
    assert eager._get_dtype("float16") is torch.float16 and eager._get_dtype("bfloat16") is torch.bfloat16
    yaml = OmegaConf.load(tiny_folder / "pipeline.yaml")
    assert eager.version == yaml.get("version", "v0") and eager.pad_size == yaml.get("pad_size", 1.0)
    rgba = eager.merge_image_and_mask(inp["image_rgb"].numpy(), inp["mask"].numpy())
    rgb = torch.from_numpy(rgba[..., :3].copy()).permute(2, 0, 1).float() / 255
    mask = torch.from_numpy(rgba[..., 3].copy()).float()[None] / 255
    pointmap = eager.compute_pointmap(rgba, inp["pointmap"].clone())["pointmap"]
    pre = eager.ss_preprocessor
    img, msk, pm = eager._preprocess_image_and_mask_pointmap(rgb, mask, pointmap,
                                                              pre.img_mask_pointmap_joint_transform)
    ref_img, ref_msk, ref_pm = pre._preprocess_image_mask_pointmap(rgb, mask, pointmap)
    assert torch.equal(img, ref_img) and torch.equal(msk, ref_msk)
    assert torch.equal(pm.nan_to_num(7), ref_pm.nan_to_num(7))
    assert eager._apply_transform(None, pre.img_transform) is None
    full = eager.preprocess_image(rgba, pre, pointmap=pointmap)
    torch.testing.assert_close(full["image"][0], eager._apply_transform(ref_img, pre.img_transform).to(full["image"]))


def test_warmup_runs_and_keeps_the_random_state(eager):
    before = saved(eager, ("ss_inference_steps",))
    eager.ss_inference_steps = 1
    try:
        torch.manual_seed(3)
        expected = torch.rand(4)
        torch.manual_seed(3)
        np.random.seed(0)
        assert eager._warmup(num_warmup_iters=1) is None
        assert torch.equal(torch.rand(4), expected)
    finally:
        restore(eager, before)


def test_stage1_by_hand_with_upstreams_calls_equals_the_run(eager, case):  # noqa: F811
    """Research code re-implementing stage 1 with upstream's calls (preprocess_image, get_condition_input with
    condition_embedders[...], models["ss_generator"] on upstream's latent shapes) gets the run's latents."""
    inp, _ = case
    out = run_stage1(eager, case)
    rgba = eager.merge_image_and_mask(inp["image_rgb"].numpy(), inp["mask"].numpy())
    pointmap = eager.compute_pointmap(rgba, inp["pointmap"].clone())["pointmap"]
    ss_input = eager.preprocess_image(rgba, eager.ss_preprocessor, pointmap=pointmap)
    torch.manual_seed(SEED)
    with torch.no_grad():
        args, kwargs = eager.get_condition_input(eager.condition_embedders["ss_condition_embedder"], ss_input,
                                                 eager.ss_condition_input_mapping)
        generator = eager.models["ss_generator"]
        shapes = {k: (1, v.pos_emb.shape[0], v.input_layer.in_features)
                  for k, v in generator.reverse_fn.backbone.latent_mapping.items()}
        latents = generator(shapes, ss_input["image"].device, *args, **kwargs)
    for key in ("shape", "6drotation_normalized", "translation_scale"):  # scale / translation: pose-decoded in run
        assert torch.equal(latents[key].float(), out[key]), key
