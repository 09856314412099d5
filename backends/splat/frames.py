"""Frame-parallel rendering on the CPU: the frames of a turntable rendered side by side, each on fewer threads.

One CPU frame is about ten thousand torch calls (1M-element passes, sorts, the compositing rounds' small ops), each
its own OpenMP region. With every thread on one frame, a frame scaled poorly: 0.95 s on one thread of the 2-core
machine, 0.475 s on 16 threads of the 16-core host (2x from 16 threads), and on a loaded machine a descheduled
thread stalls every region's barrier (2 threads, load 4: 8-14 s a frame against 1.1 s on one thread). Frames are
independent, so a turntable renders ``workers`` frames at once, each on ``threads // workers`` threads (by
default four each on many threads, one each on 2-3, :func:`cpu_frame_workers`): the ops do the same arithmetic on fewer threads (the compositing's
running products and sums go along a tile's own gaussians, never split across threads), and the frames came out
bit-identical to frame by frame on the 1M-gaussian object; tests hold them to float rounding.

PyTorch has no per-thread thread count: with OpenMP (PyTorch's usual CPU backend) ``torch.set_num_threads`` in a
worker sets that worker's team size and the process default that threads started meanwhile pick up; the
caller's count is set back when the frames are done. With the native backend the workers share its one pool.
The caller's context variables (``use_compositor``, ``use_frame_workers``) and grad mode go with every frame.
"""
from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, Optional, Sequence, TypeVar

import torch

from ..device import available_memory

__all__ = ["cpu_frame_workers", "frame_workers", "map_frames", "use_frame_workers", "available_memory"]

T = TypeVar("T")
R = TypeVar("R")

_WORKERS: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar("splat_frame_workers", default=None)


@contextlib.contextmanager
def use_frame_workers(workers: Optional[int]) -> Iterator[None]:
    """Frame loops inside the block (``render_frames`` and the turntables built on it) render ``workers`` frames
    at once; 1 renders frame by frame with every thread on each frame (the previous path); None restores the
    default (:func:`frame_workers`)."""
    if workers is not None and int(workers) < 1:
        raise ValueError(f"frame workers must be >= 1 (1: frame by frame) or None (the default), got {workers}")
    token = _WORKERS.set(None if workers is None else int(workers))
    try:
        yield
    finally:
        _WORKERS.reset(token)


# bytes a 1M-gaussian 512^2 frame holds while it renders, per gaussian (measured: about 0.35 GiB more peak RSS a
# frame in flight on the CPU, projection, tables and tile pairs)
FRAME_BYTES_PER_GAUSSIAN = 400
MEMORY_SHARE = 0.5  # frames in flight may take this share of the memory available when the loop starts


def cpu_frame_workers(threads: int) -> int:
    """Frames in flight for ``threads`` torch threads: one frame per thread on 2-3 threads, else a quarter of
    the threads (each frame on 4). Measured with ``bench_render.py --video --workers``, 1 M gaussians at 512^2:
    on the 16-core host 4 frames x 4 threads 0.176 s a frame against 0.190 (8 x 2), 0.217 (16 x 1) and
    0.313 (1 x 16); on 2 cores 2 x 1 beat 1 x 2 by 1.29x."""
    return max(1, min(threads, max(2, threads // 4)))


def frame_workers(device: torch.device, n_frames: int, n_gaussians: Optional[int] = None) -> int:
    """How many frames to render at once: :func:`use_frame_workers`'s choice, else on the CPU
    :func:`cpu_frame_workers` of the torch threads (at most ``n_frames``, and no more than ``MEMORY_SHARE`` of the
    available memory holds at ``FRAME_BYTES_PER_GAUSSIAN`` for ``n_gaussians``), elsewhere 1 (an accelerator runs
    one frame's ops across the device)."""
    chosen = _WORKERS.get()
    if n_frames <= 1:
        return 1
    if chosen is not None:
        return max(1, min(chosen, n_frames))
    if torch.device(device).type != "cpu":
        return 1
    workers = min(cpu_frame_workers(torch.get_num_threads()), n_frames)
    free = available_memory() if n_gaussians else None
    if free is not None:
        workers = min(workers, int(MEMORY_SHARE * free // (FRAME_BYTES_PER_GAUSSIAN * n_gaussians)))
    return max(1, workers)


def map_frames(render: Callable[[T], R], items: Sequence[T], workers: int) -> Iterator[R]:
    """``render(item)`` for every item, yielded in order; ``workers`` > 1 renders that many at once (threads of
    this process, each with ``torch.get_num_threads() // workers`` torch threads, at least one). A failure in a
    frame is raised here once the frames before it are yielded; frames not started yet are dropped."""
    if workers <= 1 or len(items) <= 1:
        for item in items:
            yield render(item)
        return
    threads = torch.get_num_threads()
    per_worker = max(1, threads // workers)
    grad = torch.is_grad_enabled()
    own_teams = _openmp()

    def start() -> None:
        if own_teams:
            torch.set_num_threads(per_worker)

    def one(item: T) -> R:
        with torch.set_grad_enabled(grad):
            return render(item)

    pool = ThreadPoolExecutor(max_workers=workers, initializer=start, thread_name_prefix="splat-frame")
    try:
        # one copy of the caller's context per frame: a context cannot be entered by two threads at once
        futures = collections.deque(pool.submit(contextvars.copy_context().run, one, item) for item in items)
        while futures:
            yield futures.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        if own_teams:
            torch.set_num_threads(threads)


@functools.lru_cache(maxsize=None)
def _openmp() -> bool:
    """Whether torch's CPU ops run on OpenMP, where each calling thread gets its own team of
    ``torch.get_num_threads()`` threads (so a worker sets its own count). The native backend has one shared pool
    that frames from several threads queue on, and warns on a second ``set_num_threads``: workers leave it."""
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()
