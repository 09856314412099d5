"""Metal fast paths for Apple GPUs: sparse conv (``SPARSE_BACKEND=metal``) and varlen attention
(``SPARSE_ATTN_BACKEND=metal``), picked by ``auto`` on MPS when the shaders compile.

The kernels are MSL sources kept next to this file (``*.metal``, package data). Each source is compiled once per
process with ``torch.mps.compile_shader`` and the library is cached; kernels are dispatched on MPS tensors with
explicit ``threads=`` / ``group_size=``, so nothing goes through the CPU and no PyObjC is needed. A compile
failure is remembered too: the probe reports it, so ``auto`` falls back to the torch backends with one warning,
and an explicit ``metal`` request fails with the reason.

Every launch is bounded (:data:`LAUNCH_WORK_LIMIT` multiply-adds, worst case) and big problems are split into
several launches, because the macOS GPU watchdog kills command buffers that run too long; since torch may encode
several launches into one command buffer, the stream is also flushed after :data:`FLUSH_WORK_LIMIT`. Both limits
are settings (:func:`set_launch_limits`): they were chosen on paper, not timed on every Apple GPU.

The probe also checks that each kernel's threadgroup memory fits the GPU's limit (32 KiB on every Apple GPU
family that runs macOS 14+; :func:`set_threadgroup_memory_limit` changes it).

The neighbour map itself is built with torch ops (sort + searchsorted run on MPS); only its int32 table and a
row order by neighbour mask are derived here, once per map.

Tests run these exact sources as C++ on the CPU (tests/metal_emulator) through :func:`set_compiler`.
"""
from __future__ import annotations

import threading
from importlib import resources
from typing import Any, Callable, Optional

import torch

from ..device import (MIN_TORCH_FOR_MPS, require_torch_for_mps,  # noqa: F401  (re-exported)
                      synchronize, torch_too_old_for_mps)
from ..hashing import NeighborMap, neighbor_map as _neighbor_map
from ..registry import Family, env_value, register

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}

# Worst-case multiply-adds per launch: ~2^34 keeps a launch in the tens of milliseconds on Apple GPUs, far from
# the watchdog's seconds, while big layers still need only a handful of launches.
LAUNCH_WORK_LIMIT = 2 ** 34
# torch's MPS stream may encode several launches into one command buffer, and the watchdog times command
# buffers: after this much work the stream is flushed (a wait, not a data copy) so none grows past it.
FLUSH_WORK_LIMIT = 2 ** 37

# Tile shapes: these must match the #defines in the .metal sources.
CONV_TILE_ROWS, CONV_TILE_COLS, CONV_GROUP = 32, 64, (16, 16)
ATTN_TILE_Q, ATTN_THREADS, ATTN_MAX_HEAD_DIM = 16, 128, 128

_SOURCES = {"sparse_conv": "sparse_conv.metal", "varlen_attention": "varlen_attention.metal"}

# Threadgroup memory the kernels declare (bytes, from the tile #defines in the .metal sources; fp32 tiles).
CONV_THREADGROUP_BYTES = 4 * (16 * (CONV_TILE_ROWS + 1) + 16 * CONV_TILE_COLS + CONV_TILE_ROWS + 1)
ATTN_THREADGROUP_BYTES = 4 * (ATTN_TILE_Q * ATTN_MAX_HEAD_DIM + 32 * (ATTN_MAX_HEAD_DIM + 1) + ATTN_TILE_Q * (32 + 1))
# MTLDevice.maxThreadgroupMemoryLength of Apple GPUs (torch exposes no query for it)
THREADGROUP_MEMORY_LIMIT = 32 * 1024

# torch.mps.compile_shader became public in 2.7; MPS max_pool3d / avg_pool3d and bicubic antialias also need it.


def set_launch_limits(launch_work: Optional[int] = None, flush_work: Optional[int] = None) -> None:
    """Change the watchdog bounds (worst-case multiply-adds per launch / per flushed command buffer); ``None``
    keeps a value. The registry passes its settings here; lower them if macOS reports GPU timeouts."""
    global LAUNCH_WORK_LIMIT, FLUSH_WORK_LIMIT
    for name, value in (("launch_work", launch_work), ("flush_work", flush_work)):
        if value is not None and int(value) < 1:
            raise ValueError(f"{name} must be a positive number of multiply-adds, got {value}")
    if launch_work is not None:
        LAUNCH_WORK_LIMIT = int(launch_work)
    if flush_work is not None:
        FLUSH_WORK_LIMIT = int(flush_work)


def set_threadgroup_memory_limit(limit_bytes: int) -> None:
    """Threadgroup memory available per threadgroup on this GPU (forgets earlier probe results)."""
    global THREADGROUP_MEMORY_LIMIT
    THREADGROUP_MEMORY_LIMIT = int(limit_bytes)
    _PROBED.clear()


def _mps_compile(source: str):
    if not hasattr(torch, "mps") or not hasattr(torch.mps, "compile_shader"):
        raise RuntimeError(f"torch {torch.__version__} has no torch.mps.compile_shader (needs PyTorch >= 2.7)")
    return torch.mps.compile_shader(source)


_compiler: Callable[[str], Any] = _mps_compile
_LIBS: dict[str, Any] = {}
_ERRORS: dict[str, str] = {}
_PROBED: dict = {}
_LOCK = threading.Lock()


def set_compiler(compile_fn: Optional[Callable[[str], Any]]) -> None:
    """Use another shader compiler (``None`` restores ``torch.mps.compile_shader``) and forget compiled
    libraries. The tests pass the CPU emulator here."""
    global _compiler
    with _LOCK:
        _compiler = compile_fn or _mps_compile
        _LIBS.clear()
        _ERRORS.clear()
        _PROBED.clear()


def shader_source(name: str) -> str:
    """The MSL text of one of the package's ``.metal`` files."""
    return resources.files(__package__).joinpath(_SOURCES[name]).read_text(encoding="utf-8")


def library(name: str):
    """The compiled library for ``name`` (compiled on first use, then cached; failures are cached too)."""
    with _LOCK:
        if name in _LIBS:
            return _LIBS[name]
        if name in _ERRORS:
            raise RuntimeError(_ERRORS[name])
        try:
            lib = _compiler(shader_source(name))
        except Exception as e:  # any compiler/driver failure makes the backend unavailable, with the reason
            _ERRORS[name] = f"compiling backends/metal/{_SOURCES[name]} failed: {type(e).__name__}: {e}"
            raise RuntimeError(_ERRORS[name]) from e
        _LIBS[name] = lib
        return lib


def _kernel(lib, name: str):
    try:
        return getattr(lib, name)
    except Exception:  # torch raises its own error type for unknown kernel names
        return None


def _kernel_for(lib_name: str, stem: str, dtype: torch.dtype):
    """(kernel, compute dtype). bf16 kernels need Metal 3.1; without them bf16 runs through the fp32 kernel."""
    lib = library(lib_name)
    kernel = _kernel(lib, f"{stem}_{_SUFFIX[dtype]}")
    if kernel is None and dtype == torch.bfloat16:
        return _kernel(lib, f"{stem}_f32"), torch.float32
    if kernel is None:
        raise RuntimeError(f"kernel {stem}_{_SUFFIX[dtype]} is missing from backends/metal/{_SOURCES[lib_name]}")
    return kernel, dtype


def _flush(device: torch.device) -> None:
    synchronize(device)


class _WorkMeter:
    """Counts worst-case work of consecutive launches and flushes the stream when it passes the limit."""

    def __init__(self, device: torch.device):
        self.device, self.pending = device, 0

    def add(self, work: int) -> None:
        if self.pending and self.pending + work > FLUSH_WORK_LIMIT:
            _flush(self.device)
            self.pending = 0
        self.pending += work


def _check_group_size(kernel, needed: int, name: str) -> None:
    limit = getattr(kernel, "max_threads_per_threadgroup", needed)
    if limit < needed:
        raise RuntimeError(f"Metal kernel {name} allows {limit} threads per threadgroup on this GPU but needs "
                           f"{needed}")


def _check_threadgroup_memory(kernel, declared: int, name: str) -> None:
    """The kernel's threadgroup memory (as Metal reports it when torch exposes it, else what the source
    declares) must fit the GPU's limit, or the launch fails or corrupts results."""
    used = max(int(getattr(kernel, "static_thread_group_memory_length", 0) or 0), declared)
    if used > THREADGROUP_MEMORY_LIMIT:
        raise RuntimeError(f"Metal kernel {name} needs {used} bytes of threadgroup memory but this GPU allows "
                           f"{THREADGROUP_MEMORY_LIMIT}")


def _probe_for(lib_name: str, stem: str, threads: int, memory: int = 0) -> Callable[[torch.device], Optional[str]]:
    """A registry probe: None when the library compiles and its kernel fits (threads and threadgroup memory),
    else the reason (cached, because the registry asks on every call)."""
    def probe(device: torch.device) -> Optional[str]:
        key = (lib_name, _compiler)
        if key not in _PROBED:
            try:
                kernel, _ = _kernel_for(lib_name, stem, torch.float32)
                _check_group_size(kernel, threads, f"{stem}_f32")
                _check_threadgroup_memory(kernel, memory, f"{stem}_f32")
                _PROBED[key] = None
            except Exception as e:
                _PROBED[key] = str(e)
        return _PROBED[key]

    return probe


# ---------------------------------------------------------------------------------------------------------------
# sparse convolution
# ---------------------------------------------------------------------------------------------------------------
def conv_row_order(nmap: NeighborMap) -> dict:
    """Rows ordered by their neighbour bit masks (rows with the same offsets share tiles, so whole offsets are
    skipped per tile) and the neighbour table as int32 in that order."""
    table = nmap.table
    k = table.shape[1]
    if k <= 31:  # int32 masks: the widest integer type every MPS op here supports
        bits = torch.ones(k, dtype=torch.int32, device=table.device) << torch.arange(k, dtype=torch.int32,
                                                                                      device=table.device)
        masks = ((table >= 0).to(torch.int32) * bits).sum(dim=1, dtype=torch.int32)
        try:
            order = torch.argsort(masks, stable=True)  # keeps spatial order within a mask: better locality
        except RuntimeError:  # a stable sort is only a locality nicety
            order = torch.argsort(masks)
    else:
        order = torch.arange(table.shape[0], device=table.device)
    return {"order": order.to(torch.int32).contiguous(), "table": table[order].to(torch.int32).contiguous()}


def conv_launches(n_rows: int, cin: int, cout: int, k_vol: int) -> list[tuple[int, int]]:
    """(first row tile, row tiles) of each launch, each bounded by :data:`LAUNCH_WORK_LIMIT`."""
    tiles = -(-n_rows // CONV_TILE_ROWS)
    per_tile = CONV_TILE_ROWS * k_vol * cin * max(cout, 1)
    step = max(1, LAUNCH_WORK_LIMIT // per_tile)
    return [(t, min(step, tiles - t)) for t in range(0, tiles, step)]


def metal_sparse_conv3d(feats: torch.Tensor, coords: torch.Tensor, weight: torch.Tensor,
                        bias: Optional[torch.Tensor] = None, nmap: Optional[NeighborMap] = None) -> torch.Tensor:
    """Submanifold convolution (see ``backends.sparse_conv3d``) with the implicit-GEMM Metal kernel."""
    k = weight.shape[1]
    nmap = nmap if nmap is not None else _neighbor_map(coords, k)
    kernel, work = _kernel_for("sparse_conv", "sparse_conv", feats.dtype)
    n, cin = feats.shape
    cout, k_vol = weight.shape[0], k ** 3
    prep = nmap.extra("metal_conv_order", conv_row_order)
    x = feats.to(work).contiguous()
    w = weight.to(work).contiguous()  # [Cout, k, k, k, Cin] is read as [Cout, K, Cin]: no permute
    b = bias.to(work).contiguous() if bias is not None else w  # any buffer; has_bias=0 keeps it unread
    out = torch.empty((n, cout), dtype=work, device=feats.device)
    col_tiles = -(-cout // CONV_TILE_COLS)
    gx, gy = CONV_GROUP
    meter = _WorkMeter(feats.device)
    for tile0, tiles in conv_launches(n, cin, cout, k_vol):
        meter.add(tiles * CONV_TILE_ROWS * k_vol * cin * cout)
        kernel(x, prep["table"], prep["order"], w, b, out, n, cin, cout, k_vol, int(bias is not None), tile0,
               threads=[gx * col_tiles, gy * tiles], group_size=[gx, gy])
    return out if work == feats.dtype else out.to(feats.dtype)


# ---------------------------------------------------------------------------------------------------------------
# varlen attention
# ---------------------------------------------------------------------------------------------------------------
def attention_launches(n_seq: int, max_q: int, max_k: int, heads: int, d: int, dv: int) -> list[tuple]:
    """(first query tile, query tiles, first sequence, sequences) of each launch, bounded in worst-case work."""
    q_tiles = max(1, -(-max_q // ATTN_TILE_Q))
    per_tile = ATTN_TILE_Q * heads * max(max_k, 1) * (d + dv)
    tiles_per_launch = max(1, LAUNCH_WORK_LIMIT // per_tile)
    if q_tiles <= tiles_per_launch:
        seqs = max(1, tiles_per_launch // q_tiles)
        return [(0, q_tiles, s, min(seqs, n_seq - s)) for s in range(0, n_seq, seqs)]
    return [(t, min(tiles_per_launch, q_tiles - t), s, 1)
            for s in range(n_seq) for t in range(0, q_tiles, tiles_per_launch)]


def metal_varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """Flash-style varlen attention (see ``backends.varlen_attention``); head dims above 128 use SDPA."""
    if q.shape[-1] > ATTN_MAX_HEAD_DIM or v.shape[-1] > ATTN_MAX_HEAD_DIM:
        from ..attn import sdpa_varlen_attention

        return sdpa_varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, scale)
    kernel, work = _kernel_for("varlen_attention", "varlen_attention", q.dtype)
    heads, d, dv = q.shape[1], q.shape[2], v.shape[2]
    qc, kc, vc = (t.to(work).contiguous() for t in (q, k, v))
    cq = cu_q.to(torch.int32).contiguous()
    ck = cu_k.to(torch.int32).contiguous()
    out = torch.empty((q.shape[0], heads, dv), dtype=work, device=q.device)
    n_seq = cq.numel() - 1
    meter = _WorkMeter(q.device)
    for tile0, tiles, seq0, seqs in attention_launches(n_seq, max_q, max_k, heads, d, dv):
        meter.add(tiles * seqs * ATTN_TILE_Q * heads * max(max_k, 1) * (d + dv))
        kernel(qc, kc, vc, cq, ck, out, heads, d, dv, float(scale), tile0, seq0,
               threads=[ATTN_THREADS * tiles, heads, seqs], group_size=[ATTN_THREADS, 1, 1])
    return out if work == q.dtype else out.to(q.dtype)


def metal_dense_attention(q, k, v, scale):
    """Dense [B, L, H, D] attention through the varlen kernel (equal lengths)."""
    b, lq, lk = q.shape[0], q.shape[1], k.shape[1]
    cu_q = torch.arange(0, (b + 1) * lq, lq, device=q.device, dtype=torch.int32)
    cu_k = torch.arange(0, (b + 1) * lk, lk, device=q.device, dtype=torch.int32)
    out = metal_varlen_attention(q.reshape(b * lq, *q.shape[2:]), k.reshape(b * lk, *k.shape[2:]),
                                 v.reshape(b * lk, *v.shape[2:]), cu_q, cu_k, lq, lk, scale)
    return out.reshape(b, lq, q.shape[2], -1)


_conv_probe = _probe_for("sparse_conv", "sparse_conv", CONV_GROUP[0] * CONV_GROUP[1], CONV_THREADGROUP_BYTES)
_attn_probe = _probe_for("varlen_attention", "varlen_attention", ATTN_THREADS, ATTN_THREADGROUP_BYTES)

register(Family.SPARSE_CONV, "metal", devices=("mps",), dtypes=DTYPES, probe=_conv_probe, priority=30,
         warn_when_skipped=True)(metal_sparse_conv3d)
register(Family.SPARSE_ATTN, "metal", devices=("mps",), dtypes=DTYPES, probe=_attn_probe, priority=30,
         warn_when_skipped=True)(metal_varlen_attention)
# Dense attention: MPS's own SDPA (priority 10) stays the automatic choice; `ATTN_BACKEND=metal` selects this.
register(Family.ATTN, "metal", devices=("mps",), dtypes=DTYPES, probe=_attn_probe, priority=-10)(
    metal_dense_attention)


def _apply_environment_settings() -> None:
    """The watchdog and threadgroup-memory settings of the registry's environment table (read there)."""
    launch, flush = env_value("SAM3D_METAL_LAUNCH_WORK"), env_value("SAM3D_METAL_FLUSH_WORK")
    if launch or flush:
        set_launch_limits(int(float(launch)) if launch else None, int(float(flush)) if flush else None)
    memory = env_value("SAM3D_METAL_THREADGROUP_MEMORY")
    if memory:
        set_threadgroup_memory_limit(int(memory))


_apply_environment_settings()
