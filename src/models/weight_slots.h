// The tensors of one attention layer: their names in GGUF and Hugging Face checkpoints, the AttentionWeights field
// each fills and the shape the geometry gives it. One table for the readers (weights.cpp) and MlaLayer's checks.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "smla/weights.h"

namespace smla::models {

// Which layers of the geometry a tensor belongs to.
enum class Needed { always, without_q_lora, with_q_lora, sparse, pooled };

// A tensor of the layer: the field it fills, its name after "blk.N." in GGUF and after "model.layers.N.self_attn."
// in Hugging Face checkpoints, and the shape the geometry gives it.
struct WeightSlot {
  const char* field_name;  // the AttentionWeights field ("q_b", "indexer.wk"), as MlaLayer's messages name it
  const char* gguf;
  const char* hf;
  Needed needed;
  WeightTensor& (*field)(AttentionWeights&);
  std::vector<int64_t> (*shape)(const AttentionSpec&);

  // Whether a layer of this geometry has the tensor: sparse ones with an indexer, pooled ones with a pooled indexer
  // (index_kpool > 1, GLM-5.3-Flash).
  bool needed_by(const AttentionSpec& spec) const;
};

std::span<const WeightSlot> weight_slots();

// "[a, b]", as the messages print a shape.
std::string shape_text(const std::vector<int64_t>& shape);

}  // namespace smla::models
