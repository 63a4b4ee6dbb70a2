// Framework tensors as smla::TensorViews, without nanobind: shared by the _smla module (any DLPack producer) and
// smla._torch_ops (torch tensors, no Python in between), so both read raw bytes, pick backends and word their
// errors the same way.
#pragma once

#include <dlpack/dlpack.h>

#include <optional>
#include <string_view>

#include "smla/backend.h"
#include "smla/types.h"

namespace smla::python {

// Views `t` as smla sees argument `name`. `as` (a dtype name's meaning) reads 8-bit integer / small-float data as
// that 1-byte smla dtype (fp8 travels as bytes) or 16-bit raw data as bfloat16 / float16; over a float tensor it
// only checks the dtype ("q: is float16, not bfloat16").
TensorView view_of(DLTensor t, const char* name, std::optional<DType> as);

// The backend named `name` (empty: null, the ops then pick the default for the tensors' device). Throws
// smla::Error for an unknown name or a backend of another device kind than `device`.
const Backend* backend_by_name(std::string_view name, const Device& device);

// What the indexer's query tensors are called: in indexer_topk, and in dsa_decode_step, whose attention has a q.
struct IndexerQueryNames {
  const char* q;
  const char* q_scale;
  const char* weights;
};
inline constexpr IndexerQueryNames kIndexerTopkNames{"q", "q_scale", "weights"};
inline constexpr IndexerQueryNames kDecodeStepNames{"index_q", "index_q_scale", "index_weights"};

}  // namespace smla::python
