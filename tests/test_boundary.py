"""The op boundary: models never ask which backend runs nor do conv arithmetic, nothing is patched on
import or use, the registry is the ground floor of `backends`, `backends` the ground floor of the project, and no
import cycle anywhere in the tree."""
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


# The project's own code (tests excluded: they are clients of everything).
TREE = ("backends", "sam3d_objects", "patches", "notebooks", "notebook", "benchmarks")


def _project_modules(tops=TREE):
    """Dotted module name -> (path, is a package __init__) for every .py under the given top-level folders."""
    modules = {}
    for top in tops:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            modules[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = (path, rel.name == "__init__")
    return modules


def _import_graph(tops=TREE):
    """Static import graph of the project: module -> {imported project module: line}.

    Every import statement counts, at module level or inside a function (a deferred import still ties the two
    modules together: it only moves the cycle from import time to call time). ``import a.b.c`` and
    ``from a.b import c`` point at the deepest project module they name (``a.b.c`` when it is a module, else the
    package ``a.b`` whose attribute is taken)."""
    modules = _project_modules(tops)

    def deepest(name):
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in modules:
                return ".".join(parts[:i])
        return None

    graph = {}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        deps = {}
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                source = (f"{base}.{node.module}" if node.module else base) if node.level else (node.module or "")
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else deepest(source)
                           for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [deepest(a.name) for a in node.names]
            else:
                continue
            for target in targets:
                if target and target != name:
                    deps.setdefault(target, node.lineno)
        graph[name] = deps
    return graph


def _cycles(graph):
    """The groups of modules tied by import cycles (strongly connected components of more than one module), as
    sets; the one cycle finder of the tests (``test_package_structure.cycles``)."""
    from test_package_structure import cycles

    return [set(c) for c in cycles(graph)]


def _describe(graph, component):
    return "\n".join(f"  {a} -> {b} (line {graph[a][b]})" for a in sorted(component) for b in sorted(graph[a])
                     if b in component)


def test_import_graph_sees_function_level_imports():
    """The graph is not blind to the imports it must judge: a deferred (function-level) import is an edge."""
    graph = _import_graph(("sam3d_objects",))
    assert "sam3d_objects.assets.tiny_checkpoint" in graph["sam3d_objects.selfcheck"]  # inside check_pipeline
    assert "backends.splat" in _import_graph(("patches", "backends"))["patches.gsplat_shim"]  # inside functions
    assert _cycles({"a": {"b": 1}, "b": {"a": 3}, "c": {"a": 2}}) == [{"a", "b"}]  # graphs with line numbers


def test_registry_imports_nothing_of_backends():
    assert _import_graph(("backends",))["backends.registry"] == {}


def test_backends_is_the_ground_floor():
    """``backends`` imports nothing of the project above it (sam3d_objects, patches, notebooks, benchmarks), not
    even inside a function: the self-check, a client of the whole package, lives in ``sam3d_objects.selfcheck``."""
    graph = _import_graph()
    bad = [f"{m}:{line} imports {d}" for m, deps in graph.items() if m.split(".")[0] == "backends"
           for d, line in deps.items() if d.split(".")[0] != "backends"]
    assert not bad, "backends/ must not import the code above it:\n" + "\n".join(bad)


def test_backends_has_no_import_cycle():
    graph = _import_graph(("backends",))
    cycles = _cycles(graph)
    assert not cycles, "import cycles in backends/:\n" + "\n\n".join(_describe(graph, c) for c in cycles)


# Cycles known and being removed, reported as a warning while they last (none left: the CLI's entry point imports
# `batch` and `app` for their subcommands, and all three are built on `sam3d_objects.reconstruction` below them).
_CYCLES_BEING_REMOVED: set = set()


def test_no_import_cycle_anywhere():
    """No import cycle in the whole tree (module- and function-level imports both count, see `_import_graph`)."""
    import warnings

    graph = _import_graph()
    cycles = _cycles(graph)
    pending = [c for c in cycles if c <= _CYCLES_BEING_REMOVED]
    if pending:
        warnings.warn("import cycles still being removed:\n" + "\n\n".join(_describe(graph, c) for c in pending))
    cycles = [c for c in cycles if not c <= _CYCLES_BEING_REMOVED]
    assert not cycles, "import cycles:\n" + "\n\n".join(_describe(graph, c) for c in cycles)


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
