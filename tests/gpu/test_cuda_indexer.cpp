// The CUDA indexer ops against the CPU backend: index-cache bytes, top-k sets
// (equal except where float64 scores tie within rounding), the tie rule,
// short contexts, shuffled block tables, bf16/fp8 queries and caches, slot
// mapping, the whole DSA decode step (also replayed from a CUDA graph), and
// the top-k stage alone on score rows crafted to reach each of its paths.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <utility>

#include "core/numeric.h"
#include "cuda/common/runtime.h"
#include "cuda/kernels.h"
#include "gpu/gpu_util.h"
#include "reference/indexer_reference.h"
#include "support/test_util.h"

namespace smla {
namespace {

struct IndexProblem {
  DType q_dtype = DType::bf16, cache_dtype = DType::bf16;
  int tokens = 5, heads = 32, k = 64, block_size = 16, max_blocks = 40;  // 5 tokens: every context choice below
  bool duplicate_keys = false;  // keys drawn from a handful of rows: massive exact ties
  double tie_tol = 1e-4;        // relative score gap under which two positions may swap
};

int cache_row(DType d) { return d == DType::bf16 ? kIndexHeadDim : kFp8IndexRowBytes; }

// Host tensors of one indexer problem, written through the CPU backend.
struct IndexData {
  IndexProblem pr;
  int num_blocks = 0;
  std::vector<uint8_t> cache, q;
  std::vector<float> q_scale, weights;
  std::vector<int32_t> request_ids, table, context;
  TensorView cache_view;

  explicit IndexData(const IndexProblem& p, uint64_t seed) : pr(p) {
    test::Rng rng(seed);
    const int requests = 3;
    num_blocks = requests * p.max_blocks + 2;
    std::vector<int32_t> perm(num_blocks);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    table.assign(perm.begin(), perm.begin() + requests * p.max_blocks);
    const int64_t slots = static_cast<int64_t>(num_blocks) * p.block_size;
    cache.assign(slots * cache_row(p.cache_dtype) * dtype_size(p.cache_dtype), 0xff);  // NaN where unwritten
    cache_view = TensorView(cache.data(), {num_blocks, p.block_size, cache_row(p.cache_dtype)}, p.cache_dtype);

    // Every slot the tables reach gets a key; duplicates come from 7 base rows.
    std::vector<int64_t> mapping;
    for (int32_t b : table)
      for (int o = 0; o < p.block_size; ++o) mapping.push_back(static_cast<int64_t>(b) * p.block_size + o);
    const int64_t n = static_cast<int64_t>(mapping.size());
    std::vector<float> keys = test::random_floats(rng, n * kIndexHeadDim);
    if (p.duplicate_keys)
      for (int64_t i = 0; i < n; ++i)
        std::copy_n(keys.begin() + (i % 7) * kIndexHeadDim, kIndexHeadDim, keys.begin() + i * kIndexHeadDim);
    auto kbits = test::to_half_bits(keys, DType::bf16);
    WriteIndexCacheArgs w;
    w.k = TensorView(kbits.data(), {n, kIndexHeadDim}, DType::bf16);
    w.slot_mapping = TensorView(mapping.data(), {n}, DType::i64);
    w.cache = cache_view;
    write_index_cache(w, &cpu());

    const int64_t qn = static_cast<int64_t>(p.tokens) * p.heads * kIndexHeadDim;
    std::vector<float> qv = test::random_floats(rng, qn);
    if (p.q_dtype == DType::fp8_e4m3) {
      q.resize(qn);
      for (int64_t i = 0; i < qn; ++i) q[i] = numeric::float_to_e4m3(qv[i] * 200.f);
      q_scale = test::random_floats(rng, p.tokens * p.heads, 0.001f, 0.01f);
    } else {
      // Rounded to bf16 first: the GPU computes in bf16, so an f16 query is compared on the same values.
      std::vector<float> rounded;
      test::to_half_bits(qv, DType::bf16, &rounded);
      auto bits = test::to_half_bits(rounded, p.q_dtype);
      q.resize(qn * 2);
      std::memcpy(q.data(), bits.data(), q.size());
    }
    weights = test::random_floats(rng, p.tokens * p.heads, 0.01f, 0.1f);
    const int capacity = p.max_blocks * p.block_size;
    for (int t = 0; t < p.tokens; ++t) {
      request_ids.push_back(static_cast<int32_t>(rng() % requests));
      // Mixed lengths: shorter than k, around k, up to the table's capacity.
      const int choices[] = {1, p.k / 2, p.k, p.k + 1, capacity};
      context.push_back(std::min(capacity, choices[t % 5]));
    }
  }

  IndexerTopkArgs args(std::vector<int32_t>& out) {
    IndexerTopkArgs a;
    a.q = TensorView(q.data(), {pr.tokens, pr.heads, kIndexHeadDim}, pr.q_dtype);
    if (pr.q_dtype == DType::fp8_e4m3) a.q_scale = TensorView(q_scale.data(), {pr.tokens, pr.heads}, DType::f32);
    a.weights = TensorView(weights.data(), {pr.tokens, pr.heads}, DType::f32);
    a.index_cache = cache_view;
    a.request_ids = TensorView(request_ids.data(), {pr.tokens}, DType::i32);
    a.block_table = TensorView(table.data(), {3, pr.max_blocks}, DType::i32);
    a.context_lens = TensorView(context.data(), {pr.tokens}, DType::i32);
    out.assign(static_cast<size_t>(pr.tokens) * pr.k, 12345);
    a.topk = TensorView(out.data(), {pr.tokens, pr.k}, DType::i32);
    return a;
  }
};

// A problem's inputs copied to the GPU, and `args` (a copy of the host's) pointing at them; args.topk stays the
// host's.
struct IndexInputsOnGpu {
  DeviceBuffer q, q_scale, weights, cache, request_ids, table, context;
  IndexerTopkArgs args;
  IndexInputsOnGpu(const IndexData& d, const IndexerTopkArgs& host)
      : q(d.q), q_scale(d.q_scale), weights(d.weights), cache(d.cache), request_ids(d.request_ids), table(d.table),
        context(d.context), args(host) {
    args.q = on_gpu(host.q, q.ptr);
    if (host.q_scale.defined()) args.q_scale = on_gpu(host.q_scale, q_scale.ptr);
    args.weights = on_gpu(host.weights, weights.ptr);
    args.index_cache = on_gpu(host.index_cache, cache.ptr);
    args.request_ids = on_gpu(host.request_ids, request_ids.ptr);
    args.block_table = on_gpu(host.block_table, table.ptr);
    args.context_lens = on_gpu(host.context_lens, context.ptr);
  }
};

void run_topk(const IndexProblem& pr, uint64_t seed) {
  SCOPED_TRACE("q=" + std::string(dtype_name(pr.q_dtype)) + " cache=" + std::string(dtype_name(pr.cache_dtype)) +
               " H=" + std::to_string(pr.heads) + " k=" + std::to_string(pr.k) + " bs=" +
               std::to_string(pr.block_size) + (pr.duplicate_keys ? " ties" : ""));
  IndexData d(pr, seed);
  std::vector<int32_t> want, got;
  IndexerTopkArgs a = d.args(want);
  indexer_topk(a, &cpu());

  IndexInputsOnGpu on(d, a);
  DeviceBuffer dout(std::vector<int32_t>(want.size(), 12345));
  IndexerTopkArgs g = on.args;
  g.topk = on_gpu(a.topk, dout.ptr);
  indexer_topk(g, &gpu());
  CUDA_OK(cudaDeviceSynchronize());
  got = dout.download<int32_t>();

  for (int t = 0; t < pr.tokens; ++t) {
    const std::vector<double> scores = reference::ref_indexer_scores(a, t);
    const auto row = [&](const std::vector<int32_t>& v) {
      return std::vector<int32_t>(v.begin() + t * pr.k, v.begin() + (t + 1) * pr.k);
    };
    const std::vector<int32_t> w = row(want), gr = row(got);
    const std::set<int32_t> distinct(gr.begin(), gr.end());
    EXPECT_EQ(distinct.size() - distinct.count(-1), gr.size() - std::count(gr.begin(), gr.end(), -1))
        << "token " << t << ": a position chosen twice";
    if (pr.duplicate_keys) {  // exact ties: both must pick the lowest positions, in the same order
      EXPECT_EQ(gr, w) << "token " << t;
      continue;
    }
    // Same -1 padding; a position only one side chose must tie the other's within rounding.
    EXPECT_EQ(std::count(gr.begin(), gr.end(), -1), std::count(w.begin(), w.end(), -1)) << "token " << t;
    const std::set<int32_t> ws(w.begin(), w.end());
    double kth = INFINITY;
    for (int32_t p : w)
      if (p >= 0) kth = std::min(kth, scores[p]);
    for (size_t i = 0; i < gr.size(); ++i) {
      const int32_t p = gr[i];
      if (p < 0) continue;
      ASSERT_LT(p, static_cast<int32_t>(scores.size())) << "token " << t;
      if (!ws.count(p))
        EXPECT_LE(std::fabs(scores[p] - kth), pr.tie_tol * std::fabs(kth) + 1e-9) << "token " << t << " pos " << p;
      if (i > 0 && gr[i - 1] >= 0)  // best first
        EXPECT_GE(scores[gr[i - 1]] + pr.tie_tol * std::fabs(scores[gr[i - 1]]) + 1e-9, scores[p]) << "token " << t;
    }
  }
}

TEST(CudaIndexer, TopkMatchesCpu) {
  uint64_t seed = 1;
  for (DType q : {DType::bf16, DType::fp8_e4m3})
    for (DType c : {DType::bf16, DType::fp8_e4m3})
      for (int bs : {1, 16, 64}) {
        IndexProblem p;
        p.q_dtype = q;
        p.cache_dtype = c;
        p.block_size = bs;
        p.max_blocks = (bs == 1 ? 700 : 2200 / bs);
        p.k = 128;
        if (q == DType::fp8_e4m3 && c == DType::fp8_e4m3) p.tie_tol = 2e-3;  // e4m3 mma sums to ~13 bits (SM89, SM12x)
        run_topk(p, seed++);
      }
  for (int heads : {1, 20, 64, 128}) {
    IndexProblem p;
    p.heads = heads;
    p.k = 100;
    run_topk(p, seed++);
  }
  for (DType c : {DType::bf16, DType::fp8_e4m3}) {  // f16 queries, rounded to bf16
    IndexProblem f16;
    f16.q_dtype = DType::f16;
    f16.cache_dtype = c;
    run_topk(f16, seed++);
  }
}

// The scores themselves, each way the kernel can multiply fp8 keys by fp8
// queries, against float64: within 1e-5 of the row's largest score through
// bf16 (exact products, fp32 sums; mma.sync, and wgmma on Hopper for 17-64
// heads), 2e-3 through e4m3 operands (mma.sync: SM89 and SM12x sum a
// k-step's products to about 13 bits, SM90 emulates it exactly; wgmma on
// Hopper; automatic is held to what it resolves to). Positions past each
// token's context keep the sentinel. The first case has enough tokens that
// CTAs take 64 tiles each on an H200 (two chunks of block lookups); 20 and 40
// heads leave padding columns in wgmma's N. The worst error of each way is
// printed.
TEST(CudaIndexer, ScoresOfEachMmaMatchFloat64) {
  // The arch as the launch code sees it (an emulated one under SMLA_CUDA_EMULATE).
  std::vector<cuda::ScoreMma> kinds = {cuda::ScoreMma::bf16, cuda::ScoreMma::automatic};
  if (cuda::current_device().compute_capability >= 89) kinds.push_back(cuda::ScoreMma::fp8);
  struct Case {
    int heads, block_size, max_blocks, tokens;
  };
  std::vector<Case> cases = {{1, 64, 128, 600}};
  std::map<cuda::ScoreMma, double> worst;  // error / the row's largest score
  for (int heads : {8, 32, 64, 128})
    for (int bs : {16, 64}) cases.push_back({heads, bs, 1100 / bs, 5});
  for (int heads : {20, 40}) cases.push_back({heads, 64, 17, 5});
  uint64_t seed = 80;
  for (const Case& c : cases) {
    IndexProblem pr;
    pr.q_dtype = pr.cache_dtype = DType::fp8_e4m3;
    pr.heads = c.heads;
    pr.block_size = c.block_size;
    pr.max_blocks = c.max_blocks;
    pr.tokens = c.tokens;
    pr.k = 64;
    IndexData d(pr, seed++);
    std::vector<int32_t> unused;
    IndexerTopkArgs a = d.args(unused);
    IndexInputsOnGpu on(d, a);
    const int64_t stride = cuda::score_row_stride(a);
    constexpr float kSentinel = -12345.f;
    std::vector<cuda::ScoreMma> these = kinds;
    if (c.heads > 16 && c.heads <= 64 && cuda::wgmma_kernels_available())
      these.insert(these.end(), {cuda::ScoreMma::bf16_wgmma, cuda::ScoreMma::fp8_wgmma});
    for (cuda::ScoreMma mma : these) {
      SCOPED_TRACE("heads " + std::to_string(c.heads) + " bs " + std::to_string(c.block_size) + " tokens " +
                   std::to_string(c.tokens) + " mma " + std::to_string(static_cast<int>(mma)));
      DeviceBuffer scores(std::vector<float>(static_cast<size_t>(pr.tokens) * stride, kSentinel));
      cuda::indexer_scores(on.args, static_cast<float*>(scores.ptr), mma);
      CUDA_OK(cudaDeviceSynchronize());
      const std::vector<float> got = scores.download<float>();
      const cuda::ScoreMma used = cuda::resolve_score_mma(on.args, mma);
      const bool exact_products = used == cuda::ScoreMma::bf16 || used == cuda::ScoreMma::bf16_wgmma;
      const double tol = exact_products ? 1e-5 : 2e-3;
      for (int t = 0; t < pr.tokens; ++t) {
        const std::vector<double> want = reference::ref_indexer_scores(a, t);
        double largest = 0;  // 0 when ReLU zeroes every head (then so must the GPU)
        for (double v : want) largest = std::max(largest, std::fabs(v));
        for (int64_t i = 0; i < stride; ++i) {
          const float v = got[t * stride + i];
          if (i < static_cast<int64_t>(want.size())) {
            ASSERT_NEAR(v, want[i], tol * largest) << "token " << t << " position " << i;
            if (largest > 0) worst[mma] = std::max(worst[mma], std::fabs(v - want[i]) / largest);
          } else {
            ASSERT_EQ(v, kSentinel) << "token " << t << " position " << i << " is past the context";
          }
        }
      }
    }
  }
  for (const auto& [mma, error] : worst)
    std::printf("[ measured ] indexer scores, ScoreMma %d: worst error %.2e of the row's largest score\n",
                static_cast<int>(mma), error);
}

// wgmma against mma.sync (itself checked against float64 above) on enough tokens of long rows that CTAs take 64
// tiles each on an H200 (float64 there would take a minute): the same exact products, summed in another order.
TEST(CudaIndexer, WgmmaScoresEqualMmaSyncOnLongRows) {
  if (!cuda::wgmma_kernels_available()) GTEST_SKIP() << "needs a Hopper GPU running the library's sm_90a code";
  for (int heads : {32, 64}) {
    SCOPED_TRACE("heads " + std::to_string(heads));
    IndexProblem pr;
    pr.cache_dtype = DType::fp8_e4m3;
    pr.heads = heads;
    pr.tokens = 400;
    pr.block_size = 64;
    pr.max_blocks = 128;
    IndexData d(pr, 95 + heads);
    std::vector<int32_t> unused;
    IndexInputsOnGpu on(d, d.args(unused));
    const size_t floats = static_cast<size_t>(pr.tokens) * cuda::score_row_stride(on.args);
    DeviceBuffer by_mma(std::vector<float>(floats, NAN)), by_wgmma(std::vector<float>(floats, NAN));
    cuda::indexer_scores(on.args, static_cast<float*>(by_mma.ptr), cuda::ScoreMma::bf16);
    cuda::indexer_scores(on.args, static_cast<float*>(by_wgmma.ptr), cuda::ScoreMma::bf16_wgmma);
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<float> want = by_mma.download<float>(), got = by_wgmma.download<float>();
    int64_t compared = 0;
    for (size_t i = 0; i < floats; ++i) {
      if (std::isnan(want[i])) {  // past the context: untouched by both
        ASSERT_TRUE(std::isnan(got[i])) << "score " << i;
        continue;
      }
      ASSERT_NEAR(got[i], want[i], 1e-5 * std::fabs(want[i]) + 1e-30) << "score " << i;
      ++compared;
    }
    EXPECT_GT(compared, 80 * 8192);  // the 80 tokens of full context, at least
  }
}

// Queries whose rows are not 16-byte aligned (a head stride of 132 values: 264 bytes of bf16, 132 of fp8) are
// staged value by value instead of in 16-byte loads: the scores must be those of the same queries stored densely,
// bit for bit, on every path (mma.sync, e4m3 or bf16 wgmma on Hopper). The padding between rows is NaN.
TEST(CudaIndexer, StridedQueriesScoreAsDenseOnes) {
  for (DType q_dtype : {DType::bf16, DType::fp8_e4m3})
    for (int heads : {32, 64}) {
      SCOPED_TRACE(std::string(dtype_name(q_dtype)) + " heads " + std::to_string(heads));
      IndexProblem pr;
      pr.q_dtype = q_dtype;
      pr.cache_dtype = DType::fp8_e4m3;
      pr.heads = heads;
      pr.block_size = 64;
      IndexData d(pr, 70 + heads);
      std::vector<int32_t> unused;
      IndexInputsOnGpu on(d, d.args(unused));
      constexpr int kStride = kIndexHeadDim + 4;
      const size_t elem = dtype_size(q_dtype), row_bytes = kIndexHeadDim * elem;
      std::vector<uint8_t> strided(static_cast<size_t>(pr.tokens) * heads * kStride * elem, 0xff);
      for (int64_t r = 0; r < int64_t{pr.tokens} * heads; ++r)
        std::memcpy(strided.data() + r * kStride * elem, d.q.data() + r * row_bytes, row_bytes);
      DeviceBuffer q(strided);
      IndexerTopkArgs sa = on.args;
      sa.q = TensorView(q.ptr, {pr.tokens, heads, kIndexHeadDim}, {int64_t{heads} * kStride, kStride, 1}, q_dtype,
                        on.args.q.device);
      const size_t floats = static_cast<size_t>(pr.tokens) * cuda::score_row_stride(on.args);
      DeviceBuffer dense_scores(std::vector<float>(floats, NAN)), strided_scores(std::vector<float>(floats, NAN));
      cuda::indexer_scores(on.args, static_cast<float*>(dense_scores.ptr));
      cuda::indexer_scores(sa, static_cast<float*>(strided_scores.ptr));
      CUDA_OK(cudaDeviceSynchronize());
      const std::vector<float> want = dense_scores.download<float>(), got = strided_scores.download<float>();
      ASSERT_EQ(std::memcmp(want.data(), got.data(), floats * sizeof(float)), 0);
      EXPECT_GT(std::count_if(want.begin(), want.end(), [](float v) { return v > 0.f; }), 0);
    }
}

// e4m3 operands are fp8 queries and fp8 keys, nothing else: forced on bf16 queries, mma.sync and wgmma are refused.
TEST(CudaIndexer, Fp8MmaNeedsFp8QueriesAndKeys) {
  IndexProblem pr;
  pr.cache_dtype = DType::fp8_e4m3;  // bf16 queries
  IndexData d(pr, 90);
  std::vector<int32_t> unused;
  IndexInputsOnGpu on(d, d.args(unused));
  DeviceBuffer scores(static_cast<size_t>(pr.tokens) * cuda::score_row_stride(on.args) * sizeof(float));
  test::expect_error([&] { cuda::indexer_scores(on.args, static_cast<float*>(scores.ptr), cuda::ScoreMma::fp8); },
                     ErrorKind::invalid_argument, {"e4m3 mma needs fp8 queries and keys"});
  // Where wgmma runs (32 heads, fp8 keys, Hopper) it is the queries that are refused.
  test::expect_error(
      [&] { cuda::indexer_scores(on.args, static_cast<float*>(scores.ptr), cuda::ScoreMma::fp8_wgmma); },
      ErrorKind::invalid_argument,
      {cuda::wgmma_kernels_available() ? "e4m3 wgmma needs fp8 queries, got bfloat16" : "wgmma needs an fp8 index cache"});
}

// Grouped tokens (ScoreTokens::grouped: the CTAs of up to 4 consecutive tokens of one request share their key tiles)
// score exactly as one token a CTA: bit for bit, each token's positions past its own context untouched (NaN), with
// histograms too (the counts equal), each way the kernel multiplies fp8 keys (fp8 and bf16 queries) for 8-64 heads,
// blocks of 64 and 128 keys, launched grouped (score_group_tokens: 4). The request ids run across the windows of 4
// (windows from token 0): a run of 7 from a window's start, one of 4 filling a window, interleaved lone tokens, two
// equal negative ids and one past the table, a run of 3 and one of 4 each crossing a window's end; the contexts grow
// by one a token (draft tokens), every fifth past the table (clamped), and a group holds a short one and an empty
// one. Refused, naming it, with a bf16 cache, blocks of 16 keys, and 128 heads.
TEST(CudaIndexer, GroupedTokensScoreAsOneTokenCtas) {
  const std::vector<int32_t> requests = {0, 0, 0, 0, 0, 0, 0, 1, 2, 2, 2, 2, 1, 2,
                                         1, 2, -1, -1, 3, 1, 1, 1, 0, 0, 0, 0, 2};
  const int tokens = static_cast<int>(requests.size());
  uint64_t seed = 300;
  for (DType q_dtype : {DType::fp8_e4m3, DType::bf16})
    for (int heads : {8, 16, 32, 64})
      for (int bs : {64, 128}) {
        IndexProblem pr;
        pr.q_dtype = q_dtype;
        pr.cache_dtype = DType::fp8_e4m3;
        pr.heads = heads;
        pr.tokens = tokens;
        pr.block_size = bs;
        pr.max_blocks = 6400 / bs;  // 100 tiles of 64 positions
        IndexData d(pr, seed++);
        d.request_ids = requests;
        const int capacity = pr.max_blocks * bs;
        for (int t = 0; t < tokens; ++t) d.context[t] = t % 5 == 0 ? capacity + 100 + t : capacity - 40 + t;
        d.context[9] = 100;  // tokens 8-11 (request 2) are a group: one short context, one empty
        d.context[10] = 0;
        std::vector<int32_t> unused;
        IndexInputsOnGpu on(d, d.args(unused));
        ASSERT_EQ(cuda::score_group_tokens(on.args, cuda::ScoreTokens::grouped), 4);
        ASSERT_EQ(cuda::score_group_tokens(on.args, cuda::ScoreTokens::one), 1);
        const int64_t stride = cuda::score_row_stride(on.args);
        const size_t floats = static_cast<size_t>(tokens) * stride, bins = static_cast<size_t>(tokens) * 4096;
        std::vector<cuda::ScoreMma> kinds = {cuda::ScoreMma::automatic, cuda::ScoreMma::bf16};
        if (q_dtype == DType::fp8_e4m3 && cuda::current_device().compute_capability >= 89)
          kinds.push_back(cuda::ScoreMma::fp8);
        if (heads > 16 && cuda::wgmma_kernels_available()) {
          kinds.push_back(cuda::ScoreMma::bf16_wgmma);
          if (q_dtype == DType::fp8_e4m3) kinds.push_back(cuda::ScoreMma::fp8_wgmma);
        }
        for (cuda::ScoreMma mma : kinds)
          for (bool counted : {false, true}) {
            SCOPED_TRACE(std::string(dtype_name(q_dtype)) + " queries, heads " + std::to_string(heads) + ", bs " +
                         std::to_string(bs) + ", mma " + std::to_string(static_cast<int>(mma)) +
                         (counted ? ", histograms" : ""));
            DeviceBuffer one(std::vector<float>(floats, NAN)), grouped(std::vector<float>(floats, NAN)),
                one_hist(std::vector<int32_t>(bins, 0x7f7f7f7f)), grouped_hist(std::vector<int32_t>(bins, -5));
            cuda::indexer_scores(on.args, static_cast<float*>(one.ptr), mma,
                                 counted ? static_cast<int*>(one_hist.ptr) : nullptr, cuda::ScoreTokens::one);
            cuda::indexer_scores(on.args, static_cast<float*>(grouped.ptr), mma,
                                 counted ? static_cast<int*>(grouped_hist.ptr) : nullptr, cuda::ScoreTokens::grouped);
            CUDA_OK(cudaDeviceSynchronize());
            const std::vector<float> want = one.download<float>(), got = grouped.download<float>();
            ASSERT_EQ(std::memcmp(want.data(), got.data(), floats * sizeof(float)), 0);
            for (int t = 0; t < tokens; ++t) {  // the sentinel exactly past each token's own context
              const bool known = requests[t] >= 0 && requests[t] < 3;
              const int visible = known ? std::max(0, std::min(d.context[t], capacity)) : 0;
              for (int64_t i = 0; i < stride; ++i)
                ASSERT_EQ(std::isnan(got[t * stride + i]), i >= visible) << "token " << t << " position " << i;
            }
            if (counted) EXPECT_EQ(one_hist.download<int32_t>(), grouped_hist.download<int32_t>());
          }
      }
  IndexProblem pr;
  pr.cache_dtype = DType::fp8_e4m3;
  pr.block_size = 64;
  const auto refused = [&](const IndexProblem& bad, const char* what) {
    SCOPED_TRACE(what);
    IndexData d(bad, 330);
    std::vector<int32_t> unused;
    IndexInputsOnGpu on(d, d.args(unused));
    DeviceBuffer scores(static_cast<size_t>(bad.tokens) * cuda::score_row_stride(on.args) * sizeof(float));
    test::expect_error(
        [&] {
          cuda::indexer_scores(on.args, static_cast<float*>(scores.ptr), cuda::ScoreMma::automatic, nullptr,
                               cuda::ScoreTokens::grouped);
        },
        ErrorKind::invalid_argument, {"indexer_scores", "grouped tokens need an fp8 index cache", what});
    EXPECT_EQ(cuda::score_group_tokens(on.args, cuda::ScoreTokens::one), 1);
  };
  IndexProblem bf16_cache = pr, small_blocks = pr, many_heads = pr;
  bf16_cache.cache_dtype = DType::bf16;
  small_blocks.block_size = 16;
  many_heads.heads = 128;
  refused(bf16_cache, "got bfloat16 blocks of 64");
  refused(small_blocks, "blocks of 16");
  refused(many_heads, "and 128 heads");
}

// Grouping as the ops launch it (ScoreTokens::automatic): 8 draft tokens of one request over 128K, whose runs of
// tiles one token a CTA are long (2048 tiles over the resident CTAs / 8: 16 or more tiles on any GPU of up to 256 SMs),
// are grouped and score exactly as one token a CTA (bit for bit, the sentinel past each context untouched); the first
// token alone is not grouped, nor a bf16 cache (automatic never refuses).
TEST(CudaIndexer, AutomaticGroupingWhereRunsAreLong) {
  IndexProblem pr;
  pr.q_dtype = pr.cache_dtype = DType::fp8_e4m3;
  pr.heads = 32;
  pr.tokens = 8;
  pr.block_size = 64;
  pr.max_blocks = 2048;
  IndexData d(pr, 340);
  d.request_ids.assign(pr.tokens, 1);
  const int capacity = pr.max_blocks * pr.block_size;
  for (int t = 0; t < pr.tokens; ++t) d.context[t] = capacity - 7 + t - (t == 7 ? 100 : 0);
  std::vector<int32_t> unused;
  IndexInputsOnGpu on(d, d.args(unused));
  ASSERT_EQ(cuda::score_group_tokens(on.args, cuda::ScoreTokens::automatic), 4);
  const int64_t stride = cuda::score_row_stride(on.args);
  const size_t floats = static_cast<size_t>(pr.tokens) * stride;
  DeviceBuffer one(std::vector<float>(floats, NAN)), automatic(std::vector<float>(floats, NAN));
  cuda::indexer_scores(on.args, static_cast<float*>(one.ptr), cuda::ScoreMma::automatic, nullptr,
                       cuda::ScoreTokens::one);
  cuda::indexer_scores(on.args, static_cast<float*>(automatic.ptr));
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> want = one.download<float>(), got = automatic.download<float>();
  ASSERT_EQ(std::memcmp(want.data(), got.data(), floats * sizeof(float)), 0);
  for (int t = 0; t < pr.tokens; ++t)
    for (int64_t i = 0; i < stride; ++i)
      ASSERT_EQ(std::isnan(got[t * stride + i]), i >= std::min(d.context[t], capacity)) << "token " << t << " position " << i;

  IndexerTopkArgs first = on.args;  // token 0 alone
  for (TensorView* v : {&first.q, &first.q_scale, &first.weights, &first.request_ids, &first.context_lens})
    v->shape[0] = 1;
  EXPECT_EQ(cuda::score_group_tokens(first, cuda::ScoreTokens::automatic), 1);
  IndexProblem bf16_cache = pr;
  bf16_cache.cache_dtype = DType::bf16;
  IndexData b(bf16_cache, 341);
  IndexInputsOnGpu on_b(b, b.args(unused));
  EXPECT_EQ(cuda::score_group_tokens(on_b.args, cuda::ScoreTokens::automatic), 1);
}

TEST(CudaIndexer, LongContextTopk2048) {
  IndexProblem p;
  p.tokens = 5;
  p.heads = 64;
  p.k = 2048;
  p.block_size = 64;
  p.max_blocks = 300;  // 19200 positions
  p.cache_dtype = DType::fp8_e4m3;
  run_topk(p, 50);
}

TEST(CudaIndexer, TiesGoToTheLowerPosition) {
  for (DType c : {DType::bf16, DType::fp8_e4m3}) {
    IndexProblem p;
    p.cache_dtype = c;
    p.duplicate_keys = true;
    p.k = 50;
    run_topk(p, 60 + static_cast<int>(c));
  }
}

TEST(CudaIndexer, WriteIndexCacheSameBytesAsCpu) {
  test::Rng rng(70);
  for (DType src : {DType::f32, DType::bf16, DType::f16})
    for (DType c : {DType::bf16, DType::fp8_e4m3}) {
      SCOPED_TRACE(std::string(dtype_name(src)) + " -> " + std::string(dtype_name(c)));
      const int n = 90, blocks = 8, bs = 16;
      std::vector<float> vals = test::random_floats(rng, n * kIndexHeadDim, -30.f, 30.f);
      std::vector<uint8_t> k(n * kIndexHeadDim * dtype_size(src));
      if (src == DType::f32) std::memcpy(k.data(), vals.data(), k.size());
      else {
        auto bits = test::to_half_bits(vals, src);
        std::memcpy(k.data(), bits.data(), k.size());
      }
      std::vector<int64_t> slots(n);
      for (int i = 0; i < n; ++i) slots[i] = i % 13 == 3 ? -1 : (i * 37) % (blocks * bs);
      std::vector<uint8_t> ref(blocks * bs * cache_row(c) * dtype_size(c), 0xab);
      WriteIndexCacheArgs a;
      a.k = TensorView(k.data(), {n, kIndexHeadDim}, src);
      a.slot_mapping = TensorView(slots.data(), {n}, DType::i64);
      a.cache = TensorView(ref.data(), {blocks, bs, cache_row(c)}, c);
      write_index_cache(a, &cpu());
      DeviceBuffer dk(k), ds(slots), dc(std::vector<uint8_t>(ref.size(), 0xab));
      WriteIndexCacheArgs g = a;
      g.k = on_gpu(a.k, dk.ptr);
      g.slot_mapping = on_gpu(a.slot_mapping, ds.ptr);
      g.cache = on_gpu(a.cache, dc.ptr);
      write_index_cache(g, &gpu());
      CUDA_OK(cudaDeviceSynchronize());
      EXPECT_EQ(dc.download<uint8_t>(), ref);
    }
}

TEST(CudaIndexer, PositionsToSlotsMatchesCpu) {
  const int tokens = 6, k = 40, bs = 16, max_blocks = 5;
  std::vector<int32_t> positions(tokens * k), req = {0, 1, 2, 0, 1, 2};
  std::vector<int32_t> table = {3, 9, -1, 4, 8, 0, 1, 2, 5, 6, 7, 10, 11, 12, 13};
  test::Rng rng(80);
  for (auto& p : positions) p = static_cast<int32_t>(rng() % (max_blocks * bs + 10)) - 5;  // some < 0, some past the table
  std::vector<int32_t> want(tokens * k, 7);
  PositionsToSlotsArgs a;
  a.positions = TensorView(positions.data(), {tokens, k}, DType::i32);
  a.request_ids = TensorView(req.data(), {tokens}, DType::i32);
  a.block_table = TensorView(table.data(), {3, max_blocks}, DType::i32);
  a.block_size = bs;
  a.slots = TensorView(want.data(), {tokens, k}, DType::i32);
  positions_to_slots(a, &cpu());
  DeviceBuffer dp(positions), dr(req), dt(table), ds(std::vector<int32_t>(want.size(), 7));
  PositionsToSlotsArgs g = a;
  g.positions = on_gpu(a.positions, dp.ptr);
  g.request_ids = on_gpu(a.request_ids, dr.ptr);
  g.block_table = on_gpu(a.block_table, dt.ptr);
  g.slots = on_gpu(a.slots, ds.ptr);
  positions_to_slots(g, &gpu());
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(ds.download<int32_t>(), want);
}

// One DSA decode step's inputs (random keys, latents and queries; by default 5 tokens of mixed contexts, shuffled
// blocks, a bf16 latent cache), its CPU result (`host`, run at construction unless cpu_step is false), and the same inputs on the GPU
// with poisoned outputs (`gpu`).
struct DsaStepCase {
  static constexpr int kHeads = 8;
  IndexProblem pr;
  IndexData d;
  std::vector<uint8_t> mla;
  std::vector<uint16_t> q, out;
  std::vector<int32_t> topk, slots;
  std::vector<float> lse;
  DsaDecodeStepArgs host;
  std::unique_ptr<IndexInputsOnGpu> on;
  std::unique_ptr<DeviceBuffer> dtopk, dslots, dq, dmla, dout, dlse;
  DsaDecodeStepArgs gpu;

  static IndexProblem problem() {
    IndexProblem pr;
    pr.tokens = 5;
    pr.heads = 32;
    pr.k = 256;
    pr.block_size = 64;
    pr.max_blocks = 20;
    return pr;
  }

  explicit DsaStepCase(const IndexProblem& problem_to_run = problem(), bool cpu_step = true,
                       DType kv_dtype = DType::bf16)
      : pr(problem_to_run), d(pr, 90) {
    test::Rng rng(91);
    const int64_t row = MlaHead{}.cache_row(kv_dtype);
    mla.assign(static_cast<size_t>(d.num_blocks) * pr.block_size * row * dtype_size(kv_dtype), 0xff);
    TensorView mla_view(mla.data(), {d.num_blocks, pr.block_size, row}, kv_dtype);
    std::vector<int64_t> mapping;
    for (int32_t b : d.table)
      for (int o = 0; o < pr.block_size; ++o) mapping.push_back(static_cast<int64_t>(b) * pr.block_size + o);
    const int64_t n = static_cast<int64_t>(mapping.size());
    auto lat = test::to_half_bits(test::random_floats(rng, n * kMlaLatentDim), DType::bf16);
    auto kpe = test::to_half_bits(test::random_floats(rng, n * kMlaRopeDim), DType::bf16);
    WriteMlaCacheArgs w;
    w.latent = TensorView(lat.data(), {n, kMlaLatentDim}, DType::bf16);
    w.k_pe = TensorView(kpe.data(), {n, kMlaRopeDim}, DType::bf16);
    w.slot_mapping = TensorView(mapping.data(), {n}, DType::i64);
    w.cache = mla_view;
    write_mla_cache(w, &cpu());

    q = test::to_half_bits(test::random_floats(rng, pr.tokens * kHeads * kMlaQkDim), DType::bf16);
    slots.resize(pr.tokens * pr.k);
    out.resize(pr.tokens * kHeads * kMlaVDim);
    lse.resize(pr.tokens * kHeads);
    host.indexer = d.args(topk);
    host.slots = TensorView(slots.data(), {pr.tokens, pr.k}, DType::i32);
    host.q = TensorView(q.data(), {pr.tokens, kHeads, kMlaQkDim}, DType::bf16);
    host.kv_cache = mla_view;
    host.softmax_scale = 0.0625f;
    host.out = TensorView(out.data(), {pr.tokens, kHeads, kMlaVDim}, DType::bf16);
    host.lse = TensorView(lse.data(), {pr.tokens, kHeads}, DType::f32);

    // On the GPU before the CPU runs: the outputs start poisoned.
    on = std::make_unique<IndexInputsOnGpu>(d, host.indexer);
    dtopk = std::make_unique<DeviceBuffer>(topk);
    dslots = std::make_unique<DeviceBuffer>(std::vector<int32_t>(slots.size(), 777));
    dq = std::make_unique<DeviceBuffer>(q);
    dmla = std::make_unique<DeviceBuffer>(mla);
    dout = std::make_unique<DeviceBuffer>(std::vector<uint16_t>(out.size(), 0x7fc1));
    dlse = std::make_unique<DeviceBuffer>(std::vector<float>(lse.size(), NAN));
    gpu = host;
    gpu.indexer = on->args;
    gpu.indexer.topk = on_gpu(host.indexer.topk, dtopk->ptr);
    gpu.slots = on_gpu(host.slots, dslots->ptr);
    gpu.q = on_gpu(host.q, dq->ptr);
    gpu.kv_cache = on_gpu(host.kv_cache, dmla->ptr);
    gpu.out = on_gpu(host.out, dout->ptr);
    gpu.lse = on_gpu(host.lse, dlse->ptr);

    if (cpu_step) dsa_decode_step(host, &cpu());
  }

  // The GPU's outputs: top-k positions, slots, out (bf16 bits), lse.
  struct Outputs {
    std::vector<int32_t> topk, slots;
    std::vector<uint16_t> out;
    std::vector<float> lse;
  };
  Outputs download() const {
    return {dtopk->download<int32_t>(), dslots->download<int32_t>(), dout->download<uint16_t>(),
            dlse->download<float>()};
  }
  // Sentinels in every output, so a step that writes nothing cannot pass for one that wrote the same values.
  void poison_outputs() const {
    CUDA_OK(cudaMemset(dtopk->ptr, 0x5a, dtopk->bytes));
    CUDA_OK(cudaMemset(dslots->ptr, 0x5a, dslots->bytes));
    CUDA_OK(cudaMemset(dout->ptr, 0xff, dout->bytes));
    CUDA_OK(cudaMemset(dlse->ptr, 0xff, dlse->bytes));
  }
};

// Two runs' outputs bit for bit: top-k, slots, out's bf16 bits and lse's bytes (NaN as NaN).
void expect_identical(const DsaStepCase::Outputs& got, const DsaStepCase::Outputs& want, const char* what) {
  SCOPED_TRACE(what);
  EXPECT_EQ(got.topk, want.topk);
  EXPECT_EQ(got.slots, want.slots);
  EXPECT_EQ(got.out, want.out);
  ASSERT_EQ(got.lse.size(), want.lse.size());
  EXPECT_EQ(std::memcmp(got.lse.data(), want.lse.data(), want.lse.size() * sizeof(float)), 0);
}

TEST(CudaIndexer, DsaDecodeStepMatchesCpu) {
  DsaStepCase c;
  dsa_decode_step(c.gpu, &gpu());
  CUDA_OK(cudaDeviceSynchronize());
  const DsaStepCase::Outputs got = c.download();
  EXPECT_EQ(got.topk, c.topk);
  EXPECT_EQ(got.slots, c.slots);
  std::vector<double> want(c.out.size()), out(c.out.size());
  for (size_t i = 0; i < c.out.size(); ++i) {
    want[i] = numeric::bf16_to_float(c.out[i]);
    out[i] = numeric::bf16_to_float(got.out[i]);
  }
  EXPECT_EQ(test::compare(want, out, 2e-3, 2e-2, 0.9999), "");
  EXPECT_EQ(test::compare(std::vector<double>(c.lse.begin(), c.lse.end()),
                          std::vector<double>(got.lse.begin(), got.lse.end()), 1e-3, 1e-4, 0.9999),
            "");
}

// The whole step captured into a CUDA graph on a non-blocking stream (after a warm-up call there: capture cannot
// allocate the workspace), with only the step's `stream` set: replayed on new queries, it must give what an
// eager call on them gives, bit for bit. Capture fails if anything in the step synchronises with the host or
// runs on another stream.
TEST(CudaIndexer, DsaDecodeStepReplaysInACudaGraph) {
  DsaStepCase c;
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  DsaDecodeStepArgs g = c.gpu;
  g.stream = stream;
  ASSERT_EQ(g.indexer.stream, nullptr);
  dsa_decode_step(g, &gpu());
  CUDA_OK(cudaStreamSynchronize(stream));
  const DsaStepCase::Outputs first = c.download();

  const CapturedGraph graph(stream, cudaStreamCaptureModeThreadLocal, [&] { dsa_decode_step(g, &gpu()); });

  // New queries for the indexer and for the attention, in the buffers the graph reads.
  IndexProblem other = DsaStepCase::problem();
  const IndexData d2(other, 190);
  test::Rng rng(191);
  const auto q2 = test::to_half_bits(test::random_floats(rng, c.q.size()), DType::bf16);
  CUDA_OK(cudaMemcpy(c.on->q.ptr, d2.q.data(), d2.q.size(), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(c.dq->ptr, q2.data(), q2.size() * 2, cudaMemcpyHostToDevice));

  c.poison_outputs();
  CUDA_OK(cudaGraphLaunch(graph.exec(), stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  const DsaStepCase::Outputs replayed = c.download();
  c.poison_outputs();
  dsa_decode_step(g, &gpu());
  CUDA_OK(cudaStreamSynchronize(stream));
  const DsaStepCase::Outputs eager = c.download();
  expect_identical(replayed, eager, "replayed vs eager");
  EXPECT_NE(replayed.out, first.out);  // the replay read the new queries
  EXPECT_EQ(first.topk, c.topk);    // and the first call was the CPU's step

  CUDA_OK(cudaStreamDestroy(stream));
}

// The step's fused kernels (the top-k writing the slots, launched as the scores kernel's programmatic dependent on
// SM90+, and the attention as the top-k's) against its three ops run one by one on the GPU (each checked against
// the CPU above), on rows of 40960 positions, for 1 and 8 tokens over a bf16 and an fp8_ds_mla cache (the
// 16-head-tile kernel, split, and the combine) and 16 tokens over fp8_ds_mla (the small-heads kernel, where the device holds it): the same
// positions, slots, out and lse, bit for bit, eager and replayed from a CUDA graph. On SM90+ the automatic split
// gives rows this long to a cluster's CTAs (plan_topk's rule); the test does not check that it did (select_topk
// does not report its split), only that the step and its ops agree. Also 1 and 8 tokens of 8192 positions over
// fp8_ds_mla (issue 23's shape: one CTA per row, the row held in registers), and of 131072 (issue 23's long shape:
// on Hopper a cluster of 16 CTAs a row for one token, and the wgmma kernel's keys-on-M form for 8 tokens of 8 heads).
TEST(CudaIndexer, DsaDecodeStepEqualsItsOpsOnLongRows) {
  for (auto [tokens, kv, blocks] :
       {std::tuple{1, DType::bf16, 640}, {8, DType::bf16, 640}, {1, DType::fp8_ds_mla, 640},
        {8, DType::fp8_ds_mla, 640}, {16, DType::fp8_ds_mla, 640}, {1, DType::fp8_ds_mla, 128},
        {8, DType::fp8_ds_mla, 128}, {1, DType::fp8_ds_mla, 2048}, {8, DType::fp8_ds_mla, 2048}}) {
    SCOPED_TRACE("tokens " + std::to_string(tokens) + " cache " + std::string(dtype_name(kv)) + " blocks " +
                 std::to_string(blocks));
    IndexProblem pr = DsaStepCase::problem();
    pr.tokens = tokens;
    pr.k = 2048;
    pr.max_blocks = blocks;  // 640: 40960 positions; 128: 8192; 2048: 131072
    DsaStepCase c(pr, false, kv);
    std::vector<int32_t> context(tokens);
    for (int t = 0; t < tokens; ++t) context[t] = pr.max_blocks * pr.block_size - 61 * t;  // long, each its own
    CUDA_OK(cudaMemcpy(c.on->context.ptr, context.data(), context.size() * 4, cudaMemcpyHostToDevice));

    c.poison_outputs();
    indexer_topk(indexer_step(c.gpu), &gpu());
    positions_to_slots(slots_step(c.gpu), &gpu());
    sparse_mla(attention_step(c.gpu), &gpu());
    CUDA_OK(cudaDeviceSynchronize());
    const DsaStepCase::Outputs ops = c.download();
    ASSERT_EQ(std::count(ops.topk.begin(), ops.topk.end(), -1), 0);  // every token has 2048 positions
    ASSERT_EQ(std::count(ops.slots.begin(), ops.slots.end(), -1), 0);

    c.poison_outputs();
    dsa_decode_step(c.gpu, &gpu());
    CUDA_OK(cudaDeviceSynchronize());
    const DsaStepCase::Outputs fused = c.download();
    expect_identical(fused, ops, "the step vs its three ops");

    cudaStream_t stream = nullptr;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    DsaDecodeStepArgs g = c.gpu;
    g.stream = stream;
    dsa_decode_step(g, &gpu());  // the default workspace is made before the capture
    CUDA_OK(cudaStreamSynchronize(stream));
    const CapturedGraph graph(stream, cudaStreamCaptureModeThreadLocal, [&] { dsa_decode_step(g, &gpu()); });
    c.poison_outputs();
    CUDA_OK(cudaGraphLaunch(graph.exec(), stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    const DsaStepCase::Outputs replayed = c.download();
    expect_identical(replayed, ops, "the step replayed vs its three ops");
    CUDA_OK(cudaStreamDestroy(stream));
  }
}

// Each of the step's paths forced, the top-k's split (one CTA, slices through global memory, a cluster, a cluster of
// 16) and the attention's kernel, against the same ops run one by one with the same forced choices: positions, slots,
// out and lse bit for bit, on 8 tokens of 8192 and of 40960 positions over fp8_ds_mla. Only what the device lacks is
// refused (clusters below SM90, clusters of 16 where it runs fewer, wgmma without sm_90a code, the wide tile beyond
// its shared memory), and the forced step refuses it too.
TEST(CudaIndexer, DsaDecodeStepForcedPathsEqualTheirOps) {
  using cuda::AttentionKernel;
  using cuda::TopkSplit;
  const cuda::DeviceInfo& dev = cuda::current_device();
  const auto may_refuse = [&](TopkSplit split, AttentionKernel kernel) {
    return (split == TopkSplit::cluster && dev.compute_capability < 90) ||
           (split == TopkSplit::cluster16 && cuda::topk_max_cluster_ranks(2048) < 16) ||
           (kernel == AttentionKernel::wgmma && !cuda::wgmma_kernels_available()) ||
           (kernel == AttentionKernel::wide_tile && dev.max_smem_per_block < 232448);
  };
  for (int blocks : {128, 640}) {
    IndexProblem pr = DsaStepCase::problem();
    pr.tokens = 8;
    pr.k = 2048;
    pr.max_blocks = blocks;
    DsaStepCase c(pr, false, DType::fp8_ds_mla);
    std::vector<int32_t> context(pr.tokens);
    for (int t = 0; t < pr.tokens; ++t) context[t] = pr.max_blocks * pr.block_size - 61 * t;
    CUDA_OK(cudaMemcpy(c.on->context.ptr, context.data(), context.size() * 4, cudaMemcpyHostToDevice));
    const IndexerTopkArgs ix = indexer_step(c.gpu);
    DeviceBuffer scores(static_cast<size_t>(pr.tokens) * cuda::score_row_stride(ix) * sizeof(float));
    int forced = 0;
    for (TopkSplit split : {TopkSplit::one_cta, TopkSplit::slices, TopkSplit::cluster, TopkSplit::cluster16})
      for (AttentionKernel kernel : {AttentionKernel::automatic, AttentionKernel::head_tile,
                                     AttentionKernel::small_heads, AttentionKernel::wide_tile, AttentionKernel::wgmma}) {
        SCOPED_TRACE("positions " + std::to_string(blocks * pr.block_size) + " split " +
                     std::to_string(static_cast<int>(split)) + " kernel " + std::to_string(static_cast<int>(kernel)));
        const cuda::AttentionChoice choice{kernel};
        c.poison_outputs();
        try {
          DeviceBuffer scratch(cuda::topk_scratch_bytes(ix, split));
          cuda::indexer_scores(ix, static_cast<float*>(scores.ptr));
          cuda::select_topk(ix, static_cast<const float*>(scores.ptr), split, scratch.ptr);
          positions_to_slots(slots_step(c.gpu), &gpu());
          cuda::sparse_mla(attention_step(c.gpu), choice);
        } catch (const Error& e) {  // the device runs no such split or kernel: the forced step refuses it too
          CUDA_OK(cudaDeviceSynchronize());
          EXPECT_NE(e.kind(), ErrorKind::internal) << e.what();
          EXPECT_TRUE(may_refuse(split, kernel)) << "refused: " << e.what();
          std::printf("[ skipped  ] %s\n", e.what());
          EXPECT_THROW(cuda::dsa_decode_step(c.gpu, split, choice), Error);
          CUDA_OK(cudaDeviceSynchronize());
          continue;
        }
        CUDA_OK(cudaDeviceSynchronize());
        const DsaStepCase::Outputs ops = c.download();
        ASSERT_EQ(std::count(ops.topk.begin(), ops.topk.end(), -1), 0);
        c.poison_outputs();
        cuda::dsa_decode_step(c.gpu, split, choice);
        CUDA_OK(cudaDeviceSynchronize());
        expect_identical(c.download(), ops, "the forced step vs its ops forced alike");
        // (The wide tile's bound is the sm_90/sm_100 limit, not its need: it may fit a little less.)
        EXPECT_FALSE(may_refuse(split, kernel) && kernel != AttentionKernel::wide_tile) << "ran where the device lacks it";
        ++forced;
      }
    EXPECT_GE(forced, 6);  // every device: one CTA a row and slices, each with the automatic, 16-head-tile and
                           // small-heads kernels
  }
}

// ---------------------------------------------- the top-k stage on crafted rows

// Score rows built to reach every path of the selection: distinct scores
// (coarse bin, then refine few candidates by counting), one fp16 bin holding
// every score (refine over all by radix), exact ties among few candidates,
// few distinct values and all-equal rows (too many candidates: the exact
// select over the row), both signs, zeros of both signs and -inf, rows shorter
// than k, lengths that are not a multiple of 4, a row too short for every rank
// of a cluster to own positions, an empty context.
struct CraftedRow {
  const char* what;
  int64_t n;
  std::function<float(int64_t, test::Rng&)> score;
};

// Scores in [0, 1.000000007), distinct almost everywhere.
float distinct_score(int64_t, test::Rng& rng) { return static_cast<float>(rng() % 1000000007) / 1e9f; }

// Zeros of both signs, -inf and scores of either sign over about 2^-60..2^61.
float signed_wide_range_score(int64_t i, test::Rng& rng) {
  switch (i % 7) {
    case 0: return 0.f;
    case 1: return -0.f;
    case 2: return -INFINITY;
    default: {
      const float mag = std::ldexp(distinct_score(i, rng) + 0.5f, static_cast<int>(rng() % 120) - 60);
      return rng() % 2 ? mag : -mag;
    }
  }
}

std::vector<int32_t> expected_topk(const std::vector<float>& row, int64_t n, int k) {
  std::vector<int32_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return row[a] > row[b]; });
  order.resize(std::min<int64_t>(n, k));
  order.resize(k, -1);
  return order;
}

// A best-first top-k row in ascending position order, its -1 padding left last: what sorted = false returns.
std::vector<int32_t> by_position(std::vector<int32_t> row) {
  std::sort(row.begin(), std::find(row.begin(), row.end(), -1));
  return row;
}

// The scores kernel's coarse bin of a score (indexer_common.cuh): the top 12 bits of the order key of the score
// rounded to fp16 (not for NaN, whose fp16 code the host does not know).
int coarse_bin(float v) {
  const uint16_t u = numeric::float_to_f16(v + 0.f);
  return ((u & 0x8000u) ? (~u & 0xffffu) : (u | 0x8000u)) >> 4;
}

// What the top-k returned: positions and slots, [T, k] each.
struct TopkResult {
  std::vector<int32_t> positions, slots;
};

// exact: the result must be the reference's; else (NaN scores: an unspecified order) only valid: distinct
// positions of the row, as many as it has up to k, then -1. The top-k also writes the slots of its positions (as
// dsa_decode_step has it do) through a shuffled block table with holes: they must be the CPU's positions_to_slots
// of the positions it chose. sorted = false: the reference in position order (the CPU backend's unsorted result, as
// tests/cpu/test_indexer.cpp checks), and every row (NaN ones too) must be the GPU's own sorted selection in
// position order. counted: the rows' coarse-bin histograms counted on the host are given to the top-k
// (TopkFusion::histograms, as the scores kernel counts them; rows without NaN). `result` (if given) receives what
// the top-k returned.
void check_crafted_rows(const std::vector<CraftedRow>& rows, int k, uint64_t seed,
                        cuda::TopkSplit split = cuda::TopkSplit::automatic, bool exact = true, bool sorted = true,
                        bool counted = false, TopkResult* result = nullptr) {
  test::Rng rng(seed);
  const int tokens = static_cast<int>(rows.size()), bs = 64;
  int64_t longest = 1;
  for (const CraftedRow& r : rows) longest = std::max(longest, r.n);
  const int max_blocks = static_cast<int>((longest + bs - 1) / bs);
  std::vector<int32_t> request_ids(tokens), context(tokens), table(static_cast<size_t>(tokens) * max_blocks);
  std::iota(request_ids.begin(), request_ids.end(), 0);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);
  for (size_t i = 5; i < table.size(); i += 13) table[i] = -1;  // blocks not in the cache: slot -1
  std::vector<uint8_t> no_cache(16);
  std::vector<int32_t> out(static_cast<size_t>(tokens) * k);
  IndexerTopkArgs a;
  a.q = TensorView(nullptr, {tokens, 1, kIndexHeadDim}, DType::bf16);
  a.index_cache = TensorView(no_cache.data(), {1, bs, kFp8IndexRowBytes}, DType::fp8_e4m3);
  a.block_table = TensorView(table.data(), {tokens, max_blocks}, DType::i32);
  const int64_t stride = cuda::score_row_stride(a);
  std::vector<float> scores(static_cast<size_t>(tokens) * stride, NAN);  // NaN past each row's context
  std::vector<int32_t> want;
  std::vector<int32_t> histograms(counted ? static_cast<size_t>(tokens) * 4096 : 0);
  for (int t = 0; t < tokens; ++t) {
    context[t] = static_cast<int32_t>(rows[t].n);
    std::vector<float> row(rows[t].n);
    for (int64_t i = 0; i < rows[t].n; ++i) row[i] = rows[t].score(i, rng);
    std::copy(row.begin(), row.end(), scores.begin() + t * stride);
    for (int64_t i = 0; counted && i < rows[t].n; ++i) {
      if (std::isnan(row[i])) {
        ADD_FAILURE() << rows[t].what << ": no host histogram of NaN scores";
        return;
      }
      ++histograms[t * 4096 + coarse_bin(row[i])];
    }
    std::vector<int32_t> w = expected_topk(row, rows[t].n, k);
    if (!sorted) w = by_position(w);
    want.insert(want.end(), w.begin(), w.end());
  }
  DeviceBuffer dscores(scores), dreq(request_ids), dctx(context), dtable(table), dout(std::vector<int32_t>(out.size(), 777)),
      dslots(std::vector<int32_t>(out.size(), 777)), dhist(histograms);
  a.request_ids = on_gpu(TensorView(request_ids.data(), {tokens}, DType::i32), dreq.ptr);
  a.context_lens = on_gpu(TensorView(context.data(), {tokens}, DType::i32), dctx.ptr);
  a.block_table = on_gpu(a.block_table, dtable.ptr);
  a.topk = on_gpu(TensorView(out.data(), {tokens, k}, DType::i32), dout.ptr);
  // Where the split takes no histograms (slices, which automatic picks for long rows without clusters, e.g. SM80),
  // the top-k counts for itself.
  const int* counts = counted && cuda::topk_reads_histograms(a, split) ? static_cast<const int*>(dhist.ptr) : nullptr;
  std::vector<int32_t> sorted_by_gpu;
  if (!sorted) {  // the GPU's own sorted selection first, into the same buffer
    cuda::select_topk(a, static_cast<const float*>(dscores.ptr), split, nullptr, {nullptr, false, counts});
    CUDA_OK(cudaDeviceSynchronize());
    sorted_by_gpu = dout.download<int32_t>();
    CUDA_OK(cudaMemset(dout.ptr, 0x5a, dout.bytes));
    a.sorted = false;
  }
  PositionsToSlotsArgs to_slots;
  to_slots.positions = a.topk;
  to_slots.request_ids = a.request_ids;
  to_slots.block_table = a.block_table;
  to_slots.block_size = bs;
  to_slots.slots = on_gpu(a.topk, dslots.ptr);
  cuda::select_topk(a, static_cast<const float*>(dscores.ptr), split, nullptr, {&to_slots, false, counts});
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<int32_t> got = dout.download<int32_t>(), got_slots = dslots.download<int32_t>();
  std::vector<int32_t> positions = got, want_slots(got.size());
  PositionsToSlotsArgs on_cpu;
  on_cpu.positions = TensorView(positions.data(), {tokens, k}, DType::i32);
  on_cpu.request_ids = TensorView(request_ids.data(), {tokens}, DType::i32);
  on_cpu.block_table = TensorView(table.data(), {tokens, max_blocks}, DType::i32);
  on_cpu.block_size = bs;
  on_cpu.slots = TensorView(want_slots.data(), {tokens, k}, DType::i32);
  positions_to_slots(on_cpu, &cpu());
  EXPECT_EQ(got_slots, want_slots) << "split " << static_cast<int>(split) << ", k = " << k;
  EXPECT_NE(std::count(got_slots.begin(), got_slots.end(), -1), static_cast<long>(got_slots.size()));
  for (int t = 0; t < tokens; ++t) {
    const std::string what = std::string(rows[t].what) + " (n = " + std::to_string(rows[t].n) +
                             ", k = " + std::to_string(k) + ", split " + std::to_string(static_cast<int>(split)) +
                             (sorted ? "" : ", unsorted") + (counted ? ", counted)" : ")");
    if (!sorted)
      EXPECT_EQ(std::vector<int32_t>(got.begin() + t * k, got.begin() + (t + 1) * k),
                by_position(std::vector<int32_t>(sorted_by_gpu.begin() + t * k, sorted_by_gpu.begin() + (t + 1) * k)))
          << what << ": not the sorted selection in position order";
    if (exact) {
      EXPECT_TRUE(std::equal(got.begin() + t * k, got.begin() + (t + 1) * k, want.begin() + t * k)) << what;
      continue;
    }
    std::vector<int32_t> row(got.begin() + t * k, got.begin() + (t + 1) * k);
    const int64_t chosen = std::min<int64_t>(rows[t].n, k);
    for (int64_t i = 0; i < k; ++i)
      if (i < chosen) EXPECT_TRUE(row[i] >= 0 && row[i] < rows[t].n) << what << ": rank " << i << " is " << row[i];
      else EXPECT_EQ(row[i], -1) << what << ": rank " << i;
    std::sort(row.begin(), row.begin() + chosen);
    EXPECT_TRUE(std::adjacent_find(row.begin(), row.begin() + chosen) == row.begin() + chosen) << what << ": repeats";
  }
  if (result != nullptr) *result = {got, got_slots};
}

std::vector<CraftedRow> crafted_rows() {
  return {
      {"distinct", 131072, distinct_score},
      {"distinct, odd length", 4099, distinct_score},
      {"one fp16 bin", 20000, [](int64_t, test::Rng& rng) { return 1.f + 1e-7f * static_cast<float>(rng() % 5000); }},
      {"one fp16 bin, long", 150000, [](int64_t, test::Rng& rng) { return 1.f + 1e-7f * static_cast<float>(rng() % 5000); }},
      {"four values", 100003, [](int64_t, test::Rng& rng) { return static_cast<float>(rng() % 4); }},
      {"all equal", 60000, [](int64_t, test::Rng&) { return 0.25f; }},
      {"signs, zeros, -inf, wide range", 77777, signed_wide_range_score},
      {"exact ties among few candidates", 8192,
       [](int64_t, test::Rng& rng) { return static_cast<float>(rng() % 3000); }},
      {"shorter than k", 1000, distinct_score},
      {"nine positions (cluster ranks with none)", 9, distinct_score},
      {"empty context", 0, [](int64_t, test::Rng&) { return 0.f; }},
  };
}

// The ways to force select_topk to share rows, and not: thread block clusters only where the device has them
// (SM90+; elsewhere select_topk refuses them), so they are skipped on older devices; clusters of 16 likewise only
// where they run (Hopper).
std::vector<cuda::TopkSplit> forced_splits() {
  std::vector<cuda::TopkSplit> splits = {cuda::TopkSplit::one_cta, cuda::TopkSplit::slices};
  if (cuda::current_device().compute_capability >= 90) splits.push_back(cuda::TopkSplit::cluster);
  if (cuda::topk_max_cluster_ranks(2048) >= 16) splits.push_back(cuda::TopkSplit::cluster16);
  return splits;
}

// Every row in one CTA, split among CTAs (slice histograms, plan, slice compaction), shared by a cluster's CTAs,
// and as select_topk picks; few and many tokens.
TEST(CudaTopk, ExactOnCraftedRows) {
  std::vector<CraftedRow> many;
  for (int copy = 0; copy < 3; ++copy)
    for (const CraftedRow& r : crafted_rows()) many.push_back(r);
  std::vector<cuda::TopkSplit> splits = forced_splits();
  splits.push_back(cuda::TopkSplit::automatic);
  for (cuda::TopkSplit split : splits) {
    check_crafted_rows(crafted_rows(), 2048, 100, split);
    check_crafted_rows(crafted_rows(), 37, 101, split);
    check_crafted_rows(many, 2048, 105, split);
  }
}

// Shorter tables (fewer slices when split, ranks of a cluster with less each).
TEST(CudaTopk, ExactOnCraftedRowsOfShortTables) {
  std::vector<CraftedRow> rows;
  for (const CraftedRow& r : crafted_rows())
    if (r.n < 32768) rows.push_back(r);
  rows.push_back({"all equal, 30000", 30000, [](int64_t, test::Rng&) { return -2.5f; }});
  rows.push_back({"four values, 30001", 30001, [](int64_t, test::Rng& rng) { return static_cast<float>(rng() % 4); }});
  for (cuda::TopkSplit split : forced_splits()) {
    check_crafted_rows(rows, 2048, 103, split);
    check_crafted_rows(rows, 8192, 104, split);
  }
}

// NaN scores have no order, but every path still returns distinct positions of the row.
TEST(CudaTopk, NanScoresGiveValidPositions) {
  const auto some_nan = [](int64_t i, test::Rng& rng) {
    return i % 5 == 0 ? (i % 10 == 0 ? NAN : -NAN) : static_cast<float>(rng() % 1000) / 7.f;
  };
  const std::vector<CraftedRow> rows = {
      {"a fifth NaN", 131072, some_nan},
      {"one NaN in 1000", 131072,
       [](int64_t i, test::Rng& rng) { return i % 1000 == 0 ? NAN : static_cast<float>(rng() % 100000) / 7.f; }},
      {"a fifth NaN, short", 5000, some_nan},
      {"all NaN", 70000, [](int64_t, test::Rng&) { return NAN; }},
      {"NaN and -inf", 40000, [](int64_t i, test::Rng&) { return i % 2 ? NAN : -INFINITY; }},
  };
  for (cuda::TopkSplit split : forced_splits()) {
    check_crafted_rows(rows, 2048, 106, split, false);
    check_crafted_rows(rows, 37, 107, split, false);
  }
}

TEST(CudaTopk, ExactWithK8192) {
  std::vector<CraftedRow> rows = crafted_rows();
  rows.push_back({"many ties, 300K", 300000, [](int64_t, test::Rng& rng) { return static_cast<float>(rng() % 99991); }});
  for (cuda::TopkSplit split : forced_splits()) check_crafted_rows(rows, 8192, 102, split);
}

// sorted = false on every path (one CTA, slices, cluster, automatic): the CPU backend's unsorted positions (the
// reference in position order) and their slots bit for bit, and the GPU's sorted selection in position order; NaN
// rows (no reference order) against the GPU's sorted selection alone.
TEST(CudaTopk, UnsortedOnCraftedRows) {
  std::vector<CraftedRow> short_rows;
  for (const CraftedRow& r : crafted_rows())
    if (r.n < 32768) short_rows.push_back(r);
  const auto some_nan = [](int64_t i, test::Rng& rng) {
    return i % 5 == 0 ? (i % 10 == 0 ? NAN : -NAN) : static_cast<float>(rng() % 1000) / 7.f;
  };
  const std::vector<CraftedRow> nan_rows = {
      {"a fifth NaN", 131072, some_nan},
      {"a fifth NaN, short", 5000, some_nan},
      {"all NaN", 70000, [](int64_t, test::Rng&) { return NAN; }},
  };
  std::vector<cuda::TopkSplit> splits = forced_splits();
  splits.push_back(cuda::TopkSplit::automatic);
  for (cuda::TopkSplit split : splits) {
    check_crafted_rows(crafted_rows(), 2048, 200, split, true, false);
    check_crafted_rows(crafted_rows(), 37, 201, split, true, false);
    check_crafted_rows(short_rows, 8192, 202, split, true, false);
    check_crafted_rows(nan_rows, 2048, 203, split, false, false);
  }
}

// `tokens` rows of about `n` positions (61 fewer per token), in turn of distinct scores, of exact ties among few
// candidates, of four values (too many candidates: the select over the row) and a short one.
std::vector<CraftedRow> decode_shape_rows(int64_t n, int tokens) {
  std::vector<CraftedRow> rows;
  for (int t = 0; t < tokens; ++t) {
    const int64_t len = n - 61 * t;
    switch (t % 4) {
      case 0: rows.push_back({"distinct", len, distinct_score}); break;
      case 1: rows.push_back({"ties", len, [](int64_t, test::Rng& rng) { return static_cast<float>(rng() % 3000); }}); break;
      case 2: rows.push_back({"four values", len, [](int64_t, test::Rng& rng) { return static_cast<float>(rng() % 4); }}); break;
      default: rows.push_back({"short", 1500 + t, distinct_score});
    }
  }
  return rows;
}

// sorted = false at decode batch sizes (1, 8 and 128 tokens) and contexts (8K, 32K, 128K), each path forced, on
// decode_shape_rows.
TEST(CudaTopk, UnsortedAtDecodeShapes) {
  for (int64_t n : {8192, 32768, 131072})
    for (int tokens : {1, 8, 128}) {
      SCOPED_TRACE("context " + std::to_string(n) + ", tokens " + std::to_string(tokens));
      const std::vector<CraftedRow> rows = decode_shape_rows(n, tokens);
      for (cuda::TopkSplit split : forced_splits()) check_crafted_rows(rows, 2048, 300 + tokens, split, true, false);
    }
}

// Rows one CTA holds in registers (at most 16384 positions; indexer_topk.cu's HeldRow), at the lengths around its
// pieces (a 16-byte piece per thread is 2048 positions) and limits: 1, 2047, 2048, 2049 (k more, equal, fewer than
// the row), 4096, 8192, 16384 (the longest held) and 16385 (the row read twice from memory again, on the same rows),
// each length with distinct scores, exact ties, four values, all equal, one fp16 bin, signs with zeros and -inf, and
// a row a third as long (fewer visible than the table holds), sorted and unsorted, k 2048, 37 and 8192, with the fused
// slots; NaN rows give valid positions. One CTA forced and as select_topk picks (one CTA for rows this short: of
// 1024 threads for k 2048 and 37 up to 16384, of 512 for k 8192 and the 16385 positions).
TEST(CudaTopk, RowsHeldInRegisters) {
  const auto some_nan = [](int64_t i, test::Rng& rng) {
    return i % 5 == 0 ? (i % 10 == 0 ? NAN : -NAN) : static_cast<float>(rng() % 1000) / 7.f;
  };
  for (int64_t n : {1, 2047, 2048, 2049, 4096, 8192, 16384, 16385}) {
    SCOPED_TRACE("n " + std::to_string(n));
    const std::vector<CraftedRow> rows = {
        {"distinct", n, distinct_score},
        {"exact ties", n, [](int64_t, test::Rng& rng) { return static_cast<float>(rng() % 3000); }},
        {"four values", n, [](int64_t, test::Rng& rng) { return static_cast<float>(rng() % 4); }},
        {"all equal", n, [](int64_t, test::Rng&) { return -1.5f; }},
        {"one fp16 bin", n, [](int64_t, test::Rng& rng) { return 1.f + 1e-7f * static_cast<float>(rng() % 5000); }},
        {"signs, zeros, -inf", n, signed_wide_range_score},
        {"a third as long", n / 3 + 1, distinct_score},
    };
    const std::vector<CraftedRow> nan_rows = {
        {"a fifth NaN", n, some_nan},
        {"all NaN", n, [](int64_t, test::Rng&) { return NAN; }},
        {"NaN and -inf", n, [](int64_t i, test::Rng&) { return i % 2 ? NAN : -INFINITY; }},
    };
    for (cuda::TopkSplit split : {cuda::TopkSplit::one_cta, cuda::TopkSplit::automatic})
      for (bool sorted : {true, false}) {
        check_crafted_rows(rows, 2048, 500, split, true, sorted);
        check_crafted_rows(rows, 37, 501, split, true, sorted);
        check_crafted_rows(rows, 8192, 502, split, true, sorted);
        check_crafted_rows(nan_rows, 2048, 503, split, false, sorted);
      }
  }
  // decode_shape_rows at 1 and 8 tokens of 8K and of 16K, sorted and unsorted.
  for (int64_t n : {8192, 16384})
    for (int tokens : {1, 8}) {
      SCOPED_TRACE("context " + std::to_string(n) + ", tokens " + std::to_string(tokens));
      const std::vector<CraftedRow> rows = decode_shape_rows(n, tokens);
      for (cuda::TopkSplit split : {cuda::TopkSplit::one_cta, cuda::TopkSplit::automatic})
        for (bool sorted : {true, false}) check_crafted_rows(rows, 2048, 510 + tokens, split, true, sorted);
    }
}

// A held row (one CTA, the row in registers: its compaction one scan of per-thread counts, its unsorted order one
// more from its marks) against the same rows read twice from memory (TopkSplit::one_cta_streamed): the CPU's
// result each, and the same positions and slots bit for bit; 1 and 8 tokens of 8K, 16K and 128K (not held: the
// automatic split against one CTA streaming it), decode_shape_rows (distinct, exact ties, four values: the select
// over the row, short rows) and rows whose ties straddle the bin of the k-th, sorted and unsorted, k 2048 and 37.
TEST(CudaTopk, HeldRowsEqualTheStreamedPath) {
  for (int64_t n : {8192, 16384, 131072})
    for (int tokens : {1, 8}) {
      SCOPED_TRACE("context " + std::to_string(n) + ", tokens " + std::to_string(tokens));
      std::vector<CraftedRow> rows = decode_shape_rows(n, tokens);
      rows.push_back(
          {"ties in few bins", n - 7, [](int64_t, test::Rng& rng) { return static_cast<float>(rng() % 40) / 8.f; }});
      for (bool sorted : {true, false})
        for (int k : {2048, 37}) {
          TopkResult held, streamed;
          check_crafted_rows(rows, k, 600 + tokens, cuda::TopkSplit::automatic, true, sorted, false, &held);
          check_crafted_rows(rows, k, 600 + tokens, cuda::TopkSplit::one_cta_streamed, true, sorted, false, &streamed);
          EXPECT_EQ(held.positions, streamed.positions) << "k " << k << (sorted ? "" : ", unsorted");
          EXPECT_EQ(held.slots, streamed.slots) << "k " << k << (sorted ? "" : ", unsorted");
          EXPECT_FALSE(held.positions.empty());
        }
    }
}

// The CTA of 1024 threads (indexer_topk.cu's kWideThreads) where one CTA holds every row in registers and k <= 2048,
// 512 otherwise (k 8192, a table longer than 16384 positions, the row streamed, split); held rows on it against the
// CTA of 512 streaming them: the CPU's result each, and the same positions and slots bit for bit (sorted and unsorted,
// k 2048 and 37; distinct scores, exact ties, all equal: the select over the candidates, a fp16 bin, a short row).
TEST(CudaTopk, WideCtaOnHeldRows) {
  const auto threads = [](int64_t blocks, int k, cuda::TopkSplit split) {
    std::vector<uint8_t> no_cache(16);
    IndexerTopkArgs a;
    a.q = TensorView(nullptr, {1, 1, kIndexHeadDim}, DType::bf16);
    a.index_cache = TensorView(no_cache.data(), {1, 64, kFp8IndexRowBytes}, DType::fp8_e4m3);
    a.request_ids = TensorView(nullptr, {1}, DType::i32);
    a.context_lens = TensorView(nullptr, {1}, DType::i32);
    a.block_table = TensorView(nullptr, {1, blocks}, DType::i32);
    a.topk = TensorView(nullptr, {1, k}, DType::i32);
    return cuda::topk_cta_threads(a, split);
  };
  EXPECT_EQ(threads(256, 2048, cuda::TopkSplit::automatic), 1024);
  EXPECT_EQ(threads(256, 2048, cuda::TopkSplit::one_cta), 1024);
  EXPECT_EQ(threads(2, 37, cuda::TopkSplit::one_cta), 1024);
  EXPECT_EQ(threads(256, 8192, cuda::TopkSplit::one_cta), 512);
  EXPECT_EQ(threads(257, 2048, cuda::TopkSplit::one_cta), 512);
  EXPECT_EQ(threads(256, 2048, cuda::TopkSplit::one_cta_streamed), 512);
  EXPECT_EQ(threads(256, 2048, cuda::TopkSplit::slices), 512);
  const std::vector<CraftedRow> rows = {
      {"distinct", 8192, distinct_score},
      {"exact ties", 16384 - 5, [](int64_t, test::Rng& rng) { return static_cast<float>(rng() % 3000); }},
      {"all equal", 16384, [](int64_t, test::Rng&) { return 0.75f; }},
      {"one fp16 bin", 6000, [](int64_t, test::Rng& rng) { return 1.f + 1e-7f * static_cast<float>(rng() % 5000); }},
      {"short", 1500, distinct_score},
  };
  for (bool sorted : {true, false})
    for (int k : {2048, 37}) {
      TopkResult wide, streamed;
      check_crafted_rows(rows, k, 700, cuda::TopkSplit::one_cta, true, sorted, false, &wide);
      check_crafted_rows(rows, k, 700, cuda::TopkSplit::one_cta_streamed, true, sorted, false, &streamed);
      EXPECT_EQ(wide.positions, streamed.positions) << "k " << k << (sorted ? "" : ", unsorted");
      EXPECT_EQ(wide.slots, streamed.slots) << "k " << k << (sorted ? "" : ", unsorted");
    }
}

// Clusters of 16 ranks forced (non-portable, Hopper), at the decode shapes issue 23 is about: 1 and 8 tokens of
// rows of 32K (2048 positions per rank) and 128K, sorted and unsorted, with the fused slots; distinct scores, exact
// ties, four values (the select over the row by rank 0) and a row so short most ranks have nothing (test_cuda_emulation
// checks where cluster16 is refused).
TEST(CudaTopk, SixteenRanksAtDecodeShapes) {
  if (cuda::topk_max_cluster_ranks(2048) < 16)
    GTEST_SKIP() << "the device runs clusters of at most " << cuda::topk_max_cluster_ranks(2048) << " CTAs";
  for (int64_t n : {32768, 131072})
    for (int tokens : {1, 8}) {
      SCOPED_TRACE("context " + std::to_string(n) + ", tokens " + std::to_string(tokens));
      const std::vector<CraftedRow> rows = decode_shape_rows(n, tokens);
      for (bool sorted : {true, false}) {
        check_crafted_rows(rows, 2048, 400 + tokens, cuda::TopkSplit::cluster16, true, sorted);
        check_crafted_rows(rows, 37, 410 + tokens, cuda::TopkSplit::cluster16, true, sorted);
      }
    }
}

// The top-k reading each row's coarse-bin histogram (TopkFusion::histograms, as the scores kernel counts them) in
// place of its own count, on every split that takes it (all but slices; as select_topk picks too), sorted and
// unsorted, with the fused slots: the exact reference (the CPU backend's order: ties to the lower position) and,
// positions and slots, bit for bit the top-k that counted for itself. Crafted rows (ties, one fp16 bin, all equal,
// signs with zeros and -inf, rows shorter than k, empty; k 2048 and 37) and the decode shapes, 1 and 8 tokens of 8K
// (held in registers) and 128K (clusters; k 2048). NaN rows: CudaIndexer.ScoresCountTheTopksHistograms.
TEST(CudaTopk, CountedHistogramsOnCraftedRows) {
  std::vector<cuda::TopkSplit> splits;
  for (cuda::TopkSplit split : forced_splits())
    if (split != cuda::TopkSplit::slices) splits.push_back(split);
  splits.push_back(cuda::TopkSplit::automatic);
  std::vector<std::vector<CraftedRow>> row_sets = {crafted_rows()};
  for (int64_t n : {8192, 131072})
    for (int tokens : {1, 8}) row_sets.push_back(decode_shape_rows(n, tokens));
  for (cuda::TopkSplit split : splits)
    for (size_t set = 0; set < row_sets.size(); ++set)
      for (bool sorted : {true, false})
        for (int k : {2048, 37}) {
          if (k != 2048 && set > 0) continue;  // k 37 on the crafted rows only
          const std::vector<CraftedRow>& rows = row_sets[set];
          SCOPED_TRACE("split " + std::to_string(static_cast<int>(split)) + ", " + std::to_string(rows.size()) +
                       " rows, k " + std::to_string(k) + (sorted ? "" : ", unsorted"));
          TopkResult counted, counting;
          check_crafted_rows(rows, k, 600 + k, split, true, sorted, true, &counted);
          check_crafted_rows(rows, k, 600 + k, split, true, sorted, false, &counting);
          ASSERT_FALSE(counted.positions.empty());
          EXPECT_EQ(counted.positions, counting.positions);
          EXPECT_EQ(counted.slots, counting.slots);
        }
}

// Rows split into slices count their own: histograms given there are an error naming them (select_topk refuses
// them before any launch; SM90+ picks clusters, so slices are forced here).
TEST(CudaTopk, SlicesRefuseCountedHistograms) {
  std::vector<int32_t> req = {0}, ctx = {70000}, table(2048, 0), out(2048);
  DeviceBuffer dreq(req), dctx(ctx), dtable(table), dout(out), dscores(size_t{131072} * 4), dhist(size_t{4096} * 4);
  IndexerTopkArgs a;
  std::vector<uint8_t> no_cache(16);
  a.q = TensorView(nullptr, {1, 1, kIndexHeadDim}, DType::bf16);
  a.index_cache = TensorView(no_cache.data(), {1, 64, kFp8IndexRowBytes}, DType::fp8_e4m3);
  a.request_ids = on_gpu(TensorView(req.data(), {1}, DType::i32), dreq.ptr);
  a.context_lens = on_gpu(TensorView(ctx.data(), {1}, DType::i32), dctx.ptr);
  a.block_table = on_gpu(TensorView(table.data(), {1, 2048}, DType::i32), dtable.ptr);
  a.topk = on_gpu(TensorView(out.data(), {1, 2048}, DType::i32), dout.ptr);
  EXPECT_FALSE(cuda::topk_reads_histograms(a, cuda::TopkSplit::slices));
  EXPECT_TRUE(cuda::topk_reads_histograms(a, cuda::TopkSplit::one_cta));
  test::expect_error(
      [&] {
        cuda::select_topk(a, static_cast<const float*>(dscores.ptr), cuda::TopkSplit::slices, nullptr,
                          {nullptr, false, static_cast<const int*>(dhist.ptr)});
      },
      ErrorKind::invalid_argument, {"select_topk", "TopkFusion::histograms", "slices"});
}

// The scores kernel counting each row's coarse bins as it writes the scores (indexer_scores with histograms, into
// memory poisoned first: its zeroing kernel runs), fp8 queries and keys (GLM-5's indexer, 32 heads), 1 and 8 tokens
// of 8K and 128K contexts; the 8-token problems also have a row shorter than k, an empty one, one whose scores are all
// NaN (a NaN head weight) and a block outside the cache (-inf scores); the 8K ones once more with exact ties
// (duplicate keys). The scores bit for bit those of the kernel without histograms; each histogram the host's count of
// those scores (NaN rows: their total); the top-k reading them (each split that takes them, sorted and unsorted)
// bit for bit the top-k counting for itself, and the exact reference on the scores (rows without NaN); indexer_topk
// (whose top-k counts for itself) the same.
TEST(CudaIndexer, ScoresCountTheTopksHistograms) {
  std::vector<cuda::TopkSplit> splits = {cuda::TopkSplit::automatic, cuda::TopkSplit::one_cta};
  if (cuda::current_device().compute_capability >= 90) splits.push_back(cuda::TopkSplit::cluster);
  if (cuda::topk_max_cluster_ranks(2048) >= 16) splits.push_back(cuda::TopkSplit::cluster16);
  for (int context : {8192, 131072})
    for (int tokens : {1, 8})
      for (bool ties : {false, true}) {
        if (ties && context > 8192) continue;
        SCOPED_TRACE("context " + std::to_string(context) + ", tokens " + std::to_string(tokens) +
                     (ties ? ", ties" : ""));
        IndexProblem pr;
        pr.q_dtype = pr.cache_dtype = DType::fp8_e4m3;
        pr.tokens = tokens;
        pr.k = 2048;
        pr.block_size = 64;
        pr.max_blocks = context / 64;
        pr.duplicate_keys = ties;
        IndexData d(pr, 700 + context + tokens);
        for (int t = 0; t < tokens; ++t) {
          const int lengths[] = {context, 1000, context - 61 * t, 0, context - 7, context, context, 3333};
          d.context[t] = lengths[t % 8];
        }
        if (tokens == 8) {
          d.weights[5 * pr.heads + 3] = NAN;  // token 5: every score NaN
          d.table[1] = -1;                    // request 0's second block is outside the cache: -inf
        }
        std::vector<int32_t> host_out;
        IndexerTopkArgs a = d.args(host_out);
        IndexInputsOnGpu on(d, a);
        IndexerTopkArgs g = on.args;
        const int64_t stride = cuda::score_row_stride(g);
        const size_t floats = static_cast<size_t>(tokens) * stride;
        DeviceBuffer plain(std::vector<float>(floats, NAN)), with(std::vector<float>(floats, NAN)),
            hist(std::vector<int32_t>(static_cast<size_t>(tokens) * 4096, 0x7f7f7f7f)),
            dout(std::vector<int32_t>(host_out.size(), 777));
        ASSERT_EQ(cuda::topk_histogram_bytes(g), hist.bytes);
        cuda::indexer_scores(g, static_cast<float*>(plain.ptr));
        cuda::indexer_scores(g, static_cast<float*>(with.ptr), cuda::ScoreMma::automatic, static_cast<int*>(hist.ptr));
        CUDA_OK(cudaDeviceSynchronize());
        const std::vector<float> scores = plain.download<float>(), scores_with = with.download<float>();
        const std::vector<int32_t> counts = hist.download<int32_t>();
        ASSERT_EQ(std::memcmp(scores.data(), scores_with.data(), floats * 4), 0) << "the scores changed";
        std::vector<std::vector<float>> rows(tokens);
        std::vector<bool> has_nan(tokens, false);
        for (int t = 0; t < tokens; ++t) {
          const int n = std::max(0, std::min(d.context[t], context));
          rows[t].assign(scores.begin() + t * stride, scores.begin() + t * stride + n);
          std::vector<int32_t> want(4096, 0);
          for (float v : rows[t]) {
            has_nan[t] = has_nan[t] || std::isnan(v);
            if (!std::isnan(v)) ++want[coarse_bin(v)];
          }
          const std::vector<int32_t> got(counts.begin() + t * 4096, counts.begin() + (t + 1) * 4096);
          if (has_nan[t])
            EXPECT_EQ(std::accumulate(got.begin(), got.end(), int64_t{0}), n) << "token " << t;
          else
            EXPECT_EQ(got, want) << "token " << t;
        }
        if (tokens == 8) ASSERT_TRUE(has_nan[5]);
        g.topk = on_gpu(a.topk, dout.ptr);
        for (cuda::TopkSplit split : splits)
          for (bool sorted : {true, false}) {
            SCOPED_TRACE("split " + std::to_string(static_cast<int>(split)) + (sorted ? "" : ", unsorted"));
            g.sorted = sorted;
            cuda::select_topk(g, static_cast<const float*>(plain.ptr), split);
            CUDA_OK(cudaDeviceSynchronize());
            const std::vector<int32_t> counting = dout.download<int32_t>();
            std::vector<int32_t> counted = counting;
            if (cuda::topk_reads_histograms(g, split)) {  // not where automatic picks slices (no clusters: SM80)
              CUDA_OK(cudaMemset(dout.ptr, 0x5a, dout.bytes));
              cuda::select_topk(g, static_cast<const float*>(with.ptr), split, nullptr,
                                {nullptr, false, static_cast<const int*>(hist.ptr)});
              CUDA_OK(cudaDeviceSynchronize());
              counted = dout.download<int32_t>();
              EXPECT_EQ(counted, counting);
            }
            for (int t = 0; t < tokens; ++t) {
              if (has_nan[t]) continue;
              std::vector<int32_t> want = expected_topk(rows[t], static_cast<int64_t>(rows[t].size()), pr.k);
              if (!sorted) want = by_position(want);
              EXPECT_TRUE(std::equal(want.begin(), want.end(), counted.begin() + t * pr.k)) << "token " << t;
            }
            if (split == cuda::TopkSplit::automatic) {  // the op, its scores and histograms in its own workspace
              CUDA_OK(cudaMemset(dout.ptr, 0x5a, dout.bytes));
              indexer_topk(g, &gpu());
              CUDA_OK(cudaDeviceSynchronize());
              EXPECT_EQ(dout.download<int32_t>(), counted) << "indexer_topk";
            }
          }
      }
}

// The step with sorted = false against the step with sorted = true: per token the same positions in position order,
// the slots of those positions, and the attention within the attention tests' tolerance (the sum runs in another
// order); short mixed contexts (also against the CPU's unsorted step), and long rows for 1 and 8 tokens (a
// cluster's on SM90+).
TEST(CudaIndexer, DsaDecodeStepUnsortedEqualsTheSortedStep) {
  for (int tokens : {5, 1, 8}) {
    SCOPED_TRACE("tokens " + std::to_string(tokens));
    IndexProblem pr = DsaStepCase::problem();
    pr.tokens = tokens;
    if (tokens != 5) {
      pr.k = 2048;
      pr.max_blocks = 640;  // 40960 positions
    }
    DsaStepCase c(pr, false);
    if (tokens != 5) {  // long rows, each its own length
      std::vector<int32_t> context(tokens);
      for (int t = 0; t < tokens; ++t) context[t] = pr.max_blocks * pr.block_size - 977 * t;
      CUDA_OK(cudaMemcpy(c.on->context.ptr, context.data(), context.size() * 4, cudaMemcpyHostToDevice));
    }
    c.poison_outputs();
    dsa_decode_step(c.gpu, &gpu());
    CUDA_OK(cudaDeviceSynchronize());
    const DsaStepCase::Outputs want = c.download();
    c.poison_outputs();
    DsaDecodeStepArgs unsorted = c.gpu;
    unsorted.indexer.sorted = false;
    dsa_decode_step(unsorted, &gpu());
    CUDA_OK(cudaDeviceSynchronize());
    const DsaStepCase::Outputs got = c.download();
    const int k = pr.k;
    for (int t = 0; t < tokens; ++t) {
      // (position, slot) pairs of the sorted step, in position order, must be the unsorted step's.
      std::vector<std::pair<int32_t, int32_t>> pairs, got_pairs;
      for (int i = t * k; i < (t + 1) * k; ++i) {
        if (want.topk[i] >= 0) pairs.emplace_back(want.topk[i], want.slots[i]);
        got_pairs.emplace_back(got.topk[i], got.slots[i]);
      }
      std::sort(pairs.begin(), pairs.end());
      pairs.resize(k, {-1, -1});
      EXPECT_EQ(got_pairs, pairs) << "token " << t;
    }
    if (tokens == 5) {  // short mixed contexts: the CPU's unsorted step chooses the same, in the same order
      DsaDecodeStepArgs host = c.host;
      host.indexer.sorted = false;
      dsa_decode_step(host, &cpu());
      EXPECT_EQ(got.topk, c.topk);
      EXPECT_EQ(got.slots, c.slots);
    }
    std::vector<double> out_want(want.out.size()), out_got(got.out.size());
    for (size_t i = 0; i < out_want.size(); ++i) {
      out_want[i] = numeric::bf16_to_float(want.out[i]);
      out_got[i] = numeric::bf16_to_float(got.out[i]);
    }
    // The attention tests' tolerance against the float64 reference: the order moves where the running max of
    // the softmax steps, so fp8 rows' f16 P rounds elsewhere (on the H200 up to ~1.5e-4 on outputs of ~3e-3).
    EXPECT_EQ(test::compare(out_want, out_got, 2e-3, 2e-2, 0.9999), "");
    EXPECT_EQ(test::compare(std::vector<double>(want.lse.begin(), want.lse.end()),
                            std::vector<double>(got.lse.begin(), got.lse.end()), 1e-5, 1e-5, 0.99999),
              "");
  }
}

}  // namespace
}  // namespace smla
