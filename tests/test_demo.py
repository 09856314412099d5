"""`make demo` (python -m sam3d_objects.demo): the bundled example, the tiny checkpoint recipe, the notices."""
import json
import math

import numpy as np
import pytest
from PIL import Image

from sam3d_objects import cli, demo, reconstruction
from sam3d_objects.assets import example
from sam3d_objects.assets.tiny_checkpoint import MARKER, ensure_tiny_checkpoint, is_random_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", log=lambda *a: None).parent


def test_stored_example_matches_its_generator():
    scene = example.render_example()
    stored = example.load_example()
    diff = np.abs(scene["image"].astype(int) - stored["image"].astype(int))
    assert (diff > 2).mean() < 1e-3  # PNGs are the generator's output (tolerate platform rounding at edges)
    for got, want in zip(stored["masks"], scene["masks"]):
        assert (got != want).mean() < 1e-3
        assert got.sum() > 5000  # each object is well visible
    assert not (stored["masks"][0] & stored["masks"][1]).any()


def test_example_pointmap_geometry():
    """Independent checks of the analytic point map: pinhole focal, sphere radius, floor height."""
    from sam3d_objects.render import focal_from_pointmap
    pm = example.example_pointmap()
    assert pm.shape == (example.HEIGHT, example.WIDTH, 3) and np.isfinite(pm).all()
    assert focal_from_pointmap(pm) == pytest.approx(example.FOCAL, rel=1e-5)
    # back to the unpitched OpenCV world frame, then the sphere's pixels lie on the sphere
    c, s = math.cos(example.CAMERA_PITCH), math.sin(example.CAMERA_PITCH)
    rot = np.array([[1.0, 0.0, 0.0], [0.0, c, s], [0.0, -s, c]])
    world = (pm * np.array([-1.0, -1.0, 1.0])) @ rot.T
    mask = example.load_example()["masks"][0]
    dist = np.linalg.norm(world[mask] - example.SPHERE_CENTRE, axis=-1)
    np.testing.assert_allclose(dist, example.SPHERE_RADIUS, atol=1e-4)
    floor = ~(mask | example.load_example()["masks"][1]) & (np.abs(world[..., 1] - example.FLOOR_Y) < 1e-4)
    assert floor.sum() > 10000


def test_tiny_checkpoint_is_marked_and_reused(tiny, tmp_path):
    assert is_random_checkpoint(tiny) and is_random_checkpoint(tiny / "pipeline.yaml")
    recipe = json.loads((tiny / MARKER).read_text())
    assert recipe["random_weights"] is True
    stamp = (tiny / "ss_decoder.ckpt").stat().st_mtime_ns
    ensure_tiny_checkpoint(tiny, log=lambda *a: None)
    assert (tiny / "ss_decoder.ckpt").stat().st_mtime_ns == stamp  # up to date: not regenerated
    other = tmp_path / "not_ours"
    other.mkdir()
    (other / "precious.txt").write_text("keep")
    with pytest.raises(FileExistsError):
        ensure_tiny_checkpoint(other, log=lambda *a: None)
    assert (other / "precious.txt").read_text() == "keep"


def test_demo_without_weights_generates_tiny_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(cli.CHECKPOINT_ENV, raising=False)
    monkeypatch.setattr(reconstruction, "repo_root", lambda: None)  # ignore official weights of the checkout, if any
    out = tmp_path / "outputs"
    code = demo.main(["--out", str(out), "--tiny-dir", str(tmp_path / "tiny"), "--turntable", "2", "--steps", "2",
                      "--no-progress"])
    stdout = capsys.readouterr().out
    assert code == 0
    assert stdout.count("PLUMBING CHECK") == 2  # before and after
    assert "--checkpoints facebook/sam-3d-objects" in stdout and "hf auth login" in stdout \
        and "checkpoints/hf/pipeline.yaml" in stdout
    for name in ("splat.ply", "mesh.glb", "pose.json", "preview.png", "turntable.gif"):
        assert (out / name).stat().st_size > 0, name
    pose = json.loads((out / "pose.json").read_text())
    assert pose["random_weights"] is True and pose["mask"] == "0"
    with Image.open(out / "turntable.gif") as gif:
        assert gif.n_frames == 2


def test_demo_with_explicit_random_checkpoint_still_warns(tiny, tmp_path, capsys):
    code = demo.main(["--checkpoints", str(tiny), "--out", str(tmp_path / "o"), "--turntable", "0", "--steps", "1",
                      "--object", "1", "--no-progress"])
    stdout = capsys.readouterr().out
    assert code == 0 and "PLUMBING CHECK" in stdout
    assert json.loads((tmp_path / "o" / "pose.json").read_text())["mask"] == "1"
    assert not (tmp_path / "o" / "turntable.gif").exists()


def test_demo_bad_checkpoint_path(tmp_path, capsys):
    code = demo.main(["--checkpoints", str(tmp_path / "missing"), "--out", str(tmp_path / "o")])
    assert code == cli.EXIT_CHECKPOINT
    assert "pipeline.yaml" in capsys.readouterr().err
