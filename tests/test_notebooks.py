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


IMPORT_CELL = ("from inference import Inference, ready_gaussian_for_video_rendering, render_video, load_image, "
               "load_single_mask, display_image, make_scene, interactive_visualizer")


def check_gif(path, frames):
    from PIL import Image
    with Image.open(path) as gif:
        assert gif.n_frames == frames


def test_single_object_notebook(tiny_checkpoint, tmp_path):
    out = tmp_path / "single"
    nb = run_notebook("demo_single_object.ipynb", {"CHECKPOINTS": str(tiny_checkpoint.parent), "SEED": 42,
                                                   "NUM_FRAMES": 3, "RESOLUTION": 32,
                                                   "OUTPUT_DIR": str(out)}, tmp_path)
    assert any(IMPORT_CELL in c.source for c in nb.cells)  # upstream's import cell, unchanged
    for f in ("example.ply", "example.glb"):
        assert (out / f).stat().st_size > 0, f
    check_gif(out / "example.gif", 3)  # NUM_FRAMES frames (the last repeats the first, as upstream)
    assert len(outputs_of_type(nb, "image/png")) >= 1  # display_image
    assert len(outputs_of_type(nb, "image/gif")) == 1
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert "PLUMBING CHECK" in text  # random weights are announced


def test_multi_object_notebook(tiny_checkpoint, tmp_path):
    out = tmp_path / "multi"
    nb = run_notebook("demo_multi_object.ipynb", {"CHECKPOINTS": str(tiny_checkpoint.parent), "NUM_FRAMES": 3,
                                                  "RESOLUTION": 32, "OUTPUT_DIR": str(out)}, tmp_path)
    assert any(IMPORT_CELL in c.source for c in nb.cells)
    check_gif(out / "example_scene.gif", 3)
    from plyfile import PlyData
    scene = PlyData.read(str(out / "example_scene.ply"))["vertex"].count
    assert scene > 0
