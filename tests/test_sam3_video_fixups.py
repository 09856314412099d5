"""The SAM 3 video fix-ups of patches.sam3_video without SAM 3: the syntax-tree transformations on small modules
written here (they rewrite exactly the named construct, refuse a module without it), and the runtime helpers the
rewritten statements call (checked against scipy / torch themselves). SAM 3 itself: test_sam3_video.py (slow)."""
import ast
import textwrap
import types

import numpy as np
import pytest
import torch
from scipy import ndimage

import patches
from patches import fixups, sam3_video


def _run(source: str, transform) -> types.ModuleType:
    tree = ast.parse(textwrap.dedent(source))
    transform(tree)
    ast.fix_missing_locations(tree)
    module = types.ModuleType("fake_sam3_module")
    exec(compile(tree, "<fake>", "exec"), module.__dict__)
    return module


def test_entries_are_registered_and_listed_by_report():
    names = [n for n, f in fixups.FIXUPS.items() if f.module.startswith("sam3.")]
    assert set(names) == {"sam3_video_predictor_gpu_count", "sam3_video_autocast", "sam3_tracker_autocast",
                          "sam3_tracker_bfloat16_memory", "sam3_detector_bfloat16_features",
                          "sam3_cpu_connected_components", "sam3_decoder_ffn_autocast"}
    try:
        patches.apply(fixups=["sam3_video_autocast"])
        report = patches.report()
        assert "fix-up sam3_video_autocast [sam3.model.sam3_video_inference]" in report
        assert "sam3_tracker_autocast" in report and patches.fixup_status()["sam3_tracker_autocast"] == "off"
    finally:
        patches.remove()


def test_device_count_rewrite_in_the_named_method_only():
    source = """
        import torch
        class Sam3VideoPredictorMultiGPU:
            def __init__(self):
                self.ok = all(0 <= i < torch.cuda.device_count() for i in [0])
        def elsewhere():
            return torch.cuda.device_count()
    """
    fixup = fixups.FIXUPS["sam3_video_predictor_gpu_count"]
    module = _run(source, fixup.transform)
    if not torch.cuda.is_available():
        assert module.Sam3VideoPredictorMultiGPU().ok
        assert module.elsewhere() == 0  # untouched outside the named method
    with pytest.raises(fixups.ShapeMismatch):
        _run("import torch\nclass Sam3VideoPredictorMultiGPU:\n    def __init__(self):\n        pass\n",
             fixup.transform)


def test_autocast_rewrites_only_cuda_autocasts():
    source = """
        import torch
        class TransformerDecoderLayer:
            def forward_ffn(self, x):
                with torch.amp.autocast(device_type="cuda", enabled=False):
                    inner = torch.is_autocast_enabled("cpu")
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    cpu = torch.is_autocast_enabled("cpu")
                return inner, cpu
    """
    tree = ast.parse(textwrap.dedent(source))
    fixups.FIXUPS["sam3_decoder_ffn_autocast"].transform(tree)
    rewritten = ast.unparse(tree)
    assert rewritten.count("_sam3d_patches_sam3_video.cuda_autocast(device_type='cuda', enabled=False)") == 1
    assert "torch.autocast('cpu', dtype=torch.bfloat16)" in rewritten  # other device types untouched
    assert rewritten.count("import patches.sam3_video as _sam3d_patches_sam3_video") == 1
    module = _run(source, fixups.FIXUPS["sam3_decoder_ffn_autocast"].transform)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a caller's own autocast is left alone
        inner, cpu = module.TransformerDecoderLayer().forward_ffn(None)
    if not torch.cuda.is_available():
        assert inner is True and cpu is True


def test_cuda_autocast_helper_changes_nothing_without_cuda_and_works_as_decorator():
    if torch.cuda.is_available():
        pytest.skip("with CUDA the helper is torch.autocast itself")
    before = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
    context = sam3_video.cuda_autocast(device_type="cuda", dtype=torch.bfloat16)
    context.__enter__()  # entered and never left, as the tracker's constructor does
    assert (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")) == before
    context.__exit__(None, None, None)

    @sam3_video.cuda_autocast(device_type="cuda", dtype=torch.bfloat16)
    def matmul(a, b):
        return a @ b

    assert matmul(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.float32
    with sam3_video.cuda_autocast("cpu", dtype=torch.bfloat16):  # other device types: the real autocast
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


def test_bfloat16_cast_rewrite():
    source = """
        import torch
        class Sam3TrackerPredictor:
            def _run_single_frame_inference(self, x):
                return x.to(torch.bfloat16), x.to(torch.float16)
            def _run_memory_encoder(self, x):
                y = x.to(torch.bfloat16)
                return y
    """
    module = _run(source, fixups.FIXUPS["sam3_tracker_bfloat16_memory"].transform)
    a, b = module.Sam3TrackerPredictor()._run_single_frame_inference(torch.ones(2))
    c = module.Sam3TrackerPredictor()._run_memory_encoder(torch.ones(2))
    expected = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    assert a.dtype == expected and c.dtype == expected and b.dtype == torch.float16
    with pytest.raises(fixups.ShapeMismatch):  # both sites are required
        _run("import torch\nclass Sam3TrackerPredictor:\n    def _run_memory_encoder(self, x):\n"
             "        return x.to(torch.bfloat16)\n", fixups.FIXUPS["sam3_tracker_bfloat16_memory"].transform)


def test_connected_components_match_scipy_and_handle_empty_batches():
    rng = np.random.default_rng(0)
    masks = torch.from_numpy(rng.random((3, 1, 17, 23)) > 0.6).to(torch.uint8)
    labels, counts = sam3_video.connected_components_cpu(masks)
    assert labels.shape == counts.shape == masks.shape
    for b in range(3):
        plane = masks[b, 0].numpy().astype(bool)
        ref, n = ndimage.label(plane, structure=np.ones((3, 3)))
        np.testing.assert_array_equal(labels[b, 0].numpy(), ref)
        sizes = np.array([0] + [(ref == k).sum() for k in range(1, n + 1)])
        np.testing.assert_array_equal(counts[b, 0].numpy(), sizes[ref])
    empty_labels, empty_counts = sam3_video.connected_components_cpu(torch.zeros(0, 1, 8, 8, dtype=torch.uint8))
    assert empty_labels.shape == empty_counts.shape == (0, 1, 8, 8)


def test_connected_components_rewrite_targets_the_cpu_fallback_call():
    source = """
        def connected_components_cpu(x):
            raise RuntimeError("stack expects a non-empty TensorList")
        def connected_components(x):
            return connected_components_cpu(x)
    """
    module = _run(source, fixups.FIXUPS["sam3_cpu_connected_components"].transform)
    labels, _ = module.connected_components(torch.zeros(0, 1, 4, 4))
    assert labels.shape == (0, 1, 4, 4)
