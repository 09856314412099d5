"""CLI: `reconstruct --texture --simplify --formats ...,obj,stl` and `downsample`, on the tiny random checkpoint."""
import numpy as np
import pytest

from sam3d_objects import cli
from sam3d_objects.assets.example import EXAMPLE_DIR

trimesh = pytest.importorskip("trimesh")
pytest.importorskip("xatlas", reason="--texture needs xatlas")
pytest.importorskip("fast_simplification", reason="--simplify needs fast-simplification")

IMAGE, MASK0 = str(EXAMPLE_DIR / "image.png"), str(EXAMPLE_DIR / "0.png")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from sam3d_objects.assets.tiny_checkpoint import ensure_tiny_checkpoint
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", log=lambda *a: None).parent


@pytest.mark.slow  # builds the tiny checkpoint and runs the pipeline once (~1 min on 2 cores)
def test_texture_simplify_and_mesh_exports(tiny, tmp_path, monkeypatch, capsys):
    from sam3d_objects import presets

    # Even the CPU-sized bake takes a minute or two on a CPU; the plumbing is the same with fewer, smaller views.
    monkeypatch.setattr(presets, "BAKE_CPU", dict(fill_holes_num_views=24, fill_holes_resolution=128, bake_views=4,
                                                  bake_resolution=64, bake_steps=5, texture_size=64))
    out = tmp_path / "run"
    code = cli.main(["reconstruct", IMAGE, "--mask", MASK0, "--out", str(out), "--checkpoints", str(tiny),
                     "--pointmap", "flat", "--steps", "1", "--formats", "gaussian,obj,stl", "--texture",
                     "--simplify", "0.5", "--no-progress"])
    assert code == 0, capsys.readouterr().err
    glb = trimesh.load(out / "mesh.glb", force="mesh")
    assert glb.visual.uv is not None and glb.visual.material.baseColorTexture.size == (64, 64)
    assert len(trimesh.load(out / "mesh.obj", force="mesh").faces) > 0
    assert len(trimesh.load(out / "mesh.stl", force="mesh").faces) == len(glb.faces)
    assert (out / "mesh_preview.png").is_file()
    summary = __import__("json").loads((out / "summary.json").read_text())
    assert summary["stage_seconds"]["texture"] > 0  # the bake's time is reported


def test_downsample_command(tmp_path, capsys):
    from plyfile import PlyData, PlyElement

    data = np.zeros(40, dtype=[(k, "f4") for k in ("x", "y", "z", "opacity", "f_dc_0")])
    data["x"] = np.arange(40)
    src = tmp_path / "s.ply"
    PlyData([PlyElement.describe(data, "vertex")]).write(str(src))
    assert cli.main(["downsample", str(src), "-o", str(tmp_path / "o.ply"), "--uniform", "4"]) == 0
    assert PlyData.read(str(tmp_path / "o.ply"))["vertex"].count == 10
    with pytest.raises(SystemExit) as info:  # refused when the command line is parsed
        cli.main(["downsample", str(src), "-o", str(tmp_path / "o.ply"), "--random", "2"])
    assert info.value.code == cli.EXIT_INPUT
    err = capsys.readouterr().err
    assert "--random" in err and "(0, 1]" in err
