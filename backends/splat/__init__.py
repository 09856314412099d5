"""Gaussian splat rendering, the arithmetic behind previews, turntables and the ``gsplat`` /
``diff_gaussian_rasterization`` stand-ins: pinhole cameras (``camera``), EWA projection and front-to-back tile
compositing in torch ops (``portable``, every device; ``slabs``, its CPU compositor), turntable frames side by side
on the CPU (``frames``) and one Triton kernel compositing every tile (``triton``, CUDA
float32, picked by ``portable`` where it can run)."""
from .camera import Camera, focal_from_pointmap, intrinsics_from_fov, look_at, orbit_camera, pytorch3d_to_opencv
from .frames import cpu_frame_workers, frame_workers, map_frames, use_frame_workers
from .portable import (COMPOSITORS, SH_C0, RenderResult, covariance_from_scale_rotation, project_gaussians,
                       quaternion_to_rotation_matrix, render_gaussians, use_compositor)

__all__ = ["Camera", "focal_from_pointmap", "intrinsics_from_fov", "look_at", "orbit_camera", "pytorch3d_to_opencv",
           "SH_C0", "RenderResult", "covariance_from_scale_rotation", "project_gaussians",
           "quaternion_to_rotation_matrix", "render_gaussians", "use_compositor", "COMPOSITORS",
           "cpu_frame_workers", "frame_workers", "map_frames", "use_frame_workers"]
