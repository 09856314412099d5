"""Write a checkpoint folder in upstream's layout filled with random weights (benchmarks, demos, tests).

Two sources for the list of tensors (key, shape, dtype):

* ``--manifests DIR`` (full size): the json manifests of the released checkpoint (``shared/golden/manifests``);
  the yamls are copied from ``--configs`` (default: the official ``shared/upstream_configs``).
* ``--from-configs DIR``: the yamls of DIR (e.g. a tiny pipeline); every model is built from its yaml on the meta
  device (no memory) to list its state dict.

    python -m sam3d_objects.tools.make_random_checkpoint --manifests MANIFESTS_DIR --out ckpt_full
    python -m sam3d_objects.tools.make_random_checkpoint --from-configs my_tiny_yamls --out ckpt_tiny

Random recipe (the golden data's, so no branch is dead): tensors with >= 2 dims ~ N(0, 1/fan_in) (fan_in = numel /
out_dim), biases ~ N(0, 0.1^2), 1-D weights / gammas ~ 1 + N(0, 0.1^2), embedding-like tensors ~ N(0, 0.5^2).
Files: generators ``{'state_dict': {'_base_models.generator.<k>' / '_base_models.condition_embedder.<k>'}}``,
decoders a raw state dict, each tensor in its manifest / model dtype (``--dtype`` overrides floating tensors).
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import torch

Spec = List[Tuple[str, Tuple[int, ...], torch.dtype]]
GENERATOR_FILES = ("ss_generator", "slat_generator")
DECODER_FILES = ("ss_decoder", "slat_decoder_gs", "slat_decoder_gs_4", "slat_decoder_mesh")
EMBEDDING_NAMES = ("pos_emb", "pos_embed", "cls_token", "register_tokens", "mask_token", "idx_emb",
                   "invalid_xyz_token", "pos_embed_window")
GENERATOR_PREFIX = "_base_models.generator."
EMBEDDER_PREFIX = "_base_models.condition_embedder."


def default_configs_dir() -> Path:
    return Path(__file__).resolve().parents[2].parent / "shared" / "upstream_configs"


def random_tensor(key: str, shape: Tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    if not dtype.is_floating_point:
        return torch.zeros(shape, dtype=dtype)
    leaf = key.rsplit(".", 1)[-1]
    numel = math.prod(shape) if shape else 1
    if leaf in EMBEDDING_NAMES:
        t = torch.randn(shape, generator=generator) * 0.5
    elif leaf == "bias":
        t = torch.randn(shape, generator=generator) * 0.1
    elif len(shape) <= 1:
        t = 1.0 + torch.randn(shape, generator=generator) * 0.1
    else:
        fan_in = max(1, numel // shape[0])
        t = torch.randn(shape, generator=generator) / math.sqrt(fan_in)
    return t.to(dtype)


def random_state_dict(spec: Spec, seed: int, dtype: Optional[torch.dtype] = None) -> Dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for key, shape, dt in spec:
        out[key] = random_tensor(key, tuple(shape), dtype if (dtype and dt.is_floating_point) else dt, generator)
    return out


# ----------------------------------------------------------------------------------------------------------------
# tensor lists
# ----------------------------------------------------------------------------------------------------------------
def spec_from_manifest(path: Path) -> Spec:
    data = json.loads(path.read_text())
    return [(k["key"], tuple(k["shape"]), getattr(torch, k["dtype"])) for k in data["keys"]]


def spec_from_model(model: torch.nn.Module, prefix: str = "") -> Spec:
    return [(prefix + k, tuple(v.shape), v.dtype) for k, v in model.state_dict().items()]


def spec_from_yaml(yaml_path: Path, node: Optional[str] = None, prefix: str = "") -> Spec:
    from omegaconf import OmegaConf

    from sam3d_objects.config.instantiate import load_config, safe_instantiate
    from sam3d_objects.pipeline.checkpoint import build_on_meta
    config = load_config(yaml_path)
    if node:
        config = OmegaConf.select(config, node)
    elif "pretrained_ckpt_path" in config:
        del config["pretrained_ckpt_path"]
    return spec_from_model(build_on_meta(lambda: safe_instantiate(config)), prefix)


# ----------------------------------------------------------------------------------------------------------------
# writers
# ----------------------------------------------------------------------------------------------------------------
def write_file(out: Path, name: str, spec: Spec, seed: int, dtype: Optional[torch.dtype], suffix: str) -> Path:
    sd = random_state_dict(spec, seed, dtype)
    path = out / f"{name}{suffix}"
    if suffix == ".safetensors":
        from safetensors.torch import save_file
        save_file(sd, str(path))
    elif name in GENERATOR_FILES:
        torch.save({"state_dict": sd}, path)
    else:
        torch.save(sd, path)
    return path


def _set_ckpt_suffix(pipeline_yaml: Path, suffix: str) -> None:
    if suffix == ".ckpt":
        return
    from omegaconf import OmegaConf
    config = OmegaConf.load(pipeline_yaml)
    for key in list(config.keys()):
        if key.endswith("_ckpt_path") and config[key]:
            config[key] = str(Path(config[key]).with_suffix(suffix))
    OmegaConf.save(config, pipeline_yaml)


def make_from_manifests(manifests: Path, configs: Path, out: Path, seed: int = 0,
                        dtype: Optional[torch.dtype] = None, only: Optional[Iterable[str]] = None,
                        suffix: str = ".ckpt") -> List[Path]:
    out.mkdir(parents=True, exist_ok=True)
    for yaml_file in configs.glob("*.yaml"):
        shutil.copyfile(yaml_file, out / yaml_file.name)
    _set_ckpt_suffix(out / "pipeline.yaml", suffix)
    written = []
    for i, name in enumerate(GENERATOR_FILES + DECODER_FILES):
        if only and name not in only:
            continue
        written.append(write_file(out, name, spec_from_manifest(manifests / f"{name}.json"), seed + i, dtype,
                                  suffix))
    return written


def make_from_configs(configs: Path, out: Path, seed: int = 0, dtype: Optional[torch.dtype] = None,
                      suffix: str = ".ckpt") -> List[Path]:
    from omegaconf import OmegaConf
    out.mkdir(parents=True, exist_ok=True)
    if configs.resolve() != out.resolve():
        for yaml_file in configs.glob("*.yaml"):
            shutil.copyfile(yaml_file, out / yaml_file.name)
    _set_ckpt_suffix(out / "pipeline.yaml", suffix)
    pipeline = OmegaConf.load(out / "pipeline.yaml")
    written = []
    for i, name in enumerate(GENERATOR_FILES + DECODER_FILES):
        yaml_name = pipeline.get(f"{name}_config_path")
        if not yaml_name:
            continue
        if name in GENERATOR_FILES:
            spec = (spec_from_yaml(out / yaml_name, "module.generator.backbone", GENERATOR_PREFIX)
                    + spec_from_yaml(out / yaml_name, "module.condition_embedder.backbone", EMBEDDER_PREFIX))
        else:
            spec = spec_from_yaml(out / yaml_name)
        written.append(write_file(out, name, spec, seed + i, dtype, suffix))
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--manifests", type=Path, help="folder with the full-size json manifests")
    src.add_argument("--from-configs", type=Path, help="folder with pipeline.yaml + model yamls")
    p.add_argument("--configs", type=Path, default=None, help="yamls to copy with --manifests "
                                                                "(default: shared/upstream_configs)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="store floating tensors in this dtype (default: the manifest / model dtype)")
    p.add_argument("--format", choices=["ckpt", "safetensors"], default="ckpt")
    p.add_argument("--only", nargs="*", help="with --manifests: only these files (e.g. ss_decoder)")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    suffix = "." + args.format
    if args.manifests:
        written = make_from_manifests(args.manifests, args.configs or default_configs_dir(), args.out, args.seed,
                                      dtype, args.only, suffix)
    else:
        written = make_from_configs(args.from_configs, args.out, args.seed, dtype, suffix)
    for path in written:
        print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
