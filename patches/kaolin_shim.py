"""``kaolin`` stand-in: the subset SAM 3D code touches.

Why: kaolin ships CUDA builds only for specific torch versions; SAM 3D imports it for input assertions
(``kaolin.utils.testing.check_tensor``) and, in its notebook helper, for a turntable visualiser and the camera
classes. ``check_tensor`` and the pinhole cameras of ``kaolin.render.camera`` are implemented;
``kaolin.visualize``'s widgets import, and constructing one raises an error that names kaolin.

Camera conventions (kaolin's, OpenGL-like): the camera looks down its -z axis with y up and x right; a view
matrix [B, 4, 4] maps world to camera (column vectors), its rotation rows being the camera's right, up and
backward axes in world coordinates. ``PinholeIntrinsics`` (pixels: ``focal_x/y``, principal point offsets ``x0``,
``y0`` from the image centre, ``near``/``far``) projects camera points to NDC with the OpenGL perspective matrix
(x_ndc = 2 fx x / (W (-z)) + 2 x0 / W, y_ndc = 2 fy y / (H (-z)) + 2 y0 / H, depth to [-1, 1] between near and
far). ``Camera.transform`` = extrinsics then intrinsics.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ._modules import drop, install_shim, make


def check_tensor(tensor: torch.Tensor, shape: Optional[Sequence[Optional[int]]] = None,
                 dtype: Optional[torch.dtype] = None, device=None, throw: bool = True) -> bool:
    """Whether ``tensor`` has ``shape`` (None entries match any size), ``dtype`` and ``device``; with ``throw``
    a mismatch raises ValueError instead of returning False."""
    problem = None
    if shape is not None:
        if len(shape) != tensor.dim() or any(s is not None and s != t for s, t in zip(shape, tensor.shape)):
            problem = f"tensor shape is {tuple(tensor.shape)}, should be {tuple(shape)}"
    if problem is None and dtype is not None and tensor.dtype != dtype:
        problem = f"tensor dtype is {tensor.dtype}, should be {dtype}"
    if problem is None and device is not None and tensor.device != torch.device(device):
        problem = f"tensor device is {tensor.device}, should be {device}"
    if problem is not None and throw:
        raise ValueError(problem)
    return problem is None


def _batch(value, dtype=torch.float32, device=None, rank: int = 2) -> torch.Tensor:
    t = torch.as_tensor(value, dtype=dtype, device=device)
    while t.dim() < rank:
        t = t[None]
    return t


class CameraExtrinsics:
    """World-to-camera rigid transforms ``view_matrix()`` [B, 4, 4] (see the module docstring)."""

    def __init__(self, view_matrix: torch.Tensor):
        self._view = _batch(view_matrix, view_matrix.dtype, view_matrix.device, 3)

    @classmethod
    def from_view_matrix(cls, view_matrix: torch.Tensor, dtype: Optional[torch.dtype] = None, device=None,
                         requires_grad: bool = False) -> "CameraExtrinsics":
        m = torch.as_tensor(view_matrix, dtype=dtype or torch.as_tensor(view_matrix).dtype, device=device)
        return cls(m.clone().requires_grad_(requires_grad))

    @classmethod
    def from_lookat(cls, eye, at, up, dtype: torch.dtype = torch.float32, device=None,
                    requires_grad: bool = False) -> "CameraExtrinsics":
        """Cameras at ``eye`` looking at ``at`` with ``up`` roughly up ([3] or [B, 3] each)."""
        eye, at, up = (_batch(v, dtype, device) for v in (eye, at, up))
        eye, at, up = torch.broadcast_tensors(eye, at, up)
        backward = torch.nn.functional.normalize(eye - at, dim=-1)
        right = torch.nn.functional.normalize(torch.cross(up, backward, dim=-1), dim=-1)
        true_up = torch.cross(backward, right, dim=-1)
        rot = torch.stack([right, true_up, backward], 1)  # rows: the camera axes in world coordinates
        view = torch.eye(4, dtype=dtype, device=device).repeat(eye.shape[0], 1, 1)
        view[:, :3, :3] = rot
        view[:, :3, 3] = -(rot @ eye[..., None])[..., 0]
        return cls(view.requires_grad_(requires_grad))

    def view_matrix(self) -> torch.Tensor:
        return self._view

    def inv_view_matrix(self) -> torch.Tensor:
        return torch.linalg.inv(self._view)

    @property
    def R(self) -> torch.Tensor:  # noqa: N802 (kaolin's name)
        return self._view[:, :3, :3]

    @property
    def t(self) -> torch.Tensor:
        return self._view[:, :3, 3:]

    def cam_pos(self) -> torch.Tensor:
        """Camera centres in world coordinates [B, 3, 1]."""
        return -self.R.transpose(1, 2) @ self.t

    def transform(self, vectors: torch.Tensor) -> torch.Tensor:
        """World points [B, N, 3] (or [N, 3], applied with every camera) -> camera coordinates [B, N, 3]."""
        v = vectors[None] if vectors.dim() == 2 else vectors
        return v @ self.R.transpose(1, 2).to(v) + self.t.transpose(1, 2).to(v)

    def __len__(self) -> int:
        return self._view.shape[0]

    @property
    def device(self):
        return self._view.device

    @property
    def dtype(self):
        return self._view.dtype


class CameraIntrinsics:
    """Base class of kaolin's intrinsics (``isinstance`` checks)."""


class PinholeIntrinsics(CameraIntrinsics):
    """Pinhole intrinsics in pixels (see the module docstring)."""

    def __init__(self, width: int, height: int, focal_x, focal_y=None, x0=0.0, y0=0.0, near: float = 1e-2,
                 far: float = 1e2, dtype: torch.dtype = torch.float32, device=None):
        self.width, self.height, self.near, self.far = int(width), int(height), float(near), float(far)
        self.focal_x = _batch(focal_x, dtype, device, 1)
        self.focal_y = self.focal_x.clone() if focal_y is None else _batch(focal_y, dtype, device, 1)
        self.x0, self.y0 = _batch(x0, dtype, device, 1), _batch(y0, dtype, device, 1)

    @classmethod
    def from_focal(cls, width: int, height: int, focal_x, focal_y=None, x0=0.0, y0=0.0, near: float = 1e-2,
                   far: float = 1e2, num_cameras: int = 1, device=None, dtype: torch.dtype = torch.float32):
        return cls(width, height, focal_x, focal_y, x0, y0, near, far, dtype, device)

    @classmethod
    def from_fov(cls, width: int, height: int, fov, fov_direction=None, x0=0.0, y0=0.0, near: float = 1e-2,
                 far: float = 1e2, num_cameras: int = 1, device=None, dtype: torch.dtype = torch.float32):
        """``fov`` in radians along the vertical axis (``fov_direction`` "x"/CameraFOV.HORIZONTAL: horizontal)."""
        horizontal = str(getattr(fov_direction, "name", fov_direction)).lower() in ("horizontal", "x")
        size = width if horizontal else height
        focal = (size / 2) / torch.tan(_batch(fov, dtype, device, 1) / 2)
        return cls(width, height, focal, focal, x0, y0, near, far, dtype, device)

    @property
    def fov_x(self) -> torch.Tensor:
        return 2 * torch.atan(self.width / (2 * self.focal_x))

    @property
    def fov_y(self) -> torch.Tensor:
        return 2 * torch.atan(self.height / (2 * self.focal_y))

    def projection_matrix(self) -> torch.Tensor:
        """OpenGL perspective matrices [B, 4, 4] (column vectors, clip w = -z)."""
        n, f = self.near, self.far
        b = max(self.focal_x.shape[0], self.focal_y.shape[0])
        m = self.focal_x.new_zeros(b, 4, 4)
        m[:, 0, 0] = 2 * self.focal_x / self.width
        m[:, 1, 1] = 2 * self.focal_y / self.height
        m[:, 0, 2] = -2 * self.x0 / self.width
        m[:, 1, 2] = -2 * self.y0 / self.height
        m[:, 2, 2] = -(f + n) / (f - n)
        m[:, 2, 3] = -2 * f * n / (f - n)
        m[:, 3, 2] = -1.0
        return m

    def transform(self, vectors: torch.Tensor) -> torch.Tensor:
        """Camera points [B, N, 3] -> NDC [B, N, 3] (homogeneous division done)."""
        v = vectors[None] if vectors.dim() == 2 else vectors
        homo = torch.cat([v, torch.ones_like(v[..., :1])], -1) @ self.projection_matrix().transpose(1, 2).to(v)
        return homo[..., :3] / homo[..., 3:]

    def __len__(self) -> int:
        return self.focal_x.shape[0]


class Camera:
    """Extrinsics + intrinsics; attribute access falls through to them (``width``, ``view_matrix()``, ...)."""

    def __init__(self, extrinsics: CameraExtrinsics, intrinsics: PinholeIntrinsics):
        self.extrinsics, self.intrinsics = extrinsics, intrinsics

    @classmethod
    def from_args(cls, eye=None, at=None, up=None, view_matrix=None, fov=None, focal_x=None, focal_y=None,
                  x0=0.0, y0=0.0, width: int = 512, height: int = 512, near: float = 1e-2, far: float = 1e2,
                  fov_direction=None, dtype: torch.dtype = torch.float32, device=None, **unused) -> "Camera":
        if view_matrix is not None:
            extrinsics = CameraExtrinsics.from_view_matrix(view_matrix, dtype=dtype, device=device)
        elif eye is not None and at is not None and up is not None:
            extrinsics = CameraExtrinsics.from_lookat(eye, at, up, dtype=dtype, device=device)
        else:
            raise ValueError("Camera.from_args needs view_matrix, or eye, at and up")
        if fov is not None:
            intrinsics = PinholeIntrinsics.from_fov(width, height, fov, fov_direction, x0, y0, near, far,
                                                    device=device, dtype=dtype)
        elif focal_x is not None:
            intrinsics = PinholeIntrinsics.from_focal(width, height, focal_x, focal_y, x0, y0, near, far,
                                                      device=device, dtype=dtype)
        else:
            raise ValueError("Camera.from_args needs fov or focal_x")
        return cls(extrinsics, intrinsics)

    def transform(self, vectors: torch.Tensor) -> torch.Tensor:
        """World points -> NDC through both transforms."""
        return self.intrinsics.transform(self.extrinsics.transform(vectors))

    def view_matrix(self) -> torch.Tensor:
        return self.extrinsics.view_matrix()

    def projection_matrix(self) -> torch.Tensor:
        return self.intrinsics.projection_matrix()

    def cam_pos(self) -> torch.Tensor:
        return self.extrinsics.cam_pos()

    def __getattr__(self, name):
        if name in ("extrinsics", "intrinsics"):
            raise AttributeError(name)
        for part in (self.intrinsics, self.extrinsics):
            if hasattr(part, name):
                return getattr(part, name)
        raise AttributeError(name)

    def __len__(self) -> int:
        return len(self.extrinsics)


def _import_only(qualname: str):
    class ImportOnly:
        def __init__(self, *args, **kwargs):
            raise NotImplementedError(f"{qualname} is only importable through the sam3d patches kaolin stand-in; "
                                      f"install kaolin (CUDA) to use it")
    ImportOnly.__name__ = ImportOnly.__qualname__ = qualname.rsplit(".", 1)[-1]
    return ImportOnly


def _build():
    testing = make("kaolin.utils.testing", __doc__, check_tensor=check_tensor)
    utils = make("kaolin.utils", __doc__, testing=testing)
    visualize = make("kaolin.visualize", __doc__, **{n: _import_only(f"kaolin.visualize.{n}") for n in (
        "IpyTurntableVisualizer", "IpyFlyingVisualizer")})
    camera = make("kaolin.render.camera", __doc__, Camera=Camera, CameraExtrinsics=CameraExtrinsics,
                  PinholeIntrinsics=PinholeIntrinsics, CameraIntrinsics=CameraIntrinsics,
                  OrthographicIntrinsics=_import_only("kaolin.render.camera.OrthographicIntrinsics"))
    render = make("kaolin.render", __doc__, camera=camera)
    root = make("kaolin", __doc__, utils=utils, visualize=visualize, render=render, __version__="0.0+sam3d-shim")
    return [root, utils, testing, visualize, render, camera]


def install(replace_installed: bool = False) -> str:
    return install_shim("kaolin", _build, replace_installed)


def uninstall() -> None:
    drop("kaolin", only_shims=True)
