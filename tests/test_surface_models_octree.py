"""OctreeRenderer (pure-PyTorch ray marching) against closed forms: a constant-density cube's opacity
1 - exp(-sigma * path), its depth, the DC colour, trivec density from the tri-vector product, the projection
matrix of the spec, and supersampling shapes. Each check renders an octree built on every test device, with the
camera on the host (the renderer renders where the octree lives)."""
import math

import pytest
import torch

from conftest import host

from sam3d_objects.model.backbone.tdfy_dit.renderers.octree_renderer import (
    OctreeRenderer, intrinsics_to_projection)
from sam3d_objects.model.backbone.tdfy_dit.representations import Octree, Strivec

E = torch.eye(4)
E[2, 3] = 2.0  # camera at (0, 0, -2) looking down +z
K = torch.tensor([[1.0, 0, 0.5], [0, 1.0, 0.5], [0, 0, 1]])
SH_C0 = 0.28209479177387814


def _renderer(**opts):
    renderer = OctreeRenderer({"resolution": 9, "near": 0.5, "far": 4.0, "bg_color": (0, 0, 0), **opts})
    renderer.pipe.num_samples = 160
    return renderer


def test_intrinsics_to_projection_matches_spec():
    P = intrinsics_to_projection(torch.tensor([[0.8, 0, 0.4], [0, 0.9, 0.6], [0, 0, 1]]), 0.1, 10.0)
    expected = torch.tensor([[1.6, 0, -0.2, 0], [0, 1.8, -0.2, 0], [0, 0, 10 / 9.9, 1.0 / -9.9], [0, 0, 1, 0]])
    torch.testing.assert_close(P, expected)


def test_voxel_cube_opacity_depth_and_colour(device):
    tree = Octree(depth=1, primitive="voxel", sh_degree=0, device=device)
    tree.aabb = torch.tensor([-0.5, -0.5, -0.5, 1.0, 1.0, 1.0], device=device)
    tree.density = torch.full((8, 1), 2 + math.log(0.5), device=device)  # exp(x - 2) = 0.5 per unit length
    tree.features_dc[:] = 0.4
    out = host(_renderer().render(tree, E, K))
    assert all(v.device.type == "cpu" for v in out.values())
    assert out.color.shape == (3, 9, 9) and out.alpha.shape == (9, 9)
    assert abs(out.alpha[4, 4].item() - (1 - math.exp(-0.5))) < 0.01  # central ray crosses 1 unit
    assert out.alpha[0, 0].item() == 0.0  # misses the cube
    torch.testing.assert_close(out.color[:, 4, 4], torch.full((3,), (0.5 + SH_C0 * 0.4)) * out.alpha[4, 4],
                               atol=1e-4, rtol=1e-4)
    # expected depth of the exponential absorption profile starting at 1.5, weighted by the opacity
    s = 0.5
    mean_in = (1 - math.exp(-s) * (1 + s)) / (s * (1 - math.exp(-s)))
    assert abs(out.depth[4, 4].item() / out.alpha[4, 4].item() - (1.5 + mean_in)) < 0.02


def test_strivec_density_is_the_trivec_product(device):
    rep = Strivec(resolution=2, aabb=[-0.5, -0.5, -0.5, 1, 1, 1], rank=2, dim=3, device=device)
    rep.trivec = torch.ones(8, 2, 3, 3, device=device)
    rep.trivec[:, 1] = 2.0  # rank 1 lines = 2 -> product 8
    rep.density = torch.tensor([[0.25, 0.1]], device=device).repeat(8, 1)  # total 0.25 + 0.8 = 1.05
    rep.features_dc = torch.zeros(8, 2, 1, 3, device=device)
    out = _renderer().render(rep, E, K)
    assert out.alpha.device.type == torch.device(device).type
    out = host(out)
    assert abs(out.alpha[4, 4].item() - (1 - math.exp(-1.05))) < 0.01
    assert "percent_depth" in out and out.percent_depth[4, 4].item() > 1.5


def test_supersampling_and_options(device):
    tree = Octree(depth=1, primitive="gaussian", sh_degree=0, device=device)
    tree.aabb = torch.tensor([-0.5, -0.5, -0.5, 1.0, 1.0, 1.0], device=device)
    out = _renderer(ssaa=2).render(tree, E, K)
    assert out.color.shape == (3, 9, 9) and out.depth.shape == (9, 9)
    with pytest.raises(ValueError, match="resolution"):
        OctreeRenderer().render(tree, E, K)
    tree.primitive = "nope"
    with pytest.raises(ValueError, match="Unknown primitive"):
        _renderer().render(tree, E, K)
