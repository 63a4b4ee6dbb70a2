#!/usr/bin/env bash
# Copies the header-only and static build dependencies (DLPack, nlohmann-json,
# CLI11, GoogleTest) from this Debian machine into DIR/usr, so smla can be
# configured on a GPU machine that has CUDA and CMake but cannot install
# packages: cmake -DCMAKE_PREFIX_PATH=$PWD/DIR/usr ...  (see docs/gpu-testing.md)
set -euo pipefail
dir=${1:-.devdeps}
bash "$(dirname "$0")/install-deps.sh"
rm -rf "$dir"
mkdir -p "$dir/usr/include" "$dir/usr/lib/x86_64-linux-gnu/cmake" "$dir/usr/share/cmake"
cp -r /usr/include/dlpack /usr/include/nlohmann /usr/include/CLI /usr/include/gtest /usr/include/gmock "$dir/usr/include/"
cp -r /usr/lib/x86_64-linux-gnu/cmake/dlpack /usr/lib/x86_64-linux-gnu/cmake/GTest "$dir/usr/lib/x86_64-linux-gnu/cmake/"
cp /usr/lib/x86_64-linux-gnu/libgtest*.a /usr/lib/x86_64-linux-gnu/libgmock*.a "$dir/usr/lib/x86_64-linux-gnu/"
cp -r /usr/share/cmake/nlohmann_json /usr/share/cmake/CLI11 "$dir/usr/share/cmake/"
du -sh "$dir"
