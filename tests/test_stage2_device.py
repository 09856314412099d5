"""Full-size stage-2 models on an accelerator (skipped without one): the slat flow backbone and both decoders with
their fp16 torsos (use_fp16=True, as the released configs) stay finite and close to float32; the mesh decoder's
sparse extraction runs at 256^3 on the device."""
import math
import time

import pytest
import torch

import backends
from sam3d_objects.model.backbone.tdfy_dit.models.structured_latent_flow import SLatFlowModelTdfyWrapper
from sam3d_objects.model.backbone.tdfy_dit.models.structured_latent_vae.decoder_gs import (
    SLatGaussianDecoderTdfyWrapper)
from sam3d_objects.model.backbone.tdfy_dit.models.structured_latent_vae.decoder_mesh import (
    SLatMeshDecoderTdfyWrapper)
from sam3d_objects.model.backbone.tdfy_dit.modules.sparse import SparseTensor

# every accelerator of the test devices (conftest: CUDA / MPS present, or SAM3D_TEST_DEVICES); none: not collected
pytestmark = pytest.mark.accelerators_only
DEVICE = torch.device("cpu")  # set per test by _on_device


@pytest.fixture(autouse=True)
def _on_device(device):
    global DEVICE
    DEVICE = device
    yield
    backends.device.empty_cache(device)
GS = {"lr": {"_xyz": 1.0, "_features_dc": 1.0, "_opacity": 1.0, "_scaling": 1.0, "_rotation": 0.1},
      "perturb_offset": True, "voxel_size": 1.5, "num_gaussians": 32, "2d_filter_kernel_size": 0.1,
      "3d_filter_kernel_size": 0.0009, "scaling_bias": 0.004, "opacity_bias": 0.1, "scaling_activation": "softplus"}


def shell(n_target: int, res: int = 64) -> torch.Tensor:
    axis = torch.arange(res, dtype=torch.float32) + 0.5
    grid = torch.stack(torch.meshgrid(axis, axis, axis, indexing="ij"), -1).reshape(-1, 3)
    radius = math.sqrt(n_target / (4 * math.pi))
    keep = ((grid - res / 2).norm(dim=1) - radius).abs() < 0.5
    xyz = torch.nonzero(keep.reshape(res, res, res))
    return torch.cat([torch.zeros(xyz.shape[0], 1, dtype=torch.long), xyz], 1).int()


def randomize_(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p[0].numel()))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05 + (1.0 if name.endswith(("weight", "gamma"))
                                                                     else 0.0))
    return model


def pair(build):
    """(fp16-torso model, fp32 model with the same weights), both on the device."""
    half = randomize_(build(True)).to(DEVICE).eval()
    full = build(False).to(DEVICE).eval()
    full.load_state_dict(half.state_dict())
    return half, full


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@torch.no_grad()
def test_full_size_slat_flow_fp16():
    half, full = pair(lambda fp16: SLatFlowModelTdfyWrapper(
        resolution=64, in_channels=8, model_channels=1024, cond_channels=1024, out_channels=8, num_blocks=24,
        num_heads=16, num_io_res_blocks=2, io_block_channels=[128], patch_size=2, qk_rms_norm=True,
        use_fp16=fp16, force_zeros_cond=True))
    coords = shell(12000).to(DEVICE)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, coords.shape[0], 8, generator=g).to(DEVICE)
    cond = torch.randn(1, 5496, 1024, generator=g).to(DEVICE)
    t = torch.tensor(500.0, device=DEVICE)
    ref = full(x, t, cond, coords)
    backends.device.synchronize(DEVICE)
    start = time.perf_counter()
    out = half(x, t, cond, coords)
    backends.device.synchronize(DEVICE)
    print(f"slat flow fp16, {coords.shape[0]} voxels: {time.perf_counter() - start:.3f} s")
    assert half.blocks[0].self_attn.to_qkv.weight.dtype == torch.float16
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert rel(out, ref) < 3e-2


@torch.no_grad()
def test_full_size_decoders_fp16():
    coords = shell(20000).to(DEVICE)
    feats = torch.randn(coords.shape[0], 8, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    x = SparseTensor(feats=feats, coords=coords)
    gs_half, gs_full = pair(lambda fp16: SLatGaussianDecoderTdfyWrapper(
        resolution=64, model_channels=768, latent_channels=8, num_blocks=12, num_heads=12, window_size=8,
        representation_config=GS, use_fp16=fp16))
    g16, g32 = gs_half(x)[0], gs_full(x)[0]
    assert g16._xyz.device.type == DEVICE.type and g16._xyz.shape == (coords.shape[0] * 32, 3)
    for attr in ("get_xyz", "get_scaling", "get_opacity"):
        assert torch.isfinite(getattr(g16, attr)).all() and rel(getattr(g16, attr), getattr(g32, attr)) < 3e-2, attr

    mesh_half, mesh_full = pair(lambda fp16: SLatMeshDecoderTdfyWrapper(
        resolution=64, model_channels=768, latent_channels=8, num_blocks=12, num_heads=12, window_size=8,
        representation_config={"use_color": True}, use_fp16=fp16))
    backends.device.reset_peak_memory(DEVICE)
    backends.device.synchronize(DEVICE)
    start = time.perf_counter()
    m16 = mesh_half(x)[0]
    backends.device.synchronize(DEVICE)
    print(f"mesh decoder fp16, {coords.shape[0]} voxels -> {m16.vertices.shape[0]} vertices: "
          f"{time.perf_counter() - start:.2f} s, peak {backends.device.peak_memory(DEVICE) / 2 ** 30:.2f} GiB")
    m32 = mesh_full(x)[0]
    assert m16.success and m32.success and m16.vertices.device.type == DEVICE.type
    assert abs(m16.vertices.shape[0] - m32.vertices.shape[0]) < 0.02 * m32.vertices.shape[0]
    assert float(m16.vertices.abs().max()) < 0.51
