// What the indexer's kernels share: the index cache's layout, which rows of
// the block table a token reads and how many positions it sees.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/common/griddep.cuh"
#include "cuda/kernels.h"
#include "smla/ops.h"

namespace smla::cuda {

// An index cache [num_blocks, block_size, row] as the kernels address it: bf16
// rows, or fp8 blocks (block_size keys of 128 bytes, then their fp32 scales).
struct IndexCacheLayout {
  uint8_t* data;
  bool fp8;
  int64_t block_stride, row_stride;  // bytes (row stride: bf16 rows)
  int block_size, num_blocks;
};

inline IndexCacheLayout index_cache_layout(const TensorView& cache) {
  const bool fp8 = cache.dtype == DType::fp8_e4m3;
  const int64_t elem = fp8 ? 1 : 2;
  return {cache.ptr<uint8_t>(),     fp8, cache.stride(0) * elem, cache.stride(1) * elem,
          static_cast<int>(cache.size(1)), static_cast<int>(cache.size(0))};
}

struct IndexRows {
  const int32_t* request_ids;
  int64_t req_stride;
  int num_requests;
  const int32_t* context_lens;
  int64_t ctx_stride;
  int64_t capacity;  // max_blocks * block_size

  __device__ __forceinline__ int32_t request(int t) const { return request_ids[t * req_stride]; }
  // Positions token t may see: its context clamped to the table, 0 when its request id is out of range.
  __device__ __forceinline__ int64_t visible(int t) const {
    const int32_t req = request(t), ctx = context_lens[t * ctx_stride];  // one trip to memory, not two
    if (req < 0 || req >= num_requests || ctx < 0) return 0;
    return ctx < capacity ? ctx : capacity;
  }
};

inline IndexRows index_rows(const IndexerTopkArgs& a) {
  return {a.request_ids.ptr<int32_t>(),  a.request_ids.stride(0),  static_cast<int>(a.block_table.size(0)),
          a.context_lens.ptr<int32_t>(), a.context_lens.stride(0), index_capacity(a)};
}

// Logical positions to physical slots through a block table, as positions_to_slots maps them: -1 for no position
// (< 0), a request out of range, a position past the table, a block id < 0 or a slot past int32.
struct SlotMap {
  const int32_t* block_table;
  int64_t table_stride, num_requests, max_blocks;
  int block_size;
  int block_shift;  // log2(block_size) when a power of 2 (a shift and a mask, not a division), else -1

  __device__ __forceinline__ int32_t slot(int32_t req, int32_t pos) const {
    return slot_in(req >= 0 && req < num_requests ? block_table + req * table_stride : nullptr, req, pos);
  }
  // slot(req, pos) where `row` holds request req's block-table row (the table's, or a copy of its first entries
  // up to the block of pos).
  __device__ __forceinline__ int32_t slot_in(const int32_t* row, int32_t req, int32_t pos) const {
    const int32_t b = block_shift >= 0 ? pos >> block_shift : pos / block_size;
    if (pos < 0 || req < 0 || req >= num_requests || b >= max_blocks) return -1;
    const int64_t block = row[b];
    const int64_t s = block * block_size + (pos - b * block_size);
    return block >= 0 && s <= INT32_MAX ? static_cast<int32_t>(s) : -1;
  }
};

// The top-k's coarse bins: the order key of a score rounded to fp16 (16 bits), and its top 12 bits, the score's
// bin. Rounding is monotone, so a higher bin never holds a lower score. The scores kernel counts them too
// (indexer_scores with `histograms`), the top-k reads those counts instead of counting (TopkFusion::histograms).
constexpr int kCoarseBins = 4096;
__device__ __forceinline__ uint32_t half_key(float v) {
  const uint32_t u = __half_as_ushort(__float2half_rn(v + 0.0f));
  return (u & 0x8000u) ? (~u & 0xffffu) : (u | 0x8000u);
}
__device__ __forceinline__ int coarse_bin(float v) { return static_cast<int>(half_key(v) >> 4); }

inline SlotMap slot_map(const PositionsToSlotsArgs& a) {
  const bool pow2 = a.block_size > 0 && (a.block_size & (a.block_size - 1)) == 0;
  return {a.block_table.ptr<int32_t>(), a.block_table.stride(0), a.block_table.size(0), a.block_table.size(1),
          a.block_size, pow2 ? __builtin_ctz(static_cast<unsigned>(a.block_size)) : -1};
}

}  // namespace smla::cuda
