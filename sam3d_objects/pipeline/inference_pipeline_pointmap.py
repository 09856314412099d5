"""Pipeline variant conditioned on a point map (from MoGe, or given by the caller): the released one."""
from __future__ import annotations

import copy
import logging
from typing import Any, Callable, Dict, Optional, Sequence

import numpy as np
import torch

from sam3d_objects.data.dataset.tdfy.img_and_mask_transforms import resize_nearest
from sam3d_objects.pipeline.compile_utils import (  # noqa: F401  upstream's names live in this module
    compile_wrapper, recursive_clone, recursive_contiguous, recursive_fn_factory)
from sam3d_objects.data.dataset.tdfy.preprocessor import apply_joint_transforms
from sam3d_objects.pipeline.inference_pipeline import InferencePipeline, _image_to_numpy, rng_preserved
from sam3d_objects.pipeline.run_options import NOISE_AUTO, RunOptions
from sam3d_objects.utils.focal import infer_intrinsics_from_pointmap
from sam3d_objects.validation import check_run_inputs

logger = logging.getLogger(__name__)

MAX_RETURNED_POINTMAP_SIDE = 1200
# OpenCV camera (x right, y down, z forward) -> PyTorch3D camera (x left, y up, z forward)
OPENCV_TO_PYTORCH3D = torch.diag(torch.tensor([-1.0, -1.0, 1.0]))


def camera_to_pytorch3d_camera(device="cpu"):
    """Upstream's look-at decomposition of the OpenCV -> PyTorch3D camera change: an object with ``rotation``
    diag(-1, -1, 1) [1, 3, 3], ``translation`` (0, 0, 1) [1, 3] and ``scale`` 1.0 (only the rotation is used:
    points (x, y, z) -> (-x, -y, z))."""
    from types import SimpleNamespace
    return SimpleNamespace(rotation=OPENCV_TO_PYTORCH3D[None].to(device),
                           translation=torch.tensor([[0.0, 0.0, 1.0]], device=device), scale=1.0)


class InferencePipelinePointMap(InferencePipeline):
    """Adds the depth model and the point-map condition. Extra constructor arguments (upstream's):
    ``depth_model`` (a ``MoGe`` adapter or None), ``layout_post_optimization_method`` (None = off; the pose refinement
    ``inference_utils.layout_post_optimization``, as a callable or its dotted name) and
    ``clip_pointmap_beyond_scale`` (None, or drop points farther than that many median distances from
    the median point)."""

    def __init__(self, *args, depth_model=None, layout_post_optimization_method=None,
                 clip_pointmap_beyond_scale: Optional[float] = None, **kwargs):
        self.depth_model = depth_model
        self.layout_post_optimization_method = layout_post_optimization_method
        self.clip_pointmap_beyond_scale = clip_pointmap_beyond_scale
        super().__init__(*args, **kwargs)
        if depth_model is not None and hasattr(depth_model, "device_given") and not depth_model.device_given:
            depth_model.device = self.device

    def _mask_from_alpha(self, alpha: torch.Tensor) -> torch.Tensor:
        return alpha  # the point-map pipeline keeps the alpha as is (no threshold), as upstream

    # ----------------------------------------------------------------------------------------------------------
    def _depth_pointmap(self, image: np.ndarray) -> torch.Tensor:
        if self.depth_model is None:
            raise ValueError("no point map: pass pointmap= (float [H, W, 3], camera frame with x left, y up, z "
                             "forward; NaN where unknown) or configure a depth model (pipeline.yaml depth_model, "
                             "needs the `moge` package and its weights)")
        return self.depth_model(image[..., :3])["pointmap"]

    def _clip_pointmap(self, pointmap: torch.Tensor) -> torch.Tensor:
        """Drop (NaN) points farther than clip_pointmap_beyond_scale median distances from the median point."""
        pts = pointmap.reshape(3, -1)
        center = pts.nanmedian(dim=1).values
        dist = (pts - center[:, None]).norm(dim=0)
        limit = dist.nanmedian() * self.clip_pointmap_beyond_scale
        far = (dist > limit).reshape(pointmap.shape[1:])
        return torch.where(far[None], torch.full_like(pointmap, float("nan")), pointmap)

    def _preprocess_image_and_mask_pointmap(self, rgb_image: torch.Tensor, mask_image: torch.Tensor,
                                            pointmap: Optional[torch.Tensor],
                                            img_mask_pointmap_joint_transform: Sequence[Callable]):
        """(image, mask, point map) through the joint transforms in turn (the point map passed as
        ``pointmap=``): the step ``PreProcessor`` applies to the point-map view."""
        return tuple(apply_joint_transforms(img_mask_pointmap_joint_transform, rgb_image, mask_image, pointmap))

    def _warmup_pointmap(self, image: np.ndarray) -> torch.Tensor:
        """The depth model's point map of the warm-up image; without a depth model a fronto-parallel plane one
        unit in front of the camera (PyTorch3D frame), so that warming up needs no depth model."""
        if self.depth_model is not None:
            return self.compute_pointmap(image)["pointmap"]
        height, width = image.shape[:2]
        ys, xs = torch.meshgrid(torch.linspace(0.5, -0.5, height), torch.linspace(0.5, -0.5, width), indexing="ij")
        return torch.stack([xs, ys, torch.ones_like(xs)])

    def _warmup(self, num_warmup_iters: int = 3):
        """Upstream's point-map warm-up: point map, preprocessing and stage 1, ``num_warmup_iters`` times on a
        random image (the torch random state is put back afterwards)."""
        from tqdm.auto import tqdm
        image = self._warmup_image()
        with rng_preserved(self.device), torch.no_grad():
            for _ in tqdm(range(num_warmup_iters), desc="warm-up"):
                pointmap = self._warmup_pointmap(image)
                ss_input_dict = self.preprocess_image(image, self.ss_preprocessor, pointmap=pointmap)
                self.sample_sparse_structure(ss_input_dict, inference_steps=None)

    def preprocess_image(self, image, preprocessor, pointmap=None) -> Dict[str, torch.Tensor]:
        """RGBA image (+ point map [3, H, W]) -> batched condition inputs on ``self.device`` (with the point map:
        also the normalised point maps and their scale / shift)."""
        return self._preprocess(image, preprocessor, pointmap)

    def compute_pointmap(self, image, pointmap=None) -> Dict[str, Any]:
        """{"pointmap": [3, H, W] float32 (image size, camera frame), "intrinsics": [3, 3]}."""
        image = _image_to_numpy(image)
        height, width = image.shape[:2]
        if pointmap is None:
            pointmap = self._depth_pointmap(image)
        pointmap = torch.as_tensor(np.asarray(pointmap) if not isinstance(pointmap, torch.Tensor) else pointmap)
        if pointmap.dim() != 3 or pointmap.shape[-1] != 3:
            raise ValueError(f"pointmap must be [H, W, 3] (xyz per pixel), got shape {tuple(pointmap.shape)}")
        pointmap = pointmap.detach().float().cpu()
        if not bool(torch.isfinite(pointmap).all(-1).any()):
            raise ValueError("the point map has no finite point (all NaN/inf): check the depth model output or the "
                             "pointmap you passed")
        chw = resize_nearest(pointmap.permute(2, 0, 1), (height, width))
        if self.clip_pointmap_beyond_scale is not None:
            chw = self._clip_pointmap(chw)
        intrinsics = infer_intrinsics_from_pointmap(chw.permute(1, 2, 0))
        return {"pointmap": chw, "intrinsics": intrinsics}

    def _prepare_condition_inputs(self, image, pointmap=None):
        pointmap_dict = self.compute_pointmap(image, pointmap)
        pm = pointmap_dict["pointmap"]
        ss_input = self.preprocess_image(image, self.ss_preprocessor, pointmap=pm)
        slat_input = self.preprocess_image(image, self.slat_preprocessor)
        rgb = torch.from_numpy(np.ascontiguousarray(_image_to_numpy(image)[..., :3])).float() / 255.0
        points = pm.permute(1, 2, 0)
        points, rgb = self._down_sample_img(points), self._down_sample_img(rgb)
        extra = {"pointmap": points, "pointmap_colors": rgb, "intrinsics": pointmap_dict["intrinsics"]}
        return ss_input, slat_input, extra

    @staticmethod
    def _down_sample_img(x: torch.Tensor) -> torch.Tensor:
        """[H, W, C] maps larger than 1200 px on a side are shrunk (nearest) for the returned point cloud."""
        h, w = x.shape[:2]
        side = max(h, w)
        if side <= MAX_RETURNED_POINTMAP_SIDE:
            return x
        scale = MAX_RETURNED_POINTMAP_SIDE / side
        size = (max(1, int(h * scale)), max(1, int(w * scale)))
        return resize_nearest(x.permute(2, 0, 1), size).permute(1, 2, 0)

    # ----------------------------------------------------------------------------------------------------------
    # layout post-optimisation and floor plane
    # ----------------------------------------------------------------------------------------------------------
    def _layout_method(self):
        """The configured method: a callable, or a dotted name / "layout_post_optimization" (the yaml's form)."""
        method = self.layout_post_optimization_method
        if callable(method):
            return method
        from sam3d_objects.pipeline import inference_utils
        name = str(method).rsplit(".", 1)[-1]
        if not hasattr(inference_utils, name):
            raise ValueError(f"layout_post_optimization_method {method!r}: unknown (use "
                             f"sam3d_objects.pipeline.inference_utils.layout_post_optimization)")
        return getattr(inference_utils, name)

    def run_post_optimization(self, mesh_glb, intrinsics, pose_dict, layout_input_dict) -> Dict[str, Any]:
        """Refine the pose so that the mesh matches the mask and point map (``layout_post_optimization_method``).
        fx and fy both become min(fx, fy): the preprocessed image is padded to a square."""
        intrinsics = torch.as_tensor(intrinsics).clone().float()
        focal = torch.minimum(intrinsics[0, 0], intrinsics[1, 1])
        intrinsics[0, 0] = intrinsics[1, 1] = focal
        mask = layout_input_dict["rgb_image_mask"][0, 0]
        point_map = layout_input_dict["rgb_pointmap"][0]
        if point_map.shape[0] == 3:
            point_map = point_map.permute(1, 2, 0)
        quat, translation, scale, iou, *_ = self._layout_method()(
            mesh_glb, pose_dict["rotation"], pose_dict["translation"], pose_dict["scale"], mask, point_map,
            intrinsics, min_size=518)
        return {"rotation": quat, "translation": translation, "scale": scale, "iou": iou}

    def estimate_plane(self, pointmap_dict, image, ground_area_threshold: float = 0.25,
                       min_points: int = 100) -> Dict[str, Any]:
        """Floor-plane quad under the masked region of the point map (upstream's estimate_plane=True output):
        {"glb": trimesh or None, identity pose}. Needs inference_utils' plane helpers (open3d)."""
        from sam3d_objects.pipeline import inference_utils
        image = _image_to_numpy(image)
        if image.shape[-1] != 4:
            raise ValueError("estimate_plane needs an RGBA image (the mask in the alpha channel)")
        floor = self._down_sample_img(torch.from_numpy(image[..., 3:4].astype(np.float32)))[..., 0] > 0.5
        points = self._down_sample_img(pointmap_dict["pointmap"].permute(1, 2, 0).cpu())
        selected = points[floor]
        selected = selected[torch.isfinite(selected).all(-1) & (selected.norm(dim=-1) > 1e-6)]
        glb = None
        area = inference_utils.estimate_plane_area(floor.numpy())
        if area > ground_area_threshold and selected.shape[0] >= min_points:
            try:
                glb = inference_utils.o3d_plane_estimation(selected.numpy())
            except Exception as e:  # noqa: BLE001  upstream logs and returns no plane
                logger.warning("floor-plane estimation failed: %s", e)
        return {"glb": glb, "translation": [[0.0, 0.0, 0.0]], "scale": [[1.0, 1.0, 1.0]],
                "rotation": [[1.0, 0.0, 0.0, 0.0]]}

    def _apply_layout_postprocess(self, out: Dict[str, Any], ss_input: Dict[str, Any]) -> None:
        """Upstream: refine the pose in place; any failure is logged and the predicted pose kept."""
        try:
            if out.get("glb") is None:
                raise ValueError("require mesh to run postprocessing (decode_formats must include 'mesh')")
            refined = self.run_post_optimization(copy.deepcopy(out["glb"]), out["intrinsics"], out, ss_input)
            out.update(refined)
        except Exception as e:  # noqa: BLE001  upstream keeps the predicted pose on any failure
            logger.warning("layout post-optimisation failed, keeping the predicted pose: %s", e)

    def run(self, image, mask=None, seed=None, stage1_only=False, with_mesh_postprocess=True,
            with_texture_baking=True, with_layout_postprocess=True, use_vertex_color=False,
            stage1_inference_steps=None, stage2_inference_steps=None, use_stage1_distillation=False,
            use_stage2_distillation=False, pointmap=None, decode_formats=None, estimate_plane=False,
            noise_device: str = NOISE_AUTO) -> Dict[str, Any]:
        """As ``InferencePipeline.run``, conditioned on the point map (``pointmap`` [H, W, 3] in the PyTorch3D
        camera frame, or from the depth model); adds ``pointmap`` / ``pointmap_colors`` / ``intrinsics``.
        ``estimate_plane``: only the floor plane under the mask (no generation). With a configured
        ``layout_post_optimization_method`` and ``with_layout_postprocess`` the pose is refined (and ``iou``
        added); a failure there is logged and the predicted pose kept (as upstream). ``seed=None`` (upstream's
        default here): no seeding, the noise comes from the global generator."""
        options = RunOptions.from_locals(locals())
        return self.run_with_options(image, mask, options, pointmap=pointmap)

    def run_with_options(self, image, mask=None, options: RunOptions = RunOptions(seed=None), pointmap=None
                         ) -> Dict[str, Any]:
        """(ours) ``run`` with its keywords in one ``RunOptions`` (``pointmap`` is an input, not an option)."""
        check_run_inputs(image, mask, pointmap)
        image = self.merge_image_and_mask(image, mask)
        if options.estimate_plane:
            return self.estimate_plane(self.compute_pointmap(image, pointmap), image)
        out = self._run_stages(image, options, pointmap)
        ss_input = out.pop("_ss_input")
        if not options.stage1_only and options.with_layout_postprocess and \
                self.layout_post_optimization_method is not None:
            with self._stage("layout_postprocess"):
                self._apply_layout_postprocess(out, ss_input)
        return out
