// The scoring half of the CPU indexer: one kernel per instruction set, each
// packing a token's query once and then scoring ranges of its context.
// score[s] = k_scale[s] * sum_h w[h] * q_scale[h] * ReLU(q[h] . k[s]),
// written as order keys (cpu/indexer.h) for the top-k selection. Each score
// is computed by one call with a fixed summation order, so results do not
// depend on how the context is split across threads.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cpu/indexer.h"
#include "cpu/isa.h"
#include "smla/types.h"

namespace smla::cpu::indexer {

// The paged index cache, as bytes.
struct IndexCacheView {
  const uint8_t* base = nullptr;
  int64_t block_size = 0;
  int64_t block_stride = 0;  // bytes between blocks
  int64_t row_stride = 0;    // bytes between tokens of a bf16 block (fp8 rows are always 128 bytes apart)
  bool fp8 = false;
};

// One token's query heads and weights.
struct QueryRow {
  const void* q = nullptr;  // [heads, 128] in `dtype`
  DType dtype = DType::bf16;
  int64_t head_stride = 0;  // elements
  int heads = 0;
  const float* weights = nullptr;  // [heads]
  const float* q_scale = nullptr;  // [heads], fp8 q only
};

// How a kernel lays out one packed query: heads padded to
// chunks * groups * lanes; `planes` copies of the query are summed (2 when an
// f16 query is split into exact bf16 high and low parts).
struct QueryLayout {
  int lanes = 0, groups = 0, chunks = 0, planes = 0;
  size_t chunk_elems = 0;  // packed query elements per chunk
  size_t elem_size = 0;
  size_t query_bytes() const { return chunk_elems * chunks * elem_size; }
  size_t weight_count() const { return static_cast<size_t>(chunks) * groups * lanes; }
};

struct ScoreKernel {
  QueryLayout (*layout)(int heads, DType q_dtype);
  // Packs `row` into `query` (query_bytes(), 64-byte aligned) and `weights` (weight_count() floats).
  void (*pack)(const QueryLayout& layout, const QueryRow& row, void* query, float* weights);
  // Order keys of logical positions [s0, s1), read through `blocks` (the
  // token's block table row, already validated), to keys[0, s1 - s0).
  void (*score)(const QueryLayout& layout, const void* query, const float* weights, const IndexCacheView& cache,
                const int32_t* blocks, int64_t s0, int64_t s1, uint32_t* keys);
};

// The instruction sets with a scoring kernel of their own: portable C++,
// AVX2 + FMA, and AVX-512 with BF16 dot products.
inline constexpr Isa kScoreKernelIsas[] = {Isa::scalar, Isa::avx2, Isa::avx512_bf16};
// The best of them that `isa` includes: the one whose kernel runs under `isa`.
constexpr Isa score_kernel_isa(Isa isa) {
  Isa best = Isa::scalar;
  for (Isa k : kScoreKernelIsas)
    if (k <= isa) best = k;
  return best;
}

// The kernel of score_kernel_isa(isa) (`isa` must be supported).
const ScoreKernel& score_kernel(Isa isa);

// 128 fp8 key bytes widened as `isa`'s kernel widens them, as floats; tests
// hold it to numeric::e4m3_to_float bit for bit.
void widen_fp8_key(Isa isa, const uint8_t* src, float* dst);

}  // namespace smla::cpu::indexer
