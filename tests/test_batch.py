"""`sam3d-objects batch`: a folder of images with masks from a sibling folder or automatic, resumable, one table,
a failing image recorded without stopping the batch, an interrupt that the next run continues."""
import json
import shutil

import pytest

from sam3d_objects import batch, cli, reconstruction
from sam3d_objects.assets.example import EXAMPLE_DIR


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from sam3d_objects.assets.tiny_checkpoint import ensure_tiny_checkpoint
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", log=lambda *a: None).parent


@pytest.fixture()
def photos(tmp_path):
    """photos/{a,b,c}.png (the example) and photos_masks/: a.png (one object), b/0.png + b/1.png, none for c."""
    images, masks = tmp_path / "photos", tmp_path / "photos_masks"
    images.mkdir()
    (masks / "b").mkdir(parents=True)
    for name in ("a", "b", "c"):
        shutil.copyfile(EXAMPLE_DIR / "image.png", images / f"{name}.png")
    (images / "notes.txt").write_text("not an image")
    shutil.copyfile(EXAMPLE_DIR / "0.png", masks / "a.png")
    shutil.copyfile(EXAMPLE_DIR / "0.png", masks / "b" / "0.png")
    shutil.copyfile(EXAMPLE_DIR / "1.png", masks / "b" / "1.png")
    return images


def run(args, tiny):
    return cli.main(["batch", *args, "--checkpoints", str(tiny), "--pointmap", "flat", "--steps", "1",
                     "--no-progress"])


def test_sibling_masks_failure_recorded_and_resume(photos, tiny, tmp_path, capsys):
    out = tmp_path / "results"
    code = run([str(photos), "--out", str(out)], tiny)
    text = capsys.readouterr().out
    assert code == cli.EXIT_RUN  # c has no mask: recorded, the others done
    assert (out / "a" / "splat.ply").is_file() and (out / "a" / "summary.json").is_file()
    assert (out / "b" / "object_0" / "mesh.glb").is_file() and (out / "b" / "object_1" / "mesh.glb").is_file()
    assert (out / "b" / "scene.ply").is_file() and not (out / "c").exists()
    rows = {r["image"]: r for r in json.loads((out / "batch_summary.json").read_text())["images"]}
    assert set(rows) == {"a.png", "b.png", "c.png"}
    assert rows["a.png"]["status"] == "done" and rows["a.png"]["objects"] == 1 and rows["b.png"]["objects"] == 2
    assert rows["c.png"]["status"].startswith("failed: no mask for c.png")
    assert "ETA" in text and "3 image(s): 2 reconstructed, 0 skipped, 1 failed" in text
    stamp = (out / "a" / "splat.ply").stat().st_mtime_ns

    shutil.copyfile(EXAMPLE_DIR / "1.png", photos.parent / "photos_masks" / "c.png")  # the user adds c's mask
    code = run([str(photos), "--out", str(out)], tiny)
    text = capsys.readouterr().out
    assert code == cli.EXIT_OK
    rows = {r["image"]: r for r in json.loads((out / "batch_summary.json").read_text())["images"]}
    assert rows["a.png"]["status"] == rows["b.png"]["status"] == "skipped (finished earlier)"
    assert rows["c.png"]["status"] == "done" and (out / "c" / "splat.ply").is_file()
    assert (out / "a" / "splat.ply").stat().st_mtime_ns == stamp  # not redone
    assert "3 image(s): 1 reconstructed, 2 skipped, 0 failed" in text


@pytest.mark.slow  # three more tiny runs; the resume logic is also covered by the test above
def test_interrupted_batch_continues(photos, tiny, tmp_path, monkeypatch):
    out = tmp_path / "results"
    real = reconstruction.reconstruct
    calls = []

    def interrupt_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)
    monkeypatch.setattr(reconstruction, "reconstruct", interrupt_second)
    assert run([str(photos), "--out", str(out), "--masks", "auto"], tiny) == cli.EXIT_INTERRUPT
    assert batch.is_finished(out / "a") and not (out / "b").exists()
    assert "interrupted" in (out / "batch_summary.json").read_text()
    monkeypatch.setattr(reconstruction, "reconstruct", real)
    assert run([str(photos), "--out", str(out), "--masks", "auto"], tiny) == cli.EXIT_OK
    assert all(batch.is_finished(out / n) for n in "abc")
    assert (out / "c" / "object_1" / "splat.ply").is_file()  # auto: the sphere and the box


def test_no_masks_anywhere_is_one_clear_error(tmp_path, tiny, capsys):
    images = tmp_path / "shots"
    images.mkdir()
    shutil.copyfile(EXAMPLE_DIR / "image.png", images / "x.png")
    assert run([str(images), "--out", str(tmp_path / "o")], tiny) == cli.EXIT_INPUT
    err = capsys.readouterr().err
    assert "--masks auto" in err and "shots_masks" in err


def test_is_finished_and_table(tmp_path):
    folder = tmp_path / "x"
    folder.mkdir()
    assert not batch.is_finished(folder)
    (folder / "splat.ply").write_text("x")
    summary = {"objects": [{"files": [str(folder / "splat.ply")]}], "failed": []}
    (folder / "summary.json").write_text(json.dumps(summary))
    assert batch.is_finished(folder)
    (folder / "summary.json").write_text(json.dumps({**summary, "failed": [{"mask": "1"}]}))
    assert not batch.is_finished(folder)
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "splat.ply").unlink()
    assert not batch.is_finished(folder)  # a file it lists is gone: redo
    table = batch.format_table([{"image": "long_name.png", "objects": 2, "seconds": 3.25, "status": "done"},
                                {"image": "b.png", "objects": None, "seconds": None, "status": "failed: x"}])
    lines = table.splitlines()
    assert lines[1].startswith("long_name.png") and "3.2" in lines[1] and lines[2].split()[1] == "-"
    assert lines[-1] == "2 image(s): 1 reconstructed, 0 skipped, 1 failed"
