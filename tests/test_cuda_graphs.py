"""CUDA-graph replay of the flow backbone (generator/cuda_graph.py) and the sync-free time handling of the
generators. The CPU tests drive the wrapper's logic with a stand-in graph (a replay that re-runs the function on the
static buffers, which is what a CUDA graph does); the CUDA test compares real graph replays with eager calls."""
import numpy as np
import pytest
import torch
import torch.nn as nn

from sam3d_objects.model.backbone.generator import cuda_graph as cg
from sam3d_objects.model.backbone.generator.classifier_free_guidance import (ClassifierFreeGuidance,
                                                                             time_in_interval)
from sam3d_objects.model.backbone.generator.flow_matching.model import FlowMatching
from sam3d_objects.model.backbone.generator.shortcut.model import ShortCut
from sam3d_objects.model.backbone.generator.tree import host_values, with_host_values


class Backbone(nn.Module):
    """A dict-latent velocity model with a condition, an optional cfg flag and step size d (stage 1's call form)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x, t, cond, cfg=False, d=None):
        self.calls += 1
        c = torch.zeros_like(cond) if cfg else cond
        shift = t.reshape(-1, 1, 1) / 1000 + (0 if d is None else d.reshape(-1, 1, 1) / 1000)
        return {k: self.lin(v + shift) + c.mean() for k, v in x.items()}


class FakeGraph(cg._Graph):
    """Replay = run the recorded call again on the static inputs, writing into the static outputs in place."""

    @staticmethod
    def record(fn, args, kwargs, pool):
        outputs = fn(*args, **kwargs)

        class Replay:
            def replay(self):
                fresh = fn(*args, **kwargs)
                for static, new in zip(cg.flatten_call(outputs)[0], cg.flatten_call(fresh)[0]):
                    static.copy_(new)
        return Replay(), outputs


class FakeCalls(cg.GraphedCalls):
    graph_class = FakeGraph

    def usable(self, leaves):
        return True


def _inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    x = {"shape": torch.randn(1, 3, 4, generator=g), "pose": torch.randn(1, 1, 4, generator=g)}
    return x, torch.tensor([250.0]), torch.randn(1, 5, 4, generator=g)


def test_flatten_and_rebuild_round_trip():
    x, t, cond = _inputs()
    leaves, spec = cg.flatten_call(((x, t, cond), {"cfg": True}))
    assert len(leaves) == 4 and leaves[2] is t
    rebuilt = cg.rebuild(((x, t, cond), {"cfg": True}), iter([v * 2 for v in leaves]))
    assert torch.equal(rebuilt[0][0]["pose"], x["pose"] * 2) and rebuilt[1] == {"cfg": True}
    # the signature tells apart the cond / uncond calls and other shapes, and refuses unhashable leaves
    assert spec != cg.flatten_call(((x, t, cond), {"cfg": False}))[1]
    assert spec != cg.flatten_call(((x, t, cond[:, :2]), {"cfg": True}))[1]
    with pytest.raises(TypeError):
        cg.flatten_call(({1, 2},))
    # numpy arrays (stage 2's voxel coords) key the call by identity: equal contents in another array differ
    coords = np.zeros((5, 4), dtype=np.int32)
    assert cg.flatten_call((coords,))[1] == cg.flatten_call((coords,))[1]
    assert cg.flatten_call((coords,))[1] != cg.flatten_call((coords.copy(),))[1]
    assert cg.flatten_call((coords,))[0] == []


def test_cpu_tensors_take_the_eager_path():
    model = Backbone().eval()
    runner = cg.GraphedCalls(model)
    x, t, cond = _inputs()
    with torch.no_grad():
        outs = [runner(x, t, cond) for _ in range(3)]
    assert model.calls == 3 and runner.captures == 0 and runner.replays == 0
    assert torch.equal(outs[2]["shape"], model(x, t, cond)["shape"])
    assert not cg.graphs_usable(model, [t])  # CPU tensor
    assert not cg.graphs_usable(model, [])


def test_hooks_grad_and_training_forbid_graphs(monkeypatch):
    model = Backbone()
    cuda_like = torch.zeros(1)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    with torch.no_grad():
        assert not cg.graphs_usable(model, [cuda_like])  # training mode
        model.eval()
        assert cg.graphs_usable(model, [cuda_like])
        handle = model.register_forward_pre_hook(lambda m, a: None)
        assert not cg.graphs_usable(model, [cuda_like])
        handle.remove()
    assert not cg.graphs_usable(model, [cuda_like])  # autograd on


def test_static_buffers_copy_inputs_and_clone_outputs():
    model = Backbone().eval()
    runner = FakeCalls(model)
    with torch.no_grad():
        x1, t1, c1 = _inputs(1)
        x2, t2, c2 = _inputs(2)
        first = runner(x1, t1, c1)               # warm-up, eager
        second = runner(x2, t2, c2)              # capture + replay on x2
        third = runner(x1, t1, c1, cfg=True)     # another signature, same shapes: captured at once
        fourth = runner(x1, t1, c1)              # replay with x1 copied into the static inputs
        assert runner.captures == 2 and runner.replays == 3 and model.calls == 6  # FakeGraph runs at capture too
        # other shapes are warmed up eagerly first (lazy initialisation may depend on the shapes)
        short = {k: v[:, :1] for k, v in x1.items()}
        runner(short, t1, c1)
        assert runner.captures == 2
        for got, ref in ((first, model(x1, t1, c1)), (second, model(x2, t2, c2)),
                         (third, model(x1, t1, c1, cfg=True)), (fourth, model(x1, t1, c1))):
            for k in ref:
                torch.testing.assert_close(got[k], ref[k], rtol=0, atol=0)
        # a later replay does not overwrite what an earlier one returned (outputs are cloned)
        assert not torch.equal(second["shape"], fourth["shape"])
        # the caller's tensors are never the static buffers
        entry = runner.entries[(cg.flatten_call(((x1, t1, c1), {}))[1], (False, None))]
        assert all(s is not a for s, a in zip(entry.inputs, [x1["pose"], x1["shape"], t1, c1]))


def test_kept_graphs_serve_the_next_run_until_the_weights_move(monkeypatch):
    class Calls(FakeCalls):
        def _warm_up(self, args, kwargs):
            return self.eager(args, kwargs)
    monkeypatch.setattr(cg, "GraphedCalls", Calls)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    model = Backbone().eval()
    cfg = ClassifierFreeGuidance(model, strength=2.0, unconditional_handling="add_flag").eval()
    x, t, cond = _inputs()
    with torch.no_grad():
        with cg.graphed_backbone(cfg, keep=True) as first:
            for _ in range(3):
                cfg.graph_runner(x, t, cond)
        assert cfg.graph_runner is None and first.captures == 1
        with cg.graphed_backbone(cfg, keep=True) as second:
            calls = model.calls
            out = cfg.graph_runner(x, t, cond)
        assert second is first and second.captures == 1 and model.calls == calls + 1  # a replay, no warm-up
        torch.testing.assert_close(out["shape"], model(x, t, cond)["shape"], rtol=0, atol=0)
        # unused signatures are forgotten; moved / replaced weights drop the kept graphs
        with cg.graphed_backbone(cfg, keep=True) as third:
            third(x, t, cond, cfg=True)
        assert len(third.entries) == 1
        model.lin.weight = nn.Parameter(model.lin.weight.clone())
        with cg.graphed_backbone(cfg, keep=True) as fourth:
            pass
        assert fourth is not third and third.entries == {}
        # keep=False (stage 2) and disabled graphs free everything on exit
        with cg.graphed_backbone(cfg, enabled=False) as none:
            assert none is None
        assert "_kept_graph_runner" not in cfg.__dict__


def test_failed_capture_falls_back_to_eager_for_that_signature():
    class Failing(FakeGraph):
        @staticmethod
        def record(fn, args, kwargs, pool):
            raise RuntimeError("operation not permitted when stream is capturing")

    class Calls(FakeCalls):
        graph_class = Failing

    model = Backbone().eval()
    runner = Calls(model)
    x, t, cond = _inputs()
    with torch.no_grad(), pytest.warns(UserWarning, match="capture"):
        outs = [runner(x, t, cond) for _ in range(4)]
    assert runner.captures == 0 and model.calls == 4
    assert torch.equal(outs[-1]["shape"], outs[0]["shape"])


class OfferingBackbone(Backbone):
    """Offers the cfg=True call as an ordinary call on zeroed condition tokens (as the flow wrappers do)."""

    def unconditional_arguments(self, args, kwargs):
        return (args[0] * 0,), dict(kwargs)


@pytest.mark.parametrize("backbone, graphs", [(Backbone, 2), (OfferingBackbone, 1)])
def test_guidance_routes_backbone_calls_through_the_runner(backbone, graphs):
    """cond and uncond (cfg=True) are separate graphs, unless the backbone offers its cfg=True call as an ordinary
    call on zeroed tokens: then one graph serves both branches. Either way the outputs are the eager ones."""
    model = backbone().eval()
    cfg = ClassifierFreeGuidance(model, strength=2.0, unconditional_handling="add_flag", interval=[0, 1000]).eval()
    x, t, cond = _inputs()
    with torch.no_grad():
        eager = cfg(x, t, cond)
        cfg.graph_runner = FakeCalls(model)
        outs = [cfg(x, t, cond) for _ in range(3)]
        runner, cfg.graph_runner = cfg.graph_runner, None
    assert runner.captures == graphs and runner.replays == 5  # all calls but the one eager warm-up
    for out in outs:
        for k in eager:
            torch.testing.assert_close(out[k], eager[k], rtol=0, atol=0)
    # 'zeros' handling keeps its own route (the offer is about the cfg flag only)
    zeros = ClassifierFreeGuidance(model, strength=2.0, unconditional_handling="zeros").eval()
    assert zeros._unconditional_as_plain_call((cond,), {}) is None
    if not torch.cuda.is_available():
        with cg.graphed_backbone(cfg) as none:
            assert none is None


def _tiny_mot_flow():
    from sam3d_objects.model.backbone.tdfy_dit.models.mm_latent import (Latent, LearntPositionEmbedder,
                                                                        ShapePositionEmbedder)
    from sam3d_objects.model.backbone.tdfy_dit.models.mot_sparse_structure_flow import (
        SparseStructureFlowTdfyWrapper)
    torch.manual_seed(0)
    c = 32
    mapping = {"shape": Latent(8, c, ShapePositionEmbedder(c, 4, 1)),
               "translation": Latent(3, c, LearntPositionEmbedder(c, 1))}
    model = SparseStructureFlowTdfyWrapper(resolution=4, in_channels=8, model_channels=c, cond_channels=16,
                                           out_channels=8, num_blocks=2, num_heads=2, latent_mapping=mapping,
                                           qk_rms_norm=True, force_zeros_cond=True,
                                           is_shortcut_model=True).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return model


def test_stage2_offers_its_unconditional_call_and_stage1_collapses_the_zeroed_tokens():
    """Stage 2's wrapper offers its cfg=True call as an ordinary call on zeroed tokens (one CUDA graph for both
    guidance branches; none with a condition embedder inside), while its eager cfg=True call, like stage 1's,
    attends to one zeroed token (same result as all of them zeroed within float32 rounding, at a fraction of the
    cost); stage 1 offers no plain call, so its two branches differ in work and keep two graphs."""
    g = torch.Generator().manual_seed(5)
    t = torch.tensor([400.0])
    cond = torch.randn(1, 5, 16, generator=g) * 3
    slat, coords = _tiny_slat_flow()
    x = torch.randn(1, coords.shape[0], 8, generator=g)
    mot = _tiny_mot_flow()
    latents = {"shape": torch.randn(1, 64, 8, generator=g), "translation": torch.randn(1, 1, 3, generator=g)}
    d = torch.tensor([0.25])
    with torch.no_grad():
        args, kwargs = slat.unconditional_arguments((cond, coords), {})
        assert args[1] is coords and torch.equal(args[0], torch.zeros_like(cond))
        plain = slat(x, t, *args, **kwargs)
        # float32 rounding of the whole network: a few units of the last place at the output's scale
        torch.testing.assert_close(plain, slat(x, t, cond, coords, cfg=True), rtol=1e-6,
                                   atol=8 * torch.finfo(torch.float32).eps * float(plain.abs().max()))
        assert not hasattr(mot, "unconditional_arguments")
        full = type(mot).__mro__[1].forward(mot, latents, t, cond * 0, d=d)  # every token zeroed, as upstream
        got = mot(latents, t, cond, cfg=True, d=d)
        assert not torch.equal(got["shape"], mot(latents, t, cond, d=d)["shape"])
        for k in full:
            torch.testing.assert_close(got[k], full[k], rtol=1e-6, atol=1e-6)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # half precision: the same bits
            full = type(mot).__mro__[1].forward(mot, latents, t, cond * 0, d=d)
            got = mot(latents, t, cond, cfg=True, d=d)
        for k in full:
            assert torch.equal(got[k], full[k]), k
    slat_embedded = _tiny_slat_flow()[0]
    slat_embedded.condition_embedder = nn.Identity()
    assert slat_embedded.unconditional_arguments((cond, coords), {}) is None


def test_host_values_are_read_from_the_tag():
    t = torch.tensor([300.0])
    assert host_values(t) == [300.0] and host_values(2.5) == [2.5]
    with_host_values(t, [900.0])  # a wrong tag shows that the check reads the tag, not the tensor
    assert host_values(t) == [900.0]
    assert not time_in_interval(t, [0, 500])


def test_shortcut_scaled_times_match_per_call_tensors():
    sc = ShortCut(Backbone(), inference_steps=7, rescale_t=3.0)
    times = [float(v) for v in sc.time_grid()] + [sc.step_size()]
    cache = sc._cache_scaled_times(times, torch.device("cpu"))
    for v in times:
        ref = torch.tensor([v * sc.time_scale], dtype=torch.float32)
        got = cache[(v, torch.device("cpu"))]
        assert got.dtype == torch.float32 and got.shape == (1,) and torch.equal(got, ref)
        assert host_values(got) == ref.tolist()


def test_flow_matching_tagged_times_match_the_grid():
    fm = FlowMatching(Backbone(), inference_steps=9, rescale_t=2.0)
    grid = fm.time_grid()
    tagged = fm._tagged_times("cpu")
    for t, ref in zip(tagged, grid):
        assert torch.equal(t, ref) and host_values(t) == [ref.item()]
        scaled = fm._scaled_time(t)
        assert host_values(scaled) == (ref * fm.time_scale).reshape(-1).tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backbone, graphs", [(Backbone, 2), (OfferingBackbone, 1)])
def test_cuda_graph_replays_match_eager(backbone, graphs):
    model = backbone().cuda().eval()
    cfg = ClassifierFreeGuidance(model, strength=2.0, unconditional_handling="add_flag", interval=[0, 1000]).eval()
    gen = ShortCut(cfg, inference_steps=6, rescale_t=3.0, no_shortcut=True)
    shapes = {"shape": (1, 3, 4), "pose": (1, 1, 4)}
    cond = torch.randn(1, 5, 4, device="cuda")
    for autocast in (False, True):
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16, enabled=autocast):
            torch.manual_seed(3)
            eager = gen(shapes, torch.device("cuda"), cond)
            torch.manual_seed(3)
            with cg.graphed_backbone(cfg) as runner:
                graphed = gen(shapes, torch.device("cuda"), cond)
                assert runner.captures == graphs and runner.replays == 2 * 6 - 1  # all but the one warm-up
        assert cfg.graph_runner is None
        for k in eager:
            torch.testing.assert_close(graphed[k], eager[k], rtol=1e-3 if autocast else 1e-6,
                                       atol=1e-3 if autocast else 1e-6)


class HostSyncRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the aten ops that read device values on the host (a sync on CUDA, forbidden in a graph capture)
    or copy host data in (a fresh torch.tensor literal)."""

    SYNCING = ("_local_scalar_dense", "nonzero", "unique", "bincount", "masked_select", "lift_fresh")

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if any(s in name for s in self.SYNCING) or (name.startswith("repeat_interleave")
                                                    and "output_size" not in (kwargs or {})):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def _tiny_slat_flow():
    from sam3d_objects.model.backbone.tdfy_dit.models.structured_latent_flow import SLatFlowModelTdfyWrapper
    torch.manual_seed(0)
    model = SLatFlowModelTdfyWrapper(resolution=16, in_channels=8, model_channels=32, cond_channels=16,
                                     out_channels=8, num_blocks=2, num_heads=2, io_block_channels=[16],
                                     patch_size=2, force_zeros_cond=True).eval()
    for p in model.parameters():  # the zero-initialised output layers would hide wrong caches
        torch.nn.init.normal_(p, std=0.2)
    g = torch.Generator().manual_seed(1)
    cells = torch.randperm(16 ** 3, generator=g)[:300].sort().values
    coords = torch.stack([torch.zeros_like(cells), cells // 256, cells // 16 % 16, cells % 16], 1).int().numpy()
    return model, coords


def _attention_exempt_from_the_sync_check(monkeypatch) -> list:
    """backends.varlen_attention runs outside HostSyncRecorder; returns the list of (max_q type, max_k type, cu_q
    device, cu_k device) it is called with."""
    import backends
    from torch.utils._python_dispatch import _disable_current_modes
    real = backends.varlen_attention
    passed = []

    def varlen_attention(q, k, v, cu_q, cu_k, max_q=None, max_k=None, scale=None):
        passed.append((type(max_q), type(max_k), cu_q.device, cu_k.device))
        with _disable_current_modes():
            return real(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale)
    monkeypatch.setattr(backends, "varlen_attention", varlen_attention)
    return passed


def test_stage2_step_after_the_first_is_free_of_host_syncs(monkeypatch):
    """Stage 2's backbone keeps every coordinate-derived tensor with the run's coords, so the calls a CUDA graph
    captures (after an eager warm-up of the same coords object) do feature arithmetic only. The attention backend
    itself is exempt here: on CPU it validates cu_seqlens and buckets lengths on the host; on CUDA it reads
    nothing when given device cu_seqlens and max lengths, which is what the model must pass."""
    passed = _attention_exempt_from_the_sync_check(monkeypatch)
    model, coords = _tiny_slat_flow()
    g = torch.Generator().manual_seed(2)
    x1, x2 = (torch.randn(1, coords.shape[0], 8, generator=g) for _ in range(2))
    t, cond = torch.tensor([500.0]), torch.randn(1, 5, 16, generator=g)
    with torch.no_grad():
        model(x1, t, cond, coords)  # warm-up: builds maps, downsampling index, sequence lengths
        with HostSyncRecorder() as rec:
            cached = [model(x2, t, cond, coords), model(x2, t, cond, coords, cfg=True)]
        assert rec.seen == []
        assert passed and all(p == (int, int, q.device, q.device) for p in passed for q in [x1])
        # the cached path computes what a fresh tensor (new coords object) computes
        fresh = [model(x2, t, cond, coords.copy()), model(x2, t, cond, coords.copy(), cfg=True)]
    for a, b in zip(cached, fresh):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(cached[0], cached[1])


def test_linear_weights_stored_in_the_autocast_dtype_give_the_same_results():
    """The pipeline stores stage 1's Linear weights in the autocast dtype on CUDA; autocast would cast them the
    same way at every call, so outputs are bit-identical (checked here with CPU bfloat16 autocast on a block of
    Linear + LayerNorm + GELU, the pattern of the flow transformer)."""
    from sam3d_objects.model.backbone.tdfy_dit.modules.utils import store_linear_weights_in
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 16)).eval()
    x = torch.randn(3, 7, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = block(x)
        assert store_linear_weights_in(block, torch.bfloat16) == 2
        got = block(x)
    assert block[0].weight.dtype == torch.bfloat16 and block[2].weight.dtype == torch.float32
    assert got.dtype == want.dtype and torch.equal(got, want)


def _cache_keys(sparse) -> set:
    return {(scale, key) for scale, entries in sparse._spatial_cache.items() for key in entries}


def test_stage2_prepare_builds_everything_a_capture_reads(monkeypatch):
    """`prepare_graph_capture` (what lets a warmed-up runner capture a new object's call without an eager
    warm-up) builds every coordinate-derived tensor: the call after it adds nothing to the coords' cache, does
    no host sync, and computes what a fresh eager call computes."""
    passed = _attention_exempt_from_the_sync_check(monkeypatch)
    model, coords = _tiny_slat_flow()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, coords.shape[0], 8, generator=g)
    t, cond = torch.tensor([500.0]), torch.randn(1, 5, 16, generator=g)
    with torch.no_grad():
        want = model(x, t, cond, coords.copy())
        model.prepare_graph_capture(x, t, cond, coords)
        keys = _cache_keys(model._step_input[1])
        assert len(keys) >= 4  # range check, maps of both levels, downsampling, sequence lengths
        with HostSyncRecorder() as rec:
            got = model(x, t, cond, coords)
        assert _cache_keys(model._step_input[1]) == keys
    assert rec.seen == [] and passed and all(p[:2] == (int, int) for p in passed)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


class PreparingBackbone(Backbone):
    """Offers prepare_graph_capture, as stage 2's wrapper does; counts its calls."""

    prepared = 0

    def prepare_graph_capture(self, x, t, cond, cfg=False, d=None):
        self.prepared += 1


def test_a_warmed_backbone_with_prepare_captures_new_shapes_without_warm_up():
    model = PreparingBackbone().eval()
    x, t, cond = _inputs()
    short = {k: v[:, :1] for k, v in x.items()}
    with torch.no_grad():
        first = FakeCalls(model)
        for _ in range(3):  # first run in the process: warm-up, capture, replay
            first(x, t, cond)
        assert (first.warm_ups, first.captures, model.prepared) == (1, 1, 0)
        second = FakeCalls(model)  # next run, other shapes: prepared and captured at its first call
        outs = [second(short, t, cond) for _ in range(3)]
        assert (second.warm_ups, second.captures, second.replays, model.prepared) == (0, 1, 3, 1)
        for out in outs:
            torch.testing.assert_close(out["shape"], model(short, t, cond)["shape"], rtol=0, atol=0)
        # a backbone without prepare_graph_capture always warms up new shapes
        plain = Backbone().eval()
        plain.__dict__[cg._WARMED] = True
        runner = FakeCalls(plain)
        runner(x, t, cond)
        assert runner.warm_ups == 1 and runner.captures == 0


def test_a_failed_capture_without_warm_up_becomes_the_warm_up():
    class FailsOnce(FakeGraph):
        failed = []

        @staticmethod
        def record(fn, args, kwargs, pool):
            if not FailsOnce.failed:
                FailsOnce.failed.append(True)
                raise RuntimeError("operation not permitted when stream is capturing")
            return FakeGraph.record(fn, args, kwargs, pool)

    class Calls(FakeCalls):
        graph_class = FailsOnce

    model = PreparingBackbone().eval()
    model.__dict__[cg._WARMED] = True
    runner = Calls(model)
    x, t, cond = _inputs()
    with torch.no_grad():
        outs = [runner(x, t, cond) for _ in range(3)]
    assert (model.prepared, runner.warm_ups, runner.captures, runner.replays) == (1, 1, 1, 2)
    for out in outs:
        torch.testing.assert_close(out["shape"], outs[0]["shape"], rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_stage2_new_coords_captured_without_warm_up_match_eager():
    model, coords = _tiny_slat_flow()
    model = model.cuda()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, coords.shape[0], 8, generator=g).cuda()
    t, cond = torch.tensor([500.0]).cuda(), torch.randn(1, 5, 16, generator=g).cuda()
    # under the pipeline's half-precision autocast (its attention kernels take device sequence lengths)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        first = cg.GraphedCalls(model)
        [first(x, t, cond, coords) for _ in range(3)]
        assert (first.warm_ups, first.captures) == (1, 1)
        other = coords[: coords.shape[0] // 2].copy()  # the next object: new coords and shapes
        y = x[:, : other.shape[0]].contiguous()
        second = cg.GraphedCalls(model)
        outs = [second(y * s, t, cond, other) for s in (1.0, 0.5, 2.0)]
        assert (second.warm_ups, second.captures, second.replays) == (0, 1, 3)
        for s, out in zip((1.0, 0.5, 2.0), outs):
            torch.testing.assert_close(out, model(y * s, t, cond, other.copy()), rtol=2e-3, atol=2e-3)
