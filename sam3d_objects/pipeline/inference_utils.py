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
