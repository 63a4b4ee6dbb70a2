// One GLM-5 attention layer (real geometry, random float32 weights) decoding on the CPU: where a step's time goes
// (projections, RoPE, cache writes, indexer, top-k, attention, output) for each batch size, every request with
// `context` cached tokens (imported with append_context, then decoded one token per step).
//
//   bench_cpu_layer [context (4096)] [steps (9)] [batch sizes (1 8)...]
#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "core/random.h"
#include "layer_profile.h"
#include "smla/layer.h"

namespace {

using namespace smla;

std::vector<float> uniform(Xorshift64& rng, int64_t n, float bound) {
  std::vector<float> v(n);
  for (float& x : v) x = rng.symmetric() * bound;
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  const int context = argc > 1 ? std::atoi(argv[1]) : 4096;
  const int steps = std::max(1, argc > 2 ? std::atoi(argv[2]) : 9);
  std::vector<int> batches;
  for (int i = 3; i < argc; ++i) batches.push_back(std::atoi(argv[i]));
  if (batches.empty()) batches = {1, 8};
  constexpr int kWarmup = 2, kBlock = 64;

  const AttentionSpec spec = *preset("glm-5");
  int requests = 0;
  for (const int b : batches) requests += b;
  const int blocks_per_request = (context + kWarmup + steps + kBlock - 1) / kBlock;
  MlaLayer layer(random_attention_weights(spec), {.num_blocks = requests * blocks_per_request, .block_size = kBlock});

  Xorshift64 rng(42);
  const std::vector<float> latent = uniform(rng, int64_t(context) * 512, 1.f),
                           k_pe = uniform(rng, int64_t(context) * 64, 1.f),
                           index_k = uniform(rng, int64_t(context) * 128, 1.f);
  std::printf("GLM-5 layer decode on the CPU: context %d, median of %d steps (after %d warm-up), bf16 caches, ms\n",
              context, steps, kWarmup);
  std::printf("%6s %11s %6s %11s %8s %6s %9s %7s %8s\n", "batch", "projections", "rope", "cache_write", "indexer",
              "topk", "attention", "output", "total");
  for (const int batch : batches) {
    std::vector<LayerSegment> segments;
    for (int b = 0; b < batch; ++b) {
      segments.push_back({layer.add_request(), 1});
      layer.append_context(segments.back().request, context, latent.data(), k_pe.data(), index_k.data());
    }
    const std::vector<float> hidden = uniform(rng, int64_t(batch) * spec.hidden_size, 1.f);
    std::vector<float> out(hidden.size());
    for (int i = 0; i < kWarmup; ++i) layer.forward(segments, hidden.data(), out.data());
    const std::array<double, 8> median = bench::median_profile_ms(layer, segments, hidden.data(), out.data(), steps);
    std::printf("%6d %11.2f %6.2f %11.2f %8.2f %6.2f %9.2f %7.2f %8.2f\n", batch, median[0], median[1], median[2],
                median[3], median[4], median[5], median[6], median[7]);
    for (const LayerSegment& seg : segments) layer.release_request(seg.request);
  }
}
