"""``pytorch3d.structures`` and ``pytorch3d.renderer`` stand-ins: meshes, point clouds, textures, cameras, ray
bundles and the soft silhouette renderer, with PyTorch3D's conventions (part of :mod:`patches.pytorch3d_shim`).

Conventions (PyTorch3D's documented ones):
- Row vectors: a camera maps world points to its view frame by ``X_view = X_world R + T`` (x left, y up, z
  forward). Its centre is ``-T R^T``.
- NDC: x left, y up; the shorter image side spans [-1, 1], the longer [-u, u] (u = aspect ratio); screen
  (pixel) coordinates have (0, 0) at the top-left corner of the top-left pixel, x right, y down, so
  ``u = (W - s x_ndc) / 2``, ``v = (H - s y_ndc) / 2`` with s = min(H, W).
- ``PerspectiveCameras``: in NDC (``in_ndc=True``) ``x_ndc = fx X / Z + px``, ``y_ndc = fy Y / Z + py``,
  ``z_ndc = 1 / Z``. Defined in screen space (``in_ndc=False``, focal length and principal point in pixels, with
  ``image_size`` (H, W)), the camera is the NDC camera with ``f_ndc = 2 f / s`` and ``p_ndc = -(2 p - size) / s``
  (PyTorch3D's documented conversion), so a view point lands at pixel ``(px - fx X / Z, py - fy Y / Z)``: the
  OpenCV pixel of the point (-X, -Y, Z), i.e. OpenCV intrinsics used on points in PyTorch3D's frame.
- ``FoVPerspectiveCameras``: OpenGL-style frustum, ``x_ndc = X / (Z tan(fov / 2) aspect_ratio)``,
  ``y_ndc = Y / (Z tan(fov / 2))``, ``z_ndc = zfar (Z - znear) / ((zfar - znear) Z)``.
- ``MeshRasterizer`` keeps, per pixel, the ``faces_per_pixel`` nearest faces within ``blur_radius`` (a squared
  NDC distance) and returns ``Fragments(pix_to_face, zbuf, bary_coords, dists)``; ``SoftSilhouetteShader``
  returns [N, H, W, 4] images whose alpha is ``1 - prod_k (1 - sigmoid(-dists_k / sigma))`` and whose colour is
  1. The arithmetic is ``backends.soft_rasterize``; gradients flow to the vertices through ``dists``.
"""
from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from .pytorch3d_transforms import Transform3d

TensorOrList = Union[torch.Tensor, Sequence[torch.Tensor]]


# ------------------------------------------------------------------------------------------------- helpers
def _as_list(value: Optional[TensorOrList], name: str) -> Optional[List[torch.Tensor]]:
    """A list of per-item tensors from a list, or from a padded [N, ...] tensor (a lone [V, C] is one item)."""
    if value is None:
        return None
    if torch.is_tensor(value):
        if value.dim() == 2:
            return [value]
        if value.dim() != 3:
            raise ValueError(f"{name} must be a list of [V, C] tensors or a padded [N, V, C] tensor, got "
                             f"{tuple(value.shape)}")
        return list(value.unbind(0))
    return list(value)


def _pad(items: Sequence[torch.Tensor], fill: float, width: int, dtype=None, device=None) -> torch.Tensor:
    n = max((t.shape[0] for t in items), default=0)
    out = torch.full((len(items), n, width), fill, dtype=dtype or (items[0].dtype if items else torch.float32),
                     device=device or (items[0].device if items else None))
    for i, t in enumerate(items):
        out[i, :t.shape[0]] = t
    return out


# ------------------------------------------------------------------------------------------------ textures
class TexturesVertex:
    """Per-vertex features (colours): ``verts_features`` a list of [V, C] tensors or a padded [N, V, C] tensor."""

    def __init__(self, verts_features: TensorOrList):
        self._list = _as_list(verts_features, "verts_features")

    def verts_features_list(self) -> List[torch.Tensor]:
        return self._list

    def verts_features_packed(self) -> torch.Tensor:
        return torch.cat(self._list, 0)

    def verts_features_padded(self) -> torch.Tensor:
        return _pad(self._list, 0.0, self._list[0].shape[-1])

    def join_scene(self) -> "TexturesVertex":
        return TexturesVertex([self.verts_features_packed()])

    def join_batch(self, textures: Sequence["TexturesVertex"]) -> "TexturesVertex":
        return TexturesVertex(self._list + [t for tex in textures for t in tex._list])

    def extend(self, n: int) -> "TexturesVertex":
        return TexturesVertex([t for t in self._list for _ in range(n)])

    def sample_textures(self, fragments, faces_packed: torch.Tensor) -> torch.Tensor:
        """Barycentric interpolation of the vertex features at every fragment: [N, H, W, K, C]."""
        feats = self.verts_features_packed()
        corner = feats[faces_packed]  # [F, 3, C]
        p2f = fragments.pix_to_face
        vals = (fragments.bary_coords[..., None] * corner[p2f.clamp(min=0)]).sum(-2)
        return torch.where((p2f >= 0)[..., None], vals, torch.zeros_like(vals))

    def __getitem__(self, index) -> "TexturesVertex":
        return TexturesVertex([self._list[i] for i in _indices(index, len(self._list))])

    def __len__(self) -> int:
        return len(self._list)

    def clone(self) -> "TexturesVertex":
        return TexturesVertex([t.clone() for t in self._list])

    def detach(self) -> "TexturesVertex":
        return TexturesVertex([t.detach() for t in self._list])

    def to(self, device) -> "TexturesVertex":
        return TexturesVertex([t.to(device) for t in self._list])

    def cpu(self) -> "TexturesVertex":
        return self.to("cpu")


class TexturesAtlas:
    """Per-face texture atlases: ``atlas`` a list of [F, R, R, C] tensors or a padded [N, F, R, R, C] tensor."""

    def __init__(self, atlas: TensorOrList):
        self._list = list(atlas.unbind(0)) if torch.is_tensor(atlas) else list(atlas)

    def atlas_list(self) -> List[torch.Tensor]:
        return self._list

    def atlas_packed(self) -> torch.Tensor:
        return torch.cat(self._list, 0)

    def atlas_padded(self) -> torch.Tensor:
        n = max(t.shape[0] for t in self._list)
        out = self._list[0].new_zeros((len(self._list), n) + tuple(self._list[0].shape[1:]))
        for i, t in enumerate(self._list):
            out[i, :t.shape[0]] = t
        return out

    def join_scene(self) -> "TexturesAtlas":
        return TexturesAtlas([self.atlas_packed()])

    def extend(self, n: int) -> "TexturesAtlas":
        return TexturesAtlas([t for t in self._list for _ in range(n)])

    def __getitem__(self, index) -> "TexturesAtlas":
        return TexturesAtlas([self._list[i] for i in _indices(index, len(self._list))])

    def __len__(self) -> int:
        return len(self._list)

    def clone(self) -> "TexturesAtlas":
        return TexturesAtlas([t.clone() for t in self._list])

    def detach(self) -> "TexturesAtlas":
        return TexturesAtlas([t.detach() for t in self._list])

    def to(self, device) -> "TexturesAtlas":
        return TexturesAtlas([t.to(device) for t in self._list])

    def cpu(self) -> "TexturesAtlas":
        return self.to("cpu")


def _indices(index, n: int) -> List[int]:
    if isinstance(index, int):
        return [index % n]
    if isinstance(index, slice):
        return list(range(n))[index]
    if torch.is_tensor(index):
        index = torch.nonzero(index).squeeze(1) if index.dtype == torch.bool else index
        return [int(i) for i in index.reshape(-1)]
    return [int(i) for i in index]


# ---------------------------------------------------------------------------------------------- structures
class Meshes:
    """A batch of triangle meshes: ``verts`` (list of [V, 3] or padded [N, V, 3]), ``faces`` (list of [F, 3] int
    or padded [N, F, 3] with -1 rows as padding), optional ``textures``. Packed faces index packed vertices."""

    def __init__(self, verts: TensorOrList, faces: TensorOrList, textures=None, verts_normals=None):
        self._verts = _as_list(verts, "verts")
        faces_list = _as_list(faces, "faces")
        if len(faces_list) != len(self._verts):
            raise ValueError(f"{len(self._verts)} vertex sets but {len(faces_list)} face sets")
        if torch.is_tensor(faces):  # padded: drop the -1 rows
            faces_list = [f[(f >= 0).all(-1)] for f in faces_list]
        self._faces = [f.to(dtype=torch.long, device=v.device) for f, v in zip(faces_list, self._verts)]
        self.textures = textures
        self.device = self._verts[0].device if self._verts else torch.device("cpu")

    # -- per mesh
    def verts_list(self) -> List[torch.Tensor]:
        return self._verts

    def faces_list(self) -> List[torch.Tensor]:
        return self._faces

    def num_verts_per_mesh(self) -> torch.Tensor:
        return torch.tensor([v.shape[0] for v in self._verts], device=self.device)

    def num_faces_per_mesh(self) -> torch.Tensor:
        return torch.tensor([f.shape[0] for f in self._faces], device=self.device)

    # -- packed
    def verts_packed(self) -> torch.Tensor:
        return torch.cat(self._verts, 0)

    def mesh_to_verts_packed_first_idx(self) -> torch.Tensor:
        n = self.num_verts_per_mesh()
        return torch.cumsum(n, 0) - n

    def mesh_to_faces_packed_first_idx(self) -> torch.Tensor:
        n = self.num_faces_per_mesh()
        return torch.cumsum(n, 0) - n

    def faces_packed(self) -> torch.Tensor:
        firsts = self.mesh_to_verts_packed_first_idx().tolist()
        return torch.cat([f + first for f, first in zip(self._faces, firsts)], 0)

    def verts_packed_to_mesh_idx(self) -> torch.Tensor:
        return torch.repeat_interleave(torch.arange(len(self), device=self.device), self.num_verts_per_mesh())

    def faces_packed_to_mesh_idx(self) -> torch.Tensor:
        return torch.repeat_interleave(torch.arange(len(self), device=self.device), self.num_faces_per_mesh())

    # -- padded
    def verts_padded(self) -> torch.Tensor:
        return _pad(self._verts, 0.0, 3)

    def faces_padded(self) -> torch.Tensor:
        return _pad(self._faces, -1, 3, dtype=torch.long, device=self.device)

    # -- geometry
    def faces_normals_packed(self) -> torch.Tensor:
        v, f = self.verts_packed(), self.faces_packed()
        a, b, c = v[f[:, 0]], v[f[:, 1]], v[f[:, 2]]
        return F.normalize(torch.cross(b - a, c - a, dim=-1), dim=-1, eps=1e-6)

    def faces_areas_packed(self) -> torch.Tensor:
        v, f = self.verts_packed(), self.faces_packed()
        a, b, c = v[f[:, 0]], v[f[:, 1]], v[f[:, 2]]
        return 0.5 * torch.cross(b - a, c - a, dim=-1).norm(dim=-1)

    def verts_normals_packed(self) -> torch.Tensor:
        """Vertex normals: the area-weighted sum of the adjacent faces' normals, normalised."""
        v, f = self.verts_packed(), self.faces_packed()
        a, b, c = v[f[:, 0]], v[f[:, 1]], v[f[:, 2]]
        n = torch.cross(b - a, c - a, dim=-1)  # length = 2 * area
        out = torch.zeros_like(v).index_add(0, f.reshape(-1), n.repeat_interleave(3, 0))
        return F.normalize(out, dim=-1, eps=1e-6)

    def get_bounding_boxes(self) -> torch.Tensor:
        """[N, 3, 2]: per mesh and axis, (min, max)."""
        return torch.stack([torch.stack([v.amin(0), v.amax(0)], -1) for v in self._verts])

    # -- batch
    def __len__(self) -> int:
        return len(self._verts)

    def isempty(self) -> bool:
        return len(self._verts) == 0 or all(v.shape[0] == 0 for v in self._verts)

    def __getitem__(self, index) -> "Meshes":
        ids = _indices(index, len(self))
        tex = self.textures[ids] if self.textures is not None else None
        return Meshes([self._verts[i] for i in ids], [self._faces[i] for i in ids], textures=tex)

    def _like(self, verts: List[torch.Tensor], faces: Optional[List[torch.Tensor]] = None, textures=None):
        return Meshes(verts, self._faces if faces is None else faces,
                      textures=self.textures if textures is None else textures)

    def offset_verts(self, vert_offsets_packed: torch.Tensor) -> "Meshes":
        moved = self.verts_packed() + vert_offsets_packed
        return self._like(list(moved.split(self.num_verts_per_mesh().tolist(), 0)))

    def update_padded(self, new_verts_padded: torch.Tensor) -> "Meshes":
        return self._like([new_verts_padded[i, :v.shape[0]] for i, v in enumerate(self._verts)])

    def scale_verts(self, scale) -> "Meshes":
        s = torch.as_tensor(scale, dtype=self._verts[0].dtype, device=self.device).reshape(-1)
        s = s.expand(len(self)) if s.numel() == 1 else s
        return self._like([v * s[i] for i, v in enumerate(self._verts)])

    def extend(self, n: int) -> "Meshes":
        tex = self.textures.extend(n) if self.textures is not None else None
        return Meshes([v for v in self._verts for _ in range(n)], [f for f in self._faces for _ in range(n)],
                      textures=tex)

    def clone(self) -> "Meshes":
        tex = self.textures.clone() if self.textures is not None else None
        return Meshes([v.clone() for v in self._verts], [f.clone() for f in self._faces], textures=tex)

    def detach(self) -> "Meshes":
        tex = self.textures.detach() if self.textures is not None else None
        return Meshes([v.detach() for v in self._verts], self._faces, textures=tex)

    def to(self, device) -> "Meshes":
        tex = self.textures.to(device) if self.textures is not None else None
        return Meshes([v.to(device) for v in self._verts], [f.to(device) for f in self._faces], textures=tex)

    def cpu(self) -> "Meshes":
        return self.to("cpu")


def join_meshes_as_scene(meshes: Union[Meshes, Sequence[Meshes]], include_textures: bool = True) -> Meshes:
    """One mesh holding every mesh of the batch (or of the list): packed vertices, packed faces, joined
    textures."""
    if not isinstance(meshes, Meshes):
        meshes = join_meshes_as_batch(list(meshes), include_textures)
    tex = None
    if include_textures and meshes.textures is not None:
        tex = meshes.textures.join_scene()
    return Meshes([meshes.verts_packed()], [meshes.faces_packed()], textures=tex)


def join_meshes_as_batch(meshes: Sequence[Meshes], include_textures: bool = True) -> Meshes:
    verts = [v for m in meshes for v in m.verts_list()]
    faces = [f for m in meshes for f in m.faces_list()]
    tex = None
    if include_textures and all(m.textures is not None for m in meshes):
        first = meshes[0].textures
        if isinstance(first, TexturesVertex):
            tex = TexturesVertex([t for m in meshes for t in m.textures.verts_features_list()])
        elif isinstance(first, TexturesAtlas):
            tex = TexturesAtlas([t for m in meshes for t in m.textures.atlas_list()])
    return Meshes(verts, faces, textures=tex)


class Pointclouds:
    """A batch of point clouds: ``points`` (list of [P, 3] or padded [N, P, 3]; a lone [P, 3] tensor is one
    cloud), optional ``normals`` and ``features`` in the same layout."""

    def __init__(self, points: TensorOrList, normals: Optional[TensorOrList] = None,
                 features: Optional[TensorOrList] = None):
        self._points = _as_list(points, "points")
        self._normals = _as_list(normals, "normals")
        self._features = _as_list(features, "features")
        for name, items in (("normals", self._normals), ("features", self._features)):
            if items is not None and [t.shape[0] for t in items] != [p.shape[0] for p in self._points]:
                raise ValueError(f"{name} must have one row per point")
        self.device = self._points[0].device if self._points else torch.device("cpu")

    def points_list(self) -> List[torch.Tensor]:
        return self._points

    def normals_list(self) -> Optional[List[torch.Tensor]]:
        return self._normals

    def features_list(self) -> Optional[List[torch.Tensor]]:
        return self._features

    def points_packed(self) -> torch.Tensor:
        return torch.cat(self._points, 0)

    def normals_packed(self) -> Optional[torch.Tensor]:
        return None if self._normals is None else torch.cat(self._normals, 0)

    def features_packed(self) -> Optional[torch.Tensor]:
        return None if self._features is None else torch.cat(self._features, 0)

    def points_padded(self) -> torch.Tensor:
        return _pad(self._points, 0.0, 3)

    def normals_padded(self) -> Optional[torch.Tensor]:
        return None if self._normals is None else _pad(self._normals, 0.0, 3)

    def features_padded(self) -> Optional[torch.Tensor]:
        return None if self._features is None else _pad(self._features, 0.0, self._features[0].shape[-1])

    def num_points_per_cloud(self) -> torch.Tensor:
        return torch.tensor([p.shape[0] for p in self._points], device=self.device)

    def packed_to_cloud_idx(self) -> torch.Tensor:
        return torch.repeat_interleave(torch.arange(len(self), device=self.device), self.num_points_per_cloud())

    def get_bounding_boxes(self) -> torch.Tensor:
        return torch.stack([torch.stack([p.amin(0), p.amax(0)], -1) for p in self._points])

    def __len__(self) -> int:
        return len(self._points)

    def isempty(self) -> bool:
        return len(self._points) == 0 or all(p.shape[0] == 0 for p in self._points)

    def __getitem__(self, index) -> "Pointclouds":
        ids = _indices(index, len(self))
        pick = (lambda items: None if items is None else [items[i] for i in ids])
        return Pointclouds(pick(self._points), pick(self._normals), pick(self._features))

    def _map(self, fn) -> "Pointclouds":
        each = (lambda items: None if items is None else [fn(t) for t in items])
        return Pointclouds(each(self._points), each(self._normals), each(self._features))

    def clone(self) -> "Pointclouds":
        return self._map(torch.clone)

    def detach(self) -> "Pointclouds":
        return self._map(torch.Tensor.detach)

    def to(self, device) -> "Pointclouds":
        return self._map(lambda t: t.to(device))

    def cpu(self) -> "Pointclouds":
        return self.to("cpu")


# ------------------------------------------------------------------------------------------------- cameras
def _batched(value, dtype, device, width: Optional[int] = None) -> torch.Tensor:
    t = torch.as_tensor(value, dtype=dtype, device=device) if not torch.is_tensor(value) else \
        value.to(device=device, dtype=dtype)
    if width is not None:
        t = t.reshape(-1, width) if t.dim() < 2 else t
    return t


class CamerasBase:
    """A batch of cameras with extrinsics ``R`` [N, 3, 3], ``T`` [N, 3] (``X_view = X_world R + T``)."""

    _in_ndc = True

    def __init__(self, R=None, T=None, device="cpu", dtype: torch.dtype = torch.float32):
        self.device = torch.device(device) if not torch.is_tensor(R) else R.device
        R = torch.eye(3)[None] if R is None else R
        T = torch.zeros(1, 3) if T is None else T
        self.R = _batched(R, dtype, self.device)
        self.R = self.R[None] if self.R.dim() == 2 else self.R
        self.T = _batched(T, dtype, self.device, 3)
        self._N = max(self.R.shape[0], self.T.shape[0])

    # -- extrinsics
    def get_world_to_view_transform(self, R: Optional[torch.Tensor] = None,
                                    T: Optional[torch.Tensor] = None, **kwargs) -> Transform3d:
        R = self.R if R is None else R
        T = self.T if T is None else T
        n = max(R.shape[0], T.shape[0])
        m = torch.eye(4, dtype=R.dtype, device=R.device).repeat(n, 1, 1)
        m[:, :3, :3] = R.expand(n, 3, 3)
        m[:, 3, :3] = T.expand(n, 3)
        return Transform3d(matrix=m)

    def get_camera_center(self, **kwargs) -> torch.Tensor:
        """World position of each camera [N, 3]: the point whose view coordinates are 0."""
        return -(self.T[:, None, :] @ self.R.transpose(1, 2))[:, 0]

    # -- projection (subclasses: _project(view points [N, P, 3]) -> NDC or screen [N, P, 3])
    def get_full_projection_transform(self, **kwargs) -> Transform3d:
        return self.get_world_to_view_transform(**kwargs).compose(self.get_projection_transform(**kwargs))

    def transform_points(self, points: torch.Tensor, eps: Optional[float] = None, **kwargs) -> torch.Tensor:
        """World points -> the camera's projection space (NDC, or screen pixels for screen-space cameras)."""
        view = self.get_world_to_view_transform(**kwargs).transform_points(points)
        return self._project(view, **kwargs)

    def transform_points_ndc(self, points: torch.Tensor, eps: Optional[float] = None, **kwargs) -> torch.Tensor:
        view = self.get_world_to_view_transform(**kwargs).transform_points(points)
        return self._project_ndc(view, **kwargs)

    def transform_points_screen(self, points: torch.Tensor, eps: Optional[float] = None, image_size=None,
                                with_xyflip: bool = True, **kwargs) -> torch.Tensor:
        """World points -> (u, v, z): pixel coordinates (origin at the image's top-left corner, x right, y down)
        and the projection's z."""
        ndc = self.transform_points_ndc(points, **kwargs)
        h, w = self._image_hw(image_size)
        s = min(h, w)
        if not with_xyflip:
            return torch.stack([(w + s * ndc[..., 0]) / 2, (h + s * ndc[..., 1]) / 2, ndc[..., 2]], -1)
        return torch.stack([(w - s * ndc[..., 0]) / 2, (h - s * ndc[..., 1]) / 2, ndc[..., 2]], -1)

    def _image_hw(self, image_size=None) -> tuple:
        size = image_size if image_size is not None else getattr(self, "image_size", None)
        if size is None:
            raise ValueError("image_size is needed for screen coordinates (pass image_size=(H, W))")
        h, w = torch.as_tensor(size, dtype=torch.float64).reshape(-1, 2)[0].tolist()
        return h, w

    def _project_ndc(self, view: torch.Tensor, **kwargs) -> torch.Tensor:
        return self._project(view, **kwargs)

    def is_perspective(self) -> bool:
        return True

    def in_ndc(self) -> bool:
        return self._in_ndc

    def get_znear(self):
        return getattr(self, "znear", None)

    def get_image_size(self):
        return getattr(self, "image_size", None)

    def __len__(self) -> int:
        return self._N

    def _fields(self) -> dict:
        return {"R": self.R, "T": self.T}

    def _rebuild(self, fields: dict) -> "CamerasBase":
        out = self.__class__.__new__(self.__class__)
        out.__dict__.update(self.__dict__)
        out.__dict__.update(fields)
        out.device = next(iter(fields.values())).device
        out._N = max(v.shape[0] for v in fields.values() if torch.is_tensor(v) and v.dim() > 0)
        return out

    def __getitem__(self, index) -> "CamerasBase":
        ids = torch.as_tensor(_indices(index, self._N), device=self.device)
        return self._rebuild({k: (v[ids.clamp(max=v.shape[0] - 1)] if torch.is_tensor(v) and v.dim() > 0 else v)
                              for k, v in self._fields().items()})

    def to(self, device) -> "CamerasBase":
        return self._rebuild({k: v.to(device) if torch.is_tensor(v) else v for k, v in self._fields().items()})

    def cpu(self) -> "CamerasBase":
        return self.to("cpu")

    def clone(self) -> "CamerasBase":
        return self._rebuild({k: v.clone() if torch.is_tensor(v) else v for k, v in self._fields().items()})


def _pair(value, dtype, device) -> torch.Tensor:
    """focal_length / principal_point: a float, [N] / [N, 1] (one value for x and y) or [N, 2] -> [N, 2]."""
    t = _batched(value, dtype, device)
    if t.dim() == 0:
        t = t.reshape(1, 1)
    if t.dim() == 1:
        t = t[:, None] if t.shape[0] != 2 else t[None]
    return t.expand(-1, 2) if t.shape[-1] == 1 else t


class PerspectiveCameras(CamerasBase):
    """Pinhole cameras: ``focal_length`` (fx, fy) and ``principal_point`` (px, py), in NDC units, or in pixels
    with ``in_ndc=False`` and ``image_size`` [(H, W)] (see the module docstring for both conventions)."""

    def __init__(self, focal_length=1.0, principal_point=((0.0, 0.0),), R=None, T=None, K=None, device="cpu",
                 in_ndc: bool = True, image_size=None):
        super().__init__(R, T, device)
        if K is not None:
            K = _batched(K, torch.float32, self.device)
            K = K[None] if K.dim() == 2 else K
            focal_length, principal_point = K[:, [0, 1], [0, 1]], K[:, [0, 1], [2, 2]]
        self.focal_length = _pair(focal_length, torch.float32, self.device)
        self.principal_point = _pair(principal_point, torch.float32, self.device)
        self._in_ndc = bool(in_ndc)
        self.image_size = None if image_size is None else _batched(image_size, torch.float32, self.device, 2)
        if not in_ndc and self.image_size is None:
            raise ValueError("image_size (H, W) is required for cameras defined in screen space (in_ndc=False)")
        self._N = max(self._N, self.focal_length.shape[0], self.principal_point.shape[0])

    def _fields(self) -> dict:
        fields = {"R": self.R, "T": self.T, "focal_length": self.focal_length,
                  "principal_point": self.principal_point}
        if self.image_size is not None:
            fields["image_size"] = self.image_size
        return fields

    def _ndc_intrinsics(self, **kwargs):
        """(f_ndc [N, 2], p_ndc [N, 2]): screen-space intrinsics converted with the documented rule."""
        f = kwargs.get("focal_length", self.focal_length)
        p = kwargs.get("principal_point", self.principal_point)
        if self._in_ndc:
            return f, p
        size = self.image_size.flip(-1)  # (W, H)
        s = self.image_size.amin(-1, keepdim=True)
        return 2 * f / s, -(2 * p - size) / s

    def _project(self, view: torch.Tensor, **kwargs) -> torch.Tensor:
        ndc = self._project_ndc(view, **kwargs)
        if self._in_ndc:
            return ndc
        return self.transform_points_screen_from_ndc(ndc)

    def _project_ndc(self, view: torch.Tensor, **kwargs) -> torch.Tensor:
        f, p = self._ndc_intrinsics(**kwargs)
        squeeze = view.dim() == 2
        v = view[None] if squeeze else view
        z = v[..., 2]
        out = torch.stack([f[:, None, 0] * v[..., 0] / z + p[:, None, 0], f[:, None, 1] * v[..., 1] / z + p[:, None, 1],
                           1.0 / z], -1)
        return out[0] if squeeze and out.shape[0] == 1 else out

    def transform_points_screen_from_ndc(self, ndc: torch.Tensor) -> torch.Tensor:
        h, w = self._image_hw()
        s = min(h, w)
        return torch.stack([(w - s * ndc[..., 0]) / 2, (h - s * ndc[..., 1]) / 2, ndc[..., 2]], -1)

    def get_projection_transform(self, **kwargs) -> Transform3d:
        """The NDC projection as a row-vector 4x4 (homogeneous divide by the view depth)."""
        f, p = self._ndc_intrinsics(**kwargs)
        m = torch.zeros(f.shape[0], 4, 4, dtype=f.dtype, device=f.device)
        m[:, 0, 0], m[:, 1, 1] = f[:, 0], f[:, 1]
        m[:, 2, 0], m[:, 2, 1] = p[:, 0], p[:, 1]
        m[:, 3, 2], m[:, 2, 3] = 1.0, 1.0
        return Transform3d(matrix=m)


class FoVPerspectiveCameras(CamerasBase):
    """OpenGL-style perspective cameras (``fov`` in degrees unless ``degrees=False``), always in NDC."""

    def __init__(self, znear=1.0, zfar=100.0, aspect_ratio=1.0, fov=60.0, degrees: bool = True, R=None, T=None,
                 K=None, device="cpu"):
        super().__init__(R, T, device)
        if K is not None:
            raise NotImplementedError("FoVPerspectiveCameras(K=...) is not provided by the pytorch3d stand-in")
        as_vec = (lambda v: _batched(v, torch.float32, self.device).reshape(-1))
        self.znear, self.zfar, self.aspect_ratio, self.fov = (as_vec(v) for v in (znear, zfar, aspect_ratio, fov))
        self.degrees = degrees
        self._N = max(self._N, *(t.shape[0] for t in (self.znear, self.zfar, self.aspect_ratio, self.fov)))

    def _fields(self) -> dict:
        return {"R": self.R, "T": self.T, "znear": self.znear, "zfar": self.zfar,
                "aspect_ratio": self.aspect_ratio, "fov": self.fov}

    def _terms(self):
        fov = self.fov * math.pi / 180.0 if self.degrees else self.fov
        tan_half = torch.tan(fov / 2)
        return tan_half, self.aspect_ratio, self.znear, self.zfar

    def _project(self, view: torch.Tensor, **kwargs) -> torch.Tensor:
        tan_half, aspect, near, far = self._terms()
        squeeze = view.dim() == 2
        v = view[None] if squeeze else view
        z = v[..., 2]
        out = torch.stack([v[..., 0] / (z * tan_half[:, None] * aspect[:, None]), v[..., 1] / (z * tan_half[:, None]),
                           far[:, None] * (z - near[:, None]) / ((far - near)[:, None] * z)], -1)
        return out[0] if squeeze and out.shape[0] == 1 else out

    def get_projection_transform(self, **kwargs) -> Transform3d:
        tan_half, aspect, near, far = self._terms()
        m = torch.zeros(tan_half.shape[0], 4, 4, dtype=tan_half.dtype, device=tan_half.device)
        m[:, 0, 0] = 1.0 / (tan_half * aspect)
        m[:, 1, 1] = 1.0 / tan_half
        m[:, 2, 2] = far / (far - near)
        m[:, 3, 2] = -far * near / (far - near)
        m[:, 2, 3] = 1.0
        return Transform3d(matrix=m)


class OrthographicCameras(PerspectiveCameras):
    """Orthographic cameras: ``x_ndc = fx X + px``, ``y_ndc = fy Y + py``, ``z_ndc = Z``."""

    def _project_ndc(self, view: torch.Tensor, **kwargs) -> torch.Tensor:
        f, p = self._ndc_intrinsics(**kwargs)
        squeeze = view.dim() == 2
        v = view[None] if squeeze else view
        out = torch.stack([f[:, None, 0] * v[..., 0] + p[:, None, 0], f[:, None, 1] * v[..., 1] + p[:, None, 1],
                           v[..., 2]], -1)
        return out[0] if squeeze and out.shape[0] == 1 else out

    def get_projection_transform(self, **kwargs) -> Transform3d:
        f, p = self._ndc_intrinsics(**kwargs)
        m = torch.zeros(f.shape[0], 4, 4, dtype=f.dtype, device=f.device)
        m[:, 0, 0], m[:, 1, 1], m[:, 2, 2], m[:, 3, 3] = f[:, 0], f[:, 1], 1.0, 1.0
        m[:, 3, 0], m[:, 3, 1] = p[:, 0], p[:, 1]
        return Transform3d(matrix=m)

    def is_perspective(self) -> bool:
        return False


def camera_to_eye_at_up(world_to_view_transform: Transform3d):
    """(eye, at, up) [N, 3] each, such that ``look_at_view_transform(eye=eye, at=at, up=up)`` gives back the
    camera: eye is the camera centre, at the point one unit in front of it, up the view's +y axis in world."""
    m = world_to_view_transform.get_matrix()
    R, T = m[:, :3, :3], m[:, 3:, :3]
    eye = -(T @ R.transpose(1, 2))[:, 0]
    # the view's axes expressed in world coordinates are R's columns
    forward, up = R[:, :, 2], R[:, :, 1]
    return eye, eye + forward, up


# ------------------------------------------------------------------------------------------------ renderer
class RasterizationSettings:
    """PyTorch3D's mesh rasterisation settings (bin sizes are accepted and ignored: no bins are used here)."""

    def __init__(self, image_size=256, blur_radius: float = 0.0, faces_per_pixel: int = 1, bin_size=None,
                 max_faces_per_bin=None, perspective_correct: Optional[bool] = None,
                 clip_barycentric_coords: Optional[bool] = None, cull_backfaces: bool = False,
                 z_clip_value: Optional[float] = None, cull_to_frustum: bool = False):
        self.image_size = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
        self.blur_radius, self.faces_per_pixel = float(blur_radius), int(faces_per_pixel)
        self.bin_size, self.max_faces_per_bin = bin_size, max_faces_per_bin
        self.perspective_correct, self.clip_barycentric_coords = perspective_correct, clip_barycentric_coords
        self.cull_backfaces, self.z_clip_value, self.cull_to_frustum = cull_backfaces, z_clip_value, cull_to_frustum


class BlendParams(NamedTuple):
    sigma: float = 1e-4
    gamma: float = 1e-4
    background_color: Sequence[float] = (1.0, 1.0, 1.0)


class Fragments(NamedTuple):
    pix_to_face: torch.Tensor  # [N, H, W, K] packed face index, -1 where empty
    zbuf: torch.Tensor  # [N, H, W, K] view depth
    bary_coords: torch.Tensor  # [N, H, W, K, 3]
    dists: torch.Tensor  # [N, H, W, K] signed squared NDC distance (negative inside)


class MeshRasterizer(torch.nn.Module):
    """Meshes -> Fragments through ``backends.soft_rasterize`` (see the module docstring)."""

    def __init__(self, cameras: Optional[CamerasBase] = None, raster_settings: Optional[RasterizationSettings] = None):
        super().__init__()
        self.cameras = cameras
        self.raster_settings = raster_settings or RasterizationSettings()

    def transform(self, meshes_world: Meshes, **kwargs) -> List[torch.Tensor]:
        """Per mesh, vertices as (x_ndc, y_ndc, view depth)."""
        cameras = kwargs.get("cameras", self.cameras)
        if cameras is None:
            raise ValueError("MeshRasterizer needs cameras (constructor or cameras=...)")
        out = []
        for i, verts in enumerate(meshes_world.verts_list()):
            cam = cameras[i if len(cameras) > 1 else 0]
            view = cam.get_world_to_view_transform().transform_points(verts[None])[0]
            ndc = cam.transform_points_ndc(verts[None])[0]
            out.append(torch.stack([ndc[:, 0], ndc[:, 1], view[:, 2]], -1))
        return out

    def forward(self, meshes_world: Meshes, **kwargs) -> Fragments:
        from backends.soft_rasterize import soft_rasterize

        settings = kwargs.get("raster_settings", self.raster_settings)
        if settings.cull_backfaces:
            raise NotImplementedError("cull_backfaces=True is not provided by the pytorch3d stand-in")
        cameras = kwargs.get("cameras", self.cameras)
        perspective = settings.perspective_correct
        perspective = cameras.is_perspective() if perspective is None else perspective
        clip = settings.clip_barycentric_coords
        clip = settings.blur_radius > 0.0 if clip is None else clip
        firsts = meshes_world.mesh_to_faces_packed_first_idx().tolist()
        parts = []
        for verts, faces, first in zip(self.transform(meshes_world, **kwargs), meshes_world.faces_list(), firsts):
            frag = soft_rasterize(verts, faces, settings.image_size, settings.blur_radius, settings.faces_per_pixel,
                                  perspective_correct=perspective, clip_barycentric_coords=clip)
            p2f = frag.pix_to_face if first == 0 else \
                torch.where(frag.pix_to_face >= 0, frag.pix_to_face + first, frag.pix_to_face)
            parts.append(Fragments(p2f, frag.zbuf, frag.bary_coords, frag.dists))
        if len(parts) == 1:
            return parts[0]
        return Fragments(*(torch.cat([p[i] for p in parts], 0) for i in range(4)))


class SoftSilhouetteShader(torch.nn.Module):
    """Fragments -> [N, H, W, 4] images: colour 1, alpha = 1 - prod_k (1 - sigmoid(-dists_k / sigma))."""

    def __init__(self, blend_params: Optional[BlendParams] = None):
        super().__init__()
        self.blend_params = blend_params if blend_params is not None else BlendParams()

    def forward(self, fragments: Fragments, meshes=None, **kwargs) -> torch.Tensor:
        from backends.soft_rasterize import sigmoid_coverage

        params = kwargs.get("blend_params", self.blend_params)
        alpha = sigmoid_coverage(fragments.dists, fragments.pix_to_face, params.sigma)
        return torch.cat([torch.ones(alpha.shape + (3,), dtype=alpha.dtype, device=alpha.device), alpha[..., None]],
                         -1)


class MeshRenderer(torch.nn.Module):
    """rasterizer then shader: ``renderer(meshes)`` -> the shader's images."""

    def __init__(self, rasterizer: MeshRasterizer, shader: torch.nn.Module):
        super().__init__()
        self.rasterizer, self.shader = rasterizer, shader

    def forward(self, meshes_world: Meshes, **kwargs) -> torch.Tensor:
        fragments = self.rasterizer(meshes_world, **kwargs)
        return self.shader(fragments, meshes_world, **kwargs)


# ---------------------------------------------------------------------------------------------------- rays
class RayBundle(NamedTuple):
    """Rays ``origins + lengths * directions``: origins/directions [..., 3], lengths [..., L], xys [..., 2]."""
    origins: torch.Tensor
    directions: torch.Tensor
    lengths: torch.Tensor
    xys: torch.Tensor


class HeterogeneousRayBundle(NamedTuple):
    """A RayBundle whose rays come from several cameras: ``camera_ids`` [M] and ``camera_counts`` [M] say which
    camera each group of rays belongs to."""
    origins: torch.Tensor
    directions: torch.Tensor
    lengths: torch.Tensor
    xys: torch.Tensor
    camera_ids: Optional[torch.LongTensor] = None
    camera_counts: Optional[torch.LongTensor] = None


def ray_bundle_variables_to_ray_points(origins: torch.Tensor, directions: torch.Tensor,
                                       lengths: torch.Tensor) -> torch.Tensor:
    """Points [..., L, 3] at ``lengths`` along each ray."""
    return origins[..., None, :] + lengths[..., :, None] * directions[..., None, :]


def ray_bundle_to_ray_points(ray_bundle) -> torch.Tensor:
    return ray_bundle_variables_to_ray_points(ray_bundle.origins, ray_bundle.directions, ray_bundle.lengths)


RENDERER = dict(PerspectiveCameras=PerspectiveCameras, FoVPerspectiveCameras=FoVPerspectiveCameras,
                OrthographicCameras=OrthographicCameras, CamerasBase=CamerasBase,
                RasterizationSettings=RasterizationSettings, BlendParams=BlendParams, Fragments=Fragments,
                MeshRasterizer=MeshRasterizer, MeshRenderer=MeshRenderer, SoftSilhouetteShader=SoftSilhouetteShader,
                TexturesVertex=TexturesVertex, TexturesAtlas=TexturesAtlas, RayBundle=RayBundle,
                HeterogeneousRayBundle=HeterogeneousRayBundle, ray_bundle_to_ray_points=ray_bundle_to_ray_points,
                ray_bundle_variables_to_ray_points=ray_bundle_variables_to_ray_points)
CAMERAS = dict(PerspectiveCameras=PerspectiveCameras, FoVPerspectiveCameras=FoVPerspectiveCameras,
               OrthographicCameras=OrthographicCameras, CamerasBase=CamerasBase)
STRUCTURES = dict(Meshes=Meshes, Pointclouds=Pointclouds, join_meshes_as_scene=join_meshes_as_scene,
                  join_meshes_as_batch=join_meshes_as_batch)
