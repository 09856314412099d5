"""Pure-PyTorch gaussian splat rendering for previews and turntables (any device; no gsplat/CUDA needed)."""
from .camera import Camera, focal_from_pointmap, intrinsics_from_fov, look_at, orbit_camera, pytorch3d_to_opencv
from .gaussians import (gaussian_render_inputs, mask_overlay, object_extent, preview_image,
                        ready_gaussian_for_video_rendering, render_gaussian, render_input_view, render_video,
                        save_gif, turntable)
from .splat import (SH_C0, RenderResult, covariance_from_scale_rotation, project_gaussians,
                    quaternion_to_rotation_matrix, render_gaussians)

__all__ = ["Camera", "focal_from_pointmap", "intrinsics_from_fov", "look_at", "orbit_camera", "pytorch3d_to_opencv",
           "gaussian_render_inputs", "mask_overlay", "object_extent", "preview_image",
           "ready_gaussian_for_video_rendering", "render_gaussian", "render_input_view", "render_video", "save_gif",
           "turntable", "SH_C0", "RenderResult", "covariance_from_scale_rotation", "project_gaussians",
           "quaternion_to_rotation_matrix", "render_gaussians"]
