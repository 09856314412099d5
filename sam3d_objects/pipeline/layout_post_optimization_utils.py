"""Layout (pose) refinement after generation: match the posed mesh to the input mask and point map.

Upstream's names and steps (its layout post-optimisation: ICP on the point map, then a render-and-compare
refinement of the pose), on every device:

* Hard silhouettes (IoU, the accept / reject decisions) are rendered with the project's triangle rasteriser
  ``backends.rasterize`` (nvdiffrast-like API), imported on use.
* The gradient of the render-and-compare step comes from a documented simpler objective instead of PyTorch3D's
  soft rasteriser (sigma 1e-4, i.e. a near-hard silhouette whose gradient lives on a one-pixel sliver): a *soft
  splat silhouette*: the visible surface point of each covered pixel (rasterised, then re-expressed through the
  live vertices) is splatted with a one-pixel Gaussian, and the normalised coverage goes through a sigmoid that
  is 0.5 on the silhouette's edge (``SilhouetteRenderer.__call__``). Its MSE against the mask has the same
  minimiser (the silhouette covering the mask) and a gradient a few pixels wide around the boundary.
* ICP uses Open3D when installed (as upstream); otherwise a point-to-point ICP on a SciPy k-d tree with the
  closed-form (Kabsch) rigid fit per iteration.

Frames: vertices in the PyTorch3D camera frame (x left, y up, z forward), row-vector convention (p' = p M).
Intrinsics are normalised (fx, fy, cx, cy in image fractions), projection u = fx (-x) / z + cx, v = fy (-y) / z + cy
(OpenCV axes, pixel (0, 0) top-left).
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Tuple

import numpy as np
import torch
import torch.nn.functional as F

from sam3d_objects.utils.rotation import quaternion_to_matrix

logger = logging.getLogger(__name__)

# y-up (GLB) -> z-up (object frame) for row vectors: p @ ZY.T maps (x, y, z) -> (x, -z, y)
ZY = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, -1.0], [0.0, 1.0, 0.0]])
LOSS_WEIGHTS = {"mask": 200.0, "reg_q": 0.1, "reg_t": 0.05, "reg_s": 0.05}
SHARPNESS = 10.0  # of the soft silhouette's edge
# sigmoid(-+SHARPNESS / 2) as host floats (float32 values): no host tensor enters the device arithmetic
_EDGE_LOW, _EDGE_HIGH = (float(torch.sigmoid(torch.tensor(v))) for v in (-SHARPNESS / 2, SHARPNESS / 2))


# --------------------------------------------------------------------------------------------------------------
# occlusion heuristics (numpy, SciPy)
# --------------------------------------------------------------------------------------------------------------
def remove_small_regions(mask, min_area: int = 100) -> np.ndarray:
    """Keep the 4-connected components of at least ``min_area`` pixels (bool)."""
    from scipy import ndimage
    labels, count = ndimage.label(np.asarray(mask) != 0)
    if count == 0:
        return np.zeros(labels.shape, dtype=bool)
    sizes = np.bincount(labels.ravel())
    keep = sizes >= min_area
    keep[0] = False
    return keep[labels]


def is_near_image_border(mask, border_thickness: int = 10) -> bool:
    mask = np.asarray(mask) != 0
    b = border_thickness
    return bool(mask[:b].any() or mask[-b:].any() or mask[:, :b].any() or mask[:, -b:].any())


def is_occluded_by_others(mask, point_map, dilation_iter: int = 2, z_thresh: float = 0.05,
                          filter_size: int = 3) -> bool:
    """Something nearer than the object hugs its boundary: more than 10 inner-edge pixels lie more than
    ``z_thresh`` behind the nearest outer-edge depth around them."""
    from scipy import ndimage
    mask = np.asarray(mask) != 0
    if not mask.any():
        return False
    z = np.asarray(point_map)[..., 2]
    inner = mask & ~ndimage.binary_erosion(mask, iterations=dilation_iter)
    outer = ndimage.binary_dilation(mask, iterations=dilation_iter) & ~mask
    z_ext = np.where(outer, z, np.inf)
    z_ext_min = ndimage.minimum_filter(z_ext, size=filter_size, mode="constant", cval=np.inf)
    with np.errstate(invalid="ignore"):
        diff = z - z_ext_min
        occluded = inner & (diff > z_thresh)
    return int(np.count_nonzero(occluded & ~np.isnan(diff))) > 10


def has_internal_occlusion(mask, min_hole_area: int = 20) -> bool:
    from scipy import ndimage
    mask = np.asarray(mask) != 0
    _, count = ndimage.label(mask)
    if count > 1:
        return True
    holes = ndimage.binary_fill_holes(mask) & ~mask
    return int(holes.sum()) >= min_hole_area


def check_occlusion(mask, point_map, min_region_area: int = 25, border_thickness: int = 5, z_thresh: float = 0.3,
                    min_hole_area: int = 100) -> bool:
    """True when the object is likely cut by the border or occluded (the refinement is then skipped)."""
    cleaned = remove_small_regions(mask, min_region_area)
    return (is_near_image_border(cleaned, border_thickness)
            or is_occluded_by_others(cleaned, point_map, dilation_iter=2, z_thresh=z_thresh, filter_size=5)
            or has_internal_occlusion(cleaned, min_hole_area))


# --------------------------------------------------------------------------------------------------------------
# mesh, camera, renderer
# --------------------------------------------------------------------------------------------------------------
@dataclass
class LayoutMesh:
    """The posed mesh the refinement works on (PyTorch3D's Meshes upstream)."""
    verts: torch.Tensor  # [V, 3] float32
    faces: torch.Tensor  # [F, 3] int64

    def verts_padded(self) -> torch.Tensor:
        return self.verts[None]

    def faces_padded(self) -> torch.Tensor:
        return self.faces[None]


def set_seed(seed: int = 100) -> None:
    """Seed Python, NumPy and torch (all devices). Unlike upstream, cuDNN flags are left alone (no global side
    effect beyond the seeds)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def load_and_simplify_mesh(Mesh, device, target_triangles: int = 5000):
    """(verts float32 [V, 3], faces int64 [F, 3]) on ``device``: duplicate / degenerate triangles removed and,
    above ``target_triangles``, quadric decimation (Open3D when installed, else fast-simplification through
    trimesh when installed, else the mesh as is, logged)."""
    import trimesh
    mesh = trimesh.Trimesh(np.asarray(Mesh.vertices, dtype=np.float64), np.asarray(Mesh.faces), process=True)
    mesh.update_faces(mesh.nondegenerate_faces())
    mesh.update_faces(mesh.unique_faces())
    mesh.remove_unreferenced_vertices()
    if len(mesh.faces) > target_triangles:
        mesh = _decimate(mesh, target_triangles)
    verts = torch.as_tensor(np.asarray(mesh.vertices), dtype=torch.float32, device=device)
    faces = torch.as_tensor(np.asarray(mesh.faces), dtype=torch.int64, device=device)
    return verts, faces


def _decimate(mesh, target_triangles: int):
    try:
        import open3d as o3d
        o3 = o3d.geometry.TriangleMesh(o3d.utility.Vector3dVector(mesh.vertices),
                                       o3d.utility.Vector3iVector(mesh.faces))
        o3 = o3.remove_non_manifold_edges().simplify_quadric_decimation(target_triangles)
        import trimesh
        return trimesh.Trimesh(np.asarray(o3.vertices), np.asarray(o3.triangles), process=False)
    except ImportError:
        pass
    try:
        return mesh.simplify_quadric_decimation(face_count=target_triangles)
    except Exception as e:  # noqa: BLE001  no decimation library: refine on the full mesh (slower, same result)
        logger.info("no mesh decimation available (%s); using all %d faces", e, len(mesh.faces))
        return mesh


def _row_transform(scale, rotation, translation) -> torch.Tensor:
    """4x4 row-convention matrix of scale(s) -> rotate(R) -> translate(t): [p, 1] @ M = (p * s) @ R + t."""
    rotation = torch.as_tensor(rotation, dtype=torch.float32).reshape(3, 3)
    scale = torch.as_tensor(scale, dtype=torch.float32).reshape(-1).expand(3).to(rotation)
    m = torch.eye(4, dtype=torch.float32, device=rotation.device)
    m[:3, :3] = scale[:, None] * rotation
    m[3, :3] = torch.as_tensor(translation, dtype=torch.float32).reshape(3).to(rotation)
    return m


def _apply_row(m: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    return points @ m[:3, :3].to(points) + m[3, :3].to(points)


def get_mesh(Mesh, tfm_ori: torch.Tensor, device):
    """GLB (y-up) -> object z-up -> posed by ``tfm_ori`` (4x4 row convention) into the camera frame. As upstream,
    the posed vertices are written back into ``Mesh.vertices``. Returns (LayoutMesh, faces, white textures)."""
    verts = torch.as_tensor(np.asarray(Mesh.vertices), dtype=torch.float32) @ ZY.T
    verts = _apply_row(tfm_ori.cpu(), verts)
    Mesh.vertices = verts.numpy()
    v, f = load_and_simplify_mesh(Mesh, device)
    textures = torch.ones_like(v)[None]
    return LayoutMesh(v, f), f, textures


def denormalize_f(norm_K, height, width) -> np.ndarray:
    """Pixel intrinsics from normalised ones: fx W, fy H, cx W, cy H, skew W."""
    K = np.array(torch.as_tensor(norm_K).detach().cpu().numpy(), dtype=np.float64, copy=True)
    K[0, 0] *= width
    K[1, 1] *= height
    K[0, 2] *= width
    K[1, 2] *= height
    K[0, 1] *= width
    return K


class SilhouetteRenderer:
    """Silhouettes of a camera-frame mesh at (H, W): ``hard(mesh)`` through ``backends.rasterize`` (no gradient),
    ``__call__(mesh)`` the soft splat silhouette [1, H, W, 4] (alpha in channel 3, differentiable in the
    vertices)."""

    def __init__(self, K: np.ndarray, size: Tuple[int, int], device):
        self.K = torch.as_tensor(K, dtype=torch.float32, device=device)
        self.size = size
        self.device = device
        self.sigma = 1.0  # pixels

    def project(self, points: torch.Tensor) -> torch.Tensor:
        """Camera points [N, 3] -> pixel (u, v) [N, 2] (pixel centres at integer + 0.5)."""
        z = points[:, 2].clamp_min(1e-6)
        u = self.K[0, 0] * (-points[:, 0]) / z + self.K[0, 2]
        v = self.K[1, 1] * (-points[:, 1]) / z + self.K[1, 2]
        return torch.stack([u, v], dim=-1)

    def clip_coords(self, verts: torch.Tensor) -> torch.Tensor:
        """[1, V, 4] clip-space positions for the rasteriser (x, y in [-1, 1] across the image, w = z)."""
        h, w = self.size
        uv = self.project(verts)
        z = verts[:, 2:3].clamp_min(1e-6)
        ndc = torch.stack([uv[:, 0] / w * 2 - 1, uv[:, 1] / h * 2 - 1], dim=-1)
        depth = (z - 1e-3) / z  # any monotone depth in [0, 1) for the z-test
        return torch.cat([ndc * z, depth * z, z], dim=-1)[None]

    def hard(self, mesh: LayoutMesh) -> torch.Tensor:
        """[1, H, W] float silhouette (1 where a triangle covers the pixel centre)."""
        from backends import rasterize
        rast = rasterize.rasterize(self.clip_coords(mesh.verts.detach()), mesh.faces.to(torch.int32), self.size)
        return (rast[..., 3] > 0).float()

    def visible_points(self, mesh: LayoutMesh) -> torch.Tensor:
        """The surface point seen at each covered pixel centre, as a differentiable function of the vertices:
        the rasteriser fixes (triangle, barycentrics) per pixel, the point is their blend of the live vertices
        (nvdiffrast's (u, v): p = u v0 + v v1 + (1 - u - v) v2)."""
        from backends import rasterize
        rast = rasterize.rasterize(self.clip_coords(mesh.verts.detach()), mesh.faces.to(torch.int32),
                                   self.size)[0]
        hit = rast[..., 3] > 0
        tri = mesh.faces[(rast[..., 3][hit] - 1).long()]
        u, v = rast[..., 0][hit, None], rast[..., 1][hit, None]
        corners = mesh.verts[tri]  # [P, 3, 3]
        return u * corners[:, 0] + v * corners[:, 1] + (1 - u - v) * corners[:, 2]

    def __call__(self, mesh: LayoutMesh) -> torch.Tensor:
        """Soft silhouette: the visible surface point of every covered pixel (one per pixel, so the density is
        uniform) is splatted with a Gaussian of ``sigma`` pixels over the 7x7 pixels around it (O(pixels)
        memory); the coverage c is ~1 inside and ~0.5 on a straight edge after dividing by 2 pi sigma^2, and
        alpha = sigmoid(SHARPNESS (c - 0.5)). Moving the vertices moves the splats, hence the gradient."""
        h, w = self.size
        uv = self.project(self.visible_points(mesh))
        base = torch.floor(uv.detach()).long()
        offsets = torch.arange(-3, 4, device=uv.device)
        px = (base[:, 0, None, None] + offsets[None, None, :]).expand(-1, 7, 7)
        py = (base[:, 1, None, None] + offsets[None, :, None]).expand(-1, 7, 7)
        d2 = (px + 0.5 - uv[:, 0, None, None]) ** 2 + (py + 0.5 - uv[:, 1, None, None]) ** 2
        weight = torch.exp(-d2 / (2 * self.sigma ** 2))
        inside = (px >= 0) & (px < w) & (py >= 0) & (py < h)
        coverage = torch.zeros(h * w, device=uv.device, dtype=uv.dtype).index_add(
            0, (py * w + px)[inside], weight[inside]).reshape(h, w)
        alpha = torch.sigmoid(SHARPNESS * (coverage / (2 * np.pi * self.sigma ** 2) - 0.5))
        low, high = _EDGE_LOW, _EDGE_HIGH
        alpha = ((alpha - low) / (high - low)).clamp(0, 1)  # exactly 0 on empty pixels, 1 when fully covered
        rgba = torch.zeros(1, h, w, 3, device=uv.device, dtype=uv.dtype)
        return torch.cat([rgba, alpha[None, ..., None]], dim=-1)


def get_mask_renderer(Mask, min_size, Intrinsics, device):
    """Mask resized (bilinear) so its short side is ``min_size`` -> ([1, 1, H', W'], renderer at H' x W')."""
    mask = torch.as_tensor(Mask, dtype=torch.float32, device=device)
    h, w = mask.shape[-2:]
    factor = float(min_size) / min(h, w)
    size = (int(round(h * factor)), int(round(w * factor)))
    mask = F.interpolate(mask.reshape(1, 1, h, w), size=size, mode="bilinear", align_corners=False)
    K = denormalize_f(Intrinsics, size[0], size[1])
    return mask, SilhouetteRenderer(K, size, device)


def compute_iou(render_mask_obj, mask_obj_gt, threshold: float = 0.5) -> torch.Tensor:
    a = torch.as_tensor(render_mask_obj).squeeze() > threshold
    b = torch.as_tensor(mask_obj_gt).squeeze().to(a.device) > threshold
    union = (a | b).sum()
    inter = (a & b).sum()
    if union == 0:
        return torch.ones((), device=a.device)
    return inter.float() / union.float()


# --------------------------------------------------------------------------------------------------------------
# alignment, ICP, render-and-compare
# --------------------------------------------------------------------------------------------------------------
def run_alignment(Point_Map, mask, mesh, center, faces_idx, textures, renderer, device,
                  align_pm_coordinate: bool = False):
    """Scale (height ratio) and shift (means) the mesh onto the masked point-map points. Returns (source verts,
    target points, center, tfm1, mesh, iou tensor, iou float, no_target flag)."""
    pts = torch.as_tensor(Point_Map, dtype=torch.float32, device=device)
    sel = torch.as_tensor(mask, device=device)[0, 0] != 0
    target = pts[sel]
    if align_pm_coordinate:
        target = target * target.new_tensor([-1.0, -1.0, 1.0])
    if target.shape[0]:
        target = target[target[:, 2] <= torch.quantile(target[:, 2], 0.9)]  # drop flying points
    if target.shape[0] == 0:
        return None, None, None, None, None, None, None, True
    verts = mesh.verts.clone()
    s1 = (target[:, 1].max() - target[:, 1].min()) / (verts[:, 1].max() - verts[:, 1].min()).clamp_min(1e-12)
    verts = verts * s1
    center = torch.as_tensor(center, dtype=torch.float32, device=device) * s1
    t1 = target.mean(0) - verts.mean(0)
    verts, center = verts + t1, center + t1
    tfm1 = _row_transform(s1, torch.eye(3, device=t1.device), t1)
    new_mesh = LayoutMesh(verts, mesh.faces)
    iou = compute_iou(renderer.hard(new_mesh), mask[0, 0], 0.5)
    return verts, target, center, tfm1, new_mesh, iou, float(iou), False


def tensor_to_o3d_pcd(tensor):
    import open3d as o3d
    return o3d.geometry.PointCloud(o3d.utility.Vector3dVector(torch.as_tensor(tensor).detach().cpu().double()
                                                              .numpy()))


def o3d_to_tensor(pcd) -> torch.Tensor:
    return torch.as_tensor(np.asarray(pcd.points), dtype=torch.float32)


def _kabsch(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """4x4 column-convention rigid transform minimising |R src + t - dst|^2."""
    cs, cd = src.mean(0), dst.mean(0)
    u, _, vt = np.linalg.svd((src - cs).T @ (dst - cd))
    sign = np.sign(np.linalg.det(vt.T @ u.T)) or 1.0
    r = vt.T @ np.diag([1.0, 1.0, sign]) @ u.T
    m = np.eye(4)
    m[:3, :3], m[:3, 3] = r, cd - r @ cs
    return m


def _icp_scipy(src: np.ndarray, dst: np.ndarray, threshold: float, iterations: int = 30) -> np.ndarray:
    from scipy.spatial import cKDTree
    tree = cKDTree(dst)
    total = np.eye(4)
    current = src.copy()
    for _ in range(iterations):
        dist, idx = tree.query(current, distance_upper_bound=threshold)
        ok = np.isfinite(dist)
        if ok.sum() < 3:
            break
        step = _kabsch(current[ok], dst[idx[ok]])
        current = current @ step[:3, :3].T + step[:3, 3]
        total = step @ total
        if np.abs(step - np.eye(4)).max() < 1e-7:
            break
    return total


def run_ICP(source_points_mesh, source_points, target_points, threshold):
    """Rigid point-to-point ICP of the mesh points onto the target points (max correspondence ``threshold``);
    returns (aligned mesh vertices on their device, 4x4 column-convention numpy transform)."""
    src = torch.as_tensor(source_points).detach().cpu().double().numpy()
    dst = torch.as_tensor(target_points).detach().cpu().double().numpy()
    try:
        import open3d as o3d
        result = o3d.pipelines.registration.registration_icp(
            tensor_to_o3d_pcd(src), tensor_to_o3d_pcd(dst), threshold, np.eye(4),
            o3d.pipelines.registration.TransformationEstimationPointToPoint())
        transform = np.asarray(result.transformation)
    except ImportError:
        transform = _icp_scipy(src, dst, threshold)
    verts = source_points_mesh.verts if isinstance(source_points_mesh, LayoutMesh) else source_points_mesh
    m = torch.as_tensor(transform, dtype=verts.dtype, device=verts.device)
    return verts @ m[:3, :3].T + m[:3, 3], transform


def apply_transform(mesh, center, quat, translation, scale) -> LayoutMesh:
    """v' = ((v - center) * scale) R^T + center + translation, R from the normalised quaternion (wxyz)."""
    rot = quaternion_to_matrix(quat / quat.norm())
    verts = ((mesh.verts - center) * scale) @ rot.T + center + translation
    return LayoutMesh(verts, mesh.faces)


def compute_loss(rendered, mask_gt, loss_weights, quat, translation, scale) -> torch.Tensor:
    identity = quat.new_tensor([1.0, 0.0, 0.0, 0.0])
    return (loss_weights["mask"] * F.mse_loss(rendered[0, ..., 3], mask_gt[0, 0])
            + loss_weights["reg_q"] * F.mse_loss(quat / quat.norm(), identity)
            + loss_weights["reg_t"] * (translation ** 2).sum()
            + loss_weights["reg_s"] * (scale - 1) ** 2)


def run_render_compare(mesh, center, renderer, mask, device):
    """Adam on (t, s) (5 iterations, lr 1e-2), then on (q, t, s) (25 iterations, lr 5e-3), stopping a stage when
    the loss changes by less than 1e-5. Returns (q, t, s, R) detached."""
    quat = torch.tensor([1.0, 0.0, 0.0, 0.0], device=device, requires_grad=True)
    translation = torch.zeros(3, device=device, requires_grad=True)
    scale = torch.ones((), device=device, requires_grad=True)
    center = torch.as_tensor(center, dtype=torch.float32, device=device).detach()
    mesh = LayoutMesh(mesh.verts.detach(), mesh.faces)
    previous = None
    for params, lr, iterations in (([translation, scale], 1e-2, 5), ([quat, translation, scale], 5e-3, 25)):
        optimizer = torch.optim.Adam(params, lr=lr)
        for _ in range(iterations):
            with torch.enable_grad():
                optimizer.zero_grad()
                rendered = renderer(apply_transform(mesh, center, quat, translation, scale))
                loss = compute_loss(rendered, mask, LOSS_WEIGHTS, quat, translation, scale)
                loss.backward()
                optimizer.step()
            value = float(loss.detach())
            if previous is not None and abs(value - previous) < 1e-5:
                previous = value
                break
            previous = value
    quat, translation, scale = quat.detach(), translation.detach(), scale.detach()
    return quat, translation, scale, quaternion_to_matrix(quat / quat.norm())


def export_transformed_mesh_glb(verts, mesh_obj, center, quat, translation, scale, output_path) -> None:
    """Write ``<output_path>/result.glb``: ``mesh_obj`` (trimesh) with the vertices transformed as in
    ``apply_transform``."""
    verts = torch.as_tensor(verts, dtype=torch.float32, device=quat.device)  # the pose's device
    moved = apply_transform(LayoutMesh(verts, torch.zeros(0, 3, dtype=torch.int64)), center, quat, translation,
                            scale).verts
    mesh_obj.vertices = moved.detach().cpu().numpy()
    Path(output_path).mkdir(parents=True, exist_ok=True)
    mesh_obj.export(str(Path(output_path) / "result.glb"))


__all__ = ["remove_small_regions", "is_near_image_border", "is_occluded_by_others", "has_internal_occlusion",
           "check_occlusion", "get_mesh", "get_mask_renderer", "run_alignment", "apply_transform", "compute_loss",
           "export_transformed_mesh_glb", "set_seed", "load_and_simplify_mesh", "compute_iou", "denormalize_f",
           "tensor_to_o3d_pcd", "o3d_to_tensor", "run_ICP", "run_render_compare", "LayoutMesh",
           "SilhouetteRenderer"]

