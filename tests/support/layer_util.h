// Tiny MlaLayer geometries, random weights and hidden states, shared by the CPU and GPU layer tests: the kernels'
// sizes (kv_lora 512, rope 64, indexer head 128), everything else shrunk.
#pragma once

#include <cstdint>
#include <vector>

#include "smla/weights.h"

namespace smla::test {

// hidden 64, 4 heads, nope 32, v 48; DSA: 2 indexer heads, half-split indexer RoPE.
AttentionSpec tiny_spec(bool sparse, int q_lora_rank = 48, int topk = 16);
// GLM-5.3-Flash's geometry, as tiny: no rope part and a pooled indexer (kpool 4, the tail always attended).
AttentionSpec tiny_pooled_spec(int topk = 16);
// Linears uniform in ±sqrt(3 / in) (activations stay near 1), norm weights in [0.8, 1.2), the LayerNorm bias in
// ±0.1: away from random_attention_weights' 1 and 0, so that a norm applied wrongly shows.
AttentionWeights random_weights(const AttentionSpec& spec, uint64_t seed);
// [tokens, hidden] uniform in [-1, 1).
std::vector<float> random_hidden(uint64_t seed, int64_t tokens, int hidden);

}  // namespace smla::test
