"""Upstream-surface modules: checkpoint io, llama3 FeedForward, embedder pieces (point remapper, point-map dropout,
fuser options, DinoForMasks), sparse/attention switches and call forms, SparseTensor helpers, masked and
serialized attention vs dense references, spconv convs, utils, Gaussian PLY round trip, 3DGS utils, cube helpers,
FlexiCubes table names, shortcut d-embedder of the SLat flow, MoT share-group merge/split."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import backends
from sam3d_objects.model import io as mio
from sam3d_objects.model.backbone.dit.embedder.embedder_fuser import EmbedderFuser
from sam3d_objects.model.backbone.dit.embedder.point_remapper import PointRemapper
from sam3d_objects.model.backbone.dit.embedder.pointmap import PointPatchEmbed
from sam3d_objects.model.backbone.tdfy_dit.modules import attention as dense_attn
from sam3d_objects.model.backbone.tdfy_dit.modules import sparse as sp
from sam3d_objects.model.backbone.tdfy_dit.modules import utils as mu
from importlib import import_module

# the package re-exports functions named like these modules (as upstream), so import the modules by path
ms = import_module("sam3d_objects.model.backbone.tdfy_dit.modules.sparse.attention.masked_sdpa")
sa = import_module("sam3d_objects.model.backbone.tdfy_dit.modules.sparse.attention.serialized_attn")
from sam3d_objects.model.layers.llama3.ff import FeedForward


def test_feed_forward_hidden_size_and_formula():
    ff = FeedForward(dim=8, hidden_dim=96, multiple_of=16, output_dim=5)
    assert ff.w1.weight.shape == (64, 8) and ff.w2.weight.shape == (5, 64)  # int(2*96/3)=64
    assert list(ff.state_dict()) == ["w1.weight", "w2.weight", "w3.weight"]
    x = torch.randn(3, 8)
    torch.testing.assert_close(ff(x), ff.w2(F.silu(ff.w1(x)) * ff.w3(x)))
    skip = FeedForward(8, 30, multiple_of=16, ffn_dim_multiplier=2.0, skip_w2=True)
    assert skip.w1.weight.shape[0] == 48 and not hasattr(skip, "w2")  # int(2*20)=40 -> 48


def test_load_model_from_checkpoint_and_prefix_helpers(tmp_path):
    src = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    sd = {"model." + k: v for k, v in src.state_dict().items()}
    sd["junk"] = torch.zeros(1)
    torch.save({"state_dict": sd}, tmp_path / "c.ckpt")
    dst = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    out = mio.load_model_from_checkpoint(dst, str(tmp_path / "c.ckpt"), remove_name=["junk"], freeze=True,
                                         state_dict_fn=mio.remove_prefix_state_dict_fn("model."))
    assert not out.training and not any(p.requires_grad for p in out.parameters())
    for k, v in src.state_dict().items():
        assert torch.equal(out.state_dict()[k], v)
    assert mio.add_prefix_state_dict_fn("p.")({"a": 1}) == {"p.a": 1}
    assert mio.filter_and_remove_prefix_state_dict_fn("p.")({"p.a": 1, "b": 2}) == {"a": 1}
    with pytest.raises(FileNotFoundError):
        mio.load_model_from_checkpoint(dst, str(tmp_path / "missing.ckpt"))
    with pytest.raises(RuntimeError, match="cpu"):
        mio.load_sharded_checkpoint(tmp_path, device="cuda")


def test_get_last_checkpoint(tmp_path):
    for name in ("epoch=1-step=10.ckpt", "epoch=2-step=5.ckpt", "epoch=2-step=7.ckpt", "other.ckpt"):
        (tmp_path / name).write_bytes(b"")
    assert mio.get_last_checkpoint(str(tmp_path)).endswith("epoch=2-step=7.ckpt")
    with pytest.raises(RuntimeError, match="no checkpoint"):
        mio.get_last_checkpoint(str(tmp_path / "none"))


def test_rename_by_suffix_matching(tmp_path):
    model = nn.Sequential()
    model.add_module("enc", nn.Linear(2, 2))
    src = {"backbone.module.enc.weight": torch.ones(2, 2), "backbone.module.enc.bias": torch.zeros(2)}
    torch.save({"sd": src}, tmp_path / "in.pt")
    mio.rename_checkpoint_weights_using_suffix_matching(tmp_path / "in.pt", tmp_path / "out.pt", model, keys=("sd",))
    out = torch.load(tmp_path / "out.pt")["sd"]
    assert set(out) == {"enc.weight", "enc.bias"} and torch.equal(out["enc.weight"], torch.ones(2, 2))


@pytest.mark.parametrize("kind", PointRemapper.VALID_TYPES)
def test_point_remapper_round_trip(kind):
    pts = torch.tensor([[0.3, -0.2, 1.5], [-1.0, 0.7, 0.2]], dtype=torch.float64)
    r = PointRemapper(kind)
    torch.testing.assert_close(r.inverse(r(pts)), pts)
    if kind == "exp":
        torch.testing.assert_close(r(pts)[0], torch.tensor([0.3 / 2.5, -0.2 / 2.5, math.log(2.5)],
                                                           dtype=torch.float64))
    assert kind in r.extra_repr()
    with pytest.raises(ValueError):
        PointRemapper("log")


def test_pointmap_dropout_and_split_forward():
    torch.manual_seed(0)
    emb = PointPatchEmbed(input_size=16, patch_size=4, embed_dim=32, num_heads=4, dropout_prob=0.5,
                          force_dropout_always=True).eval()
    emb.initialize_weights()
    assert "dropped_xyz_token" in emb.state_dict()
    assert "dropped_xyz_token" not in PointPatchEmbed(16, 4, 32, num_heads=4).state_dict()
    xyz = torch.rand(2, 3, 20, 20) + 0.5
    assert emb.resize_input(xyz).shape == (2, 16, 16, 3)
    out = emb(xyz)
    expected = emb.dropped_xyz_token + emb._get_pos_embed((4, 4)).reshape(1, 16, 32)
    torch.testing.assert_close(out, expected.expand(2, -1, -1))  # every sample dropped (forced)
    emb.force_dropout_always = False
    x, b, h, w = emb.embed_pointmap_windows(xyz)
    assert (b, h, w) == (2, 16, 16)
    torch.testing.assert_close(emb(xyz), emb.inner_forward(x, b, h, w))  # eval: no dropout


def test_embedder_fuser_compression_and_no_pre_norm():
    class Emb(nn.Module):
        embed_dim = 8

        def forward(self, x):
            return x.flatten(2).transpose(1, 2)[..., :8].repeat(1, 1, 1)

    fuser = EmbedderFuser([(Emb(), [("image", "cropped"), ("depth", "cropped")])], projection_pre_norm=False,
                          compression_projection_multiplier=2.0)
    keys = set(fuser.state_dict())
    assert "projection_nets.0.1.w1.weight" in keys and not any(k.startswith("projection_nets.0.0") for k in keys)
    assert fuser.compression_projector[1].w1.weight.shape[1] == 16  # two inputs side by side
    image, depth = torch.randn(2, 8, 3, 3), torch.randn(2, 8, 3, 3)
    out = fuser(image=image, depth=depth)
    tokens = [fuser.projection_nets[0](Emb()(x)) + fuser.idx_emb[0] for x in (image, depth)]
    torch.testing.assert_close(out, fuser.compression_projector(torch.cat(tokens, dim=-1)))
    assert out.shape == (2, 9, 8)


def test_backend_switches_delegate_to_backends():
    try:
        sp.set_attn("naive")
        assert sp.ATTN == "naive" and backends.current("cpu")["sparse_attn"] == "naive"
        dense_attn.set_backend("naive")
        assert dense_attn.BACKEND == "naive" and backends.current("cpu")["attn"] == "naive"
        sp.set_debug(True)
        assert sp.DEBUG is True
    finally:
        backends.reset_backends()
        sp.set_debug(False)
    assert isinstance(sp.BACKEND, str) and sp.logger is not None


def test_attention_keyword_call_forms():
    q, k, v = torch.randn(3, 1, 5, 2, 4).unbind(0)
    ref = dense_attn.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(dense_attn.scaled_dot_product_attention(q, k=k, v=v), ref)
    torch.testing.assert_close(dense_attn.scaled_dot_product_attention(q=q, kv=torch.stack([k, v], 2)), ref)
    with pytest.raises(TypeError):
        dense_attn.scaled_dot_product_attention(q, key=k, v=v)


def _sparse(n=40, res=8, channels=4, seed=0, batches=1):
    g = torch.Generator().manual_seed(seed)
    parts = []
    for b in range(batches):
        c = torch.unique(torch.randint(0, res, (n, 3), generator=g), dim=0)
        parts.append(torch.cat([torch.full((len(c), 1), b), c], 1))
    coords = torch.cat(parts).int()
    return sp.SparseTensor(coords.shape[0] and torch.randn(coords.shape[0], channels, generator=g), coords)


def test_sparse_tensor_helpers():
    x = sp.SparseTensor(torch.ones(2, 3), torch.tensor([[0, 0, 0, 0], [0, 1, 0, 0]], dtype=torch.int32))
    x.feats = torch.zeros(2, 3)
    assert not x.feats.any()
    full = sp.SparseTensor.full((0, 0, 0, 1, 2, 0), (2, 3), 7.0)
    assert full.coords.shape == (12, 4) and full.shape[0] == 2 and torch.all(full.feats == 7)
    assert full.coords[:6, 0].eq(0).all() and full.coords[1].tolist() == [0, 0, 1, 0]
    with pytest.raises(TypeError, match="features/.indices"):
        sp.SparseTensor(data=object())


def test_masked_sdpa_matches_per_sequence_attention():
    torch.manual_seed(0)
    lens = [3, 5]
    q, k, v = torch.randn(3, 1, 8, 2, 4).unbind(0)
    out = ms.masked_sdpa(q, k, v, lens, lens)
    ref = torch.cat([F.scaled_dot_product_attention(*(t[0, s:s + n].transpose(0, 1) for t in (q, k, v))
                                                    ).transpose(0, 1) for s, n in ((0, 3), (3, 5))])
    torch.testing.assert_close(out, ref)
    mask = ms.block_diag_attn_mask([1, 2], [2, 1])
    assert mask.tolist() == [[0, 0, -math.inf], [-math.inf, -math.inf, 0], [-math.inf, -math.inf, 0]]


def test_curve_codes():
    xyz = torch.tensor([[1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 1, 1]])
    assert backends.curves.z_order_encode(xyz, 1).tolist() == [4, 2, 1, 7]
    grid = torch.stack(torch.meshgrid(*[torch.arange(4)] * 3, indexing="ij"), -1).reshape(-1, 3)
    order = grid[torch.argsort(backends.curves.hilbert_encode(grid, 2))]
    assert sorted(backends.curves.hilbert_encode(grid, 2).tolist()) == list(range(64))  # a bijection
    assert ((order[1:] - order[:-1]).abs().sum(1) == 1).all()  # consecutive Hilbert cells are neighbours


@pytest.mark.parametrize("mode", sa.SerializeModes)
def test_serialized_attention_matches_dense_windows(mode):
    torch.manual_seed(0)
    x = _sparse(n=30, batches=2)
    qkv = x.replace(torch.randn(x.coords.shape[0], 3, 2, 4))
    out = sa.sparse_serialized_scaled_dot_product_self_attention(qkv, window_size=8, serialize_mode=mode,
                                                                 shift_sequence=2)
    fwd, bwd, seq_lens, seq_batch = sa.calc_serialization(qkv, 8, mode, 2)
    assert (seq_lens == 8).all() and set(seq_batch.tolist()) == {0, 1}
    gathered = qkv.feats[fwd].reshape(-1, 8, 3, 2, 4)
    q, k, v = gathered.unbind(2)
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    torch.testing.assert_close(out.feats, ref.reshape(-1, 2, 4)[bwd])
    assert out.feats.shape == (x.coords.shape[0], 2, 4)


def test_spconv_strided_conv_round_trip():
    pytest.importorskip("spconv.pytorch")
    from sam3d_objects.model.backbone.tdfy_dit.modules.sparse.conv import conv_spconv as cs
    x = _sparse(n=30, batches=2)
    down = cs.SparseConv3d(4, 6, 2, stride=2, indice_key="k")
    y = down(x)
    assert y.coords[:, 0].tolist() == sorted(y.coords[:, 0].tolist()) and y._scale == (2.0, 2.0, 2.0)
    assert set(map(tuple, y.coords[:, 1:].tolist())) == set(map(tuple, (x.coords[:, 1:] // 2).tolist()))
    up = cs.SparseInverseConv3d(6, 3, 2, stride=2, indice_key="k")
    z = up(y)
    assert z.coords.shape[0] == x.coords.shape[0] and z.feats.shape[1] == 3
    sub = cs.SparseConv3d(4, 5, 3)
    assert sub.conv.weight.shape == (5, 3, 3, 3, 4) and torch.equal(sub(x).coords, x.coords)


def test_module_utils():
    assert mu.FP16_TYPE is torch.float16 and sp.SparseLinear in mu.FP16_MODULES
    lin = nn.Linear(2, 2)
    w = lin.weight.detach().clone()
    mu.scale_module(lin, 3.0)
    torch.testing.assert_close(lin.weight.detach(), 3 * w)
    x, shift, scale = torch.randn(2, 3, 4), torch.randn(2, 4), torch.randn(2, 4)
    torch.testing.assert_close(mu.modulate(x, shift, scale), x * (1 + scale[:, None]) + shift[:, None])
    mu.convert_module_to_f16(lin)
    assert lin.weight.dtype == torch.float16
    assert isinstance(sp.SparseLinear(2, 3, device="cpu"), nn.Linear)
    assert sp.SparseGroupNorm32(2, 4).forward.__code__.co_varnames[1] == "x"
