"""The mesh decoder's streamed tail (last subdivision block, output layer and mesh extraction chunk by chunk, to
bound its peak memory on the CPU) against the whole-tensor path, and its parts: the blocked convolution in
row chunks, the in-place GroupNorm of voxel rows, the chunk-fed mesh extractor. Chunk sizes are forced small
here so that every boundary case (chunks inside a batch element, across two of them, of a few rows) runs."""
import pytest
import torch
import torch.nn.functional as F

import backends
from backends.registry import Family
from conftest import dense_conv3d_float64


def _children(parents: torch.Tensor) -> torch.Tensor:
    """Parent-major children in upstream's order (c = 4 cx + 2 cy + cz)."""
    offs = torch.tensor([[i >> 2 & 1, i >> 1 & 1, i & 1] for i in range(8)], dtype=torch.int32)
    xyz = (parents[:, None, 1:] * 2 + offs).reshape(-1, 3)
    return torch.cat([parents[:, :1].repeat_interleave(8, 0), xyz], 1)


@pytest.fixture
def blocks():
    g = torch.Generator().manual_seed(11)
    xyz = torch.unique(torch.randint(0, 7, (160, 3), generator=g), dim=0)
    parents = torch.cat([torch.zeros_like(xyz[:, :1]), xyz], 1).to(torch.int32)
    second = parents[:30].clone()
    second[:, 0] = 1
    parents = torch.cat([parents, second])  # two batch elements
    weight = torch.randn(6, 3, 3, 3, 5, generator=g)
    bias = torch.randn(6, generator=g)
    return parents, _children(parents), weight, bias


@pytest.mark.parametrize("subdivided", [True, False])
def test_blocked_conv_in_chunks_equals_the_whole_output(blocks, subdivided):
    """Chunks of any size (and ranges of any size inside them) give the whole output's rows bit for bit, and
    both match a float64 dense convolution."""
    from backends.sparse_conv import blocked_sparse_conv3d, blocked_sparse_conv3d_chunks

    parents, children, weight, bias = blocks
    rows = parents.shape[0] if subdivided else children.shape[0]
    feats = torch.randn(rows, 5, generator=torch.Generator().manual_seed(1))
    pmap = backends.neighbor_map(parents, 3)
    whole = blocked_sparse_conv3d(feats, pmap, weight, bias, subdivided=subdivided)
    child_rows = feats.repeat_interleave(8, 0) if subdivided else feats
    torch.testing.assert_close(whole.double(), dense_conv3d_float64(child_rows, children, weight, bias),
                               rtol=1e-4, atol=1e-4)
    for chunk_parents, chunk_bytes in ((1, 1 << 26), (7, 256), (40, 1 << 12), (10 ** 6, 1 << 26)):
        parts = list(blocked_sparse_conv3d_chunks(feats, pmap, weight, bias, subdivided=subdivided,
                                                  chunk_parents=chunk_parents, chunk_bytes=chunk_bytes))
        assert [p[0] for p in parts] == list(range(0, parents.shape[0], chunk_parents))[:len(parts)]
        assert parts[-1][1] == parents.shape[0]
        assert max(p[2].shape[0] for p in parts) <= 8 * chunk_parents
        # the same sums in the same order per row; only the GEMMs' row counts differ (which MKL does not round
        # differently, other BLAS may: float rounding)
        torch.testing.assert_close(torch.cat([p[2] for p in parts]), whole, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(blocked_sparse_conv3d(feats, pmap, weight, bias, subdivided=subdivided,
                                                         chunk_bytes=chunk_bytes), whole, rtol=1e-5, atol=1e-5)
    # float64: chunked and whole agree with the dense reference to float64 rounding
    f64 = [t.double() for t in (feats, weight, bias)]
    parts = blocked_sparse_conv3d_chunks(f64[0], pmap, f64[1], f64[2], subdivided=subdivided, chunk_parents=5)
    torch.testing.assert_close(torch.cat([p[2] for p in parts]),
                               dense_conv3d_float64(child_rows, children, weight, bias), rtol=1e-12, atol=1e-12)


def test_sparse_conv3d_chunks_dispatch(blocks):
    """The portable backend streams child blocks in chunks of the requested rows; a backend with its own kernels
    (or a request without parent_map) yields the whole output once."""
    parents, children, weight, bias = blocks
    feats = torch.randn(children.shape[0], 5, generator=torch.Generator().manual_seed(2))
    pmap = backends.neighbor_map(parents, 3)
    with backends.use(sparse="torch"):
        whole = backends.sparse_conv3d(feats, children, weight, bias, parent_map=pmap)
        parts = list(backends.sparse_conv3d_chunks(feats, children, weight, bias, parent_map=pmap, chunk_rows=64))
        assert len(parts) == -(-children.shape[0] // 64)
        assert all(rows.stop - rows.start == out.shape[0] <= 64 for rows, out in parts)
        torch.testing.assert_close(torch.cat([out for _, out in parts]), whole, rtol=1e-5, atol=1e-5)
        plain = list(backends.sparse_conv3d_chunks(feats, children, weight, bias, chunk_rows=64))
        assert len(plain) == 1 and plain[0][0] == slice(0, children.shape[0])
        torch.testing.assert_close(plain[0][1], whole, rtol=1e-5, atol=1e-5)
    # off the CPU the default is one chunk: the device's own path, unchanged
    assert backends.sparse_conv.stream_rows(torch.device("cpu")) is not None
    assert backends.sparse_conv.stream_rows(torch.device("cuda")) is None


def test_sparse_conv3d_chunks_with_a_backend_of_its_own_is_one_chunk(blocks, monkeypatch):
    from backends import registry
    import backends.sparse_conv as sc

    parents, children, weight, bias = blocks
    feats = torch.randn(children.shape[0], 5, generator=torch.Generator().manual_seed(3))
    spec = backends.registered(Family.SPARSE_CONV)["metal"]
    monkeypatch.setattr(registry, "_RESOLVED", {})
    monkeypatch.setitem(spec.extra, "lean", False)
    monkeypatch.setattr(spec, "devices", ("cpu",))
    monkeypatch.setattr(spec, "probe", None)
    monkeypatch.setattr(spec, "requires", ())
    monkeypatch.setattr(spec, "fn", lambda f, c, w, b, m: sc.torch_sparse_conv3d(f, c, w, b))
    with backends.use(sparse="metal"):
        parts = list(backends.sparse_conv3d_chunks(feats, children, weight, bias, chunk_rows=16,
                                                   parent_map=lambda: pytest.fail("parent map requested")))
    assert len(parts) == 1
    torch.testing.assert_close(parts[0][1].double(), dense_conv3d_float64(feats, children, weight, bias),
                               rtol=1e-4, atol=1e-4)


def test_group_norm_rows_in_place_equals_group_norm():
    """The in-place GroupNorm of voxel rows: the new-tensor path's values bit for bit, written over the rows on
    the CPU, and a float64 F.group_norm within float rounding."""
    g = torch.Generator().manual_seed(4)
    rows = torch.randn(3000, 64, generator=g) * 3 + 1
    weight, bias = torch.randn(64, generator=g), torch.randn(64, generator=g)
    want = backends.group_norm(rows.t()[None], 16, weight, bias, 1e-5)[0].t()
    ref = F.group_norm(rows.double().t()[None], 16, weight.double(), bias.double(), 1e-5)[0].t()
    original = rows.clone()
    got = backends.group_norm_rows_(rows, 16, weight, bias, 1e-5)
    assert got.data_ptr() == rows.data_ptr()
    assert torch.equal(got, want)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    # another backend (the reference norm) computes its own arithmetic, in a new tensor
    with backends.use(norm="reference"):
        other = backends.group_norm_rows_(original, 16, weight, bias, 1e-5)
    assert other.data_ptr() != original.data_ptr()
    torch.testing.assert_close(other.double(), ref, rtol=1e-5, atol=1e-5)


def test_sparse_group_norm_normalize_in_place_per_batch_element():
    from sam3d_objects.model.backbone.tdfy_dit.modules.sparse import SparseGroupNorm32, SparseTensor

    g = torch.Generator().manual_seed(6)
    coords = torch.cat([torch.zeros(50, 1, dtype=torch.int32), torch.randperm(1000, generator=g)[:50, None].int()
                        .repeat(1, 3)], 1)
    coords[30:, 0] = 1
    norm = SparseGroupNorm32(8, 32)
    with torch.no_grad():
        norm.weight.normal_(generator=g)
        norm.bias.normal_(generator=g)
    x = SparseTensor(feats=torch.randn(50, 32, generator=g), coords=coords)
    want = norm(x).feats
    with torch.no_grad():
        rows = x.feats.clone()
        got = norm.normalize_(x.replace(rows))
    assert got.feats.data_ptr() == rows.data_ptr()  # in place
    assert torch.equal(got.feats, want)
    # under autograd (parameters that require grad) the forward's new tensor: the backward needs the input
    got = norm.normalize_(x.replace(x.feats.clone()))
    assert got.feats.requires_grad and torch.equal(got.feats, want)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_half_rows_normalised_in_place_in_float32(half):
    """Half rows (a bfloat16 decoder torso) are normalised in place with float32 statistics and arithmetic, chunk
    by chunk: SparseGroupNorm32's float32-copy values within one rounding of the half type, and a float64
    reference within the half type's precision; no float32 copy of the rows is returned."""
    from sam3d_objects.model.backbone.tdfy_dit.modules.sparse import SparseGroupNorm32, SparseTensor

    g = torch.Generator().manual_seed(8)
    rows = (torch.randn(20000, 64, generator=g) * 3 + 40).to(half)  # a large mean: half sums would lose it
    coords = torch.cat([torch.zeros(20000, 1, dtype=torch.int32), torch.arange(20000)[:, None].int().repeat(1, 3)],
                       1)
    norm = SparseGroupNorm32(16, 64)
    with torch.no_grad():
        norm.weight.normal_(generator=g)
        norm.bias.normal_(generator=g)
        x = SparseTensor(feats=rows, coords=coords)
        want = norm(x).feats  # the forward: a float32 copy, normalised, rounded to the half type
        ref = F.group_norm(rows.double().t()[None], 16, norm.weight.double(), norm.bias.double(), 1e-5)[0].t()
        given = rows.clone()
        got = norm.normalize_(x.replace(given)).feats
    assert got.dtype == half and got.data_ptr() == given.data_ptr()  # in place
    ulp = torch.finfo(half).eps * want.double().abs().clamp_min(1)
    assert ((got.double() - want.double()).abs() <= ulp).all()
    err = (got.double() - ref).abs().max() / ref.abs().max()
    assert err < 2 * torch.finfo(half).eps, err


@pytest.mark.parametrize("layout", ["rows", "column view"])
def test_half_rows_with_float32_parameters_on_every_device(device, layout):
    """A half decoder torso's GroupNorm32 (float16 rows, float32 parameters) through ``normalize_`` on the device
    under test, in place or on the new-tensor path (a column view is not voxel-major; CUDA's group_norm refuses
    half values with float32 parameters in one call): the forward's values within one rounding, in the rows'
    type."""
    from sam3d_objects.model.backbone.tdfy_dit.modules.sparse import SparseGroupNorm32, SparseTensor

    g = torch.Generator().manual_seed(9)
    wide = (torch.randn(3000, 128, generator=g) * 3 + 5).half().to(device)
    rows = wide if layout == "rows" else wide[:, :64]
    channels = rows.shape[1]
    coords = torch.cat([torch.zeros(3000, 1, dtype=torch.int32), torch.arange(3000)[:, None].int().repeat(1, 3)],
                       1).to(device)
    norm = SparseGroupNorm32(16, channels).to(device)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(channels, generator=g))
        norm.bias.copy_(torch.randn(channels, generator=g))
        want = norm(SparseTensor(feats=rows.contiguous(), coords=coords)).feats
        got = norm.normalize_(SparseTensor(feats=rows, coords=coords)).feats
    assert got.dtype == torch.float16 and got.device.type == device.type
    ulp = torch.finfo(torch.float16).eps * want.double().abs().clamp_min(1)
    assert ((got.double() - want.double()).abs() <= ulp).all()


def _fine_features(seed: int, batch: int = 2):
    """Twice-subdivided shells with decoder-like 101-channel features (SDF around 0)."""
    from benchmarks.shapes import shell_coords

    parts = []
    for b in range(batch):
        c = shell_coords(120 + 80 * b, 8, seed=seed + b, thickness=0.9, exact=False)
        c[:, 0] = b
        parts.append(c)
    coords = _children(_children(torch.cat(parts)))
    feats = torch.randn(coords.shape[0], 101, generator=torch.Generator().manual_seed(seed))
    feats[:, :8] *= 0.05
    return coords, feats


def test_mesh_extractor_fed_in_chunks_equals_the_whole_call():
    from sam3d_objects.model.backbone.tdfy_dit.modules.sparse import SparseTensor
    from sam3d_objects.model.backbone.tdfy_dit.representations.mesh import SparseFeatures2Mesh

    coords, feats = _fine_features(0, batch=1)
    extractor = SparseFeatures2Mesh(res=32, use_color=True)
    want = extractor(SparseTensor(feats=feats, coords=coords))
    assert want.faces.shape[0] > 100
    for size in (1, 333, 4096):
        stream = extractor.stream(coords[:, 1:])
        for start in range(0, feats.shape[0], size):
            stream.add(feats[start:start + size])
        got = stream.finish()
        assert torch.equal(got.vertices, want.vertices) and torch.equal(got.faces, want.faces)
        assert torch.equal(got.vertex_attrs, want.vertex_attrs)
    stream = extractor.stream(coords[:, 1:])
    stream.add(feats[:10])
    with pytest.raises(ValueError, match="rows were added"):
        stream.finish()
    with pytest.raises(ValueError, match="channels"):
        stream.add(feats[:10, :50])


def _decoder(seed: int = 0):
    from benchmarks.bench_mesh_decoder import randomize_
    from sam3d_objects.model.backbone.tdfy_dit.models.structured_latent_vae.decoder_mesh import SLatMeshDecoder

    model = SLatMeshDecoder(resolution=8, model_channels=256, latent_channels=8, num_blocks=1, num_heads=4,
                            window_size=4, representation_config={"use_color": True})
    randomize_(model, seed)
    return model.eval()


def test_streamed_decoder_tail_gives_the_whole_paths_meshes(monkeypatch):
    """Streamed in chunks of a few rows (inside and across batch elements) or in one: the same meshes, bit for
    bit, as the whole-tensor path; the output layer never sees more than a chunk."""
    from benchmarks.shapes import shell_coords
    from sam3d_objects.model.backbone.tdfy_dit.modules.sparse import SparseTensor

    model = _decoder()
    a = shell_coords(60, 8, seed=1, thickness=0.9, exact=False)
    b = shell_coords(90, 8, seed=2, thickness=0.9, exact=False)
    b[:, 0] = 1
    coords = torch.cat([a, b])
    x = SparseTensor(feats=torch.randn(coords.shape[0], 8, generator=torch.Generator().manual_seed(3)),
                     coords=coords)
    seen = []
    model.out_layer.register_forward_hook(lambda m, i, o: seen.append(o.feats.shape[0]))
    with torch.no_grad():
        monkeypatch.setattr(model, "stream_tail", False)
        want = model(x)
        assert seen == [64 * coords.shape[0]]
        monkeypatch.setattr(model, "stream_tail", True)
        for rows in (8, 1000, None):  # None: the CPU's default
            seen.clear()
            monkeypatch.setattr(model, "stream_rows", rows)
            got = model(x)
            assert sum(seen) == 64 * coords.shape[0]
            assert max(seen) <= (rows or backends.sparse_conv.stream_rows(torch.device("cpu")))
            if rows is None:  # an output of at most one chunk takes the whole path (module hooks as always)
                assert seen == [64 * coords.shape[0]]
            else:
                assert len(seen) > 1
            assert len(got) == len(want) == 2
            for w, g in zip(want, got):
                # the same mesh: the same faces, vertices within float rounding (bit-identical with MKL, which
                # rounds a GEMM row independently of the row count; see blocked_sparse_conv3d_chunks)
                assert w.faces.shape[0] > 0
                assert torch.equal(g.faces, w.faces)
                torch.testing.assert_close(g.vertices, w.vertices, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(g.vertex_attrs, w.vertex_attrs, rtol=1e-5, atol=1e-5)
    # a device whose default is the whole output (off the CPU) keeps the whole path
    seen.clear()
    monkeypatch.setattr(model, "stream_rows", None)
    monkeypatch.setattr(backends, "stream_rows", lambda device: None)
    with torch.no_grad():
        model(x)
    assert seen == [64 * coords.shape[0]]
    monkeypatch.undo()
    # with autograd on, the whole path runs (a backward needs every activation)
    seen.clear()
    monkeypatch.setattr(model, "stream_rows", 8)
    model.requires_grad_(False)
    with torch.enable_grad():
        model(x)
    assert seen == [64 * coords.shape[0]]
