"""Bad input through the CLI (exit code + one-line message + nothing left behind) and the Python API (exception
type + message), on the tiny random checkpoint. One real run (interrupted during export) - the rest fails early."""
import json
import shutil

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from sam3d_objects import cli, reconstruction
from sam3d_objects.assets.example import EXAMPLE_DIR

IMAGE = str(EXAMPLE_DIR / "image.png")
MASK0, MASK1 = str(EXAMPLE_DIR / "0.png"), str(EXAMPLE_DIR / "1.png")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from sam3d_objects.assets.tiny_checkpoint import ensure_tiny_checkpoint
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", log=lambda *a: None).parent


@pytest.fixture
def copy(tiny, tmp_path):
    def make(name="ckpt"):
        folder = tmp_path / name
        shutil.copytree(tiny, folder)
        return folder
    return make


def run(argv, capsys):
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def leftovers(folder):
    """Names in ``folder`` that a run may have left (staging folders, probes, partial files)."""
    return sorted(p.name for p in folder.iterdir() if ".partial" in p.name or "sam3d-write-test" in p.name)


def reconstruct_args(out, ckpt, *extra):
    return ["reconstruct", IMAGE, "--mask", MASK0, "--out", str(out), "--checkpoints", str(ckpt), "--pointmap",
            "flat", "--steps", "1", "--no-progress", *extra]


# ---------------------------------------------------------------------------------------------------------------
# configuration errors: exit 3, one line naming yaml / key / target, traceback only with --debug
# ---------------------------------------------------------------------------------------------------------------
def _edit(path, change):
    config = OmegaConf.load(path)
    change(config)
    OmegaConf.save(config, path)


@pytest.mark.parametrize("case", ["pipeline_nested", "pipeline_root", "model_yaml", "unknown", "missing_key",
                                  "syntax"])
def test_config_errors_exit_3(copy, tmp_path, capsys, case):
    folder = copy()
    yaml, key, target = folder / "pipeline.yaml", None, None
    if case == "pipeline_nested":
        key, target = "ss_preprocessor.img_transform", "os.system"
        _edit(yaml, lambda c: OmegaConf.update(c, key, {"_target_": target, "command": "touch pwned"}))
    elif case == "pipeline_root":
        key, target = "<root>", "builtins.eval"
        _edit(yaml, lambda c: OmegaConf.update(c, "_target_", target))
    elif case == "model_yaml":
        yaml, key, target = folder / "ss_decoder.yaml", "<root>", "subprocess.run"
        _edit(yaml, lambda c: OmegaConf.update(c, "_target_", target))
    elif case == "unknown":
        yaml, key, target = folder / "slat_decoder_gs.yaml", "<root>", "sam3d_objects.model.NoSuchDecoder"
        _edit(yaml, lambda c: OmegaConf.update(c, "_target_", target))
    elif case == "missing_key":
        key = "ss_decoder_config_path"
        _edit(yaml, lambda c: c.pop(key))
    else:
        yaml, key = folder / "ss_decoder.yaml", "not valid YAML"
        yaml.write_text("out_channels: [1, 2\n")
    out = tmp_path / "out"
    code, _, err = run(reconstruct_args(out, folder), capsys)
    assert code == cli.EXIT_CHECKPOINT, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert str(yaml) in err and key in err and (target is None or target in err)
    assert not out.exists() and not (tmp_path / "pwned").exists() and not leftovers(tmp_path)
    code, _, err = run(["--debug", *reconstruct_args(out, folder)], capsys)
    assert code == cli.EXIT_CHECKPOINT and "Traceback" in err


def test_config_errors_from_the_api(copy):
    from sam3d_objects.inference import ConfigError, Inference
    folder = copy()
    _edit(folder / "slat_generator.yaml", lambda c: OmegaConf.update(c, "module.extra", {"_target_": "os.system"}))
    with pytest.raises(ConfigError, match=r"slat_generator\.yaml: module\.extra \(_target_: os\.system\)"):
        Inference(folder / "pipeline.yaml")


# ---------------------------------------------------------------------------------------------------------------
# checkpoints: checked up front, also in low-memory mode
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["truncate", "empty", "wrong_model"])
def test_bad_later_checkpoint_fails_up_front(copy, tmp_path, capsys, damage):
    folder = copy()
    target = folder / "slat_decoder_mesh.ckpt"  # loaded last in low-memory mode
    if damage == "truncate":
        data = target.read_bytes()
        target.write_bytes(data[: len(data) * 2 // 3])
    elif damage == "empty":
        target.write_bytes(b"")
    else:
        shutil.copy(folder / "ss_decoder.ckpt", folder / "ss_generator.ckpt")  # no generator / embedder keys
        target = folder / "ss_generator.ckpt"
    out = tmp_path / "out"
    code, _, err = run(reconstruct_args(out, folder, "--low-memory"), capsys)
    assert code == cli.EXIT_CHECKPOINT and str(target) in err and "download it again" in err.lower(), err
    assert "Traceback" not in err and not out.exists() and not leftovers(tmp_path)

    from sam3d_objects.pipeline.checkpoint import CheckpointError
    from sam3d_objects.inference import Inference
    with pytest.raises(CheckpointError, match=target.name):
        Inference(folder / "pipeline.yaml", low_memory=True)


def test_loader_errors_name_the_file(tiny, monkeypatch):
    from sam3d_objects.pipeline import checkpoint as ckpt

    def failing(*args, **kwargs):
        raise OSError(22, "Invalid argument")
    monkeypatch.setattr(ckpt, "load_into_meta_model", failing)
    with pytest.raises(ckpt.CheckpointError, match=r"ss_decoder\.ckpt.*download it again"):
        ckpt.load_model(lambda: torch.nn.Linear(2, 2), tiny / "ss_decoder.ckpt")


# ---------------------------------------------------------------------------------------------------------------
# inputs, device and output folder: refused before any folder is created
# ---------------------------------------------------------------------------------------------------------------
def test_bad_inputs_leave_nothing(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    (tmp_path / "file").write_text("x")
    Image.fromarray(np.zeros((384, 512), np.uint8)).save(tmp_path / "empty.png")
    np.save(tmp_path / "nan.npy", np.full((384, 512, 3), np.nan, np.float32))
    np.savez(tmp_path / "none.npz")
    cases = [
        (["reconstruct", str(tmp_path / "missing.png"), "--mask", MASK0], cli.EXIT_INPUT, "image"),
        (["reconstruct", IMAGE, "--mask", MASK0, "--pointmap", str(tmp_path / "nan.npy")], cli.EXIT_INPUT,
         "no finite point"),
        (["reconstruct", IMAGE, "--mask", MASK0, "--pointmap", str(tmp_path / "none.npz")], cli.EXIT_INPUT,
         "cannot read"),
        (["reconstruct", IMAGE, "--mask", str(tmp_path / "empty.png")], cli.EXIT_INPUT, "empty"),
        (["reconstruct", IMAGE, "--mask", MASK0, "--pointmap", str(tmp_path / "file")], cli.EXIT_INPUT,
         "--pointmap"),
    ]
    if not torch.cuda.is_available():
        cases.append((["reconstruct", IMAGE, "--mask", MASK0, "--device", "cuda:0"], cli.EXIT_INPUT,
                      "CUDA is not available"))
    for argv, want, needle in cases:
        code, _, err = run([*argv, "--out", str(out), "--checkpoints", str(tiny)], capsys)
        assert code == want and needle in err and "Traceback" not in err, (argv, err)
        assert not out.exists() and not leftovers(tmp_path)
    for bad_out in (tmp_path / "file", tmp_path / "file" / "sub"):
        code, _, err = run(reconstruct_args(bad_out, tiny), capsys)
        assert code == cli.EXIT_INPUT and "--out" in err and "is a file" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.png", "file", "nan.npy", "none.npz"]


def test_api_errors_name_the_fix(tiny):
    from sam3d_objects.inference import DeviceUnavailableError, Inference
    if not torch.cuda.is_available():
        with pytest.raises(DeviceUnavailableError, match="CUDA is not available"):
            Inference(tiny / "pipeline.yaml", device="cuda")
    if not torch.backends.mps.is_available():
        with pytest.raises(DeviceUnavailableError, match="MPS is not available"):
            Inference(tiny / "pipeline.yaml", device="mps")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        Inference(tiny / "nowhere" / "pipeline.yaml")
    inference = Inference(tiny / "pipeline.yaml", device="cpu", low_memory=True)  # lazy: cheap to build
    from sam3d_objects.inference import load_image, load_mask
    image, mask = load_image(IMAGE), load_mask(MASK0)
    pm = cli.flat_pointmap(*image.shape[:2])
    for call in (inference, lambda im, m, **kw: inference.pipeline.run(im, m, **kw)):
        with pytest.raises(ValueError, match="empty"):  # not scipy's "Residuals are not finite"
            call(image, np.zeros_like(mask), seed=0, pointmap=pm)
        with pytest.raises(ValueError, match="point map is 256x192"):
            call(image, mask, seed=0, pointmap=pm[::2, ::2])
    assert inference.pipeline.loaded_models() == {}  # refused before any model was loaded


def test_input_warnings_small_mask_and_huge_image():
    image = np.zeros((3000, 4500, 3), np.uint8)
    mask = np.zeros((3000, 4500), bool)
    mask[:40, :40] = True  # 1600 px, 400 px after downscaling: fine
    dot = np.zeros_like(mask)
    dot[10:12, 10:12] = True
    pm = np.ones((3000, 4500, 3), np.float32)
    messages = []
    small, masks, spm = cli.input_warnings(image, [("big", mask), ("dot", dot)], pm, log=messages.append)
    assert small.shape == (1365, 2048, 3) and spm.shape == (1365, 2048, 3)
    assert [m.shape for _, m in masks] == [(1365, 2048)] * 2
    text = "\n".join(messages)
    assert "4500x3000" in text and "Downscaled to 2048x1365" in text
    assert "mask dot selects only" in text and "mask big" not in text


# ---------------------------------------------------------------------------------------------------------------
# atomic outputs: an interrupt during the export of the second object
# ---------------------------------------------------------------------------------------------------------------
def test_interrupt_during_export_keeps_completed_objects_only(tiny, tmp_path, capsys, monkeypatch):
    import sam3d_objects.render as render
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")  # an existing --out is not damaged
    (out / "object_1").mkdir()
    (out / "object_1" / "old.txt").write_text("previous run")
    real = render.preview_image
    state = {"calls": 0, "interrupt_at": 2}  # object_1: splat.ply, mesh.glb, pose.json already written

    def preview_then_interrupt(*args, **kwargs):
        state["calls"] += 1
        if state["calls"] == state["interrupt_at"]:
            raise KeyboardInterrupt
        return real(*args, **kwargs)
    monkeypatch.setattr(render, "preview_image", preview_then_interrupt)
    code, _, err = run(["reconstruct", IMAGE, "--mask", MASK0, "--mask", MASK1, "--out", str(out),
                        "--checkpoints", str(tiny), "--pointmap", "flat", "--steps", "1", "--no-progress"], capsys)
    assert code == cli.EXIT_INTERRUPT and "interrupted" in err
    assert sorted(p.name for p in (out / "object_0").iterdir()) == ["mesh.glb", "pose.json", "preview.png",
                                                                      "splat.ply"]
    assert sorted(p.name for p in (out / "object_1").iterdir()) == ["old.txt"]
    assert (out / "notes.txt").read_text() == "mine"
    assert not (out / "scene.ply").exists() and not leftovers(tmp_path) and not leftovers(out)
    summary = json.loads((out / "summary.json").read_text())
    assert [o["mask"] for o in summary["objects"]] == ["0"]
    assert summary["failed"] == [{"mask": "1", "error": "interrupted"}]
    assert all(f.startswith(str(out / "object_0")) for f in summary["objects"][0]["files"])

    # a one-object run into a new folder, interrupted while its files are written: no folder at all
    def half_written(output, folder, *args, **kwargs):
        folder.mkdir(parents=True)
        (folder / "splat.ply").write_text("half")
        raise KeyboardInterrupt
    monkeypatch.setattr(reconstruction, "_run_one", lambda *args, **kwargs: {"coords": torch.zeros(0, 4)})
    monkeypatch.setattr(reconstruction, "save_object", half_written)
    fresh = tmp_path / "fresh" / "deeper"
    code, _, err = run(reconstruct_args(fresh, tiny), capsys)
    assert code == cli.EXIT_INTERRUPT and not (tmp_path / "fresh").exists() and not leftovers(tmp_path)
