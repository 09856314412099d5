"""Structure of ``sam3d_objects``: the module pairs that were import cycles stay apart, the CLI's exit codes and
user errors live in one module with the old paths still valid, and one place (backends.device) knows which
devices exist, used by ``patches``' device shims, which follow ``$SAM3D_DEVICE``."""
import ast
import json
import os
import subprocess
import sys
import textwrap

import torch

from conftest import ROOT


def cycles(graph):
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_pairs_that_were_cycles_stay_apart():
    """cli <-> segment, cli <-> batch / app (their shared library is sam3d_objects.reconstruction), pipeline <->
    validation, config.safety <-> validation / instantiate, images <-> validation
    and the plotly pair: the lower module no longer imports the upper one, at any depth (the whole-tree cycle
    check is tests/test_boundary.py's)."""
    from test_boundary import _import_graph
    graph = _import_graph(("sam3d_objects",))
    for front_end in ("segment", "batch", "app", "demo"):
        assert "sam3d_objects.errors" in graph[f"sam3d_objects.{front_end}"], front_end
    lower_upper = [("segment", "cli"), ("segment_folder", "segment"), ("segment_video", "segment"),
                   ("validation", "pipeline.inference_pipeline"), ("config.safety", "validation"),
                   ("config.safety", "config.instantiate"), ("utils.images", "validation"),
                   ("utils.visualization.plotly.plot_scene", "utils.visualization.scene_visualizer"),
                   ("batch", "cli"), ("app", "cli"), ("reconstruction", "cli"), ("reconstruction", "batch"),
                   ("reconstruction", "app")]
    found = [(a, b) for a, b in lower_upper if f"sam3d_objects.{b}" in graph[f"sam3d_objects.{a}"]]
    assert not found, found


def test_old_import_paths_are_the_same_objects():
    from sam3d_objects import cli, errors, reconstruction, segment, validation
    from sam3d_objects.config import instantiate, safety
    from sam3d_objects.pipeline import checkpoint, inference_pipeline
    from sam3d_objects.utils.visualization import scene_visualizer
    from sam3d_objects.utils.visualization.plotly import structures
    assert cli.UserError is errors.UserError and cli.EXIT_CHECKPOINT == errors.EXIT_CHECKPOINT == 3
    assert (cli.EXIT_OK, cli.EXIT_ERROR, cli.EXIT_INPUT, cli.EXIT_RUN, cli.EXIT_INTERRUPT) == (0, 1, 2, 4, 130)
    assert cli.reconstruct is reconstruction.reconstruct and cli.find_checkpoint is reconstruction.find_checkpoint
    assert cli.SIGNALS is reconstruction.SIGNALS and cli.FORMATS is reconstruction.FORMATS
    assert validation.ConfigError is errors.ConfigError and validation.InputWarning is errors.InputWarning
    assert validation.DeviceUnavailableError is errors.DeviceUnavailableError
    assert segment.SegmentError.__module__ == "sam3d_objects.sam3_support"
    assert inference_pipeline.GENERATOR_PREFIX is checkpoint.GENERATOR_PREFIX
    assert instantiate.torchvision_imports is safety.torchvision_imports
    assert scene_visualizer.CameraPose is structures.CameraPose


def test_segment_errors_become_cli_input_errors(tmp_path, capsys):
    from sam3d_objects import cli
    code = cli.main(["segment", str(tmp_path / "missing.png"), "--out", str(tmp_path / "m"), "--box", "3,3,1,1"])
    assert code == cli.EXIT_INPUT and "--box" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# devices
# ---------------------------------------------------------------------------------------------------------------
def test_mps_availability_is_asked_in_backends_device_only():
    found = []
    for folder in ("sam3d_objects", "patches"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Attribute) and node.attr == "is_available" and \
                        "mps" in ast.unparse(node.value):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, "use backends.device.mps_available(): " + ", ".join(found)


def test_redirect_target_is_never_cuda_without_cuda(monkeypatch):
    import backends
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(backends.device, "mps_available", lambda: False)
    monkeypatch.setattr(backends.device, "_DEFAULT", torch.device("cuda"))
    assert backends.device.redirect_target() == torch.device("cpu")
    monkeypatch.setattr(backends.device, "mps_available", lambda: True)
    assert backends.device.redirect_target() == torch.device("mps")
    monkeypatch.setattr(backends.device, "_DEFAULT", torch.device("meta"))
    assert backends.device.redirect_target() == torch.device("meta")


def _shim_targets(env):
    code = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(ROOT)!r})
        import torch
        import patches
        state = patches.apply(replace_installed=True)
        from patches import cuda_shim, device_shim
        t = torch.zeros(2, device="cuda")
        print(json.dumps({{"state": state["cuda_device"], "device_shim": str(device_shim.target()),
                           "cuda_shim": str(cuda_shim._target()), "tensor": str(t.device)}}))
    """)
    env = {**{k: v for k, v in os.environ.items() if k != "SAM3D_DEVICE"}, **env}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_patches_redirection_follows_sam3d_device():
    """The shims send CUDA requests where ``$SAM3D_DEVICE`` says (here the meta device, the one non-CPU device
    every machine has), and to the default device (CPU here) without it."""
    if torch.cuda.is_available():
        import pytest
        pytest.skip("with CUDA present the shims leave CUDA requests alone")
    import backends
    plain = _shim_targets({})
    expected = str(backends.device.redirect_target()) if "SAM3D_DEVICE" not in os.environ else None
    assert plain["state"] == "shim" and plain["device_shim"] == plain["cuda_shim"] == plain["tensor"]
    if expected is not None:
        assert plain["tensor"] == expected
    chosen = _shim_targets({"SAM3D_DEVICE": "meta"})
    assert chosen["device_shim"] == chosen["cuda_shim"] == chosen["tensor"] == "meta"
