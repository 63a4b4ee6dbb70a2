// The CPU indexer ops: write_index_cache, indexer_topk, positions_to_slots, and the pooled indexer's
// write_pooled_index_cache, pools_to_positions and rotate_index_q.
// Index values (slots, request ids, context lengths, block ids) are checked
// here, serially and before any parallel work, so errors are thrown outside
// OpenMP regions. Scratch buffers are thread_local vectors that only grow:
// after the first call of a given size the hot path allocates nothing.
#include "cpu/indexer.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/numeric.h"
#include "cpu/indexer_scores.h"
#include "cpu/kernels.h"
#include "smla/error.h"

namespace smla::cpu {

namespace {

// Grows `v` to at least n elements, never shrinking, and returns its data.
template <class T>
T* grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

}  // namespace

namespace indexer {

namespace {

// A floor that about 1.25 m + n / 64 of the keys reach, from a strided
// sample; 0 (keep everything) for short rows. Only a filter: select_topk is
// exact whatever it returns.
uint32_t estimate_floor(const uint32_t* keys, int64_t n, int64_t m) {
  constexpr int64_t kSample = 1024;
  if (n <= 4 * kSample) return 0;
  uint32_t sample[kSample];
  for (int64_t i = 0; i < kSample; ++i) sample[i] = keys[i * n / kSample];
  const int64_t rank = m * kSample * 5 / (4 * n) + 16;
  if (rank >= kSample) return 0;
  std::nth_element(sample, sample + rank, sample + kSample, std::greater<>());
  return sample[rank];
}

// Entries are key << 32 | position, kept in position order until the final sort.
uint32_t key_of(uint64_t entry) { return static_cast<uint32_t>(entry >> 32); }

// Packs the keys >= floor; returns their count.
int64_t compact(const uint32_t* keys, int64_t n, uint32_t floor, uint64_t* out) {
  int64_t count = 0;
  for (int64_t s = 0; s < n; ++s) {  // branchless: always write, advance when kept
    out[count] = static_cast<uint64_t>(keys[s]) << 32 | static_cast<uint64_t>(s);
    count += keys[s] >= floor;
  }
  return count;
}

// Radix select, 8 bits at a time from the top: the m-th largest key of
// entries[0, count), and how many entries equal to it are among the top m.
std::pair<uint32_t, int64_t> kth_largest_key(const uint64_t* entries, int64_t count, int64_t m, uint64_t* scratch) {
  uint32_t key = 0;
  int64_t needed = m;
  for (int shift = 24; shift >= 0; shift -= 8) {
    uint32_t hist[256] = {};
    for (int64_t i = 0; i < count; ++i) ++hist[key_of(entries[i]) >> shift & 255];
    uint32_t bin = 255;
    while (hist[bin] < needed) needed -= hist[bin--];  // the bins hold >= needed entries
    key |= bin << shift;
    if (shift == 0) break;
    int64_t kept = 0;  // in place after the first level
    for (int64_t i = 0; i < count; ++i)
      if ((key_of(entries[i]) >> shift & 255) == bin) scratch[kept++] = entries[i];
    entries = scratch;
    count = kept;
  }
  return {key, needed};
}

// Stable LSD radix sort by key, descending; returns where the result is (a or b).
uint64_t* sort_by_key_descending(uint64_t* a, uint64_t* b, int64_t count) {
  for (int shift = 0; shift < 32; shift += 8) {
    uint32_t offset[256] = {};
    for (int64_t i = 0; i < count; ++i) ++offset[255 - (key_of(a[i]) >> shift & 255)];
    if (offset[255 - (key_of(a[0]) >> shift & 255)] == count) continue;  // one digit value: order unchanged
    uint32_t sum = 0;
    for (uint32_t& o : offset) sum += std::exchange(o, sum);
    for (int64_t i = 0; i < count; ++i) b[offset[255 - (key_of(a[i]) >> shift & 255)]++] = a[i];
    std::swap(a, b);
  }
  return a;
}

}  // namespace

void select_topk(const uint32_t* keys, int64_t n, int64_t k, int32_t* out, bool sorted) {
  const int64_t m = std::min(k, n);
  std::fill(out + m, out + k, -1);
  if (m == 0) return;
  thread_local std::vector<uint64_t> buffer_a, buffer_b;
  uint64_t* a = grow(buffer_a, static_cast<size_t>(n));
  uint64_t* b = grow(buffer_b, static_cast<size_t>(n));
  // Candidates: the keys >= a sampled floor, or all keys if that keeps fewer than m.
  int64_t count = compact(keys, n, estimate_floor(keys, n, m), a);
  if (count < m) count = compact(keys, n, 0, a);
  // Survivors: keys above the m-th largest, then equal ones lowest position first.
  if (count > m) {
    auto [threshold, equal_needed] = kth_largest_key(a, count, m, b);
    int64_t kept = 0;
    for (int64_t i = 0; i < count; ++i) {
      const uint32_t key = key_of(a[i]);
      if (key > threshold) {
        b[kept++] = a[i];
      } else if (key == threshold && equal_needed > 0) {
        b[kept++] = a[i];
        --equal_needed;
      }
    }
    std::swap(a, b);
  }
  // The survivors are in position order: unsorted, that is the order wanted.
  const uint64_t* chosen = sorted ? sort_by_key_descending(a, b, m) : a;
  for (int64_t i = 0; i < m; ++i) out[i] = static_cast<int32_t>(chosen[i] & 0xffffffffu);
}

}  // namespace indexer

namespace {

using indexer::IndexCacheView;

int64_t num_slots(const TensorView& cache) { return cache.shape[0] * cache.shape[1]; }

IndexCacheView cache_view(const TensorView& cache) {
  const int64_t elem = static_cast<int64_t>(dtype_size(cache.dtype));
  IndexCacheView v;
  v.base = static_cast<const uint8_t*>(cache.data);
  v.block_size = cache.shape[1];
  v.block_stride = cache.strides[0] * elem;
  v.row_stride = cache.strides[1] * elem;
  v.fp8 = cache.dtype == DType::fp8_e4m3;
  return v;
}

// Token t's block table row, after checking its request id.
const int32_t* block_row(const TensorView& request_ids, const TensorView& block_table, int64_t t,
                         std::string_view op) {
  const int32_t req = request_ids.ptr<const int32_t>()[t];
  if (req < 0 || req >= block_table.shape[0])
    fail(std::string(op) + ": request_ids: row " + std::to_string(t) + " holds " + std::to_string(req) +
         ", outside the block table's rows [0, " + std::to_string(block_table.shape[0]) + ")");
  return block_table.ptr<const int32_t>() + req * block_table.strides[0];
}

float load_float(const TensorView& t, int64_t i) {
  switch (t.dtype) {
    case DType::bf16: return numeric::bf16_to_float(t.ptr<const uint16_t>()[i]);
    case DType::f16: return numeric::f16_to_float(t.ptr<const uint16_t>()[i]);
    default: return t.ptr<const float>()[i];
  }
}

// Throws, naming the row, unless every slot of slot_mapping[0, n) is below the cache's slots (negative: skipped).
void check_slots(std::string_view op, const int64_t* slot_mapping, int64_t n, const TensorView& cache) {
  const int64_t slots = num_slots(cache);
  for (int64_t i = 0; i < n; ++i)
    if (slot_mapping[i] >= slots)
      fail(std::string(op) + ": slot_mapping: row " + std::to_string(i) + " holds slot " +
           std::to_string(slot_mapping[i]) + ", but the cache has " + std::to_string(slots) +
           " slots (num_blocks * block_size)");
}

// Stores one index key at `slot`: rounded to bf16, or fp8 e4m3 with its ue8m0 scale.
void store_index_key(const IndexCacheView& c, int64_t slot, const float* x) {
  uint8_t* block = const_cast<uint8_t*>(c.base) + slot / c.block_size * c.block_stride;
  const int64_t off = slot % c.block_size;
  if (!c.fp8) {
    auto* dst = reinterpret_cast<uint16_t*>(block + off * c.row_stride);
    for (int d = 0; d < kIndexHeadDim; ++d) dst[d] = numeric::float_to_bf16(x[d]);
    return;
  }
  float amax = 0.f;
  for (int d = 0; d < kIndexHeadDim; ++d) amax = std::fmax(amax, std::fabs(x[d]));
  const float scale = numeric::index_key_scale(amax);
  uint8_t* dst = block + off * kIndexHeadDim;
  for (int d = 0; d < kIndexHeadDim; ++d) dst[d] = numeric::float_to_e4m3(x[d] / scale);
  std::memcpy(block + c.block_size * kIndexHeadDim + off * sizeof(float), &scale, sizeof scale);
}

float round_to_bf16(float x) { return numeric::bf16_to_float(numeric::float_to_bf16(x)); }

}  // namespace

void write_index_cache(const WriteIndexCacheArgs& a) {
  const int64_t n = a.k.shape[0];
  const int64_t* slot_mapping = a.slot_mapping.ptr<const int64_t>();
  check_slots("write_index_cache", slot_mapping, n, a.cache);
  const IndexCacheView c = cache_view(a.cache);
  // Rows with the same slot race; one of them wins.
#pragma omp parallel for schedule(static) if (n >= 64)
  for (int64_t i = 0; i < n; ++i) {
    if (slot_mapping[i] < 0) continue;
    float x[kIndexHeadDim];
    for (int d = 0; d < kIndexHeadDim; ++d) x[d] = load_float(a.k, i * a.k.strides[0] + d);
    store_index_key(c, slot_mapping[i], x);
  }
}

void write_pooled_index_cache(const WritePooledIndexCacheArgs& a) {
  const int64_t pools = a.k.shape[0], kpool = a.k.shape[1];
  const int64_t* slot_mapping = a.slot_mapping.ptr<const int64_t>();
  check_slots("write_pooled_index_cache", slot_mapping, pools, a.cache);
  const IndexCacheView c = cache_view(a.cache);
  const float* ape = a.ape.ptr<const float>();
#pragma omp parallel for schedule(static) if (pools >= 64)
  for (int64_t p = 0; p < pools; ++p) {
    if (slot_mapping[p] < 0) continue;
    // Per dimension, softmax over the pool's tokens of gate + ape, weighting their keys (vLLM's kpool compress).
    float max_score[kIndexHeadDim], denom[kIndexHeadDim] = {}, x[kIndexHeadDim] = {};
    std::fill(max_score, max_score + kIndexHeadDim, -INFINITY);
    auto score = [&](int64_t m, int d) {
      return load_float(a.gate, p * a.gate.strides[0] + m * a.gate.strides[1] + d) + ape[m * a.ape.strides[0] + d];
    };
    for (int64_t m = 0; m < kpool; ++m)
      for (int d = 0; d < kIndexHeadDim; ++d) max_score[d] = std::fmax(max_score[d], score(m, d));
    for (int64_t m = 0; m < kpool; ++m)
      for (int d = 0; d < kIndexHeadDim; ++d) {
        const float w = std::exp(score(m, d) - max_score[d]);
        denom[d] += w;
        x[d] += w * load_float(a.k, p * a.k.strides[0] + m * a.k.strides[1] + d);
      }
    // bf16 before and after the rotation, as the model's kernel rounds them.
    for (int d = 0; d < kIndexHeadDim; ++d) x[d] = round_to_bf16(x[d] / denom[d]);
    if (a.hadamard) {
      numeric::hadamard128(x);
      for (int d = 0; d < kIndexHeadDim; ++d) x[d] = round_to_bf16(x[d]);
    }
    store_index_key(c, slot_mapping[p], x);
  }
}

void pools_to_positions(const PoolsToPositionsArgs& a) {
  const int64_t tokens = a.pools.shape[0], kp = a.pools.shape[1], kpool = a.kpool;
  const int32_t* context_lens = a.context_lens.ptr<const int32_t>();
  for (int64_t t = 0; t < tokens; ++t)
    if (context_lens[t] < 0)
      fail("pools_to_positions: context_lens: row " + std::to_string(t) + " holds " +
           std::to_string(context_lens[t]) + ", a negative length");
#pragma omp parallel for schedule(static) if (tokens * kp >= 4096)
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t whole_pools = context_lens[t] / kpool, tail_start = whole_pools * kpool;
    const int32_t* pool = a.pools.ptr<const int32_t>() + t * a.pools.strides[0];
    int32_t* out = a.positions.ptr<int32_t>() + t * a.positions.strides[0];
    for (int64_t i = 0; i < kp; ++i)
      for (int64_t m = 0; m < kpool; ++m)
        out[i * kpool + m] = pool[i] >= 0 && pool[i] < whole_pools ? static_cast<int32_t>(pool[i] * kpool + m) : -1;
    for (int64_t m = 0; m < kpool - 1; ++m)
      out[kp * kpool + m] = tail_start + m < context_lens[t] ? static_cast<int32_t>(tail_start + m) : -1;
  }
}

void rotate_index_q(const RotateIndexQArgs& a) {
  const int64_t tokens = a.q.shape[0], heads = a.q.shape[1];
  const bool fp8 = a.q_out.dtype == DType::fp8_e4m3;
#pragma omp parallel for schedule(static) if (tokens * heads >= 256)
  for (int64_t row = 0; row < tokens * heads; ++row) {
    const int64_t t = row / heads, h = row % heads;
    float x[kIndexHeadDim];
    for (int d = 0; d < kIndexHeadDim; ++d) x[d] = load_float(a.q, t * a.q.strides[0] + h * a.q.strides[1] + d);
    numeric::hadamard128(x);
    float amax = 0.f;
    for (int d = 0; d < kIndexHeadDim; ++d) {
      x[d] = round_to_bf16(x[d]);
      amax = std::fmax(amax, std::fabs(x[d]));
    }
    const int64_t out = t * a.q_out.strides[0] + h * a.q_out.strides[1];
    if (!fp8) {
      auto* dst = a.q_out.ptr<uint16_t>() + out;
      for (int d = 0; d < kIndexHeadDim; ++d) dst[d] = numeric::float_to_bf16(x[d]);
      continue;
    }
    const float scale = numeric::index_key_scale(amax);
    auto* dst = a.q_out.ptr<uint8_t>() + out;
    for (int d = 0; d < kIndexHeadDim; ++d) dst[d] = numeric::float_to_e4m3(x[d] / scale);
    a.q_scale.ptr<float>()[t * a.q_scale.strides[0] + h * a.q_scale.strides[1]] = scale;
  }
}

void indexer_topk(const IndexerTopkArgs& a) {
  constexpr std::string_view op = "indexer_topk";
  const int64_t tokens = a.q.shape[0], k = a.topk.shape[1];
  const IndexCacheView cache = cache_view(a.index_cache);
  const int64_t num_blocks = a.index_cache.shape[0], bs = cache.block_size;
  const int64_t capacity = a.block_table.shape[1] * bs;
  const int32_t* context_lens = a.context_lens.ptr<const int32_t>();

  thread_local std::vector<const int32_t*> rows;
  const int32_t** row = grow(rows, static_cast<size_t>(tokens));
  for (int64_t t = 0; t < tokens; ++t) {
    row[t] = block_row(a.request_ids, a.block_table, t, op);
    const int64_t ctx = context_lens[t];
    if (ctx < 0 || ctx > capacity)
      fail(std::string(op) + ": context_lens: row " + std::to_string(t) + " holds " + std::to_string(ctx) +
           ", outside [0, max_blocks * block_size = " + std::to_string(capacity) + "]");
    for (int64_t i = 0; i < (ctx + bs - 1) / bs; ++i)
      if (row[t][i] < 0 || row[t][i] >= num_blocks)
        fail(std::string(op) + ": block_table: row " + std::to_string(a.request_ids.ptr<const int32_t>()[t]) +
             " (request of token " + std::to_string(t) + "), entry " + std::to_string(i) + " holds block " +
             std::to_string(row[t][i]) + ", outside [0, " + std::to_string(num_blocks) +
             ") but is read for context length " + std::to_string(ctx));
  }

  const auto& kernel = indexer::score_kernel(active_isa());
  const indexer::QueryLayout layout = kernel.layout(static_cast<int>(a.q.shape[1]), a.q.dtype);
  struct alignas(64) Line {
    std::byte bytes[64];
  };
  const size_t query_lines = (layout.query_bytes() + 63) / 64;
  const size_t weight_lines = (layout.weight_count() * sizeof(float) + 63) / 64;
  thread_local std::vector<Line> queries, weights;
  thread_local std::vector<uint32_t> keys;
  thread_local std::vector<int64_t> key_start, item_start;

  // Tokens go in batches whose scores fit a bounded buffer (prefill can have
  // many tokens with long contexts); each batch is one parallel region.
  constexpr int64_t kMaxBatchKeys = int64_t{1} << 24;
  constexpr int64_t kChunk = 1024;  // positions per work item: enough items to balance threads
  for (int64_t t0 = 0; t0 < tokens;) {
    int64_t t1 = t0, total = 0;
    while (t1 < tokens && (t1 == t0 || total + context_lens[t1] <= kMaxBatchKeys)) total += context_lens[t1++];
    const int64_t batch = t1 - t0;
    int64_t* kstart = grow(key_start, batch + 1);
    int64_t* istart = grow(item_start, batch + 1);
    kstart[0] = istart[0] = 0;
    for (int64_t b = 0; b < batch; ++b) {
      kstart[b + 1] = kstart[b] + context_lens[t0 + b];
      istart[b + 1] = istart[b] + (context_lens[t0 + b] + kChunk - 1) / kChunk;
    }
    std::byte* qbuf = grow(queries, batch * query_lines)->bytes;
    auto* wbuf = reinterpret_cast<float*>(grow(weights, batch * weight_lines)->bytes);
    uint32_t* kbuf = grow(keys, static_cast<size_t>(total));
    const int64_t items = istart[batch];

#pragma omp parallel
    {
#pragma omp for schedule(static)
      for (int64_t b = 0; b < batch; ++b) {
        const int64_t t = t0 + b;
        indexer::QueryRow q;
        q.dtype = a.q.dtype;
        q.q = static_cast<const std::byte*>(a.q.data) + t * a.q.strides[0] * dtype_size(a.q.dtype);
        q.head_stride = a.q.strides[1];
        q.heads = static_cast<int>(a.q.shape[1]);
        q.weights = a.weights.ptr<const float>() + t * a.weights.strides[0];
        if (a.q_scale.defined()) q.q_scale = a.q_scale.ptr<const float>() + t * a.q_scale.strides[0];
        kernel.pack(layout, q, qbuf + b * query_lines * 64, wbuf + b * weight_lines * 16);
      }
#pragma omp for schedule(dynamic, 1)
      for (int64_t item = 0; item < items; ++item) {
        const int64_t b = std::upper_bound(istart, istart + batch + 1, item) - istart - 1;
        const int64_t s0 = (item - istart[b]) * kChunk;
        const int64_t s1 = std::min<int64_t>(s0 + kChunk, context_lens[t0 + b]);
        kernel.score(layout, qbuf + b * query_lines * 64, wbuf + b * weight_lines * 16, cache, row[t0 + b], s0, s1,
                     kbuf + kstart[b] + s0);
      }
#pragma omp for schedule(dynamic, 1)
      for (int64_t b = 0; b < batch; ++b)
        indexer::select_topk(kbuf + kstart[b], context_lens[t0 + b], k,
                             a.topk.ptr<int32_t>() + (t0 + b) * a.topk.strides[0], a.sorted);
    }
    t0 = t1;
  }
}

void positions_to_slots(const PositionsToSlotsArgs& a) {
  const int64_t tokens = a.positions.shape[0], k = a.positions.shape[1], bs = a.block_size;
  const int64_t capacity = a.block_table.shape[1] * bs;
  for (int64_t t = 0; t < tokens; ++t) block_row(a.request_ids, a.block_table, t, "positions_to_slots");
#pragma omp parallel for schedule(static) if (tokens * k >= 16384)
  for (int64_t t = 0; t < tokens; ++t) {
    const int32_t* blocks = a.block_table.ptr<const int32_t>() + a.request_ids.ptr<const int32_t>()[t] *
                                                                     a.block_table.strides[0];
    const int32_t* pos = a.positions.ptr<const int32_t>() + t * a.positions.strides[0];
    int32_t* slot = a.slots.ptr<int32_t>() + t * a.slots.strides[0];
    for (int64_t i = 0; i < k; ++i) {
      const int64_t block = pos[i] < 0 || pos[i] >= capacity ? -1 : blocks[pos[i] / bs];
      const int64_t s = block < 0 ? -1 : block * bs + pos[i] % bs;
      slot[i] = s > INT32_MAX ? -1 : static_cast<int32_t>(s);  // a slot int32 cannot hold is no slot
    }
  }
}

}  // namespace smla::cpu
