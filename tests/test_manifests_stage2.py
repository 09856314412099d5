"""Full-size stage-2 models (slat flow backbone, Gaussian decoders, mesh decoder) built from the released yamls on
the meta device must have exactly the checkpoint's state-dict keys, shapes, dtypes and order
(../shared/golden/manifests). The slat condition embedder is checked in test_manifests_stage1.py."""
import json
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
CONFIGS = SHARED / "upstream_configs"
MANIFESTS = SHARED / "golden" / "manifests"
BACKBONE_PREFIX = "_base_models.generator.reverse_fn.backbone."


def require_shared():
    if not (CONFIGS / "slat_generator.yaml").exists() or not (MANIFESTS / "slat_generator.json").exists():
        pytest.skip(f"upstream configs / manifests not found under {SHARED}")


def build_on_meta(node):
    with torch.device("meta"):
        return instantiate(node)


def manifest(name: str):
    return json.loads((MANIFESTS / f"{name}.json").read_text())


def manifest_entries(name: str, prefix: str = ""):
    return [(e["key"][len(prefix):], tuple(e["shape"]), e["dtype"]) for e in manifest(name)["keys"]
            if e["key"].startswith(prefix)]


def state_entries(module: torch.nn.Module):
    return [(k, tuple(v.shape), str(v.dtype).replace("torch.", "")) for k, v in module.state_dict().items()]


def assert_same_entries(actual, expected, what: str):
    actual_keys, expected_keys = [a[0] for a in actual], [e[0] for e in expected]
    missing = sorted(set(expected_keys) - set(actual_keys))
    unexpected = sorted(set(actual_keys) - set(expected_keys))
    assert not missing and not unexpected, f"{what}: missing {missing[:8]} unexpected {unexpected[:8]}"
    wrong = [(a, e) for a, e in zip(sorted(actual), sorted(expected)) if a != e]
    assert not wrong, f"{what}: shape/dtype differ, e.g. {wrong[:5]}"
    assert actual_keys == expected_keys, f"{what}: same keys, different state_dict() order"


def test_slat_flow_backbone_manifest():
    require_shared()
    cfg = OmegaConf.load(CONFIGS / "slat_generator.yaml")
    module = build_on_meta(cfg.module.generator.backbone.reverse_fn.backbone)
    assert all(t.is_meta for t in module.state_dict().values()), "construction allocated real tensors"
    expected = manifest_entries("slat_generator", BACKBONE_PREFIX)
    assert len(expected) == manifest("slat_generator")["num_keys"]["generator"]
    assert_same_entries(state_entries(module), expected, "slat flow backbone")
    assert sum(p.numel() for p in module.parameters()) == manifest("slat_generator")["num_parameters"]["generator"]


@pytest.mark.parametrize("name", ["slat_decoder_gs", "slat_decoder_gs_4", "slat_decoder_mesh"])
def test_decoder_manifest(name):
    require_shared()
    module = build_on_meta(OmegaConf.load(CONFIGS / f"{name}.yaml"))
    assert_same_entries(state_entries(module), manifest_entries(name), name)
    info = manifest(name)
    assert sum(p.numel() for p in module.parameters()) == info["num_parameters"]
    buffers = sum(v.numel() for k, v in module.state_dict().items() if k == "offset_perturbation")
    assert buffers == info["num_buffer_elements_in_state_dict"]
