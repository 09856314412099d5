"""Device self-check (``sam3d_objects.selfcheck``, also ``python -m backends.selfcheck``) on the CPU, and that it
catches a wrong backend; the MPS guards that can be tested without a Mac (torch version message, Metal limits, the
F.linear chunking trigger)."""
import pytest
import torch

import backends
from backends import registry
from sam3d_objects import selfcheck


def test_quick_selfcheck_passes_on_cpu(capsys):
    assert selfcheck.main(["--device", "cpu", "--quick"]) == 0
    out = capsys.readouterr().out
    for op in ("sparse_conv3d k3", "varlen_attention", "neighbor_map (keys beyond int32)", "unique",
               "conv3d as conv2d (workaround)", "render_gaussians", "group_norm"):
        assert op in out
    assert "all checks passed" in out


def _reregister(spec):
    registry.register(spec.family, spec.name, devices=spec.devices, dtypes=spec.dtypes, requires=spec.requires,
                      probe=spec.probe, priority=spec.priority, auto_devices=spec.auto_devices,
                      reference=spec.reference, **spec.extra)(spec.fn)


@pytest.fixture
def wrong_backend():
    """Registers a deliberately wrong CPU sparse-attention backend ('xformers': a name of the family) and a
    sparse conv that ignores the bias ('torchsparse'); puts the real registrations back afterwards."""
    saved = {fam: registry.registered(fam).get(name) for fam, name in
             ((registry.Family.SPARSE_ATTN, "xformers"), (registry.Family.SPARSE_CONV, "torchsparse"))}

    @registry.register(registry.Family.SPARSE_ATTN, "xformers", devices=("cpu",), dtypes=(torch.float32,))
    def bad_attention(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        return v[: q.shape[0]] * 1.0  # no softmax at all

    @registry.register(registry.Family.SPARSE_CONV, "torchsparse", devices=("cpu",), dtypes=(torch.float32,))
    def bad_conv(feats, coords, weight, bias=None, nmap=None):
        from backends.sparse_conv import torch_sparse_conv3d
        return torch_sparse_conv3d(feats, coords, weight, None, nmap)  # forgets the bias

    try:
        yield
    finally:
        for fam, name in ((registry.Family.SPARSE_ATTN, "xformers"), (registry.Family.SPARSE_CONV, "torchsparse")):
            spec = saved[fam]
            if spec is not None:
                _reregister(spec)
            else:
                registry._REGISTRY[fam].pop(name, None)


def test_selfcheck_fails_on_a_wrong_backend(wrong_backend, capsys):
    results = selfcheck.run_selfcheck("cpu", quick=True, families=["sparse_conv", "attention"])
    verdicts = {(r.op, r.backend): r.verdict for r in results}
    assert verdicts[("varlen_attention", "xformers")] == selfcheck.WRONG
    assert verdicts[("sparse_conv3d k3", "torchsparse")] == selfcheck.WRONG
    assert verdicts[("varlen_attention", "sdpa")] == selfcheck.OK  # the real ones still pass
    assert verdicts[("sparse_conv3d k3", "torch")] == selfcheck.OK
    assert selfcheck.exit_status(results) == 1
    assert selfcheck.main(["--device", "cpu", "--quick", "--only", "attention"]) == 1
    assert "WRONG" in capsys.readouterr().out


def test_selfcheck_reports_a_crashing_backend(wrong_backend):
    @registry.register(registry.Family.SPARSE_ATTN, "xformers", devices=("cpu",), dtypes=(torch.float32,))
    def crashing(*args):
        raise RuntimeError("kernel exploded")

    results = selfcheck.run_selfcheck("cpu", quick=True, families=["attention"])
    row = [r for r in results if r.backend == "xformers"][0]
    assert row.verdict == selfcheck.FAILED and "kernel exploded" in row.note
    assert selfcheck.exit_status(results) == 2


def test_references_are_independent_of_the_backends():
    # the dict neighbour table and the dense conv reference agree with a hand-made case
    coords = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 2], [0, 2, 1, 1], [1, 1, 1, 2]], dtype=torch.int32)
    table = selfcheck.dict_neighbor_table(coords, 3)
    centre = 13
    assert table[:, centre].tolist() == [0, 1, 2, 3]
    assert table[0, centre + 1] == 1  # +z neighbour of voxel 0
    assert table[0, centre + 9] == 2  # +x neighbour
    assert table[3, centre - 1] == -1  # other batch element
    feats = torch.ones(4, 1)
    weight = torch.ones(1, 3, 3, 3, 1)
    out = selfcheck.dense_sparse_conv_reference(feats, coords, weight, None)
    assert out.reshape(-1).tolist() == [3.0, 3.0, 3.0, 1.0]  # the first three are mutual 3x3x3 neighbours


def test_torch_version_message_for_mps():
    from backends import metal
    assert metal.torch_too_old_for_mps("2.7.0") is None
    assert metal.torch_too_old_for_mps("2.13.0+cpu") is None
    msg = metal.torch_too_old_for_mps("2.6.0")
    assert msg and "torch >= 2.7" in msg and "--device cpu" in msg
    with pytest.raises(RuntimeError, match="too old"):
        metal.require_torch_for_mps("2.5.1")


def test_metal_threadgroup_memory_and_launch_limits():
    from backends import metal
    from backends.attn import metal as metal_attn
    from backends.sparse_conv import metal as metal_conv

    class Kernel:
        max_threads_per_threadgroup = 1024
        static_thread_group_memory_length = 40 * 1024

    with pytest.raises(RuntimeError, match="threadgroup memory"):
        metal._check_threadgroup_memory(Kernel(), 0, "k")
    metal._check_threadgroup_memory(object(), metal_attn.ATTN_THREADGROUP_BYTES, "attn")  # ~27 KB fits 32 KB
    assert metal_attn.ATTN_THREADGROUP_BYTES < metal.THREADGROUP_MEMORY_LIMIT
    old = (metal.LAUNCH_WORK_LIMIT, metal.FLUSH_WORK_LIMIT)
    try:
        many = len(metal_conv.conv_launches(100_000, 64, 64, 27))
        metal.set_launch_limits(launch_work=2 ** 26)
        assert len(metal_conv.conv_launches(100_000, 64, 64, 27)) > many
        with pytest.raises(ValueError):
            metal.set_launch_limits(flush_work=0)
    finally:
        metal.set_launch_limits(*old)


def test_pointmap_linear_chunking_only_on_the_real_trigger():
    from sam3d_objects.model.backbone.dit.embedder.pointmap import PointPatchEmbed, mps_linear_needs_chunks
    assert mps_linear_needs_chunks((70000, 65, 768), "mps")
    assert not mps_linear_needs_chunks((1024, 65, 768), "mps")  # full-size embedder: 66,560 rows, but B = 1024
    assert not mps_linear_needs_chunks((70000 * 65, 768), "mps")  # 2-D input
    assert not mps_linear_needs_chunks((70000, 65, 768), "mps", has_bias=False)
    assert not mps_linear_needs_chunks((70000, 65, 768), "cpu")
    assert PointPatchEmbed._windows_per_chunk(torch.zeros(1024, 65, 8)) == 1024


def test_cli_selfcheck_command(capsys):
    from sam3d_objects import cli
    assert cli.main(["selfcheck", "--device", "cpu", "--quick"]) == 0
    assert "all checks passed" in capsys.readouterr().out


def test_pipeline_noise_option_is_found_through_the_forwarded_run_options():
    """Inference.__call__ takes **run_options and forwards them to the pipeline's run (which has noise_device):
    the self-check must see the option there, not give up on __call__'s own signature."""
    from sam3d_objects.inference import Inference
    from sam3d_objects.pipeline.inference_pipeline import InferencePipeline

    inference = object.__new__(Inference)
    inference._pipeline = object.__new__(InferencePipeline)
    assert selfcheck.pipeline_takes_noise_device(inference)

    def closed(image, mask, seed=None):
        pass

    def forwards(image, **options):
        pass

    def run(image, noise_device="device"):
        pass

    assert not selfcheck.takes_option(closed, "noise_device", [run])  # no **kwargs: nothing is forwarded
    assert selfcheck.takes_option(forwards, "noise_device", [run])
    assert not selfcheck.takes_option(forwards, "noise_device", [closed])


def test_pipeline_comparison_compares_on_the_cpu_through_the_device_path():
    """The CPU-vs-device pipeline row on the CPU with the emulated device path: a comparison (a number and a
    verdict), never 'skipped'."""
    (row,) = selfcheck.check_pipeline(torch.device("cpu"), quick=True, emulate=True)
    assert row.verdict == selfcheck.OK, row
    assert row.max_error is not None and row.max_error <= 1e-6, row  # the same arithmetic on the same CPU
    (plain,) = selfcheck.check_pipeline(torch.device("cpu"), quick=True)
    assert plain.verdict == selfcheck.SKIPPED and "reference" in plain.note


def test_pipeline_comparison_runs_on_each_accelerator(device):
    """On an accelerator the row compares (ok, not skipped): the noise is drawn on the CPU on both sides."""
    if device.type == "cpu":
        pytest.skip("the CPU is the reference; the emulated device path is tested above")
    (row,) = selfcheck.check_pipeline(device, quick=True)
    assert row.verdict == selfcheck.OK, row


def test_backends_selfcheck_alias_runs_the_selfcheck():
    """``python -m backends.selfcheck`` (the documented path) runs ``sam3d_objects.selfcheck``; importing the alias
    imports nothing of ``sam3d_objects``."""
    import os
    import pathlib
    import subprocess
    import sys

    from conftest import root_pythonpath

    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=root_pythonpath(), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "backends.selfcheck", "--device", "cpu", "--quick", "--only", "sort"],
                         capture_output=True, text=True, timeout=300, cwd=root, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "self-check on cpu" in res.stdout and "all checks passed" in res.stdout
    res = subprocess.run([sys.executable, "-c", "import sys, backends.selfcheck; "
                          "print(sorted(m for m in sys.modules if m.startswith('sam3d_objects')))"],
                         capture_output=True, text=True, timeout=300, cwd=root, env=env)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr[-2000:]

