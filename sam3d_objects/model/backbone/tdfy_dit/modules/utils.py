"""Small helpers shared by the dense and sparse models (fp16 torsos, zero init)."""
from typing import Tuple, Type

import torch.nn as nn

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


def convert_module_to_f16(module: nn.Module) -> None:
    """Cast the parameters of one convertible layer to float16 (use with `Module.apply`)."""
    if isinstance(module, fp16_module_types()):
        for p in module.parameters(recurse=False):
            p.data = p.data.half()
        # sparse wrappers keep their weights in a child (e.g. `.conv`); convert those too
        for child in module.children():
            if not isinstance(child, fp16_module_types()):
                for p in child.parameters():
                    p.data = p.data.half()


def convert_module_to_f32(module: nn.Module) -> None:
    """Inverse of `convert_module_to_f16`."""
    if isinstance(module, fp16_module_types()):
        for p in module.parameters(recurse=False):
            p.data = p.data.float()
        for child in module.children():
            if not isinstance(child, fp16_module_types()):
                for p in child.parameters():
                    p.data = p.data.float()


def zero_module(module: nn.Module) -> nn.Module:
    """Zero every parameter of `module` and return it (upstream's zero-init of output/residual layers)."""
    for p in module.parameters():
        p.detach().zero_()
    return module
