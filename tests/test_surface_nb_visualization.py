"""visualization.image_mesh: point-map meshes (grid triangulation, edge cutting) and the lazy package exports."""
import numpy as np


def plane_with_step(h=8, w=10):
    v, u = np.meshgrid(np.arange(h) + 0.5, np.arange(w) + 0.5, indexing="ij")
    z = np.where(u < w / 2, 2.0, 4.0)  # a depth jump in the middle
    return np.stack([(u - w / 2) / 10 * z, (v - h / 2) / 10 * z, z], -1)


def test_mesh_from_pointmap_triangulates_and_cuts_edges():
    from sam3d_objects.utils.visualization.image_mesh import create_textured_mesh, mesh_from_pointmap
    pm = plane_with_step()
    img = np.random.default_rng(0).random(pm.shape).astype(np.float32)
    full = mesh_from_pointmap(pm, img, filter_edges=False)
    assert full.vertices.shape == (80, 3) and full.vertices.dtype == np.float64
    assert full.faces.shape == (2 * 7 * 9, 3)  # two triangles per 2x2 quad
    np.testing.assert_allclose(full.vertex_colors, img.reshape(-1, 3))
    np.testing.assert_allclose(full.vertex_uvs[0], [0.05, 1 - 1 / 16])
    cut = mesh_from_pointmap(pm, img)
    assert cut.vertices.shape[0] < 80  # the step is cut ...
    z = cut.vertices[cut.faces][..., 2]
    assert (np.ptp(z, axis=1) == 0).all()  # ... no triangle spans it
    masked = mesh_from_pointmap(pm, img, mask=np.zeros(pm.shape[:2], bool), filter_edges=False)
    assert masked.faces.shape == (0, 3)
    mesh = create_textured_mesh(full.vertices, full.faces, full.vertex_colors)
    assert mesh is not None


def test_visualization_package_exports_are_lazy():
    import sam3d_objects.utils.visualization as vis
    assert set(vis.__all__) == {"SceneVisualizer", "plot_tdfy_scene"}
    try:
        vis.SceneVisualizer
    except AttributeError as e:
        assert "not available" in str(e)
