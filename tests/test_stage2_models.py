"""Stage-2 models: batch independence, bad inputs, empty structures, half-precision torsos (fp32 CPU fallback)."""
import pytest
import torch

import backends
from sam3d_objects.model.backbone.tdfy_dit.models.structured_latent_flow import SLatFlowModelTdfyWrapper
from sam3d_objects.model.backbone.tdfy_dit.models.structured_latent_vae.decoder_gs import (
    SLatGaussianDecoderTdfyWrapper)
from sam3d_objects.model.backbone.tdfy_dit.models.structured_latent_vae.decoder_mesh import (
    SLatMeshDecoderTdfyWrapper)
from sam3d_objects.model.backbone.tdfy_dit.modules.sparse import SparseTensor

GS_CONFIG = {"lr": {"_xyz": 1.0, "_features_dc": 1.0, "_opacity": 1.0, "_scaling": 1.0, "_rotation": 0.1},
             "perturb_offset": True, "voxel_size": 1.5, "num_gaussians": 4, "2d_filter_kernel_size": 0.1,
             "3d_filter_kernel_size": 0.0009, "scaling_bias": 0.004, "opacity_bias": 0.1,
             "scaling_activation": "softplus"}


def randomize_(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (p.shape[-1] ** -0.5 if p.dim() >= 2 else 0.1))
    return model.eval()


def flow_model(use_fp16=False):
    return randomize_(SLatFlowModelTdfyWrapper(resolution=16, in_channels=8, model_channels=32, cond_channels=16,
                                               out_channels=8, num_blocks=2, num_heads=2, num_io_res_blocks=2,
                                               io_block_channels=[16], patch_size=2, qk_rms_norm=True,
                                               use_fp16=use_fp16, force_zeros_cond=True))


def voxels(n, res, batch, seed):
    g = torch.Generator().manual_seed(seed)
    xyz = torch.unique(torch.randint(0, res, (n, 3), generator=g), dim=0)
    return torch.cat([torch.full((xyz.shape[0], 1), batch), xyz], 1).int()


def test_flow_batch_elements_are_independent():
    model = flow_model()
    c0, c1 = voxels(80, 16, 0, 1), voxels(60, 16, 1, 2)
    x = torch.randn(1, c0.shape[0] + c1.shape[0], 8)
    t = torch.tensor([300.0, 700.0])
    cond = torch.randn(2, 5, 16)
    with torch.no_grad():
        both = model(x, t, cond, torch.cat([c0, c1]).numpy())
        first = model(x[:, :c0.shape[0]], t[:1], cond[:1], c0.numpy())
        c1_alone = c1.clone()
        c1_alone[:, 0] = 0
        second = model(x[:, c0.shape[0]:], t[1:], cond[1:], c1_alone.numpy())
    torch.testing.assert_close(both, torch.cat([first, second], dim=1), rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        uncond = model(x[:, :c0.shape[0]], t[:1], cond[:1], c0.numpy(), cfg=True)
        zero = model(x[:, :c0.shape[0]], t[:1], torch.zeros_like(cond[:1]), c0.numpy())
    torch.testing.assert_close(uncond, zero)


def test_flow_bad_inputs():
    model = flow_model()
    c = voxels(40, 16, 0, 3)
    x, t, cond = torch.randn(1, c.shape[0], 8), torch.tensor(500.0), torch.randn(1, 5, 16)
    with torch.no_grad():
        bad = c.clone()
        bad[0, 1] = 16
        with pytest.raises(ValueError, match=r"\[0, 16\)"):
            model(x, t, cond, bad)
        two = torch.cat([voxels(10, 16, 1, 4), voxels(10, 16, 0, 5)])
        with pytest.raises(ValueError, match="contiguous"):
            model(torch.randn(1, two.shape[0], 8), t, cond, two)
        with pytest.raises(ValueError, match=r"feats \[N, 8\]"):
            model(torch.randn(1, c.shape[0], 5), t, cond, c)
        with pytest.raises(ValueError, match="0 voxels"):
            model(torch.randn(1, 0, 8), t, cond, torch.zeros(0, 4, dtype=torch.int32))
        with pytest.raises(ValueError, match="ctx_channels"):
            model(x, t, torch.randn(1, 5, 7), c)


def test_flow_fp16_torso_cpu_fallback_and_half_path(monkeypatch):
    half = flow_model(use_fp16=True)
    assert half.blocks[0].self_attn.to_qkv.weight.dtype == torch.float16
    assert half.out_layer.weight.dtype == torch.float32
    full = flow_model()
    full.load_state_dict(half.state_dict())  # the same fp16-rounded weights, in fp32
    c = voxels(60, 16, 0, 6)
    args = (torch.randn(1, c.shape[0], 8), torch.tensor(250.0), torch.randn(1, 5, 16), c)
    with torch.no_grad():
        ref = full(*args)
        out = half(*args)  # CPU: torso cast up to fp32 once
    torch.testing.assert_close(out, ref)
    assert half.blocks[0].self_attn.to_qkv.weight.dtype == torch.float32
    monkeypatch.setattr(backends.device, "half_supported", lambda device, dtype=torch.float16: True)
    with torch.no_grad():
        out16 = half(*args)  # as on CUDA/MPS (e.g. after .to(device)): torso back in fp16, run here on CPU
    assert half.blocks[0].self_attn.to_qkv.weight.dtype == torch.float16
    assert out16.dtype == torch.float32
    assert float((out16 - ref).abs().max()) < 5e-2 * float(ref.abs().max())


def gs_decoder():
    return randomize_(SLatGaussianDecoderTdfyWrapper(resolution=16, model_channels=32, latent_channels=8,
                                                     num_blocks=2, num_heads=2, window_size=4,
                                                     representation_config=GS_CONFIG))


def mesh_decoder():
    return randomize_(SLatMeshDecoderTdfyWrapper(resolution=4, model_channels=256, latent_channels=8, num_blocks=1,
                                                 num_heads=4, window_size=4, representation_config={"use_color": True}))


def test_decoders_on_empty_and_bad_inputs():
    empty = SparseTensor(feats=torch.zeros(0, 8), coords=torch.zeros(0, 4, dtype=torch.int32))
    with torch.no_grad():
        assert gs_decoder()(empty) == []
        assert mesh_decoder()(empty) == []
        with pytest.raises(ValueError, match=r"\[0, 16\)"):
            gs_decoder()(SparseTensor(feats=torch.randn(1, 8), coords=torch.tensor([[0, 0, 16, 0]],
                                                                                   dtype=torch.int32)))


def test_gs_decoder_batch_elements():
    model = gs_decoder()
    c0, c1 = voxels(30, 16, 0, 7), voxels(20, 16, 1, 8)
    feats = torch.randn(c0.shape[0] + c1.shape[0], 8)
    with torch.no_grad():
        both = model(SparseTensor(feats=feats, coords=torch.cat([c0, c1])))
        c1_alone = c1.clone()
        c1_alone[:, 0] = 0
        second = model(SparseTensor(feats=feats[c0.shape[0]:], coords=c1_alone))
    assert len(both) == 2 and both[1]._xyz.shape == (c1.shape[0] * 4, 3)
    torch.testing.assert_close(both[1].get_xyz, second[0].get_xyz, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(both[1].get_scaling, second[0].get_scaling, rtol=1e-4, atol=1e-5)


def test_mesh_decoder_produces_a_mesh_inside_the_box():
    model = mesh_decoder()
    c = voxels(20, 4, 0, 9)
    with torch.no_grad():
        meshes = model(SparseTensor(feats=torch.randn(c.shape[0], 8), coords=c))
    assert len(meshes) == 1
    m = meshes[0]
    assert m.vertex_attrs.shape == (m.vertices.shape[0], 6)
    if m.success:
        assert float(m.vertices.abs().max()) <= 0.5 + 0.5 / 16 + 1e-6  # grid box + at most half a cube deform
        assert int(m.faces.max()) < m.vertices.shape[0]


def test_flow_upsampling_block_works_on_the_coarse_rows(monkeypatch):
    """The first output block's norm, SiLU, skip layer and first convolution run on the coarse rows (the
    convolution on the parents where the backend can): the same flow output as the layers called one by one on the
    upsampled voxels, which is the path a forward hook on any of them gets (and sees upstream's inputs)."""
    import backends.sparse_conv as sc

    model = flow_model()
    block = model.out_blocks[0]
    assert block.upsample and block.conv1.in_channels >= 4 * block.conv1.out_channels
    xyz = torch.stack(torch.meshgrid(*[torch.arange(4, 12)] * 3, indexing="ij"), -1).reshape(-1, 3)
    coords = torch.cat([torch.zeros(xyz.shape[0], 1, dtype=torch.long), xyz], 1).int()  # 8 voxels a parent
    x, t, cond = torch.randn(1, coords.shape[0], 8), torch.tensor([300.0]), torch.randn(1, 5, 16)
    coarse = []
    real = sc.upsampled_sparse_conv3d
    monkeypatch.setattr(sc, "upsampled_sparse_conv3d", lambda *a, **k: coarse.append(a[0].shape) or real(*a, **k))
    with torch.no_grad():
        fast = model(x, t, cond, coords.numpy())
        assert coarse == [(coords.shape[0] // 8, block.conv1.in_channels)]
        seen = []
        handle = block.conv1.register_forward_hook(lambda m, args, out: seen.append(args[0].feats.shape))
        plain = model(x, t, cond, coords.numpy())
        handle.remove()
    assert len(coarse) == 1 and seen == [(coords.shape[0], block.conv1.in_channels)]
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)
