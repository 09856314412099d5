"""Upstream's pipeline helpers (init_*, override_*_cfg_config, get_condition_input, ...) on the tiny checkpoint."""
import numpy as np
import pytest
import torch

from test_pipeline_tiny import case, tiny_folder  # noqa: F401  module-scoped fixtures


@pytest.fixture(scope="module")
def pipe(tiny_folder):  # noqa: F811
    from sam3d_objects.inference import Inference
    return Inference(str(tiny_folder / "pipeline.yaml")).pipeline  # low-memory: models load on use


def test_init_methods_load_the_same_weights(pipe, tiny_folder):  # noqa: F811
    gen = pipe.init_ss_generator("ss_generator.yaml", "ss_generator.ckpt")
    ref = pipe._get("ss_generator")
    for (k, a), (_, b) in zip(gen.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), k
    assert gen.no_shortcut is True and gen.inference_steps == pipe.ss_inference_steps
    assert gen.reverse_fn.strength == pipe.ss_cfg_strength
    assert pipe.init_ss_encoder(None, None) is None
    emb = pipe.init_slat_condition_embedder("slat_generator.yaml", "slat_generator.ckpt")
    assert type(emb).__name__ == "EmbedderFuser"
    assert pipe.is_mm_dit() and not pipe.is_mm_dit("slat_generator")
    pipe._free("ss_generator", "slat_generator")


def test_override_cfg_config_sets_the_sampler(pipe):
    gen = pipe.init_ss_generator("ss_generator.yaml", "ss_generator.ckpt")
    pipe.override_ss_generator_cfg_config(gen, cfg_strength=3, inference_steps=9, rescale_t=2,
                                          cfg_interval=[1, 2], cfg_strength_pm=0.0)
    assert (gen.reverse_fn.strength, gen.inference_steps, gen.rescale_t, gen.reverse_fn.interval) == (3, 9, 2, [1, 2])


def test_condition_input_helpers(pipe):
    item = {"image": torch.ones(1, 3), "mask": torch.zeros(1, 1), "extra": 5}
    assert pipe.map_input_keys(item, ["mask", "image"]) == [item["mask"], item["image"]]
    args, kwargs = pipe.get_condition_input(None, item, ["image"])
    assert args == (item["image"],) and set(kwargs) == {"mask", "extra"}
    tokens, args, kwargs = pipe.embed_condition(lambda image, mask: image + 1, image=item["image"],
                                                mask=item["mask"])
    assert torch.equal(tokens, item["image"] + 1) and args is None and kwargs is None
    (tok,), kw = pipe.get_condition_input(lambda image, **rest: image * 2, item, ["image"])
    assert torch.equal(tok, item["image"] * 2) and kw == {}
    f = pipe.image_to_float(np.array([[0, 255]], np.uint8))
    assert f.dtype == np.float32 and f.tolist() == [[0.0, 1.0]]
    rgba = pipe.merge_image_and_mask(np.zeros((2, 2, 3), np.uint8), np.array([[1, 0], [0, 1]]))
    assert rgba.shape == (2, 2, 4) and (rgba[..., 3] > 0).tolist() == [[True, False], [False, True]]


def test_stage1_only_returns_the_voxels(pipe, case):  # noqa: F811
    inp, _ = case
    out = pipe.run(inp["image_rgb"].numpy(), inp["mask"].numpy(), seed=1, stage1_only=True,
                   pointmap=inp["pointmap"].clone(), stage1_inference_steps=1)
    assert torch.equal(out["voxel"], out["coords"][:, 1:].float() / 64 - 0.5)


def test_set_attention_backend_reports_the_requested_backends():
    from sam3d_objects.pipeline.inference_pipeline import set_attention_backend
    import backends
    assert set_attention_backend() == {"sparse_conv": "auto", "sparse_attn": "auto", "attn": "auto", "norm": "auto"}
    with backends.use(attn="naive"):
        assert set_attention_backend()["attn"] == "naive"


def test_recursive_helpers_and_camera():
    from sam3d_objects.pipeline.inference_pipeline_pointmap import (camera_to_pytorch3d_camera, recursive_clone,
                                                                    recursive_contiguous, recursive_fn_factory)
    x = torch.arange(6.0).reshape(2, 3).t()
    out = recursive_contiguous({"a": [x, (x, None, 1, 2.0, True)]})
    assert out["a"][0].is_contiguous() and out["a"][1][1:] == (None, 1, 2.0, True)
    c = recursive_clone([x])
    assert torch.equal(c[0], x) and c[0].data_ptr() != x.data_ptr()
    with pytest.raises(TypeError, match="Unexpected type"):
        recursive_fn_factory(lambda t: t)("text")
    cam = camera_to_pytorch3d_camera()
    p = torch.tensor([[1.0, 2.0, 3.0]]) @ cam.rotation[0]
    assert p.tolist() == [[-1.0, -2.0, 3.0]] and cam.translation.tolist() == [[0.0, 0.0, 1.0]]
