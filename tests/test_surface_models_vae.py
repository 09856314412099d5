"""Upstream-surface models: encoders (shapes, state-dict keys per the spec, posterior), the radiance-field decoder,
the old dense flow model with its pose token, from_pretrained, timestep embedder vs the sinusoid formula,
octree structure and Strivec."""
import json
import math
import warnings

import pytest
import torch
from safetensors.torch import save_file

from sam3d_objects.model.backbone.tdfy_dit import models
from sam3d_objects.model.backbone.tdfy_dit.models.sparse_structure_flow import (
    DataType, SparseStructureFlowModel, SparseStructureFlowTdfyWrapper)
from sam3d_objects.model.backbone.tdfy_dit.models.sparse_structure_vae import (
    SparseStructureDecoder, SparseStructureEncoder, SparseStructureEncoderTdfyWrapper, norm_layer)
from sam3d_objects.model.backbone.tdfy_dit.models.structured_latent_vae import (
    SLatEncoder, SLatRadianceFieldDecoder)
from sam3d_objects.model.backbone.tdfy_dit.models.structured_latent_vae.base import block_attn_config
from sam3d_objects.model.backbone.tdfy_dit.models.timestep_embedder import TimestepEmbedder
from sam3d_objects.model.backbone.tdfy_dit.modules import sparse as sp
from sam3d_objects.model.backbone.tdfy_dit.representations import Octree, Strivec


def test_ss_encoder_layout_and_posterior():
    torch.manual_seed(0)
    enc = SparseStructureEncoder(in_channels=1, latent_channels=4, num_res_blocks=1, channels=[8, 16],
                                 num_res_blocks_middle=1)
    keys = set(enc.state_dict())
    assert {"input_layer.weight", "blocks.0.norm1.weight", "blocks.0.conv2.weight", "blocks.1.conv.weight",
            "blocks.2.conv1.weight", "middle_block.0.conv1.weight", "out_layer.0.weight",
            "out_layer.2.weight"} <= keys
    assert enc.out_layer[2].weight.shape == (8, 16, 3, 3, 3)
    x = (torch.rand(2, 1, 8, 8, 8) > 0.5).float()
    z, mean, logvar = enc(x, sample_posterior=False, return_raw=True)
    assert z.shape == (2, 4, 4, 4, 4) and torch.equal(z, mean)
    torch.manual_seed(1)
    zs = enc(x, sample_posterior=True)
    torch.manual_seed(1)
    noise = torch.randn_like(mean)
    torch.testing.assert_close(zs, mean + torch.exp(0.5 * logvar) * noise)
    wrapper = SparseStructureEncoderTdfyWrapper(in_channels=1, latent_channels=4, num_res_blocks=1, channels=[8, 16],
                                                num_res_blocks_middle=1, sample_posterior=False)
    wrapper.load_state_dict(enc.state_dict())
    out = wrapper(x)
    assert set(out) == {"z", "mean", "logvar"} and torch.allclose(out["z"], mean)
    with pytest.raises(FileNotFoundError, match="SS encoder"):
        SparseStructureEncoderTdfyWrapper(in_channels=1, latent_channels=4, num_res_blocks=1, channels=[8],
                                          pretrained_ckpt_path="/nonexistent.safetensors")


def test_norm_layer_forwards_extra_arguments():
    assert norm_layer("group", 64, eps=1e-3).eps == 1e-3
    with pytest.raises(ValueError):
        norm_layer("batch", 4)


def test_ss_decoder_flat_to_cube_is_x_major():
    flat = torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(2, 8, 3)
    cube = SparseStructureDecoder.flat_to_cube(flat)
    assert cube.shape == (2, 3, 2, 2, 2)
    assert cube[1, 2, 1, 0, 1] == flat[1, 1 * 4 + 0 * 2 + 1, 2]
    dec = SparseStructureDecoder(1, 3, 1, [8], num_res_blocks_middle=1, reshape_input_to_cube=True)
    torch.testing.assert_close(dec(flat), dec(cube))


def _sparse_input(channels, resolution=8, n=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    coords = torch.unique(torch.randint(0, resolution, (n, 3), generator=g), dim=0)
    coords = torch.cat([torch.zeros(len(coords), 1, dtype=torch.long), coords], 1).int()
    return sp.SparseTensor(feats=torch.randn(len(coords), channels, generator=g), coords=coords)


def test_slat_encoder_shapes_keys_and_zero_output_init():
    torch.manual_seed(0)
    enc = SLatEncoder(resolution=8, in_channels=6, model_channels=32, latent_channels=4, num_blocks=2,
                      num_head_channels=16, window_size=4)
    keys = set(enc.state_dict())
    assert {"input_layer.weight", "blocks.1.attn.to_qkv.weight", "out_layer.weight", "out_layer.bias"} <= keys
    assert enc.out_layer.weight.shape == (8, 32) and not enc.out_layer.weight.any()
    x = _sparse_input(6)
    z, mean, logvar = enc(x, sample_posterior=False, return_raw=True)
    assert mean.shape == (x.feats.shape[0], 4) and torch.equal(z.coords, x.coords)
    assert not mean.any() and not logvar.any()  # zero-initialised output layer


def test_radiance_field_decoder_builds_strivecs():
    dec = SLatRadianceFieldDecoder(resolution=8, model_channels=32, latent_channels=4, num_blocks=1,
                                   num_head_channels=16, window_size=4, representation_config={"rank": 2, "dim": 3})
    assert dec.out_channels == 2 * 3 * 3 + 2 + 2 * 3
    x = _sparse_input(4)
    (rep,) = dec(x)
    assert isinstance(rep, Strivec) and rep.trivec.shape == (x.feats.shape[0], 2, 3, 3)
    torch.testing.assert_close(rep.trivec, torch.ones_like(rep.trivec))  # zero output + 1
    torch.testing.assert_close(rep.position, (x.coords[:, 1:].float() + 0.5) / 8)
    assert int(rep.depth[0]) == 3


def test_block_attn_config_upstream_tuples():
    class Cfg:
        num_blocks, window_size = 2, 8
    for mode, expected in [("swin", [("windowed", 8, None, 0, None), ("windowed", 8, None, 4, None)]),
                           ("full", [("full", None, None, None, None)] * 2)]:
        Cfg.attn_mode = mode
        assert list(block_attn_config(Cfg)) == expected
    Cfg.attn_mode = "shift_window"
    assert list(block_attn_config(Cfg))[1][3] == (16, 16, 16)


def test_timestep_embedder_matches_sinusoid_formula():
    t = torch.tensor([0.0, 3.5, 999.0], dtype=torch.float64)
    emb = TimestepEmbedder.timestep_embedding(t, 7)
    half = 3
    for i, tv in enumerate(t.tolist()):
        for k in range(half):
            f = math.exp(-math.log(10000) * k / half)
            assert abs(emb[i, k].item() - math.cos(tv * f)) < 1e-4
            assert abs(emb[i, half + k].item() - math.sin(tv * f)) < 1e-4
        assert emb[i, 6] == 0
    frozen = TimestepEmbedder(16, 8, freeze=True)
    assert not frozen.training and not any(p.requires_grad for p in frozen.parameters())
    assert frozen(torch.tensor(2.0)).shape == (1, 16)


def _dense_flow(**kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return SparseStructureFlowTdfyWrapper(resolution=4, in_channels=2, model_channels=32, cond_channels=8,
                                              out_channels=2, num_blocks=1, num_head_channels=16, patch_size=2, **kw)


def test_dense_flow_pose_token_and_token_wrapper():
    torch.manual_seed(0)
    model = _dense_flow(include_pose=True).eval()
    assert model.pos_emb.shape == (9, 32) and torch.all(model.pos_emb[-1] == 0.5)
    x = torch.randn(1, 64 + 1, 2)  # 4^3 voxels + a pose token... of the patch width
    with pytest.raises(RuntimeError):
        model(x, torch.tensor([1.0]), torch.randn(1, 3, 8))
    tokens = torch.randn(1, 64, 2)
    pose = torch.randn(1, 1, 16)
    grid = tokens.permute(0, 2, 1).reshape(1, 2, 4, 4, 4)
    out = SparseStructureFlowModel.forward(model, DataType(grid, pose), torch.tensor([1.0]), torch.randn(1, 3, 8))
    assert out.shape.shape == grid.shape and out.pose.shape == (1, 1, 16)
    plain = _dense_flow(force_zeros_cond=True).eval()
    cond = torch.randn(1, 3, 8)
    y = plain(tokens, torch.tensor([5.0]), cond)
    assert y.shape == tokens.shape
    direct = SparseStructureFlowModel.forward(plain, grid, torch.tensor([5.0]), cond)
    torch.testing.assert_close(y, direct.reshape(1, 2, 64).permute(0, 2, 1))
    torch.testing.assert_close(plain(tokens, torch.tensor([5.0]), cond, cfg=True),
                               plain(tokens, torch.tensor([5.0]), torch.zeros_like(cond)))


def test_from_pretrained_local(tmp_path):
    enc = SparseStructureEncoder(1, 2, 1, [8], num_res_blocks_middle=1)
    args = {"in_channels": 1, "latent_channels": 2, "num_res_blocks": 1, "channels": [8],
            "num_res_blocks_middle": 1}
    (tmp_path / "m.json").write_text(json.dumps({"name": "SparseStructureEncoder", "args": args}))
    save_file({k: v.contiguous() for k, v in enc.state_dict().items()}, str(tmp_path / "m.safetensors"))
    loaded = models.from_pretrained(str(tmp_path / "m"))
    for k, v in enc.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v)


def test_octree_initial_structure_and_gathers():
    tree = Octree(depth=3, primitive="gaussian", sh_degree=1, device="cpu")
    assert tree.structure.tolist() == [[8, 1, 0]] and tree.num_leaf_nodes == 8
    assert tree.position[1].tolist() == [0.75, 0.25, 0.25] and tree.position[2].tolist() == [0.25, 0.75, 0.25]
    assert tree.features_ac.shape == (8, 3, 3)
    vals = torch.arange(8.0)
    assert tree.gather_from_leaf_children(vals).tolist() == [28.0]
    mask = torch.zeros(8, dtype=torch.long)
    mask[3] = 1
    tree.structure_control(mask)
    assert tree.num_leaf_nodes == 15 and tree.structure.tolist() == [[7, 1, 0], [8, 2, 7]]
    assert tree.gather_from_leaf_children(torch.ones(15)).tolist() == [7.0, 8.0]
    assert tree.gather_from_non_leaf_children(torch.tensor([1.0, 5.0])).tolist() == [5.0, 0.0]
    assert tree.cur_depth == 2 and tree.occupancy == 15 / 64
    children = tree.position[tree.depth[:, 0] == 2]
    torch.testing.assert_close(children.mean(0), torch.tensor([0.75, 0.75, 0.25]))
    tree.structure_control(torch.tensor([0] * 7 + [-1] * 8))  # merge them back
    assert tree.num_leaf_nodes == 8 and tree.structure.tolist() == [[8, 1, 0]]
    with pytest.raises(ValueError, match="power of 2"):
        Strivec(resolution=6, aabb=[0, 0, 0, 1, 1, 1])
