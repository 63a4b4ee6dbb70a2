#!/usr/bin/env bash
# Copies the header-only and static build dependencies (DLPack, nlohmann-json,
# CLI11, GoogleTest) and OpenBLAS (the layer's CPU GEMMs: its header, the
# shared library and the Fortran runtime it needs) from this Debian machine
# into DIR/usr, so smla can be configured on a GPU machine that has CUDA and
# CMake but cannot install packages: cmake -DCMAKE_PREFIX_PATH=$PWD/DIR/usr ...
# with LD_LIBRARY_PATH=$PWD/DIR/usr/lib/x86_64-linux-gnu (scripts/gpu-check.sh
# does both; see docs/gpu-testing.md)
set -euo pipefail
dir=${1:-.devdeps}
bash "$(dirname "$0")/install-deps.sh"
rm -rf "$dir"
mkdir -p "$dir/usr/include" "$dir/usr/lib/x86_64-linux-gnu/cmake" "$dir/usr/share/cmake"
cp -r /usr/include/dlpack /usr/include/nlohmann /usr/include/CLI /usr/include/gtest /usr/include/gmock "$dir/usr/include/"
cp -r /usr/lib/x86_64-linux-gnu/cmake/dlpack /usr/lib/x86_64-linux-gnu/cmake/GTest "$dir/usr/lib/x86_64-linux-gnu/cmake/"
cp /usr/lib/x86_64-linux-gnu/libgtest*.a /usr/lib/x86_64-linux-gnu/libgmock*.a "$dir/usr/lib/x86_64-linux-gnu/"
cp -r /usr/share/cmake/nlohmann_json /usr/share/cmake/CLI11 "$dir/usr/share/cmake/"
blas=/usr/include/x86_64-linux-gnu/openblas-pthread
cp "$blas/cblas.h" "$blas/openblas_config.h" "$dir/usr/include/"
lib="$dir/usr/lib/x86_64-linux-gnu"
cp -L /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 /usr/lib/x86_64-linux-gnu/libgfortran.so.5 \
  /usr/lib/x86_64-linux-gnu/libquadmath.so.0 "$lib/"
ln -sf libopenblas.so.0 "$lib/libopenblas.so"
du -sh "$dir"
