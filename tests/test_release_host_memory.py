"""backends.device.release_host_memory: freed C-heap pages go back to the system (glibc), and the low-memory
pipeline calls it after every model it unloads (a second run in one process peaked ~0.5-1 GiB higher
because stage 2's freed activations stayed resident in malloc arenas)."""
import ctypes
import platform
import weakref

import pytest

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
