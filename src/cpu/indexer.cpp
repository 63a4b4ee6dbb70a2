// The CPU indexer ops: write_index_cache, indexer_topk, positions_to_slots.
// Index values (slots, request ids, context lengths, block ids) are checked
// here, serially and before any parallel work, so errors are thrown outside
// OpenMP regions. Scratch buffers are thread_local vectors that only grow:
// after the first call of a given size the hot path allocates nothing.
#include "cpu/indexer.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstring>
#include <functional>
#include <string>
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

Isa detect_isa() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("fma"))
    return Isa::avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::avx2;
#endif
  return Isa::portable;
}

std::atomic<int> forced_isa{-1};

}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "portable";
  }
}

Isa best_isa() {
  static const Isa isa = detect_isa();
  return isa;
}

bool isa_supported(Isa isa) { return static_cast<int>(isa) <= static_cast<int>(best_isa()); }

Isa active_isa() {
  const int f = forced_isa.load(std::memory_order_relaxed);
  return f < 0 ? best_isa() : static_cast<Isa>(f);
}

void force_isa(std::optional<Isa> isa) {
  if (isa && !isa_supported(*isa))
    throw Error(ErrorKind::unsupported, std::string("indexer: this CPU cannot run the ") + isa_name(*isa) + " kernel");
  forced_isa.store(isa ? static_cast<int>(*isa) : -1, std::memory_order_relaxed);
}

void select_topk(const uint32_t* keys, int64_t n, int64_t k, int32_t* out) {
  const int64_t m = std::min(k, n);
  std::fill(out + m, out + k, -1);
  if (m == 0) return;

  // Radix select of the m-th largest key, 11 + 11 + 10 bits; the first
  // level's bin is copied out so later levels scan only it. With m == n the
  // threshold stays 0 and everything is taken.
  thread_local std::vector<uint32_t> candidates;
  thread_local std::vector<uint64_t> picked;
  uint32_t threshold = 0;    // the m-th largest key
  int64_t equal_needed = m;  // how many keys equal to the threshold to take
  if (m < n) {
    constexpr int kShift[3] = {21, 10, 0};
    constexpr uint32_t kMask[3] = {2047, 2047, 1023};
    uint32_t* buffer = grow(candidates, static_cast<size_t>(n));
    const uint32_t* cand = keys;
    int64_t count = n;
    for (int level = 0; level < 3; ++level) {
      uint32_t hist[2048] = {};
      for (int64_t i = 0; i < count; ++i) ++hist[(cand[i] >> kShift[level]) & kMask[level]];
      uint32_t bin = kMask[level];
      while (hist[bin] < equal_needed) equal_needed -= hist[bin--];  // the bins hold >= equal_needed keys
      threshold |= bin << kShift[level];
      if (level == 2) break;
      int64_t kept = 0;
      for (int64_t i = 0; i < count; ++i)
        if (((cand[i] >> kShift[level]) & kMask[level]) == bin) buffer[kept++] = cand[i];
      cand = buffer;
      count = kept;
    }
  }

  uint64_t* p = grow(picked, static_cast<size_t>(m));
  int64_t np = 0;
  // Ascending positions, so equal keys are taken lowest position first.
  for (int64_t s = 0; s < n; ++s) {
    const uint32_t key = keys[s];
    bool take = key > threshold;
    if (key == threshold && equal_needed > 0) {
      take = true;
      --equal_needed;
    }
    if (take) p[np++] = (static_cast<uint64_t>(key) << 32) | ~static_cast<uint32_t>(s);
  }
  // Descending composite: larger key first, then lower position (larger ~position).
  std::sort(p, p + np, std::greater<>());
  for (int64_t i = 0; i < np; ++i) out[i] = static_cast<int32_t>(~static_cast<uint32_t>(p[i]));
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

}  // namespace

void write_index_cache(const WriteIndexCacheArgs& a) {
  const int64_t n = a.k.shape[0], slots = num_slots(a.cache);
  const int64_t* slot_mapping = a.slot_mapping.ptr<const int64_t>();
  for (int64_t i = 0; i < n; ++i)
    if (slot_mapping[i] >= slots)
      fail("write_index_cache: slot_mapping: row " + std::to_string(i) + " holds slot " +
           std::to_string(slot_mapping[i]) + ", but the cache has " + std::to_string(slots) +
           " slots (num_blocks * block_size)");
  const IndexCacheView c = cache_view(a.cache);
  // Rows with the same slot race; one of them wins.
#pragma omp parallel for schedule(static) if (n >= 64)
  for (int64_t i = 0; i < n; ++i) {
    const int64_t slot = slot_mapping[i];
    if (slot < 0) continue;
    uint8_t* block = const_cast<uint8_t*>(c.base) + slot / c.block_size * c.block_stride;
    const int64_t off = slot % c.block_size;
    float x[kIndexHeadDim];
    float amax = 0.f;
    for (int d = 0; d < kIndexHeadDim; ++d) {
      x[d] = load_float(a.k, i * a.k.strides[0] + d);
      amax = std::fmax(amax, std::fabs(x[d]));
    }
    if (!c.fp8) {
      auto* dst = reinterpret_cast<uint16_t*>(block + off * c.row_stride);
      for (int d = 0; d < kIndexHeadDim; ++d) dst[d] = numeric::float_to_bf16(x[d]);
      continue;
    }
    const float scale = numeric::index_key_scale(amax);
    uint8_t* dst = block + off * kIndexHeadDim;
    for (int d = 0; d < kIndexHeadDim; ++d) dst[d] = numeric::float_to_e4m3(x[d] / scale);
    std::memcpy(block + c.block_size * kIndexHeadDim + off * sizeof(float), &scale, sizeof scale);
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

  const auto& kernel = indexer::score_kernel(indexer::active_isa());
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
                             a.topk.ptr<int32_t>() + (t0 + b) * a.topk.strides[0]);
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
