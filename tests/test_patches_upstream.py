"""Meta's unmodified SAM 3D Objects package (the commit kept in ../shared/upstream) through `patches.apply()`:
real packages are kept and keep working (triton / torch._dynamo with and without a real triton), the upstream
fix-ups repair exactly the crashes reproduced here (each test first shows the crash without the fix-up), a user's
modified checkout gets a warning instead of a wrong edit, and `patches.report()` says what is what.

The package is extracted to a temporary folder; it is only run, never imported by the project. Each scenario runs
in a fresh interpreter, since the patches change global state."""
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

from conftest import ROOT, root_pythonpath

UPSTREAM_TARBALL = ROOT.parent / "shared" / "upstream" / "sam-3d-objects_cf06676.tar.xz"

PRELUDE = """
import json, os, sys, warnings
sys.path.insert(0, {root!r})
result = {{}}
"""

# makes `import triton` fail as on a machine where triton is not installed (the venv may have a real one)
HIDE_TRITON = """
import importlib.abc
class _NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _NoTriton())
"""


def run(body: str, env: dict = None, hide_triton: bool = False) -> dict:
    code = (PRELUDE.format(root=str(ROOT)) + (HIDE_TRITON if hide_triton else "") + textwrap.dedent(body)
            + "\nprint(json.dumps(result))\n")
    full_env = dict(os.environ, OMP_NUM_THREADS="1")
    full_env.pop("LIDRA_SKIP_INIT", None)
    full_env.pop("CONDA_PREFIX", None)
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env=full_env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def upstream(tmp_path_factory) -> Path:
    """A fresh copy of Meta's package (root holding sam3d_objects/, notebook/, demo.py)."""
    if not UPSTREAM_TARBALL.exists():
        pytest.skip(f"Meta's package not found at {UPSTREAM_TARBALL} (CI provides ../shared beside the checkout)")
    folder = tmp_path_factory.mktemp("upstream")
    with tarfile.open(UPSTREAM_TARBALL) as tar:
        tar.extractall(folder, filter="data")
    return folder


def needs(*modules):
    import importlib.util
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"upstream's imports need {missing}: pip install -e '.[upstream]'")


# ---------------------------------------------------------------------------------------------------------------
# real packages stay real and keep working
# ---------------------------------------------------------------------------------------------------------------
def test_triton_standin_keeps_dynamo_compile_and_torchvision_importable():
    """Without triton, the stand-in used to make `import torch._dynamo` fail (No module named 'triton.backends'),
    and with it a real torchvision, which patches then silently replaced."""
    out = run(hide_triton=True, body="""
        import patches
        state = patches.apply()
        import torch
        import triton                                   # the stand-in, for research code that imports it
        result["triton_is_standin"] = hasattr(triton, "__sam3d_shim__")
        import torch._dynamo                            # torch must still see "no triton"
        from torch.utils._triton import has_triton_package
        result["torch_sees_triton"] = has_triton_package()
        compiled = torch.compile(lambda x: torch.sin(x) * 2 + 1, backend="eager")
        x = torch.linspace(0, 1, 5)
        result["compile_err"] = float((compiled(x) - (torch.sin(x) * 2 + 1)).abs().max())
        import torchvision, torchvision.ops
        result["torchvision_real"] = not hasattr(torchvision, "__sam3d_shim__")
        result["has_frozen_bn"] = hasattr(torchvision.ops.misc, "FrozenBatchNorm2d")
        result.update(state=state, report=patches.report())
    """)
    assert out["state"]["triton"] == "shim" and out["triton_is_standin"]
    assert out["torch_sees_triton"] is False
    assert out["compile_err"] == 0.0
    # a real torchvision (when one is installed) still imports; without one, the stand-in serves torchvision.ops
    if importlib.util.find_spec("torchvision") is not None:
        assert out["torchvision_real"] and out["state"]["torchvision"] != "shim"
    assert out["has_frozen_bn"]
    line = next(l for l in out["report"].splitlines() if l.startswith("triton"))
    assert "stand-in" in line and "No module named 'triton'" in line


def test_inductor_compile_without_triton():
    """torch.compile's default (inductor) backend on the CPU still works with the stand-in registered."""
    out = run(hide_triton=True, body="""
        import patches
        patches.apply()
        import torch
        compiled = torch.compile(lambda x: torch.relu(x) + 1)
        x = torch.linspace(-1, 1, 7)
        try:
            result["err"] = float((compiled(x) - (torch.relu(x) + 1)).abs().max())
        except Exception as e:  # no C++ compiler on this machine: inductor's own limitation, not the stand-in's
            result["err"] = None if "triton" not in str(e).lower() else str(e)
    """)
    assert out["err"] in (0.0, None), out["err"]


def test_real_triton_is_kept():
    pytest.importorskip("triton")
    out = run("""
        import patches
        state = patches.apply()
        import triton, torch, torch._dynamo
        result.update(state=state, shim=hasattr(triton, "__sam3d_shim__"), report=patches.report())
    """)
    assert out["state"]["triton"] == "real" and not out["shim"]
    line = next(l for l in out["report"].splitlines() if l.startswith("triton"))
    assert line.split()[1] == "real"


# ---------------------------------------------------------------------------------------------------------------
# upstream fix-ups: each crash reproduced without its fix-up, then gone with it
# ---------------------------------------------------------------------------------------------------------------
@needs("loguru", "hydra", "omegaconf")
def test_gpu_name_fixup(upstream):
    body = """
        import patches
        patches.apply(fixups={fixups})
        sys.path.insert(0, {root!r})
        os.environ["LIDRA_SKIP_INIT"] = "1"
        from loguru import logger
        logged = []
        logger.add(lambda m: logged.append(str(m)), level="INFO")
        try:
            import sam3d_objects.pipeline.inference_pipeline as p
            result["outcome"] = "imported"
        except Exception as e:
            result["outcome"] = f"{{type(e).__name__}}: {{e}}"
        result["attn"] = os.environ.get("ATTN_BACKEND")
        result["status"] = patches.fixup_status()
        result["report"] = patches.report()
        result["logged"] = [m for m in logged if "GPU name" in m]
    """
    broken = run(body.format(fixups="False", root=str(upstream)))
    assert broken["outcome"].startswith("UnboundLocalError") and "gpu_name" in broken["outcome"]
    fixed = run(body.format(fixups='["gpu_name_unbound"]', root=str(upstream)))
    assert fixed["status"]["gpu_name_unbound"].startswith("applied")
    assert len(fixed["logged"]) == 1 and fixed["logged"][0].rstrip().endswith("GPU name is")  # no GPU: empty
    assert fixed["attn"] != "flash_attn"
    if fixed["outcome"] != "imported":  # the module's later imports need the stand-ins of pytorch3d.structures
        assert "gpu_name" not in fixed["outcome"]
        pytest.skip(f"past the fix-up, the module stops at: {fixed['outcome']}")
    assert fixed["status"]["missing_init_module"] == "off"
    assert "fix-up gpu_name_unbound" in fixed["report"] and "applied" in fixed["report"]


def test_missing_init_module_fixup(upstream):
    body = """
        import patches
        patches.apply(fixups={fixups})
        sys.path.insert(0, {root!r})
        try:
            import sam3d_objects
            result["outcome"] = "imported"
        except Exception as e:
            result["outcome"] = f"{{type(e).__name__}}: {{e}}"
        result["status"] = patches.fixup_status()["missing_init_module"]
        result["ran"] = os.environ.get("INIT_RAN")
    """
    broken = run(body.format(fixups="False", root=str(upstream)))
    assert broken["outcome"] == "ModuleNotFoundError: No module named 'sam3d_objects.init'"
    fixed = run(body.format(fixups="True", root=str(upstream)))
    assert fixed["outcome"] == "imported" and fixed["status"].startswith("applied")
    # the file on disk and its bytecode cache are untouched: without the fix-up the crash is back
    again = run(body.format(fixups="False", root=str(upstream)))
    assert again["outcome"] == broken["outcome"]
    # a checkout that ships the module still runs it
    (upstream / "sam3d_objects" / "init.py").write_text("import os\nos.environ['INIT_RAN'] = 'yes'\n")
    try:
        ran = run(body.format(fixups="True", root=str(upstream)))
    finally:
        (upstream / "sam3d_objects" / "init.py").unlink()
    assert ran["outcome"] == "imported" and ran["ran"] == "yes"


def test_notebook_conda_prefix_fixup(upstream):
    """notebook/inference.py, loaded by file path as check_cases.py does, without conda."""
    body = """
        import importlib.util
        import patches
        patches.apply(fixups={fixups})
        spec = importlib.util.spec_from_file_location("inference", {path!r})
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
            result["outcome"] = "imported"
        except Exception as e:
            result["outcome"] = f"{{type(e).__name__}}: {{e}}"
        result["cuda_home"] = os.environ.get("CUDA_HOME")
        result["status"] = patches.fixup_status()["conda_prefix_required"]
    """
    path = str(upstream / "notebook" / "inference.py")
    broken = run(body.format(fixups="False", path=path))
    assert broken["outcome"] == "KeyError: 'CONDA_PREFIX'"
    fixed = run(body.format(fixups="True", path=path))
    assert not fixed["outcome"].startswith("KeyError") and fixed["status"].startswith("applied")
    with_conda = run(body.format(fixups="True", path=path), env={"CONDA_PREFIX": "/opt/conda-x"})
    assert with_conda["cuda_home"] == "/opt/conda-x"  # where conda is there, the line still runs


def test_modified_checkout_gets_a_warning_not_an_edit(tmp_path, upstream):
    """A user's checkout where the function no longer has the expected shape: the fix-up is skipped with a
    warning, and the module runs as the user wrote it."""
    pkg = tmp_path / "sam3d_objects" / "pipeline"
    pkg.mkdir(parents=True)
    (tmp_path / "sam3d_objects" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "inference_pipeline.py").write_text(
        "def set_attention_backend():\n    return 'user version'\n\nVALUE = set_attention_backend()\n")
    out = run(f"""
        import patches
        patches.apply()
        sys.path.insert(0, {str(tmp_path)!r})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import sam3d_objects.pipeline.inference_pipeline as p
        result["value"] = p.VALUE
        result["warnings"] = [str(w.message) for w in caught if "fix-up" in str(w.message)]
        result["status"] = patches.fixup_status()["gpu_name_unbound"]
    """)
    assert out["value"] == "user version"
    assert sum("gpu_name_unbound" in w for w in out["warnings"]) == 1
    assert all("no longer has the expected shape" in w for w in out["warnings"])
    assert out["status"].startswith("skipped")


def test_fixup_registry_api_and_remove(tmp_path):
    """The declarative API another package's entries use: module name, description, transform; remove() puts
    the loader back."""
    (tmp_path / "crashy_mod.py").write_text("def f():\n    if False:\n        x = 1\n    return x\nVALUE = f()\n")
    out = run(f"""
        import ast, importlib.machinery
        import patches
        from patches import fixups
        original = importlib.machinery.SourceFileLoader.get_code

        @fixups.fixup("crashy_mod", "x is only bound in a dead branch: bind it to 2 first")
        def crashy_x_unbound(tree):
            fn = fixups.find_function(tree, "f")
            fn.body[:0] = fixups.statement("x = 2")

        patches.apply(fixups=["crashy_x_unbound"])
        sys.path.insert(0, {str(tmp_path)!r})
        import crashy_mod
        result["value"] = crashy_mod.VALUE
        result["status"] = patches.fixup_status()
        patches.remove()
        result["loader_restored"] = importlib.machinery.SourceFileLoader.get_code is original
        try:
            patches.apply(fixups=["no_such_fixup"])
        except ValueError as e:
            result["unknown"] = str(e)
    """)
    assert out["value"] == 2 and out["status"]["crashy_x_unbound"].startswith("applied")
    assert out["loader_restored"] and "no_such_fixup" in out["unknown"]


# ---------------------------------------------------------------------------------------------------------------
# repaired real packages, and the offline torch.hub DINOv2
# ---------------------------------------------------------------------------------------------------------------
def test_real_spconv_cpu_bias_in_eval_mode_is_repaired():
    """spconv's CPU build refuses a biased conv in eval mode; repaired, it computes the dense float64 reference."""
    pytest.importorskip("spconv.pytorch")
    out = run("""
        import torch, torch.nn.functional as F
        import spconv.pytorch as spconv
        torch.manual_seed(0)
        xyz = torch.unique(torch.randint(0, 6, (80, 3)), dim=0)
        coords = torch.cat([torch.zeros(len(xyz), 1, dtype=torch.long), xyz], 1).int()
        feats = torch.randn(len(coords), 4)
        conv = spconv.SubMConv3d(4, 5, 3, bias=True, indice_key="k").eval()
        try:
            conv(spconv.SparseConvTensor(feats, coords, [6, 6, 6], 1))
            result["unrepaired"] = "ran"
        except AssertionError as e:
            result["unrepaired"] = str(e)
        import patches
        state = patches.apply()
        y = conv(spconv.SparseConvTensor(feats, coords, [6, 6, 6], 1)).features
        grid = torch.zeros(1, 4, 6, 6, 6, dtype=torch.float64)
        c = coords.long()
        grid[0, :, c[:, 1], c[:, 2], c[:, 3]] = feats.double().T
        ref = F.conv3d(grid, conv.weight.double().permute(0, 4, 1, 2, 3), conv.bias.double(), padding=1)
        ref = ref[0, :, c[:, 1], c[:, 2], c[:, 3]].T
        result.update(state=state["spconv"], err=float((y.double() - ref).abs().max()), training=conv.training,
                      report=[l for l in patches.report().splitlines() if l.startswith("spconv")][0])
    """)
    assert "cpu don't support act and bias" in out["unrepaired"]
    assert out["state"] == "repaired" and out["training"] is False
    assert out["err"] < 1e-5
    assert "repaired" in out["report"] and "training=True" in out["report"]


def test_utils3d_earlier_names_compute_like_hand_references():
    pytest.importorskip("utils3d")
    out = run("""
        import numpy as np
        import patches
        state = patches.apply()
        from utils3d.numpy import depth_edge, image_mesh, image_uv, normals_edge, points_to_normals
        uv = image_uv(height=2, width=4)
        faces, vertices = image_mesh(np.arange(6, dtype=np.float32).reshape(2, 3, 1), tri=True)
        depth = np.ones((5, 6), np.float32)
        depth[:, 3:] = 2.0                      # a step between columns 2 and 3
        edge = depth_edge(depth, rtol=0.1)
        result.update(state=state.get("utils3d"), uv=uv.tolist(), faces=faces.tolist(), vertices=vertices.tolist(),
                      edge_cols=sorted(set(np.nonzero(edge)[1].tolist())),
                      flat=bool(depth_edge(np.ones((4, 4), np.float32), rtol=0.1).any()))
    """)
    assert out["state"] in ("repaired", "real")
    u = [(i + 0.5) / 4 for i in range(4)]
    v = [(j + 0.5) / 2 for j in range(2)]
    expected = [[ui, vj] for vj in v for ui in u]  # pixel centres, (0, 0) top-left, rows of v
    assert [p for row in out["uv"] for p in row] == [pytest.approx(p) for p in expected]
    assert len(out["faces"]) == 4 and out["vertices"] == [[0], [1], [2], [3], [4], [5]]  # 2 quads -> 4 triangles
    assert sorted({i for f in out["faces"] for i in f}) == list(range(6))
    assert out["edge_cols"] == [2, 3] and out["flat"] is False  # only the pixels beside the step


def test_dinov2_hub_call_built_locally_without_download(tmp_path):
    """Upstream's `torch.hub.load('facebookresearch/dinov2', name, **sizes)` on a machine with an empty hub cache
    and no network: the hub model's architecture and parameter names, the caller's sizes, no download."""
    out = run(f"""
        import torch
        torch.hub.set_dir({str(tmp_path / "hub")!r})
        import patches
        patches.apply()
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = torch.hub.load("facebookresearch/dinov2", "dinov2_vitl14_reg", source="github", verbose=False,
                                   img_size=28, embed_dim=32, depth=2, num_heads=2)
        keys = list(model.state_dict())
        x = torch.randn(1, 3, 28, 28)
        feats = model.forward_features(x)
        result.update(served=patches.hub_shim.served(), embed_dim=model.embed_dim,
                      n_registers=model.num_register_tokens, keys=keys[:6], n_blocks=len(model.blocks),
                      patch_tokens=list(feats["x_norm_patchtokens"].shape),
                      )
        os.makedirs(os.path.join({str(tmp_path / "hub")!r}, "facebookresearch_dinov2_main"))
        result["after_cache"] = patches.hub_shim.local_folder("facebookresearch/dinov2")
    """)
    assert out["served"] == 1 and out["embed_dim"] == 32 and out["n_blocks"] == 2 and out["n_registers"] == 4
    assert {"cls_token", "pos_embed", "register_tokens", "mask_token"} <= set(out["keys"])
    assert out["patch_tokens"] == [1, 4, 32]
    assert out["after_cache"] is None  # a cached hub repository is the real code: used as it is


def test_python_m_patches_run_fixups_option(tmp_path):
    script = tmp_path / "show.py"
    script.write_text("import patches, json\nprint(json.dumps(patches.fixup_status()))\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root_pythonpath())
    states = {}
    for option in ("none", "gpu_name_unbound"):
        proc = subprocess.run([sys.executable, "-m", "patches", "run", "--fixups", option, str(script)],
                              capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        states[option] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(states["none"].values()) == {"off"}
    assert states["gpu_name_unbound"]["gpu_name_unbound"] == "waiting"
    assert states["gpu_name_unbound"]["missing_init_module"] == "off"
