"""The library under the command line: checkpoint lookup, input reading and checks, progress bars, the
reconstruction of each masked object and the writing of its files (staged, then published whole), the run summary.

``sam3d_objects.cli`` (the ``reconstruct`` subcommand), ``sam3d_objects.batch`` and ``sam3d_objects.app`` are built
on these functions; none of them is imported here, so the subcommands and the entry point stay free of import
cycles. ``sam3d_objects.cli`` re-exports every public name (``from sam3d_objects.cli import reconstruct`` works).
Failures are ``UserError``s carrying the CLI's exit codes (``sam3d_objects.errors``).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from sam3d_objects.errors import EXIT_CHECKPOINT, EXIT_RUN, UserError
from sam3d_objects.paths import default_tiny_dir, repo_root  # noqa: F401  (default_tiny_dir: cli, app)
from sam3d_objects.pipeline.run_options import DEFAULT_SEED, NOISE_AUTO, NOISE_ON_CPU, NOTEBOOK_RUN_OPTIONS, RunOptions

FORMATS = ("gaussian", "mesh", "gaussian_4", "obj", "stl")
MESH_EXPORTS = ("obj", "stl")  # not decoders: trimesh exports of the mesh (they imply "mesh")
CHECKPOINT_ENV = "SAM3D_CHECKPOINTS"
OFFICIAL_SUBDIR = Path("checkpoints") / "hf"
STAGE_ORDER = ("preprocess", "ss_condition", "ss_sampling", "ss_decoding", "slat_condition", "slat_sampling",
               "decode_mesh", "decode_gaussian", "decode_gaussian_4")


# ----------------------------------------------------------------------------------------------------------------
# signals and broken pipes
# ----------------------------------------------------------------------------------------------------------------
class Terminated(KeyboardInterrupt):
    """SIGTERM / SIGHUP, handled like Ctrl-C (staging removed, finished objects kept); exit 128 + the signal."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


class SignalGuard:
    """SIGINT, SIGTERM and SIGHUP raise ``KeyboardInterrupt`` / ``Terminated`` where the program is, once: the
    next signal is ignored so the clean-up finishes (a double Ctrl-C leaves nothing behind either); a third one
    exits at once (a hung shutdown can still be left). Inside
    ``deferred()`` the first signal waits for the end of the block (an object and its summary.json appear
    together). Installed by ``main`` in the main thread only; elsewhere ``deferred`` is a plain block.
    ``delivered`` is the signal whose exception was raised into the program: ``main`` reports the run as ended by
    it even when a library's clean-up turned that exception into another error, or swallowed it. A signal that
    arrives inside importlib's own code is sent again a moment later instead of raising there."""

    SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")
    REDELIVER_S = 0.05

    def __init__(self):
        self.previous: Dict[int, Any] = {}
        self.raised: Optional[int] = None
        self.pending: Optional[int] = None
        self.delivered: Optional[int] = None
        self.resending: Optional[int] = None  # a signal being sent again (_redeliver)
        self._timer: Any = None
        self.depth = 0
        self.ignored = 0

    def install(self) -> None:
        import signal
        import threading
        self.raised = self.pending = self.delivered = self.resending = None
        self.ignored = 0
        if threading.current_thread() is not threading.main_thread():
            return
        for name in self.SIGNALS:
            if hasattr(signal, name):
                number = getattr(signal, name)
                self.previous[number] = signal.signal(number, self._handle)

    def restore(self) -> None:
        import signal
        if self._timer is not None:  # the run ended before a re-sent signal arrived: it is not sent
            self._timer.cancel()
            self._timer = None
        for number, handler in self.previous.items():
            signal.signal(number, handler)
        self.previous.clear()

    @staticmethod
    def exception(signum: int) -> KeyboardInterrupt:
        import signal
        return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)

    def received(self) -> Optional[int]:
        """The signal that ended (or is ending) the run: raised into it, or about to be sent again."""
        return self.delivered or self.resending

    def _handle(self, signum: int, frame) -> None:
        self.resending = None
        if self.raised is not None:
            self.ignored += 1
            if self.ignored >= 2:  # a third signal: the user insists (a hung shutdown); leave at once
                _quiet_print("sam3d-objects: forced exit; a staging folder may remain (the next run into the same "
                             "--out removes it)", file=sys.stderr)
                os._exit(128 + signum)
            _quiet_print("sam3d-objects: still cleaning up, please wait (a third signal forces the exit)",
                         file=sys.stderr)
            return
        if self.depth:
            self.pending = self.pending or signum
            return
        if _in_import_machinery(frame):
            self._redeliver(signum)
            return
        self.raised = self.delivered = signum
        raise self.exception(signum)

    def _redeliver(self, signum: int) -> None:
        """Sends ``signum`` to the main thread again in a moment, from a timer thread (the handler then runs past
        the import machinery's critical section)."""
        import threading
        self.resending = signum
        self._timer = threading.Timer(self.REDELIVER_S, _signal_main_thread, (signum,))
        self._timer.daemon = True  # pure Python, asleep: nothing for the interpreter's exit to interrupt
        self._timer.start()

    @contextmanager
    def deferred(self):
        self.depth += 1
        try:
            yield
        except BaseException:
            self.depth -= 1
            if self.pending is not None and self.raised is None:
                self.raised = self.pending  # the block failed anyway: its error wins, later signals are ignored
            raise
        self.depth -= 1
        if not self.depth and self.pending is not None and self.raised is None:
            self.raised = self.delivered = self.pending
            self.pending = None
            raise self.exception(self.raised)


SIGNALS = SignalGuard()


def _signal_main_thread(signum: int) -> None:
    """``signum`` to the main thread, so that a blocking call there is interrupted as by the original signal (POSIX);
    where threads cannot be signalled (Windows), raised in this process: the handler still runs in the main thread.
    Not ``os.kill``: on Windows that ends the process at once."""
    import signal
    import threading
    if hasattr(signal, "pthread_kill"):
        signal.pthread_kill(threading.main_thread().ident, signum)
    else:
        signal.raise_signal(signum)


def _in_import_machinery(frame) -> bool:
    """Whether the main thread is in importlib's own code (not a module being imported): an exception raised there
    can leave the global import lock held, so that the next import of another thread (the pipeline's preload)
    waits forever, or it is swallowed, where the frame is a module lock's weakref callback ("Exception ignored")."""
    return frame is not None and frame.f_code.co_filename.startswith("<frozen importlib")


def _quiet_print(*args, **kwargs) -> None:
    try:
        print(*args, **kwargs)
    except BrokenPipeError:
        pass


# ----------------------------------------------------------------------------------------------------------------
# checkpoints
# ----------------------------------------------------------------------------------------------------------------
def _pipeline_yaml(path: Path) -> Path:
    return path if path.suffix in (".yaml", ".yml") else path / "pipeline.yaml"


def hub_checkpoint(repo_id: str, revision: Optional[str] = None) -> Path:
    """pipeline.yaml of a Hugging Face repo id, fetched into (or found in) the standard cache (exit 3 if not)."""
    from sam3d_objects.hub import HubError, download_checkpoint
    try:
        return download_checkpoint(repo_id, revision=revision)
    except HubError as e:
        raise UserError(str(e), EXIT_CHECKPOINT) from e


def find_checkpoint(explicit: Optional[str] = None, revision: Optional[str] = None) -> Tuple[Optional[Path], str]:
    """(pipeline.yaml, where it came from) of the weights to use: ``explicit`` (a folder, a pipeline.yaml or a
    Hugging Face repo id such as facebook/sam-3d-objects, at ``revision``), else ``$SAM3D_CHECKPOINTS`` (the same),
    else ``checkpoints/hf/`` in the current directory or the checkout.
    (None, searched places) when nothing is found; an explicit path that does not exist is a UserError."""
    from backends.registry import checkpoints_env
    from sam3d_objects.hub import looks_like_repo_id

    if explicit:
        if looks_like_repo_id(explicit):
            return hub_checkpoint(explicit, revision), f"Hugging Face {explicit}"
        yaml = _pipeline_yaml(Path(explicit).expanduser())
        if not yaml.is_file():
            raise UserError(f"--checkpoints {explicit}: no {yaml.name} there. Point it at the folder holding the "
                            f"released pipeline.yaml and .ckpt files (e.g. checkpoints/hf).", EXIT_CHECKPOINT)
        return yaml, "--checkpoints"
    env = checkpoints_env()
    if env and looks_like_repo_id(env):
        return hub_checkpoint(env, revision), f"${CHECKPOINT_ENV} (Hugging Face {env})"
    if env:
        yaml = _pipeline_yaml(Path(env).expanduser())
        if not yaml.is_file():
            raise UserError(f"${CHECKPOINT_ENV}={env}: no {yaml.name} there (unset it or fix the path)",
                            EXIT_CHECKPOINT)
        return yaml, f"${CHECKPOINT_ENV}"
    candidates = [Path.cwd() / OFFICIAL_SUBDIR]
    root = repo_root()
    if root is not None and root / OFFICIAL_SUBDIR not in candidates:
        candidates.append(root / OFFICIAL_SUBDIR)
    for folder in candidates:
        if (folder / "pipeline.yaml").is_file():
            return folder / "pipeline.yaml", str(folder)
    searched = ", ".join(str(c / "pipeline.yaml") for c in candidates)
    return None, f"--checkpoints, ${CHECKPOINT_ENV}, {searched}"


# ----------------------------------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------------------------------
def read_image(path: str) -> np.ndarray:
    from sam3d_objects.utils.images import load_image_file  # Pillow + numpy only: fails fast, before torch
    try:
        return load_image_file(path)
    except FileNotFoundError as e:
        raise UserError(f"image not found: {path}") from e
    except ValueError as e:
        raise UserError(str(e)) from e


def _mask_folder(path: Path) -> List[Tuple[str, Path]]:
    """(name, file) of every ``<index>.png`` of a folder, in index order (upstream's layout)."""
    found = sorted((int(f.stem), f) for f in path.glob("*.png") if f.stem.isdigit())
    if not found:
        raise UserError(f"mask folder {path} holds no <index>.png mask (0.png, 1.png, ...)")
    return [(f"{path.name}/{i}", f) for i, f in found]


def read_masks(paths: Sequence[str], shape: Tuple[int, int]) -> List[Tuple[str, np.ndarray]]:
    """(name, bool [H, W]) per mask; a folder contributes every ``<index>.png`` in it (upstream's layout)."""
    from sam3d_objects.utils.images import load_mask_file
    files: List[Tuple[str, Path]] = []
    for p in paths:
        path = Path(p)
        files += _mask_folder(path) if path.is_dir() else [(path.stem, path)]
    import warnings
    masks = []
    for name, path in files:
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                masks.append((name, load_mask_file(path)))
            for w in caught:
                print(f"sam3d-objects: warning: {w.message}", file=sys.stderr)
        except FileNotFoundError as e:
            raise UserError(f"mask not found: {path}") from e
        except ValueError as e:
            raise UserError(str(e)) from e
    for name, mask in masks:
        if mask.shape != tuple(shape):
            raise UserError(f"mask {name} is {mask.shape[1]}x{mask.shape[0]} (WxH) but the image is "
                            f"{shape[1]}x{shape[0]}: masks must have the image's size")
        if not mask.any():
            raise UserError(f"mask {name} is empty: no pixel selects the object")
    return masks


def flat_pointmap(height: int, width: int, fov_deg: float = 60.0) -> np.ndarray:
    """A fronto-parallel plane at depth 1 seen by a pinhole camera (PyTorch3D frame: x left, y up, z forward).
    Only for plumbing checks without a depth model: shapes are conditioned on a wrong geometry."""
    focal = 0.5 * width / np.tan(np.radians(fov_deg) / 2)
    v, u = np.meshgrid(np.arange(height) + 0.5, np.arange(width) + 0.5, indexing="ij")
    x_cv, y_cv = (u - width / 2) / focal, (v - height / 2) / focal
    return np.stack([-x_cv, -y_cv, np.ones_like(u)], axis=-1).astype(np.float32)


def read_pointmap(spec: Optional[str], shape: Tuple[int, int]) -> Optional[np.ndarray]:
    if spec is None:
        return None
    if spec == "flat":
        return flat_pointmap(*shape)
    path = Path(spec)
    if not path.is_file():
        raise UserError(f"--pointmap {spec}: file not found (give a .npy/.npz [H, W, 3] array or 'flat')")
    expected = (shape[0], shape[1], 3)
    try:
        _check_array_headers(path, expected)
        data = np.load(path)  # allow_pickle=False: a .npy holding Python objects is refused, not executed
        if isinstance(data, np.lib.npyio.NpzFile):
            with data:
                if not data.files:
                    raise ValueError("the .npz holds no array")
                data = data[data.files[0]]
        data = np.asarray(data)
    except (OSError, ValueError, IndexError, TypeError, EOFError) as e:
        raise UserError(f"--pointmap {spec}: cannot read it as a numeric numpy array ({e})") from e
    if data.ndim != 3 or data.shape[-1] != 3:
        raise UserError(f"--pointmap {spec}: expected [H, W, 3] (xyz per pixel), got {data.shape}")
    if data.shape[:2] != tuple(shape):
        raise UserError(f"--pointmap {spec}: {data.shape[1]}x{data.shape[0]} does not match the image "
                        f"{shape[1]}x{shape[0]}")
    import warnings

    from sam3d_objects.validation import check_pointmap_values
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            check_pointmap_values(data, name=f"--pointmap {spec}")
    except (ValueError, TypeError) as e:
        raise UserError(str(e)) from e
    for w in caught:
        print(f"sam3d-objects: warning: {w.message}", file=sys.stderr)
    return data.astype(np.float32)


def _check_array_headers(path: Path, expected: Tuple[int, ...]) -> None:
    """ValueError, before any data is read, when a .npy / .npz member's header does not describe an array of
    ``expected`` shape and real dtype, or claims more bytes than the file holds (a tiny file claiming 10^12
    values would otherwise be allocated for)."""
    import zipfile
    from numpy.lib import format as npy_format

    def check(f, available: int, label: str) -> None:
        version = npy_format.read_magic(f)
        reader = {(1, 0): npy_format.read_array_header_1_0, (2, 0): npy_format.read_array_header_2_0}.get(version)
        if reader is None:
            raise ValueError(f"{label}: unsupported .npy version {version}")
        shape, _, dtype = reader(f)
        if dtype.kind not in "fiu":
            raise ValueError(f"{label}: dtype {dtype} is not real numbers (give float32 xyz)")
        if tuple(shape) != tuple(expected):
            raise ValueError(f"{label}: the array is {tuple(shape)}, expected {tuple(expected)} ([H, W, 3] of the "
                             f"image)")
        if int(np.prod(shape)) * dtype.itemsize > available:
            raise ValueError(f"{label}: its header claims more data than the file holds (truncated?)")

    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            members = [i for i in archive.infolist() if i.filename.endswith(".npy")]
            if not members:
                raise ValueError("the .npz holds no array")
            with archive.open(members[0]) as f:
                check(f, members[0].file_size, members[0].filename)
        return
    with open(path, "rb") as f:
        check(f, path.stat().st_size, path.name)


FAST_STAGE1_STEPS = 4  # --fast: upstream's distilled stage 1 needs only a few shortcut steps


# caps of the options that scale work or memory (a typo of 10^9 steps must not run until the machine swaps)
MAX_STEPS = 1000            # the released yamls use 25 (stage 1) and 25 (stage 2)


def parse_steps(text: Optional[str]) -> Tuple[Optional[int], Optional[int]]:
    if text is None:
        return None, None
    try:
        parts = [int(p) for p in str(text).split(",")]
    except ValueError as e:
        raise UserError(f"--steps {text}: give N (both stages) or N1,N2 (stage 1, stage 2)") from e
    if len(parts) not in (1, 2) or min(parts) < 1:
        raise UserError(f"--steps {text}: give N (both stages) or N1,N2 with positive integers")
    if max(parts) > MAX_STEPS:
        raise UserError(f"--steps {text}: at most {MAX_STEPS} sampling steps (the released model uses 25; more "
                        f"steps only cost time)")
    return (parts[0], parts[-1])


def parse_formats(text: str) -> List[str]:
    formats = [f.strip() for f in text.split(",") if f.strip()]
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        raise UserError(f"--formats {text}: unknown {bad or 'empty'}; choose from {','.join(FORMATS)}")
    return formats


def check_device(name: Optional[str]) -> Optional[str]:
    from sam3d_objects.validation import DeviceUnavailableError, check_device as check
    if name is not None and str(name).split(":")[0].strip().lower() == "meta":
        raise UserError(f"--device {name}: the meta device holds no data (it only plans shapes); use cpu, cuda, "
                        f"cuda:N or mps")
    try:
        check(name)
    except (DeviceUnavailableError, ValueError) as e:
        raise UserError(f"--device {name}: {e}".replace("device='cpu'", "--device cpu")) from e
    return name


def check_environment(device: Optional[str]) -> None:
    """UserError (exit 2) for settings of the environment that would fail mid-run: ``$SAM3D_DEVICE`` naming no
    usable device, a backend variable (``SPARSE_BACKEND``, ``ATTN_BACKEND``, ``SPARSE_ATTN_BACKEND``, ...) naming
    an unknown backend or one that cannot run on the device."""
    import torch

    from backends import device as devices
    from backends.registry import BackendUnavailableError, Family, env_value, requested, resolve
    chosen = env_value("SAM3D_DEVICE")
    if device is None and chosen:
        try:
            check_device(chosen)
        except UserError as e:
            raise UserError(f"$SAM3D_DEVICE={chosen}: {str(e).split(': ', 1)[-1]} (or unset it)") from None
    try:
        dev = torch.device(device) if device else devices.default_device()
    except (RuntimeError, ValueError) as e:
        raise UserError(f"device {device or chosen!r} is not a torch device ({e}); use cpu, cuda or mps") from None
    for family in Family:
        try:
            requested(family)
            resolve(family, dev)
        except ValueError as e:
            raise UserError(f"{e}; fix or unset the environment variable") from None
        except BackendUnavailableError as e:
            raise UserError(f"{e}; or unset the environment variable") from None


def check_out_dir(path: str) -> Path:
    from sam3d_objects.validation import check_output_dir
    try:
        check_output_dir(path)
    except ValueError as e:
        raise UserError(f"--out {path}: {e}") from e
    return Path(path)


# what a run writes into --out (a one-object run) or into --out/object_<i>/ (several)
OUTPUT_NAMES = ("splat.ply", "splat_4.ply", "mesh.glb", "mesh.obj", "mesh.stl", "pose.json", "preview.png",
                "mesh_preview.png", "turntable.gif", "turntable.mp4", "summary.json", "scene.ply")


def check_inputs_not_overwritten(inputs: Sequence[Optional[str]], out_dir: Path) -> None:
    """UserError when an input file lies where the run writes (``<out>/preview.png``, anything in
    ``<out>/object_<i>/``): it would be replaced without warning."""
    out = Path(out_dir).expanduser().resolve()
    for given in inputs:
        if not given or given in ("flat", "auto"):
            continue
        path = Path(given).expanduser().resolve()
        files = sorted(path.glob("*.png")) if path.is_dir() else [path]
        for f in files:
            try:
                rel = f.relative_to(out)
            except ValueError:
                continue
            if (len(rel.parts) == 1 and rel.name in OUTPUT_NAMES) or \
                    (len(rel.parts) > 1 and rel.parts[0].startswith("object_")):
                raise UserError(f"input {given} lies where this run writes its outputs ({out}/{rel}) and would "
                                f"be overwritten; move it, or choose another --out")


def check_checkpoint_folder(config: Path) -> None:
    """Every yaml and checkpoint file pipeline.yaml names, in seconds, before any model is built (exit 3)."""
    from sam3d_objects.pipeline.checkpoint import CheckpointError
    from sam3d_objects.validation import ConfigError, check_checkpoint_folder as check
    try:
        check(config)
    except ConfigError as e:
        raise UserError(f"unusable configuration: {e}", EXIT_CHECKPOINT) from e
    except (FileNotFoundError, CheckpointError) as e:
        raise UserError(str(e), EXIT_CHECKPOINT) from e


def input_warnings(image: np.ndarray, masks: Sequence[Tuple[str, np.ndarray]], pointmap: Optional[np.ndarray],
                   log: Callable = print):
    """Warn about tiny masks and downscale images far above the model's input size early (preprocessing time
    grows with the pixel count; the model sees a 518 px crop either way). Returns (image, masks, pointmap)."""
    import warnings

    from sam3d_objects.validation import LARGE_IMAGE_SIDE, check_mask, downscale_inputs, large_image_message
    height, width = image.shape[:2]
    if max(height, width) > LARGE_IMAGE_SIDE:
        image, small, pointmap = downscale_inputs(image, [m for _, m in masks], pointmap, LARGE_IMAGE_SIDE)
        masks = [(name, m) for (name, _), m in zip(masks, small)]
        log(f"sam3d-objects: warning: {large_image_message(height, width)} Downscaled to "
            f"{image.shape[1]}x{image.shape[0]} first.")
    with warnings.catch_warnings(record=True) as caught:  # the masks the model will see (after downscaling)
        warnings.simplefilter("always")
        for name, mask in masks:
            check_mask(mask, image.shape[:2], name=f"mask {name}")
    for w in caught:
        log(f"sam3d-objects: warning: {w.message}")
    return image, masks, pointmap


# ----------------------------------------------------------------------------------------------------------------
# progress
# ----------------------------------------------------------------------------------------------------------------
class Progress:
    """tqdm bars for the pipeline's stages (its ``stage_hook``) and for every sampling step (a global forward
    pre-hook that watches the samplers' ``reverse_fn``; removed when the run ends)."""

    def __init__(self, pipeline, formats: Sequence[str], enabled: bool = True, label: str = ""):
        self.pipeline, self.enabled, self.label = pipeline, enabled, label
        decode = [f"decode_{f}" for f in ("mesh", "gaussian", "gaussian_4") if f in formats]
        self.expected = [s for s in STAGE_ORDER if not s.startswith("decode_")] + decode
        self._stage_bar = self._step_bar = None
        self._reverse_fns: Dict[int, Any] = {}

    def _on_stage(self, stage: str, event: str) -> None:
        if self._stage_bar is None:
            return
        if event == "start":
            if stage not in self.expected:  # a stage this run adds (mesh post-processing, ...): grow the total
                self.expected.append(stage)
                self._stage_bar.total = len(self.expected)
                self._stage_bar.refresh()
            self._stage_bar.set_postfix_str(stage)
        else:
            self._stage_bar.update(1)
            if self._step_bar is not None:
                self._step_bar.close()
                self._step_bar = None

    def _on_forward(self, module, args) -> None:
        from sam3d_objects.model.backbone.generator.flow_matching.model import FlowMatching
        if isinstance(module, FlowMatching):
            from tqdm.auto import tqdm
            self._reverse_fns[id(module.reverse_fn)] = module
            if self._step_bar is not None:
                self._step_bar.close()
            name = "stage 1 steps" if type(module).__name__ == "ShortCut" else "stage 2 steps"
            self._step_bar = tqdm(total=int(module.inference_steps), desc=f"  {name}", unit="step", leave=False,
                                  position=1, file=sys.stderr, dynamic_ncols=True)
        elif id(module) in self._reverse_fns and self._step_bar is not None:
            self._step_bar.update(1)

    @contextmanager
    def __call__(self):
        if not self.enabled:
            yield
            return
        import torch
        from tqdm.auto import tqdm
        self._stage_bar = tqdm(total=len(self.expected), desc=f"{self.label}stages", unit="stage", position=0,
                               file=sys.stderr, dynamic_ncols=True)
        previous = getattr(self.pipeline, "stage_hook", None)
        self.pipeline.stage_hook = self._on_stage
        handle = torch.nn.modules.module.register_module_forward_pre_hook(self._on_forward)
        try:
            yield
            self._stage_bar.total = self._stage_bar.n  # a finished run ends at 100% (stages it skipped)
        finally:
            handle.remove()
            self.pipeline.stage_hook = previous
            if self._step_bar is not None:
                self._step_bar.close()
            self._stage_bar.close()
            self._stage_bar = self._step_bar = None


# ----------------------------------------------------------------------------------------------------------------
# reconstruction
# ----------------------------------------------------------------------------------------------------------------
def _fmt_bytes(n: Optional[int]) -> str:
    if not n:
        return "n/a"
    return f"{n / 2 ** 30:.2f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.0f} MiB"


def pose_dict(output: Dict[str, Any]) -> Dict[str, Any]:
    def flat(key):
        value = output.get(key)
        if value is None:
            return None
        return [float(x) for x in np.asarray(value.detach().cpu() if hasattr(value, "detach") else value).ravel()]
    return {
        "frame": "PyTorch3D camera frame of the input image: x left, y up, z forward (object points p map to "
                 "(scale * p) @ R + translation with R = quaternion_to_matrix(rotation))",
        "translation": flat("translation"), "rotation_wxyz": flat("rotation"), "scale": flat("scale"),
        "downsample_factor": int(output.get("downsample_factor", 1)),
        "num_voxels": int(output["coords"].shape[0]) if output.get("coords") is not None else None,
    }


def _non_finite(value: Any) -> int:
    if value is None:
        return 0
    if hasattr(value, "detach"):
        value = value.detach()
        return int((~value.isfinite()).sum()) if value.is_floating_point() or value.is_complex() else 0
    array = np.asarray(value)
    return int((~np.isfinite(array)).sum()) if array.dtype.kind in "fc" else 0


def check_finite_outputs(output: Dict[str, Any], name: str) -> None:
    """UserError (exit 4) when a decoded object or its pose holds NaN / infinite values: such files would be
    silently unusable (a splat.ply of NaN gaussians, ``Infinity`` in pose.json, which is not JSON)."""
    problems = []
    for key in ("translation", "rotation", "scale"):
        if _non_finite(output.get(key)):
            problems.append(f"pose {key}")
    for key in ("gs", "gs_4"):
        gaussians = output.get(key)
        if gaussians is not None:
            bad = sum(_non_finite(v) for v in vars(gaussians).values() if hasattr(v, "detach"))
            if bad:
                problems.append(f"{bad} values of the gaussians ({key})")
    mesh = output.get("glb")
    if mesh is not None and _non_finite(getattr(mesh, "vertices", None)):
        problems.append("mesh vertices")
    if problems:
        raise UserError(f"object {name}: the result holds NaN/infinite values ({', '.join(problems)}); nothing was "
                        f"written for it. Check the checkpoint (download it again) and the point map / mask, or "
                        f"try another --seed", EXIT_RUN)


def save_object(output: Dict[str, Any], folder: Path, image: np.ndarray, mask: np.ndarray, meta: Dict[str, Any],
                turntable_frames: int = 0, preview_resolution: int = 256, log: Callable = print,
                progress: bool = False, mesh_formats: Sequence[str] = (), mesh_preview: bool = False,
                turntable_format: str = "gif", name: Optional[str] = None) -> List[Path]:
    """splat.ply (splat_4.ply for the gaussian_4 decoder), mesh.glb, pose.json, preview.png (+ a turntable) of one
    object. ``name`` is how messages call the object (``folder`` may be a temporary folder)."""
    from PIL import Image
    check_finite_outputs(output, name or folder.name)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    if output.get("gs") is not None:
        output["gs"].save_ply(str(folder / "splat.ply"))
        written.append(folder / "splat.ply")
    if output.get("gs_4") is not None:
        output["gs_4"].save_ply(str(folder / "splat_4.ply"))
        written.append(folder / "splat_4.ply")
    if output.get("glb") is not None:
        output["glb"].export(str(folder / "mesh.glb"))
        written.append(folder / "mesh.glb")
        if mesh_formats or mesh_preview:
            from sam3d_objects.model.backbone.tdfy_dit.utils.postprocessing_utils import export_mesh_extras
            written += export_mesh_extras(output["glb"], folder, mesh_formats, preview=mesh_preview)
    (folder / "pose.json").write_text(json.dumps({**pose_dict(output), **meta}, indent=2, allow_nan=False) + "\n")
    written.append(folder / "pose.json")
    gaussians = output.get("gs") if output.get("gs") is not None else output.get("gs_4")
    if gaussians is not None:
        from sam3d_objects.render import preview_image, turntable
        Image.fromarray(preview_image(gaussians, image, mask, resolution=preview_resolution)).save(
            folder / "preview.png")
        written.append(folder / "preview.png")
        if turntable_frames:
            frames = turntable(gaussians, num_frames=turntable_frames, resolution=min(preview_resolution, 192),
                               progress=progress)
            written.append(save_turntable(frames, folder / f"turntable.{turntable_format}"))
    else:
        log(f"object {name or folder.name}: no gaussians decoded (--formats without 'gaussian' or 'gaussian_4'): "
            f"no splat.ply / preview.png")
    return written


TURNTABLE_FORMATS = ("gif", "mp4")


def save_turntable(frames: Sequence[np.ndarray], path: Path, fps: int = 12) -> Path:
    """``turntable.gif`` (Pillow) or ``turntable.mp4`` (H.264 through imageio-ffmpeg: the `video` extra)."""
    from sam3d_objects.render import save_gif
    if path.suffix == ".gif":
        return save_gif(frames, path, fps=fps)
    try:
        import imageio.v2 as imageio
        import imageio_ffmpeg  # noqa: F401  the writer's ffmpeg binary
    except ImportError as e:
        raise UserError("--turntable-format mp4 needs imageio and imageio-ffmpeg: `make extras EXTRAS=video` in the "
                        "clone (or pip install imageio imageio-ffmpeg)") from e
    # macro_block_size=1 keeps the frame size as rendered (even sizes: the turntable's are)
    with imageio.get_writer(str(path), fps=fps, codec="libx264", quality=7, macro_block_size=1,
                            ffmpeg_log_level="error", pixelformat="yuv420p") as writer:
        for frame in frames:
            writer.append_data(np.ascontiguousarray(np.asarray(frame)[..., :3]))
    return path


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` then rename over ``path``: readers never see a half-written file."""
    tmp = path.with_name(f".{path.name}.partial")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


STAGING_PREFIX = ".sam3d-staging-"  # + <pid>-<random>: the folder a run writes each object into first


def write_summary(out_dir: Path, summary: Dict[str, Any]) -> None:
    _write_atomic(out_dir / "summary.json",
                  lambda p: p.write_text(json.dumps(summary, indent=2, default=str) + "\n"))


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # someone else's process: leave its folder alone
    return True


def remove_stale_staging(out_dir: Path, log: Callable = print) -> List[Path]:
    """Remove the staging folders of runs into ``out_dir`` that were killed (SIGKILL, power loss): their owner
    process no longer exists. A running process's folder is left alone."""
    removed = []
    for folder in out_dir.glob(f"{STAGING_PREFIX}*"):
        pid_text = folder.name[len(STAGING_PREFIX):].split("-", 1)[0]
        if not folder.is_dir() or not pid_text.isdigit() or _process_alive(int(pid_text)):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    if removed:
        log(f"removed {len(removed)} unfinished staging folder(s) of an earlier, killed run in {out_dir}")
    return removed


def publish(staged: Path, target: Path, single: bool, trash: Path) -> List[Path]:
    """Move a complete object folder into place. ``single``: its files go straight into ``target`` (the --out of
    a one-object run, which may hold other files); else it replaces ``target`` (an old object_<i> goes to
    ``trash`` first, so the new one appears whole)."""
    if single:
        target.mkdir(parents=True, exist_ok=True)
        moved = []
        for f in sorted(staged.iterdir()):
            os.replace(f, target / f.name)
            moved.append(target / f.name)
        return moved
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        os.replace(target, trash)
    os.replace(staged, target)
    return sorted(target.iterdir())


def run_options(seed: Optional[int] = DEFAULT_SEED, steps: Tuple[Optional[int], Optional[int]] = (None, None),
                formats: Optional[Sequence[str]] = None, fast: bool = False) -> RunOptions:
    """The pipeline's ``RunOptions`` of a CLI run: upstream's notebook keywords (raw mesh with vertex colours,
    layout refinement) with the seed, the (stage 1, stage 2) steps, the decoders and fast mode given."""
    return NOTEBOOK_RUN_OPTIONS.replace(seed=seed, stage1_inference_steps=steps[0], stage2_inference_steps=steps[1],
                                        decode_formats=None if formats is None else list(formats),
                                        use_stage1_distillation=fast, use_stage2_distillation=fast)


def reconstruct(config: Path, image: np.ndarray, masks: Sequence[Tuple[str, np.ndarray]], out_dir: Path,
                pointmap: Optional[np.ndarray] = None, device: Optional[str] = None, seed: int = DEFAULT_SEED,
                steps: Tuple[Optional[int], Optional[int]] = (None, None), low_memory: Optional[bool] = None,
                formats: Sequence[str] = ("gaussian", "mesh"), turntable_frames: int = 0,
                random_weights: bool = False, progress: bool = True, log: Callable = print,
                texture: bool = False, simplify: Optional[float] = None, fast: bool = False,
                portable_seed: bool = False, compile: bool = False, bake: Optional[Dict[str, Any]] = None,
                turntable_format: str = "gif", inference=None,
                on_object: Optional[Callable[[int, Dict[str, Any]], None]] = None,
                weights: str = "default", dtype: str = "auto") -> Dict[str, Any]:
    """Run the pipeline once per mask and write every object's files; returns a summary dict. ``fast``:
    upstream's distillation mode in both stages; ``portable_seed``: noise drawn on the CPU (same object for a
    seed on every device); ``compile``: torch.compile the dense models; ``weights``: "default", "int8" or "bf16"
    (the large transformers' linear weights, ``sam3d_objects.pipeline.weights``); ``dtype``: the sampling
    stages' half type ("auto" = the yaml's; "bfloat16" also on the CPU, see ``Inference``).

    Each object is written into a staging folder inside ``out_dir`` (same file system: renames never cross a
    mount point) and moved into place only when complete, so a failure or an interrupt leaves ``out_dir`` as it
    was plus the objects finished before it; ``summary.json`` is rewritten with each object it lists, and at the
    end names the one that failed."""
    import backends

    out_dir = Path(out_dir).absolute()
    # obj/stl are trimesh exports of the mesh, not decoders: they (and the texture options) imply "mesh"
    mesh_formats = [f for f in formats if f in MESH_EXPORTS]
    formats = [f for f in formats if f not in MESH_EXPORTS]
    if (mesh_formats or texture or simplify is not None) and "mesh" not in formats:
        formats.append("mesh")
    options = run_options(seed, steps, formats, fast)  # the one object the pipeline and its sampler receive
    extras = {"mesh_formats": mesh_formats, "texture": texture, "simplify": simplify, "fast": fast,
              "bake": bake or {}, "turntable_format": turntable_format, "on_object": on_object}
    t0 = time.perf_counter()
    owned = inference is None  # a caller's Inference (batch, app) is reused and kept
    if owned:
        inference = build_inference(config, device=device, low_memory=low_memory, portable_seed=portable_seed,
                                    compile=compile, weights=weights, dtype=dtype)
    pipeline = inference.pipeline
    dev = pipeline.device
    log(f"checkpoint {config} | device {dev} | low-memory {'on' if pipeline.low_memory else 'off'} | "
        f"weights {getattr(pipeline, 'weights', 'default')} | sampling {sampling_dtype_name(pipeline)} | "
        f"decoders {decoder_dtype_name(pipeline)} | backends {backends.current(dev)}")
    backends.device.reset_peak_memory(dev)
    summary = {"checkpoint": str(config), "device": str(dev), "random_weights": random_weights,
               "build_seconds": time.perf_counter() - t0, "objects": [], "failed": [], "out_dir": str(out_dir)}
    existing = _nearest_existing(out_dir)
    created = [] if existing == out_dir else [out_dir, *[p for p in out_dir.parents if existing in p.parents]]
    out_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(out_dir, log)
    # staging lives inside --out: the final renames never cross a file system (a mount point as --out works)
    staging = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-", dir=out_dir))
    try:
        outputs = _run_objects(inference, image, masks, out_dir, staging, pointmap, options, turntable_frames,
                               random_weights, progress, log, summary, extras)
        if len(outputs) > 1 and all(o.get("gs") is not None for o in outputs):
            from sam3d_objects.inference import make_scene
            scene = make_scene(*outputs)
            _write_atomic(out_dir / "scene.ply", lambda p: scene.save_ply(str(p)))
            summary["scene"] = str(out_dir / "scene.ply")
            log(f"scene of {len(outputs)} objects (placed by their poses) -> {out_dir / 'scene.ply'}")
    finally:
        with SIGNALS.deferred():  # a second signal must not cut the clean-up short
            shutil.rmtree(staging, ignore_errors=True)
            summary["total_seconds"] = time.perf_counter() - t0
            summary["peak_device_bytes"] = backends.device.peak_memory(dev)
            summary["peak_rss_bytes"] = backends.device.peak_rss_bytes()
            if summary["objects"]:  # a failure before the first object leaves --out untouched
                write_summary(out_dir, summary)
            else:
                for folder in created:  # the folders this run made, when empty: nothing was published
                    try:
                        folder.rmdir()
                    except OSError:
                        break
    log(format_summary(summary))
    del inference
    if owned:
        backends.device.empty_cache(dev)
    return summary


def sampling_dtype_name(pipeline) -> str:
    """What the sampling stages run in on the pipeline's device (the yaml's float16 means float32 on a CPU)."""
    import torch
    dtype = getattr(pipeline, "dtype", torch.float32)
    enabled = getattr(pipeline, "_autocast_enabled", lambda d: False)(dtype)
    return str(dtype if enabled else torch.float32).replace("torch.", "")


def decoder_dtype_name(pipeline) -> str:
    """What the decoders' ``use_fp16`` torsos (upstream's mesh and Gaussian decoders) compute in on the pipeline's
    device: bfloat16 on a CPU sampling in bfloat16, float16 on CUDA / MPS, float32 otherwise; their output layers
    and the mesh extraction are float32 in every case."""
    from sam3d_objects.model.backbone.tdfy_dit.modules.utils import half_torso_dtype
    half = getattr(pipeline, "decoder_half_dtype", lambda: None)()
    return str(half_torso_dtype(half, pipeline.device)).replace("torch.", "")


def build_inference(config: Path, device: Optional[str] = None, low_memory: Optional[bool] = None,
                    portable_seed: bool = False, compile: bool = False, weights: str = "default",
                    dtype: str = "auto"):
    """``Inference`` for the CLI: its failures as UserErrors with the CLI's exit codes."""
    from sam3d_objects.inference import Inference
    from sam3d_objects.pipeline.checkpoint import CheckpointError
    from sam3d_objects.validation import ConfigError, DeviceUnavailableError
    try:
        return Inference(config, compile=compile, device=device, low_memory=low_memory,
                         noise_device=NOISE_ON_CPU if portable_seed else NOISE_AUTO, weights=weights, dtype=dtype)
    except DeviceUnavailableError as e:  # the yaml names a device this machine lacks
        raise UserError(f"{config}: {e}; pass --device") from e
    except ConfigError as e:
        raise UserError(f"unusable configuration: {e}", EXIT_CHECKPOINT) from e
    except (FileNotFoundError, CheckpointError) as e:
        raise UserError(str(e), EXIT_CHECKPOINT) from e
    except (ValueError, TypeError) as e:  # a constructor refused a value of the yaml
        raise UserError(f"unusable configuration {config}: {_first_line(e)}; compare with the released "
                        f"pipeline.yaml, or download the folder again", EXIT_CHECKPOINT) from e


def _run_one(pipeline, rgba: np.ndarray, name: str, label: str, pointmap, options: RunOptions,
             progress: bool) -> Dict[str, Any]:
    from sam3d_objects.pipeline.checkpoint import CheckpointError
    from sam3d_objects.pipeline.inference_pipeline import EmptyStructureError
    try:
        with Progress(pipeline, options.decode_formats or (), enabled=progress, label=label)():
            return pipeline.run(rgba, None, pointmap=pointmap, **options.keywords(pipeline.run))
    except EmptyStructureError as e:
        raise UserError(f"object {name}: {e}", EXIT_RUN) from e
    except CheckpointError as e:  # low-memory mode loads each model when its stage starts
        raise UserError(str(e), EXIT_CHECKPOINT) from e
    except (ValueError, ImportError) as e:  # input problems the pipeline detects; depth model not installed
        msg = str(e)
        if "point map" in msg or "depth model" in msg or "pointmap" in msg:
            msg += ". With the CLI: --pointmap FILE.npy ([H, W, 3]), or --pointmap flat for a plumbing check."
        raise UserError(f"object {name}: {msg}") from e


def _run_objects(inference, image, masks, out_dir: Path, staging: Path, pointmap, options: RunOptions,
                 turntable_frames, random_weights, progress, log, summary,
                 extras: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
    """Reconstruct and publish each object in turn; the failing one is recorded in ``summary['failed']``."""
    extras = extras or {}
    import warnings

    from sam3d_objects.validation import InputWarning
    pipeline = inference.pipeline
    outputs, stage_totals = [], {}
    summary["stage_seconds"] = stage_totals
    run_start = time.perf_counter()
    for i, (name, mask) in enumerate(masks):
        label = f"[{i + 1}/{len(masks)}] " if len(masks) > 1 else ""
        single = len(masks) == 1
        try:
            rgba = inference.merge_mask_to_rgba(image, mask)
            start = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", InputWarning)  # already reported by input_warnings
                output = _run_one(pipeline, rgba, name, label, pointmap, options, progress)
            for k, v in pipeline.stage_times.items():
                stage_totals[k] = stage_totals.get(k, 0.0) + v
            if extras.get("texture") or extras.get("simplify") is not None:
                from sam3d_objects import presets
                from sam3d_objects.model.backbone.tdfy_dit.utils.postprocessing_utils import refine_glb
                settings = presets.bake_settings(pipeline.device.type, **extras.get("bake", {})) \
                    if extras.get("texture") else {}
                bake_start = time.perf_counter()
                try:
                    output["glb"] = refine_glb(output, texture=extras.get("texture", False),
                                               simplify=extras.get("simplify"), verbose=progress, **settings)
                except ValueError as e:  # e.g. post-processing removed every face of a noisy mesh
                    raise UserError(f"object {name}: {e}", EXIT_RUN) from e
                key = "texture" if extras.get("texture") else "simplify"
                stage_totals[key] = stage_totals.get(key, 0.0) + time.perf_counter() - bake_start
            seconds = time.perf_counter() - start
            meta = {"mask": name, "seed": options.seed, "checkpoint": str(summary["checkpoint"]),
                    "random_weights": random_weights, "seconds": round(seconds, 3)}
            staged = staging / f"object_{i}"
            save_object(output, staged, image, mask, meta, turntable_frames, log=log, progress=progress,
                        mesh_formats=extras.get("mesh_formats", ()), mesh_preview=bool(extras.get("texture")),
                        turntable_format=extras.get("turntable_format", "gif"), name=name)
            folder = out_dir if single else out_dir / f"object_{i}"
            with SIGNALS.deferred():  # the object and the summary.json that lists it appear together
                written = publish(staged, folder, single, staging / f"replaced_{i}")
                summary["objects"].append({"mask": name, "folder": str(folder), "seconds": seconds,
                                           "files": [str(p) for p in written]})
                write_summary(out_dir, summary)
        except BaseException as e:  # noqa: B902  record, then let main() map it to its exit code
            reason = "interrupted" if isinstance(e, KeyboardInterrupt) else f"{type(e).__name__}: {e}"
            summary["failed"].append({"mask": name, "error": reason})
            raise
        log(f"{label}object {name}: {int(output['coords'].shape[0])} voxels, {seconds:.1f} s -> "
            + ", ".join(str(p) for p in written))
        outputs.append(output)
        if extras.get("on_object") is not None:
            extras["on_object"](i, summary["objects"][-1])
        summary["run_seconds"] = time.perf_counter() - run_start
    return outputs


def format_summary(summary: Dict[str, Any]) -> str:
    lines = ["", "summary", f"  device {summary['device']}, {len(summary['objects'])} object(s), "
                            f"total {summary['total_seconds']:.1f} s (model set-up {summary['build_seconds']:.1f} s)"]
    stages = summary["stage_seconds"]
    for name in list(STAGE_ORDER) + [k for k in stages if k not in STAGE_ORDER]:
        if name in stages:
            lines.append(f"  {name:<16} {stages[name]:8.2f} s")
    dev = summary["device"]
    if not dev.startswith("cpu"):
        lines.append(f"  peak {dev} memory  {_fmt_bytes(summary['peak_device_bytes'])}")
    lines.append(f"  peak process RSS  {_fmt_bytes(summary['peak_rss_bytes'])}")
    lines.append(f"  outputs in {summary['out_dir']}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# presets, automatic masks, one-line error messages
# ----------------------------------------------------------------------------------------------------------------
def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def apply_preset(preset: Optional[str], fast: bool, steps: Tuple[Optional[int], Optional[int]]):
    """(fast, steps) of ``--preset`` with explicit ``--fast`` / ``--steps`` winning; ``--fast`` alone keeps
    upstream's 4 stage-1 shortcut steps."""
    from sam3d_objects import presets
    fast, steps = presets.resolve(preset, fast, steps)
    if fast and steps[0] is None:
        steps = (FAST_STAGE1_STEPS, steps[1])
    return fast, steps


def auto_masks(image: np.ndarray) -> List[Tuple[str, np.ndarray]]:
    """``--mask auto``: one mask per foreground object (the image's alpha, else far from the border colours)."""
    from sam3d_objects.foreground import NoForegroundError, auto_masks as find
    try:
        return [(f"auto{i}", m) for i, m in enumerate(find(image))]
    except NoForegroundError as e:
        raise UserError(f"--mask auto: {e}") from e
