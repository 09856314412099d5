"""``Inference(dtype=...)`` / ``--dtype``: the half type the condition and sampling stages run under. "auto" keeps
the yaml's float16 (float32 on the CPU); "bfloat16" runs them under CPU bfloat16 autocast, measured against the
float32 run of the golden tiny pipeline with the same inputs and seed."""
import numpy as np
import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file

from test_pipeline_tiny import tiny_folder  # noqa: F401  (fixture: the golden tiny checkpoint folder)

import backends
from sam3d_objects.model.backbone.tdfy_dit.modules.quantized import QuantizedLinear
from sam3d_objects.pipeline.inference_pipeline import check_sampling_dtype

SEED = 42


def test_dtype_names_are_checked():
    assert check_sampling_dtype("auto") is None and check_sampling_dtype(None) is None
    assert check_sampling_dtype("bf16") == "bfloat16" and check_sampling_dtype("float32") == "float32"
    with pytest.raises(ValueError, match="auto, bfloat16, float16, float32"):
        check_sampling_dtype("int4")


def _matmul_dtypes(pipeline):
    """Records the output dtype of every Linear of both generators' backbones while they run."""
    seen = {"ss_generator": set(), "slat_generator": set()}
    hooks = []

    def watch(name, model):
        for module in model.modules():
            if isinstance(module, (torch.nn.Linear, QuantizedLinear)):
                hooks.append(module.register_forward_hook(lambda m, i, o, n=name: seen[n].add(o.dtype)))
    return seen, hooks, watch


@pytest.fixture(scope="module")
def runs(tiny_folder, golden_dir):  # noqa: F811
    from benchmarks.bench_int8_gate import render_views
    from sam3d_objects.inference import Inference
    inp = load_file(str(golden_dir / "pipeline_tiny" / "inputs.safetensors"))
    results = {}
    for dtype in ("auto", "bfloat16"):
        inference = Inference(str(tiny_folder / "pipeline.yaml"), compile=False, device="cpu", dtype=dtype,
                              low_memory=False)
        seen, hooks, watch = _matmul_dtypes(inference.pipeline)
        for name in seen:
            watch(name, inference.pipeline.models[name])
        out = inference(inp["image_rgb"].numpy(), inp["mask"].numpy(), seed=SEED, pointmap=inp["pointmap"].clone())
        for h in hooks:
            h.remove()
        results[dtype] = {"coords": out["coords"].numpy(), "views": render_views(out["gaussian"][0], 4, 128),
                          "matmuls": seen, "pipeline": inference.pipeline}
    return results


def test_auto_keeps_float32_on_the_cpu(runs):
    assert runs["auto"]["matmuls"] == {"ss_generator": {torch.float32}, "slat_generator": {torch.float32}}


def test_bfloat16_samples_in_bfloat16_close_to_float32(runs):
    """Measured (2-core AVX-512 BF16 machine): occupancy IoU 0.969 against float32; the tiny random pipeline is
    chaotic (0.3% relative weight noise alone gives IoU 0.991), so the bound is loose; the views stay finite."""
    from benchmarks.bench_int8_gate import compare
    assert runs["bfloat16"]["pipeline"].dtype == torch.bfloat16
    assert torch.bfloat16 in runs["bfloat16"]["matmuls"]["ss_generator"]
    assert torch.bfloat16 in runs["bfloat16"]["matmuls"]["slat_generator"]
    result = compare(runs["auto"], runs["bfloat16"])
    print(result)
    assert result["occupancy_iou"] >= 0.9, result
    assert result["render_mae"] <= 0.1, result
    assert not np.array_equal(runs["auto"]["coords"], runs["bfloat16"]["coords"]) or result["render_mae"] > 0
    assert np.isfinite(runs["bfloat16"]["views"]).all()


def test_bfloat16_sampling_stores_the_linears_it_computes_from_in_bfloat16(runs):
    """On the CPU, bfloat16 sampling loads the large transformers' linears as ``weights="bf16"`` does (half their
    memory): the values autocast would cast them to at every call."""
    pipeline = runs["bfloat16"]["pipeline"]
    assert pipeline.weights == "bf16" and runs["auto"]["pipeline"].weights == "default"
    layers = [m for m in pipeline.models["slat_generator"].modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(m.weight.dtype == torch.bfloat16 for m in layers)


@pytest.mark.parametrize("shape", [(3, 64), (2, 77, 256)])
def test_bfloat16_weights_give_autocasts_linear_bit_for_bit(shape):
    torch.manual_seed(0)
    linear = torch.nn.Linear(shape[-1], 96)
    stored = QuantizedLinear.from_weight(linear.weight.detach(), linear.bias.detach(), "bf16")
    x = torch.randn(*shape)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        for inp in (x, x.bfloat16()):  # a norm's float32 output, a matmul's bfloat16 one
            expected, got = linear(inp), stored(inp)
            assert got.dtype == expected.dtype == torch.bfloat16
            assert torch.equal(got, expected)


def test_bfloat16_without_hardware_warns(tiny_folder, monkeypatch):  # noqa: F811
    from sam3d_objects.inference import Inference
    monkeypatch.setattr(backends.device, "bf16_fast", lambda device: False)
    with pytest.warns(UserWarning, match="no bfloat16 matmul hardware"):
        Inference(str(tiny_folder / "pipeline.yaml"), compile=False, device="cpu", dtype="bfloat16")


def test_cli_dtype_option_reaches_the_pipeline(tmp_path, monkeypatch, runs):
    from sam3d_objects import cli, reconstruction
    from sam3d_objects.assets.example import EXAMPLE_DIR
    from sam3d_objects.assets.tiny_checkpoint import ensure_tiny_checkpoint
    config = ensure_tiny_checkpoint(tmp_path / "tiny", log=lambda *a: None)
    calls = []
    monkeypatch.setattr(cli, "reconstruct", lambda *a, **kw: calls.append(kw))
    code = cli.main(["reconstruct", str(EXAMPLE_DIR / "image.png"), "--mask", str(EXAMPLE_DIR / "0.png"),
                     "--out", str(tmp_path / "o"), "--checkpoints", str(config.parent), "--pointmap", "flat",
                     "--dtype", "bfloat16"])
    assert code == 0 and calls[0]["dtype"] == "bfloat16"
    # what the run's log line says the sampling runs in
    assert reconstruction.sampling_dtype_name(runs["bfloat16"]["pipeline"]) == "bfloat16"
    assert reconstruction.sampling_dtype_name(runs["auto"]["pipeline"]) == "float32"
    with pytest.raises(SystemExit) as exc:
        cli.main(["reconstruct", "x.png", "--mask", "m.png", "--out", str(tmp_path), "--dtype", "int4"])
    assert exc.value.code == 2


# ------------------------------------------------------------------------------------------------------------------
# the decoders: upstream's use_fp16 torsos compute in bfloat16 where the pipeline samples in CPU bfloat16
# ------------------------------------------------------------------------------------------------------------------
SLAT_DECODERS = ("slat_decoder_mesh", "slat_decoder_gs", "slat_decoder_gs_4")


def test_half_torso_dtype_policy_keeps_float16_on_gpus_and_float32_by_default_on_the_cpu():
    from sam3d_objects.model.backbone.tdfy_dit.modules.utils import half_torso_dtype
    cpu, cuda, mps = torch.device("cpu"), torch.device("cuda"), torch.device("mps")
    assert half_torso_dtype(None, cuda) == half_torso_dtype(None, mps) == torch.float16  # upstream's fp16 torso
    assert half_torso_dtype(None, cpu) == torch.float32  # no fast float16 on CPUs: the default stays float32
    assert half_torso_dtype(torch.float16, cpu) == torch.float32
    assert half_torso_dtype(torch.bfloat16, cpu) == torch.bfloat16


def test_set_torso_half_dtype_converts_only_the_torso():
    from benchmarks.bench_decoder_dtype import GS_CONFIG
    from sam3d_objects.model.backbone.tdfy_dit.models.structured_latent_vae.decoder_gs import SLatGaussianDecoder
    from sam3d_objects.model.backbone.tdfy_dit.modules.utils import set_torso_half_dtype
    model = SLatGaussianDecoder(resolution=64, model_channels=64, latent_channels=8, num_blocks=2, num_heads=2,
                                representation_config=dict(GS_CONFIG), use_fp16=True)
    assert model.dtype == torch.float16  # upstream converts the torso at construction
    assert set_torso_half_dtype(model, torch.bfloat16) == 1
    # a torso holding the other half type is converted at once (a checkpoint loaded next is cast once)
    assert model.dtype == torch.bfloat16 and model.half_dtype == torch.bfloat16
    torso = {p.dtype for p in model.blocks.parameters() if p.dim() == 2}
    assert torso == {torch.bfloat16}
    assert model.out_layer.weight.dtype == model.input_layer.weight.dtype == torch.float32
    assert model.compute_dtype(torch.device("cpu")) == torch.bfloat16
    plain = SLatGaussianDecoder(resolution=64, model_channels=64, latent_channels=8, num_blocks=2, num_heads=2,
                                representation_config=dict(GS_CONFIG), use_fp16=False)
    assert set_torso_half_dtype(plain, torch.bfloat16) == 0  # use_fp16: false stays float32 (upstream's switch)
    assert plain.compute_dtype(torch.device("cpu")) == torch.float32
    with pytest.raises(ValueError, match="half type"):
        set_torso_half_dtype(model, torch.float32)


@pytest.fixture(scope="module")
def fp16_decoder_folder(tiny_folder, tmp_path_factory):  # noqa: F811
    """The golden tiny checkpoint with upstream's ``use_fp16: true`` in the structured-latent decoders' yamls (the
    tiny folder says false; the released ones say true)."""
    import shutil
    from omegaconf import OmegaConf
    folder = tmp_path_factory.mktemp("fp16dec") / "ckpt"
    shutil.copytree(tiny_folder, folder)
    for name in SLAT_DECODERS:
        config = OmegaConf.load(folder / f"{name}.yaml")
        config.use_fp16 = True
        OmegaConf.save(config, folder / f"{name}.yaml")
    return folder


def _slat(seed: int = 0):
    """A structured latent on closed sphere shells at 64^3 (the tiny mesh decoder finds a surface in it)."""
    from benchmarks.shapes import shell_coords
    from sam3d_objects.model.backbone.tdfy_dit.modules.sparse import SparseTensor
    coords = shell_coords(1500, 64, seed=seed, thickness=0.9, exact=False)
    feats = torch.randn(coords.shape[0], 8, generator=torch.Generator().manual_seed(seed))
    return SparseTensor(feats=feats, coords=coords)


def _decode_watching_dtypes(pipeline):
    """Decodes one latent with all three decoders; records the dtypes their torso linears, the mesh decoder's
    subdivision convolutions and the output layers computed in."""
    from sam3d_objects.model.backbone.tdfy_dit.modules.sparse import SparseTensor
    seen = {"torso": set(), "subdivision": set(), "out_layer": set()}
    hooks = []

    def record(key):
        def hook(module, inputs, output):
            feats = output.feats if isinstance(output, SparseTensor) else output
            seen[key].add(feats.dtype)
        return hook
    models = {name: pipeline.models[name] for name in SLAT_DECODERS}
    for model in models.values():
        hooks += [m.register_forward_hook(record("torso")) for m in model.blocks.modules()
                  if isinstance(m, torch.nn.Linear)]
        hooks.append(model.out_layer.register_forward_hook(record("out_layer")))
    hooks += [block.register_forward_hook(record("subdivision")) for block in models["slat_decoder_mesh"].upsample]
    with torch.no_grad():
        out = pipeline.decode_slat(_slat(), ["mesh", "gaussian", "gaussian_4"])
    for h in hooks:
        h.remove()
    return out, seen, {name: m.dtype for name, m in models.items()}


@pytest.fixture(scope="module")
def decoded(fp16_decoder_folder):
    from sam3d_objects.inference import Inference
    result = {}
    for dtype in ("auto", "bfloat16"):
        pipeline = Inference(str(fp16_decoder_folder / "pipeline.yaml"), compile=False, device="cpu", dtype=dtype,
                             low_memory=True).pipeline
        pipeline.low_memory = False  # keep the decoders loaded after decoding (to inspect them)
        result[dtype] = (pipeline, *_decode_watching_dtypes(pipeline))
    return result


def test_bfloat16_sampling_decodes_with_bfloat16_torsos(decoded):
    from sam3d_objects import reconstruction
    pipeline, _, seen, held = decoded["bfloat16"]
    assert pipeline.decoder_half_dtype() == torch.bfloat16
    assert held == dict.fromkeys(SLAT_DECODERS, torch.bfloat16)  # the torsos' weights are stored in bfloat16
    assert seen == {"torso": {torch.bfloat16}, "subdivision": {torch.bfloat16}, "out_layer": {torch.float32}}
    assert reconstruction.decoder_dtype_name(pipeline) == "bfloat16"


def test_default_decoders_stay_float32(decoded):
    from sam3d_objects import reconstruction
    pipeline, _, seen, held = decoded["auto"]
    assert pipeline.decoder_half_dtype() is None
    assert held == dict.fromkeys(SLAT_DECODERS, torch.float32)
    assert seen == {"torso": {torch.float32}, "subdivision": {torch.float32}, "out_layer": {torch.float32}}
    assert reconstruction.decoder_dtype_name(pipeline) == "float32"


def test_default_decoders_are_the_models_own_bit_for_bit(decoded, fp16_decoder_folder):
    """The default pipeline's decoders give what the decoders loaded on their own give (no half type chosen):
    the float32 path is the one it was."""
    from sam3d_objects.config.instantiate import load_config, safe_instantiate
    from sam3d_objects.pipeline import checkpoint as ckpt
    _, out, _, _ = decoded["auto"]
    folder = fp16_decoder_folder
    mesh = ckpt.load_model(lambda: safe_instantiate(load_config(folder / "slat_decoder_mesh.yaml")),
                           folder / "slat_decoder_mesh.ckpt")
    gs = ckpt.load_model(lambda: safe_instantiate(load_config(folder / "slat_decoder_gs.yaml")),
                         folder / "slat_decoder_gs.ckpt")
    with torch.no_grad():
        ref_mesh, ref_gs = mesh(_slat())[0], gs(_slat())[0]
    assert ref_mesh.vertices.shape[0] > 1000
    assert torch.equal(out["mesh"][0].vertices, ref_mesh.vertices)
    assert torch.equal(out["mesh"][0].faces, ref_mesh.faces)
    for name in ("_xyz", "_features_dc", "_scaling", "_rotation", "_opacity"):
        assert torch.equal(getattr(out["gaussian"][0], name), getattr(ref_gs, name)), name


def test_bfloat16_decoders_close_to_float32(decoded):
    """Against the float32 decoders on the same latent (the reference). Measured on the 2-core machine: mesh
    vertex count +0.04 %, Chamfer distance 0.017 of an extraction cell; Gaussian parameter MAE 0.5 % of the
    float32 values' mean absolute deviation. Full width (bench_decoder_dtype.py, random weights, 23k
    voxels): Chamfer 0.026 cells, positions 3e-5 of the bounding box."""
    from benchmarks.bench_decoder_dtype import gaussian_quality, mesh_quality
    _, ref, _, _ = decoded["auto"]
    _, out, _, _ = decoded["bfloat16"]
    mesh = mesh_quality(ref["mesh"][0], out["mesh"][0], resolution=64)
    print(mesh, "float32 vertices", ref["mesh"][0].vertices.shape[0])
    assert out["mesh"][0].vertices.dtype == torch.float32
    assert abs(mesh["vertices"] - ref["mesh"][0].vertices.shape[0]) <= 0.01 * ref["mesh"][0].vertices.shape[0]
    assert mesh["chamfer_cells"] <= 0.2, mesh
    for fmt in ("gaussian", "gaussian_4"):
        quality = gaussian_quality(ref[fmt][0], out[fmt][0])
        print(fmt, quality)
        assert quality["_xyz_mae_rel_bbox"] <= 1e-3, quality
        for name in ("_features_dc", "_scaling", "_rotation", "_opacity"):
            assert getattr(out[fmt][0], name).dtype == torch.float32
            assert quality[f"{name}_mae"] <= 0.03 * quality[f"{name}_mad_f32"], (name, quality)
            assert quality[f"{name}_mae"] > 0  # bfloat16 did run: not the float32 values


def test_subdivision_block_in_bfloat16_is_within_its_rounding_of_float64():
    """The mesh decoder's subdivision block as a bfloat16 torso runs it: bfloat16 features and conv weights
    (blocked parent-level convolutions of the portable backend, which sum the 27 offsets' bfloat16 products in
    float32), GroupNorm in float32. Against float64 on the same bfloat16-rounded values; measured mean relative
    error 0.0024 (each stage's bfloat16 output rounding, 2^-9), max 0.005."""
    import copy
    from benchmarks.shapes import shell_coords
    from sam3d_objects.model.backbone.tdfy_dit.models.structured_latent_vae.decoder_mesh import (
        SparseSubdivideBlock3d)
    from sam3d_objects.model.backbone.tdfy_dit.modules.sparse import SparseTensor
    from sam3d_objects.model.backbone.tdfy_dit.modules.utils import convert_module_to_f32, _convert_layer
    g = torch.Generator().manual_seed(0)
    coords = shell_coords(800, 32, seed=0, thickness=0.9, exact=False)
    block = SparseSubdivideBlock3d(channels=64, resolution=32, out_channels=32)
    with torch.no_grad():
        for p in block.parameters():  # every branch live (the second conv is zero-initialised)
            p.copy_(torch.randn(p.shape, generator=g) * (p[0].numel() ** -0.5 if p.dim() > 1 else 0.1))
    half = copy.deepcopy(block)
    half.apply(lambda m: _convert_layer(m, torch.bfloat16))  # what the torso conversion does to this block
    assert half.out_layers[0].conv.weight.dtype == torch.bfloat16
    assert half.out_layers[1].weight.dtype == torch.float32  # the norm stays float32
    exact = copy.deepcopy(half)
    exact.apply(convert_module_to_f32)
    exact.double()
    x = torch.randn(coords.shape[0], 64, generator=g).bfloat16()
    with torch.no_grad():
        got = half(SparseTensor(feats=x, coords=coords)).feats
        ref = exact(SparseTensor(feats=x.double(), coords=coords)).feats
    assert got.dtype == torch.bfloat16 and got.shape == (coords.shape[0] * 8, 32)
    err = (got.double() - ref).abs()
    assert err.mean() / ref.abs().mean() < 0.006
    assert err.max() / ref.abs().max() < 0.02


@pytest.mark.parametrize("device,low_memory,dtype,setting,active", [
    ("cpu", False, "bfloat16", True, True), ("cpu", True, "bfloat16", True, False),
    ("cpu", False, "float32", True, False), ("cuda", False, "bfloat16", True, False),
    ("cpu", False, "bfloat16", False, False)])
def test_pipeline_prepacks_the_generators_where_models_stay_loaded(monkeypatch, device, low_memory, dtype, setting,
                                                                   active):
    """The packed weight copies (``prepack_weights``) are made for a generator's backbone where both stages sample
    in bfloat16 on the CPU with the models kept loaded, and not in low-memory mode, in float32, on other devices,
    with ``compile_model`` or when the attribute is off."""
    from types import SimpleNamespace

    import sam3d_objects.pipeline.inference_pipeline as ip
    packed = []
    monkeypatch.setattr(ip, "prepack_linear_weights", lambda model: packed.append(model) or 0)
    backbone = nn.Linear(2, 2)
    half = dtype == "bfloat16"
    pipeline = SimpleNamespace(device=torch.device(device), low_memory=low_memory, prepack_weights=setting,
                               compile_model=False, _samples_in_cpu_bfloat16=lambda: half and device == "cpu")
    generator = SimpleNamespace(reverse_fn=SimpleNamespace(backbone=backbone))
    ip.InferencePipeline._prepack(pipeline, generator)
    assert packed == ([backbone] if active else [])
    pipeline.compile_model = True  # compiled graphs take the plain weights
    ip.InferencePipeline._prepack(pipeline, generator)
    assert len(packed) == int(active)


def test_bfloat16_run_packs_the_generators_step_layers_where_the_cpu_can(runs):
    """The bfloat16 run (models kept loaded) packed both generators' per-step bf16 layers on a CPU with bf16
    matmul hardware, and none elsewhere (nothing to pack with); the float32 run none."""
    import backends
    for dtype in ("auto", "bfloat16"):
        for name in ("ss_generator", "slat_generator"):
            layers = [m for m in runs[dtype]["pipeline"].models[name].modules() if isinstance(m, QuantizedLinear)]
            count = sum(m._packed is not None for m in layers)
            if dtype == "bfloat16" and backends.device.cpu_bf16_matmul_fast():
                assert 0 < count < len(layers), (name, count, len(layers))
            else:
                assert count == 0, (dtype, name)
