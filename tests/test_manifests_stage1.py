"""Full-size stage-1 models built from the released yamls on the meta device must have exactly the checkpoint's
state-dict keys, shapes and dtypes (../shared/golden/manifests), in state_dict() order."""
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

GENERATOR_PREFIX = "_base_models.generator."
EMBEDDER_PREFIX = "_base_models.condition_embedder."


def require_shared():
    if not (CONFIGS / "ss_generator.yaml").exists() or not (MANIFESTS / "ss_generator.json").exists():
        pytest.skip(f"upstream configs / manifests not found under {SHARED}")


def build_on_meta(node):
    with torch.device("meta"):
        return instantiate(node)


def manifest_entries(name: str, prefix: str = ""):
    keys = json.loads((MANIFESTS / f"{name}.json").read_text())["keys"]
    return [(e["key"][len(prefix):], tuple(e["shape"]), e["dtype"]) for e in keys if e["key"].startswith(prefix)]


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


def check_all_meta(module: torch.nn.Module):
    assert all(t.is_meta for t in module.state_dict().values()), "construction allocated real tensors"


@pytest.mark.parametrize("part,prefix", [("generator", GENERATOR_PREFIX), ("condition_embedder", EMBEDDER_PREFIX)])
def test_ss_generator_manifest(part, prefix):
    require_shared()
    cfg = OmegaConf.load(CONFIGS / "ss_generator.yaml")
    module = build_on_meta(cfg.module[part].backbone)
    check_all_meta(module)
    assert_same_entries(state_entries(module), manifest_entries("ss_generator", prefix), f"ss {part}")


def test_slat_condition_embedder_manifest():
    require_shared()
    cfg = OmegaConf.load(CONFIGS / "slat_generator.yaml")
    module = build_on_meta(cfg.module.condition_embedder.backbone)
    check_all_meta(module)
    assert_same_entries(state_entries(module), manifest_entries("slat_generator", EMBEDDER_PREFIX),
                        "slat condition_embedder")


def test_ss_decoder_manifest():
    require_shared()
    cfg = OmegaConf.load(CONFIGS / "ss_decoder.yaml")
    cfg.pop("pretrained_ckpt_path", None)
    module = build_on_meta(cfg)
    check_all_meta(module)
    assert_same_entries(state_entries(module), manifest_entries("ss_decoder"), "ss decoder")


def test_parameter_counts_match_manifest():
    require_shared()
    ss = json.loads((MANIFESTS / "ss_generator.json").read_text())["num_parameters"]
    cfg = OmegaConf.load(CONFIGS / "ss_generator.yaml")
    gen = build_on_meta(cfg.module.generator.backbone)
    emb = build_on_meta(cfg.module.condition_embedder.backbone)
    assert sum(p.numel() for p in gen.parameters()) == ss["generator"]
    assert sum(p.numel() for p in emb.parameters()) == ss["condition_embedder"]
