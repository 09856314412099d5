"""Surface finish: utils.visualization (SceneVisualizer, plot_tdfy_scene, save_scene) against the
behaviour in rendering_and_notebook.md section 6; plotly is optional (its absence gives a clear error)."""
import io
import sys

import numpy as np
import pytest
import torch

from sam3d_objects.utils.rotation import quaternion_to_matrix


def test_missing_plotly_names_the_install(monkeypatch):
    from sam3d_objects.utils.visualization.plotly import plot_scene
    monkeypatch.setitem(sys.modules, "plotly", None)
    monkeypatch.setitem(sys.modules, "plotly.graph_objects", None)
    with pytest.raises(ImportError, match="pip install plotly"):
        plot_scene.plot_tdfy_scene({"s": {}})


def test_object_pointcloud_pose_and_colours():
    from sam3d_objects.utils.visualization import SceneVisualizer
    g = torch.Generator().manual_seed(0)
    p = torch.rand(1, 5, 3, generator=g, dtype=torch.float64)
    q = torch.nn.functional.normalize(torch.rand(1, 4, generator=g, dtype=torch.float64), dim=-1)
    t = torch.tensor([[0.1, 0.2, 3.0]], dtype=torch.float64)
    s = torch.tensor([[2.0, 1.0, 0.5]], dtype=torch.float64)
    pc = SceneVisualizer.object_pointcloud(p, q, t, s)
    R = quaternion_to_matrix(q)[0].numpy()
    ref = (p[0].numpy() * s.numpy()) @ R + t.numpy()  # PyTorch3D row-vector chain scale -> rotate -> translate
    np.testing.assert_allclose(pc.points[0].numpy(), ref, atol=1e-12)
    assert pc.features.shape == (1, 5, 3) and pc.features[0, :, 0].eq(1).all() and pc.features[0, :, 1:].eq(0).all()
    assert SceneVisualizer.object_pointcloud(p, q, t, s, colors=(0.0, 0.5, 1.0)).features[0, 3].tolist() == \
        [0.0, 0.5, 1.0]
    cam = SceneVisualizer.camera()
    assert torch.equal(cam.R, torch.eye(3)[None]) and torch.equal(cam.T, torch.zeros(1, 3))
    img = torch.rand(3, 4, 6)
    pcd = SceneVisualizer.pointmap_to_pointcloud(torch.rand(4, 6, 3), img)
    torch.testing.assert_close(pcd.features[0], img.permute(1, 2, 0).reshape(-1, 3))


def _pointmap(h=6, w=5):
    yy, xx = torch.meshgrid(torch.linspace(-1, 1, h), torch.linspace(-1, 1, w), indexing="ij")
    return torch.stack([xx, yy, torch.full_like(xx, 3.0)], -1)


def test_pointmap_to_mesh_triangulates_the_grid():
    from sam3d_objects.utils.visualization import SceneVisualizer
    pm = _pointmap()
    mesh = SceneVisualizer.pointmap_to_mesh(pm, torch.zeros(6, 5, 3))
    verts = mesh.verts_packed() if hasattr(mesh, "verts_packed") else np.asarray(mesh.vertices)
    faces = mesh.faces_packed() if hasattr(mesh, "faces_packed") else np.asarray(mesh.faces)
    assert len(verts) == 30 and len(faces) == 2 * 5 * 4  # two triangles per 2x2 pixel quad


def test_plot_scene_and_multi_objects_figures():
    pytest.importorskip("plotly")
    from sam3d_objects.utils.visualization import SceneVisualizer, plot_tdfy_scene
    pm = _pointmap()
    fig = SceneVisualizer.plot_scene(torch.rand(40, 3), torch.tensor([[1.0, 0, 0, 0]]), torch.tensor([[0, 0, 3.0]]),
                                     torch.tensor([[0.5, 0.5, 0.5]]), pointmap=pm, image=torch.rand(6, 5, 3),
                                     title="T", height=321)
    assert [(t.type, t.name) for t in fig.data] == [("scatter3d", "camera"), ("scatter3d", "object_points"),
                                                   ("mesh3d", "Pointmap mesh")]
    assert fig.layout.height == 321 and fig.layout.annotations[0].text == "T"
    pts = fig.data[1]
    assert len(pts.x) == 40 and np.allclose(np.asarray(pts.z).mean(), 3.0, atol=0.5)
    rng = fig.layout.scene.xaxis.range, fig.layout.scene.yaxis.range, fig.layout.scene.zaxis.range
    lengths = [r[1] - r[0] for r in rng]
    assert np.allclose(lengths, lengths[0])  # equal-length cube axes
    pm_nan = pm.clone()
    pm_nan[0, 0] = float("nan")
    targets = [{"xyz_local": torch.rand(10, 3), "rotation": torch.tensor([[1.0, 0, 0, 0]]),
                "translation": torch.zeros(1, 3), "scale": torch.ones(1, 3)}] * 2
    fig2 = SceneVisualizer.plot_multi_objects(targets, mask_names=["a", None], pointmap=pm_nan)
    assert [t.name for t in fig2.data] == ["a", "Pointmap mesh"] and fig2.layout.width == 1000
    assert bool(pm_nan[0, 0].isnan().all())  # the caller's point map is left alone
    two = plot_tdfy_scene({"A": {"c": SceneVisualizer.camera()}, "B": {"c": SceneVisualizer.camera()}}, ncols=2)
    assert two.layout.scene2 is not None and len(two.data) == 2
    cam = SceneVisualizer.camera(translation=torch.tensor([[0.0, 0.0, 5.0]]))
    view = plot_tdfy_scene({"A": {"c": cam}}, viewpoint_cameras=cam)
    assert view.layout.scene.camera.projection.type == "orthographic"
    # camera centre -T R^T = (0, 0, -5), in plotly's [-1, 1] units of the data cube around the wireframe
    lo, hi = view.layout.scene.zaxis.range
    ez = view.layout.scene.camera.eye["z"]
    assert np.isclose(ez, (-5 - (lo + hi) / 2) / ((hi - lo) / 2))
    with pytest.raises(ValueError, match="cannot draw"):
        plot_tdfy_scene({"A": {"x": object()}})


def test_save_scene_helpers():
    from PIL import Image
    from sam3d_objects.utils.visualization.plotly import save_scene
    arr = (np.arange(2 * 3 * 4) % 255).astype(np.uint8).reshape(2, 3, 4)
    buf = io.BytesIO()
    Image.fromarray(arr, "RGBA").save(buf, format="PNG")
    np.testing.assert_array_equal(save_scene.img_bytes_to_np(buf.getvalue()), arr)
    cams = save_scene.orbit_cameras(4, axis="y", elevation=1.0, radius=2.0)
    assert [round(c["eye"]["x"], 6) for c in cams] == [0.0, 2.0, 0.0, -2.0] and cams[0]["eye"]["z"] == 2.0
    assert cams[0]["eye"]["y"] == 1.0 and cams[0]["up"] == {"x": 0, "y": 1, "z": 0}
    with pytest.raises(ValueError, match="Invalid axis"):
        save_scene.orbit_cameras(2, axis="w")
    go = pytest.importorskip("plotly.graph_objects")
    with pytest.raises(ValueError, match="Scene must have subplots"):
        save_scene.make_video(go.Figure())
