"""Full-size stage-2 models (slat flow backbone, Gaussian decoders, mesh decoder) built from the released yamls on
the meta device must have exactly the checkpoint's state-dict keys, shapes, dtypes and order
(../shared/golden/manifests). The slat condition embedder is checked in test_manifests_stage1.py."""
import pytest
from omegaconf import OmegaConf

from manifest_utils import (CONFIGS, assert_same_entries, build_on_meta, manifest, manifest_entries, require_shared,
                            state_entries)

BACKBONE_PREFIX = "_base_models.generator.reverse_fn.backbone."














def test_slat_flow_backbone_manifest():
    require_shared("slat_generator")
    cfg = OmegaConf.load(CONFIGS / "slat_generator.yaml")
    module = build_on_meta(cfg.module.generator.backbone.reverse_fn.backbone)
    assert all(t.is_meta for t in module.state_dict().values()), "construction allocated real tensors"
    expected = manifest_entries("slat_generator", BACKBONE_PREFIX)
    assert len(expected) == manifest("slat_generator")["num_keys"]["generator"]
    assert_same_entries(state_entries(module), expected, "slat flow backbone")
    assert sum(p.numel() for p in module.parameters()) == manifest("slat_generator")["num_parameters"]["generator"]


@pytest.mark.parametrize("name", ["slat_decoder_gs", "slat_decoder_gs_4", "slat_decoder_mesh"])
def test_decoder_manifest(name):
    require_shared("slat_generator")
    module = build_on_meta(OmegaConf.load(CONFIGS / f"{name}.yaml"))
    assert_same_entries(state_entries(module), manifest_entries(name), name)
    info = manifest(name)
    assert sum(p.numel() for p in module.parameters()) == info["num_parameters"]
    buffers = sum(v.numel() for k, v in module.state_dict().items() if k == "offset_perturbation")
    assert buffers == info["num_buffer_elements_in_state_dict"]
