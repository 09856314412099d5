"""``sam3d-objects segment VIDEO --video ...``: SAM 3's video predictor (the ``sam3`` package, unmodified) over a
clip, a text or point prompt propagated to every frame; per-frame masks written as PNGs.

Runs on CUDA as upstream does and on CPU / MPS through ``patches.apply()`` (which includes the import-time
fix-ups of :mod:`patches.sam3_video`). Output (``--out DIR``)::

    frames/<frame>.png              the frames as the predictor saw them (what --reconstruct hands over)
    masks/<frame>/<object id>.png   one 0/255 PNG per tracked object on that frame (`reconstruct --mask` layout)
    tracks.json                     per frame: object ids, scores, boxes (x, y, w, h in pixels)

A video file is read with imageio (``imageio-ffmpeg`` for mp4/mov/avi/mkv/webm; GIFs need only Pillow); a folder
of frames needs neither.
"""
from __future__ import annotations

import contextlib
import io
import json
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import numpy as np

from sam3d_objects.sam3_support import SegmentError, fill_uninitialised_parameters, find_bpe_vocabulary, require_sam3

VIDEO_EXTS = (".mp4", ".mov", ".avi", ".mkv", ".webm", ".gif", ".m4v")
FRAME_EXTS = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff")


def is_video_file(path: str) -> bool:
    return Path(path).is_file() and Path(path).suffix.lower() in VIDEO_EXTS


def _natural_key(path: Path):
    """frame2 before frame10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]


def read_frames(source: str, max_frames: Optional[int] = None, stride: int = 1) -> List["Image.Image"]:
    """RGB frames of a video file or of a folder of images (in natural name order), every ``stride``-th, at most
    ``max_frames``."""
    from PIL import Image

    if stride < 1:
        raise SegmentError(f"--stride must be at least 1, got {stride}")
    path = Path(source)
    frames: List[Image.Image] = []
    if path.is_dir():
        files = sorted((p for p in path.iterdir() if p.is_file() and p.suffix.lower() in FRAME_EXTS), key=_natural_key)
        for k, file in enumerate(files[::stride]):
            if max_frames is not None and k >= max_frames:
                break
            frames.append(Image.open(file).convert("RGB"))
    elif is_video_file(source):
        frames = _read_video_file(path, max_frames, stride)
    elif path.exists():
        raise SegmentError(f"{source} is neither a folder of frames nor a video ({', '.join(VIDEO_EXTS)})")
    else:
        raise SegmentError(f"{source} does not exist")
    if not frames:
        raise SegmentError(f"no frames in {source}")
    sizes = {f.size for f in frames}
    if len(sizes) > 1:
        raise SegmentError(f"the frames of {source} differ in size ({sorted(sizes)[:3]}): a clip has one frame size")
    return frames


def _read_video_file(path: Path, max_frames: Optional[int], stride: int) -> list:
    from PIL import Image

    try:
        import imageio.v2 as imageio
    except ImportError as error:
        raise SegmentError(f"reading {path.name} needs imageio (pip install imageio imageio-ffmpeg), or pass a "
                           f"folder of its frames") from error
    try:
        reader = imageio.get_reader(str(path))
    except (ValueError, RuntimeError, OSError) as error:
        raise SegmentError(f"cannot read {path.name} ({error}); for mp4/mov/avi/mkv/webm install imageio-ffmpeg "
                           f"(pip install imageio-ffmpeg), or pass a folder of its frames") from error
    frames = []
    with reader:
        for k, frame in enumerate(reader):
            if k % stride:
                continue
            if max_frames is not None and len(frames) >= max_frames:
                break
            frames.append(Image.fromarray(np.asarray(frame)[..., :3]).convert("RGB"))
    return frames


def parse_points(text: str) -> List[List[float]]:
    """``x,y;x,y`` in pixels."""
    points = []
    for item in text.split(";"):
        try:
            x, y = (float(v) for v in item.split(","))
        except ValueError:
            raise SegmentError(f"--points must be x,y[;x,y...] in pixels, got {text!r}") from None
        points.append([x, y])
    return points


def build_video_predictor(checkpoint: Optional[str] = None, bpe: Optional[str] = None,
                          device: Optional[str] = None):
    """``sam3.model_builder.build_sam3_video_predictor`` after ``patches.apply()``; random weights without
    ``checkpoint`` (plumbing checks: the predictor loads an empty checkpoint non-strictly, then the parameters
    SAM 3 leaves uninitialised get small random values)."""
    require_sam3()
    try:
        import scipy  # noqa: F401  SAM 3's video tracker imports it
    except ImportError as error:
        raise SegmentError("SAM 3's video predictor needs scipy: `make extras EXTRAS=sam3`") from error
    import patches

    patches.apply(device=device)
    from sam3.model_builder import build_sam3_video_predictor

    vocabulary = str(find_bpe_vocabulary(bpe))
    if checkpoint is not None:
        if not Path(checkpoint).is_file():
            raise SegmentError(f"SAM 3 checkpoint {checkpoint} does not exist")
        return build_sam3_video_predictor(checkpoint_path=checkpoint, bpe_path=vocabulary)
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        empty = Path(tmp) / "no_weights.pt"
        torch.save({}, empty)
        with contextlib.redirect_stdout(io.StringIO()):  # SAM 3 prints every missing key
            predictor = build_sam3_video_predictor(checkpoint_path=str(empty), bpe_path=vocabulary,
                                                   strict_state_dict_loading=False)
    fill_uninitialised_parameters(predictor.model)
    return predictor


@dataclass
class VideoSummary:
    frames: int = 0
    objects: List[int] = field(default_factory=list)
    masks: int = 0
    seconds_prompt: float = 0.0
    seconds_propagate: float = 0.0
    out: str = ""

    def text(self) -> str:
        per = self.seconds_propagate / max(1, self.frames)
        return (f"{self.frames} frame(s), {len(self.objects)} object(s) tracked (ids {self.objects}), {self.masks} "
                f"mask(s) written to {Path(self.out) / 'masks'}; prompt {self.seconds_prompt:.1f} s, propagation "
                f"{self.seconds_propagate:.1f} s ({per:.1f} s per frame)")


def _write_png(array: np.ndarray, path: Path) -> None:
    from PIL import Image

    tmp = path.with_name(path.stem + ".tmp.png")
    Image.fromarray(array).save(tmp)
    tmp.replace(path)


def write_frame_outputs(out: Path, frame_index: int, outputs: dict) -> Tuple[dict, int]:
    """One frame's masks as ``masks/<frame>/<object id>.png``; returns its tracks.json entry and the mask count."""
    folder = out / "masks" / f"{frame_index:05d}"
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.png"):  # a frame seen again (both directions) is rewritten whole
        old.unlink()
    ids = [int(i) for i in np.asarray(outputs["out_obj_ids"]).tolist()]
    masks = np.asarray(outputs["out_binary_masks"]).astype(bool)
    written = 0
    for obj_id, mask in zip(ids, masks):
        if mask.any():
            _write_png(mask.astype(np.uint8) * 255, folder / f"{obj_id}.png")
            written += 1
    entry = {"frame": frame_index, "object_ids": ids,
             "scores": [float(v) for v in np.asarray(outputs["out_probs"]).tolist()],
             "boxes_xywh": np.asarray(outputs["out_boxes_xywh"], np.float64).round(2).tolist()}
    return entry, written


def segment_video(source: str, out_dir: str, text: Optional[str] = None, points: Optional[str] = None,
                  negative_points: Optional[str] = None, prompt_frame: int = 0, checkpoint: Optional[str] = None,
                  bpe: Optional[str] = None, device: Optional[str] = None, max_frames: Optional[int] = None,
                  stride: int = 1, predictor=None, detection_threshold: Optional[float] = None) -> VideoSummary:
    """Propagate a text prompt (every instance of the concept) or a point prompt (one object, id 1) given on
    ``prompt_frame`` through the clip, both directions; masks per frame under ``out_dir``."""
    if (text is None) == (points is None):
        raise SegmentError("a video needs exactly one prompt: --text or --points")
    frames = read_frames(source, max_frames, stride)
    if not 0 <= prompt_frame < len(frames):
        raise SegmentError(f"--prompt-frame {prompt_frame} is outside the clip's {len(frames)} frame(s)")
    width, height = frames[0].size
    out = Path(out_dir)
    (out / "frames").mkdir(parents=True, exist_ok=True)
    for k, frame in enumerate(frames):
        frame.save(out / "frames" / f"{k:05d}.png")
    predictor = predictor or build_video_predictor(checkpoint, bpe, device)
    if detection_threshold is not None:  # SAM 3's detection score thresholds (0.5 new / 0.7 new-track default)
        predictor.model.score_threshold_detection = detection_threshold
        predictor.model.new_det_thresh = max(detection_threshold, 0.0)
    summary = VideoSummary(frames=len(frames), out=str(out))
    session = predictor.handle_request({"type": "start_session", "resource_path": frames})["session_id"]
    try:
        start = time.perf_counter()
        request = {"type": "add_prompt", "session_id": session, "frame_index": prompt_frame}
        if text is not None:
            request["text"] = text
        else:
            # SAM 3 adds points to the results of a propagation (it refines or adds one object on a frame, then
            # tracks it through the frames already processed): a first pass without prompts gives it those.
            for _ in predictor.handle_stream_request({"type": "propagate_in_video", "session_id": session,
                                                      "start_frame_index": 0, "propagation_direction": "forward"}):
                pass
            positive = parse_points(points)
            negative = parse_points(negative_points) if negative_points else []
            request.update(obj_id=1, points=[[x / width, y / height] for x, y in positive + negative],
                           point_labels=[1] * len(positive) + [0] * len(negative))
        predictor.handle_request(request)
        summary.seconds_prompt = time.perf_counter() - start
        start = time.perf_counter()
        tracks = {}
        for result in predictor.handle_stream_request({"type": "propagate_in_video", "session_id": session,
                                                       "start_frame_index": prompt_frame,
                                                       "propagation_direction": "both"}):
            entry, _ = write_frame_outputs(out, result["frame_index"], result["outputs"])
            tracks[result["frame_index"]] = entry
        summary.seconds_propagate = time.perf_counter() - start
    finally:
        predictor.handle_request({"type": "close_session", "session_id": session})
    ordered = [tracks[k] for k in sorted(tracks)]
    summary.objects = sorted({i for e in ordered for i in e["object_ids"]})
    summary.masks = sum(len(list((out / "masks" / f"{e['frame']:05d}").glob("*.png"))) for e in ordered)
    (out / "tracks.json").write_text(json.dumps({"frames": ordered, "width": width, "height": height,
                                                 "prompt": {"frame": prompt_frame, "text": text, "points": points}},
                                                indent=1))
    return summary


def reconstruct_frame(out_dir: str, frame: int, extra_args: Sequence[str] = ()) -> int:
    """Hand one frame's masks to ``sam3d-objects reconstruct`` (a fresh process: SAM 3's memory and its patches
    stay behind); returns its exit code."""
    import subprocess
    import sys

    out = Path(out_dir)
    masks = out / "masks" / f"{frame:05d}"
    if not masks.is_dir() or not any(masks.glob("*.png")):
        raise SegmentError(f"frame {frame} has no masks to reconstruct (see {out / 'tracks.json'}): choose "
                           f"another --reconstruct-frame")
    command = [sys.executable, "-m", "sam3d_objects.cli", "reconstruct", str(out / "frames" / f"{frame:05d}.png"),
               "--mask", str(masks), "--out", str(out / "reconstruct"), *extra_args]
    print("running:", " ".join(command), flush=True)
    return subprocess.call(command)
