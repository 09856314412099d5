"""``sam3d-objects app``: a local web app (Gradio; the ``app`` extra) from a photo to a 3D viewer.

    sam3d-objects app [--checkpoints DIR_OR_REPO] [--device DEV] [--port 7860] [--host 127.0.0.1] [--share]

Upload a photo, mark the object (click on it, draw a box with two clicks, a SAM 3 text prompt, the automatic
foreground, or uploaded mask files), add as many objects as the scene holds, choose a preset and a device and press
Reconstruct: progress follows the pipeline's stages and steps, Cancel stops the run at the next step. The result
opens in 3D viewers (the GLB mesh, the gaussian splat; several objects: the scene laid out by their poses), with a
turntable and downloads of PLY / GLB / OBJ / STL.

One reconstruction runs at a time (the queue's concurrency is 1): a second user waits for the first instead of
loading the model twice. The server listens on 127.0.0.1 unless ``--host`` says otherwise; ``--share`` (a public
Gradio link to this machine) is off unless asked for. Without a segmentation model, a click picks the automatic
foreground region under it and a box keeps the foreground inside it; with ``sam3`` installed a box and a text
prompt go through SAM 3 (``sam3d_objects.segment``).

Built on the CLI's functions (``sam3d_objects.reconstruction.reconstruct`` with a cached ``Inference``), so outputs,
checks and messages are those of ``sam3d-objects reconstruct``.
"""
# no `from __future__ import annotations`: gradio reads the handlers' gr.Request / gr.SelectData annotations
import argparse
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from sam3d_objects import errors
from sam3d_objects.pipeline.run_options import DEFAULT_SEED

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 7860
KEEP_RUNS = 8  # result folders kept for the viewers and downloads; older ones are deleted
DEPTH_CHOICES = ("depth model (MoGe)", "flat plane (plumbing check)")
CLICK_MODES = ("click on the object", "box: two clicks (corners)")
MASK_COLOURS = np.array([[255, 64, 64], [64, 160, 255], [64, 220, 96], [255, 200, 40], [200, 90, 255],
                         [40, 220, 220]], np.uint8)


class RunCancelled(Exception):
    """Raised inside the pipeline's thread when the user pressed Cancel."""


def require_gradio():
    try:
        import gradio as gr
    except ImportError as e:
        from sam3d_objects.errors import UserError
        raise UserError("the web app needs gradio: `make extras EXTRAS=app` in the clone (or pip install "
                        "'gradio>=5,<7')") from e
    return gr


# ----------------------------------------------------------------------------------------------------------------
# the engine: one Inference per (checkpoint, device), one run at a time, cancellable between steps
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Engine:
    config: Path
    random_weights: bool = False
    pointmap_default: str = DEPTH_CHOICES[0]
    work_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="sam3d-app-")))
    _inference: Any = None
    _device: Optional[str] = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _cancel: threading.Event = field(default_factory=threading.Event)
    _owner: Optional[str] = None

    def inference(self, device: Optional[str]):
        from sam3d_objects import reconstruction
        if self._inference is None or device != self._device:
            self._inference = None  # free the old models before loading new ones
            import backends
            backends.device.release_host_memory()
            self._inference = reconstruction.build_inference(self.config, device=device)
            self._device = device
        return self._inference

    def _prune(self, keep: Path, runs: int = KEEP_RUNS) -> None:
        """Delete all but the newest ``runs`` result folders (full-size results are tens of MB each)."""
        folders = sorted((p for p in self.work_dir.glob("run-*") if p.is_dir()), key=lambda p: p.stat().st_mtime)
        for old in folders[:-runs]:
            if old != keep:
                shutil.rmtree(old, ignore_errors=True)

    def cancel(self, owner: Optional[str]) -> str:
        if self._owner is not None and (owner is None or owner == self._owner):
            self._cancel.set()
            return "Cancelling: the run stops at its next step ..."
        return "Nothing of yours is running."

    def run(self, image: np.ndarray, masks: List[Tuple[str, np.ndarray]], preset: str, device: Optional[str],
            seed: int, depth: str, owner: Optional[str] = None, progress=None, turntable_frames: int = 24,
            pointmap: Optional[np.ndarray] = None) -> Dict[str, Any]:
        """Reconstruct ``masks`` of ``image`` into a fresh folder; returns the CLI's summary plus ``folder``."""
        import torch

        from sam3d_objects import reconstruction
        if not masks:
            raise errors.UserError("no object yet: mark one (click, box, text, automatic or mask files) and press "
                                "'Add object'")
        fast, steps = reconstruction.apply_preset(preset, False, (None, None))
        with self._lock:  # the queue runs one at a time already; this guards direct API callers too
            self._cancel.clear()
            self._owner = owner
            try:
                if progress is not None:
                    progress(0.0, desc="loading the model")
                inference = self.inference(device)
                pipeline = inference.pipeline
                if pointmap is None and depth == DEPTH_CHOICES[1]:
                    pointmap = reconstruction.flat_pointmap(*image.shape[:2])
                image, masks, pointmap = reconstruction.input_warnings(image, masks, pointmap, log=lambda m: None)
                out = Path(tempfile.mkdtemp(prefix="run-", dir=self.work_dir))
                stages = len(reconstruction.STAGE_ORDER) - 1  # the decoders of the formats asked for (gaussian, mesh)
                done = {"stages": 0, "object": 0}

                def on_stage(stage: str, event: str) -> None:
                    if self._cancel.is_set():
                        raise RunCancelled()
                    if event == "end":
                        done["stages"] = min(done["stages"] + 1, stages)
                    if progress is not None:
                        total = stages * len(masks)
                        value = (done["object"] * stages + done["stages"]) / total
                        progress(min(value, 1.0), desc=f"object {done['object'] + 1}/{len(masks)}: {stage}")

                def on_object(index: int, _summary: Dict[str, Any]) -> None:
                    done["object"], done["stages"] = index + 1, 0

                def check_cancel(module, args) -> None:  # every module call: stops within a sampling step
                    if self._cancel.is_set():
                        raise RunCancelled()
                previous = getattr(pipeline, "stage_hook", None)
                pipeline.stage_hook = on_stage
                handle = torch.nn.modules.module.register_module_forward_pre_hook(check_cancel)
                try:
                    fmt = "mp4" if _has_ffmpeg() else "gif"
                    summary = reconstruction.reconstruct(
                        self.config, image, masks, out, pointmap=pointmap, seed=int(seed), steps=steps, fast=fast,
                        formats=("gaussian", "mesh", "obj", "stl"), turntable_frames=turntable_frames,
                        turntable_format=fmt, random_weights=self.random_weights, progress=False,
                        log=lambda m: None, inference=inference, on_object=on_object)
                finally:
                    handle.remove()
                    pipeline.stage_hook = previous
                if progress is not None:
                    progress(1.0, desc="done")
                summary["folder"] = str(out)
                self._prune(keep=out)
                return summary
            finally:
                self._owner = None
                self._cancel.clear()


def _has_ffmpeg() -> bool:
    try:
        import imageio  # noqa: F401
        import imageio_ffmpeg  # noqa: F401
        return True
    except ImportError:
        return False


def result_files(summary: Dict[str, Any]) -> Dict[str, Any]:
    """What the viewers and downloads show: the first object's GLB (or the only one), the splat (the scene's for
    several objects), the turntable, every file for download."""
    objects = summary["objects"]
    files = [Path(f) for obj in objects for f in obj["files"]]
    if summary.get("scene"):
        files.append(Path(summary["scene"]))
    pick = {name: next((f for f in files if f.name == name), None)
            for name in ("mesh.glb", "splat.ply", "turntable.mp4", "turntable.gif")}
    splat = Path(summary["scene"]) if summary.get("scene") else pick["splat.ply"]
    downloads = [f for f in files if f.suffix in (".ply", ".glb", ".obj", ".stl", ".mp4", ".gif", ".json")]
    return {"glb": pick["mesh.glb"], "splat": splat, "turntable": pick["turntable.mp4"] or pick["turntable.gif"],
            "downloads": downloads}


def status_text(summary: Dict[str, Any], random_weights: bool) -> str:
    parts = [f"{len(summary['objects'])} object(s) in {summary['total_seconds']:.1f} s on {summary['device']}"]
    if summary.get("scene"):
        parts.append("the splat viewer shows the scene laid out by the objects' poses")
    if random_weights:
        parts.append("RANDOM weights (plumbing check): the shapes are noise, not a reconstruction")
    return "Done: " + "; ".join(parts) + "."


# ----------------------------------------------------------------------------------------------------------------
# masks
# ----------------------------------------------------------------------------------------------------------------
def overlay(image: Optional[np.ndarray], objects: Sequence[np.ndarray], current: Optional[np.ndarray],
            points: Sequence[Tuple[int, int]] = ()) -> Optional[np.ndarray]:
    """The photo with the objects' masks tinted (one colour each), the current mask outlined bright."""
    if image is None:
        return None
    out = image[..., :3].astype(np.float32).copy()
    for i, mask in enumerate(objects):
        out[mask] = 0.55 * out[mask] + 0.45 * MASK_COLOURS[i % len(MASK_COLOURS)]
    if current is not None:
        out[current] = 0.4 * out[current] + 0.6 * np.array([255, 255, 255], np.float32)
    for x, y in points:
        out[max(0, y - 3):y + 4, max(0, x - 3):x + 4] = (255, 0, 255)
    return out.clip(0, 255).astype(np.uint8)


def mask_at_point(image: np.ndarray, x: int, y: int) -> np.ndarray:
    """The automatic-foreground region under (x, y); a clear error when the click is on background."""
    from sam3d_objects.foreground import auto_masks
    for mask in auto_masks(image, min_fraction=0.0005, max_objects=64):
        if mask[y, x]:
            return mask
    raise ValueError("that click is on the background (no foreground region there): click on the object, or use "
                     "a box, a text prompt or a mask file")


def mask_in_box(image: np.ndarray, box: Sequence[int]) -> np.ndarray:
    """SAM 3's mask for the box when sam3 is installed, else the foreground inside the box."""
    x0, y0, x1, y1 = sorted(box[0::2])[0], sorted(box[1::2])[0], sorted(box[0::2])[1], sorted(box[1::2])[1]
    if _sam3_available():
        masks = sam3_masks(image, box=f"{x0},{y0},{x1},{y1}")
        if masks:
            return masks[0]
    from sam3d_objects.foreground import foreground
    inside = np.zeros(image.shape[:2], bool)
    inside[y0:y1 + 1, x0:x1 + 1] = True
    mask = foreground(image) & inside
    if not mask.any():
        raise ValueError("nothing stands out from the background inside that box")
    return mask


def _sam3_available() -> bool:
    from sam3d_objects import segment
    try:
        segment.require_sam3()
        return True
    except Exception:  # noqa: BLE001  any reason: not installed, broken install
        return False


SAM3_MISSING = ("Text prompts need SAM 3, which is not installed: `make extras EXTRAS=sam3` in the clone, then "
                "restart the app. Meanwhile: click on the object, draw a box, use 'Automatic' or upload mask files.")


def sam3_masks(image: np.ndarray, text: Optional[str] = None, box: Optional[str] = None,
               checkpoint: Optional[str] = None) -> List[np.ndarray]:
    """SAM 3 masks (by decreasing score) through the ``segment`` path; ValueError with the fix when absent."""
    from PIL import Image

    from sam3d_objects import segment
    if not _sam3_available():
        raise ValueError(SAM3_MISSING)
    with tempfile.TemporaryDirectory(prefix="sam3d-app-seg-") as tmp:
        src = Path(tmp) / "image.png"
        Image.fromarray(image[..., :3]).save(src)
        try:
            written = segment.segment(str(src), str(Path(tmp) / "masks"), text=text, box=box, checkpoint=checkpoint)
        except segment.SegmentError as e:
            raise ValueError(str(e)) from e
        return [np.asarray(Image.open(p).convert("L")) > 127 for p in written]


def read_mask_files(paths: Sequence[str], shape: Tuple[int, int]) -> List[np.ndarray]:
    from sam3d_objects import reconstruction
    return [m for _, m in reconstruction.read_masks([str(p) for p in paths], shape)]


# ----------------------------------------------------------------------------------------------------------------
# the UI
# ----------------------------------------------------------------------------------------------------------------
def available_devices() -> List[str]:
    import torch

    import backends
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices = [f"cuda:{i}" if torch.cuda.device_count() > 1 else "cuda"
                   for i in range(torch.cuda.device_count())] + devices
    if backends.device.mps_available():
        devices = ["mps"] + devices
    return devices


def build_app(engine: Engine, default_device: Optional[str] = None, sam3_checkpoint: Optional[str] = None,
              example_pointmap: bool = True):
    """The gradio Blocks (not launched)."""
    gr = require_gradio()
    from sam3d_objects import presets, reconstruction
    from sam3d_objects.assets.example import EXAMPLE_DIR, example_pointmap as load_example_pointmap

    example_image = np.asarray(__import__("PIL.Image", fromlist=["Image"]).open(EXAMPLE_DIR / "image.png")
                               .convert("RGB"))
    devices = available_devices()
    device_default = default_device or devices[0]
    if device_default not in devices:
        devices.insert(0, device_default)

    def pointmap_for(image: np.ndarray) -> Optional[np.ndarray]:
        """The bundled example's exact point map when its image is uploaded (no depth model needed)."""
        if example_pointmap and image.shape[:2] == example_image.shape[:2] and \
                np.array_equal(image[..., :3], example_image):
            return load_example_pointmap()
        return None

    def new_state() -> Dict[str, Any]:
        return {"image": None, "objects": [], "current": None, "points": [], "box": []}

    def describe(state) -> str:
        n = len(state["objects"])
        current = "a mask is selected: press 'Add object'" if state["current"] is not None else "no mask selected"
        return f"{n} object(s) added; {current}."

    def on_upload(image, state):
        state = new_state()
        if image is None:
            return None, state, describe(state)
        state["image"] = np.asarray(image)[..., :3].astype(np.uint8) if np.asarray(image).ndim == 3 else \
            np.repeat(np.asarray(image)[..., None], 3, -1).astype(np.uint8)
        state["upload"] = np.asarray(image)
        return overlay(state["image"], [], None), state, describe(state)

    def on_click(state, mode, evt: gr.SelectData):
        if state["image"] is None:
            return gr.update(), state, "Upload a photo first."
        x, y = int(evt.index[0]), int(evt.index[1])
        try:
            if mode == CLICK_MODES[0]:
                state["current"], state["box"] = mask_at_point(state["upload"], x, y), []
                state["points"] = [(x, y)]
            else:
                state["box"] = state["box"][-1:] + [(x, y)] if len(state["box"]) < 2 else [(x, y)]
                state["points"] = list(state["box"])
                if len(state["box"]) == 2:
                    (x0, y0), (x1, y1) = state["box"]
                    state["current"] = mask_in_box(state["upload"], (x0, y0, x1, y1))
                    state["box"] = []
            message = describe(state)
        except ValueError as e:
            message = f"{e}"
        return overlay(state["image"], state["objects"], state["current"], state["points"]), state, message

    def on_text(state, text):
        if state["image"] is None:
            return gr.update(), state, "Upload a photo first."
        if not text or not text.strip():
            return gr.update(), state, "Type what to segment, e.g. 'chair'."
        try:
            masks = sam3_masks(state["image"], text=text.strip(), checkpoint=sam3_checkpoint)
        except ValueError as e:
            return gr.update(), state, str(e)
        if not masks:
            return gr.update(), state, f"SAM 3 found no {text.strip()!r}."
        state["current"], state["points"] = masks[0], []
        return overlay(state["image"], state["objects"], state["current"]), state, describe(state)

    def on_auto(state):
        if state["image"] is None:
            return gr.update(), state, "Upload a photo first."
        from sam3d_objects.foreground import NoForegroundError, auto_masks
        try:
            found = auto_masks(state["upload"])
        except NoForegroundError as e:
            return gr.update(), state, str(e)
        state["objects"] += found
        state["current"], state["points"] = None, []
        return overlay(state["image"], state["objects"], None), state, \
            f"Automatic: {len(found)} object(s) added. " + describe(state)

    def on_mask_files(files, state):
        if state["image"] is None or not files:
            return gr.update(), state, "Upload a photo first." if state["image"] is None else describe(state)
        paths = [f if isinstance(f, str) else getattr(f, "name", str(f)) for f in files]
        try:
            state["objects"] += read_mask_files(paths, state["image"].shape[:2])
        except errors.UserError as e:
            return gr.update(), state, str(e)
        return overlay(state["image"], state["objects"], None), state, describe(state)

    def on_add(state):
        if state["current"] is not None:
            state["objects"].append(state["current"])
            state["current"], state["points"] = None, []
        return overlay(state["image"], state["objects"], None), state, describe(state)

    def on_clear(state):
        state.update(objects=[], current=None, points=[], box=[])
        return overlay(state["image"], [], None), state, describe(state)

    def reconstruct(state, preset, device, seed, depth, request: gr.Request, progress=gr.Progress()):
        if state["image"] is None:
            raise gr.Error("Upload a photo first.")
        objects = list(state["objects"]) or ([state["current"]] if state["current"] is not None else [])
        masks = [(str(i), m) for i, m in enumerate(objects)]
        return _run(state["image"], masks, preset, device, seed, depth, getattr(request, "session_hash", None),
                    progress)

    def reconstruct_api(image_path, mask_paths, preset, device, seed, depth, request: gr.Request,
                        progress=gr.Progress()):
        """API: an image file and mask files (one per object) -> (GLB, splat, turntable, files, status)."""
        from sam3d_objects.utils.images import load_image_file
        image = load_image_file(image_path)
        paths = [p if isinstance(p, str) else p.get("path") if isinstance(p, dict) else str(p)
                 for p in (mask_paths or [])]
        try:
            masks = reconstruction.auto_masks(image) if not paths else \
                [(str(i), m) for i, m in enumerate(read_mask_files(paths, image.shape[:2]))]
        except errors.UserError as e:
            raise gr.Error(str(e))
        return _run(image, masks, preset, device, seed, depth, getattr(request, "session_hash", None), progress)

    def _run(image, masks, preset, device, seed, depth, owner, progress):
        try:
            summary = engine.run(image, masks, preset, device, int(seed), depth, owner=owner, progress=progress,
                                 pointmap=pointmap_for(image))
        except RunCancelled:
            raise gr.Error("Cancelled.")
        except errors.UserError as e:
            message = str(e)
            if "depth model" in message or "point map" in message or "pointmap" in message:
                message += (" In the app: install the depth model (`make extras EXTRAS=moge`) or choose "
                            "'flat plane (plumbing check)' under Depth.")
            raise gr.Error(message)
        files = result_files(summary)
        return (str(files["glb"]) if files["glb"] else None, str(files["splat"]) if files["splat"] else None,
                str(files["turntable"]) if files["turntable"] else None, [str(f) for f in files["downloads"]],
                status_text(summary, engine.random_weights))

    def on_cancel(request: gr.Request):
        return engine.cancel(getattr(request, "session_hash", None))

    title = "SAM 3D Objects - one photo to a 3D object"
    with gr.Blocks(title=title, analytics_enabled=False) as demo:
        gr.Markdown(f"## {title}\nWeights: `{engine.config}`" + (
            " - **random weights (plumbing check)**: every stage runs, the shapes are noise. Official weights: "
            "`sam3d-objects app --checkpoints facebook/sam-3d-objects` (README: weights by name)."
            if engine.random_weights else ""))
        state = gr.State(new_state())
        with gr.Row():
            with gr.Column(scale=1):
                upload = gr.Image(label="1. Your photo", type="numpy", image_mode=None, sources=["upload", "clipboard"],
                                  elem_id="photo")
                annotated = gr.Image(label="2. Mark the object: click on it (or two clicks for a box)",
                                     type="numpy", interactive=False, elem_id="annotated")
                mode = gr.Radio(list(CLICK_MODES), value=CLICK_MODES[0], label="Clicks")
                with gr.Row():
                    text = gr.Textbox(label="Text prompt (SAM 3)", placeholder="e.g. chair", scale=3)
                    text_button = gr.Button("Segment", scale=1)
                mask_files = gr.File(label="Or upload mask files (one per object)", file_count="multiple",
                                     file_types=["image"], type="filepath")
                with gr.Row():
                    add = gr.Button("Add object", variant="secondary")
                    auto = gr.Button("Automatic (all objects)", elem_id="auto-button")
                    clear = gr.Button("Clear objects")
                objects_info = gr.Markdown("Upload a photo.", elem_id="objects-info")
                with gr.Row():
                    preset = gr.Dropdown(list(presets.PRESETS), value="fast", label="Preset")
                    device = gr.Dropdown(devices, value=device_default, label="Device")
                with gr.Row():
                    seed = gr.Number(value=DEFAULT_SEED, precision=0, label="Seed")
                    depth = gr.Dropdown(list(DEPTH_CHOICES), value=engine.pointmap_default, label="Depth")
                with gr.Row():
                    run = gr.Button("Reconstruct", variant="primary", elem_id="reconstruct-button")
                    cancel = gr.Button("Cancel", variant="stop", elem_id="cancel-button")
            with gr.Column(scale=1):
                status = gr.Markdown("", elem_id="status")
                mesh_view = gr.Model3D(label="Mesh (GLB)", elem_id="mesh-viewer", height=360)
                splat_view = gr.Model3D(label="Gaussian splat (several objects: the scene)", elem_id="splat-viewer",
                                        height=360)
                turntable = gr.Video(label="Turntable", elem_id="turntable") if _has_ffmpeg() else \
                    gr.Image(label="Turntable", type="filepath", elem_id="turntable")
                downloads = gr.File(label="Downloads (PLY / GLB / OBJ / STL)", file_count="multiple",
                                    elem_id="downloads")
        # hidden inputs of the API endpoint (gradio_client: /reconstruct_files)
        api_image = gr.Image(type="filepath", visible=False)
        api_masks = gr.File(file_count="multiple", type="filepath", visible=False)

        upload.change(on_upload, [upload, state], [annotated, state, objects_info], queue=False)
        annotated.select(on_click, [state, mode], [annotated, state, objects_info], queue=False)
        text_button.click(on_text, [state, text], [annotated, state, objects_info])
        auto.click(on_auto, [state], [annotated, state, objects_info], queue=False)
        mask_files.upload(on_mask_files, [mask_files, state], [annotated, state, objects_info], queue=False)
        add.click(on_add, [state], [annotated, state, objects_info], queue=False)
        clear.click(on_clear, [state], [annotated, state, objects_info], queue=False)
        outputs = [mesh_view, splat_view, turntable, downloads, status]
        run.click(reconstruct, [state, preset, device, seed, depth], outputs, api_name="reconstruct",
                  concurrency_limit=1, concurrency_id="model")
        cancel.click(on_cancel, None, [status], queue=False, api_name="cancel")
        api_button = gr.Button(visible=False)
        api_button.click(reconstruct_api, [api_image, api_masks, preset, device, seed, depth], outputs,
                         api_name="reconstruct_files", concurrency_limit=1, concurrency_id="model")
    demo.queue(default_concurrency_limit=1, max_size=32)
    return demo


# ----------------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------------
def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("app", help="the web app: photo -> masks -> 3D viewer and downloads (extra `app`)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoints", default=None, help="checkpoint folder or Hugging Face repo id "
                                                       "(default: as reconstruct; else the tiny random checkpoint)")
    p.add_argument("--revision", default=None, help="branch, tag or commit of a Hugging Face repo")
    p.add_argument("--device", default=None, help="the device selected at start (cpu, cuda, mps)")
    p.add_argument("--host", default=DEFAULT_HOST, help="address to listen on (default 127.0.0.1: this machine "
                                                         "only; 0.0.0.0 opens it to your network)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--share", action="store_true", help="also make a public gradio.live link to this machine "
                                                        "(off by default)")
    p.add_argument("--depth", choices=("moge", "flat"), default=None,
                   help="the Depth choice at start (default: moge, flat for random weights)")
    p.add_argument("--sam3-checkpoint", default=None, help="SAM 3 checkpoint for text prompts and boxes")
    p.add_argument("--no-browser", action="store_true", help="do not open a browser tab")
    return p


def run_cli(args) -> int:
    from sam3d_objects import reconstruction
    from sam3d_objects.assets.tiny_checkpoint import ensure_tiny_checkpoint, is_random_checkpoint
    require_gradio()
    config, source = reconstruction.find_checkpoint(args.checkpoints, args.revision)
    if config is None:
        print(f"No official weights found ({source}): the app uses the tiny RANDOM-weight checkpoint (plumbing "
              f"check). Official weights: sam3d-objects app --checkpoints facebook/sam-3d-objects")
        config = ensure_tiny_checkpoint(reconstruction.default_tiny_dir())
    reconstruction.check_device(args.device)
    reconstruction.check_checkpoint_folder(config)
    random_weights = is_random_checkpoint(config)
    depth = {"moge": DEPTH_CHOICES[0], "flat": DEPTH_CHOICES[1]}.get(args.depth or "",
                                                                      DEPTH_CHOICES[1 if random_weights else 0])
    engine = Engine(config, random_weights=random_weights, pointmap_default=depth)
    demo = build_app(engine, default_device=args.device, sam3_checkpoint=args.sam3_checkpoint)
    if args.share:
        print("WARNING: --share publishes this app (and this machine's compute) on a public gradio.live link.")
    try:
        demo.launch(server_name=args.host, server_port=args.port, share=bool(args.share),
                    inbrowser=not args.no_browser, allowed_paths=[str(engine.work_dir)], show_error=True)
    finally:
        shutil.rmtree(engine.work_dir, ignore_errors=True)
    return errors.EXIT_OK
