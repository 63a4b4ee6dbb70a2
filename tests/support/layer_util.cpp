#include "support/layer_util.h"

#include <cmath>

#include "support/test_util.h"

namespace smla::test {
namespace {

WeightTensor random_tensor(Rng& rng, std::vector<int64_t> shape, float lo, float hi) {
  WeightTensor t{std::move(shape), {}};
  t.data = random_floats(rng, size_t(t.numel()), lo, hi);
  return t;
}

WeightTensor linear(Rng& rng, int64_t out, int64_t in) {
  const float bound = float(std::sqrt(3.0 / in));
  return random_tensor(rng, {out, in}, -bound, bound);
}

}  // namespace

AttentionSpec tiny_spec(bool sparse, int q_lora_rank, int topk) {
  AttentionSpec s;
  s.name = "tiny";
  s.model_type = sparse ? "glm_moe_dsa" : "deepseek_v3";
  s.hidden_size = 64;
  s.num_heads = 4;
  s.q_lora_rank = q_lora_rank;
  s.kv_lora_rank = 512;
  s.qk_nope_head_dim = 32;
  s.qk_rope_head_dim = 64;
  s.v_head_dim = 48;
  s.num_layers = 1;
  s.rope.theta = 10000;
  if (sparse) s.indexer = IndexerSpec{2, 128, topk, RopeStyle::half_split};
  s.softmax_scale = reference_softmax_scale(s.qk_head_dim(), s.rope);
  return s;
}

AttentionSpec tiny_pooled_spec(int topk) {
  AttentionSpec s = tiny_spec(true, 48, topk);
  s.model_type = "glm5_next_text";
  s.qk_nope_head_dim = 64;  // GLM-5.3-Flash's head: no rope part, 512 wide absorbed
  s.qk_rope_head_dim = 0;
  s.indexer->kpool = 4;
  s.indexer->always_select_tail = true;
  s.softmax_scale = reference_softmax_scale(s.qk_head_dim(), s.rope);
  return s;
}

AttentionWeights random_weights(const AttentionSpec& s, uint64_t seed) {
  Rng rng(seed);
  AttentionWeights w;
  w.spec = s;
  const int64_t h = s.num_heads, qk = s.qk_head_dim();
  if (s.q_lora_rank > 0) {
    w.q_a = linear(rng, s.q_lora_rank, s.hidden_size);
    w.q_a_norm = random_tensor(rng, {s.q_lora_rank}, 0.8f, 1.2f);
    w.q_b = linear(rng, h * qk, s.q_lora_rank);
  } else {
    w.q = linear(rng, h * qk, s.hidden_size);
  }
  w.kv_a_mqa = linear(rng, s.absorbed_qk_dim(), s.hidden_size);
  w.kv_a_norm = random_tensor(rng, {s.kv_lora_rank}, 0.8f, 1.2f);
  w.kv_b = linear(rng, h * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank);
  w.o = linear(rng, s.hidden_size, h * s.v_head_dim);
  if (s.is_sparse()) {
    const IndexerSpec& ix = *s.indexer;
    w.indexer.wq_b = linear(rng, int64_t(ix.heads) * ix.head_dim, s.q_lora_rank);
    w.indexer.wk = linear(rng, ix.head_dim, s.hidden_size);
    w.indexer.k_norm = random_tensor(rng, {ix.head_dim}, 0.8f, 1.2f);
    w.indexer.k_norm_bias = random_tensor(rng, {ix.head_dim}, -0.1f, 0.1f);
    w.indexer.weights_proj = linear(rng, ix.heads, s.hidden_size);
    if (ix.kpool > 1) {
      w.indexer.kpool_ape = random_tensor(rng, {ix.kpool, ix.head_dim}, -1.f, 1.f);
      w.indexer.kpool_gate = linear(rng, ix.head_dim, s.hidden_size);
    }
  }
  return w;
}

std::vector<float> random_hidden(uint64_t seed, int64_t tokens, int hidden) {
  Rng rng(seed);
  return random_floats(rng, size_t(tokens * hidden));
}

}  // namespace smla::test
