# Everything sets itself up: a virtual environment in .venv with the package installed in
# editable mode (which compiles the C parts), in two steps, each done once:
#   .venv/.demo  the package and the demo's extra (cuda-bindings): what `make demo` needs
#   .venv/.test  the test extra on top (Triton, NVVM, the kubernetes client, ...): `make test`
# The package is built without build isolation (its build needs only setuptools, wheel and
# cffi, installed first), so every sdist pulled in is built in this venv too and its build
# dependencies must be here: gpustat 1.1.1 is published only as an sdist and its build
# needs setuptools_scm.  The BUILD_TOOLS line is where such a need goes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install --disable-pip-version-check --progress-bar off --quiet
BUILD_TOOLS := pip setuptools wheel cffi setuptools_scm
C_SOURCES := $(shell find csrc shim simgpu -name '*.[ch]' 2>/dev/null)
INSTALL_INPUTS := pyproject.toml setup.py tools/build_c.py src/vgpu/_region_build.py $(C_SOURCES)
# a line per step while it installs, and the seconds the step took
STEP = @echo "vgpu set-up: $(1)"

.PHONY: venv build test test-serial demo bench clean wheel image

venv: $(VENV)/.demo

$(VENV)/.tools:
	$(call STEP,virtual environment in $(VENV) and build tools ($(BUILD_TOOLS)))
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(PIP) --upgrade $(BUILD_TOOLS)
	@touch $@

$(VENV)/.demo: $(VENV)/.tools $(INSTALL_INPUTS)
	$(call STEP,vgpu (editable; compiles the shim and simgpu) with the demo's dependencies)
	@start=$$(date +%s); $(PIP) --no-build-isolation -e '.[demo]' && \
	  echo "vgpu set-up: done in $$(( $$(date +%s) - start )) s"
	@touch $@

$(VENV)/.test: $(VENV)/.demo
	$(call STEP,the test dependencies (about 2 GB: Triton, NVVM/NVRTC, numba-cuda, the kubernetes client))
	@start=$$(date +%s); $(PIP) --no-build-isolation -e '.[test]' && \
	  echo "vgpu set-up: done in $$(( $$(date +%s) - start )) s"
	@touch $@

build: venv

# Two pytest runs: the tests that measure no time side by side (4 workers: they mostly
# wait on child processes, so 4 keep 2 cores busy; a module stays on one worker, its
# module-scoped fixtures made once), then those marked `timing` (shares, latencies) alone.
test: $(VENV)/.test
	$(BIN)/python -m pytest tests -q -n 4 --dist loadscope -m 'not timing'
	$(BIN)/python -m pytest tests -q -m timing

# the same tests in one process, one at a time (for debugging)
test-serial: $(VENV)/.test
	$(BIN)/python -m pytest tests -q

demo: venv
	$(BIN)/python examples/demo.py

bench: $(VENV)/.test
	$(BIN)/python bench/figures.py --write
	$(BIN)/python -m pytest bench -q -s -p no:cacheprovider --benchmark-json=bench/last-run.json --benchmark-columns=median

# The node agent image's build steps (tools/image/, run by the Dockerfile and by
# tests/deploy/test_image_steps.py).  `wheel` needs no Docker; `image` needs a Docker engine.
IMAGE ?= vgpu:0.1.0

wheel: venv
	VGPU_BUILD_ISOLATION=0 PYTHON=$(BIN)/python tools/image/build-wheel.sh . dist

image:
	docker build -t $(IMAGE) .

clean:
	rm -rf $(VENV) build src/vgpu/_lib src/vgpu/_region*.so src/*.egg-info
