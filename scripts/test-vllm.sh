#!/usr/bin/env bash
# make test-vllm: smla.vllm inside the pinned vLLM from PyPI, on the CPU (tests/vllm; docs/vllm.md).
#
# Installs vLLM (and the torch it pins, with its CUDA libraries: about 9 GiB installed) into its own virtual
# environment ($VLLM_VENV, default .venv-vllm), installs smla there (built in $BUILD-py, as make python-test builds
# it), builds a libcuda.so.1 stand-in (vLLM's compiled modules link the CUDA driver; tests/vllm/conftest.py says
# what is stubbed) and runs pytest tests/vllm with it on LD_LIBRARY_PATH. That build of smla has smla._torch_ops
# (built against vLLM's torch): the torch tests run there first.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION=0.33.0  # the tested release (smla/vllm/__init__.py: TESTED_VLLM)
BUILD=${BUILD:-build}
VENV=${VLLM_VENV:-.venv-vllm}
PIP_CONFIG=${PIP_CONFIG:-}

[[ -x "$VENV/bin/python" ]] || python3 -m venv "$VENV"
python="$VENV/bin/python"
pip=("$python" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore)
"${pip[@]}" "vllm==$VLLM_VERSION"
PYTHON="$python" bash scripts/install-deps.sh --python
# shellcheck disable=SC2086  # PIP_CONFIG holds several arguments
CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-$(nproc)} "${pip[@]}" --no-build-isolation . \
  --config-settings=build-dir="$BUILD-py" $PIP_CONFIG

# smla was just built against this environment's torch, so with smla._torch_ops (the C++ kernels of
# torch.ops.smla): its tests and the torch ones, on the CPU (before the driver stand-in below).
SMLA_REQUIRE_TORCH_OPS=1 "$python" -m pytest tests/python/test_torch_native.py tests/python/test_torch.py \
  tests/python/test_hostile_inputs.py -q -p no:cacheprovider -W ignore::DeprecationWarning

# The stand-in defines every cu* driver function that vLLM's compiled modules import, each returning
# CUDA_ERROR_NO_DEVICE (100); nothing in the tests calls them.
stub="$BUILD-vllm-stub"
mkdir -p "$stub"
site=$("$python" -c 'import os, vllm; print(os.path.dirname(vllm.__file__))')
find "$site" -name '*.so' -print0 |
  xargs -0 -n1 sh -c 'if readelf -d "$0" 2>/dev/null | grep -q "libcuda.so.1"; then nm -D --undefined-only "$0"; fi' |
  awk '{print $2}' | grep -E '^cu[A-Z]' | sort -u | sed 's/.*/int &(void) { return 100; }/' >"$stub/stub.c"
[[ -s "$stub/stub.c" ]] || { echo "test-vllm: found no CUDA driver functions in vLLM's modules" >&2; exit 1; }
cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$stub/libcuda.so.1" "$stub/stub.c"

export LD_LIBRARY_PATH="$PWD/$stub${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
"$python" -m pytest tests/vllm -q -p no:cacheprovider -W ignore::DeprecationWarning
