"""Device self-check: every op family and backend that can run on a device against independent float64 CPU
references, at the pipeline's shapes and dtypes (``--quick``: small shapes, for CI).

    python -m backends.selfcheck [--device mps|cuda|cpu] [--quick]      (also: sam3d-objects selfcheck,
                                                                         python -m sam3d_objects.selfcheck)

References are computed separately, never by a backend against itself: a dense float64 ``F.conv3d`` for sparse
convolution and for the dense-conv workaround, explicit-softmax attention, a Python dict for coordinate hashing and
neighbour maps, Python's ``sorted`` / ``set`` for sort and unique, float64 moments for the norms and a per-pixel
float64 brute force for the splat renderer. Prints a table (op, backend, dtype, max error, time, verdict) and exits
with status 1 when any result is wrong (2 when a check crashed), so a user on a new device can send the table back.

It lives in ``sam3d_objects`` because it is a client of the whole package (the renderer, the tiny pipeline, the
CLI's tiny checkpoint): ``backends`` stays the ground floor that imports nothing above it, and
``python -m backends.selfcheck`` runs this module by name.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional, Sequence

import torch
import torch.nn.functional as F

from backends import registry
from backends.attn import attention, varlen_attention
from backends.hashing import CoordHash, neighbor_map, clear_cache
from backends.norm import gated_residual, group_norm, head_rms_norm, layer_norm, linear_gelu, modulated_layer_norm
from backends.quant_linear import quantize_int8, quantized_linear
from backends.sparse_conv import sparse_conv3d

OK, WRONG, FAILED, SKIPPED = "ok", "WRONG", "error", "skipped"
# max |out - ref| / max(1, max |ref|) allowed per dtype (accelerators may use TF32 in convolutions)
TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-4, torch.float16: 2e-2, torch.bfloat16: 8e-2}
ACCEL_FP32_TOLERANCE = 3e-3


@dataclass
class CheckResult:
    op: str
    backend: str
    dtype: str
    max_error: Optional[float]
    seconds: Optional[float]
    verdict: str
    note: str = ""


@dataclass(frozen=True)
class Shapes:
    """Problem sizes: the full-size pipeline's (stage 2 at 64^3, 1024-wide transformers, 16 heads of 64) or tiny."""

    grid: int
    voxels: int
    channels: int
    seq_lengths: tuple
    heads: int
    head_dim: int
    cond_tokens: int
    dense_res: int
    dense_channels: int
    norm_rows: int
    norm_width: int
    sort_size: int
    gaussians: int
    image: tuple


FULL = Shapes(grid=64, voxels=20000, channels=64, seq_lengths=(4096, 1500), heads=16, head_dim=64,
              cond_tokens=1374, dense_res=32, dense_channels=64, norm_rows=20000, norm_width=1024,
              sort_size=200_000, gaussians=400, image=(64, 48))
QUICK = Shapes(grid=12, voxels=300, channels=8, seq_lengths=(40, 17), heads=2, head_dim=16, cond_tokens=23,
               dense_res=6, dense_channels=4, norm_rows=64, norm_width=32, sort_size=3000, gaussians=30,
               image=(24, 20))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _timed(fn: Callable, device: torch.device):
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t0


def _rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().cpu().double(), ref.detach().cpu().double()  # no float64 on MPS: convert on the CPU
    if out.shape != ref.shape:
        return math.inf
    if out.numel() == 0:
        return 0.0
    err = (out - ref).abs()
    if not bool(torch.isfinite(out).all()):
        return math.inf
    return float(err.max()) / max(1.0, float(ref.abs().max()))


def _tolerance(dtype: torch.dtype, device: torch.device) -> float:
    if dtype == torch.float32 and device.type != "cpu":
        return ACCEL_FP32_TOLERANCE
    return TOLERANCE[dtype]


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _compare(op, backend, dtype, device, fn, ref, tol=None, note="") -> CheckResult:
    """Run ``fn`` on the device and compare with ``ref`` (a float64 CPU tensor, or a callable giving one)."""
    try:
        out, seconds = _timed(fn, device)
    except Exception as e:  # a crash is reported in the table, not raised: the other checks still run
        return CheckResult(op, backend, _dtype_name(dtype), None, None, FAILED, f"{type(e).__name__}: {e}"[:120])
    err = _rel_error(out, ref() if callable(ref) else ref)
    tol = _tolerance(dtype, device) if tol is None else tol
    return CheckResult(op, backend, _dtype_name(dtype), err, seconds, OK if err <= tol else WRONG, note)


def _exact(op, backend, dtype, device, fn, expected: Callable[[object], bool], note="") -> CheckResult:
    """Run ``fn``; the verdict is ``expected(result)`` (for integer results: error 0 or 1)."""
    try:
        out, seconds = _timed(fn, device)
        good = bool(expected(out))
    except Exception as e:
        return CheckResult(op, backend, _dtype_name(dtype), None, None, FAILED, f"{type(e).__name__}: {e}"[:120])
    return CheckResult(op, backend, _dtype_name(dtype), 0.0 if good else 1.0, seconds, OK if good else WRONG, note)


# ---------------------------------------------------------------------------------------------------------------
# test data and float64 references
# ---------------------------------------------------------------------------------------------------------------
def random_coords(n: int, grid: int, batches: int = 2, seed: int = 0, scale=(1, 1, 1)) -> torch.Tensor:
    """[n, 4] int32 unique (b, x, y, z) voxels: a shell (surface-like, as stage 2's voxels) in ``batches``
    objects; ``scale`` stretches axes (large extents give keys beyond int32)."""
    g = torch.Generator().manual_seed(seed)
    per = -(-n // batches)
    rows = []
    for b in range(batches):
        d = torch.nn.functional.normalize(torch.randn(per * 3, 3, generator=g), dim=-1)
        r = (grid / 2 - 1) * (0.8 + 0.2 * torch.rand(per * 3, 1, generator=g))
        xyz = (d * r + grid / 2).long().clamp(0, grid - 1)
        xyz = torch.unique(xyz, dim=0)
        xyz = xyz[torch.randperm(xyz.shape[0], generator=g)[:per]]
        rows.append(torch.cat([torch.full((xyz.shape[0], 1), b), xyz * torch.tensor(scale)], dim=1))
    coords = torch.cat(rows)[:n]
    return coords.int()


def dense_sparse_conv_reference(feats, coords, weight, bias) -> torch.Tensor:
    """Submanifold conv via a dense float64 F.conv3d over the voxel grid, read back at the voxels."""
    c = coords.long()
    nb = int(c[:, 0].max()) + 1
    ext = (c[:, 1:].max(dim=0).values + 1).tolist()
    cin, cout, k = feats.shape[1], weight.shape[0], weight.shape[1]
    grid = torch.zeros(nb, cin, *ext, dtype=torch.float64)
    grid[c[:, 0], :, c[:, 1], c[:, 2], c[:, 3]] = feats.double()
    w = weight.double().permute(0, 4, 1, 2, 3)  # [Cout, k, k, k, Cin] -> [Cout, Cin, k, k, k]
    out = F.conv3d(grid, w, bias.double() if bias is not None else None, padding=k // 2)
    return out[c[:, 0], :, c[:, 1], c[:, 2], c[:, 3]].reshape(-1, cout)


def softmax_attention_reference(q, k, v, scale) -> torch.Tensor:
    """[Lq, H, D] x [Lk, H, D] -> [Lq, H, Dv] with an explicit float64 softmax."""
    q, k, v = q.double(), k.double(), v.double()
    heads = []
    for h in range(q.shape[1]):  # one head at a time: [Lq, Lk] float64 scores stay small at full size
        s = (q[:, h] @ k[:, h].T) * scale
        p = torch.exp(s - s.max(dim=-1, keepdim=True).values)
        heads.append((p / p.sum(dim=-1, keepdim=True)) @ v[:, h])
    return torch.stack(heads, dim=1)


def dict_neighbor_table(coords: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """[N, k^3] neighbour rows from a Python dict of voxels (offsets (kx, ky, kz) row-major, centred)."""
    rows = {tuple(c): i for i, c in enumerate(coords.tolist())}
    r = kernel_size // 2
    offs = [(x - r, y - r, z - r) for x in range(kernel_size) for y in range(kernel_size) for z in range(kernel_size)]
    table = [[rows.get((b, x + dx, y + dy, z + dz), -1) for dx, dy, dz in offs] for b, x, y, z in coords.tolist()]
    return torch.tensor(table, dtype=torch.int64)


# ---------------------------------------------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------------------------------------------
_USE_KEYWORD = {registry.Family.SPARSE_CONV: "sparse", registry.Family.SPARSE_ATTN: "sparse_attn",
                registry.Family.ATTN: "attn", registry.Family.NORM: "norm",
                registry.Family.QUANT_LINEAR: "quant_linear"}


def _each_backend(op: str, family: registry.Family, device, dtype, call, ref) -> List[CheckResult]:
    """``call()`` under every backend of ``family`` registered for this device type, each compared with ``ref``;
    a backend that cannot run here is reported as skipped with the reason."""
    results = []
    for name, reason in _available(family, device, dtype):
        if reason:
            results.append(CheckResult(op, name, _dtype_name(dtype), None, None, SKIPPED, reason))
            continue

        def run(name=name):
            with registry.use(**{_USE_KEYWORD[family]: name}):
                return call()
        results.append(_compare(op, name, dtype, device, run, ref))
    return results


def _available(family: registry.Family, device: torch.device, dtype: torch.dtype):
    """(name, reason or None) of every backend of ``family`` registered for this device type."""
    for name, spec in sorted(registry.registered(family).items()):
        if device.type not in spec.devices:
            continue
        yield name, spec.why_not(device, dtype)


# quantized_linear: int8_dynamic also rounds the activations to int8 per row; bf16 multiplies in bfloat16
_QUANT_TOLERANCE = {"int8_dynamic": 3e-2, "bf16": 2e-2}


def check_quant_linear(device, dtypes, shapes: Shapes) -> List[CheckResult]:
    """``quantized_linear`` of int8 (per-channel scales) and bf16 weights, every backend registered for the
    device, against the float64 product with the same (rounded) weight: what ``--weights`` runs."""
    g = torch.Generator().manual_seed(9)
    k, n = shapes.norm_width, 2 * shapes.norm_width
    # 2048 rows at most: int8pack (a few-row kernel) takes seconds per call beyond that on a CPU
    x = torch.randn(min(shapes.norm_rows, 2048), k, generator=g)
    w, bias = torch.randn(n, k, generator=g) / math.sqrt(k), torch.randn(n, generator=g) * 0.1
    q, scale = quantize_int8(w)
    stored = {"int8": (q, scale, q.double() * scale.double()[:, None]),
              "bf16": (w.to(torch.bfloat16), None, w.to(torch.bfloat16).double())}
    results = []
    for fmt, (weight, s, exact) in stored.items():
        ref = x.double() @ exact.T + bias.double()
        for dtype in dtypes:
            args = (x.to(device, dtype), weight.to(device), None if s is None else s.to(device), bias.to(device))
            specs = registry.registered(registry.Family.QUANT_LINEAR)
            for name, reason in _available(registry.Family.QUANT_LINEAR, device, weight.dtype):
                op = f"quantized_linear {fmt}"
                if weight.dtype not in specs[name].dtypes:
                    continue  # a backend for the other weight format
                if reason:
                    results.append(CheckResult(op, name, _dtype_name(dtype), None, None, SKIPPED, reason))
                    continue

                def run(name=name, args=args):
                    with registry.use(quant_linear=name):
                        return quantized_linear(*args)
                tol = max(_tolerance(dtype, device), _QUANT_TOLERANCE.get(name, 0.0))
                results.append(_compare(op, name, dtype, device, run, ref, tol=tol))
    return results


def check_sparse_conv(device, dtypes, shapes: Shapes) -> List[CheckResult]:
    g = torch.Generator().manual_seed(1)
    coords = random_coords(shapes.voxels, shapes.grid)
    c = shapes.channels
    feats = torch.randn(coords.shape[0], c, generator=g)
    weight = torch.randn(c, 3, 3, 3, c, generator=g) / math.sqrt(27 * c)
    bias = torch.randn(c, generator=g) * 0.1
    ref = dense_sparse_conv_reference(feats, coords, weight, bias)
    results = []
    for dtype in dtypes:
        args = (feats.to(device, dtype), coords.to(device), weight.to(device, dtype), bias.to(device, dtype))
        results += _each_backend("sparse_conv3d k3", registry.Family.SPARSE_CONV, device, dtype,
                                 lambda args=args: sparse_conv3d(*args), ref)
    return results


def check_attention(device, dtypes, shapes: Shapes) -> List[CheckResult]:
    g = torch.Generator().manual_seed(2)
    h, d = shapes.heads, shapes.head_dim
    lengths = list(shapes.seq_lengths)
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, d, generator=g) for _ in range(3))
    cu = torch.tensor([0] + lengths).cumsum(0).int()
    scale = 1.0 / math.sqrt(d)
    ref_var = torch.cat([softmax_attention_reference(q[a:b], k[a:b], v[a:b], scale)
                         for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    # dense cross-attention: the longest sequence's queries against the conditioning tokens
    lq, lk = lengths[0], shapes.cond_tokens
    qd = torch.randn(2, lq, h, d, generator=g)
    kd, vd = torch.randn(2, lk, h, d, generator=g), torch.randn(2, lk, h, d, generator=g)
    ref_dense = torch.stack([softmax_attention_reference(qd[i], kd[i], vd[i], scale) for i in range(2)])
    results = []
    for dtype in dtypes:
        args = [t.to(device, dtype) for t in (q, k, v)] + [cu.to(device), cu.to(device)]
        results += _each_backend("varlen_attention", registry.Family.SPARSE_ATTN, device, dtype,
                                 lambda args=args: varlen_attention(*args, max_seqlen_q=max(lengths),
                                                                    max_seqlen_k=max(lengths)), ref_var)
        args = [t.to(device, dtype) for t in (qd, kd, vd)]
        results += _each_backend("attention", registry.Family.ATTN, device, dtype,
                                 lambda args=args: attention(*args), ref_dense)
    return results


def check_norms(device, dtypes, shapes: Shapes) -> List[CheckResult]:
    g = torch.Generator().manual_seed(3)
    c = max(32, shapes.dense_channels)
    x = torch.randn(1, c, shapes.dense_res, shapes.dense_res, shapes.dense_res, generator=g) * 3 + 1
    w, b = torch.randn(c, generator=g), torch.randn(c, generator=g)
    xd = x.double().reshape(1, 32, -1)
    ref_g = ((xd - xd.mean(-1, keepdim=True)) / torch.sqrt(xd.var(-1, unbiased=False, keepdim=True) + 1e-5))
    ref_g = ref_g.reshape(x.shape) * w.double().reshape(1, -1, 1, 1, 1) + b.double().reshape(1, -1, 1, 1, 1)
    rows = torch.randn(shapes.norm_rows, shapes.norm_width, generator=g) * 2 + 0.5
    lw, lb = torch.randn(shapes.norm_width, generator=g), torch.randn(shapes.norm_width, generator=g)
    rd = rows.double()
    ref_l = (rd - rd.mean(-1, keepdim=True)) / torch.sqrt(rd.var(-1, unbiased=False, keepdim=True) + 1e-6)
    ref_l = ref_l * lw.double() + lb.double()
    results = []
    for dtype in dtypes:
        results.append(_compare("group_norm", "backends", dtype, device,
                                lambda: group_norm(x.to(device, dtype), 32, w.to(device, dtype),
                                                   b.to(device, dtype), 1e-5), ref_g))
        results.append(_compare("layer_norm", "backends", dtype, device,
                                lambda: layer_norm(rows.to(device, dtype), (shapes.norm_width,),
                                                   lw.to(device, dtype), lb.to(device, dtype), 1e-6), ref_l))
    return results + check_adaln(device, dtypes, rows, ref_l, lw, lb)


def check_adaln(device, dtypes, rows, ref_norm, weight, bias) -> List[CheckResult]:
    """The DiT block steps of the norm family, every backend, against float64: modulation of rows of two batch
    elements, the gated residual, the per-head RMS norm of a strided query view and the MLP's linear + GELU."""
    g = torch.Generator().manual_seed(4)
    n, c = rows.shape
    batch = (torch.arange(n) >= n // 3).to(torch.int32)  # two batch elements of unequal size
    shift, scale, gate = (torch.randn(2, c, generator=g) * 0.5 for _ in range(3))
    ref_mod = ref_norm * (1 + scale.double()[batch.long()]) + shift.double()[batch.long()]
    branch = torch.randn(n, c, generator=g)
    ref_gated = rows.double() + branch.double() * gate.double()[batch.long()]
    heads = max(1, c // 64)
    qkv = torch.randn(n, 3, heads, c // heads, generator=g) * 3
    gamma = torch.rand(heads, c // heads, generator=g) + 0.5
    q = qkv.double()[:, 0]
    ref_rms = q / q.norm(dim=-1, keepdim=True) * gamma.double() * (c // heads) ** 0.5
    fc1 = torch.randn(4 * c, c, generator=g) / math.sqrt(c)
    fc1_b = torch.randn(4 * c, generator=g) * 0.1
    pre = rows.double() @ fc1.double().t() + fc1_b.double()
    ref_gelu = 0.5 * pre * (1 + torch.tanh(math.sqrt(2 / math.pi) * (pre + 0.044715 * pre ** 3)))
    results = []
    for dtype in dtypes:
        on = lambda *ts: [t.to(device, dtype) for t in ts]  # noqa: E731
        x, w, b, sh, sc, gt, br, qkv_d, gm, w1, b1 = on(rows, weight, bias, shift, scale, gate, branch, qkv,
                                                       gamma, fc1, fc1_b)
        idx = batch.to(device)
        results += _each_backend("modulated_layer_norm", registry.Family.NORM, device, dtype,
                                 lambda: modulated_layer_norm(x, sh, sc, w, b, 1e-6, batch_index=idx), ref_mod)
        results += _each_backend("gated_residual", registry.Family.NORM, device, dtype,
                                 lambda: gated_residual(x, br, gt, batch_index=idx), ref_gated)
        results += _each_backend("head_rms_norm", registry.Family.NORM, device, dtype,
                                 lambda: head_rms_norm(qkv_d.unbind(1)[0], gm, (c // heads) ** 0.5), ref_rms)
        results += _each_backend("linear_gelu", registry.Family.NORM, device, dtype,
                                 lambda: linear_gelu(x, w1, b1), ref_gelu)
    return results


def check_hashing(device, shapes: Shapes) -> List[CheckResult]:
    results = []
    cases = [("small extent", (1, 1, 1)), ("keys beyond int32", (4099, 4097, 4093))]
    for label, scale in cases:
        coords = random_coords(shapes.voxels, shapes.grid, scale=scale, seed=4)
        table = dict_neighbor_table(coords, 3)
        for int_dtype in (torch.int32, torch.int64):
            if label == "keys beyond int32" and int_dtype == torch.int32 and int(coords.max()) >= 2 ** 31:
                continue
            dev_coords = coords.to(device=device, dtype=int_dtype)

            def run(dev_coords=dev_coords):
                clear_cache()
                return neighbor_map(dev_coords, 3).table
            results.append(_exact(f"neighbor_map ({label})", "hashing", int_dtype, device, run,
                                  lambda t: torch.equal(t.long().cpu(), table)))
        # lookup of present and absent voxels (absent: shifted by one along x, or outside the extent)
        query = torch.cat([coords, coords + torch.tensor([0, 1, 0, 0], dtype=torch.int32), coords[:5] * 0 - 1])
        rows = {tuple(c): i for i, c in enumerate(coords.tolist())}
        want = torch.tensor([rows.get(tuple(c), -1) for c in query.tolist()])
        results.append(_exact(f"CoordHash.lookup ({label})", "hashing", torch.int32, device,
                              lambda: CoordHash(coords.to(device)).lookup(query.to(device)),
                              lambda t: torch.equal(t.long().cpu(), want)))
    return results


def check_sort_unique(device, shapes: Shapes) -> List[CheckResult]:
    """Device sort/argsort/unique on more than 256 elements, int32 and int64 keys (also beyond 2^31) and
    non-contiguous inputs, against Python's sorted / set."""
    g = torch.Generator().manual_seed(5)
    n = shapes.sort_size
    results = []
    for dtype, high in ((torch.int32, 2 ** 31 - 1), (torch.int64, 2 ** 40)):
        values = torch.randint(0, high, (n,), generator=g, dtype=torch.int64)
        values[: n // 4] = values[n // 4: n // 2]  # duplicates for unique
        want_sorted = torch.tensor(sorted(values.tolist()))
        want_unique = torch.tensor(sorted(set(values.tolist())))
        dev = values.to(device=device, dtype=dtype)
        results.append(_exact("sort", "torch", dtype, device, lambda: torch.sort(dev).values,
                              lambda t: torch.equal(t.long().cpu(), want_sorted)))
        results.append(_exact("argsort", "torch", dtype, device, lambda: dev[torch.argsort(dev)],
                              lambda t: torch.equal(t.long().cpu(), want_sorted)))
        results.append(_exact("unique", "torch", dtype, device, lambda: torch.unique(dev),
                              lambda t: torch.equal(t.long().cpu(), want_unique)))
        # a transposed (non-contiguous) view sorted along its rows
        two = values[: (n // 2) * 2].reshape(2, -1).t().to(device=device, dtype=dtype)  # [n/2, 2], stride (1, n/2)
        want_rows = torch.tensor([sorted(r) for r in values[: (n // 2) * 2].reshape(2, -1).tolist()])
        results.append(_exact("sort (non-contiguous)", "torch", dtype, device, lambda: torch.sort(two, dim=0).values,
                              lambda t: torch.equal(t.long().cpu().t(), want_rows)))
    return results


def check_dense_conv(device, dtypes, shapes: Shapes) -> List[CheckResult]:
    """The structure decoder's Conv3d, and its MPS workaround (3D conv as 2D convs over non-contiguous weight
    slices), against a float64 CPU F.conv3d."""
    from backends import dense_conv

    g = torch.Generator().manual_seed(6)
    c, r = shapes.dense_channels, shapes.dense_res
    x = torch.randn(1, c, r, r, r, generator=g)
    w = torch.randn(c, c, 3, 3, 3, generator=g) / math.sqrt(27 * c)
    b = torch.randn(c, generator=g) * 0.1
    ref = F.conv3d(x.double(), w.double(), b.double(), padding=1)
    results = []
    for dtype in dtypes:
        args = (x.to(device, dtype), w.to(device, dtype), b.to(device, dtype), (1, 1, 1))
        results.append(_compare("dense_conv3d (decoder path)", "backends", dtype, device,
                                lambda: dense_conv.dense_conv3d(*args), ref))
        results.append(_compare("conv3d as conv2d (workaround)", "backends", dtype, device,
                                lambda: dense_conv.conv3d_as_conv2d(*args), ref))
        results.append(_compare("F.conv3d (device kernel)", "torch", dtype, device,
                                lambda: F.conv3d(args[0], args[1], args[2], padding=1), ref,
                                note="informational on mps: the decoder avoids it"))
    return results


def brute_force_splat(means, covs, colors, opac, camera, background, blur=0.3, extent=3.0,
                      alpha_min=1 / 255, alpha_max=0.99) -> torch.Tensor:
    """float64 per-pixel reference: every gaussian at every pixel, composited in depth order."""
    rot, t = camera.rotation.double(), camera.translation.double()
    cam = means.double() @ rot.T + t
    v, u = torch.meshgrid(torch.arange(camera.height, dtype=torch.float64) + 0.5,
                          torch.arange(camera.width, dtype=torch.float64) + 0.5, indexing="ij")
    out = torch.zeros(camera.height, camera.width, 3, dtype=torch.float64)
    trans = torch.ones(camera.height, camera.width, dtype=torch.float64)
    for i in torch.argsort(cam[:, 2]).tolist():
        x, y, z = cam[i].tolist()
        if z <= 1e-2:
            continue
        jac = torch.tensor([[camera.fx / z, 0, -camera.fx * x / z ** 2],
                            [0, camera.fy / z, -camera.fy * y / z ** 2]], dtype=torch.float64)
        cov2d = jac @ rot @ covs[i].double() @ rot.T @ jac.T + blur * torch.eye(2, dtype=torch.float64)
        inv = torch.linalg.inv(cov2d)
        du, dv = u - (camera.fx * x / z + camera.cx), v - (camera.fy * y / z + camera.cy)
        q = inv[0, 0] * du * du + 2 * inv[0, 1] * du * dv + inv[1, 1] * dv * dv
        a = (float(opac[i]) * torch.exp(-0.5 * q)).clamp(max=alpha_max)
        a = torch.where((q > extent ** 2) | (a < alpha_min), torch.zeros_like(a), a)
        out += (trans * a)[..., None] * colors[i].double()
        trans = trans * (1 - a)
    return out + trans[..., None] * torch.as_tensor(background, dtype=torch.float64)


def check_splat(device, shapes: Shapes) -> List[CheckResult]:
    from backends.splat import covariance_from_scale_rotation, orbit_camera, render_gaussians

    g = torch.Generator().manual_seed(7)
    n = shapes.gaussians
    means = torch.randn(n, 3, generator=g) * 0.4
    covs = covariance_from_scale_rotation(torch.rand(n, 3, generator=g) * 0.1 + 0.01, torch.randn(n, 4, generator=g))
    colors, opac = torch.rand(n, 3, generator=g), torch.rand(n, generator=g) * 0.9 + 0.1
    cam = orbit_camera(30.0, 20.0, 3.0, fov_deg=45.0, width=shapes.image[0], height=shapes.image[1])
    bg = (0.2, 0.3, 0.4)
    ref = brute_force_splat(means, covs, colors, opac, cam, bg)
    return [_compare("render_gaussians", "splat", torch.float32, device,
                     lambda: render_gaussians(means.to(device), covs.to(device), colors.to(device),
                                              opac.to(device), cam, background=bg).color, ref)]


def takes_option(fn: Callable, name: str, forwards_to: Sequence[Callable] = ()) -> bool:
    """Whether calling ``fn`` with keyword ``name`` reaches a parameter of that name: ``fn``'s own, or, when
    ``fn`` only collects ``**kwargs``, one of the functions it forwards them to (``forwards_to``, in order)."""
    import inspect

    for f in (fn, *forwards_to):
        params = inspect.signature(f).parameters
        if name in params:
            return True
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return False
    return False


def pipeline_takes_noise_device(inference) -> bool:
    """``Inference.__call__`` forwards its ``**run_options`` to the pipeline's ``run``, which takes
    ``noise_device``: the option is looked up along that chain, not on ``__call__``'s own signature."""
    pipeline = getattr(inference, "_pipeline", None)
    return takes_option(inference.__call__, "noise_device", [pipeline.run] if pipeline is not None else [])


def check_pipeline(device, quick: bool, emulate: bool = False) -> List[CheckResult]:
    """The tiny random-weight pipeline on the device vs on the CPU (same seed, the sampling noise drawn on the
    CPU through ``noise_device="cpu"``: device generators differ). On the CPU the comparison is skipped (the CPU
    is the reference) unless ``emulate``: then the device run takes the accelerator's code path on the CPU (its
    own pipeline instance, the noise option), which is how the comparison itself is tested without a GPU."""
    if device.type == "cpu" and not emulate:
        return [CheckResult("pipeline (tiny)", "all", "-", None, None, SKIPPED, "the CPU is the reference")]
    try:
        from sam3d_objects.assets.tiny_checkpoint import ensure_tiny_checkpoint
        from sam3d_objects.inference import Inference
        from sam3d_objects.paths import default_tiny_dir
        config = ensure_tiny_checkpoint(default_tiny_dir(), log=lambda *a, **k: None)
        image, mask, pointmap = _tiny_scene()
        outs = {}
        seconds = None
        for role, dev in (("reference", "cpu"), ("device", device.type)):
            inference = Inference(str(config), compile=False, device=dev)
            kwargs = {"seed": 1, "pointmap": pointmap}
            if quick:  # a few sampler steps compare the same code paths (the layout refinement: full run only)
                kwargs.update(stage1_inference_steps=2, stage2_inference_steps=2, with_layout_postprocess=False)
            if pipeline_takes_noise_device(inference):
                kwargs["noise_device"] = "cpu"
            elif role == "device":
                return [CheckResult("pipeline (tiny)", "all", "-", None, None, SKIPPED,
                                    "no noise_device option: device noise differs from the CPU's")]
            out, seconds = _timed(lambda: inference(image, mask, **kwargs), torch.device(dev))
            outs[role] = out
        return [_compare_pipeline_outputs(outs["reference"], outs["device"], seconds, device)]
    except Exception as e:
        return [CheckResult("pipeline (tiny)", "all", "-", None, None, FAILED, f"{type(e).__name__}: {e}"[:120])]


def _voxel_iou(a: torch.Tensor, b: torch.Tensor) -> float:
    sa, sb = set(map(tuple, a.cpu().tolist())), set(map(tuple, b.cpu().tolist()))
    return len(sa & sb) / max(1, len(sa | sb))


def _compare_pipeline_outputs(a: dict, b: dict, seconds, device) -> CheckResult:
    """The device run ``b`` against the CPU run ``a``: the pose (float tolerance of the device's precision), the
    occupied voxels (a random-weight decoder puts a few logits within rounding of the threshold, so a voxel or
    two may flip: IoU >= 0.98) and, where the voxels are the same, the gaussians' positions."""
    errors = [_rel_error(b[k].float(), a[k].double()) for k in ("translation", "scale", "rotation") if k in a]
    iou = _voxel_iou(a["coords"], b["coords"])
    same = iou == 1.0
    if same and "gs" in a:
        errors.append(_rel_error(b["gs"].get_xyz.float(), a["gs"].get_xyz.double()))
    err = max(errors, default=0.0)
    note = ("CPU run through the device path" if device.type == "cpu" else "noise drawn on the CPU") + (
        "" if same else f"; voxel IoU {iou:.4f}, gaussians not compared")
    ok = err <= 5e-2 and iou >= 0.98
    return CheckResult("pipeline (tiny)", "all", "-", err, seconds, OK if ok else WRONG, note)


def _tiny_scene():
    import numpy as np
    h = w = 64
    image = np.full((h, w, 3), 128, dtype=np.uint8)
    mask = np.zeros((h, w), dtype=bool)
    mask[16:48, 16:48] = True
    image[mask] = (200, 60, 40)
    v, u = np.meshgrid(np.arange(h) + 0.5, np.arange(w) + 0.5, indexing="ij")
    z = np.where(mask, 2.0, 3.0)
    pointmap = np.stack([-(u - w / 2) / (0.9 * w) * z, -(v - h / 2) / (0.9 * w) * z, z], -1).astype(np.float32)
    return image, mask, torch.from_numpy(pointmap)


# ---------------------------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------------------------
FAMILIES = ("sparse_conv", "attention", "norms", "quant_linear", "hashing", "sort", "dense_conv", "splat",
            "pipeline")


def default_dtypes(device: torch.device) -> List[torch.dtype]:
    """The dtypes the pipeline runs on ``device``: fp32 on the CPU, fp32 and fp16 on accelerators."""
    return [torch.float32] if device.type == "cpu" else [torch.float32, torch.float16]


def run_selfcheck(device: str | torch.device = "cpu", quick: bool = False,
                  families: Optional[Iterable[str]] = None,
                  dtypes: Optional[Sequence[torch.dtype]] = None) -> List[CheckResult]:
    """Every check of ``families`` (default: all of :data:`FAMILIES`) on ``device``."""
    device = torch.device(device)
    shapes = QUICK if quick else FULL
    dtypes = list(dtypes or default_dtypes(device))
    wanted = list(families or FAMILIES)
    unknown = set(wanted) - set(FAMILIES)
    if unknown:
        raise ValueError(f"unknown self-check families {sorted(unknown)}; choose from {FAMILIES}")
    runners = {
        "sparse_conv": lambda: check_sparse_conv(device, dtypes, shapes),
        "attention": lambda: check_attention(device, dtypes, shapes),
        "norms": lambda: check_norms(device, dtypes, shapes),
        "quant_linear": lambda: check_quant_linear(device, dtypes, shapes),
        "hashing": lambda: check_hashing(device, shapes),
        "sort": lambda: check_sort_unique(device, shapes),
        "dense_conv": lambda: check_dense_conv(device, dtypes, shapes),
        "splat": lambda: check_splat(device, shapes),
        "pipeline": lambda: check_pipeline(device, quick),
    }
    results: List[CheckResult] = []
    for family in wanted:
        try:
            results += runners[family]()
        except Exception as e:  # a family that cannot even set up is one failed row
            results.append(CheckResult(family, "-", "-", None, None, FAILED, f"{type(e).__name__}: {e}"[:120]))
    return results


def format_table(results: Sequence[CheckResult]) -> str:
    lines = [f"{'op':38} {'backend':12} {'dtype':9} {'max error':>10} {'time ms':>9}  verdict"]
    for r in results:
        err = "-" if r.max_error is None else f"{r.max_error:.2e}"
        ms = "-" if r.seconds is None else f"{1000 * r.seconds:.1f}"
        note = f"  ({r.note})" if r.note else ""
        lines.append(f"{r.op:38} {r.backend:12} {r.dtype:9} {err:>10} {ms:>9}  {r.verdict}{note}")
    return "\n".join(lines)


def exit_status(results: Sequence[CheckResult], informational: Sequence[str] = ()) -> int:
    """0 all good (skips allowed), 1 a wrong result, 2 a check crashed."""
    relevant = [r for r in results if r.op not in informational]
    if any(r.verdict == WRONG for r in relevant):
        return 1
    if any(r.verdict == FAILED for r in relevant):
        return 2
    return 0


def _environment(device: torch.device) -> str:
    import platform
    parts = [f"torch {torch.__version__}", f"python {platform.python_version()}", platform.platform()]
    if device.type == "cuda":
        parts.append(torch.cuda.get_device_name(device))
    if device.type == "mps":
        parts.append(f"macOS {platform.mac_ver()[0]}")
    return ", ".join(parts)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m backends.selfcheck", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cpu, cuda or mps (default: the best available)")
    p.add_argument("--quick", action="store_true", help="small shapes (seconds; what CI runs)")
    p.add_argument("--only", nargs="+", choices=FAMILIES, help="run only these checks")
    args = p.parse_args(argv)
    if args.device is None:
        from backends.device import default_device
        device = default_device()
    else:
        device = torch.device(args.device)
    if device.type == "mps":
        from backends.metal import torch_too_old_for_mps
        message = torch_too_old_for_mps()
        if message:
            print(message, file=sys.stderr)
            return 2
    print(f"self-check on {device} ({'quick' if args.quick else 'full-size'} shapes): {_environment(device)}")
    results = run_selfcheck(device, quick=args.quick, families=args.only)
    print(format_table(results))
    # MPS Conv3d is known to be wrong; the decoder does not use it there, so it does not fail the check
    informational = ("F.conv3d (device kernel)",) if device.type == "mps" else ()
    status = exit_status(results, informational)
    print({0: "all checks passed", 1: "WRONG RESULTS: please send this table back (see README)",
           2: "some checks crashed: please send this table back (see README)"}[status])
    return status


if __name__ == "__main__":
    sys.exit(main())
