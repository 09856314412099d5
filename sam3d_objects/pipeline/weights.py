"""Weight formats of the large transformers (``--weights``, ``Inference(..., weights=...)``): a load-time option.

* ``default``: the checkpoint's weights as the models declare them (float32 on the CPU; upstream's half-precision
  torsos on CUDA / MPS). Nothing is converted.
* ``int8``: the linear layers of the transformer blocks (attention, MLP, adaLN modulation) are stored as int8
  with one float32 scale per output channel (symmetric, max |w| / 127) and run through
  ``backends.quantized_linear``; about a quarter of their float32 memory. The generators' cross-attention and the
  condition fuser's projection nets, where int8's rounding weighs most, are stored in bfloat16
  (:data:`INT8_FINER_PARTS`): 0.34 of the 2.76 B converted parameters, 0.32 GiB more than all-int8.
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
# int8 keeps these layers at a finer format ({path component: format}): the flow generators' cross-attention
# (query, key/value and output projections) and the condition fuser's projection nets, in bfloat16. Measured with
# benchmarks/bench_int8_gate.py on the golden tiny pipeline (stage 1 alone, 5 seeds): relative error of the
# stage-1 latent 9.8e-3 (all int8) -> 3.7e-3 (bf16 everywhere: 4.1e-3), occupancy IoU 0.953-0.967 -> 0.983-0.996.
# Full size they are 0.34 B of the 2.76 B converted parameters: +0.19 GiB for stage 1's generator, +0.09 GiB for
# stage 2's, +0.02 GiB for each condition embedder over all-int8.
INT8_FINER_PARTS: Dict[str, str] = {"cross_attn": "bf16", "projection_nets": "bf16"}


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


def layer_format(name: str, fmt: str) -> str:
    """The format the layer ``name`` (a qualified name from :func:`selected_linears`) is stored in under ``fmt``:
    ``fmt`` itself, except where :data:`INT8_FINER_PARTS` names a finer one for int8 ("default": left as is)."""
    if fmt == "int8":
        for part in name.split("."):
            if part in INT8_FINER_PARTS:
                return INT8_FINER_PARTS[part]
    return fmt


def _swap(model: nn.Module, name: str, layer: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, layer)


def convert_linear_weights(model: nn.Module, fmt: str) -> int:
    """Replace the selected layers of a loaded model by :class:`QuantizedLinear` in format ``fmt`` (in place);
    returns how many. For a model already in memory; loading through :func:`converter` keeps the peak lower."""
    fmt = check_weights(fmt)
    if fmt == "default":
        return 0
    names = [n for n in selected_linears(model) if layer_format(n, fmt) != "default"]
    for name in names:
        layer = model.get_submodule(name)
        bias = None if layer.bias is None else layer.bias.detach().float()
        _swap(model, name, QuantizedLinear.from_weight(layer.weight.detach(), bias, layer_format(name, fmt)))
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
            layer_fmt = layer_format(name, fmt)
            if layer_fmt == "default":
                continue  # loaded as the checkpoint stores it
            keys = [f"{name}.{leaf}" for leaf, _ in model.get_submodule(name).named_parameters(recurse=False)]
            source = state_dict[f"{name}.weight"]
            bias = state_dict.get(f"{name}.bias")
            layer = QuantizedLinear.from_weight(source.to(device), None if bias is None else
                                                bias.to(device=device, dtype=torch.float32), layer_fmt)
            check_finite({f"{name}.weight": layer.weight_scale if layer_fmt == "int8" else layer.weight},
                         "checkpoint")
            backends.device.drop_read_pages(source)
            _swap(model, name, layer)
            used += keys
        return used

    return convert


# Layers whose weight is read as a plain matrix, so a packed copy would only cost memory: the MLPs' first layer
# (``mlp.0``: its GELU runs in the GEMM's epilogue from the plain weight; packed, 6 % faster, for 40 % of a block's
# weights) and the cross-attention's key / value projection (run once per sampling run under the context cache).
UNPACKED_SUFFIXES = ("mlp.0", "to_kv")


def prepack_linear_weights(model: nn.Module) -> int:
    """Packed CPU copies (:meth:`QuantizedLinear.prepack`) of the bf16 format's weights of ``model``'s linear
    layers that run at every step (all but :data:`UNPACKED_SUFFIXES`); returns how many layers have one. None
    anywhere the device or the layer's format does not allow it (then it returns 0)."""
    return sum(module.prepack() for name, module in model.named_modules()
               if isinstance(module, QuantizedLinear) and not name.endswith(UNPACKED_SUFFIXES))


def weight_bytes(model: nn.Module) -> Dict[str, int]:
    """Bytes of the model's parameters and buffers by dtype (what a conversion saves)."""
    out: Dict[str, int] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        key = str(t.dtype).replace("torch.", "")
        out[key] = out.get(key, 0) + t.numel() * t.element_size()
    return out
