"""The demo notebooks run headless (nbclient) with a tiny random-weight checkpoint and write their outputs."""
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from sam3d_objects.assets.tiny_checkpoint import ensure_tiny_checkpoint
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", log=lambda *a: None)


def run_notebook(name, overrides, tmp_path):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1, f"{name}: exactly one cell must be tagged 'parameters'"
    params[0].source += "\n" + "\n".join(f"{k} = {v!r}" for k, v in overrides.items())
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()
    nbformat.write(nb, tmp_path / name)  # executed copy, kept for inspection on failure
    return nb


def outputs_of_type(nb, kind):
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if kind in o.get("data", {})]


def test_single_object_notebook(tiny_checkpoint, tmp_path):
    out = tmp_path / "single"
    nb = run_notebook("demo_single_object.ipynb", {"CHECKPOINTS": str(tiny_checkpoint.parent), "SEED": 42,
                                                   "TURNTABLE_FRAMES": 3, "RESOLUTION": 64,
                                                   "OUTPUT_DIR": str(out)}, tmp_path)
    for f in ("splat.ply", "mesh.glb", "preview.png", "turntable.gif"):
        assert (out / f).stat().st_size > 0, f
    assert len(outputs_of_type(nb, "image/png")) >= 2  # input + preview
    assert len(outputs_of_type(nb, "image/gif")) == 1
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert "PLUMBING CHECK" in text  # random weights are announced


def test_multi_object_notebook(tiny_checkpoint, tmp_path):
    out = tmp_path / "multi"
    run_notebook("demo_multi_object.ipynb", {"CHECKPOINTS": str(tiny_checkpoint.parent), "VIDEO_FRAMES": 3,
                                             "RESOLUTION": 64, "OUTPUT_DIR": str(out)}, tmp_path)
    for f in ("scene.ply", "input_view.png", "scene_turntable.gif"):
        assert (out / f).stat().st_size > 0, f
    from plyfile import PlyData
    scene = PlyData.read(str(out / "scene.ply"))["vertex"].count
    assert scene > 0
