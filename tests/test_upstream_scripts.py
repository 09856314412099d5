"""Upstream-written usage, run unchanged: the calls of upstream's README and notebooks (``sys.path.append(
"notebook(s)"); from inference import ...``), the pipeline's ``run`` with upstream's keyword names, ``render_utils``,
``GaussianRenderer``, the ``tdfy_dit.models`` re-exports and the Gaussian attribute surface upstream code reads.

One tiny random-weight pipeline run (module fixture) feeds every check; the expected values come from the spec
(../shared/docs/upstream_spec/rendering_and_notebook.md) and from independent readers (plyfile, trimesh, Pillow).
"""
import importlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import host

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_NAMES = ("Inference", "ready_gaussian_for_video_rendering", "render_video", "load_image", "load_single_mask",
                  "display_image", "make_scene", "interactive_visualizer", "load_masks")
OUTPUT_KEYS = ("gaussian", "gs", "rotation", "translation", "scale", "glb", "pointmap", "pointmap_colors", "mesh",
               "coords", "shape", "6drotation_normalized", "translation_scale", "downsample_factor")


@pytest.fixture(scope="module")
def nb():
    """upstream's ``notebook/inference.py`` as scripts import it: the folder on sys.path, then ``import
    inference``."""
    sys.path.insert(0, str(ROOT / "notebooks"))
    try:
        sys.modules.pop("inference", None)
        module = importlib.import_module("inference")
    finally:
        sys.path.remove(str(ROOT / "notebooks"))
    yield module
    sys.modules.pop("inference", None)


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    from sam3d_objects.assets.tiny_checkpoint import ensure_tiny_checkpoint
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", log=lambda *a: None)


@pytest.fixture(scope="module")
def inference(nb, config_path):
    return nb.Inference(str(config_path), compile=False)


@pytest.fixture(scope="module")
def inputs(nb):
    from sam3d_objects.assets.example import EXAMPLE_DIR, example_pointmap
    image = nb.load_image(str(Path(EXAMPLE_DIR) / "image.png"))
    mask = nb.load_single_mask(str(EXAMPLE_DIR), index=0)
    return image, mask, example_pointmap()


@pytest.fixture(scope="module")
def output(inference, inputs):
    image, mask, pointmap = inputs
    return inference(image, mask, seed=42, pointmap=pointmap)


@pytest.fixture(scope="module")
def small_gs(output):
    """The first 256 gaussians of the object (renders cost per gaussian; the calls under test are the same)."""
    import copy
    gs = copy.deepcopy(output["gs"])
    for name in ("_xyz", "_features_dc", "_scaling", "_rotation", "_opacity"):
        setattr(gs, name, getattr(gs, name)[:256])
    return gs


def test_notebook_import_cell_names(nb):
    for name in NOTEBOOK_NAMES:
        assert callable(getattr(nb, name)), name
    assert nb.__all__ == ["Inference"]  # upstream's star-export


def test_inputs_as_upstream(nb, inputs):
    from sam3d_objects.assets.example import EXAMPLE_DIR
    image, mask, _ = inputs
    assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] in (3, 4)
    assert mask.dtype == bool and mask.shape == image.shape[:2] and mask.any()
    masks = nb.load_masks(str(EXAMPLE_DIR), extension=".png")
    n = len(list(Path(EXAMPLE_DIR).glob("[0-9]*.png")))
    assert len(masks) == n >= 2
    np.testing.assert_array_equal(masks[0], mask)


def test_output_keys_and_pose_shapes(output):
    for key in OUTPUT_KEYS:
        assert key in output, key
    assert output["gs"] is output["gaussian"][0]
    assert tuple(output["rotation"].shape) == (1, 4)
    assert tuple(output["translation"].shape) == (1, 3)
    assert tuple(output["scale"].shape) == (1, 3)
    torch.testing.assert_close(host(output["rotation"]).norm(dim=-1), torch.ones(1), rtol=0, atol=1e-5)


def test_gaussian_attribute_surface(output):
    """The activated values upstream code reads, against the spec's formulas on the raw fields (0.3)."""
    gs = output["gs"]  # compared on the gaussians' own device
    n = gs.get_xyz.shape[0]
    assert n > 0
    aabb = torch.as_tensor(gs.aabb, dtype=gs._xyz.dtype).to(gs._xyz.device)
    torch.testing.assert_close(gs.get_xyz, gs._xyz * aabb[3:] + aabb[:3])
    assert gs.get_features.shape == (n, 1, 3) and gs.sh_degree == 0 and gs.active_sh_degree == 0
    torch.testing.assert_close(gs.get_features, gs._features_dc)
    assert gs.get_opacity.shape == (n, 1) and bool(((gs.get_opacity > 0) & (gs.get_opacity < 1)).all())
    rot = gs.get_rotation
    torch.testing.assert_close(rot, torch.nn.functional.normalize(gs._rotation + rot.new_tensor([1, 0, 0, 0])))
    scale = gs.get_scaling
    assert scale.shape == (n, 3) and bool((scale >= gs.mininum_kernel_size * (1 - 1e-5)).all())
    assert gs.get_covariance().shape == (n, 6)


def test_save_ply_and_glb_export(output, tmp_path):
    from plyfile import PlyData
    trimesh = pytest.importorskip("trimesh")
    gs = output["gs"]
    output["gs"].save_ply(str(tmp_path / "splat.ply"))
    vertex = PlyData.read(str(tmp_path / "splat.ply"))["vertex"]
    assert vertex.count == gs.get_xyz.shape[0]
    names = {p.name for p in vertex.properties}
    assert {"x", "y", "z", "f_dc_0", "opacity", "scale_0", "rot_0"} <= names
    np.testing.assert_allclose(np.stack([vertex["x"], vertex["y"], vertex["z"]], 1), host(gs.get_xyz).numpy(),
                               atol=1e-6)
    output["glb"].export(str(tmp_path / "mesh.glb"))
    loaded = trimesh.load(str(tmp_path / "mesh.glb"))
    assert len(loaded.geometry if hasattr(loaded, "geometry") else [loaded]) >= 1


def test_notebook_video_flow_to_gif(nb, output, tmp_path):
    imageio = pytest.importorskip("imageio")
    from PIL import Image
    n_before = output["gs"].get_xyz.clone()
    scene_gs = nb.make_scene(output)
    torch.testing.assert_close(output["gs"].get_xyz, n_before)  # in_place=False leaves the output alone
    scene_gs = nb.ready_gaussian_for_video_rendering(scene_gs)
    extent = host(scene_gs.get_xyz.max(0).values - scene_gs.get_xyz.min(0).values)
    torch.testing.assert_close(extent, torch.ones(3), rtol=0, atol=1.0)  # normalized: longest side 1, centred
    assert abs(float((scene_gs.get_xyz.max(0).values - scene_gs.get_xyz.min(0).values).max()) - 1) < 1e-4
    video = nb.render_video(scene_gs, r=1, fov=60, pitch_deg=15, yaw_start_deg=-45, resolution=16, num_frames=3)
    assert video["depth"] == [None] * 3
    frames = video["color"]
    assert len(frames) == 3 and all(f.dtype == np.uint8 and f.shape == (16, 16, 3) for f in frames)
    # the endpoint repeats the first yaw, as upstream: the same view up to the rounding of yaw + 2 pi in the
    # camera's sine and cosine (a pixel on an edge may land one level apart; seen on the 16-core host's CPU)
    diff = np.abs(frames[0].astype(int) - frames[-1].astype(int))
    assert diff.max() <= 1 and (diff == 0).mean() >= 0.99, (diff.max(), (diff == 0).mean())
    imageio.mimsave(str(tmp_path / "video.gif"), frames, format="GIF")
    with Image.open(tmp_path / "video.gif") as gif:
        assert gif.n_frames >= 2 and gif.size == (16, 16)  # GIF writers may merge identical frames


def test_multi_object_scene(nb, output):
    scene = nb.make_scene(output, output)
    n = output["gs"].get_xyz.shape[0]
    assert scene.get_xyz.shape == (2 * n, 3)
    torch.testing.assert_close(scene.get_xyz[:n], scene.get_xyz[n:])
    normalized = nb.ready_gaussian_for_video_rendering(scene)
    assert normalized is not scene


def test_display_and_visualizer(nb, inputs):
    image, mask, _ = inputs
    shown = nb.display_image(image, [mask])
    assert shown is None or shown.size == (2 * image.shape[1], 2 * image.shape[0])  # matplotlib / PIL fallback
    try:
        import gradio  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="gradio"):
            nb.interactive_visualizer("splat.ply")


def test_render_utils_as_upstream(small_gs):
    from sam3d_objects.model.backbone.tdfy_dit.utils import render_utils
    gs = small_gs
    extr, intr = render_utils.yaw_pitch_r_fov_to_extrinsics_intrinsics([0.0, 1.0], [0.2, 0.3], 2, 40)
    assert len(extr) == 2 and extr[0].shape == (4, 4) and intr[0].shape == (3, 3)
    res = render_utils.render_frames(gs, extr, intr, {"resolution": 12, "bg_color": (0, 0, 0)}, verbose=False)
    assert len(res["color"]) == 2 and res["color"][0].shape == (12, 12, 3) and res["depth"] == [None, None]
    video = render_utils.render_video(gs, resolution=12, num_frames=2, verbose=False)
    assert len(video["color"]) == 2
    colors, extrs, intrs = render_utils.render_multiview(gs, resolution=12, nviews=2)
    assert len(colors) == len(extrs) == len(intrs) == 2 and colors[0].dtype == np.uint8
    assert len(render_utils.render_snapshot(gs, resolution=12, verbose=False)["color"]) == 4


def test_gaussian_renderer_as_upstream(small_gs):
    from sam3d_objects.model.backbone.tdfy_dit.renderers import GaussianRenderer
    from sam3d_objects.model.backbone.tdfy_dit.utils.render_utils import yaw_pitch_r_fov_to_extrinsics_intrinsics
    gs = small_gs
    renderer = GaussianRenderer({"resolution": 12, "near": 0.8, "far": 1.6, "bg_color": (1, 1, 1), "ssaa": 2})
    assert renderer.pipe.kernel_size == 0.1 and renderer.rendering_options["backend"] == "inria"
    extr, intr = yaw_pitch_r_fov_to_extrinsics_intrinsics(0.3, 0.2, 2, 40)
    color = renderer.render(gs, extr, intr)["color"]
    assert color.shape == (3, 12, 12)
    # the object sits inside the unit cube seen from r=2 with a 40 deg fov: the corners show the white background
    torch.testing.assert_close(host(color[:, 0, 0]), torch.ones(3), rtol=0, atol=1e-3)
    black = renderer.render(gs, extr, intr, colors_overwrite=torch.zeros_like(gs.get_xyz))["color"]
    assert float(black.min()) < 0.5 < float(color.min()) + 0.5  # overwritten colours reach the image


def test_pipeline_run_with_upstream_keywords(inference, inputs):
    image, mask, pointmap = inputs
    rgba = inference.merge_mask_to_rgba(image, mask)
    assert rgba.shape == image.shape[:2] + (4,) and rgba.dtype == np.uint8
    out = inference._pipeline.run(rgba, None, 42, stage1_only=True, with_mesh_postprocess=False,
                                  with_texture_baking=False, with_layout_postprocess=True, use_vertex_color=True,
                                  stage1_inference_steps=1, use_stage1_distillation=True,
                                  pointmap=torch.as_tensor(pointmap))
    for key in ("rotation", "translation", "scale", "coords", "pointmap"):
        assert key in out, key
    assert "gs" not in out


def test_models_reexports_and_from_pretrained(tmp_path):
    from safetensors.torch import save_file
    from sam3d_objects.model.backbone.tdfy_dit import models
    from sam3d_objects.model.backbone.tdfy_dit.models import (SLatFlowModel, SLatGaussianDecoder,  # noqa: F401
                                                              SparseStructureDecoder, SparseStructureFlowModel,
                                                              from_pretrained)
    from sam3d_objects.model.backbone.tdfy_dit.models.sparse_structure_vae import SparseStructureDecoder as Inner
    from sam3d_objects.pipeline.inference_utils import SLAT_MEAN, SLAT_STD
    assert SparseStructureDecoder is Inner and models.from_pretrained is from_pretrained
    assert SLAT_MEAN.shape == SLAT_STD.shape == (8,) and bool((SLAT_STD > 0).all())
    args = {"out_channels": 1, "latent_channels": 2, "num_res_blocks": 1, "channels": [8]}
    dec = SparseStructureDecoder(**args)
    (tmp_path / "dec.json").write_text(json.dumps({"name": "SparseStructureDecoder", "args": args}))
    save_file({k: v.contiguous() for k, v in dec.state_dict().items()}, str(tmp_path / "dec.safetensors"))
    loaded = from_pretrained(str(tmp_path / "dec"))
    assert type(loaded) is SparseStructureDecoder
    for k, v in dec.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_hydra_safety_on_the_checkpoint_config(nb, config_path):
    """upstream's check runs on the released pipeline.yaml (torchvision.transforms targets included, whether or
    not torchvision imports here) and still refuses a dangerous re-export."""
    from omegaconf import OmegaConf
    config = OmegaConf.load(str(config_path))
    assert "torchvision.transforms." in OmegaConf.to_yaml(config)
    assert nb.check_hydra_safety(config, nb.WHITELIST_FILTERS, nb.BLACKLIST_FILTERS) is None
    config.bad = {"_target_": "torch.os.system"}
    with pytest.raises(RuntimeError, match="torch.os.system"):
        nb.check_hydra_safety(config, nb.WHITELIST_FILTERS, nb.BLACKLIST_FILTERS)
