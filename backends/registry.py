"""The backend registry: names, constraints, selection and overrides for every op family.

Modelled on diffusers' attention dispatcher: each op family has an enum of backend names; each implementation is
a function registered with its constraints (devices, dtypes, optional package, a runtime probe); one dispatch
entry point per family (``backends.sparse_conv3d``, ``backends.varlen_attention``, ``backends.attention``) asks
:func:`resolve` which function to call for the tensors at hand.

The registry is the ground floor of ``backends``: it imports none of the modules that register implementations
(they import it and register themselves when ``backends/__init__.py`` imports them), and it knows nothing about
devices beyond the ``torch.device`` it is handed.

Selection order for a family: the innermost :func:`use` context, else a :func:`set_backend` call, else the
environment variable (read here and nowhere else in the project), else ``auto``. ``auto`` picks the first
registered backend, in priority order, whose constraints hold for the device and dtype of the inputs. A backend
named explicitly that cannot run is an error saying why and what would run instead: never a silent fallback.

This module is also the one place where the project reads environment variables (:func:`env_value`,
:func:`env_flag`); every name read is listed, with what it does, in :data:`ENVIRONMENT` (the op settings) or
:data:`SETTINGS` (the others: checkpoint folder, cache folder, upstream's module switches).
"""
from __future__ import annotations

import contextlib
import contextvars
import enum
import functools
import importlib.util
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import torch


class SparseConvBackend(str, enum.Enum):
    AUTO = "auto"
    TORCH = "torch"
    METAL = "metal"
    TRITON = "triton"
    SPCONV = "spconv"
    TORCHSPARSE = "torchsparse"


class AttentionBackend(str, enum.Enum):
    AUTO = "auto"
    SDPA = "sdpa"
    VARLEN = "varlen"
    FLASH_ATTN = "flash_attn"
    XFORMERS = "xformers"
    METAL = "metal"
    NAIVE = "naive"


class NormBackend(str, enum.Enum):
    AUTO = "auto"
    NATIVE = "native"
    TRITON = "triton"
    REFERENCE = "reference"


class QuantLinearBackend(str, enum.Enum):
    """Linear layers with int8 / bf16 stored weights (``backends.quant_linear``)."""
    AUTO = "auto"
    DEQUANT = "dequant"            # widen the weight, float GEMM: weight-only, every device
    INT8PACK = "int8pack"          # torch's weight-only int8 GEMM
    INT8_DYNAMIC = "int8_dynamic"  # int8 activations per token too (only when named)
    BF16 = "bf16"                  # bf16 GEMM


class Family(str, enum.Enum):
    SPARSE_CONV = "sparse_conv"
    SPARSE_ATTN = "sparse_attn"
    ATTN = "attn"
    NORM = "norm"
    QUANT_LINEAR = "quant_linear"


# The op settings: every environment variable that chooses or bounds the ops (`env_value` refuses unlisted names).
ENVIRONMENT = {
    "SPARSE_BACKEND": "sparse convolution backend: auto, torch, metal, triton, spconv, torchsparse",
    "SPARSE_ATTN_BACKEND": "sparse (varlen) attention backend; falls back to ATTN_BACKEND",
    "ATTN_BACKEND": "dense attention backend: auto, sdpa, varlen, flash_attn, xformers, metal, naive",
    "NORM_BACKEND": "norm/adaLN backend: auto (triton on CUDA, else native), native, triton, reference (PyTorch "
                    "2.5.1 CPU rounding)",
    "QUANT_LINEAR_BACKEND": "linear layers with int8 / bf16 weights (--weights): auto, dequant, int8pack, "
                            "int8_dynamic, bf16",
    "SAM3D_ATTN_MAX_MB": "upper bound in MiB for one attention-score tensor of the portable backends",
    "SAM3D_DEVICE": "default device (cpu, mps, cuda, cuda:1, ...) instead of cuda > mps > cpu",
    "SAM3D_METAL_LAUNCH_WORK": "Metal kernels: worst-case multiply-adds per launch (macOS GPU watchdog bound)",
    "SAM3D_METAL_FLUSH_WORK": "Metal kernels: worst-case multiply-adds per flushed command buffer",
    "SAM3D_METAL_THREADGROUP_MEMORY": "Metal kernels: threadgroup memory per threadgroup in bytes (default 32768)",
}

# The other settings the project reads from its environment: not op settings (they choose no backend and bound no
# op), but read here too so that the environment is read in one place and every name is listed.
SETTINGS = {
    "SAM3D_CHECKPOINTS": "folder with the released pipeline.yaml and checkpoints, or a Hugging Face repo id (read by the CLI)",
    "SAM3D_CACHE_DIR": "folder for tuning results kept between processes (default ~/.cache/sam3d_objects)",
    "ATTN_DEBUG": "upstream's dense-attention debug flag (modules.attention.DEBUG); 1/true to set",
    "SPARSE_DEBUG": "upstream's sparse-module debug flag (modules.sparse.DEBUG); 1/true to set",
    "SPCONV_ALGO": "upstream's spconv algorithm setting (modules.sparse.conv.SPCONV_ALGO), used by conv_spconv",
}


# Upstream's names that differ from ours. `torch_flash_attn` was upstream's SDPA-with-flash-kernel switch.
_ALIASES = {
    Family.SPARSE_CONV: {},
    Family.SPARSE_ATTN: {"torch_flash_attn": "sdpa", "flash-attn": "flash_attn"},
    Family.ATTN: {"torch_flash_attn": "sdpa", "flash-attn": "flash_attn"},
    Family.NORM: {},
    Family.QUANT_LINEAR: {},
}
_ENUMS = {Family.SPARSE_CONV: SparseConvBackend, Family.SPARSE_ATTN: AttentionBackend, Family.ATTN: AttentionBackend,
          Family.NORM: NormBackend, Family.QUANT_LINEAR: QuantLinearBackend}
# SPARSE_ATTN_BACKEND falls back to ATTN_BACKEND, as upstream does.
_ENV_VARS = {
    Family.SPARSE_CONV: ("SPARSE_BACKEND",),
    Family.SPARSE_ATTN: ("SPARSE_ATTN_BACKEND", "ATTN_BACKEND"),
    Family.ATTN: ("ATTN_BACKEND",),
    Family.NORM: ("NORM_BACKEND",),
    Family.QUANT_LINEAR: ("QUANT_LINEAR_BACKEND",),
}


@dataclass
class BackendSpec:
    """One implementation and the conditions under which it can run."""

    name: str
    family: Family
    fn: Callable
    devices: tuple[str, ...]                     # device types, e.g. ("cpu", "mps", "cuda")
    dtypes: tuple[torch.dtype, ...]
    requires: tuple[str, ...] = ()               # importable modules the backend needs
    probe: Optional[Callable[[torch.device], Optional[str]]] = None  # returns a reason it cannot run, or None
    priority: int = 0                            # higher is preferred by auto, per device
    auto_devices: Optional[tuple[str, ...]] = None  # devices where auto may pick it (default: all of `devices`)
    reference: bool = False                      # reference implementations are never picked by auto
    volatile: bool = False                       # the probe depends on mutable state: never cache the choice
    # family-specific companions (functions, e.g. the norm family's layer_norm) and capability flags, read by the
    # dispatchers through `has`: `lean` (sparse conv: the portable lean / child-block paths stand in for it),
    # `takes_rows` (varlen attention: accepts a row permutation), `warn_when_skipped` (auto warns once when it
    # cannot run where it should)
    extra: dict = field(default_factory=dict)

    def has(self, capability: str) -> bool:
        """Whether the backend declared ``capability`` in its registration."""
        return bool(self.extra.get(capability))

    def why_not(self, device: torch.device, dtype: Optional[torch.dtype] = None) -> Optional[str]:
        """None when the backend can run for this device/dtype, else a one-line reason."""
        if device.type not in self.devices:
            return f"runs on {'/'.join(self.devices)}, not {device.type}"
        if dtype is not None and dtype not in self.dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in self.dtypes)
            return f"supports {names}, not {str(dtype).replace('torch.', '')}"
        for module in self.requires:
            if not module_available(module):
                return f"needs the optional package '{module}' (not installed)"
        if self.probe is not None:
            return self.probe(device)
        return None


_REGISTRY: dict[Family, dict[str, BackendSpec]] = {f: {} for f in Family}
_OVERRIDES: contextvars.ContextVar[dict] = contextvars.ContextVar("backend_overrides", default={})
_SET: dict[Family, str] = {}
_WARNED: set = set()
# (family, requested name, device type, dtype) -> spec; cleared by use(), set_backend() and register()
_RESOLVED: dict = {}


def module_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def register(family: Family, name: str, *, devices: Sequence[str], dtypes: Sequence[torch.dtype],
             requires: Sequence[str] = (), probe=None, priority: int = 0, auto_devices=None,
             reference: bool = False, volatile: bool = False, **extra) -> Callable:
    """Decorator: register ``fn`` as backend ``name`` of ``family``."""
    family = Family(family)
    _ENUMS[family](name)  # only names of the family's enum can be registered

    def wrap(fn: Callable) -> Callable:
        _REGISTRY[family][name] = BackendSpec(
            name=name, family=family, fn=fn, devices=tuple(devices), dtypes=tuple(dtypes), requires=tuple(requires),
            probe=probe, priority=priority, auto_devices=tuple(auto_devices) if auto_devices else None,
            reference=reference, volatile=volatile, extra=dict(extra))
        _RESOLVED.clear()
        return fn

    return wrap


def registered(family: Family) -> dict[str, BackendSpec]:
    return dict(_REGISTRY[Family(family)])


@functools.lru_cache(maxsize=256)
def canonical_name(family: Family, name: str) -> str:
    """Map an upstream or user spelling to our enum value; unknown names raise listing the valid ones.
    (Memoised: the environment's value is re-read on every dispatch and canonicalised here.)"""
    family = Family(family)
    key = str(name).strip().lower()
    key = _ALIASES[family].get(key, key)
    valid = [m.value for m in _ENUMS[family]]
    if key not in valid:
        aliases = sorted(_ALIASES[family])
        raise ValueError(f"unknown {family.value} backend {name!r}; valid names: {', '.join(valid)}"
                         + (f" (upstream aliases: {', '.join(aliases)})" if aliases else ""))
    return key


def env_value(name: str, default: Optional[str] = None) -> Optional[str]:
    """The one place where the project reads its environment (names must be listed in :data:`ENVIRONMENT` or
    :data:`SETTINGS`); unset or blank gives ``default``."""
    if name not in ENVIRONMENT and name not in SETTINGS:
        raise KeyError(f"{name} is not a documented setting; add it to backends.registry.ENVIRONMENT (op settings) "
                       f"or backends.registry.SETTINGS (the others)")
    value = os.environ.get(name)
    return default if value is None or value.strip() == "" else value.strip()


def env_flag(name: str, default: bool = False) -> bool:
    """A yes/no setting: 1, true, yes or on (any case) is True; unset or blank gives ``default``."""
    value = env_value(name)
    if value is None:
        return default
    return value.lower() in ("1", "true", "yes", "on")


def cache_dir() -> "os.PathLike[str]":
    """``$SAM3D_CACHE_DIR`` or ``~/.cache/sam3d_objects``: where tuning results outlive the process (the folder
    may not exist yet; writers create it and tolerate failure)."""
    from pathlib import Path
    value = env_value("SAM3D_CACHE_DIR")
    return Path(value).expanduser() if value else Path.home() / ".cache" / "sam3d_objects"


def checkpoints_env() -> Optional[str]:
    """``$SAM3D_CHECKPOINTS`` (or None): the CLI's default checkpoint folder."""
    return env_value("SAM3D_CHECKPOINTS")


def requested(family: Family) -> tuple[str, str]:
    """(canonical requested name, where it came from) for a family, before device-based resolution."""
    if family.__class__ is not Family:
        family = Family(family)
    overrides = _OVERRIDES.get()
    if family in overrides:
        return overrides[family], "backends.use(...)"
    if family in _SET:
        return _SET[family], "backends.set_backend(...)"
    for var in _ENV_VARS[family]:
        value = env_value(var)
        if value is not None:
            return canonical_name(family, value), f"${var}"
    return "auto", "default"


def set_backend(*, sparse: Optional[str] = None, sparse_attn: Optional[str] = None,
                attn: Optional[str] = None, norm: Optional[str] = None,
                quant_linear: Optional[str] = None) -> None:
    """Process-wide choice (beats the environment, loses to :func:`use`). ``None`` leaves a family unchanged;
    ``"auto"`` restores automatic selection over the environment variable."""
    for family, name in ((Family.SPARSE_CONV, sparse), (Family.SPARSE_ATTN, sparse_attn), (Family.ATTN, attn),
                         (Family.NORM, norm), (Family.QUANT_LINEAR, quant_linear)):
        if name is not None:
            _SET[family] = canonical_name(family, name)
    _RESOLVED.clear()


def reset_backends() -> None:
    """Forget :func:`set_backend` choices (the environment applies again)."""
    _SET.clear()
    _RESOLVED.clear()


@contextlib.contextmanager
def use(*, sparse: Optional[str] = None, attn: Optional[str] = None,
        sparse_attn: Optional[str] = None, norm: Optional[str] = None,
        quant_linear: Optional[str] = None) -> Iterator[None]:
    """Override backends inside a ``with`` block. ``attn`` also sets sparse attention unless ``sparse_attn`` is
    given, mirroring how ``SPARSE_ATTN_BACKEND`` falls back to ``ATTN_BACKEND``."""
    current = dict(_OVERRIDES.get())
    if sparse is not None:
        current[Family.SPARSE_CONV] = canonical_name(Family.SPARSE_CONV, sparse)
    if attn is not None:
        current[Family.ATTN] = canonical_name(Family.ATTN, attn)
        if sparse_attn is None:
            current[Family.SPARSE_ATTN] = current[Family.ATTN]
    if sparse_attn is not None:
        current[Family.SPARSE_ATTN] = canonical_name(Family.SPARSE_ATTN, sparse_attn)
    if norm is not None:
        current[Family.NORM] = canonical_name(Family.NORM, norm)
    if quant_linear is not None:
        current[Family.QUANT_LINEAR] = canonical_name(Family.QUANT_LINEAR, quant_linear)
    token = _OVERRIDES.set(current)
    _RESOLVED.clear()
    try:
        yield
    finally:
        _OVERRIDES.reset(token)
        _RESOLVED.clear()


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run for these inputs."""


def _auto_candidates(family: Family, device: torch.device) -> list[BackendSpec]:
    specs = [s for s in _REGISTRY[family].values()
             if not s.reference and device.type in (s.auto_devices or s.devices)]
    return sorted(specs, key=lambda s: -s.priority)


def resolve(family: Family, device: torch.device, dtype: Optional[torch.dtype] = None,
            name: Optional[str] = None) -> BackendSpec:
    """The backend that will run ``family`` for inputs on ``device`` with ``dtype``: ``name`` when given (a
    caller's own choice, e.g. "auto" for a model that must not follow the environment), else the requested one
    (:func:`requested`).

    Successful choices are cached per (family, requested name, device type, dtype), so a call costs a dict lookup;
    the cache is cleared by :func:`use`, :func:`set_backend` and :func:`register`. Errors are never cached."""
    if family.__class__ is not Family:
        family = Family(family)
    name, source = requested(family) if name is None else (canonical_name(family, name), "the caller's backend=")
    device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
    key = (family, name, device_type, dtype)
    hit = _RESOLVED.get(key)
    if hit is not None:
        return hit
    spec = _resolve_uncached(family, torch.device(device), dtype, name, source)
    if not spec.volatile:
        _RESOLVED[key] = spec
    return spec


# A module object with this attribute set is a stand-in for a package (``patches`` registers such modules for
# flash_attn, xformers, spconv, ... so that CUDA-era code imports them); it is never the package itself.
STANDIN_FLAG = "__sam3d_shim__"


def _standin_for(spec: BackendSpec) -> Optional[str]:
    """The package this backend needs that is present only as a stand-in, if any."""
    for module in spec.requires:
        if getattr(sys.modules.get(module), STANDIN_FLAG, False):
            return module
    return None


def _standin_request(family: Family, spec: BackendSpec, device: torch.device, dtype, source: str
                     ) -> Optional[BackendSpec]:
    """A request naming a backend whose package is a stand-in (CUDA-era code sets ``ATTN_BACKEND=flash_attn``
    on GPUs it knows, with ``flash_attn`` served by the stand-in, which runs this registry's attention): it
    asks for what the stand-in serves, the automatic choice. Said once per family and name."""
    module = _standin_for(spec)
    fallback = _auto_pick(family, device, dtype) if module else None
    if fallback is not None and (family, spec.name, "standin") not in _WARNED:
        _WARNED.add((family, spec.name, "standin"))
        warnings.warn(f"{family.value} backend '{spec.name}' (from {source}) names '{module}', which is a stand-in "
                      f"here (patches.apply()); running '{fallback.name}', the automatic choice",
                      RuntimeWarning, stacklevel=4)
    return fallback


def _resolve_uncached(family: Family, device: torch.device, dtype, name: str, source: str) -> BackendSpec:
    if name != "auto":
        spec = _REGISTRY[family].get(name)
        served = _standin_request(family, spec, device, dtype, source) if spec is not None else None
        if served is not None:
            return served
        reason = "not implemented in this build" if spec is None else spec.why_not(device, dtype)
        if reason is not None:
            fallback = _auto_pick(family, device, dtype)
            hint = f"use '{fallback.name}' (or 'auto')" if fallback else "no backend can run these inputs"
            raise BackendUnavailableError(
                f"{family.value} backend '{name}' (from {source}) cannot run here: {reason}; {hint}")
        return spec
    spec = _auto_pick(family, device, dtype)
    if spec is None:
        raise BackendUnavailableError(f"no {family.value} backend can run on {device.type} with {dtype}")
    return spec


def _auto_pick(family: Family, device: torch.device, dtype) -> Optional[BackendSpec]:
    for spec in _auto_candidates(family, device):
        reason = spec.why_not(device, dtype)
        if reason is None:
            return spec
        # Only for inputs it was meant for: not another dtype, and not a question without inputs (dtype None: a
        # backend report or a start-up check, where a bf16-only path is not what the run will use)
        meant_for_inputs = dtype is not None and dtype in spec.dtypes
        if spec.has("warn_when_skipped") and meant_for_inputs and (family, spec.name, reason) not in _WARNED:
            # A fast path that should have worked on this device: say once why the slower one runs.
            _WARNED.add((family, spec.name, reason))
            warnings.warn(f"{family.value} backend '{spec.name}' is unavailable ({reason}); using a fallback",
                          RuntimeWarning, stacklevel=3)
    return None
