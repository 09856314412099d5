"""Checkpoint reading and model building for the released checkpoint folder (``checkpoints/hf/``).

Formats: upstream ``.ckpt`` files (a torch zip pickle holding either a raw state dict, or a dict with
``state_dict`` whose keys carry ``_base_models.<name>.`` prefixes) and ``.safetensors``.

Safety and memory:
* ``.ckpt`` files are read with ``torch.load(weights_only=True, mmap=True)``: only tensors and plain containers are
  unpickled (no code runs), and tensor storage stays memory-mapped until used.
* models are built on the ``meta`` device (no parameter memory, no random init) and the checkpoint tensors are
  assigned into them (``load_state_dict(assign=True)``) after a cast to each parameter's dtype and a move to the
  target device; a float32 tensor on CPU for a float32 parameter is used in place (zero copy from the mmap).
* loading is strict: missing, unexpected or mis-shaped keys raise ``CheckpointError`` listing them.
* buffers the checkpoint does not hold (non-persistent tables computed in constructors) are taken from a second,
  real construction in which parameter initialisation is skipped (so it is cheap).

dtype rules (upstream): each model keeps the dtypes its constructor gives its parameters (``use_fp16`` torsos in
float16, everything else float32), whatever dtype the file stores. A ``use_fp16`` torso is then converted to the
dtype it computes in on the target device (float32 on the CPU), which it would do at its first call anyway; when
that copies most of a file's tensors, the few still used in place are copied too, so the file's mapping, and the
half-precision pages read through it, go away with the load (``release_checkpoint_mapping``).
"""
from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Union

import torch
from torch.overrides import TorchFunctionMode

from sam3d_objects.model.backbone.tdfy_dit.modules.utils import settle_torso_dtypes

StateDict = Dict[str, torch.Tensor]
PathLike = Union[str, Path]
# key prefixes of the generator and condition-embedder weights inside the ss/slat generator checkpoints
GENERATOR_PREFIX = "_base_models.generator."
EMBEDDER_PREFIX = "_base_models.condition_embedder."


class CheckpointError(RuntimeError):
    pass


# --------------------------------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------------------------------
def _torch_load(path: Path):
    kwargs = dict(map_location="cpu", weights_only=True)
    try:
        return torch.load(path, mmap=True, **kwargs)
    except RuntimeError as e:
        if "mmap" not in str(e) and "zip" not in str(e):  # legacy (non-zip) files cannot be mapped
            raise
        return torch.load(path, **kwargs)


def read_checkpoint(path: PathLike) -> Any:
    """Raw content of a ``.ckpt`` / ``.pt`` / ``.pth`` (weights only) or a ``.safetensors`` file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} not found. Point the pipeline at the checkpoint folder "
                              f"(checkpoints/hf/ with pipeline.yaml and the *.ckpt files).")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        try:
            return load_file(str(path))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{path} is not a readable safetensors file ({e}); the file may be truncated "
                                  f"or corrupt: download it again.") from e
    try:
        return _torch_load(path)
    except Exception as e:  # noqa: BLE001  corrupt zip, truncated file, unsafe pickle ...
        text = str(e)
        if "weights_only" in text or "Unsupported global" in text or "WeightsUnpickler" in text:
            raise CheckpointError(f"{path} contains pickled Python objects besides tensors; refusing to load it "
                                  f"with code execution (weights_only=True). Re-save only its state dict "
                                  f"(torch.save({{'state_dict': sd}}, path)) or convert it to .safetensors.") from e
        if isinstance(e, (zipfile.BadZipFile, EOFError)) or "zip" in text.lower() or "central directory" in text:
            raise CheckpointError(f"{path} is truncated or corrupt ({type(e).__name__}: {text}); download it "
                                  f"again.") from e
        raise CheckpointError(f"cannot read checkpoint {path}: {type(e).__name__}: {text}") from e


def _safetensors_keys(path: Path) -> list:
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file ({e}); the file may be truncated or "
                              f"corrupt: download it again.") from e


def verify_checkpoint(path: PathLike, prefixes: Iterable[str] = ()) -> None:
    """Fast structural check of one checkpoint file, without reading its tensors: it exists, its container
    (torch zip / safetensors header) is intact, it holds a state dict and, for each of ``prefixes``, keys starting
    with it. CheckpointError names the file and the fix."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} not found: the checkpoint folder is incomplete; download "
                              f"it again.")
    if path.suffix == ".safetensors":
        keys = _safetensors_keys(path)
    else:
        if path.stat().st_size == 0:
            raise CheckpointError(f"{path} is empty (0 bytes): an interrupted download? Download it again.")
        if not zipfile.is_zipfile(path):
            # torch zip files end with a central directory; a cut download loses it. Legacy (pre-1.6) pickles are
            # not zips: those are checked when they are loaded.
            with open(path, "rb") as f:
                head = f.read(2)
            if head[:1] == b"\x80":
                return
            raise CheckpointError(f"{path} is truncated or corrupt (no zip directory at its end); download it "
                                  f"again.")
        try:
            with zipfile.ZipFile(path) as archive:
                names = archive.namelist()
        except (zipfile.BadZipFile, OSError) as e:
            raise CheckpointError(f"{path} is truncated or corrupt ({e}); download it again.") from e
        if not any(n.endswith("data.pkl") for n in names):
            raise CheckpointError(f"{path} is a zip file but not a torch checkpoint (no data.pkl); download it "
                                  f"again.")
        content = read_checkpoint(path)  # weights only + mmap: the index is unpickled, no tensor is read
        if isinstance(content, Mapping) and isinstance(content.get("state_dict"), Mapping):
            content = content["state_dict"]
        if not isinstance(content, Mapping):
            raise CheckpointError(f"{path} does not hold a state dict (name -> tensor); download it again.")
        keys = list(content.keys())
    for prefix in prefixes:
        if not any(str(k).startswith(prefix) for k in keys):
            raise CheckpointError(f"{path} has no key starting with {prefix!r}: a checkpoint of another model, or a "
                                  f"damaged file? Download it again.")


def extract_state_dict(content: Any, path: PathLike, state_dict_key: Optional[str] = None,
                       prefix: Optional[str] = None) -> StateDict:
    """Pick ``content[state_dict_key]`` (when given and present), keep keys starting with ``prefix`` (removed)."""
    sd = content
    if state_dict_key is not None and isinstance(sd, Mapping) and state_dict_key in sd:
        sd = sd[state_dict_key]
    if not isinstance(sd, Mapping) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"{path} does not hold a state dict (name -> tensor)"
                              + (f" under {state_dict_key!r}" if state_dict_key else ""))
    if prefix:
        sd = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
        if not sd:
            raise CheckpointError(f"{path} has no key starting with {prefix!r}: wrong checkpoint for this model?")
    return dict(sd)


# --------------------------------------------------------------------------------------------------------------
# building
# --------------------------------------------------------------------------------------------------------------
_INIT_OPS = {"uniform_", "normal_", "trunc_normal_", "zero_", "fill_", "copy_", "kaiming_uniform_",
             "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "constant_", "orthogonal_", "erfinv_",
             "mul_", "add_", "clamp_", "exponential_", "geometric_", "bernoulli_", "random_"}


_FACTORIES = {"empty", "zeros", "ones", "full", "randn", "rand", "randint", "normal"}
_LARGE = 1 << 20


def _requested_numel(args) -> int:
    dims = args[0] if args and isinstance(args[0], (tuple, list, torch.Size)) else args
    numel = 1
    for d in dims:
        if not isinstance(d, int):
            return 0
        numel *= d
    return numel


class _SkipParameterInit(TorchFunctionMode):
    """While constructing a module only to harvest its small computed buffers: skip in-place initialisation ops
    on parameters and, with ``large_on_meta``, allocate large tensors (> 1M elements: weights) on the meta device
    so the construction costs neither time nor memory."""

    def __init__(self, large_on_meta: bool = False):
        super().__init__()
        self.large_on_meta = large_on_meta

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _INIT_OPS and args and isinstance(args[0], torch.nn.Parameter):
            return args[0]
        if (self.large_on_meta and name in _FACTORIES and kwargs.get("device") is None
                and _requested_numel(args) > _LARGE):
            kwargs = {**kwargs, "device": "meta"}
        return func(*args, **kwargs)


def _harvest_build(rebuild: Callable[[], torch.nn.Module], needed: Iterable[str]) -> torch.nn.Module:
    """A real construction holding the tensors named in ``needed`` (cheap attempt first, then a plain one)."""
    needed = list(needed)
    try:
        with torch.device("cpu"), _SkipParameterInit(large_on_meta=True):
            real = rebuild()
        if not any(t.is_meta for n, t in real.named_buffers() if n in needed) and not _meta_attributes(real):
            return real
    except Exception:  # noqa: BLE001  a constructor mixing meta and real tensors: do the plain construction
        pass
    with torch.device("cpu"), _SkipParameterInit():
        return rebuild()


def _meta_tensors(module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    out = {f"{n}": b for n, b in module.named_buffers() if b.is_meta}
    out.update({n: p for n, p in module.named_parameters() if p.is_meta})
    return out


def _holds_meta(value, depth: int = 3, seen=None) -> bool:
    """Whether a plain Python object (not a module) holds a meta tensor, a few attribute levels deep."""
    if isinstance(value, torch.Tensor):
        return value.is_meta
    if depth == 0 or isinstance(value, (torch.nn.Module, type, str, bytes, int, float, bool)) or value is None:
        return False
    seen = set() if seen is None else seen
    if id(value) in seen:
        return False
    seen.add(id(value))
    if isinstance(value, (list, tuple)):
        children = list(value)
    elif isinstance(value, dict):
        children = list(value.values())
    elif hasattr(value, "__dict__"):
        children = list(vars(value).values())
    else:
        return False
    return any(_holds_meta(v, depth - 1, seen) for v in children)


def _meta_attributes(module: torch.nn.Module):
    """(module name, attribute) of plain (non-registered) attributes that hold meta tensors, e.g. lookup tables
    on helper objects."""
    found = []
    for mod_name, mod in module.named_modules():
        for attr, value in vars(mod).items():
            if attr in ("_parameters", "_buffers", "_modules"):
                continue
            if _holds_meta(value):
                found.append((mod_name, attr))
    return found


def _set_tensor(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    if attr in owner._buffers:
        owner._buffers[attr] = value
    else:
        owner._parameters[attr] = torch.nn.Parameter(value, requires_grad=False)


def format_key_problems(missing: Iterable[str], unexpected: Iterable[str], mismatched: Iterable[str] = (),
                        limit: int = 12) -> str:
    parts = []
    for label, keys in (("missing", list(missing)), ("unexpected", list(unexpected)),
                        ("shape mismatch", list(mismatched))):
        if keys:
            shown = ", ".join(keys[:limit]) + (f", ... (+{len(keys) - limit})" if len(keys) > limit else "")
            parts.append(f"{len(keys)} {label} key(s): {shown}")
    return "; ".join(parts)


def check_tensor_kinds(expected: Mapping[str, torch.Tensor], found: Mapping[str, Any], source: str) -> None:
    """CheckpointError when a tensor's kind differs from the model's: integer / bool / complex data where the
    model holds floating weights (or the reverse) is not a cast the loader may make silently."""
    wrong = []
    for k, ref in expected.items():
        t = found.get(k)
        dtype = getattr(t, "dtype", None)
        if dtype is None:
            continue
        if dtype.is_complex or dtype.is_floating_point != ref.dtype.is_floating_point:
            wrong.append(f"{k} {str(dtype).replace('torch.', '')} vs model {str(ref.dtype).replace('torch.', '')}")
    if wrong:
        shown = ", ".join(wrong[:6]) + (f", ... (+{len(wrong) - 6})" if len(wrong) > 6 else "")
        raise CheckpointError(f"{source}: {len(wrong)} tensor(s) of the wrong kind: {shown}; the file is not "
                              f"this model's checkpoint: download it again.")


def check_finite(tensors: Mapping[str, torch.Tensor], source: str) -> None:
    """CheckpointError naming the first floating tensor holding NaN/inf (one device sync for all tensors: the
    check runs where the weights already are, e.g. on the GPU after the move)."""
    floats = [(k, t) for k, t in tensors.items() if t.is_floating_point() and t.numel()]
    if not floats:
        return
    flags = torch.stack([torch.isfinite(t).all().to(floats[0][1].device) for _, t in floats])
    if bool(flags.all()):
        return
    bad = next(k for (k, _), ok in zip(floats, flags.tolist()) if not ok)
    raise CheckpointError(f"{source}: tensor {bad} holds NaN or infinite values: the file is damaged (or was "
                          f"saved from a diverged model); download it again.")


def _check_keys_shapes_kinds(model: torch.nn.Module, state_dict: Mapping[str, Any], source: str,
                             hint: str = "") -> Dict[str, torch.Tensor]:
    """``state_dict`` has exactly the model's keys, shapes and tensor kinds (CheckpointError naming the first
    differences otherwise); returns the model's own state dict (parameters and buffers, not detached)."""
    expected = model.state_dict(keep_vars=True)
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    mismatched = [f"{k} {tuple(state_dict[k].shape)} vs model {tuple(v.shape)}" for k, v in expected.items()
                  if k in state_dict and tuple(state_dict[k].shape) != tuple(v.shape)]
    if missing or unexpected or mismatched:
        raise CheckpointError(f"{source} does not match {type(model).__name__}: "
                              f"{format_key_problems(missing, unexpected, mismatched)}. Is this the checkpoint of "
                              f"another model, or the wrong model yaml?{hint}")
    check_tensor_kinds(expected, state_dict, source)
    return expected


def check_against_model(model: torch.nn.Module, state_dict: Mapping[str, Any], source: str) -> None:
    """The manifest check, without reading tensor data: ``state_dict`` (tensors of a memory-mapped file, or
    anything with ``shape`` and ``dtype``) has exactly the model's keys, shapes and tensor kinds. ``model`` is
    built on the meta device from the folder's yaml, so the expected manifest is the yaml's own."""
    _check_keys_shapes_kinds(model, state_dict, source, " Download the folder again.")


def verify_zip_checksums(path: PathLike, chunk: int = 16 << 20) -> None:
    """CheckpointError when a record of a torch zip checkpoint does not match its stored CRC-32 (bytes changed
    on disk or in transfer: torch's reader does not check). Streams the file once (about 1 s per GB)."""
    path = Path(path)
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key in _VERIFIED or not zipfile.is_zipfile(path):
        return  # low-memory mode reloads models every run: each file is read through once per process
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                with archive.open(info) as f:  # zipfile compares the CRC-32 when a record is read to its end
                    while f.read(chunk):
                        pass
    except zipfile.BadZipFile as e:
        damaged = "CRC" in str(e)
        raise CheckpointError(f"{path} is {'damaged' if damaged else 'truncated or corrupt'} ({e}): the file "
                              f"changed after it was written; download it again.") from e
    except (OSError, EOFError) as e:
        raise CheckpointError(f"{path} is truncated or corrupt ({e}); download it again.") from e
    _VERIFIED.add(key)


_VERIFIED: set = set()


# (model built on meta, its checked state dict, device) -> the keys it put into the model itself (e.g. by swapping
# layers for converted ones); see load_model's `convert`
Converter = Callable[[torch.nn.Module, StateDict, torch.device], Iterable[str]]


def load_into_meta_model(model: torch.nn.Module, state_dict: StateDict, device: torch.device,
                         source: str = "checkpoint", rebuild: Optional[Callable[[], torch.nn.Module]] = None,
                         convert: Optional[Converter] = None) -> torch.nn.Module:
    """Strictly assign ``state_dict`` into a model built on the meta device (see module docstring). ``convert``
    runs after the strict key/shape check and before anything is cast: the keys it consumed are left out of
    the assignment."""
    expected = _check_keys_shapes_kinds(model, state_dict, source)
    consumed = set(convert(model, state_dict, device)) if convert is not None else set()
    cast = {}
    for k, ref in expected.items():
        if k in consumed:
            continue
        t = state_dict[k]
        dtype = ref.dtype if t.is_floating_point() and ref.is_floating_point() else t.dtype
        cast[k] = t.to(device=device, dtype=dtype)
    check_finite(cast, source)
    result = model.load_state_dict(cast, strict=not consumed, assign=True)
    if consumed and result.unexpected_keys:  # the converted layers' own tensors are the only ones not assigned
        raise CheckpointError(f"{source}: keys left after converting layers: {sorted(result.unexpected_keys)[:8]}")
    leftovers = _meta_tensors(model)
    attrs = _meta_attributes(model)
    if leftovers or attrs:
        if rebuild is None:
            raise CheckpointError(f"{type(model).__name__} still has uninitialised tensors after loading: "
                                  f"{sorted(leftovers)[:8]}")
        real = _harvest_build(rebuild, leftovers)
        real_tensors = dict(real.named_buffers())
        for name in leftovers:
            _set_tensor(model, name, real_tensors[name].to(device))
        for mod_name, attr in attrs:
            src = real.get_submodule(mod_name) if mod_name else real
            dst = model.get_submodule(mod_name) if mod_name else model
            value = getattr(src, attr)
            if isinstance(value, torch.Tensor):
                value = value.to(device)
            elif hasattr(value, "to") and callable(value.to):
                try:
                    value = value.to(device)
                except TypeError:
                    pass
            setattr(dst, attr, value)
        del real
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


_PREIMPORTED = {"done": False}


def preimport_model_modules(package: str = "sam3d_objects.model") -> None:
    """Import every model module once, OUTSIDE the meta-device context.

    Module-level constant tensors (lookup tables, cube corners) created by an import that happens inside
    ``torch.device("meta")`` would be meta tensors forever; importing first keeps them real.
    """
    if _PREIMPORTED["done"]:
        return
    import importlib
    import pkgutil
    root = importlib.import_module(package)
    for info in pkgutil.walk_packages(root.__path__, prefix=package + "."):
        try:
            importlib.import_module(info.name)
        except Exception:  # noqa: BLE001  optional-dependency modules may not import; they fail later, clearly
            pass
    _PREIMPORTED["done"] = True


def build_on_meta(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    preimport_model_modules()
    with torch.device("meta"):
        return build()


def load_model(build: Callable[[], torch.nn.Module], checkpoint: Union[PathLike, StateDict],
               device: Union[str, torch.device] = "cpu", state_dict_key: Optional[str] = None,
               prefix: Optional[str] = None, convert: Optional[Converter] = None) -> torch.nn.Module:
    """Build a model with ``build()`` on the meta device and fill it from ``checkpoint`` (path or state dict).
    ``convert`` (e.g. ``sam3d_objects.pipeline.weights.converter("int8")``) replaces layers from the checkpoint's
    tensors before the rest is assigned, so their float weights are never all in memory at once."""
    device = torch.device(device)
    if isinstance(checkpoint, Mapping):
        sd, source = extract_state_dict(checkpoint, "<state dict>", state_dict_key, prefix), "state dict"
    else:
        verify_zip_checksums(checkpoint)
        sd, source = extract_state_dict(read_checkpoint(checkpoint), checkpoint, state_dict_key, prefix), \
            str(checkpoint)
        if prefix:
            source += f" (keys {prefix}*)"
    model = build_on_meta(build)
    try:
        model = load_into_meta_model(model, sd, device, source=source, rebuild=build, convert=convert)
        settle_torso_dtypes(model, device)
        if not isinstance(checkpoint, Mapping):  # a caller's state dict is theirs to keep or drop
            release_checkpoint_mapping(model, sd)
        return model
    except OSError as e:
        # tensors of a memory-mapped file are read only here: a damaged file shows up as a bare OSError
        raise CheckpointError(f"reading the tensors of {source} failed ({type(e).__name__}: {e}); the file may "
                              f"be truncated or corrupt: download it again.") from e


def release_checkpoint_mapping(model: torch.nn.Module, state_dict: StateDict) -> int:
    """Copies the model's tensors that still point into the memory-mapped checkpoint when they are fewer bytes than
    the ones already copied out of it (cast or moved); returns the bytes copied.

    The mapping lives while any tensor points into it, and so do the pages read through it: a float16 torso
    converted to float32 on the CPU (1.1 GB of the full-size stage-2 generator) stayed resident beside its copy
    because a few megabytes of float32 norms and embedders kept the file mapped. A model mostly used in place
    (float32 weights on the CPU) keeps its zero-copy load."""
    def storage_ptr(t: torch.Tensor) -> int:
        return t.untyped_storage().data_ptr()

    read = {storage_ptr(t): t.untyped_storage().nbytes() for t in state_dict.values() if isinstance(t, torch.Tensor)}
    params = dict(model.named_parameters())
    in_place = {name: t for name, t in {**dict(model.named_buffers()), **params}.items() if storage_ptr(t) in read}
    in_place_bytes = sum(read[ptr] for ptr in {storage_ptr(t) for t in in_place.values()})
    if not in_place or in_place_bytes >= sum(read.values()) - in_place_bytes:
        return 0
    for name, t in in_place.items():
        if name in params:
            params[name].data = t.detach().clone()  # the Parameter object stays (optimisers, tied weights)
        else:
            _set_tensor(model, name, t.clone())
    return in_place_bytes


def save_checkpoint(state_dict: StateDict, path: PathLike, prefixed: Optional[Dict[str, StateDict]] = None) -> None:
    """Write in upstream's layout: raw state dict, or ``{'state_dict': {prefix + key: tensor}}`` when ``prefixed``
    maps prefixes to state dicts. ``.safetensors`` paths are written flat with safetensors."""
    path = Path(path)
    flat = dict(state_dict)
    if prefixed:
        flat = {f"{p}{k}": v for p, sd in prefixed.items() for k, v in sd.items()}
    flat = {k: v.detach().contiguous() for k, v in flat.items()}
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file
        save_file(flat, str(path))
    else:
        torch.save({"state_dict": flat} if prefixed else flat, path)
