"""The Metal kernels (backends/metal/*.metal), compiled as C++ with a shim and run on the CPU over their grid
(tests/metal_emulator), against float64 references; and the Python dispatch (argument order, grid and group
sizes, dtype casts, launch splitting, caching, fallback when compilation fails) against the same emulator.
The only part of the Metal path not exercised here is Apple's shader compiler itself.
"""
from __future__ import annotations

import math
import sys
import uuid
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import metal_emulator  # noqa: E402

if metal_emulator.compiler() is None:
    pytest.skip("no C++ compiler (g++) to build the Metal emulator", allow_module_level=True)

import backends  # noqa: E402
from backends import metal  # noqa: E402
from backends.attn import metal as metal_attn  # noqa: E402
from backends.sparse_conv import metal as metal_conv  # noqa: E402
from backends.registry import Family, resolve  # noqa: E402


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("metal_emu")


@pytest.fixture
def emulated(workdir):
    """Route backends.metal's shader compilation to the CPU emulator for one test."""
    compiled = []

    def compile_fn(source):
        compiled.append(source)
        return metal_emulator.compile_shader(source, workdir)

    metal.set_compiler(compile_fn)
    yield compiled
    metal.set_compiler(None)


def libs():
    return metal.library("sparse_conv"), metal.library("varlen_attention")


# ---------------------------------------------------------------------------------------------------------------
# references
# ---------------------------------------------------------------------------------------------------------------
def random_coords(n: int, extent: int, batches: int, gen: torch.Generator) -> torch.Tensor:
    xyz = torch.randint(0, extent, (n * 2, 3), generator=gen)
    b = torch.randint(0, batches, (n * 2, 1), generator=gen)
    c = torch.unique(torch.cat([b, xyz], 1), dim=0)
    c = c[torch.randperm(c.shape[0], generator=gen)[:n]]
    return c.to(torch.int32)


def conv_reference(feats, coords, weight, bias):
    k = weight.shape[1]
    r = k // 2
    index = {tuple(c): i for i, c in enumerate(coords.tolist())}
    f, w = feats.double(), weight.double()
    out = torch.zeros(feats.shape[0], weight.shape[0], dtype=torch.float64)
    for i, (b, x, y, z) in enumerate(coords.tolist()):
        for kx in range(k):
            for ky in range(k):
                for kz in range(k):
                    j = index.get((b, x + kx - r, y + ky - r, z + kz - r))
                    if j is not None:
                        out[i] += w[:, kx, ky, kz, :] @ f[j]
    return out + (bias.double() if bias is not None else 0)


def attention_reference(q, k, v, lq, lk, scale):
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
    qs = ks = 0
    for a, b in zip(lq, lk):
        if a and b:
            s = torch.einsum("qhd,khd->hqk", q[qs:qs + a].double(), k[ks:ks + b].double()) * scale
            out[qs:qs + a] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v[ks:ks + b].double())
        qs, ks = qs + a, ks + b
    return out


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def rel_err(out, ref):
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,cin,cout,with_bias", [
    (torch.float32, 19, 70, True),     # Cin not a multiple of the 16-channel slice, Cout spans a partial tile
    (torch.float16, 16, 64, False),    # exact tiles
    (torch.bfloat16, 5, 3, True),      # tiny channel counts
])
def test_conv_kernel_matches_float64(emulated, dtype, cin, cout, with_bias):
    gen = torch.Generator().manual_seed(cin + cout)
    coords = random_coords(101, 6, 2, gen)  # 101 rows: the last 32-row tile is partial
    feats = torch.randn(coords.shape[0], cin, generator=gen).to(dtype)
    weight = (torch.randn(cout, 3, 3, 3, cin, generator=gen) / math.sqrt(9 * cin)).to(dtype)
    bias = torch.randn(cout, generator=gen).to(dtype) if with_bias else None
    out = metal_conv.metal_sparse_conv3d(feats, coords, weight, bias, backends.neighbor_map(coords, 3))
    assert out.dtype == dtype and out.shape == (coords.shape[0], cout)
    assert torch.isfinite(out.float()).all()  # guard bytes are NaN: an out-of-bounds read would show here
    assert rel_err(out, conv_reference(feats, coords, weight, bias)) < TOL[dtype]


def test_conv_kernel_skips_offsets_per_tile_and_keeps_row_order(emulated):
    """A dense block (all 27 offsets) next to isolated voxels (centre only): rows are reordered by neighbour
    mask inside the kernel's tiles, and results must land back on the caller's rows."""
    gen = torch.Generator().manual_seed(3)
    block = torch.stack(torch.meshgrid(*[torch.arange(4)] * 3, indexing="ij"), -1).reshape(-1, 3)
    lonely = torch.tensor([[20, 20, 20], [30, 2, 9], [11, 25, 3], [40, 40, 1]])
    xyz = torch.cat([lonely[:2], block, lonely[2:]])
    coords = torch.cat([torch.zeros(xyz.shape[0], 1, dtype=torch.long), xyz], 1).to(torch.int32)
    feats = torch.randn(coords.shape[0], 8, generator=gen)
    weight = torch.randn(6, 3, 3, 3, 8, generator=gen)
    out = metal_conv.metal_sparse_conv3d(feats, coords, weight, None, None)
    ref = conv_reference(feats, coords, weight, None)
    assert rel_err(out, ref) < 1e-5
    centre = weight[:, 1, 1, 1, :]
    for row in (0, 1, coords.shape[0] - 1):
        assert torch.allclose(out[row], centre @ feats[row], rtol=1e-5, atol=1e-5)


def test_conv_kernel_size_five(emulated):
    """125 offsets: more than fit in the per-tile offset masks, so rows keep their order. (Kernel size 1 never
    reaches a backend: sparse_conv3d runs it as spconv's plain matmul.)"""
    gen = torch.Generator().manual_seed(5)
    coords = random_coords(40, 5, 1, gen)
    feats = torch.randn(coords.shape[0], 6, generator=gen)
    weight = torch.randn(7, 5, 5, 5, 6, generator=gen)
    out = metal_conv.metal_sparse_conv3d(feats, coords, weight, None, backends.neighbor_map(coords, 5))
    assert rel_err(out, conv_reference(feats, coords, weight, None)) < 1e-5


@pytest.mark.parametrize("dtype,d,dv", [
    (torch.float32, 40, 24),    # head dims that are not tile multiples, D != Dv
    (torch.float16, 64, 64),
    (torch.bfloat16, 128, 128),  # the largest head dim the kernel handles
])
def test_attention_kernel_matches_float64(emulated, dtype, d, dv):
    gen = torch.Generator().manual_seed(d + dv)
    lq = [5, 0, 37, 16, 3]    # an empty query range, ragged and exact tiles
    lk = [33, 4, 70, 0, 1]    # key ranges across tile edges, one sequence without keys
    heads = 2
    q = torch.randn(sum(lq), heads, d, generator=gen).to(dtype)
    k = torch.randn(sum(lk), heads, d, generator=gen).to(dtype)
    v = torch.randn(sum(lk), heads, dv, generator=gen).to(dtype)
    cu_q = torch.tensor([0] + lq).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lk).cumsum(0).to(torch.int32)
    scale = 1.0 / math.sqrt(d)
    out = metal_attn.metal_varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), scale)
    assert out.dtype == dtype and out.shape == (sum(lq), heads, dv)
    assert torch.isfinite(out.float()).all()
    ref = attention_reference(q, k, v, lq, lk, scale)
    assert rel_err(out, ref) < TOL[dtype]
    no_keys = slice(sum(lq[:3]), sum(lq[:4]))
    assert bool((out[no_keys] == 0).all()), "queries without keys must get zeros, as flash_attn"


def test_attention_kernel_large_scores_stay_finite(emulated):
    """Online softmax must subtract running maxima: scores around 300 overflow exp() otherwise."""
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(20, 1, 16, generator=gen) * 10
    k = q.clone() + 0.01 * torch.randn(20, 1, 16, generator=gen)
    v = torch.randn(20, 1, 16, generator=gen)
    cu = torch.tensor([0, 20], dtype=torch.int32)
    out = metal_attn.metal_varlen_attention(q, k, v, cu, cu, 20, 20, 1.0)
    assert rel_err(out, attention_reference(q, k, v, [20], [20], 1.0)) < 1e-5


# ---------------------------------------------------------------------------------------------------------------
# dispatch
# ---------------------------------------------------------------------------------------------------------------
def test_conv_dispatch_grid_groups_and_arguments(emulated):
    conv_lib, _ = libs()
    conv_lib.calls.clear()
    gen = torch.Generator().manual_seed(1)
    coords = random_coords(70, 5, 1, gen)
    n = coords.shape[0]
    feats = torch.randn(n, 12, generator=gen, dtype=torch.float16)
    weight = torch.randn(130, 3, 3, 3, 12, generator=gen, dtype=torch.float16)
    metal_conv.metal_sparse_conv3d(feats, coords, weight, None, None)
    (call,) = conv_lib.calls
    assert call.kernel == "sparse_conv_f16"
    assert call.group_size == (16, 16, 1)
    assert call.threads == (16 * 3, 16 * math.ceil(n / 32), 1)  # 130 channels -> 3 column tiles of 64
    kinds = [a[0] for a in call.args]
    assert kinds == ["tensor"] * 6 + ["scalar"] * 6
    assert [a[1] for a in call.args[6:]] == [n, 12, 130, 27, 0, 0]
    assert call.args[1][1] == torch.int32 and call.args[2][1] == torch.int32


def test_conv_dispatch_splits_launches(emulated, monkeypatch):
    gen = torch.Generator().manual_seed(2)
    coords = random_coords(150, 6, 1, gen)
    feats = torch.randn(coords.shape[0], 4, generator=gen)
    weight = torch.randn(5, 3, 3, 3, 4, generator=gen)
    bias = torch.randn(5, generator=gen)
    whole = metal_conv.metal_sparse_conv3d(feats, coords, weight, bias, None)
    conv_lib, _ = libs()
    conv_lib.calls.clear()
    monkeypatch.setattr(metal, "LAUNCH_WORK_LIMIT", 2 * 32 * 27 * 4 * 5)  # two row tiles per launch
    split = metal_conv.metal_sparse_conv3d(feats, coords, weight, bias, None)
    tiles = math.ceil(coords.shape[0] / 32)
    assert len(conv_lib.calls) == math.ceil(tiles / 2)
    assert [c.args[11][1] for c in conv_lib.calls] == list(range(0, tiles, 2))  # tile0 of each launch
    assert torch.equal(whole, split)
    assert rel_err(split, conv_reference(feats, coords, weight, bias)) < 1e-5


def test_long_work_flushes_the_stream_between_launches(emulated, monkeypatch):
    flushes = []
    monkeypatch.setattr(metal, "_flush", lambda device: flushes.append(device))
    monkeypatch.setattr(metal, "LAUNCH_WORK_LIMIT", 32 * 27 * 4 * 5)      # one row tile per launch
    monkeypatch.setattr(metal, "FLUSH_WORK_LIMIT", 3 * 32 * 27 * 4 * 5)   # flush after every three launches
    gen = torch.Generator().manual_seed(12)
    coords = random_coords(200, 7, 1, gen)
    feats = torch.randn(coords.shape[0], 4, generator=gen)
    weight = torch.randn(5, 3, 3, 3, 4, generator=gen)
    out = metal_conv.metal_sparse_conv3d(feats, coords, weight, None, None)
    launches = math.ceil(coords.shape[0] / 32)
    assert len(flushes) == (launches - 1) // 3 and all(d == feats.device for d in flushes)
    assert rel_err(out, conv_reference(feats, coords, weight, None)) < 1e-5


def test_attention_dispatch_grid_and_split(emulated, monkeypatch):
    _, attn_lib = libs()
    gen = torch.Generator().manual_seed(4)
    lq, lk = [50, 7, 20], [30, 60, 9]
    heads, d = 3, 8
    q = torch.randn(sum(lq), heads, d, generator=gen)
    k = torch.randn(sum(lk), heads, d, generator=gen)
    v = torch.randn(sum(lk), heads, d, generator=gen)
    cu_q = torch.tensor([0] + lq).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lk).cumsum(0).to(torch.int32)
    attn_lib.calls.clear()
    whole = metal_attn.metal_varlen_attention(q, k, v, cu_q, cu_k, 50, 60, 0.3)
    (call,) = attn_lib.calls
    assert call.kernel == "varlen_attention_f32"
    assert call.threads == (128 * 4, heads, 3) and call.group_size == (128, 1, 1)  # ceil(50/16) query tiles
    assert call.args[9] == ("scalar", 0.3, 4)  # the scale is an fp32 scalar
    attn_lib.calls.clear()
    monkeypatch.setattr(metal, "LAUNCH_WORK_LIMIT", 16 * heads * 60 * 2 * d * 3)  # three query tiles a launch
    split = metal_attn.metal_varlen_attention(q, k, v, cu_q, cu_k, 50, 60, 0.3)
    assert len(attn_lib.calls) == 3 * 2  # per sequence: tiles 0-2, then tile 3
    assert torch.equal(whole, split)
    assert rel_err(split, attention_reference(q, k, v, lq, lk, 0.3)) < 1e-5


def test_bf16_runs_through_fp32_kernel_when_bfloat_is_unsupported(workdir):
    """Metal before 3.1 has no bfloat: the sources then compile without their bf16 kernels, and bf16 inputs are
    computed by the fp32 kernels and cast back."""
    def no_bfloat(source):
        return metal_emulator.compile_shader(source.replace("#if defined(__HAVE_BFLOAT__)", "#if 0"), workdir)

    metal.set_compiler(no_bfloat)
    try:
        gen = torch.Generator().manual_seed(6)
        coords = random_coords(30, 4, 1, gen)
        feats = torch.randn(coords.shape[0], 4, generator=gen).bfloat16()
        weight = torch.randn(3, 3, 3, 3, 4, generator=gen).bfloat16()
        out = metal_conv.metal_sparse_conv3d(feats, coords, weight, None, None)
        assert out.dtype == torch.bfloat16
        assert metal.library("sparse_conv").calls[-1].kernel == "sparse_conv_f32"
        assert rel_err(out, conv_reference(feats, coords, weight, None)) < TOL[torch.bfloat16]
    finally:
        metal.set_compiler(None)


def test_libraries_compile_once_per_process(emulated):
    gen = torch.Generator().manual_seed(8)
    coords = random_coords(20, 4, 1, gen)
    feats = torch.randn(coords.shape[0], 4, generator=gen)
    weight = torch.randn(2, 3, 3, 3, 4, generator=gen)
    for _ in range(3):
        metal_conv.metal_sparse_conv3d(feats, coords, weight, None, None)
    assert len(emulated) == 1 and "sparse_conv_implicit_gemm" in emulated[0]
    assert metal.library("sparse_conv") is metal.library("sparse_conv")


def test_sources_are_package_files():
    for name in ("sparse_conv", "varlen_attention"):
        text = metal.shader_source(name)
        assert "[[kernel]]" in text and "#include <metal_stdlib>" in text


# ---------------------------------------------------------------------------------------------------------------
# registry behaviour on MPS (the device type is all the registry looks at, so no Mac is needed)
# ---------------------------------------------------------------------------------------------------------------
def test_auto_picks_metal_on_mps_when_it_compiles(emulated):
    mps = torch.device("mps")
    assert resolve(Family.SPARSE_CONV, mps, torch.float16).name == "metal"
    assert resolve(Family.SPARSE_ATTN, mps, torch.float16).name == "metal"
    assert resolve(Family.ATTN, mps, torch.float16).name == "sdpa"  # MPS's own SDPA stays the dense default
    assert resolve(Family.SPARSE_CONV, torch.device("cpu"), torch.float32).name != "metal"


def test_compile_failure_falls_back_with_one_warning_and_explicit_request_fails():
    token = uuid.uuid4().hex[:8]

    def broken(source):
        raise RuntimeError(f"program_source:12: error: no bfloat here ({token})")

    metal.set_compiler(broken)
    try:
        mps = torch.device("mps")
        with pytest.warns(RuntimeWarning, match=f"metal.*{token}"):
            assert resolve(Family.SPARSE_CONV, mps, torch.float32).name == "torch"
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the second time is silent
            assert resolve(Family.SPARSE_CONV, mps, torch.float32).name == "torch"
        with pytest.warns(RuntimeWarning, match=token):
            assert resolve(Family.SPARSE_ATTN, mps, torch.float32).name == "sdpa"
        with backends.use(sparse="metal"):
            with pytest.raises(backends.BackendUnavailableError, match=f"compiling.*sparse_conv.metal.*{token}"):
                resolve(Family.SPARSE_CONV, mps, torch.float32)
    finally:
        metal.set_compiler(None)


# ---------------------------------------------------------------------------------------------------------------
# the emulator itself catches the mistakes it is there to catch
# ---------------------------------------------------------------------------------------------------------------
FAULTY = """
#include <metal_stdlib>
using namespace metal;

[[kernel]] void early_return(device float* x [[buffer(0)]], constant long& n [[buffer(1)]],
                             uint3 tid [[thread_position_in_threadgroup]],
                             uint3 tgid [[threadgroup_position_in_grid]],
                             uint3 tgsize [[threads_per_threadgroup]]) {
    threadgroup float shared[64];
    if (long(tid.x) >= n) return;  // lanes leave before the barrier: not allowed in Metal
    shared[tid.x] = x[tid.x];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    x[tid.x] = shared[n - 1 - tid.x];
}

[[kernel]] void reverse(device float* x [[buffer(0)]], constant long& n [[buffer(1)]],
                        uint3 tid [[thread_position_in_threadgroup]],
                        uint3 tgid [[threadgroup_position_in_grid]],
                        uint3 tgsize [[threads_per_threadgroup]]) {
    threadgroup float shared[64];
    const bool live = long(tid.x) < n;
    shared[tid.x] = live ? x[tid.x] : 0.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (live) x[tid.x] = shared[n - 1 - tid.x];
}

[[kernel]] void unbounded(device float* x [[buffer(0)]], constant long& n [[buffer(1)]],
                          uint3 tid [[thread_position_in_threadgroup]],
                          uint3 tgid [[threadgroup_position_in_grid]],
                          uint3 tgsize [[threads_per_threadgroup]]) {
    x[tgid.x * tgsize.x + tid.x] = 1.0f;  // forgets to compare with n
}
"""


def test_emulator_runs_barriers_and_reports_kernel_mistakes(workdir):
    lib = metal_emulator.compile_shader(FAULTY, workdir)
    x = torch.arange(16, dtype=torch.float32)
    lib.reverse(x, 16, threads=[64], group_size=[64])
    assert torch.equal(x, torch.arange(16, dtype=torch.float32).flip(0))
    with pytest.raises(RuntimeError, match="threadgroup_barrier was not reached by every thread"):
        lib.early_return(torch.arange(16, dtype=torch.float32), 16, threads=[64], group_size=[64])
    with pytest.raises(RuntimeError, match="wrote outside argument 0"):
        lib.unbounded(torch.zeros(10), 10, threads=[64], group_size=[64])
    with pytest.raises(RuntimeError, match="8-byte scalar but 4 bytes"):
        lib.reverse(x, 16.0, threads=[64], group_size=[64])  # a float where the kernel reads a long
    with pytest.raises(RuntimeError, match="expects a buffer"):
        lib.reverse(16, x, threads=[64], group_size=[64])  # swapped arguments
    with pytest.raises(ValueError, match="not contiguous"):
        lib.reverse(torch.zeros(4, 32)[:, :16], 16, threads=[64], group_size=[64])
