"""The official pipeline.yaml + model yamls resolve and build with this package (no weights needed).

* every model yaml builds at FULL size on the meta device and its state dict equals the released checkpoint's
  manifest (keys, shapes, dtypes);
* the preprocessors' ``torchvision.transforms`` targets resolve with the placeholder (torchvision absent) and
  with a torchvision package present (a stand-in module, in a subprocess);
* ``InferencePipelinePointMap`` is built from the official pipeline.yaml in low-memory mode (models are loaded
  only when a stage needs them, so empty placeholder checkpoint files suffice), and the MoGe node stays lazy.
"""
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from conftest import ROOT, SHARED
from sam3d_objects.config.instantiate import safe_instantiate
from sam3d_objects.pipeline.checkpoint import build_on_meta

CONFIGS = SHARED / "upstream_configs"
MODELS = {  # manifest -> (yaml, node, key prefix in the manifest)
    "ss_decoder": ("ss_decoder.yaml", None, ""),
    "slat_decoder_gs": ("slat_decoder_gs.yaml", None, ""),
    "slat_decoder_gs_4": ("slat_decoder_gs_4.yaml", None, ""),
    "slat_decoder_mesh": ("slat_decoder_mesh.yaml", None, ""),
    "ss_generator": ("ss_generator.yaml", ("module.generator.backbone", "module.condition_embedder.backbone"),
                     ("_base_models.generator.", "_base_models.condition_embedder.")),
    "slat_generator": ("slat_generator.yaml", ("module.generator.backbone", "module.condition_embedder.backbone"),
                       ("_base_models.generator.", "_base_models.condition_embedder.")),
}


@pytest.fixture(scope="module")
def configs(golden_dir):
    if not CONFIGS.is_dir():
        pytest.skip("shared/upstream_configs not found")
    return CONFIGS


def meta_spec(yaml_file, node, prefix):
    config = OmegaConf.load(yaml_file)
    if node:
        config = OmegaConf.select(config, node)
    elif "pretrained_ckpt_path" in config:
        del config["pretrained_ckpt_path"]
    model = build_on_meta(lambda: safe_instantiate(config))
    return [(prefix + k, list(v.shape), str(v.dtype).replace("torch.", "")) for k, v in model.state_dict().items()]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_full_size_models_match_manifests(configs, golden_dir, name):
    yaml_name, nodes, prefixes = MODELS[name]
    manifest = json.loads((golden_dir / "manifests" / f"{name}.json").read_text())
    expected = [(k["key"], k["shape"], k["dtype"]) for k in manifest["keys"]]
    if nodes is None:
        got = meta_spec(configs / yaml_name, None, "")
    else:
        got = [item for node, prefix in zip(nodes, prefixes) for item in meta_spec(configs / yaml_name, node, prefix)]
    assert sorted(got) == sorted(expected)


def test_preprocessors_resolve_without_torchvision(configs):
    import sam3d_objects.data  # noqa: F401
    pipeline = OmegaConf.load(configs / "pipeline.yaml")
    for node in ("ss_preprocessor", "slat_preprocessor"):
        pre = safe_instantiate(pipeline[node])
        out = pre(torch.rand(3, 60, 80), (torch.rand(1, 60, 80) > 0.5).float(),
                  *( [torch.rand(3, 60, 80)] if node == "ss_preprocessor" else []))
        assert out["image"].shape == (3, 518, 518) and out["rgb_image_mask"].shape == (1, 518, 518)


def test_preprocessors_use_real_torchvision_when_it_imports(configs, tmp_path):
    """A stand-in `torchvision` package on sys.path must be used as is (no placeholder)."""
    pkg = tmp_path / "torchvision"
    (pkg / "transforms").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import transforms\n")
    (pkg / "transforms" / "__init__.py").write_text(textwrap.dedent("""
        from sam3d_objects.data.transforms import Compose as _C, Resize as _R
        class Compose(_C):
            real = True
        class Resize(_R):
            real = True
    """))
    script = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(tmp_path)!r}, {str(ROOT)!r}]
        from omegaconf import OmegaConf
        from sam3d_objects.config.instantiate import safe_instantiate
        from patches import torchvision_shim
        pre = safe_instantiate(OmegaConf.load({str(configs / 'pipeline.yaml')!r}).ss_preprocessor)
        assert torchvision_shim.install() == "torchvision"
        assert getattr(pre.img_transform, "real", False) and pre.img_transform.transforms[1].real
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]



def _write_placeholder_checkpoint(folder, config, ckpt_key):
    """A full-size checkpoint's keys, shapes and dtypes (as the up-front manifest check demands) at no size: every
    tensor is one zero expanded to its shape, so torch.save stores a single element. Low-memory mode never reads
    them."""
    from sam3d_objects.tools.make_random_checkpoint import GENERATOR_FILES, spec_from_yaml
    from sam3d_objects.validation import _model_checkpoints
    config_key, parts = _model_checkpoints()[ckpt_key]
    spec = []
    for node, prefix in parts:
        spec += spec_from_yaml(folder / config[config_key], node, prefix or "")
    state = {k: torch.zeros((), dtype=dt).expand(shape) for k, shape, dt in spec}
    name = Path(config[ckpt_key]).stem
    torch.save({"state_dict": state} if name in GENERATOR_FILES else state, folder / config[ckpt_key])

def test_official_pipeline_yaml_builds_lazily(configs, tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    for f in configs.glob("*.yaml"):
        shutil.copy(f, folder / f.name)
    config = OmegaConf.load(folder / "pipeline.yaml")
    for key in config:
        if key.endswith("_ckpt_path"):
            _write_placeholder_checkpoint(folder, config, key)
    from sam3d_objects.inference import Inference
    inference = Inference(str(folder / "pipeline.yaml"), compile=False, device="cpu", low_memory=True)
    pipe = inference.pipeline
    assert type(pipe).__name__ == "InferencePipelinePointMap"
    assert pipe.loaded_models() == {} and pipe.low_memory and pipe.dtype == torch.float16
    assert not isinstance(pipe.depth_model._model, torch.nn.Module)  # MoGe node not built (no download)
    assert pipe.ss_cfg_strength == 7 and pipe.slat_cfg_strength == 1 and pipe.downsample_ss_dist == 1
    # a missing checkpoint file is reported with the folder
    (folder / "ss_decoder.ckpt").unlink()
    with pytest.raises(FileNotFoundError, match="ss_decoder.ckpt"):
        Inference(str(folder / "pipeline.yaml"), device="cpu", low_memory=True)
