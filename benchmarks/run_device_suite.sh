#!/usr/bin/env bash
# The test suite on this machine's accelerator (CUDA or MPS) and its CPU, in one command, with nothing to download:
#
#   bash benchmarks/run_device_suite.sh [OUTDIR] [PART]
#
# OUTDIR (default $OUT, else device_suite): pytest.log, junit-<part>.xml, device_summary-<part>.json (what ran
# where: passed / failed / skipped per device), selfcheck.txt, missing.txt. PART: all (default), k/n to run
# every n-th test file starting at the k-th (e.g. 1/2 and 2/2 in two calls when one call has a time limit), or
# check (only list the packages this interpreter lacks).
# SAM3D_SUITE_FILES="tests/a.py tests/b.py::test_x" runs only those; SAM3D_SUITE_PYTEST_ARGS adds pytest
# arguments (e.g. "-n 8" with pytest-xdist on a many-core host).
#
# Reference data: SAM3D_SHARED_DIR if set, else .device/shared (a copy of ../shared carried inside the repo: at
# least .device/shared/golden, plus upstream_configs for the config tests; or packed as .device/shared.tar.xz:
#   mkdir -p .device && tar cf - -C ../shared golden upstream_configs | xz -T0 -6 > .device/shared.tar.xz
# ), else ../shared. Packages: the
# interpreter's own (python3, or $PYTHON); wheels put in .device/wheels/ are unpacked into .device/site first
# and put ahead on PYTHONPATH (no pip, no network).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUTDIR=${1:-${OUT:-device_suite}}
PART=${2:-all}
PY=${PYTHON:-python3}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE

# a packed copy (the golden data is ~63 MB, ~44 MB as .tar.xz: it fits the 64 MiB a lent machine receives)
if [ -f .device/shared.tar.xz ] && [ ! -d .device/shared/golden ]; then
  mkdir -p .device/shared && tar xJf .device/shared.tar.xz -C .device/shared
fi
if [ -z "${SAM3D_SHARED_DIR:-}" ]; then
  if [ -d .device/shared/golden ]; then export SAM3D_SHARED_DIR=$ROOT/.device/shared
  elif [ -d ../shared/golden ]; then export SAM3D_SHARED_DIR=$(cd ../shared && pwd)
  fi
fi
echo "reference data: ${SAM3D_SHARED_DIR:-none (golden tests will skip)}"

SITE=$ROOT/.device/site
if compgen -G ".device/wheels/*.whl" > /dev/null; then
  # a wheel is a zip laid out for site-packages: unpacked as is (no pip, no network, no dependencies)
  for wheel in .device/wheels/*.whl; do
    "$PY" -m zipfile -e "$wheel" "$SITE" || echo "could not unpack $wheel"
  done
fi
export PYTHONPATH=$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}

# what the suite needs and what this interpreter lacks (tests of optional packages skip on their own)
"$PY" - <<'PY' | tee "$OUTDIR/missing.txt"
import importlib
need = ["torch", "numpy", "pytest", "omegaconf", "hydra", "safetensors", "trimesh", "plyfile", "tqdm", "PIL",
        "yaml", "scipy"]
optional = ["imageio", "xatlas", "fast_simplification", "nbclient", "nbformat", "ipykernel", "spconv",
            "triton", "torchvision", "open3d", "psutil"]
missing = []
for name in need + optional:
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001
        missing.append(name)
        print(f"{'MISSING (required)' if name in need else 'absent (optional)'}: {name} ({type(e).__name__})")
import torch
acc = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else None
print(f"torch {torch.__version__}; accelerator: {acc or 'NONE'}"
      + (f" ({torch.cuda.get_device_name(0)})" if acc == "cuda" else ""))
if [n for n in missing if n in need]:
    print("required packages are missing: put their wheels in .device/wheels/ and run again")
PY
[ "$PART" = check ] && exit 0
grep -q "MISSING (required): pytest" "$OUTDIR/missing.txt" && exit 3

ACCEL=$("$PY" -c "import torch; print('cuda' if torch.cuda.is_available() else 'mps' if torch.backends.mps.is_available() else '')")
if [ -z "$ACCEL" ]; then
  echo "no accelerator (cuda / mps) on this machine: this is 'make test' (CPU only)"
fi
export SAM3D_TEST_DEVICES=${SAM3D_TEST_DEVICES:-cpu${ACCEL:+,$ACCEL}}

FILES=${SAM3D_SUITE_FILES:-$(ls tests/test_*.py | sort)}  # SAM3D_SUITE_FILES: a subset, e.g. to rerun failures
if [ "$PART" != all ]; then
  k=${PART%/*}; n=${PART#*/}
  FILES=$(echo "$FILES" | awk -v k="$k" -v n="$n" '(NR - k) % n == 0')
fi
TAG=${PART//\//of}
export SAM3D_TEST_SUMMARY=$OUTDIR/device_summary-$TAG.json
echo "devices: $SAM3D_TEST_DEVICES; part $PART ($(echo $FILES | wc -w) files)"
# shellcheck disable=SC2086
"$PY" -m pytest -q -ra -m "not slow" -p no:cacheprovider --junitxml="$OUTDIR/junit-$TAG.xml" \
  ${SAM3D_SUITE_PYTEST_ARGS:-} $FILES \
  2>&1 | tee "$OUTDIR/pytest-$TAG.log" | tail -n 60
status=${PIPESTATUS[0]}
if [ "$PART" = all ] || [ "${PART%/*}" = 1 ]; then
  if [ -n "$ACCEL" ]; then
    "$PY" -m backends.selfcheck --device "$ACCEL" --quick > "$OUTDIR/selfcheck.txt" 2>&1
    echo "selfcheck --device $ACCEL --quick: exit $? (table in $OUTDIR/selfcheck.txt)"
  fi
fi
echo "pytest exit $status"
exit "$status"
