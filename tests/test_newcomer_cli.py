"""A newcomer's command line: presets, automatic foreground masks, gaussian_4 outputs, MP4 turntables, texture-bake
knobs, vertex colours through `downsample --faces`, and `make bench-pipeline` on a clone without the reference
material."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from sam3d_objects import cli, presets
from sam3d_objects.assets.example import EXAMPLE_DIR, example_pointmap

ROOT = Path(__file__).resolve().parents[1]
IMAGE, MASK0, MASK1 = str(EXAMPLE_DIR / "image.png"), str(EXAMPLE_DIR / "0.png"), str(EXAMPLE_DIR / "1.png")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from sam3d_objects.assets.tiny_checkpoint import ensure_tiny_checkpoint
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", log=lambda *a: None).parent


@pytest.fixture(scope="module")
def pointmap_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("pm") / "pointmap.npy"
    np.save(path, example_pointmap())
    return str(path)


def _mask(path):
    return np.asarray(Image.open(path).convert("L")) > 0


def _iou(a, b):
    return (a & b).sum() / (a | b).sum()


# ---------------------------------------------------------------------------------------------------- presets
def test_presets_resolve_and_explicit_options_win():
    assert presets.resolve("fast") == (True, (4, 4))
    assert presets.resolve("balanced") == (True, (4, 12))
    assert presets.resolve("quality") == (False, (None, None))
    assert presets.resolve("fast", steps=(None, 9)) == (True, (4, 9))       # --steps wins per stage
    assert presets.resolve("quality", fast=True) == (True, (None, None))    # --fast wins
    assert cli.apply_preset("quality", True, (None, None)) == (True, (cli.FAST_STAGE1_STEPS, None))
    assert presets.run_options("fast") == {"use_stage1_distillation": True, "use_stage2_distillation": True,
                                           "stage1_inference_steps": 4, "stage2_inference_steps": 4}
    with pytest.raises(ValueError, match="unknown preset"):
        presets.get("slow")


def test_bake_settings_are_cpu_sized():
    cpu, cuda = presets.bake_settings("cpu"), presets.bake_settings("cuda")
    assert cuda["bake_views"] == 100 and cuda["bake_steps"] == 2500 and cuda["fill_holes_num_views"] == 1000
    assert cpu["bake_views"] < cuda["bake_views"] and cpu["bake_steps"] < cuda["bake_steps"]
    assert presets.bake_settings("mps", views=7, texture_size=256, steps=11)["bake_views"] == 7
    with pytest.raises(ValueError):
        presets.bake_settings("cpu", steps=0)


def test_preset_reaches_the_pipeline(tiny, pointmap_file, tmp_path, monkeypatch):
    """--preset fast runs distilled mode with 4 + 4 steps (the pipeline's run keywords)."""
    from sam3d_objects.pipeline.inference_pipeline_pointmap import InferencePipelinePointMap
    seen = {}
    real = InferencePipelinePointMap.run

    def spy(self, *args, **kwargs):
        seen.update(kwargs)
        return real(self, *args, **kwargs)
    monkeypatch.setattr(InferencePipelinePointMap, "run", spy)
    code = cli.main(["reconstruct", IMAGE, "--mask", MASK0, "--out", str(tmp_path / "o"), "--checkpoints",
                     str(tiny), "--pointmap", pointmap_file, "--preset", "fast", "--steps", "1,1", "--no-progress"])
    assert code == 0
    assert seen["use_stage1_distillation"] and seen["use_stage2_distillation"]
    assert seen["stage1_inference_steps"] == 1 and seen["stage2_inference_steps"] == 1  # --steps wins


# ------------------------------------------------------------------------------------------------- auto masks
def test_auto_masks_find_both_objects_of_the_example():
    from sam3d_objects.foreground import auto_masks
    image = np.asarray(Image.open(IMAGE).convert("RGB"))
    masks = auto_masks(image)
    assert len(masks) == 2
    sphere, box = _mask(MASK0), _mask(MASK1)
    assert _iou(masks[0], sphere) > 0.85 and _iou(masks[1], box) > 0.9  # largest first: the sphere


def test_auto_mask_from_alpha_and_failure():
    from sam3d_objects.foreground import NoForegroundError, auto_masks
    rgba = np.zeros((64, 80, 4), np.uint8)
    rgba[..., :3] = 128
    rgba[10:30, 20:50, 3] = 255
    (mask,) = auto_masks(rgba)
    expected = np.zeros((64, 80), bool)
    expected[10:30, 20:50] = True
    assert (mask == expected).all()
    with pytest.raises(NoForegroundError):
        auto_masks(np.full((64, 64, 3), 90, np.uint8))


@pytest.mark.slow  # two tiny runs; the masks themselves are checked above
def test_cli_mask_auto_reconstructs_each_object(tiny, pointmap_file, tmp_path):
    out = tmp_path / "auto"
    code = cli.main(["reconstruct", IMAGE, "--mask", "auto", "--out", str(out), "--checkpoints", str(tiny),
                     "--pointmap", pointmap_file, "--steps", "1", "--no-progress"])
    assert code == 0
    assert (out / "object_0" / "splat.ply").is_file() and (out / "object_1" / "splat.ply").is_file()
    assert (out / "scene.ply").is_file()


def test_cli_mask_auto_without_background_is_exit_2(tiny, tmp_path, capsys):
    flat = tmp_path / "flat.png"
    Image.fromarray(np.full((64, 64, 3), 90, np.uint8)).save(flat)
    code = cli.main(["reconstruct", str(flat), "--mask", "auto", "--out", str(tmp_path / "o"), "--checkpoints",
                     str(tiny), "--pointmap", "flat"])
    assert code == cli.EXIT_INPUT and "--mask auto" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------- gaussian_4 and turntables
def test_gaussian_4_is_written_and_no_temp_path_leaks(tiny, pointmap_file, tmp_path, capsys):
    out = tmp_path / "g4"
    code = cli.main(["reconstruct", IMAGE, "--mask", MASK0, "--out", str(out), "--checkpoints", str(tiny),
                     "--pointmap", pointmap_file, "--steps", "1", "--formats", "gaussian_4", "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert (out / "splat_4.ply").is_file() and (out / "preview.png").is_file()
    n = len(__import__("plyfile").PlyData.read(str(out / "splat_4.ply"))["vertex"].data)
    assert n > 0
    assert ".partial" not in captured.out + captured.err


@pytest.mark.slow  # a tiny run; the MP4 writer itself is checked below
def test_turntable_mp4(tiny, pointmap_file, tmp_path):
    pytest.importorskip("imageio_ffmpeg", reason="MP4 turntables need imageio-ffmpeg (extra `video`)")
    out = tmp_path / "mp4"
    code = cli.main(["reconstruct", IMAGE, "--mask", MASK0, "--out", str(out), "--checkpoints", str(tiny),
                     "--pointmap", pointmap_file, "--steps", "1", "--turntable", "8", "--turntable-format", "mp4",
                     "--no-progress"])
    assert code == 0
    frames = _read_mp4(out / "turntable.mp4")
    assert len(frames) == 8 and frames[0].shape[-1] == 3


def _read_mp4(path):
    """Frames decoded by ffmpeg itself (imageio-ffmpeg's reader), [H, W, 3] uint8."""
    import imageio_ffmpeg
    reader = imageio_ffmpeg.read_frames(str(path))
    meta = next(reader)
    w, h = meta["size"]
    return [np.frombuffer(f, np.uint8).reshape(h, w, 3) for f in reader]


def test_save_turntable_gif_and_mp4_match(tmp_path):
    frames = [np.full((32, 48, 3), 40 * i, np.uint8) for i in range(6)]
    gif = cli.save_turntable(frames, tmp_path / "t.gif")
    with Image.open(gif) as im:
        assert im.n_frames == 6
    pytest.importorskip("imageio_ffmpeg", reason="MP4 needs imageio-ffmpeg")
    mp4 = cli.save_turntable(frames, tmp_path / "t.mp4")
    decoded = _read_mp4(mp4)
    assert len(decoded) == 6 and decoded[0].shape == (32, 48, 3)
    assert all(abs(float(d.mean()) - 40 * i) < 4 for i, d in enumerate(decoded))  # lossy, but the right frames


def test_bake_knobs_are_validated(tiny, tmp_path, capsys):
    code = cli.main(["reconstruct", IMAGE, "--mask", MASK0, "--out", str(tmp_path / "o"), "--checkpoints",
                     str(tiny), "--texture", "--bake-steps", "0"])
    assert code == cli.EXIT_INPUT and "--bake-steps 0" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ downsample colours
def test_downsample_faces_keeps_vertex_colours(tmp_path):
    trimesh = pytest.importorskip("trimesh")
    pytest.importorskip("fast_simplification", reason="mesh decimation needs fast-simplification")
    from sam3d_objects.tools import downsample as D

    sphere = trimesh.creation.icosphere(subdivisions=4)

    def colour_of(points):  # a smooth colour field: the reference for every vertex, old or new
        return np.clip((points * 0.5 + 0.5) * 255, 0, 255).astype(np.uint8)
    sphere.visual.vertex_colors = np.concatenate([colour_of(sphere.vertices),
                                                  np.full((len(sphere.vertices), 1), 255, np.uint8)], 1)
    src, dst = tmp_path / "m.glb", tmp_path / "small.glb"
    sphere.export(str(src))
    D.downsample(src, dst, faces=300)
    small = trimesh.load(str(dst), force="mesh", process=False)
    assert small.visual.kind == "vertex"
    got = np.asarray(small.visual.vertex_colors)[:, :3].astype(int)
    expected = colour_of(np.asarray(small.vertices)).astype(int)
    assert np.abs(got - expected).mean() < 12  # nearest original vertex: close to the field at the new vertex
    assert np.abs(got - expected).max() < 60


# ----------------------------------------------------------------------------------------- bench-pipeline setup
def _bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import importlib
    return importlib.import_module("benchmarks.bench_speed")


def test_bench_without_reference_material_is_one_line(tmp_path):
    out = tmp_path / "random_full"
    proc = subprocess.run([sys.executable, "benchmarks/bench_speed.py", "--make-random", str(out), "--manifests",
                           str(tmp_path / "missing"), "--devices", "cpu"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "--manifests" in proc.stderr
    assert not out.exists() and not out.with_name("random_full.partial").exists()


def test_bench_build_is_atomic_and_rebuilds_half_built(tmp_path):
    bench = _bench()
    manifests, configs = tmp_path / "m", tmp_path / "c"
    manifests.mkdir()
    configs.mkdir()
    out = tmp_path / "random_full"

    def failing(module, m, c, partial):
        partial.mkdir(parents=True)
        (partial / "pipeline.yaml").write_text("x: 1\n")
        raise subprocess.CalledProcessError(1, "build")
    with pytest.raises(SystemExit, match="nothing was left"):
        bench.make_random_checkpoint(out, manifests, configs, build=failing)
    assert not out.exists() and not out.with_name("random_full.partial").exists()

    out.mkdir()  # an older interrupted build: a pipeline.yaml and a truncated checkpoint, no marker
    (out / "pipeline.yaml").write_text("x: 1\n")
    (out / "ss_generator.ckpt").write_bytes(b"trunc")

    def working(module, m, c, partial):
        partial.mkdir(parents=True)
        (partial / "pipeline.yaml").write_text("complete: true\n")
    config = bench.make_random_checkpoint(out, manifests, configs, build=working)
    assert config.read_text() == "complete: true\n" and not (out / "ss_generator.ckpt").exists()
    assert bench.make_random_checkpoint(out, manifests, configs, build=failing) == config  # complete: kept

    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(SystemExit, match="not a random checkpoint"):
        bench.make_random_checkpoint(other, manifests, configs, build=working)
    assert (other / "notes.txt").is_file()


# ------------------------------------------------------------------------------------------- progress bar totals
def test_stage_bar_never_overshoots_its_total(capsys):
    class FakePipeline:
        stage_hook = None
    pipeline = FakePipeline()
    progress = cli.Progress(pipeline, ["gaussian", "mesh"], enabled=True)
    with progress():
        hook = pipeline.stage_hook
        stages = list(progress.expected) + ["postprocess_mesh"]  # a stage the static list does not know
        for stage in stages:
            hook(stage, "start")
            hook(stage, "end")
            assert progress._stage_bar.n <= progress._stage_bar.total
        bar = progress._stage_bar
    assert bar.n == bar.total == len(stages)
    assert f"{len(stages)}/{len(stages)}" in capsys.readouterr().err


def test_render_bars_have_totals(monkeypatch):
    from sam3d_objects.model.backbone.tdfy_dit.utils import render_utils
    seen = []
    real = render_utils.tqdm

    def recording(*args, **kwargs):
        seen.append(kwargs.get("total"))
        return real(*args, **kwargs)
    monkeypatch.setattr(render_utils, "tqdm", recording)
    assert render_utils._count([1, 2, 3]) == 3 and render_utils._count(iter([1])) is None

    class Renderer:
        def render(self, *a, **k):
            import torch
            return {"color": torch.zeros(3, 4, 4)}
    monkeypatch.setattr(render_utils, "_make_renderer", lambda *a, **k: Renderer())
    out = render_utils.render_frames(None, [0] * 5, [0] * 5, {}, verbose=True)
    assert len(out["color"]) == 5 and seen == [5]
