#!/usr/bin/env bash
# The CUDA numbers of README's "Measured" section in one go (run on a CUDA machine from the repo root, with the
# package's dependencies importable and ../shared/golden/manifests + ../shared/upstream_configs present).
#   bash benchmarks/gpu_report.sh OUTDIR [part]     part: all (default), speed, outputs
set -uo pipefail
OUT=${1:-gpu_report}; PART=${2:-all}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
RAND=/tmp/sam3d_random_full
if [ "$PART" = all ] || [ "$PART" = speed ]; then
  python -m backends.selfcheck --device cuda > "$OUT/selfcheck.txt" 2>&1; echo "selfcheck exit $?"
  python benchmarks/bench_speed.py --make-random "$RAND" --devices cuda --runs 3 > "$OUT/bench_speed.txt" 2>&1
  echo "bench_speed exit $?"
fi
if [ "$PART" = all ] || [ "$PART" = outputs ]; then
  [ -f "$RAND/pipeline.yaml" ] || python -m sam3d_objects.tools.make_random_checkpoint \
      --manifests ../shared/golden/manifests --out "$RAND" > /dev/null
  python - <<'PY'
import numpy as np
from PIL import Image
from sam3d_objects.assets.example import example_pointmap
np.save("/tmp/example_pointmap.npy", example_pointmap())
PY
  EX=sam3d_objects/assets/example
  for mode in default fast; do
    extra=""; [ $mode = fast ] && extra="--fast"
    python -m sam3d_objects.cli reconstruct $EX/image.png --mask $EX/0.png --pointmap /tmp/example_pointmap.npy \
        --checkpoints "$RAND" --device cuda --no-progress --out "/tmp/run_$mode" $extra > "$OUT/reconstruct_$mode.txt" 2>&1
    echo "reconstruct $mode exit $?"
    cp "/tmp/run_$mode/summary.json" "$OUT/summary_$mode.json" 2>/dev/null
  done
  python benchmarks/bench_postprocess.py --run-dir /tmp/run_default --device cuda --out "$OUT/post" \
      --json "$OUT/postprocess.json" > "$OUT/postprocess.txt" 2>&1
  echo "bench_postprocess exit $?"
fi
