"""End to end on the tiny upstream-format checkpoint: Inference API, low-memory mode, exports, bad input.

Numbers are compared with the golden pipeline_tiny outputs (upstream's run with the same seed) where the test
needs them; the full comparison is the golden case itself (tests/test_golden.py).
"""
import os
import shutil

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from test_checkpoint_loading import with_dino_sizes

SEED = 42


@pytest.fixture(scope="module")
def tiny_folder(golden_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny") / "ckpt"
    shutil.copytree(golden_dir / "pipeline_tiny" / "tiny_checkpoint", folder)
    for y in folder.glob("*.yaml"):
        OmegaConf.save(OmegaConf.create(with_dino_sizes(OmegaConf.to_container(OmegaConf.load(y)))), y)
    return folder


@pytest.fixture(scope="module")
def case(golden_dir):
    return (load_file(str(golden_dir / "pipeline_tiny" / "inputs.safetensors")),
            load_file(str(golden_dir / "pipeline_tiny" / "outputs.safetensors")))


@pytest.fixture(scope="module")
def inference(tiny_folder):
    from sam3d_objects.inference import Inference
    return Inference(str(tiny_folder / "pipeline.yaml"), compile=False, low_memory=True)


@pytest.fixture(scope="module")
def output(inference, case):
    inp, _ = case
    return inference(inp["image_rgb"].numpy(), inp["mask"].numpy(), seed=SEED, pointmap=inp["pointmap"].clone())


def test_notebook_import_path():
    import sys
    from conftest import ROOT
    sys.path.append(str(ROOT / "notebooks"))
    from inference import Inference, load_image, load_masks, load_single_mask, make_scene  # noqa: F401
    from sam3d_objects.inference import Inference as Ours
    assert Inference is Ours


def test_output_dict_matches_upstream_stage1_and_voxels(output, case):
    _, ref = case
    for key in ("shape", "6drotation_normalized", "translation_scale", "translation", "rotation", "scale"):
        assert torch.allclose(output[key].float(), ref[key], rtol=1e-3, atol=1e-3), key
    assert torch.equal(output["coords"], ref["coords"]) and output["coords"].dtype == torch.int32
    assert torch.equal(output["coords_original"], ref["coords_original"])
    assert int(output["downsample_factor"]) == 1
    assert output["gs"] is output["gaussian"][0]
    assert torch.allclose(output["gs"].get_xyz, ref["gaussian.get_xyz"], atol=1e-3)
    assert len(output["glb"].vertices) == ref["glb.num_vertices"].item()
    assert len(output["glb"].faces) == ref["glb.num_faces"].item()
    assert torch.equal(output["pointmap"].nan_to_num(9), ref["pointmap"].nan_to_num(9))


def test_low_memory_frees_models_and_equals_eager(tiny_folder, inference, output, case):
    from sam3d_objects.inference import Inference
    assert inference.pipeline.low_memory and inference.pipeline.loaded_models() == {}
    eager = Inference(str(tiny_folder / "pipeline.yaml"), low_memory=False)
    assert len(eager.pipeline.loaded_models()) == 8
    inp, _ = case
    again = eager(inp["image_rgb"].numpy(), inp["mask"].numpy(), seed=SEED, pointmap=inp["pointmap"].clone())
    for key in ("shape", "translation", "rotation", "scale", "coords"):
        assert torch.equal(again[key], output[key]), key
    assert torch.equal(again["gs"].get_xyz, output["gs"].get_xyz)


@pytest.mark.parametrize("room,expected", [("short", True), ("unknown", True), ("enough", False)])
def test_low_memory_auto_keeps_models_where_the_memory_holds_them(tiny_folder, monkeypatch, room, expected):
    """"auto" on the CPU: models stay loaded where RESIDENT_MEMORY_FACTOR (2.5) times their checkpoint files fit
    in the available memory (unknown: low-memory); CUDA keeps them, MPS does not."""
    import math
    import backends
    from sam3d_objects.inference import Inference
    from sam3d_objects.pipeline.inference_pipeline import RESIDENT_MEMORY_FACTOR, low_memory_auto
    files = sum(p.stat().st_size for p in tiny_folder.glob("*.ckpt"))
    need = math.ceil(RESIDENT_MEMORY_FACTOR * files)
    available = {"short": need - 1, "unknown": None, "enough": need}[room]
    monkeypatch.setattr(backends.device, "available_memory", lambda: available)
    pipe = Inference(str(tiny_folder / "pipeline.yaml"), compile=False).pipeline
    assert pipe.checkpoint_bytes() == files
    assert pipe.low_memory is expected
    assert (pipe.loaded_models() == {}) is expected  # resident: every model loaded up front
    assert low_memory_auto(torch.device("cuda"), files) is False
    assert low_memory_auto(torch.device("mps"), 1) is True


def test_exports(output, tmp_path):
    output["gs"].save_ply(str(tmp_path / "splat.ply"))
    assert (tmp_path / "splat.ply").read_bytes().startswith(b"ply")
    glb = output["glb"]
    glb.export(str(tmp_path / "mesh.glb"))
    import trimesh
    back = trimesh.load(str(tmp_path / "mesh.glb"), force="mesh", process=False)
    assert len(back.vertices) == len(glb.vertices)
    # y-up: the GLB's y is the mesh's z
    mesh = output["mesh"][0]
    assert np.allclose(glb.vertices[:, 1], mesh.vertices[:, 2].cpu().numpy(), atol=1e-6)
    assert np.allclose(glb.vertices[:, 2], -mesh.vertices[:, 1].cpu().numpy(), atol=1e-6)


def test_make_scene_places_each_object(output):
    from sam3d_objects.inference import make_scene
    scene = make_scene(output, output)
    n = output["gs"].get_xyz.shape[0]
    assert scene.get_xyz.shape[0] == 2 * n
    # reference placement in float64: p' = (s * p) @ R + t
    from sam3d_objects.utils.rotation import quaternion_to_matrix
    r = quaternion_to_matrix(output["rotation"][0].double())
    ref = (output["gs"].get_xyz.double() * output["scale"].double()) @ r + output["translation"].double()
    assert torch.allclose(scene.get_xyz[:n].double(), ref, atol=1e-5)
    # sizes scale with the object, kept above 1.1 x the (scaled) kernel size as upstream's make_scene does
    s = output["scale"][0, 0]
    want_scaling = torch.clamp_min(output["gs"].get_scaling * s, 1.1 * output["gs"].mininum_kernel_size * float(s))
    assert torch.allclose(scene.get_scaling[:n], want_scaling, rtol=1e-4)
    assert scene.get_xyz.shape[0] == 2 * n and output["gs"].get_xyz.shape[0] == n  # outputs not modified

    # orientations: a Gaussian's covariance must transform like its points, S' = s^2 R^T S R (row vectors)
    def covariance(quats, scales):
        m = quaternion_to_matrix(torch.nn.functional.normalize(quats.double(), dim=-1))
        return m @ torch.diag_embed(scales.double() ** 2) @ m.transpose(1, 2)

    src = covariance(output["gs"].get_rotation[:50], want_scaling[:50])  # sizes already scaled (and clamped)
    want = r.T @ src @ r
    got = covariance(scene.get_rotation[:50], scene.get_scaling[:50])
    assert torch.allclose(got, want, rtol=1e-3, atol=1e-9)


def test_bad_inputs_are_clear_errors(inference, case):
    inp, _ = case
    image, mask, pm = inp["image_rgb"].numpy(), inp["mask"].numpy(), inp["pointmap"]
    with pytest.raises(ValueError, match="same height and width"):
        inference(image, mask[:-1], seed=0, pointmap=pm)
    with pytest.raises(ValueError, match="empty"):
        inference(image, np.zeros_like(mask), seed=0, pointmap=pm)
    with pytest.raises(ValueError, match="no finite point"):
        inference(image, mask, seed=0, pointmap=torch.full_like(pm, float("nan")))
    far = pm.clone()
    far[torch.from_numpy(mask)] = float("nan")
    with pytest.raises(ValueError, match="no valid 3D point"):
        inference(image, mask, seed=0, pointmap=far)
    with pytest.raises(ValueError, match=r"\[H, W, 3\]"):
        inference(image, mask, seed=0, pointmap=pm[..., :2])
    with pytest.raises(ValueError, match="pass pointmap="):
        inference(image, mask, seed=0, pointmap=None)  # depth_model is null in the tiny yaml


def test_non_image_files(tmp_path):
    from sam3d_objects.inference import load_image, load_masks
    (tmp_path / "image.png").write_text("not an image")
    with pytest.raises(ValueError, match="not an image"):
        load_image(tmp_path / "image.png")
    assert load_masks(tmp_path) == []  # upstream: indices 0, 1, ... up to the first missing file
    with pytest.raises(FileNotFoundError):
        load_masks(tmp_path, [0])


def test_wrong_checkpoint_folder(tmp_path, tiny_folder):
    from sam3d_objects.inference import Inference
    with pytest.raises(FileNotFoundError):
        Inference(str(tmp_path / "pipeline.yaml"))
    folder = tmp_path / "wrong"
    shutil.copytree(tiny_folder, folder)
    shutil.copy(folder / "ss_decoder.ckpt", folder / "slat_decoder_gs.ckpt")  # keys of another model
    from sam3d_objects.pipeline.checkpoint import CheckpointError
    with pytest.raises(CheckpointError, match="missing"):
        Inference(str(folder / "pipeline.yaml"), low_memory=False)


def test_zero_voxels_is_a_clear_error(tmp_path, tiny_folder, case):
    """Stage 1 with every logit <= 0: EmptyStructureError (stage1_only still returns the latents and pose)."""
    from sam3d_objects.inference import Inference
    from sam3d_objects.pipeline.inference_pipeline import EmptyStructureError
    folder = tmp_path / "empty"
    shutil.copytree(tiny_folder, folder)
    sd = torch.load(folder / "ss_decoder.ckpt", weights_only=True)
    last_bias = [k for k in sd if k.endswith("bias")][-1]
    sd[last_bias] = torch.full_like(sd[last_bias], -1e6)
    torch.save(sd, folder / "ss_decoder.ckpt")
    inp, _ = case
    inf = Inference(str(folder / "pipeline.yaml"))
    with pytest.raises(EmptyStructureError, match="no occupied voxel"):
        inf(inp["image_rgb"].numpy(), inp["mask"].numpy(), seed=SEED, pointmap=inp["pointmap"].clone())
    rgba = inf.merge_mask_to_rgba(inp["image_rgb"].numpy(), inp["mask"].numpy())
    stage1 = inf.pipeline.run(rgba, None, SEED, stage1_only=True, pointmap=inp["pointmap"].clone())
    assert stage1["coords"].shape[0] == 0 and stage1["rotation"].shape == (1, 4)


def test_random_tiny_checkpoint_tool_runs_end_to_end(tmp_path, tiny_folder, case):
    from sam3d_objects.inference import Inference
    from sam3d_objects.tools.make_random_checkpoint import main as make
    folder = tmp_path / "rand"
    folder.mkdir()
    for y in tiny_folder.glob("*.yaml"):
        shutil.copy(y, folder / y.name)
    assert make(["--from-configs", str(folder), "--out", str(folder), "--format", "safetensors"]) == 0
    assert (folder / "ss_generator.safetensors").is_file()
    inp, _ = case
    inf = Inference(str(folder / "pipeline.yaml"), low_memory=False)  # loads (strictly) all 8 models
    assert len(inf.pipeline.loaded_models()) == 8
    rgba = inf.merge_mask_to_rgba(inp["image_rgb"].numpy(), inp["mask"].numpy())
    # random weights occupy ~half the grid: stage 1 only, to keep the test fast
    out = inf.pipeline.run(rgba, None, 1, stage1_only=True, pointmap=inp["pointmap"].clone())
    assert out["rotation"].shape == (1, 4) and torch.isfinite(out["translation"]).all()
    assert out["coords"].shape[0] <= 42000 and out["downsample_factor"] in (1, 2)


def test_preload_modules_imports_in_the_background(tmp_path, monkeypatch):
    """The pipeline starts importing the mesh-export library while its models load; a missing module is left
    for its user to report."""
    import sys
    from sam3d_objects.pipeline.inference_pipeline import preload_modules
    (tmp_path / "sam3d_preload_probe.py").write_text("import time\ntime.sleep(0.2)\nVALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    thread = preload_modules(["sam3d_no_such_module", "sam3d_preload_probe"])
    import sam3d_preload_probe  # waits for the thread's import if it is still running
    thread.join(5)
    assert sam3d_preload_probe.VALUE == 7 and not thread.is_alive()
    assert "sam3d_no_such_module" not in sys.modules
    sys.modules.pop("sam3d_preload_probe", None)


def test_exit_waits_for_the_preload(tmp_path):
    """A process that ends (e.g. on SIGTERM) while the preload still imports waits for the import to finish: an
    interpreter exit that stops the thread inside a C++ extension's import aborts the process."""
    import subprocess
    import sys
    from conftest import root_pythonpath
    marker = tmp_path / "imported"
    (tmp_path / "sam3d_slow_probe.py").write_text(
        f"import time\ntime.sleep(1.0)\nopen({str(marker)!r}, 'w').close()\n")
    code = ("from sam3d_objects.pipeline.inference_pipeline import preload_modules\n"
            "preload_modules(['sam3d_slow_probe'])\n")  # and exit at once
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), root_pythonpath()]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert marker.exists(), "the exit stopped the preload mid-import"


def test_tiny_checkpoint_made_by_two_processes_at_once(tmp_path, monkeypatch):
    """Two makers of the same tiny checkpoint at once (xdist workers, two CLI runs): each builds in its own
    folder, both return a complete checkpoint, nothing half-built is left; a failed build leaves nothing."""
    import threading

    from sam3d_objects.assets import tiny_checkpoint as tc
    folder = tmp_path / "tiny"
    results, errors = [], []

    def make():
        try:
            results.append(tc.ensure_tiny_checkpoint(folder, log=lambda *a: None))
        except Exception as err:  # reported below
            errors.append(err)

    workers = [threading.Thread(target=make) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors, errors
    assert results == [folder / "pipeline.yaml"] * 2 and tc._up_to_date(folder, 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(tc, "_ss_decoder_logits", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        tc.ensure_tiny_checkpoint(tmp_path / "other", log=lambda *a: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]
