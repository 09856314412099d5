"""Submanifold sparse conv against independent references: a float64 dense conv3d, the golden spconv outputs
of ../shared/golden/sparse_ops, and (when installed) the spconv package itself, single-threaded."""
import pytest
import torch

import backends
from conftest import dense_conv3d_float64 as dense_reference, random_coords


def batch_of_three():
    # Different sizes per batch element; dense enough at a small resolution that every border voxel is hit.
    parts = [random_coords(n, r, batch=b, seed=b) for b, (n, r) in enumerate([(300, 7), (40, 5), (120, 9)])]
    return torch.cat(parts)


@pytest.mark.parametrize("k", [3, 5])
def test_matches_dense_conv3d_float64(k):
    coords = batch_of_three()
    g = torch.Generator().manual_seed(k)
    feats = torch.randn(coords.shape[0], 6, generator=g, dtype=torch.float64)
    weight = torch.randn(5, k, k, k, 6, generator=g, dtype=torch.float64)
    bias = torch.randn(5, generator=g, dtype=torch.float64)
    out = backends.sparse_conv3d(feats, coords, weight, bias)
    torch.testing.assert_close(out, dense_reference(feats, coords, weight, bias), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("pairs_kept", [True, False])
def test_cpu_output_blocks_match_dense_conv3d_float64(monkeypatch, pairs_kept):
    # The portable backend's CPU path in many small output blocks (64 rows), with the map's pair lists kept or
    # (a map past the pair-cache size) built span by span; gradients flow through it when asked for.
    from backends.hashing import NeighborMap
    from backends.sparse_conv import portable

    monkeypatch.setattr(portable, "CPU_BLOCK_BYTES_PER_THREAD", 1)
    monkeypatch.setattr(portable, "PAIR_SPAN_ROWS", 128)
    if not pairs_kept:
        monkeypatch.setattr(NeighborMap, "PAIR_CACHE_MAX_VOXELS", 100)
    coords = batch_of_three()
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(coords.shape[0], 6, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, 3, 3, 3, 6, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(5, generator=g, dtype=torch.float64)
    with backends.use(sparse="torch"):
        out = backends.sparse_conv3d(feats, coords, weight, bias, backends.neighbor_map(coords, 3))
    want = dense_reference(feats, coords, weight, bias)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    got_grads = torch.autograd.grad(out.square().sum(), (feats, weight))
    want_grads = torch.autograd.grad(want.square().sum(), (feats, weight))
    for got, expected in zip(got_grads, want_grads):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_kernel_size_one_reads_the_weight_buffer_as_cin_by_cout():
    # spconv's 1x1 path (and so every upstream checkpoint) treats [Cout,1,1,1,Cin] memory as [Cin, Cout].
    coords = batch_of_three()
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(coords.shape[0], 6, generator=g, dtype=torch.float64)
    weight = torch.randn(5, 1, 1, 1, 6, generator=g, dtype=torch.float64)
    bias = torch.randn(5, generator=g, dtype=torch.float64)
    out = backends.sparse_conv3d(feats, coords, weight, bias)
    torch.testing.assert_close(out, feats @ weight.flatten().reshape(6, 5) + bias, rtol=1e-12, atol=1e-12)


def test_grid_borders_and_batches_do_not_leak(device):
    # A full 4^3 block in two batch elements: neighbours across the batch boundary or the grid border must not
    # contribute. With all-ones inputs and weights, each output counts its in-grid neighbours.
    axis = torch.arange(4)
    xyz = torch.stack(torch.meshgrid(axis, axis, axis, indexing="ij"), -1).reshape(-1, 3)
    coords = torch.cat([torch.cat([torch.full((64, 1), b), xyz], 1) for b in range(2)]).int()
    out = backends.sparse_conv3d(torch.ones(128, 1, device=device), coords.to(device),
                                 torch.ones(1, 3, 3, 3, 1, device=device)).cpu()
    per_axis = torch.tensor([2.0, 3.0, 3.0, 2.0])
    expected = per_axis[coords[:, 1].long()] * per_axis[coords[:, 2].long()] * per_axis[coords[:, 3].long()]
    torch.testing.assert_close(out[:, 0], expected)


def test_single_voxel_sees_only_the_centre_tap():
    coords = torch.tensor([[0, 5, 5, 5]], dtype=torch.int32)
    feats = torch.randn(1, 4)
    weight = torch.randn(3, 3, 3, 3, 4)
    out = backends.sparse_conv3d(feats, coords, weight)
    torch.testing.assert_close(out, feats @ weight[:, 1, 1, 1, :].T)


def test_empty_input_gives_empty_output():
    out = backends.sparse_conv3d(torch.zeros(0, 4), torch.zeros(0, 4, dtype=torch.int32), torch.randn(3, 3, 3, 3, 4))
    assert out.shape == (0, 3)


def sixteen_to_eight_case(seed: int):
    """A 16 -> 8 channel kernel-3 conv on the three-batch coords (unit-scale outputs) and its float64 reference."""
    coords = batch_of_three()
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(coords.shape[0], 16, generator=g)
    weight = torch.randn(8, 3, 3, 3, 16, generator=g) / (27 * 16) ** 0.5
    bias = torch.randn(8, generator=g)
    return coords, feats, weight, bias, dense_reference(feats, coords, weight, bias)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_low_precision_dtypes(dtype, tol, device):
    """The device's automatic sparse-conv backend in each dtype against the float64 dense reference."""
    coords, feats, weight, bias, ref = sixteen_to_eight_case(seed=3)
    out = backends.sparse_conv3d(feats.to(device, dtype), coords.to(device), weight.to(device, dtype),
                                 bias.to(device, dtype))
    assert out.dtype == dtype and out.device.type == device.type
    err = (out.cpu().double() - ref).abs().max() / ref.abs().max()
    assert err < tol, f"relative error {err:.2e} for {dtype}"


@pytest.mark.parametrize("small_blocks", [False, True])
def test_autocast_convolves_float32_inputs_in_its_dtype(monkeypatch, device, small_blocks):
    """Under autocast a float32 input is convolved in autocast's dtype and comes back in it, as torch's own
    convolutions do; outside autocast nothing changes. With small CPU output blocks the half products are widened
    into the float32 sum through a kept buffer: still the float64 reference within half precision."""
    from backends.sparse_conv import portable

    if small_blocks:
        monkeypatch.setattr(portable, "CPU_BLOCK_BYTES_PER_THREAD", 1)
    half = torch.bfloat16 if device.type == "cpu" else torch.float16
    coords, feats, weight, bias, ref = sixteen_to_eight_case(seed=5)
    args = feats.to(device), coords.to(device), weight.to(device), bias.to(device)
    with torch.autocast(device.type, dtype=half):
        out = backends.sparse_conv3d(*args)
    assert out.dtype == half
    err = (out.cpu().double() - ref).abs().max() / ref.abs().max()
    assert 1e-5 < err < 2e-2, f"relative error {err:.2e}: not computed in {half}, or wrong"
    plain = backends.sparse_conv3d(*args)
    assert plain.dtype == torch.float32
    assert (plain.cpu().double() - ref).abs().max() / ref.abs().max() < 1e-5


@pytest.mark.parametrize("bias", [True, False])
def test_cpu_half_convolution_is_one_gemm_over_all_taps(monkeypatch, bias):
    """bf16 on the CPU without gradients: one GEMM per block of rows over every tap (missing neighbours as zero
    rows), in blocks that do not divide the rows; within bf16 precision of the float64 reference, as the
    per-offset products it replaces are. float32, inputs that need gradients and inputs wider than
    ``IM2COL_MAX_CHANNELS`` keep the pairs."""
    from backends.sparse_conv import portable

    calls = []
    real = portable.im2col_sparse_conv3d
    monkeypatch.setattr(portable, "im2col_sparse_conv3d", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(portable, "IM2COL_BLOCK_ROWS", 7)
    coords, feats, weight, b, ref = sixteen_to_eight_case(seed=9)
    b = b if bias else None
    if not bias:
        ref = dense_reference(feats, coords, weight, None)
    args = coords, weight.bfloat16(), None if b is None else b.bfloat16()
    with backends.use(sparse="torch"):
        out = backends.sparse_conv3d(feats.bfloat16(), *args)
        assert len(calls) == 1 and out.dtype == torch.bfloat16
        x = feats.bfloat16().requires_grad_()
        pairs = backends.sparse_conv3d(x, *args)  # gradients wanted: the pairs path
        assert len(calls) == 1
        pairs.float().square().sum().backward()
        assert x.grad is not None and x.grad.abs().sum() > 0
        backends.sparse_conv3d(feats, coords, weight, b)  # float32: the pairs path
        assert len(calls) == 1
        monkeypatch.setattr(portable, "IM2COL_MAX_CHANNELS", feats.shape[1] - 1)
        wide = backends.sparse_conv3d(feats.bfloat16(), *args)  # wider than the one-GEMM path takes: the pairs
        assert len(calls) == 1 and wide.dtype == torch.bfloat16
    scale = ref.abs().max()
    for got in (out, pairs.detach(), wide):
        err = (got.double() - ref).abs().max() / scale
        assert err < 1e-2, f"relative error {err:.2e}"


def test_neighbor_map_is_reusable_and_not_cached_globally():
    coords = batch_of_three()
    first = backends.neighbor_map(coords, 3)
    assert backends.neighbor_map(coords, 3) is not first  # the owner (SparseTensor) keeps maps, not backends
    assert torch.equal(backends.neighbor_map(coords, 3).table, first.table)
    feats, weight = torch.randn(coords.shape[0], 3), torch.randn(2, 3, 3, 3, 3)
    torch.testing.assert_close(backends.sparse_conv3d(feats, coords, weight, neighbor_map=first),
                               backends.sparse_conv3d(feats, coords.clone(), weight))
    built = []
    lazy = lambda: built.append(1) or first  # noqa: E731
    torch.testing.assert_close(backends.sparse_conv3d(feats, coords, weight, neighbor_map=lazy),
                               backends.sparse_conv3d(feats, coords, weight, neighbor_map=first))
    assert built == [1]


@pytest.mark.parametrize("name", ["conv3", "conv1"])
def test_golden_sparse_ops_conv(golden_dir, name):
    from safetensors.torch import load_file

    case = golden_dir / "sparse_ops"
    weights, inputs, outputs = (load_file(str(case / f)) for f in
                                ("weights.safetensors", "inputs.safetensors", "outputs.safetensors"))
    out = backends.sparse_conv3d(inputs["feats"], inputs["coords"], weights[f"{name}.conv.weight"],
                                 weights[f"{name}.conv.bias"])
    torch.testing.assert_close(out, outputs[f"{name}.feats"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bad,match", [
    (dict(feats=torch.randn(5, 4, 1)), "2-D"),
    (dict(feats=torch.randint(0, 3, (5, 4))), "floating point"),
    (dict(coords=torch.zeros(5, 3, dtype=torch.int32)), r"\[N, 4\]"),
    (dict(coords=torch.zeros(5, 4)), "integer"),
    (dict(coords=torch.tensor([[0, -1, 0, 0]] + [[0, i, 1, 1] for i in range(4)], dtype=torch.int32)), "negative"),
    (dict(feats=torch.randn(6, 4)), "6 rows but coords has 5"),
    (dict(weight=torch.randn(3, 3, 3, 3, 7)), "expects 7 input channels"),
    (dict(weight=torch.randn(3, 2, 2, 2, 4)), "odd cubic kernel"),
    (dict(weight=torch.randn(3, 27, 4)), r"\[Cout, k, k, k, Cin\]"),
    (dict(bias=torch.randn(4)), r"bias must be \[Cout=3\]"),
])
def test_bad_input_errors(bad, match):
    args = dict(feats=torch.randn(5, 4), coords=torch.tensor([[0, i, 1, 1] for i in range(5)], dtype=torch.int32),
                weight=torch.randn(3, 3, 3, 3, 4), bias=None)
    args.update(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        backends.sparse_conv3d(**args)


def test_duplicate_coords_are_rejected():
    coords = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1]], dtype=torch.int32)
    with pytest.raises(ValueError, match="duplicate"):
        backends.sparse_conv3d(torch.randn(2, 2), coords, torch.randn(2, 3, 3, 3, 2))


def test_against_spconv_single_thread():
    pytest.importorskip("spconv.pytorch", reason="spconv (CPU build) not installed")
    coords = torch.cat([random_coords(2000, 14, batch=0, seed=5), random_coords(900, 11, batch=1, seed=6)])
    g = torch.Generator().manual_seed(7)
    feats = torch.randn(coords.shape[0], 16, generator=g)
    weight = torch.randn(12, 3, 3, 3, 16, generator=g) / (27 * 16) ** 0.5
    bias = torch.randn(12, generator=g)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # spconv's CPU kernels are only correct single-threaded (PLATFORMS.md)
    try:
        with backends.use(sparse="spconv"):
            ref = backends.sparse_conv3d(feats, coords, weight, bias)
    finally:
        torch.set_num_threads(threads)
    with backends.use(sparse="torch"):
        out = backends.sparse_conv3d(feats, coords, weight, bias)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_spconv_refuses_multithreaded_cpu():
    pytest.importorskip("spconv.pytorch", reason="spconv (CPU build) not installed")
    if torch.get_num_threads() == 1:
        pytest.skip("needs more than one torch thread to exercise the guard")
    coords = random_coords(50, 5)
    with backends.use(sparse="spconv"), pytest.raises(backends.BackendUnavailableError, match="one thread"):
        backends.sparse_conv3d(torch.randn(coords.shape[0], 2), coords, torch.randn(2, 3, 3, 3, 2))


def test_spconv_builds_its_pairs_once_per_neighbour_map(monkeypatch):
    """Layers at the same coordinates (one neighbour map) reuse spconv's index pairs: built by the first call,
    never again (a rebuild is a sort per layer per call, and breaks a CUDA-graph capture); results stay equal
    to the portable backend's."""
    ops = pytest.importorskip("spconv.pytorch.ops", reason="spconv (CPU build) not installed")
    builds = []
    real = ops.get_indice_pairs
    monkeypatch.setattr(ops, "get_indice_pairs", lambda *a, **k: builds.append(1) or real(*a, **k))
    coords = random_coords(700, 12, seed=3)
    nmap = backends.neighbor_map(coords, 3)
    g = torch.Generator().manual_seed(4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # spconv's CPU kernels are only correct single-threaded
    try:
        for cin, cout in ((8, 8), (8, 16), (16, 8)):
            feats = torch.randn(coords.shape[0], cin, generator=g)
            weight = torch.randn(cout, 3, 3, 3, cin, generator=g) / (27 * cin) ** 0.5
            with backends.use(sparse="spconv"):
                out = backends.sparse_conv3d(feats, coords, weight, None, neighbor_map=nmap)
            with backends.use(sparse="torch"):
                ref = backends.sparse_conv3d(feats, coords, weight, None, neighbor_map=nmap)
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    finally:
        torch.set_num_threads(threads)
    assert len(builds) == 1


def upsampling_case(seed: int, cin: int = 32, cout: int = 4):
    """Three batch elements' voxels and, for each, its coarse voxel (coords // 2 in the same batch element): coarse
    features [P, cin], the fine row -> coarse row index, a kernel-3 weight and bias (unit-scale outputs)."""
    coords = batch_of_three()
    coarse, parent = torch.unique(torch.cat([coords[:, :1], coords[:, 1:] // 2], 1), dim=0, return_inverse=True)
    g = torch.Generator().manual_seed(seed)
    parents = torch.randn(coarse.shape[0], cin, generator=g)
    weight = torch.randn(cout, 3, 3, 3, cin, generator=g) / (27 * cin) ** 0.5
    return coords, parents, parent, weight, torch.randn(cout, generator=g)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("bias", [True, False])
def test_upsampled_convolution_runs_on_the_parents(monkeypatch, device, dtype, tol, bias):
    """``sparse_conv3d_upsampled`` is the convolution of the upsampled rows (float64 dense reference): on the CPU's
    portable backend computed on the parents (the path taken, in blocks that do not divide the rows), never
    building the [N, Cin] rows; with gradients, narrow inputs or few rows a parent, the plain convolution of the
    materialised rows."""
    import backends.sparse_conv as sc
    from backends.sparse_conv import portable

    calls = []
    real = sc.upsampled_sparse_conv3d
    monkeypatch.setattr(sc, "upsampled_sparse_conv3d", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(portable, "IM2COL_BLOCK_ROWS", 7)
    coords, parents, index, weight, b = upsampling_case(seed=5)
    assert coords.shape[0] >= 2 * parents.shape[0]
    b = b if bias else None
    ref = dense_reference(parents[index], coords, weight, b)
    args = (index.to(device), coords.to(device), weight.to(device, dtype), None if b is None else b.to(device, dtype))
    with torch.no_grad():
        out = backends.sparse_conv3d_upsampled(parents.to(device, dtype), *args)
    assert out.dtype == dtype and out.shape == (coords.shape[0], weight.shape[0])
    lean = backends.resolve(backends.Family.SPARSE_CONV, torch.device(device), dtype).has("lean")
    assert len(calls) == int(lean)
    err = (out.cpu().double() - ref).abs().max() / ref.abs().max()
    assert err < tol, f"relative error {err:.2e}"
    x = parents.to(device, dtype).requires_grad_()
    with backends.use(sparse="torch"):  # the backend with gradients (CUDA's kernels have none)
        with_grad = backends.sparse_conv3d_upsampled(x, *args)  # gradients: the upsampled rows are convolved
    with_grad.float().square().sum().backward()
    assert len(calls) == int(lean) and x.grad.abs().sum() > 0
    assert (with_grad.detach().cpu().double() - ref).abs().max() / ref.abs().max() < tol
    narrow = backends.sparse_conv3d_upsampled(parents[:, :4].to(device, dtype), args[0], args[1],
                                              weight[..., :4].to(device, dtype))
    assert len(calls) == int(lean)  # 4 -> 4 channels: gathering the products would cost more than the rows
    ref_narrow = dense_reference(parents[index, :4], coords, weight[..., :4], None)
    assert (narrow.cpu().double() - ref_narrow).abs().max() / ref_narrow.abs().max() < tol


def test_upsampled_convolution_checks_its_index():
    coords, parents, index, weight, _ = upsampling_case(seed=1)
    with pytest.raises(ValueError, match="parent_index"):
        backends.sparse_conv3d_upsampled(parents, index[:-1], coords, weight)


def test_large_maps_build_their_gather_rows_per_block(monkeypatch):
    """Maps above ``NeighborMap.PAIR_CACHE_MAX_VOXELS`` keep no whole-map copy of the one-GEMM and upsampled
    convolutions' gather rows (it would be N x 27 int64 where memory is tight): the rows are built per block, with
    the same outputs; small maps keep theirs."""
    from backends.hashing import NeighborMap
    from backends.sparse_conv import portable

    monkeypatch.setattr(portable, "IM2COL_BLOCK_ROWS", 7)
    coords, parents, index, weight, b = upsampling_case(seed=2)
    feats = parents[index].bfloat16()
    outputs = {}
    for limit in (1 << 18, 8):
        monkeypatch.setattr(NeighborMap, "PAIR_CACHE_MAX_VOXELS", limit)
        nmap = backends.neighbor_map(coords, 3)
        with torch.no_grad():
            one_gemm = backends.sparse_conv3d(feats, coords, weight.bfloat16(), b.bfloat16(), neighbor_map=nmap)
            upsampled = backends.sparse_conv3d_upsampled(parents.bfloat16(), index, coords, weight.bfloat16(),
                                                         b.bfloat16(), neighbor_map=nmap)
        assert (nmap._extras != {}) == (limit > coords.shape[0])
        outputs[limit] = one_gemm, upsampled
    for small, large in zip(*outputs.values()):
        assert torch.equal(small, large)
