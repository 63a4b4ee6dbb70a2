// What the layer benchmarks share: a decode step's LayerProfile split, per phase the median over `steps` forward
// calls (single steps are hit by a busy neighbour on a shared machine, or by a GPU's clock changes).
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <span>
#include <vector>

#include "smla/layer.h"

namespace smla::bench {

// Milliseconds: projections, RoPE, cache write, indexer, top-k, attention, output, and the whole call.
inline std::array<double, 8> median_profile_ms(MlaLayer& layer, std::span<const LayerSegment> segments,
                                               const float* hidden, float* out, int steps) {
  std::vector<std::array<double, 8>> rows;
  for (int i = 0; i < steps; ++i) {
    LayerProfile p;
    const auto start = std::chrono::steady_clock::now();
    layer.forward(segments, hidden, out, AttentionPath::absorbed, &p);
    const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    rows.push_back({p.projections, p.rope, p.cache_write, p.indexer, p.topk, p.attention, p.output, total});
  }
  std::array<double, 8> median{};
  for (size_t c = 0; c < median.size(); ++c) {
    std::vector<double> column;
    for (const auto& row : rows) column.push_back(row[c] * 1e3);
    std::ranges::nth_element(column, column.begin() + steps / 2);
    median[c] = column[steps / 2];
  }
  return median;
}

}  // namespace smla::bench
