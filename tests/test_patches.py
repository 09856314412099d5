"""patches.apply(): unmodified CUDA-era code (spconv, flash_attn, xformers, .cuda(), CUDA autocast) runs on a
machine without CUDA and computes the same as independent float64 references. Each scenario runs in a fresh
interpreter, since the shims change global state."""
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import ROOT

PRELUDE = """
import json, sys
import torch
import torch.nn.functional as F
sys.path.insert(0, {root!r})
import patches
state = patches.apply(replace_installed=True)
torch.manual_seed(0)
result = {{"state": state}}
"""


def run(body: str) -> dict:
    code = PRELUDE.format(root=str(ROOT)) + textwrap.dedent(body) + "\nprint(json.dumps(result))\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_spconv_code_runs_through_backends():
    out = run("""
        import spconv.pytorch as spconv
        import backends
        xyz = torch.unique(torch.randint(0, 6, (120, 3)), dim=0)
        coords = torch.cat([torch.zeros(len(xyz), 1, dtype=torch.long), xyz], 1).int()
        feats = torch.randn(len(coords), 4)
        net = spconv.SparseSequential(spconv.SubMConv3d(4, 5, 3, indice_key="a", algo=spconv.ConvAlgo.Native),
                                      torch.nn.ReLU())
        x = spconv.SparseConvTensor(feats, coords, [6, 6, 6], 1)
        y = net(x)
        conv = net[0]
        grid = torch.zeros(1, 4, 6, 6, 6, dtype=torch.float64)
        c = coords.long()
        grid[0, :, c[:, 1], c[:, 2], c[:, 3]] = feats.double().T
        ref = F.conv3d(grid, conv.weight.double().permute(0, 4, 1, 2, 3), conv.bias.double(), padding=1)
        ref = torch.relu(ref[0, :, c[:, 1], c[:, 2], c[:, 3]].T)
        result["err"] = float((y.features.double() - ref).abs().max())
        result["is_shim"] = spconv.__name__ == "spconv.pytorch" and hasattr(sys.modules["spconv"], "__sam3d_shim__")
        result["registry_sees_real"] = backends.registered(backends.Family.SPARSE_CONV)["spconv"].why_not(
            torch.device("cpu")) is None
        try:
            spconv.SparseConv3d(4, 4, 3, stride=2)
            result["strided"] = "built"
        except NotImplementedError as e:
            result["strided"] = str(e)
    """)
    assert out["state"]["spconv"] == "shim" and out["is_shim"]
    assert out["err"] < 1e-5
    assert not out["registry_sees_real"]  # the shim must never be mistaken for spconv (it would call itself)
    assert "not provided by the shim" in out["strided"]


def test_flash_attn_and_xformers_code_runs_through_backends():
    out = run("""
        from flash_attn import flash_attn_varlen_func, flash_attn_func
        import xformers.ops as xops
        def ref(q, k, v, scale):
            s = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
            return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v.double())
        lens = [3, 17, 1, 40]
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        q, k, v = (torch.randn(sum(lens), 2, 16) for _ in range(3))
        expected = torch.cat([ref(q[a:b], k[a:b], v[a:b], 0.3) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
        got = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), softmax_scale=0.3)
        result["varlen_err"] = float((got.double() - expected).abs().max())
        bias = xops.fmha.BlockDiagonalMask.from_seqlens(lens)
        got = xops.memory_efficient_attention(q[None], k[None], v[None], attn_bias=bias, scale=0.3)[0]
        result["xformers_err"] = float((got.double() - expected).abs().max())
        qb, kb, vb = (t[:40].reshape(2, 20, 2, 16) for t in (q, k, v))
        dense = flash_attn_func(qb, kb, vb)
        expected = torch.stack([ref(qb[i], kb[i], vb[i], 0.25) for i in range(2)])
        result["dense_err"] = float((dense.double() - expected).abs().max())
        try:
            flash_attn_func(qb, kb, vb, causal=True)
            result["causal"] = "ran"
        except NotImplementedError as e:
            result["causal"] = str(e)
    """)
    assert out["state"]["flash_attn"] == "shim" and out["state"]["xformers"] == "shim"
    assert out["varlen_err"] < 1e-5 and out["xformers_err"] < 1e-5 and out["dense_err"] < 1e-5
    assert "causal=False" in out["causal"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the .cuda() shim only acts where CUDA is absent")
def test_cuda_calls_go_to_the_default_device_and_remove_restores():
    out = run("""
        import backends
        t = torch.randn(3).cuda()
        m = torch.nn.Linear(4, 2).cuda()
        with torch.autocast("cuda", dtype=torch.float16):
            y = m(torch.randn(5, 4).cuda())
        with torch.cuda.amp.autocast():
            y2 = m(torch.randn(5, 4).cuda())
        with backends.device.autocast(backends.device.default_device().type, torch.float16):
            y_ref = m(torch.randn(5, 4).cuda())
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        result.update(tensor=str(t.device), module=str(m.weight.device), y=str(y.dtype), y2=str(y2.dtype),
                      y_ref=str(y_ref.dtype), default=str(backends.device.default_device()))
        patches.remove()
        try:
            torch.randn(1).cuda()
            result["after_remove"] = "moved"
        except (AssertionError, RuntimeError) as e:
            result["after_remove"] = "raised"
        result["spconv_after_remove"] = "spconv" in sys.modules and hasattr(sys.modules["spconv"], "__sam3d_shim__")
    """)
    assert out["state"]["cuda"] == "shim"
    assert out["tensor"] == out["module"] == out["default"]
    # "cuda" autocast becomes the default device's autocast (or a null context where that is unsupported)
    assert out["y"] == out["y2"] == out["y_ref"]
    assert out["after_remove"] == "raised" and not out["spconv_after_remove"]
