"""The memory-lean options of backends.sparse_conv3d (subdivided parents, a shared CoordHash) against the plain
portable backend on the materialised input, and the fallback of backends without a lean path."""
import pytest
import torch

import backends
from backends.registry import Family
from conftest import dense_conv3d_float64


def _children(parents: torch.Tensor) -> torch.Tensor:
    """Upstream's subdivision order: parent-major, children (0,0,0), (0,0,1), ..., (1,1,1)."""
    offs = torch.tensor([[i >> 2 & 1, i >> 1 & 1, i & 1] for i in range(8)], dtype=torch.int32)
    xyz = (parents[:, None, 1:] * 2 + offs).reshape(-1, 3)
    return torch.cat([parents[:, :1].repeat_interleave(8, 0), xyz], 1)


@pytest.fixture
def case():
    g = torch.Generator().manual_seed(5)
    xyz = torch.unique(torch.randint(0, 6, (90, 3), generator=g), dim=0)
    parents = torch.cat([torch.zeros_like(xyz[:, :1]), xyz], 1).to(torch.int32)
    parents = torch.cat([parents, parents[:20] * torch.tensor([0, 1, 1, 1], dtype=torch.int32) +
                         torch.tensor([1, 0, 0, 0], dtype=torch.int32)])  # a second batch element
    feats = torch.randn(parents.shape[0], 5, generator=g)
    weight = torch.randn(7, 3, 3, 3, 5, generator=g)
    bias = torch.randn(7, generator=g)
    return parents, _children(parents), feats, weight, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_subdivided_equals_the_portable_backend_on_the_materialised_input(case, dtype):
    parents, children, feats, weight, bias = case
    feats, weight, bias = feats.to(dtype), weight.to(dtype), bias.to(dtype)
    full = feats.repeat_interleave(8, 0)
    with backends.use(sparse="torch"):
        want = backends.sparse_conv3d(full, children, weight, bias)
        got = backends.sparse_conv3d(feats, children, weight, bias, subdivided=True)
        shared = backends.sparse_conv3d(feats, children, weight, bias, subdivided=True,
                                        coord_hash=backends.CoordHash(children))
    # the same arithmetic except the centre GEMM, which runs on N parent rows instead of 8N: BLAS may block
    # the two shapes differently, so equality holds to the last few ulps only
    assert torch.equal(got, shared)
    if dtype == torch.bfloat16:
        # the plain bf16 input runs as one GEMM over all taps (rounded once), the lean path rounds every product
        # to bf16: both within bf16 precision of the output's scale
        scale = want.abs().max().item()
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=2e-2 * scale)
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    if dtype == torch.float64:  # and independently: a Python-dict loop over the submanifold rule
        torch.testing.assert_close(got, _dense_reference(full, children, weight, bias), rtol=1e-10, atol=1e-10)


def test_lean_plain_equals_the_portable_backend(case):
    _, children, feats, weight, bias = case
    x = torch.randn(children.shape[0], 5)
    with backends.use(sparse="torch"):
        assert torch.equal(backends.sparse_conv3d(x, children, weight, bias, coord_hash=backends.CoordHash(children)),
                           backends.sparse_conv3d(x, children, weight, bias))


def test_backends_without_a_lean_path_get_the_materialised_input(case):
    parents, children, feats, weight, bias = case
    seen = []
    spec = backends.registered(Family.SPARSE_CONV)["spconv"]
    original, requires, probe = spec.fn, spec.requires, spec.probe
    spec.fn, spec.requires, spec.probe = (lambda f, c, w, b=None, m=None: seen.append(f.shape[0]) or
                                          backends.registered(Family.SPARSE_CONV)["torch"].fn(f, c, w, b, m)), (), None
    try:
        with backends.use(sparse="spconv"):
            out = backends.sparse_conv3d(feats, children, weight, bias, subdivided=True,
                                         coord_hash=backends.CoordHash(children))
    finally:
        spec.fn, spec.requires, spec.probe = original, requires, probe
    assert seen == [children.shape[0]]
    with backends.use(sparse="torch"):
        assert torch.equal(out, backends.sparse_conv3d(feats.repeat_interleave(8, 0), children, weight, bias))


def test_subdivided_shape_mismatch_is_a_clear_error(case):
    parents, children, feats, weight, bias = case
    with pytest.raises(ValueError, match="8 child coords per parent"):
        backends.sparse_conv3d(feats[:-1], children, weight, bias, subdivided=True)


def _dense_reference(feats, coords, weight, bias):
    index = {tuple(c): i for i, c in enumerate(coords.tolist())}
    out = bias.expand(coords.shape[0], -1).clone()
    for i, (b, x, y, z) in enumerate(coords.tolist()):
        for kx in range(3):
            for ky in range(3):
                for kz in range(3):
                    j = index.get((b, x + kx - 1, y + ky - 1, z + kz - 1))
                    if j is not None:
                        out[i] += weight[:, kx, ky, kz, :] @ feats[j]
    return out


def test_the_metal_backend_takes_the_lean_path(case, monkeypatch):
    """On MPS `auto` picks metal; the mesh decoder's subdivided convs must still skip the [8N, C] copy.
    The metal spec is made to accept the CPU here; its kernel must not be called for a lean request."""
    from backends import registry

    parents, children, feats, weight, bias = case
    spec = backends.registered(Family.SPARSE_CONV)["metal"]
    monkeypatch.setattr(registry, "_RESOLVED", {})  # the faked spec must not stay in the resolve cache
    monkeypatch.setattr(spec, "devices", ("cpu",))
    monkeypatch.setattr(spec, "probe", None)
    monkeypatch.setattr(spec, "requires", ())
    monkeypatch.setattr(spec, "fn", lambda *a: pytest.fail("the metal kernel got the materialised input"))
    with backends.use(sparse="metal"):
        got = backends.sparse_conv3d(feats, children, weight, bias, subdivided=True,
                                     coord_hash=backends.CoordHash(children))
    with backends.use(sparse="torch"):
        assert torch.equal(got, backends.sparse_conv3d(feats, children, weight, bias, subdivided=True))


@pytest.mark.parametrize("subdivided", [True, False])
def test_child_blocks_convolved_on_the_parents_match_dense_conv3d(case, subdivided):
    """parent_map= (complete child blocks): the parent-level arithmetic equals the child-level convolution,
    for a subdivided input (per-parent rows) and for per-child rows, across batch elements and grid borders."""
    parents, children, feats, weight, bias = case
    feats = feats.double()
    rows = feats if subdivided else torch.randn(children.shape[0], feats.shape[1], dtype=torch.float64,
                                                generator=torch.Generator().manual_seed(1))
    child_rows = rows.repeat_interleave(8, 0) if subdivided else rows
    calls = []

    def parent_map():
        calls.append(1)
        return backends.neighbor_map(parents, 3)

    with backends.use(sparse="torch"):
        got = backends.sparse_conv3d(rows, children, weight.double(), bias.double(), subdivided=subdivided,
                                     parent_map=parent_map)
    torch.testing.assert_close(got, dense_conv3d_float64(child_rows, children, weight, bias), rtol=1e-12,
                               atol=1e-12)
    assert calls == [1]


def test_child_blocks_in_float32_and_small_chunks(case):
    """fp32 within float tolerance of the float64 reference, also when the gathers run in many small chunks."""
    from backends.sparse_conv import blocked_sparse_conv3d

    parents, children, _, weight, bias = case
    feats = torch.randn(children.shape[0], weight.shape[4], generator=torch.Generator().manual_seed(2))
    want = dense_conv3d_float64(feats, children, weight, bias)
    pmap = backends.neighbor_map(parents, 3)
    for chunk_bytes in (1 << 26, 64):
        got = blocked_sparse_conv3d(feats, pmap, weight, bias, chunk_bytes=chunk_bytes)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_parent_map_of_other_coords_is_a_clear_error(case):
    parents, children, feats, weight, bias = case
    with backends.use(sparse="torch"), pytest.raises(ValueError, match="parent_map must be"):
        backends.sparse_conv3d(feats, children, weight, bias, subdivided=True,
                               parent_map=backends.neighbor_map(parents[:-1], 3))


def test_backends_with_own_kernels_ignore_parent_map(case, monkeypatch):
    """A backend outside the portable ones gets the materialised child rows, whatever parent_map says."""
    from backends import registry

    parents, children, feats, weight, bias = case
    spec = backends.registered(Family.SPARSE_CONV)["metal"]
    seen = []
    monkeypatch.setattr(registry, "_RESOLVED", {})
    import backends.sparse_conv as sc
    monkeypatch.setitem(spec.extra, "lean", False)
    monkeypatch.setattr(spec, "devices", ("cpu",))
    monkeypatch.setattr(spec, "probe", None)
    monkeypatch.setattr(spec, "requires", ())
    monkeypatch.setattr(spec, "fn", lambda f, c, w, b, m: seen.append(len(f)) or sc.torch_sparse_conv3d(f, c, w, b))
    with backends.use(sparse="metal"):
        got = backends.sparse_conv3d(feats, children, weight, bias, subdivided=True,
                                     parent_map=lambda: pytest.fail("parent map requested"))
    assert seen == [children.shape[0]]
    torch.testing.assert_close(got.double(), dense_conv3d_float64(feats.repeat_interleave(8, 0), children,
                                                                   weight, bias), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("subdivided", [True, False])
def test_child_blocks_dense_and_sparse_offsets_agree(case, subdivided):
    """Offsets run over all parents (zero rows for missing neighbours) or over their pairs: same float64 sums."""
    from backends.sparse_conv import blocked_sparse_conv3d

    parents, children, _, weight, bias = case
    rows = parents.shape[0] if subdivided else children.shape[0]
    feats = torch.randn(rows, weight.shape[4], dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    want = dense_conv3d_float64(feats.repeat_interleave(8, 0) if subdivided else feats, children, weight, bias)
    pmap = backends.neighbor_map(parents, 3)
    for share in (0.0, 2.0):  # every offset dense / every offset sparse
        got = blocked_sparse_conv3d(feats, pmap, weight.double(), bias.double(), subdivided=subdivided,
                                    dense_share=share, chunk_bytes=4096)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
