"""``QuantizedLinear``: a linear layer whose weight is stored as int8 with per-output-channel scales, or as
bfloat16, and multiplied through ``backends.quantized_linear`` (the backend is the registry's choice).

It stands in for an ``nn.Linear`` or a ``SparseLinear`` (a SparseTensor's features go through it, the voxels stay)
after ``sam3d_objects.pipeline.weights`` converted a model's large layers at load time. It is inference-only: the
weight is a buffer, not a parameter.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.nn as nn

import backends


class QuantizedLinear(nn.Module):
    """``weight`` int8 [out, in] with ``weight_scale`` float32 [out] (W = weight * scale), or bf16 [out, in]
    without a scale; ``bias`` [out] (float32) or None."""

    def __init__(self, weight: torch.Tensor, weight_scale: Optional[torch.Tensor] = None,
                 bias: Optional[torch.Tensor] = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._packed = None  # (weak reference to the weight it was made from, its version, packed copy): prepack()

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: Optional[torch.Tensor], fmt: str) -> "QuantizedLinear":
        """The layer for a float ``weight`` [out, in] in format ``fmt`` ("int8" or "bf16")."""
        if fmt == "int8":
            q, scale = backends.quantize_int8(weight)
            return cls(q, scale, bias)
        if fmt == "bf16":
            return cls(weight.to(torch.bfloat16), None, bias)
        raise ValueError(f"unknown weight format {fmt!r}; use 'int8' or 'bf16'")

    def prepack(self) -> bool:
        """Keep a copy of the bf16 weight laid out for the CPU's bf16 GEMM (``backends.prepack_bf16_weight``; as
        large as the weight), which later calls multiply by where the backend can; returns whether one was made
        (not for int8 codes, other devices, CPUs without bf16 matmul hardware). The copy is not state: a state
        dict, a pickle or a copy of the layer leaves it out, and a moved or changed weight drops it."""
        if self._packed_weight() is not None:
            return True
        packed = backends.prepack_bf16_weight(self.weight) if self.weight_scale is None else None
        self._packed = None if packed is None else (weakref.ref(self.weight), self.weight._version, packed)
        return packed is not None

    def _packed_weight(self) -> Optional[torch.Tensor]:
        if self._packed is None:
            return None
        source, version, packed = self._packed
        if source() is self.weight and version == self.weight._version:
            return packed
        self._packed = None  # the weight was moved (``.to``) or written to: the copy is stale
        return None

    def __getstate__(self):
        return dict(self.__dict__, _packed=None)

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        return backends.quantized_linear(x, self.weight, self.weight_scale, self.bias, packed=self._packed_weight())

    def forward(self, x):
        if isinstance(x, torch.Tensor):
            return self._linear(x)
        return x.replace(self._linear(x.feats))  # a SparseTensor (in place of a SparseLinear): per-voxel features

    def extra_repr(self) -> str:
        fmt = "int8" if self.weight.dtype == torch.int8 else str(self.weight.dtype).replace("torch.", "")
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"weights={fmt}"


def dense_weight(layer: nn.Module) -> Optional[torch.Tensor]:
    """The float weight [out, in] a linear layer multiplies by as it is stored: an ``nn.Linear``'s (``SparseLinear``
    included), or a ``QuantizedLinear``'s bfloat16 / float16 copy (no scales); None for int8 codes and other
    layers. Fused paths (the context shortcut of cross-attention, the MLP's linear + GELU) take it as a matrix."""
    if isinstance(layer, nn.Linear):
        return layer.weight
    if isinstance(layer, QuantizedLinear) and layer.weight_scale is None and layer.weight.dtype.is_floating_point:
        return layer.weight
    return None
