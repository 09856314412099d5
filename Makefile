# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv on first use.
#
# torch is installed first and on its own: on a CPU-only Linux box a bare `torch` requirement pulls the
# multi-GB CUDA build. Here `torch==$(TORCH_VERSION)` resolves to the local CPU wheel; on macOS the normal wheel
# (with MPS) is taken; elsewhere pass TORCH_INDEX_URL=<a CPU or CUDA wheel index> to choose the build.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
TORCH_INDEX_URL ?=
STAMP := $(VENV)/.sam3d-installed
KEEP_TORCH := $(VENV)/keep-torch.txt
RUN := OMP_WAIT_POLICY=PASSIVE $(PY)

.PHONY: install extras demo test test-hydra-oldest test-slow test-browser browser-deps app bench bench-pipeline bench-render backends clean

install: $(STAMP)

$(STAMP): setup.py Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if $(PY) -c "import torch" 2>/dev/null; then \
		echo "torch already installed: $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif [ "$$(uname -s)" = "Darwin" ]; then \
		$(PY) -m pip install torch; \
	else \
		$(PY) -m pip install "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL),); \
	fi
	$(PY) -m sam3d_objects.extras constraints > $(KEEP_TORCH)
	$(PY) -m pip install -e ".[test]" -c $(KEEP_TORCH)
	@# Optional reference for the sparse-conv tests (CPU build, used with one thread only); fine if it fails.
	-$(PY) -m pip install "spconv==2.3.8" >/dev/null 2>&1 || echo "spconv not installed: its comparison tests will skip"
	@# Triton's CPU interpreter runs the CUDA conv kernel's parity tests; --no-deps keeps the CPU torch.
	-$(PY) -m pip install --no-deps "triton==3.9.0" >/dev/null 2>&1 || echo "triton not installed: its interpreter tests will skip"
	@# Meta's own package through patches (tests/test_patches_upstream*.py): the CUDA-free packages its modules import
	@# (setup.py's [upstream] extra; open3d's Linux wheel links libusb-1.0). Fine if it fails: those tests skip.
	-@if [ "$$(uname -s)" = Linux ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! ldconfig -p | grep -q libusb-1.0; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libusb-1.0-0) >/dev/null 2>&1; fi
	-$(PY) -m pip install -e ".[upstream]" -c $(KEEP_TORCH) >/dev/null 2>&1 && \
		$(PY) -m pip install --no-deps $$($(PY) -m sam3d_objects.extras no-deps upstream) >/dev/null 2>&1 || \
		echo "upstream extra not installed: the tests running Meta's package will skip"
	touch $@

# Optional parts: `make extras EXTRAS=hub,app,moge` (names: setup.py's EXTRAS). The torch (and torchvision) already
# in the environment are pinned through a generated constraints file, so no extra replaces them; packages whose
# declared requirements would pull a second torch stack are installed with --no-deps (setup.py's NO_DEPS).
EXTRAS ?= hub,app
extras: $(STAMP)
	$(PY) -m sam3d_objects.extras constraints > $(KEEP_TORCH)
	$(PY) -m pip install -e ".[$(EXTRAS)]" -c $(KEEP_TORCH)
	@nodeps="$$($(PY) -m sam3d_objects.extras no-deps $(EXTRAS))"; \
	if [ -n "$$nodeps" ]; then $(PY) -m pip install --no-deps $$nodeps; fi

app: $(STAMP)
	$(RUN) -m sam3d_objects.cli app

demo: $(STAMP)
	$(RUN) -m sam3d_objects.demo

# Two pytest-xdist workers: the suite is mostly subprocesses, small models and waits, so two processes keep a
# 2-core machine busy (6.4 min against 14.7 min in one process, 2026-11-27). TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(RUN) -m pytest -q -ra -m "not slow and not browser" -n $(TEST_WORKERS) tests

# The suite on this machine's accelerator (cuda / mps) as well as its CPU: every device-parametrised test runs on
# both, and the end lists what ran where (per-device pass / fail / skip). Results (junit, per-device summary,
# selfcheck table) go to DEVICE_OUT. Without make, or on a machine without network (a lent GPU):
# `bash benchmarks/run_device_suite.sh OUTDIR` with the interpreter's own packages.
DEVICE_OUT ?= outputs/device_suite
test-device: $(STAMP)
	PYTHON=$(PY) bash benchmarks/run_device_suite.sh $(DEVICE_OUT)

# The hostile-checkpoint and integrity suites again with the oldest hydra-core / omegaconf setup.py allows
# (installed into a folder of their own, put first on PYTHONPATH; the venv keeps its newer ones).
HYDRA_OLDEST ?= $(VENV)/hydra-oldest
test-hydra-oldest: $(STAMP)
	$(PY) -m pip install -q --no-deps --target $(HYDRA_OLDEST) hydra-core==1.3.2 omegaconf==2.3.0 \
		antlr4-python3-runtime==4.9.3
	PYTHONPATH=$(HYDRA_OLDEST) $(RUN) -c "import hydra, omegaconf; print('hydra-core', hydra.__version__, \
		'omegaconf', omegaconf.__version__)"
	PYTHONPATH=$(HYDRA_OLDEST) $(RUN) -m pytest -q -p no:cacheprovider tests/test_security_config.py \
		tests/test_security_checkpoint.py

# Slow or optional-package checks (e.g. third-party CUDA-era code through patches); not part of CI's `make test`.
test-slow: $(STAMP)
	$(RUN) -m pytest -q -ra -m "slow and not browser" tests

# The web app in a real headless Chromium (Debian's chromium + chromium-driver, installed here when missing; needs
# root or sudo for apt-get): upload the example, reconstruct with the tiny checkpoint, wait for the GLB viewer.
browser-deps: $(STAMP)
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; }
	$(PY) -m sam3d_objects.extras constraints > $(KEEP_TORCH)
	$(PY) -c "import selenium" 2>/dev/null || $(PY) -m pip install -q -e ".[browser]" -c $(KEEP_TORCH)

test-browser: browser-deps
	SAM3D_BROWSER_SCREENSHOT=outputs/browser/app.png $(RUN) -m pytest -q -ra -m browser tests/test_app_browser.py

bench: $(STAMP)
	$(RUN) -m benchmarks.bench_ops

# The speed table: pipeline per stage on CUDA and CPU (full-size random weights, built once into
# checkpoints/random_full), GPU busy fraction, kernel count, peak memory, CPU matmul rate, renderer.
BENCH_ARGS ?= --make-random checkpoints/random_full --runs 3
bench-pipeline: $(STAMP)
	$(RUN) benchmarks/bench_speed.py $(BENCH_ARGS)

bench-render: $(STAMP)
	$(RUN) benchmarks/bench_render.py

backends: $(STAMP)
	$(RUN) -m backends

clean:
	rm -rf $(VENV) outputs .pytest_cache
