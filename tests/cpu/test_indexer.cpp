// The CPU indexer ops against the float64 references: write_index_cache
// (bit-exact), indexer_topk (every kernel this CPU runs: AVX-512, AVX2,
// portable), positions_to_slots, dsa_decode_step end to end, and the
// argument checks.
//
// Top-k comparison: kernel scores are fp32 sums of exact products, so they
// differ from the float64 reference by ~1e-6 relative. Two positions whose
// reference scores are that close may legitimately swap, so check_topk()
// allows a mismatch at rank i only when the reference scores of the two
// positions are within a tolerance; everything else (the set, the order,
// the -1 padding) must be identical. Exact equality, including the tie rule,
// is tested on data whose scores are either exactly equal (duplicate keys)
// or far apart.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <optional>
#include <string>

#include "core/numeric.h"
#include "cpu/indexer.h"
#include "cpu/indexer_scores.h"
#include "smla/error.h"
#include "smla/ops.h"
#include "smla/select.h"
#include "reference/indexer_reference.h"
#include "reference/mla_reference.h"
#include "support/test_util.h"

namespace smla {
namespace {

using cpu::Isa;
using test::Rng;

const Backend& cpu_backend() { return *Registry::global().find("cpu"); }

std::vector<Isa> supported_isas() {
  std::vector<Isa> isas;
  for (Isa isa : cpu::indexer::kScoreKernelIsas)
    if (cpu::isa_supported(isa)) isas.push_back(isa);
  return isas;
}

// Runs the indexer with one kernel for the guard's lifetime.
struct ForceIsa {
  explicit ForceIsa(Isa isa) { cpu::force_isa(isa); }
  ~ForceIsa() { cpu::force_isa(std::nullopt); }
};

// Expects `f` to throw an invalid_argument smla::Error, one line, that contains every fragment.
void expect_error(const std::function<void()>& f, std::initializer_list<std::string> fragments) {
  test::expect_error(f, ErrorKind::invalid_argument, fragments);
}

// A paged index cache with padded blocks (and padded rows for bf16), every
// byte 0xff (NaN) until written.
struct IndexCache {
  std::vector<uint8_t> bytes;
  TensorView view;
  IndexCache(DType dtype, int64_t blocks, int64_t block_size) {
    constexpr int64_t kPadBytes = 64, kBf16RowStride = 136;
    if (dtype == DType::bf16) {
      const int64_t block_bytes = block_size * kBf16RowStride * 2 + kPadBytes;
      bytes.assign(blocks * block_bytes, 0xff);
      view = TensorView(bytes.data(), {blocks, block_size, 128}, {block_bytes / 2, kBf16RowStride, 1}, dtype);
    } else {
      const int64_t block_bytes = block_size * kFp8IndexRowBytes + kPadBytes;
      bytes.assign(blocks * block_bytes, 0xff);
      view = TensorView(bytes.data(), {blocks, block_size, kFp8IndexRowBytes}, {block_bytes, kFp8IndexRowBytes, 1},
                        dtype);
    }
  }
};

// ---------------------------------------------------------------- write_index_cache

TEST(WriteIndexCache, MatchesReferenceBitForBit) {
  Rng rng(1);
  for (DType cache_dtype : {DType::bf16, DType::fp8_e4m3})
    for (DType k_dtype : {DType::f32, DType::f16, DType::bf16})
      for (int64_t block_size : {1, 16, 64}) {
        SCOPED_TRACE(std::string(dtype_name(cache_dtype)) + " from " + std::string(dtype_name(k_dtype)) + " bs " +
                     std::to_string(block_size));
        const int64_t blocks = 5, slots = blocks * block_size, n = 3 * block_size + 2;
        std::vector<float> values = test::random_floats(rng, n * 128, -3.f, 3.f);
        for (int64_t d = 0; d < 128; ++d) values[128 + d] *= 1e-3f;  // small amax: a different scale
        std::vector<uint8_t> k = test::to_bytes(values, k_dtype);
        std::vector<int64_t> slot_mapping(n);
        std::vector<int64_t> perm(slots);
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng);
        for (int64_t i = 0; i < n; ++i) slot_mapping[i] = i % 7 == 3 ? -1 : perm[i];  // some rows skipped
        IndexCache got(cache_dtype, blocks, block_size), want(cache_dtype, blocks, block_size);
        WriteIndexCacheArgs a;
        a.k = TensorView(k.data(), {n, 128}, k_dtype);
        a.slot_mapping = TensorView(slot_mapping.data(), {n}, DType::i64);
        a.cache = got.view;
        write_index_cache(a, &cpu_backend());
        a.cache = want.view;
        reference::ref_write_index_cache(a);
        EXPECT_TRUE(got.bytes == want.bytes);
      }
}

TEST(WriteIndexCache, Fp8LayoutAndScaleRule) {
  // One token in slot 5 of a block of 8: bytes at [5*128, +128), scale at 8*128 + 5*4.
  std::vector<float> k(128);
  // Values with 3 mantissa bits, so exact in e4m3 after scaling; amax 1.875 * 16 = 30.
  for (int d = 0; d < 128; ++d) k[d] = (d % 2 ? -1.f : 1.f) * (1.f + d % 8 / 8.f) * std::ldexp(1.f, d % 6 - 1);
  std::vector<int64_t> slot{5};
  IndexCache cache(DType::fp8_e4m3, 1, 8);
  WriteIndexCacheArgs a;
  a.k = TensorView(k.data(), {1, 128}, DType::f32);
  a.slot_mapping = TensorView(slot.data(), {1}, DType::i64);
  a.cache = cache.view;
  write_index_cache(a, &cpu_backend());
  float scale;
  std::memcpy(&scale, cache.bytes.data() + 8 * 128 + 5 * 4, 4);
  EXPECT_EQ(scale, 0.125f);  // 30 / 448 = 0.067 rounded up to a power of two
  for (int d = 0; d < 128; ++d)
    EXPECT_EQ(numeric::e4m3_to_float(cache.bytes[5 * 128 + d]) * scale, k[d]) << d;  // all exact in e4m3
  EXPECT_EQ(cache.bytes[4 * 128], 0xff);  // neighbours untouched
  EXPECT_EQ(cache.bytes[6 * 128], 0xff);
}

TEST(WriteIndexCache, SlotOutOfRangeNamesTheRow) {
  std::vector<float> k(3 * 128, 1.f);
  std::vector<int64_t> slots{0, -5, 64};
  IndexCache cache(DType::fp8_e4m3, 4, 16);
  WriteIndexCacheArgs a;
  a.k = TensorView(k.data(), {3, 128}, DType::f32);
  a.slot_mapping = TensorView(slots.data(), {3}, DType::i64);
  a.cache = cache.view;
  expect_error([&] { write_index_cache(a, &cpu_backend()); }, {"write_index_cache", "slot_mapping", "row 2", "64"});
}

// ---------------------------------------------------------------- indexer_topk

struct ProblemSpec {
  DType q_dtype = DType::bf16;
  DType cache_dtype = DType::bf16;
  int64_t block_size = 16;
  int64_t heads = 32;
  int64_t k = 64;
  std::vector<int> contexts;    // per token
  std::vector<int> request_of;  // per token
  int palette = 0;              // > 0: keys drawn from this many distinct keys (exact ties)
};

// An indexer problem: inputs in their storage types and the topk output.
// Each request's blocks are scattered at random; table entries past a
// request's context hold ids that are out of range and must not be read.
struct Problem {
  ProblemSpec spec;
  std::vector<uint8_t> q;
  std::vector<float> q_scale, weights;
  std::optional<IndexCache> cache;
  std::vector<int32_t> request_ids, block_table, context_lens, topk;
  int64_t requests = 0, max_blocks = 0, num_blocks = 0;

  int64_t tokens() const { return static_cast<int64_t>(spec.contexts.size()); }
  IndexerTopkArgs args() {
    IndexerTopkArgs a;
    const int64_t t = tokens(), h = spec.heads;
    a.q = TensorView(q.data(), {t, h, 128}, spec.q_dtype);
    if (spec.q_dtype == DType::fp8_e4m3) a.q_scale = TensorView(q_scale.data(), {t, h}, DType::f32);
    a.weights = TensorView(weights.data(), {t, h}, DType::f32);
    a.index_cache = cache->view;
    a.request_ids = TensorView(request_ids.data(), {t}, DType::i32);
    a.block_table = TensorView(block_table.data(), {requests, max_blocks}, DType::i32);
    a.context_lens = TensorView(context_lens.data(), {t}, DType::i32);
    a.topk = TensorView(topk.data(), {t, spec.k}, DType::i32);
    return a;
  }
};

Problem make_problem(Rng& rng, const ProblemSpec& spec) {
  Problem p;
  p.spec = spec;
  const int64_t tokens = p.tokens(), bs = spec.block_size;
  p.requests = *std::max_element(spec.request_of.begin(), spec.request_of.end()) + 1;
  std::vector<int64_t> request_len(p.requests, 0);
  for (int64_t t = 0; t < tokens; ++t)
    request_len[spec.request_of[t]] = std::max<int64_t>(request_len[spec.request_of[t]], spec.contexts[t]);
  std::vector<int64_t> blocks_of(p.requests);
  for (int64_t r = 0; r < p.requests; ++r) {
    blocks_of[r] = (request_len[r] + bs - 1) / bs;
    p.num_blocks += blocks_of[r];
    p.max_blocks = std::max(p.max_blocks, blocks_of[r] + 1);
  }
  p.num_blocks += 3;  // spare blocks nobody owns
  std::vector<int32_t> ids(p.num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  p.block_table.assign(p.requests * p.max_blocks, 0);
  size_t next = 0;
  for (int64_t r = 0; r < p.requests; ++r)
    for (int64_t i = 0; i < p.max_blocks; ++i)
      p.block_table[r * p.max_blocks + i] = i < blocks_of[r] ? ids[next++] : (i % 2 ? -3 : 1000000);

  // Keys: written through the reference writer into each request's slots.
  std::vector<std::vector<float>> palette;
  for (int i = 0; i < spec.palette; ++i) palette.push_back(test::random_floats(rng, 128));
  std::vector<float> keys;
  std::vector<int64_t> slots;
  for (int64_t r = 0; r < p.requests; ++r)
    for (int64_t s = 0; s < request_len[r]; ++s) {
      const auto key = spec.palette ? palette[rng() % spec.palette] : test::random_floats(rng, 128);
      keys.insert(keys.end(), key.begin(), key.end());
      slots.push_back(int64_t{p.block_table[r * p.max_blocks + s / bs]} * bs + s % bs);
    }
  p.cache.emplace(spec.cache_dtype, p.num_blocks, bs);
  if (!slots.empty()) {
    WriteIndexCacheArgs w;
    w.k = TensorView(keys.data(), {static_cast<int64_t>(slots.size()), 128}, DType::f32);
    w.slot_mapping = TensorView(slots.data(), {static_cast<int64_t>(slots.size())}, DType::i64);
    w.cache = p.cache->view;
    reference::ref_write_index_cache(w);
  }

  // Queries: bf16 / f16 directly; fp8 with a per-(token, head) scale.
  const int64_t n = tokens * spec.heads;
  const std::vector<float> qv = test::random_floats(rng, n * 128);
  if (spec.q_dtype == DType::fp8_e4m3) {
    p.q.resize(n * 128);
    p.q_scale.resize(n);
    for (int64_t i = 0; i < n; ++i) {
      float amax = 0;
      for (int d = 0; d < 128; ++d) amax = std::max(amax, std::fabs(qv[i * 128 + d]));
      p.q_scale[i] = amax / 448.f * 1.37f;  // any positive scale
      for (int d = 0; d < 128; ++d) p.q[i * 128 + d] = numeric::float_to_e4m3(qv[i * 128 + d] / p.q_scale[i]);
    }
  } else {
    p.q = test::to_bytes(qv, spec.q_dtype);
  }
  p.weights = test::random_floats(rng, n);
  p.request_ids.assign(spec.request_of.begin(), spec.request_of.end());
  p.context_lens.assign(spec.contexts.begin(), spec.contexts.end());
  p.topk.assign(tokens * spec.k, 12345);
  return p;
}

// Checks one token's top-k row against the reference scores (see the file
// comment). Returns "" or the first problem; counts near-tie swaps.
std::string check_topk(const std::vector<double>& scores, const int32_t* got, int64_t k, int* swaps) {
  const std::vector<int32_t> want = reference::ref_topk_of_scores(scores, k);
  double scale = 0;
  for (double s : scores) scale = std::max(scale, std::fabs(s));
  const double tol = 2e-5 * scale;
  std::vector<bool> seen(scores.size(), false);
  for (int64_t i = 0; i < k; ++i) {
    if (want[i] < 0 || got[i] < 0) {
      if (want[i] != got[i]) return "rank " + std::to_string(i) + ": " + std::to_string(got[i]) + " vs " +
                                    std::to_string(want[i]) + " (padding)";
      continue;
    }
    if (got[i] >= static_cast<int64_t>(scores.size())) return "rank " + std::to_string(i) + ": out of context";
    if (seen[got[i]]) return "rank " + std::to_string(i) + ": position " + std::to_string(got[i]) + " twice";
    seen[got[i]] = true;
    if (got[i] != want[i]) {
      if (std::fabs(scores[got[i]] - scores[want[i]]) > tol)
        return "rank " + std::to_string(i) + ": position " + std::to_string(got[i]) + " (score " +
               std::to_string(scores[got[i]]) + ") where the reference has " + std::to_string(want[i]) + " (" +
               std::to_string(scores[want[i]]) + ")";
      ++*swaps;
    }
  }
  return "";
}

// Runs the problem with every kernel and compares each token with the reference.
void expect_matches_reference(Problem& p, bool exact = false) {
  IndexerTopkArgs a = p.args();
  std::vector<std::vector<double>> scores(p.tokens());
  for (int64_t t = 0; t < p.tokens(); ++t) scores[t] = reference::ref_indexer_scores(a, t);
  for (Isa isa : supported_isas()) {
    SCOPED_TRACE("kernel " + std::string(cpu::isa_name(isa)));
    ForceIsa force(isa);
    std::fill(p.topk.begin(), p.topk.end(), 12345);
    indexer_topk(a, &cpu_backend());
    int swaps = 0;
    for (int64_t t = 0; t < p.tokens(); ++t) {
      const int32_t* row = p.topk.data() + t * p.spec.k;
      if (exact) {
        EXPECT_EQ(std::vector<int32_t>(row, row + p.spec.k), reference::ref_topk_of_scores(scores[t], p.spec.k))
            << "token " << t;
      } else {
        EXPECT_EQ(check_topk(scores[t], row, p.spec.k, &swaps), "") << "token " << t;
      }
    }
    EXPECT_LE(swaps, 2) << "near-tie swaps should be rare on random data";
  }
}

struct Combo {
  DType q_dtype, cache_dtype;
  int64_t block_size, heads;
};

class IndexerTopkReference : public ::testing::TestWithParam<Combo> {};

TEST_P(IndexerTopkReference, MatchesReferenceWithEveryKernel) {
  const Combo c = GetParam();
  Rng rng(static_cast<uint64_t>(c.block_size * 1000 + c.heads * 10 + static_cast<int>(c.q_dtype) * 3 +
                                static_cast<int>(c.cache_dtype)));
  // Shorter than K (padding), empty, exactly K, longer, and past one work
  // item (1024 positions); tokens 3 and 4 share a request, as in speculative decoding.
  const ProblemSpec spec{.q_dtype = c.q_dtype, .cache_dtype = c.cache_dtype, .block_size = c.block_size,
                         .heads = c.heads, .k = 100, .contexts = {37, 0, 100, 700, 1400},
                         .request_of = {0, 1, 2, 3, 3}};
  Problem p = make_problem(rng, spec);
  expect_matches_reference(p);
}

std::vector<Combo> combos() {
  std::vector<Combo> out;
  const int64_t heads[] = {64, 20, 128, 1, 32, 80};  // lane-padded, multi-chunk and 3-group chunks
  int i = 0;
  for (DType q : {DType::bf16, DType::f16, DType::fp8_e4m3})
    for (DType cache : {DType::bf16, DType::fp8_e4m3})
      for (int64_t bs : {1, 16, 64}) out.push_back({q, cache, bs, heads[i++ % 6]});
  return out;
}

std::string combo_name(const ::testing::TestParamInfo<Combo>& info) {
  auto name = [](DType d) { return d == DType::fp8_e4m3 ? "fp8" : d == DType::f16 ? "f16" : "bf16"; };
  const Combo& c = info.param;
  return std::string("q_") + name(c.q_dtype) + "_cache_" + name(c.cache_dtype) + "_bs" + std::to_string(c.block_size) +
         "_h" + std::to_string(c.heads);
}

INSTANTIATE_TEST_SUITE_P(Combos, IndexerTopkReference, ::testing::ValuesIn(combos()), combo_name);

TEST(IndexerTopk, TiesGoToTheLowerPosition) {
  // Six distinct keys repeated over the context: scores tie exactly in groups.
  for (DType cache : {DType::bf16, DType::fp8_e4m3}) {
    SCOPED_TRACE(dtype_name(cache));
    Rng rng(7);
    const ProblemSpec spec{.cache_dtype = cache, .block_size = 16, .heads = 16, .k = 50, .contexts = {300, 40, 1100},
                           .request_of = {0, 1, 2}, .palette = 6};
    Problem p = make_problem(rng, spec);
    // Each token's six distinct scores must be far apart for the expected order to be unambiguous.
    for (int64_t t = 0; t < p.tokens(); ++t) {
      std::vector<double> s = reference::ref_indexer_scores(p.args(), t);
      std::sort(s.begin(), s.end());
      s.erase(std::unique(s.begin(), s.end()), s.end());
      for (size_t i = 1; i < s.size(); ++i) ASSERT_GT(s[i] - s[i - 1], 1e-3) << "token " << t << ": pick another seed";
    }
    expect_matches_reference(p, /*exact=*/true);
  }
}

TEST(IndexerTopk, ContextsShorterThanKArePaddedWithMinusOne) {
  Rng rng(11);
  const ProblemSpec spec{.heads = 8, .k = 64, .contexts = {0, 1, 63, 64, 65}, .request_of = {0, 1, 2, 3, 4}};
  Problem p = make_problem(rng, spec);
  indexer_topk(p.args(), &cpu_backend());
  for (int64_t t = 0; t < p.tokens(); ++t) {
    const int32_t* row = p.topk.data() + t * spec.k;
    const int64_t valid = std::min<int64_t>(spec.contexts[t], spec.k);
    for (int64_t i = valid; i < spec.k; ++i) EXPECT_EQ(row[i], -1) << "token " << t << " rank " << i;
    if (spec.contexts[t] > spec.k) continue;
    std::vector<int32_t> sorted(row, row + valid), all(valid);  // the whole context, in some order
    std::sort(sorted.begin(), sorted.end());
    std::iota(all.begin(), all.end(), 0);
    EXPECT_EQ(sorted, all) << "token " << t;
  }
  expect_matches_reference(p);
}

TEST(IndexerTopk, LargeKOnALongContext) {
  // K = 2048 of 5000 positions: the radix select's levels and many work items.
  Rng rng(5);
  const ProblemSpec spec{.block_size = 64, .heads = 4, .k = 2048, .contexts = {5000, 2048, 3000},
                         .request_of = {0, 0, 1}};
  Problem p = make_problem(rng, spec);
  expect_matches_reference(p);
}

// A best-first top-k row in ascending position order, its -1 padding left last: what sorted = false returns.
std::vector<int32_t> by_position(std::vector<int32_t> row) {
  std::sort(row.begin(), std::find(row.begin(), row.end(), -1));
  return row;
}

TEST(IndexerTopk, UnsortedIsTheSortedSetByPosition) {
  // Exact ties (a palette of 6 keys), rows shorter than K, empty, K larger than every row, and rows long enough
  // for the sampled floor (over 4096 positions), with every kernel.
  for (const auto& [k, palette] : {std::pair<int64_t, int>{50, 6}, {64, 0}, {2048, 0}, {7000, 3}}) {
    SCOPED_TRACE("k " + std::to_string(k) + " palette " + std::to_string(palette));
    Rng rng(static_cast<uint64_t>(k + palette));
    const ProblemSpec spec{.heads = 8, .k = k, .contexts = {0, 1, 49, 300, 1100, 5000},
                           .request_of = {0, 1, 2, 3, 4, 4}, .palette = palette};
    Problem p = make_problem(rng, spec);
    for (Isa isa : supported_isas()) {
      SCOPED_TRACE("kernel " + std::string(cpu::isa_name(isa)));
      ForceIsa force(isa);
      IndexerTopkArgs a = p.args();
      std::fill(p.topk.begin(), p.topk.end(), 12345);
      indexer_topk(a, &cpu_backend());
      const std::vector<int32_t> sorted = p.topk;
      std::fill(p.topk.begin(), p.topk.end(), 12345);
      a.sorted = false;
      indexer_topk(a, &cpu_backend());
      for (int64_t t = 0; t < p.tokens(); ++t) {
        const auto row = [&](const std::vector<int32_t>& v) {
          return std::vector<int32_t>(v.begin() + t * k, v.begin() + (t + 1) * k);
        };
        EXPECT_EQ(row(p.topk), by_position(row(sorted))) << "token " << t;
      }
    }
  }
}

TEST(IndexerTopk, KernelsAgreeOnStridedQuery) {
  // q and weights with padded rows: the packers follow strides.
  Rng rng(9);
  const ProblemSpec spec{.q_dtype = DType::f16, .heads = 24, .k = 32, .contexts = {500, 321}, .request_of = {0, 1}};
  Problem p = make_problem(rng, spec);
  IndexerTopkArgs dense = p.args();
  const int64_t t = p.tokens(), h = spec.heads, head_stride = 136, token_stride = h * head_stride + 8;
  std::vector<uint16_t> q(t * token_stride, 0x7e00);  // NaN padding
  std::vector<float> weights(t * (h + 5), NAN);
  for (int64_t i = 0; i < t; ++i)
    for (int64_t j = 0; j < h; ++j) {
      std::memcpy(&q[i * token_stride + j * head_stride], p.q.data() + (i * h + j) * 256, 256);
      weights[i * (h + 5) + j] = p.weights[i * h + j];
    }
  IndexerTopkArgs strided = dense;
  strided.q = TensorView(q.data(), {t, h, 128}, {token_stride, head_stride, 1}, DType::f16);
  strided.weights = TensorView(weights.data(), {t, h}, {h + 5, 1}, DType::f32);
  std::vector<int32_t> out(t * spec.k);
  strided.topk = TensorView(out.data(), {t, spec.k}, DType::i32);
  indexer_topk(dense, &cpu_backend());
  indexer_topk(strided, &cpu_backend());
  EXPECT_EQ(out, p.topk);
}

TEST(IndexerTopk, Fp8WideningMatchesTheScalarConversion) {
  for (Isa isa : supported_isas())
    for (int half = 0; half < 2; ++half) {
      uint8_t bytes[128];
      float got[128];
      for (int i = 0; i < 128; ++i) bytes[i] = static_cast<uint8_t>(half * 128 + i);
      cpu::indexer::widen_fp8_key(isa, bytes, got);
      for (int i = 0; i < 128; ++i) {
        const float want = numeric::e4m3_to_float(bytes[i]);
        const bool same = std::isnan(want) ? std::isnan(got[i]) : std::bit_cast<uint32_t>(got[i]) ==
                                                                      std::bit_cast<uint32_t>(want);
        EXPECT_TRUE(same) << cpu::isa_name(isa) << " byte " << int{bytes[i]} << ": " << got[i];
      }
    }
}

TEST(IndexerTopk, BadIndexValuesNameTheArgumentAndRow) {
  Rng rng(3);
  const ProblemSpec spec{.block_size = 16, .heads = 4, .k = 16, .contexts = {40, 20}, .request_of = {0, 1}};
  Problem p = make_problem(rng, spec);
  auto run = [&] { indexer_topk(p.args(), &cpu_backend()); };
  p.request_ids[1] = 2;
  expect_error(run, {"indexer_topk", "request_ids", "row 1"});
  p.request_ids[1] = -1;
  expect_error(run, {"request_ids", "row 1"});
  p.request_ids[1] = 1;
  p.context_lens[0] = static_cast<int32_t>(p.max_blocks * spec.block_size + 1);
  expect_error(run, {"context_lens", "row 0"});
  p.context_lens[0] = -1;
  expect_error(run, {"context_lens", "row 0"});
  p.context_lens[0] = 40;
  p.block_table[1 * p.max_blocks + 0] = static_cast<int32_t>(p.num_blocks);  // read by token 1
  expect_error(run, {"block_table", "token 1", "entry 0"});
  p.block_table[1 * p.max_blocks + 0] = -2;
  expect_error(run, {"block_table", "token 1"});
}

// ---------------------------------------------------------------- select_topk

// The k best positions of `keys`, best first, equal keys toward the lower position; -1 past the row's end.
std::vector<int32_t> best_first(const std::vector<uint32_t>& keys, int64_t k) {
  std::vector<int32_t> order(keys.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return keys[a] > keys[b]; });
  order.resize(k, -1);
  return order;
}

TEST(SelectTopk, ExactWithHeavyTiesAndAllSizes) {
  Rng rng(13);
  for (int64_t n : {1, 2, 7, 100, 4096, 70000})
    for (int64_t k : {1, 3, 64, 2048, 65536}) {
      for (uint32_t range : {3u, 1000u, 0xffffffffu}) {
        std::vector<uint32_t> keys(n);
        for (auto& key : keys) key = range == 0xffffffffu ? static_cast<uint32_t>(rng()) : rng() % range + 0x80000000u;
        const std::vector<int32_t> order = best_first(keys, k);
        std::vector<int32_t> got(k, 7);
        cpu::indexer::select_topk(keys.data(), n, k, got.data());
        ASSERT_EQ(got, order) << "n " << n << " k " << k << " range " << range;
        std::fill(got.begin(), got.end(), 7);
        cpu::indexer::select_topk(keys.data(), n, k, got.data(), /*sorted=*/false);
        ASSERT_EQ(got, by_position(order)) << "unsorted: n " << n << " k " << k << " range " << range;
      }
    }
}

TEST(SelectTopk, ExactWhenTheSampledFloorIsTooHigh) {
  // The keys the strided sample sees are the largest, so the estimated floor
  // keeps fewer than k keys and the selection must fall back to all of them.
  const int64_t n = 100000, k = 3000;
  std::vector<uint32_t> keys(n);
  for (int64_t s = 0; s < n; ++s) keys[s] = 1000 + static_cast<uint32_t>(s % 977);
  for (int64_t i = 0; i < 1024; ++i) keys[i * n / 1024] = 1u << 30;
  const std::vector<int32_t> order = best_first(keys, k);
  std::vector<int32_t> got(k);
  cpu::indexer::select_topk(keys.data(), n, k, got.data());
  EXPECT_EQ(got, order);
  cpu::indexer::select_topk(keys.data(), n, k, got.data(), /*sorted=*/false);
  EXPECT_EQ(got, by_position(order));
}

TEST(SelectTopk, NaNScoresKeepTheirKeyOrderUnsortedToo) {
  // NaN scores are ordered by their order keys as any other (positive NaNs above +inf, negative ones below -inf).
  Rng rng(21);
  const int64_t n = 9000;
  std::vector<float> scores = test::random_floats(rng, n);
  for (int64_t i = 0; i < n; i += 7) scores[i] = std::bit_cast<float>(0x7fc00000u + static_cast<uint32_t>(i % 3));
  for (int64_t i = 3; i < n; i += 11) scores[i] = -NAN;
  std::vector<uint32_t> keys(n);
  for (int64_t i = 0; i < n; ++i) keys[i] = cpu::indexer::order_key(scores[i]);
  for (int64_t k : {100, 2048, 10000}) {
    const std::vector<int32_t> order = best_first(keys, k);
    std::vector<int32_t> got(k, 7);
    cpu::indexer::select_topk(keys.data(), n, k, got.data());
    EXPECT_EQ(got, order) << "k " << k;
    cpu::indexer::select_topk(keys.data(), n, k, got.data(), /*sorted=*/false);
    EXPECT_EQ(got, by_position(order)) << "unsorted: k " << k;
  }
}

TEST(SelectTopk, OrderKeyOrdersFloatsAndTiesSignedZeros) {
  using cpu::indexer::order_key;
  const float v[] = {-INFINITY, -3e38f, -1.f, -1e-40f, 0.f, 1e-40f, 1.f, 2.f, 3e38f, INFINITY};
  for (size_t i = 1; i < std::size(v); ++i) EXPECT_LT(order_key(v[i - 1]), order_key(v[i])) << v[i];
  EXPECT_EQ(order_key(-0.f), order_key(0.f));
}

// ---------------------------------------------------------------- positions_to_slots

TEST(PositionsToSlots, EdgeCasesMatchReference) {
  const int bs = 4;
  // Two requests, three table entries each; request 1's middle block is unmapped (-1).
  std::vector<int32_t> table{7, 2, 5, 1, -1, 0};
  std::vector<int32_t> request_ids{1, 0};
  std::vector<int32_t> positions{0, 3, 4, 7, 8, 11, 12, -1,   // request 1
                                 0, 5, 11, -7, 12, 1 << 30, 9, 2};  // request 0
  std::vector<int32_t> slots(16, 99), want(16, 99);
  PositionsToSlotsArgs a;
  a.positions = TensorView(positions.data(), {2, 8}, DType::i32);
  a.request_ids = TensorView(request_ids.data(), {2}, DType::i32);
  a.block_table = TensorView(table.data(), {2, 3}, DType::i32);
  a.block_size = bs;
  a.slots = TensorView(slots.data(), {2, 8}, DType::i32);
  positions_to_slots(a, &cpu_backend());
  EXPECT_EQ(slots, (std::vector<int32_t>{4, 7, -1, -1, 0, 3, -1, -1, 28, 9, 23, -1, -1, -1, 21, 30}));
  a.slots = TensorView(want.data(), {2, 8}, DType::i32);
  reference::ref_positions_to_slots(a);
  EXPECT_EQ(slots, want);
}

TEST(PositionsToSlots, SlotsBeyondInt32AreInvalid) {
  std::vector<int32_t> table{INT32_MAX / 8 + 1}, request_ids{0}, positions{0, 3}, slots(2);
  PositionsToSlotsArgs a;
  a.positions = TensorView(positions.data(), {1, 2}, DType::i32);
  a.request_ids = TensorView(request_ids.data(), {1}, DType::i32);
  a.block_table = TensorView(table.data(), {1, 1}, DType::i32);
  a.block_size = 8;
  a.slots = TensorView(slots.data(), {1, 2}, DType::i32);
  positions_to_slots(a, &cpu_backend());
  EXPECT_EQ(slots, (std::vector<int32_t>{-1, -1}));
}

TEST(PositionsToSlots, RandomStridedMatchesReference) {
  Rng rng(17);
  const int64_t t = 5, k = 300, requests = 3, max_blocks = 40, bs = 16;
  std::vector<int32_t> table(requests * max_blocks), request_ids(t), positions(t * (k + 3)), slots(t * (k + 1), 5),
      want(t * (k + 1), 5);
  for (auto& b : table) b = static_cast<int32_t>(rng() % 200) - 20;
  for (auto& r : request_ids) r = static_cast<int32_t>(rng() % requests);
  for (auto& p : positions) p = static_cast<int32_t>(rng() % (max_blocks * bs + 100)) - 50;
  PositionsToSlotsArgs a;
  a.positions = TensorView(positions.data(), {t, k}, {k + 3, 1}, DType::i32);
  a.request_ids = TensorView(request_ids.data(), {t}, DType::i32);
  a.block_table = TensorView(table.data(), {requests, max_blocks}, DType::i32);
  a.block_size = bs;
  a.slots = TensorView(slots.data(), {t, k}, {k + 1, 1}, DType::i32);
  positions_to_slots(a, &cpu_backend());
  a.slots = TensorView(want.data(), {t, k}, {k + 1, 1}, DType::i32);
  reference::ref_positions_to_slots(a);
  EXPECT_EQ(slots, want);
  request_ids[2] = requests;
  expect_error([&] { positions_to_slots(a, &cpu_backend()); }, {"positions_to_slots", "request_ids", "row 2"});
}

// ---------------------------------------------------------------- argument checks

TEST(IndexerChecks, BadTensorsNameTheArgument) {
  Rng rng(19);
  const ProblemSpec spec{.q_dtype = DType::fp8_e4m3, .cache_dtype = DType::fp8_e4m3, .heads = 4, .k = 16,
                         .contexts = {40}, .request_of = {0}};
  Problem p = make_problem(rng, spec);
  const IndexerTopkArgs good = p.args();
  EXPECT_NO_THROW(check(good));
  auto expect_bad = [&](auto mutate, std::initializer_list<std::string> fragments) {
    IndexerTopkArgs a = good;
    mutate(a);
    expect_error([&] { check(a); }, fragments);
  };
  expect_bad([](auto& a) { a.q.dtype = DType::f32; }, {"indexer_topk", "q:", "dtype"});
  expect_bad([](auto& a) { a.q.shape[2] = 64; }, {"q:", "128"});
  expect_bad([](auto& a) { a.q.shape[1] = 129; }, {"q:", "H_I"});
  expect_bad([](auto& a) { a.q.strides[2] = 2; }, {"q:", "contiguous"});
  expect_bad([](auto& a) { a.q_scale = TensorView(); }, {"q_scale", "required"});
  expect_bad([](auto& a) { a.q_scale.shape[1] = 3; }, {"q_scale", "H_I"});
  expect_bad([](auto& a) { a.q.dtype = DType::bf16; }, {"q_scale", "absent"});
  expect_bad([](auto& a) { a.weights.dtype = DType::bf16; }, {"weights", "dtype"});
  expect_bad([](auto& a) { a.weights.shape[0] = 2; }, {"weights", "T"});
  expect_bad([](auto& a) { a.index_cache.shape[2] = 128; }, {"index cache", "132"});
  expect_bad([](auto& a) { a.index_cache.dtype = DType::f16; }, {"index cache", "dtype"});
  expect_bad([](auto& a) { a.index_cache.strides[1] = 140; }, {"index cache", "contiguous"});
  expect_bad([](auto& a) { a.index_cache.strides[0] = 100; }, {"index cache", "block stride"});
  expect_bad([](auto& a) { a.index_cache.shape[1] = 0; }, {"index cache", "block_size"});
  expect_bad([](auto& a) { a.request_ids.dtype = DType::i64; }, {"request_ids", "dtype"});
  expect_bad([](auto& a) { a.block_table.ndim = 1; }, {"block_table", "dimensions"});
  expect_bad([](auto& a) { a.context_lens = TensorView(); }, {"context_lens", "required"});
  expect_bad([](auto& a) { a.topk.shape[1] = 0; }, {"indexer_topk: topk: dimension 1 (K)"});
  expect_bad([](auto& a) { a.topk.shape[1] = 65537; }, {"indexer_topk: topk:", "65536"});
  expect_bad([](auto& a) { a.topk.shape[0] = 3; }, {"indexer_topk: topk: dimension 0 (T"});
  expect_bad([](auto& a) { a.q.shape[0] = -1; }, {"indexer_topk: q:", "negative size in dimension 0"});
  expect_bad([](auto& a) { a.weights.strides[0] = -4; }, {"indexer_topk: weights:", "negative strides"});
  expect_bad([](auto& a) { a.weights.device = Device::cuda(90); }, {"weights", "sm_90"});

  WriteIndexCacheArgs w;
  std::vector<float> k(128);
  std::vector<int32_t> slot32{0};
  w.k = TensorView(k.data(), {1, 128}, DType::f32);
  w.slot_mapping = TensorView(slot32.data(), {1}, DType::i32);
  w.cache = p.cache->view;
  expect_error([&] { check(w); }, {"write_index_cache: slot_mapping:", "int64"});
  std::vector<int64_t> slot64{0};
  w.slot_mapping = TensorView(slot64.data(), {1}, DType::i64);
  EXPECT_NO_THROW(check(w));
  const auto bad_write = [&](const std::function<void(WriteIndexCacheArgs&)>& mutate, const std::string& fragment) {
    WriteIndexCacheArgs b = w;
    mutate(b);
    expect_error([&] { check(b); }, {fragment});
  };
  bad_write([](auto& b) { b.k.dtype = DType::i32; }, "write_index_cache: k: expected dtype");
  bad_write([](auto& b) { b.k.ndim = 1; }, "write_index_cache: k: expected 2 dimensions");
  bad_write([](auto& b) { b.k.shape[1] = 64; }, "write_index_cache: k: dimension 1 (index head dim) must be 128");
  bad_write([](auto& b) { b.k.data = nullptr; }, "write_index_cache: k: is required");
  bad_write([](auto& b) { b.k.device = Device::cuda(90); }, "write_index_cache: k: is on sm_90");
  bad_write([](auto& b) { b.slot_mapping.shape[0] = 2; }, "write_index_cache: slot_mapping: dimension 0 (N)");
  bad_write([](auto& b) { b.cache.shape[1] = 0; }, "write_index_cache: index cache: dimension 1 (block_size)");

  std::vector<int32_t> pos(16), slots(16), table(4), req(1);
  PositionsToSlotsArgs s;
  s.positions = TensorView(pos.data(), {1, 16}, DType::i32);
  s.request_ids = TensorView(req.data(), {1}, DType::i32);
  s.block_table = TensorView(table.data(), {1, 4}, DType::i32);
  s.slots = TensorView(slots.data(), {1, 16}, DType::i32);
  expect_error([&] { check(s); }, {"positions_to_slots", "block_size"});
  s.block_size = 16;
  EXPECT_NO_THROW(check(s));
  const auto bad_map = [&](const std::function<void(PositionsToSlotsArgs&)>& mutate, const std::string& fragment) {
    PositionsToSlotsArgs b = s;
    mutate(b);
    expect_error([&] { check(b); }, {fragment});
  };
  bad_map([](auto& b) { b.slots.shape[1] = 8; }, "positions_to_slots: slots: dimension 1");
  bad_map([](auto& b) { b.positions.dtype = DType::i64; }, "positions_to_slots: positions: expected dtype");
  bad_map([](auto& b) { b.positions.shape[1] = 0; }, "positions_to_slots: positions: dimension 1 (K)");
  bad_map([](auto& b) { b.request_ids.shape[0] = 2; }, "positions_to_slots: request_ids: dimension 0 (T)");
  bad_map([](auto& b) { b.request_ids.dtype = DType::i64; }, "positions_to_slots: request_ids: expected dtype");
  bad_map([](auto& b) { b.block_table.ndim = 1; }, "positions_to_slots: block_table: expected 2 dimensions");
  bad_map([](auto& b) { b.block_table.device = Device::cuda(80); }, "positions_to_slots: block_table: is on sm_80");
}

// ---------------------------------------------------------------- dsa_decode_step

// A DSA decode problem: the indexer problem plus q, a bf16 MLA cache sharing
// its block table (unused slots NaN) and the outputs.
struct DsaProblem {
  Problem index;
  int64_t heads = 8;
  std::vector<uint16_t> q, kv, out;
  std::vector<float> lse, sink;
  std::vector<int32_t> slots;
  double scale = 1.0 / std::sqrt(576.0);

  DsaDecodeStepArgs args() {
    DsaDecodeStepArgs a;
    a.indexer = index.args();
    const int64_t t = index.tokens(), k = index.spec.k;
    a.slots = TensorView(slots.data(), {t, k}, DType::i32);
    a.q = TensorView(q.data(), {t, heads, 576}, DType::bf16);
    a.kv_cache = TensorView(kv.data(), {index.num_blocks, index.spec.block_size, 576}, DType::bf16);
    if (!sink.empty()) a.attn_sink = TensorView(sink.data(), {heads}, DType::f32);
    a.softmax_scale = static_cast<float>(scale);
    a.out = TensorView(out.data(), {t, heads, 512}, DType::bf16);
    a.lse = TensorView(lse.data(), {t, heads}, DType::f32);
    return a;
  }
};

DsaProblem make_dsa(Rng& rng, const ProblemSpec& spec) {
  DsaProblem d;
  d.index = make_problem(rng, spec);
  const int64_t t = d.index.tokens(), bs = spec.block_size;
  d.q = test::to_half_bits(test::random_floats(rng, t * d.heads * 576), DType::bf16);
  d.kv.assign(d.index.num_blocks * bs * 576, 0x7fc0);  // NaN: never read
  for (int64_t r = 0; r < d.index.requests; ++r)
    for (int64_t i = 0; i < d.index.max_blocks; ++i) {
      const int32_t b = d.index.block_table[r * d.index.max_blocks + i];
      if (b < 0 || b >= d.index.num_blocks) continue;
      const auto bits = test::to_half_bits(test::random_floats(rng, bs * 576), DType::bf16);
      std::copy(bits.begin(), bits.end(), d.kv.begin() + b * bs * 576);
    }
  // Sentinels: NaN outputs, slot 12345 (past every cache here); 0 would be a valid slot and an empty row's output.
  d.out.assign(t * d.heads * 512, 0x7fc1);
  d.lse.assign(t * d.heads, NAN);
  d.slots.assign(t * spec.k, 12345);
  return d;
}

// Expects the DSA outputs of tokens [t0, t0 + n) to match a reference for them.
void expect_outputs(const DsaProblem& d, int64_t t0, const reference::RefAttention& want) {
  const int64_t n = static_cast<int64_t>(want.lse.size()) / d.heads;
  std::vector<double> out(n * d.heads * 512), lse(n * d.heads);
  for (size_t i = 0; i < out.size(); ++i) out[i] = numeric::bf16_to_float(d.out[t0 * d.heads * 512 + i]);
  for (size_t i = 0; i < lse.size(); ++i) lse[i] = d.lse[t0 * d.heads + i];
  EXPECT_EQ(test::compare(want.out, out, 1e-3, 1e-2), "") << "out of tokens " << t0 << ".." << t0 + n - 1;
  EXPECT_EQ(test::compare(want.lse, lse, 1e-3, 1e-3), "") << "lse of tokens " << t0 << ".." << t0 + n - 1;
}

// The sparse attention reference of token t over K logical positions of its request (-1 skipped).
reference::RefAttention sparse_reference(DsaProblem& d, const DsaDecodeStepArgs& a, int64_t t, const int32_t* positions) {
  const int64_t k = d.index.spec.k, bs = d.index.spec.block_size;
  const int32_t* row = d.index.block_table.data() + d.index.request_ids[t] * d.index.max_blocks;
  std::vector<int32_t> slots(k, -1);
  for (int64_t i = 0; i < k; ++i)
    if (positions[i] >= 0) slots[i] = row[positions[i] / bs] * static_cast<int32_t>(bs) + positions[i] % bs;
  SparseMlaArgs s;
  s.q = TensorView(d.q.data() + t * d.heads * 576, {1, d.heads, 576}, DType::bf16);
  s.kv_cache = a.kv_cache;
  s.indices = TensorView(slots.data(), {1, k}, DType::i32);
  s.attn_sink = a.attn_sink;
  s.softmax_scale = a.softmax_scale;
  return reference::ref_sparse_mla(s);
}

TEST(DsaDecodeStep, ContextWithinTopkIsDenseCausalAttention) {
  Rng rng(23);
  // Request 0 decodes three speculative tokens, causal among themselves.
  const ProblemSpec spec{.block_size = 16, .heads = 16, .k = 64, .contexts = {40, 41, 42, 64, 1},
                         .request_of = {0, 0, 0, 1, 2}};
  DsaProblem d = make_dsa(rng, spec);
  const DsaDecodeStepArgs a = d.args();
  dsa_decode_step(a, &cpu_backend());
  // Dense paged decode of each request's tokens (s_q of them), through the same block table.
  for (int64_t t0 = 0; t0 < d.index.tokens();) {
    int64_t t1 = t0 + 1;
    while (t1 < d.index.tokens() && spec.request_of[t1] == spec.request_of[t0]) ++t1;
    std::vector<int32_t> seq_len{spec.contexts[t1 - 1]};
    PagedMlaDecodeArgs dense;
    dense.q = TensorView(d.q.data() + t0 * d.heads * 576, {1, t1 - t0, d.heads, 576}, DType::bf16);
    dense.kv_cache = a.kv_cache;
    dense.block_table = TensorView(d.index.block_table.data() + spec.request_of[t0] * d.index.max_blocks,
                                   {1, d.index.max_blocks}, DType::i32);
    dense.seq_lens = TensorView(seq_len.data(), {1}, DType::i32);
    dense.softmax_scale = a.softmax_scale;
    expect_outputs(d, t0, reference::ref_paged_mla_decode(dense));
    t0 = t1;
  }
  for (int64_t t = 0; t < d.index.tokens(); ++t)
    for (int64_t i = spec.contexts[t]; i < spec.k; ++i) EXPECT_EQ(d.slots[t * spec.k + i], -1);
}

TEST(DsaDecodeStep, LongContextAttendsTheReferenceTopk) {
  Rng rng(29);
  const ProblemSpec spec{.cache_dtype = DType::fp8_e4m3, .block_size = 16, .heads = 32, .k = 64, .contexts = {500, 300},
                         .request_of = {0, 1}};
  DsaProblem d = make_dsa(rng, spec);
  const DsaDecodeStepArgs a = d.args();
  dsa_decode_step(a, &cpu_backend());
  for (int64_t t = 0; t < d.index.tokens(); ++t) {
    // The reference top-k (near-tie swaps allowed), then attention over the reference's own positions.
    const std::vector<double> scores = reference::ref_indexer_scores(a.indexer, t);
    int swaps = 0;
    EXPECT_EQ(check_topk(scores, d.index.topk.data() + t * spec.k, spec.k, &swaps), "");
    expect_outputs(d, t, sparse_reference(d, a, t, reference::ref_topk_of_scores(scores, spec.k).data()));
  }
}

TEST(DsaDecodeStep, EqualsTheThreeOpsWithASink) {
  Rng rng(31);
  const ProblemSpec spec{.block_size = 64, .heads = 8, .k = 32, .contexts = {200, 20}, .request_of = {1, 0}};
  DsaProblem d = make_dsa(rng, spec);
  d.sink = test::random_floats(rng, d.heads, -2.f, 2.f);
  const DsaDecodeStepArgs a = d.args();
  dsa_decode_step(a, &cpu_backend());
  const std::vector<uint16_t> out = d.out;
  const std::vector<float> lse = d.lse;
  const std::vector<int32_t> slots = d.slots, topk = d.index.topk;
  // The three ops write the same buffers again, poisoned first: what they leave must be the step's.
  std::fill(d.out.begin(), d.out.end(), uint16_t{0x7fc1});
  std::fill(d.lse.begin(), d.lse.end(), NAN);
  std::fill(d.slots.begin(), d.slots.end(), 12345);
  std::fill(d.index.topk.begin(), d.index.topk.end(), 12345);

  indexer_topk(a.indexer, &cpu_backend());
  PositionsToSlotsArgs p;
  p.positions = a.indexer.topk;
  p.request_ids = a.indexer.request_ids;
  p.block_table = a.indexer.block_table;
  p.block_size = static_cast<int>(spec.block_size);
  p.slots = a.slots;
  positions_to_slots(p, &cpu_backend());
  SparseMlaArgs s;
  s.q = a.q;
  s.kv_cache = a.kv_cache;
  s.indices = a.slots;
  s.attn_sink = a.attn_sink;
  s.softmax_scale = a.softmax_scale;
  s.out = a.out;
  s.lse = a.lse;
  sparse_mla(s, &cpu_backend());
  EXPECT_EQ(d.index.topk, topk);
  EXPECT_EQ(d.slots, slots);
  EXPECT_EQ(d.out, out);
  EXPECT_EQ(d.lse, lse);
  for (int64_t t = 0; t < d.index.tokens(); ++t)
    expect_outputs(d, t, sparse_reference(d, a, t, d.index.topk.data() + t * spec.k));
}

TEST(DsaDecodeStep, ChecksNameTheStepAndArgument) {
  Rng rng(37);
  const ProblemSpec spec{.heads = 4, .k = 16, .contexts = {20}, .request_of = {0}};
  DsaProblem d = make_dsa(rng, spec);
  const DsaDecodeStepArgs good = d.args();
  EXPECT_NO_THROW(check(good));
  DsaDecodeStepArgs a = good;
  a.slots.shape[1] = 8;
  expect_error([&] { check(a); }, {"dsa_decode_step: slots:"});
  a = good;
  a.indexer.weights.dtype = DType::f16;
  expect_error([&] { check(a); }, {"dsa_decode_step", "indexer_topk", "weights"});
  a = good;
  a.kv_cache.shape[0] -= 1;
  expect_error([&] { check(a); }, {"dsa_decode_step", "kv_cache", "num_blocks"});
  a = good;
  a.q.dtype = DType::f32;
  expect_error([&] { check(a); }, {"dsa_decode_step: sparse_mla: q:", "dtype"});
  // One stream for the whole step: the indexer's may be left null (it then runs on the step's) or be the same.
  int two_streams[2];
  a = good;
  a.stream = &two_streams[0];
  a.indexer.stream = &two_streams[1];
  expect_error([&] { check(a); }, {"dsa_decode_step", "indexer.stream", "same stream"});
  a.indexer.stream = a.stream;
  EXPECT_NO_THROW(check(a));
  a.indexer.stream = nullptr;
  EXPECT_NO_THROW(check(a));
  EXPECT_EQ(indexer_step(a).stream, a.stream);
}

}  // namespace
}  // namespace smla
