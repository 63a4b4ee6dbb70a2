// The CPU attention ops. The checks (smla::check) have vouched for shapes,
// dtypes and strides; this driver checks the index values it can read (slots,
// lengths, block ids), turns each token's indices or block-table positions into
// a list of cache-row pointers, and spreads (token, split) work items over
// OpenMP threads. attention_kernels.cpp does the arithmetic.
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/numeric.h"
#include "cpu/attention_kernels.h"
#include "cpu/kernels.h"
#include "smla/error.h"

namespace smla::cpu {

namespace {

using attn::padded_heads;

using V4 = MlaV4CacheLayout;

// Token `offset` of an fp8_ds_mla_v4 block as 512 bf16 values, exactly: e4m3 times a power of two is a bf16 (the
// writer's scales are >= 2^-14; a smaller stored one rounds, an exponent byte of 255 is NaN as in ue8m0).
void dequantize_v4(const uint8_t* block, int64_t block_size, int64_t offset, uint16_t* dst) {
  const uint8_t* values = block + V4::value_offset(offset);
  const uint8_t* scales = block + V4::scale_offset(block_size, offset);
  const auto& e4m3 = numeric::e4m3_table();
  for (int tile = 0; tile < V4::kTiles; ++tile) {
    const float scale = scales[tile] == 255 ? NAN : std::ldexp(1.f, int(scales[tile]) - 127);
    for (int i = tile * V4::kTile; i < (tile + 1) * V4::kTile; ++i)
      dst[i] = numeric::float_to_bf16(e4m3[values[i]] * scale);
  }
  std::memcpy(dst + V4::kNopeDim, values + V4::kNopeDim, 2 * V4::kRopeDim);
}

// Byte addressing of a [num_blocks, block_size, row] cache with padded strides.
struct CacheLayout {
  uint8_t* base;
  int64_t num_blocks, block_size, block_stride, row_stride;  // strides in bytes
  bool v4;  // fp8_ds_mla_v4: laid out per block, rows read through dequantize_v4

  explicit CacheLayout(const TensorView& c)
      : base(c.ptr<uint8_t>()),
        num_blocks(c.shape[0]),
        block_size(c.shape[1]),
        block_stride(c.strides[0] * static_cast<int64_t>(dtype_size(c.dtype))),
        row_stride(c.strides[1] * static_cast<int64_t>(dtype_size(c.dtype))),
        v4(c.dtype == DType::fp8_ds_mla_v4) {}
  int64_t num_slots() const { return num_blocks * block_size; }
  uint8_t* row(int64_t block, int64_t offset) const { return base + block * block_stride + offset * row_stride; }
  uint8_t* slot(int64_t s) const { return row(s / block_size, s % block_size); }
  // The row the kernels read for token `offset` of `block`: the cache's own, or for fp8_ds_mla_v4 its bf16
  // dequantisation, written to `dequantized` (kMlaVDim values).
  const uint8_t* kernel_row(int64_t block, int64_t offset, uint16_t* dequantized) const {
    if (!v4) return row(block, offset);
    dequantize_v4(base + block * block_stride, block_size, offset, dequantized);
    return reinterpret_cast<const uint8_t*>(dequantized);
  }
};

// A grow-only, 64-byte aligned buffer: once warmed up, calls allocate nothing.
class Buffer {
 public:
  std::byte* reserve(size_t bytes) {
    if (bytes > size_) {
      data_.reset(static_cast<std::byte*>(::operator new(bytes, std::align_val_t{64})));
      size_ = bytes;
    }
    return data_.get();
  }

 private:
  struct Free {
    void operator()(std::byte* p) const { ::operator delete(p, std::align_val_t{64}); }
  };
  std::unique_ptr<std::byte, Free> data_;
  size_t size_ = 0;
};

// Scratch of the calling thread, sized before each parallel region (so nothing
// inside it allocates or throws): per OpenMP thread, and the split partials.
struct Scratch {
  std::vector<Buffer> per_thread;
  std::vector<std::byte*> thread_ptr;
  Buffer partials;
};
Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

// Element offset of token t in a tensor whose leading dims are [T] (per_batch = 1)
// or [B, s_q] (per_batch = s_q), with strides sb and sj.
struct TokenIndex {
  int64_t per_batch, sb, sj;
  int64_t operator()(int64_t t) const { return (t / per_batch) * sb + (t % per_batch) * sj; }
};

struct Problem {
  int64_t tokens = 0;
  int heads = 0;
  int64_t max_rows = 0;  // most positions any token has
  const TensorView* q;
  const TensorView* out;
  const TensorView* lse;
  TokenIndex q_at, out_at, lse_at;
  int64_t q_head_stride, out_head_stride, lse_head_stride;
  float empty_lse = -INFINITY;
  float* max_logits = nullptr;  // optional
  TokenIndex max_logits_at{1, 0, 0};
  int64_t max_logits_head_stride = 0;
  const float* sink;
  float scale;
  DType cache_dtype;  // the rows' dtype as the kernels see them: bf16 for an fp8_ds_mla_v4 cache
  bool dequantize;    // fp8_ds_mla_v4: each work item dequantises its rows into per-thread scratch
  MlaHead head;
};

// The kernels' view of a cache of `dtype` (see Problem).
DType kernel_cache_dtype(DType dtype) { return dtype == DType::fp8_ds_mla_v4 ? DType::bf16 : dtype; }

// Work items per token: the fewest splits whose makespan, ceil(tokens * s / threads) / s,
// is within 10% of tokens / threads, keeping >= 128 rows per split.
int choose_splits(int64_t tokens, int64_t max_rows, int threads) {
  const int limit = static_cast<int>(std::clamp<int64_t>(max_rows / 128, 1, attn::kMaxSplits));
  const double ideal = static_cast<double>(tokens) / threads;
  for (int s = 1; s < limit; ++s)
    if (static_cast<double>((tokens * s + threads - 1) / threads) / s <= 1.1 * ideal) return s;
  return limit;
}

// Runs attention for every token; `rows.count(t)` is the number of positions of
// token t and `rows.fill(t, k0, k1, list, dequantized)` writes the valid rows among
// positions [k0, k1) to `list`, returning how many (fp8_ds_mla_v4 rows dequantised
// into `dequantized`, kMlaVDim values per row; null for the other caches).
template <class Rows>
void run_attention(const Problem& p, const Rows& rows) {
  if (p.tokens == 0) return;
  const attn::Kernels& kernels = attn::active_kernels();
  const int threads = omp_get_max_threads();
  const int splits = choose_splits(p.tokens, p.max_rows, threads);
  const int hp = padded_heads(p.heads);
  const size_t part_floats = size_t(hp) * (kMlaVDim + 2);  // acc, m, l
  const size_t ws_bytes = round_up(kernels.workspace_bytes(p.heads), 64);
  const size_t list_bytes = round_up(sizeof(const uint8_t*) * std::max<int64_t>(p.max_rows, 1), 64);
  const size_t own_part_bytes = splits == 1 ? round_up(part_floats * sizeof(float), 64) : 0;
  const size_t dequant_bytes = p.dequantize ? size_t(p.max_rows / splits + 1) * kMlaVDim * sizeof(uint16_t) : 0;

  Scratch& s = scratch();
  if (s.per_thread.size() < size_t(threads)) s.per_thread.resize(threads);
  s.thread_ptr.resize(s.per_thread.size());
  for (int i = 0; i < threads; ++i) s.thread_ptr[i] = s.per_thread[i].reserve(ws_bytes + list_bytes + own_part_bytes + dequant_bytes);
  float* partials =
      splits > 1 ? reinterpret_cast<float*>(s.partials.reserve(p.tokens * splits * part_floats * sizeof(float)))
                 : nullptr;
  std::byte* const* thread_ptr = s.thread_ptr.data();

  const auto finalize = [&](int64_t t, const float* part, int n_parts, int h_begin, int h_end) {
    attn::FinalizeJob f;
    f.acc = part;
    f.m = part + size_t(hp) * kMlaVDim;
    f.l = f.m + hp;
    f.part_stride = static_cast<int64_t>(part_floats);
    f.n_parts = n_parts;
    f.h_begin = h_begin;
    f.h_end = h_end;
    f.sink = p.sink;
    f.out = p.out->ptr<uint16_t>() + p.out_at(t);
    f.out_head_stride = p.out_head_stride;
    f.out_dtype = p.out->dtype;
    f.lse = p.lse->ptr<float>() + p.lse_at(t);
    f.lse_head_stride = p.lse_head_stride;
    f.empty_lse = p.empty_lse;
    f.max_logits = p.max_logits ? p.max_logits + p.max_logits_at(t) : nullptr;
    f.max_logits_head_stride = p.max_logits_head_stride;
    kernels.finalize(f);
  };

#pragma omp parallel num_threads(threads)
  {
    std::byte* mine = thread_ptr[omp_get_thread_num()];
    auto* list = reinterpret_cast<const uint8_t**>(mine + ws_bytes);
    float* own_part = reinterpret_cast<float*>(mine + ws_bytes + list_bytes);
    auto* dequantized =
        p.dequantize ? reinterpret_cast<uint16_t*>(mine + ws_bytes + list_bytes + own_part_bytes) : nullptr;
#pragma omp for schedule(dynamic)
    for (int64_t item = 0; item < p.tokens * splits; ++item) {
      const int64_t t = item / splits, split = item % splits;
      const int64_t n_pos = rows.count(t);
      float* part = splits == 1 ? own_part : partials + item * part_floats;
      attn::AttendJob j;
      j.q = static_cast<const uint16_t*>(p.q->data) + p.q_at(t);
      j.q_head_stride = p.q_head_stride;
      j.q_dtype = p.q->dtype;
      j.heads = p.heads;
      j.head = p.head;
      j.cache_dtype = p.cache_dtype;
      j.rows = list;
      j.n_rows = rows.fill(t, n_pos * split / splits, n_pos * (split + 1) / splits, list, dequantized);
      j.scale = p.scale;
      j.acc = part;
      j.m = part + size_t(hp) * kMlaVDim;
      j.l = j.m + hp;
      j.workspace = mine;
      kernels.attend(j);
      if (splits == 1) finalize(t, part, 1, 0, p.heads);
    }
    if (splits > 1) {
      constexpr int kHeadGroup = 16;
      const int groups = (p.heads + kHeadGroup - 1) / kHeadGroup;
#pragma omp for schedule(static)
      for (int64_t item = 0; item < p.tokens * groups; ++item) {
        const int64_t t = item / groups;
        const int g = static_cast<int>(item % groups);
        finalize(t, partials + t * splits * part_floats, splits, g * kHeadGroup,
                 std::min(p.heads, (g + 1) * kHeadGroup));
      }
    }
  }
}

// Each token's list of slots into one cache.
struct SlotList {
  const int32_t* indices;
  int64_t index_stride;
  const int32_t* lengths;  // optional
  int64_t length_stride;
  int64_t topk;
  CacheLayout cache;

  int64_t count(int64_t t) const { return lengths ? lengths[t * length_stride] : topk; }
  int64_t fill(int64_t t, int64_t k0, int64_t k1, const uint8_t** list, uint16_t* dequantized) const {
    const int32_t* idx = indices + t * index_stride;
    const int64_t num_slots = cache.num_slots();
    int64_t n = 0;
    for (int64_t k = k0; k < k1; ++k)
      if (idx[k] >= 0 && idx[k] < num_slots) {
        list[n] = cache.kernel_row(idx[k] / cache.block_size, idx[k] % cache.block_size,
                                   dequantized ? dequantized + n * kMlaVDim : nullptr);
        ++n;
      }
    return n;
  }
};

// A token's positions: its main list, then its extra list (the second cache) when there is one. Rows are pointers,
// so one softmax runs over both caches whatever their block sizes.
struct SparseRows {
  SlotList main;
  std::optional<SlotList> extra;

  int64_t count(int64_t t) const { return main.count(t) + (extra ? extra->count(t) : 0); }
  int64_t fill(int64_t t, int64_t k0, int64_t k1, const uint8_t** list, uint16_t* dequantized) const {
    const int64_t n_main = main.count(t);
    int64_t n = main.fill(t, std::min(k0, n_main), std::min(k1, n_main), list, dequantized);
    if (extra)
      n += extra->fill(t, std::max(k0, n_main) - n_main, std::max(k1, n_main) - n_main, list + n,
                       dequantized ? dequantized + n * kMlaVDim : nullptr);
    return n;
  }
};

struct PagedRows {
  const int32_t* table;
  int64_t table_stride;
  const int32_t* seq_lens;
  int64_t seq_len_stride;
  int64_t s_q;
  bool causal;
  CacheLayout cache;

  int64_t count(int64_t t) const {
    const int64_t len = seq_lens[(t / s_q) * seq_len_stride];
    return causal ? len - s_q + t % s_q + 1 : len;
  }
  int64_t fill(int64_t t, int64_t k0, int64_t k1, const uint8_t** list, uint16_t* dequantized) const {
    const int32_t* blocks = table + (t / s_q) * table_stride;
    for (int64_t pos = k0; pos < k1; ++pos)
      list[pos - k0] = cache.kernel_row(blocks[pos / cache.block_size], pos % cache.block_size,
                                        dequantized ? dequantized + (pos - k0) * kMlaVDim : nullptr);
    return k1 - k0;
  }
};

// One row of write_mla_cache: `get(i)` reads value i of the latent (i < 512) or k_pe (i >= 512) as float.
// With no rope part, an fp8_ds_mla envelope's rope bytes are left as they are (nothing reads them).
template <class Get>
void write_row(DType cache_dtype, MlaHead head, const Get& get, uint8_t* dst) {
  if (!is_fp8_mla_cache(cache_dtype)) {
    auto* out = reinterpret_cast<uint16_t*>(dst);
    for (int i = 0; i < head.qk_dim(); ++i)
      out[i] = cache_dtype == DType::bf16 ? numeric::float_to_bf16(get(i)) : numeric::float_to_f16(get(i));
    return;
  }
  float scales[4];
  for (int tile = 0; tile < 4; ++tile) {
    float x[128], amax = 0.f;
    for (int i = 0; i < 128; ++i) {
      x[i] = get(tile * 128 + i);
      amax = std::fmax(amax, std::fabs(x[i]));
    }
    scales[tile] = numeric::ds_mla_tile_scale(amax);
    for (int i = 0; i < 128; ++i) dst[tile * 128 + i] = numeric::float_to_e4m3(x[i] / scales[tile]);
  }
  std::memcpy(dst + kMlaLatentDim, scales, sizeof scales);
  for (int i = 0; i < head.rope_dim; ++i) {
    const uint16_t h = numeric::float_to_bf16(get(kMlaLatentDim + i));
    std::memcpy(dst + kMlaLatentDim + sizeof scales + 2 * i, &h, 2);
  }
}

// One token of an fp8_ds_mla_v4 block (`get(i)`, i < 512, as in write_row): each tile of 64 of the first 448
// values quantised with the power-of-two scale of its amax (fp8_ds_mla's rule), the last 64 rounded to bf16.
// The pad byte after the 7 scales is left as it is (nothing reads it).
template <class Get>
void write_v4_token(const Get& get, uint8_t* block, int64_t block_size, int64_t offset) {
  uint8_t* values = block + V4::value_offset(offset);
  uint8_t* scales = block + V4::scale_offset(block_size, offset);
  for (int tile = 0; tile < V4::kTiles; ++tile) {
    float x[V4::kTile], amax = 0.f;
    for (int i = 0; i < V4::kTile; ++i) {
      x[i] = get(tile * V4::kTile + i);
      amax = std::fmax(amax, std::fabs(x[i]));
    }
    const float scale = numeric::ds_mla_tile_scale(amax);
    scales[tile] = static_cast<uint8_t>(std::bit_cast<uint32_t>(scale) >> 23);  // ue8m0: the exponent byte
    for (int i = 0; i < V4::kTile; ++i) values[tile * V4::kTile + i] = numeric::float_to_e4m3(x[i] / scale);
  }
  for (int i = 0; i < V4::kRopeDim; ++i) {
    const uint16_t h = numeric::float_to_bf16(get(V4::kNopeDim + i));
    std::memcpy(values + V4::kNopeDim + 2 * i, &h, 2);
  }
}

float value_at(const TensorView& t, int64_t offset) {
  switch (t.dtype) {
    case DType::f32: return t.ptr<const float>()[offset];
    case DType::f16: return numeric::f16_to_float(t.ptr<const uint16_t>()[offset]);
    default: return numeric::bf16_to_float(t.ptr<const uint16_t>()[offset]);
  }
}

}  // namespace

void write_mla_cache(const WriteMlaCacheArgs& a) {
  const int64_t n = a.latent.shape[0];
  const CacheLayout cache(a.cache);
  const auto* slots = a.slot_mapping.ptr<const int64_t>();
  const int64_t slot_stride = a.slot_mapping.strides[0];
  const MlaHead head = written_head(a);
  for (int64_t i = 0; i < n; ++i)
    if (slots[i * slot_stride] >= cache.num_slots())
      fail("write_mla_cache: slot_mapping: row " + std::to_string(i) + " holds slot " +
           std::to_string(slots[i * slot_stride]) + ", beyond the cache's " + std::to_string(cache.num_slots()) +
           " slots (num_blocks x block_size)");
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const int64_t slot = slots[i * slot_stride];
    if (slot < 0) continue;
    const int64_t lat = i * a.latent.strides[0], rope = head.rope_dim ? i * a.k_pe.strides[0] : 0;
    const auto get = [&](int d) {
      return d < kMlaLatentDim ? value_at(a.latent, lat + d) : value_at(a.k_pe, rope + d - kMlaLatentDim);
    };
    if (cache.v4)
      write_v4_token(get, cache.row(slot / cache.block_size, 0), cache.block_size, slot % cache.block_size);
    else
      write_row(a.cache.dtype, head, get, cache.slot(slot));
  }
}

namespace {

// One cache's list of slots per token, its lengths checked against K.
SlotList slot_list(const TensorView& indices, const TensorView& lengths_view, const TensorView& cache,
                   const char* lengths_name, const char* k_name) {
  const int64_t tokens = indices.shape[0], topk = indices.shape[1];
  const auto* lengths = lengths_view.defined() ? lengths_view.ptr<const int32_t>() : nullptr;
  const int64_t length_stride = lengths ? lengths_view.strides[0] : 0;
  if (lengths)
    for (int64_t t = 0; t < tokens; ++t) {
      const int32_t len = lengths[t * length_stride];
      if (len < 0 || len > topk)
        fail("sparse_mla: " + std::string(lengths_name) + ": row " + std::to_string(t) + " is " + std::to_string(len) +
             ", outside [0, " + std::to_string(topk) + "] (" + k_name + ")");
    }
  return {indices.ptr<const int32_t>(), indices.strides[0], lengths, length_stride, topk, CacheLayout(cache)};
}

}  // namespace

void sparse_mla(const SparseMlaArgs& a) {
  const int64_t tokens = a.q.shape[0];
  SparseRows rows{slot_list(a.indices, a.topk_length, a.kv_cache, "topk_length", "K = indices.size(1)"),
                  std::nullopt};
  if (a.extra_indices.defined())  // with a cache of no blocks (null data) too: then every extra index is invalid
    rows.extra = slot_list(a.extra_indices, a.extra_topk_length, a.extra_kv_cache, "extra_topk_length",
                           "K2 = extra_indices.size(1)");
  Problem p;
  p.tokens = tokens;
  p.heads = static_cast<int>(a.q.shape[1]);
  p.max_rows = rows.main.topk + (rows.extra ? rows.extra->topk : 0);
  p.q = &a.q;
  p.out = &a.out;
  p.lse = &a.lse;
  p.q_at = {1, a.q.strides[0], 0};
  p.out_at = {1, a.out.strides[0], 0};
  p.lse_at = {1, a.lse.strides[0], 0};
  p.q_head_stride = a.q.strides[1];
  p.out_head_stride = a.out.strides[1];
  p.lse_head_stride = a.lse.strides[1];
  p.empty_lse = a.empty_lse_plus_inf ? INFINITY : -INFINITY;
  if (a.max_logits.defined()) {
    p.max_logits = a.max_logits.ptr<float>();
    p.max_logits_at = {1, a.max_logits.strides[0], 0};
    p.max_logits_head_stride = a.max_logits.strides[1];
  }
  p.sink = a.attn_sink.defined() ? a.attn_sink.ptr<const float>() : nullptr;
  p.scale = a.softmax_scale;
  p.cache_dtype = kernel_cache_dtype(a.kv_cache.dtype);
  p.dequantize = a.kv_cache.dtype == DType::fp8_ds_mla_v4;
  p.head = *mla_head_for_qk_dim(a.q.shape[2]);
  run_attention(p, rows);
}

void paged_mla_decode(const PagedMlaDecodeArgs& a) {
  const int64_t batch = a.q.shape[0], s_q = a.q.shape[1];
  const int64_t max_blocks = a.block_table.shape[1];
  const CacheLayout cache(a.kv_cache);
  const auto* table = a.block_table.ptr<const int32_t>();
  const auto* seq_lens = a.seq_lens.ptr<const int32_t>();
  const int64_t table_stride = a.block_table.strides[0], len_stride = a.seq_lens.strides[0];
  int64_t max_rows = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = seq_lens[b * len_stride];
    const std::string row = "paged_mla_decode: seq_lens: row " + std::to_string(b) + " is " + std::to_string(len);
    if (len < 0) fail(row + "; lengths must be >= 0");
    if (len > max_blocks * cache.block_size)
      fail(row + ", beyond the block table's capacity of " + std::to_string(max_blocks) + " blocks x " +
           std::to_string(cache.block_size) + " = " + std::to_string(max_blocks * cache.block_size) + " positions");
    if (a.causal && len < s_q)
      fail(row + ", shorter than the s_q = " + std::to_string(s_q) + " new tokens it must contain (causal)");
    for (int64_t j = 0; j < (len + cache.block_size - 1) / cache.block_size; ++j) {
      const int64_t block = table[b * table_stride + j];
      if (block < 0 || block >= cache.num_blocks)
        fail("paged_mla_decode: block_table: row " + std::to_string(b) + ", column " + std::to_string(j) + " is " +
             std::to_string(block) + ", outside [0, " + std::to_string(cache.num_blocks) +
             ") (num_blocks), and seq_lens reads it");
    }
    max_rows = std::max(max_rows, len);
  }
  Problem p;
  p.tokens = batch * s_q;
  p.heads = static_cast<int>(a.q.shape[2]);
  p.max_rows = max_rows;
  p.q = &a.q;
  p.out = &a.out;
  p.lse = &a.lse;
  p.q_at = {s_q, a.q.strides[0], a.q.strides[1]};
  p.out_at = {s_q, a.out.strides[0], a.out.strides[1]};
  p.lse_at = {s_q, a.lse.strides[0], a.lse.strides[1]};
  p.q_head_stride = a.q.strides[2];
  p.out_head_stride = a.out.strides[2];
  p.lse_head_stride = a.lse.strides[2];
  p.empty_lse = a.empty_lse_plus_inf ? INFINITY : -INFINITY;
  p.sink = a.attn_sink.defined() ? a.attn_sink.ptr<const float>() : nullptr;
  p.scale = a.softmax_scale;
  p.cache_dtype = kernel_cache_dtype(a.kv_cache.dtype);
  p.dequantize = a.kv_cache.dtype == DType::fp8_ds_mla_v4;
  p.head = *mla_head_for_qk_dim(a.q.shape[3]);
  run_attention(p, PagedRows{table, table_stride, seq_lens, len_stride, s_q, a.causal, cache});
}

}  // namespace smla::cpu
