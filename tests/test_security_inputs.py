"""Hostile or ambiguous inputs: masks interpreted explicitly, point maps validated, API types checked, sizes
capped, environment and yaml shapes reported in one line with the documented exit code."""
import shutil
import warnings

import numpy as np
import pytest
from omegaconf import OmegaConf
from PIL import Image

from sam3d_objects import cli, validation
from sam3d_objects.assets.example import EXAMPLE_DIR
from sam3d_objects.utils.images import load_mask_file, mask_from_array
from sam3d_objects.validation import InputWarning

IMAGE = str(EXAMPLE_DIR / "image.png")
MASK0 = str(EXAMPLE_DIR / "0.png")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from sam3d_objects.assets.tiny_checkpoint import ensure_tiny_checkpoint
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", log=lambda *a: None).parent


def _object(h=32, w=40):
    obj = np.zeros((h, w), bool)
    obj[8:20, 10:30] = True
    return obj


# ---------------------------------------------------------------------------------------------------------------
# masks
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("background,foreground", [(0, 255), (0, 1), (0, 65535)])
def test_binary_masks_are_taken_as_they_are(tmp_path, background, foreground):
    obj = _object()
    arr = np.where(obj, foreground, background).astype(np.uint16 if foreground > 255 else np.uint8)
    Image.fromarray(arr).save(tmp_path / "m.png")
    with warnings.catch_warnings():
        warnings.simplefilter("error", InputWarning)
        np.testing.assert_array_equal(load_mask_file(tmp_path / "m.png"), obj)


def test_soft_mask_with_background_1_selects_the_object_not_the_image(tmp_path):
    obj = _object()
    soft = np.where(obj, 250, 1).astype(np.uint8)
    soft[0, 0] = 40  # a third value: soft
    Image.fromarray(soft).save(tmp_path / "m.png")
    with pytest.warns(InputWarning, match="soft mask"):
        np.testing.assert_array_equal(load_mask_file(tmp_path / "m.png"), obj)


def test_rgba_mask_with_opaque_alpha_is_read_by_its_colour(tmp_path):
    obj = _object()
    rgba = np.zeros(obj.shape + (4,), np.uint8)
    rgba[obj, :3] = 255
    rgba[..., 3] = 255  # alpha carries nothing
    Image.fromarray(rgba, "RGBA").save(tmp_path / "m.png")
    np.testing.assert_array_equal(load_mask_file(tmp_path / "m.png"), obj)
    rgba[..., 3] = np.where(obj, 255, 0)  # real alpha: it decides
    rgba[..., :3] = 255
    Image.fromarray(rgba, "RGBA").save(tmp_path / "a.png")
    np.testing.assert_array_equal(load_mask_file(tmp_path / "a.png"), obj)


def test_jpeg_mask_warns_and_has_no_halo(tmp_path):
    obj = np.zeros((64, 64), bool)
    obj[16:48, 16:48] = True
    Image.fromarray(obj.astype(np.uint8) * 255).save(tmp_path / "m.jpg", quality=60)
    with pytest.warns(InputWarning, match="JPEG"):
        got = load_mask_file(tmp_path / "m.jpg")
    assert (got != obj).sum() <= 0.02 * obj.size  # thresholded at 50%, not "> 0" (the halo)


def test_mask_from_array_refuses_nan():
    with pytest.raises(ValueError, match="NaN"):
        mask_from_array(np.full((4, 4), np.nan))


def test_cli_reports_mask_warnings_in_one_line(tiny, tmp_path, capsys):
    soft = np.array(Image.open(MASK0).convert("L"))
    soft = np.where(soft > 0, 200, 3).astype(np.uint8)
    soft[0, 0] = 90
    Image.fromarray(soft).save(tmp_path / "soft.png")
    code = cli.main(["reconstruct", IMAGE, "--mask", str(tmp_path / "soft.png"), "--out", str(tmp_path / "o"),
                     "--checkpoints", str(tiny), "--pointmap", "flat", "--steps", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert any(line.startswith("sam3d-objects: warning:") and "soft mask" in line for line in err.splitlines())


# ---------------------------------------------------------------------------------------------------------------
# point maps
# ---------------------------------------------------------------------------------------------------------------
def _plane(h, w):
    return cli.flat_pointmap(h, w)


@pytest.mark.parametrize("case,match", [
    ("constant", "same"), ("huge", "beyond"), ("negative_depth", "z"), ("complex", "real numbers"),
    ("bool", "real numbers"), ("mostly_nan", "finite")])
def test_bad_point_maps_refused(case, match):
    pm = _plane(20, 30).astype(np.float64)
    if case == "constant":
        pm[:] = [0.1, 0.2, 1.0]
    elif case == "huge":
        pm *= 1e30
    elif case == "negative_depth":
        pm[..., 2] *= -1
    elif case == "complex":
        pm = pm.astype(np.complex64)
    elif case == "bool":
        pm = pm > 0
    else:
        pm[:] = np.nan
        pm[0, 0] = [0, 0, 1]
    with pytest.raises((ValueError, TypeError), match=match):
        validation.check_pointmap(pm, (20, 30))


@pytest.mark.parametrize("case", ["huge_header", "complex", "negative_depth", "wrong_shape"])
def test_bad_point_map_files_cli(tiny, tmp_path, capsys, case):
    h, w = np.array(Image.open(IMAGE)).shape[:2]
    path = tmp_path / "pm.npy"
    if case == "huge_header":
        header = {"descr": "<f4", "fortran_order": False, "shape": (10 ** 6, 10 ** 6, 3)}
        with open(path, "wb") as f:
            np.lib.format.write_array_header_1_0(f, header)
            f.write(b"\0" * 1024)
    else:
        pm = _plane(h, w)
        pm = {"complex": pm.astype(np.complex64), "negative_depth": pm * np.float32([1, 1, -1]),
              "wrong_shape": pm[:-1]}[case]
        np.save(path, pm)
    code = cli.main(["reconstruct", IMAGE, "--mask", MASK0, "--out", str(tmp_path / "o"), "--checkpoints",
                     str(tiny), "--pointmap", str(path), "--steps", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_INPUT and "--pointmap" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------------------------------------
# images and API types
# ---------------------------------------------------------------------------------------------------------------
def test_decompression_bomb_and_pixel_cap(tmp_path, capsys):
    big = tmp_path / "big.png"
    Image.new("1", (12000, 9000)).save(big)  # a few KB, 108 megapixels
    code = cli.main(["reconstruct", str(big), "--mask", str(big), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == cli.EXIT_INPUT and "megapixel" in err and "Traceback" not in err, err


@pytest.mark.parametrize("image,error", [(np.ones((8, 8, 3), bool), TypeError),
                                         (np.full((8, 8, 3), np.nan, np.float32), ValueError),
                                         (np.zeros((8, 8, 3), np.complex64), TypeError)])
def test_api_image_types(image, error):
    with pytest.raises(error):
        validation.check_image(image)


@pytest.mark.parametrize("options,error", [
    ({"seed": 1.5}, TypeError), ({"seed": True}, TypeError), ({"seed": "1"}, TypeError),
    ({"stage1_inference_steps": 0}, ValueError), ({"stage2_inference_steps": 10 ** 9}, ValueError),
    ({"stage1_inference_steps": 2.0}, TypeError), ({"decode_formats": ["bogus"]}, ValueError),
    ({"decode_formats": "gaussian"}, TypeError), ({"decode_formats": []}, ValueError)])
def test_api_run_options(options, error):
    with pytest.raises(error):
        validation.check_run_options(**options)
    validation.check_run_options(seed=np.int64(3), stage1_inference_steps=1, decode_formats=["gaussian", "mesh"])


@pytest.mark.parametrize("kwargs", [{"num_frames": 0}, {"fov": 0}, {"r": 0}, {"num_frames": 2.5},
                                    {"fov": float("nan")}, {"resolution": 0}])
def test_render_video_parameters(kwargs):
    from sam3d_objects.inference import render_video
    with pytest.raises(ValueError):
        render_video(object(), **{"resolution": 16, "num_frames": 3, **kwargs})


def test_inference_call_validates_before_running(monkeypatch):
    from sam3d_objects.inference import Inference
    inference = Inference.__new__(Inference)
    inference._pipeline = None  # never reached
    image = np.zeros((16, 16, 3), np.uint8)
    mask = np.zeros((16, 16), bool)
    mask[4:12, 4:12] = True
    with pytest.raises(TypeError, match="seed"):
        inference(image, mask, seed=1.5)
    with pytest.raises(ValueError, match="stage1_inference_steps"):
        inference(image, mask, seed=1, stage1_inference_steps=0)


# ---------------------------------------------------------------------------------------------------------------
# environment and yaml shapes: one line, documented exit code
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("var,value,needle", [("SPARSE_BACKEND", "bogus", "bogus"), ("ATTN_BACKEND", "bogus", "bogus"),
                                              ("SPARSE_ATTN_BACKEND", "bogus", "bogus"),
                                              ("SAM3D_DEVICE", "bogus", "SAM3D_DEVICE")])
def test_bad_environment_one_line(tiny, tmp_path, capsys, monkeypatch, var, value, needle):
    monkeypatch.setenv(var, value)
    code = cli.main(["reconstruct", IMAGE, "--mask", MASK0, "--out", str(tmp_path / "o"), "--checkpoints",
                     str(tiny), "--pointmap", "flat", "--steps", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_INPUT and needle in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("case", ["no_target", "unknown_key", "empty_pipeline", "dtype_int8", "list_root"])
def test_bad_yaml_shapes_one_line(tiny, tmp_path, capsys, case):
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny, folder)
    if case == "no_target":
        config = OmegaConf.load(folder / "ss_decoder.yaml")
        del config["_target_"]
        OmegaConf.save(config, folder / "ss_decoder.yaml")
    elif case == "unknown_key":
        config = OmegaConf.load(folder / "slat_decoder_gs.yaml")
        config.no_such_parameter = 3
        OmegaConf.save(config, folder / "slat_decoder_gs.yaml")
    elif case == "empty_pipeline":
        (folder / "pipeline.yaml").write_text("")
    elif case == "dtype_int8":
        config = OmegaConf.load(folder / "pipeline.yaml")
        config.dtype = "int8"
        OmegaConf.save(config, folder / "pipeline.yaml")
    else:
        (folder / "ss_decoder.yaml").write_text("- a\n- b\n")
    code = cli.main(["reconstruct", IMAGE, "--mask", MASK0, "--out", str(tmp_path / "o"), "--checkpoints",
                     str(folder), "--pointmap", "flat", "--steps", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_CHECKPOINT and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "o").exists()
