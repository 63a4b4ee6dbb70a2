#!/usr/bin/env bash
# One GPU session: build for this machine's GPU, then run the parts asked for
# (default all): `tests` (GPU tests + compute-sanitizer on small cases),
# `bench` (bench/bench_cuda.cu, its table last), `run` (`smla run` jobs).
# Logs go to $OUT when set. Dependencies that the machine cannot install come
# from .devdeps (scripts/pack-device-deps.sh).
set -uo pipefail
parts=${*:-tests bench run}
out=${OUT:-/tmp/smla-gpu}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)
prefix=()
[ -d .devdeps ] && prefix=(-DCMAKE_PREFIX_PATH="$PWD/.devdeps/usr")
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="${arch}-real" "${prefix[@]}" \
  >"$out/configure.log" 2>&1 || { tail -30 "$out/configure.log"; exit 1; }
cmake --build build-gpu -j "$(nproc)" --target test_gpu bench_cuda smla_cli >"$out/build.log" 2>&1 ||
  { grep -E "error" "$out/build.log" | head -30; exit 1; }
if [[ " $parts " == *" tests "* ]]; then
  echo "== GPU tests"
  ./build-gpu/tests/gpu/test_gpu 2>&1 | tee "$out/test.log" | grep -E "^\[  (PASSED|FAILED)|Failure|error|Expected|Which is|which is" | head -40
  small="CudaSparseMla.TopkLengthSinksAndStridedQ:CudaPagedDecode.*:CudaWriteMlaCache.*:CudaIndexer.TiesGoToTheLowerPosition:CudaIndexer.PositionsToSlotsMatchesCpu:CudaIndexer.DsaDecodeStepMatchesCpu"
  if command -v compute-sanitizer >/dev/null; then
    for tool in memcheck racecheck; do
      echo "== compute-sanitizer $tool"
      compute-sanitizer --tool "$tool" --error-exitcode 9 ./build-gpu/tests/gpu/test_gpu --gtest_filter="$small" \
        >"$out/$tool.log" 2>&1
      echo "exit $? ; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/$tool.log" | tail -1)"
    done
  fi
fi
if [[ " $parts " == *" run "* ]]; then
  for args in "" "--kv-cache-dtype fp8_ds_mla --tp 8" "--model deepseek-v3.2 --tp 8 --batch 128" "--model kimi-k2 --tp 8"; do
    echo "== smla run $args"
    ./build-gpu/tools/smla/smla run $args 2>&1 | tee -a "$out/run.log" | grep -E "^(result|job|per step|throughput|  *indexer|check)"
  done
fi
if [[ " $parts " == *" bench "* ]]; then
  echo "== benchmark"
  ./build-gpu/bench/bench_cuda 2>&1 | tee "$out/bench.txt"
fi
