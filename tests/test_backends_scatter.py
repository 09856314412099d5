"""backends.index_add_ranked_ / slot_ranks / SlotScatter / unique_codes against torch's own ops.

The sums must equal ``index_add_`` bit for bit (the mesh extraction's vertex values, and so its faces, depend on the
rounding): the inputs mix magnitudes so that another summation order rounds differently, and a test shows that
it does. Ranks are checked against a reference from a stable sort."""
import pytest
import torch

import backends
import backends.scatter as scatter


@pytest.fixture
def passes(monkeypatch):
    """The ranked passes at any thread count (they run from 4 threads; CI has 2)."""
    monkeypatch.setattr(scatter, "RANKED_MIN_THREADS", 1)


def _ranks_reference(index: torch.Tensor) -> torch.Tensor:
    """Number of earlier entries with the same target (stable sort: entries of one target in entry order)."""
    flat = index.reshape(-1).long()
    values, order = torch.sort(flat, stable=True)
    position = torch.arange(flat.numel())
    starts = torch.ones_like(values, dtype=torch.bool)
    starts[1:] = values[1:] != values[:-1]
    first = torch.cummax(torch.where(starts, position, 0), 0).values
    ranks = torch.empty_like(flat)
    ranks[order] = position - first
    return ranks.reshape(index.shape)


def _order_sensitive_values(rows: int, width: int, seed: int) -> torch.Tensor:
    """float32 values of mixed magnitudes: their sums depend on the order they are added in."""
    g = torch.Generator().manual_seed(seed)
    scale = 10.0 ** torch.randint(-4, 5, (rows, 1), generator=g).float()
    return (torch.randn(rows, width, generator=g) * scale).squeeze(-1) if width == 1 else \
        torch.randn(rows, width, generator=g) * scale


def _corner_index(num_voxels: int, seed: int = 0):
    """The mesh extraction's [M, 8] vertex of each voxel corner, voxels in a shuffled order."""
    from sam3d_objects.model.backbone.tdfy_dit.representations.mesh.utils_cube import construct_voxel_grid
    g = torch.Generator().manual_seed(seed)
    occupied = torch.nonzero(torch.rand(24, 24, 24, generator=g) < num_voxels / 24 ** 3)
    coords = occupied[torch.randperm(occupied.shape[0], generator=g)]
    verts, cubes = construct_voxel_grid(coords)
    return cubes, verts.shape[0]


@pytest.mark.parametrize("width", [1, 10])
def test_index_add_ranked_equals_index_add_bit_for_bit(width, passes):
    g = torch.Generator().manual_seed(0)
    rows, targets = 3 * scatter.RANKED_MIN_ROWS, 1000
    index = torch.randint(0, targets, (rows,), generator=g)
    src = _order_sensitive_values(rows, width, 1)
    ranks = _ranks_reference(index)
    num_ranks = int(ranks.max()) + 1
    out_shape = (targets,) if width == 1 else (targets, width)
    want = torch.zeros(out_shape).index_add_(0, index, src)
    got = backends.index_add_ranked_(torch.zeros(out_shape), index, src, ranks, num_ranks)
    assert torch.equal(got, want)
    # the check can fail: the same rows summed in reversed order round differently
    reverse = torch.zeros(out_shape).index_add_(0, index.flip(0), src.flip(0))
    assert not torch.equal(reverse, want)


def test_index_add_ranked_over_chunks_keeps_row_order(passes):
    """Ranks count the rows of earlier calls too: chunked calls give the one-call sums."""
    g = torch.Generator().manual_seed(2)
    rows, targets = 5 * scatter.RANKED_MIN_ROWS, 700
    index = torch.randint(0, targets, (rows,), generator=g, dtype=torch.int32)
    src = _order_sensitive_values(rows, 3, 3)
    ranks = _ranks_reference(index)
    want = torch.zeros(targets, 3).index_add_(0, index, src)
    out = torch.zeros(targets, 3)
    for start in range(0, rows, 6000):
        part = slice(start, start + 6000)
        backends.index_add_ranked_(out, index[part], src[part], ranks[part], int(ranks.max()) + 1)
    assert torch.equal(out, want)


def test_fewer_threads_than_the_minimum_keep_index_add(monkeypatch):
    """Below RANKED_MIN_THREADS no ranks are computed and index_add_ runs (same sums)."""
    monkeypatch.setattr(scatter, "RANKED_MIN_THREADS", torch.get_num_threads() + 1)
    cubes, num_verts = _corner_index(4000, seed=3)
    sums = backends.SlotScatter(cubes, num_verts)
    assert sums.ranks is None
    values = _order_sensitive_values(cubes.numel(), 4, 8)
    out = sums.add_(torch.zeros(num_verts, 4), 0, values)
    assert torch.equal(out, torch.zeros(num_verts, 4).index_add_(0, cubes.reshape(-1), values))
    assert torch.equal(sums.counts, torch.bincount(cubes.reshape(-1), minlength=num_verts))


def test_index_add_ranked_validates_shapes():
    with pytest.raises(ValueError, match="one entry per row"):
        backends.index_add_ranked_(torch.zeros(4), torch.zeros(5, dtype=torch.long), torch.ones(5),
                                   torch.zeros(4, dtype=torch.long), 1)


def test_slot_ranks_match_stable_sort_and_counts():
    cubes, num_verts = _corner_index(8000)
    ranks, counts = backends.slot_ranks(cubes, num_verts)
    assert ranks.dtype == torch.int8 and ranks.shape == cubes.shape
    assert torch.equal(ranks.long(), _ranks_reference(cubes))
    assert torch.equal(counts, torch.bincount(cubes.reshape(-1), minlength=num_verts))
    assert int(ranks.max()) == 7  # some vertex is shared by eight voxels


def test_slot_ranks_rejects_a_repeated_target_in_a_column():
    index = torch.tensor([[0, 1], [2, 3], [0, 4]])
    with pytest.raises(ValueError, match="repeats within column 0"):
        backends.slot_ranks(index, 5)


def test_slot_scatter_chunks_equal_one_index_add(device, passes):
    cubes, num_verts = _corner_index(4000, seed=1)
    cubes = cubes.to(device=device, dtype=torch.int32)
    values = _order_sensitive_values(cubes.numel(), 10, 4).view(cubes.shape[0], 8, 10).to(device)
    want = torch.zeros(num_verts, 10, device=device).index_add_(0, cubes.reshape(-1), values.reshape(-1, 10))
    sums = backends.SlotScatter(cubes, num_verts)
    assert (sums.ranks is not None) == (device.type == "cpu")  # the ranked path is the CPU's
    out = torch.zeros(num_verts, 10, device=device)
    for start in range(0, cubes.shape[0], 700):
        sums.add_(out, start, values[start:start + 700])
    if device.type == "cpu":
        assert torch.equal(out, want)
    else:  # index_add_ with atomics: the order is the device's
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)
    assert torch.equal(sums.counts.cpu(), torch.bincount(cubes.reshape(-1).long().cpu(), minlength=num_verts))
    with pytest.raises(ValueError, match="values for rows"):
        sums.add_(out, cubes.shape[0] - 1, values[:2])


@pytest.mark.parametrize("size_factor", [1, 2, 100])  # 100: beyond the presence map, the sort path
def test_unique_codes_equal_torch_unique(device, size_factor):
    g = torch.Generator().manual_seed(5)
    n = 20_000
    size = n * size_factor
    codes = torch.randint(0, size, (n,), generator=g).to(device)
    for dtype in (torch.int64, torch.int32):
        data = codes.to(dtype)
        want = torch.unique(data.cpu(), return_inverse=True, return_counts=True)
        got = backends.unique_codes(data, size, return_inverse=True, return_counts=True)
        for a, b in zip(want, got):
            assert b.dtype == a.dtype and torch.equal(b.cpu(), a)
        assert torch.equal(backends.unique_codes(data.view(100, 200), size), want[0].to(device))
        assert backends.unique_codes(data.view(100, 200), size, return_inverse=True)[1].shape == (100, 200)
    assert backends.unique_codes(torch.zeros(0, dtype=torch.long, device=device), 10).numel() == 0


def _grid_edges(seed: int = 7):
    """Edges of random cubes of a 30^3 grid as (first, second, direction) in FlexiCubes' table order, vertices
    numbered in grid order (the sparse extractor's)."""
    from sam3d_objects.model.backbone.tdfy_dit.representations.mesh.flexicubes.flexicubes import FlexiCubes
    from sam3d_objects.model.backbone.tdfy_dit.representations.mesh.utils_cube import construct_voxel_grid
    g = torch.Generator().manual_seed(seed)
    cubes = torch.nonzero(torch.rand(30, 30, 30, generator=g) < 0.3)
    verts, corner = construct_voxel_grid(cubes)
    fc = FlexiCubes()
    ends = fc.cube_edges.reshape(12, 2)
    return corner[:, ends[:, 0]], corner[:, ends[:, 1]], verts.shape[0], fc.edge_direction.expand(cubes.shape[0], -1)


def test_unique_pairs_equal_torch_unique_with_and_without_the_structure(monkeypatch):
    sorts = []
    monkeypatch.setattr(scatter, "unique", lambda *a, **k: sorts.append(1) or backends.unique(*a, **k))
    first, second, num_verts, direction = _grid_edges()
    want = torch.unique(first * num_verts + second, return_inverse=True, return_counts=True)
    got = backends.unique_pairs(first, second, num_verts, direction, 6, return_inverse=True, return_counts=True)
    assert not sorts  # grid edges in grid order: the presence map, no sort
    for a, b in zip(want, got):
        assert b.dtype == a.dtype and torch.equal(b, a)
    assert got[0].numel() < first.numel()  # edges shared by neighbouring cubes were merged
    # a direction that does not fix the second vertex, and one whose order disagrees: the sort gives the same
    for classes in (torch.zeros_like(direction), 5 - direction):
        got = backends.unique_pairs(first, second, num_verts, classes, 6, return_inverse=True, return_counts=True)
        for a, b in zip(want, got):
            assert torch.equal(b, a)
    assert len(sorts) == 2


def test_unique_codes_rejects_codes_outside_the_range():
    with pytest.raises(ValueError, match="outside"):
        backends.unique_codes(torch.tensor([0, 3, 7]), 7)
    with pytest.raises(TypeError, match="integer"):
        backends.unique_codes(torch.tensor([0.0, 1.0]), 4)


def test_mesh_extraction_through_ranked_sums_equals_index_add(passes, monkeypatch):
    """The whole extraction (corner sums over voxel chunks, FlexiCubes' dual-vertex sums): the same mesh, bit
    for bit, as with torch's index_add_ (the ranked path forced off)."""
    from benchmarks.shapes import shell_coords
    from sam3d_objects.model.backbone.tdfy_dit.modules.sparse import SparseTensor
    from sam3d_objects.model.backbone.tdfy_dit.representations.mesh.cube2mesh import SparseFeatures2Mesh

    coords = shell_coords(6000, 48, thickness=1.5, exact=False)
    feats = torch.randn(coords.shape[0], 101, generator=torch.Generator().manual_seed(6)) * 0.5
    extractor = SparseFeatures2Mesh(res=48, use_color=True)
    calls = []
    ranked = scatter.index_add_ranked_

    def counted(out, index, src, ranks, num_ranks, passes=None):
        calls.append(index.numel() >= scatter.RANKED_MIN_ROWS)
        return ranked(out, index, src, ranks, num_ranks, passes=passes)

    monkeypatch.setattr(scatter, "index_add_ranked_", counted)
    monkeypatch.setattr(backends, "index_add_ranked_", counted)

    def mesh(min_rows: int):
        monkeypatch.setattr(scatter, "RANKED_MIN_ROWS", min_rows)
        stream = extractor.stream(coords[:, 1:])
        for start in range(0, coords.shape[0], 1500):
            stream.add(feats[start:start + 1500])
        return stream.finish()

    sorts = []
    monkeypatch.setattr(scatter, "unique", lambda *a, **k: sorts.append(1) or backends.unique(*a, **k))
    want = mesh(10 ** 12)
    assert not sorts  # the voxel corners', candidate cubes' and edges' uniques took the presence map
    assert not any(calls)
    got = mesh(1)
    assert sum(calls) >= 2  # corner sums and dual vertices went through the passes
    assert want.faces.shape[0] > 1000
    for name in ("vertices", "faces", "vertex_attrs"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_index_add_ranked_carries_gradients_like_index_add():
    """FlexiCubes' training path differentiates through the sums: the passes give index_add_'s gradients."""
    g = torch.Generator().manual_seed(9)
    index = torch.randint(0, 500, (scatter.RANKED_MIN_ROWS + 904,), generator=g)
    ranks = _ranks_reference(index)
    src = torch.randn(index.numel(), 3, generator=g, requires_grad=True)
    weight = torch.randn(500, 3, generator=g)
    grads = []
    for passes in (True, False):
        src.grad = None
        out = backends.index_add_ranked_(torch.zeros(500, 3), index, src * 2, ranks, int(ranks.max()) + 1,
                                         passes=passes)
        (out * weight).sum().backward()
        grads.append(src.grad.clone())
    assert torch.equal(grads[0], grads[1]) and grads[0].abs().sum() > 0
