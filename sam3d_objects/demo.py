"""``make demo``: the main job on an embedded default.

Until the full pipeline lands this prints the backend registry report and runs a quick benchmark of the sparse
convolution and windowed attention on every device present.
"""
from __future__ import annotations

import sys


def main(argv=None) -> int:
    import backends
    from backends import bench

    print("SAM 3D Objects (anywhere) - backend report\n")
    print(backends.report())
    print("\nQuick benchmark (python -m backends.bench for the full table):")
    return bench.main(["--quick"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
