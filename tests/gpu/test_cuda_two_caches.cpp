// sparse_mla over two caches under one softmax (DeepSeek-V4's window cache and its compressed "extra" cache) on the
// CUDA backend against the CPU backend (itself tested against the float64 reference): head counts, top-k and extra
// top-k, each cache with its own block size, every cache format (DeepSeek-V4's 584-byte fp8_ds_mla_v4 too), invalid
// indices, NaN-poisoned unused slots and block padding, outputs pre-filled with NaN and checked fully written, topk_length and extra_topk_length (0 for
// both: the empty-row convention), sinks, max_logits, forced splits, a caller workspace poisoned with NaN, and a
// CUDA graph captured on a new non-blocking stream.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/kernels.h"
#include "cuda/mla/attention_small_heads.h"
#include "cuda/mla/attention_wide.h"
#include "gpu/gpu_util.h"
#include "smla/error.h"
#include "smla/ops.h"
#include "support/test_util.h"

namespace smla {
namespace {

struct TwoCaches {
  DType q_dtype = DType::bf16;
  DType kv_dtype = DType::bf16;
  int rope = 0;  // 0: DeepSeek-V4's 512-wide head (the value the whole row); 64: 576-wide heads
  int tokens = 4, heads = 8, topk = 128, extra_topk = 64, block_size = 16, extra_block_size = 64;
  bool lengths = true, sink = false, max_logits = true, empty_lse_plus_inf = false;
  bool caller_workspace = false;
  cuda::AttentionChoice choice;  // forced (a kernel or splits): the op's CUDA function is called directly
  int qk() const { return MlaHead{rope}.qk_dim(); }
  bool forced() const { return choice.kernel != cuda::AttentionKernel::automatic || choice.splits != 0; }
  // The kernel the plan must pick: the forced one, else the wgmma kernel where it runs from its heads and rows on, else
  // the small-heads kernel by its automatic rules, else the wide-tile or 16-head-tile one.
  cuda::AttentionKernel expected_kernel() const {
    namespace sh = cuda::mla::small;
    if (choice.kernel != cuda::AttentionKernel::automatic) return choice.kernel;
    if (automatic_wgmma(kv_dtype, rope, false, heads, tokens)) return cuda::AttentionKernel::wgmma;
    const int min_tokens = rope ? sh::kMinTokensAutomatic : sh::kMinTokensAutomaticNoRope;
    const bool sixteen_bit = kv_dtype == DType::bf16 || kv_dtype == DType::f16;
    const bool small =
        (heads <= sh::kMaxHeadsAutomatic &&
         ((kv_dtype == DType::fp8_ds_mla && tokens >= min_tokens) ||
          (kv_dtype == DType::fp8_ds_mla_nope && tokens >= sh::kMinTokensAutomaticNoRope) ||
          (kv_dtype == DType::fp8_ds_mla_v4 && sh::kAutomaticForV4 && tokens >= sh::kMinTokensAutomaticNoRope))) ||
        (sixteen_bit && heads <= sh::kMaxHeadsAutomatic16Bit &&
         tokens >= std::max(min_tokens, sh::kMinTokensAutomatic16Bit) &&
         small_heads_fit(kv_dtype == DType::bf16 ? cuda::mla::CacheFormat::bf16 : cuda::mla::CacheFormat::f16, rope));
    return small ? cuda::AttentionKernel::small_heads : automatic_many_heads_kernel(kv_dtype, rope, false, heads, tokens);
  }
  // Whether the plan reads both caches in one launch (the 16-head tile; the wgmma kernel on bf16, f16 and
  // fp8_ds_mla_v4 caches): its splits are the chunks of both lists together, so one split and no partials where the
  // keys need not split.
  bool one_launch(const cuda::AttentionPlan& plan) const {
    return plan.kernel == cuda::AttentionKernel::head_tile ||
           (plan.kernel == cuda::AttentionKernel::wgmma &&
            (kv_dtype == DType::bf16 || kv_dtype == DType::f16 || kv_dtype == DType::fp8_ds_mla_v4));
  }
  std::string what() const {
    return "q=" + std::string(dtype_name(q_dtype)) + " kv=" + std::string(dtype_name(kv_dtype)) +
           " rope=" + std::to_string(rope) + " T=" + std::to_string(tokens) + " H=" + std::to_string(heads) +
           " K=" + std::to_string(topk) + " K2=" + std::to_string(extra_topk) + " bs=" + std::to_string(block_size) +
           "/" + std::to_string(extra_block_size) + (lengths ? " lengths" : "") + (sink ? " sink" : "") +
           " kernel=" + std::to_string(static_cast<int>(choice.kernel)) + " splits=" + std::to_string(choice.splits);
  }
};

// One cache's host data: rows written through the CPU backend from random latents where the indices use them,
// NaN (0xff bytes) everywhere else, block padding included. Its indices: random valid slots with every kind of
// invalid value mixed in (negative, past the slots, the other cache's slot space); with lengths, the entries past a
// row's length point at the last slot, never written: they must not be read.
struct HostCache {
  std::vector<uint8_t> bytes;
  TensorView view;
  std::vector<int32_t> indices, lengths;
};

HostCache make_cache(test::Rng& rng, const TwoCaches& p, int topk, int block_size, int other_slots) {
  HostCache c;
  const int num_blocks = std::max(4, (2 * topk + block_size - 1) / block_size);
  const int64_t num_slots = static_cast<int64_t>(num_blocks) * block_size;
  c.lengths.resize(p.tokens);
  for (auto& l : c.lengths) l = static_cast<int32_t>(rng() % (topk + 1));
  std::uniform_int_distribution<int64_t> pick(0, num_slots - 2);
  const int32_t invalid[] = {-1, std::numeric_limits<int32_t>::min(), static_cast<int32_t>(num_slots),
                             std::numeric_limits<int32_t>::max(), other_slots + static_cast<int32_t>(num_slots)};
  c.indices.resize(static_cast<size_t>(p.tokens) * topk);
  std::vector<bool> used(num_slots, false);
  for (size_t i = 0; i < c.indices.size(); ++i) {
    if (p.lengths && static_cast<int>(i % topk) >= c.lengths[i / topk]) {
      c.indices[i] = static_cast<int32_t>(num_slots - 1);
    } else if (rng() % 7 == 0) {
      c.indices[i] = invalid[rng() % 5];
    } else {
      c.indices[i] = static_cast<int32_t>(pick(rng));
      used[c.indices[i]] = true;
    }
  }
  const int row = static_cast<int>(MlaHead{p.rope}.cache_row(p.kv_dtype));
  // A padded block stride (elements), 16-byte aligned; fp8_ds_mla_v4's as FlashMLA pads it (its tokens' scale pad
  // bytes stay NaN too).
  const int64_t pad = block_size % 2 == 0 ? 8 * 16 : 0;
  const int64_t block_stride = p.kv_dtype == DType::fp8_ds_mla_v4 ? v4_block_stride(block_size) + pad
                                                                  : static_cast<int64_t>(block_size) * row + pad;
  c.bytes.assign(num_blocks * block_stride * dtype_size(p.kv_dtype), 0xff);
  c.view = TensorView(c.bytes.data(), {num_blocks, block_size, row}, {block_stride, row, 1}, p.kv_dtype);
  std::vector<int64_t> slots;
  for (size_t s = 0; s < used.size(); ++s)
    if (used[s]) slots.push_back(static_cast<int64_t>(s));
  const int64_t n = static_cast<int64_t>(slots.size());
  if (n == 0) return c;
  auto latent = test::to_half_bits(test::random_floats(rng, n * kMlaLatentDim, -2.f, 2.f), DType::bf16);
  auto kpe = test::to_half_bits(test::random_floats(rng, n * kMlaRopeDim, -2.f, 2.f), DType::bf16);
  WriteMlaCacheArgs w;
  w.latent = TensorView(latent.data(), {n, kMlaLatentDim}, DType::bf16);
  if (p.rope) w.k_pe = TensorView(kpe.data(), {n, kMlaRopeDim}, DType::bf16);
  w.slot_mapping = TensorView(slots.data(), {n}, DType::i64);
  w.cache = c.view;
  write_mla_cache(w, &cpu());
  return c;
}

// The host inputs of one problem and the CPU backend's results.
struct Inputs {
  HostCache main, extra;
  std::vector<uint16_t> q;
  std::vector<float> sink;
  SparseMlaArgs args;  // host views
  std::vector<uint16_t> out;
  std::vector<float> lse, max_logits;
};

void make_inputs(const TwoCaches& p, uint64_t seed, Inputs& in) {
  test::Rng rng(seed);
  in.main = make_cache(rng, p, p.topk, p.block_size, 0);
  in.extra = make_cache(rng, p, p.extra_topk, p.extra_block_size,
                        static_cast<int>(in.main.view.shape[0] * in.main.view.shape[1]));
  if (p.tokens > 1) {  // token 1 has nothing valid in either cache: out 0, the empty lse, max_logits -inf
    for (int k = 0; k < p.topk; ++k) in.main.indices[p.topk + k] = -1;
    for (int k = 0; k < p.extra_topk; ++k) in.extra.indices[p.extra_topk + k] = -1;
  }
  if (p.tokens > 3 && p.lengths) {  // the last token's lengths are 0 in both lists: the same
    in.main.lengths[p.tokens - 1] = 0;
    in.extra.lengths[p.tokens - 1] = 0;
  }
  // Queries pre-rounded to the cache's compute type (bf16 for fp8), so both backends see the same function.
  const DType compute = p.kv_dtype == DType::f16 ? DType::f16 : DType::bf16;
  std::vector<float> rounded;
  test::to_half_bits(test::random_floats(rng, static_cast<size_t>(p.tokens) * p.heads * p.qk()), compute, &rounded);
  in.q = test::to_half_bits(rounded, p.q_dtype);
  in.sink = test::random_floats(rng, p.heads, -2.f, 2.f);

  SparseMlaArgs& a = in.args;
  a.q = TensorView(in.q.data(), {p.tokens, p.heads, p.qk()}, p.q_dtype);
  a.kv_cache = in.main.view;
  a.indices = TensorView(in.main.indices.data(), {p.tokens, p.topk}, DType::i32);
  a.extra_kv_cache = in.extra.view;
  a.extra_indices = TensorView(in.extra.indices.data(), {p.tokens, p.extra_topk}, DType::i32);
  if (p.lengths) {
    a.topk_length = TensorView(in.main.lengths.data(), {p.tokens}, DType::i32);
    a.extra_topk_length = TensorView(in.extra.lengths.data(), {p.tokens}, DType::i32);
  }
  if (p.sink) a.attn_sink = TensorView(in.sink.data(), {p.heads}, DType::f32);
  a.softmax_scale = 1.f / std::sqrt(static_cast<float>(p.qk()));
  a.empty_lse_plus_inf = p.empty_lse_plus_inf;
  in.out.assign(static_cast<size_t>(p.tokens) * p.heads * kMlaVDim, 0);
  in.lse.assign(static_cast<size_t>(p.tokens) * p.heads, 0.f);
  in.max_logits.assign(in.lse.size(), 0.f);
  a.out = TensorView(in.out.data(), {p.tokens, p.heads, kMlaVDim}, p.q_dtype);
  a.lse = TensorView(in.lse.data(), {p.tokens, p.heads}, DType::f32);
  if (p.max_logits) a.max_logits = TensorView(in.max_logits.data(), {p.tokens, p.heads}, DType::f32);
  sparse_mla(a, &cpu());
}

// Device copies of one problem's inputs and NaN-filled outputs.
struct OnGpu {
  DeviceBuffer q, cache, extra_cache, indices, extra_indices, lengths, extra_lengths, sink, out, lse, max_logits;
  SparseMlaArgs args;
  explicit OnGpu(const Inputs& in)
      : q(in.q), cache(in.main.bytes), extra_cache(in.extra.bytes), indices(in.main.indices),
        extra_indices(in.extra.indices), lengths(in.main.lengths), extra_lengths(in.extra.lengths), sink(in.sink),
        out(std::vector<uint16_t>(in.out.size(), 0x7fc1)),  // NaN in both 16-bit types
        lse(std::vector<float>(in.lse.size(), std::nanf(""))),
        max_logits(std::vector<float>(in.lse.size(), std::nanf(""))) {
    const SparseMlaArgs& a = in.args;
    args = a;
    args.q = on_gpu(a.q, q.ptr);
    args.kv_cache = on_gpu(a.kv_cache, cache.ptr);
    args.indices = on_gpu(a.indices, indices.ptr);
    args.extra_kv_cache = on_gpu(a.extra_kv_cache, extra_cache.ptr);
    args.extra_indices = on_gpu(a.extra_indices, extra_indices.ptr);
    if (a.topk_length.defined()) args.topk_length = on_gpu(a.topk_length, lengths.ptr);
    if (a.extra_topk_length.defined()) args.extra_topk_length = on_gpu(a.extra_topk_length, extra_lengths.ptr);
    if (a.attn_sink.defined()) args.attn_sink = on_gpu(a.attn_sink, sink.ptr);
    args.out = on_gpu(a.out, out.ptr);
    args.lse = on_gpu(a.lse, lse.ptr);
    if (a.max_logits.defined()) args.max_logits = on_gpu(a.max_logits, max_logits.ptr);
  }
};

std::vector<double> doubles(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// The GPU's outputs against the CPU's: out fully written (no NaN sentinel left) and close, lse and max_logits close
// (their infinities equal).
void expect_matches(const TwoCaches& p, const Inputs& in, const OnGpu& g, const std::string& what) {
  const auto got = g.out.download<uint16_t>();
  std::vector<double> r(got.size()), o(got.size());
  for (size_t i = 0; i < got.size(); ++i) {
    r[i] = test::half_bits_to_float(in.out[i], p.q_dtype);
    o[i] = test::half_bits_to_float(got[i], p.q_dtype);
    ASSERT_FALSE(std::isnan(o[i])) << what << ": out[" << i << "] not written";
  }
  // The CPU backend rounds P to bf16 for P.V (2^-9 of each weight) where the GPU's per-cache splits keep a lone
  // key's P exact: over values in [-2, 2] an output may differ by up to 2^-9 * 4 (seen on the H200: 2.5e-3).
  EXPECT_EQ(test::compare(r, o, 8e-3, 2e-2, 0.9999), "") << what << " (out)";
  EXPECT_EQ(test::compare(doubles(in.lse), doubles(g.lse.download<float>()), 1e-3, 1e-4, 0.9999), "")
      << what << " (lse)";
  if (p.max_logits) {
    EXPECT_EQ(test::compare(doubles(in.max_logits), doubles(g.max_logits.download<float>()), 1e-3, 1e-4, 0.9999),
              "")
        << what << " (max_logits)";
  }
}

// Runs `p` on the GPU against the CPU backend; returns the plan the op made.
cuda::AttentionPlan run_two_caches(const TwoCaches& p, uint64_t seed) {
  const std::string what = p.what();
  SCOPED_TRACE(what);
  Inputs in;
  make_inputs(p, seed, in);
  // The empty rows hold the convention the CPU applies and the other rows attend keys: the comparison below is
  // not vacuous.
  const float empty = p.empty_lse_plus_inf ? INFINITY : -INFINITY;
  for (int h = 0; h < p.heads && p.tokens > 1; ++h) EXPECT_EQ(in.lse[p.heads + h], empty) << what;
  for (int h = 0; h < p.heads && p.tokens > 3 && p.lengths; ++h)
    EXPECT_EQ(in.lse[(p.tokens - 1) * p.heads + h], empty) << what;
  EXPECT_GT(std::count_if(in.lse.begin(), in.lse.end(), [](float l) { return std::isfinite(l); }), 0) << what;
  OnGpu g(in);
  const cuda::AttentionPlan plan = cuda::sparse_mla_plan(g.args, p.choice);
  EXPECT_EQ(plan.kernel, p.expected_kernel()) << what;
  if (!p.one_launch(plan)) EXPECT_GE(plan.num_splits, 2) << what << ": each cache takes at least one split";
  const size_t bytes = workspace_size(g.args, &gpu());  // the automatic plan's
  if (!p.forced() && plan.num_splits > 1) {
    EXPECT_GE(bytes, static_cast<size_t>(plan.num_splits) * p.tokens * p.heads * (kMlaVDim + 2) * sizeof(float))
        << what;
  }
  std::optional<DeviceBuffer> ws;
  if (p.caller_workspace || p.forced()) {
    ws.emplace(std::vector<uint8_t>(bytes + static_cast<size_t>(plan.num_splits) * p.tokens * p.heads *
                                                (kMlaVDim + 2) * sizeof(float),
                                    0xff));  // NaN: every partial read must have been written
    g.args.workspace = TensorView(ws->ptr, {static_cast<int64_t>(ws->bytes)}, DType::u8, Device::cuda(0, 0));
  }
  if (!p.forced()) sparse_mla(g.args, &gpu());
  else cuda::sparse_mla(g.args, p.choice);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  expect_matches(p, in, g, what);
  return plan;
}

TEST(CudaTwoCaches, HeadsAndTopks) {
  uint64_t seed = 1;
  for (int heads : {1, 8, 64, 128})
    for (int topk : {1, 100, 2048})
      for (int extra_topk : {1, 100, 2048}) {
        TwoCaches p;
        p.heads = heads;
        p.topk = topk;
        p.extra_topk = extra_topk;
        p.tokens = heads >= 64 && std::max(topk, extra_topk) == 2048 ? 3 : 6;
        p.caller_workspace = seed % 2 == 0;
        run_two_caches(p, seed++);
      }
}

TEST(CudaTwoCaches, BlockSizesPerCacheAndFormats) {
  uint64_t seed = 100;
  const std::pair<int, int> block_sizes[] = {{1, 64}, {16, 1}, {64, 16}};
  struct Format {
    DType q, kv;
    int rope;
  };
  const Format formats[] = {{DType::bf16, DType::bf16, 0},       {DType::f16, DType::f16, 0},
                            {DType::f16, DType::bf16, 0},        {DType::bf16, DType::f16, 0},
                            {DType::bf16, DType::bf16, kMlaRopeDim}, {DType::bf16, DType::fp8_ds_mla, kMlaRopeDim},
                            {DType::bf16, DType::fp8_ds_mla, 0}, {DType::f16, DType::fp8_ds_mla_nope, 0}};
  for (const Format& f : formats)
    for (auto [bs, extra_bs] : block_sizes) {
      TwoCaches p;
      p.q_dtype = f.q;
      p.kv_dtype = f.kv;
      p.rope = f.rope;
      p.block_size = bs;
      p.extra_block_size = extra_bs;
      p.heads = 20;
      p.topk = 300;
      p.extra_topk = 200;
      run_two_caches(p, seed++);
    }
}

TEST(CudaTwoCaches, LengthsSinksAndEmptyRows) {
  uint64_t seed = 200;
  for (bool plus_inf : {false, true})
    for (bool sink : {false, true}) {
      TwoCaches p;
      p.tokens = 6;
      p.heads = 16;
      p.topk = 512;
      p.extra_topk = 1000;
      p.sink = sink;
      p.empty_lse_plus_inf = plus_inf;
      run_two_caches(p, seed++);
    }
  TwoCaches no_lengths;
  no_lengths.lengths = false;
  no_lengths.sink = true;
  run_two_caches(no_lengths, seed++);
}

// Splits of the 16-head tile's one launch over both lists (forced, and the automatic plan of a decode batch), and
// within each cache where each has its launch (the wide tile forced), merged by the one combine.
TEST(CudaTwoCaches, SplitsWithinEachCache) {
  uint64_t seed = 300;
  for (bool wide : {false, true})
    for (int splits : {1, 3, 64}) {
      TwoCaches p;
      p.tokens = 4;
      p.heads = 16;
      p.topk = 2048;
      p.extra_topk = 640;
      p.sink = true;
      p.choice.splits = splits;
      if (wide) p.choice.kernel = cuda::AttentionKernel::wide_tile;
      if (wide && !cuda::mla::wide::find_wide_config(cuda::mla::CacheFormat::bf16, 0, false)) continue;
      // 2048 keys are 64 chunks of 32, 640 are 20: dealt to at most `splits` splits, both lists' 84 together
      // (rounded up to 64 keys each) or each cache's apart.
      auto splits_of = [&](int chunks) {
        const int per_split = (chunks + std::min(splits, chunks) - 1) / std::min(splits, chunks);
        return (chunks + per_split - 1) / per_split;
      };
      EXPECT_EQ(run_two_caches(p, seed++).num_splits, wide ? splits_of(64) + splits_of(20) : splits_of(84))
          << "forced splits " << splits << (wide ? ", wide tile" : "");
    }
  TwoCaches decode;  // 2 tokens x 1 head group: the automatic plan splits the keys to fill the GPU
  decode.tokens = 2;
  decode.heads = 16;
  decode.topk = 2048;
  decode.extra_topk = 2048;
  decode.caller_workspace = true;
  EXPECT_GT(run_two_caches(decode, seed++).num_splits, 2);
}

// Whether the device's shared memory holds `p`'s forced small-heads shape (16 heads a CTA does not fit the 99 KB
// archs, real or emulated); reported as skipped where not.
bool small_heads_fit(const TwoCaches& p) {
  const cuda::mla::CacheFormat f =
      p.kv_dtype == DType::fp8_ds_mla_v4 ? cuda::mla::CacheFormat::fp8_ds_mla_v4 : cuda::mla::CacheFormat::fp8_ds_mla;
  if (cuda::mla::small::find_small_heads_config(f, p.rope, false, p.heads,
                                                {p.choice.stages, p.choice.heads_per_cta, p.choice.split_dims}))
    return true;
  std::printf("[ skipped  ] %s: beyond the device's shared memory\n", p.what().c_str());
  return false;
}

// The small-heads kernel forced over two fp8_ds_mla caches of 576-wide heads (each cache's launch writes its
// splits' partials for the one combine), with lengths, sinks and max_logits.
TEST(CudaTwoCaches, SmallHeadsKernel) {
  uint64_t seed = 400;
  for (int heads : {8, 16}) {
    TwoCaches p;
    p.kv_dtype = DType::fp8_ds_mla;
    p.rope = kMlaRopeDim;
    p.heads = heads;
    p.tokens = 5;
    p.topk = 300;
    p.extra_topk = 200;
    p.sink = true;
    p.choice.kernel = cuda::AttentionKernel::small_heads;
    if (small_heads_fit(p)) run_two_caches(p, seed++);
  }
}


// The wgmma kernel over two 16-bit caches (one launch reads both lists): forced at 64, 100 (a padded tile) and 128
// heads, both head widths, sinks; and chosen by itself at 32 tokens of 128 heads (the wide rule's rows), where
// Hopper with sm_90a code takes it.
TEST(CudaTwoCaches, WgmmaKernel) {
  if (!cuda::wgmma_kernels_available()) GTEST_SKIP() << "needs a Hopper GPU running the library's sm_90a code";
  uint64_t seed = 450;
  for (DType kv : {DType::bf16, DType::f16})
    for (int heads : {64, 100, 128}) {
      TwoCaches p;
      p.q_dtype = kv;
      p.kv_dtype = kv;
      p.rope = heads == 100 ? 0 : kMlaRopeDim;
      p.heads = heads;
      p.tokens = 3;
      p.topk = 300;
      p.extra_topk = heads == 64 ? 2048 : 100;
      p.sink = heads != 64;
      p.choice.kernel = cuda::AttentionKernel::wgmma;
      run_two_caches(p, seed++);
    }
  TwoCaches automatic;
  automatic.rope = kMlaRopeDim;
  automatic.tokens = 32;
  automatic.heads = 128;
  automatic.topk = 256;
  automatic.extra_topk = 64;
  EXPECT_EQ(run_two_caches(automatic, seed++).kernel, cuda::AttentionKernel::wgmma);
}

// The wgmma kernel's one launch over both lists (the pairs kernel for bf16 and f16, the staged one for
// fp8_ds_mla_v4): top-k and extra top-k of odd chunk counts (64-key chunks) and lengths that cut both lists, so a
// pair of chunks takes its first from the main list and its second from the extra one; each cache its own block
// size (1, 2, 61, 64, 69, 576: rows in one block or many, blocks padded); forced splits that cut the lists anywhere
// (the plan's splits count the chunks of both lists together); and DeepSeek-V4's decode batches of 64 heads, bf16
// and fp8_ds_mla_v4, where the automatic plan takes it.
TEST(CudaTwoCaches, WgmmaKernelReadsBothListsInOneLaunch) {
  if (!cuda::wgmma_kernels_available()) GTEST_SKIP() << "needs a Hopper GPU running the library's sm_90a code";
  uint64_t seed = 470;
  const std::pair<int, int> block_sizes[] = {{1, 576}, {2, 69}, {61, 64}, {64, 61}, {69, 2}, {576, 1}};
  struct Case {
    DType kv;
    int rope, heads, topk, extra_topk;
  };
  const Case cases[] = {{DType::bf16, 0, 64, 100, 300},         {DType::f16, 0, 100, 128, 512},
                        {DType::fp8_ds_mla_v4, 0, 64, 1, 65},   {DType::bf16, kMlaRopeDim, 128, 300, 1},
                        {DType::fp8_ds_mla_v4, 0, 100, 64, 2048}, {DType::f16, kMlaRopeDim, 64, 2048, 100}};
  for (int i = 0; i < 6; ++i)
    for (int splits : {0, 1, 2, 7}) {
      const Case& c = cases[i];
      TwoCaches p;
      p.kv_dtype = c.kv;
      p.q_dtype = c.kv == DType::f16 || (c.kv == DType::fp8_ds_mla_v4 && splits % 2) ? DType::f16 : DType::bf16;
      p.rope = c.rope;
      p.heads = c.heads;
      p.tokens = 5;
      p.topk = c.topk;
      p.extra_topk = c.extra_topk;
      std::tie(p.block_size, p.extra_block_size) = block_sizes[(i + splits) % 6];
      p.sink = splits % 2 == 0;
      p.lengths = i != 4;
      p.choice.kernel = cuda::AttentionKernel::wgmma;
      p.choice.splits = splits;
      const cuda::AttentionPlan plan = run_two_caches(p, seed++);
      // Chunks of both lists dealt to at most `splits` splits.
      const int chunks = (p.topk + 63) / 64 + (p.extra_topk + 63) / 64;
      if (splits > 0) {
        const int per_split = (chunks + std::min(splits, chunks) - 1) / std::min(splits, chunks);
        EXPECT_EQ(plan.num_splits, (chunks + per_split - 1) / per_split) << p.what();
      }
    }
  for (int batch : {74, 130}) {  // V4's window (top-k 128, blocks of 64) and c4 (top-k 512) caches, automatic
    TwoCaches p;
    p.kv_dtype = batch == 74 ? DType::bf16 : DType::fp8_ds_mla_v4;
    p.heads = 64;
    p.topk = 128;
    p.extra_topk = 512;
    p.block_size = p.extra_block_size = 64;
    p.tokens = batch;
    p.sink = true;
    p.caller_workspace = batch == 130;
    EXPECT_EQ(run_two_caches(p, seed++).kernel, cuda::AttentionKernel::wgmma);
  }
}
// A workspace smaller than workspace_size (the partials of every split the plan makes over both caches) is refused.
TEST(CudaTwoCaches, WorkspaceTooSmallIsAnError) {
  TwoCaches p;
  p.tokens = 2;
  p.topk = 2048;
  p.extra_topk = 2048;
  Inputs in;
  make_inputs(p, 500, in);
  OnGpu g(in);
  const size_t need = workspace_size(g.args, &gpu());
  const cuda::AttentionPlan plan = cuda::sparse_mla_plan(g.args);
  ASSERT_GT(plan.num_splits, 1);  // two tokens' 4096 keys split to fill the GPU
  EXPECT_EQ(need, static_cast<size_t>(plan.num_splits) * p.tokens * p.heads * (kMlaVDim + 2) * sizeof(float));
  DeviceBuffer ws(need);
  g.args.workspace = TensorView(ws.ptr, {static_cast<int64_t>(need - 16)}, DType::u8, Device::cuda(0, 0));
  test::expect_error([&] { sparse_mla(g.args, &gpu()); }, ErrorKind::invalid_argument,
                     {"sparse_mla", "workspace", "too small"});
}

// The extra cache is held to the main cache's alignment, and the error names it.
TEST(CudaTwoCaches, MisalignedExtraCacheIsAnError) {
  TwoCaches p;
  Inputs in;
  make_inputs(p, 700, in);
  OnGpu g(in);
  DeviceBuffer shifted(g.extra_cache.bytes + 16);
  g.args.extra_kv_cache.data = static_cast<char*>(shifted.ptr) + 2;
  test::expect_error([&] { sparse_mla(g.args, &gpu()); }, ErrorKind::invalid_argument,
                     {"sparse_mla", "extra_kv_cache", "16-byte aligned"});
  const auto out = g.out.download<uint16_t>();
  for (uint16_t v : out) ASSERT_EQ(v, 0x7fc1);
}

// An extra cache of no blocks (null data, as frameworks hand out empty tensors): every extra index is invalid, the
// result the CPU's on the same call.
TEST(CudaTwoCaches, ExtraCacheOfNoBlocks) {
  TwoCaches p;
  p.sink = true;
  Inputs in;
  make_inputs(p, 800, in);
  const TensorView none(nullptr, {0, p.extra_block_size, MlaHead{p.rope}.cache_row(p.kv_dtype)}, p.kv_dtype);
  in.args.extra_kv_cache = none;
  sparse_mla(in.args, &cpu());
  OnGpu g(in);
  g.args.extra_kv_cache = on_gpu(none, nullptr);
  sparse_mla(g.args, &gpu());
  CUDA_OK(cudaDeviceSynchronize());
  expect_matches(p, in, g, "extra cache of no blocks");
}

// DeepSeek-V4's fp8 cache (fp8_ds_mla_v4) in both caches, against the CPU backend: block sizes 1/2/61/64/69/576
// for each cache (each paired with another), top-k and extra top-k 64/576/2048, lengths that cut both lists (and
// rows with every index invalid, or lengths 0, in both), sinks; NaN in unused slots, the tokens' scale pad bytes and
// FlashMLA's block padding.
TwoCaches v4_caches(int heads, int topk, int extra_topk, int block_size, int extra_block_size) {
  TwoCaches p;
  p.kv_dtype = DType::fp8_ds_mla_v4;
  p.rope = 0;
  p.heads = heads;
  p.topk = topk;
  p.extra_topk = extra_topk;
  p.block_size = block_size;
  p.extra_block_size = extra_block_size;
  return p;
}

TEST(CudaTwoCachesV4, BlockSizesPerCache) {
  uint64_t seed = 1000;
  const std::pair<int, int> block_sizes[] = {{1, 576}, {2, 69}, {61, 64}, {64, 61}, {69, 2}, {576, 1}};
  for (auto [bs, extra_bs] : block_sizes) {
    TwoCaches p = v4_caches(64, 576, 128, bs, extra_bs);
    p.sink = bs % 2 == 1;
    p.q_dtype = bs == 61 ? DType::f16 : DType::bf16;
    run_two_caches(p, seed++);
  }
}

TEST(CudaTwoCachesV4, TopksLengthsAndSinks) {
  uint64_t seed = 1100;
  for (int topk : {64, 576, 2048})
    for (int extra_topk : {64, 576, 2048}) {
      TwoCaches p = v4_caches(64, topk, extra_topk, 64, 2);
      p.tokens = 5;
      p.sink = (topk + extra_topk) % 3 != 0;
      p.caller_workspace = topk == extra_topk;
      run_two_caches(p, seed++);
    }
  TwoCaches no_lengths = v4_caches(128, 128, 512, 64, 64);
  no_lengths.lengths = false;
  no_lengths.sink = true;
  no_lengths.empty_lse_plus_inf = true;
  run_two_caches(no_lengths, seed++);
}

// V4's decode batches: 4, 74 and 321 requests with s_q 1 and 3 (FlashMLA's q (b, s_q, h, 512) is b * s_q tokens
// here; 321 requests with s_q 1 and 16 heads, V4-Flash under TP 4), the window cache (top-k 128, blocks of 64)
// beside the ratio-4 compressed cache (the indexer's top-k 512, blocks of 256 / 4 = 64 entries, as vLLM sizes them)
// or the ratio-128 one (every entry: 1024 at 128K tokens, blocks of 256 / 128 = 2); and forced splits.
TEST(CudaTwoCachesV4, DecodeBatchesAndSplits) {
  uint64_t seed = 1200;
  for (int batch : {4, 74, 321})
    for (int s_q : {1, 3}) {
      if (batch == 321 && s_q == 3) continue;
      const bool c4 = s_q == 1;
      TwoCaches p = v4_caches(batch == 4 ? 128 : batch == 74 ? 64 : 16, 128, c4 ? 512 : 1024, 64, c4 ? 64 : 2);
      p.tokens = batch * s_q;
      p.sink = true;
      run_two_caches(p, seed++);
    }
  for (int splits : {1, 5}) {
    TwoCaches p = v4_caches(16, 2048, 640, 61, 69);
    p.choice.splits = splits;
    run_two_caches(p, seed++);
  }
}

// The small-heads kernel forced over two fp8_ds_mla_v4 caches: 1, 8, 16 and 32 heads (8 or 16 a CTA), block sizes
// 2/61/64 paired per cache, tokens 1/3/62, lengths cutting both lists (0 in both, and every index invalid in both,
// on some rows), sinks, max_logits, pipeline depths, splits forced to 1 a cache and several; NaN in unused slots,
// the scale and pad bytes of unused tokens and the block padding.
TEST(CudaTwoCachesV4, SmallHeadsKernel) {
  uint64_t seed = 1300;
  const std::pair<int, int> block_sizes[] = {{2, 61}, {61, 64}, {64, 2}};
  int i = 0;
  for (int heads : {1, 8, 16, 32})
    for (int tokens : {1, 3, 62}) {
      TwoCaches p = v4_caches(heads, tokens == 62 ? 512 : 2048, tokens == 62 ? 128 : 640, block_sizes[i % 3].first,
                              block_sizes[i % 3].second);
      p.tokens = tokens;
      p.q_dtype = i % 5 == 4 ? DType::f16 : DType::bf16;
      p.sink = i % 3 != 1;
      p.lengths = i % 4 != 3;
      p.empty_lse_plus_inf = i % 6 == 5;
      p.choice = {cuda::AttentionKernel::small_heads, i % 3 == 0 ? 0 : 2 + i % 3, heads <= 8 && i % 2 == 1 ? 16 : 0,
                  0, i % 4 == 1 ? 1 : i % 4 == 2 ? 6 : 0};
      ++i;
      if (!small_heads_fit(p)) continue;
      const cuda::AttentionPlan plan = run_two_caches(p, seed++);
      if (p.choice.splits == 1) EXPECT_EQ(plan.num_splits, 2) << p.what();
      if (p.choice.splits == 6) EXPECT_GT(plan.num_splits, 4) << p.what();
    }
}

// Captured into a CUDA graph on a new non-blocking stream with a caller workspace (both caches `kv`): the replay
// equals an eager call bit for bit, and a replay on new inputs (indices and lengths changed in place) equals the CPU
// on those.
void expect_capture_replays(DType kv) {
  TwoCaches p;
  p.kv_dtype = kv;
  p.tokens = 4;
  p.heads = 64;
  p.topk = 512;
  p.extra_topk = 128;
  p.block_size = 64;
  p.extra_block_size = 2;
  p.sink = true;
  Inputs first;
  make_inputs(p, 600, first);
  // New inputs over the same caches and queries: the main lists cut to half their length, a third of the extra
  // entries invalidated.
  std::vector<int32_t> lengths = first.main.lengths, extra_indices = first.extra.indices;
  for (auto& l : lengths) l /= 2;
  for (size_t i = 0; i < extra_indices.size(); i += 3) extra_indices[i] = -1;
  std::vector<uint16_t> want(first.out.size());
  std::vector<float> want_lse(first.lse.size()), want_max(first.lse.size());
  SparseMlaArgs changed = first.args;
  changed.topk_length.data = lengths.data();
  changed.extra_indices.data = extra_indices.data();
  changed.out.data = want.data();
  changed.lse.data = want_lse.data();
  changed.max_logits.data = want_max.data();
  sparse_mla(changed, &cpu());
  Inputs second = first;  // its vectors hold the changed inputs and the CPU's results on them; its views are unused
  second.main.lengths = lengths;
  second.extra.indices = extra_indices;
  second.out = want;
  second.lse = want_lse;
  second.max_logits = want_max;
  OnGpu g(first);

  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const size_t bytes = workspace_size(g.args, &gpu());
  DeviceBuffer ws(bytes);
  g.args.workspace = TensorView(ws.ptr, {static_cast<int64_t>(bytes)}, DType::u8, Device::cuda(0, 0));
  g.args.stream = stream;
  sparse_mla(g.args, &gpu());  // eager
  CUDA_OK(cudaStreamSynchronize(stream));
  const auto eager = g.out.download<uint16_t>();
  const auto eager_lse = g.lse.download<float>();
  expect_matches(p, first, g, "eager");

  const CapturedGraph graph(stream, cudaStreamCaptureModeGlobal, [&] { sparse_mla(g.args, &gpu()); });
  ASSERT_NE(graph.exec(), nullptr);
  CUDA_OK(cudaMemset(g.out.ptr, 0xff, g.out.bytes));
  CUDA_OK(cudaMemset(g.lse.ptr, 0xff, g.lse.bytes));
  CUDA_OK(cudaGraphLaunch(graph.exec(), stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  EXPECT_EQ(g.out.download<uint16_t>(), eager);
  const auto replay_lse = g.lse.download<float>();
  for (size_t i = 0; i < eager_lse.size(); ++i)  // bit for bit, infinities included
    EXPECT_EQ(std::memcmp(&replay_lse[i], &eager_lse[i], sizeof(float)), 0) << "lse[" << i << "]";

  CUDA_OK(cudaMemcpy(g.lengths.ptr, lengths.data(), g.lengths.bytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(g.extra_indices.ptr, extra_indices.data(), g.extra_indices.bytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(g.out.ptr, 0xff, g.out.bytes));
  CUDA_OK(cudaGraphLaunch(graph.exec(), stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  EXPECT_NE(g.out.download<uint16_t>(), eager);
  expect_matches(p, second, g, "replay on new indices");

  CUDA_OK(cudaStreamDestroy(stream));
}

TEST(CudaTwoCaches, CapturedOnANewNonBlockingStream) { expect_capture_replays(DType::bf16); }
TEST(CudaTwoCachesV4, CapturedOnANewNonBlockingStream) { expect_capture_replays(DType::fp8_ds_mla_v4); }

}  // namespace
}  // namespace smla
