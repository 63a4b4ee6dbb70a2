// Float64 references of the attention ops (write_mla_cache, sparse_mla,
// paged_mla_decode), written as plainly as possible and sharing no code with
// the backends. Host tensors only; they trust their arguments.
#pragma once

#include <cstdint>
#include <vector>

#include "smla/ops.h"

namespace smla::reference {

// Cache row `slot` as [c (512) | k_pe (head.rope_dim)]; fp8 rows dequantised as e4m3 * tile scale (a head
// with no rope part never reads an fp8_ds_mla row's rope values; fp8_ds_mla_v4's 512 are 448 e4m3 * 2^(e - 127)
// and 64 bf16).
std::vector<double> ref_cache_row(const TensorView& cache, int64_t slot, MlaHead head = {});

// Writes the rows with a non-negative slot into args.cache (no k_pe: a head with no rope part, whose
// fp8_ds_mla rows keep their rope bytes).
void ref_write_mla_cache(const WriteMlaCacheArgs& args);

struct RefAttention {
  std::vector<double> out;  // [tokens, H, 512], tokens = T or B * s_q
  std::vector<double> lse;  // [tokens, H]; empty rows -inf, or +inf with empty_lse_plus_inf
  std::vector<double> max_logits;  // [tokens, H]: max of softmax_scale * q.k, -inf for empty rows
};

RefAttention ref_sparse_mla(const SparseMlaArgs& args);
RefAttention ref_paged_mla_decode(const PagedMlaDecodeArgs& args);

}  // namespace smla::reference
