"""Stage-1 models and condition embedders: meta-device construction + assign loading against the golden data,
fixed buffers against the golden weights, MoT attention pattern, building blocks against naive references,
fp16 torsos, and clear errors on bad input."""
import itertools
import json

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from safetensors.torch import load_file

from sam3d_objects.model.backbone.dit.embedder.dino import Dino
from sam3d_objects.model.backbone.dit.embedder.pointmap import PointPatchEmbed
from sam3d_objects.model.backbone.tdfy_dit.models.mm_latent import ShapePositionEmbedder
from sam3d_objects.model.backbone.tdfy_dit.models.sparse_structure_utils import (downsample_sparse_structure,
                                                                                 prune_sparse_structure)
from sam3d_objects.model.backbone.tdfy_dit.modules.spatial import patchify, pixel_shuffle_3d, unpatchify

DINO_KEYS = ("img_size", "embed_dim", "depth", "num_heads")


def load_case(golden_dir, name):
    folder = golden_dir / name
    meta = json.loads((folder / "case.json").read_text())
    return (OmegaConf.load(folder / "config.yaml"), load_file(str(folder / "weights.safetensors")),
            load_file(str(folder / "inputs.safetensors")), load_file(str(folder / "outputs.safetensors")), meta)


def with_dino_sizes(node, sizes):
    node = OmegaConf.to_container(node) if OmegaConf.is_config(node) else node
    if isinstance(node, dict):
        node = {k: with_dino_sizes(v, sizes) for k, v in node.items()}
        if str(node.get("_target_", "")).endswith(".Dino"):
            node["backbone_kwargs"] = {k: sizes[k] for k in DINO_KEYS}
    elif isinstance(node, list):
        node = [with_dino_sizes(v, sizes) for v in node]
    return node


def meta_built_and_loaded(node, weights):
    with torch.device("meta"):
        module = instantiate(node)
    assert all(t.is_meta for t in module.state_dict().values())
    module.load_state_dict(weights, strict=True, assign=True)
    return module.eval()


def prefixed(weights, prefix):
    return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}


def close(actual, expected, tol):
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


# ---------------------------------------------------------------------------------------------------------------
# meta construction + assign=True loading reproduces the golden outputs
# ---------------------------------------------------------------------------------------------------------------
# each on every test device (inputs moved there, outputs compared on the host; no TF32)
def on(tree, device):
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    return {k: on(v, device) for k, v in tree.items()}


def module_on(module, device):
    """The loaded module on ``device``; buffers an assign=True load leaves on the meta device stay there (the
    modules rebuild them where their input is, e.g. Dino's ImageNet mean / std)."""
    return module._apply(lambda t: t if t.is_meta else t.to(device))


@torch.no_grad()
def test_meta_assign_ss_flow_mot(golden_dir, device, exact_float32):
    cfg, w, inp, out, _ = load_case(golden_dir, "ss_flow_mot")
    model = meta_built_and_loaded(cfg, w).to(device)
    latents = prefixed(inp, "latent.")
    result = model(on(latents, device), inp["t"].to(device), inp["cond"].to(device), d=inp["d"].to(device))
    for name in latents:
        close(result[name].cpu(), out[f"out.{name}"], 1e-4)


@torch.no_grad()
def test_meta_assign_ss_decoder(golden_dir, device, exact_float32):
    cfg, w, inp, out, _ = load_case(golden_dir, "ss_decoder")
    model = meta_built_and_loaded(cfg, w).to(device)
    close(model(inp["x"].to(device)).cpu(), out["y"], 1e-4)


@torch.no_grad()
def test_meta_assign_embedder_fuser(golden_dir, device, exact_float32):
    cfg, w, inp, out, meta = load_case(golden_dir, "embedder_fuser")
    sizes = meta["tiny_sizes"]["dino"]
    for prefix in ("ss", "slat"):
        fuser = meta_built_and_loaded(with_dino_sizes(cfg[f"{prefix}_condition_embedder"], sizes),
                                      prefixed(w, prefix + "."))
        fuser = module_on(fuser, device)
        tokens = fuser(**{name: inp[name].to(device) for name in fuser.input_names})
        close(tokens.cpu(), out[f"{prefix}_tokens"], 2e-4)


@torch.no_grad()
def test_meta_assign_point_patch_embed(golden_dir, device, exact_float32):
    cfg, w, inp, out, _ = load_case(golden_dir, "point_patch_embed")
    model = meta_built_and_loaded(cfg.linear, prefixed(w, "linear.")).to(device)
    close(model(inp["xyz"].to(device)).cpu(), out["linear.tokens"], 1e-4)


# ---------------------------------------------------------------------------------------------------------------
# fixed buffers and structure
# ---------------------------------------------------------------------------------------------------------------
def test_shape_position_embedding_matches_checkpoint_buffer(golden_dir):
    # the golden weights keep buffers as upstream constructed them
    cfg, w, _, _, _ = load_case(golden_dir, "ss_flow_mot")
    node = cfg.latent_mapping.shape.pos_embedder
    table = ShapePositionEmbedder(node.model_channels, node.resolution, node.patch_size)
    torch.testing.assert_close(table, w["latent_mapping.shape.pos_emb"], rtol=0, atol=1e-6)


@torch.no_grad()
def test_mot_shape_stream_ignores_pose_and_pose_reads_shape(golden_dir):
    cfg, w, inp, _, _ = load_case(golden_dir, "ss_flow_mot")
    model = instantiate(cfg)
    model.load_state_dict(w)
    model.eval()
    latents = prefixed(inp, "latent.")
    base = model(latents, inp["t"], inp["cond"], d=inp["d"])
    pose_changed = dict(latents, translation=latents["translation"] + 1.0)
    out = model(pose_changed, inp["t"], inp["cond"], d=inp["d"])
    torch.testing.assert_close(out["shape"], base["shape"], rtol=0, atol=0)
    assert (out["scale"] - base["scale"]).abs().max() > 1e-3  # pose tokens see each other
    shape_changed = dict(latents, shape=latents["shape"] + 1.0)
    out = model(shape_changed, inp["t"], inp["cond"], d=inp["d"])
    assert (out["translation"] - base["translation"]).abs().max() > 1e-3  # pose tokens read shape tokens


def test_pixel_shuffle_3d_matches_naive_rule():
    s, c = 2, 3
    x = torch.randn(2, c * s ** 3, 3, 2, 4)
    y = pixel_shuffle_3d(x, s)
    for b, k, i, j, l in itertools.product(range(2), range(c), range(6), range(4), range(8)):
        channel = ((k * s + i % s) * s + j % s) * s + l % s  # (C, sx, sy, sz), sx slowest
        assert y[b, k, i, j, l] == x[b, channel, i // s, j // s, l // s]


def test_patchify_roundtrip():
    x = torch.randn(2, 3, 4, 6, 8)
    torch.testing.assert_close(unpatchify(patchify(x, 2), 2), x, rtol=0, atol=0)


def naive_prune(coords, dist=1):
    occupied = set(map(tuple, coords.tolist()))
    offsets = list(itertools.product(range(-dist, dist + 1), repeat=3))
    keep = [any((b, x + i, y + j, z + k) not in occupied for i, j, k in offsets)
            for b, x, y, z in coords.tolist()]
    return coords[torch.tensor(keep)]


def test_prune_matches_naive_neighbour_count():
    g = torch.Generator().manual_seed(0)
    dense = torch.rand(2, 9, 9, 9, generator=g) < 0.8  # many full neighbourhoods, two batch items
    coords = torch.argwhere(dense).int()
    coords = coords[torch.randperm(coords.shape[0], generator=g)]  # order must be preserved, whatever it is
    torch.testing.assert_close(prune_sparse_structure(coords, max_neighbor_axes_dist=1), naive_prune(coords))


def test_downsample_is_a_noop_below_max_coords():
    coords = torch.tensor([[0, 1, 2, 3], [0, 4, 5, 6]], dtype=torch.int32)
    out, factor = downsample_sparse_structure(coords, max_coords=2)
    assert factor == 1 and out is coords


def test_downsample_halves_the_box(golden_dir):
    _, _, _, out, _ = load_case(golden_dir, "ss_decoder")
    coords, factor = downsample_sparse_structure(out["postprocess.pruned"], max_coords=609, downsample_factor=2)
    assert factor == 2 and coords.dtype == torch.int32
    torch.testing.assert_close(coords, out["postprocess.downsampled"], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------------
# point maps with non-finite points
# ---------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def test_point_patch_embed_invalid_points_use_invalid_token():
    torch.manual_seed(0)
    model = PointPatchEmbed(input_size=16, patch_size=8, embed_dim=32, remap_output="linear").eval()
    torch.nn.init.normal_(model.invalid_xyz_token)
    xyz = torch.randn(1, 3, 16, 16)
    xyz[0, 0, 2, 3] = float("nan")
    xyz[0, 1, 5, 5] = float("inf")
    xyz[0, 2, 9, 1] = -float("inf")
    emb, batch, height, width = model.embed_pointmap_windows(xyz)
    assert (batch, height, width) == (1, 16, 16)
    for i, j in ((2, 3), (5, 5), (9, 1)):
        torch.testing.assert_close(emb[0, i, j], model.invalid_xyz_token)
    tokens = model(xyz)
    assert torch.isfinite(tokens).all()
    other = xyz.clone()
    other[~torch.isfinite(other)] = float("nan")  # any non-finite value is just "invalid"
    torch.testing.assert_close(model(other), tokens, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------------
# fp16 torsos
# ---------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def test_use_fp16_converts_only_the_blocks(golden_dir):
    cfg, w, inp, out, _ = load_case(golden_dir, "ss_flow_mot")
    cfg.use_fp16 = True
    model = instantiate(cfg)
    model.load_state_dict(w)
    model.eval()
    for name, p in model.named_parameters():
        linear_in_blocks = name.startswith("blocks.") and ("norm2" not in name and "rms_norm" not in name)
        assert p.dtype == (torch.float16 if linear_in_blocks else torch.float32), name
    latents = prefixed(inp, "latent.")
    result = model(latents, inp["t"], inp["cond"], d=inp["d"])
    for name in latents:
        assert result[name].dtype == torch.float32
        close(result[name], out[f"out.{name}"], 2e-2)


# ---------------------------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------------------------
def tiny_dino(**kwargs):
    return Dino(input_size=28, dino_model="dinov2_vits14_reg",
                backbone_kwargs=dict(img_size=28, embed_dim=32, depth=1, num_heads=2), **kwargs)


def test_dino_tiny_sizes_and_outputs():
    with torch.no_grad():
        dino = tiny_dino().eval()
        assert dino(torch.rand(2, 3, 40, 50)).shape == (2, 1 + 4, 32)
        assert dino(torch.rand(2, 1, 40, 50)).shape == (2, 1 + 4, 32)
        pre = tiny_dino(prenorm_features=True).eval()
        assert pre(torch.rand(1, 3, 28, 28)).shape == (1, 1 + 4 + 4, 32)
    keys = set(dino.state_dict())
    assert {"backbone.mask_token", "backbone.norm.weight", "backbone.register_tokens"} <= keys
    assert "mean" not in keys and "std" not in keys


@pytest.mark.parametrize("shape", [(1, 2, 28, 28), (1, 4, 28, 28), (3, 28, 28)])
def test_dino_rejects_bad_channels(shape):
    with pytest.raises(ValueError, match="Dino expects"):
        tiny_dino()(torch.rand(*shape))


def test_dino_unknown_model_name():
    with pytest.raises(ValueError, match="unknown DINOv2 model"):
        Dino(dino_model="dinov2_vitx99")


def test_point_patch_embed_rejects_bad_shapes():
    model = PointPatchEmbed(input_size=16, patch_size=8, embed_dim=32)
    with pytest.raises(ValueError, match=r"point map \[B, 3, H, W\]"):
        model(torch.rand(1, 4, 16, 16))
    with pytest.raises(ValueError, match="valid_mask"):
        model(torch.rand(1, 3, 20, 20), torch.ones(1, 20, 20, dtype=torch.bool))


@pytest.fixture(scope="module")
def tiny_fuser(golden_dir):
    cfg, w, _, _, meta = load_case(golden_dir, "embedder_fuser")
    fuser = instantiate(with_dino_sizes(cfg.ss_condition_embedder, meta["tiny_sizes"]["dino"]))
    fuser.load_state_dict(prefixed(w, "ss."))
    return fuser.eval()


def fuser_inputs(batch=1):
    img, mask, pm = torch.rand(batch, 3, 70, 70), torch.rand(batch, 1, 70, 70), torch.randn(batch, 3, 32, 32)
    return dict(image=img, rgb_image=img, mask=mask, rgb_image_mask=mask, pointmap=pm, rgb_pointmap=pm)


def test_fuser_missing_modality(tiny_fuser):
    inputs = fuser_inputs()
    del inputs["rgb_pointmap"]
    with pytest.raises(ValueError, match="rgb_pointmap"):
        tiny_fuser(**inputs)


def test_fuser_mask_must_be_one_channel(tiny_fuser):
    inputs = fuser_inputs()
    inputs["mask"] = torch.rand(1, 3, 70, 70)
    with pytest.raises(ValueError, match="1 channel"):
        tiny_fuser(**inputs)


def test_fuser_batch_mismatch(tiny_fuser):
    inputs = fuser_inputs()
    inputs["image"] = torch.rand(2, 3, 70, 70)
    with pytest.raises(ValueError, match="batch sizes"):
        tiny_fuser(**inputs)


def test_fuser_positional_inputs_refused(tiny_fuser):
    with pytest.raises(TypeError, match="keyword"):
        tiny_fuser(torch.rand(1, 3, 70, 70))


def test_fuser_is_deterministic_in_eval_despite_dropout(tiny_fuser):
    inputs = fuser_inputs()
    with torch.no_grad():
        torch.testing.assert_close(tiny_fuser(**inputs), tiny_fuser(**inputs), rtol=0, atol=0)


def test_mot_rejects_missing_latent(golden_dir):
    cfg, w, inp, _, _ = load_case(golden_dir, "ss_flow_mot")
    model = instantiate(cfg).eval()
    latents = prefixed(inp, "latent.")
    del latents["scale"]
    with pytest.raises(ValueError, match="missing \\['scale'\\]"):
        model(latents, inp["t"], inp["cond"])
    with pytest.raises(ValueError, match="condition tokens"):
        model(prefixed(inp, "latent."), inp["t"], inp["cond"][..., :5])


# ---------------------------------------------------------------------------------------------------------------
# device workarounds, checked on CPU against the plain kernels
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel,padding", [(3, (1, 1, 1)), (1, (0, 0, 0))])
def test_conv3d_as_conv2d_matches_conv3d(kernel, padding):
    from backends.dense_conv import conv3d_as_conv2d

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 6, 7, 4, generator=g, dtype=torch.float64)
    w = torch.randn(3, 5, kernel, kernel, kernel, generator=g, dtype=torch.float64)
    b = torch.randn(3, generator=g, dtype=torch.float64)
    torch.testing.assert_close(conv3d_as_conv2d(x, w, b, padding),
                               torch.nn.functional.conv3d(x, w, b, padding=padding))


@torch.no_grad()
def test_point_patch_embed_windows_in_groups_match():
    torch.manual_seed(0)
    model = PointPatchEmbed(input_size=32, patch_size=8, embed_dim=32).eval()
    tokens = torch.randn(16, 65, 32)
    whole = model._run_blocks(tokens)
    grouped = torch.cat([model._run_blocks(chunk) for chunk in tokens.split(5)])
    torch.testing.assert_close(grouped, whole, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# dense building blocks shared with the stage-2 models
# ---------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def test_modulated_blocks_with_zero_modulation_are_identity_except_cross_attention():
    from sam3d_objects.model.backbone.tdfy_dit.modules.transformer import (ModulatedTransformerBlock,
                                                                           ModulatedTransformerCrossBlock)

    torch.manual_seed(0)
    x, mod, ctx = torch.randn(2, 5, 32), torch.randn(2, 32), torch.randn(2, 3, 16)
    block = ModulatedTransformerBlock(32, num_heads=4, qk_rms_norm=True).eval()
    torch.nn.init.zeros_(block.adaLN_modulation[1].weight)
    torch.nn.init.zeros_(block.adaLN_modulation[1].bias)  # all gates 0 -> residual branches vanish
    torch.testing.assert_close(block(x, mod), x)
    cross = ModulatedTransformerCrossBlock(32, 16, num_heads=4).eval()
    torch.nn.init.zeros_(cross.adaLN_modulation[1].weight)
    torch.nn.init.zeros_(cross.adaLN_modulation[1].bias)
    expected = x + cross.cross_attn(cross.norm2(x), ctx)  # the only ungated branch
    torch.testing.assert_close(cross(x, mod, ctx), expected)


@torch.no_grad()
def test_multihead_attention_matches_float64_reference():
    from sam3d_objects.model.backbone.tdfy_dit.modules.attention import MultiHeadAttention

    torch.manual_seed(0)
    attn = MultiHeadAttention(16, num_heads=2, type="cross", ctx_channels=8, qk_rms_norm=True).double().eval()
    x, ctx = torch.randn(2, 4, 16, dtype=torch.float64), torch.randn(2, 6, 8, dtype=torch.float64)
    q = attn.to_q(x).reshape(2, 4, 2, 8)
    k, v = attn.to_kv(ctx).reshape(2, 6, 2, 2, 8).unbind(2)
    q = q / q.norm(dim=-1, keepdim=True) * attn.q_rms_norm.gamma * 8 ** 0.5
    k = k / k.norm(dim=-1, keepdim=True) * attn.k_rms_norm.gamma * 8 ** 0.5
    weights = torch.einsum("blhd,bmhd->bhlm", q, k).div(8 ** 0.5).softmax(-1)
    expected = attn.to_out(torch.einsum("bhlm,bmhd->blhd", weights, v).reshape(2, 4, 16))
    torch.testing.assert_close(attn(x, ctx), expected)


@torch.no_grad()
def test_dense_sparse_structure_flow_shapes():
    from sam3d_objects.model.backbone.tdfy_dit.models.sparse_structure_flow import SparseStructureFlowModel

    model = SparseStructureFlowModel(resolution=4, in_channels=3, model_channels=32, cond_channels=8,
                                     out_channels=3, num_blocks=1, num_heads=2, patch_size=2).eval()
    out = model(torch.randn(2, 3, 4, 4, 4), torch.tensor([1.0, 500.0]), torch.randn(2, 5, 8))
    assert out.shape == (2, 3, 4, 4, 4)
    with pytest.raises(ValueError, match="expected input"):
        model(torch.randn(2, 3, 8, 8, 8), torch.tensor([1.0, 2.0]), torch.randn(2, 5, 8))


@torch.no_grad()
def test_meta_assign_shortcut_generator_reproduces_golden_run(golden_dir):
    cfg, w, inp, out, meta = load_case(golden_dir, "samplers")
    gen = meta_built_and_loaded(cfg.shortcut, prefixed(w, "shortcut."))
    details = meta["run_details"]["shortcut"]
    gen.no_shortcut, gen.rescale_t, gen.inference_steps = details["no_shortcut"], details["rescale_t"], \
        details["inference_steps"]
    gen.reverse_fn.strength, gen.reverse_fn.interval = details["cfg_strength"], details["cfg_interval"]
    shapes = {k: tuple(v) for k, v in meta["latent_shape_dict"].items()}
    torch.manual_seed(42)  # as case.json "runs" says
    result = gen(shapes, torch.device("cpu"), inp["shortcut.cond"])
    for k in shapes:
        close(result[k], out[f"shortcut.final.{k}"], 1e-3)


def test_mot_rejects_batch_mismatch(golden_dir):
    cfg, _, inp, _, _ = load_case(golden_dir, "ss_flow_mot")
    model = instantiate(cfg).eval()
    with pytest.raises(ValueError, match="batch sizes differ"):
        model(prefixed(inp, "latent."), inp["t"], inp["cond"][:1])
