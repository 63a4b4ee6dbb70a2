// The CPU backend's ops. Args arrive checked (smla::check); these functions
// trust shapes, dtypes and strides, but never trust index values.
#pragma once

#include "smla/ops.h"

namespace smla::cpu {

void write_mla_cache(const WriteMlaCacheArgs& args);
void sparse_mla(const SparseMlaArgs& args);
void paged_mla_decode(const PagedMlaDecodeArgs& args);
void write_index_cache(const WriteIndexCacheArgs& args);
void indexer_topk(const IndexerTopkArgs& args);
void positions_to_slots(const PositionsToSlotsArgs& args);
void write_pooled_index_cache(const WritePooledIndexCacheArgs& args);
void pools_to_positions(const PoolsToPositionsArgs& args);
void rotate_index_q(const RotateIndexQArgs& args);

}  // namespace smla::cpu
