"""The sort-based coordinate hash and neighbour maps against brute-force Python dictionaries."""
import pytest
import torch

import backends
from conftest import random_coords


def brute_index(coords):
    return {tuple(row): i for i, row in enumerate(coords.tolist())}


def test_lookup_present_absent_and_out_of_range(device):
    coords = torch.cat([random_coords(200, 6, batch=0, seed=1), random_coords(80, 9, batch=1, seed=2)])
    table = brute_index(coords)
    h = backends.CoordHash(coords.to(device))
    g = torch.Generator().manual_seed(3)
    queries = torch.cat([
        coords[torch.randperm(coords.shape[0], generator=g)[:50]],             # present
        torch.randint(0, 9, (200, 4), generator=g) * torch.tensor([0, 1, 1, 1]) + torch.tensor([1, 0, 0, 0]),
        torch.tensor([[0, -1, 0, 0], [0, 0, 0, 99], [5, 0, 0, 0], [0, 6, 0, 0], [-1, 0, 0, 0]]),  # out of range
    ]).int()
    expected = torch.tensor([table.get(tuple(q), -1) for q in queries.tolist()])
    found = h.lookup(queries.to(device))
    assert found.device.type == device.type and torch.equal(found.cpu(), expected)


def test_lookup_empty_hash():
    h = backends.CoordHash(torch.zeros(0, 4, dtype=torch.int32))
    assert torch.equal(h.lookup(torch.tensor([[0, 0, 0, 0]])), torch.tensor([-1]))


def test_duplicates_are_an_error():
    coords = torch.tensor([[0, 1, 2, 3], [0, 4, 4, 4], [0, 1, 2, 3]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"duplicate rows \(e.g. \[0, 1, 2, 3\]\)"):
        backends.CoordHash(coords)


def test_neighbor_map_matches_brute_force(device):
    coords = torch.cat([random_coords(150, 5, batch=0, seed=4), random_coords(60, 5, batch=2, seed=5)])
    table = brute_index(coords)
    nmap = backends.neighbor_map(coords.to(device), 3).table.cpu()
    offsets = backends.kernel_offsets(3).tolist()
    for i, (b, x, y, z) in enumerate(coords.tolist()):
        for j, (dx, dy, dz) in enumerate(offsets):
            assert nmap[i, j] == table.get((b, x + dx, y + dy, z + dz), -1)


def test_kernel_offsets_follow_spconv_weight_order():
    off = backends.kernel_offsets(3)
    assert off.shape == (27, 3)
    assert off[0].tolist() == [-1, -1, -1] and off[1].tolist() == [-1, -1, 0] and off[13].tolist() == [0, 0, 0]


@pytest.mark.parametrize("coords,match", [
    (torch.zeros(3, 3, dtype=torch.int32), r"\[N, 4\]"),
    (torch.zeros(3, 4), "integer"),
    (torch.tensor([[0, 0, -2, 0]]), "negative"),
])
def test_bad_coords(coords, match):
    with pytest.raises((ValueError, TypeError), match=match):
        backends.CoordHash(coords)
