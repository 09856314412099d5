"""Mesh decoder parity in detail (the golden harness's own comparison functions, in process).

The extraction itself is bit-exact: fed upstream's recorded 101-channel decoder output, our sparse FlexiCubes
reproduces vertices, faces, vertex attributes and face normals exactly (compared as sets: vertex and face
order are implementation-defined). End to end, float32 rounding differences of the network (~4e-6 on the
decoder output: torch 2.13's CPU kernels, GroupNorm among them, round differently from torch 2.5.1's) move
vertices by < 1e-6; every check passes except face normals of a few tiny triangles, whose direction is that
sensitive (a +-1 ulp nudge of upstream's own recorded output fails 6-24 entries, see
tests/tools/mesh_normal_conditioning.py): we require all but 0.05% of their entries within the case tolerance.
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


def test_extraction_is_exact_on_recorded_decoder_output(harness):
    from sam3d_objects.model.backbone.tdfy_dit.modules.sparse import SparseTensor
    from sam3d_objects.model.backbone.tdfy_dit.representations.mesh import SparseFeatures2Mesh

    cc, case = harness
    out = case.outputs
    extractor = SparseFeatures2Mesh(res=4 * case.config.resolution, use_color=True)
    mesh = extractor(SparseTensor(feats=out["stage.out_layer.feats"].clone(), coords=out["stage.out_layer.coords"]))
    chk = cc.Checker(case)
    cc.check_mesh(chk, mesh, KEYS)
    assert not chk.failures, chk.failures
    ours = sorted(map(tuple, mesh.vertices.tolist()))
    assert ours == sorted(map(tuple, out["vertices"].tolist()))  # bitwise the same vertex set


def test_end_to_end_within_float32_noise(harness):
    cc, case = harness
    model = cc.build_loaded(case.config, case.weights)
    with torch.no_grad():
        meshes = model(cc.sparse_tensor(case.inputs["feats"], case.inputs["coords"]))
    chk = cc.Checker(case)
    cc.check_mesh(chk, meshes[0], KEYS)
    other = [f for f in chk.failures if f[0] != "face_normal"]
    assert not other, other
    fn = meshes[0].face_normal
    assert fn.shape == case.outputs["face_normal"].shape
    for key, detail in chk.failures:  # "... N of M entries out of tolerance ..."
        bad, total = [int(t) for t in detail.split(" entries")[0].split(";")[-1].split(" of ")]
        assert bad <= 5e-4 * total, detail
