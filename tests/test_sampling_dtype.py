"""``Inference(dtype=...)`` / ``--dtype``: the half type the condition and sampling stages run under. "auto" keeps
the yaml's float16 (float32 on the CPU); "bfloat16" runs them under CPU bfloat16 autocast, measured against the
float32 run of the golden tiny pipeline with the same inputs and seed."""
import numpy as np
import pytest
import torch
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
