"""`sam3d-objects segment VIDEO`: frames from a folder or a video file, the SAM 3 video predictor's request
protocol (start_session / add_prompt / propagate_in_video / close_session), per-frame masks and --reconstruct.
The predictor is a stand-in here that "tracks" a bright square; the real one runs in test_sam3_video.py (slow)."""
import json

import numpy as np
import pytest
from PIL import Image

from sam3d_objects import cli, segment
from sam3d_objects import segment_video as sv

H, W = 24, 32


def square_frames(count=4):
    frames = []
    for k in range(count):
        a = np.full((H, W, 3), 20, np.uint8)
        a[6:14, 4 + 3 * k:12 + 3 * k] = 240
        frames.append(a)
    return frames


class SquarePredictor:
    """Answers SAM 3 video-predictor requests: object 1 is the bright square of each frame."""

    def __init__(self):
        self.requests, self.sessions = [], {}

    def handle_request(self, request):
        self.requests.append({k: v for k, v in request.items() if k != "resource_path"})
        if request["type"] == "start_session":
            frames = request["resource_path"]
            assert all(isinstance(f, Image.Image) for f in frames)
            self.sessions["s"] = [np.asarray(f) for f in frames]
            return {"session_id": "s"}
        if request["type"] == "close_session":
            self.sessions.pop(request["session_id"])
        return {}

    def handle_stream_request(self, request):
        self.requests.append(dict(request))
        frames = self.sessions[request["session_id"]]
        order = list(range(request["start_frame_index"], len(frames)))
        if request.get("propagation_direction", "both") == "both":
            order += list(range(request["start_frame_index"], -1, -1))
        for k in order:
            mask = frames[k][..., 0] > 128
            yield {"frame_index": k, "outputs": {"out_obj_ids": np.array([1]), "out_probs": np.array([0.9]),
                                                 "out_boxes_xywh": np.array([[4.0 + 3 * k, 6, 8, 8]]),
                                                 "out_binary_masks": mask[None]}}


def test_frames_from_a_folder_in_natural_order_and_from_a_gif(tmp_path):
    folder = tmp_path / "clip"
    folder.mkdir()
    frames = square_frames(11)
    for k, a in enumerate(frames):
        Image.fromarray(a).save(folder / f"f{k}.png")
    read = sv.read_frames(str(folder))
    assert len(read) == 11 and all((np.asarray(r) == a).all() for r, a in zip(read, frames))  # f10 after f9
    assert len(sv.read_frames(str(folder), max_frames=3, stride=2)) == 3
    imageio = pytest.importorskip("imageio.v2")
    gif = tmp_path / "clip.gif"
    imageio.mimsave(gif, frames[:3])
    got = sv.read_frames(str(gif))
    assert len(got) == 3 and got[0].size == (W, H)
    assert (np.asarray(got[1])[..., 0] > 128).sum() == 64  # the square survives the palette


def test_read_errors_name_the_problem(tmp_path):
    with pytest.raises(segment.SegmentError, match="does not exist"):
        sv.read_frames(str(tmp_path / "none.mp4"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(segment.SegmentError, match="no frames"):
        sv.read_frames(str(tmp_path / "empty"))
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"not a video")
    with pytest.raises(segment.SegmentError, match="cannot read bad.mp4"):
        sv.read_frames(str(bad))
    with pytest.raises(segment.SegmentError, match="--points must be"):
        sv.parse_points("1,2;3")


def _clip(tmp_path, count=4):
    folder = tmp_path / "clip"
    folder.mkdir()
    for k, a in enumerate(square_frames(count)):
        Image.fromarray(a).save(folder / f"{k:03d}.jpg", quality=100)
    return folder


def test_text_prompt_writes_masks_per_frame(tmp_path, monkeypatch, capsys):
    folder = _clip(tmp_path)
    fake = SquarePredictor()
    monkeypatch.setattr(sv, "build_video_predictor", lambda *a, **k: fake)
    out = tmp_path / "out"
    code = cli.main(["segment", str(folder), "--video", "--text", "square", "--prompt-frame", "1", "--out", str(out)])
    assert code == cli.EXIT_OK
    assert "4 frame(s), 1 object(s) tracked (ids [1]), 4 mask(s)" in capsys.readouterr().out
    kinds = [r["type"] for r in fake.requests]
    assert kinds == ["start_session", "add_prompt", "propagate_in_video", "close_session"]
    assert fake.requests[1] == {"type": "add_prompt", "session_id": "s", "frame_index": 1, "text": "square"}
    for k, a in enumerate(square_frames()):
        mask = np.asarray(Image.open(out / "masks" / f"{k:05d}" / "1.png")) > 127
        np.testing.assert_array_equal(mask, a[..., 0] > 128)
        assert (out / "frames" / f"{k:05d}.png").is_file()
    tracks = json.loads((out / "tracks.json").read_text())
    assert [f["frame"] for f in tracks["frames"]] == [0, 1, 2, 3] and tracks["frames"][2]["object_ids"] == [1]
    # one frame's masks are what reconstruct reads
    assert len(cli.read_masks([str(out / "masks" / "00002")], (H, W))) == 1


def test_point_prompt_runs_a_first_pass_then_normalised_points(tmp_path, monkeypatch):
    folder = _clip(tmp_path, 3)
    fake = SquarePredictor()
    monkeypatch.setattr(sv, "build_video_predictor", lambda *a, **k: fake)
    summary = sv.segment_video(str(folder), str(tmp_path / "o"), points="8,10;10,12", negative_points="30,2")
    assert summary.frames == 3 and summary.objects == [1]
    kinds = [(r["type"], r.get("propagation_direction")) for r in fake.requests]
    assert kinds == [("start_session", None), ("propagate_in_video", "forward"), ("add_prompt", None),
                     ("propagate_in_video", "both"), ("close_session", None)]
    prompt = fake.requests[2]
    assert prompt["obj_id"] == 1 and prompt["point_labels"] == [1, 1, 0]
    assert prompt["points"] == [[8 / W, 10 / H], [10 / W, 12 / H], [30 / W, 2 / H]]


def test_video_argument_errors(tmp_path, monkeypatch, capsys):
    folder = _clip(tmp_path, 2)
    monkeypatch.setattr(sv, "build_video_predictor", lambda *a, **k: SquarePredictor())
    assert cli.main(["segment", str(folder), "--video", "--out", str(tmp_path / "o")]) == cli.EXIT_INPUT
    assert "exactly one prompt" in capsys.readouterr().err
    assert cli.main(["segment", str(folder), "--video", "--text", "a", "--prompt-frame", "5",
                     "--out", str(tmp_path / "o")]) == cli.EXIT_INPUT
    assert "outside the clip's 2 frame(s)" in capsys.readouterr().err
    image = tmp_path / "one.png"
    Image.fromarray(square_frames(1)[0]).save(image)
    assert cli.main(["segment", str(image), "--points", "1,1", "--out", str(tmp_path / "o")]) == cli.EXIT_INPUT
    assert "need a video file or a folder of frames" in capsys.readouterr().err


def test_reconstruct_hands_one_frame_to_reconstruct(tmp_path, monkeypatch):
    folder = _clip(tmp_path, 3)
    monkeypatch.setattr(sv, "build_video_predictor", lambda *a, **k: SquarePredictor())
    calls = []
    import subprocess

    monkeypatch.setattr(subprocess, "call", lambda command: calls.append(command) or 0)
    out = tmp_path / "o"
    code = cli.main(["segment", str(folder), "--video", "--text", "square", "--out", str(out), "--reconstruct",
                     "--reconstruct-frame", "2", "--reconstruct-args", "--steps 2 --formats gaussian"])
    assert code == cli.EXIT_OK
    (command,) = calls
    assert command[1:4] == ["-m", "sam3d_objects.cli", "reconstruct"]
    assert command[4:] == [str(out / "frames" / "00002.png"), "--mask", str(out / "masks" / "00002"), "--out",
                           str(out / "reconstruct"), "--steps", "2", "--formats", "gaussian"]
