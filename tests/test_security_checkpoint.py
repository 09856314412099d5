"""Damaged or foreign checkpoint files: refused up front (before any model is built or sampled), one line, exit 3.

The up-front manifest check compares each file's keys / shapes / tensor kinds with the models its yaml describes,
built on the meta device; the full-size case runs against the released checkpoint's manifests (key, shape, dtype
of every tensor, in ../shared/golden/manifests) without the weights."""
import json
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sam3d_objects import cli, validation
from sam3d_objects.assets.example import EXAMPLE_DIR
from sam3d_objects.pipeline.checkpoint import CheckpointError

IMAGE = str(EXAMPLE_DIR / "image.png")
MASK0 = str(EXAMPLE_DIR / "0.png")
SHARED = Path(__file__).resolve().parents[2] / "shared"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from sam3d_objects.assets.tiny_checkpoint import ensure_tiny_checkpoint
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", log=lambda *a: None).parent


def _edit_ckpt(path: Path, change):
    content = torch.load(path, map_location="cpu", weights_only=True)
    sd = content["state_dict"] if "state_dict" in content else content
    change(sd)
    torch.save(content, path)


def _run(folder, tmp_path, capsys, *extra):
    start = time.perf_counter()
    code = cli.main(["reconstruct", IMAGE, "--mask", MASK0, "--out", str(tmp_path / "out"), "--checkpoints",
                     str(folder), "--pointmap", "flat", "--steps", "1", "--no-progress", *extra])
    err = capsys.readouterr().err
    return code, err, time.perf_counter() - start


def _first_float_key(sd):
    return next(k for k, v in sd.items() if v.is_floating_point() and v.numel() > 4)


@pytest.mark.parametrize("damage", ["renamed_key", "shape", "int64", "bool", "complex", "extra_key"])
def test_manifest_mismatch_refused_before_building(tiny, tmp_path, capsys, monkeypatch, damage):
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny, folder)

    def change(sd):
        k = _first_float_key(sd)
        if damage == "renamed_key":
            sd[k + "_renamed"] = sd.pop(k)
        elif damage == "shape":
            sd[k] = torch.zeros(sd[k].numel() + 1)
        elif damage == "int64":
            sd[k] = sd[k].to(torch.int64)
        elif damage == "bool":
            sd[k] = sd[k] > 0
        elif damage == "complex":
            sd[k] = sd[k].to(torch.complex64)
        else:
            sd["bogus.weight"] = torch.zeros(3)
    _edit_ckpt(folder / "slat_decoder_mesh.ckpt", change)
    built = []
    from sam3d_objects import inference
    monkeypatch.setattr(inference.Inference, "__init__", lambda *a, **k: built.append(1) or None)
    code, err, _ = _run(folder, tmp_path, capsys)
    assert code == cli.EXIT_CHECKPOINT, err
    assert "slat_decoder_mesh.ckpt" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not built, "the manifest check must run before the pipeline is built"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", [float("nan"), pytest.param(float("inf"), marks=pytest.mark.slow)])
def test_non_finite_weights_refused(tiny, tmp_path, capsys, value):
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny, folder)

    def change(sd):
        k = _first_float_key(sd)
        sd[k] = sd[k].clone()
        sd[k].view(-1)[3] = value
    _edit_ckpt(folder / "slat_decoder_gs.ckpt", change)
    code, err, _ = _run(folder, tmp_path, capsys, "--no-low-memory")
    assert code == cli.EXIT_CHECKPOINT and "NaN or infinite" in err and "slat_decoder_gs" in err, err
    assert not (tmp_path / "out").exists()
    code, err, _ = _run(folder, tmp_path, capsys, "--low-memory")  # loaded at its stage: still refused, no file
    assert code == cli.EXIT_CHECKPOINT and "NaN or infinite" in err, err
    assert not list((tmp_path / "out").glob("**/splat.ply"))


def test_random_bytes_inside_a_ckpt_refused(tiny, tmp_path, capsys):
    """4 KB of random bytes over tensor data: the zip stays readable, torch does not check the CRC; we do."""
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny, folder)
    path = folder / "ss_decoder.ckpt"
    data = bytearray(path.read_bytes())
    import zipfile
    with zipfile.ZipFile(path) as archive:
        info = max(archive.infolist(), key=lambda i: i.file_size)
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra) + 16
    size = min(4096, info.file_size - 32)
    data[start:start + size] = torch.randint(0, 256, (size,), generator=torch.Generator().manual_seed(0)).to(
        torch.uint8).numpy().tobytes()
    path.write_bytes(bytes(data))
    code, err, _ = _run(folder, tmp_path, capsys, "--no-low-memory")
    assert code == cli.EXIT_CHECKPOINT and "ss_decoder.ckpt" in err and "Traceback" not in err, err


def test_full_size_manifests_match_the_released_configs(monkeypatch):
    """The up-front check accepts the released checkpoint (its manifests: every key, shape, dtype) with the
    released yamls, and names the tensor when one shape differs."""
    manifests, configs = SHARED / "golden" / "manifests", SHARED / "upstream_configs"
    if not manifests.is_dir() or not configs.is_dir():
        pytest.skip("../shared (released manifests and configs) not present")
    names = ["ss_generator", "slat_generator", "ss_decoder", "slat_decoder_gs", "slat_decoder_gs_4",
             "slat_decoder_mesh"]
    indices = {}
    for name in names:
        data = json.loads((manifests / f"{name}.json").read_text())
        indices[name] = {k["key"]: SimpleNamespace(shape=tuple(k["shape"]), dtype=getattr(torch, k["dtype"]))
                         for k in data["keys"]}
    monkeypatch.setattr(validation, "checkpoint_index", lambda path: indices[Path(path).stem])
    found = {"configs": [(f"{n}_config_path", configs / f"{n}.yaml") for n in names],
             "checkpoints": [(f"{n}_ckpt_path", Path(f"{n}.ckpt")) for n in names]}
    start = time.perf_counter()
    validation.check_manifests(found)
    assert time.perf_counter() - start < 60
    key = next(k for k in indices["slat_decoder_gs"] if k.endswith("weight"))
    indices["slat_decoder_gs"][key].shape = (1,) + indices["slat_decoder_gs"][key].shape
    with pytest.raises(CheckpointError, match="slat_decoder_gs.ckpt.*shape mismatch"):
        validation.check_manifests(found)
