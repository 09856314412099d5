"""Small "CUDA-era" scripts, unmodified, on a machine without CUDA through `patches.apply()`: each construct's
result is compared with the same computation written device-agnostically (or with an independent float64
reference), so a shim that only makes imports or calls succeed fails here. Each scenario runs in a fresh
interpreter, since the shims change global state."""
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import ROOT

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA shims only act where CUDA is absent")

PRELUDE = """
import json, os, sys, tempfile
import torch
import torch.nn.functional as F
sys.path.insert(0, {root!r})
import patches
result = {{}}
"""


def run(body: str, env_path: str = "") -> dict:
    code = PRELUDE.format(root=str(ROOT)) + textwrap.dedent(body) + "\nprint(json.dumps(result))\n"
    env = None
    if env_path:
        import os
        env = dict(os.environ, PYTHONPATH=env_path)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_explicit_cuda_requests_compute_like_device_agnostic_code(tmp_path):
    out = run(f"""
        from safetensors.torch import save_file
        # reference first, device-agnostic, before anything is patched
        torch.manual_seed(0)
        w_ref, b_ref = torch.randn(4, 3), torch.randn(4)
        x_ref = torch.arange(6.0).reshape(2, 3)
        y_ref = x_ref @ w_ref.T + b_ref
        saved = torch.randn(5, 2)
        save_file({{"t": saved}}, {str(tmp_path / "w.safetensors")!r})
        # a tensor saved on CUDA: torch's public location-tag hook says "cuda:0" while saving
        torch.serialization.register_package(0, lambda s: "cuda:0", lambda s, loc: None)
        torch.save({{"t": saved}}, {str(tmp_path / "cuda.pt")!r})
        try:
            torch.load({str(tmp_path / "cuda.pt")!r})
            result["unpatched_load"] = "loaded"
        except RuntimeError as e:
            result["unpatched_load"] = "raised"

        state = patches.apply()
        # --- the CUDA-era code ---
        torch.manual_seed(0)
        w = torch.randn(4, 3, device="cuda")
        b = torch.randn(4, device=torch.device("cuda:0"))
        x = torch.arange(6.0).reshape(2, 3).pin_memory().to("cuda", non_blocking=True)
        lin = torch.nn.Linear(3, 4).cuda()
        lin.load_state_dict({{"weight": w, "bias": b}})
        y = lin(x.cuda())
        z = torch.zeros(2, 2, device=0) + torch.ones(2, 2).to(torch.device("cuda"), torch.float64)
        loaded = torch.load({str(tmp_path / "cuda.pt")!r})["t"]
        mapped = torch.load({str(tmp_path / "cuda.pt")!r}, map_location="cuda")["t"]
        from safetensors.torch import load_file
        from safetensors import safe_open
        st = load_file({str(tmp_path / "w.safetensors")!r}, device="cuda")["t"]
        with safe_open({str(tmp_path / "w.safetensors")!r}, framework="pt", device="cuda:0") as f:
            st2 = f.get_tensor("t")
        # ---
        result.update(state=state, y_err=float((y - y_ref).abs().max()), devices=sorted({{str(t.device) for t in
                      (w, b, x, y, z, loaded, mapped, st, st2, lin.weight)}}), z=z.tolist(), z_dtype=str(z.dtype),
                      load_err=float((loaded - saved).abs().max() + (mapped - saved).abs().max()),
                      st_err=float((st - saved).abs().max() + (st2 - saved).abs().max()))
        patches.remove()
        try:
            torch.zeros(1, device="cuda")
            result["after_remove"] = "created"
        except (AssertionError, RuntimeError):
            result["after_remove"] = "raised"
        result["load_restored"] = torch.load.__module__
    """)
    assert out["unpatched_load"] == "raised"  # the fabricated file really is a CUDA checkpoint
    assert out["state"]["cuda_device"] == "shim"
    assert out["y_err"] == 0.0  # the same random stream and maths as the device-agnostic code
    assert out["devices"] == ["cpu"]
    assert out["z"] == [[1.0, 1.0], [1.0, 1.0]] and out["z_dtype"] == "torch.float64"
    assert out["load_err"] == 0.0 and out["st_err"] == 0.0
    assert out["after_remove"] == "raised" and out["load_restored"] == "torch.serialization"


def test_cuda_queries_autocast_and_sdp_switches():
    out = run("""
        a, b = torch.randn(8, 16), torch.randn(16, 4)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref_bf16 = a @ b
        q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
        attn_ref = torch.softmax(q.double() @ k.double().transpose(-1, -2) / 8 ** 0.5, -1) @ v.double()
        state = patches.apply()
        # --- the CUDA-era code ---
        name = torch.cuda.get_device_name(torch.cuda.current_device())
        props = torch.cuda.get_device_properties(0)
        torch.cuda.set_device(0)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        free, total = torch.cuda.mem_get_info()
        log = f"running on {name} with {props.total_memory / 2**30:.1f} GiB, cc {props.major}.{props.minor}"
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y1 = a @ b
        with torch.amp.autocast(device_type="cuda", dtype=torch.bfloat16):
            y2 = a @ b
        @torch.cuda.amp.autocast(dtype=torch.bfloat16)
        def decorated(x, y):
            return x @ y
        y3 = decorated(a, b)
        with torch.autocast(device_type="cuda", enabled=False):
            y4 = a @ b
        torch.backends.cuda.enable_flash_sdp(True)
        torch.backends.cuda.enable_mem_efficient_sdp(True)
        torch.backends.cuda.enable_math_sdp(True)
        attn = F.scaled_dot_product_attention(q, k, v)
        # ---
        result.update(state=state, log=log, available=torch.cuda.is_available(), count=torch.cuda.device_count(),
                      allocated=torch.cuda.memory_allocated(), total=total, free_ok=0 <= free <= total,
                      dtypes=[str(t.dtype) for t in (y1, y2, y3, y4)],
                      err=max(float((t.float() - ref_bf16.float()).abs().max()) for t in (y1, y2, y3)),
                      attn_err=float((attn.double() - attn_ref).abs().max()),
                      is_autocast=isinstance(torch.autocast("cuda"), torch.amp.autocast_mode.autocast))
        patches.remove()
        try:
            torch.cuda.current_device()
            result["after_remove"] = "answered"
        except (AssertionError, RuntimeError):
            result["after_remove"] = "raised"
    """)
    assert out["state"]["cuda"] == "shim"
    assert out["log"].startswith("running on cpu") and out["total"] > 0 and out["free_ok"]
    assert out["available"] is False and out["count"] == 0 and out["allocated"] == 0  # the truth
    assert out["dtypes"] == ["torch.bfloat16"] * 3 + ["torch.float32"]
    assert out["err"] == 0.0  # CUDA autocast computes as the device-agnostic CPU autocast
    assert out["attn_err"] < 1e-5 and out["is_autocast"]
    assert out["after_remove"] == "raised"


def test_python_m_patches_run(tmp_path):
    script = tmp_path / "cuda_script.py"
    script.write_text(textwrap.dedent("""
        import sys, torch
        x = torch.full((2,), float(sys.argv[1]), device="cuda").cuda()
        print("RESULT", __name__, x.sum().item(), x.device, torch.cuda.get_device_name())
    """))
    proc = subprocess.run([sys.executable, "-m", "patches", "run", "--report", str(script), "2.5"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][0].split()
    assert line[1:4] == ["__main__", "5.0", "cpu"]
    assert "cuda_device  shim" in proc.stderr  # the report names what was replaced
