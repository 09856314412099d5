"""tdfy_dit models (upstream's re-exports) and `from_pretrained` for TRELLIS-style (json + safetensors) models."""
import json
import os
from typing import Any

import torch.nn as nn

from .sparse_structure_flow import SparseStructureFlowModel, SparseStructureFlowTdfyWrapper
from .sparse_structure_vae import SparseStructureDecoder, SparseStructureEncoder
from .structured_latent_flow import SLatFlowModel, SLatFlowModelTdfyWrapper
from .structured_latent_vae import SLatGaussianDecoder

__all__ = ["SparseStructureFlowModel", "SparseStructureFlowTdfyWrapper", "SparseStructureEncoder",
           "SparseStructureDecoder", "SLatGaussianDecoder", "SLatFlowModel", "SLatFlowModelTdfyWrapper",
           "from_pretrained"]


def _model_class(name: str) -> type:
    """The model class called `name` among this package's models (upstream's lookup fails with NameError; this is
    its evident intent)."""
    from . import mot_sparse_structure_flow, structured_latent_vae
    for namespace in (globals(), vars(structured_latent_vae), vars(mot_sparse_structure_flow)):
        klass = namespace.get(name)
        if isinstance(klass, type) and issubclass(klass, nn.Module):
            return klass
    raise ValueError(f"unknown model class {name!r} in the model's json: expected one of {__all__[:-1]} or a "
                     f"structured_latent_vae model")


def _files(path: str) -> tuple:
    if os.path.exists(path + ".json") and os.path.exists(path + ".safetensors"):
        return path + ".json", path + ".safetensors"
    parts = path.split("/")
    if len(parts) < 3:
        raise FileNotFoundError(f"{path}.json / {path}.safetensors not found and {path!r} is not "
                                f"'owner/repo/path/name' on the Hugging Face hub")
    from huggingface_hub import hf_hub_download
    repo_id, model_name = "/".join(parts[:2]), "/".join(parts[2:])
    return (hf_hub_download(repo_id, f"{model_name}.json"), hf_hub_download(repo_id, f"{model_name}.safetensors"))


def from_pretrained(path: str, **kwargs: Any) -> nn.Module:
    """Build the model named in `path`.json (``{"name": class, "args": {...}}``; `kwargs` add constructor
    arguments) and load `path`.safetensors into it (strict). `path` is local or 'owner/repo/sub/name' on the hub."""
    from safetensors.torch import load_file
    config_file, model_file = _files(path)
    with open(config_file) as f:
        config = json.load(f)
    model = _model_class(config["name"])(**config["args"], **kwargs)
    model.load_state_dict(load_file(model_file))
    return model
