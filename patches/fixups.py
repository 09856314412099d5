"""Targeted fix-ups of named upstream modules: a syntax-tree transformation applied while the module is imported.

Why: some CUDA-era code crashes off-CUDA by itself, where no truthful shim can help (e.g. a function that binds a
name only when CUDA is available and then reads it unconditionally). For those few places, and only in the named
modules, :func:`install` adds an import hook that parses the module's source, lets the entry's transform change the
tree, and compiles the result. The file on disk, its bytecode cache and every other module are left alone.

Each entry is small and states in words what it fixes (never a copy of upstream's code). When the module no longer
has the shape the transform expects (a user's modified checkout), the transform raises :class:`ShapeMismatch`; the
module then imports unchanged and a warning says which fix-up was skipped and why. :func:`status` (shown by
``patches.report()``) lists every entry as applied / skipped / waiting (module not imported yet) / off.
``patches.apply(fixups=False)`` turns them all off, ``fixups=["name", ...]`` keeps only the named ones.

Adding an entry (declarative: module name, description, transform)::

    from patches.fixups import ShapeMismatch, fixup, find_function

    @fixup("sam3.model.some_module",
           "what crashes without CUDA, and what the transformation changes (one or two sentences)")
    def some_module_name_of_the_fix(tree: ast.Module) -> None:
        fn = find_function(tree, "the_function")      # raises ShapeMismatch when absent
        ...                                            # edit the tree in place; raise ShapeMismatch("why")
                                                       # when the expected construct is not there

The decorated function's name is the entry's name (the ``fixups=`` keyword and the report use it). An entry can
also be made with ``register(Fixup(name, module, description, transform, path_suffix))``; ``path_suffix`` further
restricts a generic module name to files whose path ends with it (upstream's ``notebook/inference.py`` is imported
as plain ``inference``). Entries for another package's modules go in this file, grouped under a comment naming the
package. Keep the list short: every entry must be justified by a crash reproduced in a test.

How the hook works: :func:`install` wraps ``importlib.machinery.SourceFileLoader.get_code`` (the loader of every
``.py`` module, also of ``importlib.util.spec_from_file_location``), so only modules whose name has an enabled entry
take the transforming path (never this project's own ``sam3d_objects``, which shares upstream's module names); the
transformed code is never written to ``__pycache__``. A module imported before :func:`install` keeps its original
code (its entry reports "already imported").
"""
from __future__ import annotations

import ast
import importlib.machinery
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Union


class ShapeMismatch(Exception):
    """The module does not have the construct a fix-up expects: the fix-up is skipped, the module runs as is."""


class FixupWarning(UserWarning):
    """A fix-up was skipped because its module no longer has the expected shape."""


@dataclass(frozen=True)
class Fixup:
    name: str                                   # short identifier (apply(fixups=[...]) and report())
    module: str                                 # dotted module name as imported
    description: str                            # the crash, and what the transformation changes
    transform: Callable[[ast.Module], None]     # edits the tree in place; raises ShapeMismatch
    path_suffix: Optional[str] = None           # also require the file path to end with this ("/" separators)

    def matches(self, module: str, path: str) -> bool:
        if module != self.module:
            return False
        return self.path_suffix is None or path.replace("\\", "/").endswith(self.path_suffix)


FIXUPS: Dict[str, Fixup] = {}
_STATE: dict = {"enabled": set(), "status": {}, "original_get_code": None, "own_get_code": False}


def register(entry: Fixup) -> Fixup:
    if entry.name in FIXUPS:
        raise ValueError(f"fix-up {entry.name!r} is registered twice")
    FIXUPS[entry.name] = entry
    return entry


def fixup(module: str, description: str, path_suffix: Optional[str] = None):
    """Decorator: register the decorated ``transform(tree)`` as a fix-up of ``module`` (name = function name)."""
    def decorate(transform: Callable[[ast.Module], None]):
        register(Fixup(transform.__name__, module, description, transform, path_suffix))
        return transform
    return decorate


# ---------------------------------------------------------------------------------------------------------------
# small tree helpers for transforms
# ---------------------------------------------------------------------------------------------------------------
def find_function(tree: ast.AST, name: str) -> ast.FunctionDef:
    """The (first) function definition called ``name`` anywhere in ``tree``."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    raise ShapeMismatch(f"no function {name!r}")


def names_stored(node: ast.AST) -> set:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def names_loaded(node: ast.AST) -> set:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def mentions(node: ast.AST, text: str) -> bool:
    """Whether the source of ``node`` contains ``text`` (for shape checks)."""
    return text in ast.unparse(node)


def statement(source: str) -> List[ast.stmt]:
    """Statements parsed from a short snippet written by the fix-up itself."""
    return ast.parse(source).body


def _locate(tree: ast.AST, predicate) -> tuple:
    """(parent body list, index) of the first statement satisfying ``predicate``."""
    for parent in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            body = getattr(parent, field, None)
            if isinstance(body, list):
                for i, stmt in enumerate(body):
                    if isinstance(stmt, ast.stmt) and predicate(stmt):
                        return body, i
    raise ShapeMismatch("statement not found")


# ---------------------------------------------------------------------------------------------------------------
# entries: Meta's SAM 3D Objects (sam3d_objects, notebook/inference.py)
# ---------------------------------------------------------------------------------------------------------------
@fixup("sam3d_objects.pipeline.inference_pipeline",
       "set_attention_backend() binds gpu_name only when CUDA is available, then reads it: importing the pipeline "
       "without CUDA raises UnboundLocalError. gpu_name starts as '' (no GPU), so the non-flash_attn branch runs.")
def gpu_name_unbound(tree: ast.Module) -> None:
    fn = find_function(tree, "set_attention_backend")
    if "gpu_name" not in names_loaded(fn) or "gpu_name" not in names_stored(fn):
        raise ShapeMismatch("set_attention_backend no longer assigns and reads gpu_name")
    first = fn.body[0]
    if names_stored(first) == {"gpu_name"} and not isinstance(first, ast.If):
        raise ShapeMismatch("gpu_name is already bound unconditionally first")
    fn.body[:0] = statement("gpu_name = ''")


@fixup("sam3d_objects",
       "the package's __init__ imports sam3d_objects.init, a module the released package does not ship (only "
       "skipped when LIDRA_SKIP_INIT is set): `import sam3d_objects` raises ModuleNotFoundError. The import is "
       "kept, and only that module's absence is tolerated.")
def missing_init_module(tree: ast.Module) -> None:
    def is_init_import(stmt: ast.stmt) -> bool:
        return isinstance(stmt, ast.Import) and any(a.name == "sam3d_objects.init" for a in stmt.names)

    body, i = _locate(tree, is_init_import)
    guarded = statement(
        "try:\n"
        "    pass\n"
        "except ModuleNotFoundError as _missing:\n"
        "    if _missing.name != 'sam3d_objects.init':\n"
        "        raise\n")[0]
    guarded.body = [body[i]]
    body[i] = guarded


@fixup("inference",
       "notebook/inference.py sets CUDA_HOME from CONDA_PREFIX at import: without conda it raises KeyError. The "
       "assignment now runs only where CONDA_PREFIX is set.",
       path_suffix="notebook/inference.py")
def conda_prefix_required(tree: ast.Module) -> None:
    def reads_conda_prefix(stmt: ast.stmt) -> bool:
        return isinstance(stmt, ast.Assign) and mentions(stmt.value, "CONDA_PREFIX") and \
            isinstance(stmt.value, ast.Subscript)

    body, i = _locate(tree, reads_conda_prefix)
    guard = statement("if 'CONDA_PREFIX' in os.environ:\n    pass\n")[0]
    guard.body = [body[i]]
    body[i] = guard


# ---------------------------------------------------------------------------------------------------------------
# the import hook
# ---------------------------------------------------------------------------------------------------------------
def _transformed_code(loader, fullname: str, path: str, entries: List[Fixup]):
    source = loader.get_data(path)
    tree = ast.parse(source, filename=path)
    applied = []
    for entry in entries:
        try:
            entry.transform(tree)
        except ShapeMismatch as why:
            _STATE["status"][entry.name] = f"skipped: {why}"
            warnings.warn(f"patches fix-up {entry.name!r} skipped: {fullname} ({path}) no longer has the expected "
                          f"shape ({why}); the module runs unchanged there", FixupWarning, stacklevel=2)
            continue
        _STATE["status"][entry.name] = f"applied ({path})"
        applied.append(entry)
    if not applied:
        return None
    ast.fix_missing_locations(tree)
    return compile(tree, path, "exec", dont_inherit=True)


# This project's own re-implementation shares upstream's module names; its files are never fix-up targets.
_PROJECT_PACKAGE = str(Path(__file__).resolve().parents[1] / "sam3d_objects") + os.sep


def _entries_for(fullname: str, path: str) -> List[Fixup]:
    if os.path.abspath(path).startswith(_PROJECT_PACKAGE):
        return []
    return [FIXUPS[n] for n in sorted(_STATE["enabled"]) if n in FIXUPS and FIXUPS[n].matches(fullname, path)]


def _get_code(self, fullname):
    original = _STATE["original_get_code"]
    try:
        path = self.get_filename(fullname)
    except ImportError:
        return original(self, fullname)
    entries = _entries_for(fullname, str(path))
    if entries:
        code = _transformed_code(self, fullname, str(path), entries)
        if code is not None:
            return code
    return original(self, fullname)


def install(which: Union[bool, Iterable[str]] = True) -> Dict[str, str]:
    """Enable the fix-ups (``True``: all; an iterable: those names; ``False``: none); returns :func:`status`."""
    if which is False:
        names = set()
    elif which is True:
        names = set(FIXUPS)
    else:
        names = set(which)
        unknown = names - set(FIXUPS)
        if unknown:
            raise ValueError(f"unknown fix-up(s) {sorted(unknown)}; known: {sorted(FIXUPS)}")
    _STATE["enabled"] = names
    for name in FIXUPS:
        if name not in names:
            _STATE["status"][name] = "off"
        elif not _STATE["status"].get(name, "").startswith(("applied", "skipped")):
            loaded = sys.modules.get(FIXUPS[name].module)
            _STATE["status"][name] = ("already imported before patches.apply(): not fixed"
                                      if loaded is not None and FIXUPS[name].path_suffix is None else "waiting")
    loader = importlib.machinery.SourceFileLoader
    if names and _STATE["original_get_code"] is None:
        _STATE["original_get_code"] = loader.get_code  # SourceLoader's, inherited (or the class's own)
        _STATE["own_get_code"] = "get_code" in loader.__dict__
        loader.get_code = _get_code
    return status()


def uninstall() -> None:
    loader = importlib.machinery.SourceFileLoader
    if _STATE["original_get_code"] is not None:
        if loader.__dict__.get("get_code") is _get_code:
            if _STATE["own_get_code"]:
                loader.get_code = _STATE["original_get_code"]
            else:
                del loader.get_code  # back to the inherited SourceLoader.get_code
        _STATE["original_get_code"] = None
    _STATE["enabled"] = set()
    _STATE["status"] = {}


def status() -> Dict[str, str]:
    """``{name: "applied (path)" | "skipped: why" | "waiting" | "off" | "already imported ..."}``."""
    return {name: _STATE["status"].get(name, "off") for name in FIXUPS}
