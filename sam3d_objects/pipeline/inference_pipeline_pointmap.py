"""Pipeline variant conditioned on a point map (from MoGe, or given by the caller): the released one."""
from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np
import torch

from sam3d_objects.data.dataset.tdfy.img_and_mask_transforms import resize_nearest
from sam3d_objects.pipeline.inference_pipeline import InferencePipeline, _image_to_numpy
from sam3d_objects.utils.focal import infer_intrinsics_from_pointmap

MAX_RETURNED_POINTMAP_SIDE = 1200


class InferencePipelinePointMap(InferencePipeline):
    """Adds the depth model and the point-map condition. Extra constructor arguments (upstream's):
    ``depth_model`` (a ``MoGe`` adapter or None), ``layout_post_optimization_method`` (not supported, must be
    None) and ``clip_pointmap_beyond_scale`` (None, or drop points farther than that many median distances from
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

    def get_condition_input(self, image, pointmap=None):
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

    def run(self, image, mask=None, seed=None, stage1_only=False, with_mesh_postprocess=True,
            with_texture_baking=True, with_layout_postprocess=True, use_vertex_color=False,
            stage1_inference_steps=None, pointmap=None, decode_formats=None, stage2_inference_steps=None):
        if with_layout_postprocess and self.layout_post_optimization_method is not None:
            raise NotImplementedError("layout post-optimisation is not supported; set "
                                      "layout_post_optimization_method: null")
        return super().run(image, mask=mask, seed=seed, stage1_only=stage1_only,
                           with_mesh_postprocess=with_mesh_postprocess, with_texture_baking=with_texture_baking,
                           with_layout_postprocess=with_layout_postprocess, use_vertex_color=use_vertex_color,
                           stage1_inference_steps=stage1_inference_steps, pointmap=pointmap,
                           decode_formats=decode_formats, stage2_inference_steps=stage2_inference_steps)
