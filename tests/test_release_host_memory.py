"""backends.device.release_host_memory: freed C-heap pages go back to the system (glibc), and the low-memory
pipeline calls it after every model it unloads (a second run in one process peaked ~0.5-1 GiB higher
because stage 2's freed activations stayed resident in malloc arenas)."""
import ctypes
import platform
import weakref

import pytest
import torch

import backends.device as dev

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
CHUNK = 64 * 2 ** 10  # below glibc's smallest mmap threshold (128 KiB): always carved from an arena
CHUNKS = 4096  # 256 MiB
KEEP_EVERY = 32  # one chunk in 32 stays allocated, so free() cannot shrink the heap from its top


def test_returns_whether_the_platform_can_release():
    assert dev.release_host_memory() is GLIBC
    assert dev.release_host_memory() is GLIBC  # repeatable, nothing left to release is fine


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_fragmented_free_heap_pages_leave_the_resident_set():
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.restype, libc.free.argtypes = None, [ctypes.c_void_p]
    dev.release_host_memory()
    chunks = [libc.malloc(CHUNK) for _ in range(CHUNKS)]
    kept = [p for i, p in enumerate(chunks) if i % KEEP_EVERY == KEEP_EVERY - 1]
    try:
        assert all(chunks)
        for p in chunks:
            ctypes.memset(p, 1, CHUNK)  # resident
        for i, p in enumerate(chunks):
            if i % KEEP_EVERY != KEEP_EVERY - 1:
                libc.free(p)
        freed = CHUNK * (CHUNKS - len(kept))
        before = dev.current_rss_bytes()
        assert dev.release_host_memory()
        released = before - dev.current_rss_bytes()
        # the holes between the kept chunks are ~2 MiB each: nearly all of their pages can go
        assert released > freed // 2, (released, freed)
    finally:
        for p in kept:
            libc.free(p)


def test_low_memory_pipeline_releases_around_each_model(tmp_path_factory, monkeypatch):
    """Before each load and after each unload; the unloaded model is gone by then (a reference held until the
    calling method returns would keep its weights mapped and its freed memory unreleasable)."""
    from sam3d_objects.assets.tiny_checkpoint import ensure_tiny_checkpoint
    from sam3d_objects.inference import Inference
    import backends

    yaml = ensure_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", log=lambda *a: None)
    model = {}
    calls = []  # at each release: is the model watched through `model` still alive?
    monkeypatch.setattr(backends.device, "release_host_memory",
                        lambda: calls.append("ref" in model and model["ref"]() is not None) or GLIBC)
    low = Inference(str(yaml), compile=False, device="cpu", low_memory=True).pipeline
    assert calls == []  # nothing loaded yet
    with low._generator("ss_generator", None, 1) as generator:
        assert calls == [False]  # before loading
        model["ref"] = weakref.ref(generator)
        del generator
    assert calls == [False, False] and low.loaded_models() == {}  # after unloading, with the model already gone
    low._get("ss_decoder")
    low._free("ss_decoder")
    assert len(calls) == 4 and low.loaded_models() == {}
    eager = Inference(str(yaml), compile=False, device="cpu", low_memory=False).pipeline
    eager._free("ss_decoder")  # keeps its models: nothing was freed, nothing to release
    assert eager.models.is_loaded("ss_decoder") and len(calls) == 4


REUSE_SCRIPT = r'''
import resource, sys, torch
import backends.device as dev
if sys.argv[1] == "keep":
    assert dev.keep_freed_host_memory()
def one_round():
    tensors = [torch.empty(2 * 2 ** 20).fill_(1.0) for _ in range(8)]  # 8 x 8 MiB, every page written
    del tensors
one_round()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    one_round()
print("FAULTS", resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
'''
REUSE_PAGES = 5 * 8 * (8 * 2 ** 20 // 4096)  # pages the five rounds write


def _faults_of_reused_tensors(mode: str) -> int:
    import subprocess
    import sys
    from pathlib import Path
    proc = subprocess.run([sys.executable, "-c", REUSE_SCRIPT, mode], capture_output=True, text=True, timeout=300,
                          cwd=str(Path(__file__).resolve().parents[1]))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return int(proc.stdout.split("FAULTS")[-1])


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_kept_freed_memory_is_reused_without_page_faults():
    """Rounds of eight 8 MiB tensors written and freed: with glibc's defaults every round faults its pages in
    again (the heap top is trimmed back to the system); after ``keep_freed_host_memory`` the later rounds reuse
    the first round's pages. Each case in a fresh process (the setting is process-wide)."""
    default = _faults_of_reused_tensors("default")
    kept = _faults_of_reused_tensors("keep")
    # the control: the measure sees the faults. Usually every round faults all its pages in again (81,750 of
    # 81,920); with the other core busy some runs fault only 18,391 (not traced; the heap top not trimmed in some
    # rounds would give it), still 9x the kept setting's 2,048 (2-core CI machine, 2026-11-28: the control failed
    # once in a clean-clone CI run, with the other test worker busy; 20,318 in one of 8 runs of the code before)
    assert default > REUSE_PAGES // 5, (default, REUSE_PAGES)
    assert kept < REUSE_PAGES // 10 and 4 * kept < default, (kept, default, REUSE_PAGES)


def test_keep_freed_host_memory_says_whether_it_applied():
    assert dev.keep_freed_host_memory() is GLIBC
    assert dev.keep_freed_host_memory() is GLIBC  # once per process; repeating is free


@pytest.mark.parametrize("device, low_memory, setting, active", [
    ("cpu", False, True, True), ("cpu", True, True, False), ("cpu", False, False, False),
    ("cuda", False, True, False), ("mps", False, True, False)])
def test_pipeline_run_reuses_host_memory_where_models_stay_loaded_on_the_cpu(monkeypatch, device, low_memory,
                                                                            setting, active):
    """``reuse_host_memory``: set before the run's stages on the CPU with the models kept loaded, and the free
    pages returned when the run ends, also when it fails; nothing on other devices, in low-memory mode or when
    the attribute is off."""
    from types import SimpleNamespace

    import sam3d_objects.pipeline.inference_pipeline as ip
    calls = []
    monkeypatch.setattr(dev, "keep_freed_host_memory", lambda: calls.append("keep") or True)
    monkeypatch.setattr(dev, "release_host_memory", lambda: calls.append("release") or True)
    pipeline = SimpleNamespace(device=torch.device(device), low_memory=low_memory, reuse_host_memory=setting)
    with ip.InferencePipeline._host_memory_reused(pipeline):
        assert calls == (["keep"] if active else [])
    assert calls == (["keep", "release"] if active else [])
    with pytest.raises(RuntimeError):
        with ip.InferencePipeline._host_memory_reused(pipeline):
            raise RuntimeError("stage failed")
    assert calls == (["keep", "release"] * 2 if active else [])
