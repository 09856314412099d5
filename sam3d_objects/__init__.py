"""SAM 3D Objects, re-implemented on device-agnostic backends (CPU, MPS, CUDA).

Module paths, constructor arguments and state-dict keys follow Meta's release so that the official
``pipeline.yaml`` and checkpoints load unchanged.
"""

__version__ = "0.1.0"
