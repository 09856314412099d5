"""Pipeline helpers: voxel post-processing after stage 1 and the pose decoders.

``prune_sparse_structure`` / ``downsample_sparse_structure`` turn the stage-1 occupancy into the voxel set that
stage 2 works on; ``get_pose_decoder(name)`` returns the function mapping the stage-1 pose latents to a metric
pose (translation, quaternion wxyz, scale).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

from sam3d_objects.model.backbone.tdfy_dit.models.sparse_structure_utils import (  # noqa: F401  re-exported
    downsample_sparse_structure, prune_sparse_structure)
from sam3d_objects.utils.rotation import matrix_to_quaternion, rotation_6d_to_matrix

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


POSE_DECODERS: Dict[str, Callable] = {"ScaleShiftInvariant": decode_scale_shift_invariant}


def get_pose_decoder(name: Optional[str]) -> Callable:
    if name not in POSE_DECODERS:
        raise ValueError(f"unknown pose decoder {name!r}; available: {sorted(POSE_DECODERS)} "
                         f"(pipeline.yaml key pose_decoder_name)")
    return POSE_DECODERS[name]


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
    device = torch.device(device) if device is not None else torch.device("cpu")
    lpo.set_seed(100)
    quat0 = torch.as_tensor(Quaternion, dtype=torch.float32).reshape(1, 4)
    trans0 = torch.as_tensor(Translation, dtype=torch.float32).reshape(1, 3)
    scale0 = torch.as_tensor(Scale, dtype=torch.float32).reshape(1, 3)
    skipped = (Quaternion, Translation, Scale, -1.0, False, False)
    tfm_ori = lpo._row_transform(scale0[0], quaternion_to_matrix(quat0[0]), trans0[0])
    mesh, faces, textures = lpo.get_mesh(Mesh, tfm_ori, device)
    mask, renderer = lpo.get_mask_renderer(Mask, min_size, Intrinsics, device)
    point_map = torch.as_tensor(Point_Map, dtype=torch.float32)
    if point_map.shape[:2] != mask.shape[-2:]:  # the point map follows the mask's resize (nearest keeps NaNs local)
        point_map = torch.nn.functional.interpolate(point_map.permute(2, 0, 1)[None], size=mask.shape[-2:],
                                                    mode="nearest")[0].permute(1, 2, 0)
    if lpo.check_occlusion(mask[0, 0].cpu().numpy(), point_map.numpy()):
        return skipped
    src, tgt, center, tfm1, mesh, ori_iou, final_iou, no_target = lpo.run_alignment(
        point_map, mask, mesh, trans0[0], faces, textures, renderer, device)
    if no_target:
        return skipped
    tfm2, icp_ok = torch.eye(4), False
    if Enable_shape_ICP:
        verts_icp, transform = lpo.run_ICP(mesh, src, tgt, 0.05)
        mesh_icp = lpo.LayoutMesh(verts_icp, mesh.faces)
        iou_icp = lpo.compute_iou(renderer.hard(mesh_icp), mask[0, 0])
        if iou_icp > ori_iou:
            icp_ok, mesh, final_iou = True, mesh_icp, float(iou_icp)
            row = torch.as_tensor(transform, dtype=torch.float32).T  # column -> row convention
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
            to_center, from_center = torch.eye(4), torch.eye(4)
            to_center[3, :3], from_center[3, :3] = -center, center + t
            tfm3 = to_center @ lpo._row_transform(s, rot.T, torch.zeros(3)) @ from_center
            tfm = tfm @ tfm3
    scale = tfm[:3, :3].norm(dim=-1)
    rot = tfm[:3, :3] / scale[:, None]
    return (matrix_to_quaternion(rot)[None], tfm[3, :3][None].clone(), scale[None], round(float(final_iou), 4),
            icp_ok, render_ok)

