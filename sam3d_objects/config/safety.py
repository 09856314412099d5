"""What a checkpoint folder's yaml may ask for: the safety rules every config obeys before hydra builds it.

A checkpoint folder is untrusted input (it may come from any hub repository), so its yamls may only name the
classes and functions the released configs name, with the parameters those callables take:

* **exact targets**: every ``_target_`` (and ``_rpartial_target_``) must be one of ``REGISTERED_TARGETS``,
  compared as whole strings *after* every interpolation is resolved. Prefix checks do not work: hydra imports
  the longest importable module and walks the rest as attributes, so ``sam3d_objects.reconstruction.shutil.rmtree`` is
  ``shutil.rmtree``;
* **no resolvers**: only plain node interpolations (``${a.b}``) are allowed. Resolvers run code while a value is
  read: ``${oc.create:...}`` makes new nodes (with targets nobody checked), ``${oc.env:...}`` reads the environment
  (and error messages would echo it), ``${oc.decode:...}`` parses yaml, custom ones do anything. They are refused
  before anything is resolved, and the refusal names the key and the resolver, never a value;
* **parameters**: every key of a target node must be a parameter of the callable (unless the callable takes
  ``**kwargs``); ``_args_`` is refused, ``_partial_`` / ``_recursive_`` must be booleans and ``_convert_`` one of
  hydra's modes; parameters that switch off a safety (``weights_only: false``, ``allow_pickle: true``,
  ``pickle_module``, ``trust_remote_code: true``) are refused wherever they appear;
* **bounded yaml**: at most ``MAX_YAML_BYTES`` of text and ``MAX_YAML_NODES`` nodes once every alias is expanded
  (the "billion laughs" file of 250 bytes expands to 10^9 nodes), nested at most ``MAX_YAML_DEPTH`` levels;
* **no code from the folder**: third-party target packages (``moge``, ``torchvision``) are imported only from
  outside every checkpoint folder this process has read (``trusted_import``): a ``moge/`` folder planted beside
  ``pipeline.yaml`` is never imported, even when the folder is the working directory.

These rules hold whatever hydra-core / omegaconf build is installed: nothing relies on hydra's own blocklists.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path
from typing import Any, Dict, FrozenSet, Iterable, Iterator, Optional, Set, Tuple, Union

from sam3d_objects.errors import ConfigError

PathLike = Union[str, Path]

# module:qualname of every callable the released configs (pipeline.yaml and the six model yamls) name
_REGISTRY: Tuple[str, ...] = (
    "sam3d_objects.pipeline.inference_pipeline_pointmap:InferencePipelinePointMap",
    "sam3d_objects.pipeline.depth_models.moge:MoGe",
    "moge.model.v1:MoGeModel.from_pretrained",
    "sam3d_objects.config.utils:make_dict",
    "sam3d_objects.data.dataset.tdfy.preprocessor:PreProcessor",
    "sam3d_objects.data.dataset.tdfy.img_and_mask_transforms:ObjectCentricSSI",
    "sam3d_objects.data.dataset.tdfy.img_and_mask_transforms:crop_around_mask_with_padding",
    "sam3d_objects.data.dataset.tdfy.img_and_mask_transforms:resize_all_to_same_size",
    "sam3d_objects.data.dataset.tdfy.img_processing:pad_to_square_centered",
    "torchvision.transforms:Compose",
    "torchvision.transforms:Resize",
    "sam3d_objects.model.backbone.dit.embedder.dino:Dino",
    "sam3d_objects.model.backbone.dit.embedder.embedder_fuser:EmbedderFuser",
    "sam3d_objects.model.backbone.dit.embedder.pointmap:PointPatchEmbed",
    "sam3d_objects.model.backbone.generator.classifier_free_guidance:ClassifierFreeGuidance",
    "sam3d_objects.model.backbone.generator.classifier_free_guidance:"
    "ClassifierFreeGuidanceWithExternalUnconditionalProbability",
    "sam3d_objects.model.backbone.generator.flow_matching.model:FlowMatching",
    "sam3d_objects.model.backbone.generator.flow_matching.model:lognorm_sampler",
    "sam3d_objects.model.backbone.generator.shortcut.model:ShortCut",
    "sam3d_objects.model.backbone.tdfy_dit.models.mm_latent:Latent",
    "sam3d_objects.model.backbone.tdfy_dit.models.mm_latent:LearntPositionEmbedder",
    "sam3d_objects.model.backbone.tdfy_dit.models.mm_latent:ShapePositionEmbedder",
    "sam3d_objects.model.backbone.tdfy_dit.models.mot_sparse_structure_flow:SparseStructureFlowTdfyWrapper",
    "sam3d_objects.model.backbone.tdfy_dit.models.sparse_structure_vae:SparseStructureDecoderTdfyWrapper",
    "sam3d_objects.model.backbone.tdfy_dit.models.structured_latent_flow:SLatFlowModelTdfyWrapper",
    "sam3d_objects.model.backbone.tdfy_dit.models.structured_latent_vae.decoder_gs:SLatGaussianDecoderTdfyWrapper",
    "sam3d_objects.model.backbone.tdfy_dit.models.structured_latent_vae.decoder_mesh:SLatMeshDecoderTdfyWrapper",
)
REGISTRY: Dict[str, Tuple[str, str]] = {f"{m}.{q}": (m, q) for m, q in (e.split(":") for e in _REGISTRY)}
REGISTERED_TARGETS: FrozenSet[str] = frozenset(REGISTRY)
TARGET_KEYS = ("_target_", "_rpartial_target_")
HYDRA_KEYS = {"_target_", "_partial_", "_recursive_", "_convert_", "_args_", "_rpartial_target_"}
CONVERT_MODES = {"none", "partial", "all", "object"}
# parameters that switch a loader's safety off, refused in any node: (name, the only value allowed or None)
GUARDED_PARAMETERS: Dict[str, Optional[bool]] = {"weights_only": True, "allow_pickle": False,
                                                 "trust_remote_code": False, "pickle_module": None,
                                                 "pickle_load_args": None}
# MoGe's from_pretrained reads a local folder when the name exists as a path: only hub ids, never paths
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")
MAX_YAML_BYTES = 2 * 2 ** 20   # the released yamls are 0.2-5 KB
MAX_YAML_NODES = 200_000       # after alias expansion; the released yamls have about 600
MAX_YAML_DEPTH = 64            # the released yamls nest 12 levels
# plain node interpolation: ${a.b}, ${.sibling}, ${..up.x}, ${a[0]}; anything else inside ${} is a resolver call
PLAIN_INTERPOLATION = re.compile(r"\$\{\.*[A-Za-z_][A-Za-z0-9_-]*(?:\.[A-Za-z_][A-Za-z0-9_-]*|\[\d+\])*\}")

_untrusted_folders: Set[Path] = set()


class UnsafeConfigError(ConfigError):
    """A config asks for something a checkpoint folder may not (a target outside the registry, a resolver,
    a safety switched off, an oversized yaml). ``key`` is the config path, ``target`` the node's target and
    ``yaml`` the file (set once known; it prefixes the message)."""

    def __init__(self, message: str, key: str = "<root>", target: Optional[str] = None, yaml: Optional[str] = None):
        ValueError.__init__(self, message)
        self.key, self.target, self.yaml, self.reason = key, target, yaml, message

    def __str__(self) -> str:
        return f"{self.yaml}: {self.reason}" if self.yaml else self.reason


# ----------------------------------------------------------------------------------------------------------------
# trusted folders and imports
# ----------------------------------------------------------------------------------------------------------------
def mark_untrusted(folder: PathLike) -> None:
    """Remember a checkpoint folder: no module is ever imported from inside it (``trusted_import``)."""
    _untrusted_folders.add(Path(folder).resolve())


def _inside_untrusted(origin: Optional[str]) -> Optional[Path]:
    if not origin:
        return None
    path = Path(origin).resolve()
    for folder in _untrusted_folders:
        if path == folder or folder in path.parents:
            return folder
    return None


def trusted_import(name: str):
    """``importlib.import_module(name)``, refused (UnsafeConfigError) when the module would come from inside a
    checkpoint folder (e.g. a ``moge/`` folder beside pipeline.yaml found through the working directory)."""
    import sys
    top = name.split(".")[0]
    module = sys.modules.get(top)
    origin = getattr(module, "__file__", None) if module is not None else None
    if module is None:
        spec = importlib.util.find_spec(top)
        if spec is None:
            raise ModuleNotFoundError(f"No module named {top!r}", name=top)
        origin = spec.origin or next(iter(spec.submodule_search_locations or []), None)
    folder = _inside_untrusted(origin)
    if folder is not None:
        raise UnsafeConfigError(f"refusing to import {top!r} from {origin}: it lies inside the checkpoint folder "
                                f"{folder} (a checkpoint folder never provides code); install the package "
                                f"({top}) normally, and run from another directory")
    return importlib.import_module(name)


# torchvision transform targets, and our own classes built in their place where torchvision does not import
TORCHVISION_TRANSFORMS = "torchvision.transforms."
OWN_TRANSFORMS = "sam3d_objects.data.transforms."


def torchvision_imports() -> bool:
    """Whether the real ``torchvision.transforms`` imports here (a broken binary build raises anything)."""
    module = sys.modules.get("torchvision.transforms")
    if module is not None:
        return True
    if importlib.util.find_spec("torchvision") is None:
        return False
    before = set(sys.modules)
    try:
        trusted_import("torchvision.transforms")
        return True
    except UnsafeConfigError:
        raise
    except Exception:  # noqa: BLE001  a CUDA build on CPU-only torch raises RuntimeError/OSError, not ImportError
        # a broken build leaves half-imported submodules behind: forget them, so later code sees no torchvision
        # (list(): another thread, e.g. the pipeline's preload, may import while this runs)
        for name in [m for m in list(sys.modules) if m.split(".")[0] == "torchvision" and m not in before]:
            del sys.modules[name]
        return False


def resolve_target(target: str) -> Any:
    """The registered callable ``target`` names (exact name; UnsafeConfigError otherwise)."""
    if target not in REGISTRY:
        raise UnsafeConfigError(f"target {target!r} is not one of the {len(REGISTRY)} classes/functions the "
                                f"released configs use", target=target)
    module_name, qualname = REGISTRY[target]
    if module_name.startswith("torchvision."):
        if not torchvision_imports():  # our stand-in classes are what gets built then
            module_name = OWN_TRANSFORMS.rstrip(".")
    module = trusted_import(module_name) if not module_name.startswith("sam3d_objects.") \
        else importlib.import_module(module_name)
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


# ----------------------------------------------------------------------------------------------------------------
# yaml text
# ----------------------------------------------------------------------------------------------------------------
def check_yaml_text(text: str, name: str = "<yaml>") -> None:
    """UnsafeConfigError for yaml text over the size / expanded-node / depth caps (aliases counted expanded,
    computed on the composed node graph, which shares aliased nodes: linear time even for a billion laughs)."""
    import yaml
    if len(text.encode("utf-8", "surrogatepass")) > MAX_YAML_BYTES:
        raise UnsafeConfigError(f"{name}: {len(text)} bytes, over the {MAX_YAML_BYTES} byte limit of a config")
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except RecursionError as e:
        raise UnsafeConfigError(f"{name}: nested too deeply (limit {MAX_YAML_DEPTH} levels)") from e
    except yaml.YAMLError as e:
        first = str(e).splitlines()[0] if str(e) else ""
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise UnsafeConfigError(f"not valid YAML ({type(e).__name__}{where}: {first})", key="<file>") from None
    if root is None:
        return
    sizes: Dict[int, int] = {}
    depths: Dict[int, int] = {}
    # iterative post-order walk: (node, children visited?)
    stack = [(root, False)]
    on_path: Set[int] = set()
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            on_path.discard(key)
            children = _yaml_children(node)
            sizes[key] = 1 + sum(sizes[id(c)] for c in children)
            depths[key] = 1 + max((depths[id(c)] for c in children), default=0)
            if sizes[key] > MAX_YAML_NODES:
                raise UnsafeConfigError(f"{name}: expands to over {MAX_YAML_NODES} nodes (yaml aliases repeat "
                                        f"nodes); a checkpoint config is a few hundred")
            if depths[key] > MAX_YAML_DEPTH:
                raise UnsafeConfigError(f"{name}: nested deeper than {MAX_YAML_DEPTH} levels")
            continue
        if key in sizes:
            continue
        if key in on_path:
            raise UnsafeConfigError(f"{name}: a yaml alias refers to itself (recursive structure)")
        on_path.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _yaml_children(node) if id(c) not in sizes)


def _yaml_children(node) -> list:
    import yaml
    if isinstance(node, yaml.MappingNode):
        return [x for pair in node.value for x in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


# ----------------------------------------------------------------------------------------------------------------
# interpolations
# ----------------------------------------------------------------------------------------------------------------
def _raw_strings(node: Any, path: str = "") -> Iterator[Tuple[str, str]]:
    """(config path, raw text) of every string value and key, interpolations unresolved."""
    from omegaconf import DictConfig, ListConfig, OmegaConf
    if isinstance(node, DictConfig):
        if node._is_interpolation():
            yield path or "<root>", str(node._value())
            return
        for key in node.keys():
            child_path = f"{path}.{key}" if path else str(key)
            yield child_path, str(key)
            yield from _raw_strings(node._get_node(key), child_path)
    elif isinstance(node, ListConfig):
        if node._is_interpolation():
            yield path or "<root>", str(node._value())
            return
        for i in range(len(node)):
            yield from _raw_strings(node._get_node(i), f"{path}[{i}]")
    elif OmegaConf.is_config(node) or hasattr(node, "_value"):
        value = node._value()
        if isinstance(value, str):
            yield path or "<root>", value
    elif isinstance(node, str):
        yield path or "<root>", node


def check_no_resolvers(config: Any) -> None:
    """UnsafeConfigError for any ``${...}`` that is not a plain node interpolation (see module doc). Checked on
    the raw text, before anything is resolved: the message names the key and the resolver only."""
    for key, text in _raw_strings(config):
        if "${" not in text:
            continue
        rest = PLAIN_INTERPOLATION.sub("", text)
        if "${" in rest:
            found = re.search(r"\$\{\s*([A-Za-z0-9_.]*)\s*:", rest)
            what = f"the resolver '{found.group(1)}'" if found else "an interpolation that is not a plain ${a.b}"
            raise UnsafeConfigError(f"{key}: uses {what}; a checkpoint config may only refer to its own keys "
                                    f"(resolvers such as oc.env / oc.create / oc.decode run code or read the "
                                    f"environment)", key=key)


def resolved_copy(config: Any):
    """A new DictConfig/ListConfig with every interpolation resolved (after ``check_no_resolvers``): the tree that
    is checked is exactly the tree hydra gets. A resolved string holding ``${`` (an escaped ``\\${...}``) would
    become an interpolation again and is refused."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    check_no_resolvers(config)
    try:
        container = OmegaConf.to_container(config, resolve=True)
    except OmegaConfBaseException as e:
        raise UnsafeConfigError(f"{getattr(e, 'full_key', '') or '<root>'}: does not resolve "
                                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})",
                                key=str(getattr(e, "full_key", "") or "<root>")) from e
    for key, text in _plain_strings(container):
        if "${" in text:
            raise UnsafeConfigError(f"{key}: resolves to text holding '${{' (an escaped interpolation), which "
                                    f"would be interpreted again; remove it", key=key)
    return OmegaConf.create(container)


def _plain_strings(node: Any, path: str = "") -> Iterator[Tuple[str, str]]:
    if isinstance(node, dict):
        for k, v in node.items():
            child = f"{path}.{k}" if path else str(k)
            yield child, str(k)
            yield from _plain_strings(v, child)
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from _plain_strings(v, f"{path}[{i}]")
    elif isinstance(node, str):
        yield path or "<root>", node


# ----------------------------------------------------------------------------------------------------------------
# targets and parameters
# ----------------------------------------------------------------------------------------------------------------
def iter_target_nodes(node: Any, path: str = "") -> Iterator[Tuple[str, Any]]:
    """(config path, node) of every mapping holding a target key, in a resolved tree (DictConfig or dict)."""
    from omegaconf import DictConfig, ListConfig
    if isinstance(node, (DictConfig, dict)):
        if any(k in node for k in TARGET_KEYS):
            yield path or "<root>", node
        for key in list(node.keys()):
            yield from iter_target_nodes(node[key], f"{path}.{key}" if path else str(key))
    elif isinstance(node, (ListConfig, list, tuple)):
        for i, value in enumerate(node):
            yield from iter_target_nodes(value, f"{path}[{i}]")


def _accepted_parameters(obj: Any) -> Optional[Set[str]]:
    """Keyword parameters ``obj`` accepts; None when it takes any keyword (``**kwargs`` that is not handed to a
    base class). Classes follow ``**kwargs`` pass-through along the MRO up to torch.nn.Module / object."""
    if inspect.isclass(obj):
        names: Set[str] = set()
        for klass in inspect.getmro(obj):
            if klass.__module__.startswith(("torch.", "builtins")) or klass is object:
                return names
            init = klass.__dict__.get("__init__")
            if init is None:
                continue
            try:
                params = list(inspect.signature(init).parameters.values())[1:]
            except (TypeError, ValueError):
                return None
            names |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
            if not any(p.kind == p.VAR_KEYWORD for p in params):
                return names
        return names
    try:
        params = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _check_guarded(key: str, name: str, value: Any, target: Optional[str]) -> None:
    if name not in GUARDED_PARAMETERS:
        return
    allowed = GUARDED_PARAMETERS[name]
    if allowed is None or value is not allowed:
        raise UnsafeConfigError(f"{key}.{name}: {name}={value!r} would switch off a safety check; a checkpoint "
                                f"config may not set it" + ("" if allowed is None else f" (only {allowed})"),
                                key=f"{key}.{name}", target=target)


def check_node(key: str, node: Any, registry: Iterable[str] = REGISTERED_TARGETS) -> None:
    """Validate one target node: exact target, hydra keys, parameter names and guarded values."""
    registry = registry if isinstance(registry, (set, frozenset)) else frozenset(registry)
    for target_key in TARGET_KEYS:
        if target_key not in node:
            continue
        target = node[target_key]
        if not isinstance(target, str):
            raise UnsafeConfigError(f"{key}: {target_key} must be a dotted name, got {type(target).__name__}",
                                    key=key)
        if target not in registry:
            raise UnsafeConfigError(f"{key}: target {target!r} refused: a checkpoint config may only name the "
                                    f"classes and functions of the released configs (exact names, "
                                    f"sam3d_objects.config.safety.REGISTERED_TARGETS); edit the yaml or download "
                                    f"the folder again", key=key, target=target)
    target = next(str(node[k]) for k in TARGET_KEYS if k in node)
    if "_args_" in node:
        raise UnsafeConfigError(f"{key}: positional _args_ are not used by the released configs; give keyword "
                                f"parameters", key=key, target=target)
    for flag in ("_partial_", "_recursive_"):
        if flag in node and not isinstance(node[flag], bool):
            raise UnsafeConfigError(f"{key}.{flag} must be true or false, got {node[flag]!r}", key=key,
                                    target=target)
    if "_convert_" in node and str(node["_convert_"]) not in CONVERT_MODES:
        raise UnsafeConfigError(f"{key}._convert_ must be one of {sorted(CONVERT_MODES)}", key=key, target=target)
    params = [str(k) for k in node.keys() if str(k) not in HYDRA_KEYS]
    for name in params:
        _check_guarded(key, name, node[name], target)
    if target == "moge.model.v1.MoGeModel.from_pretrained":
        _check_hub_id(key, node, target)
        return
    try:
        accepted = _accepted_parameters(resolve_target(target))
    except UnsafeConfigError:
        raise
    except ImportError:
        return  # an optional package that is not installed: its user reports that when it is needed
    if accepted is None:
        return
    unknown = [n for n in params if n not in accepted]
    if unknown:
        raise UnsafeConfigError(f"{key}.{unknown[0]}: unknown parameter of {target} (it takes "
                                f"{', '.join(sorted(accepted)) or 'none'}); remove it or fix its name",
                                key=f"{key}.{unknown[0]}", target=target)


def _check_hub_id(key: str, node: Any, target: str) -> None:
    allowed = {"pretrained_model_name_or_path"}
    unknown = [str(k) for k in node.keys() if str(k) not in HYDRA_KEYS | allowed]
    if unknown:
        raise UnsafeConfigError(f"{key}.{unknown[0]}: unknown parameter of {target} (it takes "
                                f"pretrained_model_name_or_path)", key=f"{key}.{unknown[0]}", target=target)
    name = node.get("pretrained_model_name_or_path")
    if name is None:
        return
    name = str(name)
    if not HUB_ID.match(name) or ".." in name or Path(name).exists():
        raise UnsafeConfigError(f"{key}.pretrained_model_name_or_path must be a Hugging Face repository id such "
                                f"as Ruicheng/moge-vitl, not a local path (weights of a checkpoint folder are "
                                f"never loaded through the depth model)", key=key, target=target)


def check_config_tree(config: Any, registry: Iterable[str] = REGISTERED_TARGETS) -> None:
    """Every target node of a *resolved* tree (see ``resolved_copy``) checked with ``check_node``."""
    registry = frozenset(registry)
    for key, node in iter_target_nodes(config):
        check_node(key, node, registry)


def load_checkpoint_yaml(path: PathLike):
    """A yaml of a checkpoint folder, loaded under every rule of this module: size / alias / depth caps, no
    resolvers, every interpolation resolved, every target node valid. The folder is marked untrusted
    (``trusted_import``). Returns a DictConfig; FileNotFoundError / UnsafeConfigError (with ``yaml`` set)."""
    from omegaconf import DictConfig, OmegaConf
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} not found: the checkpoint folder is incomplete; "
                                f"download it again")
    mark_untrusted(path.resolve().parent)
    try:
        if path.stat().st_size > MAX_YAML_BYTES:
            raise UnsafeConfigError(f"{path.stat().st_size} bytes, over the {MAX_YAML_BYTES} byte limit of a "
                                    f"config")
        text = path.read_text(encoding="utf-8")
        check_yaml_text(text, path.name)
        try:
            config = OmegaConf.create(_load_yaml_text(text))
        except UnsafeConfigError:
            raise
        except Exception as e:  # noqa: BLE001  yaml scanner/parser errors have no common public base class
            raise UnsafeConfigError(f"not valid YAML ({type(e).__name__}: "
                                    f"{str(e).splitlines()[0] if str(e) else ''})", key="<file>") from e
        if not isinstance(config, DictConfig):
            raise UnsafeConfigError("expected a mapping of keys to values (the file is empty or a list)")
        config = resolved_copy(config)
        check_config_tree(config)
    except UnicodeDecodeError as e:
        raise UnsafeConfigError(f"{path}: not UTF-8 text ({e.reason})", key="<file>", yaml=str(path)) from e
    except UnsafeConfigError as e:
        e.yaml = str(path)
        raise
    return config


def _load_yaml_text(text: str):
    """The yaml parsed with omegaconf's own loader (its float / key rules), into plain Python data."""
    import yaml
    try:
        from omegaconf._utils import get_yaml_loader
        loader = get_yaml_loader()
    except ImportError:  # pragma: no cover - every omegaconf 2.3 has it
        loader = yaml.SafeLoader
    data = yaml.load(text, Loader=loader)  # noqa: S506  omegaconf's loader derives from SafeLoader
    if data is None:
        raise UnsafeConfigError("the file is empty; download the checkpoint folder again", key="<file>")
    return data
