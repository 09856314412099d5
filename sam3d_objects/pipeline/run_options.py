"""The options of one pipeline run, in one object that the CLI, the API (``Inference``), the batch mode, the web
app and the pipeline pass along, and the per-run random generator made from its seed.

``RunOptions``'s fields are the keywords of upstream's ``InferencePipeline.run`` / ``InferencePipelinePointMap.run``
with upstream's defaults (``InferencePipeline.run``'s: ``seed=42``, post-processing and texture baking on), plus
``noise_device`` (ours). The public ``run`` / ``Inference.__call__`` signatures stay upstream's; they build a
``RunOptions`` from their keywords (``RunOptions.from_locals``) and hand that one object down to the sampler, so a
new option is one field here plus the line that reads it. The CLI and ``Inference`` build one ``RunOptions`` and
call upstream's ``run`` with its keywords (``RunOptions.keywords``: a pipeline class that overrides ``run`` is
still called); callers may pass a ``RunOptions`` directly: ``pipeline.run_with_options(image, mask, options)``,
``Inference(...)(image, mask, options=...)``.

Seeds. Upstream seeds torch's global random generator (``torch.manual_seed(seed)``) right after preprocessing and
draws the sampling noise from it. Here a seeded run draws its noise from its own ``torch.Generator`` seeded
the same way on the same device (``RunOptions.generator``): the same numbers as upstream's for the same seed,
while the global random state is left alone. ``seed=None`` (the default of upstream's ``Inference.__call__``
and ``InferencePipelinePointMap.run``) reseeds nothing and draws from the global generator, as upstream does,
so ``torch.manual_seed(s)`` before such a run still decides its noise. Differences that remain: after a seeded
run upstream's global generator is left seeded (and advanced by the noise draws), ours is left as it was; the
research-only SDE solver (``solver_method="sde"``, no released config uses it) draws its per-step noise from the
global generator, which a seeded run no longer seeds.

Noise device (ours). Where the initial noise is drawn; canonical values (``NOISE_DEVICES``):

* ``"device"``: the generator of the device the model runs on (upstream's behaviour, the default);
* ``"cpu"``: the CPU generator, the noise then moved to the device, so that a seed gives the same object on
  CPU, CUDA and MPS (the CLI's ``--portable-seed``);
* ``"auto"``: not set at this level: a run uses the pipeline's setting, the pipeline uses ``"device"``,
  ``Inference`` keeps the yaml's (as its ``device="auto"`` / ``low_memory="auto"``).

``resolve_noise_device`` is the one function that reads a spelling. ``None`` is read as ``"auto"``; the old
per-call spelling ``"pipeline"`` is a deprecated alias of ``"auto"`` (a DeprecationWarning).
"""
from __future__ import annotations

import dataclasses
import inspect
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

DEFAULT_SEED = 42  # upstream's InferencePipeline.run and demo.py; the CLI, batch mode and web app use it too
DEFAULT_INFERENCE_STEPS = 25  # upstream's pipeline default for both stages (FlowMatching's own is 100)

NOISE_AUTO = "auto"  # not set at this level: the next level's setting
NOISE_ON_DEVICE = "device"
NOISE_ON_CPU = "cpu"
NOISE_DEVICES = (NOISE_AUTO, NOISE_ON_DEVICE, NOISE_ON_CPU)
# old spellings: run()'s "pipeline" (deprecated); None, Python's "unset", is read as "auto" without a warning
DEPRECATED_NOISE_DEVICES = {"pipeline": NOISE_AUTO}

STAGES = ("ss_generator", "slat_generator")


def resolve_noise_device(value: Optional[str], inherited: Optional[str] = NOISE_AUTO) -> Optional[str]:
    """The canonical spelling of ``value`` (one of ``NOISE_DEVICES``), with "auto" replaced by ``inherited`` (the
    next level's setting). None reads as "auto"; "pipeline" too, with a DeprecationWarning. ValueError for
    anything else, naming the choices."""
    if isinstance(value, str) and value in DEPRECATED_NOISE_DEVICES:
        warnings.warn(f"noise_device={value!r} is deprecated: use 'auto' (the next level's setting) or one of "
                      f"{list(NOISE_DEVICES[1:])}", DeprecationWarning, stacklevel=3)
        value = DEPRECATED_NOISE_DEVICES[value]
    if value is None:
        value = NOISE_AUTO
    if value not in NOISE_DEVICES:
        raise ValueError(f"noise_device={value!r}: use 'device' (the model's device, upstream's default), 'cpu' "
                         f"(the same object on every device) or 'auto' (the next level's setting)")
    return inherited if value == NOISE_AUTO else value


@dataclass(frozen=True)
class RunOptions:
    """The keywords of upstream's ``run`` (``InferencePipeline.run``'s defaults) plus ``noise_device`` (ours).
    ``stage1_inference_steps`` / ``stage2_inference_steps``: None = the pipeline's configured counts
    (``ss_inference_steps`` / ``slat_inference_steps``, ``DEFAULT_INFERENCE_STEPS`` unless the yaml says
    otherwise)."""

    seed: Optional[int] = DEFAULT_SEED
    stage1_only: bool = False
    with_mesh_postprocess: bool = True
    with_texture_baking: bool = True
    with_layout_postprocess: bool = True
    use_vertex_color: bool = False
    stage1_inference_steps: Optional[int] = None
    stage2_inference_steps: Optional[int] = None
    use_stage1_distillation: bool = False
    use_stage2_distillation: bool = False
    decode_formats: Optional[Sequence[str]] = None
    estimate_plane: bool = False
    noise_device: str = NOISE_AUTO

    def __post_init__(self) -> None:
        # one spelling from here on: aliases are read once, where the options are made
        object.__setattr__(self, "noise_device", resolve_noise_device(self.noise_device))
        if self.decode_formats is not None and not isinstance(self.decode_formats, str):
            object.__setattr__(self, "decode_formats", tuple(self.decode_formats))

    def replace(self, **changes: Any) -> "RunOptions":
        """A copy with ``changes`` (field names; TypeError naming the fields for an unknown one)."""
        _check_names(changes)
        return dataclasses.replace(self, **changes) if changes else self

    @classmethod
    def from_kwargs(cls, base: Optional["RunOptions"] = None, **kwargs: Any) -> "RunOptions":
        """``base`` (default: ``RunOptions()``) with the keyword options ``kwargs`` applied."""
        return (base if base is not None else cls()).replace(**kwargs)

    @classmethod
    def from_locals(cls, arguments: Mapping[str, Any]) -> "RunOptions":
        """The options of a ``run`` call from its ``locals()`` taken first thing in its body (they hold exactly
        its parameters): its keyword values, the dataclass defaults for the fields it lacks. Reading the
        parameters from the locals, not from the method's signature, keeps a decorated or wrapped ``run`` (a
        research script timing it, a test spying on it) from losing the caller's options."""
        return cls(**{name: arguments[name] for name in FIELD_NAMES if name in arguments})

    @classmethod
    def from_call(cls, function: Callable, arguments: Mapping[str, Any]) -> "RunOptions":
        """The options of a call of ``function`` (a ``run`` with upstream's keywords): its keyword values from
        ``arguments`` (its ``locals()``), the dataclass defaults for the fields it lacks."""
        parameters = _parameters(function)
        return cls(**{name: arguments[name] for name in FIELD_NAMES if name in parameters and name in arguments})

    def keywords(self, function: Callable) -> Dict[str, Any]:
        """These options as the keywords of ``function`` (a ``run``), to call it with; TypeError when an option
        set away from its default has no keyword there (e.g. ``estimate_plane`` for the plain pipeline)."""
        parameters = _parameters(function)
        if any(p.kind is p.VAR_KEYWORD for p in inspect.signature(function).parameters.values()):
            return {name: getattr(self, name) for name in FIELD_NAMES}
        dropped = [n for n in FIELD_NAMES if n not in parameters and getattr(self, n) != getattr(RunOptions(), n)]
        if dropped:
            raise TypeError(f"{getattr(function, '__qualname__', function)} takes no {dropped}")
        return {name: getattr(self, name) for name in FIELD_NAMES if name in parameters}

    def inference_steps(self, stage: str) -> Optional[int]:
        """The step count asked for ``stage`` ("ss_generator" / "slat_generator"); None = the configured one."""
        return self.stage1_inference_steps if _stage_index(stage) == 0 else self.stage2_inference_steps

    def use_distillation(self, stage: str) -> bool:
        return self.use_stage1_distillation if _stage_index(stage) == 0 else self.use_stage2_distillation

    def generator(self, device) -> Optional["torch.Generator"]:  # noqa: F821  (torch is imported lazily)
        """A ``torch.Generator`` on ``device`` seeded with ``seed`` (None without a seed: the global generator
        is used, as upstream). Its numbers equal those of the global generator after ``torch.manual_seed(seed)``
        on that device."""
        if self.seed is None:
            return None
        import torch
        return torch.Generator(device=torch.device(device)).manual_seed(int(self.seed))


FIELD_NAMES: Tuple[str, ...] = tuple(f.name for f in dataclasses.fields(RunOptions))

# upstream's notebook/inference.py Inference.__call__: its run keywords (no seed unless given, the raw mesh with
# vertex colours, the layout refinement on)
NOTEBOOK_RUN_OPTIONS = RunOptions(seed=None, with_mesh_postprocess=False, with_texture_baking=False,
                                  with_layout_postprocess=True, use_vertex_color=True)


def _stage_index(stage: str) -> int:
    if stage not in STAGES:
        raise ValueError(f"unknown sampling stage {stage!r}; one of {list(STAGES)}")
    return STAGES.index(stage)


def _check_names(kwargs: Mapping[str, Any]) -> None:
    unknown = sorted(set(kwargs) - set(FIELD_NAMES))
    if unknown:
        raise TypeError(f"unknown run option(s) {unknown}; the options are {list(FIELD_NAMES)}")


_PARAMETER_CACHE: Dict[Callable, Dict[str, Any]] = {}


def _parameters(function: Callable) -> Dict[str, Any]:
    """{name: default} of ``function``'s parameters (cached: read once per function)."""
    function = getattr(function, "__func__", function)
    if function not in _PARAMETER_CACHE:
        _PARAMETER_CACHE[function] = {p.name: p.default for p in inspect.signature(function).parameters.values()}
    return _PARAMETER_CACHE[function]
