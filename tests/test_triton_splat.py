"""The Triton tile-compositing kernel of the splat renderer (backends/splat/triton.py) against the renderer's
PyTorch compositing rounds, the float64 brute force of tests/test_render.py and hand-computed tiles.

On the CPU the kernel runs in Triton's interpreter (every program in NumPy, one gaussian at a time), so scenes are
small. ``render_gaussians`` picks the kernel only for float32 CUDA tensors; here ``triton_splat.compositor`` is
patched so the same render runs either path on the CPU. Skips when triton is not importable.
"""
from __future__ import annotations

import math

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (pip install --no-deps triton)")

from backends.splat import portable as splat  # noqa: E402
from backends.splat import triton as triton_splat  # noqa: E402
from sam3d_objects.render import covariance_from_scale_rotation, orbit_camera, render_gaussians  # noqa: E402
from test_render import brute_force  # noqa: E402  (the float64 per-pixel reference)

from conftest import TEST_DEVICES, device_params  # noqa: E402

# Triton kernels run on CUDA, and on the CPU in Triton's interpreter (MPS has no Triton)
DEVICES = device_params([d for d in TEST_DEVICES if d in ("cpu", "cuda")])


def random_scene(n, seed, spread, scale_lo, scale_hi, opacity_lo, opacity_hi):
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(n, 3, generator=g) * spread
    covs = covariance_from_scale_rotation(torch.rand(n, 3, generator=g) * (scale_hi - scale_lo) + scale_lo,
                                          torch.randn(n, 4, generator=g))
    colors = torch.rand(n, 3, generator=g)
    opac = torch.rand(n, generator=g) * (opacity_hi - opacity_lo) + opacity_lo
    return means, covs, colors, opac


def render_with(path, monkeypatch, scene, cam, device, **kw):
    """render_gaussians with the Triton kernel (path "triton") or the PyTorch rounds (path "torch")."""
    pick = (lambda device, dtype: triton_splat.composite_tiles) if path == "triton" else (lambda device, dtype: None)
    with monkeypatch.context() as m:
        m.setattr(triton_splat, "compositor", pick)
        return render_gaussians(*(t.to(device) for t in scene), cam, **kw)


def assert_renders_close(a, b, atol):
    """colour and alpha within atol; depth compared as alpha * depth (what is accumulated: the division by a small
    alpha magnifies last-bit differences of 1 - T)."""
    torch.testing.assert_close(a.color.cpu(), b.color.cpu(), atol=atol, rtol=0)
    torch.testing.assert_close(a.alpha.cpu(), b.alpha.cpu(), atol=atol, rtol=0)
    depth_scale = float(b.depth.abs().max().clamp_min(1.0))
    torch.testing.assert_close((a.alpha * a.depth).cpu(), (b.alpha * b.depth).cpu(), atol=atol * depth_scale, rtol=0)


def test_renderer_uses_the_kernel_only_for_float32_cuda():
    assert triton_splat.compositor(torch.device("cpu"), torch.float32) is None
    assert triton_splat.compositor(torch.device("cuda"), torch.float64) is None
    if torch.cuda.is_available():
        assert triton_splat.compositor(torch.device("cuda"), torch.float32) is triton_splat.composite_tiles
    assert triton_splat.unavailable_reason(torch.device("cpu"), torch.float64) is not None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tile_size", [8, 5, 16])
def test_matches_pytorch_rounds_and_brute_force_for_any_tile_size(tile_size, device, monkeypatch):
    # 64x48 with tile 5 leaves partial tiles on the right and bottom edges (BLOCK 32 > 25 pixels: masked lanes)
    scene = random_scene(80, 0, 0.4, 0.01, 0.13, 0.1, 1.0)
    cam = orbit_camera(30.0, 20.0, 3.0, fov_deg=45.0, width=64, height=48)
    kw = dict(background=(0.2, 0.3, 0.4), tile_size=tile_size, min_transmittance=0.0)
    fast = render_with("triton", monkeypatch, scene, cam, device, **kw)
    rounds = render_with("torch", monkeypatch, scene, cam, device, **kw)
    assert fast.color.device.type == device and fast.color.shape == (48, 64, 3)
    # no early stop: the same gaussians, only the rounding of the running transmittance differs
    assert_renders_close(fast, rounds, 1e-5)
    ref = brute_force(*scene, cam, (0.2, 0.3, 0.4), 0.3, 3.0)
    torch.testing.assert_close(fast.color.double().cpu(), ref, atol=2e-5 if device == "cpu" else 2e-3, rtol=0)
    assert float(fast.alpha.max()) > 0.5 and float(fast.alpha.min()) == 0.0  # covered and empty pixels both


@pytest.mark.parametrize("min_transmittance", [0.0, 1e-5])
def test_dense_scene_stops_early_within_min_transmittance(min_transmittance, monkeypatch):
    # 300 overlapping, mostly opaque gaussians filling a narrow view: 9 of the 12 tiles turn opaque (every pixel's
    # transmittance < 1e-5) long before the end of their lists
    scene = random_scene(300, 3, 0.15, 0.02, 0.1, 0.7, 1.0)
    cam = orbit_camera(10.0, 30.0, 2.5, fov_deg=12.0, width=32, height=24)
    kw = dict(background=(0.0, 0.0, 0.0), tile_size=8, min_transmittance=min_transmittance)
    fast = render_with("triton", monkeypatch, scene, cam, "cpu", **kw)
    rounds = render_with("torch", monkeypatch, scene, cam, "cpu", **kw)
    opaque_tiles = (1 - fast.alpha).reshape(3, 8, 4, 8).amax(dim=(1, 3)) < 1e-5
    assert int(opaque_tiles.sum()) >= 6  # the scene really is opaque, tile-wide
    # both paths stop a tile only once all its pixels let < min_transmittance through; what they leave out
    # (different amounts: the rounds stop between chunks) changes a pixel by less than that
    assert_renders_close(fast, rounds, 1e-5 + min_transmittance)
    ref = brute_force(*scene, cam, (0.0, 0.0, 0.0), 0.3, 3.0)
    torch.testing.assert_close(fast.color.double(), ref, atol=2e-5 + min_transmittance, rtol=0)
    if min_transmittance > 0:
        full = render_with("triton", monkeypatch, scene, cam, "cpu", **dict(kw, min_transmittance=0.0))
        diff = (fast.color - full.color).abs().max()
        assert 0 < float(diff) <= min_transmittance  # the early stop did trigger, within its bound


def test_list_longer_than_the_largest_chunk(monkeypatch):
    # one 8x8 tile under 4200 faint gaussians: longer than MAX_CHUNK, so the rounds need all their doubling
    # chunks (32 + 64 + ... + 4096) while the kernel walks the list in one go
    n = 4200
    g = torch.Generator().manual_seed(5)
    means = torch.rand(n, 3, generator=g) * 0.16 - 0.08  # the view is 0.26 wide at the origin
    covs = covariance_from_scale_rotation(torch.rand(n, 3, generator=g) * 0.05 + 0.05, torch.randn(n, 4, generator=g))
    scene = (means, covs, torch.rand(n, 3, generator=g), torch.rand(n, generator=g) * 0.004 + 0.0042)
    cam = orbit_camera(0.0, 0.0, 3.0, fov_deg=5.0, width=8, height=8)
    tile_of_pair = splat._tile_pairs(splat.project_gaussians(means, covs, cam), 8, 8, 8)[0]
    assert tile_of_pair.numel() > splat.MAX_CHUNK  # every gaussian lands in the one tile
    kw = dict(background=(1.0, 1.0, 1.0), tile_size=8, min_transmittance=0.0)
    fast = render_with("triton", monkeypatch, scene, cam, "cpu", **kw)
    rounds = render_with("torch", monkeypatch, scene, cam, "cpu", **kw)
    assert_renders_close(fast, rounds, 1e-5)
    ref = brute_force(*scene, cam, (1.0, 1.0, 1.0), 0.3, 3.0)
    torch.testing.assert_close(fast.color.double(), ref, atol=2e-5, rtol=0)
    # the gaussians past the first MAX_CHUNK (in depth order) still show: the match above needs them
    front = torch.argsort(splat.project_gaussians(means, covs, cam).depths)[:splat.MAX_CHUNK]
    cut_short = brute_force(*(t[front] for t in scene), cam, (1.0, 1.0, 1.0), 0.3, 3.0)
    assert float((cut_short - ref).abs().max()) > 1e-3


def _row(u, v, a, b, c, opacity, color, depth, alpha_min=1 / 255, extent=3.0):
    """One table row as _gaussian_table builds it, for the inverse covariance [[a, b], [b, c]]."""
    log_op = math.log(opacity)
    return [u, v, -a / 2, -b, -c / 2, log_op, max(log_op - extent ** 2 / 2, math.log(alpha_min)), *color, depth]


def test_hand_built_tiles_empty_stopped_and_exact():
    """Three 5x5 tiles in a row: tile 0 has no gaussians, tile 1 twenty uniform alpha-0.99 layers (it stops at
    the first test, after CHECK_EVERY of them), tile 2 one elliptic gaussian checked per pixel in float64."""
    tile, check = 5, triton_splat.CHECK_EVERY
    flat = dict(a=0.0, b=0.0, c=0.0, opacity=0.99)
    rows = [_row(0.0, 0.0, **flat, color=(0.0, 1.0, 0.0), depth=1.0) for _ in range(check)]
    rows += [_row(0.0, 0.0, **flat, color=(1.0, 0.0, 0.0), depth=9.0) for _ in range(20 - check)]
    rows.append(_row(12.3, 2.2, 2.0, 0.5, 1.5, 0.8, (0.3, 0.6, 0.9), 4.0))
    table = torch.tensor(rows, dtype=torch.float32)
    gauss = torch.arange(21)
    counts = torch.tensor([0, 20, 1])
    starts = torch.tensor([0, 0, 20])
    trans = torch.ones(3, tile * tile)
    acc = torch.zeros(3, tile * tile, 4)
    triton_splat.composite_tiles(table, gauss, starts, counts, 3, tile, 15, 5, 0.99, 0.5, trans, acc)
    assert bool((trans[0] == 1).all()) and bool((acc[0] == 0).all())  # empty tile untouched
    # stopped after exactly CHECK_EVERY layers: the red ones behind added nothing at all
    torch.testing.assert_close(trans[1], torch.full((25,), 0.01 ** check), rtol=1e-4, atol=0)
    assert bool((acc[1, :, 0] == 0).all())
    torch.testing.assert_close(acc[1, :, 1], torch.ones(25), atol=1e-6, rtol=0)
    # tile 2 covers pixels x in [10, 15), y in [0, 5); pixel centres at +0.5
    y, x = torch.meshgrid(torch.arange(5, dtype=torch.float64) + 0.5, torch.arange(10, 15, dtype=torch.float64) + 0.5,
                          indexing="ij")
    dx, dy = x - 12.3, y - 2.2
    q = 2.0 * dx * dx + 2 * 0.5 * dx * dy + 1.5 * dy * dy
    alpha = (0.8 * torch.exp(-q / 2)).clamp(max=0.99)
    alpha = torch.where((q > 9.0) | (alpha < 1 / 255), torch.zeros_like(alpha), alpha).reshape(-1)
    assert 0 < int((alpha == 0).sum()) < 25  # the cut-off is inside the tile
    torch.testing.assert_close(trans[2].double(), 1 - alpha, atol=1e-6, rtol=0)
    want = alpha[:, None] * torch.tensor([0.3, 0.6, 0.9, 4.0], dtype=torch.float64)
    torch.testing.assert_close(acc[2].double(), want, atol=1e-6, rtol=0)
    # a second call continues from the buffers: tile 2 composites its gaussian again, behind the first
    triton_splat.composite_tiles(table, gauss, starts, counts, 3, tile, 15, 5, 0.99, 0.5, trans, acc)
    torch.testing.assert_close(trans[2].double(), (1 - alpha) ** 2, atol=1e-6, rtol=0)


def test_bad_buffers_are_refused():
    table = torch.zeros(2, 11)
    idx = torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match="trans_img"):
        triton_splat.composite_tiles(table, idx, idx, idx, 1, 8, 8, 8, 0.99, 1e-5, torch.ones(1, 63),
                                     torch.zeros(1, 63, 4))
    with pytest.raises(RuntimeError, match="float32"):
        triton_splat.composite_tiles(table.double(), idx, idx, idx, 1, 8, 8, 8, 0.99, 1e-5, torch.ones(1, 64),
                                     torch.zeros(1, 64, 4))


@pytest.mark.parametrize("tile,block", [(8, 64), (5, 32), (16, 256)])
def test_kernel_compiles_for_hopper_without_a_gpu(tile, block):
    """Ahead-of-time compile for sm_90 (Triton ships ptxas): the GPU code path parses, type-checks and lowers,
    although this machine has no GPU to run it."""
    import inspect

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = triton_splat._composite_tiles_kernel
    names = list(inspect.signature(fn).parameters)
    pointers = {"table_ptr": "*fp32", "gauss_ptr": "*i64", "starts_ptr": "*i64", "counts_ptr": "*i64",
                "trans_ptr": "*fp32", "acc_ptr": "*fp32"}
    consts = {"TILE": tile, "BLOCK": block, "CHECK": triton_splat.CHECK_EVERY}
    sig = {n: pointers[n] if n in pointers else "constexpr" if n in consts
           else "fp32" if n in ("alpha_max", "min_transmittance") else "i32" for n in names}
    src = ASTSource(fn=triton.jit(fn), signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in pointers})
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": triton_splat._num_warps(block)})
    except (FileNotFoundError, PermissionError) as e:  # pragma: no cover - a triton build without its ptxas
        pytest.skip(f"triton cannot compile for CUDA here: {e}")
    ptx = compiled.asm["ptx"]
    assert "ld.global" in ptx and "st.global" in ptx and "ex2.approx" in ptx
