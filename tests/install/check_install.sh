#!/usr/bin/env bash
# Installs the build into a scratch prefix, builds a consumer against it with
# find_package(smla), and runs it linked both ways.
set -euo pipefail
build=$1 src=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null
cmake -S "$src" -B "$work/consumer" -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$work/consumer" -j 2 >/dev/null
LD_LIBRARY_PATH="$work/prefix/lib" "$work/consumer/consumer_shared"
"$work/consumer/consumer_static"
