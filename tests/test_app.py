"""The web app through gradio_client against a running server on the tiny checkpoint: a reconstruction returns a
GLB, a splat, a turntable and the downloads; Cancel stops a run; the queue runs one reconstruction at a time; the
server and interactive_visualizer bind to 127.0.0.1 and share nothing unless asked."""
import socket
import threading
import time

import numpy as np
import pytest

gr = pytest.importorskip("gradio", reason="the web app needs gradio (extra `app`)")
gradio_client = pytest.importorskip("gradio_client", reason="gradio_client comes with gradio")

from sam3d_objects import app, cli  # noqa: E402
from sam3d_objects.assets.example import EXAMPLE_DIR  # noqa: E402

IMAGE, MASK0, MASK1 = str(EXAMPLE_DIR / "image.png"), str(EXAMPLE_DIR / "0.png"), str(EXAMPLE_DIR / "1.png")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from sam3d_objects.assets.tiny_checkpoint import ensure_tiny_checkpoint
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", log=lambda *a: None)


@pytest.fixture(scope="module")
def server(tiny):
    engine = app.Engine(tiny, random_weights=True, pointmap_default=app.DEPTH_CHOICES[1])
    demo = app.build_app(engine, default_device="cpu")
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True,
                allowed_paths=[str(engine.work_dir)])
    yield f"http://127.0.0.1:{port}/", engine, demo
    demo.close()


def client(url):
    return gradio_client.Client(url, verbose=False)


def test_reconstruct_through_the_api(server):
    url, engine, _ = server
    glb, splat, turntable, files, status = client(url).predict(
        gradio_client.handle_file(IMAGE), [gradio_client.handle_file(MASK0)], "fast", "cpu", 42,
        app.DEPTH_CHOICES[0], api_name="/reconstruct_files")
    import trimesh
    mesh = trimesh.load(glb, force="mesh")
    assert len(mesh.faces) > 0
    from plyfile import PlyData
    assert PlyData.read(splat)["vertex"].count > 0
    assert turntable.endswith((".mp4", ".gif"))
    names = sorted(__import__("os").path.basename(f) for f in files)
    for name in ("mesh.glb", "mesh.obj", "mesh.stl", "splat.ply"):
        assert name in names
    # "depth model" was chosen and the tiny checkpoint has none: the bundled example's exact point map was used
    assert "1 object(s)" in status and "RANDOM weights" in status


@pytest.mark.slow  # a second full two-object run
def test_automatic_masks_make_a_scene(server):
    url, _, _ = server
    _, splat, _, files, status = client(url).predict(
        gradio_client.handle_file(IMAGE), [], "fast", "cpu", 1, app.DEPTH_CHOICES[1], api_name="/reconstruct_files")
    assert "2 object(s)" in status and splat.endswith("scene.ply")
    assert sum(f.endswith("mesh.glb") for f in files) == 2


def test_queue_runs_one_at_a_time(server, monkeypatch):
    """Two users at once: the second waits in the queue; the runs never overlap."""
    url, engine, _ = server
    spans, lock = [], threading.Lock()

    def slow_run(image, masks, *args, **kwargs):
        start = time.monotonic()
        time.sleep(2.0)
        with lock:
            spans.append((start, time.monotonic()))
        raise cli.UserError("stopped by the test")
    monkeypatch.setattr(engine, "run", slow_run)
    jobs = [client(url).submit(gradio_client.handle_file(IMAGE), [gradio_client.handle_file(MASK0)], "fast", "cpu",
                               42, app.DEPTH_CHOICES[1], api_name="/reconstruct_files") for _ in range(2)]
    for job in jobs:
        with pytest.raises(Exception, match="stopped by the test"):
            job.result(timeout=60)
    (a0, a1), (b0, b1) = sorted(spans)
    assert b0 >= a1 - 0.05, f"runs overlapped: {spans}"


def test_cancel_stops_a_running_reconstruction(server, monkeypatch):
    url, engine, _ = server
    started = threading.Event()
    real_inference = engine.inference

    def inference_then_signal(device):
        inference = real_inference(device)
        started.set()
        return inference
    monkeypatch.setattr(engine, "inference", inference_then_signal)
    c = client(url)
    job = c.submit(gradio_client.handle_file(IMAGE), [gradio_client.handle_file(MASK0)], "quality", "cpu", 42,
                   app.DEPTH_CHOICES[1], api_name="/reconstruct_files")
    assert started.wait(120)
    assert "Cancelling" in c.predict(api_name="/cancel")
    t0 = time.monotonic()
    with pytest.raises(Exception, match="Cancelled"):
        job.result(timeout=120)
    assert time.monotonic() - t0 < 60
    assert engine._owner is None and not engine._cancel.is_set()


def test_overlay_and_click_selection():
    image = np.full((60, 80, 3), 200, np.uint8)
    image[20:40, 10:30] = (220, 60, 30)
    mask = app.mask_at_point(image, 15, 25)
    assert mask[25, 15] and mask.sum() == 400
    with pytest.raises(ValueError, match="background"):
        app.mask_at_point(image, 70, 5)
    box = app.mask_in_box(image, (5, 15, 35, 45)) if not app._sam3_available() else mask
    assert (box == mask).all()
    shown = app.overlay(image, [mask], None)
    assert shown.shape == (60, 80, 3) and (shown[25, 15] != image[25, 15]).any() and (shown[5, 70] == 200).all()


def test_text_prompt_without_sam3_says_how(monkeypatch):
    monkeypatch.setattr(app, "_sam3_available", lambda: False)
    with pytest.raises(ValueError, match="make extras EXTRAS=sam3"):
        app.sam3_masks(np.zeros((8, 8, 3), np.uint8), text="chair")


def test_local_only_by_default(tiny, monkeypatch):
    """`sam3d-objects app` binds 127.0.0.1 and makes no public link unless --share / --host say so."""
    launched = {}
    monkeypatch.setattr(gr.Blocks, "launch", lambda self, **kw: launched.update(kw))
    assert cli.main(["app", "--checkpoints", str(tiny.parent), "--no-browser"]) == 0
    assert launched["server_name"] == "127.0.0.1" and launched["share"] is False
    assert cli.main(["app", "--checkpoints", str(tiny.parent), "--no-browser", "--share", "--host", "0.0.0.0"]) == 0
    assert launched["server_name"] == "0.0.0.0" and launched["share"] is True


def test_interactive_visualizer_does_not_share_by_default(monkeypatch, tmp_path):
    from sam3d_objects.inference import interactive_visualizer
    launched = {}
    monkeypatch.setattr(gr.Blocks, "launch", lambda self, **kw: launched.update(kw))
    interactive_visualizer(tmp_path / "splat.ply")
    assert launched["share"] is False and launched["server_name"] == "127.0.0.1"
    interactive_visualizer(tmp_path / "splat.ply", share=True)
    assert launched["share"] is True
