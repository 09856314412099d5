"""The CPU report's bookkeeping (benchmarks/cpu_report.py, bench_blocks.py): backbone-call counts from the time
grid against hand-computed ones, the depth extrapolation, the stage-2 voxel shell, and the markdown of a report."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_blocks  # noqa: E402
import cpu_report  # noqa: E402


@pytest.mark.parametrize("steps, rescale, strength, expected", [
    (25, 3, 7.0, (25, 19)),   # release stage 1: i / 25 <= 0.75
    (25, 1, 1.0, (25, 13)),   # release stage 2: i / 25 <= 0.5
    (3, 3, 7.0, (3, 3)),      # 0, 0.143, 0.4 (x1000): all guided
    (3, 1, 1.0, (3, 2)),      # 0, 333 guided; 667 not
    (25, 3, 0.0, (25, 0)),    # no guidance strength: no unconditional pass
])
def test_backbone_calls_follow_the_cfg_interval(steps, rescale, strength, expected):
    assert cpu_report.backbone_calls(steps, rescale, [0, 500], strength) == expected


def test_fast_preset_counts_no_unconditional_calls():
    class Pipe:
        ss_inference_steps = slat_inference_steps = 25
        ss_rescale_t, slat_rescale_t = 3, 1
        ss_cfg_interval = slat_cfg_interval = [0, 500]
        ss_cfg_strength, slat_cfg_strength = 7.0, 1.0
    from sam3d_objects import presets
    assert cpu_report.sampling_calls(Pipe, {}) == {"ss_sampling": (25, 19), "slat_sampling": (25, 13)}
    assert cpu_report.sampling_calls(Pipe, presets.run_options("fast")) == {"ss_sampling": (4, 0),
                                                                             "slat_sampling": (4, 0)}


def test_extrapolation_and_voxel_shell():
    assert bench_blocks.extrapolate({2: 3.0, 4: 5.0}) == pytest.approx(25.0)  # 1 + 1 s a block, 24 blocks
    assert bench_blocks.extrapolate({2: 3.0}) is None
    coords = bench_blocks.shell_coords(500, 16)
    assert coords.shape == (500, 4) and coords[:, 0].eq(0).all()
    assert len({tuple(c) for c in coords.tolist()}) == 500 and coords[:, 1:].max() < 16


def test_markdown_of_a_report(tmp_path):
    stages = {"ss_sampling": 10.0, "slat_sampling": 20.0, "total": 40.0}
    part = {"options": {}, "weights": "default", "first": stages, "warm": [stages], "peak_rss_gib": 4.5,
            "stage_rss_gib": {}, "calls": {"ss_sampling": (25, 19), "slat_sampling": (25, 13)}}
    point = {s: {p: {"blocks": {"2": 1.0, "4": 2.0}, "full_depth_s": 12.0} for p in ("cond", "uncond")}
             for s in ("stage1", "stage2")}
    report = {"machine": cpu_report.machine(), "default": part,
              "scaling": {"points": {"2": point, "4": {**point}}, "config": {}}}
    cpu_report.write(report, tmp_path)
    text = (tmp_path / "cpu_report.md").read_text()
    assert "| ss_sampling | 10.0 | 10.0 |" in text
    assert "40.0 s a run, peak RSS 4.50 GiB" in text and "25 cond + 19 uncond calls, 0.23 s a call" in text
    assert "| 2 | 12.00 | 12.00 | 12.00 | 12.00 | 984 | 1.00x | 100% |" in text  # 12 * (25 + 19 + 25 + 13)
    assert (tmp_path / "cpu_report.json").is_file() and not list(tmp_path.glob("*.partial"))
    # a part without warm runs: one column, its first run
    lines = cpu_report.pipeline_markdown({"fast": {**part, "first": {**stages, "total": 41.0}, "warm": []}})
    assert lines[0] == "| stage | fast first s |" and "| total | 41.0 |" in lines


def test_default_estimate_adds_the_other_stages_of_a_run():
    point = {s: {p: {"blocks": {}, "full_depth_s": 1.0} for p in ("cond", "uncond")} for s in ("stage1", "stage2")}
    stages = {"ss_condition": 5.0, "ss_sampling": 99.0, "slat_sampling": 99.0, "decode_mesh": 10.0,
              "(gc pauses, in the above)": 1.0, "total": 300.0}
    report = {"fast": {"first": stages, "warm": []}, "scaling": {"points": {"2": point, "16": point}}}
    assert cpu_report.default_estimate(report) == (25 + 19 + 25 + 13 + 15.0, 16, 82.0, "fast")
    assert cpu_report.default_estimate({"fast": report["fast"]}) is None
