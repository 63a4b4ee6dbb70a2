// The weights of one attention layer, read from a GGUF model or a Hugging Face safetensors checkpoint into one
// in-memory form: float32 tensors in the checkpoint's (PyTorch) orientation, checked against the model's geometry.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "smla/spec.h"

namespace smla {

// A dense float32 tensor, row-major, shape outermost first as PyTorch prints it (a Linear weight is [out, in]).
// Empty (no shape) when the model has no such tensor.
struct WeightTensor {
  std::vector<int64_t> shape;
  std::vector<float> data;

  bool empty() const { return shape.empty(); }
  int64_t numel() const;
};

// The DSA lightning indexer of a layer (empty tensors for dense models).
struct IndexerWeights {
  WeightTensor wq_b;          // [index_n_heads * index_head_dim, q_lora_rank]
  WeightTensor wk;            // [index_head_dim, hidden_size]
  WeightTensor k_norm;        // [index_head_dim], LayerNorm weight
  WeightTensor k_norm_bias;   // [index_head_dim], LayerNorm bias
  WeightTensor weights_proj;  // [index_n_heads, hidden_size]
  // A pooled indexer's (index_kpool > 1, GLM-5.3-Flash) key compression: per pool position and dimension a learned
  // term, and the gate projection whose scores (plus that term) weight each pool's keys through a softmax.
  WeightTensor kpool_ape;   // [index_kpool, index_head_dim], index_kpool_compress_ape
  WeightTensor kpool_gate;  // [index_head_dim, hidden_size], index_kpool_compress_gate
};

// H heads, nope = qk_nope_head_dim, rope = qk_rope_head_dim, v = v_head_dim.
struct AttentionWeights {
  AttentionSpec spec;  // the geometry the shapes below were checked against
  int layer = 0;
  WeightTensor q;          // [H * (nope + rope), hidden_size], only when q_lora_rank == 0
  WeightTensor q_a;        // [q_lora_rank, hidden_size]
  WeightTensor q_a_norm;   // [q_lora_rank], RMSNorm weight
  WeightTensor q_b;        // [H * (nope + rope), q_lora_rank]
  WeightTensor kv_a_mqa;   // [kv_lora_rank + rope, hidden_size]: the latent c, then the shared k_pe
  WeightTensor kv_a_norm;  // [kv_lora_rank], RMSNorm weight
  WeightTensor kv_b;       // [H * (nope + v), kv_lora_rank]: per head, nope rows of W_UK then v rows of W_UV
  WeightTensor o;          // [hidden_size, H * v]
  IndexerWeights indexer;  // DSA models only
};

// kv_b split the way llama.cpp's converter stores it for the absorbed form: k_b [H, kv_lora_rank, nope] (W_UK
// transposed per head, GGUF attn_k_b) and v_b [H, v, kv_lora_rank] (W_UV, GGUF attn_v_b). Both directions only
// move values, so a round trip gives back the same bits. Throw smla::Error on shapes that do not fit together.
struct KvBSplit {
  WeightTensor k_b;
  WeightTensor v_b;
};
KvBSplit split_kv_b(const WeightTensor& kv_b, int num_heads, int qk_nope_head_dim, int v_head_dim);
WeightTensor merge_kv_b(const WeightTensor& k_b, const WeightTensor& v_b);

// Layer `layer` of a model: `path` is a .gguf file (the first part of a split model) or a folder holding
// config.json and model.safetensors.index.json with its shards (or a single model.safetensors). GGUF tensors may
// be F32, F16, BF16, Q8_0, Q4_K or Q6_K; safetensors F32, F16 or BF16. Throws smla::Error naming the file and the
// tensor at fault: a missing tensor, a shape that disagrees with the geometry, a type smla cannot read.
AttentionWeights load_attention_weights(const std::string& path, int layer);

// Random weights of the geometry, for benchmarks and dry runs: each Linear [out, in] uniform in ±sqrt(3 / in) (so
// activations stay near 1), the norms' weights 1 and the indexer's LayerNorm bias 0; the same seed gives the same
// values. Throws smla::Error when the spec does not validate.
AttentionWeights random_attention_weights(const AttentionSpec& spec, uint64_t seed = 1);

// Rank `rank`'s share under tensor parallelism over `tp` ranks: its num_heads / tp heads, that is its rows of q or
// q_b and of kv_b and its columns of o (o_proj's output is then this rank's partial sum); q_a, kv_a, the norms and
// the indexer stay whole, as every rank runs them. spec.num_heads becomes the rank's heads. Throws smla::Error
// when tp does not divide the heads or rank is not in [0, tp).
AttentionWeights shard_attention_heads(AttentionWeights weights, int tp, int rank);

}  // namespace smla
