"""The CPU-testable parts of ``python -m benchmarks.cuda_check`` (the CUDA benchmark the lead runs on the device):
its input builders and its behaviour on a machine without CUDA."""
from __future__ import annotations

import torch

from backends import neighbor_map
from benchmarks import cuda_check


def test_shell_coords_are_exact_unique_sorted_surfaces():
    coords = cuda_check.shell_coords(5_000, 64, torch.device("cpu"), seed=3)
    assert coords.shape == (5_000, 4) and coords.dtype == torch.int32
    assert bool((coords[:, 0] == 0).all()) and bool((coords[:, 1:] >= 0).all()) and bool((coords < 64).all())
    key = (coords[:, 1].long() * 64 + coords[:, 2]) * 64 + coords[:, 3]
    assert bool((key[1:] > key[:-1]).all()), "lexicographic order, no duplicates"
    neighbours = (neighbor_map(coords, 3).table >= 0).sum(dim=1).float().mean()
    assert 6 < float(neighbours) < 18, "surface-like occupancy: far from both isolated points and solid blocks"


def test_window_lengths_hit_the_total_under_the_cap():
    for _, count, total in cuda_check.WINDOW_SETS:
        lengths = cuda_check.window_lengths(count, total)
        assert len(lengths) == count and sum(lengths) == total
        assert max(lengths) <= 400 and min(lengths) >= 1


def test_without_cuda_it_says_so_and_exits_zero(capsys):
    if torch.cuda.is_available():  # pragma: no cover - this suite runs on CPU machines
        return
    assert cuda_check.main([]) == 0
    assert "CUDA is not available" in capsys.readouterr().out
