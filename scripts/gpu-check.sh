#!/usr/bin/env bash
# One GPU session: build for this machine's GPU, then run the parts asked for
# (default all): `tests` (GPU tests + compute-sanitizer on small cases),
# `bench` (bench/bench_cuda.cu, its table last), `run` (`smla run` jobs),
# `layer` (MlaLayer on the GPU: its GPU tests, the GLM-5 decode split of
# bench/bench_cuda_layer.cpp, tests/layer against transformers when torch is there).
# Logs go to $OUT when set. Dependencies that the machine cannot install come
# from .devdeps (scripts/pack-device-deps.sh).
set -uo pipefail
parts=${*:-tests bench run layer}
out=${OUT:-/tmp/smla-gpu}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)
[ "$arch" = 90 ] && arch=90a  # Hopper: the indexer's wgmma needs sm_90a code
prefix=()
if [ -d .devdeps ]; then
  prefix=(-DCMAKE_PREFIX_PATH="$PWD/.devdeps/usr")
  export LD_LIBRARY_PATH="$PWD/.devdeps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"  # OpenBLAS
fi
targets=()
[[ " $parts " == *" tests "* ]] && targets+=(test_gpu)
[[ " $parts " == *" bench "* ]] && targets+=(bench_cuda)
[[ " $parts " == *" run "* ]] && targets+=(smla_cli)
[[ " $parts " == *" layer "* ]] && targets+=(test_gpu bench_cuda_layer layer_driver)
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="${arch}-real" "${prefix[@]}" \
  >"$out/configure.log" 2>&1 || { tail -30 "$out/configure.log"; exit 1; }
cmake --build build-gpu -j "$(nproc)" --target "${targets[@]}" >"$out/build.log" 2>&1 ||
  { grep -E "error" "$out/build.log" | head -30; exit 1; }
if [[ " $parts " == *" tests "* ]]; then
  echo "== GPU tests"
  ./build-gpu/tests/gpu/test_gpu 2>&1 | tee "$out/test.log" | grep -E "^\[  (PASSED|FAILED)|Failure|error|Expected|Which is|which is" | head -40
  # Each other arch's launch decisions executed here (docs/gpu-testing.md, "Emulated archs").
  for emulated in sm_80 sm_86 sm_89 sm_100 sm_120; do
    echo "== GPU tests, $emulated emulated"
    SMLA_CUDA_EMULATE=$emulated ./build-gpu/tests/gpu/test_gpu 2>&1 | tee "$out/test-$emulated.log" |
      grep -E "^\[  (PASSED|FAILED)|Failure|error|Expected|Which is|which is" | head -20
  done
  small="CudaSparseMla.TopkLengthSinksAndStridedQ:CudaSparseMla.NoRopePartDtypesFormatsBlockSizes:CudaSparseMlaSmallHeads.DepthsInAnyOrder:CudaSparseMlaSmallHeads.RowCopiesAgreeBitForBit:CudaPagedDecode.*:CudaWriteMlaCache.*:CudaIndexer.TiesGoToTheLowerPosition:CudaIndexer.StridedQueriesScoreAsDenseOnes:CudaIndexer.PositionsToSlotsMatchesCpu:CudaIndexer.DsaDecodeStepMatchesCpu:CudaSparseMlaWgmma.PartialPairWithoutRope:CudaSparseMlaWgmma.OutputRowsAlignedOrNot:CudaSparseMlaWideTile.ForcedSplits"
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
  for args in "" "--kv-cache-dtype fp8_ds_mla --tp 8" "--model deepseek-v3.2 --tp 8 --batch 128" "--model kimi-k2 --tp 8" \
      "--model glm-5.3-flash --tp 8 --kv-cache-dtype fp8_ds_mla_nope --context 32768" \
      "--tp 8 --kv-cache-dtype fp8_ds_mla --batch 1 --context 131072" \
      "--tp 8 --kv-cache-dtype fp8_ds_mla --batch 8 --context 131072"; do  # the last two: issue 23's per-user latency
    echo "== smla run $args"
    ./build-gpu/tools/smla/smla run $args 2>&1 | tee -a "$out/run.log" |
      grep -E "^(result|job|per step|step |throughput|  *indexer|per user|check)"
  done
  echo "== smla run --model glm-5 --layer 3 --tp 8"
  ./build-gpu/tools/smla/smla run --model glm-5 --layer 3 --tp 8 2>&1 | tee -a "$out/run.log" | tail -25
fi
if [[ " $parts " == *" bench "* ]]; then
  echo "== benchmark"
  ./build-gpu/bench/bench_cuda --json "$out/h200.json" 2>&1 | tee "$out/bench.txt"
fi
if [[ " $parts " == *" layer "* ]]; then
  echo "== MlaLayer on the GPU"
  ./build-gpu/tests/gpu/test_gpu --gtest_filter='*CudaLayer*' 2>&1 | tee "$out/layer-test.log" |
    grep -E "^\[  (PASSED|FAILED)|^\[ measured|Failure|Expected|Which is|which is|error" | head -60
  if command -v compute-sanitizer >/dev/null; then
    small="CudaLayerContext.*:Models/CudaLayer.*/deepseek_v3_no_q_lora_f16:Models/CudaLayer.*/glm_moe_dsa_fp8"
    for tool in memcheck racecheck; do
      compute-sanitizer --tool "$tool" --error-exitcode 9 ./build-gpu/tests/gpu/test_gpu --gtest_filter="$small" \
        >"$out/layer-$tool.log" 2>&1
      echo "compute-sanitizer $tool: exit $? ; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/layer-$tool.log" | tail -1)"
    done
  fi
  for kv in bfloat16 fp8_ds_mla; do
    ./build-gpu/bench/bench_cuda_layer 8192 32 8 "$kv" 2>&1 | tee -a "$out/layer-bench.txt"
  done
  if python3 -c "import torch, transformers, safetensors" 2>/dev/null; then
    echo "== tests/layer against transformers, layer on the GPU"
    SMLA_LAYER_DRIVER=build-gpu/tests/cpu/layer_driver SMLA_LAYER_DEVICE=cuda python3 -m pytest tests/layer -q 2>&1 |
      tee "$out/layer-hf.log" | tail -15
  else
    echo "== tests/layer skipped: no torch / transformers / safetensors here"
  fi
fi
