"""SAM 3D Objects, re-implemented on device-agnostic backends (CPU, MPS, CUDA).

Module paths, constructor arguments and state-dict keys follow Meta's release so that the official
``pipeline.yaml`` and checkpoints load unchanged.
"""

import sys as _sys


def _forget_working_directory() -> None:
    """``python -m sam3d_objects.cli`` puts the working directory first on sys.path; run from inside a downloaded
    checkpoint folder, a ``backends/`` or ``numpy/`` folder planted there would be imported instead of the real
    package. While ``-m`` imports this package (``sys.argv[0] == "-m"``) that entry is dropped, unless this
    package itself comes from there (a source checkout run in place)."""
    import os
    if not _sys.argv or _sys.argv[0] != "-m" or not _sys.path:
        return
    first = os.path.realpath(_sys.path[0] or os.getcwd())
    if first == os.path.realpath(os.getcwd()) and \
            os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) != first:
        del _sys.path[0]


_forget_working_directory()
__version__ = "0.1.0"
