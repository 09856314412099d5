"""The fused Triton sparse convolution, run by Triton's interpreter on CPU tensors, against a float64 reference.

Kept small: the interpreter executes every program of the grid in NumPy. Skips when triton is not importable.
"""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (pip install --no-deps triton)")

import backends  # noqa: E402
from backends.sparse_conv import triton as triton_kernels  # noqa: E402


def shell_coords(n_target: int, radius: float, batches: int, gen: torch.Generator) -> torch.Tensor:
    """Voxels of thin spherical shells (surface-like occupancy), lexicographically sorted, no duplicates."""
    size = int(2 * radius + 3)
    g = torch.stack(torch.meshgrid(*[torch.arange(size)] * 3, indexing="ij"), -1).reshape(-1, 3)
    d = ((g.float() - size / 2) ** 2).sum(-1).sqrt()
    shell = g[(d - radius).abs() < 0.9]
    out = []
    for b in range(batches):
        keep = shell[torch.randperm(shell.shape[0], generator=gen)[:n_target]]
        out.append(torch.cat([torch.full((keep.shape[0], 1), b), keep], 1))
    c = torch.cat(out).to(torch.int32)
    key = ((c[:, 0].long() * size + c[:, 1]) * size + c[:, 2]) * size + c[:, 3]
    return c[torch.argsort(key)]


def reference(feats, coords, weight, bias):
    """Dense float64 evaluation of the submanifold rule straight from the definition."""
    k = weight.shape[1]
    r = k // 2
    table = {tuple(c): i for i, c in enumerate(coords.tolist())}
    f = feats.double()
    w = weight.double()
    out = torch.zeros(feats.shape[0], weight.shape[0], dtype=torch.float64)
    for i, (b, x, y, z) in enumerate(coords.tolist()):
        for kx in range(k):
            for ky in range(k):
                for kz in range(k):
                    j = table.get((b, x + kx - r, y + ky - r, z + kz - r))
                    if j is not None:
                        out[i] += w[:, kx, ky, kz, :] @ f[j]
    return out + (bias.double() if bias is not None else 0)


@pytest.mark.parametrize("dtype,cin,cout,with_bias", [
    (torch.float32, 13, 21, True),     # channels not divisible by any tile
    (torch.float16, 16, 40, False),    # output tile edge
    (torch.bfloat16, 20, 8, True),
])
def test_triton_conv_matches_float64_reference(dtype, cin, cout, with_bias):
    gen = torch.Generator().manual_seed(cin * 100 + cout)
    coords = shell_coords(45, 3.5, 2, gen)  # ragged: row count not a multiple of the 32-row tile
    n = coords.shape[0]
    assert n % 32 != 0
    feats = torch.randn(n, cin, generator=gen).to(dtype)
    weight = (torch.randn(cout, 3, 3, 3, cin, generator=gen) / (27 * cin) ** 0.5).to(dtype)
    bias = torch.randn(cout, generator=gen).to(dtype) if with_bias else None
    nmap = backends.neighbor_map(coords, 3)
    out = triton_kernels.triton_sparse_conv3d(feats, coords, weight, bias, nmap)
    ref = reference(feats, coords, weight, bias)
    assert out.dtype == dtype and out.shape == (n, cout)
    assert torch.isfinite(out.float()).all()
    rel = (out.double() - ref).norm() / ref.norm()
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert rel < tol, f"relative error {rel:.2e} for {dtype}"


def test_triton_conv_skips_unused_offsets_per_tile_correctly():
    """Rows are reordered by neighbour mask and whole offsets are skipped per tile: isolated voxels (only the
    centre offset) and a dense block must both come out right, written back in the caller's row order."""
    gen = torch.Generator().manual_seed(7)
    block = torch.stack(torch.meshgrid(*[torch.arange(4)] * 3, indexing="ij"), -1).reshape(-1, 3)
    lonely = torch.tensor([[20, 20, 20], [30, 2, 9], [11, 25, 3]])
    xyz = torch.cat([lonely[:1], block, lonely[1:]])
    coords = torch.cat([torch.zeros(xyz.shape[0], 1, dtype=torch.long), xyz], 1).to(torch.int32)
    feats = torch.randn(coords.shape[0], 8, generator=gen)
    weight = torch.randn(5, 3, 3, 3, 8, generator=gen)
    out = triton_kernels.triton_sparse_conv3d(feats, coords, weight, None, None, config=(16, 16, 16, 1, 1))
    ref = reference(feats, coords, weight, None)
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-4)
    centre = weight[:, 1, 1, 1, :]
    assert torch.allclose(out[0], centre @ feats[0], rtol=1e-5, atol=1e-5)
    order = backends.neighbor_map(coords, 3).extra(("triton_order", True), triton_kernels._row_order)
    assert sorted(order["perm"].tolist()) == list(range(coords.shape[0]))


def test_triton_backend_is_registered_for_cuda_only():
    spec = backends.registered(backends.Family.SPARSE_CONV)["triton"]
    assert spec.devices == ("cuda",)
    assert spec.why_not(torch.device("cpu")) is not None
    with pytest.raises(backends.BackendUnavailableError, match="triton"):
        with backends.use(sparse="triton"):
            coords = torch.zeros(3, 4, dtype=torch.int32) + torch.arange(3, dtype=torch.int32)[:, None]
            backends.sparse_conv3d(torch.randn(3, 4), coords, torch.randn(2, 3, 3, 3, 4))


def test_triton_conv_kernel_size_five():
    """125 offsets per row; per-tile active-offset lists longer than any bit mask."""
    gen = torch.Generator().manual_seed(9)
    coords = shell_coords(30, 3.0, 1, gen)
    feats = torch.randn(coords.shape[0], 6, generator=gen)
    weight = torch.randn(7, 5, 5, 5, 6, generator=gen)
    nmap = backends.neighbor_map(coords, 5)
    out = triton_kernels.triton_sparse_conv3d(feats, coords, weight, None, nmap)
    assert (out.double() - reference(feats, coords, weight, None)).norm() < 1e-5 * out.double().norm()


@pytest.mark.parametrize("dtype,precision", [("fp16", "tf32"), ("fp32", "ieee")])
def test_triton_kernel_compiles_for_hopper_without_a_gpu(dtype, precision):
    """Ahead-of-time compile for sm_90 (Triton ships ptxas): the GPU code path parses, type-checks, lowers to
    tensor-core instructions and is software-pipelined, even though this machine has no GPU to run it."""
    import inspect

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = triton.jit(triton_kernels._subm_conv_kernel)
    names = list(inspect.signature(triton_kernels._subm_conv_kernel).parameters)
    ints = {"table_ptr", "perm_ptr", "active_ptr", "n_active_ptr"}
    sig = {n: ("*i32" if n in ints else f"*{dtype}") if n.endswith("_ptr")
           else "i32" if n in ("N", "CIN", "COUT", "K") else "constexpr" for n in names}
    consts = {"HAS_BIAS": True, "PRECISION": precision, "DOT_IN_F32": False, "BLOCK_M": 64, "BLOCK_N": 64,
              "BLOCK_K": 32, "STATIC_STEPS": 0}  # what GPU launches pass
    # what the JIT infers for 16-byte aligned tensors and channel counts divisible by 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n.endswith("_ptr") or n in ("CIN", "COUT")}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
    except (FileNotFoundError, PermissionError) as e:  # pragma: no cover - a triton build without its ptxas
        pytest.skip(f"triton cannot compile for CUDA here: {e}")
    ptx = kernel.asm["ptx"]
    assert "cp.async" in ptx, "the gathers should be software-pipelined"
    if dtype == "fp16":
        assert "wgmma.mma_async" in ptx, "fp16 tiles should use Hopper's tensor-core instructions"


def test_tilings_are_kept_on_disk_per_gpu_model(tmp_path, monkeypatch):
    """The first run of a later process reads the tiling an earlier one timed (no timing launches), and only for
    the same GPU model; an unreadable file just means timing again."""
    from backends.sparse_conv import triton as tk
    monkeypatch.setenv("SAM3D_CACHE_DIR", str(tmp_path))
    gpu = {"name": "GPU A"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu["name"])
    timed = []

    def fake_time(feats, weight, bias, nmap, out, config, reps=5):
        timed.append(config)
        return 1.0 if config == tk._CONFIGS[2] else 2.0  # the third tiling is the fastest
    monkeypatch.setattr(tk, "_time_launch", fake_time)
    monkeypatch.setattr(tk, "_TUNED", {})
    feats, weight = torch.zeros(1000, 128), torch.zeros(128, 3, 3, 3, 128)
    assert tk._pick_config(feats, weight, None, None, None) == tk._CONFIGS[2]
    assert len(timed) > 1 and (tmp_path / tk._TUNING_FILE).is_file()
    timed.clear()
    monkeypatch.setattr(tk, "_TUNED", {})  # a new process
    assert tk._pick_config(feats, weight, None, None, None) == tk._CONFIGS[2] and timed == []
    monkeypatch.setattr(tk, "_TUNED", {})
    gpu["name"] = "GPU B"
    tk._pick_config(feats, weight, None, None, None)
    assert timed  # another GPU model times its own
    (tmp_path / tk._TUNING_FILE).write_text("{not json")
    monkeypatch.setattr(tk, "_TUNED", {})
    timed.clear()
    assert tk._pick_config(feats, weight, None, None, None) == tk._CONFIGS[2] and timed


def test_shipped_tilings_serve_the_nearest_row_count(tmp_path, monkeypatch):
    """A cold process on a GPU model the project measured takes the shipped tiling of the same layer shape (the
    nearest row-count class) instead of timing; a layer shape not shipped is timed."""
    import json
    from backends.sparse_conv import triton as tk
    monkeypatch.setenv("SAM3D_CACHE_DIR", str(tmp_path / "user"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU A")
    shipped = tmp_path / "shipped.json"
    feats, weight = torch.zeros(1000, 128), torch.zeros(128, 3, 3, 3, 128)  # 1000 rows: bit length 10
    key = (128, 128, feats.dtype, tk._precision(feats.dtype), 10, feats.device, tk.SORT_ROWS_BY_MASK)
    far, near = key[:4] + (20,) + key[5:], key[:4] + (12,) + key[5:]
    shipped.write_text(json.dumps({tk._disk_key(far): list(tk._CONFIGS[0]), tk._disk_key(near): list(tk._CONFIGS[3])}))
    monkeypatch.setattr(tk, "_shipped_path", lambda: shipped)
    timed = []
    monkeypatch.setattr(tk, "_time_launch", lambda *a, **k: timed.append(1) or 1.0)
    monkeypatch.setattr(tk, "_TUNED", {})
    assert tk._pick_config(feats, weight, None, None, None) == tk._CONFIGS[3] and timed == []
    other = torch.zeros(128, 3, 3, 3, 64)  # Cin 64: no shipped entry
    tk._pick_config(torch.zeros(1000, 64), other, None, None, None)
    assert timed


def test_static_step_bound_computes_what_the_loaded_bound_computes(monkeypatch):
    """Interpreters that cannot loop to a loaded bound (Triton 3.6 with NumPy >= 2.4) run every step of the
    tile's offset list with the steps past its count masked: the same result as looping to the count (the
    path Triton 3.9's interpreter and every GPU take). Whichever path this triton takes by itself, the other is
    forced here and both must agree with the float64 reference."""
    from backends import triton_jit
    gen = torch.Generator().manual_seed(11)
    coords = shell_coords(40, 3.0, 2, gen)
    feats = torch.randn(coords.shape[0], 20, generator=gen)
    weight = torch.randn(9, 3, 3, 3, 20, generator=gen) / (27 * 20) ** 0.5
    ref = reference(feats, coords, weight, None)
    outs = {}
    for static in (False, True):
        monkeypatch.setattr(triton_kernels, "_static_steps",
                            lambda interpret, k, cin, block_k, static=static: k * -(-cin // block_k) if static else 0)
        if not static and not triton_jit.interpreter_takes_runtime_loop_bounds():
            continue  # this interpreter cannot run the loaded bound (the reason the static bound exists)
        outs[static] = triton_kernels.triton_sparse_conv3d(feats, coords, weight, None, None,
                                                           config=(16, 16, 16, 1, 1))
        assert (outs[static].double() - ref).norm() < 1e-5 * ref.norm(), static
    if len(outs) == 2:
        torch.testing.assert_close(outs[True], outs[False], rtol=1e-6, atol=1e-6)
