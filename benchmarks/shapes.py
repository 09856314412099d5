"""The one set of benchmark inputs: surface-like voxel sets, window lengths, the pipeline's conv shapes, timing."""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable

import torch

import backends

CONV_SHAPES = (  # (name, voxels, channels, grid resolution): the pipeline's sparse conv workloads
    ("SLAT flow io", 20_000, 128, 64),
    ("mesh dec 128^3", 151_322, 192, 128),
    ("mesh dec 256^3", 630_694, 96, 256),
    ("small", 5_000, 128, 64),
)
WINDOW_SETS = (("40 windows", 40, 12_422), ("300 windows", 300, 91_606))  # (name, windows, total tokens)


def shell_coords(n: int, resolution: int, device="cpu", seed: int = 0, thickness: float = 0.5,
                 exact: bool = True) -> torch.Tensor:
    """About ``n`` voxels of sphere shells inside a ``resolution``^3 grid, int32 [n, 4] with batch 0, in the
    lexicographic order ``nonzero`` gives: the occupancy of a decoded surface. ``exact`` drops a random few to
    hit ``n``; otherwise whole shells are kept (closed surfaces for the mesh extractor)."""
    device = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    axis = torch.arange(resolution, device=device, dtype=torch.float32)
    occupied = torch.zeros((resolution,) * 3, dtype=torch.bool, device=device)
    count = 0
    while count < n:
        r = float(torch.empty(1).uniform_(0.2, 0.45, generator=gen)) * resolution
        # the last sphere is sized to the voxels still missing, so few have to be dropped at the end
        r = min(r, math.sqrt(max(n - count, 1) / (4 * math.pi)) + 2, resolution / 2 - 2)
        c = torch.empty(3).uniform_(r + 1, resolution - r - 1, generator=gen).tolist()
        d2 = ((axis - c[0])[:, None, None] ** 2 + (axis - c[1])[None, :, None] ** 2
              + (axis - c[2])[None, None, :] ** 2)
        occupied |= (d2.sqrt() - r).abs() < thickness
        count = int(occupied.sum())
    xyz = occupied.nonzero()
    if exact and xyz.shape[0] > n:  # order stays lexicographic
        keep = torch.randperm(xyz.shape[0], generator=gen)[:n].sort().values.to(device)
        xyz = xyz[keep]
    return torch.cat([torch.zeros_like(xyz[:, :1]), xyz], 1).to(torch.int32).contiguous()


def window_lengths(count: int, total: int, cap: int = 400, seed: int = 0) -> list[int]:
    """``count`` window lengths summing to ``total``, each in [1, cap]: a swin layer's packed sequences."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.rand(count, generator=gen) * 0.6 + 0.4
    lengths = (raw / raw.sum() * total).floor().clamp(1, cap).long()
    i = 0
    while int(lengths.sum()) != total:  # spread the rounding remainder without exceeding the cap
        step = 1 if int(lengths.sum()) < total else -1
        if 1 <= int(lengths[i]) + step <= cap:
            lengths[i] += step
        i = (i + 1) % count
    return lengths.tolist()


def timeit_interleaved(fns: dict[str, Callable[[], object]], device: torch.device, repeat: int = 10,
                       warmup: int = 1) -> dict[str, tuple[float, float]]:
    """Median (wall, process CPU) milliseconds of each candidate, run in turn ``repeat`` times: load that comes
    and goes on a shared machine then falls on every candidate alike, so their ratios stay comparable. CPU time
    (all threads of this process) is the steadier of the two when other processes take the cores away."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    backends.device.synchronize(device)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            backends.device.synchronize(device)
            times[name].append(((time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3))
    return {name: (statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts))
            for name, ts in times.items()}


def timeit(fn: Callable[[], object], device: torch.device, repeat: int = 10, warmup: int = 2) -> float:
    """Median wall time in milliseconds (the device synchronised around each run)."""
    for _ in range(warmup):
        fn()
    backends.device.synchronize(device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        backends.device.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
