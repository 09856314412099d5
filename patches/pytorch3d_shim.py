"""``pytorch3d`` stand-in: the ``transforms`` subset and camera helpers SAM 3D code uses, in plain PyTorch.

Why: pytorch3d has no wheels for recent torch and builds CUDA extensions from source; SAM 3D imports it for pose
maths (quaternions, ``Transform3d``) and ``look_at_view_transform``. Conventions are pytorch3d's: quaternions are
(w, x, y, z); ``Transform3d`` uses row vectors (``p' = p M``, translation in the last row; ``a.compose(b)`` applies
``a`` first); ``look_at_view_transform`` returns (R, T) with ``X_cam = X_world R + T``.

Provided: ``pytorch3d.transforms`` (quaternion_to_matrix, matrix_to_quaternion, axis_angle_to_quaternion,
quaternion_to_axis_angle, axis_angle_to_matrix, matrix_to_axis_angle, quaternion_raw_multiply,
quaternion_multiply, quaternion_invert, quaternion_apply, standardize_quaternion, euler_angles_to_matrix,
rotation_6d_to_matrix, matrix_to_rotation_6d, Transform3d, Translate, Scale, Rotate, RotateAxisAngle) and
``pytorch3d.renderer`` (look_at_rotation, look_at_view_transform, camera_position_from_spherical_angles), and,
from :mod:`patches.pytorch3d_render`, ``pytorch3d.structures`` (Meshes, Pointclouds, join_meshes_as_scene), the
renderer's cameras (PerspectiveCameras, FoVPerspectiveCameras, OrthographicCameras, CamerasBase,
camera_utils.camera_to_eye_at_up), textures (TexturesVertex, TexturesAtlas), ray bundles and the soft silhouette
renderer (MeshRasterizer, MeshRenderer, SoftSilhouetteShader, RasterizationSettings, BlendParams) through
``backends.soft_rasterize``; from :mod:`patches.pytorch3d_vis`, ``pytorch3d.vis.plotly_vis``'s helpers. Shaders
other than the silhouette one (Phong, textured) are not provided.
"""
from __future__ import annotations

from ._modules import drop, install_shim, make
from .pytorch3d_transforms import (  # noqa: F401  (re-exported: the stand-in's functions, as pytorch3d names them)
    _CAMERAS, _TRANSFORMS, Rotate, RotateAxisAngle, Scale, Transform3d, Translate, axis_angle_to_matrix,
    axis_angle_to_quaternion, camera_position_from_spherical_angles, euler_angles_to_matrix, look_at_rotation,
    look_at_view_transform, matrix_to_axis_angle, matrix_to_quaternion, matrix_to_rotation_6d, quaternion_apply,
    quaternion_invert, quaternion_multiply, quaternion_raw_multiply, quaternion_to_axis_angle, quaternion_to_matrix,
    rotation_6d_to_matrix, standardize_quaternion)


def _build():
    from . import pytorch3d_render as render
    from .pytorch3d_vis import PLOTLY_VIS

    transforms = make("pytorch3d.transforms", __doc__, **_TRANSFORMS)
    rotation_conversions = make("pytorch3d.transforms.rotation_conversions", __doc__, **_TRANSFORMS)
    transform3d = make("pytorch3d.transforms.transform3d", __doc__, **_TRANSFORMS)
    transforms.rotation_conversions, transforms.transform3d = rotation_conversions, transform3d
    cameras = make("pytorch3d.renderer.cameras", render.__doc__, **{**_CAMERAS, **render.CAMERAS})
    camera_utils = make("pytorch3d.renderer.camera_utils", render.__doc__,
                        camera_to_eye_at_up=render.camera_to_eye_at_up)
    textures = make("pytorch3d.renderer.mesh.textures", render.__doc__, TexturesVertex=render.TexturesVertex,
                    TexturesAtlas=render.TexturesAtlas)
    mesh = make("pytorch3d.renderer.mesh", render.__doc__, textures=textures, **{
        n: render.RENDERER[n] for n in ("MeshRasterizer", "MeshRenderer", "SoftSilhouetteShader",
                                        "RasterizationSettings", "TexturesVertex", "TexturesAtlas")})
    renderer = make("pytorch3d.renderer", render.__doc__, cameras=cameras, camera_utils=camera_utils, mesh=mesh,
                    **{**_CAMERAS, **render.RENDERER})
    structures = make("pytorch3d.structures", render.__doc__, **render.STRUCTURES)
    plotly_vis = make("pytorch3d.vis.plotly_vis", __doc__, **PLOTLY_VIS)
    vis = make("pytorch3d.vis", __doc__, plotly_vis=plotly_vis)
    root = make("pytorch3d", __doc__, transforms=transforms, renderer=renderer, structures=structures, vis=vis,
                __version__="0.7+sam3d-shim")
    return [root, transforms, rotation_conversions, transform3d, renderer, cameras, camera_utils, mesh, textures,
            structures, vis, plotly_vis]


def install(replace_installed: bool = False) -> str:
    return install_shim("pytorch3d", _build, replace_installed)


def uninstall() -> None:
    drop("pytorch3d", only_shims=True)
