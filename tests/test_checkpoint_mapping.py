"""A use_fp16 torso loaded on the CPU: converted to float32 at load, and the checkpoint's mapping (with the half
pages read for the conversion) released, while float32 models keep their zero-copy load."""
import functools
import sys

import pytest
import torch

from sam3d_objects.model.backbone.tdfy_dit.models.structured_latent_flow import SLatFlowModel
from sam3d_objects.model.backbone.tdfy_dit.modules.utils import settle_torso_dtypes
from sam3d_objects.pipeline import checkpoint as ckpt


def build_flow(channels: int = 64, blocks: int = 1, use_fp16: bool = True) -> SLatFlowModel:
    return SLatFlowModel(resolution=16, in_channels=8, model_channels=channels, cond_channels=32, out_channels=8,
                         num_blocks=blocks, num_heads=4, io_block_channels=[16], patch_size=2, use_fp16=use_fp16)


def save(model: torch.nn.Module, path) -> dict:
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ckpt.save_checkpoint(sd, path)
    return sd


def file_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("RssFile:"))
    return int(line.split()[1]) * 1024


def test_fp16_torso_is_float32_on_cpu_and_no_tensor_points_into_the_file(tmp_path):
    torch.manual_seed(0)
    saved = save(build_flow(), tmp_path / "flow.ckpt")
    assert any(v.dtype == torch.float16 for v in saved.values())
    model = ckpt.load_model(build_flow, tmp_path / "flow.ckpt")
    assert model.dtype == torch.float32
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], v.float()) for k, v in saved.items())  # fp16 -> fp32 is exact

    # the same steps by hand, with the file's tensors in view: afterwards none of the model's tensors is one of them
    sd = ckpt.read_checkpoint(tmp_path / "flow.ckpt")
    model = ckpt.load_into_meta_model(ckpt.build_on_meta(build_flow), sd, torch.device("cpu"))
    settle_torso_dtypes(model, torch.device("cpu"))
    file_ptrs = {t.untyped_storage().data_ptr() for t in sd.values()}
    still_mapped = [t for t in model.state_dict().values() if t.untyped_storage().data_ptr() in file_ptrs]
    assert still_mapped, "float32 norms / embedders are used in place before the release"
    copied = ckpt.release_checkpoint_mapping(model, sd)
    assert copied == sum(t.untyped_storage().nbytes() for t in {id(t): t for t in still_mapped}.values())
    assert not [t for t in model.state_dict().values() if t.untyped_storage().data_ptr() in file_ptrs]


def test_float32_model_keeps_its_zero_copy_load(tmp_path):
    torch.manual_seed(0)
    save(build_flow(use_fp16=False), tmp_path / "flow32.ckpt")
    sd = ckpt.read_checkpoint(tmp_path / "flow32.ckpt")
    model = ckpt.load_into_meta_model(ckpt.build_on_meta(functools.partial(build_flow, use_fp16=False)), sd,
                                      torch.device("cpu"))
    assert ckpt.release_checkpoint_mapping(model, sd) == 0
    assert all(model.state_dict()[k].data_ptr() == v.data_ptr() for k, v in sd.items())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads RssFile from /proc/self/status")
def test_half_pages_read_for_the_conversion_leave_with_the_load(tmp_path):
    torch.manual_seed(0)
    big = functools.partial(build_flow, channels=384, blocks=6)  # ~16 M fp16 torso parameters, ~32 MB in the file
    save(big(), tmp_path / "big.ckpt")
    half_bytes = sum(t.numel() * 2 for t in ckpt.read_checkpoint(tmp_path / "big.ckpt").values()
                     if t.dtype == torch.float16)
    assert half_bytes > 24 * 2 ** 20

    ckpt.load_model(big, tmp_path / "big.ckpt")  # warm-up: imports, page cache, allocator
    before = file_rss_bytes()
    model = ckpt.load_model(big, tmp_path / "big.ckpt")
    released = file_rss_bytes() - before
    assert model.dtype == torch.float32

    # the reference: the same load with the file's tensors still referenced keeps the half pages resident
    sd = ckpt.read_checkpoint(tmp_path / "big.ckpt")
    before = file_rss_bytes()
    held = ckpt.load_into_meta_model(ckpt.build_on_meta(big), sd, torch.device("cpu"))
    held.compute_dtype(torch.device("cpu"))
    kept = file_rss_bytes() - before
    assert kept > 0.8 * half_bytes
    assert released < 0.25 * half_bytes
