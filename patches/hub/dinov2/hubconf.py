"""Local torch.hub entry points for ``facebookresearch/dinov2`` (served by :mod:`patches.hub_shim` when the hub
repository is not in torch.hub's cache and cannot be downloaded).

Each ``dinov2_vit{s,b,l,g}14[_reg](**kwargs)`` builds the DINOv2 vision transformer of this project
(``sam3d_objects/model/backbone/dit/embedder/dinov2.py``: the hub model's module and parameter names, the hub's
constructor arguments as overrides). Pretrained weights are not downloaded: parameters are freshly initialised, as
code that loads a checkpoint over the backbone (SAM 3D's condition embedders) expects.
"""
import importlib
import sys
import types
import warnings
from pathlib import Path

dependencies = ["torch"]

_PACKAGE = "patches._project_dinov2"
_SOURCE = Path(__file__).resolve().parents[3] / "sam3d_objects" / "model" / "backbone" / "dit" / "embedder"


def _project_dinov2():
    """The project's dinov2 module, loaded under a private package name: the name ``sam3d_objects`` may belong to
    the code being run (Meta's package)."""
    if _PACKAGE not in sys.modules:
        if not (_SOURCE / "dinov2.py").exists():
            raise ImportError(f"the local DINOv2 builder is missing ({_SOURCE / 'dinov2.py'}); install "
                              f"sam3d-objects-anywhere with its sources, or allow torch.hub to download")
        package = types.ModuleType(_PACKAGE)
        package.__path__ = [str(_SOURCE)]
        sys.modules[_PACKAGE] = package
    return importlib.import_module(_PACKAGE + ".dinov2")


def _own_attention(model):
    """The hub's DINOv2 picks its attention itself and ignores SAM 3D's ``ATTN_BACKEND``, which upstream's
    pipeline sets to ``flash_attn`` on the GPUs it knows, also where flash_attn is absent: the model's attention
    modules take the registry's automatic choice instead of that variable."""
    for module in model.modules():
        if hasattr(module, "attn_backend"):
            module.attn_backend = "auto"
    return model


def _entry(name):
    def build(*, pretrained: bool = True, **kwargs):
        if pretrained:
            warnings.warn(f"patches' offline torch.hub DINOv2 stand-in: {name} is built without downloading its "
                          "pretrained weights (fresh parameters; load a checkpoint over them)", stacklevel=2)
        return _own_attention(_project_dinov2().build_dinov2(name, **kwargs))
    build.__name__ = name
    build.__doc__ = f"DINOv2 {name} (architecture of the hub model; weights not downloaded)."
    return build


for _arch in ("vits14", "vitb14", "vitl14", "vitg14"):
    for _suffix in ("", "_reg"):
        _name = f"dinov2_{_arch}{_suffix}"
        globals()[_name] = _entry(_name)
