// Float64 references of the indexer ops (the attention ones are in
// mla_reference.h), written as plainly as possible: loops over the
// definitions in docs/ops.md, reading tensors element by element through
// their strides. They take the same Args as the ops and write the same outputs.
#pragma once

#include <cstdint>
#include <vector>

#include "smla/ops.h"

namespace smla::reference {

// One element of a host tensor as float64 (f32, f16, bf16, fp8_e4m3, i32, i64).
double element(const TensorView& t, std::initializer_list<int64_t> index);

void ref_write_index_cache(const WriteIndexCacheArgs& args);

// The index key of cache slot (block, offset): its 128 stored values, and its
// fp32 scale in *scale (1 for a bf16 cache).
std::vector<double> ref_index_key(const TensorView& index_cache, int64_t block, int64_t offset, double* scale);

// Token t's scores over logical positions [0, context_lens[t]).
std::vector<double> ref_indexer_scores(const IndexerTopkArgs& args, int64_t t);

// Positions of the top-k scores, best first, ties toward the lower position, -1 padded.
std::vector<int32_t> ref_topk_of_scores(const std::vector<double>& scores, int64_t k);

void ref_indexer_topk(const IndexerTopkArgs& args);
void ref_positions_to_slots(const PositionsToSlotsArgs& args);

// Pool p's index key as the model defines it, in float64 with no rounding: per dimension d, the keys of the pool's
// tokens weighted by softmax_m(gate[p, m, d] + ape[m, d]), then (args.hadamard) 128^-0.5 * H_128 times that.
std::vector<double> ref_pooled_index_key(const WritePooledIndexCacheArgs& args, int64_t p);
// Stores ref_pooled_index_key of every pool with slot_mapping >= 0 as write_index_cache stores a key.
void ref_write_pooled_index_cache(const WritePooledIndexCacheArgs& args);
void ref_pools_to_positions(const PoolsToPositionsArgs& args);
// Query head (t, h) rotated, 128^-0.5 * H_128 q[t, h], in float64 with no rounding.
std::vector<double> ref_rotated_index_q(const RotateIndexQArgs& args, int64_t t, int64_t h);

}  // namespace smla::reference
