// The unabsorbed MLA prefill: the textbook form the absorbed path is checked against.
#pragma once

#include <cstdint>

#include "smla/spec.h"

namespace smla::layer {

// Causal attention over one new prompt (positions 0..n-1): k_nope = c @ W_UK^T and v = c @ W_UV^T per head from
// kv_b [H * (nope + v), kv_lora], keys [k_nope | k_pe]. q [n, H, nope + rope] and kva [n, kv_lora + rope] (c
// normed, q_pe and k_pe roped); attn [n, H * v] receives each head's output.
void unabsorbed_attention(const AttentionSpec& spec, float scale, const float* kv_b, const float* q, const float* kva,
                          int64_t n, float* attn);

}  // namespace smla::layer
