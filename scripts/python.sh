#!/usr/bin/env bash
# Prints the Python that the tests, the fixture script and the Python package use: $PYTHON if set; else python3
# where it takes pip installs (a virtual environment, or an interpreter that is not externally managed, such as
# pyenv's); else a virtual environment in .venv, made on first use (Debian's own python3 refuses pip installs,
# PEP 668). scripts/install-deps.sh installs python3 and its venv module.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then
  echo "$PYTHON"
  exit
fi
managed=$(python3 -c 'import os, sys, sysconfig
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
print(int(sys.prefix == sys.base_prefix and os.path.exists(marker)))')
if [ "$managed" = 0 ]; then
  echo python3
  exit
fi
[ -x .venv/bin/python ] || python3 -m venv .venv >&2
echo "$PWD/.venv/bin/python"
