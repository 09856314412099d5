"""Triton fast path for CUDA: a fused submanifold sparse convolution (sparse-conv backend ``"triton"``).

The kernel is an implicit GEMM: each program owns a tile of output rows and output channels, walks the kernel
offsets, gathers the neighbour rows of its tile straight from ``feats`` through the neighbour table and multiplies
them with the offset's weight slice in registers (``tl.dot``), accumulating in fp32. The ``N x k^3 x Cin`` gather
is never written to memory, and there is one launch per layer.

Offsets that no row of a tile uses are skipped. To make that common, rows are processed in the order of their
neighbour bit masks (the set of offsets present), so a tile holds rows with the same few offsets: on a surface a
voxel has about 9 of 27 neighbours, so a tile costs about a third of the dense implicit GEMM. The order, the
permuted table and the per-tile lists of used offsets are built once per neighbour map and cached on it, so
layers sharing a map share them.

The same kernel runs in Triton's interpreter on CPU tensors (tests/test_triton_interpret.py), which is how its
indexing is checked on machines without a GPU.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..hashing import NeighborMap, neighbor_map as _neighbor_map
from .. import triton_jit
from ..registry import Family, register

try:  # the module must import without triton, so `python -m backends` can say why the backend is unavailable
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) tried once per layer shape on CUDA; the fastest is kept.
_CONFIGS = (
    (64, 64, 32, 4, 3),
    (128, 64, 32, 4, 3),
    (64, 128, 32, 4, 3),
    (128, 128, 32, 8, 3),
    (64, 32, 32, 2, 4),
)
_INTERPRET_CONFIG = (32, 32, 16, 1, 1)
# Process rows grouped by neighbour mask (fewer offsets per tile) rather than in the caller's (spatial) order
# (better gather locality). Module-level so benchmarks/cuda_check.py can time both on the device.
SORT_ROWS_BY_MASK = True


def _subm_conv_kernel(feats_ptr, table_ptr, perm_ptr, active_ptr, n_active_ptr, weight_ptr, bias_ptr, out_ptr,
                      N, CIN, COUT, K,
                      HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, DOT_IN_F32: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      STATIC_STEPS: tl.constexpr = 0):
    """out[perm[r], n] = bias[n] + sum_k sum_c feats[table[r, k], c] * W[n, k, c] for the rows r of this tile
    (``table`` is already in ``perm`` order; ``W`` is spconv's weight viewed as [Cout, K, Cin]).

    The tile visits only its active offsets (``active[tile, :n_active[tile]]``) in one flat loop over
    (offset, channel slice), which Triton software-pipelines: the gathers of the next steps are in flight while
    the current step multiplies.

    ``STATIC_STEPS`` > 0 (interpreters that cannot loop to a loaded bound, see
    ``triton_jit.interpreter_takes_runtime_loop_bounds``): the loop runs that many steps (every offset of the
    tile's list) and the steps past the tile's count are masked out, which computes the same sums. GPU kernels
    are compiled with 0."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    table_rows = table_ptr + rows.to(tl.int64) * K
    out_rows = tl.load(perm_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < COUT
    w_cols = weight_ptr + cols[None, :].to(tl.int64) * (K * CIN)
    chans = tl.arange(0, BLOCK_K)
    # tl.zeros and tl.cdiv are @jit helpers that Triton's interpreter cannot call; these are builtins.
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    n_chunks = (CIN + BLOCK_K - 1) // BLOCK_K
    steps = tl.load(n_active_ptr + pid_m) * n_chunks
    for step in range(0, steps if STATIC_STEPS == 0 else STATIC_STEPS):
        j = step // n_chunks
        c = (step - j * n_chunks) * BLOCK_K + chans
        k = tl.load(active_ptr + pid_m * K + j)
        nbr = tl.load(table_rows + k, mask=row_ok, other=-1)
        present = nbr >= 0
        if STATIC_STEPS > 0:  # (a [1] tensor: Triton 3.9's interpreter mis-types a Python-int comparison mask)
            present = present & (tl.full((1,), step, tl.int32) < steps)
        src = tl.where(present, nbr, 0).to(tl.int64) * CIN
        c_ok = c < CIN
        a = tl.load(feats_ptr + src[:, None] + c[None, :], mask=present[:, None] & c_ok[None, :], other=0.0)
        w = tl.load(w_cols + k * CIN + c[:, None], mask=c_ok[:, None] & col_ok[None, :], other=0.0)
        if DOT_IN_F32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + out_rows[:, None] * COUT + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def _kernel(interpret: bool):
    # N (the voxel count) changes with every object and only bounds the rows
    return triton_jit.kernel(_subm_conv_kernel, interpret, do_not_specialize=["N"])


# ---------------------------------------------------------------------------------------------------------------
# per-map preparation (cached on the NeighborMap)
# ---------------------------------------------------------------------------------------------------------------
def _row_order(nmap: NeighborMap) -> dict:
    """Rows sorted by their neighbour bit mask, and the neighbour table (int32) in that order."""
    table = nmap.table
    k = table.shape[1]
    if k <= 62 and SORT_ROWS_BY_MASK:
        weights = torch.ones(k, dtype=torch.int64, device=table.device) << torch.arange(k, device=table.device)
        masks = ((table >= 0).to(torch.int64) * weights).sum(dim=1)
        perm = torch.argsort(masks, stable=True)  # stable: rows keep their spatial order within a mask
    else:
        perm = torch.arange(table.shape[0], device=table.device)
    return {"perm": perm.to(torch.int32).contiguous(), "table": table[perm].to(torch.int32).contiguous()}


def _tile_offsets(nmap: NeighborMap, block_m: int) -> dict:
    """Per tile of ``block_m`` rows (in mask order): the offsets some row of the tile uses, ascending, padded
    (``active`` int32 [tiles, K]), and how many there are (``count`` int32 [tiles])."""
    table = nmap.extra(("triton_order", SORT_ROWS_BY_MASK), _row_order)["table"]
    n, k = table.shape
    tiles = -(-n // block_m)
    padded = torch.full((tiles * block_m, k), -1, dtype=table.dtype, device=table.device)
    padded[:n] = table
    used = (padded.view(tiles, block_m, k) >= 0).any(dim=1)
    # a stable sort of "unused" puts the used offsets first, still in ascending order
    active = torch.argsort((~used).to(torch.int8), dim=1, stable=True).to(torch.int32).contiguous()
    return {"active": active, "count": used.sum(dim=1).to(torch.int32).contiguous()}


def _precision(dtype: torch.dtype, interpret: bool = False) -> str:
    """fp32 follows torch's own matmul switch, so `allow_tf32` means the same thing for every backend. Without
    it, fp32 runs as "tf32x3" on GPUs: each operand is split into a high and a low tf32 part and three tensor-core
    products are summed, which keeps fp32-level error (~1e-6 relative) at a fraction of the cost of the FMA-only
    "ieee" path. The interpreter has no tensor cores to emulate, so it computes "ieee"."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee" if interpret else "tf32x3"
    return "tf32"


def _launch(feats, weight, bias, nmap, out, config, interpret: bool) -> None:
    block_m, block_n, block_k, warps, stages = config
    n, cin = feats.shape
    cout = weight.shape[0]
    order = nmap.extra(("triton_order", SORT_ROWS_BY_MASK), _row_order)
    tiles = nmap.extra(("triton_tiles", block_m, SORT_ROWS_BY_MASK), lambda m: _tile_offsets(m, block_m))
    k = order["table"].shape[1]
    grid = (triton.cdiv(n, block_m), triton.cdiv(cout, block_n))
    extra = {} if interpret else {"num_warps": warps, "num_stages": stages}
    _kernel(interpret)[grid](
        feats, order["table"], order["perm"], tiles["active"], tiles["count"], weight,
        bias if bias is not None else weight, out, n, cin, cout, k,
        HAS_BIAS=bias is not None, PRECISION=_precision(feats.dtype, interpret),
        # Triton 3.9's interpreter multiplies bf16 tiles as raw integers; upcasting there keeps the CPU check
        # meaningful. GPUs multiply bf16 natively.
        DOT_IN_F32=interpret and feats.dtype == torch.bfloat16,
        STATIC_STEPS=_static_steps(interpret, k, cin, block_k),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **extra)


def _static_steps(interpret: bool, k: int, cin: int, block_k: int) -> int:
    """0 (loop to each tile's own step count), or every (offset, channel slice) step where the interpreter
    cannot loop to a loaded bound (Triton 3.6 with NumPy >= 2.4)."""
    if not interpret or triton_jit.interpreter_takes_runtime_loop_bounds():
        return 0
    return k * -(-cin // block_k)


def _fits(config, cin: int, cout: int) -> bool:
    _, block_n, block_k, _, _ = config
    return block_n <= max(32, triton.next_power_of_2(cout)) and block_k <= max(16, triton.next_power_of_2(cin))


_TUNED: dict = {}
_TUNING_FILE = "triton_sparse_conv_tilings.json"


def _tuning_path():
    from ..registry import cache_dir
    return cache_dir() / _TUNING_FILE


def _disk_fields(key: tuple) -> list:
    """The tuning key as text fields, with the GPU's name instead of its index and the Triton version: a file
    written on one machine is only read back for the same GPU model and compiler. Field 6 is the row-count class."""
    cin, cout, dtype, precision, bits, device, by_mask = key
    return [str(v) for v in (torch.cuda.get_device_name(device), triton.__version__, cin, cout, dtype, precision,
                             bits, by_mask, _CONFIGS)]


def _disk_key(key: tuple) -> str:
    return "|".join(_disk_fields(key))


_BITS_FIELD = 6


# Tilings measured on the GPUs this project was benchmarked on (same key format), shipped so that a cold first
# run compiles one tiling per layer shape instead of timing all of them. The user's own file wins.
SHIPPED_TILINGS = "triton_tilings.json"


def _shipped_path():
    from pathlib import Path
    return Path(__file__).with_name(SHIPPED_TILINGS)


def _read_tilings(path) -> dict:
    import json
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def _valid(config) -> Optional[tuple]:
    return tuple(config) if isinstance(config, list) and tuple(config) in _CONFIGS else None


def _load_tuned(key: tuple) -> Optional[tuple]:
    """A tiling timed by an earlier process or shipped for this GPU model, so the first run of a fresh process
    skips the timing: the exact layer shape and row-count class first (the user's file, then the shipped one),
    else the shipped tiling of the same layer shape measured at the nearest row count (tilings change little
    between neighbouring sizes, and the object decides the row count)."""
    fields = _disk_fields(key)
    shipped = _read_tilings(_shipped_path())
    for table in (_read_tilings(_tuning_path()), shipped):
        config = _valid(table.get("|".join(fields)))
        if config:
            return config
    same_layer = []
    for other, config in shipped.items():
        parts = other.split("|")
        if len(parts) == len(fields) and _valid(config) and parts[:_BITS_FIELD] == fields[:_BITS_FIELD] \
                and parts[_BITS_FIELD + 1:] == fields[_BITS_FIELD + 1:] and parts[_BITS_FIELD].isdigit():
            same_layer.append((abs(int(parts[_BITS_FIELD]) - key[4]), _valid(config)))
    return min(same_layer)[1] if same_layer else None


def _store_tuned(key: tuple, config: tuple) -> None:
    """Adds one tiling to the file (written to a temporary name and renamed: readers never see half a file);
    a read-only or missing cache folder only costs the timing in the next process."""
    import json
    import os
    path = _tuning_path()
    table = _read_tilings(path)
    table[_disk_key(key)] = list(config)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=0, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass


def _pick_config(feats, weight, bias, nmap, out) -> tuple:
    """Fastest of the candidate tilings for this layer shape, timed once per GPU model, layer shape and Triton
    version, and kept on disk (``backends.registry.cache_dir``) for later processes."""
    n, cin = feats.shape
    cout = weight.shape[0]
    key = (cin, cout, feats.dtype, _precision(feats.dtype), max(n, 1).bit_length(), feats.device,
           SORT_ROWS_BY_MASK)
    if key in _TUNED:
        return _TUNED[key]
    stored = _load_tuned(key)
    if stored is not None:
        _TUNED[key] = stored
        return stored
    candidates = [c for c in _CONFIGS if _fits(c, cin, cout)] or [_CONFIGS[0]]
    best, best_ms = candidates[0], float("inf")
    for config in candidates:
        try:
            ms = _time_launch(feats, weight, bias, nmap, out, config)
        except Exception:  # a tiling that does not compile for this GPU (e.g. shared memory) is simply skipped
            continue
        if ms < best_ms:
            best, best_ms = config, ms
    _TUNED[key] = best
    if best_ms < float("inf"):
        _store_tuned(key, best)
    return best


def _time_launch(feats, weight, bias, nmap, out, config, reps: int = 5) -> float:
    for _ in range(2):
        _launch(feats, weight, bias, nmap, out, config, interpret=False)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        _launch(feats, weight, bias, nmap, out, config, interpret=False)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def triton_sparse_conv3d(feats: torch.Tensor, coords: torch.Tensor, weight: torch.Tensor,
                         bias: Optional[torch.Tensor] = None, nmap: Optional[NeighborMap] = None,
                         config: Optional[tuple] = None) -> torch.Tensor:
    """Submanifold convolution (see ``backends.sparse_conv3d``) as one fused Triton kernel.

    On CUDA tensors the tiling is tuned once per layer shape; on CPU tensors Triton's interpreter runs the same
    kernel (for tests). ``config`` = (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) forces a tiling.
    """
    if triton is None:
        raise RuntimeError("the 'triton' sparse-conv backend needs the triton package; pip install triton")
    k = weight.shape[1]
    nmap = nmap if nmap is not None else _neighbor_map(coords, k)
    feats = feats.contiguous()
    weight = weight.to(feats.dtype).contiguous()  # [Cout, k, k, k, Cin] read as [Cout, K, Cin]: no copy
    bias = bias.to(feats.dtype).contiguous() if bias is not None else None
    out = torch.empty((feats.shape[0], weight.shape[0]), dtype=feats.dtype, device=feats.device)
    if feats.shape[0] == 0:
        return out
    interpret = feats.device.type == "cpu"
    if config is None:
        config = _INTERPRET_CONFIG if interpret else _pick_config(feats, weight, bias, nmap, out)
    _launch(feats, weight, bias, nmap, out, config, interpret)
    return out


# Below spconv (20), above torchsparse (10): picked on CUDA when spconv is absent.
register(Family.SPARSE_CONV, "triton", devices=("cuda",), dtypes=DTYPES, requires=("triton",),
         probe=triton_jit.cuda_probe(triton), priority=15)(triton_sparse_conv3d)
