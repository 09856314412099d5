"""Upstream's model internals as research code reads them: embedder attributes and private steps, the sparse
tensor's backend object, the point-map embedder's return arity and NaN behaviour, the MoT block's import path
and helpers, sampler helpers, and the mesh's vertex / face order against the golden slat_decoder_mesh case
(recorded from Meta's package)."""
import math
import pathlib
import sys

import pytest
import torch

from conftest import GOLDEN, root_pythonpath
from test_stage1_models import load_case, meta_built_and_loaded, prefixed, with_dino_sizes


@pytest.fixture(scope="module")
def mesh_case():
    if not (GOLDEN / "slat_decoder_mesh" / "case.json").exists():
        pytest.skip(f"golden data not found at {GOLDEN}")
    sys.path.insert(0, str(GOLDEN))
    import check_cases

    check_cases._import_libraries()
    return check_cases, check_cases.Case(pathlib.Path(GOLDEN / "slat_decoder_mesh"))


# ---------------------------------------------------------------------------------------------- mesh order
def test_mesh_extraction_gives_upstreams_vertex_and_face_order(mesh_case):
    """On the decoder output upstream recorded, the extracted mesh equals upstream's array for array, in order."""
    from sam3d_objects.model.backbone.tdfy_dit.modules.sparse import SparseTensor
    from sam3d_objects.model.backbone.tdfy_dit.representations.mesh import SparseFeatures2Mesh

    _, case = mesh_case
    out = case.outputs
    extractor = SparseFeatures2Mesh(res=4 * case.config.resolution, use_color=True)
    mesh = extractor(SparseTensor(feats=out["stage.out_layer.feats"].clone(), coords=out["stage.out_layer.coords"]))
    assert torch.equal(mesh.faces, out["faces"].long())
    torch.testing.assert_close(mesh.vertices, out["vertices"], rtol=0, atol=1e-5)
    torch.testing.assert_close(mesh.vertex_attrs, out["vertex_attrs"], rtol=0, atol=1e-5)
    v = out["vertices"].double()
    assert (v[mesh.faces[:, 0]] - v[mesh.faces[:, 1]]).norm(dim=1).max() < 0.2  # faces index nearby vertices


def test_mesh_decoder_output_order(mesh_case):
    cc, case = mesh_case
    model = cc.build_loaded(case.config, case.weights)
    with torch.no_grad():
        mesh = model(cc.sparse_tensor(case.inputs["feats"], case.inputs["coords"]))[0]
    assert torch.equal(mesh.faces, case.outputs["faces"].long())
    torch.testing.assert_close(mesh.vertices, case.outputs["vertices"], rtol=1e-4, atol=1e-4)


def test_flexicubes_tables_follow_the_cube_conventions():
    from sam3d_objects.model.backbone.tdfy_dit.representations.mesh.flexicubes import FlexiCubes

    fc = FlexiCubes()
    ends = fc.cube_edges.reshape(12, 2)
    axis = (fc.cube_corners[ends[:, 0]] - fc.cube_corners[ends[:, 1]]).abs().argmax(dim=1)
    assert torch.equal(fc.edge_dir_table, axis)
    for direction in range(3):  # every ring step crosses a face perpendicular to the edge, out one side, in the other
        faces = fc.dir_faces_table[direction]
        assert not (faces // 2 == direction).any() and ((faces[:, 0] - faces[:, 1]).abs() == 1).all()
    assert fc.adj_pairs.tolist() == [0, 1, 1, 3, 3, 2, 2, 0]
    assert fc.quad_split_1.tolist() == [0, 1, 2, 0, 2, 3] and fc.quad_split_train.numel() == 8
    # cubes with several dual vertices number them by the corners they enclose (smallest first)
    slots = fc.dmc_table[0b00010100][:2]  # corners 2 and 4 inside: two patches
    assert slots[0][slots[0] >= 0].tolist() == [4, 7, 8] and slots[1][slots[1] >= 0].tolist() == [2, 3, 11]


def test_flexicubes_private_helpers():
    from sam3d_objects.model.backbone.tdfy_dit.representations.mesh.flexicubes import FlexiCubes

    fc = FlexiCubes()
    sdf = torch.tensor([-1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0])
    cubes = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8]])
    surf, occ = fc._identify_surf_cubes(sdf, cubes)
    assert surf.tolist() == [True, False] and occ[0].tolist() == [True] + [False] * 7
    x = fc._linear_interp(torch.tensor([[[-1.0], [3.0]]]), torch.tensor([[[0.0, 0, 0], [4.0, 0, 0]]]))
    torch.testing.assert_close(x, torch.tensor([[1.0, 0, 0]]))
    normals = torch.eye(3).repeat(3, 1)[:7][None]  # planes x = 1, y = 2, z = 3 (repeated)
    points = torch.tensor([[1.0, 0, 0], [0, 2, 0], [0, 0, 3]]).repeat(3, 1)[:7][None]
    vd = fc._solve_vd_QEF(points, normals, torch.zeros(1, 3), qef_reg_scale=1e-6)
    torch.testing.assert_close(vd, torch.tensor([[1.0, 2.0, 3.0]]), rtol=0, atol=1e-4)
    loss = fc._compute_reg_loss(torch.zeros(1, 3), torch.tensor([[1.0, 0, 0], [3.0, 0, 0]]), torch.tensor([0, 0]),
                                torch.tensor([[2]]))
    torch.testing.assert_close(loss, torch.tensor([1.0, 1.0]))


# ------------------------------------------------------------------------------------------------ embedders
@torch.no_grad()
def test_point_patch_embed_returns_upstreams_four_values_and_nan_tokens(golden_dir):
    cfg, w, inp, out, _ = load_case(golden_dir, "point_patch_embed")
    model = meta_built_and_loaded(cfg.linear, prefixed(w, "linear."))
    xyz = inp["xyz"]
    result = model.embed_pointmap_windows(xyz)
    assert len(result) == 4
    x, b, h, w_ = result
    assert (b, h, w_) == (xyz.shape[0], model.input_size, model.input_size) and x.shape == (b, h, w_, model.embed_dim)
    torch.testing.assert_close(model.inner_forward(x, b, h, w_), out["linear.tokens"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model(xyz, inp["valid_mask"]), out["linear.tokens_with_valid_mask"], rtol=1e-4,
                               atol=1e-4, equal_nan=True)
    # a valid_mask that marks a NaN point valid gives NaN tokens (upstream): only that point's window
    resized = model.resize_input(xyz)
    nan_at = torch.nonzero(~torch.isfinite(resized).all(-1))[0].tolist()
    everything = torch.ones(resized.shape[:3], dtype=torch.bool)
    tokens = model(xyz, everything)
    window = (nan_at[1] // model.patch_size) * (model.input_size // model.patch_size) + nan_at[2] // model.patch_size
    assert torch.isnan(tokens[nan_at[0], window]).all()
    assert torch.isfinite(model(xyz)).all()  # without a mask non-finite points are the invalid ones
    pos = model._get_pos_embed((2, 3))
    assert pos.shape == (1, 2, 3, model.embed_dim)


@torch.no_grad()
def test_embedder_fuser_and_dino_internals(golden_dir):
    cfg, w, inp, out, meta = load_case(golden_dir, "embedder_fuser")
    sizes = meta["tiny_sizes"]["dino"]
    fuser = meta_built_and_loaded(with_dino_sizes(cfg["ss_condition_embedder"], sizes), prefixed(w, "ss."))
    assert fuser.embed_dims == fuser.idx_emb.shape[1] == max(e.embed_dim for e, _ in fuser.embedder_list)
    assert fuser.positional_embed_map == {"cropped": 0, "full": 1}
    assert fuser.concate_embed_dims == sum(e.embed_dim for e, names in fuser.embedder_list for _ in names)
    assert fuser.projection_net_hidden_dim_multiplier > 0
    net = fuser._make_projection_net(fuser.embedder_list[0][0].embed_dim, fuser.embed_dims,
                                     fuser.projection_net_hidden_dim_multiplier)
    assert {k: v.shape for k, v in net.state_dict().items()} == {
        k: v.shape for k, v in fuser.projection_nets[0].state_dict().items()}
    tokens = [torch.ones(1, 2, 4), torch.ones(1, 2, 4)]
    fuser.force_drop_modalities = ["pointmap"]
    dropped = fuser._dropout_modalities(["image", "pointmap"], tokens)
    assert dropped[0].eq(1).all() and dropped[1].eq(0).all()
    fuser.force_drop_modalities = None
    configs, cumulative = fuser._build_dropout_distribution("cpu") if fuser.drop_modalities_weight else ([set()], None)
    assert configs[0] == set()
    torch.testing.assert_close(fuser(**{n: inp[n] for n in fuser.input_names}), out["ss_tokens"], rtol=2e-4,
                               atol=2e-4)

    dino = fuser.embedder_list[0][0]
    image = inp[fuser.embedder_list[0][1][0][0]]
    assert dino.resize_input_size == (dino.input_size, dino.input_size) and dino.input_channels == 3
    pre = dino._preprocess_input(image)
    assert pre.shape == (image.shape[0], 3, *dino.resize_input_size)
    torch.testing.assert_close(dino(image), dino._forward_last_layer(pre).to(image.dtype), rtol=0, atol=0)
    (patches, cls), = dino._forward_intermediate_layers(pre, 1)
    features = dino.backbone.forward_features(pre)
    torch.testing.assert_close(patches, features["x_norm_patchtokens"])
    torch.testing.assert_close(cls, features["x_norm_clstoken"])


# --------------------------------------------------------------------------------------------- sparse tensor
def test_sparse_tensor_data_is_the_backend_view():
    from sam3d_objects.model.backbone.tdfy_dit.modules.sparse import SparseTensor

    coords = torch.tensor([[0, 1, 2, 3], [0, 0, 0, 0], [1, 4, 1, 1]], dtype=torch.int32)
    x = SparseTensor(feats=torch.randn(3, 2), coords=coords)
    data = x.data
    assert data.features is x.feats and data.indices is x.coords and data.F is x.feats and data.C is x.coords
    assert data.spatial_shape == [5, 3, 4] and data.batch_size == 2
    new = torch.zeros(3, 2)
    x.data.features = new
    assert x.feats is new
    y = SparseTensor(data=x.data)
    assert torch.equal(y.coords, x.coords) and y.shape == x.shape
    torch.testing.assert_close(data.replace_feature(torch.ones(3, 2)).features, torch.ones(3, 2))
    assert data.dense().shape == x.dense().shape


# ------------------------------------------------------------------------------------------- MoT and samplers
def test_mot_block_import_path_and_helpers():
    from sam3d_objects.model.backbone.tdfy_dit.models.mot_sparse_structure_flow import (
        MOTModulatedTransformerCrossBlock as Home)
    from sam3d_objects.model.backbone.tdfy_dit.modules.transformer import MOTModulatedTransformerCrossBlock

    assert MOTModulatedTransformerCrossBlock is Home
    torch.manual_seed(0)
    block = MOTModulatedTransformerCrossBlock(16, 8, 2, latent_names=["6drotation_normalized", "shape"]).eval()
    assert isinstance(block.norm1, torch.nn.ModuleDict) and set(block.norm1) == {"6drotation_normalized", "shape"}
    x = {"6drotation_normalized": torch.randn(1, 2, 16), "shape": torch.randn(1, 5, 16)}
    mod, context = torch.randn(1, 16), torch.randn(1, 3, 8)
    with torch.no_grad():
        out = block(x, mod, context)
        assert all(torch.equal(out[k], v) for k, v in block._forward(x, mod, context).items())
        # the helpers compose upstream's step: modulated norm, gate, residual
        h, scale, shift, gate = torch.randn(1, 2, 16), torch.randn(1, 16), torch.randn(1, 16), torch.randn(1, 16)
        torch.testing.assert_close(block._apply_msa(h, scale, shift), h * (1 + scale[:, None]) + shift[:, None])
        torch.testing.assert_close(block._apply_add(h, block._apply_multiplication(h, gate)), h + h * gate[:, None])
        attn = block.self_attn
        assert attn._type == "self" and attn._get_shape(h) == h.shape
        qkv = attn._reshape(torch.randn(1, 2, 48), h.shape, attn.num_heads)
        assert qkv.shape == (1, 2, 3, 2, 8) and attn._reshape_back(qkv[:, :, 0], h.shape).shape == (1, 2, 16)
        assert set(attn._moduledict_to_dict(attn.to_qkv)) == set(x)


def test_flow_matching_and_guidance_helpers():
    from sam3d_objects.model.backbone.generator.classifier_free_guidance import ClassifierFreeGuidance, PointmapCFG
    from sam3d_objects.model.backbone.generator.flow_matching.model import FlowMatching

    diag = torch.tensor([0.5, -2.0, 3.0, 1.5])
    fm = FlowMatching(reverse_fn=torch.nn.Identity(), sigma_min=0.1)
    x0, x1, t = torch.randn(2, 4), torch.randn(2, 4), torch.tensor([0.25, 0.5])
    torch.testing.assert_close(fm._generate_xt(x0, x1, t), (1 - 0.9 * t[:, None]) * x0 + t[:, None] * x1)
    torch.testing.assert_close(fm._generate_target(x0, x1), x1 - 0.9 * x0)
    assert fm._generate_x0({"a": x1, "b": x0})["a"].shape == x1.shape
    flat = fm._tree_flatten({"b": torch.zeros(2, 1), "a": torch.ones(2, 2, 1)})
    assert flat.tolist() == [[1.0, 1.0, 0.0]] * 2  # sorted keys, per-sample flattening
    expected = torch.distributions.Normal(0.0, 1.0).log_prob(x0).sum(1)
    torch.testing.assert_close(fm._log_p0(x0), expected)
    x = torch.randn(3, 4, requires_grad=True)
    div = fm._compute_hutchinson_divergence(x * diag, x, z_samples=2)  # linear diagonal field: exact
    torch.testing.assert_close(div, diag.sum().expand(3))
    assert math.isfinite(float(fm._generate_t(x1).sum()))

    cfg = ClassifierFreeGuidance(torch.nn.Identity(), strength=2.0, unconditional_handling="add_flag")
    c, u = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(cfg._cfg_step(c, u, 2.0), 3 * c - 2 * u)
    assert cfg._make_unconditional_args((1,), {})[1] == {"cfg": True}
    pm = PointmapCFG(torch.nn.Identity(), strength=2.0, strength_pm=1.0, unconditional_handling="add_flag")
    p = torch.randn(3)
    torch.testing.assert_close(pm._cfg_step(c, u, p, 2.0, 1.0), c + (c - p) + 2 * (p - u))


def test_flexicubes_private_steps_chain_as_upstreams_call():
    """Upstream's __call__ written out with the private steps (its signatures and return values) on a dense grid
    gives the same mesh as calling the extractor."""
    from sam3d_objects.model.backbone.tdfy_dit.representations.mesh.flexicubes import FlexiCubes
    from sam3d_objects.model.backbone.tdfy_dit.representations.mesh.utils_cube import construct_dense_grid

    res = 6
    verts, cubes = construct_dense_grid(res)
    x = verts.float() / res - 0.5
    sdf = x.norm(dim=1) - 0.3 + 0.02 * torch.sin(7 * x[:, 0])
    g = torch.Generator().manual_seed(0)
    beta, alpha, gamma = (torch.randn(cubes.shape[0], n, generator=g) for n in (12, 8, 1))
    gamma = gamma[:, 0]
    fc = FlexiCubes()
    vertices, faces, _, _ = fc(x, sdf, cubes, res, beta=beta, alpha=alpha, gamma_f=gamma)

    surf, occ = fc._identify_surf_cubes(sdf, cubes)
    b, a, gm = fc._normalize_weights(beta, alpha, gamma, surf, 0.99)
    case_ids = fc._get_case_id(occ, surf, res)
    surf_edges, idx_map, edge_counts, surf_edges_mask = fc._identify_surf_edges(sdf, cubes, surf)
    vd, l_dev, vd_gamma, vd_idx_map, vd_color = fc._compute_vd(x, cubes[surf], surf_edges, sdf, case_ids, b, a, gm,
                                                               idx_map, 1e-3, None)
    vd2, faces2, s_edges, edge_indices, _ = fc._triangulate(sdf, surf_edges, vd, vd_gamma, edge_counts, idx_map,
                                                            vd_idx_map, surf_edges_mask, False, vd_color)
    assert torch.equal(vd2, vertices) and torch.equal(faces2, faces) and faces.shape[0] > 0
    assert edge_counts.max() <= 4 and s_edges.shape[1] == 2 and vd_color is None


def test_upstream_notebook_folder_is_an_alias():
    """``sys.path.append("notebook")`` (upstream's folder name) finds the same objects as ``notebooks``."""
    import os
    import subprocess

    from conftest import ROOT
    script = ("import sys; sys.path.append('notebook'); import inference; "
              "from inference import Inference, load_image, make_scene, render_video; "
              "import sam3d_objects.inference as ours; "
              "assert Inference is ours.Inference and make_scene is ours.make_scene; "
              "assert inference.__file__.replace(chr(92), '/').endswith('notebook/inference.py'); print('ok')")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": root_pythonpath()})
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
