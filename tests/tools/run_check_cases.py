"""Run the golden harness (../shared/golden/check_cases.py, third-party code to this package) with the torchvision
stand-in of ``patches/`` installed first.

Why: the harness builds the preprocess case's modules with plain ``hydra.utils.instantiate``, whose configs name
``torchvision.transforms.*``; ``sam3d_objects`` itself no longer installs anything on import (its own
``safe_instantiate`` remaps those targets), so code outside it that needs ``torchvision`` gets the stand-in
explicitly, here. With a working torchvision the stand-in leaves it alone.

    python tests/tools/run_check_cases.py <check_cases.py> [its arguments...]
"""
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from patches.torchvision_shim import install

    install()
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
