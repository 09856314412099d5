"""The bundled example: a synthetic scene (sphere and box on a checkered floor) that this project generates itself.

The scene is ray-cast analytically, so besides the image and the object masks we have its exact point map (no
depth model needed). ``image.png``, ``0.png`` (sphere) and ``1.png`` (box) in ``example/`` are this module's
output, stored in the upstream notebook layout (masks ``<index>.png`` beside ``image.png``); the point map is
recomputed on demand (deterministic, ~0.1 s). Regenerate the PNGs with ``python -m sam3d_objects.assets.example``.
Licence: CC0 1.0 (see LICENSE.md).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np

EXAMPLE_DIR = Path(__file__).resolve().parent / "example"
WIDTH, HEIGHT, FOCAL = 512, 384, 480.0  # pixels; principal point at the image centre
OBJECT_NAMES = ("sphere", "box")

# scene in a world frame that is the OpenCV camera frame (x right, y down, z forward) before the camera is
# pitched down by CAMERA_PITCH; units ~ metres
CAMERA_PITCH = math.radians(6)
FLOOR_Y = 0.9
WALL_Z = 6.0
SPHERE_CENTRE, SPHERE_RADIUS = np.array([-0.45, FLOOR_Y - 0.42, 2.6]), 0.42
BOX_CENTRE, BOX_HALF, BOX_YAW = np.array([0.5, FLOOR_Y - 0.3, 3.0]), np.array([0.3, 0.3, 0.3]), math.radians(35)
LIGHT_DIR = np.array([-0.5, -1.0, -0.6]) / np.linalg.norm([-0.5, -1.0, -0.6])  # towards the light
SPHERE_RGB, BOX_RGB = np.array([0.92, 0.45, 0.15]), np.array([0.2, 0.45, 0.85])
WALL_RGB = np.array([0.82, 0.84, 0.8])


def _rays(width: int, height: int, focal: float, supersample: int = 1) -> np.ndarray:
    """Unit-z ray directions [H*s, W*s, 3] through (sub)pixel centres."""
    s = supersample
    v, u = np.meshgrid((np.arange(height * s) + 0.5) / s, (np.arange(width * s) + 0.5) / s, indexing="ij")
    return np.stack([(u - width / 2) / focal, (v - height / 2) / focal, np.ones_like(u)], axis=-1)


def _to_world(rays: np.ndarray) -> np.ndarray:
    """Camera-frame ray directions -> world frame (camera pitched down about its x axis). Hit distances along
    the unnormalised directions are the same in both frames, so camera-frame points are t * camera ray."""
    c, s = math.cos(CAMERA_PITCH), math.sin(CAMERA_PITCH)
    return rays @ np.array([[1.0, 0.0, 0.0], [0.0, c, s], [0.0, -s, c]]).T


def _hit_plane(origin, d, axis: int, value: float):
    with np.errstate(divide="ignore", invalid="ignore"):
        t = (value - origin[..., axis]) / d[..., axis]
    return np.where(t > 1e-6, t, np.inf)


def _hit_sphere(origin, d):
    oc = origin - SPHERE_CENTRE
    a = (d * d).sum(-1)
    b = 2 * (oc * d).sum(-1)
    c = (oc * oc).sum(-1) - SPHERE_RADIUS ** 2
    disc = b * b - 4 * a * c
    sq = np.sqrt(np.maximum(disc, 0))
    t0, t1 = (-b - sq) / (2 * a), (-b + sq) / (2 * a)
    t = np.where(t0 > 1e-6, t0, np.where(t1 > 1e-6, t1, np.inf))
    return np.where(disc >= 0, t, np.inf)


def _box_rotation() -> np.ndarray:
    c, s = math.cos(BOX_YAW), math.sin(BOX_YAW)
    return np.array([[c, 0, s], [0, 1, 0], [-s, 0, c]])  # about the vertical (y) axis


def _hit_box(origin, d):
    """Slab test in the box frame; returns (t, normal in the camera frame)."""
    rot = _box_rotation()
    o = (origin - BOX_CENTRE) @ rot
    dd = d @ rot
    with np.errstate(divide="ignore", invalid="ignore"):
        t1 = (-BOX_HALF - o) / dd
        t2 = (BOX_HALF - o) / dd
    tmin, tmax = np.minimum(t1, t2), np.maximum(t1, t2)
    t_near, t_far = np.nanmax(tmin, axis=-1), np.nanmin(tmax, axis=-1)
    hit = (t_near <= t_far) & (t_far > 1e-6)
    t = np.where(hit, np.where(t_near > 1e-6, t_near, t_far), np.inf)
    axis = np.nanargmax(tmin, axis=-1)
    normal_local = np.zeros(np.broadcast_shapes(o.shape, dd.shape))
    np.put_along_axis(normal_local, axis[..., None], 1.0, axis=-1)
    normal_local *= -np.sign(np.take_along_axis(dd, axis[..., None], axis=-1))
    return t, normal_local @ rot.T


def _trace(origin, d) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(t, object id: 0 sphere, 1 box, 2 floor, 3 wall, normal) of the first hit along each ray."""
    t_sphere = _hit_sphere(origin, d)
    t_box, n_box = _hit_box(origin, d)
    t_floor = _hit_plane(origin, d, 1, FLOOR_Y)
    t_wall = _hit_plane(origin, d, 2, WALL_Z)
    ts = np.stack([t_sphere, t_box, t_floor, t_wall], axis=-1)
    ids = np.argmin(ts, axis=-1)
    t = np.take_along_axis(ts, ids[..., None], axis=-1)[..., 0]
    point = origin + d * t[..., None]
    n_sphere = (point - SPHERE_CENTRE) / SPHERE_RADIUS
    normals = np.select([ids[..., None] == 0, ids[..., None] == 1, ids[..., None] == 2],
                        [n_sphere, n_box, np.broadcast_to([0.0, -1.0, 0.0], point.shape)],
                        np.broadcast_to([0.0, 0.0, -1.0], point.shape))
    return t, ids, normals


def _shade(origin, d) -> np.ndarray:
    t, ids, normals = _trace(origin, d)
    point = origin + d * t[..., None]
    lambert = np.clip((normals * LIGHT_DIR).sum(-1), 0, 1)
    shadow_t, shadow_ids, _ = _trace(point + normals * 1e-4, np.broadcast_to(LIGHT_DIR, point.shape))
    lit = ~((shadow_ids <= 1) & np.isfinite(shadow_t))
    checker = ((np.floor(point[..., 0] * 2.5) + np.floor(point[..., 2] * 2.5)) % 2)[..., None]
    floor_rgb = np.where(checker > 0, [0.78, 0.74, 0.66], [0.45, 0.42, 0.38])
    albedo = np.select([ids[..., None] == 0, ids[..., None] == 1, ids[..., None] == 2],
                       [np.broadcast_to(SPHERE_RGB, point.shape), np.broadcast_to(BOX_RGB, point.shape), floor_rgb],
                       np.broadcast_to(WALL_RGB, point.shape))
    light = 0.35 + 0.65 * lambert * lit
    return albedo * light[..., None]


def render_example(width: int = WIDTH, height: int = HEIGHT, focal: float = FOCAL, supersample: int = 2
                   ) -> Dict[str, object]:
    """{"image": uint8 [H, W, 3], "masks": [bool [H, W]] (sphere, box), "pointmap": float32 [H, W, 3] in the
    PyTorch3D camera frame (x left, y up, z forward), "focal": pixels}."""
    origin = np.zeros(3)
    rays = _rays(width, height, focal, supersample)
    rgb = _shade(origin, _to_world(rays))
    rgb = rgb.reshape(height, supersample, width, supersample, 3).mean(axis=(1, 3))
    image = np.clip(np.round(rgb ** (1 / 1.6) * 255), 0, 255).astype(np.uint8)  # mild gamma
    centre_rays = _rays(width, height, focal)
    t, ids, _ = _trace(origin, _to_world(centre_rays))
    points = centre_rays * t[..., None]
    pointmap = (points * np.array([-1.0, -1.0, 1.0])).astype(np.float32)
    return {"image": image, "masks": [ids == 0, ids == 1], "pointmap": pointmap, "focal": focal}


def example_pointmap(height: int = HEIGHT, width: int = WIDTH) -> np.ndarray:
    """Exact point map [H, W, 3] (PyTorch3D camera frame) of the bundled image."""
    centre_rays = _rays(width, height, FOCAL)
    t, _, _ = _trace(np.zeros(3), _to_world(centre_rays))
    return (centre_rays * t[..., None] * np.array([-1.0, -1.0, 1.0])).astype(np.float32)


def load_example() -> Dict[str, object]:
    """The stored PNGs plus the analytic point map: {"image", "masks", "pointmap", "focal", "folder"}."""
    from PIL import Image
    image = np.asarray(Image.open(EXAMPLE_DIR / "image.png").convert("RGB")).copy()
    masks: List[np.ndarray] = [np.asarray(Image.open(EXAMPLE_DIR / f"{i}.png").convert("L")) > 0
                               for i in range(len(OBJECT_NAMES))]
    return {"image": image, "masks": masks, "pointmap": example_pointmap(*image.shape[:2]), "focal": FOCAL,
            "folder": EXAMPLE_DIR}


def write_example(folder: Path = EXAMPLE_DIR) -> None:
    from PIL import Image
    folder.mkdir(parents=True, exist_ok=True)
    scene = render_example()
    Image.fromarray(scene["image"]).save(folder / "image.png", optimize=True)
    for i, mask in enumerate(scene["masks"]):
        Image.fromarray(mask.astype(np.uint8) * 255).save(folder / f"{i}.png", optimize=True)


if __name__ == "__main__":
    write_example()
    print(f"wrote {EXAMPLE_DIR}/image.png, 0.png, 1.png")
