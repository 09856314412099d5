"""Checks of user input that run before anything heavy: the image / mask / point map of a run, the device, the
output folder and the checkpoint folder's configuration. Shared by the CLI, ``Inference`` and the pipeline's
``run`` so API users get the same clear errors (``FileNotFoundError`` / ``ValueError`` / ``DeviceUnavailableError``)
that name the fix, instead of a library's error from deep inside a stage.

Only numpy, omegaconf and the standard library are imported at module level; torch only when a device is checked.
"""
from __future__ import annotations

import inspect
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from sam3d_objects.errors import ConfigError, DeviceUnavailableError, InputWarning  # noqa: F401  re-exported

PathLike = Union[str, Path]

# the models see the object crop at 518 px; a mask this small is upsampled ~30x and gives little to go on
MODEL_INPUT_SIDE = 518
MIN_MASK_PIXELS = 256
# far above the model's input: preprocessing time grows with the pixel count while the crop the model sees does not
LARGE_IMAGE_SIDE = 2048
# CPU preprocessing cost measured for an 8000x6000 image (47 s) -> about 1 s per megapixel
PREPROCESS_SECONDS_PER_MEGAPIXEL = 1.0


# ----------------------------------------------------------------------------------------------------------------
# device
# ----------------------------------------------------------------------------------------------------------------
def check_device(name: Any) -> None:
    """Raise ``DeviceUnavailableError`` when ``name`` (str / torch.device / None = automatic) cannot be used."""
    if name is None:
        return
    import torch

    import backends
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {name!r} is not a torch device ({e}); use 'cpu', 'cuda', 'cuda:1' or 'mps'") from e
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailableError(f"device {name!r}: CUDA is not available in this torch build/machine; use "
                                         f"device='cpu' (or None to pick the best available device)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceUnavailableError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA "
                                         f"device(s) (cuda:0..cuda:{torch.cuda.device_count() - 1})")
    elif device.type == "mps":
        if not backends.device.mps_available():
            raise DeviceUnavailableError(f"device {name!r}: MPS is not available here (it needs Apple silicon and "
                                         f"a torch build with MPS); use device='cpu'")
    elif device.type not in ("cpu", "meta"):
        raise DeviceUnavailableError(f"device {name!r}: only cpu, cuda and mps are supported")


# ----------------------------------------------------------------------------------------------------------------
# image, mask, point map
# ----------------------------------------------------------------------------------------------------------------
def _shape(value: Any) -> Tuple[int, ...]:
    return tuple(int(s) for s in getattr(value, "shape", np.shape(value)))


def _as_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def _mask_pixels(mask: np.ndarray) -> int:
    if mask.ndim == 3 and mask.shape[-1] in (1, 3, 4):
        mask = mask[..., -1] if mask.shape[-1] == 4 else mask[..., 0]
    if mask.dtype == bool:
        return int(mask.sum())
    return int(np.count_nonzero(np.nan_to_num(mask.astype(np.float64)) > 0))


def check_mask(mask: Any, image_shape: Sequence[int], name: str = "the mask") -> int:
    """Number of object pixels; ValueError for another size or an empty mask, InputWarning for a tiny one."""
    shape = _shape(mask)
    hw = tuple(image_shape[:2])
    if shape[:2] != hw or len(shape) not in (2, 3):
        raise ValueError(f"image is {hw[0]}x{hw[1]} but {name} is {'x'.join(map(str, shape))}: they must have the "
                         f"same height and width (resize the mask with nearest-neighbour, or recompute it)")
    pixels = _mask_pixels(_as_numpy(mask))
    if pixels == 0:
        raise ValueError(f"{name} is empty: no pixel selects the object (mask values > 0, or the alpha channel of "
                         f"an RGBA mask, mark the object)")
    if pixels < MIN_MASK_PIXELS:
        warnings.warn(f"{name} selects only {pixels} pixel(s) (under {MIN_MASK_PIXELS}): the model sees the object "
                      f"upsampled to {MODEL_INPUT_SIDE} px and the result will be coarse; check the mask or use a "
                      f"closer photo", InputWarning, stacklevel=3)
    return pixels


def _dtype_kind(value: Any) -> str:
    dtype = getattr(value, "dtype", None)
    if dtype is not None and hasattr(dtype, "is_floating_point"):  # a torch dtype
        return "b" if dtype == __import__("torch").bool else "c" if dtype.is_complex else \
            "f" if dtype.is_floating_point else "i"
    return np.asarray(value).dtype.kind if dtype is None else np.dtype(dtype).kind


def check_image(image: Any) -> Tuple[int, int]:
    """(H, W); TypeError for bool / complex / non-numeric pixels, ValueError for anything but [H, W],
    [H, W, 3|4], for NaN/inf pixels or more than ``MAX_INPUT_PIXELS``; InputWarning for images far above the model
    size."""
    from sam3d_objects.utils.images import MAX_INPUT_PIXELS
    shape = _shape(image)
    if len(shape) not in (2, 3) or (len(shape) == 3 and shape[-1] not in (3, 4)) or 0 in shape:
        raise ValueError(f"image must be an RGB or RGBA array [H, W, 3|4], got shape {shape}")
    kind = _dtype_kind(image)
    if kind not in "uif":
        raise TypeError(f"image must hold numbers (uint8 0..255), got dtype "
                        f"{getattr(image, 'dtype', type(image).__name__)}: a bool image would be read as 0/1 "
                        f"intensities; convert it (e.g. image.astype(np.uint8) * 255)")
    if shape[0] * shape[1] > MAX_INPUT_PIXELS:
        raise ValueError(f"image is {shape[1]}x{shape[0]}, over the {MAX_INPUT_PIXELS / 1e6:.0f} megapixel limit; "
                         f"downscale it first (sam3d_objects.validation.downscale_inputs)")
    if kind == "f" and not np.isfinite(_as_numpy(image)).all():
        raise ValueError("image holds NaN/infinite pixels; pass uint8 RGB(A) values 0..255")
    height, width = shape[:2]
    if max(height, width) > LARGE_IMAGE_SIDE:
        warnings.warn(large_image_message(height, width) + " Downscale it first (sam3d_objects.validation."
                      "downscale_inputs) to save that time.", InputWarning, stacklevel=3)
    return height, width


def large_image_message(height: int, width: int) -> str:
    seconds = height * width / 1e6 * PREPROCESS_SECONDS_PER_MEGAPIXEL
    return (f"the image is {width}x{height}, far above the model's {MODEL_INPUT_SIDE} px input: the object crop is "
            f"downscaled to {MODEL_INPUT_SIDE} px anyway, and preprocessing at full size takes about "
            f"{seconds:.0f} s on a CPU.")


def check_pointmap(pointmap: Any, image_shape: Sequence[int]) -> None:
    """ValueError unless ``pointmap`` is None or a [H, W, 3] map of the image's size with a finite point."""
    if pointmap is None:
        return
    shape = _shape(pointmap)
    if len(shape) != 3 or shape[-1] != 3:
        raise ValueError(f"pointmap must be [H, W, 3] (xyz per pixel, camera frame), got shape {shape}")
    if shape[:2] != tuple(image_shape[:2]):
        raise ValueError(f"the point map is {shape[1]}x{shape[0]} (WxH) but the image is {image_shape[1]}x"
                         f"{image_shape[0]}: pass a point map of the image's size (one xyz per pixel)")
    check_pointmap_values(_as_numpy(pointmap))


# a point map is metric-ish (metres, or the depth model's scale): coordinates beyond this are a unit error and
# would overflow the pose (``Infinity`` in pose.json)
MAX_POINTMAP_COORDINATE = 1e5
MIN_FINITE_RATIO = 0.01


def check_pointmap_values(points: np.ndarray, name: str = "the point map") -> None:
    """ValueError for point-map values the pipeline cannot use: not real numbers (complex, bool, objects), almost
    no finite point, coordinates beyond ``MAX_POINTMAP_COORDINATE``, depth not positive (PyTorch3D camera frame:
    z forward, so points in front of the camera have z > 0; OpenCV maps have y and x flipped, not z), or every
    point the same (a constant map gives a NaN rotation); warns when under half the points are finite."""
    points = np.asarray(points)
    if points.dtype.kind not in "fiu":
        raise TypeError(f"{name} must hold real numbers (float), got dtype {points.dtype}; pass xyz as float32")
    points = points.astype(np.float64, copy=False)
    finite = np.isfinite(points).all(-1)
    ratio = float(finite.mean()) if finite.size else 0.0
    if not finite.any():
        raise ValueError(f"{name} has no finite point (all NaN/inf): check the depth model output or the "
                         f"pointmap you passed")
    if ratio < MIN_FINITE_RATIO:
        raise ValueError(f"{name}: only {ratio:.2%} of its points are finite: check the depth estimate")
    if ratio < 0.5:
        warnings.warn(f"{name}: only {ratio:.0%} of its points are finite; the object's depth comes from those",
                      InputWarning, stacklevel=3)
    valid = points[finite]
    if np.abs(valid).max() > MAX_POINTMAP_COORDINATE:
        raise ValueError(f"{name} has coordinates up to {np.abs(valid).max():.3g}, beyond "
                         f"{MAX_POINTMAP_COORDINATE:.0e}: wrong units? Give xyz in metres (or the depth model's "
                         f"scale)")
    z = valid[:, 2]
    if (z <= 0).mean() > 0.5:
        raise ValueError(f"{name}: most depths (z) are <= 0; the PyTorch3D camera frame has z forward (points in "
                         f"front of the camera have z > 0). Negate z if your map looks along -z")
    if float(np.ptp(valid, axis=0).max()) <= 1e-9 * max(1.0, float(np.abs(valid).max())):
        raise ValueError(f"{name}: every point is the same: a degenerate map (the object's size and rotation "
                         f"would be undefined); check the depth estimate")


def check_run_inputs(image: Any, mask: Any = None, pointmap: Any = None) -> None:
    """The checks of one pipeline run (``mask=None``: the image's alpha channel is the mask)."""
    height, width = check_image(image)
    object_mask = None
    if mask is None:
        if len(_shape(image)) == 3 and _shape(image)[-1] == 4:
            object_mask = _as_numpy(image)[..., 3]
            check_mask(object_mask, (height, width), name="the image's alpha channel (the mask)")
    else:
        check_mask(mask, (height, width))
        object_mask = _as_numpy(mask)
    check_pointmap(pointmap, (height, width))
    if pointmap is not None and object_mask is not None:
        check_points_under_mask(pointmap, object_mask)


MAX_INFERENCE_STEPS = 1000
DECODE_FORMATS = ("gaussian", "mesh", "gaussian_4")


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_run_options(seed: Any = None, **options: Any) -> None:
    """TypeError / ValueError for run options the pipeline would misuse silently: a seed that is not an integer
    (1.5 would be truncated), step counts outside 1..``MAX_INFERENCE_STEPS``, unknown decode formats."""
    if seed is not None and not _is_int(seed):
        raise TypeError(f"seed must be an int (or None), got {seed!r} ({type(seed).__name__})")
    if seed is not None and not -2 ** 63 <= int(seed) < 2 ** 64:
        raise ValueError(f"seed {seed} is out of range (64-bit integers)")
    for key in ("stage1_inference_steps", "stage2_inference_steps"):
        value = options.get(key)
        if value is None:
            continue
        if not _is_int(value):
            raise TypeError(f"{key} must be an int, got {value!r} ({type(value).__name__})")
        if not 1 <= int(value) <= MAX_INFERENCE_STEPS:
            raise ValueError(f"{key}={value}: give 1..{MAX_INFERENCE_STEPS} steps (the released model uses 25)")
    formats = options.get("decode_formats")
    if formats is not None:
        if isinstance(formats, str) or not all(isinstance(f, str) for f in formats):
            raise TypeError(f"decode_formats must be a list of names from {list(DECODE_FORMATS)}, got {formats!r}")
        bad = [f for f in formats if f not in DECODE_FORMATS]
        if bad or not list(formats):
            raise ValueError(f"decode_formats {list(formats)}: unknown {bad or 'empty'}; choose from "
                             f"{list(DECODE_FORMATS)}")


def check_render_options(num_frames: Any, resolution: Any, r: Any, fov: Any, max_frames: int = 3600) -> None:
    """ValueError / TypeError for orbit-render parameters that give an empty or blank video."""
    if not _is_int(num_frames) or not 1 <= int(num_frames) <= max_frames:
        raise ValueError(f"num_frames={num_frames!r}: give an int in 1..{max_frames}")
    if not _is_int(resolution) or not 8 <= int(resolution) <= 4096:
        raise ValueError(f"resolution={resolution!r}: give an int in 8..4096 pixels")
    for name, value, lo, hi in (("r", r, 0.0, 1e4), ("fov", fov, 0.0, 180.0)):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not np.isfinite(value) \
                or not lo < float(value) < hi:
            raise ValueError(f"{name}={value!r}: give a number in ({lo:g}, {hi:g})"
                             + (" degrees" if name == "fov" else " (camera distance)"))


def check_points_under_mask(pointmap: Any, mask: np.ndarray) -> None:
    """ValueError when no pixel of the object has a finite 3D point: the object's scale and position would be
    made up (upstream's normaliser only warns and falls back to the whole scene)."""
    if mask.ndim == 3:
        mask = mask[..., -1] if mask.shape[-1] == 4 else mask[..., 0]
    inside = np.nan_to_num(mask.astype(np.float64)) > 0
    finite = np.isfinite(_as_numpy(pointmap)).all(-1)
    if not (finite & inside).any():
        raise ValueError("the point map has no valid 3D point under the mask (all NaN/inf there): the object's "
                         "depth is unknown; check the depth model output or the pointmap you passed")


def downscale_inputs(image: np.ndarray, masks: Sequence[np.ndarray] = (), pointmap: Optional[np.ndarray] = None,
                     max_side: int = LARGE_IMAGE_SIDE):
    """(image, masks, pointmap) shrunk so the longer side is ``max_side``: the image with Lanczos, masks and the
    point map with nearest neighbour (no invented depths or mask edges). Unchanged when already small enough."""
    from PIL import Image
    height, width = image.shape[:2]
    if max(height, width) <= max_side:
        return image, list(masks), pointmap
    scale = max_side / max(height, width)
    size = (max(1, round(width * scale)), max(1, round(height * scale)))
    small = np.asarray(Image.fromarray(image).resize(size, Image.Resampling.LANCZOS))
    rows = np.minimum(((np.arange(size[1]) + 0.5) / scale).astype(np.int64), height - 1)
    cols = np.minimum(((np.arange(size[0]) + 0.5) / scale).astype(np.int64), width - 1)
    small_masks = [_shrink_mask(np.asarray(m), rows, cols, size) for m in masks]
    small_pm = None if pointmap is None else np.asarray(pointmap)[rows[:, None], cols[None, :]]
    return small, small_masks, small_pm


def _shrink_mask(mask: np.ndarray, rows: np.ndarray, cols: np.ndarray, size: Tuple[int, int]) -> np.ndarray:
    """Nearest-neighbour; a tiny object that nearest sampling would miss keeps every cell it touches."""
    small = mask[rows[:, None], cols[None, :]]
    if np.asarray(small).any() or not mask.any():
        return small
    from PIL import Image
    touched = np.asarray(Image.fromarray((mask > 0).astype(np.uint8) * 255).resize(size, Image.Resampling.BOX)) > 0
    return touched if mask.dtype == bool else touched.astype(mask.dtype) * mask.max()


# ----------------------------------------------------------------------------------------------------------------
# output folder
# ----------------------------------------------------------------------------------------------------------------
def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _probe_writable(folder: Path, what: str) -> None:
    if not folder.is_dir():
        raise ValueError(f"{what}: {folder} is a file, not a folder; choose another --out")
    try:
        fd, probe = tempfile.mkstemp(prefix=".sam3d-write-test-", dir=folder)
    except OSError as e:
        raise ValueError(f"{what}: cannot write in {folder} ({e.strerror or e}); choose a folder you can write "
                         f"to") from e
    os.close(fd)
    os.unlink(probe)


def check_output_dir(out: PathLike) -> None:
    """ValueError unless ``out`` can be created (or written into) and its parent takes a temporary folder."""
    out = Path(out).expanduser().absolute()
    if out.exists():
        _probe_writable(out, f"output folder {out}")
    _probe_writable(_nearest_existing(out.parent), f"output folder {out}")


# ----------------------------------------------------------------------------------------------------------------
# configuration of the checkpoint folder
# ----------------------------------------------------------------------------------------------------------------
def _config_error(path: PathLike, e: Exception) -> "ConfigError":
    key, target, reason = getattr(e, "key", "<root>"), getattr(e, "target", None), getattr(e, "reason", str(e))
    return ConfigError(path, key, target, reason)


def load_yaml(path: PathLike):
    """The yaml as a checked DictConfig (``sam3d_objects.config.safety``: size and alias caps, no resolvers, every
    interpolation resolved, every target node valid); FileNotFoundError / ConfigError naming the file."""
    from sam3d_objects.config.safety import UnsafeConfigError, load_checkpoint_yaml
    try:
        return load_checkpoint_yaml(path)
    except UnsafeConfigError as e:
        raise _config_error(path, e) from None


def check_targets(path: PathLike, config, resolve_prefixes: Sequence[str] = ("sam3d_objects.",)) -> None:
    """ConfigError for a target node that ``config.safety`` refuses (target not one of the released configs'
    exact names, unknown parameter, safety switched off). ``resolve_prefixes`` is kept for callers; every
    registered target is resolved."""
    from sam3d_objects.config.safety import UnsafeConfigError, check_config_tree, resolved_copy
    try:
        check_config_tree(resolved_copy(config))
    except UnsafeConfigError as e:
        raise _config_error(path, e) from None


def check_resolvable(path: PathLike, config) -> None:
    """ConfigError for ``???`` values and interpolations that do not resolve (or use a resolver)."""
    from omegaconf import OmegaConf

    from sam3d_objects.config.safety import UnsafeConfigError, resolved_copy
    missing = sorted(OmegaConf.missing_keys(config))
    if missing:
        raise ConfigError(path, missing[0], None, "mandatory value missing ('???'); fill it in")
    try:
        resolved_copy(config)
    except UnsafeConfigError as e:
        raise _config_error(path, e) from None


def _required_parameters(cls: type) -> List[str]:
    """Constructor parameters without a default, following ``*args, **kwargs`` pass-through to the bases."""
    required: List[str] = []
    for klass in inspect.getmro(cls):
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            params = list(inspect.signature(init).parameters.values())[1:]
        except (TypeError, ValueError):
            return required
        required += [p.name for p in params if p.default is inspect.Parameter.empty
                     and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if not any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
            return required
    return required


def check_required_keys(path: PathLike, config) -> None:
    """ConfigError for a constructor argument of the root ``_target_`` (a class of ours) that has no default and
    no key in the yaml."""
    from sam3d_objects.config.safety import REGISTERED_TARGETS, resolve_target
    target = config.get("_target_")
    if not target or str(target) not in REGISTERED_TARGETS or not str(target).startswith("sam3d_objects."):
        return
    cls = resolve_target(str(target))
    if not inspect.isclass(cls):
        return
    for name in _required_parameters(cls):
        if name not in config:
            raise ConfigError(path, name, str(target), "missing key: the constructor needs it (compare with the "
                                                       "released pipeline.yaml, or download the folder again)")


def check_config_file(path: PathLike, required_keys: bool = False):
    """The yaml, checked: it parses and resolves, every target is allowed (and exists, for ours) and, with
    ``required_keys``, the root target's mandatory constructor arguments are present."""
    from omegaconf import OmegaConf
    config = load_yaml(path)  # resolved and checked
    missing = sorted(OmegaConf.missing_keys(config))
    if missing:
        raise ConfigError(path, missing[0], None, "mandatory value missing ('???'); fill it in")
    if required_keys:
        check_required_keys(path, config)
    return config


def checkpoint_folder_files(pipeline_yaml: PathLike) -> Dict[str, List[Tuple[str, Path]]]:
    """Check pipeline.yaml and every model yaml it names; return {"configs": [(key, path)], "checkpoints": [...]}
    (paths resolved against the yaml's folder). FileNotFoundError / ConfigError name the file."""
    pipeline_yaml = Path(pipeline_yaml)
    config = check_config_file(pipeline_yaml, required_keys=True)
    folder = pipeline_yaml.absolute().parent  # not resolve(): a hub cache links each file to a blob
    found: Dict[str, List[Tuple[str, Path]]] = {"configs": [], "checkpoints": []}
    for key in config.keys():
        key = str(key)
        kind = "configs" if key.endswith("_config_path") else "checkpoints" if key.endswith("_ckpt_path") else None
        value = config.get(key)
        if kind is None or value is None:
            continue
        path = Path(str(value)).expanduser()
        found[kind].append((key, path if path.is_absolute() else folder / path))
    missing = [f"{p} ({k})" for k, p in found["configs"] + found["checkpoints"] if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"checkpoint folder {folder} is incomplete, missing: {', '.join(missing)}. "
                                f"Download it again (README: facebook/sam-3d-objects) or fix {pipeline_yaml.name}.")
    _check_pipeline_values(pipeline_yaml, config)
    for key, path in found["configs"]:
        _check_model_nodes(path, check_config_file(path), key)
    return found


# the node of each model yaml the pipeline builds (None: the root); generators also hold an optional embedder
MODEL_NODES = {"ss_generator_config_path": "module.generator.backbone",
               "slat_generator_config_path": "module.generator.backbone"}
PIPELINE_DTYPES = ("float16", "bfloat16", "float32", "fp16", "bf16", "fp32")


def _check_model_nodes(path: PathLike, config, key: str) -> None:
    """ConfigError when the node the pipeline builds from this yaml has no ``_target_`` (hydra would hand back
    the bare mapping, and loading weights into it fails much later)."""
    from omegaconf import DictConfig, OmegaConf
    node_path = MODEL_NODES.get(key)
    node = config if node_path is None else OmegaConf.select(config, node_path)
    if not isinstance(node, DictConfig) or "_target_" not in node:
        raise ConfigError(path, node_path or "<root>", None, "no _target_: the model this yaml describes is not "
                                                             "named (compare with the released yaml, or download "
                                                             "the folder again)")


def _check_pipeline_values(path: PathLike, config) -> None:
    """ConfigError for pipeline.yaml values the pipeline cannot use (found before any model is built)."""
    for key in ("dtype", "shape_model_dtype"):
        dtype = config.get(key, None)
        if dtype is not None and str(dtype) not in PIPELINE_DTYPES:
            raise ConfigError(path, key, str(config.get("_target_")), f"{dtype!r} is not a model dtype; use one of "
                                                                      f"{', '.join(PIPELINE_DTYPES)}")


# keys of pipeline.yaml whose checkpoint holds two models (generator + condition embedder, by key prefix)
PREFIXED_CHECKPOINTS = ("ss_generator_ckpt_path", "slat_generator_ckpt_path")


def check_checkpoint_folder(pipeline_yaml: PathLike) -> None:
    """Everything pipeline.yaml names, checked up front in seconds (also in low-memory mode, which loads models
    only when their stage starts): the yamls (see ``checkpoint_folder_files``), every checkpoint's structure and
    its manifest: the keys, shapes and tensor kinds of the models its yaml describes (``check_manifests``).
    FileNotFoundError / ConfigError / CheckpointError name the file."""
    from sam3d_objects.pipeline.checkpoint import EMBEDDER_PREFIX, GENERATOR_PREFIX, verify_checkpoint
    found = checkpoint_folder_files(pipeline_yaml)
    for key, path in found["checkpoints"]:
        verify_checkpoint(path, (GENERATOR_PREFIX, EMBEDDER_PREFIX) if key in PREFIXED_CHECKPOINTS else ())
    check_manifests(found)


# checkpoint key -> (its yaml's key, [(node of the yaml the pipeline builds (None: root), key prefix in the file)])
def _model_checkpoints() -> Dict[str, Tuple[str, List[Tuple[Optional[str], Optional[str]]]]]:
    from sam3d_objects.pipeline.checkpoint import EMBEDDER_PREFIX, GENERATOR_PREFIX
    generator = [("module.generator.backbone", GENERATOR_PREFIX),
                 ("module.condition_embedder.backbone", EMBEDDER_PREFIX)]
    table = {f"{n}_ckpt_path": (f"{n}_config_path", generator) for n in ("ss_generator", "slat_generator")}
    for name in ("ss_decoder", "slat_decoder_gs", "slat_decoder_gs_4", "slat_decoder_mesh"):
        table[f"{name}_ckpt_path"] = (f"{name}_config_path", [(None, None)])
    return table


_SAFETENSORS_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def checkpoint_index(path: PathLike) -> Dict[str, Any]:
    """name -> object with ``shape`` and ``dtype`` for every tensor of a checkpoint, without reading tensor data
    (``.ckpt``: memory-mapped tensors; ``.safetensors``: the header). Keys under ``state_dict`` for wrapped
    files."""
    from types import SimpleNamespace

    import torch

    from sam3d_objects.pipeline.checkpoint import CheckpointError, read_checkpoint
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open
        try:
            with safe_open(str(path), framework="pt") as f:
                index = {}
                for k in f.keys():
                    piece = f.get_slice(k)
                    name = _SAFETENSORS_DTYPES.get(piece.get_dtype(), "complex64")
                    index[k] = SimpleNamespace(shape=tuple(piece.get_shape()), dtype=getattr(torch, name))
                return index
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{path} is not a readable safetensors file ({e}); download it again.") from e
    content = read_checkpoint(path)
    if isinstance(content, dict) and isinstance(content.get("state_dict"), dict):
        content = content["state_dict"]
    if not isinstance(content, dict) or not all(isinstance(v, torch.Tensor) for v in content.values()):
        raise CheckpointError(f"{path} does not hold a state dict (name -> tensor); download it again.")
    return content


def check_manifests(found: Dict[str, List[Tuple[str, Path]]]) -> None:
    """Each checkpoint against the models its yaml describes, built on the meta device (no memory, no tensor
    read): the same keys, shapes and tensor kinds the loader will demand, found in seconds instead of after
    sampling. CheckpointError names the file and the first differences."""
    from omegaconf import DictConfig, OmegaConf

    from sam3d_objects.config.instantiate import safe_instantiate
    from sam3d_objects.pipeline.checkpoint import build_on_meta, check_against_model
    configs = dict(found["configs"])
    for ckpt_key, path in found["checkpoints"]:
        spec = _model_checkpoints().get(ckpt_key)
        if spec is None or spec[0] not in configs:
            continue
        config = load_yaml(configs[spec[0]])
        index = checkpoint_index(path)
        for node_path, prefix in spec[1]:
            node = config if node_path is None else OmegaConf.select(config, node_path)
            if not isinstance(node, DictConfig) or "_target_" not in node:
                continue
            if node_path is None and "pretrained_ckpt_path" in node:
                node = node.copy()
                del node["pretrained_ckpt_path"]
            model = build_on_meta(lambda: safe_instantiate(node))
            state = index if not prefix else {k[len(prefix):]: v for k, v in index.items() if k.startswith(prefix)}
            check_against_model(model, state, f"{path}" + (f" (keys {prefix}*)" if prefix else ""))
            del model
