"""Sparse building blocks against independent dense / float64 references."""
import math

import pytest
import torch
import torch.nn.functional as F

import backends
from sam3d_objects.model.backbone.tdfy_dit.modules import sparse as sp
from sam3d_objects.model.backbone.tdfy_dit.modules.sparse.attention import calc_window_partition
from conftest import assert_close_to_reference



def two_batch_coords(n0=60, n1=45, res=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    parts = []
    for b, n in enumerate((n0, n1)):
        xyz = torch.unique(torch.randint(0, res, (n, 3), generator=g), dim=0)
        parts.append(torch.cat([torch.full((xyz.shape[0], 1), b), xyz], 1))
    return torch.cat(parts).int()


def rand_tensor(channels, seed=0, **kw):
    coords = two_batch_coords(seed=seed, **kw)
    feats = torch.randn(coords.shape[0], channels, generator=torch.Generator().manual_seed(seed + 1))
    return sp.SparseTensor(feats=feats, coords=coords)


def on(x: sp.SparseTensor, device) -> sp.SparseTensor:
    """The same sparse tensor with feats and coords on ``device``."""
    return sp.SparseTensor(feats=x.feats.to(device), coords=x.coords.to(device))


# ------------------------------------------------------------------------------------------------ SparseTensor
def test_sparse_tensor_layout_and_errors():
    x = rand_tensor(4)
    assert x.shape == (2, 4)
    assert x.layout[0].start == 0 and x.layout[1].stop == x.coords.shape[0]
    with pytest.raises(ValueError, match="contiguous"):
        sp.SparseTensor(feats=x.feats, coords=x.coords.flip(0))
    with pytest.raises(ValueError, match="one feature row per voxel"):
        sp.SparseTensor(feats=x.feats[:-1], coords=x.coords)
    with pytest.raises(TypeError, match="integer"):
        sp.SparseTensor(feats=x.feats, coords=x.coords.float())
    with pytest.raises(ValueError, match=r"\[N, 4\]"):
        sp.SparseTensor(feats=x.feats, coords=x.coords[:, :3])
    empty = sp.SparseTensor(feats=torch.zeros(0, 4), coords=torch.zeros(0, 4, dtype=torch.int32))
    assert empty.shape[0] == 0 and empty.coords.shape == (0, 4)


def test_batch_broadcast_and_indexing():
    x = rand_tensor(3)
    per_batch = torch.tensor([[1.0, 2.0, 3.0], [10.0, 20.0, 30.0]])
    y = x * per_batch
    b = x.coords[:, 0].long()
    assert torch.equal(y.feats, x.feats * per_batch[b])
    second = x[1]
    assert torch.equal(second.feats, x.feats[x.layout[1]])
    assert bool((second.coords[:, 0] == 0).all())


# --------------------------------------------------------------------------------------- down / up / subdivide
def test_downsample_matches_python_reference_and_upsample_inverts(device):
    x = rand_tensor(5)
    down = sp.SparseDownsample(2)(on(x, device))
    assert down.feats.device.type == device.type
    up = sp.SparseUpsample(2)(down)
    down, up = sp.SparseTensor(feats=down.feats.cpu(), coords=down.coords.cpu()), (up.coords.cpu(), up.feats.cpu())
    groups = {}
    for c, f in zip(x.coords.tolist(), x.feats.double()):
        key = (c[0], c[1] // 2, c[2] // 2, c[3] // 2)
        groups.setdefault(key, []).append(f)
    keys = sorted(groups)  # lexicographic (b, x, y, z) = upstream's linear-code order
    assert down.coords.tolist() == [list(k) for k in keys]
    expected = torch.stack([torch.stack(groups[k]).sum(0) / (len(groups[k]) + 1) for k in keys])  # sum/(n+1)
    assert_close_to_reference(down.feats, expected)
    assert torch.equal(up[0], x.coords)
    parent = {tuple(c): i for i, c in enumerate(down.coords.tolist())}
    rows = [parent[(c[0], c[1] // 2, c[2] // 2, c[3] // 2)] for c in x.coords.tolist()]
    assert torch.equal(up[1], down.feats[rows])


def test_upsample_without_cache_is_a_clear_error():
    with pytest.raises(ValueError, match="SparseDownsample"):
        sp.SparseUpsample(2)(rand_tensor(2))


def test_subdivide_order(device):
    x = rand_tensor(2)
    sub = sp.SparseSubdivide()(on(x, device))
    assert sub.feats.device.type == device.type
    sub = sp.SparseTensor(feats=sub.feats.cpu(), coords=sub.coords.cpu())
    children = [(i, j, k) for i in (0, 1) for j in (0, 1) for k in (0, 1)]
    expected = [[c[0], 2 * c[1] + i, 2 * c[2] + j, 2 * c[3] + k] for c in x.coords.tolist() for i, j, k in children]
    assert sub.coords.tolist() == expected
    assert torch.equal(sub.feats, x.feats.repeat_interleave(8, dim=0))


# ------------------------------------------------------------------------------------------------------- conv
def dense_submanifold_reference(x: sp.SparseTensor, weight, bias):
    """conv3d on a dense float64 grid (padding 1), read at the input voxels."""
    c = x.coords.long()
    size = int(c[:, 1:].max()) + 1
    grid = torch.zeros(x.shape[0], x.feats.shape[1], size, size, size, dtype=torch.float64)
    grid[c[:, 0], :, c[:, 1], c[:, 2], c[:, 3]] = x.feats.double()
    w = weight.double().permute(0, 4, 1, 2, 3)  # spconv [out, kx, ky, kz, in] -> conv3d [out, in, kx, ky, kz]
    out = F.conv3d(grid, w, bias.double(), padding=weight.shape[1] // 2)
    return out[c[:, 0], :, c[:, 1], c[:, 2], c[:, 3]]


@pytest.mark.parametrize("backend", ["torch", "spconv"])
def test_conv3_matches_dense_conv(backend):
    if backend == "spconv":
        torch.set_num_threads(1)  # its only correct CPU mode; conftest restores the thread count
    spec = backends.registered(backends.Family.SPARSE_CONV).get(backend)
    reason = "not registered" if spec is None else spec.why_not(torch.device("cpu"), torch.float32)
    if reason:
        pytest.skip(f"{backend}: {reason}")
    conv = sp.SparseConv3d(6, 5, 3)
    x = rand_tensor(6)
    with backends.use(sparse=backend):
        out = conv(x)
    assert torch.equal(out.coords, x.coords)
    torch.testing.assert_close(out.feats.double(), dense_submanifold_reference(x, conv.conv.weight, conv.conv.bias),
                               rtol=1e-5, atol=1e-5)


def test_conv1_reads_weight_buffer_as_in_by_out():
    conv = sp.SparseConv3d(6, 5, 1)
    x = rand_tensor(6)
    w = conv.conv.weight.detach().reshape(-1)  # spconv's 1^3 matmul: the [5,1,1,1,6] buffer read as [6, 5]
    expected = x.feats.double() @ w.double().reshape(6, 5) + conv.conv.bias.double()
    torch.testing.assert_close(conv(x).feats.double(), expected, rtol=1e-6, atol=1e-6)


def test_conv_feature_width_mismatch():
    with pytest.raises(ValueError, match="expects feats"):
        sp.SparseConv3d(6, 5, 3)(rand_tensor(4))


# ------------------------------------------------------------------------------------------------------- norms
def test_group_norm_per_batch_element(device):
    x = rand_tensor(8)
    norm = sp.SparseGroupNorm32(4, 8)
    torch.nn.init.normal_(norm.weight)
    out = norm.to(device)(on(x, device)).feats.cpu()
    norm.cpu()
    for rows in x.layout:
        ref = F.group_norm(x.feats[rows].double().t()[None], 4, norm.weight.double(), norm.bias.double(), norm.eps)
        assert_close_to_reference(out[rows], ref[0].t(), dtype=torch.float32)


# --------------------------------------------------------------------------------------------------- attention
def softmax_attention(q, k, v):
    w = torch.softmax(q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
    return w @ v.double()


@pytest.mark.parametrize("attn", ["sdpa", "naive"])
def test_full_self_attention_per_batch(attn, device):
    x = rand_tensor(16)
    layer = sp.SparseMultiHeadAttention(16, num_heads=2, attn_mode="full", qk_rms_norm=True)
    with backends.use(attn=attn, sparse_attn=attn):
        out = layer.to(device)(on(x, device))
    layer.cpu()
    assert out.feats.device.type == device.type
    out = sp.SparseTensor(feats=out.feats.cpu(), coords=out.coords.cpu())
    qkv = layer.to_qkv(x.feats).reshape(-1, 3, 2, 8)
    q, k, v = qkv.unbind(1)
    q, k = layer.q_rms_norm(q), layer.k_rms_norm(k)
    ref = torch.zeros(x.feats.shape[0], 2, 8, dtype=torch.float64)
    for rows in x.layout:
        ref[rows] = softmax_attention(q[rows].transpose(0, 1), k[rows].transpose(0, 1),
                                      v[rows].transpose(0, 1)).transpose(0, 1)
    expected = layer.to_out.double()(ref.reshape(-1, 16))
    layer.to_out.float()
    assert_close_to_reference(out.feats, expected, dtype=torch.float32)


def test_cross_attention_to_own_context():
    x = rand_tensor(16)
    ctx = torch.randn(2, 5, 12)
    layer = sp.SparseMultiHeadAttention(16, num_heads=2, ctx_channels=12, type="cross")
    out = layer(x, ctx)
    for b, rows in enumerate(x.layout):
        single = layer(sp.SparseTensor(feats=x.feats[rows], coords=x.coords[rows] * torch.tensor([0, 1, 1, 1],
                                                                                                  dtype=torch.int32)),
                       ctx[b:b + 1])
        torch.testing.assert_close(out.feats[rows], single.feats, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="ctx_channels"):
        layer(x, torch.randn(2, 5, 7))


@pytest.mark.parametrize("shift", [0, 2])
def test_window_partition_brute_force(shift):
    x = rand_tensor(4, res=11)
    fwd, bwd, lens, batch_ids = calc_window_partition(x, window_size=4, shift_window=shift)
    c = x.coords.long()
    shifted = c[:, 1:] + shift
    nw = [math.ceil((m + 1) / 4) for m in shifted.max(0).values.tolist()]
    windows = {}
    for i, (b, wx, wy, wz) in enumerate(zip(c[:, 0].tolist(), *(shifted // 4).t().tolist())):
        windows.setdefault(((b * nw[0] + wx) * nw[1] + wy) * nw[2] + wz, []).append(i)
    order = sorted(windows)
    assert lens.tolist() == [len(windows[k]) for k in order]
    assert batch_ids.tolist() == [k // (nw[0] * nw[1] * nw[2]) for k in order]
    assert [sorted(w.tolist()) for w in torch.split(fwd, lens.tolist())] == [windows[k] for k in order]
    assert torch.equal(fwd[bwd], torch.arange(fwd.numel()))


def test_window_order_is_upstreams_on_cpu(golden_dir):
    """Inside a window the order is mathematically free, but it is the order in which attention sums: upstream's
    unstable sort gives the recorded order, and so must ours (CPU), for the same rounding."""
    from safetensors.torch import load_file

    inputs = load_file(str(golden_dir / "sparse_ops" / "inputs.safetensors"))
    outputs = load_file(str(golden_dir / "sparse_ops" / "outputs.safetensors"))
    x = sp.SparseTensor(feats=inputs["feats64"], coords=inputs["coords"])
    for shift in (0, 2):
        fwd, *_ = calc_window_partition(x, window_size=4, shift_window=shift)
        assert torch.equal(fwd, outputs[f"window_partition_shift{shift}.fwd_indices"])


def test_windowed_attention_brute_force(device):
    x = rand_tensor(16, res=11)
    layer = sp.SparseMultiHeadAttention(16, num_heads=2, attn_mode="windowed", window_size=4, shift_window=2)
    out = layer.to(device)(on(x, device))
    layer.cpu()
    assert out.feats.device.type == device.type
    out = sp.SparseTensor(feats=out.feats.cpu(), coords=out.coords.cpu())
    fwd, _, lens, _ = calc_window_partition(x, 4, 2)
    q, k, v = layer.to_qkv(x.feats).reshape(-1, 3, 2, 8).unbind(1)
    ref = torch.zeros(x.feats.shape[0], 2, 8, dtype=torch.float64)
    for rows in torch.split(fwd, lens.tolist()):
        ref[rows] = softmax_attention(q[rows].transpose(0, 1), k[rows].transpose(0, 1),
                                      v[rows].transpose(0, 1)).transpose(0, 1)
    expected = ref.reshape(-1, 16) @ layer.to_out.weight.double().t() + layer.to_out.bias.double()
    assert_close_to_reference(out.feats, expected, dtype=torch.float32)


def test_mismatched_feature_widths_are_clear_errors():
    x = rand_tensor(4)
    with pytest.raises(ValueError, match="feature widths must match"):
        x + sp.SparseTensor(feats=torch.zeros(x.feats.shape[0], 3), coords=x.coords)
    with pytest.raises(ValueError, match="feature widths must match"):
        x * torch.ones(2, 5)
    with pytest.raises(ValueError, match="expects 4 channels"):
        sp.SparseGroupNorm(2, 4)(rand_tensor(6))
    with pytest.raises(ValueError, match="expects 8 channels"):
        sp.SparseMultiHeadAttention(8, num_heads=2)(x)


# --------------------------------------------------------------------------------- coordinate data ownership
def test_sparse_tensor_owns_its_neighbour_maps():
    """Layers at the same coordinates share one map; subdivided / downsampled tensors get their own."""
    from sam3d_objects.model.backbone.tdfy_dit.modules import sparse as sp

    coords = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 2], [0, 2, 1, 1], [1, 0, 0, 0], [1, 0, 1, 0]], dtype=torch.int32)
    x = sp.SparseTensor(feats=torch.randn(5, 4), coords=coords)
    conv_a, conv_b = sp.SparseConv3d(4, 4, 3), sp.SparseConv3d(4, 4, 3)
    y = conv_b(conv_a(x))
    nmap = x.neighbor_map(3)
    assert y.neighbor_map(3) is nmap and (x + 1).neighbor_map(3) is nmap
    assert x.neighbor_map(5) is not nmap and x.neighbor_map(5).kernel_size == 5
    assert x.coord_hash() is y.coord_hash()
    fine = sp.SparseSubdivide()(x)
    coarse = sp.SparseDownsample(2)(x)
    for other in (fine, coarse, x.replace(x.feats, coords=coords.clone()), x.to(torch.float64).clone()):
        own = other.neighbor_map(3)
        assert own is not nmap and own.num_voxels == other.coords.shape[0]
        assert torch.equal(own.table, backends.neighbor_map(other.coords, 3).table)
    assert sp.SparseUpsample(2)(coarse).neighbor_map(3) is nmap  # back at x's coordinates: x's map
