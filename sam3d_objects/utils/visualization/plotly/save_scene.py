"""Frames of a plotly scene seen from an orbiting camera (static image export needs ``kaleido``)."""
from __future__ import annotations

import io
import math
from typing import Dict, List, Optional

import numpy as np


def img_bytes_to_np(img_bytes: bytes) -> np.ndarray:
    """Decode encoded image bytes (PNG from plotly) into an (H, W, C) uint8 array."""
    from PIL import Image
    with Image.open(io.BytesIO(img_bytes)) as img:
        return np.array(img)


def orbit_cameras(num_frames: int, axis: str = "y", elevation: float = 1.0, radius: float = 2.0) -> List[Dict]:
    """plotly scene cameras circling the origin about ``axis`` at distance ``radius``, ``elevation`` along it."""
    cams = []
    for i in range(num_frames):
        a = 2 * math.pi * i / num_frames
        s, c = radius * math.sin(a), radius * math.cos(a)
        if axis == "y":
            eye, up = (s, elevation, c), (0, 1, 0)
        elif axis == "z":
            eye, up = (s, c, elevation), (0, 0, 1)
        elif axis == "x":
            eye, up = (elevation, s, c), (1, 0, 0)
        else:
            raise ValueError(f"Invalid axis: {axis}")
        cams.append({"eye": dict(zip("xyz", eye)), "center": {"x": 0, "y": 0, "z": 0}, "up": dict(zip("xyz", up))})
    return cams


def make_video(scene, output_path: str = "scene_video.mp4", fps: int = 15, duration: int = 1,
               camera_trajectory: Optional[List[Dict]] = None, temp_dir: Optional[str] = None,
               trajectory_kwargs: Optional[Dict] = None) -> List[np.ndarray]:
    """Render ``fps * duration`` frames of the plotly figure ``scene`` along ``camera_trajectory`` (default: an
    orbit, see ``orbit_cameras``; ``trajectory_kwargs`` go there). As upstream, the frames are returned (the
    figure's scene camera is updated in place) and ``output_path`` / ``temp_dir`` are not written: save them with
    e.g. ``imageio.mimsave(path, frames, fps=fps)``. Needs ``pip install kaleido`` for plotly's image export."""
    from tqdm import tqdm
    if not any(k.startswith("scene") for k in scene.layout.to_plotly_json()):
        raise ValueError("Scene must have subplots to create a video")
    num_frames = int(fps * duration)
    cams = camera_trajectory if camera_trajectory is not None else orbit_cameras(num_frames,
                                                                                 **(trajectory_kwargs or {}))
    frames = []
    for cam in tqdm(cams, desc="rendering scene frames"):
        scene.update_scenes(camera=cam)
        try:
            png = scene.to_image(format="png", engine="kaleido")
        except (ValueError, ImportError, RuntimeError) as err:
            raise ImportError("rendering plotly frames needs kaleido: `pip install kaleido`") from err
        frames.append(img_bytes_to_np(png))
    return frames
