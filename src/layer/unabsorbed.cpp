#include "layer/unabsorbed.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "layer/layer_math.h"

namespace smla::layer {

void unabsorbed_attention(const AttentionSpec& s, float scale, const float* kv_b, const float* q, const float* kva,
                          int64_t n, float* attn) {
  const int64_t h = s.num_heads, nope = s.qk_nope_head_dim, rope = s.qk_rope_head_dim, qk = s.qk_head_dim(),
                v = s.v_head_dim, lora = s.kv_lora_rank, kv_rows = nope + v, kva_dim = lora + rope;
  std::vector<float> kv(n * h * kv_rows);  // per token and head: k_nope, then v
  linear(kva, kva_dim, kv_b, lora, kv.data(), h * kv_rows, n, h * kv_rows, lora);
  std::vector<float> keys(n * qk), scores(n * n);
  for (int64_t head = 0; head < h; ++head) {
    for (int64_t t = 0; t < n; ++t) {
      std::copy_n(&kv[(t * h + head) * kv_rows], nope, &keys[t * qk]);
      std::copy_n(&kva[t * kva_dim + lora], rope, &keys[t * qk + nope]);
    }
    linear(&q[head * qk], h * qk, keys.data(), qk, scores.data(), n, n, n, qk);
    for (int64_t t = 0; t < n; ++t) {
      float* row = &scores[t * n];
      float max = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j <= t; ++j) max = std::max(max, row[j] * scale);
      double sum = 0;
      for (int64_t j = 0; j <= t; ++j) sum += row[j] = std::exp(row[j] * scale - max);
      for (int64_t j = 0; j <= t; ++j) row[j] = float(row[j] / sum);
      std::fill(row + t + 1, row + n, 0.f);  // causal
    }
    matmul(scores.data(), n, &kv[head * kv_rows + nope], h * kv_rows, &attn[head * v], h * v, n, v, n);
  }
}

}  // namespace smla::layer
