"""Image + mask -> 3D object (Gaussians, mesh, GLB) and its pose: the two-stage SAM 3D Objects pipeline.

Stages of ``run`` (see docs/UPSTREAM.md section 2): preprocessing -> stage-1 sampling (sparse structure + pose
latents) -> ss decoder -> voxel coords (prune / downsample) -> pose decoding -> stage-2 sampling (structured
latent) -> decoders (mesh, Gaussians) -> exports (GLB, Gaussian).

Models are described by the checkpoint folder's yamls and read with ``sam3d_objects.pipeline.checkpoint``
(weights-only, mmap, meta-device build). ``low_memory`` (default on for CPU/MPS, off for CUDA) loads each model
right before its stage and frees it afterwards (decoders one at a time), emptying the device cache in between.
"""
from __future__ import annotations

import gc
import logging
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

import backends
from sam3d_objects.config.instantiate import load_config, safe_instantiate
from sam3d_objects.pipeline import checkpoint as ckpt
from sam3d_objects.validation import check_run_inputs
from sam3d_objects.pipeline.inference_utils import (downsample_sparse_structure, get_pose_decoder,
                                                   prune_sparse_structure)

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
GENERATOR_PREFIX = "_base_models.generator."
EMBEDDER_PREFIX = "_base_models.condition_embedder."
MAX_STAGE2_VOXELS = 42000
Z_UP_TO_Y_UP = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, -1.0], [0.0, 1.0, 0.0]])


class EmptyStructureError(RuntimeError):
    """Stage 1 produced no occupied voxel: there is nothing for stage 2 to refine."""


def as_dtype(dtype: Union[str, torch.dtype, None]) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if str(dtype) not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
    return DTYPES[str(dtype)]


def _image_to_numpy(image) -> np.ndarray:
    if isinstance(image, torch.Tensor):
        image = image.detach().cpu().numpy()
    image = np.asarray(image)
    if image.ndim == 2:  # greyscale
        image = np.repeat(image[..., None], 3, axis=-1)
    if image.ndim != 3 or image.shape[-1] not in (3, 4):
        raise ValueError(f"image must be an RGB or RGBA array [H, W, 3|4], got shape {image.shape}")
    if image.dtype != np.uint8:
        if np.issubdtype(image.dtype, np.floating) and image.size and float(np.nanmax(image)) <= 1.0:
            image = image * 255.0
        image = np.clip(np.round(image), 0, 255).astype(np.uint8)
    return image


def merge_mask_into_alpha(image, mask=None) -> np.ndarray:
    """RGBA uint8 [H, W, 4]: the mask (bool / 0-1 / 0-255) becomes the alpha channel."""
    image = _image_to_numpy(image)
    if mask is None:
        if image.shape[-1] != 4:
            raise ValueError("no mask given and the image has no alpha channel: pass mask= (HxW, non-zero on the "
                             "object) or an RGBA image whose alpha marks the object")
        return image
    mask = mask.detach().cpu().numpy() if isinstance(mask, torch.Tensor) else np.asarray(mask)
    if mask.ndim == 3 and mask.shape[-1] in (1, 3, 4):
        mask = mask[..., -1] if mask.shape[-1] == 4 else mask[..., 0]
    if mask.shape != image.shape[:2]:
        raise ValueError(f"image is {image.shape[0]}x{image.shape[1]} but the mask is "
                         f"{'x'.join(map(str, mask.shape))}: they must have the same height and width")
    if mask.dtype == bool:
        alpha = mask.astype(np.uint8) * 255
    elif np.issubdtype(mask.dtype, np.floating):
        alpha = np.clip(np.round(mask * 255.0 if mask.max(initial=0) <= 1.0 else mask), 0, 255).astype(np.uint8)
    else:
        alpha = np.clip(mask.astype(np.int64) * (255 if mask.max(initial=0) <= 1 else 1), 0, 255).astype(np.uint8)
    return np.concatenate([image[..., :3], alpha[..., None]], axis=-1)


@contextmanager
def rng_preserved(device: torch.device):
    """Restore the torch random state of the CPU and of ``device`` after the block."""
    cpu_state = torch.get_rng_state()
    dev_state = None
    if device.type == "cuda":
        dev_state = torch.cuda.get_rng_state(device)
    elif device.type == "mps":
        dev_state = torch.mps.get_rng_state()
    try:
        yield
    finally:
        torch.set_rng_state(cpu_state)
        if device.type == "cuda":
            torch.cuda.set_rng_state(dev_state, device)
        elif device.type == "mps":
            torch.mps.set_rng_state(dev_state)


class InferencePipeline:
    """Two-stage pipeline; constructor arguments are the keys of the released ``pipeline.yaml``.

    Extra (ours): ``low_memory`` (None = auto: on for CPU/MPS, off for CUDA) and ``device`` (None = the backends
    default device: cuda > mps > cpu).
    """

    def __init__(self, ss_generator_config_path: str, ss_generator_ckpt_path: str,
                 slat_generator_config_path: str, slat_generator_ckpt_path: str,
                 ss_decoder_config_path: str, ss_decoder_ckpt_path: str,
                 slat_decoder_gs_config_path: Optional[str] = None, slat_decoder_gs_ckpt_path: Optional[str] = None,
                 slat_decoder_mesh_config_path: Optional[str] = None,
                 slat_decoder_mesh_ckpt_path: Optional[str] = None,
                 slat_decoder_gs_4_config_path: Optional[str] = None,
                 slat_decoder_gs_4_ckpt_path: Optional[str] = None,
                 ss_encoder_config_path: Optional[str] = None, ss_encoder_ckpt_path: Optional[str] = None,
                 decode_formats: Sequence[str] = ("gaussian", "mesh"),
                 dtype: Union[str, torch.dtype] = "float32", pad_size: float = 1.0, version: str = "v0",
                 device: Union[str, torch.device, None] = None,
                 ss_preprocessor: Optional[Callable] = None, slat_preprocessor: Optional[Callable] = None,
                 ss_condition_input_mapping: Sequence[str] = (), slat_condition_input_mapping: Sequence[str] = (),
                 pose_decoder_name: str = "ScaleShiftInvariant", workspace_dir: str = "",
                 downsample_ss_dist: int = 0,
                 ss_inference_steps: int = 25, ss_rescale_t: float = 3, ss_cfg_strength: float = 7,
                 ss_cfg_interval: Sequence[float] = (0, 500), ss_cfg_strength_pm: float = 0.0,
                 slat_inference_steps: int = 25, slat_rescale_t: float = 3, slat_cfg_strength: float = 5,
                 slat_cfg_interval: Sequence[float] = (0, 500),
                 rendering_engine: str = "pytorch3d", shape_model_dtype: Union[str, torch.dtype, None] = None,
                 compile_model: bool = False, slat_mean: Optional[Sequence[float]] = None,
                 slat_std: Optional[Sequence[float]] = None, low_memory: Optional[bool] = None):
        self.device = backends.device.as_device(device)
        self.dtype = as_dtype(dtype)
        self.shape_model_dtype = as_dtype(shape_model_dtype) if shape_model_dtype is not None else self.dtype
        self.low_memory = self.device.type != "cuda" if low_memory is None else bool(low_memory)
        self.workspace_dir = Path(workspace_dir) if workspace_dir else Path(".")
        self.decode_formats = list(decode_formats)
        self.pad_size, self.version = pad_size, version
        self.ss_preprocessor, self.slat_preprocessor = ss_preprocessor, slat_preprocessor
        self.ss_condition_input_mapping = list(ss_condition_input_mapping or [])
        self.slat_condition_input_mapping = list(slat_condition_input_mapping or [])
        self.pose_decoder_name = pose_decoder_name
        self.pose_decoder = get_pose_decoder(pose_decoder_name)
        self.downsample_ss_dist = downsample_ss_dist
        self.ss_inference_steps, self.ss_rescale_t = ss_inference_steps, ss_rescale_t
        self.ss_cfg_strength, self.ss_cfg_interval = ss_cfg_strength, list(ss_cfg_interval)
        self.ss_cfg_strength_pm = ss_cfg_strength_pm
        self.slat_inference_steps, self.slat_rescale_t = slat_inference_steps, slat_rescale_t
        self.slat_cfg_strength, self.slat_cfg_interval = slat_cfg_strength, list(slat_cfg_interval)
        self.rendering_engine = rendering_engine
        self.compile_model = compile_model  # accepted for compatibility; models run eagerly
        if slat_mean is None or slat_std is None:
            raise ValueError("slat_mean and slat_std are required (pipeline.yaml lists them)")
        self.slat_mean = torch.tensor(list(slat_mean), dtype=torch.float32)
        self.slat_std = torch.tensor(list(slat_std), dtype=torch.float32)
        self.stage_times: Dict[str, float] = {}
        self.stage_hook: Optional[Callable[[str, str], None]] = None  # (stage, "start"|"end"), for benchmarks

        self._loaders: Dict[str, Callable[[], torch.nn.Module]] = {}
        self._models: Dict[str, torch.nn.Module] = {}
        paths = {
            "ss_generator": (ss_generator_config_path, ss_generator_ckpt_path, "module.generator.backbone",
                             GENERATOR_PREFIX),
            "ss_condition_embedder": (ss_generator_config_path, ss_generator_ckpt_path,
                                      "module.condition_embedder.backbone", EMBEDDER_PREFIX),
            "slat_generator": (slat_generator_config_path, slat_generator_ckpt_path, "module.generator.backbone",
                               GENERATOR_PREFIX),
            "slat_condition_embedder": (slat_generator_config_path, slat_generator_ckpt_path,
                                        "module.condition_embedder.backbone", EMBEDDER_PREFIX),
            "ss_decoder": (ss_decoder_config_path, ss_decoder_ckpt_path, None, None),
            "slat_decoder_gs": (slat_decoder_gs_config_path, slat_decoder_gs_ckpt_path, None, None),
            "slat_decoder_gs_4": (slat_decoder_gs_4_config_path, slat_decoder_gs_4_ckpt_path, None, None),
            "slat_decoder_mesh": (slat_decoder_mesh_config_path, slat_decoder_mesh_ckpt_path, None, None),
        }
        for name, (config_path, ckpt_path, node, prefix) in paths.items():
            if config_path and ckpt_path:
                self._loaders[name] = self._make_loader(name, config_path, ckpt_path, node, prefix)
        for required in ("ss_generator", "ss_condition_embedder", "ss_decoder"):
            if required not in self._loaders:
                raise ValueError(f"{required}: config and checkpoint paths are required")
        self._check_files()
        if not self.low_memory:
            for name in self._loaders:
                self._get(name)

    # ----------------------------------------------------------------------------------------------------------
    # model loading
    # ----------------------------------------------------------------------------------------------------------
    def _path(self, p: str) -> Path:
        p = Path(p)
        return p if p.is_absolute() else self.workspace_dir / p

    def _check_files(self) -> None:
        missing = []
        for loader in self._loaders.values():
            missing += [str(p) for p in loader.paths if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"checkpoint folder {str(self.workspace_dir)!r} is incomplete, missing: "
                                    f"{sorted(set(missing))}. Point Inference at checkpoints/hf/pipeline.yaml of the "
                                    f"released checkpoint (or a folder made by tools/make_random_checkpoint.py).")

    def _make_loader(self, name: str, config_path: str, ckpt_path: str, node: Optional[str],
                     prefix: Optional[str]):
        config_file, ckpt_file = self._path(config_path), self._path(ckpt_path)

        def build_config() -> DictConfig:
            config = load_config(config_file)
            if node is not None:
                sub = OmegaConf.select(config, node)
                if sub is None:
                    raise ValueError(f"{config_file} has no node {node!r}")
                config = sub
            elif "pretrained_ckpt_path" in config:
                del config["pretrained_ckpt_path"]  # weights come from the folder's checkpoint
            return config

        def load() -> torch.nn.Module:
            config = build_config()
            return ckpt.load_model(lambda: safe_instantiate(config), ckpt_file, device=self.device,
                                   state_dict_key="state_dict" if prefix else None, prefix=prefix)

        load.paths = [config_file, ckpt_file]
        load.build_config = build_config
        return load

    def _get(self, name: str) -> torch.nn.Module:
        if name not in self._models:
            if name not in self._loaders:
                raise ValueError(f"the pipeline has no {name} (its config/checkpoint paths were not given)")
            with rng_preserved(self.device):  # lazy (low-memory) loading must not shift the seeded noise
                model = self._loaders[name]()
            self._apply_overrides(name, model)
            self._models[name] = model
        return self._models[name]

    def _free(self, *names: str) -> None:
        if not self.low_memory:
            return
        for name in names:
            self._models.pop(name, None)
        gc.collect()
        backends.device.empty_cache(self.device)

    @property
    def models(self) -> Dict[str, torch.nn.Module]:
        """Models loaded right now (all of them unless ``low_memory``)."""
        return dict(self._models)

    def _apply_overrides(self, name: str, model: torch.nn.Module) -> None:
        """The pipeline's sampler settings replace the generator yaml's (as upstream does after loading)."""
        if name == "ss_generator":
            model.inference_steps = self.ss_inference_steps
            model.rescale_t = self.ss_rescale_t
            model.reverse_fn.strength = self.ss_cfg_strength
            model.reverse_fn.interval = list(self.ss_cfg_interval)
            model.reverse_fn.strength_pm = self.ss_cfg_strength_pm
            model.no_shortcut = True
        elif name == "slat_generator":
            model.inference_steps = self.slat_inference_steps
            model.rescale_t = self.slat_rescale_t
            model.reverse_fn.strength = self.slat_cfg_strength
            model.reverse_fn.interval = list(self.slat_cfg_interval)

    @contextmanager
    def _generator(self, name: str, inference_steps: Optional[int], configured_steps: int):
        """The flow generator `name`, run with `inference_steps` when given; the configured step count is put back
        afterwards (also on errors) and the model is freed after a successful run in low-memory mode."""
        generator = self._get(name)
        if inference_steps is not None:
            generator.inference_steps = inference_steps
        try:
            yield generator
        finally:
            generator.inference_steps = configured_steps
        self._free(name)

    @contextmanager
    def _stage(self, name: str):
        if self.stage_hook:
            self.stage_hook(name, "start")
        start = time.perf_counter()
        try:
            yield
        finally:
            backends.device.synchronize(self.device)
            self.stage_times[name] = self.stage_times.get(name, 0.0) + time.perf_counter() - start
            if self.stage_hook:
                self.stage_hook(name, "end")

    def _autocast(self, dtype: torch.dtype):
        """Upstream samples under fp16 autocast on CUDA (pipeline.yaml dtype); where half precision is slow or
        unsupported (CPU fp16, MPS autocast) sampling stays float32."""
        enabled = dtype != torch.float32 and backends.device.half_supported(self.device, dtype)
        return backends.device.autocast(self.device.type, dtype, enabled=enabled)

    # ----------------------------------------------------------------------------------------------------------
    # preprocessing
    # ----------------------------------------------------------------------------------------------------------
    @staticmethod
    def image_to_tensors(image: np.ndarray):
        """RGBA uint8 [H, W, 4] -> rgb [3, H, W] and alpha [1, H, W], float32 in [0, 1]."""
        rgba = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1).float() / 255.0
        return rgba[:3], rgba[3:4]

    def _mask_from_alpha(self, alpha: torch.Tensor) -> torch.Tensor:
        return (alpha > 0.5).float()

    def preprocess_image(self, image, preprocessor: Callable, pointmap: Optional[torch.Tensor] = None
                         ) -> Dict[str, torch.Tensor]:
        """RGBA image (+ point map [3, H, W]) -> batched condition inputs on ``self.device``."""
        image = _image_to_numpy(image)
        if image.shape[-1] != 4:
            raise ValueError("preprocess_image expects an RGBA image whose alpha channel is the object mask")
        rgb, alpha = self.image_to_tensors(image)
        mask = self._mask_from_alpha(alpha)
        if not bool((mask > 0).any()):
            raise ValueError("the mask is empty: no pixel of the object is selected")
        out = preprocessor(rgb, mask, pointmap) if pointmap is not None else preprocessor(rgb, mask)
        return {k: v[None].to(self.device) if isinstance(v, torch.Tensor) else v for k, v in out.items()}

    # ----------------------------------------------------------------------------------------------------------
    # stage 1
    # ----------------------------------------------------------------------------------------------------------
    @staticmethod
    def _embedder_inputs(embedder: torch.nn.Module, inputs: Dict[str, Any], mapping: Sequence[str]):
        names = list(mapping)
        if not names:
            for entry in getattr(embedder, "embedder_list", []):
                for item in entry[1]:
                    names.append(item[0])
        names = list(dict.fromkeys(names)) or list(inputs)
        missing = [n for n in names if n not in inputs]
        if missing:
            raise ValueError(f"the condition embedder needs {missing}, which preprocessing did not produce "
                             f"(got {sorted(inputs)})")
        return {n: inputs[n] for n in names}

    def embed_condition(self, name: str, inputs: Dict[str, torch.Tensor], mapping: Sequence[str]) -> torch.Tensor:
        embedder = self._get(name)
        return embedder(**self._embedder_inputs(embedder, inputs, mapping))

    @staticmethod
    def latent_shapes(generator: torch.nn.Module, batch: int = 1) -> Dict[str, tuple]:
        backbone = generator.reverse_fn.backbone
        return {k: (batch, lm.token_len, lm.in_channels) for k, lm in backbone.latent_mapping.items()}

    def sample_sparse_structure(self, ss_input: Dict[str, torch.Tensor],
                                inference_steps: Optional[int] = None) -> Dict[str, Any]:
        with self._stage("ss_condition"):
            cond = self.embed_condition("ss_condition_embedder", ss_input, self.ss_condition_input_mapping)
            self._free("ss_condition_embedder")
        with self._stage("ss_sampling"), self._generator("ss_generator", inference_steps,
                                                         self.ss_inference_steps) as generator:
            with self._autocast(self.shape_model_dtype):
                latents = generator(self.latent_shapes(generator, cond.shape[0]), self.device, cond)
            latents = {k: v.float() for k, v in latents.items()}
        with self._stage("ss_decoding"):
            shape = latents["shape"]
            b, n, c = shape.shape
            res = round(n ** (1 / 3))
            grid = shape.permute(0, 2, 1).contiguous().view(b, c, res, res, res)
            decoder = self._get("ss_decoder")
            logits = decoder(grid.to(next(decoder.parameters()).dtype))
            coords = torch.argwhere(logits > 0)[:, [0, 2, 3, 4]].int()
            self._free("ss_decoder")
        out = dict(latents)
        out["coords_original"] = coords
        if self.downsample_ss_dist > 0:
            coords = prune_sparse_structure(coords, max_neighbor_axes_dist=self.downsample_ss_dist)
        coords, factor = downsample_sparse_structure(coords, max_coords=MAX_STAGE2_VOXELS)
        out["coords"], out["downsample_factor"] = coords, factor
        return out

    def pose_decode(self, ss_return: Dict[str, Any], ss_input: Optional[Dict[str, torch.Tensor]] = None):
        scene_scale = ss_input.get("pointmap_scale") if ss_input else None
        scene_shift = ss_input.get("pointmap_shift") if ss_input else None
        pose = self.pose_decoder(ss_return, scene_scale=scene_scale, scene_shift=scene_shift)
        pose["scale"] = pose["scale"] * ss_return["downsample_factor"]
        return pose

    # ----------------------------------------------------------------------------------------------------------
    # stage 2 and decoding
    # ----------------------------------------------------------------------------------------------------------
    def sample_slat(self, slat_input: Dict[str, torch.Tensor], coords: torch.Tensor,
                    inference_steps: Optional[int] = None):
        from sam3d_objects.model.backbone.tdfy_dit.modules.sparse import SparseTensor
        with self._stage("slat_condition"):
            cond = self.embed_condition("slat_condition_embedder", slat_input, self.slat_condition_input_mapping)
            self._free("slat_condition_embedder")
        with self._stage("slat_sampling"), self._generator("slat_generator", inference_steps,
                                                           self.slat_inference_steps) as generator:
            channels = generator.reverse_fn.backbone.in_channels
            with self._autocast(self.dtype):
                feats = generator((1, coords.shape[0], channels), self.device, cond, coords.cpu().numpy())
        feats = getattr(feats, "feats", feats).float()
        feats = feats.reshape(-1, feats.shape[-1])
        feats = feats * self.slat_std.to(feats) + self.slat_mean.to(feats)
        return SparseTensor(feats=feats, coords=coords.to(feats.device).int())

    def decode_slat(self, slat, formats: Sequence[str]) -> Dict[str, List[Any]]:
        outputs = {}
        for fmt, name in (("mesh", "slat_decoder_mesh"), ("gaussian", "slat_decoder_gs"),
                          ("gaussian_4", "slat_decoder_gs_4")):
            if fmt not in formats:
                continue
            with self._stage(f"decode_{fmt}"):
                decoder = self._get(name)
                outputs[fmt] = decoder(slat)
                self._free(name)
        return outputs

    @staticmethod
    def to_glb(mesh, use_vertex_color: bool = True):
        """trimesh.Trimesh: vertices rotated z-up -> y-up, vertex colours from the first 3 vertex attributes."""
        import trimesh
        vertices = torch.as_tensor(mesh.vertices).detach().float().cpu()
        faces = torch.as_tensor(mesh.faces).detach().cpu().numpy()
        vertices = (vertices @ Z_UP_TO_Y_UP).numpy()  # row vectors: (x, y, z) -> (x, z, -y)
        colors = None
        if use_vertex_color and getattr(mesh, "vertex_attrs", None) is not None:
            colors = torch.as_tensor(mesh.vertex_attrs)[:, :3].detach().float().cpu().clamp(0, 1).numpy()
        return trimesh.Trimesh(vertices=vertices, faces=faces, vertex_colors=colors, process=False)

    def postprocess_slat_output(self, outputs: Dict[str, List[Any]], with_mesh_postprocess: bool = False,
                                with_texture_baking: bool = False, use_vertex_color: bool = True):
        result = dict(outputs)
        if with_mesh_postprocess or with_texture_baking:
            logger.warning("mesh post-processing and texture baking are not implemented; exporting the raw mesh "
                           "with vertex colours")
        if "mesh" in outputs and outputs["mesh"]:
            result["glb"] = self.to_glb(outputs["mesh"][0], use_vertex_color=True)
        if "gaussian" in outputs and outputs["gaussian"]:
            result["gs"] = outputs["gaussian"][0]
        return result

    # ----------------------------------------------------------------------------------------------------------
    # run
    # ----------------------------------------------------------------------------------------------------------
    def get_condition_input(self, image, pointmap=None):
        ss_input = self.preprocess_image(image, self.ss_preprocessor)
        slat_input = self.preprocess_image(image, self.slat_preprocessor)
        return ss_input, slat_input, {}

    def run(self, image, mask=None, seed: Optional[int] = None, stage1_only: bool = False,
            with_mesh_postprocess: bool = True, with_texture_baking: bool = True,
            with_layout_postprocess: bool = True, use_vertex_color: bool = False,
            stage1_inference_steps: Optional[int] = None, pointmap=None,
            decode_formats: Optional[Sequence[str]] = None, stage2_inference_steps: Optional[int] = None
            ) -> Dict[str, Any]:
        """Image (+ mask, + optional point map) -> dict of outputs (upstream's keys).

        ``image``: RGB(A) uint8 [H, W, 3|4]; ``mask``: [H, W] (bool / 0-1 / 0-255), or None when the alpha channel
        is the mask. ``seed`` seeds torch right after preprocessing (the stage-1 noise, then the stage-2 noise).
        Returns ``shape``, ``6drotation_normalized``, ``translation_scale``, ``translation`` (1,3), ``rotation``
        (1,4 wxyz), ``scale`` (1,3), ``coords_original``, ``coords`` (int32 [N,4]), ``downsample_factor``,
        ``mesh`` / ``gaussian`` (lists), ``glb`` (trimesh, y-up, vertex colours), ``gs`` (the Gaussian) and, for
        the point-map pipeline, ``pointmap`` / ``pointmap_colors``. With ``stage1_only`` only the stage-1 part.

        Zero occupied voxels after stage 1 raise ``EmptyStructureError`` (nothing to decode); ``stage1_only=True``
        still returns the latents, pose and the empty ``coords``. Mesh post-processing and texture baking are
        not implemented (the flags only log a warning); layout post-optimisation is not supported.
        """
        self.stage_times = {}
        check_run_inputs(image, mask, pointmap)
        image = merge_mask_into_alpha(image, mask)
        with self._stage("preprocess"):
            ss_input, slat_input, extra = self.get_condition_input(image, pointmap)
        if seed is not None:
            torch.manual_seed(seed)
        with torch.no_grad():
            ss_return = self.sample_sparse_structure(ss_input, stage1_inference_steps)
            ss_return.update(self.pose_decode(ss_return, ss_input))
            ss_return.update(extra)
            if stage1_only:
                return ss_return
            coords = ss_return["coords"]
            if coords.shape[0] == 0:
                raise EmptyStructureError(
                    "stage 1 decoded no occupied voxel (all sparse-structure logits <= 0), so there is no shape "
                    "to refine. Try another seed or check the mask; run(stage1_only=True) returns the stage-1 "
                    "latents and pose for inspection.")
            slat = self.sample_slat(slat_input, coords, stage2_inference_steps)
            outputs = self.decode_slat(slat, decode_formats or self.decode_formats)
        outputs = self.postprocess_slat_output(outputs, with_mesh_postprocess, with_texture_baking,
                                               use_vertex_color)
        return {**ss_return, **outputs}
