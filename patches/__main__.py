"""``python -m patches run script.py [args]``: run a CUDA-era script with the patches applied.

``python -m patches report`` prints what would be replaced on this machine.
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys
from typing import Optional, Sequence

from . import apply, report


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m patches", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a script (as __main__) with patches.apply() in effect")
    run.add_argument("--device", default=None,
                     help="where CUDA requests go (default: $SAM3D_DEVICE, else mps if available, else cpu)")
    run.add_argument("--replace-installed", action="store_true",
                     help="use the stand-ins even for packages that import")
    run.add_argument("--report", action="store_true", help="print patches.report() to stderr before running")
    run.add_argument("--fixups", default=None, metavar="NAMES",
                     help="comma-separated upstream fix-ups to apply (default: all; 'none' for none; see "
                          "patches.fixups)")
    run.add_argument("script")
    run.add_argument("args", nargs=argparse.REMAINDER)
    sub.add_parser("report", help="apply the patches and print what was replaced, and why")
    args = parser.parse_args(argv)
    if args.command == "report":
        apply()
        print(report())
        return 0
    fixups = True if args.fixups is None else ([] if args.fixups == "none" else
                                               [n.strip() for n in args.fixups.split(",") if n.strip()])
    apply(replace_installed=args.replace_installed, device=args.device, fixups=fixups if fixups != [] else False)
    if args.report:
        print(report(), file=sys.stderr)
    sys.argv = [args.script, *args.args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))  # as `python script.py` would
    runpy.run_path(args.script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
