#!/usr/bin/env bash
# Installs what smla builds with, from Debian's packages (and, with --python
# or --layer, Python packages from PyPI). Idempotent: installs only what is
# missing.
set -euo pipefail

# Debian packages: what every build needs, plus clang and libFuzzer with --fuzz.
packages=(cmake make g++ libdlpack-dev nlohmann-json3-dev libcli11-dev googletest libgtest-dev libbenchmark-dev
          libopenblas-dev python3 python3-venv)
[[ " $* " == *" --fuzz "* ]] && packages+=(clang libclang-rt-dev libomp-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "smla: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The Python packages go into the interpreter scripts/python.sh picks ($PYTHON if set; a virtual environment in
# .venv where python3 is Debian's own, which takes no pip installs).
python=$(bash "$(dirname "$0")/python.sh")
# --python: what the Python package builds and tests with (pip install . / make python-test) and what the GGUF /
# safetensors test fixtures (tests/models/make_fixtures.py) are written with.
if [[ " $* " == *" --python "* ]]; then
  "$python" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
    "scikit-build-core>=0.10" "nanobind>=2.4" "numpy>=1.22" "pytest>=7.0" "ml_dtypes>=0.2" "gguf>=0.10" "safetensors>=0.4"
fi
# --layer: torch and transformers for tests/layer (make test-layer), into $PYTHON. PyPI's torch is large (with its
# CUDA libraries about 5 GiB installed; about 2 minutes here).
if [[ " $* " == *" --layer "* ]]; then
  "$python" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
    torch "transformers>=5.2" safetensors numpy "pytest>=7.0"
fi
