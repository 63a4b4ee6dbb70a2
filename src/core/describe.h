// Human-readable text for capability declarations, shared by validation
// reasons, `smla explain` and the README's support matrix.
#pragma once

#include <string>
#include <vector>

#include "smla/backend.h"

namespace smla {

std::string compute_capability_text(int cc);                    // 120 -> "12.0"
std::string describe_compute_capabilities(const IntRange& r);   // "sm_80 to sm_12x"
std::string describe_heads(const Capabilities& c);              // "1-128" or "64, 128"
std::string describe_head_sizes(const Capabilities& c);         // absorbed q/k and v sizes: "576, 512 / 512"
std::string describe_block_sizes(const Capabilities& c);        // "any", "64", "1-1024 (multiple of 16)"
std::string describe_topk(const Capabilities& c);
std::string describe_dtypes(const std::vector<DType>& v);       // "bfloat16, float16"

}  // namespace smla
