// One GLM-5 attention layer decoding on the GPU (MlaLayer with options.device): the real geometry with the heads of
// one tensor-parallel rank, random weights (bf16 on the GPU), every request with `context` cached tokens (imported
// with append_context), one decode token per request per step. Prints the wall time of a step without a profile
// (forward only enqueues; the stream is synchronised once after all steps), then the profile's split (which
// synchronises at every phase boundary, so its total is a little larger).
//
//   bench_cuda_layer [context (8192)] [batch (32)] [tp (8)] [kv cache dtype (bfloat16)] [steps (20)]
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/random.h"
#include "layer_profile.h"
#include "smla/error.h"
#include "smla/layer.h"
#include "smla/select.h"

namespace {

using namespace smla;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(ErrorKind::internal, std::string(what) + ": " + cudaGetErrorString(e));
}

// A device copy of `n` floats uniform in [-1, 1).
float* device_uniform(int64_t n, uint64_t state) {
  Xorshift64 rng(state);
  std::vector<float> host(n);
  for (float& x : host) x = rng.symmetric();
  float* p = nullptr;
  check(cudaMalloc(&p, n * sizeof(float)), "cudaMalloc");
  check(cudaMemcpy(p, host.data(), n * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy");
  return p;
}

}  // namespace

int main(int argc, char** argv) try {
  const int context = argc > 1 ? std::atoi(argv[1]) : 8192;
  const int batch = argc > 2 ? std::atoi(argv[2]) : 32;
  const int tp = argc > 3 ? std::atoi(argv[3]) : 8;
  const DType kv = parse_dtype(argc > 4 ? argv[4] : "bfloat16").value_or(DType::u8);
  const int steps = std::max(1, argc > 5 ? std::atoi(argv[5]) : 20);
  constexpr int kWarmup = 3, kBlock = 64;

  AttentionSpec spec = *preset("glm-5");
  require(tp > 0 && spec.num_heads % tp == 0, "tp: expected a divisor of " + std::to_string(spec.num_heads));
  spec.num_heads /= tp;
  const int blocks_per_request = (context + kWarmup + 2 * steps + kBlock - 1) / kBlock;
  const LayerOptions options{.num_blocks = batch * blocks_per_request, .block_size = kBlock, .kv_cache_dtype = kv,
                             .device = detect_device()};
  MlaLayer layer(random_attention_weights(spec), options);

  float* latent = device_uniform(int64_t(context) * 512, 1);
  float* k_pe = device_uniform(int64_t(context) * 64, 2);
  float* index_k = device_uniform(int64_t(context) * 128, 3);
  float* hidden = device_uniform(int64_t(batch) * spec.hidden_size, 4);
  float* out = nullptr;
  check(cudaMalloc(&out, int64_t(batch) * spec.hidden_size * sizeof(float)), "cudaMalloc");
  std::vector<LayerSegment> segments;
  for (int b = 0; b < batch; ++b) {
    segments.push_back({layer.add_request(), 1});
    layer.append_context(segments.back().request, context, latent, k_pe, index_k);
  }
  for (int i = 0; i < kWarmup; ++i) layer.forward(segments, hidden, out);
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");

  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) layer.forward(segments, hidden, out);
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  const double step_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() /
                         steps;

  const std::array<double, 8> median = bench::median_profile_ms(layer, segments, hidden, out, steps);
  std::printf("GLM-5 layer decode on %s (backend %s): %d heads (tp %d), batch %d, context %d, %s cache, "
              "%d steps after %d warm-up\n",
              layer.device().name().c_str(), layer.backend().name().c_str(), spec.num_heads, tp, batch, context,
              std::string(dtype_name(kv)).c_str(), steps, kWarmup);
  std::printf("step without profile: %.3f ms (%.0f tokens/s)\n", step_ms, batch / step_ms * 1e3);
  std::printf("profiled, median ms: projections %.3f  rope %.3f  cache_write %.3f  indexer %.3f  topk %.3f  "
              "attention %.3f  output %.3f  total %.3f\n",
              median[0], median[1], median[2], median[3], median[4], median[5], median[6], median[7]);
  for (float* p : {latent, k_pe, index_k, hidden, out}) cudaFree(p);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_cuda_layer: %s\n", e.what());
  return 1;
}
