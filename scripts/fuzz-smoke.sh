#!/usr/bin/env bash
# CI smoke run of the libFuzzer targets (fuzz/) under ASan + UBSan: each runs FUZZ_SECONDS (default 60) from a seed
# corpus that tests/models/make_fixtures.py writes, and the run fails on any crash, sanitizer report, leak or hang.
# Builds with clang in ${BUILD:-build}-fuzz (scripts/install-deps.sh --fuzz installs clang and libFuzzer).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD:-build}-fuzz
seconds=${FUZZ_SECONDS:-60}

bash scripts/install-deps.sh --fuzz --python  # clang, libFuzzer; the fixture script's packages

cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ -DSMLA_BUILD_FUZZERS=ON \
  -DSMLA_SANITIZE=ON -DSMLA_CUDA=OFF -DSMLA_BUILD_TESTS=OFF -DSMLA_BUILD_TOOLS=OFF -DSMLA_BUILD_BENCH=OFF
cmake --build "$build" -j "$(nproc)" --target fuzz_gguf fuzz_config_json

# Seeds: the small fixture files (metadata-only models, one-tensor-per-type, every kind of damage) and the configs.
fixtures=$build/fixtures
"$(bash scripts/python.sh)" tests/models/make_fixtures.py "$fixtures"
rm -rf "$build/seeds" "$build/corpus" "$build/artifacts"
mkdir -p "$build/seeds/gguf" "$build/seeds/config_json" "$build/corpus/gguf" "$build/corpus/config_json" \
  "$build/artifacts"
cp "$fixtures"/specs/*.gguf "$fixtures"/bad/*.gguf "$fixtures/quants.gguf" "$build/seeds/gguf/"
i=0
for config in tests/data/configs/*.json tests/cli/bad/*.json "$fixtures"/tiny/*/hf/config.json; do
  cp "$config" "$build/seeds/config_json/$((i++)).json"
done

export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
for target in gguf config_json; do
  echo "fuzz-smoke: fuzz_$target for ${seconds}s"
  log=$build/fuzz_$target.log
  if ! "$build/fuzz/fuzz_$target" "$build/corpus/$target" "$build/seeds/$target" -dict="fuzz/$target.dict" \
      -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=65536 -print_final_stats=1 \
      -artifact_prefix="$build/artifacts/$target-" >"$log" 2>&1; then
    tail -n 60 "$log" >&2
    echo "fuzz-smoke: fuzz_$target failed (full log $log; the input is in $build/artifacts)" >&2
    exit 1
  fi
  grep -E "^Done [0-9]+ runs|^stat::(number_of_executed_units|average_exec_per_sec|peak_rss_mb)" "$log"
done
echo "fuzz-smoke: no crash, leak or hang"
