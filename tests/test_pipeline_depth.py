"""Depth model adapter: a caller point map skips it; MoGe output is turned into the PyTorch3D frame."""
import numpy as np
import pytest
import torch

from sam3d_objects.pipeline.depth_models.moge import MoGe


class FakeMoGeNet(torch.nn.Module):
    """Stands in for moge.model.v1.MoGeModel: a plane at depth 2 (OpenCV frame), left column invalid."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def infer(self, image, force_projection=False):
        self.calls += 1
        _, h, w = image.shape
        v, u = torch.meshgrid(torch.arange(h) + 0.5, torch.arange(w) + 0.5, indexing="ij")
        pts = torch.stack([(u - w / 2) / w, (v - h / 2) / w, torch.full_like(u, 2.0)], -1) * 2.0
        mask = torch.ones(h, w, dtype=torch.bool)
        mask[:, 0] = False
        return {"points": pts, "mask": mask, "intrinsics": torch.eye(3)}


def test_adapter_flips_to_pytorch3d_frame_and_masks():
    net = FakeMoGeNet()
    out = MoGe(net, device="cpu")(np.zeros((6, 8, 3), np.uint8))
    ref = net.infer(torch.zeros(3, 6, 8))["points"]
    pm = out["pointmap"]
    assert torch.isnan(pm[:, 0]).all()
    assert torch.allclose(pm[:, 1:, :2], -ref[:, 1:, :2]) and torch.allclose(pm[:, 1:, 2], ref[:, 1:, 2])


def test_pipeline_uses_depth_model_only_without_pointmap():
    from sam3d_objects.pipeline.inference_pipeline_pointmap import InferencePipelinePointMap
    pipe = object.__new__(InferencePipelinePointMap)
    pipe.device, pipe.dtype, pipe.clip_pointmap_beyond_scale = torch.device("cpu"), torch.float32, None
    net = FakeMoGeNet()
    pipe.depth_model = MoGe(net, device="cpu")
    image = np.zeros((6, 8, 4), np.uint8)
    out = pipe.compute_pointmap(image)
    assert net.calls == 1 and out["pointmap"].shape == (3, 6, 8)
    given = torch.ones(6, 8, 3)
    out = pipe.compute_pointmap(image, given)
    assert net.calls == 1 and torch.equal(out["pointmap"], given.permute(2, 0, 1))
    pipe.depth_model = None
    with pytest.raises(ValueError, match="pass pointmap=.*depth model"):
        pipe.compute_pointmap(image)


def test_missing_moge_package_names_both_options():
    cfg = {"_target_": "moge.model.v1.MoGeModel.from_pretrained", "pretrained_model_name_or_path": "x"}
    try:
        import moge  # noqa: F401
        pytest.skip("moge is installed here")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="moge.*pointmap="):
        MoGe(cfg, device="cpu")(np.zeros((4, 4, 3), np.uint8))
