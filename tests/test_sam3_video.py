"""SAM 3's video predictor (`pip` package sam3, unmodified, full-size random weights) on the CPU through
`patches.apply()` alone: `build_sam3_video_predictor()` is built, then a text prompt and a point prompt are
propagated through a short generated clip by `sam3d_objects.segment_video` (the code behind
`sam3d-objects segment CLIP --video`), masks written per frame.

Checks: every SAM 3 fix-up of patches.sam3_video was applied; no autocast is left switched on in the process after
the predictor is built (SAM 3's tracker enters a CUDA bfloat16 autocast in its constructor); the parameters stay
float32; each prompt yields one tracks.json entry per frame, masks of the frame's size; the point prompt's object
is id 1. With random weights the masks are noise (a text prompt detects nothing: its scores underflow to 0).

Needs `make extras EXTRAS=sam3`. Slow (full-size model, 1008 x 1008 per frame, on 2 shared CPU cores): see the
README's SAM 3 section for measured times. Run: `python -m pytest -q -s -m slow tests/test_sam3_video.py`.
"""
import importlib.util
import json
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow

FRAMES = 2
SCRIPT = """
import json, sys, time
sys.path.insert(0, {root!r})
import numpy as np, torch
from PIL import Image
from sam3d_objects import segment_video as sv

clip = {clip!r}
for k in range({frames}):
    a = np.full((48, 64, 3), 25, np.uint8)
    a[12:30, 8 + 6 * k:30 + 6 * k] = (230, 200, 40)
    Image.fromarray(a).save(f"{{clip}}/{{k:05d}}.png")
torch.manual_seed(0)
t0 = time.perf_counter()
predictor = sv.build_video_predictor()
build = time.perf_counter() - t0
import patches
state = dict(fixups=patches.fixup_status(), autocast_cpu=torch.is_autocast_enabled("cpu"),
             dtypes=sorted({{str(p.dtype) for p in predictor.model.parameters()}}),
             device=str(next(predictor.model.parameters()).device), build=build)
for name, kwargs in (("text", dict(text="yellow box")), ("points", dict(points="19,21"))):
    summary = sv.segment_video(clip, f"{{clip}}_{{name}}", predictor=predictor, **kwargs)
    tracks = json.loads(open(f"{{clip}}_{{name}}/tracks.json").read())
    state[name] = dict(frames=[f["frame"] for f in tracks["frames"]], ids=summary.objects, masks=summary.masks,
                       prompt=summary.seconds_prompt, propagate=summary.seconds_propagate, size=[tracks["width"],
                       tracks["height"]])
state["autocast_cpu_after"] = torch.is_autocast_enabled("cpu")
print(json.dumps(state))
"""


def _missing() -> str:
    for name in ("sam3", "torchvision", "timm", "einops", "ftfy", "regex", "iopath", "pycocotools", "scipy",
                 "psutil"):
        if importlib.util.find_spec(name) is None:
            return f"{name} is not installed (make extras EXTRAS=sam3)"
    return ""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    clip = tmp_path_factory.mktemp("sam3_video") / "clip"
    clip.mkdir()
    code = SCRIPT.format(root=str(ROOT), clip=str(clip), frames=FRAMES)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"\nSAM 3 video predictor (CPU, full size, random weights): build {out['build']:.1f} s; "
          + "; ".join(f"{p}: prompt {out[p]['prompt']:.1f} s, propagation {out[p]['propagate']:.1f} s for "
                      f"{FRAMES} frames" for p in ("text", "points")))
    return clip, out


@pytest.mark.skipif(bool(_missing()), reason=_missing() or "ok")
def test_video_predictor_builds_with_every_fixup_and_no_autocast_leak(run):
    _, out = run
    sam3_fixups = {n: s for n, s in out["fixups"].items() if n.startswith("sam3_")}
    assert len(sam3_fixups) == 7 and all(s.startswith("applied") for s in sam3_fixups.values()), sam3_fixups
    assert out["autocast_cpu"] is False and out["autocast_cpu_after"] is False
    assert out["dtypes"] == ["torch.float32"] and out["device"] in ("cpu", "mps")


@pytest.mark.skipif(bool(_missing()), reason=_missing() or "ok")
@pytest.mark.parametrize("prompt", ["text", "points"])
def test_prompt_propagates_through_every_frame(run, prompt):
    clip, out = run
    result = out[prompt]
    assert sorted(set(result["frames"])) == list(range(FRAMES)) and result["size"] == [64, 48]
    if prompt == "points":
        assert set(result["ids"]) <= {1}
    for png in (clip.parent / f"clip_{prompt}" / "masks").rglob("*.png"):
        from PIL import Image

        assert Image.open(png).size == (64, 48)
