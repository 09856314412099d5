"""Upstream's ``notebook/inference.py`` API: ``Inference``, ``load_image``, ``load_single_mask``, ``load_masks``,
``make_scene``.

    from sam3d_objects.inference import Inference, load_image, load_single_mask
    inference = Inference("checkpoints/hf/pipeline.yaml", compile=False)
    output = inference(load_image("image.png"), load_single_mask("masks/", 0), seed=42)
    output["gs"].save_ply("splat.ply"); output["glb"].export("mesh.glb")

(``notebooks/inference.py`` re-exports these names, so ``sys.path.append("notebooks"); from inference import
Inference`` works as in upstream's README.)
"""
from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np
import torch

from sam3d_objects.config.instantiate import check_targets, load_config, safe_instantiate
from sam3d_objects.pipeline.inference_pipeline import merge_mask_into_alpha
from sam3d_objects.utils.rotation import quaternion_multiply, quaternion_to_matrix
from sam3d_objects.validation import (ConfigError, DeviceUnavailableError, check_checkpoint_folder, check_device,
                                      check_run_inputs)

__all__ = ["Inference", "DeviceUnavailableError", "ConfigError", "load_image", "load_mask", "load_single_mask",
           "load_masks", "make_scene", "ready_gaussian_for_video_rendering", "render_video"]


class Inference:
    """Build the pipeline from a checkpoint folder's ``pipeline.yaml`` and run image + mask -> 3D object.

    ``device`` / ``low_memory`` (ours) override the yaml; by default the backends default device is used
    (cuda > mps > cpu) unless the yaml names one, and low-memory mode is on for CPU/MPS. ``compile`` replaces the
    yaml's ``compile_model`` (as upstream): True compiles the dense models with torch.compile where the device
    supports it (one warning and eager execution elsewhere). ``noise_device="cpu"`` (ours) draws the sampling
    noise on the CPU so that a seed gives the same object on every device (None: upstream's device noise).
    """

    def __init__(self, config_file: Union[str, Path], compile: bool = False, device: Optional[str] = None,
                 low_memory: Optional[bool] = None, noise_device: Optional[str] = None):
        config_file = Path(config_file)
        check_device(device)  # before reading gigabytes: the cheapest checks first
        check_checkpoint_folder(config_file)  # every yaml and checkpoint, even those low-memory mode loads later
        config = load_config(config_file)
        check_device(config.get("device") if device is None else device)
        config.rendering_engine = "pytorch3d"
        config.compile_model = bool(compile)  # the API argument wins over the yaml's compile_model
        if noise_device is not None:
            config.noise_device = noise_device
        config.workspace_dir = str(config_file.resolve().parent)
        if device is not None:
            config.device = device
        if low_memory is not None:
            config.low_memory = low_memory
        check_targets(config)
        if config.get("depth_model") is not None:
            # build the depth network lazily (first use): no download unless a point map must be estimated
            config.depth_model._recursive_ = False
        try:
            self._pipeline = safe_instantiate(config)
        except Exception as e:  # noqa: BLE001  hydra wraps the constructor's error: surface the clear one
            cause = e.__cause__ if type(e).__name__ == "InstantiationException" else None
            if cause is not None:
                raise cause from None
            raise

    @property
    def pipeline(self):
        return self._pipeline

    def merge_mask_to_rgba(self, image, mask) -> np.ndarray:
        return merge_mask_into_alpha(image, mask)

    def __call__(self, image, mask, seed: Optional[int] = None, pointmap=None, **run_options) -> Dict[str, Any]:
        """``run_options`` (ours) go to the pipeline's ``run`` and replace the notebook defaults, e.g. fast mode:
        ``use_stage1_distillation=True, use_stage2_distillation=True, stage1_inference_steps=4``, or
        ``noise_device="cpu"``."""
        check_run_inputs(image, mask, pointmap)
        rgba = self.merge_mask_to_rgba(image, mask)
        options = dict(stage1_only=False, with_mesh_postprocess=False, with_texture_baking=False,
                       with_layout_postprocess=True, use_vertex_color=True, stage1_inference_steps=None,
                       pointmap=pointmap)
        options.update(run_options)
        return self._pipeline.run(rgba, None, seed, **options)


# ----------------------------------------------------------------------------------------------------------------
# loading inputs
# ----------------------------------------------------------------------------------------------------------------
def _open_image(path: Union[str, Path]):
    """The decoded ``PIL.Image`` (EXIF orientation applied); FileNotFoundError / ValueError name the file."""
    from sam3d_objects.utils.images import open_image
    return open_image(path)


def load_image(path: Union[str, Path]) -> np.ndarray:
    """uint8 [H, W, 3] (RGB) or [H, W, 4] (RGBA files keep their alpha), as upstream; other Pillow modes (16-bit,
    palette, grey, CMYK) are converted, unusable ones refused (``sam3d_objects.utils.images``)."""
    from sam3d_objects.utils.images import load_image_file
    return load_image_file(path)


def load_mask(path: Union[str, Path]) -> np.ndarray:
    """bool [H, W]: the alpha channel of an RGBA file, else any non-zero pixel."""
    from sam3d_objects.utils.images import load_mask_file
    return load_mask_file(path)


def load_single_mask(folder: Union[str, Path], index: int = 0, extension: str = ".png") -> np.ndarray:
    return load_mask(Path(folder) / f"{index}{extension}")


def load_masks(folder: Union[str, Path], indices_list: Optional[Sequence[int]] = None,
               extension: str = ".png") -> List[np.ndarray]:
    """Masks stored as ``<index>.png`` beside ``image.png``, in index order."""
    folder = Path(folder)
    if indices_list is None:
        found = [int(m.group(1)) for p in folder.iterdir() if (m := re.fullmatch(r"(\d+)" + re.escape(extension),
                                                                                  p.name))]
        indices_list = sorted(found)
    if not indices_list:
        raise FileNotFoundError(f"no mask files <index>{extension} in {folder}")
    return [load_single_mask(folder, i, extension) for i in indices_list]


# ----------------------------------------------------------------------------------------------------------------
# scene
# ----------------------------------------------------------------------------------------------------------------
def _posed_gaussian(output: Dict[str, Any]):
    """Copy of the object's Gaussian moved into the camera (PyTorch3D) frame by its decoded pose:
    p' = (s * p) @ R + t with R = quaternion_to_matrix(rotation) (row-vector convention, as the pose decoder's
    Transform3d composition); orientations are turned by the same rotation, sizes scaled by s."""
    gs = output["gs"] if "gs" in output else output["gaussian"][0]
    device = gs.get_xyz.device
    q = torch.as_tensor(output["rotation"]).reshape(4).to(device, torch.float32)
    t = torch.as_tensor(output["translation"]).reshape(1, 3).to(device, torch.float32)
    s = torch.as_tensor(output["scale"]).reshape(1, 3).to(device, torch.float32)
    rot = quaternion_to_matrix(q)
    posed = copy.copy(gs)
    xyz = (gs.get_xyz * s) @ rot + t
    # p @ R applies R^T to column vectors, whose quaternion is the conjugate of q
    q_col = q * q.new_tensor([1.0, -1.0, -1.0, -1.0])
    rotation = quaternion_multiply(q_col[None], torch.nn.functional.normalize(gs.get_rotation, dim=-1))
    posed.aabb = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0], device=device)
    posed.from_xyz(xyz)
    posed.from_rotation(rotation)
    posed.from_scaling(gs.get_scaling * s.mean())
    posed._opacity = gs._opacity.clone()
    posed._features_dc = gs._features_dc.clone()
    return posed


def make_scene(*outputs: Dict[str, Any]):
    """One Gaussian holding every object's Gaussians, each placed in the camera frame by its pose."""
    if not outputs:
        raise ValueError("make_scene needs at least one output of Inference")
    posed = [_posed_gaussian(o) for o in outputs]
    scene = posed[0]
    for name in ("_xyz", "_features_dc", "_scaling", "_rotation", "_opacity"):
        setattr(scene, name, torch.cat([getattr(g, name) for g in posed], dim=0))
    return scene


# ----------------------------------------------------------------------------------------------------------------
# rendering helpers of upstream's notebook API (implemented in sam3d_objects.render; imported on use)
# ----------------------------------------------------------------------------------------------------------------
def ready_gaussian_for_video_rendering(scene_gs, *args, **kwargs):
    from sam3d_objects.render.gaussians import ready_gaussian_for_video_rendering as impl
    return impl(scene_gs, *args, **kwargs)


def render_video(gs, *args, **kwargs):
    from sam3d_objects.render.gaussians import render_video as impl
    return impl(gs, *args, **kwargs)
