"""Optional parts that keep the user's torch: ``python -m sam3d_objects.extras constraints | no-deps EXTRAS``.

``make extras EXTRAS=hub,app,moge`` runs ``pip install -e ".[EXTRAS]" -c <constraints>`` where the constraints pin
the torch (and torchvision) already installed, then ``pip install --no-deps`` for the packages whose declared
requirements would pull a second torch stack (setup.py's ``NO_DEPS``). Importing this module needs no torch.
"""
from __future__ import annotations

import ast
import sys
from importlib import metadata
from pathlib import Path
from typing import Dict, List, Sequence

KEPT = ("torch", "torchvision", "torchaudio")  # pinned to what is installed, when installed


def _fits_installed_torch(name: str) -> bool:
    """Whether ``name``'s own torch requirement accepts the installed torch (a torchvision built for another
    torch is left unpinned, so pip can choose the matching one instead of failing)."""
    try:
        from packaging.requirements import Requirement
        torch_version = metadata.version("torch")
        for text in metadata.requires(name) or []:
            req = Requirement(text)
            if req.name == "torch" and (req.marker is None or req.marker.evaluate()):
                return req.specifier.contains(torch_version.split("+")[0], prereleases=True)
    except Exception:  # noqa: BLE001  no packaging, odd metadata: keep the pin
        return True
    return True


def keep_torch_constraints() -> List[str]:
    """``name==version`` for each installed package of ``KEPT`` (local labels such as ``+cpu`` dropped: a
    constraint ``torch==2.13.0`` is met by the installed ``2.13.0+cpu``, and pip then keeps it)."""
    lines = []
    for name in KEPT:
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        if name == "torch" or _fits_installed_torch(name):
            lines.append(f"{name}=={version.split('+')[0]}")
    return lines


def _setup_literal(name: str) -> Dict[str, List[str]]:
    """A dict literal assigned to ``name`` in the checkout's setup.py (read, never executed)."""
    setup = Path(__file__).resolve().parents[1] / "setup.py"
    tree = ast.parse(setup.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise KeyError(f"{name} not found in {setup}")


def extras() -> Dict[str, List[str]]:
    return _setup_literal("EXTRAS")


def no_deps_packages(names: Sequence[str]) -> List[str]:
    """Packages of the extras ``names`` that are installed with ``--no-deps``; unknown names are an error."""
    known, nodeps = extras(), _setup_literal("NO_DEPS")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown extra(s) {', '.join(unknown)}; choose from {', '.join(sorted(known))}")
    return [pkg for n in names for pkg in nodeps.get(n, [])]


def main(argv: Sequence[str]) -> int:
    if argv[:1] == ["constraints"]:
        print("\n".join(keep_torch_constraints()))
        return 0
    if argv[:1] == ["no-deps"] and len(argv) == 2:
        print(" ".join(no_deps_packages([n.strip() for n in argv[1].split(",") if n.strip()])))
        return 0
    print("usage: python -m sam3d_objects.extras constraints | no-deps EXTRA[,EXTRA...]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
