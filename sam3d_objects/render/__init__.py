"""Pure-PyTorch gaussian splat rendering for previews and turntables (any device; no gsplat/CUDA needed).

The cameras and the splat arithmetic are ``backends.splat``'s; this package adds the views of the pipeline's
outputs (``gaussians``)."""
from backends.splat import (SH_C0, Camera, RenderResult, covariance_from_scale_rotation, focal_from_pointmap,
                            frame_workers, intrinsics_from_fov, map_frames, look_at, orbit_camera, project_gaussians, pytorch3d_to_opencv,
                            quaternion_to_rotation_matrix, render_gaussians)
from .gaussians import (gaussian_render_inputs, mask_overlay, object_extent, preview_image,
                        ready_gaussian_for_video_rendering, render_gaussian, render_input_view, render_video,
                        save_gif, turntable)

__all__ = ["Camera", "focal_from_pointmap", "intrinsics_from_fov", "look_at", "orbit_camera", "pytorch3d_to_opencv",
           "gaussian_render_inputs", "mask_overlay", "object_extent", "preview_image",
           "ready_gaussian_for_video_rendering", "render_gaussian", "render_input_view", "render_video", "save_gif",
           "turntable", "SH_C0", "RenderResult", "covariance_from_scale_rotation", "project_gaussians",
           "quaternion_to_rotation_matrix", "render_gaussians", "frame_workers", "map_frames"]
