"""Runtime shims so unmodified CUDA-era research code runs on MPS/CPU through ``backends``.

This is the only package of the project that patches other modules. Nothing here is applied on import: call
:func:`patches.apply` (or a specific shim) explicitly.
"""
