"""`sam3d-objects` CLI: exit codes and messages for bad input, and a full multi-object run on the tiny checkpoint."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from sam3d_objects import cli, reconstruction
from sam3d_objects.assets.example import EXAMPLE_DIR, example_pointmap

IMAGE = str(EXAMPLE_DIR / "image.png")
MASK0, MASK1 = str(EXAMPLE_DIR / "0.png"), str(EXAMPLE_DIR / "1.png")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from sam3d_objects.assets.tiny_checkpoint import ensure_tiny_checkpoint
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", log=lambda *a: None).parent


@pytest.fixture(scope="module")
def pointmap_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("pm") / "pointmap.npy"
    np.save(path, example_pointmap())
    return str(path)


def run(argv, capsys):
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_backends_command(capsys):
    code, out, _ = run(["backends"], capsys)
    assert code == 0 and "cpu" in out and "sparse" in out


def test_module_entry_point_runs():
    proc = subprocess.run([sys.executable, "-m", "sam3d_objects.cli", "backends"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "cpu" in proc.stdout


def test_no_command_prints_help(capsys):
    code, out, _ = run([], capsys)
    assert code == cli.EXIT_INPUT and "reconstruct" in out


@pytest.mark.parametrize("extra,needle", [
    (["--formats", "gaussian,pointcloud"], "unknown"),
    (["--steps", "0"], "--steps"),
    (["--steps", "a,b"], "--steps"),
    (["--pointmap", "/nonexistent/pm.npy"], "--pointmap"),
])
def test_bad_options_exit_2(tiny, capsys, extra, needle):
    code, _, err = run(["reconstruct", IMAGE, "--mask", MASK0, "--out", "unused", "--checkpoints", str(tiny),
                        *extra], capsys)
    assert code == cli.EXIT_INPUT
    assert needle in err and "error" in err


def test_missing_image_and_mask(tiny, capsys, tmp_path):
    code, _, err = run(["reconstruct", str(tmp_path / "nope.png"), "--mask", MASK0, "--out", str(tmp_path),
                        "--checkpoints", str(tiny)], capsys)
    assert code == cli.EXIT_INPUT and "image not found" in err
    code, _, err = run(["reconstruct", IMAGE, "--mask", str(tmp_path / "nope.png"), "--out", str(tmp_path),
                        "--checkpoints", str(tiny)], capsys)
    assert code == cli.EXIT_INPUT and "mask not found" in err
    (tmp_path / "text.png").write_text("not an image")
    code, _, err = run(["reconstruct", str(tmp_path / "text.png"), "--mask", MASK0, "--out", str(tmp_path),
                        "--checkpoints", str(tiny)], capsys)
    assert code == cli.EXIT_INPUT and "not an image" in err


def test_mask_size_mismatch_and_empty_mask(tiny, capsys, tmp_path):
    Image.fromarray(np.full((10, 12), 255, np.uint8)).save(tmp_path / "small.png")
    code, _, err = run(["reconstruct", IMAGE, "--mask", str(tmp_path / "small.png"), "--out", str(tmp_path),
                        "--checkpoints", str(tiny)], capsys)
    assert code == cli.EXIT_INPUT and "must have the image's size" in err
    Image.fromarray(np.zeros((384, 512), np.uint8)).save(tmp_path / "empty.png")
    code, _, err = run(["reconstruct", IMAGE, "--mask", str(tmp_path / "empty.png"), "--out", str(tmp_path),
                        "--checkpoints", str(tiny)], capsys)
    assert code == cli.EXIT_INPUT and "empty" in err


def test_missing_checkpoint_exit_3(capsys, tmp_path):
    code, _, err = run(["reconstruct", IMAGE, "--mask", MASK0, "--out", str(tmp_path), "--checkpoints",
                        str(tmp_path / "nowhere")], capsys)
    assert code == cli.EXIT_CHECKPOINT and "pipeline.yaml" in err


def test_incomplete_checkpoint_exit_3(tiny, capsys, tmp_path):
    import shutil
    broken = tmp_path / "broken"
    shutil.copytree(tiny, broken)
    (broken / "ss_decoder.ckpt").unlink()
    code, _, err = run(["reconstruct", IMAGE, "--mask", MASK0, "--out", str(tmp_path / "o"), "--checkpoints",
                        str(broken), "--pointmap", "flat", "--no-progress"], capsys)
    assert code == cli.EXIT_CHECKPOINT and "ss_decoder.ckpt" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_unavailable_device(tiny, capsys, tmp_path):
    code, _, err = run(["reconstruct", IMAGE, "--mask", MASK0, "--out", str(tmp_path), "--checkpoints", str(tiny),
                        "--device", "cuda"], capsys)
    assert code == cli.EXIT_INPUT and "CUDA is not available" in err


def test_no_pointmap_without_depth_model_says_how(tiny, capsys, tmp_path):
    code, _, err = run(["reconstruct", IMAGE, "--mask", MASK0, "--out", str(tmp_path), "--checkpoints", str(tiny),
                        "--no-progress", "--steps", "1"], capsys)
    assert code == cli.EXIT_INPUT and "--pointmap" in err


def test_two_objects_end_to_end(tiny, pointmap_file, capsys, tmp_path):
    out = tmp_path / "run"
    code, stdout, err = run(["reconstruct", IMAGE, "--mask", MASK0, "--mask", MASK1, "--out", str(out),
                             "--checkpoints", str(tiny), "--pointmap", pointmap_file, "--steps", "2,2",
                             "--seed", "7", "--device", "cpu", "--low-memory"], capsys)
    assert code == 0, err
    assert "random weights" in stdout and "summary" in stdout and "peak process RSS" in stdout
    assert "stage 1 steps" in err or "stages" in err  # tqdm bars go to stderr
    from plyfile import PlyData
    import trimesh
    total = 0
    for i in (0, 1):
        folder = out / f"object_{i}"
        pose = json.loads((folder / "pose.json").read_text())
        assert pose["random_weights"] is True and pose["seed"] == 7
        assert np.linalg.norm(pose["rotation_wxyz"]) == pytest.approx(1.0, abs=1e-4)
        assert len(pose["translation"]) == 3 and min(pose["scale"]) > 0
        n = PlyData.read(str(folder / "splat.ply"))["vertex"].count
        assert n == 32 * pose["num_voxels"]  # the tiny gaussian decoder emits 32 gaussians per voxel
        total += n
        mesh = trimesh.load(folder / "mesh.glb", force="mesh")
        assert len(mesh.faces) > 0
        preview = Image.open(folder / "preview.png")
        assert preview.size[1] == 256 and preview.size[0] > 3 * 256
    assert PlyData.read(str(out / "scene.ply"))["vertex"].count == total
    summary = json.loads((out / "summary.json").read_text())
    assert summary["device"] == "cpu" and len(summary["objects"]) == 2
    assert {"ss_sampling", "slat_sampling", "decode_mesh", "decode_gaussian"} <= set(summary["stage_seconds"])
    assert summary["peak_rss_bytes"] > 0


def test_formats_and_mask_folder(tiny, capsys, tmp_path):
    out = tmp_path / "g"
    code, _, err = run(["reconstruct", IMAGE, "--mask", str(EXAMPLE_DIR), "--out", str(out), "--checkpoints",
                        str(tiny), "--pointmap", "flat", "--steps", "1", "--formats", "gaussian", "--no-progress"],
                       capsys)
    assert code == 0, err
    # the folder holds 0.png and 1.png: two objects, gaussians only
    for i in (0, 1):
        assert (out / f"object_{i}" / "splat.ply").is_file()
        assert not (out / f"object_{i}" / "mesh.glb").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert "decode_mesh" not in summary["stage_seconds"]


def test_find_checkpoint_order(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "pipeline.yaml").write_text("x: 1\n")
    monkeypatch.setenv(cli.CHECKPOINT_ENV, str(tmp_path / "a"))
    assert cli.find_checkpoint(None)[0] == tmp_path / "a" / "pipeline.yaml"
    monkeypatch.delenv(cli.CHECKPOINT_ENV)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(reconstruction, "repo_root", lambda: None)
    assert cli.find_checkpoint(None)[0] is None
    (tmp_path / "checkpoints" / "hf").mkdir(parents=True)
    (tmp_path / "checkpoints" / "hf" / "pipeline.yaml").write_text("x: 1\n")
    assert cli.find_checkpoint(None)[0] == tmp_path / "checkpoints" / "hf" / "pipeline.yaml"
    with pytest.raises(cli.UserError):
        cli.find_checkpoint(str(tmp_path / "missing"))


def test_no_checkpoint_anywhere_exit_3_with_hint(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv(cli.CHECKPOINT_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(reconstruction, "repo_root", lambda: None)
    code, _, err = run(["reconstruct", IMAGE, "--mask", MASK0, "--out", str(tmp_path / "o")], capsys)
    assert code == cli.EXIT_CHECKPOINT
    assert "facebook/sam-3d-objects" in err and "plumbing check" in err


def test_internal_error_exit_1(tiny, capsys, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")
    monkeypatch.setattr(cli, "reconstruct", broken)
    code, _, err = run(["reconstruct", IMAGE, "--mask", MASK0, "--out", str(tmp_path), "--checkpoints", str(tiny)],
                       capsys)
    assert code == cli.EXIT_ERROR and "internal error" in err and "boom" in err


def test_depth_model_missing_is_a_user_error(tiny, capsys, tmp_path):
    """The official yaml configures MoGe; without the `moge` package the CLI says how to proceed (exit 2)."""
    import importlib.util
    import shutil

    from omegaconf import OmegaConf
    if importlib.util.find_spec("moge") is not None:
        pytest.skip("moge is installed here")
    folder = tmp_path / "with_depth"
    shutil.copytree(tiny, folder)
    config = OmegaConf.load(folder / "pipeline.yaml")
    config.depth_model = {"_target_": "sam3d_objects.pipeline.depth_models.moge.MoGe",
                          "model": {"_target_": "moge.model.v1.MoGeModel.from_pretrained",
                                    "pretrained_model_name_or_path": "Ruicheng/moge-vitl"}}
    OmegaConf.save(config, folder / "pipeline.yaml")
    code, _, err = run(["reconstruct", IMAGE, "--mask", MASK0, "--out", str(tmp_path / "o"), "--checkpoints",
                        str(folder), "--steps", "1", "--no-progress"], capsys)
    assert code == cli.EXIT_INPUT and "moge" in err and "--pointmap" in err


@pytest.mark.parametrize("low_memory", ["--low-memory", "--no-low-memory"])
def test_corrupt_checkpoint_exit_3(tiny, capsys, tmp_path, low_memory):
    import shutil
    broken = tmp_path / "corrupt"
    shutil.copytree(tiny, broken)
    data = (broken / "slat_decoder_gs.ckpt").read_bytes()
    (broken / "slat_decoder_gs.ckpt").write_bytes(data[: len(data) // 2])  # truncated download
    code, _, err = run(["reconstruct", IMAGE, "--mask", MASK0, "--out", str(tmp_path / "o"), "--checkpoints",
                        str(broken), "--pointmap", "flat", "--steps", "1", "--no-progress", low_memory], capsys)
    assert code == cli.EXIT_CHECKPOINT and "slat_decoder_gs.ckpt" in err
