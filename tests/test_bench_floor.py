"""benchmarks/bench_floor.py's arithmetic: the settings' call counts and bounds (the measuring itself builds
full-width models and runs only as a benchmark)."""
import pytest

from benchmarks import bench_floor


def _passes(cond_attention, cond_matmul, uncond_attention, uncond_matmul, rates):
    rows = {}
    for name, attention, matmul, measured in (("cond", cond_attention, cond_matmul, 10.0),
                                              ("uncond", uncond_attention, uncond_matmul, 4.0)):
        floor = matmul * 1e12 / rates["linear_flops_per_s"] + attention * 1e12 / rates["attention_flops_per_s"]
        rows[name] = {"tflop_attention": attention, "tflop_matmul": matmul, "floor_s": floor, "measured_s": measured,
                      "kernel_share": floor / measured}
    return {"depth": 24, "passes": rows}


RATES = {"linear_flops_per_s": 2e12, "attention_flops_per_s": 1e12, "peak_gemm_flops_per_s": 4e12}
STAGES = {"stage1": _passes(4.0, 4.0, 2.0, 2.0, RATES), "stage2": _passes(3.0, 5.0, 1.0, 3.0, RATES)}


def test_release_bounds_count_the_guided_calls():
    b = bench_floor.sampling_bounds(STAGES, RATES, bench_floor.SETTING_CALLS["release"])
    # stage 1: 25 x 8 + 19 x 4 TFLOP; stage 2: 25 x 8 + 13 x 4
    assert b["tflop"] == pytest.approx(25 * 8 + 19 * 4 + 25 * 8 + 13 * 4)
    assert b["at_peak_gemm_s"] == pytest.approx(b["tflop"] / 4)
    floors = {s: {n: p["floor_s"] for n, p in STAGES[s]["passes"].items()} for s in STAGES}
    assert floors["stage1"]["cond"] == pytest.approx(4 / 2 + 4 / 1)
    assert b["floor_s"] == pytest.approx(25 * floors["stage1"]["cond"] + 19 * floors["stage1"]["uncond"]
                                         + 25 * floors["stage2"]["cond"] + 13 * floors["stage2"]["uncond"])
    assert b["estimate_s"] == pytest.approx(25 * 10 + 19 * 4 + 25 * 10 + 13 * 4)


def test_fast_preset_is_four_conditional_passes_a_stage():
    b = bench_floor.sampling_bounds(STAGES, RATES, bench_floor.SETTING_CALLS["fast"])
    assert b["tflop"] == pytest.approx(4 * 8 + 4 * 8)
    assert b["estimate_s"] == pytest.approx(4 * 10 + 4 * 10)
    # the bound at the peak GEMM rate is below the floor whenever the peak is the fastest rate
    assert b["at_peak_gemm_s"] < b["floor_s"]


def test_markdown_lists_both_settings():
    settings = {name: bench_floor.sampling_bounds(STAGES, RATES, calls)
                for name, calls in bench_floor.SETTING_CALLS.items()}
    report = {"threads": 2, "dtype": "float32", "weights": "default", "stages": STAGES, "settings": settings,
              "rates": {k: v / 1e12 for k, v in RATES.items()}}
    text = bench_floor.markdown(report)
    assert "| release | 25 + 19, 25 + 13 | 528.0 | 132 |" in text
    assert "| fast | 4, 4 | 64.0 | 16 |" in text
    assert "peak GEMM (4096^3) 4.00 TFLOP/s" in text
