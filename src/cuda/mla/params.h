// Parameters of the MLA attention kernel, filled and checked on the host once;
// the kernel trusts them (but never trusts index values).
#pragma once

#include <cstdint>

#include "smla/types.h"

namespace smla::cuda::mla {

// Latent cache formats the kernel reads. Scores and values are computed in
// the cache's 16-bit type (bf16 for the fp8 formats, whose values are
// dequantised to bf16 in shared memory); queries of the other 16-bit type are
// converted. fp8_ds_mla_v4 is DeepSeek-V4's 584-byte cache (MlaV4CacheLayout),
// of 512-wide heads only.
enum class CacheFormat { bf16, f16, fp8_ds_mla, fp8_ds_mla_v4 };

// The most splits of a row's keys the ops make (K <= 65536 keys, at most 1024 splits of them) and the combine merges.
inline constexpr int kMaxSplits = 1024;

// The kernel instance of the three kernels' hosts for format `f`, rope width `rope` (kMlaRopeDim or 0) and key
// source: pick.template operator()<F, kRope, kPaged>(), one call of the instances compiled (fp8_ds_mla_v4: rope
// 0 only, as it holds 512-wide heads; checked before).
template <class Pick>
auto instance_for(CacheFormat f, int rope, bool paged, const Pick& pick) {
  const auto of_format = [&]<CacheFormat F>() {
    const auto of_rope = [&]<int kRope>() {
      return paged ? pick.template operator()<F, kRope, true>() : pick.template operator()<F, kRope, false>();
    };
    if constexpr (F != CacheFormat::fp8_ds_mla_v4) {
      if (rope) return of_rope.template operator()<kMlaRopeDim>();
    }
    return of_rope.template operator()<0>();
  };
  switch (f) {
    case CacheFormat::bf16: return of_format.template operator()<CacheFormat::bf16>();
    case CacheFormat::f16: return of_format.template operator()<CacheFormat::f16>();
    case CacheFormat::fp8_ds_mla: return of_format.template operator()<CacheFormat::fp8_ds_mla>();
    case CacheFormat::fp8_ds_mla_v4: break;
  }
  return of_format.template operator()<CacheFormat::fp8_ds_mla_v4>();
}

// sparse_mla's second key list (DeepSeek-V4's compressed cache beside its window) where one launch reads both
// lists (the wgmma kernels' two-list instances): a token's chunks of the main list's visible keys first, then
// those of this list's, under one softmax. The fields mean what AttentionParams' cache and slot-list fields mean.
struct ExtraKeys {
  const uint8_t* cache;
  int64_t block_stride, row_stride;  // bytes
  int block_size;
  int64_t num_slots;
  const int32_t* indices;
  int64_t indices_stride;
  int topk;
  const int32_t* topk_length;
  int64_t topk_length_stride;
};

struct AttentionParams {
  // Query token t is (request b, step j) with b = t / s_q, j = t % s_q. For
  // sparse attention s_q is 1 and b indexes tokens.
  const uint16_t* q;  // [.., .., H, 576], bf16 or f16 bits
  bool q_is_bf16;
  int64_t q_stride_b, q_stride_s, q_stride_h;  // elements
  int num_tokens, s_q, num_heads;

  const uint8_t* cache;  // [num_blocks, block_size, row]
  int64_t block_stride, row_stride;  // bytes
  int block_size, num_blocks;
  int64_t num_slots;

  // Key source. Sparse: row t of `indices` (physical slots), the first
  // topk_length[t] when given. Paged: logical positions 0..seq_len through
  // the request's block table, causal among the s_q new tokens.
  const int32_t* indices;
  int64_t indices_stride;
  int topk;
  const int32_t* topk_length;
  int64_t topk_length_stride;
  const int32_t* block_table;
  int64_t block_table_stride;
  int max_blocks;
  const int32_t* seq_lens;
  bool causal;
  ExtraKeys extra;  // read only by the two-list kernel instances

  const float* attn_sink;  // [H] or null
  float scale_log2;        // softmax_scale * log2(e)

  void* out;  // [.., .., H, 512], q's dtype
  int64_t out_stride_b, out_stride_s, out_stride_h;
  float* lse;  // [.., .., H]
  int64_t lse_stride_b, lse_stride_s, lse_stride_h;
  float empty_lse;     // lse of a row with no valid key: -inf or +inf
  float* max_logits;   // optional [T, H] (sparse only): max of softmax_scale * q.k, natural units
  int64_t max_logits_stride_t, max_logits_stride_h;

  // Split over the keys: split s handles chunks [s * chunks_per_split, ...).
  int num_splits, chunks_per_split;
  // The head-tile and wide kernels let the combine launch once their keys are done (SM90+), only where all their
  // CTAs are resident at once. The small-heads kernel never does: on an H200 its early combine cost 2.7-3.1 us
  // (fp8, 8 heads, 32 and 64 tokens, one-wave grids: 43.4 and 61.2 us against 40.3 and 58.5 without), while one
  // token on the head-tile kernel gained 0.5 (10.0 against 10.5).
  bool early_combine;
  float* partial_out;  // [num_splits, num_tokens, H, 512], normalised per split
  float* partial_lse;  // [num_splits, num_tokens, H], log2 units
  float* partial_max;  // [num_splits, num_tokens, H], the split's max score, log2 units
#ifdef SMLA_TOPK_STAMPS
  unsigned long long* stamps;  // bench_cuda stamps (step_stamps.cuh): the head-tile kernel's and the combine's
#endif
};

#ifdef __CUDACC__
// The keys query token t (request b, step j) may see (everything at or past `visible` is invalid) and the chunks
// of `chunk_keys` keys of them that split `split` handles: [begin, begin + count).
struct ChunkRange {
  int visible, begin, count;
};
template <bool kPaged>
__device__ __forceinline__ ChunkRange chunk_range(const AttentionParams& p, int t, int b, int j, int split,
                                                  int chunk_keys) {
  int visible;
  if constexpr (kPaged) {
    const int seq = p.seq_lens[b];
    visible = p.causal ? seq - p.s_q + j + 1 : seq;
    visible = max(0, min(visible, p.max_blocks * p.block_size));
  } else {
    visible = p.topk_length ? max(0, min(p.topk_length[t * p.topk_length_stride], p.topk)) : p.topk;
  }
  const int total_chunks = (visible + chunk_keys - 1) / chunk_keys;
  const int begin = split * p.chunks_per_split;
  return {visible, begin, max(0, min(p.chunks_per_split, total_chunks - begin))};
}

// Where a key list's rows lie: the main cache (AttentionParams' fields) or, `extra`, ExtraKeys' cache.
struct ListCache {
  const uint8_t* data;
  int64_t block_stride, row_stride;
  int block_size;
  int64_t num_slots;
};
__device__ __forceinline__ ListCache list_cache(const AttentionParams& p, bool extra) {
  const ExtraKeys& e = p.extra;
  return extra ? ListCache{e.cache, e.block_stride, e.row_stride, e.block_size, e.num_slots}
               : ListCache{p.cache, p.block_stride, p.row_stride, p.block_size, p.num_slots};
}
// Slot-list entry `entry` as a slot of cache `c` (entry_slot's check), or -1 when it must not be read.
__device__ __forceinline__ int32_t list_slot(const ListCache& c, int32_t entry) {
  return entry >= 0 && entry < c.num_slots ? entry : -1;
}

// A sparse token's two key lists in a kernel that reads both (ExtraKeys): chunks from `main_chunks` on are the
// extra list's, of its `extra_visible` keys. The default: one list.
struct ListChunks {
  int main_chunks = 1 << 30, extra_visible = 0;
};
// The keys a CTA reads: chunk_range's, and with kTwoLists (sparse only) over both lists: the main list's visible
// keys (`range.visible`) in lists.main_chunks chunks, then the extra list's, `range.begin` and `range.count`
// counting chunks of both, split `split` taking chunks_per_split of them.
struct KeyRange {
  ChunkRange range;
  ListChunks lists;
};
template <bool kPaged, bool kTwoLists>
__device__ __forceinline__ KeyRange key_range(const AttentionParams& p, int t, int b, int j, int split, int chunk_keys) {
  KeyRange r{chunk_range<kPaged>(p, t, b, j, split, chunk_keys), {}};
  if constexpr (kTwoLists) {
    const ExtraKeys& e = p.extra;
    r.lists.extra_visible = e.topk_length ? max(0, min(e.topk_length[t * e.topk_length_stride], e.topk)) : e.topk;
    r.lists.main_chunks = (r.range.visible + chunk_keys - 1) / chunk_keys;
    const int total_chunks = r.lists.main_chunks + (r.lists.extra_visible + chunk_keys - 1) / chunk_keys;
    r.range.count = max(0, min(p.chunks_per_split, total_chunks - r.range.begin));
  }
  return r;
}
#endif

}  // namespace smla::cuda::mla
