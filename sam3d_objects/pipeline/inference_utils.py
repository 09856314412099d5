"""Pipeline helpers: voxel post-processing after stage 1 and the pose decoders.

``prune_sparse_structure`` / ``downsample_sparse_structure`` turn the stage-1 occupancy into the voxel set that
stage 2 works on; ``get_pose_decoder(name)`` returns the function mapping the stage-1 pose latents to a metric
pose (translation, quaternion wxyz, scale).
"""
from __future__ import annotations

import copy
import logging
import math
from typing import Callable, Dict, Optional

import numpy as np
import torch

import backends
from sam3d_objects.model.backbone.tdfy_dit.models import sparse_structure_utils as _ssu
from sam3d_objects.utils.rotation import matrix_to_quaternion, quaternion_to_matrix, rotation_6d_to_matrix

logger = logging.getLogger(__name__)

# Default de-normalisation statistics of the stage-2 latent (InferencePipeline's slat_mean / slat_std defaults;
# the released pipeline.yaml passes its own values).
SLAT_MEAN = torch.tensor([-2.1687545776367188, -0.004347046371549368, -0.13352349400520325, -0.08418072760105133,
                          -0.5271206498146057, 0.7238689064979553, -1.1414450407028198, 1.2039363384246826])
SLAT_STD = torch.tensor([2.377650737762451, 2.386378288269043, 2.124418020248413, 2.1748552322387695,
                         2.663944721221924, 2.371192216873169, 2.6217446327209473, 2.684523105621338])


def prune_sparse_structure(coord_batch: torch.Tensor, max_neighbor_axes_dist: int = 1) -> torch.Tensor:
    """Drop voxels whose whole (2d+1)^3 neighbourhood is occupied (interior voxels); rows [batch, x, y, z]."""
    return _ssu.prune_sparse_structure(coord_batch, max_neighbor_axes_dist)


def downsample_sparse_structure(coord_batch: torch.Tensor, max_coords: int = 42000, downsample_factor: int = 2):
    """(coords, factor): coarsen the voxel set by ``downsample_factor`` when it has more than ``max_coords`` rows."""
    return _ssu.downsample_sparse_structure(coord_batch, max_coords, downsample_factor)

# Statistics of the 6D rotation latent (pred * STD + MEAN). Gram-Schmidt normalises each 3-vector, so results
# depend on each half (a1 = first three, a2 = last three entries) only up to a positive factor; the values below
# are fixed by the released model's behaviour (golden pose_decode / pipeline_tiny data), each half scaled so that
# its largest std is 1.
ROTATION_6D_MEAN = torch.tensor([-0.093798, 0.012433, 0.000252, 0.001154, -0.005006, 0.836440])
ROTATION_6D_STD = torch.tensor([0.980840, 1.000000, 0.447104, 0.711512, 0.644691, 1.000000])



# --------------------------------------------------------------------------------------------------------------
# pose decoding
# --------------------------------------------------------------------------------------------------------------
def _token(x: torch.Tensor) -> torch.Tensor:
    """Generator output [B, 1, C] (or [B, C]) -> [B, C]."""
    return x.reshape(x.shape[0], -1) if x.dim() >= 2 else x[None]


def _as_row(value, default, like: torch.Tensor) -> torch.Tensor:
    value = default if value is None else value
    value = torch.as_tensor(value, dtype=like.dtype, device=like.device)
    return value.reshape(1, -1) if value.dim() <= 1 else value.reshape(value.shape[0], -1)


def compose_object_to_scene(scale_obj: torch.Tensor, rot: torch.Tensor, translation: torch.Tensor,
                            scene_scale: torch.Tensor, scene_shift: torch.Tensor):
    """Scale(s) -> Rotate(R) -> Translate(t) then Scale(scene) -> Translate(shift), row-vector convention,
    decomposed back into (translation, rotation matrix, per-axis scale = row norms)."""
    block = scale_obj[..., :, None] * rot * scene_scale[..., None, :]
    t = translation * scene_scale + scene_shift
    scale = block.norm(dim=-1)
    return t, block / scale[..., :, None], scale


def decode_scale_shift_invariant(model_output: Dict[str, torch.Tensor], scene_scale=None, scene_shift=None,
                                 **_) -> Dict[str, torch.Tensor]:
    """Stage-1 pose latents (normalised point-map frame) -> metric pose in the camera (PyTorch3D) frame."""
    d6 = _token(model_output["6drotation_normalized"])
    d6 = d6 * ROTATION_6D_STD.to(d6) + ROTATION_6D_MEAN.to(d6)
    rot = rotation_6d_to_matrix(d6)
    scale_obj = torch.exp(_token(model_output["scale"])).mean(-1, keepdim=True).expand(-1, 3)
    translation = _token(model_output["translation"])
    s = _as_row(scene_scale, 1.0, translation).expand_as(translation)
    shift = _as_row(scene_shift, [0.0, 0.0, 0.0], translation).expand_as(translation)
    t, rot, scale = compose_object_to_scene(scale_obj, rot, translation, s, shift)
    return {"translation": t, "rotation": matrix_to_quaternion(rot), "scale": scale}


def pose_decoder(pose_target_convention: str) -> Callable:
    """Decoder of the stage-1 pose latents for ``pose_target_convention``. The released model uses
    "ScaleShiftInvariant" (the only convention decoded here; others raise a clear error when called)."""
    if pose_target_convention == "ScaleShiftInvariant":
        return decode_scale_shift_invariant

    def unsupported(model_output_dict, scene_scale=None, scene_shift=None, **_):
        raise ValueError(f"pose target convention {pose_target_convention!r} is not decoded by this package; the "
                         f"released checkpoints use 'ScaleShiftInvariant'")
    return unsupported


def zero_prediction_decoder() -> Callable:
    """Decoder that ignores the predicted pose: zero translation, log-scale 1.337 (a debugging baseline)."""
    def decode(model_output_dict, scene_scale=None, scene_shift=None, **kwargs):
        out = copy.deepcopy(model_output_dict)
        logger.warning("zero_prediction_decoder: the predicted translation and scale are replaced by constants")
        for key in ("translation", "translation_scale"):
            if key in out:
                out[key] = torch.zeros_like(out[key])
        out["scale"] = torch.full_like(out["scale"], 1.337)
        return decode_scale_shift_invariant(out, scene_scale=scene_scale, scene_shift=scene_shift, **kwargs)
    return decode


def get_default_pose_decoder() -> Callable:
    """Decoder that returns no pose ({})."""
    def decode(model_output_dict, **kwargs):
        return {}
    return decode


POSE_DECODERS: Dict[str, Callable] = {
    "default": get_default_pose_decoder(),
    "ApparentSize": pose_decoder("ApparentSize"),
    "DisparitySpace": pose_decoder("DisparitySpace"),
    "ScaleShiftInvariant": pose_decoder("ScaleShiftInvariant"),
    "ZeroPredictionScaleShiftInvariant": zero_prediction_decoder(),
}


class UnknownPoseDecoderError(ValueError, NotImplementedError):
    """Unknown pose decoder name (a NotImplementedError too, as upstream raised)."""


def get_pose_decoder(name: Optional[str]) -> Callable:
    if name not in POSE_DECODERS:
        raise UnknownPoseDecoderError(f"unknown pose decoder {name!r}; available: {sorted(POSE_DECODERS)} "
                                      f"(pipeline.yaml key pose_decoder_name)")
    return POSE_DECODERS[name]


# --------------------------------------------------------------------------------------------------------------
# mesh / layout utilities
# --------------------------------------------------------------------------------------------------------------
def normalize_mesh_verts(verts: np.ndarray):
    """(vertices centred on their box and divided by its longest side, 1 / side, centre); side 0 -> scale 1."""
    verts = np.asarray(verts)
    lo, hi = verts.min(axis=0), verts.max(axis=0)
    center = (lo + hi) / 2
    extent = float((hi - lo).max())
    if extent == 0:
        return verts - center, 1, center
    return (verts - center) / extent, 1 / extent, center


def _already_unit(verts: np.ndarray) -> bool:
    return abs(float(verts.min()) + 0.5) < 1e-3 and abs(float(verts.max()) - 0.5) < 1e-3


def preprocess_mesh(mesh):
    """A trimesh mesh normalised in place into the unit box centred at 0 (unless it already spans [-0.5, 0.5])."""
    verts = np.asarray(mesh.vertices)
    if not _already_unit(verts):
        mesh.vertices = normalize_mesh_verts(verts)[0]
    return mesh


def estimate_plane_area(mask: torch.Tensor) -> float:
    """Fraction of the image covered by the bounding box of the mask's > 0.5 pixels (0 for an empty mask)."""
    mask = torch.as_tensor(mask)
    if mask.numel() == 0:
        return 0.0
    rows, cols = torch.nonzero(mask > 0.5, as_tuple=True)
    if rows.numel() == 0:
        return 0.0
    height = int(rows.max() - rows.min() + 1)
    width = int(cols.max() - cols.min() + 1)
    return height * width / (mask.shape[-2] * mask.shape[-1])


def quat_wxyz_to_euler_XYZ(q) -> tuple:  # noqa: N802  upstream's name
    """Negated (alpha, beta, gamma) XYZ Euler angles of a wxyz quaternion, from the transposed rotation matrix."""
    q = torch.as_tensor(q, dtype=torch.float64).reshape(4)
    r = quaternion_to_matrix(q / q.norm()).T
    eps = 1e-12
    beta = math.atan2(-float(r[2, 0]), max(math.sqrt(float(r[0, 0]) ** 2 + float(r[1, 0]) ** 2), eps))
    alpha = math.atan2(float(r[2, 1]), float(r[2, 2]))
    gamma = math.atan2(float(r[1, 0]), float(r[0, 0]))
    return -alpha, -beta, -gamma


def format_to_halo(layout_output: Dict) -> Dict:
    """{"roll", "pitch", "yaw", "pred_scale", "pred_transform" (4x4 nested list, rotation + translation)}."""
    quaternion = torch.as_tensor(layout_output["quaternion"])[0, 0]
    translation = torch.as_tensor(layout_output["translation"])[0]
    scale = [float(v) for v in torch.as_tensor(layout_output["scale"])[0].reshape(-1)]
    roll, pitch, yaw = quat_wxyz_to_euler_XYZ(quaternion)
    transform = torch.eye(4, dtype=torch.float64)
    transform[:3, :3] = quaternion_to_matrix(quaternion.double() / quaternion.double().norm())
    transform[:3, 3] = translation.double().reshape(-1)[:3]
    return {"roll": float(roll), "pitch": float(pitch), "yaw": float(yaw), "pred_scale": scale,
            "pred_transform": transform.tolist()}


def json_to_halo_payloads(target_data: Dict) -> Dict:
    """Viewer payload: positions from the transform's last column (z - 1), rotation (roll, pitch, yaw), scale."""
    t = target_data["pred_transform"]
    s = target_data["pred_scale"]
    return {"positions": {"x": t[0][3], "y": t[1][3], "z": t[2][3] - 1},
            "rotation": {"x": target_data.get("roll", 0), "y": target_data.get("pitch", 0),
                         "z": target_data.get("yaw", 0)},
            "scale": {"x": s[0], "y": s[1], "z": s[2]}}


def _row_matrix(transform) -> torch.Tensor:
    """[N, 4, 4] row-vector matrix of a PyTorch3D ``Transform3d`` / ``RowTransform`` or of a raw matrix."""
    m = transform.get_matrix() if hasattr(transform, "get_matrix") else torch.as_tensor(transform)
    return m if m.dim() == 3 else m[None]


def convert_to_halo(pred_transform, device, dtype):
    """Wrap a row-vector pose transform for the viewer's frame: first (x, y, z) -> (x, -z, y) (GLB y-up -> z-up
    object frame), then the pose, then diag(-1, -1, 1) (PyTorch3D camera -> OpenCV camera)."""
    from sam3d_objects.data.dataset.tdfy.transforms_3d import RowTransform
    a = torch.eye(4, device=device, dtype=dtype)
    a[:3, :3] = torch.tensor([[1.0, 0, 0], [0, 0, 1], [0, -1, 0]], device=device, dtype=dtype)
    b = torch.diag(torch.tensor([-1.0, -1.0, 1.0, 1.0], device=device, dtype=dtype))
    return RowTransform(a @ _row_matrix(pred_transform).to(device=device, dtype=dtype) @ b)


def update_layout(pred_t, pred_s, pred_quat, center, scale, to_halo: bool = True):
    """(translation, scale, quaternion wxyz) of the pose after undoing a mesh normalisation ``(p - center) *
    scale`` (when ``center`` is given) and, with ``to_halo``, converting to the viewer's frame
    (:func:`convert_to_halo`). Without both the inputs are returned unchanged."""
    from sam3d_objects.data.dataset.tdfy.transforms_3d import compose_transform, decompose_transform
    if center is None and not to_halo:
        return pred_t, pred_s, pred_quat
    pred_t = torch.as_tensor(pred_t).reshape(1, 3)
    dtype, device = pred_t.dtype, pred_t.device
    rot = quaternion_to_matrix(torch.as_tensor(pred_quat, dtype=dtype, device=device).reshape(-1, 4)[0])
    pose = _row_matrix(compose_transform(torch.as_tensor(pred_s, dtype=dtype, device=device).reshape(1, 3),
                                         rot[None], pred_t))
    if center is not None:
        norm = torch.eye(4, dtype=dtype, device=device) * float(scale)
        norm[3, 3] = 1
        norm[3, :3] = -float(scale) * torch.as_tensor(center, dtype=dtype, device=device).reshape(3)
        pose = norm[None] @ pose
    if to_halo:
        pose = _row_matrix(convert_to_halo(pose, device, dtype))
    from sam3d_objects.data.dataset.tdfy.transforms_3d import RowTransform
    dec = decompose_transform(RowTransform(pose))
    return dec.translation, dec.scale, matrix_to_quaternion(dec.rotation)


# --------------------------------------------------------------------------------------------------------------
# layout post-optimisation (owned by the pipeline; helpers in layout_post_optimization_utils)
# --------------------------------------------------------------------------------------------------------------
def layout_post_optimization(Mesh, Quaternion, Translation, Scale, Mask, Point_Map, Intrinsics,
                             Enable_shape_ICP: bool = True, Enable_rendering_optimization: bool = True,
                             min_size: int = 512, device=None):
    """Refine the predicted pose so that the posed mesh's silhouette matches ``Mask`` and its surface the
    ``Point_Map`` (upstream's algorithm, spec 3.2): align (height ratio + mean shift), rigid ICP (kept if the IoU
    improves), render-and-compare (kept if the IoU is >= 0.5 and better than after alignment; otherwise every
    refinement is dropped). ``Mesh``: the pipeline's y-up GLB (its vertices are overwritten: pass a copy).
    Returns (quaternion [1, 4] wxyz, translation [1, 3], scale [1, 3], iou float (-1.0 when skipped),
    icp_accepted, render_opt_accepted). Renders go through ``backends.rasterize``."""
    from sam3d_objects.pipeline import layout_post_optimization_utils as lpo
    from sam3d_objects.utils.rotation import quaternion_to_matrix
    device = backends.device.as_device(device)  # upstream: "cuda"; here the default device
    lpo.set_seed(100)
    # the refinement works on `device`; the refined pose goes back to the caller's device
    out_device = Quaternion.device if isinstance(Quaternion, torch.Tensor) else torch.device("cpu")
    quat0 = torch.as_tensor(Quaternion, dtype=torch.float32).reshape(1, 4).to(device)
    trans0 = torch.as_tensor(Translation, dtype=torch.float32).reshape(1, 3).to(device)
    scale0 = torch.as_tensor(Scale, dtype=torch.float32).reshape(1, 3).to(device)
    skipped = (Quaternion, Translation, Scale, -1.0, False, False)
    tfm_ori = lpo._row_transform(scale0[0], quaternion_to_matrix(quat0[0]), trans0[0])
    mesh, faces, textures = lpo.get_mesh(Mesh, tfm_ori, device)
    mask, renderer = lpo.get_mask_renderer(Mask, min_size, Intrinsics, device)
    point_map = torch.as_tensor(Point_Map, dtype=torch.float32).to(device)
    if point_map.shape[:2] != mask.shape[-2:]:  # the point map follows the mask's resize (nearest keeps NaNs local)
        point_map = torch.nn.functional.interpolate(point_map.permute(2, 0, 1)[None], size=mask.shape[-2:],
                                                    mode="nearest")[0].permute(1, 2, 0)
    if lpo.check_occlusion(mask[0, 0].cpu().numpy(), point_map.cpu().numpy()):
        return skipped
    src, tgt, center, tfm1, mesh, ori_iou, final_iou, no_target = lpo.run_alignment(
        point_map, mask, mesh, trans0[0], faces, textures, renderer, device)
    if no_target:
        return skipped
    # every 4x4 below is built on `device`: the pose algebra mixes them with the device's tensors
    tfm2, icp_ok = torch.eye(4, device=device), False
    if Enable_shape_ICP:
        verts_icp, transform = lpo.run_ICP(mesh, src, tgt, 0.05)
        mesh_icp = lpo.LayoutMesh(verts_icp, mesh.faces)
        iou_icp = lpo.compute_iou(renderer.hard(mesh_icp), mask[0, 0])
        if iou_icp > ori_iou:
            icp_ok, mesh, final_iou = True, mesh_icp, float(iou_icp)
            row = torch.as_tensor(transform, dtype=torch.float32, device=device).T  # column -> row convention
            scale = row[:3, :3].norm(dim=-1)
            rot = row[:3, :3] / scale[:, None]
            center = (center * scale) @ rot + row[3, :3]
            tfm2 = lpo._row_transform(scale, rot, row[3, :3])
    tfm = tfm_ori @ tfm1 @ tfm2
    render_ok = False
    if Enable_rendering_optimization:
        q, t, s, rot = lpo.run_render_compare(mesh, center, renderer, mask, device)
        optimized = float(lpo.compute_iou(renderer.hard(lpo.apply_transform(mesh, center, q, t, s)), mask[0, 0]))
        if optimized < 0.5 or optimized <= float(ori_iou):
            tfm = tfm_ori  # every refinement rejected (as upstream)
        else:
            render_ok, final_iou = True, optimized
            to_center, from_center = torch.eye(4, device=device), torch.eye(4, device=device)
            to_center[3, :3], from_center[3, :3] = -center, center + t
            tfm3 = to_center @ lpo._row_transform(s, rot.T, torch.zeros(3, device=device)) @ from_center
            tfm = tfm @ tfm3
    scale = tfm[:3, :3].norm(dim=-1)
    rot = tfm[:3, :3] / scale[:, None]
    return (matrix_to_quaternion(rot)[None].to(out_device), tfm[3, :3][None].clone().to(out_device),
            scale[None].to(out_device), round(float(final_iou), 4), icp_ok, render_ok)



# ----------------------------------------------------------------------------------------------------------------
# mesh voxelisation and floor-plane estimation (open3d optional: numpy / trimesh implementations here)
# ----------------------------------------------------------------------------------------------------------------
# row-vector map (x, y, z) -> (x, z, -y): z-up object frame -> the GLB's y-up frame
_ZY = np.array([[1.0, 0.0, 0.0], [0.0, 0.0, -1.0], [0.0, 1.0, 0.0]])


def _require_open3d():
    try:
        import open3d
    except ImportError as err:
        raise ImportError("this function builds an Open3D mesh: install Open3D with `pip install open3d` "
                          "(or `make extras EXTRAS=open3d` in the clone)") from err
    return open3d


def _mesh_arrays(mesh):
    """(vertices, faces) numpy arrays of an Open3D TriangleMesh or a trimesh mesh."""
    if hasattr(mesh, "triangles") and not hasattr(mesh, "faces"):  # Open3D
        return np.asarray(mesh.vertices, dtype=np.float64), np.asarray(mesh.triangles, dtype=np.int64)
    return np.asarray(mesh.vertices, dtype=np.float64), np.asarray(mesh.faces, dtype=np.int64)


def _set_mesh_vertices(mesh, verts: np.ndarray) -> None:
    if hasattr(mesh, "triangles") and not hasattr(mesh, "faces"):
        import open3d
        mesh.vertices = open3d.utility.Vector3dVector(verts)
    else:
        mesh.vertices = verts


def _surface_voxels(verts: np.ndarray, faces: np.ndarray, voxel_size: float) -> np.ndarray:
    """Unique (i, j, k) indices of the voxels of the box [-0.5, 0.5]^3 touched by the surface: every triangle is
    sampled on a barycentric grid finer than half a voxel along its longest edge, and the samples are binned."""
    tri = verts[faces]  # (F, 3, 3)
    edges = np.linalg.norm(tri - np.roll(tri, 1, axis=1), axis=-1).max(axis=1)
    steps = np.maximum(1, np.ceil(edges / (voxel_size / 2))).astype(np.int64)
    n = int(round(1.0 / voxel_size))
    cells = []
    for k in np.unique(steps):  # triangles with the same grid size are sampled together
        i, j = np.meshgrid(np.arange(k + 1), np.arange(k + 1), indexing="ij")
        keep = i + j <= k
        bary = np.stack([i[keep], j[keep]], axis=-1) / k  # (S, 2)
        t = tri[steps == k]
        pts = t[:, None, 0] + bary[None, :, :1] * (t[:, None, 1] - t[:, None, 0]) \
            + bary[None, :, 1:] * (t[:, None, 2] - t[:, None, 0])
        idx = np.floor((pts.reshape(-1, 3) + 0.5) / voxel_size).astype(np.int64)
        idx = idx[((idx >= 0) & (idx < n)).all(axis=1)]
        cells.append(np.unique((idx[:, 0] * n + idx[:, 1]) * n + idx[:, 2]))  # 1-D keys: fast unique
    flat = np.unique(np.concatenate(cells)) if cells else np.zeros(0, dtype=np.int64)
    return np.stack([flat // (n * n), flat // n % n, flat % n], axis=-1)


def voxelize_mesh(mesh, resolution: int = 64):
    """Surface occupancy of a y-up mesh (Open3D TriangleMesh as upstream, or trimesh) on a resolution^3 grid.

    The vertices go back to z-up, are normalised into the unit box (unless they already span [-0.5, 0.5]) and
    clipped inside it; as upstream, the normalised vertices are written back into ``mesh``. Voxels are 1/64 wide
    (fixed, as upstream), their centres mapped to grid cell int((c + 0.5) * resolution). Returns (occupancy long
    tensor (1, R, R, R), scale, center) with scale/center None when no normalisation was needed.
    """
    verts, faces = _mesh_arrays(mesh)
    verts = verts @ _ZY.T
    scale = center = None
    if not _already_unit(verts):
        verts, scale, center = normalize_mesh_verts(verts)
    verts = np.clip(verts, -0.5 + 1e-6, 0.5 - 1e-6)
    _set_mesh_vertices(mesh, verts)
    voxel_size = 1.0 / 64
    cells = _surface_voxels(verts, faces, voxel_size)
    centers = (cells + 0.5) * voxel_size - 0.5
    grid = np.clip(((centers + 0.5) * resolution).astype(np.int64), 0, resolution - 1)
    occupancy = torch.zeros(1, resolution, resolution, resolution, dtype=torch.long)
    if len(grid):
        g = torch.from_numpy(grid)
        occupancy[0, g[:, 0], g[:, 1], g[:, 2]] = 1
    return occupancy, scale, center


def trimesh2o3d_mesh(trimesh_mesh):
    """Open3D TriangleMesh with the trimesh mesh's vertices and faces (needs `pip install open3d`)."""
    o3d = _require_open3d()
    return o3d.geometry.TriangleMesh(o3d.utility.Vector3dVector(np.asarray(trimesh_mesh.vertices, dtype=np.float64)),
                                     o3d.utility.Vector3iVector(np.asarray(trimesh_mesh.faces, dtype=np.int32)))


def _ransac_plane(points: np.ndarray, distance: float = 0.02, iterations: int = 1000, seed: int = 0):
    """Plane (a, b, c, d), unit normal, with the most points within ``distance``; and those inlier indices.
    Open3D's ``segment_plane`` is used when installed (upstream's choice), else this numpy RANSAC."""
    try:
        import open3d as o3d
    except ImportError:
        o3d = None
    if o3d is not None:
        pcd = o3d.geometry.PointCloud(o3d.utility.Vector3dVector(points.astype(np.float64)))
        model, inliers = pcd.segment_plane(distance_threshold=distance, ransac_n=3, num_iterations=iterations)
        return np.asarray(model, dtype=np.float64), np.asarray(inliers, dtype=np.int64)
    rng = np.random.default_rng(seed)
    best, best_count = None, -1
    for _ in range(iterations):
        p0, p1, p2 = points[rng.choice(len(points), 3, replace=False)]
        n = np.cross(p1 - p0, p2 - p0)
        norm = np.linalg.norm(n)
        if norm < 1e-12:
            continue
        n = n / norm
        d = -float(n @ p0)
        count = int((np.abs(points @ n + d) <= distance).sum())
        if count > best_count:
            best, best_count = np.append(n, d), count
    if best is None:
        raise ValueError("plane estimation needs at least 3 non-collinear points")
    # refine on the inliers by least squares (smallest singular vector of the centred inliers)
    inliers = np.nonzero(np.abs(points @ best[:3] + best[3]) <= distance)[0]
    centred = points[inliers] - points[inliers].mean(axis=0)
    n = np.linalg.svd(centred, full_matrices=False)[2][-1]
    n = n if n @ best[:3] >= 0 else -n
    best = np.append(n, -float(n @ points[inliers].mean(axis=0)))
    inliers = np.nonzero(np.abs(points @ best[:3] + best[3]) <= distance)[0]
    return best, inliers


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def _plane_corners(points: np.ndarray, n: np.ndarray) -> np.ndarray:
    """4 corners of the floor quad (the spec's extents and margins), camera-frame coordinates."""
    tangent = np.array([0.0, 0.0, 1.0]) if abs(n[2]) < 0.9 else np.array([1.0, 0.0, 0.0])
    v1 = _unit(np.cross(n, tangent))
    v2 = _unit(np.cross(n, v1))
    if np.cross(v1, v2) @ n < 0:
        v2 = -v2
    centroid = (points.min(axis=0) + points.max(axis=0)) / 2
    rel = points - centroid

    def extent(axis):
        proj = rel @ axis
        return max(float(proj.max() - proj.min()), 0.1)

    away = _unit(centroid)
    away = away - (away @ n) * n
    if np.linalg.norm(away) > 1e-6:
        away_axis = _unit(away)
        perp_axis = _unit(np.cross(n, away_axis))
        e_a, e_p = extent(away_axis), extent(perp_axis)
        corners = []
        for da in (-1, 1):
            a = (e_a / 2 + 0.5 * e_a) if da == 1 else -(e_a / 2 + 0.1 * e_a)
            for dp in (-1, 1):
                corners.append(centroid + a * away_axis + dp * (e_p / 2 + 0.2 * e_p) * perp_axis)
        return np.stack(corners)
    e_u, e_v = extent(v1), extent(v2)
    return np.stack([centroid + dx * (e_u / 2) * v1 + dy * (e_v / 2) * v2 for dx in (-1, 1) for dy in (-1, 1)])


def o3d_plane_estimation(points: np.ndarray):
    """A grey quad (trimesh, GLB y-up frame) on the dominant plane of camera-frame ``points`` (N, 3).

    RANSAC plane (distance 0.02, 3 points, 1000 iterations; Open3D when installed, numpy otherwise); far inliers
    dropped by a z quantile (0.90 / 0.93 / 0.95 for a z range > 6 / > 2 / else); the quad extends the inliers'
    extent, longer on the side away from the camera.
    """
    import trimesh
    points = np.asarray(points, dtype=np.float64)
    model, inliers = _ransac_plane(points)
    plane_pts = points[inliers]
    z = plane_pts[:, 2]
    z_range = float(z.max() - z.min())
    q = 0.90 if z_range > 6 else 0.93 if z_range > 2 else 0.95
    plane_pts = plane_pts[z <= np.quantile(z, q)]
    n = _unit(model[:3])
    corners = _plane_corners(plane_pts, n) @ _ZY
    quad = trimesh.Trimesh(vertices=corners, faces=[[0, 1, 3, 2]], process=False)
    quad.visual.face_colors = np.tile(np.array([128, 128, 128, 255], dtype=np.uint8), (len(quad.faces), 1))
    logger.info("floor plane: normal %s, %d inliers", np.round(n, 3).tolist(), len(inliers))
    return quad
