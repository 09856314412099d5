"""Image + mask -> 3D object (Gaussians, mesh, GLB) and its pose: the two-stage SAM 3D Objects pipeline.

Stages of ``run``, in upstream's order: preprocessing -> stage-1 sampling (sparse structure + pose
latents) -> ss decoder -> voxel coords (prune / downsample) -> pose decoding -> stage-2 sampling (structured
latent) -> decoders (mesh, Gaussians) -> exports (GLB, Gaussian).

Models are described by the checkpoint folder's yamls and read with ``sam3d_objects.pipeline.checkpoint``
(weights-only, mmap, meta-device build). ``low_memory`` (default on for CPU/MPS, off for CUDA) loads each model
right before its stage and frees it afterwards (decoders one at a time), emptying the device cache in between.
"""
from __future__ import annotations

import gc
import importlib
import logging
import threading
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

import backends
from sam3d_objects.config.instantiate import load_config, safe_instantiate
from sam3d_objects.data.dataset.tdfy.preprocessor import apply_joint_transforms
from sam3d_objects.pipeline import checkpoint as ckpt
from sam3d_objects.pipeline.checkpoint import EMBEDDER_PREFIX, GENERATOR_PREFIX  # noqa: F401  (also read here)
from sam3d_objects.model.backbone.generator.cuda_graph import graphed_backbone
from sam3d_objects.model.backbone.tdfy_dit.modules.attention.context_cache import cached_condition
from sam3d_objects.model.backbone.tdfy_dit.modules.utils import set_torso_half_dtype, store_linear_weights_in
from sam3d_objects.pipeline.compile_utils import COMPILED_MODELS, compile_model_forward
from sam3d_objects.pipeline.inference_pipeline_models import LazyModuleDict
from sam3d_objects.pipeline.run_options import (DEFAULT_INFERENCE_STEPS, DEFAULT_SEED, NOISE_AUTO,
                                                NOISE_ON_DEVICE, RunOptions, resolve_noise_device)
from sam3d_objects.pipeline.weights import CONVERTED_MODELS, check_weights, converter, prepack_linear_weights
from sam3d_objects.validation import check_run_inputs
from sam3d_objects.pipeline.inference_utils import (downsample_sparse_structure, get_pose_decoder,
                                                   prune_sparse_structure)

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
MAX_STAGE2_VOXELS = 42000
Z_UP_TO_Y_UP = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, -1.0], [0.0, 1.0, 0.0]])
# upstream's keys of pipeline.models (a ModuleDict, None where the yaml names no model) and of
# pipeline.condition_embedders
MODEL_KEYS = ("ss_generator", "slat_generator", "ss_encoder", "ss_decoder", "slat_decoder_gs", "slat_decoder_gs_4",
              "slat_decoder_mesh")
EMBEDDER_KEYS = ("ss_condition_embedder", "slat_condition_embedder")
# the decoders: their ``use_fp16`` torsos compute in the half type the pipeline chooses (`decoder_half_dtype`)
DECODER_KEYS = ("ss_decoder", "slat_decoder_gs", "slat_decoder_gs_4", "slat_decoder_mesh")
WARMUP_IMAGE_SIDE = 512


def set_attention_backend() -> Dict[str, str]:
    """Upstream writes ATTN_BACKEND / SPARSE_ATTN_BACKEND = flash_attn into the environment on A100/H100/H200 GPUs.
    Here ``backends`` already picks the fastest attention per device and dtype (settable with
    ``backends.set_backend``), so this only reports the requested backends ("auto" = chosen per device and
    dtype when an op runs; ``python -m backends`` shows the resolution): {family: backend}."""
    choice = {family: backends.requested_backend(family) for family in ("sparse_conv", "sparse_attn", "attn", "norm")}
    logger.info("attention backends: %s", choice)
    return choice


def _default_slat_stat(name: str) -> List[float]:
    """Upstream's module constants inference_utils.SLAT_MEAN / SLAT_STD (the constructor's defaults)."""
    from sam3d_objects.pipeline import inference_utils
    value = getattr(inference_utils, name, None)
    if value is None:
        raise ValueError(f"slat_{name[5:].lower()} is required (pipeline.yaml lists it)")
    return list(torch.as_tensor(value).reshape(-1).tolist())


def _default_preprocessor() -> Optional[Callable]:
    """Upstream's default (preprocess_utils.get_default_preprocessor()) where that module exists here."""
    try:
        from sam3d_objects.pipeline.preprocess_utils import get_default_preprocessor
    except ImportError:
        return None
    return get_default_preprocessor()


def _decode_nothing(*_, **__) -> Dict[str, torch.Tensor]:
    """Upstream's "default" pose decoder: no pose (the pipeline then returns the raw stage-1 latents)."""
    return {}


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


SAMPLING_DTYPES = ("auto", "bfloat16", "float16", "float32")


def check_sampling_dtype(dtype: Optional[str]) -> Optional[str]:
    """The canonical name of a sampling dtype choice (``Inference(dtype=)``, ``--dtype``): None for "auto" (the
    yaml's), else "bfloat16" / "float16" / "float32" (aliases "bf16", "fp16", "fp32"); ValueError naming them."""
    if dtype is None or dtype == "auto":
        return None
    name = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(str(dtype), str(dtype))
    if name not in SAMPLING_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(SAMPLING_DTYPES)}")
    return name


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


# The mesh export's library (imported on first use): ~1.3 s of imports that a first run would otherwise wait for.
MESH_EXPORT_MODULES = ("trimesh",)


def has_module_hooks(module: torch.nn.Module) -> bool:
    """Whether a forward / forward-pre / backward hook is registered on ``module`` or any of its submodules
    (global hooks registered with ``torch.nn.modules.module.register_module_*`` are not counted)."""
    names = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    return any(getattr(m, name, None) for m in module.modules() for name in names)


def preload_modules(names: Sequence[str]) -> threading.Thread:
    """Imports ``names`` in a background thread, overlapping with model loading (torch's loaders release the GIL),
    so that the first run does not wait for them. A later ``import`` of a module still loading waits for it
    (Python's per-module import lock); a missing module is left for its user to report. Not a daemon thread: the
    interpreter's exit stops a daemon thread wherever it is, and one stopped inside a C++ extension's import
    aborts the process ("terminate called without an active exception", seen after a SIGTERM early in a run);
    the exit waits for the imports instead (about a second)."""
    def run() -> None:
        for name in names:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - the user of the module reports the error when it needs it
                pass
    thread = threading.Thread(target=run, name="sam3d-preload", daemon=False)
    thread.start()
    return thread


RESIDENT_MEMORY_FACTOR = 2.5


def low_memory_auto(device: torch.device, checkpoint_bytes: int) -> bool:
    """``low_memory="auto"``: off on CUDA; on for MPS (its memory is the GPU's too); on the CPU, off where the
    memory available now holds ``RESIDENT_MEMORY_FACTOR`` times the checkpoint files, so that a server keeps its
    models between objects and runs. Full size (10.9 GB of files), all models loaded: peak RSS 16.6 GiB in float32
    on the 2-core machine, 9.0 GiB with ``--dtype bfloat16`` on the 16-core host, whose `fast` preset then took
    49.6 s warm against 65.0 s reloading the models (3.4 GiB). Unknown available memory keeps it on."""
    if device.type == "cuda":
        return False
    if device.type != "cpu":
        return True
    available = backends.device.available_memory()
    return available is None or available < RESIDENT_MEMORY_FACTOR * checkpoint_bytes


class GeneratorSetting:
    """A per-stage sampler setting (``pipeline.ss_inference_steps`` ...): stored on the pipeline, written into
    the stage's generator when it loads and, if it is loaded, right away, so that setting the attribute changes
    the next run. A value set directly on the generator (``pipeline.models["ss_generator"].inference_steps``)
    is read back when a low-memory pipeline unloads it, so it survives the reload too."""

    def __init__(self, model: str, apply: Callable[[torch.nn.Module, Any], None],
                 read: Optional[Callable[[torch.nn.Module], Any]] = None):
        self.model, self.apply, self.read = model, apply, read

    def __set_name__(self, owner, name: str) -> None:
        self.slot = "_setting_" + name

    def __get__(self, pipeline, owner=None):
        if pipeline is None:
            return self
        return pipeline.__dict__[self.slot]

    def __set__(self, pipeline, value) -> None:
        pipeline.__dict__[self.slot] = value
        generator = pipeline._loaded_model(self.model)
        if generator is not None:
            self.apply(generator, value)

    def write(self, pipeline, generator: torch.nn.Module) -> None:
        self.apply(generator, pipeline.__dict__[self.slot])

    def read_back(self, pipeline, generator: torch.nn.Module) -> None:
        if self.read is not None:
            pipeline.__dict__[self.slot] = self.read(generator)


def _set_steps(generator, value):
    generator.inference_steps = value


def _set_rescale_t(generator, value):
    generator.rescale_t = value


def _set_interval(generator, value):
    generator.reverse_fn.interval = list(value)


def _set_strength(generator, value):
    generator.reverse_fn.strength = value


def _set_strength_pm(generator, value):
    generator.reverse_fn.strength_pm = value


class InferencePipeline:
    """Two-stage pipeline; constructor arguments are the keys of the released ``pipeline.yaml`` (upstream's
    names and defaults; ``device=None`` is the backends default device: cuda > mps > cpu).

    Extra (ours): ``low_memory`` ("auto" / None: :func:`low_memory_auto`: off for CUDA and for CPUs with room
    for every model, on for MPS and other CPUs) loads each model right before its stage and frees it afterwards;
    ``noise_device`` ("device" / None = upstream: the sampling noise comes from the
    random generator of the device the model runs on; "cpu" = drawn with the CPU generator and moved, so that a
    seed gives the same object on CPU, CUDA and MPS); ``weights`` ("default", "int8", "bf16"; read when each
    model loads) stores the large transformers' linear weights in int8 or bf16 (``sam3d_objects.pipeline.weights``).
    ``compile_model`` compiles the dense models with
    ``torch.compile`` where the device supports it (one warning and eager execution elsewhere).
    ``cuda_graphs`` (attribute, default True): stage-1 and stage-2 backbone calls replay CUDA graphs on CUDA (set
    False for eager execution; off CUDA it changes nothing). Stage 1's graphs are kept for the next run (its
    shapes never change); stage 2's are freed after each run.
    ``half_weights`` (attribute, default True; read when the stage-1 generator loads): where stage 1 samples
    under half-precision autocast (CUDA), its flow backbone's Linear weights are stored in that dtype, the values
    autocast would compute from them at every call (same results, ~2 GB less memory, no per-call casts).
    ``prepack_weights`` (attribute, default True): where both stages sample in bfloat16 on a CPU with bf16 matmul
    hardware and the models stay loaded, the generators' per-step linear layers keep a copy of their bf16 weights
    laid out for oneDNN (``weights.prepack_linear_weights``; products within one bf16 rounding, 20-29 % faster
    GEMMs, 3-4 % faster sampling; 2.3 GiB more peak memory at full size). Low-memory mode and ``compile_model``
    (whose graphs take the plain weights) do not.
    ``reuse_host_memory`` (attribute, default True): where the models stay loaded on the CPU, a run first lets the
    C allocator keep freed tensors of up to 32 MiB for reuse (``backends.device.keep_freed_host_memory``: glibc,
    process-wide; no page faults for every op's activations: 4.6 % faster default settings at 16 threads) and returns
    the free pages to the system when it ends. Same outputs; low-memory mode keeps glibc's defaults.
    """

    cuda_graphs: bool = True
    half_weights: bool = True
    prepack_weights: bool = True
    reuse_host_memory: bool = True

    # upstream's per-stage settings (constructor arguments); setting one changes the next run
    ss_inference_steps = GeneratorSetting("ss_generator", _set_steps, lambda g: g.inference_steps)
    ss_rescale_t = GeneratorSetting("ss_generator", _set_rescale_t, lambda g: g.rescale_t)
    ss_cfg_interval = GeneratorSetting("ss_generator", _set_interval, lambda g: list(g.reverse_fn.interval))
    ss_cfg_strength = GeneratorSetting("ss_generator", _set_strength)  # re-applied at every run (upstream)
    ss_cfg_strength_pm = GeneratorSetting("ss_generator", _set_strength_pm)
    slat_inference_steps = GeneratorSetting("slat_generator", _set_steps, lambda g: g.inference_steps)
    slat_rescale_t = GeneratorSetting("slat_generator", _set_rescale_t, lambda g: g.rescale_t)
    slat_cfg_interval = GeneratorSetting("slat_generator", _set_interval, lambda g: list(g.reverse_fn.interval))
    slat_cfg_strength = GeneratorSetting("slat_generator", _set_strength)

    def __init__(self, ss_generator_config_path: str, ss_generator_ckpt_path: str,
                 slat_generator_config_path: str, slat_generator_ckpt_path: str,
                 ss_decoder_config_path: str, ss_decoder_ckpt_path: str,
                 slat_decoder_gs_config_path: Optional[str] = None, slat_decoder_gs_ckpt_path: Optional[str] = None,
                 slat_decoder_mesh_config_path: Optional[str] = None,
                 slat_decoder_mesh_ckpt_path: Optional[str] = None,
                 slat_decoder_gs_4_config_path: Optional[str] = None,
                 slat_decoder_gs_4_ckpt_path: Optional[str] = None,
                 ss_encoder_config_path: Optional[str] = None, ss_encoder_ckpt_path: Optional[str] = None,
                 decode_formats: Sequence[str] = ["gaussian", "mesh"],  # noqa: B006  upstream's default, copied
                 dtype: Union[str, torch.dtype] = "bfloat16", pad_size: float = 1.0, version: str = "v0",
                 device: Union[str, torch.device, None] = None,
                 ss_preprocessor: Optional[Callable] = None, slat_preprocessor: Optional[Callable] = None,
                 ss_condition_input_mapping: Sequence[str] = ["image"],  # noqa: B006
                 slat_condition_input_mapping: Sequence[str] = ["image"],  # noqa: B006
                 pose_decoder_name: Optional[str] = "default", workspace_dir: str = "",
                 downsample_ss_dist: int = 0,
                 ss_inference_steps: int = DEFAULT_INFERENCE_STEPS, ss_rescale_t: float = 3,
                 ss_cfg_strength: float = 7,
                 ss_cfg_interval: Sequence[float] = [0, 500], ss_cfg_strength_pm: float = 0.0,  # noqa: B006
                 slat_inference_steps: int = DEFAULT_INFERENCE_STEPS, slat_rescale_t: float = 3,
                 slat_cfg_strength: float = 5,
                 slat_cfg_interval: Sequence[float] = [0, 500],  # noqa: B006
                 rendering_engine: str = "nvdiffrast", shape_model_dtype: Union[str, torch.dtype, None] = None,
                 compile_model: bool = False, slat_mean: Optional[Sequence[float]] = None,
                 slat_std: Optional[Sequence[float]] = None, low_memory: Union[bool, str, None] = "auto",
                 noise_device: Optional[str] = "device", weights: Optional[str] = "default"):
        self.device = backends.device.as_device(device)
        self.weights = check_weights(weights)
        self.dtype = self._get_dtype(dtype)
        self.shape_model_dtype = self._get_dtype(shape_model_dtype) if shape_model_dtype is not None else self.dtype
        self._warn_if_half_is_emulated()
        if self.weights == "default" and self._samples_in_cpu_bfloat16():
            # autocast computes the linears from their weights cast to bfloat16: storing them so gives the same
            # outputs (bit for bit) with half their memory, converted layer by layer as they load
            self.weights = "bf16"
        auto_low_memory = low_memory is None or low_memory == "auto"  # decided once the checkpoint files are known
        self.workspace_dir = Path(workspace_dir) if workspace_dir else Path(".")
        self.decode_formats = list(decode_formats)
        self.pad_size = pad_size  # stored as upstream does; upstream's pipeline reads neither
        self.version = version
        self.ss_preprocessor = ss_preprocessor if ss_preprocessor is not None else _default_preprocessor()
        self.slat_preprocessor = slat_preprocessor if slat_preprocessor is not None else _default_preprocessor()
        self.ss_condition_input_mapping = list(ss_condition_input_mapping or [])
        self.slat_condition_input_mapping = list(slat_condition_input_mapping or [])
        self.pose_decoder_name = pose_decoder_name
        self.pose_decoder = self.init_pose_decoder(ss_generator_config_path, pose_decoder_name)
        self.downsample_ss_dist = downsample_ss_dist
        self.ss_inference_steps = ss_inference_steps
        self.ss_rescale_t = ss_rescale_t
        self.ss_cfg_strength = ss_cfg_strength
        self.ss_cfg_interval = list(ss_cfg_interval)
        self.ss_cfg_strength_pm = ss_cfg_strength_pm
        self.slat_inference_steps = slat_inference_steps
        self.slat_rescale_t = slat_rescale_t
        self.slat_cfg_strength = slat_cfg_strength
        self.slat_cfg_interval = list(slat_cfg_interval)
        self.rendering_engine = rendering_engine
        self.compile_model = bool(compile_model)
        self.noise_device = resolve_noise_device(noise_device, NOISE_ON_DEVICE)  # "auto" / None: upstream's
        slat_mean = _default_slat_stat("SLAT_MEAN") if slat_mean is None else slat_mean
        slat_std = _default_slat_stat("SLAT_STD") if slat_std is None else slat_std
        self.slat_mean = torch.tensor(list(slat_mean), dtype=torch.float32)
        self.slat_std = torch.tensor(list(slat_std), dtype=torch.float32)
        self.stage_times: Dict[str, float] = {}
        self.stage_hook: Optional[Callable[[str, str], None]] = None  # (stage, "start"|"end"), for benchmarks

        self._loaders: Dict[str, Callable[[], torch.nn.Module]] = {}
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
            "ss_encoder": (ss_encoder_config_path, ss_encoder_ckpt_path, None, None),
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
        self.low_memory = (low_memory_auto(self.device, self.checkpoint_bytes()) if auto_low_memory
                           else bool(low_memory))
        if "slat_decoder_mesh" in self._loaders:
            preload_modules(MESH_EXPORT_MODULES)
        # upstream's containers, all keys in every mode; entries load on first access (see
        # inference_pipeline_models for what survives a low-memory unload)
        self.models = LazyModuleDict({k: self._container_loader(k) for k in MODEL_KEYS},
                                     on_load=self._apply_overrides, on_unload=self._read_back_settings)
        self.condition_embedders = LazyModuleDict({k: self._container_loader(k) for k in EMBEDDER_KEYS},
                                                  on_load=self._apply_overrides)
        if not self.low_memory:
            for name in self._loaders:
                self._get(name)

    # ----------------------------------------------------------------------------------------------------------
    # model loading
    # ----------------------------------------------------------------------------------------------------------
    def _path(self, p: str) -> Path:
        p = Path(p)
        return p if p.is_absolute() else self.workspace_dir / p

    def checkpoint_bytes(self) -> int:
        """Bytes of the checkpoint files this pipeline loads (each file once)."""
        files = {p for loader in self._loaders.values() for p in loader.paths if p.suffix != ".yaml"}
        return sum(p.stat().st_size for p in files)

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
            convert = converter(self.weights) if name in CONVERTED_MODELS else None
            return ckpt.load_model(lambda: self._with_half_dtype(name, safe_instantiate(config)), ckpt_file,
                                   device=self.device, state_dict_key="state_dict" if prefix else None,
                                   prefix=prefix, convert=convert)

        load.paths = [config_file, ckpt_file]
        load.build_config = build_config
        return load

    def _container_loader(self, name: str) -> Optional[Callable[[], torch.nn.Module]]:
        """The loader behind ``models[name]`` / ``condition_embedders[name]`` (None: the yaml names no such
        model)."""
        if name not in self._loaders:
            return None

        def load() -> torch.nn.Module:
            if self.low_memory:
                # what the run freed since the last unload (e.g. the previous run's post-processing) would
                # otherwise stay resident under this model's weights
                backends.device.release_host_memory()
            with rng_preserved(self.device):  # lazy (low-memory) loading must not shift the seeded noise
                return self._loaders[name]()
        return load

    def _container(self, name: str) -> LazyModuleDict:
        return self.condition_embedders if name in EMBEDDER_KEYS else self.models

    def _loaded_model(self, name: str) -> Optional[torch.nn.Module]:
        """The model ``name`` if it is loaded right now (None otherwise, also during construction)."""
        container = self.__dict__.get("condition_embedders" if name in EMBEDDER_KEYS else "models")
        return container.loaded().get(name) if container is not None else None

    def _get(self, name: str) -> torch.nn.Module:
        """The model ``name`` (loaded now if needed): what ``models[name]`` / ``condition_embedders[name]``
        return."""
        container = self._container(name)
        if name not in container or not container.has_model(name):
            raise ValueError(f"the pipeline has no {name} (its config/checkpoint paths were not given)")
        return container.load(name)

    def _free(self, *names: str) -> None:
        """Low-memory mode: unload the models ``names`` (their hooks wait for the next load). The caller drops
        its own references first, otherwise the model (weights and per-model caches) outlives this call."""
        if not self.low_memory:
            return
        for name in names:
            self._container(name).unload(name)
        gc.collect()
        backends.device.empty_cache(self.device)
        # the stage's freed CPU tensors stay resident in the C allocator's arenas otherwise, and carry into the
        # next stage's and the next run's peak RSS
        backends.device.release_host_memory()

    def loaded_models(self) -> Dict[str, torch.nn.Module]:
        """{name: model} of the models (condition embedders included) loaded right now: all of them unless
        ``low_memory``."""
        return {**self.models.loaded(), **self.condition_embedders.loaded()}

    def _settings_of(self, name: str) -> List[GeneratorSetting]:
        prefix = {"ss_generator": "ss_", "slat_generator": "slat_"}.get(name)
        if prefix is None:
            return []
        return [v for k, v in vars(InferencePipeline).items()
                if isinstance(v, GeneratorSetting) and k.startswith(prefix)]

    def _read_back_settings(self, name: str, model: torch.nn.Module) -> None:
        """Before a low-memory unload: settings changed on the generator itself survive the reload."""
        for setting in self._settings_of(name):
            setting.read_back(self, model)

    def _apply_overrides(self, name: str, model: torch.nn.Module) -> None:
        """The pipeline's sampler settings replace the generator yaml's (as upstream does after loading); with
        ``compile_model`` the dense models are compiled."""
        if name == "ss_generator":
            self.override_ss_generator_cfg_config(model, cfg_strength=self.ss_cfg_strength,
                                                  inference_steps=self.ss_inference_steps,
                                                  rescale_t=self.ss_rescale_t, cfg_interval=self.ss_cfg_interval,
                                                  cfg_strength_pm=self.ss_cfg_strength_pm)
            model.no_shortcut = True
            if self.half_weights and self._autocast_enabled(self.shape_model_dtype):
                store_linear_weights_in(model.reverse_fn.backbone, self.shape_model_dtype)
        elif name == "slat_generator":
            self.override_slat_generator_cfg_config(model, cfg_strength=self.slat_cfg_strength,
                                                    inference_steps=self.slat_inference_steps,
                                                    rescale_t=self.slat_rescale_t,
                                                    cfg_interval=self.slat_cfg_interval)
        if self.compile_model:
            self._compile_model(name, model)

    def _compile_model(self, name: str, model: torch.nn.Module) -> None:
        """torch.compile the dense models (a no-op for the others and for a model compiled already)."""
        if name in COMPILED_MODELS:
            compile_model_forward(model if name != "ss_generator" else model.reverse_fn.backbone, self.device,
                                  name)

    @staticmethod
    def _get_dtype(dtype: Union[str, torch.dtype, None]) -> torch.dtype:
        """Upstream's dtype names ("bfloat16", "float16", "float32"; also "bf16" / "fp16" / "fp32" and torch
        dtypes here) -> torch.dtype."""
        return as_dtype(dtype)

    def _compile(self) -> None:
        """Upstream's compile step: turn on ``compile_model``, compile the dense models loaded now (the others
        are compiled when they load), then warm up (``_warmup``)."""
        self.compile_model = True
        for name, model in self.loaded_models().items():
            self._compile_model(name, model)
        self._warmup()

    def _warmup_image(self) -> np.ndarray:
        """Upstream's warm-up input: random RGB noise, fully opaque (the whole image is the object)."""
        image = np.full((WARMUP_IMAGE_SIDE, WARMUP_IMAGE_SIDE, 4), 255, dtype=np.uint8)
        image[..., :3] = np.random.randint(0, 255, (WARMUP_IMAGE_SIDE, WARMUP_IMAGE_SIDE, 3), dtype=np.uint8)
        return self.merge_image_and_mask(image, None)

    def _warmup(self, num_warmup_iters: int = 3):
        """Run both sampling stages ``num_warmup_iters`` times on a random image (compiled graphs and caches
        are built before the first real run). The torch random state is put back afterwards."""
        from tqdm.auto import tqdm
        image = self._warmup_image()
        with rng_preserved(self.device), torch.no_grad():
            for _ in tqdm(range(num_warmup_iters), desc="warm-up"):
                ss_input_dict = self.preprocess_image(image, self.ss_preprocessor)
                slat_input_dict = self.preprocess_image(image, self.slat_preprocessor)
                ss_return_dict = self.sample_sparse_structure(ss_input_dict)
                coords = ss_return_dict["coords"]
                if coords.shape[0]:
                    self.sample_slat(slat_input_dict, coords)

    def override_ss_generator_cfg_config(self, ss_generator: torch.nn.Module, cfg_strength: float = 7,
                                         inference_steps: int = DEFAULT_INFERENCE_STEPS, rescale_t: float = 3,
                                         cfg_interval: Sequence[float] = [0, 500],  # noqa: B006
                                         cfg_strength_pm: float = 0.0) -> None:
        """Stage-1 sampler settings (steps, time warp, guidance strength / interval / point-map strength).
        Upstream also sets ``unconditional_handling = "add_flag"``, which the released yaml already has (our
        guidance wrapper fixes its unconditional call at construction)."""
        self.override_slat_generator_cfg_config(ss_generator, cfg_strength, inference_steps, rescale_t,
                                                cfg_interval)
        ss_generator.reverse_fn.strength_pm = cfg_strength_pm

    def override_slat_generator_cfg_config(self, slat_generator: torch.nn.Module, cfg_strength: float = 5,
                                           inference_steps: int = DEFAULT_INFERENCE_STEPS, rescale_t: float = 3,
                                           cfg_interval: Sequence[float] = [0, 500]  # noqa: B006
                                           ) -> None:
        slat_generator.inference_steps = inference_steps
        slat_generator.rescale_t = rescale_t
        slat_generator.reverse_fn.strength = cfg_strength
        slat_generator.reverse_fn.interval = list(cfg_interval)

    # upstream's per-model loaders (used by research code; the pipeline itself loads lazily through _get) -------
    def instantiate_and_load_from_pretrained(self, config, ckpt_path, state_dict_fn: Optional[Callable] = None,
                                             state_dict_key: Optional[str] = "state_dict",
                                             device: Union[str, torch.device, None] = None) -> torch.nn.Module:
        """Build ``config`` (hydra node, allow-listed targets) and fill it from ``ckpt_path`` (weights only, via
        the safe loader); ``state_dict_fn`` maps the state dict first (e.g. a key-prefix filter)."""
        state = ckpt.read_checkpoint(self._path(ckpt_path))
        if state_dict_key and isinstance(state, dict) and state_dict_key in state:
            state = state[state_dict_key]
        if state_dict_fn is not None:
            state = state_dict_fn(state)
        device = self.device if device is None else backends.device.as_device(device)
        model = ckpt.load_model(lambda: safe_instantiate(config), state, device=device)
        return model.eval()

    def _load_node(self, name: str, config_path: Optional[str], ckpt_path: Optional[str],
                   node: Optional[str], prefix: Optional[str]) -> Optional[torch.nn.Module]:
        if not config_path or not ckpt_path:
            return None
        if node is not None and OmegaConf.select(load_config(self._path(config_path)), node) is None:
            return None  # e.g. a generator yaml without a condition embedder
        with rng_preserved(self.device):
            model = self._make_loader(name, config_path, ckpt_path, node, prefix)()
        self._apply_overrides(name, model)
        return model

    def init_pose_decoder(self, ss_generator_config_path, pose_decoder_name) -> Callable:
        """``pose_decoder_name`` None: the ss generator yaml's ``module.pose_target_convention``."""
        if pose_decoder_name is None:
            config = load_config(self._path(ss_generator_config_path))
            pose_decoder_name = OmegaConf.select(config, "module.pose_target_convention")
        if pose_decoder_name == "default":
            from sam3d_objects.pipeline import inference_utils
            return getattr(inference_utils, "POSE_DECODERS", {}).get("default", _decode_nothing)
        return get_pose_decoder(pose_decoder_name)

    def init_ss_preprocessor(self, ss_preprocessor, ss_generator_config_path):
        """The given preprocessor, else the ss generator yaml's ``tdfy.val_preprocessor``."""
        if ss_preprocessor is not None:
            return ss_preprocessor
        node = OmegaConf.select(load_config(self._path(ss_generator_config_path)), "tdfy.val_preprocessor")
        if node is None:
            raise ValueError(f"{ss_generator_config_path} has no tdfy.val_preprocessor; pass ss_preprocessor")
        return safe_instantiate(node)

    def init_ss_generator(self, ss_generator_config_path, ss_generator_ckpt_path):
        return self._load_node("ss_generator", ss_generator_config_path, ss_generator_ckpt_path,
                               "module.generator.backbone", GENERATOR_PREFIX)

    def init_slat_generator(self, slat_generator_config_path, slat_generator_ckpt_path):
        return self._load_node("slat_generator", slat_generator_config_path, slat_generator_ckpt_path,
                               "module.generator.backbone", GENERATOR_PREFIX)

    def init_ss_encoder(self, ss_encoder_config_path, ss_encoder_ckpt_path):
        return self._load_node("ss_encoder", ss_encoder_config_path, ss_encoder_ckpt_path, None, None)

    def init_ss_decoder(self, ss_decoder_config_path, ss_decoder_ckpt_path):
        return self._load_node("ss_decoder", ss_decoder_config_path, ss_decoder_ckpt_path, None, None)

    def init_slat_decoder_gs(self, slat_decoder_gs_config_path, slat_decoder_gs_ckpt_path):
        return self._load_node("slat_decoder_gs", slat_decoder_gs_config_path, slat_decoder_gs_ckpt_path, None,
                               None)

    def init_slat_decoder_mesh(self, slat_decoder_mesh_config_path, slat_decoder_mesh_ckpt_path):
        return self._load_node("slat_decoder_mesh", slat_decoder_mesh_config_path, slat_decoder_mesh_ckpt_path,
                               None, None)

    def init_ss_condition_embedder(self, ss_generator_config_path, ss_generator_ckpt_path):
        return self._load_node("ss_condition_embedder", ss_generator_config_path, ss_generator_ckpt_path,
                               "module.condition_embedder.backbone", EMBEDDER_PREFIX)

    def init_slat_condition_embedder(self, slat_generator_config_path, slat_generator_ckpt_path):
        return self._load_node("slat_condition_embedder", slat_generator_config_path, slat_generator_ckpt_path,
                               "module.condition_embedder.backbone", EMBEDDER_PREFIX)

    def is_mm_dit(self, model_name: str = "ss_generator") -> bool:
        """Whether the generator's backbone is a multi-modal (mixture-of-transformers) one with latent_mapping."""
        return hasattr(self._get(model_name).reverse_fn.backbone, "latent_mapping")

    def _noise_device(self, options: RunOptions) -> str:
        """Where this run draws its noise: the run's ``noise_device``, else the pipeline's (canonical values)."""
        return resolve_noise_device(options.noise_device, self.noise_device)

    def _noise_generator(self, options: RunOptions) -> Optional[torch.Generator]:
        """The run's random generator: seeded with ``options.seed`` on the device its noise is drawn on (None
        without a seed: the global generator, as upstream)."""
        noise_device = self._noise_device(options)
        return options.generator(self.device if noise_device == NOISE_ON_DEVICE else noise_device)

    def _generator(self, name: str, inference_steps: Optional[int] = None, configured_steps: Optional[int] = None,
                   use_distillation: bool = False, noise_device: Optional[str] = NOISE_AUTO):
        """``_sampler`` for one stage's settings given one by one (the older form of this helper; the
        ``configured_steps`` it took are held by the generator itself, see ``GeneratorSetting``)."""
        first = name == "ss_generator"
        stage = {"stage1_inference_steps" if first else "stage2_inference_steps": inference_steps,
                 "use_stage1_distillation" if first else "use_stage2_distillation": use_distillation}
        return self._sampler(name, RunOptions(seed=None, noise_device=noise_device, **stage))

    @contextmanager
    def _sampler(self, name: str, options: RunOptions, rng: Optional[torch.Generator] = None):
        """The flow generator `name` set up for one call from the run's ``options`` and put back afterwards (also
        on errors); freed after a successful run in low-memory mode.

        ``options.stage1_inference_steps`` / ``stage2_inference_steps`` (truthy) override the step count (the
        generator itself holds the pipeline's setting, see ``GeneratorSetting``). ``use_stage1_distillation`` /
        ``use_stage2_distillation`` are upstream's fast mode: a shortcut generator steps with d = 1/steps
        (``no_shortcut=False``) and guidance is off (strength 0, and strength_pm 0). The initial noise is drawn
        with ``rng`` (the run's seeded generator), else with the global generator of the run's noise device."""
        generator = self._get(name)
        guidance = generator.reverse_fn
        # upstream puts back the generator's own step count (set from the pipeline's at load or by the caller)
        saved = {"inference_steps": generator.inference_steps,
                 "no_shortcut": getattr(generator, "no_shortcut", None),
                 "noise_device": getattr(generator, "noise_device", None),
                 "noise_generator": getattr(generator, "noise_generator", None),
                 "strength": guidance.strength, "strength_pm": getattr(guidance, "strength_pm", None)}
        inference_steps = options.inference_steps(name)
        if inference_steps:
            generator.inference_steps = inference_steps
        if options.use_distillation(name):
            if saved["no_shortcut"] is not None:
                generator.no_shortcut = False
            guidance.strength = 0.0
            if saved["strength_pm"] is not None:
                guidance.strength_pm = 0.0
        else:  # upstream reads the guidance strengths from the pipeline at every run
            guidance.strength = self.ss_cfg_strength if name == "ss_generator" else self.slat_cfg_strength
            if name == "ss_generator" and saved["strength_pm"] is not None:
                guidance.strength_pm = self.ss_cfg_strength_pm
        noise_device = self._noise_device(options)
        generator.noise_device = None if noise_device == NOISE_ON_DEVICE else noise_device
        generator.noise_generator = rng
        try:
            yield generator
        finally:
            for key in ("inference_steps", "no_shortcut", "noise_device", "noise_generator"):
                if saved[key] is not None or key in ("noise_device", "noise_generator"):
                    setattr(generator, key, saved[key])
            guidance.strength = saved["strength"]
            if saved["strength_pm"] is not None:
                guidance.strength_pm = saved["strength_pm"]
        del generator, guidance  # the caller has dropped its reference: now _free really frees the model
        self._free(name)

    def _graphs_allowed(self, generator: torch.nn.Module) -> bool:
        """CUDA graphs for this generator's backbone calls: ``cuda_graphs``, unless a hook sits on the backbone or
        one of its submodules (a replayed graph runs no Python, so the hook would not fire on later steps)."""
        return self.cuda_graphs and not has_module_hooks(generator.reverse_fn.backbone)

    def _condition_cache(self, generator: torch.nn.Module):
        """The sampling run's reuse of the condition's key / value projections (``context_cache``): off the GPU
        (there the projection is inside the captured graphs) where the models are kept loaded (the projections
        cost memory: 0.74 GB for stage 1 in bfloat16, which low-memory mode does not spend), and with no hook on
        the backbone (a reused projection would not run a hook on ``to_kv`` again)."""
        backbone = generator.reverse_fn.backbone
        return cached_condition(backbone, enabled=self.device.type != "cuda" and not self.low_memory
                                and not has_module_hooks(backbone))

    def _prepack(self, generator: torch.nn.Module) -> None:
        """The generator's packed weight copies (``prepack_weights``, see the class docstring): made at its first
        sampling run and kept with the loaded model (later runs reuse them)."""
        if self.prepack_weights and not self.low_memory and not self.compile_model \
                and self._samples_in_cpu_bfloat16():
            prepack_linear_weights(generator.reverse_fn.backbone)

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

    def _warn_if_half_is_emulated(self) -> None:
        """bfloat16 sampling on a CPU without AVX-512 BF16 / AMX runs, but slower than float32: say so once."""
        wanted = {d for d in (self.dtype, self.shape_model_dtype) if self._autocast_enabled(d)}
        if torch.bfloat16 in wanted and not backends.device.bf16_fast(self.device):
            warnings.warn(f"dtype bfloat16 on {self.device}: this device has no bfloat16 matmul hardware (AVX-512 "
                          "BF16 / AMX on CPUs), so sampling in bfloat16 is slower than in float32; use dtype "
                          "float32 (or --dtype auto)", stacklevel=3)

    def _samples_in_cpu_bfloat16(self) -> bool:
        """Whether both stages (conditions and sampling) run under CPU bfloat16 autocast here."""
        return self.device.type == "cpu" and all(
            d == torch.bfloat16 and self._autocast_enabled(d) for d in (self.dtype, self.shape_model_dtype))

    def decoder_half_dtype(self) -> Optional[torch.dtype]:
        """The half type the decoders' ``use_fp16`` torsos compute in, where the pipeline chooses one: bfloat16
        when both stages sample in CPU bfloat16 (the CPU's half type; output layers, norms and mesh extraction
        stay float32), else None: the models' own rule (float16 where the device runs it well, i.e. upstream's
        CUDA path, float32 on the CPU)."""
        return torch.bfloat16 if self._samples_in_cpu_bfloat16() else None

    def _with_half_dtype(self, name: str, model: torch.nn.Module) -> torch.nn.Module:
        """A decoder just built (before its weights load, so its torso is cast once): its half type set."""
        half = self.decoder_half_dtype() if name in DECODER_KEYS else None
        if half is not None:
            set_torso_half_dtype(model, half)
        return model

    def _autocast_enabled(self, dtype: torch.dtype) -> bool:
        return dtype != torch.float32 and backends.device.half_supported(self.device, dtype)

    def _autocast(self, dtype: torch.dtype):
        """Upstream samples under fp16 autocast on CUDA (pipeline.yaml dtype); where half precision is slow or
        unsupported (CPU fp16, MPS autocast) sampling stays float32."""
        return backends.device.autocast(self.device.type, dtype, enabled=self._autocast_enabled(dtype))

    # ----------------------------------------------------------------------------------------------------------
    # preprocessing
    # ----------------------------------------------------------------------------------------------------------
    @staticmethod
    def image_to_tensors(image: np.ndarray):
        """RGBA uint8 [H, W, 4] -> rgb [3, H, W] and alpha [1, H, W], float32 in [0, 1]."""
        rgba = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1).float() / 255.0
        return rgba[:3], rgba[3:4]

    def image_to_float(self, image) -> np.ndarray:
        """uint8 image -> float32 array in [0, 1]."""
        return (np.asarray(image) / 255.0).astype(np.float32)

    def merge_image_and_mask(self, image, mask) -> np.ndarray:
        """RGBA uint8: the mask becomes the alpha channel (None: the image's own alpha). Upstream copies a 0/1
        mask unscaled; here it is scaled to 0/255 so the result is a viewable image; both select alpha > 0."""
        return merge_mask_into_alpha(image, mask)

    def _mask_from_alpha(self, alpha: torch.Tensor) -> torch.Tensor:
        return (alpha > 0.5).float()

    def _apply_transform(self, input: Optional[torch.Tensor], transform: Callable):  # noqa: A002 upstream's name
        """``transform(input)``, None stays None (upstream's helper)."""
        return transform(input) if input is not None else input

    def _preprocess_image_and_mask(self, rgb_image: torch.Tensor, mask_image: torch.Tensor,
                                   img_mask_joint_transform: Sequence[Callable]):
        """(image, mask) through the preprocessor's joint transforms in turn (e.g. the crop around the mask):
        the step ``PreProcessor`` runs first."""
        return tuple(apply_joint_transforms(img_mask_joint_transform, rgb_image, mask_image))

    def preprocess_image(self, image, preprocessor: Callable) -> Dict[str, torch.Tensor]:
        """RGBA image -> batched condition inputs on ``self.device``."""
        return self._preprocess(image, preprocessor, None)

    def _preprocess(self, image, preprocessor: Callable, pointmap: Optional[torch.Tensor]
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
    # conditioning
    # ----------------------------------------------------------------------------------------------------------
    def map_input_keys(self, item: Dict[str, Any], condition_input_mapping: Sequence[str]) -> List[Any]:
        return [item[k] for k in condition_input_mapping]

    def embed_condition(self, condition_embedder, *args, **kwargs):
        """(tokens, None, None) when an embedder is given, else (None, args, kwargs) for a generator that takes
        the raw inputs (upstream's contract)."""
        if condition_embedder is not None:
            return condition_embedder(*args, **kwargs), None, None
        return None, args, kwargs

    def get_condition_input(self, condition_embedder, input_dict: Dict[str, Any], input_mapping: Sequence[str]):
        """(args, kwargs) for the generator: the mapped inputs positionally and the rest by name, or
        ((tokens,), {}) when ``condition_embedder`` embeds them."""
        args = self.map_input_keys(input_dict, input_mapping)
        kwargs = {k: v for k, v in input_dict.items() if k not in input_mapping}
        tokens, args, kwargs = self.embed_condition(condition_embedder, *args, **kwargs)
        if tokens is not None:
            return (tokens,), {}
        return tuple(args), kwargs

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

    def _embed(self, name: str, inputs: Dict[str, torch.Tensor], mapping: Sequence[str]) -> torch.Tensor:
        """Condition tokens of the pipeline's embedder ``name``; the inputs it needs are found by name (the
        embedder's own list when the yaml's mapping is empty, as in the released one)."""
        embedder = self._get(name)
        return embedder(**self._embedder_inputs(embedder, inputs, mapping))

    def _prepare_condition_inputs(self, image, pointmap=None):
        """(stage-1 inputs, stage-2 inputs, extra outputs) from the RGBA image."""
        ss_input = self.preprocess_image(image, self.ss_preprocessor)
        slat_input = self.preprocess_image(image, self.slat_preprocessor)
        return ss_input, slat_input, {}

    # ----------------------------------------------------------------------------------------------------------
    # stage 1
    # ----------------------------------------------------------------------------------------------------------
    @staticmethod
    def latent_shapes(generator: torch.nn.Module, batch: int = 1) -> Dict[str, tuple]:
        backbone = generator.reverse_fn.backbone
        return {k: (batch, lm.token_len, lm.in_channels) for k, lm in backbone.latent_mapping.items()}

    def sample_sparse_structure(self, ss_input_dict: Dict[str, torch.Tensor],
                                inference_steps: Optional[int] = None, use_distillation: bool = False,
                                noise_device: str = NOISE_AUTO) -> Dict[str, Any]:
        """Stage 1: latents (shape + pose), the decoded occupancy and the voxel coords for stage 2.
        ``use_distillation``: upstream's fast mode (shortcut steps d = 1/steps, no guidance). The noise comes from
        the global generator (``run`` seeds its own)."""
        options = RunOptions(seed=None, stage1_inference_steps=inference_steps,
                             use_stage1_distillation=use_distillation, noise_device=noise_device)
        return self._sample_sparse_structure(ss_input_dict, options)

    def _sample_sparse_structure(self, ss_input_dict: Dict[str, torch.Tensor], options: RunOptions,
                                 rng: Optional[torch.Generator] = None) -> Dict[str, Any]:
        """``sample_sparse_structure`` with the run's ``options`` and its seeded generator ``rng``."""
        # upstream embeds the condition inside the sampling autocast (fp16 DINO on CUDA), so does this
        with self._stage("ss_condition"), self._autocast(self.shape_model_dtype):
            cond = self._embed("ss_condition_embedder", ss_input_dict, self.ss_condition_input_mapping)
            self._free("ss_condition_embedder")
        with self._stage("ss_sampling"), self._sampler("ss_generator", options, rng) as generator:
            self._prepack(generator)
            # dense stage: every backbone call after the first of its kind replays a CUDA graph (on CUDA only)
            with self._autocast(self.shape_model_dtype), graphed_backbone(generator.reverse_fn,
                                                                          self._graphs_allowed(generator),
                                                                          keep=True), self._condition_cache(generator):
                latents = generator(self.latent_shapes(generator, cond.shape[0]), self.device, cond)
            latents = {k: v.float() for k, v in latents.items()}
            del generator  # freed on leaving the block (low-memory), not only when this method returns
        with self._stage("ss_decoding"):
            shape = latents["shape"]
            b, n, c = shape.shape
            res = round(n ** (1 / 3))
            grid = shape.permute(0, 2, 1).contiguous().view(b, c, res, res, res)
            decoder = self._get("ss_decoder")
            logits = decoder(grid.to(next(decoder.parameters()).dtype))
            coords = torch.argwhere(logits > 0)[:, [0, 2, 3, 4]].int()
            del decoder
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
        if "scale" in pose:
            pose["scale"] = pose["scale"] * ss_return["downsample_factor"]
        return pose

    # ----------------------------------------------------------------------------------------------------------
    # stage 2 and decoding
    # ----------------------------------------------------------------------------------------------------------
    def sample_slat(self, slat_input: Dict[str, torch.Tensor], coords: torch.Tensor,
                    inference_steps: int = DEFAULT_INFERENCE_STEPS, use_distillation: bool = False,
                    noise_device: str = NOISE_AUTO):
        """Stage 2: the structured latent on ``coords``. ``inference_steps`` (truthy) overrides the configured
        count for this call (upstream's default ``DEFAULT_INFERENCE_STEPS``; ``run`` leaves the configured one);
        ``use_distillation`` turns guidance off (strength 0). The noise comes from the global generator."""
        options = RunOptions(seed=None, stage2_inference_steps=inference_steps,
                             use_stage2_distillation=use_distillation, noise_device=noise_device)
        return self._sample_slat(slat_input, coords, options)

    def _sample_slat(self, slat_input: Dict[str, torch.Tensor], coords: torch.Tensor, options: RunOptions,
                     rng: Optional[torch.Generator] = None):
        """``sample_slat`` with the run's ``options`` and its seeded generator ``rng``."""
        from sam3d_objects.model.backbone.tdfy_dit.modules.sparse import SparseTensor
        with self._stage("slat_condition"), self._autocast(self.dtype):
            cond = self._embed("slat_condition_embedder", slat_input, self.slat_condition_input_mapping)
            self._free("slat_condition_embedder")
        with self._stage("slat_sampling"), self._sampler("slat_generator", options, rng) as generator:
            channels = generator.reverse_fn.backbone.in_channels
            self._prepack(generator)
            # the coords array is one object for the whole run (upstream passes numpy): the backbone keeps what it
            # derives from it, so calls after the first of their kind replay CUDA graphs (on CUDA only)
            with self._autocast(self.dtype), graphed_backbone(generator.reverse_fn, self._graphs_allowed(generator)), \
                    self._condition_cache(generator):
                feats = generator((1, coords.shape[0], channels), self.device, cond, coords.cpu().numpy())
            del generator  # freed on leaving the block (low-memory), not only when this method returns
        feats = getattr(feats, "feats", feats).float()
        feats = feats.reshape(-1, feats.shape[-1])
        feats = feats * self.slat_std.to(feats) + self.slat_mean.to(feats)
        return SparseTensor(feats=feats, coords=coords.to(feats.device).int())

    def decode_slat(self, slat, formats: Sequence[str] = ["mesh", "gaussian"]  # noqa: B006
                    ) -> Dict[str, List[Any]]:
        outputs = {}
        for fmt, name in (("mesh", "slat_decoder_mesh"), ("gaussian", "slat_decoder_gs"),
                          ("gaussian_4", "slat_decoder_gs_4")):
            if fmt not in formats:
                continue
            with self._stage(f"decode_{fmt}"):
                decoder = self._get(name)
                outputs[fmt] = decoder(slat)
                del decoder
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

    def _postprocessed_glb(self, outputs: Dict[str, List[Any]], with_mesh_postprocess: bool,
                           with_texture_baking: bool, use_vertex_color: bool):
        """Upstream's postprocessing_utils.to_glb: simplification / hole filling and / or a baked texture."""
        try:
            from sam3d_objects.model.backbone.tdfy_dit.utils import postprocessing_utils
        except ImportError:  # an older checkout without the post-processing module: the raw mesh, said loudly
            logger.warning("mesh post-processing / texture baking need tdfy_dit.utils.postprocessing_utils, which "
                           "this installation lacks: exporting the raw mesh with vertex colours")
            return self.to_glb(outputs["mesh"][0], use_vertex_color=True)
        if "gaussian" not in outputs or not outputs["gaussian"]:
            raise ValueError("texture baking and mesh post-processing render the Gaussians: decode_formats must "
                             "include 'gaussian' as well as 'mesh'")
        return postprocessing_utils.to_glb(outputs["gaussian"][0], outputs["mesh"][0], simplify=0.95,
                                           fill_holes=True, texture_size=1024, verbose=False,
                                           with_mesh_postprocess=with_mesh_postprocess,
                                           with_texture_baking=with_texture_baking,
                                           use_vertex_color=use_vertex_color, rendering_engine=self.rendering_engine)

    def postprocess_slat_output(self, outputs: Dict[str, List[Any]], with_mesh_postprocess: bool,
                                with_texture_baking: bool, use_vertex_color: bool) -> Dict[str, Any]:
        """Adds "glb" (None without a mesh), "gs" and "gs_4". Without post-processing and baking the GLB is the
        raw decoder mesh (y-up, vertex colours when ``use_vertex_color``), as upstream's demo path; otherwise
        upstream's ``to_glb`` simplifies / fills holes / bakes a texture from Gaussian renders."""
        result = dict(outputs)
        glb = None
        if "mesh" in outputs and outputs["mesh"]:
            with self._stage("postprocess_mesh"):
                if with_mesh_postprocess or with_texture_baking:
                    glb = self._postprocessed_glb(outputs, with_mesh_postprocess, with_texture_baking,
                                                  use_vertex_color)
                else:
                    glb = self.to_glb(outputs["mesh"][0], use_vertex_color=use_vertex_color)
        result["glb"] = glb
        if "gaussian" in outputs and outputs["gaussian"]:
            result["gs"] = outputs["gaussian"][0]
        if "gaussian_4" in outputs and outputs["gaussian_4"]:
            result["gs_4"] = outputs["gaussian_4"][0]
        return result

    # ----------------------------------------------------------------------------------------------------------
    # run
    # ----------------------------------------------------------------------------------------------------------
    def _run_stages(self, image, options: RunOptions, pointmap=None) -> Dict[str, Any]:
        """Both pipelines' run(): returns the output dict plus "_ss_input" (the stage-1 inputs, removed by run).
        The noise of both stages comes from one generator seeded with ``options.seed`` after preprocessing (where
        upstream seeds the global generator), or from the global generator without a seed."""
        self.stage_times = {}
        with self._host_memory_reused():
            return self._run_stages_now(image, options, pointmap)

    @contextmanager
    def _host_memory_reused(self):
        """A run's CPU tensors reused by the C allocator between its ops (``reuse_host_memory``), the free pages
        returned when the run ends."""
        reuse = self.reuse_host_memory and self.device.type == "cpu" and not self.low_memory \
            and backends.device.keep_freed_host_memory()
        try:
            yield
        finally:
            if reuse:
                backends.device.release_host_memory()

    def _run_stages_now(self, image, options: RunOptions, pointmap=None) -> Dict[str, Any]:
        with self._stage("preprocess"):
            ss_input, slat_input, extra = self._prepare_condition_inputs(image, pointmap)
        rng = self._noise_generator(options)
        with torch.no_grad():
            ss_return = self._sample_sparse_structure(ss_input, options, rng)
            ss_return.update(self.pose_decode(ss_return, ss_input))
            ss_return.update(extra)
            if options.stage1_only:
                ss_return["voxel"] = ss_return["coords"][:, 1:].float() / 64 - 0.5
                return {**ss_return, "_ss_input": ss_input}
            coords = ss_return["coords"]
            if coords.shape[0] == 0:
                raise EmptyStructureError(
                    "stage 1 decoded no occupied voxel (all sparse-structure logits <= 0), so there is no shape "
                    "to refine. Try another seed or check the mask; run(stage1_only=True) returns the stage-1 "
                    "latents and pose for inspection.")
            slat = self._sample_slat(slat_input, coords, options, rng)
            outputs = self.decode_slat(slat, options.decode_formats or self.decode_formats)
        outputs = self.postprocess_slat_output(outputs, options.with_mesh_postprocess, options.with_texture_baking,
                                               options.use_vertex_color)
        return {**ss_return, **outputs, "_ss_input": ss_input}

    def run(self, image, mask=None, seed: Optional[int] = DEFAULT_SEED, stage1_only: bool = False,
            with_mesh_postprocess: bool = True, with_texture_baking: bool = True, use_vertex_color: bool = False,
            stage1_inference_steps: Optional[int] = None, stage2_inference_steps: Optional[int] = None,
            use_stage1_distillation: bool = False, use_stage2_distillation: bool = False,
            decode_formats: Optional[Sequence[str]] = None, with_layout_postprocess: bool = True,
            noise_device: str = NOISE_AUTO) -> Dict[str, Any]:
        """Image (+ mask) -> dict of outputs (upstream's keys).

        ``image``: RGB(A) uint8 [H, W, 3|4]; ``mask``: [H, W] (bool / 0-1 / 0-255), or None when the alpha channel
        is the mask. ``seed``: the sampling noise comes from a generator seeded with it right after preprocessing
        (the numbers of upstream's ``torch.manual_seed(seed)``, without touching the global random state); None:
        no seeding, the global generator is used. Returns ``shape``,
        ``6drotation_normalized``, ``translation_scale``, ``translation`` (1,3), ``rotation`` (1,4 wxyz),
        ``scale`` (1,3), ``coords_original``, ``coords`` (int32 [N,4]), ``downsample_factor``, ``mesh`` /
        ``gaussian`` (lists), ``glb`` (trimesh, y-up), ``gs`` (the Gaussian), ``gs_4``. With ``stage1_only`` only
        the stage-1 part plus ``voxel`` (coords[:, 1:] / 64 - 0.5).

        ``use_stage1_distillation`` / ``use_stage2_distillation``: upstream's fast mode (stage 1 as a shortcut
        model with d = 1/steps and no guidance; stage 2 without guidance); few steps then suffice (e.g. 4).
        ``with_mesh_postprocess`` / ``with_texture_baking``: upstream's ``to_glb`` options (simplified, hole-filled
        and/or texture-baked GLB). ``noise_device`` (ours): "cpu" draws the noise on the CPU, so that a seed
        gives the same object on every device; "device" the model's device (upstream); "auto" (default) the
        constructor's setting (see ``run_options``). ``with_layout_postprocess`` is used by the point-map pipeline.
        All of these at once: ``run_with_options(image, mask, RunOptions(...))``.

        Zero occupied voxels after stage 1 raise ``EmptyStructureError`` (nothing to decode); ``stage1_only=True``
        still returns the latents, pose and the empty ``coords``.
        """
        return self.run_with_options(image, mask, RunOptions.from_locals(locals()))

    def run_with_options(self, image, mask=None, options: RunOptions = RunOptions(), pointmap=None
                         ) -> Dict[str, Any]:
        """(ours) ``run`` with its keywords in one ``RunOptions`` (``pointmap``: for the point-map pipeline)."""
        if pointmap is not None:
            raise TypeError(f"{type(self).__name__} takes no point map (InferencePipelinePointMap does)")
        check_run_inputs(image, mask, None)
        image = self.merge_image_and_mask(image, mask)
        out = self._run_stages(image, options)
        out.pop("_ss_input")
        return out
