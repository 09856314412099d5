"""The op boundary: models never ask which backend runs nor do conv arithmetic, nothing is patched on
import or use, and the registry is the ground floor of `backends` (no import circle)."""
import ast
import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]
from conftest import SHARED  # noqa: E402  (the reference material, SAM3D_SHARED_DIR or ../shared)
CLIENT_DIRS = [ROOT / "sam3d_objects" / d for d in ("model", "pipeline", "data")]


def _sources(dirs):
    for d in dirs:
        for path in sorted(d.rglob("*.py")):
            yield path, ast.parse(path.read_text(), str(path))


def _dotted(node):
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def test_models_never_ask_which_backend_runs_nor_reach_into_the_registry():
    bad = []
    for path, tree in _sources(CLIENT_DIRS):
        rel = path.relative_to(ROOT)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _dotted(node) in (
                    "backends.current", "backends.resolve", "backends.registered", "backends.report"):
                bad.append(f"{rel}:{node.lineno} {_dotted(node)}")
            if isinstance(node, ast.Attribute) and _dotted(node).startswith("backends.registry"):
                bad.append(f"{rel}:{node.lineno} {_dotted(node)}")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("backends."):
                bad.append(f"{rel}:{node.lineno} from {node.module} import ...")
            if isinstance(node, ast.ImportFrom) and node.module == "backends" and any(
                    a.name in ("current", "resolve", "registry", "registered") for a in node.names):
                bad.append(f"{rel}:{node.lineno} from backends import {[a.name for a in node.names]}")
    assert not bad, "model/pipeline/data code must only call backends' ops:\n" + "\n".join(bad)


def test_no_conv_arithmetic_outside_backends():
    """Convolutions are backends' ops: no function here named like a conv, and no gather-GEMM-scatter
    (index_add_ of neighbour products) nor functional conv calls on 3D data."""
    bad = []
    for path, tree in _sources(CLIENT_DIRS):
        rel = path.relative_to(ROOT)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and "conv" in node.name.lower() \
                    and not node.name.startswith(("convert", "_convert")):
                bad.append(f"{rel}:{node.lineno} def {node.name}")
            if isinstance(node, ast.Call) and _dotted(node.func) in ("F.conv3d", "torch.nn.functional.conv3d",
                                                                      "F.conv2d", "torch.conv3d"):
                bad.append(f"{rel}:{node.lineno} {_dotted(node.func)}(...)")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr == "lookup" and "kernel_offsets" in ast.unparse(tree):
                bad.append(f"{rel}:{node.lineno} neighbour lookup with kernel offsets")
    assert not bad, "conv arithmetic belongs in backends/:\n" + "\n".join(bad)


def _backends_import_graph():
    graph = {}
    pkg = ROOT / "backends"
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        package = name if rel.name == "__init__" else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    target = f"{base}.{node.module}" if node.module else base
                    targets = [target] if node.module else [f"{base}.{a.name}" for a in node.names]
                else:
                    targets = [node.module or ""]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            deps.update(t for t in targets if t == "backends" or t.startswith("backends."))
        graph[name] = deps - {name}
    return graph


def test_registry_imports_nothing_of_backends():
    assert _backends_import_graph()["backends.registry"] == set()


def test_backends_has_no_import_circle():
    graph = _backends_import_graph()
    # a submodule's import of the package itself (`from . import x` inside backends/) is not counted: only module
    # edges between submodules; the package __init__ is the one module allowed to import everything
    edges = {m: {d for d in deps if d in graph and d != "backends"} for m, deps in graph.items() if m != "backends"}
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for dep in edges.get(node, ()):
            if state.get(dep) == "open":
                raise AssertionError("import circle: " + " -> ".join(stack + [node, dep]))
            if dep not in state:
                visit(dep, stack + [node])
        state[node] = "done"

    for module in edges:
        if module not in state:
            visit(module, [])


def test_importing_and_running_puts_no_stand_in_into_sys_modules():
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        import torch
        import sam3d_objects, sam3d_objects.data, sam3d_objects.pipeline
        from omegaconf import OmegaConf
        from sam3d_objects.config.instantiate import safe_instantiate
        from sam3d_objects.model.backbone.tdfy_dit.modules import sparse as sp
        from sam3d_objects.model.backbone.tdfy_dit.models.sparse_structure_vae import Conv3d
        pipeline = OmegaConf.load({str(SHARED / 'upstream_configs' / 'pipeline.yaml')!r})
        pre = safe_instantiate(pipeline.ss_preprocessor)
        pre(torch.rand(3, 40, 50), (torch.rand(1, 40, 50) > 0.5).float(), torch.rand(3, 40, 50))
        coords = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 2], [0, 2, 1, 1]], dtype=torch.int32)
        x = sp.SparseTensor(feats=torch.randn(3, 4), coords=coords)
        sp.SparseConv3d(4, 4, 3)(x); sp.SparseConv3d(4, 4, 1)(x); sp.SparseGroupNorm32(2, 4)(x)
        Conv3d(2, 2, 3, padding=1)(torch.randn(1, 2, 4, 4, 4))
        real_tv = "torchvision" in sys.modules and not getattr(sys.modules["torchvision"], "__sam3d_torchvision_shim__", False)
        bad = [m for m in sys.modules if m.split(".")[0] in ("patches", "spconv", "flash_attn", "xformers")
               or (m.split(".")[0] == "torchvision" and not real_tv)]
        print("BAD", bad)
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "BAD []" in res.stdout, res.stdout
