"""Upstream's notebook helpers (notebook/inference.py) behave as the spec says: defaults, file rules, scene and
normalisation maths, hydra filters, display fallbacks."""
import copy
import inspect
import sys

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from conftest import ROOT
from sam3d_objects import inference as nb
from sam3d_objects.utils.rotation import quaternion_to_matrix
from test_surface_nb_render import make_gaussian


def test_notebook_module_exports_and_defaults():
    sys.path.append(str(ROOT / "notebooks"))
    from inference import (Inference, display_image, interactive_visualizer, load_image,  # noqa: F401
                           load_single_mask, make_scene, ready_gaussian_for_video_rendering, render_video)
    d = {k: v.default for k, v in inspect.signature(render_video).parameters.items()}
    assert (d["num_frames"], d["pitch_deg"], d["yaw_start_deg"], d["r"], d["fov"], d["resolution"],
            d["bg_color"]) == (300, 0, -90, 2.0, 40, 512, (0, 0, 0))
    assert inspect.signature(ready_gaussian_for_video_rendering).parameters["fix_alignment"].default is False
    assert inspect.signature(make_scene).parameters["in_place"].default is False


def test_load_image_keeps_alpha_and_modes(tmp_path):
    rgba = np.random.default_rng(0).integers(0, 256, (5, 7, 4), dtype=np.uint8)
    Image.fromarray(rgba, "RGBA").save(tmp_path / "a.png")
    out = nb.load_image(tmp_path / "a.png")
    assert out.dtype == np.uint8 and np.array_equal(out, rgba)
    # an 8-bit grey file: upstream returns [H, W], which its own pipeline cannot use; converted to RGB here
    # (modes upstream mishandles are converted correctly)
    Image.fromarray(rgba[..., 0], "L").save(tmp_path / "l.png")
    assert np.array_equal(nb.load_image(tmp_path / "l.png"), np.repeat(rgba[..., :1], 3, axis=-1))


def test_load_masks_stop_at_the_first_gap(tmp_path):
    for i in (0, 1, 3):
        m = np.zeros((4, 4), np.uint8)
        m[i % 4, :] = 255
        Image.fromarray(m).save(tmp_path / f"{i}.png")
    masks = nb.load_masks(tmp_path)
    assert len(masks) == 2 and masks[1][1].all() and not masks[1][0].any()
    assert nb.load_single_mask(tmp_path, 3)[3].all()
    assert [m[3].all() for m in nb.load_masks(tmp_path, [3, 0])] == [True, False]
    with pytest.raises(FileNotFoundError, match="2.png"):
        nb.load_masks(tmp_path, [0, 2])
    with pytest.raises(AssertionError):  # upstream's error type still catches
        nb.load_single_mask(tmp_path, 2)
    (tmp_path / "0.png").unlink()
    assert nb.load_masks(tmp_path) == []


def test_normalized_gaussian_fits_the_opaque_box():
    gs = make_gaussian(n=60, opacity_shift=4.5)
    before = gs.get_xyz.clone()
    out = nb.normalized_gaussian(gs)
    assert torch.equal(gs.get_xyz, before)  # a copy
    active = gs.get_opacity.reshape(-1) > 0.9
    side = (before[active].max(0).values - before[active].min(0).values).max()
    xyz = out.get_xyz[active]
    extent = xyz.max(0).values - xyz.min(0).values
    assert float(extent.max()) == pytest.approx(1.0, abs=1e-5)
    torch.testing.assert_close(xyz.max(0).values, -xyz.min(0).values, atol=1e-5, rtol=0)  # centred
    torch.testing.assert_close(out.get_scaling, gs.get_scaling / side, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(out.get_rotation, gs.get_rotation)
    q = nb.normalized_gaussian(gs, outlier_percentile=0.1).get_xyz[active]
    lo, hi = torch.quantile(q, 0.1, dim=0), torch.quantile(q, 0.9, dim=0)
    torch.testing.assert_close((lo + hi) / 2, torch.zeros(3), atol=1e-5, rtol=0)
    assert nb.normalized_gaussian(gs, in_place=True) is gs
    faint = make_gaussian(n=20, opacity_shift=-3.0)
    with pytest.warns(UserWarning, match="opacity above 0.9"):
        xyz = nb.normalized_gaussian(faint).get_xyz
    assert float((xyz.max(0).values - xyz.min(0).values).max()) == pytest.approx(1.0, abs=1e-5)


def test_ready_gaussian_for_video_rendering_alignment():
    gs = make_gaussian(n=30, opacity_shift=4.5)
    plain = nb.ready_gaussian_for_video_rendering(gs)
    torch.testing.assert_close(plain.get_xyz, nb.normalized_gaussian(gs).get_xyz)
    moved = copy.deepcopy(gs)
    moved._xyz = gs._xyz[:, [0, 2, 1]] * torch.tensor([-1.0, 1.0, 1.0])  # raw (x, y, z) -> (-x, z, y)
    torch.testing.assert_close(nb.ready_gaussian_for_video_rendering(gs, fix_alignment=True).get_xyz,
                               nb.normalized_gaussian(moved).get_xyz)
    torch.testing.assert_close(nb.ready_gaussian_for_video_rendering(gs, fix_alignment=True).get_rotation,
                               gs.get_rotation)  # orientations untouched, as upstream


def fake_output(seed, scale=0.7, kernel=0.0009):
    gs = make_gaussian(n=12, seed=seed)
    gs.mininum_kernel_size = kernel
    q = torch.nn.functional.normalize(torch.randn(1, 4, generator=torch.Generator().manual_seed(seed)), dim=-1)
    return {"gaussian": [gs], "gs": gs, "rotation": q, "translation": torch.tensor([[0.1, -0.2, 2.0]]),
            "scale": torch.full((1, 3), scale)}


def test_make_scene_pose_copy_and_kernel_rules():
    a, b = fake_output(1), fake_output(2, scale=1.3, kernel=0.002)
    a_xyz = a["gs"].get_xyz.clone()
    scene = nb.make_scene(a, b)
    assert torch.equal(a["gs"].get_xyz, a_xyz) and scene is not a["gs"]  # outputs untouched
    r = quaternion_to_matrix(a["rotation"][0].double())
    want = (a_xyz.double() * 0.7) @ r + a["translation"].double()  # row-vector pose, float64 reference
    torch.testing.assert_close(scene.get_xyz[:12].double(), want, atol=1e-5, rtol=0)
    assert scene.mininum_kernel_size == pytest.approx(min(0.0009 * 0.7, 0.002 * 1.3))
    assert scene.get_xyz.shape[0] == 24 and bool((scene.get_rotation[:, 0] >= 0).all())
    same = nb.make_scene(a, in_place=True)
    assert same is a["gaussian"][0]
    with pytest.raises(AssertionError, match="isotropic"):
        bad = fake_output(3)
        bad["scale"] = torch.tensor([[1.0, 2.0, 1.0]])
        nb.make_scene(bad)


def test_render_video_y_up_orbit_and_frames():
    gs = make_gaussian(n=1)
    gs.aabb = torch.tensor([0.0, 0, 0, 1, 1, 1])
    gs.from_xyz(torch.tensor([[0.4, 0.0, 0.0]]))  # +x of the PyTorch3D camera frame
    gs.from_scaling(torch.full((1, 3), 0.1))
    gs._opacity = torch.full((1, 1), 10.0)
    gs._features_dc = torch.full((1, 1, 3), 1.7)  # white
    video = nb.render_video(gs, resolution=16, num_frames=5, r=2.0, fov=60, yaw_start_deg=180, verbose=False)
    frames = video["color"]
    assert len(frames) == 5 and video["depth"] == [None] * 5
    assert all(f.dtype == np.uint8 and f.shape == (16, 16, 3) for f in frames)
    np.testing.assert_array_equal(frames[0], frames[-1])  # endpoint included: the last frame repeats the first
    # yaw 180 looks along +z from (0, 0, -r): world +x appears on the image's left (the input photo, un-mirrored)
    cols = frames[0].sum(axis=(0, 2))
    assert cols[:8].sum() > 4 * cols[8:].sum()


def test_hydra_filters():
    nb.check_target("torch.nn.Linear", nb.WHITELIST_FILTERS, nb.BLACKLIST_FILTERS)
    for bad in ("os.system", "builtins.eval", "torch.os.system"):
        with pytest.raises(RuntimeError, match="is not allowed to be hydra instantiated"):
            nb.check_target(bad, nb.WHITELIST_FILTERS, nb.BLACKLIST_FILTERS)
    good = OmegaConf.create({"a": {"_target_": "torch.nn.Linear", "b": [{"_target_": "torch.nn.ReLU"}]}})
    assert nb.check_hydra_safety(good, nb.WHITELIST_FILTERS, nb.BLACKLIST_FILTERS) is None
    bad = OmegaConf.create({"a": {"_target_": "torch.nn.Linear", "b": [1, {"c": {"_target_": "torch.os.system"}}]}})
    with pytest.raises(RuntimeError, match="torch.os.system"):
        nb.check_hydra_safety(bad, nb.WHITELIST_FILTERS, nb.BLACKLIST_FILTERS)


def test_display_and_visualizer_degrade_clearly(tmp_path):
    image = np.full((6, 8, 3), 200, np.uint8)
    masks = [np.eye(6, 8, dtype=bool), np.eye(6, 8, k=1, dtype=bool)]
    try:
        import matplotlib
        matplotlib.use("Agg")
        assert nb.display_image(image, masks) is None
    except ImportError:
        single = nb.display_image(image)
        assert single.size == (8, 6) and np.asarray(single)[0, 0].tolist() == [200, 200, 200]
        grid = np.asarray(nb.display_image(image, masks))
        assert grid.shape == (12, 16, 3)
        assert grid[6, 8].tolist() == [200, 200, 200] and grid[6, 10].tolist() == [0, 0, 0]  # image * union
        assert grid[0, 8].tolist() == [0, 0, 0] and grid[6, 0].max() > 0  # black panel, coloured masks
    try:
        import gradio  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install gradio"):
            nb.interactive_visualizer(tmp_path / "x.ply")
