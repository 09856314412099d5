"""Upstream's ``notebook/inference.py`` API: ``Inference``, ``load_image``, ``load_single_mask``, ``load_masks``,
``make_scene``.

    from sam3d_objects.inference import Inference, load_image, load_single_mask
    inference = Inference("checkpoints/hf/pipeline.yaml", compile=False)
    output = inference(load_image("image.png"), load_single_mask("masks/", 0), seed=42)
    output["gs"].save_ply("splat.ply"); output["glb"].export("mesh.glb")

(``notebooks/inference.py`` re-exports these names, so ``sys.path.append("notebooks"); from inference import
Inference`` works as in upstream's README.)
"""
from __future__ import annotations

import copy
import math
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from sam3d_objects.config.instantiate import check_targets, load_config, safe_instantiate
from sam3d_objects.pipeline.inference_pipeline import check_sampling_dtype, merge_mask_into_alpha
from sam3d_objects.pipeline.run_options import NOTEBOOK_RUN_OPTIONS, RunOptions, resolve_noise_device
from sam3d_objects.utils.rotation import quaternion_multiply, quaternion_to_matrix
from sam3d_objects.validation import (ConfigError, DeviceUnavailableError, check_checkpoint_folder, check_device,
                                      check_render_options, check_run_inputs, check_run_options)

__all__ = ["Inference", "DeviceUnavailableError", "ConfigError", "load_image", "load_mask", "load_single_mask",
           "load_masks", "make_scene", "ready_gaussian_for_video_rendering", "render_video", "normalized_gaussian",
           "display_image", "interactive_visualizer", "check_target", "check_hydra_safety", "WHITELIST_FILTERS",
           "BLACKLIST_FILTERS"]


class Inference:
    """Build the pipeline from a checkpoint folder's ``pipeline.yaml`` and run image + mask -> 3D object.

    ``device`` / ``low_memory`` (ours) override the yaml unless "auto"; by default the backends default device is
    used (cuda > mps > cpu) unless the yaml names one, and low-memory mode is on for CPU/MPS. ``compile`` replaces
    the yaml's ``compile_model`` (as upstream): True compiles the dense models with torch.compile where the device
    supports it (one warning and eager execution elsewhere). ``noise_device="cpu"`` (ours) draws the sampling
    noise on the CPU so that a seed gives the same object on every device; "device" the model's device
    (upstream); "auto" keeps the yaml's setting, which is "device" unless it names one (the spellings:
    ``sam3d_objects.pipeline.run_options``).
    ``weights`` (ours): "default" (the checkpoint's), "int8" or "bf16" stores the large transformers' linear
    weights in that format as they load (``sam3d_objects.pipeline.weights``: a quarter / half of their memory).
    ``dtype`` (ours): replaces the yaml's ``dtype``, the half type the condition and sampling stages run under
    (autocast): "auto" keeps the yaml's (float16: used on CUDA; the CPU, where float16 is slow, stays float32);
    "bfloat16" also runs them in bfloat16 on the CPU (matmuls and attention; about 2.5x faster sampling where
    the CPU has AVX-512 BF16 or AMX, with outputs that differ from float32's as upstream's half-precision CUDA
    runs do), and the mesh / Gaussian decoders' torsos in bfloat16 (upstream's float16 torsos on CUDA; their
    output layers and the mesh extraction stay float32); "float32" turns autocast off everywhere.
    """

    def __init__(self, config_file: Union[str, Path], compile: bool = False, device: Optional[str] = "auto",
                 low_memory: Union[bool, str, None] = "auto", noise_device: Optional[str] = "auto",
                 weights: Optional[str] = "default", dtype: Optional[str] = "auto"):
        from sam3d_objects.pipeline.weights import check_weights
        weights = check_weights(weights)  # a typo fails before anything is read
        dtype = check_sampling_dtype(dtype)
        device = None if device == "auto" else device
        low_memory = None if low_memory == "auto" else low_memory
        noise_device = resolve_noise_device(noise_device, inherited=None)  # None: the yaml's (set below if not)
        config_file = Path(config_file)
        check_device(device)  # before reading gigabytes: the cheapest checks first
        check_checkpoint_folder(config_file)  # every yaml and checkpoint, even those low-memory mode loads later
        config = load_config(config_file)
        check_device(config.get("device") if device is None else device)
        config.rendering_engine = "pytorch3d"
        config.compile_model = bool(compile)  # the API argument wins over the yaml's compile_model
        if noise_device is not None:
            config.noise_device = noise_device
        config.workspace_dir = str(config_file.absolute().parent)  # the yaml's folder, not its link target
        if device not in (None, "auto"):
            config.device = device
        if low_memory not in (None, "auto"):
            config.low_memory = low_memory
        if weights != "default":
            config.weights = weights
        if dtype is not None:
            config.dtype = dtype
            if config.get("shape_model_dtype") is not None:  # a yaml that sets stage 1's apart: both follow
                config.shape_model_dtype = dtype
        check_targets(config)
        if config.get("depth_model") is not None:
            # build the depth network lazily (first use): no download unless a point map must be estimated
            config.depth_model._recursive_ = False
        try:
            self._pipeline = safe_instantiate(config)
        except Exception as e:  # noqa: BLE001  hydra wraps the constructor's error: surface the clear one
            cause = e.__cause__ if type(e).__name__ == "InstantiationException" else None
            if cause is not None:
                raise cause from None
            raise

    @classmethod
    def from_pretrained(cls, repo_id: str = "facebook/sam-3d-objects", revision: Optional[str] = None,
                        cache_dir: Optional[str] = None, token: Optional[str] = None,
                        local_files_only: bool = False, **kwargs) -> "Inference":
        """(ours) ``Inference`` from a Hugging Face repo id, or a local folder / pipeline.yaml. The repo's yamls and
        the checkpoints its pipeline.yaml names are fetched into the standard Hugging Face cache (``revision``: a
        branch, tag or commit; ``token`` or ``HF_TOKEN`` / ``hf auth login``; ``HF_HUB_OFFLINE=1`` or
        ``local_files_only``: the cache only) and loaded through the same checks as any folder. ``kwargs`` go to
        ``Inference(...)`` (``compile``, ``device``, ``low_memory``, ``noise_device``, ``weights``). A gated or missing repo
        raises ``sam3d_objects.hub.HubError`` naming the licence page and ``hf auth login``."""
        from sam3d_objects.hub import download_checkpoint, looks_like_repo_id
        if looks_like_repo_id(repo_id):
            config = download_checkpoint(repo_id, revision=revision, cache_dir=cache_dir, token=token,
                                         local_files_only=local_files_only)
        else:
            path = Path(repo_id).expanduser()
            config = path if path.suffix in (".yaml", ".yml") else path / "pipeline.yaml"
        return cls(config, **kwargs)

    @property
    def pipeline(self):
        return self._pipeline

    def merge_mask_to_rgba(self, image, mask) -> np.ndarray:
        return merge_mask_into_alpha(image, mask)

    def __call__(self, image, mask, seed: Optional[int] = None, pointmap=None, **run_options) -> Dict[str, Any]:
        """``run_options`` (ours) replace the notebook's run keywords (``NOTEBOOK_RUN_OPTIONS``), e.g. fast mode:
        ``use_stage1_distillation=True, use_stage2_distillation=True, stage1_inference_steps=4``, or
        ``noise_device="cpu"``; ``preset="fast" | "balanced" | "quality"`` sets the distillation flags and steps
        (``sam3d_objects.presets``; other run options given with it win); ``options=RunOptions(...)`` replaces
        the notebook's keywords as a whole (``seed``, when given, still wins). ``seed=None`` (upstream's
        default): no seeding, the noise comes from the global generator."""
        check_run_inputs(image, mask, pointmap)
        options = self.run_options(seed, **run_options)
        check_run_options(options.seed, stage1_inference_steps=options.stage1_inference_steps,
                          stage2_inference_steps=options.stage2_inference_steps,
                          decode_formats=options.decode_formats)
        rgba = self.merge_mask_to_rgba(image, mask)
        return self._pipeline.run(rgba, None, pointmap=pointmap, **options.keywords(self._pipeline.run))

    @staticmethod
    def run_options(seed: Optional[int] = None, options: Optional[RunOptions] = None, preset: Optional[str] = None,
                    **run_options) -> RunOptions:
        """(ours) The ``RunOptions`` of ``__call__(image, mask, seed, **run_options)``: the notebook's keywords,
        then the preset's, then the given ones (``options`` in place of the notebook's), then ``seed``."""
        base = NOTEBOOK_RUN_OPTIONS if options is None else options
        if preset is not None:
            from sam3d_objects import presets
            base = base.replace(**presets.run_options(preset))
        base = base.replace(**run_options)
        if options is None or seed is not None:
            base = base.replace(seed=seed)
        return base


# ----------------------------------------------------------------------------------------------------------------
# loading inputs
# ----------------------------------------------------------------------------------------------------------------
def _open_image(path: Union[str, Path]):
    """The decoded ``PIL.Image`` (EXIF orientation applied); FileNotFoundError / ValueError name the file."""
    from sam3d_objects.utils.images import open_image
    return open_image(path)


def load_image(path: Union[str, Path]) -> np.ndarray:
    """uint8 [H, W, 3] (RGB) or [H, W, 4] (RGBA files keep their alpha), as upstream; other Pillow modes (16-bit,
    palette, grey, CMYK) are converted, unusable ones refused (``sam3d_objects.utils.images``)."""
    from sam3d_objects.utils.images import load_image_file
    return load_image_file(path)


def load_mask(path: Union[str, Path]) -> np.ndarray:
    """bool [H, W]: the alpha channel of an RGBA file, else any non-zero pixel."""
    from sam3d_objects.utils.images import load_mask_file
    return load_mask_file(path)


class MaskNotFoundError(FileNotFoundError, AssertionError):
    """A requested mask file is missing (an AssertionError too, as upstream's check raised one)."""


def load_single_mask(folder_path: Union[str, Path], index: int = 0, extension: str = ".png") -> np.ndarray:
    """The mask ``<folder_path>/<index><extension>``."""
    return load_masks(folder_path, [index], extension)[0]


def load_masks(folder_path: Union[str, Path], indices_list: Optional[Sequence[int]] = None,
               extension: str = ".png") -> List[np.ndarray]:
    """Masks ``<index><extension>`` of ``folder_path`` for ``indices_list``, in that order; without indices (None
    or empty) 0, 1, 2, ... up to the first missing file (``[]`` when there is no ``0<extension>``)."""
    folder = Path(folder_path)
    if not indices_list:
        indices_list = []
        while (folder / f"{len(indices_list)}{extension}").is_file():
            indices_list.append(len(indices_list))
    paths = [folder / f"{i}{extension}" for i in indices_list]
    for path in paths:
        if not path.is_file():
            raise MaskNotFoundError(f"Mask path {path} does not exist")
    return [load_mask(path) for path in paths]


# ----------------------------------------------------------------------------------------------------------------
# scene
# ----------------------------------------------------------------------------------------------------------------
def _place_object(output: Dict[str, Any]):
    """Move ``output["gaussian"][0]`` in place from its local frame into the camera (PyTorch3D) frame of the
    image by the decoded pose: p' = (s * p) @ R(q) + t (row vectors, as PyTorch3D's scale -> rotate -> translate
    chain), orientations turned by conj(q), sizes scaled by the (isotropic) scale, kept above 1.1 x the kernel
    size. Returns the gaussian."""
    gs = output["gaussian"][0]
    xyz = gs.get_xyz
    q = torch.as_tensor(output["rotation"]).reshape(1, 4).to(xyz)
    t = torch.as_tensor(output["translation"]).reshape(1, 3).to(xyz)
    s = torch.as_tensor(output["scale"]).reshape(1, 3).to(xyz)
    gs.from_xyz((xyz * s) @ quaternion_to_matrix(q[0]) + t)
    q_conj = q * q.new_tensor([1.0, -1.0, -1.0, -1.0])
    rotation = quaternion_multiply(q_conj, gs.get_rotation)
    gs.from_rotation(torch.where(rotation[:, :1] < 0, -rotation, rotation))  # w >= 0, as PyTorch3D standardizes
    # upstream asserts exact equality (its decoder expands one mean); float noise of a few ulps is tolerated here
    if not torch.allclose(s[0], s[0, :1].expand(3), rtol=1e-5, atol=0):
        raise AssertionError(f"make_scene needs an isotropic object scale, got {s[0].tolist()}")
    scaling = gs.get_scaling * s
    gs.mininum_kernel_size *= float(s[0, 0])
    gs.from_scaling(torch.clamp_min(scaling, 1.1 * gs.mininum_kernel_size))
    return gs


def make_scene(*outputs: Dict[str, Any], in_place: bool = False):
    """One Gaussian holding every object of ``outputs`` (``Inference`` results) placed in the camera frame of the
    image by its pose. Copies the outputs unless ``in_place`` (then the first object's Gaussian is the scene).

    As upstream, the scene keeps the first object's attributes and the smallest kernel size of all objects, and
    concatenates the raw parameters of the others (their sizes are decoded with that kernel size)."""
    if not outputs:
        raise ValueError("make_scene needs at least one output of Inference")
    if not in_place:
        outputs = tuple(copy.deepcopy(o) for o in outputs)
    placed = [_place_object(o) for o in outputs]
    scene = placed[0]
    scene.mininum_kernel_size = min(g.mininum_kernel_size for g in placed)
    for name in ("_xyz", "_features_dc", "_scaling", "_rotation", "_opacity"):
        setattr(scene, name, torch.cat([getattr(g, name) for g in placed], dim=0))
    return scene


def normalized_gaussian(scene_gs, in_place: bool = False, outlier_percentile: Optional[float] = None):
    """Scale and centre ``scene_gs`` so that its opaque gaussians (opacity > 0.9) fit in [-0.5, 0.5]^3 with the
    longest side 1 (bounds: min/max, or the ``outlier_percentile`` and 1 - it quantiles). Without any opaque
    gaussian (e.g. random weights) all gaussians are used, with a warning."""
    gs = scene_gs if in_place else copy.deepcopy(scene_gs)
    xyz, scales = gs.get_xyz, gs.get_scaling
    active = gs.get_opacity.reshape(-1) > 0.9
    if not bool(active.any()):
        # upstream fails on an empty reduction here; the evident intent is a scene-sized box, so use every gaussian
        warnings.warn("normalized_gaussian: no gaussian has an opacity above 0.9; normalizing over all of them")
        active = torch.ones_like(active)
    side = (xyz[active].max(dim=0).values - xyz[active].min(dim=0).values).max()
    xyz, scales = xyz / side, scales / side
    kept = xyz[active]
    if outlier_percentile is None:
        lo, hi = kept.min(dim=0).values, kept.max(dim=0).values
    else:
        lo = torch.quantile(kept, outlier_percentile, dim=0)
        hi = torch.quantile(kept, 1 - outlier_percentile, dim=0)
    gs.from_xyz(xyz - (lo + hi) / 2)
    gs.mininum_kernel_size = gs.mininum_kernel_size / side
    gs.from_scaling(scales)
    return gs


def _fix_gaussian_alignment(scene_gs, in_place: bool = False):
    """Raw positions (x, y, z) -> (-x, z, y): camera frame -> z up with the camera looking along +y. As upstream,
    orientations are left as they are."""
    gs = scene_gs if in_place else copy.deepcopy(scene_gs)
    m = torch.tensor([[-1.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 1.0, 0.0]], dtype=gs._xyz.dtype,
                     device=gs._xyz.device)
    gs._xyz = gs._xyz @ m.T
    return gs


def ready_gaussian_for_video_rendering(scene_gs, in_place: bool = False, fix_alignment: bool = False):
    """A normalized copy of ``scene_gs`` (see :func:`normalized_gaussian`) for :func:`render_video`;
    ``fix_alignment`` first turns the camera frame z-up. The default keeps the camera frame (y up), which the
    y-up orbit of :func:`render_video` expects."""
    if fix_alignment:
        scene_gs = _fix_gaussian_alignment(scene_gs, in_place=in_place)
    return normalized_gaussian(scene_gs, in_place=fix_alignment)


def _yaw_pitch_r_fov_to_extrinsics_intrinsics(yaws, pitchs, rs, fovs, device=None):
    """y-up orbit: eye = r (sin yaw cos pitch, sin pitch, cos yaw cos pitch) looking at the origin."""
    from sam3d_objects.model.backbone.tdfy_dit.utils.render_utils import _orbit_views

    def eye_of(yaw, pitch):
        return torch.stack([torch.sin(yaw) * torch.cos(pitch), torch.sin(pitch), torch.cos(yaw) * torch.cos(pitch)])
    return _orbit_views(yaws, pitchs, rs, fovs, eye_of, (0.0, 1.0, 0.0), device)


def render_video(sample, resolution: int = 512, bg_color=(0, 0, 0), num_frames: int = 300, r: float = 2.0,
                 fov: float = 40, pitch_deg: float = 0, yaw_start_deg: float = -90, **kwargs) -> Dict[str, list]:
    """Orbit around the origin (y up, yaw 0 on +z): {"color": num_frames uint8 [H, W, 3] frames, "depth": [None,
    ...]}. Yaws span 360 deg from ``yaw_start_deg`` with the endpoint included (the last frame repeats the first).
    kwargs go to ``render_utils.render_frames`` (``verbose``, ``colors_overwrite``)."""
    from sam3d_objects.model.backbone.tdfy_dit.utils.render_utils import _sample_device, render_frames
    check_render_options(num_frames, resolution, r, fov)
    yaws = (torch.linspace(0, 2 * math.pi, num_frames) + math.radians(yaw_start_deg)).tolist()
    pitchs = [math.radians(pitch_deg)] * num_frames
    extr, intr = _yaw_pitch_r_fov_to_extrinsics_intrinsics(yaws, pitchs, r, fov, _sample_device(sample))
    return render_frames(sample, extr, intr, {"resolution": resolution, "bg_color": bg_color, "backend": "gsplat"},
                         **kwargs)


# ----------------------------------------------------------------------------------------------------------------
# hydra safety (upstream's filters; the pipeline itself is built through config.instantiate.safe_instantiate)
# ----------------------------------------------------------------------------------------------------------------
def _whitelisted_module(target: str) -> bool:
    return target.split(".", 1)[0] in ("sam3d_objects", "torch", "torchvision", "moge")


def _dangerous_callables() -> tuple:
    """Upstream's list (process, file and import primitives), plus the loaders and writers a config could use to
    run a pickle or plant a file."""
    import builtins
    import os
    import pathlib
    import pickle
    import shutil
    import subprocess
    os_names = ("kill", "system", "putenv", "remove", "removedirs", "rmdir", "fchdir", "setuid", "fork", "forkpty",
                "killpg", "rename", "renames", "truncate", "replace", "unlink", "fchmod", "fchown", "chmod", "chown",
                "chroot", "lchown", "getcwd", "chdir", "popen", "execv", "execve", "execl", "execvp", "spawnv",
                "spawnl", "posix_spawn", "open", "write", "makedirs", "mkdir", "symlink", "link", "walk", "listdir")
    found = [getattr(builtins, n) for n in ("exec", "eval", "__import__", "help", "open", "compile", "getattr",
                                            "setattr", "delattr", "breakpoint", "input", "globals", "vars")]
    found += [getattr(os, n) for n in os_names if hasattr(os, n)]  # some do not exist on every platform
    found += [shutil.rmtree, shutil.move, shutil.chown, shutil.copy, shutil.copy2, shutil.copyfile,
              shutil.copytree, subprocess.Popen, subprocess.run, subprocess.call, subprocess.check_call,
              subprocess.check_output, pickle.load, pickle.loads]
    found += [getattr(pathlib.Path, n) for n in ("write_text", "write_bytes", "unlink", "rename", "replace",
                                                 "touch", "mkdir", "symlink_to", "rmdir", "chmod", "open")]
    try:
        import torch
        found += [torch.load, torch.save, torch.hub.load, torch.hub.load_state_dict_from_url, torch.jit.load]
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    try:
        import numpy
        found += [numpy.load, numpy.save, numpy.savez, numpy.fromfile]
    except ImportError:  # pragma: no cover
        pass
    return tuple(found)


# modules of the whitelisted packages whose objects read, write or run things (never a model part)
_DANGEROUS_MODULES = ("torch.serialization", "torch.hub", "torch.jit", "torch.package", "torch.utils.cpp_extension",
                      "torch.utils.model_zoo", "torch.multiprocessing", "torch.distributed", "torch.library",
                      "torch.utils.data", "torch._", "torch.ops", "torch.classes", "torch.compiler")


def _resolves_to_dangerous(target: str) -> bool:
    """Resolve the target like hydra does and compare with dangerous callables (catches re-exports such as
    ``torch.os.system``). Stricter than upstream's list: the object must also be *defined* in a whitelisted
    package (``sam3d_objects.reconstruction.shutil.rmtree`` is shutil's), outside its loader / process modules, and be a
    class unless the released configs name it (``safety.REGISTERED_TARGETS``): functions such as
    ``sam3d_objects.cli.main`` or ``torch.load`` are refused. Without an importable torchvision,
    ``torchvision.transforms.*`` targets resolve to the classes ``Inference`` instantiates in their place
    (``config.instantiate``), not to an ImportError."""
    import inspect

    from hydra.utils import get_method

    from sam3d_objects.config.instantiate import TORCHVISION_TRANSFORMS, own_transform_target, torchvision_imports
    from sam3d_objects.config.safety import REGISTERED_TARGETS
    if target.startswith(TORCHVISION_TRANSFORMS) and not torchvision_imports():
        target = own_transform_target(target)
    obj = get_method(target)
    if any(obj is bad for bad in _dangerous_callables()):
        return True
    module = str(getattr(obj, "__module__", None) or "")
    if module.split(".")[0] not in ("sam3d_objects", "torch", "torchvision", "moge"):
        return True
    if module.startswith(_DANGEROUS_MODULES):
        return True
    if target in REGISTERED_TARGETS or _own_target(target):
        return False
    if not inspect.isclass(obj):
        return True
    return module.startswith("torchvision.") and not module.startswith("torchvision.transforms")


def _own_target(target: str) -> bool:
    """A class of sam3d_objects.data.transforms that stands in for a registered torchvision transform."""
    from sam3d_objects.config.instantiate import OWN_TRANSFORMS, TORCHVISION_TRANSFORMS
    from sam3d_objects.config.safety import REGISTERED_TARGETS
    return target.startswith(OWN_TRANSFORMS) and \
        TORCHVISION_TRANSFORMS + target[len(OWN_TRANSFORMS):] in REGISTERED_TARGETS


WHITELIST_FILTERS = [_whitelisted_module]
BLACKLIST_FILTERS = [_resolves_to_dangerous]


def check_target(target: str, whitelist_filters, blacklist_filters) -> None:
    """Raise RuntimeError unless some whitelist predicate accepts ``target`` and no blacklist predicate does."""
    if any(f(target) for f in whitelist_filters) and not any(f(target) for f in blacklist_filters):
        return None
    raise RuntimeError(f"target '{target}' is not allowed to be hydra instantiated, if this is a mistake, please "
                       f"do modify the whitelist_filters / blacklist_filters")


def check_hydra_safety(config, whitelist_filters, blacklist_filters) -> None:
    """Check every ``_target_`` of an OmegaConf tree with :func:`check_target` (values are resolved). Stricter than
    upstream: a config using a resolver (``${oc.env:...}``, ``${oc.create:...}``) is refused before any value is
    read, so nothing is created or read from the environment while checking."""
    from omegaconf import DictConfig, ListConfig

    from sam3d_objects.config.safety import UnsafeConfigError, check_no_resolvers
    if isinstance(config, (DictConfig, ListConfig)):
        try:
            check_no_resolvers(config)
        except UnsafeConfigError as e:
            raise RuntimeError(f"config is not allowed to be hydra instantiated: {e}") from None
    stack = [config]
    while stack:
        node = stack.pop()
        if isinstance(node, DictConfig):
            stack.extend(node[k] for k in node.keys())
            if "_target_" in node:
                check_target(node["_target_"], whitelist_filters, blacklist_filters)
        elif isinstance(node, ListConfig):
            stack.extend(node[i] for i in range(len(node)))


# ----------------------------------------------------------------------------------------------------------------
# display (optional extras: matplotlib, gradio)
# ----------------------------------------------------------------------------------------------------------------
def _palette(n: int) -> List[Tuple[float, float, float]]:
    """``n`` evenly spaced hues (upstream uses seaborn's husl palette; any distinct colours serve)."""
    import colorsys
    return [colorsys.hls_to_rgb(i / max(n, 1), 0.6, 0.75) for i in range(n)]


def _mask_panels(image: np.ndarray, masks: Sequence[np.ndarray]):
    """(black, coloured masks, image * union of masks) panels of upstream's 2x2 figure."""
    rgb = np.asarray(image)[..., :3]
    black = np.zeros(rgb.shape, dtype=np.float32)
    coloured = np.zeros(rgb.shape, dtype=np.float32)
    union = np.zeros(rgb.shape, dtype=rgb.dtype)
    for colour, mask in zip(_palette(len(masks)), masks):
        m = np.asarray(mask).astype(bool)
        coloured[m] = colour
        union[m] = 1
    return black, coloured, rgb * union


def display_image(image: np.ndarray, masks: Optional[Sequence[np.ndarray]] = None):
    """Show ``image`` (and, with ``masks``, the masks coloured and the masked image, in a 2x2 grid) with
    matplotlib. Without matplotlib it returns the same layout as a PIL image (notebooks display it)."""
    panels = [np.asarray(image)] if masks is None else [np.asarray(image), *_mask_panels(image, masks)]
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        return _panels_as_pil(panels)
    rows, cols = (1, 1) if masks is None else (2, 2)
    fig, axes = plt.subplots(rows, cols)
    for ax, panel in zip(np.atleast_1d(axes).ravel(), panels):
        ax.imshow(panel)
        ax.axis("off")
    fig.tight_layout(pad=0)
    fig.show()
    return None


def _to_uint8(panel: np.ndarray) -> np.ndarray:
    if panel.dtype == np.uint8:
        return panel
    return (np.clip(panel.astype(np.float32), 0, 1) * 255).astype(np.uint8)


def _panels_as_pil(panels: Sequence[np.ndarray]):
    from PIL import Image
    images = [Image.fromarray(_to_uint8(np.asarray(p))).convert("RGB") for p in panels]
    if len(images) == 1:
        return images[0]
    w, h = images[0].size
    grid = Image.new("RGB", (2 * w, 2 * h))
    for i, im in enumerate(images):
        grid.paste(im.resize((w, h)), ((i % 2) * w, (i // 2) * h))
    return grid


def interactive_visualizer(ply_path: Union[str, Path], share: bool = False, **launch_kwargs):
    """Serve the splat ``ply_path`` in a gradio ``Model3D`` viewer on this machine only (127.0.0.1). Upstream
    launched with ``share=True``, a public link to the caller's machine; here ``share=True`` (ours) must be asked
    for. ``launch_kwargs`` go to ``gradio.Blocks.launch``. Needs gradio: ``make extras EXTRAS=notebook`` in the
    clone (or ``pip install gradio``)."""
    try:
        import gradio as gr
    except ImportError as e:
        raise ImportError("interactive_visualizer needs gradio: `make extras EXTRAS=notebook` in the clone (or "
                          "pip install gradio)") from e
    with gr.Blocks() as demo:
        gr.Markdown("# 3D Gaussian Splatting (black-screen loading might take a while)")
        gr.Model3D(value=str(ply_path), label="3D Scene")
    launch_kwargs.setdefault("server_name", "127.0.0.1")
    demo.launch(share=share, **launch_kwargs)
    return demo
