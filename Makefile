# Entry points. `make run` and `make test` each install what is missing,
# build, and run; see README.md.
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=

.PHONY: run test python-test test-asan test-gpu deps build install clean

# Debian packages, and the Python packages the tests and fixtures use.
deps:
	bash scripts/install-deps.sh --python

# The Python the tests and the Python package use (scripts/python.sh: a virtual environment in .venv where python3
# is Debian's own). Expanded only where a recipe uses it, after `deps` has installed python3.
PYTHON ?= $(shell bash scripts/python.sh)

$(BUILD)/CMakeCache.txt: | deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release -DSMLA_PYTHON=$(PYTHON) $(CMAKE_FLAGS)

build: deps $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

# The main job.
run: build
	$(BUILD)/tools/smla/smla run

# Every CPU test: the C++ tests, then the Python package's.
test: build
	ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS) -LE gpu
	$(MAKE) --no-print-directory python-test

# The Python package: `pip install .` into $(PYTHON) (with the CUDA kernels when nvcc is found;
# built in $(BUILD)-py so that a re-run is incremental), then its tests (the GPU ones skip
# without a GPU). PIP_CONFIG passes more, e.g. --config-settings=cmake.define.SMLA_CUDA=OFF.
PIP_CONFIG ?=
python-test: deps
	PYTHON=$(PYTHON) bash scripts/install-deps.sh --python
	CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) $(PYTHON) -m pip install --no-build-isolation --disable-pip-version-check \
	  --root-user-action=ignore . --config-settings=build-dir=$(BUILD)-py $(PIP_CONFIG)
	$(PYTHON) -m pytest tests/python -q

# The GPU tests: gpu.all on any NVIDIA GPU of compute capability >= 8.0, and gpu.emulated.sm_80/86/89/100/120 where
# the GPU can stand in for the arch (src/cuda/emulation.cpp): all five on an H100, H200 or B200; elsewhere ctest
# reports the entries of the archs it cannot stand in for as skipped, with the reason (e.g. an A100 lacks sm_89's and
# sm_120's e4m3 mma.sync and sm_100's 227 KB a block, a 99 KB GPU sm_80's 163 KB). docs/gpu-testing.md lists them.
test-gpu: build
	ctest --test-dir $(BUILD) --output-on-failure -L gpu

# The CPU tests under AddressSanitizer and UndefinedBehaviorSanitizer (CUDA off: nothing to run it on).
test-asan: deps
	cmake -S . -B $(BUILD)-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSMLA_SANITIZE=ON -DSMLA_CUDA=OFF -DSMLA_BUILD_BENCH=OFF \
	  -DSMLA_PYTHON=$(PYTHON)
	cmake --build $(BUILD)-asan -j $(JOBS)
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ctest --test-dir $(BUILD)-asan --output-on-failure -j $(JOBS)

# The libFuzzer targets (GGUF and config.json readers) under ASan + UBSan, FUZZ_SECONDS (60) each, in $(BUILD)-fuzz.
.PHONY: fuzz-smoke
fuzz-smoke: deps
	BUILD=$(BUILD) bash scripts/fuzz-smoke.sh

# MlaLayer against transformers' own attention modules (deepseek_v3, deepseek_v32, glm_moe_dsa); installs torch and
# transformers from PyPI into $(PYTHON) (scripts/install-deps.sh --layer). docs/layer.md says more.
.PHONY: test-layer
test-layer: build
	PYTHON=$(PYTHON) bash scripts/install-deps.sh --layer
	SMLA_LAYER_DRIVER=$(BUILD)/tests/cpu/layer_driver $(PYTHON) -m pytest tests/layer -q

# smla.vllm inside the pinned vLLM (PyPI) on the CPU: its own virtual environment (VLLM_VENV, default .venv-vllm;
# vLLM and its torch take about 9 GiB), smla built in $(BUILD)-py; scripts/test-vllm.sh, docs/vllm.md.
.PHONY: test-vllm
test-vllm: deps
	BUILD=$(BUILD) JOBS=$(JOBS) PIP_CONFIG='$(PIP_CONFIG)' bash scripts/test-vllm.sh

PREFIX ?= /usr/local
install: build
	cmake --install $(BUILD) --prefix $(PREFIX)

clean:
	rm -rf $(BUILD) $(BUILD)-asan $(BUILD)-py $(BUILD)-fuzz $(BUILD)-vllm-stub
