"""``SceneVisualizer``: plotly views of posed objects, the camera and the scene point map.

Upstream builds PyTorch3D ``Pointclouds`` / ``Meshes`` / ``PerspectiveCameras``; here the point clouds and cameras
are this module's small ``PointCloud`` / ``CameraPose`` records and meshes come from ``create_textured_mesh``
(PyTorch3D ``Meshes`` when installed, else trimesh), all drawn by ``plot_tdfy_scene``. Poses follow PyTorch3D's
row-vector convention: world = (scale * p) @ R(q) + t, quaternions (w, x, y, z).
"""
from __future__ import annotations

import copy
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from sam3d_objects.utils.rotation import quaternion_to_matrix

from .image_mesh import create_textured_mesh, mesh_from_pointmap
from .plotly.plot_scene import NO_BACKGROUND, plot_tdfy_scene
from .plotly.save_scene import make_video
from .plotly.structures import CameraPose, PointCloud  # noqa: F401  re-exported: this module's records



def _husl_like(n: int) -> List[tuple]:
    """n evenly spaced, saturated hues (seaborn's "husl" palette role, without seaborn)."""
    import colorsys
    return [colorsys.hls_to_rgb(i / max(n, 1), 0.6, 0.65) for i in range(n)]


class SceneVisualizer:
    make_video_from_fig = staticmethod(make_video)

    @staticmethod
    def camera(quaternion: Optional[torch.Tensor] = None, translation: Optional[torch.Tensor] = None) -> CameraPose:
        """Camera with rotation R(quaternion) (default identity) and translation (default 0)."""
        q = torch.tensor([[1.0, 0.0, 0.0, 0.0]]) if quaternion is None else torch.as_tensor(quaternion).float()
        t = torch.zeros(1, 3) if translation is None else torch.as_tensor(translation).float()
        return CameraPose(quaternion_to_matrix(q.reshape(-1, 4)), t.reshape(-1, 3))

    @staticmethod
    def object_pointcloud(points_local: torch.Tensor, quat_l2c: torch.Tensor, trans_l2c: torch.Tensor,
                          scale_l2c: torch.Tensor, colors=None) -> PointCloud:
        """Object points (1, N, 3) posed into the camera frame; colours: default red, a tuple for all points,
        or a tensor as is."""
        p = points_local.reshape(1, -1, 3)
        R = quaternion_to_matrix(quat_l2c.reshape(-1, 4)[:1].to(p)).reshape(3, 3)
        world = (p * scale_l2c.reshape(1, 1, -1).to(p)) @ R + trans_l2c.reshape(1, 1, 3).to(p)
        if colors is None:
            colors = (1.0, 0.0, 0.0)
        if isinstance(colors, (tuple, list)):
            feats = torch.tensor(colors, dtype=p.dtype, device=p.device).expand(1, p.shape[1], 3)
        else:
            feats = torch.as_tensor(colors)
        return PointCloud(world, feats)

    @staticmethod
    def pointmap_to_pointcloud(pointmap: torch.Tensor, image: Optional[torch.Tensor]) -> PointCloud:
        """(H, W, 3) point map -> (1, H*W, 3) points, coloured by an (H, W, 3) or (3, H, W) image if given."""
        points = torch.as_tensor(pointmap).reshape(1, -1, 3)
        if image is None:
            return PointCloud(points, None)
        image = torch.as_tensor(image)
        if image.shape[0] == 3:
            image = image.permute(1, 2, 0)
        return PointCloud(points, image.reshape(1, -1, 3).float())

    @staticmethod
    def pointmap_to_mesh(pointmap, image, clip_pointmap_colors_for_vis: bool = True, filter_edges: bool = True,
                         clamp_eps: float = 1 / 254):
        """Triangulated point map (two triangles per valid 2x2 pixel quad) with the image as vertex colours."""
        pm = torch.as_tensor(pointmap).detach().cpu().numpy()
        img = torch.zeros_like(torch.as_tensor(pointmap)) if image is None else torch.as_tensor(image)
        if img.shape[0] == 3 and img.shape[-1] != 3:
            img = img.permute(1, 2, 0)
        img = img.detach().cpu().float().numpy()
        if clip_pointmap_colors_for_vis:
            img = np.clip(img, clamp_eps, 1 - clamp_eps)
        m = mesh_from_pointmap(pm, img, filter_edges=filter_edges)
        return create_textured_mesh(torch.from_numpy(m.vertices), torch.from_numpy(m.faces),
                                    torch.from_numpy(np.asarray(m.vertex_colors, dtype=np.float32)))

    @staticmethod
    def _create_pointmap_structure(pointmap, image, show_pointmap_as_mesh: bool = True,
                                   clip_pointmap_colors_for_vis: bool = True,
                                   filter_pointmap_edges: bool = True) -> Dict:
        if pointmap is None:
            return {}
        if show_pointmap_as_mesh:
            image = torch.zeros_like(torch.as_tensor(pointmap)) if image is None else image
            return {"Pointmap mesh": SceneVisualizer.pointmap_to_mesh(pointmap, image, clip_pointmap_colors_for_vis,
                                                                      filter_pointmap_edges)}
        return {"Pointmap pointcloud": SceneVisualizer.pointmap_to_pointcloud(pointmap, image)}

    @staticmethod
    def plot_scene(points_local, instance_quaternions_l2c, instance_positions_l2c, instance_scales_l2c,
                   pointmap=None, image=None, title: str = "Tdfy Scene", height: int = 1000,
                   show_pointmap_as_mesh: bool = True, clip_pointmap_colors_for_vis: bool = False,
                   filter_pointmap_edges: bool = True):
        """plotly Figure: identity camera, the red posed object points and the point map (mesh or points)."""
        traces = {"camera": SceneVisualizer.camera(),
                  "object_points": SceneVisualizer.object_pointcloud(
                      torch.as_tensor(points_local).reshape(1, -1, 3), instance_quaternions_l2c,
                      instance_positions_l2c, instance_scales_l2c)}
        traces.update(SceneVisualizer._create_pointmap_structure(pointmap, image, show_pointmap_as_mesh,
                                                                 clip_pointmap_colors_for_vis,
                                                                 filter_pointmap_edges))
        return plot_tdfy_scene({title: traces}, height=height)

    @staticmethod
    def plot_multi_objects(pose_targets: Sequence[Dict], mask_names=None, pointmap=None, pointmap_colors=None,
                           mask_colors=None, plot_tdfy_kwargs=None, title: str = "Tdfy Scene"):
        """plotly Figure with one coloured point cloud per object (``pose_targets[i]``: ``xyz_local``,
        ``rotation``, ``translation``, ``scale``) and the point map as a mesh. Unlike upstream, the caller's
        point map is not modified (NaNs are zeroed on a copy) and colours default sensibly with no names."""
        if mask_names is None:
            mask_names = [str(i) for i in range(len(pose_targets))]
        if mask_colors is None:
            mask_colors = _husl_like(len(mask_names))
        traces = {}
        for i, name in enumerate(mask_names):
            if name is None:
                continue
            pt = pose_targets[i]
            traces[name] = SceneVisualizer.object_pointcloud(torch.as_tensor(pt["xyz_local"]).reshape(1, -1, 3),
                                                             pt["rotation"], pt["translation"], pt["scale"],
                                                             colors=tuple(mask_colors[i]))
        if pointmap is not None:
            pm = torch.nan_to_num(torch.as_tensor(pointmap).clone(), nan=0.0)
            traces.update(SceneVisualizer._create_pointmap_structure(pm, pointmap_colors, True, True, True))
        kwargs = copy.deepcopy(NO_BACKGROUND) if plot_tdfy_kwargs is None else plot_tdfy_kwargs
        kwargs.setdefault("height", 1000)
        kwargs.setdefault("width", 1000)
        return plot_tdfy_scene({title: traces}, **kwargs)
