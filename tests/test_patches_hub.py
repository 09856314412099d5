"""The torch.hub DINOv2 stand-in (``patches/hub/dinov2``) picks its attention as DINOv2 does: SAM 3D's
``ATTN_BACKEND`` does not reach it. Upstream's pipeline sets ``ATTN_BACKEND=flash_attn`` on the GPUs it knows,
also where flash_attn is not installed (its own attention modules read the variable before that); the DINOv2
condition encoder must still run."""
import sys
import warnings

import pytest
import torch

import backends
from patches.hub_shim import LOCAL_REPOS

TINY = dict(img_size=28, embed_dim=32, depth=2, num_heads=2)


def _hub_model():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.hub.load(str(LOCAL_REPOS["facebookresearch/dinov2"]), "dinov2_vits14", source="local",
                              pretrained=False, **TINY).eval()


def test_hub_dinov2_ignores_sam3d_attention_variables(monkeypatch):
    if "flash_attn" in sys.modules or backends.registry.module_available("flash_attn"):
        pytest.skip("flash_attn is importable here: the variable names a backend that can run")
    torch.manual_seed(0)
    model = _hub_model()
    x = torch.randn(1, 3, 28, 28)
    with torch.no_grad():
        expected = model.forward_features(x)["x_norm_patchtokens"]
        monkeypatch.setenv("ATTN_BACKEND", "flash_attn")
        got = model.forward_features(x)["x_norm_patchtokens"]
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        # the project's own modules do follow the variable (here: an explicit error naming the fix)
        attention = next(m for m in model.modules() if hasattr(m, "attn_backend"))
        attention.attn_backend = None
        with pytest.raises(backends.BackendUnavailableError, match="flash_attn"):
            model.forward_features(x)
