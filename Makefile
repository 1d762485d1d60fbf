# Everything sets itself up: a virtual environment in .venv with the package installed
# in editable mode (which compiles the C parts) and the test dependencies.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
C_SOURCES := $(shell find csrc shim -name '*.[ch]' 2>/dev/null)

.PHONY: venv build test demo bench clean wheel image

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py tools/build_c.py src/vgpu/_region_build.py $(C_SOURCES)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip setuptools wheel cffi
	$(BIN)/pip install --quiet --no-build-isolation -e '.[test]'
	touch $@

build: venv

test: venv
	$(BIN)/python -m pytest tests -q

demo: venv
	$(BIN)/python examples/demo.py

bench: venv
	$(BIN)/python -m pytest bench -q -s -p no:cacheprovider --benchmark-json=bench/last-run.json --benchmark-columns=median

# The node agent image's build steps (tools/image/, run by the Dockerfile and by
# tests/test_image_steps.py).  `wheel` needs no Docker; `image` needs a Docker engine.
IMAGE ?= vgpu:0.1.0

wheel: venv
	VGPU_BUILD_ISOLATION=0 PYTHON=$(BIN)/python tools/image/build-wheel.sh . dist

image:
	docker build -t $(IMAGE) .

clean:
	rm -rf $(VENV) build src/vgpu/_lib src/vgpu/_region*.so src/*.egg-info
