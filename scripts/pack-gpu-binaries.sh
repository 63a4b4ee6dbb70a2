#!/usr/bin/env bash
# Builds test_gpu, bench_cuda and the smla tool on this (CPU) machine and packs them, with the OpenBLAS runtime they
# link, into one archive that a GPU machine runs as it is: no build there, so a device call spends its time on the
# GPU (the build there took ~100 s of a 30-minute session). docs/gpu-testing.md, "Binaries built here".
#
#   scripts/pack-gpu-binaries.sh BUILD ARCHIVE     e.g. build-hb .gpu/new.tgz
#
# BUILD: a build directory configured for the GPU's arch (for the H200: -DCMAKE_CUDA_ARCHITECTURES=90a-real, see
# docs/gpu-testing.md); it is built first. The archive holds one folder named as the archive (new/ for new.tgz), so
# two builds' archives unpack side by side (scripts/bench-ab.sh). On the GPU machine, from the repository root:
#   tar xzf .gpu/new.tgz -C .gpu && LD_LIBRARY_PATH=.gpu/new/lib .gpu/new/test_gpu
set -euo pipefail
[[ $# -eq 2 ]] || { echo "usage: $0 BUILD ARCHIVE" >&2; exit 2; }
build=$1
archive=$(realpath -m "$2")
name=$(basename "$archive" .tgz)
[[ "$name" =~ ^[A-Za-z0-9_.-]+$ && "$archive" == *.tgz ]] ||
  { echo "$0: ARCHIVE must be NAME.tgz, NAME of letters, digits, '.', '_' or '-'" >&2; exit 2; }
[[ -f "$build/CMakeCache.txt" ]] || { echo "$0: $build is not a configured build directory" >&2; exit 1; }
archs=$(sed -n 's/^CMAKE_CUDA_ARCHITECTURES:[A-Z]*=//p' "$build/CMakeCache.txt")
[[ -n "$archs" ]] || { echo "$0: $build was configured without CUDA (no CUDA compiler found, or SMLA_CUDA=OFF)" >&2; exit 1; }
echo "packing the binaries of $build, CUDA architectures $archs"
cmake --build "$build" -j "$(nproc)" --target test_gpu bench_cuda smla_cli

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
dir="$stage/$name"
mkdir -p "$dir/lib"
strip -o "$dir/test_gpu" "$build/tests/gpu/test_gpu"
strip -o "$dir/bench_cuda" "$build/bench/bench_cuda"
strip -o "$dir/smla" "$build/tools/smla/smla"  # smla run on the GPU (the main job)
# The shared libraries they need that a CUDA image may lack (OpenBLAS and its Fortran runtime): those ldd resolves
# outside the system's C/C++ runtime and CUDA's own.
ldd "$dir/test_gpu" "$dir/bench_cuda" "$dir/smla" | awk '$2 == "=>" {print $3}' | sort -u |
  grep -E 'openblas|gfortran|quadmath' | xargs -r -I{} cp -L {} "$dir/lib/"
mkdir -p "$(dirname "$archive")"
tar czf "$archive" -C "$stage" "$name"
tar tzf "$archive"
echo "$archive: $(du -h "$archive" | cut -f1)"
