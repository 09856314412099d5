"""Upstream-surface representations and flow pieces: Gaussian PLY round trip and covariance, 3DGS utilities,
dense cube helpers, FlexiCubes dense call form and table names, the SLat flow's shortcut d-embedder, the MoT
share-group merge/split and upstream backbone interface, position-embedder factories, DinoForMasks."""
import math
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn
from PIL import Image

from sam3d_objects.model.backbone.dit.embedder.dino import DinoForMasks
from sam3d_objects.model.backbone.tdfy_dit.models import mm_latent
from sam3d_objects.model.backbone.tdfy_dit.models.mot_sparse_structure_flow import (
    SparseStructureFlowModel, SparseStructureFlowTdfyWrapper)
from sam3d_objects.model.backbone.tdfy_dit.models.structured_latent_flow import SLatFlowModelTdfyWrapper
from sam3d_objects.model.backbone.tdfy_dit.representations.gaussian import general_utils as gu
from sam3d_objects.model.backbone.tdfy_dit.representations.gaussian.gaussian_model import (
    Gaussian, softplus_inverse_scaling_activation)
from sam3d_objects.model.backbone.tdfy_dit.representations.mesh import utils_cube as uc
from sam3d_objects.model.backbone.tdfy_dit.representations.mesh.flexicubes import tables
from sam3d_objects.model.backbone.tdfy_dit.representations.mesh.flexicubes.flexicubes import FlexiCubes


def _gaussian(n=12):
    g = torch.Generator().manual_seed(0)
    gs = Gaussian(aabb=[-0.5, -0.5, -0.5, 1.0, 1.0, 1.0], mininum_kernel_size=0.0009, scaling_bias=0.004,
                  opacity_bias=0.1, scaling_activation="softplus")
    gs._xyz = torch.rand(n, 3, generator=g)
    gs._features_dc = torch.randn(n, 1, 3, generator=g)
    gs._scaling = torch.randn(n, 3, generator=g)
    gs._rotation = torch.randn(n, 4, generator=g) * 0.3
    gs._opacity = torch.randn(n, 1, generator=g)
    return gs


def test_gaussian_ply_round_trip(tmp_path):
    pytest.importorskip("plyfile")
    gs = _gaussian()
    gs.save_ply(str(tmp_path / "g.ply"))
    back = Gaussian(aabb=[-0.5, -0.5, -0.5, 1.0, 1.0, 1.0], mininum_kernel_size=0.0009, scaling_bias=0.004,
                    opacity_bias=0.1, scaling_activation="softplus")
    back.load_ply(str(tmp_path / "g.ply"))
    for attr in ("get_xyz", "get_opacity", "get_scaling", "get_rotation", "_features_dc"):
        torch.testing.assert_close(getattr(back, attr), getattr(gs, attr), rtol=1e-4, atol=1e-5)


def test_build_covariance_and_softplus_inverse():
    s = torch.tensor([[1.0, 2.0, 3.0]])
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    cov = Gaussian.build_covariance_from_scaling_rotation(s, 2.0, r)
    torch.testing.assert_close(cov, torch.tensor([[4.0, 0, 0, 16.0, 0, 36.0]]))
    x = torch.tensor([0.1, 1.0, 5.0], dtype=torch.float64)
    torch.testing.assert_close(torch.nn.functional.softplus(softplus_inverse_scaling_activation(x)), x)


def test_3dgs_utilities(capsys):
    lr = gu.get_expon_lr_func(1e-2, 1e-4, lr_delay_steps=10, lr_delay_mult=0.1, max_steps=100)
    assert lr(-1) == 0.0 and abs(lr(0) - 1e-3) < 1e-12
    assert abs(lr(100) - 1e-4) < 1e-12 and abs(lr(50) - math.sqrt(1e-2 * 1e-4)) < 1e-9
    img = Image.fromarray(np.full((4, 6, 3), 255, dtype=np.uint8))
    t = gu.PILtoTorch(img, (3, 2))
    assert t.shape == (3, 2, 3) and torch.all(t == 1)
    assert gu.PILtoTorch(img.convert("L"), (3, 2)).shape == (1, 2, 3)
    old = sys.stdout
    try:
        gu.safe_state(silent=True)
        print("hidden")
        a = torch.rand(1)
        gu.safe_state(silent=False)
        b = torch.rand(1)
    finally:
        sys.stdout = old
    assert torch.equal(a, b) and "hidden" not in capsys.readouterr().out


def test_dense_cube_helpers():
    assert uc.cube_edges.dtype == torch.long and uc.cube_edges.shape == (24,)
    dense = uc.get_dense_attrs(torch.tensor([[1, 0, 1]]), torch.tensor([[-2.0, 5.0]]), res=2)
    assert dense.shape == (8, 2) and dense[1 * 4 + 0 * 2 + 1].tolist() == [-2.0, 5.0]
    assert dense[0].tolist() == [1.0, 0.0]
    cubes = torch.tensor([[0, 1], [1, 2]])
    value = torch.tensor([[[1.0], [2.0]], [[3.0], [4.0]]])
    assert uc.cubes_to_verts(3, cubes, value, reduce="sum").flatten().tolist() == [1.0, 5.0, 4.0]
    assert uc.cubes_to_verts(3, cubes, value).flatten().tolist() == [1.0, 2.5, 4.0]


def test_flexicubes_tables_and_dense_call_form():
    assert tables.dmc_table.shape == (256, 4, 7) and tables.num_vd_table.shape == (256,)
    assert tables.check_table.shape == (256, 5)
    assert tables.num_vd_table[0] == 0 and tables.num_vd_table[1] == 1
    # every listed edge of a case's dual vertices is a sign-changing edge of that case
    edges = uc.cube_edges.reshape(12, 2)
    for case in (1, 7, 60, 105):
        inside = [(case >> i) & 1 for i in range(8)]
        for e in tables.dmc_table[case].flatten().tolist():
            if e >= 0:
                a, b = edges[e].tolist()
                assert inside[a] != inside[b]
    res = 6
    verts, cubes = uc.construct_dense_grid(res)
    pos = verts.float() / res - 0.5
    sdf = pos.norm(dim=1) - 0.3
    ids = torch.arange(res ** 3)
    coords = torch.stack([ids // (res * res), ids // res % res, ids % res], 1)
    v1, f1, _, _ = FlexiCubes()(pos, sdf, cubes, res)
    v2, f2, _, _ = FlexiCubes()(pos, sdf, cubes, res, cube_coords=coords)
    assert torch.equal(v1, v2) and torch.equal(f1, f2) and f1.shape[0] > 0


def test_slat_flow_shortcut_d_embedding():
    torch.manual_seed(0)
    model = SLatFlowModelTdfyWrapper(resolution=8, in_channels=4, model_channels=32, cond_channels=8,
                                     out_channels=4, num_blocks=1, num_heads=2, io_block_channels=[16],
                                     patch_size=2, is_shortcut_model=True).eval()
    model.initialize_weights()
    assert not model.out_layer.weight.any()
    assert list(dict(model.named_children()))[:2] == ["d_embedder", "t_embedder"]
    with torch.no_grad():  # away from the (degenerate) training init: every weight random
        for p in model.parameters():
            p.normal_(std=p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1)
    coords = torch.tensor([[0, 1, 2, 3], [0, 4, 4, 4], [0, 2, 2, 2]], dtype=torch.int32)
    x, cond, t = torch.randn(1, 3, 4), torch.randn(1, 5, 8), torch.tensor([100.0])
    a = model(x, t, cond, coords, d=torch.tensor([0.0]))
    b = model(x, t, cond, coords=coords, d=torch.tensor([0.0]))
    torch.testing.assert_close(a, b)
    assert not torch.allclose(a, model(x, t, cond, coords, d=torch.tensor([250.0])))


def _latents():
    return {"shape": mm_latent.Latent(4, 32, mm_latent.ShapePositionEmbedder(32, 2, 1)),
            "rot": mm_latent.Latent(6, 32, lambda: mm_latent.LearntPositionEmbedder(32, 1)),
            "scale": mm_latent.Latent(3, 32, mm_latent.RandomPositionEmbedder(32, 1))}


def test_mot_share_groups_and_upstream_backbone():
    torch.manual_seed(0)
    wrapper = SparseStructureFlowTdfyWrapper(resolution=2, in_channels=4, model_channels=32, cond_channels=8,
                                             out_channels=4, num_blocks=1, num_heads=2,
                                             latent_mapping=_latents(),
                                             latent_share_transformer={"pose": ["rot", "scale"]}).eval()
    assert isinstance(wrapper.latent_mapping["rot"].pos_emb, nn.Parameter)
    assert "pos_emb" in dict(wrapper.latent_mapping["scale"].named_buffers())
    parts = {"rot": torch.randn(1, 1, 32), "scale": torch.randn(1, 1, 32), "shape": torch.randn(1, 8, 32)}
    merged = wrapper.merge_latent_share_transformer(parts)
    assert list(merged) == ["pose", "shape"] and merged["pose"].shape == (1, 2, 32)
    split = wrapper.split_latent_share_transformer(merged)
    assert all(torch.equal(split[k], parts[k]) for k in parts)
    latents = {"shape": torch.randn(1, 8, 4), "rot": torch.randn(1, 1, 6), "scale": torch.randn(1, 1, 3)}
    cond, t = torch.randn(1, 3, 8), torch.tensor([10.0])
    out = wrapper(latents, t, cond)
    streams = wrapper.project_input(latents)
    core = SparseStructureFlowModel.forward(wrapper, streams, t, cond)
    ref = wrapper.project_output(core)
    for k in latents:
        torch.testing.assert_close(out[k], ref[k])
    with pytest.raises(KeyError, match="not found in latents_dict"):
        wrapper.project_input({"shape": latents["shape"]})
    backbone = SparseStructureFlowModel(4, 32, 8, 4, 1, num_heads=2, latent_mapping=_latents())
    assert backbone(streams_single := {k: torch.randn(1, n, 32) for k, n in (("shape", 8), ("rot", 1),
                                                                          ("scale", 1))}, t, cond)["rot"].shape \
        == streams_single["rot"].shape


def test_latent_initialize_and_timestep_embedder_freeze():
    lat = _latents()["rot"]
    with torch.no_grad():
        lat.input_layer.bias.fill_(3.0)
    lat.initialize_weights()
    assert not lat.input_layer.bias.any()


def test_dino_for_masks_embeds_the_mask():
    class FakeDino(nn.Module):
        embed_dim = 7

        def forward(self, x, **kwargs):
            return x.mean(dim=(2, 3))

    wrapper = DinoForMasks(FakeDino())
    mask = torch.rand(2, 1, 4, 4)
    assert wrapper.embed_dim == 7
    torch.testing.assert_close(wrapper(torch.zeros(2, 3, 4, 4), mask), mask.mean(dim=(2, 3)))


def test_mot_layers_upstream_interface():
    from sam3d_objects.model.backbone.tdfy_dit.modules.attention.modules import MOTMultiHeadSelfAttention
    from sam3d_objects.model.backbone.tdfy_dit.modules.transformer.modulated import MOTModulatedTransformerCrossBlock
    torch.manual_seed(0)
    attn = MOTMultiHeadSelfAttention(16, 2, latent_names=["pose", "shape"])
    x = {"pose": torch.randn(1, 2, 16), "shape": torch.randn(1, 5, 16)}
    cat, mapping = attn.concatenate_tensor(x, ["pose", "shape"])
    assert cat.shape == (1, 7, 16) and mapping == {"pose": [0, 2], "shape": [2, 5]}  # upstream: [start, length]
    back = attn.unpack_tensors(cat, mapping)
    assert all(torch.equal(back[k], x[k]) for k in x)
    q, k, v = attn.unbind_qkv(torch.randn(1, 4, 3, 2, 8))
    assert q.shape == (1, 4, 2, 8)
    qkv = {n: attn._project(n, h) for n, h in x.items()}
    parts = attn.mm_scale_dot_product_attention(*({n: t[i] for n, t in qkv.items()} for i in range(3)))
    # shape attends only to itself: its output does not depend on the pose tokens
    alone = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in qkv["shape"]))
    torch.testing.assert_close(parts["shape"], alone.transpose(1, 2))
    out = attn(x)
    assert set(out) == {"pose", "shape"} and out["pose"].shape == (1, 2, 16)
    block = MOTModulatedTransformerCrossBlock(16, 8, 2, latent_names=["pose", "shape"])
    y = block(x, torch.randn(1, 16), torch.randn(1, 3, 8))
    assert y["shape"].shape == (1, 5, 16)
