// The CUDA attention ops against the CPU backend (itself tested against the
// float64 reference): every dtype and cache format, head counts, top-k, block
// sizes, padded strides, invalid indices, NaN-poisoned unused slots, outputs
// pre-filled with NaN and checked fully written, topk_length and sinks; heads
// of 576 (rope 64) and of 512 (no rope part: the fp8_ds_mla envelope's rope
// bytes NaN, never read), DeepSeek-V4's 584-byte fp8_ds_mla_v4 cache among them.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <vector>

#include "core/numeric.h"
#include "cuda/common/runtime.h"
#include "cuda/kernels.h"
#include "cuda/mla/attention_small_heads.h"
#include "cuda/mla/attention_wide.h"
#include "cuda/mla/kernel_choice.h"
#include "smla/error.h"
#include "smla/select.h"
#include "gpu/gpu_util.h"
#include "support/test_util.h"

namespace smla {
namespace {

struct Problem {
  DType q_dtype = DType::bf16;
  DType kv_dtype = DType::bf16;
  int tokens = 3, heads = 16, topk = 128, block_size = 16, num_blocks = 0, block_pad = 0;
  bool topk_length = false, sink = false, q_padded = false;
  bool out_padded = false;  // out's rows 4 elements apart more than 512: 8-byte aligned, not 16
  bool max_logits = false, empty_lse_plus_inf = false;
  // Whole runs of keys invalid, so that whole splits are empty: token 0's first half, the last token's second half
  // (from 3 tokens; token 1 has no valid key at all).
  bool empty_halves = false;
  // > 0: head h's query times 2^(head_scale_step (h % 4 - 2)), so the heads' magnitudes differ widely.
  int head_scale_step = 0;
  int rope = kMlaRopeDim;  // 0: 512-wide heads (GLM-5.3-Flash, DeepSeek-V4)
  // > 0: the CPU reference (and the comparison) for the first and last that many tokens only: a long prefill, whose
  // every row would keep the CPU busy for minutes.
  int reference_tokens = 0;
  cuda::AttentionChoice kernel;  // forced: the op's CUDA function is called directly
  bool skip_beyond_device = true;  // a forced shape the device's shared memory cannot hold: skipped, not an error
  int qk() const { return MlaHead{rope}.qk_dim(); }
};

int row_elems(DType kv, int rope) { return static_cast<int>(MlaHead{rope}.cache_row(kv)); }

std::string nope_tag(const Problem& p) { return p.rope ? "" : " no-rope"; }

// A paged cache: written through the CPU backend from random latents where
// `used`, NaN (0xff bytes) everywhere else, including the block padding (an
// fp8_ds_mla_v4 block's: FlashMLA's, then block_pad more bytes).
std::vector<uint8_t> make_cache(test::Rng& rng, const Problem& pr, const std::vector<bool>& used, TensorView& view) {
  const int row = row_elems(pr.kv_dtype, pr.rope);
  const int64_t esz = dtype_size(pr.kv_dtype);
  const int64_t block_stride = (pr.kv_dtype == DType::fp8_ds_mla_v4 ? v4_block_stride(pr.block_size)
                                                                     : static_cast<int64_t>(pr.block_size) * row) +
                               pr.block_pad;
  std::vector<uint8_t> cache(pr.num_blocks * block_stride * esz, 0xff);
  view = TensorView(cache.data(), {pr.num_blocks, pr.block_size, row}, {block_stride, row, 1}, pr.kv_dtype);
  std::vector<int64_t> slots;
  for (size_t s = 0; s < used.size(); ++s)
    if (used[s]) slots.push_back(static_cast<int64_t>(s));
  const int64_t n = static_cast<int64_t>(slots.size());
  auto latent = test::to_half_bits(test::random_floats(rng, n * kMlaLatentDim, -2.f, 2.f), DType::bf16);
  auto kpe = test::to_half_bits(test::random_floats(rng, n * kMlaRopeDim, -2.f, 2.f), DType::bf16);
  WriteMlaCacheArgs w;
  w.latent = TensorView(latent.data(), {n, kMlaLatentDim}, DType::bf16);
  if (pr.rope) w.k_pe = TensorView(kpe.data(), {n, kMlaRopeDim}, DType::bf16);  // none: the rope part stays NaN
  w.slot_mapping = TensorView(slots.data(), {n}, DType::i64);
  w.cache = view;
  write_mla_cache(w, &cpu());
  return cache;
}

// Queries as the kernel sees them: it computes in the cache's 16-bit type
// (bf16 for fp8_ds_mla) and rounds queries of the other type to it, as
// docs/ops.md says. Pre-rounding makes that conversion exact, so the CPU and
// GPU results are compared on the same function.
std::vector<uint16_t> queries(test::Rng& rng, size_t n, DType q_dtype, DType kv_dtype) {
  const DType compute = kv_dtype == DType::f16 ? DType::f16 : DType::bf16;
  std::vector<float> rounded;
  test::to_half_bits(test::random_floats(rng, n, -1.f, 1.f), compute, &rounded);
  return test::to_half_bits(rounded, q_dtype);
}

std::vector<double> as_doubles(const std::vector<uint16_t>& bits, DType d) {
  std::vector<double> v(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) v[i] = test::half_bits_to_float(bits[i], d);
  return v;
}

void expect_close(const std::vector<uint16_t>& ref, const std::vector<uint16_t>& got, DType d,
                  const std::vector<float>& ref_lse, const std::vector<float>& got_lse, const std::string& what,
                  double abs_tol = 2e-3) {
  const auto r = as_doubles(ref, d), g = as_doubles(got, d);
  for (size_t i = 0; i < g.size(); ++i) ASSERT_FALSE(std::isnan(g[i])) << what << ": out[" << i << "] not written";
  EXPECT_EQ(test::compare(r, g, abs_tol, 2e-2, 0.9999), "") << what;
  std::vector<double> rl(ref_lse.begin(), ref_lse.end()), gl(got_lse.begin(), got_lse.end());
  EXPECT_EQ(test::compare(rl, gl, 1e-3, 1e-4, 0.9999), "") << what << " (lse)";
}

// Whether `e` is the op's refusal of a forced kernel shape the device's shared memory cannot hold ("needs N bytes
// of shared memory per block; this device allows M"), with N > M and M the device's limit: the shapes the 99 KB
// archs (SM86, SM89, SM120, real or emulated) cannot run are skipped there, and the refusal itself is checked.
bool beyond_shared_memory(const Error& e) {
  const std::string what = e.what();
  const size_t needs = what.find(" needs "), allows = what.find("this device allows ");
  if (e.kind() != ErrorKind::unsupported || needs == std::string::npos || allows == std::string::npos) return false;
  const long need = std::stol(what.substr(needs + 7)), allow = std::stol(what.substr(allows + 19));
  EXPECT_GT(need, allow) << what;
  EXPECT_EQ(allow, cuda::current_device().max_smem_per_block) << what;
  return true;
}

// The plan the CUDA op makes for `a` with `choice` (`plan_of`: cuda::sparse_mla_plan or paged_mla_decode_plan), or
// nullopt where `skip` and the forced choice is beyond the device's shared memory (reported as skipped).
template <class Args, class PlanOf>
std::optional<cuda::AttentionPlan> plan_or_skip(const Args& a, cuda::AttentionChoice choice, bool skip,
                                                const std::string& what, PlanOf plan_of) {
  try {
    return plan_of(a, choice);
  } catch (const Error& e) {
    if (!skip || !beyond_shared_memory(e)) throw;
    std::printf("[ skipped  ] %s: %s\n", what.c_str(), e.what());
    return std::nullopt;
  }
}

// Rows [t0, t1) of a view whose first dimension is the token (undefined views stay so).
TensorView token_rows(TensorView v, int64_t t0, int64_t t1) {
  if (!v.defined()) return v;
  v.data = static_cast<char*>(v.data) + t0 * v.strides[0] * static_cast<int64_t>(dtype_size(v.dtype));
  v.shape[0] = t1 - t0;
  return v;
}

// The tokens [begin, end) the CPU reference computes for `p`: all of them, or the first and last
// p.reference_tokens.
std::vector<std::pair<int64_t, int64_t>> reference_ranges(const Problem& p) {
  if (p.reference_tokens <= 0 || 2 * p.reference_tokens >= p.tokens) return {{0, p.tokens}};
  return {{0, p.reference_tokens}, {p.tokens - p.reference_tokens, p.tokens}};
}

// The entries of `v` (`per_token` a token) of the tokens in `ranges`.
template <class T>
std::vector<T> token_entries(const std::vector<T>& v, int64_t per_token,
                             const std::vector<std::pair<int64_t, int64_t>>& ranges) {
  std::vector<T> kept;
  for (auto [t0, t1] : ranges) kept.insert(kept.end(), v.begin() + t0 * per_token, v.begin() + t1 * per_token);
  return kept;
}

// Runs `pr` on the GPU (through the registry, or the op's CUDA function where the choice is forced) against the CPU
// backend; the plan the op made (nullopt: skipped), and the GPU's output in `gpu_out` when given (every token's).
std::optional<cuda::AttentionPlan> run_sparse(const Problem& pr, uint64_t seed,
                                              std::vector<uint16_t>* gpu_out = nullptr) {
  const std::string what = std::string("sparse q=") + std::string(dtype_name(pr.q_dtype)) + " kv=" +
                           std::string(dtype_name(pr.kv_dtype)) + " H=" + std::to_string(pr.heads) +
                           " K=" + std::to_string(pr.topk) + " bs=" + std::to_string(pr.block_size) + nope_tag(pr) +
                           " kernel=" + std::to_string(static_cast<int>(pr.kernel.kernel)) +
                           " stages=" + std::to_string(pr.kernel.stages);
  SCOPED_TRACE(what);
  test::Rng rng(seed);
  Problem p = pr;
  if (p.num_blocks == 0) p.num_blocks = std::max(4, (p.topk * 2 + p.block_size - 1) / p.block_size);
  const int64_t num_slots = static_cast<int64_t>(p.num_blocks) * p.block_size;

  // Indices: random valid slots with every kind of invalid value mixed in. With topk_length, the entries past a
  // row's length point at the last slot, which is never written (NaN): they must not be read.
  std::vector<int32_t> lens(p.tokens);
  for (auto& l : lens) l = static_cast<int32_t>(rng() % (p.topk + 1));
  std::uniform_int_distribution<int64_t> pick(0, num_slots - 2);
  const int32_t invalid[] = {-1, std::numeric_limits<int32_t>::min(), static_cast<int32_t>(num_slots),
                             std::numeric_limits<int32_t>::max()};
  std::vector<int32_t> idx(static_cast<size_t>(p.tokens) * p.topk);
  std::vector<bool> used(num_slots, false);
  for (size_t i = 0; i < idx.size(); ++i) {
    if (p.topk_length && static_cast<int>(i % p.topk) >= lens[i / p.topk]) {
      idx[i] = static_cast<int32_t>(num_slots - 1);
    } else if (rng() % 7 == 0) {
      idx[i] = invalid[rng() % 4];
    } else {
      idx[i] = static_cast<int32_t>(pick(rng));
      used[idx[i]] = true;
    }
  }
  if (p.tokens > 1)  // one row with nothing valid: out 0, lse -inf
    for (int k = 0; k < p.topk; ++k) idx[p.topk + k] = -1;
  if (p.empty_halves) {
    std::fill(idx.begin(), idx.begin() + p.topk / 2, -1);
    if (p.tokens > 2) std::fill(idx.end() - (p.topk - p.topk / 2), idx.end(), -1);
  }
  TensorView cache_view;
  auto cache = make_cache(rng, p, used, cache_view);

  const int64_t q_row = p.q_padded ? p.qk() + 64 : p.qk();
  auto qbits = queries(rng, p.tokens * p.heads * q_row, p.q_dtype, p.kv_dtype);
  if (p.head_scale_step > 0) {  // powers of two: the values stay exact (f16 ones may round, the same for both)
    std::vector<float> scaled(qbits.size());
    for (size_t i = 0; i < qbits.size(); ++i)
      scaled[i] = std::ldexp(test::half_bits_to_float(qbits[i], p.q_dtype),
                             p.head_scale_step * (static_cast<int>(i / q_row % p.heads) % 4 - 2));
    qbits = test::to_half_bits(scaled, p.q_dtype);
  }
  std::vector<float> sink = test::random_floats(rng, p.heads, -2.f, 2.f);

  SparseMlaArgs a;
  a.q = TensorView(qbits.data(), {p.tokens, p.heads, p.qk()}, {p.heads * q_row, q_row, 1}, p.q_dtype);
  a.kv_cache = cache_view;
  a.indices = TensorView(idx.data(), {p.tokens, p.topk}, DType::i32);
  if (p.topk_length) a.topk_length = TensorView(lens.data(), {p.tokens}, DType::i32);
  if (p.sink) a.attn_sink = TensorView(sink.data(), {p.heads}, DType::f32);
  a.softmax_scale = 0.0625f;
  const int64_t out_row = p.out_padded ? kMlaVDim + 4 : kMlaVDim;
  std::vector<uint16_t> ref(p.tokens * p.heads * out_row, 0x7fc1);  // NaN sentinel in both 16-bit types
  std::vector<float> ref_lse(p.tokens * p.heads);
  a.out = TensorView(ref.data(), {p.tokens, p.heads, kMlaVDim}, {p.heads * out_row, out_row, 1}, p.q_dtype);
  a.lse = TensorView(ref_lse.data(), {p.tokens, p.heads}, DType::f32);
  std::vector<float> ref_max(p.tokens * p.heads);
  if (p.max_logits) a.max_logits = TensorView(ref_max.data(), {p.tokens, p.heads}, DType::f32);
  a.empty_lse_plus_inf = p.empty_lse_plus_inf;
  const std::optional<cuda::AttentionPlan> plan =
      plan_or_skip(a, p.kernel, p.skip_beyond_device && p.kernel.kernel != cuda::AttentionKernel::automatic, what,
                   [](const SparseMlaArgs& x, cuda::AttentionChoice c) { return cuda::sparse_mla_plan(x, c); });
  if (!plan) return plan;
  const std::vector<std::pair<int64_t, int64_t>> checked = reference_ranges(p);
  for (auto [t0, t1] : checked) {  // the rows not computed are not compared
    SparseMlaArgs part = a;
    for (TensorView* v : {&part.q, &part.indices, &part.topk_length, &part.out, &part.lse, &part.max_logits})
      *v = token_rows(*v, t0, t1);
    sparse_mla(part, &cpu());
  }

  DeviceBuffer dq(qbits), dcache(cache), didx(idx), dlens(lens), dsink(sink);
  DeviceBuffer dmax(std::vector<float>(ref_max.size(), std::nanf("")));
  DeviceBuffer dout(std::vector<uint16_t>(ref.size(), 0x7fc1));  // NaN sentinel in both 16-bit types
  DeviceBuffer dlse(std::vector<float>(ref_lse.size(), std::nanf("")));
  SparseMlaArgs g = a;
  g.q = on_gpu(a.q, dq.ptr);
  g.kv_cache = on_gpu(a.kv_cache, dcache.ptr);
  g.indices = on_gpu(a.indices, didx.ptr);
  if (p.topk_length) g.topk_length = on_gpu(a.topk_length, dlens.ptr);
  if (p.sink) g.attn_sink = on_gpu(a.attn_sink, dsink.ptr);
  g.out = on_gpu(a.out, dout.ptr);
  g.lse = on_gpu(a.lse, dlse.ptr);
  if (p.max_logits) g.max_logits = on_gpu(a.max_logits, dmax.ptr);
  if (p.kernel.kernel == cuda::AttentionKernel::automatic && p.kernel.splits == 0) sparse_mla(g, &gpu());
  else cuda::sparse_mla(g, p.kernel);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint16_t> got = dout.download<uint16_t>();
  if (p.out_padded) {  // the padding untouched; the rows compared without it
    std::vector<uint16_t> ref_rows, got_rows;
    for (size_t i = 0; i < got.size(); ++i) {
      if (static_cast<int64_t>(i) % out_row < kMlaVDim) {
        ref_rows.push_back(ref[i]);
        got_rows.push_back(got[i]);
      } else if (got[i] != 0x7fc1) {
        ADD_FAILURE() << what << ": out's padding at " << i << " written";
        return plan;
      }
    }
    ref = std::move(ref_rows);
    got = std::move(got_rows);
  }
  if (gpu_out) *gpu_out = got;
  const std::vector<float> got_lse = dlse.download<float>();
  if (checked.size() > 1) {  // every row written, those the CPU did not compute too
    EXPECT_EQ(std::count_if(got.begin(), got.end(),
                            [&](uint16_t b) { return std::isnan(test::half_bits_to_float(b, p.q_dtype)); }),
              0)
        << what << ": out entries not written";
    EXPECT_EQ(std::count_if(got_lse.begin(), got_lse.end(), [](float v) { return std::isnan(v); }), 0)
        << what << ": lse entries not written";
  }
  const int64_t per_token = static_cast<int64_t>(got.size()) / p.tokens;  // out's entries of a token (no padding)
  expect_close(token_entries(ref, per_token, checked), token_entries(got, per_token, checked), p.q_dtype,
               token_entries(ref_lse, p.heads, checked), token_entries(got_lse, p.heads, checked), what);
  if (p.max_logits) {
    const auto ref_kept = token_entries(ref_max, p.heads, checked),
               got_kept = token_entries(dmax.download<float>(), p.heads, checked);
    std::vector<double> r(ref_kept.begin(), ref_kept.end()), gm(got_kept.begin(), got_kept.end());
    EXPECT_EQ(test::compare(r, gm, 1e-3, 1e-4, 0.9999), "") << what << " (max_logits)";
  }
  return plan;
}

// A prefill of 4096 query tokens at 64 and 128 heads over a 32K context, both cache formats (issue 19): the
// automatic kernel (on Hopper with sm_90a code the wgmma kernel) over many waves of CTAs, its first and last 32
// tokens against the CPU backend.
TEST(CudaSparseMla, PrefillOf4096Tokens) {
  uint64_t seed = 4096;
  for (DType kv : {DType::bf16, DType::fp8_ds_mla})
    for (int heads : {64, 128}) {
      Problem p;
      p.kv_dtype = kv;
      p.heads = heads;
      p.topk = 2048;
      p.tokens = 4096;
      p.block_size = 64;
      p.num_blocks = 32768 / p.block_size;
      p.reference_tokens = 32;
      p.sink = heads == 64;
      run_sparse(p, seed++);
    }
}

TEST(CudaSparseMla, HeadsAndTopk) {
  uint64_t seed = 1;
  for (int heads : {1, 8, 16, 20, 32, 64, 128})
    for (int topk : {1, 100, 2048}) {
      Problem p;
      p.heads = heads;
      p.topk = topk;
      p.tokens = heads >= 64 ? 2 : 3;
      run_sparse(p, seed++);
    }
  Problem big;
  big.topk = 4096;
  big.heads = 8;
  run_sparse(big, seed++);
}

TEST(CudaSparseMla, DtypesFormatsBlockSizes) {
  uint64_t seed = 100;
  for (DType q : {DType::bf16, DType::f16})
    for (DType kv : {DType::bf16, DType::f16, DType::fp8_ds_mla})
      for (int bs : {1, 16, 64}) {
        Problem p;
        p.q_dtype = q;
        p.kv_dtype = kv;
        p.block_size = bs;
        p.heads = 20;
        p.topk = 300;
        p.block_pad = bs == 16 ? 8 * 16 : 0;  // padded block stride (in elements), keeps 16-byte alignment
        run_sparse(p, seed++);
      }
}

TEST(CudaSparseMla, TopkLengthSinksAndStridedQ) {
  uint64_t seed = 200;
  for (DType kv : {DType::bf16, DType::fp8_ds_mla}) {
    Problem p;
    p.kv_dtype = kv;
    p.heads = 8;
    p.topk = 1000;
    p.tokens = 5;
    p.topk_length = true;
    p.sink = true;
    p.q_padded = true;
    run_sparse(p, seed++);
  }
}

// The split's partial results and their combine, against the CPU and against the same problem forced unsplit: the
// op must split this shape.
void expect_splits_run(Problem p, uint64_t seed) {
  std::vector<uint16_t> split_out, unsplit_out;
  const std::optional<cuda::AttentionPlan> split = run_sparse(p, seed, &split_out);
  if (!split) return;  // a forced shape beyond the device's shared memory (checked and reported)
  EXPECT_GT(split->num_splits, 1) << "the op ran this shape unsplit: the test would not reach the combine";
  p.kernel.splits = 1;
  const std::optional<cuda::AttentionPlan> unsplit = run_sparse(p, seed, &unsplit_out);
  ASSERT_TRUE(unsplit.has_value());
  EXPECT_EQ(unsplit->num_splits, 1);
  EXPECT_EQ(unsplit->kernel, split->kernel);
  EXPECT_EQ(test::compare(as_doubles(unsplit_out, p.q_dtype), as_doubles(split_out, p.q_dtype), 2e-3, 2e-2, 0.9999),
            "")
      << "split against unsplit";
}

TEST(CudaSparseMla, DecodeBatchUsesSplits) {
  // 64 tokens x 8 heads x top-k 2048: the GLM-5 TP8 decode shape.
  Problem p;
  p.tokens = 64;
  p.heads = 8;
  p.topk = 2048;
  p.block_size = 64;
  expect_splits_run(p, 300);
}

// The combine for every forced split count from 1 to one split per 32-key chunk, with sinks and max_logits, whole
// splits empty (empty_halves) and a row with no valid key: 1, 3 and 9 tokens of 8 heads spread each row's columns
// over 2-8 CTAs on a 132-SM H200 (combine_column_blocks: 9 tokens over 2 for up to 16 splits, 4 for 31, 8 for 64),
// 64 tokens of 16 heads over one (four batches of splits a thread).
TEST(CudaSparseMla, CombineOfForcedSplits) {
  uint64_t seed = 1300;
  for (DType kv : {DType::bf16, DType::fp8_ds_mla})
    for (int tokens : {1, 3, 9})
      for (int splits : {1, 2, 3, 31, 64}) {
        Problem p;
        p.kv_dtype = kv;
        p.tokens = tokens;
        p.heads = 8;
        p.topk = splits == 31 ? 1970 : 2048;  // 62 chunks: 31 splits of 2 (of 64 chunks, 31 would give 22 of 3)
        p.block_size = 64;
        p.sink = true;
        p.max_logits = true;
        p.empty_halves = true;
        p.kernel = {cuda::AttentionKernel::head_tile, 0, 0, 0, splits};
        SCOPED_TRACE("splits " + std::to_string(splits) + " tokens " + std::to_string(tokens));
        const std::optional<cuda::AttentionPlan> plan = run_sparse(p, seed++);
        ASSERT_TRUE(plan.has_value());
        EXPECT_EQ(plan->num_splits, splits);
      }
  Problem many;
  many.tokens = 64;
  many.heads = 16;
  many.topk = 1970;
  many.block_size = 16;
  many.sink = true;
  many.max_logits = true;
  many.empty_halves = true;
  many.kernel = {cuda::AttentionKernel::head_tile, 0, 0, 0, 31};
  expect_splits_run(many, seed++);
}

// One 32-key chunk per split (the most splits a row's keys can take), for one and three tokens, both cache
// formats, 8 and 16 heads; the small-heads kernel's 64-key chunks likewise.
TEST(CudaSparseMla, OneChunkSplits) {
  uint64_t seed = 1400;
  for (DType kv : {DType::bf16, DType::fp8_ds_mla})
    for (int heads : {8, 16})
      for (int tokens : {1, 3})
        for (int topk : {100, 2048}) {
          Problem p;
          p.kv_dtype = kv;
          p.tokens = tokens;
          p.heads = heads;
          p.topk = topk;
          p.block_size = 64;
          p.sink = tokens == 3;
          p.max_logits = true;
          p.kernel = {cuda::AttentionKernel::head_tile, 0, 0, 0, 64};
          const std::optional<cuda::AttentionPlan> plan = run_sparse(p, seed++);
          ASSERT_TRUE(plan.has_value());
          EXPECT_EQ(plan->num_splits, (topk + 31) / 32) << "one split per chunk";
          if (kv != DType::fp8_ds_mla) continue;
          p.kernel = {cuda::AttentionKernel::small_heads, 0, 0, 0, 64};
          const std::optional<cuda::AttentionPlan> small = run_sparse(p, seed++);
          if (small) EXPECT_EQ(small->num_splits, (topk + 63) / 64) << "one split per 64-key chunk";
        }
}

// `worst`, if given: the largest |out - the CPU backend's out|.
void run_paged(DType q_dtype, DType kv, int batch, int s_q, int heads, int block_size, bool causal, uint64_t seed,
               int rope = kMlaRopeDim, cuda::AttentionChoice kernel = {}, double abs_tol = 2e-3,
               double* worst = nullptr) {
  SCOPED_TRACE("paged kv=" + std::string(dtype_name(kv)) + " B=" + std::to_string(batch) + " s_q=" +
               std::to_string(s_q) + " H=" + std::to_string(heads) + " bs=" + std::to_string(block_size) +
               " rope=" + std::to_string(rope) + " kernel=" + std::to_string(static_cast<int>(kernel.kernel)) +
               " stages=" + std::to_string(kernel.stages));
  test::Rng rng(seed);
  const int max_blocks = (700 + block_size - 1) / block_size;
  Problem p;
  p.rope = rope;
  p.kv_dtype = kv;
  p.block_size = block_size;
  p.num_blocks = batch * max_blocks + 3;
  std::vector<int32_t> seq(batch), table(batch * max_blocks);
  std::vector<int32_t> perm(p.num_blocks);
  for (int i = 0; i < p.num_blocks; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  for (int i = 0; i < batch * max_blocks; ++i) table[i] = perm[i];
  std::vector<bool> used(static_cast<size_t>(p.num_blocks) * block_size, false);
  for (int b = 0; b < batch; ++b) {
    seq[b] = static_cast<int32_t>(s_q + rng() % (max_blocks * block_size - s_q + 1));
    for (int pos = 0; pos < seq[b]; ++pos) used[table[b * max_blocks + pos / block_size] * block_size + pos % block_size] = true;
  }
  TensorView cache_view;
  auto cache = make_cache(rng, p, used, cache_view);
  auto qbits = queries(rng, batch * s_q * heads * p.qk(), q_dtype, kv);

  PagedMlaDecodeArgs a;
  a.q = TensorView(qbits.data(), {batch, s_q, heads, p.qk()}, q_dtype);
  a.kv_cache = cache_view;
  a.block_table = TensorView(table.data(), {batch, max_blocks}, DType::i32);
  a.seq_lens = TensorView(seq.data(), {batch}, DType::i32);
  a.softmax_scale = 0.1352f;
  a.causal = causal;
  std::vector<uint16_t> ref(batch * s_q * heads * kMlaVDim);
  std::vector<float> ref_lse(batch * s_q * heads);
  a.out = TensorView(ref.data(), {batch, s_q, heads, kMlaVDim}, q_dtype);
  a.lse = TensorView(ref_lse.data(), {batch, s_q, heads}, DType::f32);
  if (!plan_or_skip(a, kernel, kernel.kernel != cuda::AttentionKernel::automatic, "paged",
                    [](const PagedMlaDecodeArgs& x, cuda::AttentionChoice c) { return cuda::paged_mla_decode_plan(x, c); }))
    return;
  paged_mla_decode(a, &cpu());

  DeviceBuffer dq(qbits), dcache(cache), dtable(table), dseq(seq);
  DeviceBuffer dout(std::vector<uint16_t>(ref.size(), 0x7fc1));
  DeviceBuffer dlse(std::vector<float>(ref_lse.size(), std::nanf("")));
  PagedMlaDecodeArgs g = a;
  g.q = on_gpu(a.q, dq.ptr);
  g.kv_cache = on_gpu(a.kv_cache, dcache.ptr);
  g.block_table = on_gpu(a.block_table, dtable.ptr);
  g.seq_lens = on_gpu(a.seq_lens, dseq.ptr);
  g.out = on_gpu(a.out, dout.ptr);
  g.lse = on_gpu(a.lse, dlse.ptr);
  if (kernel.kernel == cuda::AttentionKernel::automatic) paged_mla_decode(g, &gpu());
  else cuda::paged_mla_decode(g, kernel);
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint16_t> got = dout.download<uint16_t>();
  expect_close(ref, got, q_dtype, ref_lse, dlse.download<float>(), "paged", abs_tol);
  if (!worst) return;
  const auto want = as_doubles(ref, q_dtype), have = as_doubles(got, q_dtype);
  *worst = 0;
  for (size_t i = 0; i < have.size(); ++i) *worst = std::max(*worst, std::fabs(have[i] - want[i]));
}

TEST(CudaPagedDecode, MatchesCpu) {
  uint64_t seed = 400;
  for (DType kv : {DType::bf16, DType::f16, DType::fp8_ds_mla})
    for (int bs : {1, 16, 64}) run_paged(DType::bf16, kv, 3, 2, 16, bs, true, seed++);
  run_paged(DType::f16, DType::bf16, 4, 1, 128, 64, true, seed++);
  run_paged(DType::bf16, DType::bf16, 2, 4, 8, 16, false, seed++);
}

// Launch configurations of one kernel made in any order: a deep pipeline forced, then the one it picks (shallower),
// then the deep one again must still launch (the kernel's shared-memory opt-in covers every depth). First of its
// suite, so it meets the kernel before the other tests configure it.
TEST(CudaSparseMlaSmallHeads, DepthsInAnyOrder) {
  uint64_t seed = 550;
  for (int stages : {4, 0, 4, 3, 2, 4}) {
    Problem p;
    p.kv_dtype = DType::fp8_ds_mla;
    p.heads = 8;
    p.topk = 200;
    p.kernel = {cuda::AttentionKernel::small_heads, stages};
    run_sparse(p, seed++);
  }
}

// Case n of a small-heads sweep: the block size (1/16/64), topk_length, sink, strided queries, max_logits, empty
// rows' lse, the kernel's head grouping (as picked or 8), output-dim split (as picked, unsplit or in 2) and row
// copies (as picked: bulk copies from sm_90 on; or cp.async pieces) cycle with n at periods of 2 to 7, so that a
// sweep meets many combinations; `stages`: the pipeline depth forced.
void vary_small_heads_case(Problem& p, int n, int stages) {
  p.block_size = std::array<int, 3>{1, 16, 64}[n % 3];
  p.topk_length = n % 4 == 1;
  p.sink = n % 5 == 2;
  p.q_padded = n % 3 == 2;
  p.kernel = {cuda::AttentionKernel::small_heads, stages, n % 4 >= 2 ? 8 : 0, n % 3};
  p.kernel.copy = n % 6 >= 3 ? cuda::RowCopy::pieces : cuda::RowCopy::automatic;
  p.max_logits = n % 2 == 0;  // the exact max score, whatever the softmax's lazily moved base
  p.empty_lse_plus_inf = n % 7 == 3;
}

// The small-heads kernel forced (keys on the mma's M side, heads on N, per-warp
// online softmax): every head count it serves, both cache formats and f16,
// top-k 1 to 4096, block sizes 1/16/64, each pipeline depth, invalid indices,
// NaN-poisoned unused slots, topk_length, sinks and strided queries.
TEST(CudaSparseMlaSmallHeads, HeadsFormatsTopkBlockSizes) {
  uint64_t seed = 600;
  int n = 0;
  for (int heads : {1, 4, 8, 16, 20, 32})
    for (DType kv : {DType::bf16, DType::fp8_ds_mla})
      for (int topk : {1, 100, 2048, 4096}) {
        Problem p;
        p.kv_dtype = kv;
        p.heads = heads;
        p.topk = topk;
        p.tokens = topk == 4096 ? 2 : 3;
        // fp8 stages are small enough for every depth on an H200; bf16 ones as picked, or 2. (16 heads and more
        // with 8 heads per CTA: several CTAs per token.)
        vary_small_heads_case(p, n, kv == DType::fp8_ds_mla ? 2 + n % 3 : 2 * (n % 2));
        ++n;
        run_sparse(p, seed++);
      }
}

// Heads with no rope part: 512-wide bf16/f16 caches, the fp8_ds_mla envelope (rope part NaN) and the compact
// fp8_ds_mla_nope rows, against the CPU backend.
TEST(CudaSparseMla, NoRopePartHeadsAndTopk) {
  uint64_t seed = 600;
  const DType forms[] = {DType::bf16, DType::fp8_ds_mla, DType::fp8_ds_mla_nope, DType::f16};
  int turn = 0;
  for (int heads : {1, 8, 16, 64, 128})
    for (int topk : {1, 100, 2048}) {
      Problem p;
      p.rope = 0;
      p.kv_dtype = forms[turn % 4];
      p.block_size = std::array<int, 3>{1, 16, 64}[turn % 3];
      p.heads = heads;
      p.topk = topk;
      p.tokens = heads >= 64 ? 2 : 3;
      p.sink = turn % 2 == 1;
      p.topk_length = turn % 3 == 2;
      ++turn;
      run_sparse(p, seed++);
    }
}

TEST(CudaSparseMla, NoRopePartDtypesFormatsBlockSizes) {
  uint64_t seed = 700;
  for (DType q : {DType::bf16, DType::f16})
    for (DType kv : {DType::bf16, DType::f16, DType::fp8_ds_mla, DType::fp8_ds_mla_nope})
      for (int bs : {1, 16, 64}) {
        Problem p;
        p.rope = 0;
        p.q_dtype = q;
        p.kv_dtype = kv;
        p.block_size = bs;
        p.heads = 20;
        p.topk = 300;
        p.block_pad = bs == 16 ? 8 * 16 : 0;
        p.topk_length = bs == 64;
        p.sink = bs == 1;
        p.q_padded = q == DType::f16;
        run_sparse(p, seed++);
      }
}

// The small-heads kernel forced on rope-free 512-wide heads (GLM-5.3-Flash): 16-bit rows of 1024 bytes, the
// fp8_ds_mla envelope (its rope part NaN, never read) and the compact fp8_ds_mla_nope rows; every head count it
// serves, top-k 1 to 2048, block sizes 1/16/64, each pipeline depth that fits, both head groupings and dim splits,
// invalid indices, NaN-poisoned unused slots, topk_length, sinks, max_logits and strided queries.
TEST(CudaSparseMlaSmallHeads, NoRopePartHeadsFormatsTopkBlockSizes) {
  uint64_t seed = 650;
  const DType forms[] = {DType::fp8_ds_mla, DType::bf16, DType::fp8_ds_mla_nope, DType::f16};
  int n = 0;
  for (int heads : {1, 8, 16, 20, 32})
    for (DType kv : forms)
      for (int topk : {1, 100, 2048}) {
        const bool fp8 = kv != DType::bf16 && kv != DType::f16;
        Problem p;
        p.rope = 0;
        p.kv_dtype = kv;
        p.q_dtype = n % 5 == 4 ? DType::f16 : DType::bf16;
        p.heads = heads;
        p.topk = topk;
        p.tokens = topk == 2048 ? 2 : 3;
        // 16-bit rope-free stages fit 3 deep on an H200, fp8 ones 4.
        vary_small_heads_case(p, n, fp8 ? 2 + n % 3 : 2 * (n % 2) + (n % 4 == 3));
        ++n;
        run_sparse(p, seed++);
      }
  for (DType kv : forms) {  // GLM-5.3-Flash's TP8 decode shape, through the splits and the combine
    Problem p;
    p.rope = 0;
    p.kv_dtype = kv;
    p.tokens = 64;
    p.heads = 8;
    p.topk = 2048 + 3;
    p.block_size = 64;
    p.max_logits = true;
    p.kernel = {cuda::AttentionKernel::small_heads, 0};
    run_sparse(p, seed++);
  }
}

// fp8 caches: each head's latent query is scaled by its own power of two for the f16 products. Heads 2^-8 to 2^4
// in magnitude, so a scale taken from another head's largest value overflows f16 or drops the small head's bits;
// 8 heads unsplit and dim-split, 16 heads in one CTA (two groups, or 16 heads a warp with the dims split) and in two.
TEST(CudaSparseMlaSmallHeads, QueryMagnitudesPerHead) {
  uint64_t seed = 760;
  const cuda::AttentionChoice shapes[] = {{cuda::AttentionKernel::small_heads, 0, 8, 1},
                                          {cuda::AttentionKernel::small_heads, 0, 8, 2},
                                          {cuda::AttentionKernel::small_heads, 0, 16, 1},
                                          {cuda::AttentionKernel::small_heads, 0, 16, 2}};
  for (int heads : {8, 16})
    for (const cuda::AttentionChoice& shape : shapes)
      for (int topk : {100, 2048}) {
        Problem p;
        p.kv_dtype = DType::fp8_ds_mla;
        p.heads = heads;
        p.topk = topk;
        p.head_scale_step = 4;
        p.kernel = shape;
        p.sink = topk == 100;
        run_sparse(p, seed++);
      }
}

TEST(CudaSparseMlaSmallHeads, F16AndQueryDtypes) {
  uint64_t seed = 700;
  for (DType q : {DType::bf16, DType::f16})
    for (DType kv : {DType::bf16, DType::f16, DType::fp8_ds_mla}) {
      Problem p;
      p.q_dtype = q;
      p.kv_dtype = kv;
      p.heads = 8;
      p.topk = 300;
      p.block_size = 16;
      p.block_pad = 8 * 16;
      p.kernel = {cuda::AttentionKernel::small_heads, 0};
      run_sparse(p, seed++);
    }
}

TEST(CudaSparseMlaSmallHeads, DecodeBatchUsesSplits) {
  for (DType kv : {DType::bf16, DType::fp8_ds_mla})
    for (int heads : {8, 16}) {
      Problem p;
      p.kv_dtype = kv;
      p.tokens = 64;
      p.heads = heads;
      p.topk = 2048;
      p.block_size = 64;
      p.max_logits = true;  // through the splits' partial maxima
      p.kernel = {cuda::AttentionKernel::small_heads, 0};
      expect_splits_run(p, 800 + heads);
    }
}

TEST(CudaSparseMlaSmallHeads, DepthBeyondSharedMemoryIsAnError) {
  Problem p;  // 4 stages of 64 bf16 rows (296 KB) fit no GPU's shared memory
  p.heads = 16;
  p.kernel = {cuda::AttentionKernel::small_heads, 4};
  p.skip_beyond_device = false;
  try {
    run_sparse(p, 1);
    FAIL() << "4 bf16 stages accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("shared memory"), std::string::npos) << e.what();
  }
}

TEST(CudaSparseMlaSmallHeads, InvalidShapeIsAnError) {
  for (cuda::AttentionChoice bad : {cuda::AttentionChoice{cuda::AttentionKernel::small_heads, 5},
                                    cuda::AttentionChoice{cuda::AttentionKernel::small_heads, 0, 12},
                                    cuda::AttentionChoice{cuda::AttentionKernel::small_heads, 0, 8, 3}}) {
    Problem p;
    p.kernel = bad;
    try {
      run_sparse(p, 2);
      FAIL() << "shape accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::invalid_argument) << e.what();
    }
  }
}

// Heads that go to the small-heads kernel automatically, forced onto the 16-head-tile kernel: it stays tested.
TEST(CudaSparseMla, HeadTileKernelForSmallHeadCounts) {
  uint64_t seed = 900;
  for (DType kv : {DType::bf16, DType::fp8_ds_mla})
    for (int heads : {8, 20}) {
      Problem p;
      p.kv_dtype = kv;
      p.heads = heads;
      p.topk = 1000;
      p.topk_length = true;
      p.sink = true;
      p.max_logits = true;
      p.kernel = {cuda::AttentionKernel::head_tile, 0};
      run_sparse(p, seed++);
    }
}

TEST(CudaPagedDecode, SmallHeadsKernel) {
  uint64_t seed = 1000;
  for (DType kv : {DType::bf16, DType::fp8_ds_mla})
    for (int bs : {1, 16, 64})
      run_paged(DType::bf16, kv, 3, 2, 16, bs, true, seed++, kMlaRopeDim, {cuda::AttentionKernel::small_heads, 0});
  run_paged(DType::bf16, DType::fp8_ds_mla, 2, 4, 8, 16, false, seed++, kMlaRopeDim, {cuda::AttentionKernel::small_heads, 3});
  run_paged(DType::bf16, DType::fp8_ds_mla, 2, 2, 16, 64, true, seed++, kMlaRopeDim, {cuda::AttentionKernel::small_heads, 0, 8, 1});
  run_paged(DType::bf16, DType::bf16, 2, 2, 20, 64, true, seed++, kMlaRopeDim, {cuda::AttentionKernel::small_heads, 0, 8, 2});
  run_paged(DType::f16, DType::bf16, 4, 1, 4, 64, true, seed++, kMlaRopeDim, {cuda::AttentionKernel::small_heads, 3});
  run_paged(DType::bf16, DType::bf16, 2, 2, 16, 16, true, seed++, kMlaRopeDim, {cuda::AttentionKernel::head_tile, 0});
  // Rope-free 512-wide heads, every cache form.
  for (DType kv : {DType::bf16, DType::f16, DType::fp8_ds_mla, DType::fp8_ds_mla_nope})
    for (int bs : {1, 16, 64})
      run_paged(kv == DType::f16 ? DType::f16 : DType::bf16, kv, 3, 2, bs == 16 ? 20 : 8, bs, bs != 1, seed++, 0,
                {cuda::AttentionKernel::small_heads, 0});
}

TEST(CudaSparseMla, NoRopePartDecodeBatchUsesSplits) {
  // 64 tokens x 8 heads x top-k 2048: GLM-5.3-Flash's TP8 decode shape, in the three forms engines would use.
  uint64_t seed = 800;
  for (DType kv : {DType::bf16, DType::fp8_ds_mla, DType::fp8_ds_mla_nope}) {
    Problem p;
    p.rope = 0;
    p.kv_dtype = kv;
    p.tokens = 64;
    p.heads = 8;
    p.topk = 2048;
    p.block_size = 64;
    p.sink = true;
    expect_splits_run(p, seed++);
  }
}

TEST(CudaPagedDecode, NoRopePartMatchesCpu) {
  uint64_t seed = 900;
  for (DType kv : {DType::bf16, DType::f16, DType::fp8_ds_mla, DType::fp8_ds_mla_nope})
    for (int bs : {1, 16, 64}) run_paged(DType::bf16, kv, 3, 2, 16, bs, true, seed++, 0);
  run_paged(DType::f16, DType::f16, 4, 1, 128, 64, true, seed++, 0);
  run_paged(DType::bf16, DType::fp8_ds_mla_nope, 2, 4, 8, 16, false, seed++, 0);
}

TEST(CudaWriteMlaCache, SameBytesAsCpu) {
  test::Rng rng(500);
  for (int rope : {kMlaRopeDim, 0})
    for (DType src : {DType::f32, DType::bf16, DType::f16})
      for (DType kv : {DType::bf16, DType::f16, DType::fp8_ds_mla, DType::fp8_ds_mla_nope, DType::fp8_ds_mla_v4}) {
        if (MlaHead{rope}.cache_row(kv) == 0) continue;  // fp8_ds_mla_nope and _v4 hold no separate rope part
        SCOPED_TRACE(std::string(dtype_name(src)) + " -> " + std::string(dtype_name(kv)) + " rope " +
                     std::to_string(rope));
        const int n = 77, num_blocks = 10, bs = 16;
        const int row = row_elems(kv, rope);
        const int64_t esz = dtype_size(src);
        std::vector<uint8_t> latent(n * kMlaLatentDim * esz), kpe(n * kMlaRopeDim * esz);
        auto fill = [&](std::vector<uint8_t>& buf, int count) {
          auto vals = test::random_floats(rng, count, -40.f, 40.f);
          if (src == DType::f32) std::memcpy(buf.data(), vals.data(), buf.size());
          else {
            auto bits = test::to_half_bits(vals, src);
            std::memcpy(buf.data(), bits.data(), buf.size());
          }
        };
        fill(latent, n * kMlaLatentDim);
        fill(kpe, n * kMlaRopeDim);
        std::vector<int64_t> slots(n);
        std::vector<int64_t> perm(num_blocks * bs);
        for (size_t i = 0; i < perm.size(); ++i) perm[i] = static_cast<int64_t>(i);
        std::shuffle(perm.begin(), perm.end(), rng);
        for (int i = 0; i < n; ++i) slots[i] = i % 11 == 5 ? -1 : perm[i];
        std::vector<uint8_t> ref(num_blocks * bs * row * dtype_size(kv), 0xab);
        WriteMlaCacheArgs a;
        a.latent = TensorView(latent.data(), {n, kMlaLatentDim}, src);
        if (rope) a.k_pe = TensorView(kpe.data(), {n, kMlaRopeDim}, src);  // none: the envelope's rope bytes stay
        a.slot_mapping = TensorView(slots.data(), {n}, DType::i64);
        a.cache = TensorView(ref.data(), {num_blocks, bs, row}, kv);
        write_mla_cache(a, &cpu());
        DeviceBuffer dl(latent), dk(kpe), ds(slots), dc(std::vector<uint8_t>(ref.size(), 0xab));
        WriteMlaCacheArgs g = a;
        g.latent = on_gpu(a.latent, dl.ptr);
        if (rope) g.k_pe = on_gpu(a.k_pe, dk.ptr);
        g.slot_mapping = on_gpu(a.slot_mapping, ds.ptr);
        g.cache = on_gpu(a.cache, dc.ptr);
        write_mla_cache(g, &gpu());
        CUDA_OK(cudaDeviceSynchronize());
        EXPECT_EQ(dc.download<uint8_t>(), ref);
      }
}

TEST(CudaBackend, RejectsMisalignedQueries) {
  uint16_t dummy[8];
  SparseMlaArgs a;
  DeviceBuffer d(1 << 20);
  char* base = static_cast<char*>(d.ptr);  // each tensor in its own 64 KB, so only the alignment is at fault
  a.q = on_gpu(TensorView(dummy, {1, 1, kMlaQkDim}, {kMlaQkDim, kMlaQkDim, 1}, DType::bf16), base + 2);
  a.kv_cache = on_gpu(TensorView(dummy, {1, 16, kMlaQkDim}, DType::bf16), base + (1 << 16));
  a.indices = on_gpu(TensorView(dummy, {1, 1}, DType::i32), base + (2 << 16));
  a.out = on_gpu(TensorView(dummy, {1, 1, kMlaVDim}, DType::bf16), base + (3 << 16));
  a.lse = on_gpu(TensorView(dummy, {1, 1}, DType::f32), base + (4 << 16));
  a.softmax_scale = 1.f;
  try {
    sparse_mla(a, &gpu());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("q:"), std::string::npos) << e.what();
  }
}

// DeepSeek-V4's fp8 cache (fp8_ds_mla_v4: per token 448 e4m3 in 7 tiles of 64 and 64 bf16, its 7 ue8m0 scales and a
// pad byte at the block's end; blocks padded as FlashMLA pads them) on the 16-head-tile kernel against the CPU
// backend: unused slots, pad bytes and block padding NaN, V4's head counts, top-k 64/576/2048 and block sizes
// 1/2/61/64/69/576, lengths that cut the lists, sinks, max_logits.
Problem v4_problem(int heads, int topk, int block_size) {
  Problem p;
  p.rope = 0;
  p.kv_dtype = DType::fp8_ds_mla_v4;
  p.heads = heads;
  p.topk = topk;
  p.block_size = block_size;
  return p;
}

TEST(CudaSparseMlaV4, HeadsTopkBlockSizes) {
  uint64_t seed = 1100;
  const int block_sizes[] = {1, 2, 61, 64, 69, 576};
  int i = 0;
  for (int heads : {1, 16, 64, 128})
    for (int topk : {64, 576, 2048}) {
      Problem p = v4_problem(heads, topk, block_sizes[i++ % 6]);
      p.tokens = heads >= 64 ? 4 : 6;
      p.q_dtype = i % 4 == 0 ? DType::f16 : DType::bf16;
      p.topk_length = i % 2 == 0;
      p.sink = i % 3 == 0;
      p.max_logits = true;
      p.block_pad = i % 5 == 0 ? 576 : 0;  // a block stride past FlashMLA's padding
      const std::optional<cuda::AttentionPlan> plan = run_sparse(p, seed++);
      ASSERT_TRUE(plan.has_value());
      EXPECT_EQ(plan->kernel, automatic_many_heads_kernel(DType::fp8_ds_mla_v4, 0, false, heads, p.tokens))
          << "the small-heads kernel from 64 tokens only";
    }
}

// Decode batches of 4 and 74 requests with s_q 1 and 3 (FlashMLA's q (b, s_q, h, 512) is b * s_q tokens here), and
// the keys split (the combine) against the same problem unsplit.
TEST(CudaSparseMlaV4, DecodeBatchesAndSplits) {
  uint64_t seed = 1200;
  for (int batch : {4, 74})
    for (int s_q : {1, 3}) {
      Problem p = v4_problem(batch == 4 ? 128 : 64, 2048, 64);
      p.tokens = batch * s_q;
      p.topk_length = true;
      p.sink = s_q == 3;
      run_sparse(p, seed++);
    }
  Problem split = v4_problem(16, 2048, 61);
  split.tokens = 2;
  split.sink = true;
  expect_splits_run(split, seed++);
}

// Dense paged decode over an fp8_ds_mla_v4 cache: batches 4 and 74, s_q 1 and 3 (causal among them), block sizes.
TEST(CudaPagedDecodeV4, MatchesCpu) {
  uint64_t seed = 1300;
  for (int batch : {4, 74})
    for (int s_q : {1, 3})
      for (int bs : {1, 61, 576})
        run_paged(DType::bf16, DType::fp8_ds_mla_v4, batch, s_q, batch == 4 ? 64 : 16, bs, true, seed++, 0);
  run_paged(DType::f16, DType::fp8_ds_mla_v4, 2, 2, 128, 2, false, seed++, 0);
}

// The small-heads kernel forced on an fp8_ds_mla_v4 cache, against the CPU backend: 1, 8, 16 and 32 heads (8 or 16
// a CTA), block sizes 2/61/64 (and a padded block stride), tokens 1/3/62, lengths cutting the list, a row with every
// index invalid and whole empty halves, sinks, max_logits, pipeline depths, splits forced to 1 and several (and
// split against unsplit). NaN fills every unused slot, block padding and the pad and scale bytes of unused tokens.
TEST(CudaSparseMlaV4, SmallHeadsKernel) {
  uint64_t seed = 1450;
  const int block_sizes[] = {2, 61, 64};
  int i = 0;
  for (int heads : {1, 8, 16, 32})
    for (int tokens : {1, 3, 62}) {
      Problem p = v4_problem(heads, tokens == 62 ? 576 : 2048, block_sizes[i % 3]);
      p.tokens = tokens;
      p.q_dtype = i % 5 == 4 ? DType::f16 : DType::bf16;
      p.topk_length = i % 2 == 0;
      p.sink = i % 3 != 1;
      p.max_logits = true;
      p.empty_halves = i % 4 == 3;
      p.block_pad = i % 5 == 2 ? 576 : 0;
      p.kernel = {cuda::AttentionKernel::small_heads, i % 3 == 0 ? 0 : 2 + i % 3, heads <= 8 && i % 2 == 1 ? 16 : 0,
                  0, i % 4 == 1 ? 1 : i % 4 == 2 ? 7 : 0};
      const std::optional<cuda::AttentionPlan> plan = run_sparse(p, seed++);
      ++i;
      if (!plan) continue;  // a forced shape beyond the device's shared memory (checked and reported)
      EXPECT_EQ(plan->kernel, cuda::AttentionKernel::small_heads) << "heads " << heads << " tokens " << tokens;
      if (p.kernel.splits == 1) EXPECT_EQ(plan->num_splits, 1);
      if (p.kernel.splits == 7) EXPECT_GT(plan->num_splits, 1);
    }
  for (int heads : {8, 16}) {
    Problem split = v4_problem(heads, 2048, 61);
    split.tokens = 2;
    split.sink = true;
    split.max_logits = true;
    split.kernel = {cuda::AttentionKernel::small_heads, 0};
    expect_splits_run(split, seed++);
  }
}

// The small-heads kernel's two ways of copying rows (16-byte cp.async pieces; one bulk copy a row, sm_90+) land the
// same bytes in the same places: outputs equal bit for bit (each also against the CPU backend), over invalid
// indices, topk_length, whole empty halves, both head groupings and dim splits, and 16-bit, fp8_ds_mla (576- and
// 512-wide) and fp8_ds_mla_nope rows. Bulk copies forced where the device has none, or on fp8_ds_mla_v4 rows (whose
// 8 scale bytes are no bulk copy), are an error that says so.
TEST(CudaSparseMlaSmallHeads, RowCopiesAgreeBitForBit) {
  const bool bulk = cuda::current_device().compute_capability >= 90;
  uint64_t seed = 1500;
  int n = 0;
  for (DType kv : {DType::bf16, DType::fp8_ds_mla, DType::fp8_ds_mla_nope})
    for (int heads : {8, 16}) {
      Problem p;
      p.kv_dtype = kv;
      p.rope = kv == DType::fp8_ds_mla_nope || n % 3 == 2 ? 0 : kMlaRopeDim;
      p.heads = heads;
      p.topk = 1000;
      p.block_size = n % 2 ? 64 : 16;
      p.topk_length = n % 2 == 0;
      p.empty_halves = true;
      p.kernel = {cuda::AttentionKernel::small_heads, 0, 0, n % 4 == 3 ? 2 : 0};
      p.kernel.copy = cuda::RowCopy::pieces;
      std::vector<uint16_t> by_pieces, by_bulk;
      ++n;
      if (!run_sparse(p, seed, &by_pieces)) continue;
      p.kernel.copy = cuda::RowCopy::bulk;
      if (!bulk) {
        test::expect_error([&] { run_sparse(p, seed); }, ErrorKind::unsupported, {"small-heads kernel", "bulk", "sm_90"});
        continue;
      }
      ASSERT_TRUE(run_sparse(p, seed++, &by_bulk));
      EXPECT_EQ(by_pieces, by_bulk) << dtype_name(kv) << " heads " << heads;
    }
  Problem v4 = v4_problem(8, 256, 64);
  v4.kernel = {cuda::AttentionKernel::small_heads, 0};
  v4.kernel.copy = cuda::RowCopy::bulk;
  test::expect_error([&] { run_sparse(v4, seed); }, ErrorKind::unsupported, {"small-heads kernel", "bulk", "fp8_ds_mla_v4"});
}

// On an fp8_ds_mla_v4 cache the small-heads kernel does not split the output dims (that form spilled): forcing it
// is refused; blocks that are not 16-byte aligned are refused, naming the cache.
TEST(CudaSparseMlaV4, RefusesTheDimSplitAndMisalignedBlocks) {
  Problem small = v4_problem(8, 256, 64);
  small.kernel = {cuda::AttentionKernel::small_heads, 0, 8, 2};
  test::expect_error([&] { run_sparse(small, 1400); }, ErrorKind::unsupported,
                     {"small-heads kernel", "does not split the output dims", "fp8_ds_mla_v4"});
  Problem misaligned = v4_problem(8, 256, 61);
  misaligned.block_pad = 8;  // 62 * 576 + 8 bytes a block
  test::expect_error([&] { run_sparse(misaligned, 1401); }, ErrorKind::invalid_argument,
                     {"sparse_mla", "kv_cache", "16-byte aligned"});
}

// The n-th case of a sweep's options: query dtype, block size, topk_length, sinks, strided queries, max_logits and
// the +inf empty lse, each on and off across the cases.
void vary_options(Problem& p, int n) {
  p.q_dtype = n % 4 == 3 ? DType::f16 : DType::bf16;
  p.block_size = std::array<int, 3>{1, 16, 64}[n % 3];
  p.topk_length = n % 4 == 1;
  p.sink = n % 3 == 1;
  p.q_padded = n % 5 == 3;
  p.max_logits = n % 2 == 0;
  p.empty_lse_plus_inf = n % 7 == 4;
}

// Chosen by itself for 16-bit caches (bf16, f16) at up to 8 heads from 32 query rows on (64 for 512-wide heads;
// kernel_choice.h says why) where the device's shared memory holds it, matching the CPU backend; 31 rows or 16 heads
// keep the 16-head tile (on Hopper 16 heads take the wgmma kernel). Sparse and paged.
TEST(CudaSparseMlaSmallHeads, AutomaticFor16BitCaches) {
  namespace sh = cuda::mla::small;
  uint64_t seed = 3100;
  int n = 0;
  for (DType kv : {DType::bf16, DType::f16})
    for (int rope : {kMlaRopeDim, 0})
      for (const auto& [tokens, heads] : {std::pair<int, int>{32, 8}, {64, 4}, {64, 1}, {31, 8}, {64, 16}}) {
        Problem p;
        p.kv_dtype = kv;
        p.rope = rope;
        p.tokens = tokens;
        p.heads = heads;
        p.topk = 640;  // ten 64-key chunks
        vary_options(p, n++);
        const std::optional<cuda::AttentionPlan> plan = run_sparse(p, seed++);
        ASSERT_TRUE(plan.has_value());
        const cuda::mla::CacheFormat f = kv == DType::bf16 ? cuda::mla::CacheFormat::bf16 : cuda::mla::CacheFormat::f16;
        const bool fits = small_heads_fit(f, rope);
        const int min_tokens = std::max(sh::kMinTokensAutomatic16Bit, rope ? sh::kMinTokensAutomatic : sh::kMinTokensAutomaticNoRope);
        // Past 8 heads only as 16 heads a warp, where its two stages fit (kernel_choice.h).
        const int limit = cuda::current_device().max_smem_per_block;
        const int max_heads = cuda::mla::small_heads_smem(f, rope, 16, 2, 2) <= limit
                                  ? sh::kMaxHeadsAutomatic16Bit
                                  : sh::kMaxHeadsAutomatic16BitTwoGroups;
        EXPECT_EQ(plan->kernel == cuda::AttentionKernel::small_heads,
                  heads <= max_heads && tokens >= min_tokens && fits && !automatic_wgmma(kv, rope, false, heads, tokens))
            << dtype_name(kv) << " rope " << rope << " tokens " << tokens << " heads " << heads;
      }
  // Paged: 32 requests of one query of 8 heads.
  PagedMlaDecodeArgs a;
  a.q = TensorView(nullptr, {32, 1, 8, kMlaQkDim}, DType::bf16, Device::cuda(0));
  a.kv_cache = TensorView(nullptr, {64, 64, kMlaQkDim}, DType::bf16, Device::cuda(0));
  a.block_table = TensorView(nullptr, {32, 16}, DType::i32, Device::cuda(0));
  EXPECT_EQ(cuda::paged_mla_decode_plan(a).kernel == cuda::AttentionKernel::small_heads,
            small_heads_fit(cuda::mla::CacheFormat::bf16, kMlaRopeDim));
  run_paged(DType::bf16, DType::bf16, 32, 1, 8, 64, true, seed++);
}

// The wide-tile kernel (64 heads per CTA, 8 warps) forced: head counts that fill one tile, two, and pad one
// (100: a tile of 36), every cache format and rope width, query dtypes, top-k from one chunk to 128, block sizes,
// invalid indices, NaN-poisoned unused slots (and the fp8_ds_mla envelope's rope bytes without rope), outputs
// pre-filled with NaN, topk_length, sinks, strided queries, max_logits, both empty-row lse conventions. On devices
// whose shared memory cannot hold it (the 99 KB archs, sm_80) the forced kernel's refusal is checked and the case
// skipped.
TEST(CudaSparseMlaWideTile, HeadsFormatsTopk) {
  uint64_t seed = 2000;
  int n = 0;
  for (DType kv : {DType::bf16, DType::fp8_ds_mla, DType::f16, DType::fp8_ds_mla_v4})
    for (int heads : {32, 64, 100, 128})
      for (int topk : {64, 2048}) {
        Problem p;
        p.kv_dtype = kv;
        p.rope = kv == DType::fp8_ds_mla_v4 || n % 3 == 2 ? 0 : kMlaRopeDim;
        p.heads = heads;
        p.topk = topk;
        p.tokens = n % 2 ? 1 : 3;
        vary_options(p, n);
        const int stages = std::array<int, 3>{0, 2, 3}[(n / 2) % 3];  // each depth, forced or picked, per format
        p.kernel = {cuda::AttentionKernel::wide_tile, stages};
        ++n;
        const std::optional<cuda::AttentionPlan> plan = run_sparse(p, seed++);
        if (!plan) continue;  // beyond this device's shared memory (checked)
        EXPECT_EQ(plan->kernel, cuda::AttentionKernel::wide_tile);
        if (stages) EXPECT_EQ(plan->stages, stages);
        else if (cuda::current_device().max_smem_per_block >= 227 * 1024)
          EXPECT_EQ(plan->stages, 3) << "the deepest pipeline that fits (sm_90, sm_100: 227 KB per block)";
      }
  // A prefill-like batch (62 tokens) and top-k 4096 (128 chunks).
  for (DType kv : {DType::bf16, DType::fp8_ds_mla}) {
    Problem p;
    p.kv_dtype = kv;
    p.heads = 64;
    p.topk = 64;
    p.tokens = 62;
    p.sink = true;
    p.kernel = {cuda::AttentionKernel::wide_tile};
    run_sparse(p, seed++);
    p.tokens = 2;
    p.topk = 4096;
    p.topk_length = true;
    p.max_logits = true;
    run_sparse(p, seed++);
  }
}

// A 64-head kernel's split partials and the combine over cache `kv`: forced counts 1, 3 and `per_chunk` (one split
// per chunk) for one token of 100 heads and three of 64, with whole splits empty, a row with no valid key, sinks and
// max_logits; and the split the op picks for one token of 128 heads (2 CTAs on a whole GPU) against the same problem
// unsplit. False where the device's shared memory cannot hold the kernel (checked), when `skip_beyond_device`.
bool expect_forced_splits(cuda::AttentionKernel kernel, DType kv, int per_chunk, bool skip_beyond_device,
                          uint64_t& seed) {
  for (int tokens : {1, 3})
    for (int splits : {1, 3, per_chunk}) {
      Problem p;
      p.kv_dtype = kv;
      p.tokens = tokens;
      p.heads = tokens == 1 ? 100 : 64;
      p.topk = 2048;
      p.block_size = 64;
      p.sink = true;
      p.max_logits = true;
      p.empty_halves = true;
      p.kernel = {kernel, 0, 0, 0, splits};
      p.skip_beyond_device = skip_beyond_device;
      SCOPED_TRACE("splits " + std::to_string(splits) + " tokens " + std::to_string(tokens));
      const std::optional<cuda::AttentionPlan> plan = run_sparse(p, seed++);
      if (!plan) return false;
      EXPECT_EQ(plan->kernel, kernel);
      EXPECT_EQ(plan->num_splits, splits);
    }
  Problem one;
  one.kv_dtype = kv;
  one.tokens = 1;
  one.heads = 128;
  one.topk = 2048;
  one.max_logits = true;
  one.kernel = {kernel};
  one.skip_beyond_device = skip_beyond_device;
  expect_splits_run(one, seed++);
  return true;
}

// The wide-tile kernel's splits (32-key chunks: 64 of them), both cache kinds.
TEST(CudaSparseMlaWideTile, ForcedSplits) {
  uint64_t seed = 2200;
  for (DType kv : {DType::bf16, DType::fp8_ds_mla})
    if (!expect_forced_splits(cuda::AttentionKernel::wide_tile, kv, 64, true, seed)) return;
}

// Dense paged decode on the wide-tile kernel: causal s_q > 1 (each step its own visible length), non-causal,
// every cache format, padded head tiles, rope-free heads.
TEST(CudaPagedDecodeWideTile, MatchesCpu) {
  uint64_t seed = 2300;
  const cuda::AttentionChoice wide{cuda::AttentionKernel::wide_tile};
  for (DType kv : {DType::bf16, DType::fp8_ds_mla, DType::f16})
    for (int s_q : {1, 3}) run_paged(DType::bf16, kv, 2, s_q, s_q == 1 ? 64 : 100, 16, true, seed++, kMlaRopeDim, wide);
  run_paged(DType::f16, DType::bf16, 3, 2, 128, 64, false, seed++, kMlaRopeDim, wide);
  run_paged(DType::bf16, DType::fp8_ds_mla, 2, 4, 64, 1, true, seed++, 0, wide);
  run_paged(DType::bf16, DType::fp8_ds_mla_v4, 2, 3, 64, 61, true, seed++, 0, wide);
}

// A forced depth out of range is an error naming the kernel.
TEST(CudaSparseMlaWideTile, InvalidDepthIsAnError) {
  for (int stages : {1, 4}) {
    Problem p;
    p.heads = 64;
    p.kernel = {cuda::AttentionKernel::wide_tile, stages};
    test::expect_error([&] { run_sparse(p, 2400); }, ErrorKind::invalid_argument, {"wide-tile kernel", "stages must be 2-3"});
  }
}

// The automatic choice names the wide-tile kernel (the wgmma kernel on Hopper with sm_90a code, from fewer heads and
// rows) from its rule's head count and query rows x heads on, where the device holds it (so the tests of 64 and 128
// heads over enough tokens without a forced kernel run it too), never below: one token of 128 heads stays on the
// 16-head tile.
// With a second cache the plan is the one cache's (on the 16-head tile and the wgmma kernel one launch for both), and
// the wide tile forced serves both caches.
TEST(CudaSparseMlaWideTile, AutomaticChoiceAndSecondCache) {
  for (int64_t tokens : {1, 7, 8, 31, 64})
    for (int heads : {16, 20, 32, 64, 128})
      for (DType kv : {DType::bf16, DType::fp8_ds_mla}) {
        SCOPED_TRACE(std::string(dtype_name(kv)) + " heads " + std::to_string(heads) + " tokens " +
                     std::to_string(tokens));
        SparseMlaArgs a;
        a.q = TensorView(nullptr, {tokens, heads, kMlaQkDim}, DType::bf16, Device::cuda(0));
        a.kv_cache = TensorView(nullptr, {64, 64, row_elems(kv, kMlaRopeDim)}, kv, Device::cuda(0));
        a.indices = TensorView(nullptr, {tokens, 2048}, DType::i32, Device::cuda(0));
        const cuda::AttentionPlan plan = cuda::sparse_mla_plan(a);
        const cuda::AttentionKernel many = automatic_many_heads_kernel(kv, kMlaRopeDim, false, heads, tokens);
        const bool wide = many == cuda::AttentionKernel::wide_tile || many == cuda::AttentionKernel::wgmma;
        if (wide) EXPECT_EQ(plan.kernel, many);
        else EXPECT_TRUE(plan.kernel == cuda::AttentionKernel::head_tile || plan.kernel == cuda::AttentionKernel::small_heads);
        // Hopper with sm_90a code: the wgmma kernel from 9 heads on (bf16 cache; fp8: 17, while kWgmmaAutomaticForFp8)
        // at 512 query rows x heads padded to 64, and its keys-on-M form for fp8 at 8-16 heads and 4-8 tokens;
        // elsewhere the wide tile from 64 heads and 4,096 rows.
        const bool wgmma_rule =
            cuda::mla::wgmma_few_tokens({cache_format_of(kv), kMlaRopeDim, false, tokens, heads, {}}) ||
            (heads >= cuda::mla::wgmma_min_heads(cache_format_of(kv)) &&
             cuda::mla::wgmma_rows(tokens, heads) >= cuda::mla::wgmma_min_rows(kMlaRopeDim));
        if (cuda::wgmma_kernels_available())
          EXPECT_EQ(plan.kernel == cuda::AttentionKernel::wgmma,
                    (kv == DType::bf16 || cuda::mla::kWgmmaAutomaticForFp8) && wgmma_rule);
        if (cuda::wgmma_kernels_available() ? !wgmma_rule
                                            : heads < cuda::mla::wide::kMinHeadsAutomatic ||
                                                  tokens * heads < cuda::mla::wide::kMinRowsAutomatic)
          EXPECT_FALSE(wide);
        if (wide) {
          EXPECT_LE(plan.smem, cuda::current_device().max_smem_per_block);
          EXPECT_EQ(plan.ctas_per_sm, 1);
        }
        // A second cache (there when its indices are: data a plan never reads).
        SparseMlaArgs two = a;
        int32_t never_read = 0;
        two.extra_kv_cache = a.kv_cache;
        two.extra_indices = TensorView(&never_read, {tokens, 2048}, DType::i32, Device::cuda(0));
        const cuda::AttentionPlan both = cuda::sparse_mla_plan(two);
        EXPECT_EQ(both.kernel, plan.kernel);
        if (both.kernel == cuda::AttentionKernel::head_tile ||
            (both.kernel == cuda::AttentionKernel::wgmma && kv == DType::bf16)) {
          // One launch reads both lists: split as one cache of both lists' keys.
          SparseMlaArgs joined = a;
          joined.indices = TensorView(nullptr, {tokens, 4096}, DType::i32, Device::cuda(0));
          EXPECT_EQ(both.num_splits, cuda::sparse_mla_plan(joined).num_splits);
        } else {
          EXPECT_GE(both.num_splits, 2);  // each cache's launch splits at least once
        }
        if (cuda::mla::wide::find_wide_config(kv == DType::bf16 ? cuda::mla::CacheFormat::bf16
                                                                 : cuda::mla::CacheFormat::fp8_ds_mla,
                                              kMlaRopeDim, false) != nullptr)
          EXPECT_EQ(cuda::sparse_mla_plan(two, {cuda::AttentionKernel::wide_tile}).kernel,
                    cuda::AttentionKernel::wide_tile);
      }
}

// A case of the wgmma kernel's tests below, that kernel forced, with case n's options (vary_options).
Problem wgmma_case(DType kv, int rope, int heads, int topk, int tokens, int n) {
  Problem p;
  p.kv_dtype = kv;
  p.rope = rope;
  p.heads = heads;
  p.topk = topk;
  p.tokens = tokens;
  vary_options(p, n);
  p.kernel = {cuda::AttentionKernel::wgmma};
  p.skip_beyond_device = false;
  return p;
}

// The wgmma kernel (sm_90a: 64 heads per CTA, two warpgroups, 64-key chunks) forced: head counts that fill one tile,
// two, pad one (100: a tile of 36) or half of one (32); top-k of one chunk, of a chunk and a part, of three and a
// part (200: the staging buffer and both sets of valid flags reused), of 32 chunks;
// 1, 3 and 62 tokens; bf16, f16 (copied into the key tile), fp8_ds_mla (dequantised into it; both by bulk copies)
// and fp8_ds_mla_v4 caches (cp.async pieces), bf16 and f16
// queries; both rope widths; block sizes; invalid indices and NaN-poisoned unused slots (run_sparse's; with fp8 the
// envelope's rope bytes without rope), outputs pre-filled with NaN, topk_length, sinks, strided queries, max_logits,
// both empty-row lse conventions. Skipped only where the device cannot run wgmma.
TEST(CudaSparseMlaWgmma, HeadsFormatsTopk) {
  if (!cuda::wgmma_kernels_available()) GTEST_SKIP() << "needs a Hopper GPU running the library's sm_90a code";
  uint64_t seed = 2600;
  int n = 0;
  for (DType kv : {DType::bf16, DType::f16, DType::fp8_ds_mla, DType::fp8_ds_mla_v4})
    for (int heads : {32, 64, 100, 128})
      for (int topk : {64, 100, 200, 2048}) {
        const int rope = kv == DType::fp8_ds_mla_v4 || n % 3 == 2 ? 0 : kMlaRopeDim;
        const int tokens = topk == 2048 ? (n % 2 ? 1 : 3) : (n % 2 ? 62 : 3);
        const Problem p = wgmma_case(kv, rope, heads, topk, tokens, n++);
        const std::optional<cuda::AttentionPlan> plan = run_sparse(p, seed++);
        ASSERT_TRUE(plan.has_value());
        EXPECT_EQ(plan->kernel, cuda::AttentionKernel::wgmma);
        EXPECT_EQ(plan->ctas_per_sm, 1);
      }
  // 17 and 20 heads (a tile of 47 or 44 padded heads), which it takes automatically on Hopper (wgmma_min_heads).
  for (DType kv : {DType::bf16, DType::fp8_ds_mla, DType::fp8_ds_mla_v4})
    for (int heads : {17, 20})
      for (int topk : {100, 2048}) {
        const int rope = kv == DType::fp8_ds_mla_v4 || n % 3 == 2 ? 0 : kMlaRopeDim;
        const std::optional<cuda::AttentionPlan> plan =
            run_sparse(wgmma_case(kv, rope, heads, topk, topk == 2048 ? 1 : 62, n++), seed++);
        ASSERT_TRUE(plan.has_value());
        EXPECT_EQ(plan->kernel, cuda::AttentionKernel::wgmma);
      }
}

// The wgmma kernel's keys-on-M form (fp8_ds_mla, 8, 16 or 32 heads per CTA on wgmma's N, producer and math
// warpgroups taking turns on the halves of one key tile) forced: head counts that fill a CTA, pad one (1, 4, 12, 20)
// or need two (20, 32 at 16 heads per CTA, 40); top-k of one chunk, a chunk and a part, three and a part (the staging
// buffers reused), 32 and 64 chunks; 1, 3 and 62 tokens; both rope widths and run_sparse's options (invalid indices,
// NaN-poisoned slots, sinks, topk_length, strided queries, NaN-filled outputs, max_logits); split and unsplit keys.
TEST(CudaSparseMlaWgmma, KeysOnM) {
  if (!cuda::wgmma_kernels_available()) GTEST_SKIP() << "needs a Hopper GPU running the library's sm_90a code";
  uint64_t seed = 2660;
  int n = 0;
  for (int hpc : {8, 16, 32})
    for (int heads : {1, 4, 8, 12, 16, 20, 32, 40})
      for (int topk : {64, 100, 200, 2048, 4096}) {
        if ((hpc == 8 && heads > 16 && topk != 2048) || (hpc < 32 && heads == 40) || (hpc == 32 && heads < 12))
          continue;
        const int rope = n % 3 == 2 ? 0 : kMlaRopeDim;
        const int tokens = topk >= 2048 ? (n % 2 ? 1 : 3) : (n % 2 ? 62 : 3);
        Problem p = wgmma_case(DType::fp8_ds_mla, rope, heads, topk, tokens, n++);
        p.kernel.heads_per_cta = hpc;
        if (n % 4 == 0) p.kernel.splits = 1;
        const std::optional<cuda::AttentionPlan> plan = run_sparse(p, seed++);
        ASSERT_TRUE(plan.has_value());
        EXPECT_EQ(plan->kernel, cuda::AttentionKernel::wgmma);
        EXPECT_EQ(plan->ctas_per_sm, 1);
      }
  // Dense paged decode over it: causal s_q > 1, block sizes 1, 16 and 64, both rope widths.
  for (int hpc : {8, 16, 32}) {
    const cuda::AttentionChoice keys{cuda::AttentionKernel::wgmma, 0, hpc};
    run_paged(DType::bf16, DType::fp8_ds_mla, 2, 3, hpc, 16, true, seed++, kMlaRopeDim, keys, 4e-3);
    run_paged(DType::bf16, DType::fp8_ds_mla, 3, 1, hpc == 8 ? 5 : hpc == 16 ? 16 : 20, 64, true, seed++, 0, keys, 4e-3);
    run_paged(DType::bf16, DType::fp8_ds_mla, 2, 2, hpc, 1, false, seed++, kMlaRopeDim, keys, 4e-3);
  }
}

// HeadsFormatsTopk's fp8 case of 100 heads, top-k 100 cut by per-token lengths, block size 64 and no rope (its 42nd),
// for every cache format with its seeds and two more: a partial pair of chunks without a rope slab on a padded head
// tile, which its 16-bit cases never combine (an fp8 version of the pairs kernel was off there on one output).
TEST(CudaSparseMlaWgmma, PartialPairWithoutRope) {
  if (!cuda::wgmma_kernels_available()) GTEST_SKIP() << "needs a Hopper GPU running the library's sm_90a code";
  for (DType kv : {DType::bf16, DType::f16, DType::fp8_ds_mla})
    for (uint64_t seed : {2641, 2642, 2643}) {
      const std::optional<cuda::AttentionPlan> plan = run_sparse(wgmma_case(kv, 0, 100, 100, 62, 41), seed);
      ASSERT_TRUE(plan.has_value());
      EXPECT_EQ(plan->kernel, cuda::AttentionKernel::wgmma);
    }
}

// The wgmma kernels' output rows where the keys are not split: staged in shared memory and bulk-copied where out's
// rows are 16-byte aligned, stored by each thread where they are not (out_padded: 8-byte aligned rows); padded head
// tiles (100 heads), both kernels (16-bit caches: the pairs kernel; fp8: the staged one), bf16 and f16 outputs.
TEST(CudaSparseMlaWgmma, OutputRowsAlignedOrNot) {
  if (!cuda::wgmma_kernels_available()) GTEST_SKIP() << "needs a Hopper GPU running the library's sm_90a code";
  uint64_t seed = 2650;
  int n = 0;
  for (DType kv : {DType::bf16, DType::f16, DType::fp8_ds_mla})
    for (bool padded : {false, true})
      for (int heads : {64, 100}) {
        Problem p = wgmma_case(kv, kMlaRopeDim, heads, 200, 3, n++);
        p.q_dtype = kv == DType::f16 ? DType::f16 : DType::bf16;
        p.out_padded = padded;
        p.kernel.splits = 1;
        const std::optional<cuda::AttentionPlan> plan = run_sparse(p, seed++);
        ASSERT_TRUE(plan.has_value());
        EXPECT_EQ(plan->kernel, cuda::AttentionKernel::wgmma);
        EXPECT_EQ(plan->num_splits, 1);
      }
}

// The wgmma kernel's splits (64-key chunks: 32 of them), both cache kinds.
TEST(CudaSparseMlaWgmma, ForcedSplits) {
  if (!cuda::wgmma_kernels_available()) GTEST_SKIP() << "needs a Hopper GPU running the library's sm_90a code";
  uint64_t seed = 2700;
  for (DType kv : {DType::bf16, DType::fp8_ds_mla})
    EXPECT_TRUE(expect_forced_splits(cuda::AttentionKernel::wgmma, kv, 32, false, seed));
}

// Dense paged decode on the wgmma kernel: causal s_q > 1 (each step its own visible length), non-causal, 16-bit and
// fp8 caches, padded head tiles, rope-free heads.
TEST(CudaPagedDecodeWgmma, MatchesCpu) {
  if (!cuda::wgmma_kernels_available()) GTEST_SKIP() << "needs a Hopper GPU running the library's sm_90a code";
  uint64_t seed = 2800;
  const cuda::AttentionChoice wgmma{cuda::AttentionKernel::wgmma};
  // fp8 rows are dequantised into bf16 before the mma, as in the wide tile; the H200 run of e9ab362 had one output
  // of 307,200 (fp8, s_q 3, 100 heads) 0.0024 off against the common 0.0021: such rows get 4e-3, and
  // Fp8ErrorAsTheWideTile below holds the kernel's error to the wide tile's on the same data.
  for (DType kv : {DType::bf16, DType::f16, DType::fp8_ds_mla})
    for (int s_q : {1, 3})
      run_paged(DType::bf16, kv, 2, s_q, s_q == 1 ? 64 : 100, 16, true, seed++, kMlaRopeDim, wgmma,
                kv == DType::fp8_ds_mla ? 4e-3 : 2e-3);
  run_paged(DType::f16, DType::bf16, 3, 2, 128, 64, false, seed++, kMlaRopeDim, wgmma);
  run_paged(DType::bf16, DType::bf16, 2, 4, 64, 1, true, seed++, 0, wgmma);
  run_paged(DType::bf16, DType::fp8_ds_mla, 2, 4, 64, 1, true, seed++, 0, wgmma);
  run_paged(DType::bf16, DType::fp8_ds_mla_v4, 2, 3, 64, 61, true, seed++, 0, wgmma);
}

// fp8_ds_mla through the wgmma kernel is no less exact than through the wide tile, which dequantises its rows into
// bf16 the same way: on the same data its largest output error stays within 1.5x the wide tile's (a wrong row or a
// race would show as a larger one).
TEST(CudaPagedDecodeWgmma, Fp8ErrorAsTheWideTile) {
  if (!cuda::wgmma_kernels_available()) GTEST_SKIP() << "needs a Hopper GPU running the library's sm_90a code";
  const cuda::AttentionChoice wgmma{cuda::AttentionKernel::wgmma}, wide{cuda::AttentionKernel::wide_tile};
  uint64_t seed = 2805;  // the first: MatchesCpu's case that missed 2e-3
  for (int heads : {100, 128, 64}) {
    double w = -1, g = -1;
    run_paged(DType::bf16, DType::fp8_ds_mla, 2, 3, heads, 16, true, seed, kMlaRopeDim, wide, 8e-3, &w);
    run_paged(DType::bf16, DType::fp8_ds_mla, 2, 3, heads, 16, true, seed, kMlaRopeDim, wgmma, 8e-3, &g);
    ASSERT_GE(w, 0) << "the wide tile ran";
    ASSERT_GE(g, 0) << "the wgmma kernel ran";
    EXPECT_LE(g, 1.5 * w + 1e-4) << heads << " heads: wgmma " << g << ", wide tile " << w;
    std::printf("fp8 paged, %d heads: largest error wgmma %.5f, wide tile %.5f\n", heads, g, w);
    ++seed;
  }
}

// Forced where it cannot run (off Hopper, or without sm_90a code), the wgmma kernel is an error that says why.
TEST(CudaSparseMlaWgmma, UnsupportedIsAnError) {
  if (cuda::wgmma_kernels_available()) GTEST_SKIP() << "runs here (every cache format)";
  Problem p;
  p.heads = 64;
  p.kernel = {cuda::AttentionKernel::wgmma};
  p.skip_beyond_device = false;
  test::expect_error([&] { run_sparse(p, 2900); }, ErrorKind::unsupported, {"wgmma kernel", "sm_90a"});
}

// The probe of the loaded code (DeviceInfo::sm90a_code) against the build: on a Hopper GPU (not emulated) a build
// whose arch list holds sm_90a code loads it, so the wgmma kernel runs (and its tests are not skipped); elsewhere, or
// without it, never.
TEST(CudaSparseMlaWgmma, Sm90aCodeFoundWhereBuilt) {
  const cuda::DeviceInfo& d = cuda::current_device();
  const int native = d.native_compute_capability != 0 ? d.native_compute_capability : d.compute_capability;
  const bool hopper = d.compute_capability == 90 && native == 90;
  EXPECT_EQ(cuda::wgmma_kernels_available(), hopper && cuda::mla::sm90a_code_built());
}

// Chosen by itself on Hopper with sm_90a code: the wgmma kernel for 16-bit caches, and fp8 ones while
// kWgmmaAutomaticForFp8, wherever the wide rule holds (128 heads from 32 query rows on, 64 from 64; sparse and paged),
// matching the CPU backend there; one token of 128 heads the 16-head tile. Elsewhere (or without sm_90a code) never
// chosen.
TEST(CudaSparseMlaWgmma, AutomaticChoiceMatchesCpu) {
  const bool runs = cuda::wgmma_kernels_available();
  uint64_t seed = 3000;
  int n = 0;
  for (DType kv : {DType::bf16, DType::f16, DType::fp8_ds_mla})
    for (const auto& [tokens, heads] : {std::pair<int, int>{32, 128}, {64, 64}}) {
      Problem p;
      p.kv_dtype = kv;
      p.heads = heads;
      p.tokens = tokens;
      p.topk = 640;  // ten chunks
      vary_options(p, n++);
      const std::optional<cuda::AttentionPlan> plan = run_sparse(p, seed++);
      ASSERT_TRUE(plan.has_value());
      EXPECT_EQ(plan->kernel == cuda::AttentionKernel::wgmma, runs && (kv != DType::fp8_ds_mla || cuda::mla::kWgmmaAutomaticForFp8));
    }
  // The plans alone (views of no data) of an fp8 cache and of one token.
  auto plan_of = [](DType kv, int64_t tokens) {
    SparseMlaArgs a;
    a.q = TensorView(nullptr, {tokens, 128, kMlaQkDim}, DType::bf16, Device::cuda(0));
    a.kv_cache = TensorView(nullptr, {64, 64, row_elems(kv, kMlaRopeDim)}, kv, Device::cuda(0));
    a.indices = TensorView(nullptr, {tokens, 2048}, DType::i32, Device::cuda(0));
    return cuda::sparse_mla_plan(a).kernel;
  };
  EXPECT_EQ(plan_of(DType::fp8_ds_mla, 128) == cuda::AttentionKernel::wgmma, runs && cuda::mla::kWgmmaAutomaticForFp8);
  EXPECT_EQ(plan_of(DType::bf16, 1), cuda::AttentionKernel::head_tile);
  EXPECT_EQ(plan_of(DType::bf16, 128) == cuda::AttentionKernel::wgmma, runs);
  // Paged: 32 requests of one query of 128 heads (4,096 rows x heads).
  PagedMlaDecodeArgs a;
  a.q = TensorView(nullptr, {32, 1, 128, kMlaQkDim}, DType::bf16, Device::cuda(0));
  a.kv_cache = TensorView(nullptr, {64, 64, kMlaQkDim}, DType::bf16, Device::cuda(0));
  a.block_table = TensorView(nullptr, {32, 16}, DType::i32, Device::cuda(0));
  EXPECT_EQ(cuda::paged_mla_decode_plan(a).kernel == cuda::AttentionKernel::wgmma, runs);
  if (runs) run_paged(DType::bf16, DType::bf16, 32, 1, 128, 64, true, seed++);
  a.kv_cache = TensorView(nullptr, {64, 64, row_elems(DType::fp8_ds_mla, kMlaRopeDim)}, DType::fp8_ds_mla, Device::cuda(0));
  EXPECT_EQ(cuda::paged_mla_decode_plan(a).kernel == cuda::AttentionKernel::wgmma,
            runs && cuda::mla::kWgmmaAutomaticForFp8);
  // fp8 rows dequantised to bf16 in the key tile: CudaPagedDecodeWgmma.MatchesCpu's tolerance.
  if (runs) run_paged(DType::bf16, DType::fp8_ds_mla, 32, 1, 128, 64, true, seed++, kMlaRopeDim, {}, 4e-3);
}

}  // namespace
}  // namespace smla
