// The workspace contract (include/smla/ops.h): workspace_size, the checks of a
// caller's workspace and how it reaches a backend and dsa_decode_step's steps;
// and the outputs FlashMLA's layouts need from the kernels: max_logits against
// float64, +inf lse for empty rows, lse written through a transposed view.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "reference/mla_reference.h"
#include "smla/backend.h"
#include "smla/error.h"
#include "smla/ops.h"
#include "smla/select.h"
#include "support/test_util.h"

namespace smla {
namespace {

using test::Rng;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// A sparse_mla problem on the CPU: T tokens, H heads, K indices into a bf16 cache of 64 slots. Token 1 has only
// invalid indices (an empty row); outputs start as NaN.
struct Sparse {
  std::vector<uint16_t> cache, q, out;
  std::vector<int32_t> indices;
  std::vector<float> lse, max_logits;
  SparseMlaArgs args;

  Sparse(int64_t tokens, int64_t heads, int64_t topk, uint64_t seed) {
    Rng rng(seed);
    constexpr int64_t kBlocks = 8, kBlockSize = 8, kSlots = kBlocks * kBlockSize;
    cache = test::to_half_bits(test::random_floats(rng, kSlots * kMlaQkDim), DType::bf16);
    q = test::to_half_bits(test::random_floats(rng, tokens * heads * kMlaQkDim, -2.f, 2.f), DType::bf16);
    indices.resize(tokens * topk);
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t k = 0; k < topk; ++k)
        indices[t * topk + k] = t == 1 ? -1 : rng() % 7 == 0 ? int32_t{kSlots} : static_cast<int32_t>(rng() % kSlots);
    out.assign(tokens * heads * kMlaVDim, 0x7fc0);  // bf16 NaN
    lse.assign(tokens * heads, kNaN);
    max_logits.assign(tokens * heads, kNaN);
    args.q = TensorView(q.data(), {tokens, heads, kMlaQkDim}, DType::bf16);
    args.kv_cache = TensorView(cache.data(), {kBlocks, kBlockSize, kMlaQkDim}, DType::bf16);
    args.indices = TensorView(indices.data(), {tokens, topk}, DType::i32);
    args.softmax_scale = 0.2f;
    args.out = TensorView(out.data(), {tokens, heads, kMlaVDim}, DType::bf16);
    args.lse = TensorView(lse.data(), {tokens, heads}, DType::f32);
  }
  int64_t tokens() const { return args.q.shape[0]; }
  int64_t heads() const { return args.q.shape[1]; }
};

// max_logits is max over the valid entries of softmax_scale * q.k in natural units (FlashMLA's
// flash_mla_sparse_fwd): fp32 scores, held to FlashMLA's lse tolerance against the float64 reference.
TEST(MaxLogits, MatchFloat64Reference) {
  for (int threads : {1, 7}) {  // 2 tokens on 7 threads: each token's rows split over several work items
    Sparse s(/*tokens=*/3, /*heads=*/5, /*topk=*/300, 11 + threads);
    s.args.max_logits = TensorView(s.max_logits.data(), {s.tokens(), s.heads()}, DType::f32);
    const int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    sparse_mla(s.args);
    omp_set_num_threads(saved);
    const reference::RefAttention ref = reference::ref_sparse_mla(s.args);
    for (int64_t i = 0; i < s.tokens() * s.heads(); ++i) {
      const double want = ref.max_logits[i];
      if (i / s.heads() == 1) {
        EXPECT_EQ(s.max_logits[i], -kInf) << i;  // no valid index
        EXPECT_EQ(s.lse[i], -kInf) << i;
        continue;
      }
      ASSERT_TRUE(std::isfinite(want));
      EXPECT_NEAR(s.max_logits[i], want, 1e-5 + 8.01 / 65536 * std::fabs(want)) << "row " << i << ", threads " << threads;
      EXPECT_LE(s.max_logits[i], s.lse[i] + 1e-5) << "a max logit cannot exceed the log-sum-exp";
    }
    // The outputs are the same with and without max_logits.
    Sparse plain(3, 5, 300, 11 + threads);
    omp_set_num_threads(threads);
    sparse_mla(plain.args);
    omp_set_num_threads(saved);
    EXPECT_EQ(plain.out, s.out);
    for (size_t i = 0; i < s.lse.size(); ++i) EXPECT_EQ(plain.lse[i], s.lse[i]) << i;
  }
}

// FlashMLA's layouts: lse of an empty row +inf when asked; lse and max_logits written through transposed views
// ([T, H] views of [H, T] buffers), with the same values as contiguous ones.
TEST(FlashMlaLayouts, PlusInfForEmptyRowsAndTransposedViews) {
  Sparse want(4, 3, 40, 5);
  want.args.max_logits = TensorView(want.max_logits.data(), {want.tokens(), want.heads()}, DType::f32);
  sparse_mla(want.args);

  Sparse got(4, 3, 40, 5);
  const int64_t T = got.tokens(), H = got.heads();
  got.args.lse = TensorView(got.lse.data(), {T, H}, {1, T}, DType::f32);
  got.args.max_logits = TensorView(got.max_logits.data(), {T, H}, {1, T}, DType::f32);
  got.args.empty_lse_plus_inf = true;
  sparse_mla(got.args);
  EXPECT_EQ(got.out, want.out);
  const reference::RefAttention ref = reference::ref_sparse_mla(got.args);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const float lse = got.lse[h * T + t], max_logit = got.max_logits[h * T + t];
      EXPECT_EQ(max_logit, want.max_logits[t * H + h]) << t << "," << h;
      if (t == 1) {
        EXPECT_EQ(lse, kInf);
        EXPECT_EQ(ref.lse[t * H + h], kInf);  // the reference follows the flag too
        EXPECT_EQ(want.lse[t * H + h], -kInf);
      } else {
        EXPECT_EQ(lse, want.lse[t * H + h]) << t << "," << h;
      }
    }
}

TEST(FlashMlaLayouts, PagedDecodeLseTransposedAndPlusInf) {
  // B = 2 requests, s_q = 2, H = 3 over a bf16 cache of 4 blocks of 4; request 1 has no context (seq_lens 0,
  // not causal), so its rows are empty.
  Rng rng(3);
  const int64_t B = 2, S = 2, H = 3;
  auto cache = test::to_half_bits(test::random_floats(rng, 16 * kMlaQkDim), DType::bf16);
  auto q = test::to_half_bits(test::random_floats(rng, B * S * H * kMlaQkDim), DType::bf16);
  std::vector<int32_t> table = {2, 0, 3, 1}, seq_lens = {7, 0};
  std::vector<uint16_t> out(B * S * H * kMlaVDim, 0x7fc0), out_plain = out;
  std::vector<float> lse(B * H * S, kNaN), lse_plain(B * S * H, kNaN);
  PagedMlaDecodeArgs a;
  a.q = TensorView(q.data(), {B, S, H, kMlaQkDim}, DType::bf16);
  a.kv_cache = TensorView(cache.data(), {4, 4, kMlaQkDim}, DType::bf16);
  a.block_table = TensorView(table.data(), {B, 2}, DType::i32);
  a.seq_lens = TensorView(seq_lens.data(), {B}, DType::i32);
  a.softmax_scale = 0.1f;
  a.causal = false;
  a.out = TensorView(out_plain.data(), {B, S, H, kMlaVDim}, DType::bf16);
  a.lse = TensorView(lse_plain.data(), {B, S, H}, DType::f32);
  paged_mla_decode(a);
  a.out = TensorView(out.data(), {B, S, H, kMlaVDim}, DType::bf16);
  a.lse = TensorView(lse.data(), {B, S, H}, {H * S, 1, S}, DType::f32);  // FlashMLA's (B, H, s_q), viewed
  a.empty_lse_plus_inf = true;
  paged_mla_decode(a);
  EXPECT_EQ(out, out_plain);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < S; ++j)
      for (int64_t h = 0; h < H; ++h) {
        const float plain = lse_plain[(b * S + j) * H + h], flash = lse[(b * H + h) * S + j];
        if (b == 1) {
          EXPECT_EQ(plain, -kInf);
          EXPECT_EQ(flash, kInf);
        } else {
          ASSERT_TRUE(std::isfinite(plain));
          EXPECT_EQ(flash, plain);
        }
      }
}

// ---------------------------------------------------------------------------
// workspace_size and a caller's workspace

TEST(Workspace, CpuBackendNeedsNone) {
  Sparse s(2, 4, 16, 1);
  EXPECT_EQ(workspace_size(s.args), 0u);
  // A workspace given anyway is accepted (it is big enough) and changes nothing.
  std::vector<uint8_t> bytes(64);
  Sparse with(2, 4, 16, 1);
  with.args.workspace = TensorView(bytes.data(), {64}, DType::u8);
  sparse_mla(with.args);
  sparse_mla(s.args);
  EXPECT_EQ(with.out, s.out);
  // workspace_size checks the args as the op does.
  s.args.q.shape[2] = 100;
  test::expect_error([&] { workspace_size(s.args); }, ErrorKind::invalid_argument, {"sparse_mla: q:"});
}

// The CPU backend, claiming to need `need` bytes of scratch and recording the workspace each op got.
class NeedyBackend final : public Backend {
 public:
  explicit NeedyBackend(size_t need) : cpu_(*Registry::global().find("cpu")), need_(need) {}
  const Capabilities& capabilities() const override { return cpu_.capabilities(); }
  void write_mla_cache(const WriteMlaCacheArgs& a) const override { cpu_.write_mla_cache(a); }
  void sparse_mla(const SparseMlaArgs& a) const override {
    seen.push_back(a.workspace);
    cpu_.sparse_mla(a);
  }
  void paged_mla_decode(const PagedMlaDecodeArgs& a) const override {
    seen.push_back(a.workspace);
    cpu_.paged_mla_decode(a);
  }
  void write_index_cache(const WriteIndexCacheArgs& a) const override { cpu_.write_index_cache(a); }
  void indexer_topk(const IndexerTopkArgs& a) const override {
    seen.push_back(a.workspace);
    cpu_.indexer_topk(a);
  }
  void positions_to_slots(const PositionsToSlotsArgs& a) const override { cpu_.positions_to_slots(a); }
  size_t workspace_size(const SparseMlaArgs&) const override { return need_; }
  size_t workspace_size(const PagedMlaDecodeArgs&) const override { return need_; }
  size_t workspace_size(const IndexerTopkArgs&) const override { return need_ / 2; }
  using Backend::workspace_size;

  mutable std::vector<TensorView> seen;

 private:
  const Backend& cpu_;
  size_t need_;
};

TEST(Workspace, CheckedAndPassedOn) {
  NeedyBackend be(1000);
  Sparse s(2, 4, 16, 2);
  EXPECT_EQ(workspace_size(s.args, &be), 1000u);
  alignas(16) static uint8_t bytes[2048];
  const auto with = [&](TensorView ws) {
    SparseMlaArgs a = s.args;
    a.workspace = ws;
    return a;
  };
  const auto fails = [&](TensorView ws, std::vector<std::string> fragments) {
    test::expect_error([&] { sparse_mla(with(ws), &be); }, ErrorKind::invalid_argument, fragments);
  };
  fails(TensorView(bytes, {999}, DType::u8), {"sparse_mla: workspace: too small", "need 1000 bytes", "got 999"});
  fails(TensorView(bytes, {0}, DType::u8), {"sparse_mla: workspace: too small", "got 0"});
  fails(TensorView(bytes, {1000}, DType::f32), {"sparse_mla: workspace: expected dtype uint8"});
  fails(TensorView(bytes, {10, 100}, DType::u8), {"sparse_mla: workspace: expected 1 dimensions"});
  fails(TensorView(bytes, {1000}, {2}, DType::u8), {"sparse_mla: workspace: the last dimension must be contiguous"});
  fails(TensorView(bytes + 1, {1000}, DType::u8), {"sparse_mla: workspace: must be 16-byte aligned"});
  fails(TensorView(nullptr, {1000}, DType::u8), {"sparse_mla: workspace: is required but has no data"});
  fails(TensorView(bytes, {1000}, DType::u8, Device::cuda(90)), {"sparse_mla: workspace: is on sm_90"});
  EXPECT_TRUE(be.seen.empty()) << "no op ran with a bad workspace";

  sparse_mla(with(TensorView(bytes, {1000}, DType::u8)), &be);
  ASSERT_EQ(be.seen.size(), 1u);
  EXPECT_EQ(be.seen[0].data, bytes);
  // Absent: the backend is left to find its own.
  sparse_mla(s.args, &be);
  ASSERT_EQ(be.seen.size(), 2u);
  EXPECT_FALSE(be.seen[1].defined());
}

TEST(Workspace, FromASourceAfterTheChecksOnlyWhenNeeded) {
  alignas(16) static uint8_t bytes[2048];
  std::vector<size_t> asked;  // the bytes each call of the source was asked for
  TensorView given(bytes, {1000}, DType::u8);
  const auto source = [&](size_t n) {
    asked.push_back(n);
    return given;
  };
  NeedyBackend be(1000);
  Sparse s(2, 4, 16, 2), plain(2, 4, 16, 2);
  sparse_mla(s.args, &be, source);
  ASSERT_EQ(asked, std::vector<size_t>{1000});
  ASSERT_EQ(be.seen.size(), 1u);
  EXPECT_EQ(be.seen[0].data, bytes) << "the op runs on the source's workspace";
  sparse_mla(plain.args, &be);
  EXPECT_EQ(s.out, plain.out);

  // Bad args: refused before the source is asked; an empty batch never asks.
  Sparse bad(2, 4, 16, 2);
  bad.args.q.shape[2] = 100;
  test::expect_error([&] { sparse_mla(bad.args, &be, source); }, ErrorKind::invalid_argument, {"sparse_mla: q:"});
  Sparse empty(0, 4, 16, 2);
  sparse_mla(empty.args, &be, source);
  // A workspace the args carry is used (and checked) as it is; the CPU backend needs none: the source is not asked.
  SparseMlaArgs carried = s.args;
  carried.workspace = TensorView(bytes + 1024, {1000}, DType::u8);
  sparse_mla(carried, &be, source);
  EXPECT_EQ(be.seen.back().data, bytes + 1024);
  carried.workspace = TensorView(bytes, {999}, DType::u8);
  test::expect_error([&] { sparse_mla(carried, &be, source); }, ErrorKind::invalid_argument,
                     {"sparse_mla: workspace: too small"});
  sparse_mla(s.args, nullptr, source);
  EXPECT_EQ(asked.size(), 1u);

  // What the source returns is checked as a caller's workspace.
  const size_t ran = be.seen.size();
  given = TensorView(bytes, {999}, DType::u8);
  test::expect_error([&] { sparse_mla(s.args, &be, source); }, ErrorKind::invalid_argument,
                     {"sparse_mla: workspace: too small", "need 1000 bytes", "got 999"});
  given = TensorView(bytes + 8, {1000}, DType::u8);
  test::expect_error([&] { sparse_mla(s.args, &be, source); }, ErrorKind::invalid_argument,
                     {"sparse_mla: workspace: must be 16-byte aligned"});
  EXPECT_EQ(be.seen.size(), ran) << "no op ran with a bad workspace";
}

TEST(Workspace, DsaDecodeStepSharesOneAmongItsSteps) {
  // A one-token DSA step over an index cache and an MLA cache of 2 blocks of 4 (bf16), top-2.
  Rng rng(9);
  const int64_t T = 1, H = 2, HI = 2, K = 2;
  auto q = test::to_half_bits(test::random_floats(rng, T * H * kMlaQkDim), DType::bf16);
  auto cache = test::to_half_bits(test::random_floats(rng, 8 * kMlaQkDim), DType::bf16);
  auto index_q = test::to_half_bits(test::random_floats(rng, T * HI * kIndexHeadDim), DType::bf16);
  auto index_cache = test::to_half_bits(test::random_floats(rng, 8 * kIndexHeadDim), DType::bf16);
  std::vector<float> weights = test::random_floats(rng, T * HI), lse(T * H, kNaN);
  std::vector<int32_t> request_ids = {0}, table = {1, 0}, context = {6}, topk(T * K, -7), slots(T * K, -7);
  std::vector<uint16_t> out(T * H * kMlaVDim, 0x7fc0);
  DsaDecodeStepArgs a;
  a.indexer.q = TensorView(index_q.data(), {T, HI, kIndexHeadDim}, DType::bf16);
  a.indexer.weights = TensorView(weights.data(), {T, HI}, DType::f32);
  a.indexer.index_cache = TensorView(index_cache.data(), {2, 4, kIndexHeadDim}, DType::bf16);
  a.indexer.request_ids = TensorView(request_ids.data(), {T}, DType::i32);
  a.indexer.block_table = TensorView(table.data(), {1, 2}, DType::i32);
  a.indexer.context_lens = TensorView(context.data(), {T}, DType::i32);
  a.indexer.topk = TensorView(topk.data(), {T, K}, DType::i32);
  a.slots = TensorView(slots.data(), {T, K}, DType::i32);
  a.q = TensorView(q.data(), {T, H, kMlaQkDim}, DType::bf16);
  a.kv_cache = TensorView(cache.data(), {2, 4, kMlaQkDim}, DType::bf16);
  a.softmax_scale = 0.1f;
  a.out = TensorView(out.data(), {T, H, kMlaVDim}, DType::bf16);
  a.lse = TensorView(lse.data(), {T, H}, DType::f32);

  NeedyBackend be(600);
  EXPECT_EQ(workspace_size(a, &be), 600u) << "the largest of the steps' (indexer 300, attention 600)";
  alignas(16) static uint8_t bytes[1024];
  a.workspace = TensorView(bytes, {599}, DType::u8);
  test::expect_error([&] { dsa_decode_step(a, &be); }, ErrorKind::invalid_argument,
                     {"dsa_decode_step: workspace: too small", "need 600 bytes"});
  a.workspace = TensorView(bytes, {600}, DType::u8);
  DsaDecodeStepArgs own_indexer_ws = a;
  own_indexer_ws.indexer.workspace = a.workspace;
  test::expect_error([&] { dsa_decode_step(own_indexer_ws, &be); }, ErrorKind::invalid_argument,
                     {"dsa_decode_step: indexer.workspace"});
  dsa_decode_step(a, &be);
  ASSERT_EQ(be.seen.size(), 2u);  // indexer_topk, then sparse_mla
  EXPECT_EQ(be.seen[0].data, bytes);
  EXPECT_EQ(be.seen[1].data, bytes);
  EXPECT_TRUE(std::isfinite(lse[0]));

  // From a source: asked once, for the largest of the steps' needs, and shared as a caller's is.
  std::vector<size_t> asked;
  a.workspace = TensorView();
  dsa_decode_step(a, &be, [&](size_t n) {
    asked.push_back(n);
    return TensorView(bytes, {1024}, DType::u8);
  });
  EXPECT_EQ(asked, std::vector<size_t>{600});
  ASSERT_EQ(be.seen.size(), 4u);
  EXPECT_EQ(be.seen[2].data, bytes);
  EXPECT_EQ(be.seen[3].data, bytes);
}

}  // namespace
}  // namespace smla
