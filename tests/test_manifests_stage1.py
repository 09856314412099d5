"""Full-size stage-1 models built from the released yamls on the meta device must have exactly the checkpoint's
state-dict keys, shapes and dtypes (../shared/golden/manifests), in state_dict() order."""
import pytest
import torch
from omegaconf import OmegaConf

from manifest_utils import (CONFIGS, assert_same_entries, build_on_meta, manifest, manifest_entries, require_shared,
                            state_entries)

GENERATOR_PREFIX = "_base_models.generator."
EMBEDDER_PREFIX = "_base_models.condition_embedder."












def check_all_meta(module: torch.nn.Module):
    assert all(t.is_meta for t in module.state_dict().values()), "construction allocated real tensors"


@pytest.mark.parametrize("part,prefix", [("generator", GENERATOR_PREFIX), ("condition_embedder", EMBEDDER_PREFIX)])
def test_ss_generator_manifest(part, prefix):
    require_shared("ss_generator")
    cfg = OmegaConf.load(CONFIGS / "ss_generator.yaml")
    module = build_on_meta(cfg.module[part].backbone)
    check_all_meta(module)
    assert_same_entries(state_entries(module), manifest_entries("ss_generator", prefix), f"ss {part}")


def test_slat_condition_embedder_manifest():
    require_shared("ss_generator")
    cfg = OmegaConf.load(CONFIGS / "slat_generator.yaml")
    module = build_on_meta(cfg.module.condition_embedder.backbone)
    check_all_meta(module)
    assert_same_entries(state_entries(module), manifest_entries("slat_generator", EMBEDDER_PREFIX),
                        "slat condition_embedder")


def test_ss_decoder_manifest():
    require_shared("ss_generator")
    cfg = OmegaConf.load(CONFIGS / "ss_decoder.yaml")
    cfg.pop("pretrained_ckpt_path", None)
    module = build_on_meta(cfg)
    check_all_meta(module)
    assert_same_entries(state_entries(module), manifest_entries("ss_decoder"), "ss decoder")


def test_parameter_counts_match_manifest():
    require_shared("ss_generator")
    ss = manifest("ss_generator")["num_parameters"]
    cfg = OmegaConf.load(CONFIGS / "ss_generator.yaml")
    gen = build_on_meta(cfg.module.generator.backbone)
    emb = build_on_meta(cfg.module.condition_embedder.backbone)
    assert sum(p.numel() for p in gen.parameters()) == ss["generator"]
    assert sum(p.numel() for p in emb.parameters()) == ss["condition_embedder"]
