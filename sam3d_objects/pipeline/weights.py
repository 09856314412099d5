"""Weight formats of the large transformers (``--weights``, ``Inference(..., weights=...)``): a load-time option.

* ``default``: the checkpoint's weights as the models declare them (float32 on the CPU; upstream's half-precision
  torsos on CUDA / MPS). Nothing is converted.
* ``int8``: the linear layers of the transformer blocks (attention, MLP, adaLN modulation) and of the condition
  fuser's projection nets are stored as int8 with one float32 scale per output channel (symmetric, max |w| / 127)
  and run through ``backends.quantized_linear``; about a quarter of their float32 memory.
* ``bf16``: the same layers stored in bfloat16 (half the memory); their matmuls run in bfloat16 where the device
  does that in hardware (CUDA, MPS, CPUs with AVX-512 BF16 or AMX), else widened to float32 (a warning says so).

Converted models (:data:`CONVERTED_MODELS`): both flow generators and both condition embedders (DINOv2 and the
point-map encoder), 2.8 of the 3.2 B parameters. The decoders keep their weights (small, and the first to show
rounding in the output). Inside a converted model the small input / output / timestep layers stay as they are
(:func:`selected_linears`). The conversion happens while the checkpoint is read (:func:`converter`): each layer is
quantized from the memory-mapped file tensor and the float pages read are dropped before the next, so peak memory
holds the converted model, not a float32 copy of it.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional

import torch
import torch.nn as nn

import backends
from sam3d_objects.model.backbone.tdfy_dit.modules.quantized import QuantizedLinear

WEIGHT_FORMATS = ("default", "int8", "bf16")
_ALIASES = {None: "default", "float32": "default", "fp32": "default", "bfloat16": "bf16"}
CONVERTED_MODELS = ("ss_generator", "slat_generator", "ss_condition_embedder", "slat_condition_embedder")
# module path components under which linear layers are converted: the transformer blocks (dense and sparse flow
# models, DINOv2, the point-map encoder) and the fuser's SwiGLU projections
CONVERTED_PARTS = frozenset({"blocks", "projection_nets"})


def check_weights(fmt: Optional[str]) -> str:
    """The canonical weight format for ``fmt`` (None / "float32" are the default); ValueError naming the choices."""
    key = fmt.strip().lower() if isinstance(fmt, str) else fmt
    key = _ALIASES.get(key, key)
    if key not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weights {fmt!r}; use one of {', '.join(WEIGHT_FORMATS)}")
    return key


def selected_linears(model: nn.Module) -> List[str]:
    """Qualified names of the ``nn.Linear`` layers (``SparseLinear`` included) that a conversion replaces."""
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and CONVERTED_PARTS.intersection(name.split("."))]


def _swap(model: nn.Module, name: str, layer: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, layer)


def convert_linear_weights(model: nn.Module, fmt: str) -> int:
    """Replace the selected layers of a loaded model by :class:`QuantizedLinear` in format ``fmt`` (in place);
    returns how many. For a model already in memory; loading through :func:`converter` keeps the peak lower."""
    fmt = check_weights(fmt)
    if fmt == "default":
        return 0
    names = selected_linears(model)
    for name in names:
        layer = model.get_submodule(name)
        bias = None if layer.bias is None else layer.bias.detach().float()
        _swap(model, name, QuantizedLinear.from_weight(layer.weight.detach(), bias, fmt))
    return len(names)


def converter(fmt: str):
    """The ``convert`` hook of ``checkpoint.load_model`` for format ``fmt`` (None for the default): it swaps the
    selected layers of the meta-built model for converted ones made from the checkpoint's tensors, one layer at
    a time, dropping the file pages each read (``backends.device.drop_read_pages``), and returns the keys used."""
    fmt = check_weights(fmt)
    if fmt == "default":
        return None

    def convert(model: nn.Module, state_dict: Dict[str, torch.Tensor], device: torch.device) -> Iterable[str]:
        from sam3d_objects.pipeline.checkpoint import check_finite
        used = []
        for name in selected_linears(model):
            keys = [f"{name}.{leaf}" for leaf, _ in model.get_submodule(name).named_parameters(recurse=False)]
            source = state_dict[f"{name}.weight"]
            bias = state_dict.get(f"{name}.bias")
            layer = QuantizedLinear.from_weight(source.to(device), None if bias is None else
                                                bias.to(device=device, dtype=torch.float32), fmt)
            check_finite({f"{name}.weight": layer.weight_scale if fmt == "int8" else layer.weight}, "checkpoint")
            backends.device.drop_read_pages(source)
            _swap(model, name, layer)
            used += keys
        return used

    return convert


def weight_bytes(model: nn.Module) -> Dict[str, int]:
    """Bytes of the model's parameters and buffers by dtype (what a conversion saves)."""
    out: Dict[str, int] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        key = str(t.dtype).replace("torch.", "")
        out[key] = out.get(key, 0) + t.numel() * t.element_size()
    return out
