"""Small helpers shared by the dense and sparse models (fp16 torsos, zero init)."""
from typing import Optional, Tuple, Type

import torch
import torch.nn as nn

import backends

# Layer types whose parameters become float16 when a model with use_fp16=True converts its torso.
# Sparse layers register themselves through `register_fp16_module` (keeps this file free of sparse code).
_FP16_MODULE_TYPES = [nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
                      nn.Linear]


def register_fp16_module(cls: Type[nn.Module]) -> Type[nn.Module]:
    """Mark a layer class as part of the fp16 torso conversion (usable as a class decorator)."""
    if cls not in _FP16_MODULE_TYPES:
        _FP16_MODULE_TYPES.append(cls)
    return cls


def fp16_module_types() -> Tuple[Type[nn.Module], ...]:
    return tuple(_FP16_MODULE_TYPES)


def _convert_layer(module: nn.Module, dtype: torch.dtype) -> None:
    if isinstance(module, fp16_module_types()):
        for p in module.parameters(recurse=False):
            p.data = p.data.to(dtype)
        # sparse wrappers keep their weights in a child (e.g. `.conv`); convert those too
        for child in module.children():
            if not isinstance(child, fp16_module_types()):
                for p in child.parameters():
                    p.data = p.data.to(dtype)


def convert_module_to_f16(l: nn.Module) -> None:  # noqa: E741 (upstream's parameter name)
    """Cast the parameters of one convertible layer to float16 (use with `Module.apply`)."""
    _convert_layer(l, torch.float16)


def convert_module_to_f32(l: nn.Module) -> None:  # noqa: E741
    """Inverse of `convert_module_to_f16`."""
    _convert_layer(l, torch.float32)


def zero_module(module: nn.Module) -> nn.Module:
    """Zero every parameter of `module` and return it (upstream's zero-init of output/residual layers)."""
    for p in module.parameters():
        p.detach().zero_()
    return module


HALF_DTYPES = (torch.float16, torch.bfloat16)


def half_torso_dtype(half: Optional[torch.dtype], device: torch.device) -> torch.dtype:
    """What a ``use_fp16`` torso of half type ``half`` (None: float16, upstream's) computes in on ``device``: that
    type where the device runs it well, else float32."""
    half = torch.float16 if half is None else half
    return half if backends.device.half_supported(device, half) else torch.float32


def torso_dtype(model: nn.Module, device: torch.device) -> torch.dtype:
    """The dtype a ``use_fp16`` model's torso runs in on ``device``: its half type (``model.half_dtype``: float16,
    upstream's, unless the caller chose bfloat16 with `set_torso_half_dtype`) where the device runs that type
    well, else float32. The torso is converted when the answer changes (a model first run on the CPU, then moved
    to a GPU, or the reverse), so the CPU fallback casts the fp16 weights up once. ``model`` provides
    ``use_fp16`` and ``_convert_torso(dtype)``."""
    wanted = half_torso_dtype(getattr(model, "half_dtype", torch.float16), device) if model.use_fp16 \
        else torch.float32
    if getattr(model, "_torso_dtype", torch.float32) != wanted:
        model._convert_torso(wanted)
    return wanted


def set_torso_half_dtype(model: nn.Module, dtype: torch.dtype) -> int:
    """Chooses the half type (float16 or bfloat16) that every ``use_fp16`` torso inside ``model`` computes in where
    the device runs it well (`torso_dtype`); returns how many torsos that covers (``use_fp16`` ones).

    The caller's choice, not the model's: upstream's float16 on CUDA; a pipeline sampling in CPU bfloat16 passes
    bfloat16, the CPU's half type (float16 has no fast CPU kernels). A torso holding the other half type now (built
    with ``use_fp16``) is converted at once, so that a checkpoint loaded next is cast once, straight to ``dtype``;
    call it before the weights load (e.g. on the meta-device build) or at least before the first call."""
    if dtype not in HALF_DTYPES:
        raise ValueError(f"a torso's half type is one of {HALF_DTYPES}, got {dtype}")
    count = 0
    for module in model.modules():
        if isinstance(module, Fp16Torso):
            module.half_dtype = dtype
            if module.dtype in HALF_DTYPES and module.dtype != dtype:
                module._convert_torso(dtype)
            count += int(bool(module.use_fp16))
    return count


def settle_torso_dtypes(model: nn.Module, device: torch.device) -> None:
    """Converts every ``use_fp16`` torso inside ``model`` to the dtype it computes in on ``device`` now instead of at
    its first call (see `torso_dtype`): a loader that then lets go of the checkpoint's half-precision tensors
    frees them before sampling rather than holding them beside their float32 copies."""
    for module in model.modules():
        if isinstance(module, Fp16Torso):
            module.compute_dtype(device)


def store_linear_weights_in(module: nn.Module, dtype: torch.dtype) -> int:
    """Casts the weight and bias of every ``nn.Linear`` in ``module`` to ``dtype``; returns how many layers.

    For a model that only runs under autocast in ``dtype``: autocast casts exactly these tensors at every call,
    with the same rounding, so storing them cast gives the same results with half the memory and no cast kernels
    per call. Other parameters (norms, embeddings, positional tables) keep their dtype, since autocast computes
    with them in float32."""
    count = 0
    for layer in module.modules():
        if isinstance(layer, nn.Linear):
            for p in layer.parameters(recurse=False):
                p.data = p.data.to(dtype)
            count += 1
    return count


class Fp16Torso:
    """Mixin for the models with upstream's ``use_fp16`` switch: ``torso()`` names the parts whose layers are cast
    to float16; the norms, embedders and output layers outside it stay float32.

    The one dtype policy of every model: ``forward`` runs the torso in ``compute_dtype(device)`` (the half type,
    ``half_dtype``, for ``use_fp16`` where the device runs it well, else float32, converting the torso when that
    changes); ``dtype`` is upstream's attribute, the dtype the torso holds now. ``half_dtype`` is float16
    (upstream's) unless the caller sets another with `set_torso_half_dtype`."""

    half_dtype: torch.dtype = torch.float16

    @property
    def dtype(self) -> torch.dtype:
        return getattr(self, "_torso_dtype", torch.float32)

    def torso(self) -> Tuple[nn.Module, ...]:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def convert_to_fp16(self) -> None:
        self._convert_torso(torch.float16)

    def convert_to_fp32(self) -> None:
        self._convert_torso(torch.float32)

    def _convert_torso(self, dtype: torch.dtype) -> None:
        for part in self.torso():
            part.apply(lambda m: _convert_layer(m, dtype))
        self._torso_dtype = dtype

    def compute_dtype(self, device: torch.device) -> torch.dtype:
        return torso_dtype(self, device)


FP16_TYPE = torch.float16


def __getattr__(name: str):
    # FP16_MODULES grows as the sparse layers register themselves, so it is computed when read
    if name == "FP16_MODULES":
        return fp16_module_types()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def scale_module(module: nn.Module, scale: float) -> nn.Module:
    """Multiply every parameter of `module` by `scale` in place; returns the module."""
    for p in module.parameters():
        p.detach().mul_(scale)
    return module


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN modulation of tokens x [B, T, C] by per-sample shift / scale [B, C]: x * (1 + scale) + shift."""
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def init_flow_transformer_weights(model: nn.Module, blocks=None) -> None:
    """Training initialisation shared by the flow transformers: xavier-uniform Linear weights and zero biases,
    N(0, 0.02) for the timestep MLP, zeroed adaLN output layers (the shared one, or each block's)."""
    def init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
    model.apply(init)
    nn.init.normal_(model.t_embedder.mlp[0].weight, std=0.02)
    nn.init.normal_(model.t_embedder.mlp[2].weight, std=0.02)
    blocks = model.blocks if blocks is None else blocks
    modulations = [model.adaLN_modulation] if model.share_mod else [b.adaLN_modulation for b in blocks
                                                                    if hasattr(b, "adaLN_modulation")]
    for modulation in modulations:
        nn.init.zeros_(modulation[-1].weight)
        nn.init.zeros_(modulation[-1].bias)
