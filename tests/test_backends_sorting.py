"""backends.sort / argsort / unique: equal to torch's on trusted devices, the MPS path (forced on the
CPU here) narrows int64 keys to int32 and gives the same results, and a wrong device sort is caught by the
one-time check and replaced by a CPU sort with a warning; CoordHash's int32 and int64 keys give identical maps."""
import pytest
import torch

import backends
import backends.sorting as sorting
from backends.hashing import CoordHash, build_neighbor_map


@pytest.fixture
def as_mps(monkeypatch):
    """Treat the CPU as a checked device (the path MPS takes), with a fresh check state."""
    monkeypatch.setattr(sorting, "CHECKED_DEVICES", ("cpu",))
    monkeypatch.setattr(sorting, "_TRUSTED", {})


def _codes(n=5000, high=64 ** 3 * 2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, high, (n,), generator=g, dtype=torch.int64)


@pytest.mark.parametrize("checked", [False, True])
def test_unique_and_sort_equal_torch(checked, monkeypatch):
    if checked:
        monkeypatch.setattr(sorting, "CHECKED_DEVICES", ("cpu",))
        monkeypatch.setattr(sorting, "_TRUSTED", {})
    x = _codes()
    strided = torch.stack([x, -x], 1)[:, 0]  # a non-contiguous view
    for data in (x, strided):
        for want, got in zip(torch.unique(data, return_inverse=True, return_counts=True),
                             backends.unique(data, return_inverse=True, return_counts=True)):
            assert torch.equal(got, want) and got.dtype == want.dtype
        values, order = backends.sort(data, stable=True)
        assert values.dtype == torch.int64 and torch.equal(values, torch.sort(data, stable=True).values)
        assert torch.equal(order, torch.sort(data, stable=True).indices)
        assert torch.equal(backends.argsort(data, stable=True), torch.argsort(data, stable=True))
    assert torch.equal(backends.unique(torch.zeros(0, dtype=torch.int64)), torch.zeros(0, dtype=torch.int64))


def test_checked_device_sorts_int64_keys_as_int32(as_mps, monkeypatch):
    seen = []
    raw = sorting._raw_sort
    monkeypatch.setattr(sorting, "_raw_sort", lambda x, **k: seen.append(x.dtype) or raw(x, **k))
    backends.sort(_codes())
    assert seen[-1] == torch.int32  # the data sort (the check before it sorts its own probe)
    backends.sort(_codes(high=2 ** 40))  # does not fit: stays int64
    assert seen[-1] == torch.int64


def test_a_wrong_device_sort_is_caught_and_replaced_by_a_cpu_sort(as_mps, monkeypatch):
    raw = sorting._raw_sort

    def broken(x, stable, descending):  # garbage beyond element 256, as the MPS int64 bug
        values, order = raw(x, stable=stable, descending=descending)
        if x.numel() > 256 and x.dtype == torch.int64:
            values, order = values.clone(), order.clone()
            values[256:] = values[256:].flip(0)
            order[256:] = order[256:].flip(0)
        return values, order

    monkeypatch.setattr(sorting, "_raw_sort", broken)
    with pytest.warns(RuntimeWarning, match="wrong result in a self-check"):
        assert sorting.sort_is_trustworthy(torch.device("cpu"), torch.int64) is False
    assert sorting.sort_is_trustworthy(torch.device("cpu"), torch.int32) is True
    assert sorting._TRUSTED[("cpu", torch.int64)] is False


def test_fallback_result_is_correct_when_the_device_sort_is_wrong(as_mps, monkeypatch):
    monkeypatch.setitem(sorting._TRUSTED, ("cpu", torch.int64), False)  # as after a failed check
    calls = []
    raw = sorting._raw_sort
    monkeypatch.setattr(sorting, "_raw_sort", lambda x, **k: calls.append(x.device.type) or raw(x, **k))
    data = _codes(high=2 ** 40)
    values, order = backends.sort(data)
    assert (values[1:] >= values[:-1]).all() and torch.equal(values, data[order])
    assert torch.equal(backends.unique(data), torch.unique(data))


@pytest.mark.parametrize("kernel", [3, 5])
def test_int32_and_int64_keys_give_identical_maps(kernel):
    g = torch.Generator().manual_seed(kernel)
    xyz = torch.unique(torch.randint(0, 64, (3000, 3), generator=g), dim=0)
    coords = torch.cat([torch.randint(0, 2, (xyz.shape[0], 1), generator=g), xyz], 1).to(torch.int32)
    coords = torch.unique(coords, dim=0)
    h32, h64 = CoordHash(coords), CoordHash(coords, key_dtype=torch.int64)
    assert h32.key_dtype == torch.int32 and h64.key_dtype == torch.int64  # 2 x 64^3 always fits int32
    assert torch.equal(build_neighbor_map(coords, kernel, h32).table, build_neighbor_map(coords, kernel, h64).table)
    query = torch.cat([coords[:50], coords[:50] + 1, torch.tensor([[0, 70, 1, 1], [5, 1, 1, 1]])]).to(torch.int32)
    assert torch.equal(h32.lookup(query), h64.lookup(query))
    with pytest.raises(ValueError, match="does not fit int32"):
        CoordHash(torch.tensor([[0, 2 ** 11, 2 ** 11, 2 ** 11]], dtype=torch.int32), key_dtype=torch.int32)
