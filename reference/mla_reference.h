// Float64 references of the attention ops (write_mla_cache, sparse_mla,
// paged_mla_decode), written as plainly as possible and sharing no code with
// the backends. Host tensors only; they trust their arguments.
#pragma once

#include <cstdint>
#include <vector>

#include "smla/ops.h"

namespace smla::reference {

// Cache row `slot` as [c (512) | k_pe (64)]; fp8_ds_mla rows dequantised as e4m3 * tile scale.
std::vector<double> ref_cache_row(const TensorView& cache, int64_t slot);

// Writes the rows with a non-negative slot into args.cache.
void ref_write_mla_cache(const WriteMlaCacheArgs& args);

struct RefAttention {
  std::vector<double> out;  // [tokens, H, 512], tokens = T or B * s_q
  std::vector<double> lse;  // [tokens, H]
};

RefAttention ref_sparse_mla(const SparseMlaArgs& args);
RefAttention ref_paged_mla_decode(const PagedMlaDecodeArgs& args);

}  // namespace smla::reference
