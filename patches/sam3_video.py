"""Targeted import-time fix-ups that let SAM 3's video predictor (the ``sam3`` package, unmodified on disk) run
without CUDA, on CPU and MPS.

Why: ``sam3.model.sam3_video_predictor`` and the modules under it were written for one or more CUDA GPUs. Most of
what they do is already covered by the generic shims (``.cuda()`` / ``device="cuda"`` redirected, ``pin_memory()``
a no-op, ``torch.cuda`` queries answered); what is left are a few statements that *decide* on CUDA and cannot be
answered truthfully by a shim: an assertion that the GPU index is below ``torch.cuda.device_count()`` (0 here),
bfloat16 CUDA autocast contexts, one of which the tracker enters in its constructor and never leaves (on the CPU that
would switch the whole process, the reconstruction after it included, to bfloat16 autocast; on MPS a CUDA
``autocast(enabled=False)`` becomes an MPS autocast, which raises ``unsupported scalarType`` in the detector
decoder's feed-forward block on some torch versions), explicit bfloat16 casts that rely on that autocast, and a CPU
connected-components fallback that fails on an empty batch and needs an undeclared package.

Each fix-up below is declarative: the module it rewrites, where, what it replaces, and the crash that justifies it.
They are entries of :mod:`patches.fixups` (registered when this module is imported, which ``patches.apply()``
does; switchable by name through ``apply(fixups=[...])``, listed by ``patches.report()``): AST transformations
applied while the module is imported, never a copy of SAM 3's code. The module's file on disk is unchanged. A
fix-up whose target is not found in the installed ``sam3`` (another release) raises ``ShapeMismatch``: the module
then runs as it is and the report says why. With CUDA present every helper behaves exactly like the statement it
replaced.

What needs no fix-up (checked on the CPU with sam3 0.1.4): process groups - with one process
``Sam3VideoPredictorMultiGPU`` never starts NCCL (``WORLD_SIZE`` is 1) and no gloo group is built (only used when
``world_size > 1``); the GPU it keeps, ``cuda:0``, is redirected by the device shim, and ``torch.cuda.set_device``
is answered by the CUDA shim. Pinned memory (``pin_memory()``, a no-op) and ``non_blocking`` copies (plain copies
on the CPU) are handled by the device shim. The video path creates no CUDA streams or events; its
``torch.cuda.memory_*`` log lines read 0 without CUDA.
"""
from __future__ import annotations

import ast
import contextlib
import copy
from typing import Callable, List, Optional

import torch

HELPER = "_sam3d_patches_sam3_video"  # the name under which a rewritten module sees this module


# ----------------------------------------------------------------------------------------------- runtime helpers
# What the rewritten statements call. They behave exactly like the original call when CUDA is present.

def cuda_device_count_at_least_one() -> int:
    """``torch.cuda.device_count()``, but 1 without CUDA: the predictor's GPU list ``[current_device()]`` = [0]
    names the one device the work runs on (redirected by the device shim)."""
    return max(1, torch.cuda.device_count()) if not torch.cuda.is_available() else torch.cuda.device_count()


class _NoAutocast(contextlib.ContextDecorator):
    """A context manager / decorator that leaves the autocast state exactly as it is."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def cuda_autocast(device_type="cuda", dtype: Optional[torch.dtype] = None, enabled: bool = True,
                  cache_enabled: Optional[bool] = None):
    """``torch.autocast`` for a CUDA device type: the real thing when CUDA is present, else a context that changes
    nothing, so the model runs in float32 on the CPU / MPS (CPU bfloat16 matmuls are emulated on most CPUs; MPS
    autocast objects raise even when disabled on some torch versions). Other device types: ``torch.autocast``."""
    original = _original_autocast()
    if str(device_type).split(":")[0] != "cuda" or torch.cuda.is_available():
        return original(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
    return _NoAutocast()


def to_bfloat16_on_cuda(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.to(torch.bfloat16)`` with CUDA (where the model runs under bfloat16 autocast and the cast is
    "usually a no-op"); the tensor unchanged without CUDA, where the model runs in float32 and a bfloat16 tensor
    would meet float32 weights outside autocast."""
    return tensor.to(torch.bfloat16) if torch.cuda.is_available() else tensor


def connected_components_cpu(masks: torch.Tensor):
    """SAM 3's CPU connected-components fallback, ``(labels, component size at each pixel)`` of a ``[B, 1, H, W]``
    (or ``[B, H, W]``) mask batch with 8-connectivity, through ``scipy.ndimage.label`` (scipy is a dependency of
    SAM 3's video code anyway). An empty batch (no detections on a frame) gives empty results."""
    import numpy as np
    from scipy import ndimage

    shape = masks.shape
    planes = masks.reshape(-1, shape[-2], shape[-1]).cpu().numpy() != 0
    labels = np.zeros(planes.shape, np.int64)
    counts = np.zeros(planes.shape, np.int64)
    for b, plane in enumerate(planes):
        labels[b], _ = ndimage.label(plane, structure=np.ones((3, 3), bool))
        sizes = np.bincount(labels[b].ravel())
        sizes[0] = 0  # background pixels belong to no component
        counts[b] = sizes[labels[b]]
    as_tensor = lambda a: torch.from_numpy(a).to(masks.device).view(shape)  # noqa: E731
    return as_tensor(labels), as_tensor(counts)


def _original_autocast():
    # the unpatched class, also while patches.cuda_shim has replaced torch.autocast
    return torch.amp.autocast_mode.autocast


# ----------------------------------------------------------------------------------------------- transformations

def _dotted(node: ast.AST) -> str:
    """``torch.cuda.device_count`` for the expression ``torch.cuda.device_count`` ("" for anything else)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _helper(name: str) -> ast.Attribute:
    return ast.Attribute(value=ast.Name(id=HELPER, ctx=ast.Load()), attr=name, ctx=ast.Load())


def _scopes(tree: ast.Module, scope: str) -> List[ast.AST]:
    """The function (``Class.method`` or ``function``) named ``scope`` in the module; the module for ``"*"``."""
    if scope == "*":
        return [tree]
    found = []
    head, _, tail = scope.partition(".")
    for node in tree.body:
        if tail and isinstance(node, ast.ClassDef) and node.name == head:
            found += [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                      and n.name == tail]
        elif not tail and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == head:
            found.append(node)
    return found


def replace_callee(scope: str, callee: str, helper: str, only_if: Optional[Callable[[ast.Call], bool]] = None):
    """A transformation: calls of ``callee`` (dotted name) inside ``scope`` call this module's ``helper`` instead,
    with the same arguments. Returns how many calls it rewrote."""

    def transform(tree: ast.Module) -> int:
        count = 0
        for root in _scopes(tree, scope):
            for node in ast.walk(root):
                if isinstance(node, ast.Call) and _dotted(node.func) == callee and (only_if is None or only_if(node)):
                    node.func = _helper(helper)
                    count += 1
        return count
    return transform


def replace_cast(scope: str, dtype: str, helper: str):
    """A transformation: ``<expr>.to(<dtype>)`` (exactly one positional argument, the dotted ``dtype``) inside
    ``scope`` becomes ``helper(<expr>)``."""

    def transform(tree: ast.Module) -> int:
        count = 0
        for root in _scopes(tree, scope):
            for parent in ast.walk(root):
                for name, value in ast.iter_fields(parent):
                    items = value if isinstance(value, list) else [value]
                    for i, node in enumerate(items):
                        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                                and node.func.attr == "to" and len(node.args) == 1 and not node.keywords
                                and _dotted(node.args[0]) == dtype):
                            new = ast.Call(func=_helper(helper), args=[node.func.value], keywords=[])
                            if isinstance(value, list):
                                value[i] = new
                            else:
                                setattr(parent, name, new)
                            count += 1
        return count
    return transform


def _names_cuda(call: ast.Call) -> bool:
    """Whether an autocast call's device type is the literal "cuda"."""
    args = [k.value for k in call.keywords if k.arg == "device_type"] + list(call.args[:1])
    return any(isinstance(a, ast.Constant) and a.value == "cuda" for a in args)


def _helper_import(tree: ast.Module) -> None:
    """``import patches.sam3_video as <HELPER>`` after the module's docstring and ``__future__`` imports (once)."""
    for node in tree.body:
        if isinstance(node, ast.Import) and any(a.asname == HELPER for a in node.names):
            return
    index = 0
    for index, node in enumerate(tree.body):
        docstring = index == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        if not (docstring or isinstance(node, ast.ImportFrom) and node.module == "__future__"):
            break
    else:
        index = len(tree.body)
    tree.body.insert(index, ast.Import(names=[ast.alias(name=__name__, asname=HELPER)]))


def _entry(name: str, module: str, description: str, transforms: List[Callable[[ast.Module], int]],
           expect: int = 1) -> None:
    """Register a :mod:`patches.fixups` entry that applies ``transforms`` all-or-nothing: they are tried on a copy
    first, and fewer than ``expect`` rewrites mean the installed sam3 differs (``ShapeMismatch``)."""
    from patches.fixups import Fixup, ShapeMismatch, register

    def transform(tree: ast.Module) -> None:
        trial = copy.deepcopy(tree)
        if sum(t(trial) for t in transforms) < expect:
            raise ShapeMismatch(f"fewer than {expect} of the expected construct(s) found")
        for t in transforms:
            t(tree)
        _helper_import(tree)

    transform.__name__ = name
    register(Fixup(name, module, description, transform))


_AUTOCASTS = ("torch.autocast", "torch.amp.autocast")


def _register_all() -> None:
    _entry("sam3_video_predictor_gpu_count", "sam3.model.sam3_video_predictor",
           "SAM 3: build_sam3_video_predictor() -> AssertionError at `assert all(0 <= i < torch.cuda.device_count() "
           "for i in gpus_to_use)`: without CUDA device_count() is 0 while the GPU list is [current_device()] = "
           "[0]; that count reads at least 1 there (the one device the device shim sends 'cuda:0' to).",
           [replace_callee("Sam3VideoPredictorMultiGPU.__init__", "torch.cuda.device_count",
                           "cuda_device_count_at_least_one")])
    _entry("sam3_video_autocast", "sam3.model.sam3_video_inference",
           "SAM 3: @torch.autocast(device_type='cuda', dtype=torch.bfloat16) on the video model's methods: without "
           "CUDA they leave the autocast state alone (float32 on the CPU / MPS) instead of becoming bfloat16 autocast "
           "of the target device.",
           [replace_callee("*", c, "cuda_autocast", _names_cuda) for c in _AUTOCASTS])
    _entry("sam3_tracker_autocast", "sam3.model.sam3_tracking_predictor",
           "SAM 3: Sam3TrackerPredictor.__init__ enters torch.autocast('cuda', bfloat16) and never leaves it; "
           "through the CUDA autocast shim that was process-wide CPU bfloat16 autocast for everything after the "
           "predictor was built (reconstruct included). Without CUDA the context changes nothing.",
           [replace_callee("Sam3TrackerPredictor.__init__", c, "cuda_autocast", _names_cuda) for c in _AUTOCASTS])
    _entry("sam3_tracker_bfloat16_memory", "sam3.model.sam3_tracking_predictor",
           "SAM 3: the tracker stores its memory features with .to(torch.bfloat16) for CUDA autocast to consume; "
           "without CUDA (float32, no autocast) they stay float32, else 'Input type (c10::BFloat16) and bias type "
           "(float) should be the same' in the memory attention.",
           [replace_cast("Sam3TrackerPredictor._run_single_frame_inference", "torch.bfloat16",
                         "to_bfloat16_on_cuda"),
            replace_cast("Sam3TrackerPredictor._run_memory_encoder", "torch.bfloat16", "to_bfloat16_on_cuda")],
           expect=2)
    _entry("sam3_detector_bfloat16_features", "sam3.model.sam3_image",
           "SAM 3: Sam3ImageOnVideoMultiGPU casts the tracker backbone features with x.to(torch.bfloat16) ('usually "
           "a no-op ... due to AMP'); without CUDA autocast -> RuntimeError 'Input type (c10::BFloat16) and bias "
           "type (float) should be the same' in the tracker's conv_s0. Without CUDA they stay float32.",
           [replace_cast("Sam3ImageOnVideoMultiGPU._build_multigpu_buffer_next_chunk", "torch.bfloat16",
                         "to_bfloat16_on_cuda")])
    _entry("sam3_cpu_connected_components", "sam3.perflib.connected_components",
           "SAM 3: the CPU fallback of connected_components() (hole filling of every video frame's masks) raises "
           "'stack expects a non-empty TensorList' on a frame without detections and needs scikit-image, which sam3 "
           "does not declare (ModuleNotFoundError 'skimage'); the call goes to a scipy.ndimage labelling with the "
           "same 8-connectivity that returns empty results for an empty batch.",
           [replace_callee("connected_components", "connected_components_cpu", "connected_components_cpu")])
    _entry("sam3_decoder_ffn_autocast", "sam3.model.decoder",
           "SAM 3: TransformerDecoderLayer.forward_ffn's torch.amp.autocast('cuda', enabled=False) becomes an MPS "
           "autocast object on a Mac, which raises 'unsupported scalarType' on some torch versions (reported "
           "upstream; not reproducible without MPS). Without CUDA the context changes nothing (the autocasts above "
           "are gone, so there is nothing to switch off).",
           [replace_callee("TransformerDecoderLayer.forward_ffn", c, "cuda_autocast", _names_cuda)
            for c in _AUTOCASTS])


_register_all()
