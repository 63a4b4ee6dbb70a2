// The pooled indexer of GLM-5.3-Flash (index_kpool > 1) on the CPU against
// direct float64 computations: write_pooled_index_cache (the softmax-weighted
// pool, the Walsh-Hadamard rotation, both cache dtypes, strided inputs),
// pools_to_positions (pools cut by the context's end, invalid pool ids),
// rotate_index_q (the queries' rotation and ue8m0 fp8), the whole pipeline
// write -> indexer_topk over pools -> pools_to_positions for the tokens of a
// causal prefill, and the argument checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <set>
#include <span>
#include <string>

#include "core/numeric.h"
#include "reference/indexer_reference.h"
#include "smla/error.h"
#include "smla/ops.h"
#include "smla/select.h"
#include "support/test_util.h"

namespace smla {
namespace {

using test::Rng;

const Backend& cpu_backend() { return *Registry::global().find("cpu"); }

void expect_error(const std::function<void()>& f, std::initializer_list<std::string> fragments) {
  test::expect_error(f, ErrorKind::invalid_argument, fragments);
}

// A paged index cache with padded blocks, every byte 0xff (NaN) until written.
struct IndexCache {
  std::vector<uint8_t> bytes;
  TensorView view;
  IndexCache(DType dtype, int64_t blocks, int64_t rows) {
    constexpr int64_t kPadBytes = 64;
    const int64_t row_bytes = dtype == DType::bf16 ? 2 * 128 : kFp8IndexRowBytes;
    const int64_t block_bytes = rows * row_bytes + kPadBytes;
    bytes.assign(blocks * block_bytes, 0xff);
    if (dtype == DType::bf16)
      view = TensorView(bytes.data(), {blocks, rows, 128}, {block_bytes / 2, 128, 1}, dtype);
    else
      view = TensorView(bytes.data(), {blocks, rows, kFp8IndexRowBytes}, {block_bytes, kFp8IndexRowBytes, 1}, dtype);
  }
  // The stored key of a slot, dequantised, and its scale (1 for bf16).
  std::vector<double> key(int64_t slot, double* scale) const {
    return reference::ref_index_key(view, slot / view.shape[1], slot % view.shape[1], scale);
  }
  bool slot_untouched(int64_t slot) const {
    const int64_t block = slot / view.shape[1], off = slot % view.shape[1];
    const uint8_t* base = bytes.data() + block * view.strides[0] * dtype_size(view.dtype);
    if (view.dtype == DType::bf16)
      return std::all_of(base + off * 256, base + off * 256 + 256, [](uint8_t b) { return b == 0xff; });
    const bool values = std::all_of(base + off * 128, base + off * 128 + 128, [](uint8_t b) { return b == 0xff; });
    const uint8_t* scale = base + view.shape[1] * 128 + off * 4;
    return values && std::all_of(scale, scale + 4, [](uint8_t b) { return b == 0xff; });
  }
};

// Values stored as `dtype` inside a buffer whose rows (of 128) are `row_stride` elements apart.
struct Strided {
  std::vector<uint8_t> bytes;
  std::vector<float> stored;  // the values as stored (rounded to dtype)
  Strided(const std::vector<float>& values, DType dtype, int64_t row_stride) {
    const int64_t rows = static_cast<int64_t>(values.size()) / 128, elem = dtype_size(dtype);
    bytes.assign(rows * row_stride * elem, 0xff);  // padding: NaN in every float type
    std::vector<float> rounded = values;
    if (dtype != DType::f32) test::to_half_bits(values, dtype, &rounded);
    stored = rounded;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t d = 0; d < 128; ++d) {
        const float v = rounded[r * 128 + d];
        uint8_t* dst = bytes.data() + (r * row_stride + d) * elem;
        if (dtype == DType::f32) {
          std::memcpy(dst, &v, 4);
        } else {
          const uint16_t bits = test::to_half_bits({v}, dtype)[0];
          std::memcpy(dst, &bits, 2);
        }
      }
  }
};

// A pooled-write problem: P pools of kpool tokens, their rows padded to 136 elements; pool stride padded too.
struct PoolProblem {
  int64_t pools, kpool;
  Strided k, gate;
  std::vector<float> ape;
  std::vector<int64_t> slot_mapping;
  PoolProblem(Rng& rng, int64_t pools_, int64_t kpool_, DType dtype, float gate_range)
      : pools(pools_),
        kpool(kpool_),
        k(test::random_floats(rng, (pools_ * (kpool_ + 1)) * 128, -3.f, 3.f), dtype, 136),
        gate(test::random_floats(rng, (pools_ * (kpool_ + 1)) * 128, -gate_range, gate_range), dtype, 136),
        ape(test::random_floats(rng, kpool_ * 128, -2.f, 2.f)) {}
  WritePooledIndexCacheArgs args(DType dtype, const TensorView& cache) {
    WritePooledIndexCacheArgs a;
    // Pool p's token m is row p * (kpool + 1) + m: one unused (NaN) row between pools.
    a.k = TensorView(k.bytes.data(), {pools, kpool, 128}, {(kpool + 1) * 136, 136, 1}, dtype);
    a.gate = TensorView(gate.bytes.data(), {pools, kpool, 128}, {(kpool + 1) * 136, 136, 1}, dtype);
    a.ape = TensorView(ape.data(), {kpool, 128}, DType::f32);
    a.slot_mapping = TensorView(slot_mapping.data(), {pools}, DType::i64);
    a.cache = cache;
    return a;
  }
};

// ---------------------------------------------------------------- write_pooled_index_cache

TEST(WritePooledIndexCache, MatchesTheFloat64Pool) {
  Rng rng(20);
  for (DType cache_dtype : {DType::bf16, DType::fp8_e4m3})
    for (DType k_dtype : {DType::f32, DType::bf16, DType::f16})
      for (int64_t kpool : {1, 4, 7})
        for (int64_t rows : {1, 16})
          for (bool hadamard : {true, false}) {
            SCOPED_TRACE(std::string(dtype_name(cache_dtype)) + " from " + std::string(dtype_name(k_dtype)) +
                         " kpool " + std::to_string(kpool) + " rows " + std::to_string(rows) +
                         (hadamard ? " rotated" : ""));
            const int64_t pools = 2 * rows + 3, blocks = pools;  // more slots than pools: some stay untouched
            PoolProblem pp(rng, pools, kpool, k_dtype, 4.f);
            std::vector<int64_t> perm(blocks * rows);
            std::iota(perm.begin(), perm.end(), 0);
            std::shuffle(perm.begin(), perm.end(), rng);
            for (int64_t p = 0; p < pools; ++p) pp.slot_mapping.push_back(p % 5 == 2 ? -1 : perm[p]);
            IndexCache cache(cache_dtype, blocks, rows);
            WritePooledIndexCacheArgs a = pp.args(k_dtype, cache.view);
            a.hadamard = hadamard;
            write_pooled_index_cache(a, &cpu_backend());

            std::set<int64_t> written;
            for (int64_t p = 0; p < pools; ++p) {
              if (pp.slot_mapping[p] < 0) continue;
              written.insert(pp.slot_mapping[p]);
              const std::vector<double> want = reference::ref_pooled_index_key(a, p);
              double scale;
              std::vector<double> got = cache.key(pp.slot_mapping[p], &scale);
              double amax = 0;
              for (double v : want) amax = std::max(amax, std::fabs(v));
              for (int d = 0; d < 128; ++d) {
                // bf16 rounding before and after the rotation (each <= 2^-8 relative; the rotation spreads the
                // first over the row), then the cache's own rounding: none more for bf16, or e4m3 (3 mantissa
                // bits, <= 2^-4 relative) whose smallest step is scale * 2^-9.
                const double tol = cache_dtype == DType::bf16
                                       ? 4e-3 * std::fabs(want[d]) + 4e-3 * amax
                                       : 6.7e-2 * std::fabs(want[d]) + 4e-3 * amax + scale * 0x1p-9;
                got[d] *= scale;
                ASSERT_NEAR(got[d], want[d], tol) << "pool " << p << " dim " << d;
              }
              if (cache_dtype == DType::fp8_e4m3) {  // ue8m0: a power of two taking the row's amax into (224, 448]
                int exponent;
                EXPECT_EQ(std::frexp(scale, &exponent), 0.5) << "pool " << p << ": scale " << scale;
                EXPECT_GT(amax / scale, 224 * (1 - 1e-2)) << "pool " << p << ": scale " << scale;
                EXPECT_LE(amax / scale, 448 * (1 + 1e-2)) << "pool " << p << ": scale " << scale;
              }
            }
            for (int64_t s = 0; s < blocks * rows; ++s)
              if (!written.count(s)) EXPECT_TRUE(cache.slot_untouched(s)) << "slot " << s;
          }
}

TEST(WritePooledIndexCache, WeightsAreASoftmaxOfGatePlusApe) {
  // A gate far above the others on token 2 of dimension d selects that token's key in d; equal keys pool to
  // themselves whatever the gates. bf16 cache, no rotation: the stored values are the pooled ones rounded to bf16.
  constexpr int64_t kpool = 4;
  Rng rng(21);
  std::vector<float> k = test::random_floats(rng, kpool * 128, -3.f, 3.f), gate(kpool * 128, 0.f);
  for (int d = 0; d < 128; ++d) {
    if (d < 64) {
      gate[2 * 128 + d] = 200.f;  // token 2 dominates: exp(-200) of the rest is below fp32's resolution
    } else {
      for (int m = 0; m < kpool; ++m) k[m * 128 + d] = 0.75f;  // equal keys
      for (int m = 0; m < kpool; ++m) gate[m * 128 + d] = static_cast<float>(m) - 1.5f;
    }
  }
  std::vector<float> ape(kpool * 128, 0.5f);
  std::vector<int64_t> slot{3};
  IndexCache cache(DType::bf16, 1, 4);
  WritePooledIndexCacheArgs a;
  a.k = TensorView(k.data(), {1, kpool, 128}, DType::f32);
  a.gate = TensorView(gate.data(), {1, kpool, 128}, DType::f32);
  a.ape = TensorView(ape.data(), {kpool, 128}, DType::f32);
  a.slot_mapping = TensorView(slot.data(), {1}, DType::i64);
  a.cache = cache.view;
  a.hadamard = false;
  write_pooled_index_cache(a, &cpu_backend());
  double scale;
  const std::vector<double> got = cache.key(3, &scale);
  for (int d = 0; d < 128; ++d) {
    const float want = d < 64 ? k[2 * 128 + d] : 0.75f;
    EXPECT_EQ(got[d], numeric::bf16_to_float(numeric::float_to_bf16(want))) << d;
  }
  EXPECT_TRUE(cache.slot_untouched(2));

  // The rotation: 128^-0.5 * H_128 of the same pool (H symmetric, H H = 128 I).
  a.hadamard = true;
  write_pooled_index_cache(a, &cpu_backend());
  const std::vector<double> rotated = cache.key(3, &scale);
  for (int i = 0; i < 128; ++i) {
    double want = 0;
    for (int j = 0; j < 128; ++j) want += ((std::popcount(static_cast<unsigned>(i & j)) & 1) ? -1 : 1) * got[j];
    EXPECT_NEAR(rotated[i], want / std::sqrt(128.0), 1e-2 * std::fabs(want / std::sqrt(128.0)) + 1e-3) << i;
  }
}

TEST(WritePooledIndexCache, SlotOutOfRangeNamesTheRowAndWritesNothing) {
  Rng rng(22);
  PoolProblem pp(rng, 3, 4, DType::bf16, 1.f);
  pp.slot_mapping = {0, -7, 8};  // 2 blocks of 4 rows: slot 8 is past the end
  IndexCache cache(DType::fp8_e4m3, 2, 4);
  WritePooledIndexCacheArgs a = pp.args(DType::bf16, cache.view);
  expect_error([&] { write_pooled_index_cache(a, &cpu_backend()); },
               {"write_pooled_index_cache", "slot_mapping", "row 2", "8"});
  EXPECT_TRUE(cache.slot_untouched(0));
}

TEST(WritePooledIndexCache, ChecksNameTheArgument) {
  Rng rng(23);
  PoolProblem pp(rng, 2, 4, DType::bf16, 1.f);
  pp.slot_mapping = {0, 1};
  IndexCache cache(DType::bf16, 2, 4);
  std::vector<float> f32(2 * 4 * 128, 1.f), ape5(5 * 128, 0.f);
  std::vector<int64_t> slots3{0, 1, 2};
  std::vector<int32_t> slots_i32{0, 1};
  auto base = [&] { return pp.args(DType::bf16, cache.view); };
  auto bad = [&](auto edit, std::initializer_list<std::string> fragments) {
    WritePooledIndexCacheArgs a = base();
    edit(a);
    expect_error([&] { write_pooled_index_cache(a, &cpu_backend()); }, fragments);
  };
  bad([&](auto& a) { a.gate = TensorView(f32.data(), {2, 4, 128}, DType::f32); }, {"gate", "dtype"});
  bad([&](auto& a) { a.gate = TensorView(pp.gate.bytes.data(), {2, 3, 128}, {5 * 136, 136, 1}, DType::bf16); },
      {"gate", "dimension 1", "kpool"});
  bad([&](auto& a) { a.ape = TensorView(ape5.data(), {5, 128}, DType::f32); }, {"ape", "dimension 0", "kpool"});
  bad([&](auto& a) { a.ape = TensorView(ape5.data(), {4, 128}, DType::bf16); }, {"ape", "dtype"});
  bad([&](auto& a) { a.k = TensorView(f32.data(), {8, 128}, DType::bf16); }, {"k", "[P, kpool, 128]"});
  bad([&](auto& a) { a.k = TensorView(pp.k.bytes.data(), {2, 4, 64}, {5 * 136, 136, 1}, DType::bf16); },
      {"k", "dimension 2"});
  bad([&](auto& a) { a.slot_mapping = TensorView(slots3.data(), {3}, DType::i64); }, {"slot_mapping", "P"});
  bad([&](auto& a) { a.slot_mapping = TensorView(slots_i32.data(), {2}, DType::i32); }, {"slot_mapping", "dtype"});
  bad([&](auto& a) { a.cache = TensorView(cache.bytes.data(), {2, 4, 130}, DType::fp8_e4m3); }, {"index cache"});
  // The cache written over the keys it reads.
  bad([&](auto& a) { a.cache = TensorView(pp.k.bytes.data(), {1, 2, 128}, DType::bf16); }, {"cache", "overlaps"});
}

// ---------------------------------------------------------------- pools_to_positions

TEST(PoolsToPositions, ExpandsPoolsAndAppendsTheCutTail) {
  // kpool 4, a context of 10 tokens: whole pools 0 and 1, the tail is tokens 8 and 9.
  std::vector<int32_t> pools{1, 2, 0, -1}, ctx{10}, out(4 * 4 + 3, 12345);
  PoolsToPositionsArgs a;
  a.pools = TensorView(pools.data(), {1, 4}, DType::i32);
  a.context_lens = TensorView(ctx.data(), {1}, DType::i32);
  a.kpool = 4;
  a.positions = TensorView(out.data(), {1, 19}, DType::i32);
  pools_to_positions(a, &cpu_backend());
  const std::vector<int32_t> want{4, 5, 6, 7, -1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 8, 9, -1};
  EXPECT_EQ(out, want);  // pool 2 is not a whole pool of this context: none
}

TEST(PoolsToPositions, MatchesReferenceOnRandomRows) {
  Rng rng(24);
  for (int kpool : {1, 2, 4, 5}) {
    const int64_t tokens = 40, kp = 6;
    std::vector<int32_t> pools(tokens * (kp + 3)), ctx(tokens);  // pools padded to a row stride of kp + 3
    for (int64_t t = 0; t < tokens; ++t) {
      ctx[t] = t < 8 ? static_cast<int32_t>(t) : static_cast<int32_t>(rng() % 60);  // 0..7: inside the first pools
      for (auto& p : std::span(pools).subspan(t * (kp + 3), kp + 3)) p = static_cast<int32_t>(rng() % 20) - 3;
    }
    const int64_t width = kp * kpool + kpool - 1;
    std::vector<int32_t> got(tokens * width, 777), want(tokens * width, 888);
    PoolsToPositionsArgs a;
    a.pools = TensorView(pools.data(), {tokens, kp}, {kp + 3, 1}, DType::i32);
    a.context_lens = TensorView(ctx.data(), {tokens}, DType::i32);
    a.kpool = kpool;
    a.positions = TensorView(got.data(), {tokens, width}, DType::i32);
    pools_to_positions(a, &cpu_backend());
    a.positions = TensorView(want.data(), {tokens, width}, DType::i32);
    reference::ref_pools_to_positions(a);
    EXPECT_EQ(got, want) << "kpool " << kpool;
    for (int64_t t = 0; t < tokens; ++t)  // causal: nothing at or past the context's end
      for (int64_t i = 0; i < width; ++i) EXPECT_LT(got[t * width + i], std::max(ctx[t], 0)) << t;
  }
}

TEST(PoolsToPositions, ChecksNameTheArgument) {
  std::vector<int32_t> pools(8, 0), ctx{5, -1}, out(2 * 11, 0);
  PoolsToPositionsArgs a;
  a.pools = TensorView(pools.data(), {2, 2}, DType::i32);
  a.context_lens = TensorView(ctx.data(), {2}, DType::i32);
  a.kpool = 4;
  a.positions = TensorView(out.data(), {2, 11}, DType::i32);
  expect_error([&] { pools_to_positions(a, &cpu_backend()); }, {"pools_to_positions", "context_lens", "row 1", "-1"});
  ctx[1] = 3;
  PoolsToPositionsArgs b = a;
  b.kpool = 0;
  expect_error([&] { pools_to_positions(b, &cpu_backend()); }, {"kpool", "got 0"});
  b = a;
  b.positions = TensorView(out.data(), {2, 8}, DType::i32);
  expect_error([&] { pools_to_positions(b, &cpu_backend()); }, {"positions", "dimension 1", "11"});
  b = a;
  b.positions = TensorView(pools.data(), {1, 8}, DType::i32);
  expect_error([&] { pools_to_positions(b, &cpu_backend()); }, {"positions", "dimension 0"});
  b = a;
  b.context_lens = TensorView(ctx.data(), {2}, DType::i64);
  expect_error([&] { pools_to_positions(b, &cpu_backend()); }, {"context_lens", "dtype"});
  b = a;
  b.positions = TensorView(pools.data(), {2, 2}, DType::i32);  // the output over an input
  b.kpool = 1;
  expect_error([&] { pools_to_positions(b, &cpu_backend()); }, {"positions", "overlaps"});
}

// ---------------------------------------------------------------- rotate_index_q

TEST(RotateIndexQ, MatchesTheFloat64Rotation) {
  Rng rng(26);
  constexpr int64_t tokens = 5, heads = 6, head_stride = 136;  // heads padded (NaN between them)
  for (DType q_dtype : {DType::f32, DType::bf16, DType::f16})
    for (DType out_dtype : {DType::bf16, DType::fp8_e4m3}) {
      SCOPED_TRACE(std::string(dtype_name(q_dtype)) + " -> " + std::string(dtype_name(out_dtype)));
      std::vector<float> values = test::random_floats(rng, tokens * heads * 128, -4.f, 4.f);
      for (int d = 0; d < 128; ++d) values[128 + d] *= 1e-3f;  // a small head: another scale
      std::vector<float> rows(tokens * heads * head_stride, NAN);
      for (int64_t r = 0; r < tokens * heads; ++r)
        std::copy(values.begin() + r * 128, values.begin() + (r + 1) * 128, rows.begin() + r * head_stride);
      std::vector<uint8_t> qbytes(rows.size() * dtype_size(q_dtype));
      if (q_dtype == DType::f32) {
        std::memcpy(qbytes.data(), rows.data(), qbytes.size());
      } else {
        const std::vector<uint16_t> bits = test::to_half_bits(rows, q_dtype);
        std::memcpy(qbytes.data(), bits.data(), qbytes.size());
      }
      std::vector<uint8_t> out(tokens * heads * 128 * dtype_size(out_dtype), 0xff);
      std::vector<float> scale(tokens * heads, -1.f);
      RotateIndexQArgs a;
      a.q = TensorView(qbytes.data(), {tokens, heads, 128}, {heads * head_stride, head_stride, 1}, q_dtype);
      a.q_out = TensorView(out.data(), {tokens, heads, 128}, out_dtype);
      if (out_dtype == DType::fp8_e4m3) a.q_scale = TensorView(scale.data(), {tokens, heads}, DType::f32);
      rotate_index_q(a, &cpu_backend());
      for (int64_t t = 0; t < tokens; ++t)
        for (int64_t h = 0; h < heads; ++h) {
          const std::vector<double> want = reference::ref_rotated_index_q(a, t, h);
          double amax = 0;
          for (double v : want) amax = std::max(amax, std::fabs(v));
          const int64_t r = t * heads + h;
          for (int d = 0; d < 128; ++d) {
            double got, tol;
            if (out_dtype == DType::bf16) {
              uint16_t bits;
              std::memcpy(&bits, out.data() + (r * 128 + d) * 2, 2);
              got = numeric::bf16_to_float(bits);
              tol = 0x1p-8 * std::fabs(want[d]) + 1e-6 * amax;
            } else {
              got = numeric::e4m3_to_float(out[r * 128 + d]) * scale[r];
              tol = 6.7e-2 * std::fabs(want[d]) + 0x1p-8 * amax + scale[r] * 0x1p-9;
            }
            ASSERT_NEAR(got, want[d], tol) << "token " << t << " head " << h << " dim " << d;
          }
          if (out_dtype == DType::fp8_e4m3) {
            int exponent;
            EXPECT_EQ(std::frexp(scale[r], &exponent), 0.5) << "ue8m0: a power of two, got " << scale[r];
            EXPECT_GT(amax / scale[r], 224 * (1 - 1e-2));
            EXPECT_LE(amax / scale[r], 448 * (1 + 1e-2));
          }
        }
    }
}

TEST(RotateIndexQ, TwiceIsTheIdentity) {
  // 128^-0.5 H_128 is orthogonal and symmetric: rotating the rotated query (f32 in, bf16 out) gives it back
  // within the two bf16 roundings.
  Rng rng(27);
  std::vector<float> q = test::random_floats(rng, 3 * 128, -2.f, 2.f), once(3 * 128);
  std::vector<uint16_t> out(3 * 128), back(3 * 128);
  RotateIndexQArgs a;
  a.q = TensorView(q.data(), {1, 3, 128}, DType::f32);
  a.q_out = TensorView(out.data(), {1, 3, 128}, DType::bf16);
  rotate_index_q(a, &cpu_backend());
  for (size_t i = 0; i < out.size(); ++i) once[i] = numeric::bf16_to_float(out[i]);
  a.q = TensorView(once.data(), {1, 3, 128}, DType::f32);
  a.q_out = TensorView(back.data(), {1, 3, 128}, DType::bf16);
  rotate_index_q(a, &cpu_backend());
  for (size_t i = 0; i < q.size(); ++i) EXPECT_NEAR(numeric::bf16_to_float(back[i]), q[i], 2e-2) << i;
}

TEST(RotateIndexQ, ChecksNameTheArgument) {
  std::vector<float> q(2 * 4 * 128, 1.f), scale(8);
  std::vector<uint8_t> out(2 * 4 * 128 * 2);
  RotateIndexQArgs a;
  a.q = TensorView(q.data(), {2, 4, 128}, DType::f32);
  a.q_out = TensorView(out.data(), {2, 4, 128}, DType::fp8_e4m3);
  expect_error([&] { rotate_index_q(a, &cpu_backend()); }, {"rotate_index_q", "q_scale"});
  RotateIndexQArgs b = a;
  b.q_out = TensorView(out.data(), {2, 4, 128}, DType::bf16);
  b.q_scale = TensorView(scale.data(), {2, 4}, DType::f32);
  expect_error([&] { rotate_index_q(b, &cpu_backend()); }, {"q_scale", "must be absent"});
  b = a;
  b.q_scale = TensorView(scale.data(), {2, 3}, DType::f32);
  expect_error([&] { rotate_index_q(b, &cpu_backend()); }, {"q_scale", "dimension 1"});
  b = a;
  b.q_out = TensorView(out.data(), {2, 4, 128}, DType::f16);
  expect_error([&] { rotate_index_q(b, &cpu_backend()); }, {"q_out", "dtype"});
  b = a;
  b.q_out = TensorView(q.data(), {2, 4, 128}, DType::bf16);  // written over q
  expect_error([&] { rotate_index_q(b, &cpu_backend()); }, {"q_out", "overlaps"});
  b = a;
  b.q = TensorView(q.data(), {2, 4, 64}, DType::f32);
  expect_error([&] { rotate_index_q(b, &cpu_backend()); }, {"q", "dimension 2"});
}

// ---------------------------------------------------------------- the pipeline

// One request of `length` tokens in pages of `block_size`: its pooled index cache written for every whole pool,
// then each of its last `queries` tokens (a causal prefill chunk) selects `kp` pools and gets its positions.
// Checked against float64: every selected pool scores (over the unquantised float64 keys) within a tolerance of the
// k-th best, the count is min(kp, whole pools), and the positions are the pools' tokens plus the cut tail.
TEST(PooledIndexer, CausalPrefillSelectsTheBestPoolsAndTheTail) {
  Rng rng(25);
  constexpr int64_t kpool = 4, heads = 8, block_size = 16, rows = block_size / kpool;
  for (DType cache_dtype : {DType::bf16, DType::fp8_e4m3})
    for (int64_t length : {3, 37, 130}) {
      SCOPED_TRACE(std::string(dtype_name(cache_dtype)) + " length " + std::to_string(length));
      const int64_t kp = 8, queries = std::min<int64_t>(length, 6), whole = length / kpool;
      const int64_t max_blocks = (length + block_size - 1) / block_size + 1, num_blocks = 3 * max_blocks;
      std::vector<int32_t> table(max_blocks);
      std::vector<int32_t> perm(num_blocks);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      for (int64_t b = 0; b < max_blocks; ++b) table[b] = perm[b];
      // Every token's key and gate; pools are views of whole pools of them (token stride 128).
      PoolProblem pp(rng, std::max<int64_t>(whole, 1), kpool, DType::bf16, 3.f);
      for (int64_t p = 0; p < whole; ++p)
        pp.slot_mapping.push_back(table[p * kpool / block_size] * rows + p % rows);
      IndexCache cache(cache_dtype, num_blocks, rows);
      WritePooledIndexCacheArgs w = pp.args(DType::bf16, cache.view);
      w.k.shape[0] = w.gate.shape[0] = w.slot_mapping.shape[0] = whole;
      write_pooled_index_cache(w, &cpu_backend());

      // Queries (already rotated, as the model rotates them) and weights; token j is at position length-queries+j.
      std::vector<float> qv = test::random_floats(rng, queries * heads * 128, -1.f, 1.f);
      std::vector<float> qround;
      std::vector<uint16_t> q = test::to_half_bits(qv, DType::bf16, &qround);
      std::vector<float> weights = test::random_floats(rng, queries * heads, 0.1f, 1.f);
      std::vector<int32_t> req(queries, 0), pool_ctx(queries), ctx(queries), top(queries * kp, 99);
      for (int64_t j = 0; j < queries; ++j) {
        ctx[j] = static_cast<int32_t>(length - queries + j + 1);
        pool_ctx[j] = ctx[j] / kpool;
      }
      IndexerTopkArgs ix;
      ix.q = TensorView(q.data(), {queries, heads, 128}, DType::bf16);
      ix.weights = TensorView(weights.data(), {queries, heads}, DType::f32);
      ix.index_cache = cache.view;
      ix.request_ids = TensorView(req.data(), {queries}, DType::i32);
      ix.block_table = TensorView(table.data(), {1, max_blocks}, DType::i32);
      ix.context_lens = TensorView(pool_ctx.data(), {queries}, DType::i32);
      ix.topk = TensorView(top.data(), {queries, kp}, DType::i32);
      indexer_topk(ix, &cpu_backend());
      const int64_t width = kp * kpool + kpool - 1;
      std::vector<int32_t> positions(queries * width, 55);
      PoolsToPositionsArgs e;
      e.pools = ix.topk;
      e.context_lens = TensorView(ctx.data(), {queries}, DType::i32);
      e.kpool = kpool;
      e.positions = TensorView(positions.data(), {queries, width}, DType::i32);
      pools_to_positions(e, &cpu_backend());

      std::vector<std::vector<double>> keys;
      for (int64_t p = 0; p < whole; ++p) keys.push_back(reference::ref_pooled_index_key(w, p));
      for (int64_t j = 0; j < queries; ++j) {
        const int64_t visible = pool_ctx[j];
        std::vector<double> score(visible);
        double best = 0;
        for (int64_t p = 0; p < visible; ++p) {
          for (int64_t h = 0; h < heads; ++h) {
            double dot = 0;
            for (int d = 0; d < 128; ++d) dot += qround[(j * heads + h) * 128 + d] * keys[p][d];
            score[p] += weights[j * heads + h] * std::max(dot, 0.0);
          }
          best = std::max(best, score[p]);
        }
        std::vector<double> sorted = score;
        std::sort(sorted.rbegin(), sorted.rend());
        const int64_t count = std::min(kp, visible);
        const double kth = count ? sorted[count - 1] : 0;
        const double tol = (cache_dtype == DType::bf16 ? 1e-2 : 8e-2) * best + 1e-6;
        std::set<int32_t> want_positions, got_positions;
        for (int64_t i = 0; i < kp; ++i) {
          const int32_t p = top[j * kp + i];
          if (i >= count) {
            EXPECT_EQ(p, -1) << "token " << j << " rank " << i;
            continue;
          }
          ASSERT_TRUE(p >= 0 && p < visible) << "token " << j << " rank " << i << ": pool " << p;
          EXPECT_GE(score[p], kth - tol) << "token " << j << ": pool " << p << " is not among the best";
          for (int64_t m = 0; m < kpool; ++m) want_positions.insert(static_cast<int32_t>(p * kpool + m));
        }
        for (int64_t s = visible * kpool; s < ctx[j]; ++s) want_positions.insert(static_cast<int32_t>(s));
        int64_t invalid = 0;
        for (int64_t i = 0; i < width; ++i) {
          const int32_t s = positions[j * width + i];
          if (s < 0) {
            ++invalid;
            continue;
          }
          EXPECT_TRUE(got_positions.insert(s).second) << "position " << s << " twice";
        }
        EXPECT_EQ(got_positions, want_positions) << "token " << j;
        EXPECT_EQ(invalid + static_cast<int64_t>(got_positions.size()), width);
        // A context of at most kp pools is dense causal attention: every position before the token.
        if (visible <= kp) EXPECT_EQ(static_cast<int64_t>(got_positions.size()), ctx[j]) << "token " << j;
      }
    }
}

// ---------------------------------------------------------------- selection

TEST(PooledIndexer, BlockSizesMustHoldWholePools) {
  const AttentionSpec spec = load_model_spec("glm-5.3-flash");
  RunSpec run;
  run.device = Device::cpu();
  EXPECT_TRUE(validate(cpu_backend().capabilities(), spec, run).empty());  // block size 64: 16 pools a block
  run.block_size = 6;
  const std::vector<std::string> reasons = validate(cpu_backend().capabilities(), spec, run);
  ASSERT_EQ(reasons.size(), 1u);
  EXPECT_EQ(reasons[0], "block size 6 is not a multiple of index_kpool 4 (the pooled index cache holds "
                        "block_size / kpool pools a block)");
  const Selection sel = select(spec, run);
  EXPECT_EQ(sel.chosen, nullptr);
  EXPECT_NE(sel.suggestion.find("--block-size 8"), std::string::npos) << sel.suggestion;
}

}  // namespace
}  // namespace smla
