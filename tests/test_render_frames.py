"""Turntables rendered several frames at once on the CPU (``backends.splat.frames``) against the same frames
rendered one by one; the footprint projection's closed form against a float64 matrix reference."""
import threading

import numpy as np
import pytest
import torch

from backends import splat
from backends.splat import map_frames, portable, use_compositor, use_frame_workers
from sam3d_objects.render import covariance_from_scale_rotation, orbit_camera, render_gaussians
from test_render_slabs import shell_object
from test_surface_nb_render import make_gaussian


def small_gaussian(n=400, seed=11):
    return make_gaussian(n, seed, opacity_shift=1.0)


def notebook_frames(gs, frames=5):
    from sam3d_objects.inference import render_video
    return render_video(gs, resolution=40, num_frames=frames, r=1.6, fov=50, pitch_deg=20, yaw_start_deg=-45,
                        verbose=False)


def test_turntable_side_by_side_equals_frame_by_frame(monkeypatch):
    gs = small_gaussian()
    with use_frame_workers(1):
        serial = notebook_frames(gs)
    from sam3d_objects.model.backbone.tdfy_dit.renderers import gaussian_render
    names = []
    render = gaussian_render.render_gaussians

    def spy(*args, **kwargs):
        names.append(threading.current_thread().name)
        return render(*args, **kwargs)
    monkeypatch.setattr(gaussian_render, "render_gaussians", spy)
    with use_frame_workers(3):
        together = notebook_frames(gs)
    # the frames really ran in the pool's threads, and come back in order with upstream's types
    assert len(names) == 5 and all(n.startswith("splat-frame") for n in names)
    assert set(together) == set(serial) == {"color", "depth"}
    assert len(together["color"]) == len(serial["color"]) == 5
    assert together["depth"] == serial["depth"] == [None] * 5
    for a, b in zip(together["color"], serial["color"]):
        assert isinstance(a, np.ndarray) and a.dtype == np.uint8 and a.shape == (40, 40, 3)
        # the same arithmetic on fewer threads: equal up to a rare float32 rounding flip of one level
        diff = np.abs(a.astype(int) - b.astype(int))
        assert diff.max() <= 1 and (diff > 0).mean() < 1e-3
    # a turntable: the frames differ from each other, so an order mix-up would show above
    assert not np.array_equal(serial["color"][0], serial["color"][2])
    assert any(c.any() for c in serial["color"])


def test_frames_side_by_side_match_float_results_and_carry_the_callers_context(monkeypatch):
    means, covs, colors, opac = shell_object(600, seed=12)
    cams = [orbit_camera(yaw, 15.0, 2.2, fov_deg=45.0, width=36, height=28) for yaw in (0, 70, 140, 210)]

    def one(cam):
        return render_gaussians(means, covs, colors, opac, cam, background=(0.2, 0.3, 0.4))
    serial = [one(c) for c in cams]
    used = []
    lists = portable._composite_lists
    monkeypatch.setattr(portable, "_composite_lists", lambda *a: used.append("rounds") or lists(*a))
    threads = torch.get_num_threads()
    with use_compositor("rounds"):  # a context variable: every frame of the pool must see it
        together = list(map_frames(one, cams, workers=2))
    assert used == ["rounds"] * 4
    assert torch.get_num_threads() == threads
    for a, b in zip(together, serial):  # rounds against slabs here: the compositors' own agreement
        torch.testing.assert_close(a.alpha, b.alpha, atol=1e-4, rtol=0)
        assert float((a.color - b.color).abs().max()) <= 1 / 255 + 1e-5
    monkeypatch.setattr(portable, "_composite_lists", lists)
    again = list(map_frames(one, cams, workers=3))
    for a, b in zip(again, serial):  # same compositor: float rounding at most
        torch.testing.assert_close(a.color, b.color, atol=1e-6, rtol=0)
        torch.testing.assert_close(a.depth, b.depth, atol=1e-5, rtol=0)


def test_frame_failures_surface_and_the_thread_count_comes_back():
    threads = torch.get_num_threads()

    def one(i):
        if i == 2:
            raise RuntimeError("frame 2 failed")
        return i * 10
    got = []
    with pytest.raises(RuntimeError, match="frame 2 failed"):
        for value in map_frames(one, list(range(6)), workers=2):
            got.append(value)
    assert got == [0, 10]
    assert torch.get_num_threads() == threads
    assert list(map_frames(lambda i: i + 1, [1, 2, 3], workers=1)) == [2, 3, 4]


def test_frame_worker_choice(monkeypatch):
    cpu = torch.device("cpu")
    assert splat.frame_workers(cpu, 1) == 1
    assert splat.frame_workers(cpu, 300) == splat.cpu_frame_workers(torch.get_num_threads())
    # one frame per thread on few threads, frames of 4 threads on many (the 16-core host's best)
    assert [splat.cpu_frame_workers(n) for n in (1, 2, 3, 8, 16, 64)] == [1, 2, 2, 2, 4, 16]
    assert splat.frame_workers(torch.device("cuda"), 300) == 1  # accelerators: one frame at a time
    with use_frame_workers(4):
        assert splat.frame_workers(cpu, 300) == 4 and splat.frame_workers(cpu, 3) == 3
        with use_frame_workers(None):
            assert splat.frame_workers(cpu, 300) == splat.cpu_frame_workers(torch.get_num_threads())
    # frames in flight fit in half the available memory
    from backends.splat import frames
    monkeypatch.setattr(frames, "available_memory", lambda: 10 * frames.FRAME_BYTES_PER_GAUSSIAN * 1_000_000)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 64)  # 16 frames in flight unless memory caps them
    assert splat.frame_workers(cpu, 300, 1_000_000) == 5 and splat.frame_workers(cpu, 300, 100_000) == 16
    assert splat.frame_workers(cpu, 300, 100_000_000) == 1 and splat.frame_workers(cpu, 300) == 16
    monkeypatch.setattr(frames, "available_memory", lambda: None)
    assert splat.frame_workers(cpu, 300, 100_000_000) == 16
    monkeypatch.undo()
    with pytest.raises(ValueError, match="frame workers must be >= 1"):
        with use_frame_workers(0):
            pass
    # a "random" background draws from numpy in frame order: such loops stay one frame at a time
    from sam3d_objects.model.backbone.tdfy_dit.utils import render_utils
    seen = []
    import sam3d_objects.render as render_api  # where the model-side render loops take it from
    real = render_api.map_frames
    monkeypatch.setattr(render_api, "map_frames", lambda fn, items, workers: seen.append(workers) or real(fn, items, 1))
    gs = small_gaussian(50)
    extr, intr = render_utils.yaw_pitch_r_fov_to_extrinsics_intrinsics([0.0, 1.0, 2.0], [0.3] * 3, 2.0, 40.0)
    with use_frame_workers(3):
        render_utils.render_frames(gs, extr, intr, {"resolution": 16, "bg_color": "random"}, verbose=False)
        render_utils.render_frames(gs, extr, intr, {"resolution": 16, "bg_color": (0, 0, 0)}, verbose=False)
    assert seen == [1, 3]


def test_projection_matches_float64_matrix_reference():
    g = torch.Generator().manual_seed(13)
    n = 500
    means = torch.randn(n, 3, generator=g, dtype=torch.float64) * 0.5
    covs = covariance_from_scale_rotation(torch.rand(n, 3, generator=g, dtype=torch.float64) * 0.1 + 0.005,
                                          torch.randn(n, 4, generator=g, dtype=torch.float64))
    cam = orbit_camera(33.0, 21.0, 1.5, fov_deg=60.0, width=70, height=50)
    rot, t = cam.rotation.double(), cam.translation.double()
    p = cam_means = means @ rot.T + t
    x, y, z = cam_means.unbind(-1)
    zero = torch.zeros_like(z)
    jac = torch.stack([cam.fx / z, zero, -cam.fx * x / z ** 2, zero, cam.fy / z, -cam.fy * y / z ** 2],
                      -1).reshape(n, 2, 3)
    cov2d = jac @ rot @ covs @ rot.T @ jac.transpose(1, 2) + 0.3 * torch.eye(2, dtype=torch.float64)
    want = torch.linalg.inv(cov2d)
    proj = portable.project_gaussians(means, covs, cam)
    v = proj.valid
    assert v.sum() > 0.5 * n and bool((v == (z > 1e-2)).all())
    torch.testing.assert_close(proj.conics[v], torch.stack([want[:, 0, 0], want[:, 0, 1], want[:, 1, 1]], -1)[v],
                               atol=1e-12, rtol=1e-9)
    torch.testing.assert_close(proj.means2d[v], torch.stack([cam.fx * x / z + cam.cx, cam.fy * y / z + cam.cy],
                                                            -1)[v], atol=1e-9, rtol=0)
    torch.testing.assert_close(proj.half_size[v], 3.0 * torch.stack([cov2d[:, 0, 0], cov2d[:, 1, 1]], -1)[v].sqrt(),
                               atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(proj.depths, p[:, 2])
    # float32 stays within float32 rounding of the float64 footprint
    f32 = portable.project_gaussians(means.float(), covs.float(), cam)
    torch.testing.assert_close(f32.conics[v].double(), proj.conics[v], atol=1e-4, rtol=1e-4)


def test_project_turntables_side_by_side_equal_frame_by_frame():
    from sam3d_objects.render import render_video, turntable
    gs = small_gaussian(300, seed=14)
    with use_frame_workers(1):
        one = turntable(gs, num_frames=4, resolution=32)
        video_one = render_video(gs, resolution=32, num_frames=3, r=1.8)["color"]
    with use_frame_workers(4):
        many = turntable(gs, num_frames=4, resolution=32, progress=True)
        video_many = render_video(gs, resolution=32, num_frames=3, r=1.8)["color"]
    assert len(many) == 4 and len(video_many) == 3
    for a, b in zip(many + video_many, one + video_one):
        assert a.dtype == np.uint8 and a.shape == (32, 32, 3)
        assert np.abs(a.astype(int) - b.astype(int)).max() <= 1
    assert not np.array_equal(one[0], one[2])


def test_bake_views_side_by_side_equal_one_by_one():
    from sam3d_objects.model.backbone.tdfy_dit.utils import postprocessing_utils as post
    from sam3d_objects.render import render_gaussian
    gs = small_gaussian(300, seed=15)
    cams = post.sphere_hammersley_cameras(4, 24)
    with use_frame_workers(3):
        obs, masks = post._render_gaussian_views(gs, cams, verbose=False)
    assert len(obs) == len(masks) == 4
    for cam, o, m in zip(cams, obs, masks):  # against the one-view call the bake used before
        res = render_gaussian(gs, cam, background=(0.0, 0.0, 0.0))
        want = ((res.color / res.alpha.clamp(min=1e-6).unsqueeze(-1)).clamp(0, 1) * 255 + 0.5).to(torch.uint8)
        assert o.dtype == np.uint8 and np.abs(o.astype(int) - want.numpy().astype(int)).max() <= 1
        assert np.array_equal(m, (res.alpha > 0.5).numpy())
    assert any(m.any() for m in masks)


def test_workers_split_the_callers_threads():
    from backends.splat import frames
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        seen = list(map_frames(lambda i: torch.get_num_threads(), list(range(4)), workers=2))
        assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(threads)
    if frames._openmp():  # each worker its own OpenMP team: 4 threads over 2 frames at once
        assert seen == [2, 2, 2, 2]
