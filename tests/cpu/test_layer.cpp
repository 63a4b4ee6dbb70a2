// MlaLayer on the CPU: the absorbed path against the unabsorbed one, decode step by step against one prefill
// (chunked, batched), DSA within top-k against dense attention, the block pool, imported context and the weight
// checks. Tiny geometries keep the kernels' sizes (kv_lora 512, rope 64, indexer head 128) and shrink the rest.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "smla/error.h"
#include "smla/layer.h"
#include "smla/select.h"
#include "support/layer_util.h"
#include "support/test_util.h"

namespace smla {
namespace {

using test::random_hidden;
using test::random_weights;
using test::Rng;
using test::tiny_spec;

// Runs one request's tokens one per forward call.
std::vector<float> decode_steps(MlaLayer& layer, int request, const std::vector<float>& hidden) {
  const int d = layer.spec().hidden_size;
  std::vector<float> out(hidden.size(), NAN);  // every output written, or a comparison fails
  for (size_t t = 0; t < hidden.size() / d; ++t) {
    const LayerSegment seg{request, 1};
    layer.forward({&seg, 1}, &hidden[t * d], &out[t * d]);
  }
  return out;
}

std::vector<float> prefill(MlaLayer& layer, int request, const std::vector<float>& hidden,
                           AttentionPath path = AttentionPath::absorbed) {
  std::vector<float> out(hidden.size(), NAN);
  const LayerSegment seg{request, int(hidden.size() / layer.spec().hidden_size)};
  layer.forward({&seg, 1}, hidden.data(), out.data(), path);
  return out;
}

// |a - b| <= tol * max|expected| everywhere, cosine >= min_cos.
void expect_close(const std::vector<float>& expected, const std::vector<float>& actual, double tol, double min_cos) {
  double max_abs = 0;
  for (const float v : expected) max_abs = std::max(max_abs, double(std::fabs(v)));
  const std::vector<double> e(expected.begin(), expected.end()), a(actual.begin(), actual.end());
  EXPECT_EQ(test::compare(e, a, tol * max_abs, 0, min_cos), "");
}

// bf16 queries, cache and attention output bound the absorbed path's error (measured: ~3e-3 of the output's size).
constexpr double kBf16Tol = 1e-2, kBf16Cos = 0.9999;

struct PathCase {
  const char* name;
  AttentionSpec spec;
};
void PrintTo(const PathCase& c, std::ostream* os) { *os << c.name; }

class LayerPaths : public ::testing::TestWithParam<PathCase> {};

TEST_P(LayerPaths, AbsorbedDecodeEqualsUnabsorbedPrefill) {
  const AttentionSpec& spec = GetParam().spec;
  const std::vector<float> hidden = random_hidden(1, 13, spec.hidden_size);
  MlaLayer reference(random_weights(spec, 7), {.num_blocks = 8, .block_size = 4});
  MlaLayer layer(random_weights(spec, 7), {.num_blocks = 8, .block_size = 4});
  const std::vector<float> expected = prefill(reference, reference.add_request(), hidden, AttentionPath::unabsorbed);
  expect_close(expected, decode_steps(layer, layer.add_request(), hidden), kBf16Tol, kBf16Cos);
}

TEST_P(LayerPaths, DecodeStepByStepEqualsChunkedPrefill) {
  const AttentionSpec& spec = GetParam().spec;
  const std::vector<float> hidden = random_hidden(2, 21, spec.hidden_size);
  MlaLayer stepped(random_weights(spec, 3), {.num_blocks = 8, .block_size = 4});
  MlaLayer chunked(random_weights(spec, 3), {.num_blocks = 8, .block_size = 4, .max_chunk_tokens = 5});
  // Same bf16 roundings on both sides: only fp32 summation order differs.
  expect_close(decode_steps(stepped, stepped.add_request(), hidden), prefill(chunked, chunked.add_request(), hidden),
               1e-3, 1 - 1e-7);
}

TEST_P(LayerPaths, BatchOfRequestsEqualsEachAlone) {
  const AttentionSpec& spec = GetParam().spec;
  const int d = spec.hidden_size;
  const std::vector<int> prompt = {9, 3, 14};
  std::vector<std::vector<float>> hidden, alone;
  for (size_t r = 0; r < prompt.size(); ++r) {
    hidden.push_back(random_hidden(10 + r, prompt[r] + 2, d));  // prompt, then two decode steps
    MlaLayer single(random_weights(spec, 5), {.num_blocks = 16, .block_size = 4});
    alone.push_back(prefill(single, single.add_request(), hidden[r]));
  }
  MlaLayer batched(random_weights(spec, 5), {.num_blocks = 16, .block_size = 4, .max_chunk_tokens = 8});
  std::vector<std::vector<float>> out(prompt.size());
  std::vector<LayerSegment> segs;
  std::vector<float> x, y;
  for (size_t r = 0; r < prompt.size(); ++r) {
    segs.push_back({batched.add_request(), prompt[r]});
    x.insert(x.end(), hidden[r].begin(), hidden[r].begin() + int64_t(prompt[r]) * d);
  }
  y.resize(x.size());
  batched.forward(segs, x.data(), y.data());  // mixed prompt lengths, chunks across requests
  for (size_t r = 0, row = 0; r < prompt.size(); row += prompt[r], ++r)
    out[r].assign(y.begin() + int64_t(row) * d, y.begin() + int64_t(row + prompt[r]) * d);
  for (int step = 0; step < 2; ++step) {
    x.clear();
    for (size_t r = 0; r < prompt.size(); ++r) {
      segs[r].num_tokens = 1;
      x.insert(x.end(), hidden[r].begin() + int64_t(prompt[r] + step) * d,
               hidden[r].begin() + int64_t(prompt[r] + step + 1) * d);
    }
    y.assign(x.size(), NAN);
    batched.forward(segs, x.data(), y.data());  // one decode token per request
    for (size_t r = 0; r < prompt.size(); ++r) out[r].insert(out[r].end(), y.begin() + r * d, y.begin() + (r + 1) * d);
  }
  for (size_t r = 0; r < prompt.size(); ++r) {
    SCOPED_TRACE("request " + std::to_string(r));
    EXPECT_EQ(batched.context_length(int(r)), prompt[r] + 2);
    // Chunks of other shapes reach OpenBLAS's GEMMs than the lone prefill, and which kernel a shape gets depends on
    // the CPU: a bf16 rounding of an intermediate can land the other way (cosine 1 - 4e-7 seen on a Zen 4 VM).
    expect_close(alone[r], out[r], 1e-3, 1 - 1e-6);
  }
}

AttentionSpec yarn_spec() {
  AttentionSpec s = tiny_spec(false, 0);
  s.rope = {.theta = 10000, .yarn = true, .factor = 40, .original_max_position_embeddings = 8, .beta_fast = 32,
            .beta_slow = 1, .mscale = 1, .mscale_all_dim = 1};
  s.softmax_scale = reference_softmax_scale(s.qk_head_dim(), s.rope);
  return s;
}

AttentionSpec interleaved_indexer_spec() {
  AttentionSpec s = tiny_spec(true);
  s.indexer->rope_style = RopeStyle::interleaved;  // GLM-5's indexer
  return s;
}

INSTANTIATE_TEST_SUITE_P(Specs, LayerPaths,
                         ::testing::Values(PathCase{"dense", tiny_spec(false)},
                                           PathCase{"dense_no_q_lora_yarn", yarn_spec()},
                                           PathCase{"dsa", tiny_spec(true)},
                                           PathCase{"dsa_interleaved_indexer", interleaved_indexer_spec()},
                                           PathCase{"pooled_no_rope", test::tiny_pooled_spec()}),
                         [](const auto& info) { return std::string(info.param.name); });

// `w` without its indexer: the same layer attending every position.
AttentionWeights without_indexer(AttentionWeights w) {
  w.spec.indexer.reset();
  w.indexer = {};
  return w;
}

// The outputs of one prompt of `tokens` random hidden states prefilled through the layer of `spec` (its indexer
// selecting) and through the same weights without the indexer (attending every position).
struct SparseAndDense {
  std::vector<float> sparse, dense;
};
SparseAndDense prefill_sparse_and_dense(const AttentionSpec& spec, int64_t tokens) {
  const std::vector<float> hidden = random_hidden(4, tokens, spec.hidden_size);
  MlaLayer dsa(random_weights(spec, 9), {.num_blocks = 8, .block_size = 4});
  MlaLayer mla(without_indexer(random_weights(spec, 9)), {.num_blocks = 8, .block_size = 4});
  return {prefill(dsa, dsa.add_request(), hidden), prefill(mla, mla.add_request(), hidden)};
}

TEST(Layer, DsaWithinTopkEqualsDense) {
  const AttentionSpec sparse = tiny_spec(true, 48, 16);
  const std::vector<float> hidden = random_hidden(4, 16, sparse.hidden_size);
  MlaLayer dsa(random_weights(sparse, 9), {.num_blocks = 8, .block_size = 4});
  MlaLayer mla(without_indexer(random_weights(sparse, 9)), {.num_blocks = 8, .block_size = 4});
  expect_close(prefill(mla, mla.add_request(), hidden), decode_steps(dsa, dsa.add_request(), hidden), 1e-3, 1 - 1e-7);
}

TEST(Layer, Fp8CachesStayCloseToBf16) {
  const AttentionSpec spec = tiny_spec(true, 48, 8);
  const std::vector<float> hidden = random_hidden(6, 12, spec.hidden_size);
  MlaLayer bf16(random_weights(spec, 2), {.num_blocks = 8, .block_size = 4});
  MlaLayer fp8(random_weights(spec, 2), {.num_blocks = 8, .block_size = 4, .kv_cache_dtype = DType::fp8_ds_mla,
                                         .index_cache_dtype = DType::fp8_e4m3});
  // e4m3 latents: about 2^-4 relative each; the selections (8 of up to 12) may differ on near-ties.
  expect_close(prefill(bf16, bf16.add_request(), hidden), decode_steps(fp8, fp8.add_request(), hidden), 0.1, 0.995);
}

TEST(Layer, DsaBeyondTopkAttendsFewerPositions) {
  // Past top-k the indexer drops positions, so the output differs from dense attention (and stays finite).
  const AttentionSpec sparse = tiny_spec(true, 48, 4);
  const auto [a, b] = prefill_sparse_and_dense(sparse, 12);
  const int d = sparse.hidden_size;
  double first = 0, last = 0;
  for (int i = 0; i < d; ++i) {
    ASSERT_TRUE(std::isfinite(a[11 * d + i]));
    first = std::max(first, double(std::fabs(a[3 * d + i] - b[3 * d + i])));
    last = std::max(last, double(std::fabs(a[11 * d + i] - b[11 * d + i])));
  }
  EXPECT_LT(first, 1e-3);  // position 3: 4 positions, all selected
  EXPECT_GT(last, 1e-3);
}

TEST(Layer, CacheFullIsAnErrorAndChangesNothing) {
  const AttentionSpec spec = tiny_spec(true);
  MlaLayer layer(random_weights(spec, 1), {.num_blocks = 3, .block_size = 4});
  const int a = layer.add_request(), b = layer.add_request();
  prefill(layer, a, random_hidden(1, 6, spec.hidden_size));  // 2 blocks
  EXPECT_EQ(layer.free_blocks(), 1);
  const std::vector<float> big = random_hidden(2, 5, spec.hidden_size);
  std::vector<float> out(big.size());
  const LayerSegment seg{b, 5};
  try {
    layer.forward({&seg, 1}, big.data(), out.data());
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("KV cache full: the batch needs 2 more blocks of 4 tokens, 1 of 3 are free"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(layer.context_length(b), 0);
  EXPECT_EQ(layer.free_blocks(), 1);
  layer.release_request(a);
  EXPECT_EQ(layer.free_blocks(), 3);
  layer.forward({&seg, 1}, big.data(), out.data());
  EXPECT_EQ(layer.context_length(b), 5);
  test::expect_error([&] { layer.context_length(a); }, ErrorKind::invalid_argument,
                     {"MlaLayer: context_length: no live request " + std::to_string(a)});
}

TEST(Layer, AppendContextGrowsTheContextOrFails) {
  const AttentionSpec spec = tiny_spec(true);
  MlaLayer layer(random_weights(spec, 1), {.num_blocks = 3, .block_size = 4});
  Rng rng(3);
  const std::vector<float> latent = test::random_floats(rng, 10 * 512), k_pe = test::random_floats(rng, 10 * 64),
                           index_k = test::random_floats(rng, 10 * 128);
  const int a = layer.add_request(), b = layer.add_request();
  layer.append_context(a, 10, latent.data(), k_pe.data(), index_k.data());
  EXPECT_EQ(layer.context_length(a), 10);
  EXPECT_EQ(layer.free_blocks(), 0);
  test::expect_error([&] { layer.append_context(b, 1, latent.data(), k_pe.data(), index_k.data()); },
                     ErrorKind::invalid_argument, {"MlaLayer: KV cache full: the batch needs 1 more blocks"});
  EXPECT_EQ(layer.context_length(b), 0);
  const std::vector<float> out = decode_steps(layer, a, random_hidden(4, 2, spec.hidden_size));
  for (const float v : out) ASSERT_TRUE(std::isfinite(v));
  EXPECT_EQ(layer.context_length(a), 12);
}

// The rows a pooled layer caches for a prompt, computed here in float64 from the weights: latents (normed c) and
// per token the index key (LayerNorm of x @ wk^T) then the gate scores (x @ kpool_gate^T).
struct PooledRows {
  std::vector<float> latent, index_k;
};
PooledRows pooled_rows(const AttentionWeights& w, const std::vector<float>& hidden) {
  const int64_t d = w.spec.hidden_size, tokens = int64_t(hidden.size()) / d, dim = 128;
  const auto dot = [&](const WeightTensor& m, int64_t row, int64_t t) {
    double sum = 0;
    for (int64_t i = 0; i < d; ++i) sum += double(m.data[row * d + i]) * hidden[t * d + i];
    return sum;
  };
  PooledRows rows;
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<double> c(512), k(dim);
    double squares = 0, mean = 0, var = 0;
    for (int64_t i = 0; i < 512; ++i) squares += (c[i] = dot(w.kv_a_mqa, i, t)) * c[i];
    for (int64_t i = 0; i < 512; ++i)
      rows.latent.push_back(float(c[i] / std::sqrt(squares / 512 + w.spec.rms_norm_eps) * w.kv_a_norm.data[i]));
    for (int64_t i = 0; i < dim; ++i) mean += (k[i] = dot(w.indexer.wk, i, t)) / dim;
    for (int64_t i = 0; i < dim; ++i) var += (k[i] - mean) * (k[i] - mean) / dim;
    for (int64_t i = 0; i < dim; ++i)
      rows.index_k.push_back(
          float((k[i] - mean) / std::sqrt(var + 1e-6) * w.indexer.k_norm.data[i] + w.indexer.k_norm_bias.data[i]));
    for (int64_t i = 0; i < dim; ++i) rows.index_k.push_back(float(dot(w.indexer.kpool_gate, i, t)));
  }
  return rows;
}

TEST(Layer, PooledAppendContextEqualsThePromptsForward) {
  // 10 tokens: 2 whole pools and a tail of 2, which the decode steps complete (the pool's first tokens imported).
  const AttentionSpec spec = test::tiny_pooled_spec(8);
  const std::vector<float> prompt = random_hidden(5, 10, spec.hidden_size),
                           steps = random_hidden(6, 3, spec.hidden_size);
  MlaLayer forwarded(random_weights(spec, 4), {.num_blocks = 8, .block_size = 4});
  MlaLayer imported(random_weights(spec, 4), {.num_blocks = 8, .block_size = 4});
  const int a = forwarded.add_request(), b = imported.add_request();
  prefill(forwarded, a, prompt);
  const PooledRows rows = pooled_rows(random_weights(spec, 4), prompt);
  imported.append_context(b, 10, rows.latent.data(), nullptr, rows.index_k.data());
  // Only the bf16 roundings of cache rows computed in float32 vs float64 differ.
  expect_close(decode_steps(forwarded, a, steps), decode_steps(imported, b, steps), 1e-3, 1 - 1e-6);
}

TEST(Layer, PooledBeyondTopkAttendsFewerPositions) {
  // top-k 4 = one pool of 4 (plus the tail): at 12 tokens some pools are left out, so dense attention differs.
  const AttentionSpec pooled = test::tiny_pooled_spec(4);
  const auto [a, b] = prefill_sparse_and_dense(pooled, 12);
  const int d = pooled.hidden_size;
  double early = 0, last = 0;
  for (int t = 0; t < 12; ++t)
    for (int i = 0; i < d; ++i) {
      ASSERT_TRUE(std::isfinite(a[t * d + i]));
      if (t < 7) early = std::max(early, double(std::fabs(a[t * d + i] - b[t * d + i])));
      if (t == 11) last = std::max(last, double(std::fabs(a[t * d + i] - b[t * d + i])));
    }
  EXPECT_LT(early, 1e-3);  // positions 0..6: at most one whole pool and the tail, all attended
  EXPECT_GT(last, 1e-3);
}

TEST(Layer, PooledGeometryErrorsNameTheField) {
  const AttentionSpec spec = test::tiny_pooled_spec();
  test::expect_error([&] { MlaLayer layer(random_weights(spec, 1), {.block_size = 6}); }, ErrorKind::invalid_argument,
                     {"MlaLayer: options.block_size: a pooled indexer needs a multiple of index_kpool 4 (a pool's "
                      "tokens share a block), got 6"});
  AttentionSpec no_tail = spec;
  no_tail.indexer->always_select_tail = false;
  test::expect_error([&] { MlaLayer layer(random_weights(no_tail, 1)); }, ErrorKind::invalid_argument,
                     {"needs index_kpool_always_select_tail true"});
  test::expect_error([&] { MlaLayer layer(random_weights(test::tiny_pooled_spec(6), 1)); },
                     ErrorKind::invalid_argument, {"MlaLayer: spec: index_topk 6 must be a multiple of index_kpool 4"});
  AttentionWeights w = random_weights(spec, 1);
  w.indexer.kpool_gate = {};
  test::expect_error([&] { MlaLayer layer(w); }, ErrorKind::invalid_argument,
                     {"MlaLayer: weights.indexer.kpool_gate: expected shape [128, 64], got []"});
  w = random_weights(spec, 1);
  w.indexer.kpool_ape.shape = {2, 128};
  test::expect_error([&] { MlaLayer layer(w); }, ErrorKind::invalid_argument,
                     {"MlaLayer: weights.indexer.kpool_ape: expected shape [4, 128], got [2, 128]"});
  MlaLayer layer(random_weights(spec, 1), {.num_blocks = 2, .block_size = 4});
  const std::vector<float> latent(512, 0.5f);
  test::expect_error([&] { layer.append_context(layer.add_request(), 1, latent.data(), nullptr, nullptr); },
                     ErrorKind::invalid_argument, {"MlaLayer: append_context: a DSA model needs index_k"});
  AttentionSpec with_rope = tiny_spec(true);
  MlaLayer roped(random_weights(with_rope, 1), {.num_blocks = 2, .block_size = 4});
  test::expect_error([&] { roped.append_context(roped.add_request(), 1, latent.data(), nullptr, latent.data()); },
                     ErrorKind::invalid_argument, {"MlaLayer: append_context: a head with a rope part needs k_pe"});
}

TEST(Layer, BadWeightsNameTheTensor) {
  const AttentionSpec spec = tiny_spec(true);
  AttentionWeights w = random_weights(spec, 1);
  w.q_b.shape = {4 * 96, 47};
  test::expect_error([&] { MlaLayer layer(w); },
                     ErrorKind::invalid_argument, {"MlaLayer: weights.q_b: expected shape [384, 48], got [384, 47]"});
  w = random_weights(spec, 1);
  w.indexer.wk = {};
  test::expect_error([&] { MlaLayer layer(w); },
                     ErrorKind::invalid_argument, {"weights.indexer.wk: expected shape [128, 64], got []"});
  w = random_weights(spec, 1);
  w.kv_a_norm.data.pop_back();
  test::expect_error([&] { MlaLayer layer(w); },
                     ErrorKind::invalid_argument, {"weights.kv_a_norm: shape [512] but 511 values"});
  AttentionSpec small = spec;
  small.kv_lora_rank = 256;
  test::expect_error([&] { MlaLayer layer(random_weights(small, 1)); },
                     ErrorKind::invalid_argument, {"kv_lora_rank 512"});
}

TEST(Layer, OptionsNameTheArgumentAtFault) {
  const AttentionSpec spec = tiny_spec(true);
  const Backend& cuda_mma = *Registry::global().find("cuda_mma");
  test::expect_error([&] { MlaLayer layer(random_weights(spec, 1), {.backend = &cuda_mma}); },
                     ErrorKind::invalid_argument,
                     {"MlaLayer: options.backend: 'cuda_mma' runs on CUDA GPUs, not on options.device cpu"});
  int not_a_stream = 0;
  test::expect_error([&] { MlaLayer layer(random_weights(spec, 1), {.stream = &not_a_stream}); },
                     ErrorKind::invalid_argument,
                     {"MlaLayer: options.stream: a CUDA stream needs a CUDA options.device, got cpu"});
  test::expect_error([&] { MlaLayer layer(random_weights(spec, 1), {.kv_cache_dtype = DType::f32}); },
                     ErrorKind::invalid_argument,
                     {"MlaLayer: options.kv_cache_dtype: expected bfloat16, float16 or fp8_ds_mla, got float32"});
  // The ops take fp8_ds_mla_nope, but the layer's head has a rope part that it cannot hold.
  test::expect_error([&] { MlaLayer layer(random_weights(spec, 1), {.kv_cache_dtype = DType::fp8_ds_mla_nope}); },
                     ErrorKind::invalid_argument,
                     {"MlaLayer: options.kv_cache_dtype: expected bfloat16, float16 or fp8_ds_mla, got fp8_ds_mla_nope"});
  // DeepSeek-V4's cache fits a rope-free head's row, but its 448 + 64 split is V4's head, which the layer does not
  // run (it needs a 512-wide latent): refused even where fp8_ds_mla_nope is taken.
  test::expect_error([&] { MlaLayer layer(random_weights(spec, 1), {.kv_cache_dtype = DType::fp8_ds_mla_v4}); },
                     ErrorKind::invalid_argument,
                     {"MlaLayer: options.kv_cache_dtype: expected bfloat16, float16 or fp8_ds_mla, got fp8_ds_mla_v4"});
  test::expect_error(
      [&] { MlaLayer layer(random_weights(test::tiny_pooled_spec(), 1), {.kv_cache_dtype = DType::fp8_ds_mla_v4}); },
      ErrorKind::invalid_argument,
      {"MlaLayer: options.kv_cache_dtype: expected bfloat16, float16, fp8_ds_mla or fp8_ds_mla_nope, "
       "got fp8_ds_mla_v4"});
  EXPECT_EQ(attention_query_dtype(DType::f16), DType::f16);
  for (DType kv : {DType::bf16, DType::fp8_ds_mla}) EXPECT_EQ(attention_query_dtype(kv), DType::bf16);
  test::expect_error([&] { MlaLayer layer(random_weights(spec, 1), {.index_cache_dtype = DType::f16}); },
                     ErrorKind::invalid_argument, {"MlaLayer: options.index_cache_dtype: expected", "got float16"});
  // More heads than any backend runs: the forced backend, and the selector, say why.
  AttentionSpec wide = tiny_spec(false);
  wide.num_heads = 130;
  const Backend& cpu = *Registry::global().find("cpu");
  test::expect_error([&] { MlaLayer layer(random_weights(wide, 1), {.backend = &cpu}); }, ErrorKind::unsupported,
                     {"MlaLayer: options.backend: 'cpu' cannot run tiny on cpu:", "130"});
  test::expect_error([&] { MlaLayer layer(random_weights(wide, 1)); }, ErrorKind::unsupported,
                     {"MlaLayer: options.backend (none given): no valid attention backend for tiny on cpu"});
}

TEST(Layer, RunsOnTheSelectorsBackendByDefault) {
  const MlaLayer layer(random_weights(tiny_spec(false), 1));
  EXPECT_EQ(layer.backend().name(), "cpu");
  EXPECT_TRUE(layer.device().is_cpu());
}

TEST(Layer, CudaDeviceWithoutAGpuIsAnError) {
  if (detect_device().is_cuda()) GTEST_SKIP() << "this machine has a GPU: tests/gpu runs the layer on it";
  // A build without CUDA says so; a CUDA build on a machine without a GPU finds no device 0.
  test::expect_error([&] { MlaLayer layer(random_weights(tiny_spec(true), 1), {.device = Device::cuda(90)}); },
                     ErrorKind::invalid_argument, {"MlaLayer: options.device: "});
}

TEST(Layer, BadCallsAreErrors) {
  const AttentionSpec spec = tiny_spec(true, 48, 4);
  MlaLayer layer(random_weights(spec, 1), {.num_blocks = 4, .block_size = 4});
  const int r = layer.add_request();
  const std::vector<float> x = random_hidden(1, 6, spec.hidden_size);
  std::vector<float> out(x.size());
  const LayerSegment twice[] = {{r, 1}, {r, 1}};
  test::expect_error([&] { layer.forward(twice, x.data(), out.data()); },
                     ErrorKind::invalid_argument, {"request 0 appears twice"});
  test::expect_error([&] { prefill(layer, r, x, AttentionPath::unabsorbed); },
                     ErrorKind::invalid_argument, {"a DSA prompt must fit in top-k (4)"});
  const LayerSegment missing{7, 1};
  test::expect_error([&] { layer.forward({&missing, 1}, x.data(), out.data()); },
                     ErrorKind::invalid_argument, {"no live request 7"});
}

}  // namespace
}  // namespace smla
