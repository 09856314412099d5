"""Full-size stage-1 models on an accelerator (skipped without one): the ss condition embedder + MoT ShortCut
generator + ss decoder run under fp16 autocast as the pipeline runs them, stay finite and close to float32."""
import time

import pytest
import torch

import backends
from sam3d_objects.model.backbone.dit.embedder.dino import Dino
from sam3d_objects.model.backbone.dit.embedder.embedder_fuser import EmbedderFuser
from sam3d_objects.model.backbone.dit.embedder.pointmap import PointPatchEmbed
from sam3d_objects.model.backbone.generator.classifier_free_guidance import \
    ClassifierFreeGuidanceWithExternalUnconditionalProbability as CFG
from sam3d_objects.model.backbone.generator.shortcut.model import ShortCut
from sam3d_objects.model.backbone.tdfy_dit.models.mm_latent import Latent, LearntPositionEmbedder, ShapePositionEmbedder
from sam3d_objects.model.backbone.tdfy_dit.models.mot_sparse_structure_flow import SparseStructureFlowTdfyWrapper
from sam3d_objects.model.backbone.tdfy_dit.models.sparse_structure_vae import SparseStructureDecoderTdfyWrapper

POSE = {"6drotation_normalized": 6, "scale": 3, "translation": 3, "translation_scale": 1}
# every accelerator of the test devices (conftest: CUDA / MPS present, or SAM3D_TEST_DEVICES); none: not collected
pytestmark = pytest.mark.accelerators_only
DEVICE = torch.device("cpu")  # set per test by _on_device


@pytest.fixture(autouse=True)
def _on_device(device):
    global DEVICE
    DEVICE = device
    yield
    backends.device.empty_cache(device)


def full_size_models():
    c = 1024
    mapping = {k: Latent(n, c, LearntPositionEmbedder(c, 1)) for k, n in POSE.items()}
    mapping["shape"] = Latent(8, c, ShapePositionEmbedder(c, 16, 1))
    flow = SparseStructureFlowTdfyWrapper(
        resolution=16, in_channels=8, model_channels=c, cond_channels=c, out_channels=8, num_blocks=24,
        num_heads=16, latent_mapping=dict(sorted(mapping.items())),
        latent_share_transformer={"6drotation_normalized": ["6drotation_normalized", "translation", "scale",
                                                             "translation_scale"]},
        qk_rms_norm=True, is_shortcut_model=True, force_zeros_cond=True)
    gen = ShortCut(CFG(flow, strength=7.0, interval=[0, 500], unconditional_handling="add_flag"),
                   inference_steps=25, rescale_t=3, no_shortcut=True)
    dino = lambda: Dino(input_size=518, dino_model="dinov2_vitl14_reg")  # noqa: E731
    fuser = EmbedderFuser([(dino(), [("image", "cropped"), ("rgb_image", "full")]),
                           (dino(), [("mask", "cropped"), ("rgb_image_mask", "full")]),
                           (PointPatchEmbed(input_size=256, patch_size=8, embed_dim=512, remap_output="linear"),
                            [("pointmap", "cropped"), ("rgb_pointmap", "full")])])
    decoder = SparseStructureDecoderTdfyWrapper(out_channels=1, latent_channels=8, num_res_blocks=2,
                                                channels=[512, 128, 32])
    torch.manual_seed(0)
    for module in (gen, fuser, decoder):
        for name, p in module.named_parameters():  # non-degenerate random weights (many inits are zero)
            with torch.no_grad():
                if p.dim() >= 2:
                    p.normal_(0, (p[0].numel()) ** -0.5)
                else:
                    p.normal_(1.0 if ("gamma" in name or name.endswith("weight")) else 0.0, 0.05)
    return gen.to(DEVICE).eval(), fuser.to(DEVICE).eval(), decoder.to(DEVICE).eval()


@torch.no_grad()
def test_full_size_stage1_under_fp16_autocast():
    gen, fuser, decoder = full_size_models()
    g = torch.Generator().manual_seed(1)
    img, mask = torch.rand(1, 3, 518, 518, generator=g), (torch.rand(1, 1, 518, 518, generator=g) > 0.5).float()
    pm = torch.randn(1, 3, 518, 518, generator=g)
    pm[:, :, :40] = float("nan")
    inputs = {k: v.to(DEVICE) for k, v in dict(image=img, rgb_image=img, mask=mask, rgb_image_mask=mask,
                                                   pointmap=pm, rgb_pointmap=pm).items()}
    shapes = {"shape": (1, 4096, 8), **{k: (1, 1, n) for k, n in POSE.items()}}
    results = {}
    for name, dtype in (("fp32", torch.float32), ("fp16", torch.float16)):
        gen.inference_steps = 4
        with backends.device.autocast(DEVICE.type, dtype=dtype, enabled=dtype != torch.float32):
            cond = fuser(**inputs)
            torch.manual_seed(42)
            out = gen(shapes, DEVICE, cond)
            logits = decoder(out["shape"].permute(0, 2, 1).reshape(1, 8, 16, 16, 16))
        assert cond.shape == (1, 2 * 1370 + 2 * 1370 + 2 * 1024, 1024)
        results[name] = (cond.float(), {k: v.float() for k, v in out.items()}, logits.float())
    (c32, o32, l32), (c16, o16, l16) = results["fp32"], results["fp16"]
    assert torch.isfinite(c16).all() and all(torch.isfinite(v).all() for v in o16.values())
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(c16, c32) < 2e-2
    for k in o32:
        assert rel(o16[k], o32[k]) < 5e-2, k
    assert l16.shape == (1, 1, 64, 64, 64) and rel(l16, l32) < 5e-2

    gen.inference_steps = 25
    backends.device.synchronize(DEVICE)
    start = time.perf_counter()
    with backends.device.autocast(DEVICE.type, dtype=torch.float16):
        cond = fuser(**inputs)
        gen(shapes, DEVICE, cond)
    backends.device.synchronize(DEVICE)
    print(f"stage 1 (embedder + 25 CFG steps, fp16 autocast) on {DEVICE}: {time.perf_counter() - start:.2f} s")
