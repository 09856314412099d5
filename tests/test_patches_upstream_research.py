"""Research-style scripts written against upstream's API give the same numbers on Meta's unmodified package
(through `patches.apply()`) as on this project's package.

Each script is run twice, each time in a fresh interpreter: once with Meta's package (extracted from
../shared/upstream) and its notebook folder first on sys.path after `patches.apply()`, once with this project's
package and notebooks/ (no patches needed). Both use the golden tiny checkpoint in upstream's format and the golden
pipeline inputs; each script prints a dict of numbers that must agree (rtol/atol 1e-3, as the golden pipeline case;
integers exactly)."""
import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap

import pytest

from conftest import ROOT, root_pythonpath

SHARED = ROOT.parent / "shared"
TARBALL = SHARED / "upstream" / "sam-3d-objects_cf06676.tar.xz"
TINY = SHARED / "golden" / "pipeline_tiny"
TOL = 1e-3

PRELUDE = """
import json, os, sys
import numpy as np
import torch
torch.set_num_threads(1)
torch.use_deterministic_algorithms(True, warn_only=True)
impl, notebook, config = {impl!r}, {notebook!r}, {config!r}
sys.path[:0] = [impl, notebook]
if {upstream!r}:
    sys.path.insert(2, {root!r})
    import patches
    patches.apply()
    from loguru import logger
    logger.remove()
from safetensors.torch import load_file
inputs = load_file({inputs!r})
image, mask, pointmap = inputs["image_rgb"].numpy(), inputs["mask"].numpy(), inputs["pointmap"]
from inference import Inference
inference = Inference(config, compile=False)
pipeline = inference._pipeline
rgba = np.concatenate([image[..., :3], (mask.astype(np.uint8) * 255)[..., None]], axis=-1)

def run(**kw):
    args = dict(stage1_only=False, with_mesh_postprocess=False, with_texture_baking=False,
                with_layout_postprocess=False, use_vertex_color=True, pointmap=pointmap.clone())
    args.update(kw)
    return pipeline.run(rgba, None, 42, **args)

def num(t):
    return [float(v) for v in torch.as_tensor(t).detach().double().flatten().tolist()]

result = {{}}
"""

SCRIPTS = {
    # the notebook's pipeline call without layout post-optimisation: pose, voxels, gaussians, mesh
    "pipeline_outputs": """
        out = run()
        gs = out["gaussian"][0]
        result["translation"] = num(out["translation"])
        result["scale"] = num(out["scale"])
        result["rotation"] = num(out["rotation"])
        result["n_voxels"] = int(out["coords"].shape[0])
        result["xyz_mean"] = num(gs.get_xyz.mean(0))
        result["opacity_mean"] = num(gs.get_opacity.mean())
        result["mesh_vertices"] = int(out["mesh"][0].vertices.shape[0])
        result["mesh_faces"] = int(out["mesh"][0].faces.shape[0])
    """,
    # forward hooks on pipeline.models (and their submodules), as a user probing intermediate results does
    "hooks_on_models": """
        seen = {}
        def keep(name):
            def hook(module, args, output):
                t = output if torch.is_tensor(output) else getattr(output, "feats", None)
                if t is not None:
                    seen[name] = [list(t.shape), float(t.double().abs().mean())]
            return hook
        handles = [pipeline.models["ss_decoder"].register_forward_hook(keep("ss_decoder")),
                   pipeline.models["slat_decoder_gs"].register_forward_hook(keep("slat_decoder_gs"))]
        run()
        for h in handles:
            h.remove()
        result["keys"] = sorted(k for k, v in pipeline.models.items() if v is not None)
        for name, (shape, mean) in seen.items():
            result[name + ".shape"] = shape
            result[name + ".abs_mean"] = mean
    """,
    # stage 1 only, with fewer steps set through the run's keyword
    "stage1_only_steps": """
        out = run(stage1_only=True, stage1_inference_steps=2)
        result["keys"] = sorted(k for k in out if k in ("shape", "translation", "scale", "rotation", "coords"))
        result["translation"] = num(out["translation"])
        result["scale"] = num(out["scale"])
        result["shape_mean"] = num(out["shape"].double().mean())
    """,
    # a decoder run by hand on a sparse tensor built with upstream's SparseTensor API
    "decoder_by_hand": """
        from sam3d_objects.model.backbone.tdfy_dit.modules import sparse as sp
        g = torch.Generator().manual_seed(0)
        xyz = torch.unique(torch.randint(0, 64, (300, 3), generator=g), dim=0)
        coords = torch.cat([torch.zeros(len(xyz), 1, dtype=torch.long), xyz], 1).int()
        decoder = pipeline.models["slat_decoder_gs"]
        channels = decoder.in_channels if hasattr(decoder, "in_channels") else 8
        feats = torch.randn(len(coords), channels, generator=g)
        with torch.no_grad():
            gaussians = decoder(sp.SparseTensor(feats=feats, coords=coords))
        gs = gaussians[0]
        result["n"] = int(gs.get_xyz.shape[0])
        result["xyz_mean"] = num(gs.get_xyz.mean(0))
        result["scaling_mean"] = num(gs.get_scaling.mean(0))
    """,
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    if not TARBALL.exists() or not (TINY / "tiny_checkpoint").is_dir():
        pytest.skip("Meta's package or the golden tiny checkpoint not found beside the checkout (../shared)")
    tmp = tmp_path_factory.mktemp("research")
    with tarfile.open(TARBALL) as tar:
        tar.extractall(tmp / "upstream", filter="data")
    shutil.copytree(TINY / "tiny_checkpoint", tmp / "ckpt")
    return tmp


def run_script(body: str, setup, upstream: bool) -> dict:
    impl = setup / "upstream" if upstream else ROOT
    notebook = impl / ("notebook" if upstream else "notebooks")
    code = PRELUDE.format(impl=str(impl), notebook=str(notebook), config=str(setup / "ckpt" / "pipeline.yaml"),
                          upstream=upstream, root=str(ROOT), inputs=str(TINY / "inputs.safetensors"))
    code += textwrap.dedent(body) + "\nprint('RESULT ' + json.dumps(result))\n"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH="")
    env.pop("LIDRA_SKIP_INIT", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, env=env,
                          cwd=str(setup))
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        if upstream and "MISSING" not in proc.stderr and "No module named" in proc.stderr:
            missing = proc.stderr.strip().splitlines()[-1]
            pytest.skip(f"upstream's imports: {missing} (pip install -e '.[upstream]')")
        raise AssertionError(("upstream" if upstream else "project") + " run failed:\n" + proc.stderr[-3000:])
    return json.loads(lines[-1][len("RESULT "):])


def same(a, b, path=""):
    if isinstance(a, float) or isinstance(b, float):
        assert abs(a - b) <= TOL + TOL * abs(b), f"{path}: {a} vs {b}"
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), f"{path}: {a} vs {b}"
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a} vs {b}"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_same_numbers_on_meta_package_and_project(name, setup):
    meta = run_script(SCRIPTS[name], setup, upstream=True)
    ours = run_script(SCRIPTS[name], setup, upstream=False)
    assert sorted(meta) == sorted(ours), (sorted(meta), sorted(ours))
    assert len(meta) >= 3, meta  # every script records several numbers (hooks: both decoders fired)
    for key in meta:
        same(meta[key], ours[key], key)


@pytest.mark.slow
def test_python_m_patches_run_a_demo_style_script(setup):
    """`python -m patches run script.py` from the root of Meta's checkout, the way upstream's demo.py is written
    (`sys.path.append("notebook")`, `from inference import ...`, `inference(image, mask, seed=42)`), on the golden
    tiny checkpoint and inputs; the splat is saved with upstream's `save_ply`."""
    script = setup / "upstream" / "demo_tiny.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.append("notebook")
        from inference import Inference
        from safetensors.torch import load_file
        inputs = load_file({str(TINY / "inputs.safetensors")!r})
        inference = Inference({str(setup / "ckpt" / "pipeline.yaml")!r}, compile=False)
        output = inference(inputs["image_rgb"].numpy(), inputs["mask"].numpy(), seed=42,
                           pointmap=inputs["pointmap"])
        output["gs"].save_ply("splat.ply")
        import patches
        print("fixups", patches.fixup_status())
        print("saved", output["gs"].get_xyz.shape[0])
    """))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root_pythonpath())
    env.pop("LIDRA_SKIP_INIT", None)
    env.pop("CONDA_PREFIX", None)
    proc = subprocess.run([sys.executable, "-m", "patches", "run", "--report", "demo_tiny.py"], capture_output=True,
                          text=True, timeout=900, env=env, cwd=str(setup / "upstream"))
    if proc.returncode != 0 and "No module named" in proc.stderr:
        pytest.skip(f"upstream's imports: {proc.stderr.strip().splitlines()[-1]} (pip install -e '.[upstream]')")
    assert proc.returncode == 0, proc.stderr[-3000:]
    n = int(proc.stdout.split("saved")[-1])
    from plyfile import PlyData
    assert PlyData.read(str(setup / "upstream" / "splat.ply"))["vertex"].count == n > 0
    assert "'conda_prefix_required': 'applied" in proc.stdout and "'gpu_name_unbound': 'applied" in proc.stdout
    assert "fix-up gpu_name_unbound" in proc.stderr  # --report lists the fix-ups
