"""postprocess_slat_output honours with_mesh_postprocess / with_texture_baking: upstream's to_glb (the post-processing
module, replaced here by a recording stand-in) gets the flags and upstream's arguments; both off = the raw mesh."""
import importlib
import sys
import types

import pytest
import torch

MODULE = "sam3d_objects.model.backbone.tdfy_dit.utils.postprocessing_utils"


@pytest.fixture
def to_glb_calls(monkeypatch):
    calls = []

    def to_glb(app_rep, mesh, **kwargs):
        calls.append((app_rep, mesh, kwargs))
        return "textured glb"

    try:
        module = importlib.import_module(MODULE)
    except ImportError:
        module = types.ModuleType(MODULE)
        monkeypatch.setitem(sys.modules, MODULE, module)
    monkeypatch.setattr(module, "to_glb", to_glb, raising=False)
    return calls


@pytest.fixture
def pipe():
    from sam3d_objects.pipeline.inference_pipeline import InferencePipeline
    p = object.__new__(InferencePipeline)
    p.device, p.stage_hook, p.stage_times, p.rendering_engine = torch.device("cpu"), None, {}, "pytorch3d"
    return p


def outputs():
    mesh = types.SimpleNamespace(vertices=torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.5]]),
                                 faces=torch.tensor([[0, 1, 2]]), vertex_attrs=torch.rand(3, 6))
    return {"mesh": [mesh], "gaussian": ["gs"], "gaussian_4": ["gs4"]}


@pytest.mark.parametrize("post, bake", [(True, True), (True, False), (False, True)])
def test_flags_reach_upstreams_to_glb(pipe, to_glb_calls, post, bake):
    out = pipe.postprocess_slat_output(outputs(), post, bake, False)
    assert out["glb"] == "textured glb" and out["gs"] == "gs" and out["gs_4"] == "gs4"
    app_rep, mesh, kwargs = to_glb_calls[0]
    assert app_rep == "gs" and mesh.faces.shape == (1, 3)
    assert kwargs["with_mesh_postprocess"] is post and kwargs["with_texture_baking"] is bake
    assert kwargs["simplify"] == 0.95 and kwargs["texture_size"] == 1024 and kwargs["use_vertex_color"] is False
    assert kwargs["rendering_engine"] == "pytorch3d"


def test_both_off_is_the_raw_y_up_mesh(pipe, to_glb_calls):
    out = pipe.postprocess_slat_output(outputs(), False, False, True)
    assert not to_glb_calls
    assert out["glb"].vertices.tolist()[2] == pytest.approx([0.0, 0.5, -1.0])  # (x, y, z) -> (x, z, -y)
    assert out["glb"].visual.vertex_colors.shape == (3, 4)


def test_no_mesh_gives_no_glb_and_baking_needs_gaussians(pipe, to_glb_calls):
    assert pipe.postprocess_slat_output({"gaussian": ["gs"]}, True, True, False)["glb"] is None
    with pytest.raises(ValueError, match="gaussian"):
        pipe.postprocess_slat_output({"mesh": outputs()["mesh"]}, False, True, False)
