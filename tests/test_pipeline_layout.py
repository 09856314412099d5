"""Layout post-optimisation on a synthetic scene: a sphere seen by a pinhole camera, the mask and the point map
computed analytically (ray-sphere intersection), a perturbed starting pose. ``backends.rasterize`` (being written
in another branch) is replaced here, in the test only, by a brute-force point-in-triangle stand-in with its API."""
import sys
import types

import numpy as np
import pytest
import torch

SIZE = 64
CENTER = np.array([0.0, 0.0, 3.0])
RADIUS = 0.5
K_NORM = torch.tensor([[1.0, 0.0, 0.5], [0.0, 1.0, 0.5], [0.0, 0.0, 1.0]])


def rasterize_standin(verts_clip, faces, size):
    """nvdiffrast-like: rast[B, H, W, 4] = (u, v, z/w, tri_id + 1) of the nearest triangle at each pixel centre
    (row 0 at ndc y = -1)."""
    h, w = size
    ndc = verts_clip[..., :2] / verts_clip[..., 3:]
    depth = verts_clip[..., 2] / verts_clip[..., 3]
    pix = torch.stack([(ndc[..., 0] + 1) / 2 * w, (ndc[..., 1] + 1) / 2 * h], -1)[0]  # [V, 2]
    ys, xs = torch.meshgrid(torch.arange(h) + 0.5, torch.arange(w) + 0.5, indexing="ij")
    p = torch.stack([xs, ys], -1).reshape(-1, 1, 2)  # [P, 1, 2]
    a, b, c = (pix[faces[:, i].long()][None] for i in range(3))
    den = (b[..., 1] - c[..., 1]) * (a[..., 0] - c[..., 0]) + (c[..., 0] - b[..., 0]) * (a[..., 1] - c[..., 1])
    l0 = ((b[..., 1] - c[..., 1]) * (p[..., 0] - c[..., 0]) + (c[..., 0] - b[..., 0]) * (p[..., 1] - c[..., 1])) / den
    l1 = ((c[..., 1] - a[..., 1]) * (p[..., 0] - c[..., 0]) + (a[..., 0] - c[..., 0]) * (p[..., 1] - c[..., 1])) / den
    l2 = 1 - l0 - l1
    inside = (l0 >= 0) & (l1 >= 0) & (l2 >= 0)
    z = l0 * depth[0][faces[:, 0].long()] + l1 * depth[0][faces[:, 1].long()] + l2 * depth[0][faces[:, 2].long()]
    z = torch.where(inside, z, torch.full_like(z, float("inf")))
    zmin, tri = z.min(dim=1)
    hit = torch.isfinite(zmin)
    rast = torch.zeros(h * w, 4)
    rast[:, 0] = torch.where(hit, l0.gather(1, tri[:, None])[:, 0], torch.zeros_like(zmin))
    rast[:, 1] = torch.where(hit, l1.gather(1, tri[:, None])[:, 0], torch.zeros_like(zmin))
    rast[:, 2] = torch.where(hit, zmin, torch.zeros_like(zmin))
    rast[:, 3] = torch.where(hit, tri.float() + 1, torch.zeros_like(zmin))
    return rast.reshape(1, h, w, 4)


@pytest.fixture(autouse=True)
def rasterize_module(monkeypatch):
    import backends
    if getattr(backends, "rasterize", None) is not None:
        yield backends.rasterize  # the real one, once merged
        return
    module = types.ModuleType("backends.rasterize")
    module.rasterize = rasterize_standin
    monkeypatch.setitem(sys.modules, "backends.rasterize", module)
    monkeypatch.setattr(backends, "rasterize", module, raising=False)
    yield module


def scene():
    """Mask [H, W] and point map [H, W, 3] (PyTorch3D camera frame) of the sphere; background plane at z = 6."""
    ys, xs = np.meshgrid(np.arange(SIZE) + 0.5, np.arange(SIZE) + 0.5, indexing="ij")
    # pixel -> ray in the OpenCV frame, then to PyTorch3D (x, y negated)
    d = np.stack([(xs / SIZE - 0.5) / 1.0, (ys / SIZE - 0.5) / 1.0, np.ones_like(xs)], -1)
    d = d * np.array([-1.0, -1.0, 1.0])
    d /= np.linalg.norm(d, axis=-1, keepdims=True)
    b = (d * CENTER).sum(-1)
    disc = b ** 2 - (CENTER ** 2).sum() + RADIUS ** 2
    hit = disc > 0
    t = np.where(hit, b - np.sqrt(np.clip(disc, 0, None)), 6.0 / d[..., 2])
    return torch.tensor(hit, dtype=torch.float32), torch.tensor(d * t[..., None], dtype=torch.float32)


def sphere_glb():
    import trimesh
    return trimesh.creation.icosphere(subdivisions=2, radius=1.0)  # y-up GLB frame; symmetric anyway


def pose_iou(translation, scale):
    from sam3d_objects.pipeline import layout_post_optimization_utils as lpo
    mask, renderer = lpo.get_mask_renderer(scene()[0], SIZE, K_NORM, "cpu")
    mesh = sphere_glb()
    verts = torch.tensor(mesh.vertices, dtype=torch.float32) * float(scale) + torch.as_tensor(translation)
    return float(lpo.compute_iou(renderer.hard(lpo.LayoutMesh(verts, torch.tensor(mesh.faces))), mask[0, 0]))


def test_the_standin_renders_the_analytic_silhouette():
    assert pose_iou(torch.tensor(CENTER, dtype=torch.float32), RADIUS) > 0.9


def test_occlusion_heuristics():
    from sam3d_objects.pipeline import layout_post_optimization_utils as lpo
    mask, pm = scene()
    assert not lpo.check_occlusion(mask.numpy(), pm.numpy())
    border = mask.clone()
    border[0, 10:20] = 1
    assert lpo.is_near_image_border(border.numpy(), 5)
    holed = mask.clone()
    holed[30:34, 30:34] = 0
    assert lpo.has_internal_occlusion(holed.numpy(), min_hole_area=10)
    nearer = pm.clone()
    ring = torch.tensor(lpo.remove_small_regions(mask.numpy(), 1))
    nearer[..., 2] = torch.where(ring, nearer[..., 2], torch.full_like(nearer[..., 2], 1.0))  # occluder in front
    assert lpo.is_occluded_by_others(mask.numpy(), nearer.numpy(), 2, 0.05, 3)
    assert lpo.remove_small_regions(np.pad(np.ones((2, 2)), 3), min_area=5).sum() == 0


def test_soft_silhouette_has_a_gradient_towards_the_mask():
    from sam3d_objects.pipeline import layout_post_optimization_utils as lpo
    mask, renderer = lpo.get_mask_renderer(scene()[0], SIZE, K_NORM, "cpu")
    mesh = sphere_glb()
    shift = torch.tensor([0.2, 0.0, 0.0], requires_grad=True)
    verts = torch.tensor(mesh.vertices, dtype=torch.float32) * RADIUS + torch.tensor(CENTER, dtype=torch.float32)
    alpha = renderer(lpo.LayoutMesh(verts + shift, torch.tensor(mesh.faces)))[0, ..., 3]
    assert alpha.max() > 0.9 and alpha.min() < 1e-3
    ((alpha - mask) ** 2).mean().backward()
    assert shift.grad[0] > 0  # moving back towards x = 0 lowers the loss


@pytest.mark.parametrize("inputs_on", ["cpu", "device"])
def test_layout_post_optimization_improves_a_perturbed_pose(device, inputs_on):
    """Refined on ``device`` (the pose algebra too); the pose comes back on the caller's device, whether the
    caller's tensors are on the host or on the refinement device."""
    from sam3d_objects.pipeline.inference_utils import layout_post_optimization
    caller = torch.device("cpu") if inputs_on == "cpu" else device
    mask, pm = scene()
    start_t = torch.tensor([[0.12, -0.08, 3.2]])
    start_s = torch.full((1, 3), 0.42)
    before = pose_iou(start_t[0], start_s[0, 0])
    q, t, s, iou, icp_ok, render_ok = layout_post_optimization(
        sphere_glb(), torch.tensor([[1.0, 0.0, 0.0, 0.0]], device=caller), start_t.to(caller), start_s.to(caller),
        mask.to(caller), pm.to(caller), K_NORM, min_size=SIZE, device=device)
    assert q.shape == (1, 4) and t.shape == (1, 3) and s.shape == (1, 3)
    assert {q.device.type, t.device.type, s.device.type} == {caller.type}
    q, t, s = q.cpu(), t.cpu(), s.cpu()
    after = pose_iou(t[0], s[0, 0])
    assert render_ok or icp_ok
    assert after > before + 0.1 and after > 0.8, (before, after, iou)
    assert abs(iou - after) < 0.05
    assert np.linalg.norm(t[0].numpy() / s[0, 0].item() * RADIUS - CENTER) < np.linalg.norm(
        start_t[0].numpy() - CENTER)


def test_pipeline_runs_the_configured_method_and_keeps_the_pose_on_failure(monkeypatch):
    from sam3d_objects.pipeline.inference_pipeline_pointmap import InferencePipelinePointMap
    pipe = object.__new__(InferencePipelinePointMap)
    pipe.layout_post_optimization_method = "sam3d_objects.pipeline.inference_utils.layout_post_optimization"
    calls = []

    def method(mesh, q, t, s, mask, point_map, intrinsics, min_size):
        calls.append((intrinsics.clone(), point_map.shape, min_size))
        return q * 0 + 1, t + 1, s, 0.9, True, True

    monkeypatch.setattr(pipe, "_layout_method", lambda: method)
    out = {"glb": sphere_glb(), "intrinsics": torch.tensor([[0.8, 0, 0.5], [0, 1.2, 0.5], [0, 0, 1.0]]),
           "rotation": torch.zeros(1, 4), "translation": torch.zeros(1, 3), "scale": torch.ones(1, 3)}
    ss_input = {"rgb_image_mask": torch.ones(1, 1, 8, 8), "rgb_pointmap": torch.zeros(1, 3, 8, 8)}
    pipe._apply_layout_postprocess(out, ss_input)
    intr, shape, min_size = calls[0]
    assert intr[0, 0] == intr[1, 1] == pytest.approx(0.8) and shape == (8, 8, 3) and min_size == 518
    assert out["iou"] == 0.9 and torch.equal(out["translation"], torch.ones(1, 3))
    out2 = dict(out, glb=None, translation=torch.zeros(1, 3))
    pipe._apply_layout_postprocess(out2, ss_input)  # no mesh: logged, pose kept
    assert torch.equal(out2["translation"], torch.zeros(1, 3))
    pipe.layout_post_optimization_method = "no_such_method"
    monkeypatch.undo()
    with pytest.raises(ValueError, match="unknown"):
        pipe._layout_method()
