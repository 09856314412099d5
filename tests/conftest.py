"""Shared fixtures: the golden parity data lives beside the checkout in ../shared/golden (CI has it there)."""
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT.parent / "shared" / "golden"


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    if not (GOLDEN / "check_cases.py").exists():
        pytest.skip(f"golden parity data not found at {GOLDEN} (CI provides ../shared beside the checkout)")
    return GOLDEN


@pytest.fixture(autouse=True)
def _fresh_backend_choice():
    """Each test starts from automatic backend selection and the process's thread count, whatever a previous
    test set."""
    import backends

    threads = torch.get_num_threads()
    backends.reset_backends()
    yield
    backends.reset_backends()
    torch.set_num_threads(threads)


def random_coords(n: int, resolution: int, batch: int = 0, seed: int = 0) -> torch.Tensor:
    """Up to n unique voxels (sorted) of one batch element as int32 [M, 4]."""
    g = torch.Generator().manual_seed(seed)
    xyz = torch.unique(torch.randint(0, resolution, (n, 3), generator=g), dim=0)
    return torch.cat([torch.full((xyz.shape[0], 1), batch), xyz], 1).to(torch.int32)
