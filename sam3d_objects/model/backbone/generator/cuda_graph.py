"""CUDA-graph replay of a flow backbone's calls during sampling.

Every backbone call of a sampling run has the same shapes (stage 1 is dense), so after one eager call per call
signature the call is captured once into a CUDA graph and replayed for the remaining steps (the guidance passes
its unconditional call as an ordinary call on zeroed condition tokens where the backbone offers that, so cond and
uncond share one graph; otherwise they differ by the `cfg` flag and get one each): one launch instead of thousands of kernel launches driven from Python. Inputs are copied into
the graph's static buffers before each replay and outputs are cloned after it, so callers see ordinary tensors that
a later replay cannot overwrite. Anything the graph cannot reproduce takes the eager path instead: CPU / MPS
tensors, autograd, training mode, forward hooks on the backbone (observers such as the golden harness must see every
call), non-tensor arguments that cannot be hashed, and a capture that fails.

Stage 2 (sparse) is captured too: its backbone takes the voxel coordinates as a numpy array, the same object at
every step of a run, and keeps every coordinate-derived tensor (device coords, neighbour maps, the downsampling
index, attention sequence lengths) with the step's SparseTensor, built by the eager warm-up call. A captured call
then only does feature arithmetic. A numpy argument therefore keys the call by identity: the graph of one run is
never replayed for another array (graphs are freed when the sampling run ends).

Stage 2's shapes change with every object, so each run would pay an eager warm-up call and a capture, both bound
by Python launch overhead (the GPU mostly idles through them). Once a backbone has been warmed up and captured in
this process, the CUDA libraries' lazy initialisation is done; a backbone that offers `prepare_graph_capture`
(builds the coordinate-derived tensors, which need host syncs, without the heavy work) then has its next new
signature captured at once, without the eager warm-up. Should that capture fail, the call runs eagerly as the
warm-up and the next call captures as usual."""
import contextlib
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
import torch.nn as nn

_EAGER = "eager"  # marker for a call signature that must not be captured
_WARMED = "_graph_capture_warmed"  # set on a backbone once a warm-up and capture of it succeeded in this process


class _SameObject:
    """A spec entry equal only to the very same object (numpy arrays are unhashable and may be large: comparing
    contents at every call would cost what the graph saves). It holds a reference, so the id is not reused while
    a graph keyed by it exists."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _SameObject) and other.obj is self.obj


def flatten_call(tree: Any) -> Tuple[List[torch.Tensor], Any]:
    """Tensor leaves of nested tuples / lists / dicts and a hashable spec of everything else (tensors as slots
    keyed by shape, dtype and device; numpy arrays by identity, see `_SameObject`). The spec raises TypeError
    when another non-tensor leaf is unhashable."""
    leaves: List[torch.Tensor] = []

    def walk(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            leaves.append(node)
            return ("T", tuple(node.shape), node.dtype, str(node.device), node.stride())
        if isinstance(node, dict):
            return ("D", tuple((k, walk(node[k])) for k in node))
        if isinstance(node, (list, tuple)):
            return (type(node).__name__, tuple(walk(v) for v in node))
        if isinstance(node, np.ndarray):
            return ("A", _SameObject(node))
        hash(node)
        return ("V", type(node).__name__, node)

    spec = walk(tree)
    return leaves, spec


def rebuild(tree: Any, leaves: Iterator[torch.Tensor]) -> Any:
    """`tree` with its tensor leaves replaced, in flatten_call's order, by the next items of `leaves`."""
    if isinstance(tree, torch.Tensor):
        return next(leaves)
    if isinstance(tree, dict):
        return {k: rebuild(v, leaves) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(rebuild(v, leaves) for v in tree)
    return tree


def _has_hooks(module: nn.Module) -> bool:
    # hooks observe or change each call; a replay would skip them, so hooked modules run eagerly
    own = module._forward_pre_hooks or module._forward_hooks
    global_hooks = nn.modules.module._global_forward_pre_hooks or nn.modules.module._global_forward_hooks
    return bool(own or global_hooks)


def graphs_usable(module: nn.Module, leaves: List[torch.Tensor]) -> bool:
    """True when a call of `module` on these tensors may be captured / replayed."""
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    return (bool(leaves) and all(t.is_cuda for t in leaves) and not torch.is_grad_enabled() and not module.training
            and not _has_hooks(module) and not capturing)


def _autocast_state() -> Tuple[bool, Optional[torch.dtype]]:
    if not torch.is_autocast_enabled("cuda"):
        return False, None
    return True, torch.get_autocast_dtype("cuda")


def _generator_states() -> List[Tuple[torch.Generator, Any]]:
    """Copies of the default CUDA generators' states, taken before a capture. A capture registers the default
    generator and marks its state as capturing; a capture that fails ends without clearing that mark, and every
    later random draw on that device (the next run's noise) then fails with "Offset increment outside graph
    capture". Putting a copy back clears it: the failed capture drew nothing that counts."""
    return [(g, g.clone_state()) for g in torch.cuda.default_generators]


def _restore_generators(states: List[Tuple[torch.Generator, Any]]) -> None:
    for generator, state in states:
        generator.graphsafe_set_state(state)


def _end_failed_capture(graph: Any, states: List[Tuple[torch.Generator, Any]]) -> None:
    """Ends a capture whose call raised (the stream must leave capture mode; the call's error is the one to
    report, so an error of ending the invalidated capture is dropped) and repairs the generators."""
    try:
        graph.capture_end()
    except Exception:  # noqa: BLE001  an invalidated capture cannot end cleanly; the call's error says why
        pass
    _restore_generators(states)


class _Graph:
    """One captured call: static input buffers, the graph and its static outputs."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, leaves: List[torch.Tensor], pool: Any):
        self.inputs = [t.clone() for t in leaves]
        static_args, static_kwargs = rebuild((args, kwargs), iter(self.inputs))
        self.graph, self.outputs = self.record(fn, static_args, static_kwargs, pool)
        self.out_leaves, _ = flatten_call(self.outputs)

    @staticmethod
    def record(fn: Callable, args: tuple, kwargs: dict, pool: Any) -> Tuple[Any, Any]:
        """(graph, static outputs) of fn captured on these static inputs."""
        graph = torch.cuda.CUDAGraph()
        enabled, dtype = _autocast_state()
        # cached autocast casts made outside the capture would be read, not recorded, by the graph: capture with
        # the cache off so every cast is part of the graph
        torch.clear_autocast_cache()
        # Captured on a side stream that waits for the work already queued, without `torch.cuda.graph`'s device
        # synchronize and cache flush: stage 2 captures in the middle of every run, and those would leave the GPU
        # idle while the capture is recorded and make the next allocations go back to cudaMalloc.
        side, current = torch.cuda.Stream(), torch.cuda.current_stream()
        side.wait_stream(current)
        rng = _generator_states()
        with torch.cuda.stream(side):
            graph.capture_begin(pool=pool)
            try:
                with torch.autocast("cuda", dtype=dtype or torch.float16, enabled=enabled, cache_enabled=False):
                    outputs = fn(*args, **kwargs)
            except BaseException:
                _end_failed_capture(graph, rng)
                raise
            try:
                graph.capture_end()
            except BaseException:
                _restore_generators(rng)
                raise
        current.wait_stream(side)
        return graph, outputs

    def __call__(self, leaves: List[torch.Tensor]) -> Any:
        for static, new in zip(self.inputs, leaves):
            static.copy_(new)
        self.graph.replay()
        return rebuild(self.outputs, iter([t.clone() for t in self.out_leaves]))


def _tensor_layout(leaves: List[torch.Tensor]) -> tuple:
    return tuple((tuple(t.shape), t.dtype, str(t.device), t.stride()) for t in leaves)


def _storage_fingerprint(module: nn.Module) -> tuple:
    """Where the module's parameters and buffers live: a graph reads them by address, so a graph kept from an
    earlier run is only valid while none of them has been replaced or moved."""
    return tuple((t.data_ptr(), t.dtype, t.device) for t in [*module.parameters(), *module.buffers()])


class GraphedCalls:
    """Calls `module(*args, **kwargs)`: the first call of a signature eagerly (on a side stream, the warm-up that
    capture requires), the second captures and replays, later ones replay. A signature whose tensors have the
    same shapes as one already warmed up (the unconditional call next to the conditional one) is captured at its
    first call: the warm-up's lazy initialisation (tuning, cuBLAS workspaces, caches keyed by shape) is shared.
    All graphs share one memory pool (they run one after another). A backbone with `prepare_graph_capture`, once
    warmed up in this process, skips the warm-up of new shapes (see the module docstring). `captures` counts
    graphs made, `replays` their replays, `warm_ups` the eager warm-up calls (for tests and benchmarks). The
    autocast state is part of a signature."""

    graph_class = _Graph

    def __init__(self, module: nn.Module):
        self.module = module
        self.entries: Dict[Any, Any] = {}
        self.warmed: set = set()
        self.used: set = set()
        self.pool = None
        self.captures = 0
        self.replays = 0
        self.warm_ups = 0
        self.fingerprint = _storage_fingerprint(module)

    def usable(self, leaves: List[torch.Tensor]) -> bool:
        return graphs_usable(self.module, leaves)

    def eager(self, args: tuple, kwargs: dict) -> Any:
        return self.module(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            leaves, spec = flatten_call((args, kwargs))
        except TypeError:
            return self.eager(args, kwargs)
        if not self.usable(leaves):
            return self.eager(args, kwargs)
        layout = (_tensor_layout(leaves), _autocast_state())
        spec = (spec, layout[1])
        self.used.add(spec)
        entry = self.entries.get(spec)
        if entry is None and layout not in self.warmed:
            self.entries[spec] = 1
            self.warmed.add(layout)
            direct = self._capture_without_warm_up(spec, args, kwargs, leaves)
            if direct is None:
                return self._warm_up(args, kwargs)
            self.replays += 1
            return direct(leaves)
        if entry == _EAGER:
            return self.eager(args, kwargs)
        if entry is None or isinstance(entry, int):
            entry = self._capture(spec, args, kwargs, leaves)
            if entry is None:
                return self.eager(args, kwargs)
        self.replays += 1
        return entry(leaves)

    def _capture_without_warm_up(self, spec: Any, args: tuple, kwargs: dict, leaves: List[torch.Tensor]
                                 ) -> Optional[_Graph]:
        """The graph of a new signature captured at once (None: warm up first), see the module docstring."""
        prepare = getattr(self.module, "prepare_graph_capture", None)
        if prepare is None or not self.module.__dict__.get(_WARMED):
            return None
        prepare(*args, **kwargs)
        try:
            entry = self.graph_class(self.module, args, kwargs, leaves, self._pool())
        except Exception:  # e.g. a library's lazy set-up for these shapes: this call becomes the warm-up
            return None
        self.entries[spec] = entry
        self.captures += 1
        return entry

    def _pool(self) -> Any:
        if self.pool is None and torch.cuda.is_available():
            self.pool = torch.cuda.graph_pool_handle()
        return self.pool

    def _warm_up(self, args: tuple, kwargs: dict) -> Any:
        self.warm_ups += 1
        if not torch.cuda.is_available():  # only reached by tests that stand in for the graph machinery
            return self.eager(args, kwargs)
        side, current = torch.cuda.Stream(), torch.cuda.current_stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            out = self.eager(args, kwargs)
        current.wait_stream(side)
        return out

    def _capture(self, spec: Any, args: tuple, kwargs: dict, leaves: List[torch.Tensor]) -> Optional[_Graph]:
        try:
            entry = self.graph_class(self.module, args, kwargs, leaves, self._pool())
        except Exception as error:  # a host sync or unsupported op inside the call: stay eager for this signature
            warnings.warn(f"CUDA-graph capture of {type(self.module).__name__} failed, running it eagerly: {error}")
            self.entries[spec] = _EAGER
            return None
        self.entries[spec] = entry
        self.captures += 1
        self.module.__dict__[_WARMED] = True  # a plain attribute: not a submodule, not in the state dict
        return entry

    def still_valid(self) -> bool:
        """False once the module's weights were replaced or moved (the kept graphs would read stale memory)."""
        return _storage_fingerprint(self.module) == self.fingerprint

    def drop_unused(self) -> None:
        """Forgets the signatures not called since the last `drop_unused` (a kept runner holds only what the
        latest run used)."""
        for spec in [s for s in self.entries if s not in self.used]:
            del self.entries[spec]
        self.used = set()

    def release(self) -> None:
        """Drops every graph and its memory pool."""
        self.entries.clear()
        self.used = set()
        self.pool = None


_KEPT = "_kept_graph_runner"


@contextlib.contextmanager
def graphed_backbone(guidance: nn.Module, enabled: bool = True, keep: bool = False
                     ) -> Iterator[Optional[GraphedCalls]]:
    """While inside, `guidance` (a ClassifierFreeGuidance) calls its backbone through GraphedCalls. Disabled, or
    off CUDA, nothing changes (the runner then only ever takes the eager path).

    ``keep=False``: the graphs are freed on exit. ``keep=True`` (stage 1, whose shapes are the same in every
    run): the runner stays with `guidance` and the next run replays its graphs without warm-up or capture; it
    keeps only the signatures the latest run used, and is dropped when the backbone's weights were replaced or
    moved since, or when graphs are disabled."""
    kept = guidance.__dict__.get(_KEPT)
    usable = enabled and torch.cuda.is_available() and hasattr(guidance, "backbone")
    reuse = usable and keep and kept is not None and kept.module is guidance.backbone and kept.still_valid()
    if kept is not None and not reuse:
        kept.release()
        del guidance.__dict__[_KEPT]
    if not usable:
        yield None
        return
    runner = kept if reuse else GraphedCalls(guidance.backbone)
    guidance.graph_runner = runner
    try:
        yield runner
    finally:
        guidance.graph_runner = None
        if keep:
            runner.drop_unused()
            guidance.__dict__[_KEPT] = runner  # a plain attribute: not a submodule, not in the state dict
        else:
            runner.release()
