"""Two process-wide CPU settings compared call by call: one process per setting, the two taking turns.

Some settings cannot be switched inside a running process: the C allocator's thresholds
(``backends.device.keep_freed_host_memory``), flushing denormal floats to zero (``torch.set_flush_denormal``: it
reaches only the OpenMP threads started after it) and the OpenMP team's size. Comparing them takes two processes,
and one run after the other is at the mercy of the host: on the lent 16-core VM hosts the same stage-1 call took
2.0 s and 3.2 s within one run (docs/CPU_SPEED.md, "One host, two speeds"). Here both processes build the same
work, warm it up and report ready; then they take turns through two pipes: A runs one call while B waits, then B
runs the same call while A waits, and so on, so each pair of calls meets the same moment of the host. The report
gives each call's median in both processes and the median of the per-pair ratios B / A.

    python -m benchmarks.bench_process_settings --a default --b flush_denormal --blocks 4 --weights bf16 \\
        --dtype bfloat16 --rounds 8
    python -m benchmarks.bench_process_settings --a threads:16 --b threads:15 --blocks 4 --weights bf16 --dtype bfloat16
    python -m benchmarks.bench_process_settings --a default --b keep_freed_memory --blocks 1     # 2-core machine

Settings (join several with "+", e.g. ``keep_freed_memory+threads:8``): ``default`` (nothing changed),
``keep_freed_memory`` (what a pipeline run with the models kept loaded sets), ``flush_denormal``, ``threads:N``.
Work: ``passes`` (both flow backbones' conditional and unconditional passes at full width with ``--blocks``
blocks, random weights, as the pipeline runs them; see ``bench_host_memory.passes_as_run``) or ``matmul`` (a
small product, for checking the harness). POSIX only (the turns go through inherited pipe descriptors).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_blocks import default_configs  # noqa: E402

SETTINGS = ("default", "keep_freed_memory", "flush_denormal", "threads:N")
READY, RESULT = "READY", "RESULT "


def parse_setting(text: str) -> List[Tuple[str, int]]:
    """"keep_freed_memory+threads:8" -> [("keep_freed_memory", 0), ("threads", 8)]; unknown names raise."""
    parts = []
    for item in text.split("+"):
        name, _, value = item.partition(":")
        if name == "threads":
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"threads needs a positive count, e.g. threads:8 (got {item!r})")
            parts.append((name, int(value)))
        elif name in ("default", "keep_freed_memory", "flush_denormal") and not value:
            parts.append((name, 0))
        else:
            raise ValueError(f"unknown setting {item!r}: use {', '.join(SETTINGS)}, joined with '+'")
    return parts


def denormals_flushed() -> bool:
    """True when every thread of a parallel multiplication read denormal float32 inputs as zero (DAZ, what
    ``flush_denormal`` turns on): the product is split over the OpenMP threads, so one thread without the mode
    leaves its share non-zero. The input is the smallest denormal as raw bits (int32 1): a float written as a
    number would already be flushed by the calling thread's conversion."""
    smallest_denormal = torch.ones(1 << 22, dtype=torch.int32).view(torch.float32)
    return int((smallest_denormal * 1.0).count_nonzero()) == 0


def apply_setting(text: str) -> Dict[str, object]:
    """Makes the setting in this process; the flush mode first, before any parallel torch work (OpenMP threads
    inherit it only when they start after it). Returns what is in effect afterwards."""
    parts = dict(parse_setting(text))
    if "flush_denormal" in parts:
        torch.set_flush_denormal(True)
    if "threads" in parts:
        torch.set_num_threads(parts["threads"])
    import backends
    kept = backends.device.keep_freed_host_memory() if "keep_freed_memory" in parts else False
    return {"setting": text, "threads": torch.get_num_threads(), "keeps_freed_memory": kept,
            "denormals_flushed": denormals_flushed()}


def matmul_work(size: int = 256) -> Dict[str, Callable[[], object]]:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(size, size, generator=g), torch.randn(size, size, generator=g)
    return {"matmul": lambda: a @ b}


def child(args: argparse.Namespace) -> None:
    effect = apply_setting(args.child_setting)
    with ExitStack() as stack:
        if args.work == "passes":
            from benchmarks.bench_host_memory import passes_as_run
            calls = {}
            for stage in ("stage1", "stage2"):
                stage_calls = stack.enter_context(passes_as_run(args.configs, stage, args.blocks, args.weights,
                                                                args.dtype))
                calls.update({f"{stage}_{name}": fn for name, fn in stage_calls.items()})
        else:
            calls = matmul_work()
        for fn in calls.values():  # first-call costs (packing, caches, oneDNN kernels) outside the turns
            fn()
            fn()
        print(READY, flush=True)
        seconds: Dict[str, List[float]] = {name: [] for name in calls}
        faults: Dict[str, List[int]] = {name: [] for name in calls}
        spans: List[Tuple[float, float]] = []
        for _ in range(args.rounds):
            for name, fn in calls.items():
                if os.read(args.token_in, 1) != b"x":
                    raise SystemExit("bench_process_settings: the other process ended before its turn")
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                start, clock = time.perf_counter(), time.monotonic()
                fn()
                seconds[name].append(time.perf_counter() - start)
                spans.append((clock, time.monotonic()))
                faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
                os.write(args.token_out, b"x")
    print(RESULT + json.dumps({**effect, "seconds": seconds, "faults": faults, "spans": spans}), flush=True)


def _stderr_tail(proc: subprocess.Popen) -> str:
    proc.error_file.seek(0)
    return proc.error_file.read().decode(errors="replace")[-3000:]


def _wait_ready(proc: subprocess.Popen, label: str) -> None:
    for line in proc.stdout:
        if line.strip() == READY:
            return
    proc.wait()
    raise SystemExit(f"bench_process_settings: process {label} ended before it was ready:\n{_stderr_tail(proc)}")


def _result(proc: subprocess.Popen, label: str) -> dict:
    out = proc.stdout.read()
    proc.wait()
    lines = [line for line in out.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"bench_process_settings: process {label} failed:\n{_stderr_tail(proc)}")
    return json.loads(lines[-1][len(RESULT):])


def run_pair(a: str, b: str, work_argv: List[str]) -> Dict[str, dict]:
    """Both settings' processes, A's first call first, then turn by turn; {"a": result, "b": result}."""
    a_to_b, b_to_a = os.pipe(), os.pipe()  # (read end, write end) each
    ends = {"a": (b_to_a[0], a_to_b[1]), "b": (a_to_b[0], b_to_a[1])}
    procs = {}
    try:
        for label, setting in (("a", a), ("b", b)):
            token_in, token_out = ends[label]
            error_file = tempfile.TemporaryFile()
            procs[label] = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.bench_process_settings", *work_argv, "--child-setting", setting,
                 "--token-in", str(token_in), "--token-out", str(token_out)],
                # stderr to a file: warnings filling a pipe nobody reads yet would stall a child before READY
                cwd=str(ROOT), stdout=subprocess.PIPE, stderr=error_file, text=True,
                pass_fds=(token_in, token_out))
            procs[label].error_file = error_file
        for label, proc in procs.items():
            _wait_ready(proc, label)
        os.write(b_to_a[1], b"x")  # A's first turn
    except BaseException:
        for proc in procs.values():  # nothing left running when one side fails to start
            proc.kill()
            proc.wait()
        raise
    finally:
        for fd in (*a_to_b, *b_to_a):  # the children hold their own ends: a child that dies ends the other's wait
            os.close(fd)
    return {label: _result(proc, label) for label, proc in procs.items()}


def summary(results: Dict[str, dict]) -> Dict[str, Dict[str, float]]:
    """Per call: each process's median seconds and the median of the per-pair ratios B / A."""
    out = {}
    for name, a_times in results["a"]["seconds"].items():
        b_times = results["b"]["seconds"][name]
        out[name] = {"a_median_s": statistics.median(a_times), "b_median_s": statistics.median(b_times),
                     "b_over_a": statistics.median(b / a for a, b in zip(a_times, b_times)),
                     "a_faults": statistics.median(results["a"]["faults"][name]),
                     "b_faults": statistics.median(results["b"]["faults"][name])}
    return out


def table(results: Dict[str, dict]) -> str:
    a, b = results["a"], results["b"]
    rows = [f"A = {a['setting']} ({a['threads']} threads, denormals flushed: {a['denormals_flushed']}), "
            f"B = {b['setting']} ({b['threads']} threads, denormals flushed: {b['denormals_flushed']}); "
            f"{len(next(iter(a['seconds'].values())))} turns each",
            "", "| call | A median s | B median s | B / A (median of pairs) | page faults A / B |", "|---|---|---|---|---|"]
    for name, s in summary(results).items():
        rows.append(f"| {name} | {s['a_median_s']:.3f} | {s['b_median_s']:.3f} | {s['b_over_a']:.3f} | "
                    f"{s['a_faults']:.0f} / {s['b_faults']:.0f} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", default="default", help="setting of process A (see above)")
    ap.add_argument("--b", default="flush_denormal", help="setting of process B")
    ap.add_argument("--work", choices=("passes", "matmul"), default="passes")
    ap.add_argument("--configs", type=Path, default=default_configs(), help="folder with the generators' yamls")
    ap.add_argument("--blocks", type=int, default=1, help="transformer blocks per backbone")
    ap.add_argument("--weights", default="default", help="linear weight format: default, bf16, int8")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="autocast dtype")
    ap.add_argument("--rounds", type=int, default=5, help="turns of each call in each process")
    ap.add_argument("--json", type=Path, default=None, help="write both processes' results here")
    ap.add_argument("--child-setting", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--token-in", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--token-out", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_setting is not None:
        child(args)
        return 0
    for setting in (args.a, args.b):
        try:
            parse_setting(setting)  # a typo fails here, before two models are built
        except ValueError as error:
            ap.error(str(error))
    work_argv = ["--work", args.work, "--configs", str(args.configs), "--blocks", str(args.blocks),
                 "--weights", args.weights, "--dtype", args.dtype, "--rounds", str(args.rounds)]
    results = run_pair(args.a, args.b, work_argv)
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps({"results": results, "summary": summary(results)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
