"""SAM 3 (Meta's segmentation model, `pip install sam3`), unmodified, on a CPU-only torch through
`patches.apply()` alone: the image model is built with random weights, then `Sam3Processor.set_image`, a text
prompt and a box prompt produce outputs of the documented shapes.

Needs `sam3` and its light dependencies (`make extras EXTRAS=sam3`), torchvision (a CUDA build whose extension does
not load is fine: the torchvision shim repairs it) and CLIP's BPE vocabulary (shipped by open-clip-torch). Slow:
building the model and `set_image` at 1008 x 1008 take minutes on 2 CPU cores (measured: build 34 s, set_image
171 s, whole test 366 s with OMP_NUM_THREADS=2 on a shared 2-core box). Run:
`OMP_NUM_THREADS=2 python -m pytest -q -s -m slow tests/test_patches_sam3.py` (or `make test-slow`).
"""
import importlib.util
import json
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow

SCRIPT = """
import json, sys, time
sys.path.insert(0, {root!r})
import patches
state = patches.apply()
import numpy as np, torch
from PIL import Image
from sam3.model_builder import build_sam3_image_model
from sam3.model.sam3_image_processor import Sam3Processor
from sam3d_objects.segment import fill_uninitialised_parameters, find_bpe_vocabulary

torch.manual_seed(0)
t0 = time.time()
model = build_sam3_image_model(checkpoint_path=None, load_from_HF=False, bpe_path=str(find_bpe_vocabulary()))
t_build = time.time() - t0
# SAM 3 creates a few parameters with torch.empty and fills them only from a checkpoint (the text encoder's
# projection and positional embedding): random-weight plumbing gives them small random values, as a checkpoint would
# give them finite ones. Nothing else is touched.
uninitialised = fill_uninitialised_parameters(model)
# random weights: keep every query (their probabilities can underflow to exactly 0, so the threshold is below 0)
processor = Sam3Processor(model, confidence_threshold=-1.0)
image = Image.fromarray((np.random.default_rng(0).random((48, 64, 3)) * 255).astype(np.uint8))
t0 = time.time()
inference_state = processor.set_image(image)
t_image = time.time() - t0
out = processor.set_text_prompt(prompt="chair", state=inference_state)
with torch.inference_mode():  # the unfiltered outputs, to check every query is finite and kept
    raw = model.forward_grounding(backbone_out=inference_state["backbone_out"], find_input=processor.find_stage,
                                  geometric_prompt=inference_state["geometric_prompt"], find_target=None)
raw = {{k: [list(raw[k].shape), bool(torch.isfinite(raw[k]).all())] for k in ("pred_logits", "pred_boxes",
                                                                            "pred_masks")}}
text = {{k: list(out[k].shape) for k in ("masks", "masks_logits", "boxes", "scores")}}
text_dtypes = {{k: str(out[k].dtype) for k in ("masks", "boxes", "scores")}}
processor.reset_all_prompts(inference_state)
out = processor.add_geometric_prompt(box=[0.5, 0.5, 0.4, 0.6], label=True, state=inference_state)
box = {{k: list(out[k].shape) for k in ("masks", "masks_logits", "boxes", "scores")}}
device = str(next(model.parameters()).device)
print(json.dumps(dict(state=state, uninitialised=uninitialised, raw=raw, text=text, text_dtypes=text_dtypes, box=box, device=device,
                      t_build=t_build, t_image=t_image)))
"""


def _missing() -> str:
    for name in ("sam3", "torchvision", "timm", "einops", "ftfy", "regex", "iopath", "pycocotools"):
        if importlib.util.find_spec(name) is None:
            return f"{name} is not installed (make extras EXTRAS=sam3)"
    return ""


@pytest.mark.skipif(bool(_missing()), reason=_missing() or "ok")
def test_sam3_image_predictor_runs_unmodified_on_cpu():
    code = SCRIPT.format(root=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["state"]["cuda_device"] == "shim" and out["device"] in ("cpu", "mps")
    print(out["raw"], out["uninitialised"])
    queries = out["raw"]["pred_logits"][0][1]
    assert out["raw"]["pred_logits"][0][:2] == [1, queries] and out["raw"]["pred_boxes"][0] == [1, queries, 4]
    assert all(finite for _, finite in out["raw"].values())
    for result in (out["text"], out["box"]):
        n = result["scores"][0]
        assert n == queries  # confidence threshold below 0: every query is kept
        assert result["masks"] == [n, 1, 48, 64] and result["masks_logits"] == [n, 1, 48, 64]
        assert result["boxes"] == [n, 4]
    assert out["text_dtypes"] == {"masks": "torch.bool", "boxes": "torch.float32", "scores": "torch.float32"}
    print(f"SAM 3 build {out['t_build']:.1f} s, set_image {out['t_image']:.1f} s")
