// The CPU attention ops (write_mla_cache, sparse_mla, paged_mla_decode)
// against the float64 references in support/mla_reference.h: random data
// (never zeros), NaN in every cache slot and padding byte that must not be
// read, NaN sentinels in the outputs (checked fully written, padding
// untouched), every kind of invalid index, every instruction set this CPU has,
// and the bad-input errors.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "cpu/attention_kernels.h"
#include "smla/error.h"
#include "smla/ops.h"
#include "smla/select.h"
#include "reference/mla_reference.h"
#include "support/test_util.h"

namespace smla {
namespace {

using cpu::Isa;
using test::Rng;

// Invalid indices besides num_slots (which depends on the cache).
constexpr int32_t kInvalidIndices[] = {-1, -2, std::numeric_limits<int32_t>::min(),
                                       std::numeric_limits<int32_t>::max()};

// ---------------------------------------------------------------------------
// Test tensors: owned memory, a strided view, NaN (or 0x7f bytes) everywhere at first.

struct Tensor {
  std::vector<uint64_t> mem;
  TensorView view;
};

void poison(Tensor& t) {
  auto* bytes = reinterpret_cast<uint8_t*>(t.mem.data());
  const size_t n = t.mem.size() * 8;
  for (size_t i = 0; i < n; ++i) {
    switch (t.view.dtype) {
      case DType::f32: bytes[i] = (i % 4 == 3) ? 0x7f : (i % 4 == 2) ? 0xc0 : 0; break;  // 0x7fc00000
      case DType::bf16: bytes[i] = (i % 2) ? 0x7f : 0xc0; break;                          // 0x7fc0
      case DType::f16: bytes[i] = (i % 2) ? 0x7e : 0x00; break;                           // 0x7e00
      default: bytes[i] = 0x7f; break;                                                    // e4m3 NaN
    }
  }
}

Tensor alloc(const std::vector<int64_t>& shape, DType dtype, const std::vector<int64_t>& strides = {}) {
  Tensor t;
  TensorView& v = t.view;
  v.ndim = static_cast<int>(shape.size());
  v.dtype = dtype;
  int64_t contiguous = 1, extent = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    v.shape[d] = shape[d];
    v.strides[d] = strides.empty() ? contiguous : strides[d];
    contiguous *= shape[d];
    extent += (shape[d] - 1) * v.strides[d];
  }
  t.mem.assign((std::max<int64_t>(extent, 1) * dtype_size(dtype) + 7) / 8, 0);
  v.data = t.mem.data();
  poison(t);
  return t;
}

// Element offsets of every logical element, row-major.
std::vector<int64_t> offsets(const TensorView& v) {
  std::vector<int64_t> out;
  std::vector<int64_t> idx(v.ndim, 0);
  for (int64_t i = 0; i < v.numel(); ++i) {
    int64_t off = 0;
    for (int d = 0; d < v.ndim; ++d) off += idx[d] * v.strides[d];
    out.push_back(off);
    for (int d = v.ndim - 1; d >= 0 && ++idx[d] == v.shape[d]; --d) idx[d] = 0;
  }
  return out;
}

void fill_half(Tensor& t, Rng& rng, float lo, float hi) {
  const auto offs = offsets(t.view);
  const auto bits = test::to_half_bits(test::random_floats(rng, offs.size(), lo, hi), t.view.dtype);
  for (size_t i = 0; i < offs.size(); ++i) t.view.ptr<uint16_t>()[offs[i]] = bits[i];
}

double element(const TensorView& v, int64_t off) {
  if (v.dtype == DType::f32) return v.ptr<float>()[off];
  return test::half_bits_to_float(v.ptr<uint16_t>()[off], v.dtype);
}

std::vector<double> read(const Tensor& t) {
  std::vector<double> out;
  for (int64_t off : offsets(t.view)) out.push_back(element(t.view, off));
  return out;
}

// Every logical element written (no NaN sentinel left), every padding element untouched.
void expect_written(const Tensor& t, const char* what) {
  const auto offs = offsets(t.view);
  std::vector<bool> logical(t.mem.size() * 8 / dtype_size(t.view.dtype), false);
  for (int64_t off : offs) logical[off] = true;
  Tensor fresh = t;
  poison(fresh);
  int64_t unwritten = 0, clobbered = 0;
  for (size_t i = 0; i < logical.size(); ++i) {
    const bool same = std::memcmp(reinterpret_cast<const uint8_t*>(t.mem.data()) + i * dtype_size(t.view.dtype),
                                  reinterpret_cast<const uint8_t*>(fresh.mem.data()) + i * dtype_size(t.view.dtype),
                                  dtype_size(t.view.dtype)) == 0;
    if (logical[i]) unwritten += std::isnan(element(t.view, static_cast<int64_t>(i)));
    else clobbered += !same;
  }
  EXPECT_EQ(unwritten, 0) << what << ": elements left unwritten (or NaN)";
  EXPECT_EQ(clobbered, 0) << what << ": padding elements overwritten";
}

// Pins the kernels' instruction set for one scope.
struct PinIsa {
  explicit PinIsa(std::optional<Isa> isa) { cpu::force_isa(isa); }
  ~PinIsa() { cpu::force_isa(std::nullopt); }
};

std::vector<Isa> available_isas() {
  std::vector<Isa> isas;
  for (Isa i : cpu::kAllIsas)
    if (cpu::isa_supported(i)) isas.push_back(i);
  return isas;
}

// ---------------------------------------------------------------------------
// Caches: only the listed slots hold data; every other slot and all padding stay poisoned.

struct CacheGeometry {
  DType dtype = DType::bf16;
  int64_t num_blocks = 8, block_size = 16;
  int64_t row_pad = 0, block_pad = 0;  // elements of padding after each row / block
  int rope_dim = kMlaRopeDim;          // 0: rows of a head with no rope part
};

// bf16 NaN in every row's rope part of an fp8_ds_mla cache that holds a head with no rope part: never read.
void poison_envelope_rope(Tensor& cache) {
  const int64_t blocks = cache.view.shape[0], block_size = cache.view.shape[1];
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t o = 0; o < block_size; ++o) {
      uint8_t* rope = cache.view.ptr<uint8_t>() + b * cache.view.strides[0] + o * cache.view.strides[1] +
                      kFp8DsMlaNopeRowBytes;
      for (int i = 0; i < kMlaRopeDim; ++i) {
        rope[2 * i] = 0xc0;
        rope[2 * i + 1] = 0x7f;
      }
    }
}

// The block padding FlashMLA gives an fp8_ds_mla_v4 cache: each block's bytes rounded up to a multiple of 576.
int64_t v4_block_pad(int64_t block_size) {
  const int64_t bytes = block_size * MlaV4CacheLayout::kRowBytes;
  return (bytes + 575) / 576 * 576 - bytes;
}

Tensor make_cache(Rng& rng, const CacheGeometry& g, const std::vector<int64_t>& slots) {
  const int64_t row = MlaHead{g.rope_dim}.cache_row(g.dtype);
  const int64_t row_stride = row + g.row_pad;
  Tensor cache = alloc({g.num_blocks, g.block_size, row}, g.dtype,
                       {g.block_size * row_stride + g.block_pad, row_stride, 1});
  const int64_t n = static_cast<int64_t>(slots.size());
  Tensor latent = alloc({n, kMlaLatentDim}, DType::f32), k_pe = alloc({n, kMlaRopeDim}, DType::f32);
  Tensor mapping = alloc({n}, DType::i64);
  std::uniform_real_distribution<float> magnitude(0.25f, 2.f);
  for (int64_t i = 0; i < n; ++i) {
    const float m = magnitude(rng);  // rows (and fp8 tile scales) of different sizes
    const auto c = test::random_floats(rng, kMlaLatentDim), r = test::random_floats(rng, kMlaRopeDim);
    for (int d = 0; d < kMlaLatentDim; ++d) latent.view.ptr<float>()[i * kMlaLatentDim + d] = m * c[d];
    for (int d = 0; d < kMlaRopeDim; ++d) k_pe.view.ptr<float>()[i * kMlaRopeDim + d] = r[d];
    mapping.view.ptr<int64_t>()[i] = slots[i];
  }
  reference::ref_write_mla_cache({latent.view, g.rope_dim ? k_pe.view : TensorView(), mapping.view, cache.view});
  if (g.rope_dim == 0 && g.dtype == DType::fp8_ds_mla) poison_envelope_rope(cache);
  return cache;
}

// A random ~3/4 of the slots (at least one).
std::vector<int64_t> some_slots(Rng& rng, int64_t num_slots) {
  std::vector<int64_t> slots;
  for (int64_t s = 0; s < num_slots; ++s)
    if (rng() % 4 != 0) slots.push_back(s);
  if (slots.empty()) slots.push_back(num_slots - 1);
  return slots;
}

// Output tensors (strided: padded token and head strides) pre-filled with NaN.
struct Outputs {
  Tensor out, lse;
};
Outputs make_outputs(const std::vector<int64_t>& lead, int64_t heads, DType dtype, bool strided) {
  std::vector<int64_t> out_shape = lead, lse_shape = lead;
  out_shape.push_back(heads);
  out_shape.push_back(kMlaVDim);
  lse_shape.push_back(heads);
  std::vector<int64_t> out_strides, lse_strides;
  if (strided) {
    out_strides.assign(out_shape.size(), 0);
    lse_strides.assign(lse_shape.size(), 0);
    out_strides.back() = 1;
    out_strides[out_shape.size() - 2] = kMlaVDim + 24;
    lse_strides.back() = 1;
    for (int d = static_cast<int>(lead.size()) - 1; d >= 0; --d) {
      out_strides[d] = out_strides[d + 1] * out_shape[d + 1] + 8;
      lse_strides[d] = lse_strides[d + 1] * lse_shape[d + 1] + 3;
    }
  }
  return {alloc(out_shape, dtype, out_strides), alloc(lse_shape, DType::f32, lse_strides)};
}

// Every output element written (no NaN sentinel left, no padding touched) and within FlashMLA's tolerances of `ref`
// (out: 1e-3 absolute, 2.01/128 relative, cosine 1 - 5e-6; lse: 1e-6, 8.01/65536), with the f16 analogue for f16
// outputs. bf16 outputs may come from P rounded to bf16 before P.V (as in FlashMLA), whose error is bounded by
// 2^-8 * max|c|: cache rows here have |c| < 2, and the softmax is peaked.
void expect_matches(const reference::RefAttention& ref, const Outputs& o) {
  expect_written(o.out, "out");
  expect_written(o.lse, "lse");
  const bool bf16 = o.out.view.dtype == DType::bf16;
  const double abs_tol = bf16 ? std::max(1e-3, 0x1p-8 * 2.0) : 1e-3;
  EXPECT_EQ(test::compare(ref.out, read(o.out), abs_tol, bf16 ? 2.01 / 128 : 2.01 / 1024, 1 - 5e-6), "") << "out";
  EXPECT_EQ(test::compare(ref.lse, read(o.lse), 1e-6, 8.01 / 65536), "") << "lse";
}

// q [lead..., H, 576 | 512], strided with padding between heads and tokens when asked.
Tensor make_q(Rng& rng, const std::vector<int64_t>& lead, int64_t heads, DType dtype, bool strided,
              MlaHead head = {}) {
  std::vector<int64_t> shape = lead, strides;
  shape.push_back(heads);
  shape.push_back(head.qk_dim());
  if (strided) {
    strides.assign(shape.size(), 1);
    strides[shape.size() - 2] = head.qk_dim() + 64;
    for (int d = static_cast<int>(lead.size()) - 1; d >= 0; --d) strides[d] = strides[d + 1] * shape[d + 1] + 32;
  }
  Tensor q = alloc(shape, dtype, strides);
  fill_half(q, rng, -1.f, 1.f);
  return q;
}

// Random sinks, with +inf (output 0) and -inf (no effect) among them as in FlashMLA's tests.
Tensor make_sink(Rng& rng, int64_t heads) {
  Tensor sink = alloc({heads}, DType::f32);
  const auto v = test::random_floats(rng, heads, -2.f, 3.f);
  std::copy(v.begin(), v.end(), sink.view.ptr<float>());
  if (heads > 2) {
    sink.view.ptr<float>()[1] = std::numeric_limits<float>::infinity();
    sink.view.ptr<float>()[2] = -std::numeric_limits<float>::infinity();
  }
  return sink;
}

// What a sparse_mla or paged_mla_decode problem's args end with: a sink when the case asks for one, the softmax
// scale, and NaN-filled outputs [lead..., H, 512] and [lead..., H] in q's dtype (padded strides when `c.strided`).
template <class Problem, class Case>
void add_sink_and_outputs(Problem& p, const Case& c, Rng& rng, float softmax_scale, const std::vector<int64_t>& lead) {
  if (c.sink) {
    p.sink = make_sink(rng, c.heads);
    p.args.attn_sink = p.sink.view;
  }
  p.args.softmax_scale = softmax_scale;
  p.o = make_outputs(lead, c.heads, c.q_dtype, c.strided);
  p.args.out = p.o.out.view;
  p.args.lse = p.o.lse.view;
}

uint64_t seed_of(const std::string& name) { return std::hash<std::string>{}(name); }

// ---------------------------------------------------------------------------
// sparse_mla

struct SparseCase {
  std::string name;
  DType q_dtype = DType::bf16;  // the cache's dtype is cache.dtype
  int heads = 8;
  int64_t tokens = 3, topk = 64;
  CacheGeometry cache;
  bool topk_length = false, sink = false, strided = false;
  std::optional<Isa> isa;
  // A second cache (extra_kv_cache, DeepSeek-V4's compressed cache) with its own geometry and top-k.
  std::optional<CacheGeometry> extra;
  int64_t extra_topk = 0;
  bool extra_topk_length = false;
};

// A filled sparse_mla problem: token 0 has only invalid indices; token 2 (if any) gets topk_length 0. With an
// extra cache, token 0's extra indices are invalid too (an empty row), token 1's all invalid (the main cache only)
// and token 2 keeps its whole extra list (the extra cache only).
struct SparseProblem {
  Tensor cache, q, indices, topk_length, sink, extra_cache, extra_indices, extra_topk_length;
  Outputs o;
  SparseMlaArgs args;
};

// [tokens, topk] slots drawn from `slots` (duplicates happen), a fifth of them invalid: negative, INT_MAX, or
// `beyond` (num_slots, or another cache's slot count); the rows of `all_invalid` tokens entirely invalid.
Tensor make_indices(Rng& rng, int64_t tokens, int64_t topk, bool strided, const std::vector<int64_t>& slots,
                    const std::vector<int64_t>& beyond, const std::function<bool(int64_t)>& all_invalid) {
  Tensor indices = alloc({tokens, topk}, DType::i32, strided ? std::vector<int64_t>{topk + 5, 1} : std::vector<int64_t>{});
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t k = 0; k < topk; ++k) {
      const bool invalid = all_invalid(t) || rng() % 5 == 0;
      const int32_t invalid_index =
          rng() % 5 == 0 ? static_cast<int32_t>(beyond[rng() % beyond.size()]) : kInvalidIndices[rng() % 4];
      indices.view.ptr<int32_t>()[t * indices.view.strides[0] + k] =
          invalid ? invalid_index : static_cast<int32_t>(slots[rng() % slots.size()]);
    }
  return indices;
}

SparseProblem make_sparse(const SparseCase& c) {
  Rng rng(seed_of(c.name));
  SparseProblem p;
  const int64_t num_slots = c.cache.num_blocks * c.cache.block_size;
  const auto slots = some_slots(rng, num_slots);
  p.cache = make_cache(rng, c.cache, slots);
  p.q = make_q(rng, {c.tokens}, c.heads, c.q_dtype, c.strided, MlaHead{c.cache.rope_dim});
  p.indices = make_indices(rng, c.tokens, c.topk, c.strided, slots, {num_slots},
                           [&](int64_t t) { return t == 0 && c.tokens > 1; });
  p.args.q = p.q.view;
  p.args.kv_cache = p.cache.view;
  p.args.indices = p.indices.view;
  if (c.topk_length) {
    p.topk_length = alloc({c.tokens}, DType::i32);
    for (int64_t t = 0; t < c.tokens; ++t)
      p.topk_length.view.ptr<int32_t>()[t] = t == 2 ? 0 : static_cast<int32_t>(rng() % (c.topk + 1));
    p.args.topk_length = p.topk_length.view;
  }
  if (c.extra) {
    const int64_t extra_slots = c.extra->num_blocks * c.extra->block_size;
    const auto filled = some_slots(rng, extra_slots);
    p.extra_cache = make_cache(rng, *c.extra, filled);
    // The main cache's slot count is an invalid extra index too when it is larger: the slot spaces are separate.
    p.extra_indices = make_indices(rng, c.tokens, c.extra_topk, c.strided, filled,
                                   {extra_slots, std::max(extra_slots, num_slots)},
                                   [&](int64_t t) { return t < 2 && c.tokens > 2; });
    p.args.extra_kv_cache = p.extra_cache.view;
    p.args.extra_indices = p.extra_indices.view;
    if (c.extra_topk_length) {
      p.extra_topk_length = alloc({c.tokens}, DType::i32);
      for (int64_t t = 0; t < c.tokens; ++t)
        p.extra_topk_length.view.ptr<int32_t>()[t] =
            t == 2 ? static_cast<int32_t>(c.extra_topk) : static_cast<int32_t>(rng() % (c.extra_topk + 1));
      p.args.extra_topk_length = p.extra_topk_length.view;
    }
  }
  add_sink_and_outputs(p, c, rng, 0.3f, {c.tokens});
  return p;
}

void PrintTo(const SparseCase& c, std::ostream* os) { *os << c.name; }

class SparseMla : public ::testing::TestWithParam<SparseCase> {};

TEST_P(SparseMla, MatchesReference) {
  const SparseCase& c = GetParam();
  SparseProblem p = make_sparse(c);
  {
    PinIsa pin(c.isa);
    sparse_mla(p.args);
  }
  expect_matches(reference::ref_sparse_mla(p.args), p.o);
}

std::string dtype_tag(DType d) {
  return d == DType::bf16 ? "bf16" : d == DType::f16 ? "f16" : d == DType::fp8_ds_mla ? "fp8"
         : d == DType::fp8_ds_mla_v4 ? "fp8v4" : "fp8nope";
}

std::vector<SparseCase> sparse_cases() {
  std::vector<SparseCase> cases;
  // Every instruction set x every q / cache dtype pair.
  for (Isa isa : available_isas())
    for (DType q : {DType::bf16, DType::f16})
      for (DType cache : {DType::bf16, DType::f16, DType::fp8_ds_mla}) {
        SparseCase c;
        c.name = std::string(cpu::isa_name(isa)) + "_q" + dtype_tag(q) + "_cache" + dtype_tag(cache);
        c.q_dtype = q;
        c.cache.dtype = cache;
        c.heads = 20;
        c.tokens = 4;
        c.topk = 70;
        c.cache.row_pad = cache == DType::bf16 ? 0 : 8;
        c.cache.block_pad = cache == DType::bf16 ? 0 : 40;
        c.topk_length = q == DType::bf16;
        c.sink = cache != DType::f16;
        c.strided = cache == DType::bf16;
        c.isa = isa;
        cases.push_back(c);
      }
  // Head counts x block sizes.
  for (int heads : {1, 8, 20, 64, 128})
    for (int64_t block_size : {1, 16, 64}) {
      SparseCase c;
      c.name = "heads" + std::to_string(heads) + "_block" + std::to_string(block_size);
      c.cache.dtype = heads % 2 ? DType::bf16 : DType::fp8_ds_mla;
      c.cache.block_size = block_size;
      c.cache.num_blocks = 256 / block_size;
      c.heads = heads;
      c.tokens = 2;
      c.topk = heads >= 64 ? 40 : 100;
      c.sink = block_size == 16;
      c.topk_length = block_size == 64;
      c.strided = heads == 20;
      cases.push_back(c);
    }
  // One token, many indices: the rows are split over threads and combined.
  for (DType cache : {DType::bf16, DType::fp8_ds_mla}) {
    SparseCase c;
    c.name = "split_" + dtype_tag(cache);
    c.cache = {cache, 64, 64, 0, 0};
    c.heads = 16;
    c.tokens = 1;
    c.topk = 1500;
    c.sink = true;
    cases.push_back(c);
  }
  // A decode-sized problem: 64 heads, topk 2048.
  SparseCase decode;
  decode.name = "decode_heads64_topk2048";
  decode.cache = {DType::fp8_ds_mla, 64, 64, 0, 0};
  decode.heads = 64;
  decode.tokens = 2;
  decode.topk = 2048;
  decode.topk_length = true;
  cases.push_back(decode);

  // Heads with no rope part (GLM-5.3-Flash, 512 wide), in every cache form (the fp8_ds_mla envelope's unused
  // rope part NaN): every instruction set x q dtype x cache form ...
  const DType nope_caches[] = {DType::bf16, DType::f16, DType::fp8_ds_mla, DType::fp8_ds_mla_nope};
  for (Isa isa : available_isas())
    for (DType q : {DType::bf16, DType::f16})
      for (DType cache : nope_caches) {
        SparseCase c;
        c.name = "nope_" + std::string(cpu::isa_name(isa)) + "_q" + dtype_tag(q) + "_cache" + dtype_tag(cache);
        c.q_dtype = q;
        c.cache.dtype = cache;
        c.cache.rope_dim = 0;
        c.heads = 20;
        c.tokens = 4;
        c.topk = 70;
        c.cache.row_pad = cache == DType::bf16 ? 0 : 8;
        c.cache.block_pad = cache == DType::bf16 ? 0 : 40;
        c.topk_length = q == DType::bf16;
        c.sink = cache != DType::f16;
        c.strided = cache == DType::bf16 || cache == DType::fp8_ds_mla_nope;
        c.isa = isa;
        cases.push_back(c);
      }
  // ... and heads {1, 8, 16, 64, 128} x top-k {1, 100, 2048}, block sizes and cache forms taking turns.
  int turn = 0;
  for (int heads : {1, 8, 16, 64, 128})
    for (int64_t topk : {1, 100, 2048}) {
      SparseCase c;
      const int64_t block_size = std::array<int64_t, 3>{1, 16, 64}[turn % 3];
      c.cache.dtype = nope_caches[turn % 4];
      c.name = "nope_heads" + std::to_string(heads) + "_topk" + std::to_string(topk) + "_block" +
               std::to_string(block_size) + "_" + dtype_tag(c.cache.dtype);
      c.cache.rope_dim = 0;
      c.cache.block_size = block_size;
      c.cache.num_blocks = 1024 / block_size;
      c.heads = heads;
      c.tokens = 3;
      c.topk = topk;
      c.sink = turn % 2 == 0;
      c.topk_length = turn % 3 == 1;
      ++turn;
      cases.push_back(c);
    }
  // Two caches under one softmax (DeepSeek-V4: 512-wide heads, the value the whole row; and the 576-wide head):
  // every instruction set x q dtype x cache form, each cache with its own block size ...
  for (Isa isa : available_isas())
    for (DType q : {DType::bf16, DType::f16})
      for (DType cache : {DType::bf16, DType::f16, DType::fp8_ds_mla})
        for (int rope : {0, kMlaRopeDim}) {
          SparseCase c;
          c.name = "extra_" + std::string(cpu::isa_name(isa)) + "_q" + dtype_tag(q) + "_cache" + dtype_tag(cache) +
                   "_rope" + std::to_string(rope);
          c.q_dtype = q;
          c.cache = {cache, 6, 61, cache == DType::bf16 ? 0 : 8, 40, rope};
          c.extra = CacheGeometry{cache, 5, 2, 0, cache == DType::bf16 ? 16 : 0, rope};
          c.heads = 20;
          c.tokens = 5;
          c.topk = 64;
          c.extra_topk = 70;
          c.topk_length = q == DType::bf16;
          c.extra_topk_length = cache != DType::f16;
          c.sink = cache != DType::f16;
          c.strided = cache == DType::bf16;
          c.isa = isa;
          cases.push_back(c);
        }
  // ... and V4's sizes: 64 / 128 heads, top-k and extra top-k 64 / 576 / 2048, block sizes 1 / 2 / 61 / 64 / 69 / 576
  // for each cache.
  struct TwoCaches {
    int heads;
    int64_t topk, extra_topk, block, extra_block;
  };
  for (const TwoCaches& g : {TwoCaches{64, 64, 2048, 64, 1}, TwoCaches{128, 576, 576, 576, 69},
                             TwoCaches{64, 2048, 64, 1, 576}, TwoCaches{128, 64, 576, 69, 64},
                             TwoCaches{64, 2048, 576, 2, 61}, TwoCaches{128, 576, 64, 61, 2}}) {
    SparseCase c;
    c.name = "extra_v4_heads" + std::to_string(g.heads) + "_topk" + std::to_string(g.topk) + "_" +
             std::to_string(g.extra_topk) + "_block" + std::to_string(g.block) + "_" + std::to_string(g.extra_block);
    c.cache = {DType::bf16, 4096 / g.block + 1, g.block, 0, 0, 0};
    c.extra = CacheGeometry{DType::bf16, 1024 / g.extra_block + 1, g.extra_block, 0, 0, 0};
    c.heads = g.heads;
    c.tokens = 3;
    c.topk = g.topk;
    c.extra_topk = g.extra_topk;
    c.topk_length = g.heads == 64;
    c.extra_topk_length = true;
    c.sink = true;
    cases.push_back(c);
  }
  // DeepSeek-V4's fp8 cache (fp8_ds_mla_v4, blocks padded as FlashMLA pads them; unused slots' e4m3 bytes NaN), one
  // cache and two: every instruction set x q dtype ...
  for (Isa isa : available_isas())
    for (DType q : {DType::bf16, DType::f16})
      for (bool two : {false, true}) {
        SparseCase c;
        c.name = "v4fp8_" + std::string(cpu::isa_name(isa)) + "_q" + dtype_tag(q) + (two ? "_two_caches" : "_one");
        c.q_dtype = q;
        c.cache = {DType::fp8_ds_mla_v4, 6, 61, 0, v4_block_pad(61), 0};
        if (two) c.extra = CacheGeometry{DType::fp8_ds_mla_v4, 5, 2, 0, v4_block_pad(2) + 3, 0};
        c.heads = 20;
        c.tokens = 5;
        c.topk = 64;
        c.extra_topk = two ? 70 : 0;
        c.topk_length = q == DType::bf16;
        c.extra_topk_length = two && q == DType::f16;
        c.sink = true;
        c.strided = q == DType::f16;
        c.isa = isa;
        cases.push_back(c);
      }
  // ... and V4's sizes (every block size in each cache, extra top-k up to 2048).
  for (const TwoCaches& g : {TwoCaches{64, 2048, 64, 1, 576}, TwoCaches{128, 64, 576, 69, 64},
                             TwoCaches{64, 576, 2048, 2, 61}, TwoCaches{128, 64, 2048, 576, 1},
                             TwoCaches{128, 576, 576, 64, 69}, TwoCaches{64, 64, 576, 61, 2}}) {
    SparseCase c;
    c.name = "v4fp8_heads" + std::to_string(g.heads) + "_topk" + std::to_string(g.topk) + "_" +
             std::to_string(g.extra_topk) + "_block" + std::to_string(g.block) + "_" + std::to_string(g.extra_block);
    c.cache = {DType::fp8_ds_mla_v4, 4096 / g.block + 1, g.block, 0, v4_block_pad(g.block), 0};
    c.extra = CacheGeometry{DType::fp8_ds_mla_v4, 1024 / g.extra_block + 1, g.extra_block, 0,
                            v4_block_pad(g.extra_block), 0};
    c.heads = g.heads;
    c.tokens = 3;
    c.topk = g.topk;
    c.extra_topk = g.extra_topk;
    c.topk_length = true;
    c.extra_topk_length = g.heads == 128;
    c.sink = true;
    cases.push_back(c);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, SparseMla, ::testing::ValuesIn(sparse_cases()),
                         [](const auto& info) { return info.param.name; });

TEST(SparseMlaSplits, SevenThreadsMatchReference) {
  SparseCase c;
  c.name = "threads";
  c.cache = {DType::bf16, 32, 16, 0, 0};
  c.tokens = 3;
  c.topk = 700;
  c.sink = true;
  SparseProblem p = make_sparse(c);
  const int threads = omp_get_max_threads();
  omp_set_num_threads(7);  // 3 tokens on 7 threads: several splits per token
  sparse_mla(p.args);
  omp_set_num_threads(threads);
  expect_matches(reference::ref_sparse_mla(p.args), p.o);
}

// The fp8 cache gives the same results as a bf16 cache holding its dequantised values (exact in bf16),
// bit for bit, under every instruction set.
TEST(SparseMlaFp8, EqualsBf16OnDequantisedCache) {
  for (Isa isa : available_isas())
    for (DType q_dtype : {DType::bf16, DType::f16}) {
      PinIsa pin(isa);
      SparseCase c;
      c.name = "fp8_vs_bf16";
      c.q_dtype = q_dtype;
      c.cache = {DType::fp8_ds_mla, 16, 16, 0, 0};
      c.heads = 12;
      c.tokens = 5;
      c.topk = 90;
      c.sink = true;
      SparseProblem fp8 = make_sparse(c);
      Tensor bf16 = alloc({16, 16, kMlaQkDim}, DType::bf16);
      for (int64_t s = 0; s < 16 * 16; ++s) {
        const uint8_t first = fp8.cache.view.ptr<uint8_t>()[s * kFp8DsMlaRowBytes];
        if (first == 0x7f) continue;  // an unfilled (poisoned) slot stays NaN
        const auto row = reference::ref_cache_row(fp8.cache.view, s);
        for (int d = 0; d < kMlaQkDim; ++d) {
          const uint16_t bits = numeric::float_to_bf16(static_cast<float>(row[d]));
          ASSERT_EQ(numeric::bf16_to_float(bits), row[d]) << "dequantised value not exact in bf16";
          bf16.view.ptr<uint16_t>()[s * kMlaQkDim + d] = bits;
        }
      }
      Outputs o = make_outputs({c.tokens}, c.heads, q_dtype, false);
      SparseMlaArgs args = fp8.args;
      args.kv_cache = bf16.view;
      args.out = o.out.view;
      args.lse = o.lse.view;
      sparse_mla(fp8.args);
      sparse_mla(args);
      EXPECT_EQ(read(fp8.o.out), read(o.out)) << dtype_name(q_dtype) << " " << cpu::isa_name(isa);
      EXPECT_EQ(read(fp8.o.lse), read(o.lse)) << dtype_name(q_dtype) << " " << cpu::isa_name(isa);
    }
}

// Tile scales that are not powers of two (another quantiser's) still dequantise as e4m3 * scale.
TEST(SparseMlaFp8, AnyTileScale) {
  SparseCase c;
  c.name = "fp8_scales";
  c.cache = {DType::fp8_ds_mla, 16, 16, 0, 0};
  c.heads = 8;
  c.topk = 80;
  SparseProblem p = make_sparse(c);
  for (int64_t s = 0; s < 16 * 16; ++s) {
    uint8_t* row = p.cache.view.ptr<uint8_t>() + s * kFp8DsMlaRowBytes;
    if (row[0] == 0x7f) continue;  // unfilled
    for (int tile = 0; tile < 4; ++tile) {
      float scale;
      std::memcpy(&scale, row + kMlaLatentDim + 4 * tile, 4);
      scale *= 1.3f + 0.1f * tile;
      std::memcpy(row + kMlaLatentDim + 4 * tile, &scale, 4);
    }
  }
  for (Isa isa : available_isas()) {
    SCOPED_TRACE(std::string(cpu::isa_name(isa)));
    PinIsa pin(isa);
    sparse_mla(p.args);
    expect_matches(reference::ref_sparse_mla(p.args), p.o);
  }
}

// The vectorised output conversions agree with numeric::float_to_bf16 / float_to_f16 bit for bit: a
// single part with m = 0 and l = 1 makes the kernels' finalize write acc itself.
TEST(Kernels, OutputConversionsAreBitExact) {
  Rng rng(11);
  std::vector<float> acc(kMlaVDim);
  std::uniform_int_distribution<uint32_t> bits;
  for (size_t i = 0; i < acc.size(); ++i) {
    uint32_t u = bits(rng);
    switch (i % 8) {
      case 0: u = (u & 0x80ffffffu) | 0x3f000000u; break;          // around 1
      case 1: u = (u & 0x8000ffffu) | 0x3f808000u; break;          // bf16 halfway cases
      case 2: u = (u & 0x807fffffu); break;                        // fp32 subnormals
      case 3: u = (u & 0x80000fffu) | 0x477fe000u; break;          // near the f16 overflow (65504..65536)
      case 4: u = (u & 0x801fffffu) | 0x33000000u; break;          // f16 subnormals
      case 5: u = (u & 0x80000000u) | 0x7f800000u | (i % 3 ? 0x400000u + (u & 0x3fffffu) : 0u); break;  // inf, qNaN
      default: u = (u & 0x8fffffffu) | 0x30000000u; break;         // anywhere
    }
    if (u == 0x80000000u) u = 0x80000001u;  // -0 * 1 + 0 would be +0
    std::memcpy(&acc[i], &u, 4);
  }
  const float m = 0.f, l = 1.f;
  for (Isa isa : available_isas())
    for (DType dtype : {DType::bf16, DType::f16}) {
      PinIsa pin(isa);
      std::vector<uint16_t> out(kMlaVDim);
      float lse = 0.f;
      cpu::attn::FinalizeJob f;
      f.acc = acc.data();
      f.m = &m;
      f.l = &l;
      f.h_end = 1;
      f.out = out.data();
      f.out_dtype = dtype;
      f.lse = &lse;
      cpu::attn::active_kernels().finalize(f);
      for (int d = 0; d < kMlaVDim; ++d) {
        const uint16_t want = dtype == DType::bf16 ? numeric::float_to_bf16(acc[d]) : numeric::float_to_f16(acc[d]);
        ASSERT_EQ(out[d], want) << cpu::isa_name(isa) << " " << dtype_name(dtype) << " value " << acc[d];
      }
    }
}

// ---------------------------------------------------------------------------
// paged_mla_decode

struct PagedCase {
  std::string name;
  DType q_dtype = DType::bf16, cache_dtype = DType::bf16;
  int heads = 8;
  int64_t batch = 3, s_q = 1, max_blocks = 4;
  int64_t block_size = 16;
  bool causal = true, sink = false, strided = false, padded = false;
  int rope_dim = kMlaRopeDim;
  std::optional<Isa> isa;
};

struct PagedProblem {
  Tensor cache, q, table, seq_lens, sink;
  Outputs o;
  PagedMlaDecodeArgs args;
};

// Blocks are handed out in a shuffled order; table entries past each sequence hold
// out-of-range ids (never read); the last request fills its table exactly.
PagedProblem make_paged(const PagedCase& c) {
  Rng rng(seed_of(c.name));
  PagedProblem p;
  const int64_t num_blocks = c.batch * c.max_blocks + 3;
  std::vector<int32_t> order(num_blocks);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  p.table = alloc({c.batch, c.max_blocks}, DType::i32);
  p.seq_lens = alloc({c.batch}, DType::i32);
  std::vector<int64_t> slots;
  const int64_t capacity = c.max_blocks * c.block_size;
  for (int64_t b = 0; b < c.batch; ++b) {
    const int64_t min_len = c.causal ? c.s_q : 0;
    int64_t len = min_len + static_cast<int64_t>(rng() % (capacity - min_len + 1));
    if (b == c.batch - 1) len = capacity;
    if (b == 0 && !c.causal) len = 0;
    p.seq_lens.view.ptr<int32_t>()[b] = static_cast<int32_t>(len);
    for (int64_t j = 0; j < c.max_blocks; ++j) {
      const bool used = j * c.block_size < len;
      const int32_t block = order[b * c.max_blocks + j];
      const int32_t unused = j % 2 ? -1 : static_cast<int32_t>(num_blocks);
      p.table.view.ptr<int32_t>()[b * c.max_blocks + j] = used ? block : unused;
      for (int64_t o = 0; used && o < c.block_size && j * c.block_size + o < len; ++o)
        slots.push_back(block * c.block_size + o);
    }
  }
  if (slots.empty()) slots.push_back(0);
  const bool v4 = c.cache_dtype == DType::fp8_ds_mla_v4;  // rows that cannot be padded
  p.cache = make_cache(
      rng, {c.cache_dtype, num_blocks, c.block_size, c.padded && !v4 ? 4 : 0, c.padded ? 100 : 0, c.rope_dim}, slots);
  p.q = make_q(rng, {c.batch, c.s_q}, c.heads, c.q_dtype, c.strided, MlaHead{c.rope_dim});
  p.args.q = p.q.view;
  p.args.kv_cache = p.cache.view;
  p.args.block_table = p.table.view;
  p.args.seq_lens = p.seq_lens.view;
  p.args.causal = c.causal;
  add_sink_and_outputs(p, c, rng, 0.25f, {c.batch, c.s_q});
  return p;
}

void PrintTo(const PagedCase& c, std::ostream* os) { *os << c.name; }

class PagedMlaDecode : public ::testing::TestWithParam<PagedCase> {};

TEST_P(PagedMlaDecode, MatchesReference) {
  const PagedCase& c = GetParam();
  PagedProblem p = make_paged(c);
  {
    PinIsa pin(c.isa);
    paged_mla_decode(p.args);
  }
  expect_matches(reference::ref_paged_mla_decode(p.args), p.o);
}

// Dense paged decode equals sparse_mla fed every visible position's slot (and -1 beyond).
TEST_P(PagedMlaDecode, EqualsSparseWithAllPositions) {
  const PagedCase& c = GetParam();
  PagedProblem p = make_paged(c);
  paged_mla_decode(p.args);
  int64_t max_len = 1;
  for (int64_t b = 0; b < c.batch; ++b) max_len = std::max<int64_t>(max_len, p.seq_lens.view.ptr<int32_t>()[b]);
  const int64_t tokens = c.batch * c.s_q;
  Tensor indices = alloc({tokens, max_len}, DType::i32);
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t j = 0; j < c.s_q; ++j) {
      const int64_t len = p.seq_lens.view.ptr<int32_t>()[b];
      const int64_t visible = c.causal ? len - c.s_q + j + 1 : len;
      for (int64_t pos = 0; pos < max_len; ++pos) {
        const int64_t column = std::min(pos / c.block_size, c.max_blocks - 1);
        const int32_t block = p.table.view.ptr<int32_t>()[b * c.max_blocks + column];
        indices.view.ptr<int32_t>()[(b * c.s_q + j) * max_len + pos] =
            pos < visible ? static_cast<int32_t>(block * c.block_size + pos % c.block_size) : -1;
      }
    }
  Tensor q = alloc({tokens, c.heads, p.q.view.shape[3]}, c.q_dtype);  // q as [B * s_q, H, 576 | 512]
  const auto q_offsets = offsets(p.q.view);
  for (size_t i = 0; i < q_offsets.size(); ++i) q.view.ptr<uint16_t>()[i] = p.q.view.ptr<uint16_t>()[q_offsets[i]];
  SparseMlaArgs s;
  s.q = q.view;
  s.kv_cache = p.cache.view;
  s.indices = indices.view;
  s.attn_sink = p.args.attn_sink;
  s.softmax_scale = p.args.softmax_scale;
  Outputs o = make_outputs({tokens}, c.heads, c.q_dtype, false);
  s.out = o.out.view;
  s.lse = o.lse.view;
  sparse_mla(s);
  EXPECT_EQ(test::compare(read(p.o.out), read(o.out), 1e-6, 1.01 / 128), "") << "out";
  EXPECT_EQ(test::compare(read(p.o.lse), read(o.lse), 1e-6, 1e-6), "") << "lse";
}

std::vector<PagedCase> paged_cases() {
  std::vector<PagedCase> cases;
  for (int64_t block_size : {1, 16, 64})
    for (int64_t s_q : {1, 2, 4})
      for (bool causal : {true, false}) {
        PagedCase c;
        c.name = "block" + std::to_string(block_size) + "_sq" + std::to_string(s_q) + (causal ? "_causal" : "_full");
        c.block_size = block_size;
        c.max_blocks = 192 / block_size;
        c.s_q = s_q;
        c.causal = causal;
        c.cache_dtype = s_q == 2 ? DType::fp8_ds_mla : DType::bf16;
        c.q_dtype = block_size == 16 && !causal ? DType::f16 : DType::bf16;
        c.heads = s_q == 4 ? 64 : 8;
        c.sink = s_q != 1;
        c.padded = block_size == 64;
        c.strided = block_size == 1 && causal;
        cases.push_back(c);
      }
  // Heads with no rope part, every cache form and block size.
  for (DType cache : {DType::bf16, DType::f16, DType::fp8_ds_mla, DType::fp8_ds_mla_nope})
    for (int64_t block_size : {1, 16, 64}) {
      PagedCase c;
      c.name = "nope_" + dtype_tag(cache) + "_block" + std::to_string(block_size);
      c.rope_dim = 0;
      c.cache_dtype = cache;
      c.block_size = block_size;
      c.max_blocks = 192 / block_size;
      c.s_q = block_size == 16 ? 2 : 1;
      c.heads = block_size == 64 ? 128 : 16;
      c.q_dtype = cache == DType::f16 ? DType::f16 : DType::bf16;
      c.sink = block_size != 1;
      c.padded = cache != DType::bf16;
      c.strided = block_size == 1;
      cases.push_back(c);
    }
  // DeepSeek-V4's fp8 cache (its rows are not padded; its blocks are, with `padded`).
  for (int64_t block_size : {1, 16, 64}) {
    PagedCase c;
    c.name = "v4fp8_block" + std::to_string(block_size);
    c.rope_dim = 0;
    c.cache_dtype = DType::fp8_ds_mla_v4;
    c.block_size = block_size;
    c.max_blocks = 192 / block_size;
    c.s_q = block_size == 16 ? 3 : 1;
    c.heads = block_size == 64 ? 64 : 16;
    c.q_dtype = block_size == 1 ? DType::f16 : DType::bf16;
    c.sink = block_size != 1;
    c.padded = block_size != 16;
    c.strided = block_size == 1;
    cases.push_back(c);
  }
  for (Isa isa : available_isas()) {
    PagedCase c;
    c.name = std::string(cpu::isa_name(isa)) + "_f16cache";
    c.cache_dtype = DType::f16;
    c.heads = 20;
    c.s_q = 2;
    c.sink = true;
    c.padded = true;
    c.isa = isa;
    cases.push_back(c);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, PagedMlaDecode, ::testing::ValuesIn(paged_cases()),
                         [](const auto& info) { return info.param.name; });

// ---------------------------------------------------------------------------
// write_mla_cache: bit-exact against the reference writer, negative slots skipped.

TEST(WriteMlaCache, BitExactAgainstReference) {
  for (DType cache_dtype : {DType::bf16, DType::f16, DType::fp8_ds_mla})
    for (DType in_dtype : {DType::f32, DType::f16, DType::bf16}) {
      SCOPED_TRACE(std::string(dtype_name(cache_dtype)) + " from " + std::string(dtype_name(in_dtype)));
      Rng rng(seed_of(std::string(dtype_name(cache_dtype)) + std::string(dtype_name(in_dtype))));
      const int64_t n = 48;
      const CacheGeometry g{cache_dtype, 6, 16, 8, 24};
      Tensor latent = alloc({n, kMlaLatentDim}, in_dtype, {kMlaLatentDim + 16, 1});
      Tensor k_pe = alloc({n, kMlaRopeDim}, in_dtype);
      for (int64_t i = 0; i < n; ++i) {
        // Magnitudes from the 1e-4 scale floor (fp8 subnormals) to past bf16 rounding of large values.
        const float m = std::array<float, 5>{1e-6f, 1e-3f, 1.f, 30.f, 3000.f}[i % 5];
        const auto c = test::random_floats(rng, kMlaLatentDim), r = test::random_floats(rng, kMlaRopeDim);
        for (int d = 0; d < kMlaLatentDim; ++d) {
          float* f = latent.view.ptr<float>() + i * latent.view.strides[0] + d;
          uint16_t* h = latent.view.ptr<uint16_t>() + i * latent.view.strides[0] + d;
          if (in_dtype == DType::f32) *f = m * c[d];
          else *h = test::to_half_bits({m * c[d]}, in_dtype)[0];
        }
        for (int d = 0; d < kMlaRopeDim; ++d) {
          if (in_dtype == DType::f32) k_pe.view.ptr<float>()[i * kMlaRopeDim + d] = r[d];
          else k_pe.view.ptr<uint16_t>()[i * kMlaRopeDim + d] = test::to_half_bits({r[d]}, in_dtype)[0];
        }
      }
      Tensor mapping = alloc({n}, DType::i64);
      std::vector<int64_t> slots(g.num_blocks * g.block_size);
      std::iota(slots.begin(), slots.end(), 0);
      std::shuffle(slots.begin(), slots.end(), rng);
      for (int64_t i = 0; i < n; ++i) mapping.view.ptr<int64_t>()[i] = i % 7 == 3 ? -1 - i : slots[i];
      Tensor expected = make_cache(rng, g, {}), actual = expected;
      actual.view.data = actual.mem.data();
      reference::ref_write_mla_cache({latent.view, k_pe.view, mapping.view, expected.view});
      write_mla_cache({latent.view, k_pe.view, mapping.view, actual.view});
      EXPECT_EQ(expected.mem, actual.mem);
    }
}

// A head with no rope part: no k_pe; rows are the latent only (bf16/f16: 512 values; fp8: the first 528 bytes),
// bit-exact against the reference; an fp8_ds_mla envelope's rope bytes (and every other byte) stay as they were.
TEST(WriteMlaCache, NoRopePartBitExact) {
  for (DType cache_dtype : {DType::bf16, DType::f16, DType::fp8_ds_mla, DType::fp8_ds_mla_nope})
    for (DType in_dtype : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(std::string(dtype_name(cache_dtype)) + " from " + std::string(dtype_name(in_dtype)));
      Rng rng(seed_of("nope" + std::string(dtype_name(cache_dtype)) + std::string(dtype_name(in_dtype))));
      const int64_t n = 40;
      const CacheGeometry g{cache_dtype, 5, 16, 16, 32, 0};
      Tensor latent = alloc({n, kMlaLatentDim}, in_dtype);
      for (int64_t i = 0; i < n; ++i) {
        const float m = std::array<float, 4>{1e-6f, 1e-2f, 1.f, 300.f}[i % 4];
        const auto c = test::random_floats(rng, kMlaLatentDim);
        for (int d = 0; d < kMlaLatentDim; ++d) {
          if (in_dtype == DType::f32) latent.view.ptr<float>()[i * kMlaLatentDim + d] = m * c[d];
          else latent.view.ptr<uint16_t>()[i * kMlaLatentDim + d] = test::to_half_bits({m * c[d]}, in_dtype)[0];
        }
      }
      Tensor mapping = alloc({n}, DType::i64);
      std::vector<int64_t> slots(g.num_blocks * g.block_size);
      std::iota(slots.begin(), slots.end(), 0);
      std::shuffle(slots.begin(), slots.end(), rng);
      for (int64_t i = 0; i < n; ++i) mapping.view.ptr<int64_t>()[i] = i % 5 == 2 ? -1 : slots[i];
      Tensor before = make_cache(rng, g, {});  // all NaN; an envelope's rope parts bf16 NaN
      Tensor expected = before, actual = before;
      expected.view.data = expected.mem.data();
      actual.view.data = actual.mem.data();
      reference::ref_write_mla_cache({latent.view, TensorView(), mapping.view, expected.view});
      Tensor empty_k_pe = alloc({n, 0}, in_dtype);  // a k_pe of width 0 means the same as none
      write_mla_cache({latent.view, cache_dtype == DType::bf16 ? empty_k_pe.view : TensorView(), mapping.view,
                       actual.view});
      EXPECT_EQ(expected.mem, actual.mem);
      // Exactly the latent part of each written row changed.
      const int64_t latent_bytes = is_fp8_mla_cache(cache_dtype) ? kFp8DsMlaNopeRowBytes : 2 * kMlaLatentDim;
      const int64_t elem = static_cast<int64_t>(dtype_size(cache_dtype));
      std::vector<bool> written(before.mem.size() * 8, false);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t slot = mapping.view.ptr<int64_t>()[i];
        if (slot < 0) continue;
        const int64_t start = ((slot / g.block_size) * before.view.strides[0] + (slot % g.block_size) *
                               before.view.strides[1]) * elem;
        for (int64_t b = 0; b < latent_bytes; ++b) written[start + b] = true;
      }
      const auto* old_bytes = reinterpret_cast<const uint8_t*>(before.mem.data());
      const auto* new_bytes = reinterpret_cast<const uint8_t*>(actual.mem.data());
      int64_t changed_outside = 0, latent_unchanged_rows = 0;
      for (size_t b = 0; b < written.size(); ++b) changed_outside += !written[b] && old_bytes[b] != new_bytes[b];
      EXPECT_EQ(changed_outside, 0) << "bytes outside the written latents changed";
      for (int64_t i = 0; i < n; ++i) {
        const int64_t slot = mapping.view.ptr<int64_t>()[i];
        if (slot < 0) continue;
        const int64_t start = ((slot / g.block_size) * before.view.strides[0] + (slot % g.block_size) *
                               before.view.strides[1]) * elem;
        latent_unchanged_rows += std::memcmp(old_bytes + start, new_bytes + start, latent_bytes) == 0;
      }
      EXPECT_EQ(latent_unchanged_rows, 0);
    }
}

void expect_error(const std::function<void()>& run, const std::string& needle);

// DeepSeek-V4's fp8 cache: bit-exact against the float64 reference writer (scales 2^ceil(log2(max(amax / 448,
// 1e-4))) as ue8m0 bytes, e4m3 by nearest-value search), for block sizes whose parts fall anywhere in a padded
// block; only each written token's 576 value bytes and 7 scale bytes change (its pad byte and the block padding
// keep their poison); dequantised, every value is within e4m3's rounding of its input.
TEST(WriteMlaCache, V4Fp8BitExact) {
  using V4 = MlaV4CacheLayout;
  for (int64_t block_size : {1, 3, 64})
    for (DType in_dtype : {DType::f32, DType::f16, DType::bf16}) {
      SCOPED_TRACE("block " + std::to_string(block_size) + " from " + std::string(dtype_name(in_dtype)));
      Rng rng(seed_of("v4fp8" + std::to_string(block_size) + std::string(dtype_name(in_dtype))));
      const int64_t n = 45;
      const CacheGeometry g{DType::fp8_ds_mla_v4, 96 / block_size + 1, block_size, 0, v4_block_pad(block_size), 0};
      Tensor latent = alloc({n, kMlaLatentDim}, in_dtype, {kMlaLatentDim + 8, 1});
      std::vector<float> x(n * kMlaLatentDim);  // the values as written (after the input dtype's rounding)
      for (int64_t i = 0; i < n; ++i) {
        const auto c = test::random_floats(rng, kMlaLatentDim);
        for (int d = 0; d < kMlaLatentDim; ++d) {
          // Tile magnitudes from below the 1e-4 scale floor to large, changing tile by tile.
          const float m = std::array<float, 6>{1e-7f, 2e-3f, 1.f, 30.f, 3000.f, 0.5f}[(i + d / V4::kTile) % 6];
          float v = m * c[d];
          if (d % V4::kTile == 5 && i % 4 == 1) v = 448.f * std::ldexp(1.f, int(i % 9) - 4);  // amax / 448 exactly 2^k
          if (in_dtype != DType::f32) v = test::half_bits_to_float(test::to_half_bits({v}, in_dtype)[0], in_dtype);
          x[i * kMlaLatentDim + d] = v;
          if (in_dtype == DType::f32) latent.view.ptr<float>()[i * latent.view.strides[0] + d] = v;
          else latent.view.ptr<uint16_t>()[i * latent.view.strides[0] + d] = test::to_half_bits({v}, in_dtype)[0];
        }
      }
      Tensor mapping = alloc({n}, DType::i64);
      std::vector<int64_t> slots(g.num_blocks * g.block_size);
      std::iota(slots.begin(), slots.end(), 0);
      std::shuffle(slots.begin(), slots.end(), rng);
      for (int64_t i = 0; i < n; ++i) mapping.view.ptr<int64_t>()[i] = i % 6 == 4 ? -1 - i : slots[i];
      const Tensor before = make_cache(rng, g, {});
      Tensor expected = before, actual = before;
      expected.view.data = expected.mem.data();
      actual.view.data = actual.mem.data();
      reference::ref_write_mla_cache({latent.view, TensorView(), mapping.view, expected.view});
      write_mla_cache({latent.view, TensorView(), mapping.view, actual.view});
      EXPECT_EQ(expected.mem, actual.mem);
      // Exactly the written tokens' value and scale bytes changed.
      const auto* old_bytes = reinterpret_cast<const uint8_t*>(before.mem.data());
      const auto* new_bytes = reinterpret_cast<const uint8_t*>(actual.mem.data());
      std::vector<bool> written(before.mem.size() * 8, false);
      int64_t unchanged_tokens = 0;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t slot = mapping.view.ptr<int64_t>()[i];
        if (slot < 0) continue;
        const int64_t block = (slot / block_size) * before.view.strides[0], t = slot % block_size;
        const int64_t values = block + V4::value_offset(t), scales = block + V4::scale_offset(block_size, t);
        for (int64_t b = 0; b < V4::kValueBytes; ++b) written[values + b] = true;
        for (int64_t b = 0; b < V4::kTiles; ++b) written[scales + b] = true;
        unchanged_tokens += std::memcmp(old_bytes + values, new_bytes + values, V4::kValueBytes) == 0;
        // Dequantised (the reference's reading), within e4m3's rounding: half an ulp of 3 mantissa bits, or half
        // the smallest subnormal (2^-10 of the scale); the rope part is bf16's rounding.
        const auto row = reference::ref_cache_row(actual.view, slot, MlaHead{0});
        for (int d = 0; d < kMlaLatentDim; ++d) {
          const double v = x[i * kMlaLatentDim + d];
          const double scale = std::ldexp(1.0, int(new_bytes[scales + d / V4::kTile]) - 127);
          const double bound = d < V4::kNopeDim ? std::max(std::fabs(v) * 0x1p-4, scale * 0x1p-10)
                                                : std::fabs(v) * 0x1p-8;
          ASSERT_LE(std::fabs(row[d] - v), bound) << "row " << i << ", value " << d;
        }
      }
      EXPECT_EQ(unchanged_tokens, 0);
      int64_t changed_outside = 0;
      for (size_t b = 0; b < written.size(); ++b) changed_outside += !written[b] && old_bytes[b] != new_bytes[b];
      EXPECT_EQ(changed_outside, 0) << "bytes outside the written tokens' values and scales changed";
      // A slot past the cache is refused before anything is written.
      mapping.view.ptr<int64_t>()[3] = g.num_blocks * g.block_size;
      Tensor untouched = before;
      untouched.view.data = untouched.mem.data();
      expect_error([&] { write_mla_cache({latent.view, TensorView(), mapping.view, untouched.view}); },
                   "write_mla_cache: slot_mapping: row 3 holds slot " + std::to_string(g.num_blocks * g.block_size));
      EXPECT_EQ(untouched.mem, before.mem);
    }
}

// ---------------------------------------------------------------------------
// Bad inputs: smla::Error whose message names the op and the argument.

// An invalid_argument smla::Error, one line, containing `needle`.
void expect_error(const std::function<void()>& run, const std::string& needle) {
  test::expect_error(run, ErrorKind::invalid_argument, {needle});
}

// An unsupported smla::Error, one line, containing `needle`.
void expect_unsupported(const std::function<void()>& run, const std::string& needle) {
  test::expect_error(run, ErrorKind::unsupported, {needle});
}

// The CPU backend's capabilities, named `name` and narrowed by `narrow`, with attention ops that must not run: the
// ops refuse what a backend does not declare before calling it.
class NarrowedCpuBackend final : public Backend {
 public:
  NarrowedCpuBackend(std::string name, const std::function<void(Capabilities&)>& narrow)
      : caps_(backend_for(Device::cpu()).capabilities()) {
    caps_.name = std::move(name);
    narrow(caps_);
  }
  const Capabilities& capabilities() const override { return caps_; }
  void write_mla_cache(const WriteMlaCacheArgs&) const override { ADD_FAILURE() << "write_mla_cache ran"; }
  void sparse_mla(const SparseMlaArgs&) const override { ADD_FAILURE() << "sparse_mla ran"; }
  void paged_mla_decode(const PagedMlaDecodeArgs&) const override { ADD_FAILURE() << "paged_mla_decode ran"; }
  void write_index_cache(const WriteIndexCacheArgs&) const override {}
  void indexer_topk(const IndexerTopkArgs&) const override {}
  void positions_to_slots(const PositionsToSlotsArgs&) const override {}

 private:
  Capabilities caps_;
};

// bad(mutate, needle): `op` run on a copy of `good` that `mutate` changed is such an error.
template <class Args>
auto mutations_refused(const Args& good, void (*op)(const Args&, const Backend*)) {
  return [good, op](const std::function<void(Args&)>& mutate, const std::string& needle) {
    Args a = good;
    mutate(a);
    expect_error([&] { op(a, nullptr); }, needle);
  };
}

TEST(SparseMlaErrors, NameTheArgument) {
  SparseCase c;
  c.name = "errors";
  c.topk_length = true;
  c.sink = true;
  SparseProblem p = make_sparse(c);
  const SparseMlaArgs good = p.args;
  ASSERT_NO_THROW(sparse_mla(good));
  const auto bad = mutations_refused(good, &sparse_mla);
  Tensor i64_indices = alloc({c.tokens, c.topk}, DType::i64);
  bad([](auto& a) { a.q.ndim = 2; }, "sparse_mla: q: expected 3 dimensions");
  bad([](auto& a) { a.q.dtype = DType::f32; }, "sparse_mla: q: expected dtype");
  bad([](auto& a) { a.q.shape[2] = 520; }, "sparse_mla: q: dimension 2 (absorbed head size) must be 576");
  // A 512-wide q (no rope part) needs a 512-wide 16-bit cache.
  bad([](auto& a) { a.q.shape[2] = 512; }, "sparse_mla: kv_cache: dimension 2 (row: c (512), no rope part)");
  bad([](auto& a) { a.kv_cache.dtype = DType::fp8_ds_mla_nope; }, "sparse_mla: kv_cache: fp8_ds_mla_nope has no rope part");
  bad([](auto& a) { a.q.shape[1] = 129; }, "sparse_mla: q: dimension 1 (heads)");
  bad([](auto& a) { a.q.data = nullptr; }, "sparse_mla: q: is required");
  bad([](auto& a) { a.q.strides[2] = 2; }, "sparse_mla: q: the last dimension must be contiguous");
  bad([](auto& a) { a.kv_cache.dtype = DType::f32; }, "sparse_mla: kv_cache: expected dtype");
  bad([](auto& a) { a.kv_cache.dtype = DType::fp8_ds_mla; }, "sparse_mla: kv_cache: dimension 2");
  bad([](auto& a) { a.kv_cache.strides[1] = 500; }, "sparse_mla: kv_cache: row stride");
  bad([](auto& a) { a.kv_cache.strides[0] = 576; }, "sparse_mla: kv_cache: block stride");
  bad([](auto& a) { a.kv_cache.device = Device::cuda(90); }, "sparse_mla: kv_cache: is on sm_90");
  bad([&](auto& a) { a.indices = i64_indices.view; }, "sparse_mla: indices: expected dtype");
  bad([](auto& a) { a.indices.shape[0] = 2; }, "sparse_mla: indices: dimension 0");
  bad([](auto& a) { a.indices.shape[1] = 0; }, "sparse_mla: indices: dimension 1 (K)");
  bad([](auto& a) { a.indices.shape[1] = 65537; }, "sparse_mla: indices: dimension 1 (K)");
  bad([](auto& a) { a.topk_length.dtype = DType::i64; }, "sparse_mla: topk_length: expected dtype");
  bad([](auto& a) { a.topk_length.shape[0] = 4; }, "sparse_mla: topk_length: dimension 0");
  bad([](auto& a) { a.attn_sink.shape[0] = 7; }, "sparse_mla: attn_sink: dimension 0");
  bad([](auto& a) { a.attn_sink.dtype = DType::bf16; }, "sparse_mla: attn_sink: expected dtype");
  bad([](auto& a) { a.softmax_scale = 0.f; }, "sparse_mla: softmax_scale");
  bad([](auto& a) { a.softmax_scale = std::numeric_limits<float>::quiet_NaN(); }, "sparse_mla: softmax_scale");
  bad([](auto& a) { a.softmax_scale = std::numeric_limits<float>::infinity(); }, "sparse_mla: softmax_scale");
  bad([](auto& a) { a.out.dtype = DType::f16; }, "sparse_mla: out: expected dtype bfloat16");
  bad([](auto& a) { a.out.shape[2] = 576; }, "sparse_mla: out: dimension 2");
  bad([](auto& a) { a.lse.dtype = DType::bf16; }, "sparse_mla: lse: expected dtype");
  bad([](auto& a) { a.lse.shape[1] = 9; }, "sparse_mla: lse: dimension 1");
  bad([](auto& a) { a.q.shape[1] = 0; }, "sparse_mla: q: dimension 1 (heads)");
  bad([](auto& a) { a.q.shape[0] = -1; }, "sparse_mla: q: negative size in dimension 0");
  bad([](auto& a) { a.kv_cache.strides[0] = -576; }, "sparse_mla: kv_cache: negative strides");
  bad([](auto& a) { a.indices.ndim = 3; }, "sparse_mla: indices: expected 2 dimensions");
  bad([](auto& a) { a.out.data = nullptr; }, "sparse_mla: out: is required");
  bad([](auto& a) { a.lse.device = Device::cuda(90); }, "sparse_mla: lse: is on sm_90");
  bad([](auto& a) { a.lse.strides[0] = -a.lse.strides[0]; }, "sparse_mla: lse: negative strides");
  bad([](auto& a) { a.out.shape[0] = 2; }, "sparse_mla: out: dimension 0 (T, as q)");
  // max_logits (optional) is checked as lse is: here a copy of lse's view, changed so that a check fails first.
  bad([](auto& a) { a.max_logits = a.lse; a.max_logits.shape[1] = 9; }, "sparse_mla: max_logits: dimension 1 (H, as");
  bad([](auto& a) { a.max_logits = a.lse; a.max_logits.dtype = DType::f16; }, "sparse_mla: max_logits: expected dtype");
  bad([](auto& a) { a.max_logits = a.lse; a.max_logits.ndim = 3; }, "sparse_mla: max_logits: expected 2 dimensions");
  bad([](auto& a) { a.max_logits = a.lse; a.max_logits.data = nullptr; }, "sparse_mla: max_logits: is required");
  bad([](auto& a) { a.max_logits = a.lse; }, "sparse_mla: max_logits: overlaps output lse");
  // Values only the CPU can read.
  p.topk_length.view.ptr<int32_t>()[1] = -1;
  expect_error([&] { sparse_mla(good); }, "sparse_mla: topk_length: row 1 is -1");
  p.topk_length.view.ptr<int32_t>()[1] = static_cast<int32_t>(c.topk + 1);
  expect_error([&] { sparse_mla(good); }, "sparse_mla: topk_length: row 1");
  p.topk_length.view.ptr<int32_t>()[1] = 0;
  // GPU tensors handed to the CPU backend.
  SparseMlaArgs gpu = good;
  for (TensorView* t : {&gpu.q, &gpu.kv_cache, &gpu.indices, &gpu.topk_length, &gpu.attn_sink, &gpu.out, &gpu.lse})
    t->device = Device::cuda(90);
  expect_error([&] { sparse_mla(gpu, &backend_for(Device::cpu())); }, "sparse_mla: backend 'cpu' does not run on sm_90");
}

// An extra cache of no blocks (null data, as frameworks hand out empty tensors): every extra index is invalid,
// its lengths are still checked.
TEST(SparseMlaExtraCache, NoBlocksMeansEveryExtraIndexInvalid) {
  SparseCase c;
  c.name = "extra_no_blocks";
  c.cache.rope_dim = 0;
  c.topk_length = true;
  c.sink = true;
  c.extra = CacheGeometry{DType::bf16, 2, 4, 0, 0, 0};
  c.extra_topk = 12;
  c.extra_topk_length = true;
  SparseProblem p = make_sparse(c);
  p.args.extra_kv_cache = TensorView(nullptr, {0, 4, kMlaLatentDim}, DType::bf16);
  sparse_mla(p.args);
  SparseMlaArgs main_only = p.args;
  main_only.extra_kv_cache = main_only.extra_indices = main_only.extra_topk_length = TensorView();
  expect_matches(reference::ref_sparse_mla(main_only), p.o);
  p.extra_topk_length.view.ptr<int32_t>()[0] = 13;
  expect_error([&] { sparse_mla(p.args); }, "sparse_mla: extra_topk_length: row 0 is 13");
}

// The extra cache's arguments, and a backend that does not declare it refusing it.
TEST(SparseMlaErrors, ExtraCacheNamesTheArgument) {
  SparseCase c;
  c.name = "extra_errors";
  c.cache.rope_dim = 0;
  c.extra = CacheGeometry{DType::bf16, 3, 5, 0, 0, 0};
  c.extra_topk = 9;
  c.extra_topk_length = true;
  SparseProblem p = make_sparse(c);
  const SparseMlaArgs good = p.args;
  ASSERT_NO_THROW(sparse_mla(good));
  const auto bad = mutations_refused(good, &sparse_mla);
  bad([](auto& a) { a.extra_kv_cache = TensorView(); }, "sparse_mla: extra_kv_cache: is required with extra_indices");
  bad([](auto& a) { a.extra_indices = TensorView(); }, "sparse_mla: extra_indices: is required");
  bad([](auto& a) { a.extra_kv_cache.dtype = DType::f16; }, "sparse_mla: extra_kv_cache: must have kv_cache's dtype");
  bad([](auto& a) { a.extra_kv_cache.shape[2] = 576; }, "sparse_mla: extra_kv_cache: dimension 2");
  bad([](auto& a) { a.extra_kv_cache.strides[1] = 100; }, "sparse_mla: extra_kv_cache: row stride");
  bad([](auto& a) { a.extra_kv_cache.device = Device::cuda(90); }, "sparse_mla: extra_kv_cache: is on sm_90");
  bad([](auto& a) { a.extra_indices.dtype = DType::i64; }, "sparse_mla: extra_indices: expected dtype");
  bad([](auto& a) { a.extra_indices.shape[0] = 2; }, "sparse_mla: extra_indices: dimension 0");
  bad([](auto& a) { a.extra_indices.shape[1] = 0; }, "sparse_mla: extra_indices: dimension 1 (K2)");
  bad([](auto& a) { a.extra_topk_length.shape[0] = 2; }, "sparse_mla: extra_topk_length: dimension 0");
  bad([](auto& a) { a.extra_topk_length.dtype = DType::i64; }, "sparse_mla: extra_topk_length: expected dtype");
  bad([&](auto& a) { a.out = p.extra_cache.view; }, "sparse_mla: out");
  p.extra_topk_length.view.ptr<int32_t>()[1] = 10;
  expect_error([&] { sparse_mla(good); }, "sparse_mla: extra_topk_length: row 1 is 10, outside [0, 9] (K2");
  p.extra_topk_length.view.ptr<int32_t>()[1] = -3;
  expect_error([&] { sparse_mla(good); }, "sparse_mla: extra_topk_length: row 1 is -3");
  p.extra_topk_length.view.ptr<int32_t>()[1] = 0;
  // An output written over an extra input is refused like one over kv_cache.
  SparseMlaArgs aliased = good;
  aliased.lse = TensorView(p.extra_indices.view.data, {c.tokens, c.heads}, DType::f32);
  expect_error([&] { sparse_mla(aliased); }, "sparse_mla: lse");
  // A backend that does not declare extra_cache refuses the second cache instead of ignoring it.
  const NarrowedCpuBackend one_cache("one_cache", [](Capabilities& c) { c.extra_cache = false; });
  expect_unsupported([&] { sparse_mla(good, &one_cache); },
                     "sparse_mla: extra_kv_cache: backend 'one_cache' does not attend a second cache");
}

TEST(PagedMlaDecodeErrors, NameTheArgument) {
  PagedCase c;
  c.name = "errors";
  c.batch = 2;
  c.s_q = 2;
  PagedProblem p = make_paged(c);
  const PagedMlaDecodeArgs good = p.args;
  ASSERT_NO_THROW(paged_mla_decode(good));
  const auto bad = mutations_refused(good, &paged_mla_decode);
  bad([](auto& a) { a.q.ndim = 3; }, "paged_mla_decode: q: expected 4 dimensions");
  bad([](auto& a) { a.block_table.dtype = DType::i64; }, "paged_mla_decode: block_table: expected dtype");
  bad([](auto& a) { a.block_table.shape[0] = 3; }, "paged_mla_decode: block_table: dimension 0");
  bad([](auto& a) { a.seq_lens.shape[0] = 1; }, "paged_mla_decode: seq_lens: dimension 0");
  bad([](auto& a) { a.seq_lens.data = nullptr; }, "paged_mla_decode: seq_lens: is required");
  bad([](auto& a) { a.out.shape[1] = 1; }, "paged_mla_decode: out: dimension 1");
  bad([](auto& a) { a.lse.shape[2] = 1; }, "paged_mla_decode: lse: dimension 2");
  bad([](auto& a) { a.softmax_scale = -1.f; }, "paged_mla_decode: softmax_scale");
  bad([](auto& a) { a.kv_cache.device = Device::cuda(80); }, "paged_mla_decode: kv_cache: is on sm_80");
  bad([](auto& a) { a.q.dtype = DType::f32; }, "paged_mla_decode: q: expected dtype");
  bad([](auto& a) { a.q.shape[3] = 640; }, "paged_mla_decode: q: dimension 3 (absorbed head size)");
  bad([](auto& a) { a.q.shape[3] = 512; }, "paged_mla_decode: kv_cache: dimension 2 (row: c (512), no rope part)");
  bad([](auto& a) { a.seq_lens.dtype = DType::i64; }, "paged_mla_decode: seq_lens: expected dtype");
  bad([](auto& a) { a.out.dtype = DType::f32; }, "paged_mla_decode: out: expected dtype");
  bad([](auto& a) { a.lse.dtype = DType::bf16; }, "paged_mla_decode: lse: expected dtype");
  bad([](auto& a) { a.out.shape[3] = 576; }, "paged_mla_decode: out: dimension 3 (value size)");
  bad([](auto& a) { a.lse.ndim = 2; }, "paged_mla_decode: lse: expected 3 dimensions");
  int32_t* lens = p.seq_lens.view.ptr<int32_t>();
  int32_t* table = p.table.view.ptr<int32_t>();
  const int32_t len0 = lens[0], capacity = static_cast<int32_t>(c.max_blocks * c.block_size);
  lens[0] = -3;
  expect_error([&] { paged_mla_decode(good); }, "paged_mla_decode: seq_lens: row 0 is -3");
  lens[0] = capacity + 1;
  expect_error([&] { paged_mla_decode(good); }, "paged_mla_decode: seq_lens: row 0 is " + std::to_string(capacity + 1));
  lens[0] = 1;
  expect_error([&] { paged_mla_decode(good); }, "paged_mla_decode: seq_lens: row 0 is 1, shorter than the s_q");
  PagedMlaDecodeArgs full = good;
  full.causal = false;
  EXPECT_NO_THROW(paged_mla_decode(full));  // without causality one position is fine
  // A bad block id is an error only where seq_lens reads it.
  lens[0] = static_cast<int32_t>(c.block_size);
  const int32_t block1 = table[1];
  table[1] = -5;
  EXPECT_NO_THROW(paged_mla_decode(good));
  lens[0] = static_cast<int32_t>(c.block_size + 1);
  expect_error([&] { paged_mla_decode(good); }, "paged_mla_decode: block_table: row 0, column 1 is -5");
  table[1] = static_cast<int32_t>(p.cache.view.shape[0]);
  expect_error([&] { paged_mla_decode(good); }, "paged_mla_decode: block_table: row 0, column 1");
  table[1] = block1;
  lens[0] = len0;
}

TEST(WriteMlaCacheErrors, NameTheArgument) {
  Rng rng(7);
  Tensor latent = alloc({4, kMlaLatentDim}, DType::f32), k_pe = alloc({4, kMlaRopeDim}, DType::f32);
  for (Tensor* t : {&latent, &k_pe}) {
    const auto v = test::random_floats(rng, t->view.numel());
    std::copy(v.begin(), v.end(), t->view.ptr<float>());
  }
  Tensor mapping = alloc({4}, DType::i64);
  for (int i = 0; i < 4; ++i) mapping.view.ptr<int64_t>()[i] = i;
  Tensor cache = make_cache(rng, {DType::fp8_ds_mla, 2, 4, 0, 0}, {});
  const WriteMlaCacheArgs good{latent.view, k_pe.view, mapping.view, cache.view};
  ASSERT_NO_THROW(write_mla_cache(good));
  const auto bad = mutations_refused(good, &write_mla_cache);
  bad([](auto& a) { a.latent.dtype = DType::i32; }, "write_mla_cache: latent: expected dtype");
  bad([](auto& a) { a.latent.shape[1] = 576; }, "write_mla_cache: latent: dimension 1");
  bad([](auto& a) { a.k_pe.dtype = DType::bf16; }, "write_mla_cache: k_pe: expected dtype float32");
  bad([](auto& a) { a.k_pe.shape[0] = 3; }, "write_mla_cache: k_pe: dimension 0");
  bad([](auto& a) { a.slot_mapping.dtype = DType::i32; }, "write_mla_cache: slot_mapping: expected dtype");
  bad([](auto& a) { a.slot_mapping.shape[0] = 5; }, "write_mla_cache: slot_mapping: dimension 0");
  bad([](auto& a) { a.cache.dtype = DType::bf16; }, "write_mla_cache: cache: dimension 2");
  bad([](auto& a) { a.latent.device = Device::cuda(120); }, "write_mla_cache: latent: is on sm_120");
  mapping.view.ptr<int64_t>()[2] = 8;
  expect_error([&] { write_mla_cache(good); }, "write_mla_cache: slot_mapping: row 2 holds slot 8");
}

// A head with no rope part: q 512 wide; a mismatched cache names the cache and the width it must have.
TEST(SparseMlaErrors, NoRopePartGeometry) {
  SparseCase c;
  c.name = "nope_errors";
  c.cache.rope_dim = 0;
  c.cache.dtype = DType::fp8_ds_mla_nope;
  SparseProblem p = make_sparse(c);
  ASSERT_NO_THROW(sparse_mla(p.args));
  Rng rng(3);
  Tensor wide = make_cache(rng, {DType::bf16, 8, 16, 0, 0, kMlaRopeDim}, {});
  Tensor wide_q = make_q(rng, {c.tokens}, c.heads, DType::bf16, false);
  SparseMlaArgs a = p.args;
  a.kv_cache = wide.view;  // 576-wide bf16 rows under a 512-wide q
  expect_error([&] { sparse_mla(a); }, "sparse_mla: kv_cache: dimension 2 (row: c (512), no rope part) must be 512");
  a = p.args;
  a.q = wide_q.view;  // the compact rope-free cache under a 576-wide q
  expect_error([&] { sparse_mla(a); }, "sparse_mla: kv_cache: fp8_ds_mla_nope has no rope part, but the head is 576");
  a = p.args;
  a.kv_cache.shape[2] = kFp8DsMlaRowBytes;  // a 656-byte row declared fp8_ds_mla_nope
  expect_error([&] { sparse_mla(a); }, "sparse_mla: kv_cache: dimension 2 (fp8_ds_mla_nope row");
  a = p.args;
  a.out.shape[2] = 576;
  expect_error([&] { sparse_mla(a); }, "sparse_mla: out: dimension 2");
  // write_mla_cache: no k_pe writes the rope-free forms; a k_pe with them, or none with a 576-wide cache, is wrong.
  Tensor latent = alloc({2, kMlaLatentDim}, DType::f32), k_pe = alloc({2, kMlaRopeDim}, DType::f32);
  Tensor mapping = alloc({2}, DType::i64);
  mapping.view.ptr<int64_t>()[0] = 0;
  mapping.view.ptr<int64_t>()[1] = 1;
  expect_error([&] { write_mla_cache({latent.view, k_pe.view, mapping.view, p.cache.view}); },
               "write_mla_cache: cache: fp8_ds_mla_nope has no rope part");
  expect_error([&] { write_mla_cache({latent.view, TensorView(), mapping.view, wide.view}); },
               "write_mla_cache: cache: dimension 2 (row: c (512), no rope part) must be 512");
}

// DeepSeek-V4's fp8 cache: 512-wide heads only, rows of exactly 584 bytes, the extra cache of the same form; a
// backend that does not declare the dtype (the CUDA backend, so far) refuses it as unsupported.
TEST(SparseMlaErrors, V4Fp8Geometry) {
  SparseCase c;
  c.name = "v4fp8_errors";
  c.cache = {DType::fp8_ds_mla_v4, 4, 16, 0, v4_block_pad(16), 0};
  c.extra = CacheGeometry{DType::fp8_ds_mla_v4, 3, 5, 0, 0, 0};
  c.extra_topk = 8;
  SparseProblem p = make_sparse(c);
  ASSERT_NO_THROW(sparse_mla(p.args));
  Rng rng(4);
  SparseMlaArgs a = p.args;
  Tensor wide_q = make_q(rng, {c.tokens}, c.heads, DType::bf16, false);
  a.q = wide_q.view;
  a.out = p.args.out;
  expect_error([&] { sparse_mla(a); },
               "sparse_mla: kv_cache: fp8_ds_mla_v4 holds DeepSeek-V4's 512-wide heads (its rope part inside the "
               "512), but the head is 576 wide");
  a = p.args;
  a.kv_cache.shape[2] = kFp8DsMlaRowBytes;  // a 656-byte row declared fp8_ds_mla_v4
  expect_error([&] { sparse_mla(a); }, "sparse_mla: kv_cache: dimension 2 (fp8_ds_mla_v4 row: 448 e4m3 + 64 bf16 "
                                       "rope + 7 ue8m0 scales + 1 pad) must be 584");
  Tensor padded_rows = alloc({4, 16, 584}, DType::fp8_ds_mla_v4, {16 * 600, 600, 1});
  a = p.args;
  a.kv_cache = padded_rows.view;
  expect_error([&] { sparse_mla(a); }, "sparse_mla: kv_cache: row stride 600 must be 584");
  Tensor bf16_extra = make_cache(rng, {DType::bf16, 3, 5, 0, 0, 0}, {});
  a = p.args;
  a.extra_kv_cache = bf16_extra.view;
  expect_error([&] { sparse_mla(a); }, "sparse_mla: extra_kv_cache: must have kv_cache's dtype (fp8_ds_mla_v4)");

  const NarrowedCpuBackend no_v4("no_v4", [](Capabilities& c) {
    c.kv_cache_dtypes = {std::begin(kMlaCacheDTypes), std::end(kMlaCacheDTypes)};
  });
  expect_unsupported([&] { sparse_mla(p.args, &no_v4); },
                     "sparse_mla: kv_cache: backend 'no_v4' does not read fp8_ds_mla_v4 caches");
  Tensor latent = alloc({2, kMlaLatentDim}, DType::f32), mapping = alloc({2}, DType::i64);
  std::fill_n(latent.view.ptr<float>(), 2 * kMlaLatentDim, 0.5f);
  mapping.view.ptr<int64_t>()[0] = 0;
  mapping.view.ptr<int64_t>()[1] = 17;
  expect_unsupported([&] { write_mla_cache({latent.view, TensorView(), mapping.view, p.cache.view}, &no_v4); },
                     "write_mla_cache: cache: backend 'no_v4' does not read fp8_ds_mla_v4 caches");
  PagedMlaDecodeArgs paged;
  Tensor q = make_q(rng, {1, 1}, 4, DType::bf16, false, MlaHead{0}), table = alloc({1, 1}, DType::i32);
  Tensor seq_lens = alloc({1}, DType::i32);
  table.view.ptr<int32_t>()[0] = 1;
  seq_lens.view.ptr<int32_t>()[0] = 3;
  Outputs o = make_outputs({1, 1}, 4, DType::bf16, false);
  paged = {q.view, p.cache.view, table.view, seq_lens.view, TensorView(), 0.2f, true, o.out.view, o.lse.view};
  expect_unsupported([&] { paged_mla_decode(paged, &no_v4); },
                     "paged_mla_decode: kv_cache: backend 'no_v4' does not read fp8_ds_mla_v4 caches");
  // A k_pe (a 576-wide head) cannot be written to it.
  Tensor k_pe = alloc({2, kMlaRopeDim}, DType::f32);
  expect_error([&] { write_mla_cache({latent.view, k_pe.view, mapping.view, p.cache.view}); },
               "write_mla_cache: cache: fp8_ds_mla_v4 holds DeepSeek-V4's 512-wide heads");
}

// Empty batches are valid: nothing is read or written.
TEST(SparseMlaEmpty, BatchOfZeroTokens) {
  SparseMlaArgs a;
  Rng rng(1);
  Tensor cache = make_cache(rng, {}, {});
  a.q = TensorView(nullptr, {0, 8, kMlaQkDim}, DType::bf16);
  a.kv_cache = cache.view;
  a.indices = TensorView(nullptr, {0, 16}, DType::i32);
  a.softmax_scale = 0.1f;
  a.out = TensorView(nullptr, {0, 8, kMlaVDim}, DType::bf16);
  a.lse = TensorView(nullptr, {0, 8}, DType::f32);
  EXPECT_NO_THROW(sparse_mla(a));
}

}  // namespace
}  // namespace smla
