// The CUDA backend's ops (compiled only with nvcc). Args arrive checked.
#pragma once

#include "smla/ops.h"

namespace smla::cuda {

void write_mla_cache(const WriteMlaCacheArgs& args);
void sparse_mla(const SparseMlaArgs& args);
void paged_mla_decode(const PagedMlaDecodeArgs& args);
void write_index_cache(const WriteIndexCacheArgs& args);
void positions_to_slots(const PositionsToSlotsArgs& args);
void indexer_topk(const IndexerTopkArgs& args);

// indexer_topk's two stages, for benchmarks: scores of every visible position
// into `scores` (fp32 device memory, 16-byte aligned, T rows
// score_row_stride apart), then the top-k.
int64_t index_capacity(const IndexerTopkArgs& args);    // max_blocks * block_size
int64_t score_row_stride(const IndexerTopkArgs& args);  // index_capacity rounded up to 4
void indexer_scores(const IndexerTopkArgs& args, float* scores);
// How select_topk shares a row among CTAs: as it sees fit, or forced (tests, benchmarks).
enum class TopkSplit { automatic, never, always };
void select_topk(const IndexerTopkArgs& args, const float* scores, TopkSplit split = TopkSplit::automatic);

}  // namespace smla::cuda
