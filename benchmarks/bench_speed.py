"""One command for the speed picture: per-stage pipeline times on CPU and CUDA (first run and the median /
range of warm runs), GPU busy fraction and kernel launch count, peak memory, the CPU matmul-rate comparison, and the
splat-renderer table; on a GPU also the 300-frame 512^2 turntable of the last object (upstream notebook's render_video).

    # full size (random weights in upstream's layout; ~13 GB written once):
    python benchmarks/bench_speed.py --make-random ckpt_full --devices cuda cpu --runs 3
    python benchmarks/bench_speed.py --config ckpt_full/pipeline.yaml --devices cuda --runs 5
    # plumbing check (tiny random checkpoint, 1 + 1 steps, small render):
    python benchmarks/bench_speed.py --quick --devices cpu
    # CPU report (default 25 + 25 and the fast preset per stage, peak RSS, thread-scaling curve; JSON + markdown):
    python benchmarks/bench_speed.py --make-random ckpt_full --cpu-report out/ --parts scaling fast default --runs 1

Columns: ``first`` = the first run in this process (lazy init, autotuning, caches); ``median [min-max]`` = the
warm runs. GPU busy = union of CUDA kernel intervals / wall time of one profiled warm run (torch profiler, whole
run: shown on the 'total' row); kernels = CUDA kernel launches in that run (on the CPU: aten op calls). Matmul rate (CPU): FLOPs of
each stage's GEMMs and attention (torch.utils.flop_counter, one counted run) / the stage's median time, next to
one large ``torch.mm`` timed in the same process (fp32 on the CPU, fp16 on CUDA, the sampling stages' autocast
dtype). CUDA also gets per-stage GPU busy fractions and kernel seconds by kind (gemm / attention / copy / other)
from the profiled run, cut at stage boundaries by marker kernels. Peak memory: device allocator peak (CUDA) or peak RSS (CPU).
"""
from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import backends  # noqa: E402  (after the path set-up: the repository root may not be installed)


def _import_first(*names: str):
    """The first importable module of ``names`` (benchmark helpers may live in benchmarks/ or the package)."""
    import importlib
    errors = []
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
    raise ImportError("none of " + ", ".join(names) + " imports: " + "; ".join(errors))


REFERENCE = ROOT.parent / "shared"  # the project's reference material, beside the checkout (not in a user's clone)
COMPLETE_MARKER = ".complete"       # written last: a folder without it was interrupted and is rebuilt


class BenchSetupError(SystemExit):
    """A one-line reason the benchmark cannot start (no traceback)."""


def _build_random(module: str, manifests: Path, configs: Path, out: Path) -> None:
    subprocess.run([sys.executable, "-m", module, "--manifests", str(manifests), "--configs", str(configs),
                    "--out", str(out)], check=True, cwd=ROOT)


def _looks_built_by_us(folder: Path) -> bool:
    """Only yamls, .ckpt / .safetensors files and our marker: safe to delete and rebuild."""
    return all(f.suffix in (".yaml", ".ckpt", ".safetensors") or f.name == COMPLETE_MARKER
               for f in folder.iterdir())


def make_random_checkpoint(out: Path, manifests: Optional[Path] = None, configs: Optional[Path] = None,
                           build=_build_random) -> Path:
    """Full-size random weights in upstream's layout, built once into ``out`` (kept when complete).

    The layout comes from the release's json manifests and yamls (``--manifests`` / ``--configs``; default: the
    reference material beside the checkout). The folder is built under ``<out>.partial`` and renamed when complete,
    so an interrupted build leaves no half-built ``out``; a folder of an older interrupted build (no marker) is
    rebuilt. Problems are one-line ``BenchSetupError``s."""
    out = Path(out)
    if (out / "pipeline.yaml").is_file() and (out / COMPLETE_MARKER).is_file():
        return out / "pipeline.yaml"
    manifests = Path(manifests) if manifests else REFERENCE / "golden" / "manifests"
    configs = Path(configs) if configs else REFERENCE / "upstream_configs"
    for what, folder, flag in (("json manifests", manifests, "--manifests"), ("yamls", configs, "--configs")):
        if not folder.is_dir():
            raise BenchSetupError(
                f"bench_speed: full-size random weights need the release's {what} ({folder} not found; pass "
                f"{flag} DIR). Or benchmark real weights with --config DIR/pipeline.yaml, or the tiny checkpoint "
                f"with --quick.")
    if out.exists() and not (out.is_dir() and _looks_built_by_us(out)):
        raise BenchSetupError(f"bench_speed: {out} exists and is not a random checkpoint built by this script; "
                              f"choose another --make-random folder")
    module = None
    for name in ("sam3d_objects.tools.make_random_checkpoint", "benchmarks.make_random_checkpoint",
                 "make_random_checkpoint"):
        try:
            _import_first(name)
            module = name
            break
        except ImportError:
            continue
    if module is None:
        raise BenchSetupError("make_random_checkpoint not found (sam3d_objects.tools or benchmarks/)")
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    print(f"building full-size random weights in {out} (about 13 GB, once) ...", flush=True)
    try:
        build(module, manifests, configs, partial)
        (partial / COMPLETE_MARKER).write_text("complete\n")
    except (subprocess.CalledProcessError, OSError) as e:
        shutil.rmtree(partial, ignore_errors=True)
        raise BenchSetupError(f"bench_speed: building the random checkpoint failed ({e}); nothing was left in "
                              f"{out}") from e
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)  # an interrupted older build (checked above: only our files)
    partial.rename(out)
    return out / "pipeline.yaml"


def tiny_checkpoint() -> Path:
    from sam3d_objects.assets.tiny_checkpoint import ensure_tiny_checkpoint
    from sam3d_objects.paths import default_tiny_dir
    return ensure_tiny_checkpoint(default_tiny_dir(), log=lambda *a, **k: None)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def matmul_rate(device: torch.device, n: int = 2048, repeat: int = 3, dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of one large torch.mm (best of ``repeat``)."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def _busy_seconds(intervals: List[tuple]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, -float("inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


_MARKER_US = 20  # length of the marker kernel that stage boundaries leave in a CUDA profile


def _mark_stage(stage: str, event: str) -> None:
    """A short, recognisable kernel at a stage boundary (the stage hook has synchronised: every kernel of the
    previous stage has finished), so the profile's GPU timeline can be cut into stages."""
    torch.cuda._sleep(1000)


def _is_marker(name: str) -> bool:
    return "spin_kernel" in name


def _kernel_kind(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("flash", "fmha", "attention", "attn")):
        return "attn"
    if any(s in n for s in ("gemm", "cutlass", "xmma", "nvjet", "cublas", "s884", "s1688", "s16816", "wgmma")):
        return "gemm"
    if any(s in n for s in ("copy", "cast", "convert")):
        return "copy"
    return "other"


def _cuda_stage_profile(kernels: List[tuple], boundaries: List[str]) -> Dict[str, Dict[str, float]]:
    """Per stage: GPU busy fraction between its boundary markers, kernel count and kernel seconds by kind
    (gemm / attn / copy / other). ``kernels``: (start us, end us, name) in any order; ``boundaries``: the stage
    of each marker, in order (start and end of every stage)."""
    kernels = sorted(kernels)
    markers = [k for k in kernels if _is_marker(k[2])]
    if len(markers) != len(boundaries):
        return {}
    result: Dict[str, Dict[str, float]] = {}
    for i in range(len(markers) - 1):
        if boundaries[i] != boundaries[i + 1]:
            continue  # between two stages, or nested: only a stage's own start..end span
        lo, hi = markers[i][1], markers[i + 1][0]
        inside = [k for k in kernels if lo <= k[0] < hi and not _is_marker(k[2])]
        stats = result.setdefault(boundaries[i], {"span": 0.0, "busy_s": 0.0, "kernels": 0})
        stats["span"] += (hi - lo) / 1e6
        stats["busy_s"] += _busy_seconds([(a, b) for a, b, _ in inside]) / 1e6
        stats["kernels"] += len(inside)
        names = stats.setdefault("names", {})
        for a, b, name in inside:
            kind = _kernel_kind(name)
            stats[kind] = stats.get(kind, 0.0) + (b - a) / 1e6
            names[name] = names.get(name, 0.0) + (b - a) / 1e6
    for stats in result.values():
        stats["busy"] = stats["busy_s"] / stats["span"] if stats["span"] else 0.0
    return result


OUTSIDE, GC = "(outside stages)", "(gc pauses, in the above)"


class GcPauses:
    """Seconds spent in Python's garbage collector while inside (gc callbacks)."""

    def __init__(self):
        self.seconds, self._start = 0.0, None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self._start = None

    def __enter__(self):
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)


class PipelineBench:
    """One Inference kept in memory; runs it with per-stage timings, optionally profiled or FLOP-counted."""

    def __init__(self, config: str, device: str, low_memory: bool, steps: Optional[List[int]],
                 run_options: Optional[dict] = None, weights: str = "default", dtype: str = "auto"):
        from sam3d_objects.inference import Inference
        bp = _import_first("bench_pipeline", "benchmarks.bench_pipeline", "sam3d_objects.tools.bench_pipeline")
        self.scene = bp.synthetic_scene()
        self.rss = bp.RssSampler()
        # the sampler thread polls every 5 ms and takes the GIL from the launch-bound main thread: only where its
        # peak is the reported memory (the CPU); CUDA reports the allocator's peak
        self.sampling_rss = torch.device(device).type == "cpu"
        if self.sampling_rss:
            self.rss.__enter__()
        self.inference = Inference(config, compile=False, device=device, low_memory=low_memory, weights=weights,
                                   dtype=dtype)
        self.run_options = dict(run_options or {})  # e.g. a preset: Inference's run options
        self.pipe = self.inference.pipeline
        self.device = torch.device(self.pipe.device)
        if steps:
            # the pipeline's per-stage settings reach loaded generators at once and the others when they load
            self.pipe.ss_inference_steps, self.pipe.slat_inference_steps = steps
        self.marks: Dict[str, list] = {}
        self.stage_rss: Dict[str, int] = {}  # CPU: peak RSS bytes per stage over the runs so far
        self.keep_output = False
        self.last_output = None
        self.marks_in_order: List[tuple] = []
        self.on_stage = None
        self.pipe.stage_hook = self._hook

    def close(self) -> None:
        if self.sampling_rss:
            self.rss.__exit__(None, None, None)

    def _hook(self, stage: str, event: str) -> None:
        sync(self.device)
        if self.sampling_rss:
            peak = self.rss.take_window()  # at "start" this only opens the stage's window
            if event == "end":
                self.stage_rss[stage] = max(self.stage_rss.get(stage, 0), peak)
        self.marks.setdefault(stage, []).append((event, time.perf_counter()))
        self.marks_in_order.append((stage, event))
        if self.on_stage:
            self.on_stage(stage, event)

    def run(self, seed: int = 42) -> Dict[str, float]:
        """Seconds per stage (and 'total') of one run."""
        image, mask, pointmap = self.scene
        self.marks_in_order = []
        self.pipe.stage_times.clear() if hasattr(self.pipe.stage_times, "clear") else None
        pauses = GcPauses()
        sync(self.device)
        t0 = time.perf_counter()
        with pauses:
            output = self.inference(image, mask, seed=seed, pointmap=pointmap, **self.run_options)
            # kept for the turntable only: held through the next run it would add to that run's peak memory
            self.last_output = output if self.keep_output else None
            del output
            sync(self.device)
        total = time.perf_counter() - t0
        times = dict(self.pipe.stage_times)
        # where a run's time goes besides its stages: the code between them, and Python's garbage collector
        times[OUTSIDE] = total - sum(times.values())
        times[GC] = pauses.seconds
        times["total"] = total
        return times

    def first_and_warm(self, runs: int, label: str, progress) -> tuple:
        """(the first run's stage times, the list of ``runs`` warm runs' stage times; seeds 42, 43, ...)."""
        progress(f"{label}: first run")
        first = self.run()
        warm = []
        for i in range(runs):
            progress(f"{label}: warm run {i + 1}/{runs}")
            warm.append(self.run(seed=42 + i))
        return first, warm

    def profiled_run(self) -> Dict[str, Dict[str, float]]:
        """One warm run. CUDA: kernel launches and GPU busy fraction (union of kernel intervals from the torch
        profiler, CUDA activity only so the trace stays small) over the run's wall time, per stage too (see
        `_cuda_stage_profile`). CPU: aten op calls (counted by a dispatch mode; the CPU profiler's trace of a
        whole run is too big to post-process)."""
        if self.device.type == "cuda":
            from torch.profiler import ProfilerActivity, profile
            self.on_stage = _mark_stage
            try:
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    wall = self.run()["total"]
            finally:
                self.on_stage = None
            kernels = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                       if str(getattr(e, "device_type", "")).endswith("CUDA")]
            result = _cuda_stage_profile(kernels, [s for s, _ in self.marks_in_order])
            spans = [(a, b) for a, b, name in kernels if not _is_marker(name)]
            busy = _busy_seconds(spans) / 1e6 if spans else 0.0
            result["total"] = {"busy": busy / wall, "kernels": len(spans)}
            return result
        from torch.utils._python_dispatch import TorchDispatchMode

        class OpCounter(TorchDispatchMode):
            calls = 0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                OpCounter.calls += 1
                return func(*args, **(kwargs or {}))
        with OpCounter():
            self.run()
        return {"total": {"kernels": OpCounter.calls}}

    def stage_flops(self) -> Dict[str, float]:
        """GEMM + attention FLOPs per stage (one counted run; eager, since graph replays bypass the counter)."""
        from benchmarks.flops import flop_counter
        counter = flop_counter()
        graphs, self.pipe.cuda_graphs = getattr(self.pipe, "cuda_graphs", False), False
        seen: Dict[str, float] = {}
        begin: Dict[str, float] = {}

        def on_stage(stage, event):
            if event == "start":
                begin[stage] = counter.get_total_flops()
            else:
                seen[stage] = seen.get(stage, 0) + counter.get_total_flops() - begin.get(stage, 0)
        self.on_stage = on_stage
        try:
            with counter:
                self.run()
        finally:
            self.on_stage = None
            self.pipe.cuda_graphs = graphs
        return seen

    def turntable(self, frames: int = 300, resolution: int = 512) -> Dict[str, float]:
        """Seconds of upstream's notebook turntable (``render_video`` of the latest run's object, ``make_scene`` +
        ``ready_gaussian_for_video_rendering``, 512^2, r 2, fov 40, pitch 0, yaw from -90 deg), uint8 frames on the
        host included; twice, the first in the process compiles the renderer's kernels."""
        from sam3d_objects.inference import make_scene, ready_gaussian_for_video_rendering, render_video
        sample = ready_gaussian_for_video_rendering(make_scene(self.last_output))
        result = {"gaussians": float(sample.get_xyz.shape[0]), "frames": float(frames)}
        for key in ("first", "second"):
            sync(self.device)
            t0 = time.perf_counter()
            video = render_video(sample, resolution=resolution, num_frames=frames, r=2, fov=40, pitch_deg=0,
                                 yaw_start_deg=-90)["color"]
            sync(self.device)
            result[key] = time.perf_counter() - t0
            assert len(video) == frames and video[0].shape == (resolution, resolution, 3)
        return result

    def peak_memory_gib(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2 ** 30
        return self.rss.peak / 2 ** 30


def _progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def bench_device(config: str, device: str, runs: int, low_memory: bool, steps, flops: bool,
                 profiled: bool = True, turntable: bool = False) -> dict:
    t0 = time.perf_counter()
    bench = PipelineBench(config, device, low_memory, steps)
    construct = time.perf_counter() - t0
    if bench.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(bench.device)
    bench.rss.reset()
    bench.keep_output = turntable
    first, warm = bench.first_and_warm(runs, device, _progress)
    peak = bench.peak_memory_gib()
    stage_rss = {k: v / 2 ** 30 for k, v in bench.stage_rss.items()}
    video = {}
    if turntable:
        _progress(f"{device}: 300-frame turntable of the object")
        video = bench.turntable()
    profile = {}
    if profiled:
        _progress(f"{device}: profiled run")
        profile = bench.profiled_run()
    _progress(f"{device}: FLOP-counted run" if flops else f"{device}: done")
    stage_flops = bench.stage_flops() if flops else {}
    bench.close()
    peak_process = backends.device.peak_rss_bytes() / 2 ** 30  # the kernel's high-water mark, construction included
    return {"device": str(bench.device), "construct": construct, "first": first, "warm": warm, "peak_gib": peak,
            "peak_process_rss_gib": peak_process, "stage_rss_gib": stage_rss,
            "profile": profile, "flops": stage_flops, "turntable": video}


def print_pipeline(result: dict, mm_rate: Optional[float], mm_label: str = "fp32") -> None:
    print(f"\n== pipeline on {result['device']}: construct {result['construct']:.1f} s, peak memory "
          f"{result['peak_gib']:.2f} GiB ({'allocator' if 'cuda' in result['device'] else 'RSS, sampled'}); process "
          f"peak RSS {result['peak_process_rss_gib']:.2f} GiB (ru_maxrss)")
    stages = list(result["first"].keys())
    stage_rss = result.get("stage_rss_gib", {})
    header = f"{'stage':24} {'first s':>8} {'median s':>9} {'range s':>15} {'busy':>6} {'kernels':>8}"
    if stage_rss:
        header += f" {'peak RSS':>9}"
    if mm_rate:
        header += f" {'GFLOP':>8} {'GFLOP/s':>8} {'% of mm':>8}"
    print(header)
    for stage in stages:
        warm = [w[stage] for w in result["warm"] if stage in w] or [result["first"][stage]]
        med = statistics.median(warm)
        prof = result["profile"].get(stage, {})
        busy = f"{100 * prof['busy']:.0f}%" if "busy" in prof else "-"
        kernels = str(prof.get("kernels", "-"))
        line = (f"{stage:24} {result['first'][stage]:8.2f} {med:9.2f} {min(warm):7.2f}-{max(warm):<7.2f}"
                f" {busy:>6} {kernels:>8}")
        if stage_rss:
            line += f" {stage_rss[stage]:5.2f} GiB" if stage in stage_rss else f" {'-':>9}"
        if mm_rate:
            fl = result["flops"].get(stage, 0.0)
            line += (f" {fl / 1e9:8.1f} {fl / med / 1e9:8.1f} {100 * fl / med / mm_rate:7.0f}%" if fl and med
                     else f" {'-':>8} {'-':>8} {'-':>8}")
        print(line)
    print("warm runs, total s: " + " ".join(f"{w['total']:.2f}" for w in result["warm"]))
    video = result.get("turntable")
    if video:
        print(f"turntable of the last object ({video['gaussians']:,.0f} gaussians, {video['frames']:.0f} frames, "
              f"512^2, render_video): {video['first']:.2f} s (first in this process), {video['second']:.2f} s again")
    if mm_rate:
        total_fl = sum(result["flops"].values())
        print(f"one large {mm_label} torch.mm in this process: {mm_rate / 1e9:.1f} GFLOP/s; the run's counted "
              f"GEMM + attention FLOPs ({total_fl / 1e12:.2f} TFLOP) take {total_fl / mm_rate:.2f} s at that rate")
    kinds = {s: p for s, p in result["profile"].items() if s != "total" and "span" in p}
    if kinds:
        print(f"GPU kernel seconds per stage (profiled warm run): {'span':>7} {'busy':>7} {'gemm':>7} "
              f"{'attn':>7} {'copy':>7} {'other':>7}")
        for stage, p in kinds.items():
            print(f"  {stage:46} " + " ".join(f"{p.get(k, 0.0):7.3f}" for k in ("span", "busy_s", "gemm", "attn",
                                                                                  "copy", "other")))
        for stage in ("ss_sampling", "slat_sampling"):
            names = kinds.get(stage, {}).get("names", {})
            top = sorted(names.items(), key=lambda kv: -kv[1])[:10]
            if top:
                print(f"  top kernels of {stage} (s): " + "; ".join(f"{n[:70]} {t:.3f}" for n, t in top))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", help="pipeline.yaml of a checkpoint folder")
    ap.add_argument("--make-random", metavar="DIR", help="build full-size random weights in DIR (if missing), use them")
    ap.add_argument("--manifests", type=Path, default=None,
                    help="with --make-random: the release's json manifests (default: ../shared/golden/manifests)")
    ap.add_argument("--configs", type=Path, default=None,
                    help="with --make-random: the release's yamls (default: ../shared/upstream_configs)")
    ap.add_argument("--quick", action="store_true", help="tiny random checkpoint, 1 + 1 steps, small render table")
    ap.add_argument("--devices", nargs="+", default=None, help="default: cuda (if available) and cpu")
    ap.add_argument("--runs", type=int, default=3, help="warm runs after the first")
    ap.add_argument("--steps", type=int, nargs=2, metavar=("STAGE1", "STAGE2"))
    ap.add_argument("--cpu-steps", type=int, nargs=2, default=None, help="steps on the CPU (default: --steps)")
    ap.add_argument("--no-low-memory-cpu", action="store_true",
                    help="CPU runs keep every model loaded (the --cpu-report part is then named <part>-resident)")
    ap.add_argument("--no-render", action="store_true")
    ap.add_argument("--no-flops", action="store_true", help="skip the FLOP-counted run")
    ap.add_argument("--no-profile", action="store_true", help="skip the profiled run (busy fraction, kernels)")
    ap.add_argument("--cpu-report", metavar="DIR", type=Path, default=None,
                    help="the CPU report instead (benchmarks/cpu_report.py): default settings and the fast preset "
                         "end to end, thread scaling; DIR/cpu_report.json and .md")
    ap.add_argument("--parts", nargs="+", default=["scaling", "fast", "default"],
                    help="with --cpu-report: any of default, fast, scaling (added to DIR's report)")
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 4, 8, 16],
                    help="with --cpu-report: thread counts of the scaling curve")
    ap.add_argument("--weights", default="default", help="with --cpu-report: default, int8 or bf16")
    ap.add_argument("--dtype", default="auto", help="with --cpu-report: the sampling dtype (auto, bfloat16, float32)")
    args = ap.parse_args(argv)
    if args.quick:
        config = str(tiny_checkpoint())
        steps = args.steps or [1, 1]
    elif args.make_random:
        config = str(make_random_checkpoint(Path(args.make_random), args.manifests, args.configs))
        steps = args.steps
    elif args.config:
        config, steps = args.config, args.steps
    else:
        ap.error("give --config, --make-random DIR or --quick")
    if args.cpu_report:
        from cpu_report import cpu_report
        cpu_report(config, args.cpu_report, args.parts, args.runs, args.weights, args.threads, progress=_progress,
                   dtype=args.dtype, low_memory=not args.no_low_memory_cpu)
        print((args.cpu_report / "cpu_report.md").read_text())
        return 0
    devices = args.devices or (["cuda"] if torch.cuda.is_available() else []) + ["cpu"]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, {os.cpu_count()} cores, load "
          f"{load:.2f}, THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}"
          + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))
    print(f"checkpoint {config}; steps {steps or 'from the config'}; {args.runs} warm runs")
    for dev in devices:
        dev_steps = (args.cpu_steps or steps) if dev == "cpu" else steps
        low_memory = dev == "cpu" and not args.no_low_memory_cpu
        # the turntable goal is a GPU one; 300 frames of a full-size object take minutes on a CPU
        result = bench_device(config, dev, args.runs, low_memory, dev_steps, flops=not args.no_flops,
                              profiled=not args.no_profile, turntable=dev != "cpu" and not args.no_render)
        if args.no_flops:
            print_pipeline(result, None)
        elif dev == "cpu":
            print_pipeline(result, matmul_rate(torch.device(dev)))
        else:  # the sampling stages compute in half precision (autocast): compare with a half-precision GEMM
            print_pipeline(result, matmul_rate(torch.device(dev), n=8192, dtype=torch.float16), "fp16")
    if not args.no_render:
        br = _import_first("bench_render")
        print("\n== splat renderer (one frame, render_video's camera)")
        sizes = ([20_000], [128]) if args.quick else ([100_000, 1_000_000], [512])
        br.print_table(br.render_table(sizes[0], sizes[1], devices, repeat=1 if args.quick else 3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
