"""Checkpoint reading/building: weights-only + mmap, meta build + assign, strict keys, dtypes, allow-list."""
import os
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from sam3d_objects.config.instantiate import UnsafeConfigError, check_targets, safe_instantiate
from sam3d_objects.pipeline import checkpoint as ckpt

DINO_SIZES = {"img_size": 70, "embed_dim": 32, "depth": 2, "num_heads": 2}


@pytest.fixture(scope="module")
def tiny(golden_dir):
    return golden_dir / "pipeline_tiny" / "tiny_checkpoint"


def with_dino_sizes(node):
    if isinstance(node, dict):
        node = {k: with_dino_sizes(v) for k, v in node.items()}
        if str(node.get("_target_", "")).endswith(".Dino"):
            node["backbone_kwargs"] = dict(DINO_SIZES)
        return node
    if isinstance(node, list):
        return [with_dino_sizes(v) for v in node]
    return node


def builder(yaml_path, node=None):
    config = OmegaConf.to_container(OmegaConf.load(yaml_path))
    config = with_dino_sizes(config)
    config = OmegaConf.create(config)
    if node:
        config = OmegaConf.select(config, node)
    return lambda: safe_instantiate(config)


def test_decoder_loads_strictly_equal_to_file(tiny):
    model = ckpt.load_model(builder(tiny / "ss_decoder.yaml"), tiny / "ss_decoder.ckpt")
    ref = torch.load(tiny / "ss_decoder.ckpt", map_location="cpu", weights_only=True)
    sd = model.state_dict()
    assert sd.keys() == ref.keys()
    assert all(torch.equal(sd[k], ref[k].to(sd[k].dtype)) for k in ref)
    assert not any(p.is_meta or p.requires_grad for p in model.parameters())
    assert not model.training


def test_generator_and_embedder_from_one_file(tiny):
    gen = ckpt.load_model(builder(tiny / "ss_generator.yaml", "module.generator.backbone"),
                          tiny / "ss_generator.ckpt", state_dict_key="state_dict",
                          prefix="_base_models.generator.")
    emb = ckpt.load_model(builder(tiny / "ss_generator.yaml", "module.condition_embedder.backbone"),
                          tiny / "ss_generator.ckpt", state_dict_key="state_dict",
                          prefix="_base_models.condition_embedder.")
    raw = torch.load(tiny / "ss_generator.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    n = sum(1 for k in raw if k.startswith("_base_models.generator."))
    assert len(gen.state_dict()) == n
    # non-persistent buffers (not in the file) are real values, not meta placeholders
    assert not any(b.is_meta for b in emb.buffers())
    dino = emb.embedder_list[0][0] if hasattr(emb, "embedder_list") else None
    if dino is not None and hasattr(dino, "mean"):
        assert torch.allclose(dino.mean.flatten(), torch.tensor([0.485, 0.456, 0.406]), atol=1e-6)


def test_missing_unexpected_and_wrong_model_keys_are_listed(tiny, tmp_path):
    sd = torch.load(tiny / "ss_decoder.ckpt", map_location="cpu", weights_only=True)
    first = next(iter(sd))
    broken = dict(sd)
    del broken[first]
    broken["extra.weight"] = torch.zeros(1)
    torch.save(broken, tmp_path / "broken.ckpt")
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load_model(builder(tiny / "ss_decoder.yaml"), tmp_path / "broken.ckpt")
    assert first in str(e.value) and "extra.weight" in str(e.value) and "missing" in str(e.value)
    with pytest.raises(ckpt.CheckpointError, match="unexpected"):
        ckpt.load_model(builder(tiny / "slat_decoder_gs.yaml"), tiny / "ss_decoder.ckpt")
    with pytest.raises(ckpt.CheckpointError, match="no key starting with"):
        ckpt.load_model(builder(tiny / "ss_decoder.yaml"), tiny / "ss_decoder.ckpt", prefix="_base_models.x.")


def test_truncated_and_missing_files(tiny, tmp_path):
    data = (tiny / "ss_decoder.ckpt").read_bytes()
    (tmp_path / "cut.ckpt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ckpt.CheckpointError, match="truncated or corrupt"):
        ckpt.read_checkpoint(tmp_path / "cut.ckpt")
    (tmp_path / "cut.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(ckpt.CheckpointError):
        ckpt.read_checkpoint(tmp_path / "cut.safetensors")
    with pytest.raises(ckpt.CheckpointError, match="not found"):
        ckpt.read_checkpoint(tmp_path / "nope.ckpt")


class _Evil:
    def __reduce__(self):
        return (os.makedirs, (str(Path(os.environ["SAM3D_TEST_EVIL_DIR"]) / "pwned"),))


def test_pickled_code_is_never_executed(tmp_path, monkeypatch):
    monkeypatch.setenv("SAM3D_TEST_EVIL_DIR", str(tmp_path))
    torch.save({"state_dict": {"w": torch.zeros(1)}, "extra": _Evil()}, tmp_path / "evil.ckpt")
    with pytest.raises(ckpt.CheckpointError, match="weights_only"):
        ckpt.read_checkpoint(tmp_path / "evil.ckpt")
    assert not (tmp_path / "pwned").exists()


def test_safetensors_and_dtype_rules(tiny, tmp_path):
    sd = torch.load(tiny / "ss_decoder.ckpt", map_location="cpu", weights_only=True)
    half = {k: v.half() for k, v in sd.items()}
    ckpt.save_checkpoint(half, tmp_path / "dec.safetensors")
    model = ckpt.load_model(builder(tiny / "ss_decoder.yaml"), tmp_path / "dec.safetensors")
    # the model keeps its own (float32) dtypes whatever the file stores
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    k = next(iter(sd))
    assert torch.equal(model.state_dict()[k], sd[k].half().float())


def test_mmap_float32_tensors_are_used_in_place(tiny, tmp_path):
    shutil.copy(tiny / "ss_decoder.ckpt", tmp_path / "d.ckpt")
    content = ckpt.read_checkpoint(tmp_path / "d.ckpt")
    k, v = next(iter(content.items()))
    model = ckpt.load_model(builder(tiny / "ss_decoder.yaml"), content)
    assert model.state_dict()[k].data_ptr() == v.data_ptr()


def test_allow_list_refuses_foreign_targets():
    bad = OmegaConf.create({"_target_": "sam3d_objects.config.utils.make_dict",
                            "x": {"_target_": "os.system", "_args_": ["echo hacked"]}})
    with pytest.raises(UnsafeConfigError, match="os.system"):
        safe_instantiate(bad)
    check_targets(OmegaConf.create({"a": {"_target_": "torchvision.transforms.Resize", "size": 3}}))
    assert safe_instantiate({"_target_": "sam3d_objects.config.utils.make_dict", "a": 1}) == {"a": 1}


class _Helper:
    def __init__(self):
        self.inner = type("Inner", (), {})()
        self.inner.table = torch.arange(5.0)


class _WithComputedState(torch.nn.Module):
    """Parameters from the file, plus a non-persistent buffer and a table on a plain helper object."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 4)
        self.register_buffer("freqs", torch.arange(3.0) * 2, persistent=False)
        self.helper = _Helper()


def test_meta_build_restores_computed_tensors():
    sd = {k: torch.randn(v.shape) for k, v in _WithComputedState().state_dict().items()}
    model = ckpt.load_model(_WithComputedState, sd)
    assert torch.equal(model.freqs, torch.tensor([0.0, 2.0, 4.0]))
    assert torch.equal(model.helper.inner.table, torch.arange(5.0))
    assert torch.equal(model.lin.weight, sd["lin.weight"])
    # large weights of the harvesting build stay on meta (no memory), small computed tensors are real
    probe = ckpt._harvest_build(_WithComputedState, ["freqs"])
    assert not probe.freqs.is_meta
