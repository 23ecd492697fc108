# Spotlight Chat: `make run` starts the app, `make test` runs the whole suite.
# Both create .venv and install everything the project needs from its own files.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
HOST ?= 127.0.0.1
PORT ?= 7860
PYTEST_ARGS ?=

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export GRADIO_ANALYTICS_ENABLED := False
export TOKENIZERS_PARALLELISM := false

.PHONY: setup run test bench bench-quick bench-deps clean-venv help

help:
	@echo "make run     set up .venv and start the app on http://$(HOST):$(PORT)"
	@echo "make test    set up .venv and run the whole test suite"
	@echo "make bench   run every benchmark and rewrite docs/RESULTS.md (bench-quick: --quick)"
	@echo "make bench-deps  optional: build llama-cpp-python from source for the llama.cpp comparison"

$(STAMP): requirements.txt requirements-nodeps.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -r requirements-nodeps.txt
	@# Debian's Chromium for the browser tests (never `playwright install`: it downloads browsers).
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium) || echo "no chromium: browser tests will skip"
	touch $(STAMP)

# The quantized decode kernels (kernels/quant.c). Optional: without a compiler, or when the build
# fails, setup goes on and kernels/quant.py uses its numba kernels. -ffp-contract=off keeps each
# dequantised weight rounded as gguf rounds it (no fused multiply-add inside the weight).
QUANT_SO := kernels/_quant.so

$(QUANT_SO): kernels/quant.c
	cc -O3 -march=native -ffp-contract=off -shared -fPIC -o $@ kernels/quant.c || echo "kernels/quant.c not built: the numba kernels will be used"

setup: $(STAMP) $(QUANT_SO)

run: setup
	$(PY) app.py --host $(HOST) --port $(PORT)

test: setup
	@# The import contracts (.importlinter) first: a layering break fails fast, before the suite.
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest $(PYTEST_ARGS)

bench: setup
	$(PY) -m bench.all

bench-quick: setup
	$(PY) -m bench.all --quick

bench-deps: setup
	CMAKE_ARGS="-DGGML_NATIVE=ON" $(PY) -m pip install --no-binary llama-cpp-python llama-cpp-python==0.3.36

clean-venv:
	rm -rf $(VENV)
