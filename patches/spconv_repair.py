"""The real ``spconv``'s CPU path, repaired for biased convolutions in eval mode.

Why: spconv 2.x fuses a convolution's bias (and activation) into its GEMM only in its CUDA kernels; on CPU
features an eval-mode convolution with a bias stops with ``AssertionError: cpu don't support act and bias``. In
training mode spconv adds the bias itself after the gather-GEMM-scatter (the same sum), so the repair runs a
CPU-features, biased, eval-mode call with the module's training flag raised for that call only. CUDA features and
calls with no bias go straight to spconv's own forward. Nothing else changes: the real spconv computes.

Known limit of spconv's CPU build, not repaired here: its submanifold convolution can give wrong results with more
than one OpenMP thread on large inputs (tens of thousands of voxels); run it with ``OMP_NUM_THREADS=1`` (read once,
when spconv is first loaded).
"""
from __future__ import annotations

import functools
import importlib

_STATE: dict = {}


def _repaired_forward(original):
    @functools.wraps(original)
    def forward(self, input, *args, **kwargs):
        features = getattr(input, "features", None)
        if self.training or getattr(self, "bias", None) is None or features is None or features.is_cuda:
            return original(self, input, *args, **kwargs)
        self.training = True  # spconv then adds the bias after the GEMM instead of refusing it on the CPU
        try:
            return original(self, input, *args, **kwargs)
        finally:
            self.training = False
    return forward


def install() -> bool:
    """Repair the imported real spconv (``True`` when repaired; ``False`` when spconv's layout is unknown)."""
    if "owner" in _STATE:
        return True
    try:
        conv = importlib.import_module("spconv.pytorch.conv")
        owner = conv.SparseConvolution
    except (ImportError, AttributeError):
        return False
    _STATE["owner"], _STATE["forward"] = owner, owner.__dict__["forward"]
    owner.forward = _repaired_forward(owner.__dict__["forward"])
    return True


def uninstall() -> None:
    owner = _STATE.pop("owner", None)
    if owner is not None:
        owner.forward = _STATE.pop("forward")
