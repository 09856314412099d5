"""The CPU speed report (``bench_speed.py --cpu-report DIR``): the release's default settings (25 + 25 steps with
guidance) and the ``fast`` preset end to end in low-memory mode, per stage, with peak RSS and the backbone calls
the sampling made, plus the thread-scaling curve of the two flow backbones (``bench_blocks``). Writes
``DIR/cpu_report.json`` and ``DIR/cpu_report.md`` after every part, so a run cut short keeps what it finished, and
a later call with other ``--parts`` adds to the same files.

    python benchmarks/bench_speed.py --make-random ckpt_full --cpu-report out/ --parts scaling fast --runs 1
    python benchmarks/bench_speed.py --make-random ckpt_full --cpu-report out/ --parts default --runs 0
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

PARTS = ("default", "fast", "scaling")
SAMPLING = {"ss_sampling": "ss", "slat_sampling": "slat"}  # stage -> the pipeline's setting prefix


def machine() -> Dict[str, object]:
    """What the numbers depend on: CPU model and matrix extensions, cores, torch threads, load."""
    info: Dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())  # the first processor's entries
    except OSError:
        pass
    model, flags = info.get("model name") or platform.processor(), set(info.get("flags", "").split())
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return {"cpu": model, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "load_1min": load, "amx_bf16": "amx_bf16" in flags, "avx512_bf16": "avx512_bf16" in flags,
            "avx512f": "avx512f" in flags}


def backbone_calls(steps: int, rescale_t: Optional[float], interval: Sequence[float], strength: float,
                   time_scale: float = 1000.0) -> Tuple[int, int]:
    """(conditional, unconditional) backbone calls of one sampling stage: one conditional call a step, one
    unconditional call more where guidance is on (strength > 0) and the scaled time lies in the interval."""
    from sam3d_objects.model.backbone.generator.flow_matching.model import rescale_times
    times = rescale_times(np.linspace(0.0, 1.0, steps + 1), rescale_t)[:-1] * time_scale
    lo, hi = interval
    return steps, int(sum(lo <= t <= hi for t in times)) if strength > 0 else 0


def sampling_calls(pipe, options: dict) -> Dict[str, Tuple[int, int]]:
    """Backbone calls per sampling stage for a run with these run options (a preset's or none)."""
    calls = {}
    for stage, prefix in SAMPLING.items():
        number = "1" if prefix == "ss" else "2"
        steps = options.get(f"stage{number}_inference_steps") or getattr(pipe, f"{prefix}_inference_steps")
        distilled = options.get(f"use_stage{number}_distillation", False)
        strength = 0.0 if distilled else getattr(pipe, f"{prefix}_cfg_strength")
        calls[stage] = backbone_calls(steps, getattr(pipe, f"{prefix}_rescale_t"),
                                      getattr(pipe, f"{prefix}_cfg_interval"), strength)
    return calls


def pipeline_part(config: str, part: str, runs: int, weights: str, progress: Callable[[str], None],
                  dtype: str = "auto", low_memory: bool = True) -> dict:
    """One preset end to end on the CPU (low-memory mode unless ``low_memory`` is false: every model then stays
    loaded, so warm runs read no weights): first run, ``runs`` warm runs, peak RSS."""
    from bench_speed import PipelineBench
    from sam3d_objects import presets
    options = presets.run_options("fast") if part == "fast" else {}
    bench = PipelineBench(config, "cpu", low_memory=low_memory, steps=None, run_options=options, weights=weights,
                          dtype=dtype)
    try:
        bench.rss.reset()
        first, warm = bench.first_and_warm(runs, f"cpu report, {part}", progress)
        calls = sampling_calls(bench.pipe, options)
        from sam3d_objects.reconstruction import decoder_dtype_name
        return {"options": options, "weights": weights, "dtype": dtype, "decoders": decoder_dtype_name(bench.pipe),
                "low_memory": low_memory,
                "first": first, "warm": warm, "calls": calls,
                "peak_rss_gib": bench.peak_memory_gib(),
                "stage_rss_gib": {k: v / 2 ** 30 for k, v in bench.stage_rss.items()}}
    finally:
        bench.close()


def _typical(part: dict) -> Dict[str, float]:
    """Per stage: the warm runs' median, or the first run's time without warm runs."""
    runs = part["warm"] or [part["first"]]
    return {stage: statistics.median(r[stage] for r in runs if stage in r) for stage in part["first"]}


def pipeline_markdown(report: dict) -> List[str]:
    parts = [p for p in report if p.split("-")[0] in ("default", "fast") and isinstance(report[p], dict)]
    if not parts:
        return []
    typical = {p: _typical(report[p]) for p in parts}
    # a part without warm runs gets one column (its first run), not the same numbers twice
    cols = {p: ["first"] + (["warm"] if report[p]["warm"] else []) for p in parts}
    head = " | ".join(f"{p} {c} s" for p in parts for c in cols[p])
    lines = [f"| stage | {head} |", "|---|" + "---|" * sum(len(c) for c in cols.values())]
    stages = list(dict.fromkeys(s for p in parts for s in report[p]["first"]))
    for stage in stages:
        cells = []
        for p in parts:
            values = {"first": report[p]["first"].get(stage), "warm": typical[p].get(stage)}
            cells += [f"{values[c]:.1f}" if values[c] is not None else "-" for c in cols[p]]
        lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    lines.append("")
    for p in parts:
        calls = report[p]["calls"]
        per_call = ", ".join(
            f"{stage} {c[0]} cond + {c[1]} uncond calls, {typical[p][stage] / max(1, sum(c)):.2f} s a call"
            for stage, c in calls.items() if stage in typical[p])
        r = report[p]
        setup = (f"weights {r['weights']}, dtype {r.get('dtype', 'auto')}, decoders {r.get('decoders', 'float32')}, "
                 f"low-memory {'on' if r.get('low_memory', True) else 'off'}, "
                 f"options {r['options'] or 'release defaults'}")
        lines.append(f"- {p} ({setup}): {typical[p]['total']:.1f} s a run, peak RSS {r['peak_rss_gib']:.2f} GiB; "
                     f"{per_call}")
    return lines


def default_estimate(report: dict) -> Optional[Tuple[float, int, float, str]]:
    """(seconds, threads, sampling seconds, part) of a default-settings run: the scaling part's full-depth
    sampling estimate at its largest thread count plus the non-sampling stages of a pipeline part run."""
    from bench_blocks import sampling_estimate
    points = report.get("scaling", {}).get("points", {})
    part = next((p for p in ("default", "fast") if p in report), None)
    if not points or part is None:
        return None
    threads = max(points, key=int)
    sampling = sampling_estimate(points[threads])
    if sampling is None:
        return None
    other = sum(v for k, v in _typical(report[part]).items() if k not in SAMPLING and not k.startswith("(")
                and k != "total")
    return sampling + other, int(threads), sampling, part


def markdown(report: dict) -> str:
    m = report.get("machine", {})
    lines = [f"# CPU report: {m.get('cpu', '?')}, {m.get('cores')} cores, {m.get('torch_threads')} torch threads, "
             f"torch {m.get('torch')}, load {m.get('load_1min', float('nan')):.2f} at the start, AMX-BF16 "
             f"{m.get('amx_bf16')}, AVX512-BF16 {m.get('avx512_bf16')}", ""]
    lines += pipeline_markdown(report)
    estimate = default_estimate(report)
    if estimate:
        lines += ["", f"- default settings estimated (E) where not run: {estimate[0]:.0f} s = the sampling of "
                      f"25 + 25 steps at {estimate[1]} threads from the scaling part ({estimate[2]:.0f} s) + the other "
                      f"stages of the {estimate[3]} run ({estimate[0] - estimate[2]:.0f} s)"]
    if "scaling" in report:
        from bench_blocks import markdown as scaling_markdown
        lines += ["", "## Thread scaling of the flow backbones (one forward pass, full depth extrapolated)", "",
                  scaling_markdown(report["scaling"])]
    return "\n".join(lines) + "\n"


def write(report: dict, out: Path) -> None:
    """JSON and markdown, each replaced whole (written beside, then renamed)."""
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("cpu_report.json", json.dumps(report, indent=1)), ("cpu_report.md", markdown(report))):
        tmp = out / (name + ".partial")
        tmp.write_text(text)
        tmp.replace(out / name)


def cpu_report(config: str, out: Path, parts: Sequence[str], runs: int, weights: str = "default",
               threads: Sequence[int] = (2, 4, 8, 16), blocks: Sequence[int] = (2, 4),
               progress: Callable[[str], None] = print, dtype: str = "auto", low_memory: bool = True) -> dict:
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise SystemExit(f"--parts: unknown {unknown}; choose from {', '.join(PARTS)}")
    path = Path(out) / "cpu_report.json"
    report = json.loads(path.read_text()) if path.is_file() else {}
    report["machine"] = machine()
    for part in parts:
        t0 = time.perf_counter()
        if part == "scaling":
            from bench_blocks import scaling
            report["scaling"] = scaling(Path(config).parent, list(threads), list(blocks),
                                        batched_at=max(threads), progress=progress)
        else:
            key = part if dtype == "auto" else f"{part}-{dtype}"  # a bf16 run sits beside the float32 one
            key += "" if low_memory else "-resident"
            report[key] = pipeline_part(config, part, runs, weights, progress, dtype, low_memory)
        report.setdefault("part_seconds", {})[part] = time.perf_counter() - t0
        write(report, Path(out))
    return report
