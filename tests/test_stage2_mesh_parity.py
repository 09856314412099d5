"""Mesh decoder parity in detail (the golden harness's own comparison functions, in process).

The face-normal check of the mesh case is ill-conditioned: near-degenerate triangles (edges ~1e-4) turn a
+-1 ulp change of the decoder output into large face-normal changes (see tests/tools/mesh_normal_conditioning.py);
the harness compares face normals with a tolerance that follows each face's conditioning. With the default
(native) norms the network output is within float32 tolerance of upstream's and the mesh passes the harness; with
the explicit `reference` norm backend (PyTorch 2.5.1's CPU rounding) and upstream's single masked SDPA call for
short attention packs, and the subdivision blocks' convolutions on the children (`blocked_convs = False`, upstream's
per-offset order), the network output is bit-exact. The default parent-level (blocked) convolutions add kernel taps
that meet the same parent before multiplying: float32 tolerance, and the mesh still passes the harness.
The harness compares meshes as sets; the order itself (upstream's) is checked in tests/test_internals_models.py.

"Exact" is checked with tolerances, never bitwise across machines: bitwise parity holds on one CPU model only
(another x86 CPU's vectorised exp / erf moved one vertex in the 8th digit), and a 1-ulp change early in the
decoder reaches ~3e-6 at its output (what the blocked convolutions' other summation order gives here). The bounds
are float32 rounding (extraction: a few ulps of the coordinates; decoder output: 1e-5, ten times below the
harness's 1e-4), so a real regression (a wrong table, tap, norm or order of magnitude) still fails them.
"""
import pathlib
import sys

import pytest
import torch

from conftest import GOLDEN


@pytest.fixture(scope="module")
def harness():
    if not (GOLDEN / "slat_decoder_mesh" / "case.json").exists():
        pytest.skip(f"golden data not found at {GOLDEN}")
    sys.path.insert(0, str(GOLDEN))
    import check_cases

    check_cases._import_libraries()
    return check_cases, check_cases.Case(pathlib.Path(GOLDEN / "slat_decoder_mesh"))


KEYS = {k: k for k in ("vertices", "faces", "vertex_attrs", "face_normal")}
EPS32 = torch.finfo(torch.float32).eps
ULPS = 8  # a few float32 roundings of an op chain, on any CPU


def matched_vertex_error(cc, case, mesh) -> float:
    """Largest |vertex - matched upstream vertex| after the harness's own set matching (vertices are an
    unordered set); inf when the meshes cannot be matched."""
    out = case.outputs
    v_impl, f_impl = cc.as_tensor(mesh.vertices).cpu(), cc.as_tensor(mesh.faces).cpu().long()
    if v_impl.shape != out["vertices"].shape:
        return float("inf")
    match, _ = cc.VertexMatcher(v_impl, f_impl, out["vertices"], out["faces"].long(), case.rtol, case.atol).run()
    if match is None:
        return float("inf")
    return float((v_impl.double() - out["vertices"].double()[match]).abs().max())




def test_extraction_is_exact_on_recorded_decoder_output(harness):
    """Our extractor on upstream's own recorded decoder output: upstream's mesh within float32 rounding."""
    from sam3d_objects.model.backbone.tdfy_dit.modules.sparse import SparseTensor
    from sam3d_objects.model.backbone.tdfy_dit.representations.mesh import SparseFeatures2Mesh

    cc, case = harness
    out = case.outputs
    extractor = SparseFeatures2Mesh(res=4 * case.config.resolution, use_color=True)
    mesh = extractor(SparseTensor(feats=out["stage.out_layer.feats"].clone(), coords=out["stage.out_layer.coords"]))
    chk = cc.Checker(case)
    cc.check_mesh(chk, mesh, KEYS)
    assert not chk.failures, chk.failures
    # the same vertex set within a few ulps of the coordinates' magnitude (bitwise on the recording machine)
    assert matched_vertex_error(cc, case, mesh) <= ULPS * EPS32 * float(out["vertices"].abs().max())


def _run(cc, case, device="cpu"):
    model = cc.build_loaded(case.config, case.weights).to(device)
    seen = {}
    model.out_layer.register_forward_hook(lambda m, a, out: seen.__setitem__("out", out.feats.clone()))
    with torch.no_grad():
        meshes = model(cc.sparse_tensor(case.inputs["feats"].to(device), case.inputs["coords"].to(device)))
    return seen["out"], meshes


def test_end_to_end_with_reference_norms_and_child_level_convs_is_exact(harness, monkeypatch):
    """Upstream's arithmetic order (reference norms, child-level convs): the decoder output within a few ulps of
    upstream's (bitwise on the recording machine's CPU; see the module docstring), and the mesh passes the harness and matches its vertex
    set within rounding."""
    import backends
    from sam3d_objects.model.backbone.tdfy_dit.models.structured_latent_vae.decoder_mesh import (
        SparseSubdivideBlock3d)

    cc, case = harness
    monkeypatch.setattr(SparseSubdivideBlock3d, "blocked_convs", False)
    with backends.use(norm="reference"):
        out, meshes = _run(cc, case)
    torch.testing.assert_close(out, case.outputs["stage.out_layer.feats"], rtol=1e-5, atol=1e-5)
    chk = cc.Checker(case)
    cc.check_mesh(chk, meshes[0], KEYS)
    assert not chk.failures, chk.failures
    assert matched_vertex_error(cc, case, meshes[0]) <= 2e-6  # coordinates ~0.5; the harness allows 1e-4


def test_blocked_convs_with_reference_norms_stay_within_float_rounding(harness):
    """The default (parent-level) convolutions differ from the bit-exact run by rounding only, and pass the mesh
    harness."""
    import backends

    cc, case = harness
    with backends.use(norm="reference"):
        out, meshes = _run(cc, case)
    want = case.outputs["stage.out_layer.feats"]
    assert not torch.equal(out, want)  # the blocked path really ran (its rounding differs)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    chk = cc.Checker(case)
    cc.check_mesh(chk, meshes[0], KEYS)
    assert not chk.failures, chk.failures


def test_end_to_end_with_native_norms_passes_the_harness(harness, device, exact_float32):
    """The default path on every test device (built where the fixture puts the default device, weights moved
    there): the decoder output within the harness's tolerance and the mesh through the harness's own
    conditioning-aware comparison."""
    cc, case = harness
    out, meshes = _run(cc, case, device)
    want = case.outputs["stage.out_layer.feats"]
    torch.testing.assert_close(out.cpu(), want, rtol=1e-4, atol=1e-4)
    chk = cc.Checker(case)
    cc.check_mesh(chk, meshes[0], KEYS)
    assert not chk.failures, chk.failures


def test_with_the_naive_attention_reference_only_face_normals_of_tiny_triangles_move(harness):
    """The float64-style naive attention backend is not upstream's SDPA arithmetic: vertices, colours and the exact
    face set still pass; a handful of face normals of tiny triangles (<= 0.05% of the entries) may not."""
    import backends

    cc, case = harness
    model = cc.build_loaded(case.config, case.weights)
    with torch.no_grad(), backends.use(attn="naive"):
        meshes = model(cc.sparse_tensor(case.inputs["feats"], case.inputs["coords"]))
    chk = cc.Checker(case)
    cc.check_mesh(chk, meshes[0], KEYS)
    other = [f for f in chk.failures if f[0] != "face_normal"]
    assert not other, other
    for key, detail in chk.failures:  # "... N of M entries out of tolerance ..."
        bad, total = [int(t) for t in detail.split(" entries")[0].split(";")[-1].split(" of ")]
        assert bad <= 5e-4 * total, detail
