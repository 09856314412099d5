"""Research-style scripts that reach into upstream's internals, run unchanged on Meta's package (through
`patches.apply()`) and on this project's, each in a fresh interpreter; the numbers they print must agree (same
machinery and tolerance as tests/test_patches_upstream_research.py). Both sides put upstream's folder name
`notebook` on sys.path."""
import pytest

import test_patches_upstream_research as research
from test_patches_upstream_research import same, setup  # noqa: F401  module-scoped fixture

SCRIPTS = {
    # containers, embedder attributes, the point-map embedder's 4 values and NaN tokens, Dino's private steps
    "embedder_internals": """
        result["models"] = sorted(k for k, v in pipeline.models.items() if v is not None)
        result["embedders"] = sorted(pipeline.condition_embedders)
        fuser = pipeline.condition_embedders["ss_condition_embedder"]
        result["embed_dims"] = int(fuser.embed_dims)
        result["concate_embed_dims"] = int(fuser.concate_embed_dims)
        result["positional_embed_map"] = sorted(fuser.positional_embed_map.items())
        result["multiplier"] = float(fuser.projection_net_hidden_dim_multiplier)
        pm = pipeline.compute_pointmap(rgba, pointmap.clone())["pointmap"]
        ss_input = pipeline.preprocess_image(rgba, pipeline.ss_preprocessor, pointmap=pm)
        embed = [m for m, _ in fuser.embedder_list if type(m).__name__ == "PointPatchEmbed"][0]
        with torch.no_grad():
            x, B, H, W = embed.embed_pointmap_windows(ss_input["pointmap"])
            result["windows"] = [int(B), int(H), int(W), list(x.shape)]
            result["x_mean"] = num(x.double().nan_to_num().mean())
            everything = torch.ones(B, H, W, dtype=torch.bool)
            tokens = embed(ss_input["pointmap"], everything)
            result["nan_tokens"] = int(torch.isnan(tokens).any(-1).sum())
            result["finite_tokens_mean"] = num(embed(ss_input["pointmap"]).double().mean())
            dino = fuser.embedder_list[0][0]
            result["resize_input_size"] = list(dino.resize_input_size)
            result["input_channels"] = int(dino.input_channels)
            pre = dino._preprocess_input(ss_input["image"].clone())
            result["pre_mean"] = num(pre.double().mean())
            result["last_layer_mean"] = num(dino._forward_last_layer(pre).double().mean())
        result["dtype"] = str(pipeline._get_dtype("float16"))
    """,
    # hooks on the models during a full run, the mesh indexed by vertex number, the structured latent's .data
    "mesh_order_and_sparse_data": """
        seen = {}
        def keep(name):
            def hook(module, args, output):
                seen[name] = num(output.double().abs().mean())
            return hook
        def slat_hook(module, args):
            data = args[0].data
            seen["slat.features"] = list(data.features.shape)
            seen["slat.indices"] = list(data.indices.shape)
            seen["slat.spatial_shape"] = [int(v) for v in data.spatial_shape]
        handles = [pipeline.condition_embedders["ss_condition_embedder"].register_forward_hook(keep("ss_tokens")),
                   pipeline.condition_embedders["slat_condition_embedder"].register_forward_hook(keep("slat_tokens")),
                   pipeline.models["slat_decoder_mesh"].register_forward_pre_hook(slat_hook)]
        out = run()
        for h in handles:
            h.remove()
        result.update(seen)
        mesh = out["mesh"][0]
        result["first_vertices"] = num(mesh.vertices[:12])
        result["first_faces"] = [int(v) for v in mesh.faces[:12].flatten()]
        result["last_faces"] = [int(v) for v in mesh.faces[-12:].flatten()]
        result["vertex_of_face_100"] = num(mesh.vertices[mesh.faces[100]])
    """,
    # per-stage settings changed between runs, counted at the stage-1 backbone
    "stage_settings": """
        calls = {"cond": 0, "uncond": 0}
        def count(module, args, kwargs):
            calls["uncond" if kwargs.get("cfg") else "cond"] += 1
        backbone = pipeline.models["ss_generator"].reverse_fn.backbone
        handle = backbone.register_forward_pre_hook(count, with_kwargs=True)
        pipeline.models["ss_generator"].inference_steps = 3
        out = run(stage1_only=True)
        result["steps3"] = dict(calls)
        result["shape3"] = num(out["shape"].double().mean())
        calls.update(cond=0, uncond=0)
        pipeline.ss_cfg_strength = 0.0
        out = run(stage1_only=True, stage1_inference_steps=2)
        result["steps2_noguidance"] = dict(calls)
        result["shape2"] = num(out["shape"].double().mean())
        handle.remove()
        result["steps_after"] = int(pipeline.models["ss_generator"].inference_steps)
    """,
    # upstream's import path of the MoT block
    "mot_block_import": """
        from sam3d_objects.model.backbone.tdfy_dit.modules.transformer import MOTModulatedTransformerCrossBlock
        block = pipeline.models["ss_generator"].reverse_fn.backbone.blocks[0]
        result["is_mot_block"] = isinstance(block, MOTModulatedTransformerCrossBlock)
        result["norm_keys"] = sorted(block.norm1.keys())
        result["streams"] = sorted(block.cross_attn.keys())
    """,
}


def run_script(body, setup_dir, upstream):  # noqa: F811
    """As the research harness, with upstream's notebook folder name on our side too."""
    original = research.PRELUDE
    research.PRELUDE = original.replace("sys.path[:0] = [impl, notebook]",
                                        "sys.path[:0] = [impl, notebook.replace('notebooks', 'notebook')]")
    try:
        return research.run_script(body, setup_dir, upstream)
    finally:
        research.PRELUDE = original


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_internals_give_meta_package_numbers(name, setup):  # noqa: F811
    meta = run_script(SCRIPTS[name], setup, upstream=True)
    ours = run_script(SCRIPTS[name], setup, upstream=False)
    assert sorted(meta) == sorted(ours), (sorted(meta), sorted(ours))
    for key in meta:
        same(meta[key], ours[key], key)
