// MlaLayer on the GPU against the same layer on the CPU (tests/cpu/test_layer.cpp checks that one against the
// unabsorbed fp32 path, tests/layer against transformers): deepseek_v3, deepseek_v32 and glm_moe_dsa geometries with
// bf16, f16 and fp8 caches; a batch of prompts of different lengths (one longer than max_chunk_tokens, one past
// top-k) in one call, then decode steps; imported context; the profile; the cache-full error; the option errors.
// The GPU's outputs are NaN-poisoned before every call.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "gpu/gpu_util.h"
#include "smla/layer.h"
#include "support/layer_util.h"
#include "support/test_util.h"

namespace smla {
namespace {

using test::random_hidden;
using test::random_weights;
using test::tiny_spec;

// The GPU holds bf16 weights and rounds every product's input to bf16 (2^-9 relative each), where the CPU stays
// fp32; along q_a, q_b, W_UK, W_UV and o_proj that adds up to about 0.5% of the largest output (measured on H200:
// see docs/layer.md). 2% leaves room without hiding a wrong head, norm or RoPE (those miss by 10-100%). An fp8 cache
// quantises latents that differ by that much, so an e4m3 rounding may fall the other way: 4%.
constexpr double kTol = 2e-2, kFp8Tol = 4e-2, kMinCos = 0.999;
// Past top-k the indexer chooses positions from scores that differ by the same rounding, so a row may swap a
// near-tie; such rows (at most a quarter of those past top-k, rounded up) need only stay within kSwapTol.
constexpr double kSwapTol = 0.25;

struct LayerCase {
  const char* name;
  AttentionSpec spec;
  DType kv_cache = DType::bf16, index_cache = DType::bf16;
};
void PrintTo(const LayerCase& c, std::ostream* os) { *os << c.name; }

constexpr int kTopk = 32;

AttentionSpec with_yarn(AttentionSpec s) {
  s.rope = {.theta = 10000, .yarn = true, .factor = 40, .original_max_position_embeddings = 8, .beta_fast = 32,
            .beta_slow = 1, .mscale = 1, .mscale_all_dim = 1};
  s.softmax_scale = reference_softmax_scale(s.qk_head_dim(), s.rope);
  return s;
}
AttentionSpec deepseek_v3(int q_lora_rank = 48) { return with_yarn(tiny_spec(false, q_lora_rank)); }
AttentionSpec deepseek_v32() {
  AttentionSpec s = with_yarn(tiny_spec(true, 48, kTopk));
  s.model_type = "deepseek_v32";
  return s;
}
AttentionSpec glm_moe_dsa() {
  AttentionSpec s = tiny_spec(true, 48, kTopk);
  s.qk_nope_head_dim = 192;
  s.v_head_dim = 256;
  s.rope.theta = 1e6;
  s.indexer->rope_style = RopeStyle::interleaved;
  s.softmax_scale = reference_softmax_scale(s.qk_head_dim(), s.rope);
  return s;
}

// GLM-5.3-Flash: no rope part (512-wide absorbed head), its nope / v widths, the pooled indexer (kpool 4, tail).
AttentionSpec glm5_next() {
  AttentionSpec s = test::tiny_pooled_spec(kTopk);
  s.qk_nope_head_dim = 256;
  s.v_head_dim = 256;
  s.softmax_scale = reference_softmax_scale(s.qk_head_dim(), s.rope);
  return s;
}

Device gpu_device() { return detect_device(); }

// A non-default stream for the lifetime of the object.
class Stream {
 public:
  Stream() { EXPECT_EQ(cudaStreamCreate(&stream_), cudaSuccess); }
  ~Stream() { cudaStreamDestroy(stream_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// Runs `segments` on both layers (hidden rows from the host; the GPU's through device memory) and appends both
// outputs.
void forward_both(MlaLayer& cpu, MlaLayer& gpu, const std::vector<LayerSegment>& segments,
                  const std::vector<float>& hidden, std::vector<float>& cpu_out, std::vector<float>& gpu_out,
                  LayerProfile* profile = nullptr) {
  std::vector<float> out(hidden.size());
  cpu.forward(segments, hidden.data(), out.data());
  cpu_out.insert(cpu_out.end(), out.begin(), out.end());
  DeviceBuffer x(hidden), y(hidden.size() * sizeof(float));
  CUDA_OK(cudaMemset(y.ptr, 0xff, y.bytes));  // NaN: every value must be written
  gpu.forward(segments, static_cast<const float*>(x.ptr), static_cast<float*>(y.ptr), AttentionPath::absorbed,
              profile);
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> g = y.download<float>();
  gpu_out.insert(gpu_out.end(), g.begin(), g.end());
}

// Every row within tol of the CPU's largest output, except rows flagged `may_swap` (tokens past top-k of a DSA
// model), of which a quarter (rounded up) may reach kSwapTol; cosine over everything. Prints the measured error.
void expect_close_rows(const std::vector<float>& cpu, const std::vector<float>& gpu, int width,
                       const std::vector<bool>& may_swap, double tol, const char* what) {
  ASSERT_EQ(cpu.size(), gpu.size());
  double scale = 0, dot = 0, nc = 0, ng = 0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    scale = std::max(scale, double(std::fabs(cpu[i])));
    dot += double(cpu[i]) * gpu[i];
    nc += double(cpu[i]) * cpu[i];
    ng += double(gpu[i]) * gpu[i];
  }
  const size_t rows = cpu.size() / width;
  double worst = 0, worst_kept = 0;
  int swapped = 0, swappable = 0;
  for (size_t r = 0; r < rows; ++r) {
    double err = 0;
    for (int i = 0; i < width; ++i) {
      const float g = gpu[r * width + i];
      err = std::isfinite(g) ? std::max(err, double(std::fabs(g - cpu[r * width + i]))) : INFINITY;
    }
    err /= scale;
    worst = std::max(worst, err);
    swappable += may_swap[r];
    if (may_swap[r] && err > tol) {
      ++swapped;
      EXPECT_LE(err, kSwapTol) << what << ": row " << r << " (past top-k)";
    } else {
      worst_kept = std::max(worst_kept, err);
      EXPECT_LE(err, tol) << what << ": row " << r;
    }
  }
  EXPECT_LE(swapped, (swappable + 3) / 4) << what << ": rows past top-k off by more than " << tol;
  const double cosine = dot / std::sqrt(nc * ng);
  EXPECT_GE(cosine, kMinCos) << what;
  std::printf("[ measured ] %s: max error %.2e of max |out| %.3g (%.2e outside %d of %d rows past top-k), "
              "cosine %.7f\n",
              what, worst, scale, worst_kept, swapped, swappable, cosine);
}

class CudaLayer : public ::testing::TestWithParam<LayerCase> {};

TEST_P(CudaLayer, PrefillThenDecodeMatchesCpu) {
  const LayerCase& c = GetParam();
  const AttentionSpec& spec = c.spec;
  const int d = spec.hidden_size;
  const LayerOptions options{.num_blocks = 24, .block_size = 8, .kv_cache_dtype = c.kv_cache,
                             .index_cache_dtype = c.index_cache, .max_chunk_tokens = 16};
  const Stream stream;  // declared before the layer, which must not outlive it
  LayerOptions on_gpu = options;
  on_gpu.device = gpu_device();
  on_gpu.stream = stream.get();
  MlaLayer cpu(random_weights(spec, 11), options), gpu(random_weights(spec, 11), on_gpu);
  EXPECT_EQ(gpu.backend().name(), "cuda_mma");
  EXPECT_EQ(gpu.device(), gpu_device());

  // Prompts of 5, 23 and 34 tokens (34 > max_chunk_tokens 16 and > top-k 32) in one call, then 4 decode steps.
  // Contexts just past top-k leave the indexer few positions to drop, so near-tie swaps stay rare.
  const std::vector<int> prompt = {5, 23, 34};
  constexpr int kSteps = 4;
  std::vector<LayerSegment> segments;
  std::vector<bool> may_swap;  // per output row: its context is longer than top-k
  const auto note_rows = [&](int request, int first, int count) {
    for (int p = first; p < first + count; ++p) may_swap.push_back(spec.is_sparse() && p + 1 > spec.indexer->topk);
    segments.push_back({request, count});
  };
  for (int p : prompt) {
    const int a = cpu.add_request();
    ASSERT_EQ(gpu.add_request(), a);
    note_rows(a, 0, p);
  }
  int tokens = 0;
  for (int p : prompt) tokens += p;
  std::vector<float> cpu_out, gpu_out;
  forward_both(cpu, gpu, segments, random_hidden(21, tokens, d), cpu_out, gpu_out);
  for (int step = 0; step < kSteps; ++step) {
    segments.clear();
    for (size_t r = 0; r < prompt.size(); ++r) note_rows(int(r), prompt[r] + step, 1);
    forward_both(cpu, gpu, segments, random_hidden(30 + step, int64_t(prompt.size()), d), cpu_out, gpu_out);
  }
  for (size_t r = 0; r < prompt.size(); ++r) EXPECT_EQ(gpu.context_length(int(r)), prompt[r] + kSteps);
  EXPECT_EQ(gpu.free_blocks(), cpu.free_blocks());
  expect_close_rows(cpu_out, gpu_out, d, may_swap, is_fp8_mla_cache(c.kv_cache) ? kFp8Tol : kTol, c.name);
}

INSTANTIATE_TEST_SUITE_P(
    Models, CudaLayer,
    ::testing::Values(LayerCase{"deepseek_v3_bf16", deepseek_v3()},
                      LayerCase{"deepseek_v3_no_q_lora_f16", deepseek_v3(0), DType::f16},
                      LayerCase{"deepseek_v3_fp8", deepseek_v3(), DType::fp8_ds_mla},
                      LayerCase{"deepseek_v32_bf16", deepseek_v32()},
                      LayerCase{"deepseek_v32_fp8_fp8_index", deepseek_v32(), DType::fp8_ds_mla, DType::fp8_e4m3},
                      LayerCase{"glm_moe_dsa_bf16", glm_moe_dsa()},
                      LayerCase{"glm_moe_dsa_fp8", glm_moe_dsa(), DType::fp8_ds_mla},
                      LayerCase{"glm5_next_bf16", glm5_next()},
                      LayerCase{"glm5_next_f16", glm5_next(), DType::f16},
                      LayerCase{"glm5_next_fp8_envelope", glm5_next(), DType::fp8_ds_mla},
                      LayerCase{"glm5_next_fp8_nope_fp8_index", glm5_next(), DType::fp8_ds_mla_nope, DType::fp8_e4m3}),
    [](const auto& info) { return std::string(info.param.name); });

// `context` imported tokens (random cache rows: the latent, k_pe where the head has a rope part, the index key and,
// for a pooled indexer, its gate scores), then 3 decode steps of one token: the GPU layer's outputs match the CPU's
// (every step's row flagged `may_swap`).
void expect_imported_context_then_decode(const AttentionSpec& spec, int context, uint64_t rows_seed,
                                         uint64_t hidden_seed, bool may_swap, const char* what) {
  const int d = spec.hidden_size;
  const LayerOptions options{.num_blocks = 16, .block_size = 8};
  LayerOptions on_gpu = options;
  on_gpu.device = gpu_device();
  MlaLayer cpu(random_weights(spec, 5), options), gpu(random_weights(spec, 5), on_gpu);
  test::Rng rng(rows_seed);
  const bool rope = spec.qk_rope_head_dim > 0;
  const int index_width = (spec.indexer->kpool > 1 ? 2 : 1) * kIndexHeadDim;
  const std::vector<float> latent = test::random_floats(rng, context * 512),
                           k_pe = test::random_floats(rng, context * spec.qk_rope_head_dim),
                           index_k = test::random_floats(rng, context * index_width);
  const DeviceBuffer latent_d(latent), k_pe_d(k_pe), index_k_d(index_k);
  const int a = cpu.add_request();
  ASSERT_EQ(gpu.add_request(), a);
  cpu.append_context(a, context, latent.data(), rope ? k_pe.data() : nullptr, index_k.data());
  gpu.append_context(a, context, static_cast<const float*>(latent_d.ptr),
                     rope ? static_cast<const float*>(k_pe_d.ptr) : nullptr, static_cast<const float*>(index_k_d.ptr));
  std::vector<float> cpu_out, gpu_out;
  for (int step = 0; step < 3; ++step)
    forward_both(cpu, gpu, {{a, 1}}, random_hidden(hidden_seed + step, 1, d), cpu_out, gpu_out);
  EXPECT_EQ(gpu.context_length(a), context + 3);
  expect_close_rows(cpu_out, gpu_out, d, std::vector<bool>(3, may_swap), kTol, what);
}

TEST(CudaLayerContext, ImportedContextThenDecodeMatchesCpu) {
  // 28 imported tokens + 3 steps: within top-k, so every position is attended.
  expect_imported_context_then_decode(glm_moe_dsa(), 28, 8, 40, false, "imported context");
}

TEST(CudaLayerContext, PooledImportedContextThenDecodeMatchesCpu) {
  // 38 imported tokens (9 whole pools and a tail of 2 the decode steps complete), then 3 steps past top-k 32.
  expect_imported_context_then_decode(glm5_next(), 38, 9, 50, true, "pooled imported context");
}

TEST(CudaLayerContext, ProfileSplitsTheStepAndChangesNothing) {
  const AttentionSpec spec = glm_moe_dsa();
  const int d = spec.hidden_size;
  LayerOptions options{.num_blocks = 16, .block_size = 8};
  MlaLayer cpu(random_weights(spec, 6), options);
  options.device = gpu_device();
  MlaLayer gpu(random_weights(spec, 6), options);
  const std::vector<LayerSegment> prompt = {{cpu.add_request(), 20}};
  ASSERT_EQ(gpu.add_request(), prompt[0].request);
  std::vector<float> cpu_out, gpu_out;
  LayerProfile p;
  forward_both(cpu, gpu, prompt, random_hidden(3, 20, d), cpu_out, gpu_out, &p);
  expect_close_rows(cpu_out, gpu_out, d, std::vector<bool>(20, false), kTol, "profiled prefill");
  for (const double seconds : {p.projections, p.rope, p.cache_write, p.indexer, p.topk, p.attention, p.output})
    EXPECT_GT(seconds, 0);
  EXPECT_LT(p.projections + p.rope + p.cache_write + p.indexer + p.topk + p.attention + p.output, 5.0);
}

TEST(CudaLayerErrors, CacheFullChangesNothing) {
  const AttentionSpec spec = tiny_spec(true);
  MlaLayer layer(random_weights(spec, 1), {.num_blocks = 3, .block_size = 4, .device = gpu_device()});
  const int a = layer.add_request(), b = layer.add_request();
  DeviceBuffer x(random_hidden(1, 6, spec.hidden_size)), y(6 * spec.hidden_size * sizeof(float));
  const auto run = [&](int request, int tokens) {
    const LayerSegment seg{request, tokens};
    layer.forward({&seg, 1}, static_cast<const float*>(x.ptr), static_cast<float*>(y.ptr));
  };
  run(a, 6);  // 2 blocks
  test::expect_error([&] { run(b, 5); }, ErrorKind::invalid_argument,
                     {"MlaLayer: KV cache full: the batch needs 2 more blocks of 4 tokens, 1 of 3 are free"});
  EXPECT_EQ(layer.context_length(b), 0);
  EXPECT_EQ(layer.free_blocks(), 1);
  layer.release_request(a);
  CUDA_OK(cudaMemset(y.ptr, 0xff, y.bytes));  // NaN: the run below must write every output
  run(b, 5);
  EXPECT_EQ(layer.context_length(b), 5);
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> out = y.download<float>();
  for (size_t i = 0; i < 5 * static_cast<size_t>(spec.hidden_size); ++i) ASSERT_TRUE(std::isfinite(out[i])) << i;
}

TEST(CudaLayerErrors, OptionsThatDoNotFitTheDeviceNameTheOption) {
  const AttentionSpec spec = tiny_spec(true);
  const Device device = gpu_device();
  test::expect_error([&] { MlaLayer layer(random_weights(spec, 1), {.device = device, .backend = &cpu()}); },
                     ErrorKind::invalid_argument,
                     {"MlaLayer: options.backend: 'cpu' runs on the CPU, not on options.device " + device.name()});
  test::expect_error([&] { MlaLayer layer(random_weights(spec, 1), {.backend = &gpu()}); },
                     ErrorKind::invalid_argument,
                     {"MlaLayer: options.backend: 'cuda_mma' runs on CUDA GPUs, not on options.device cpu"});
  const Device other_arch = Device::cuda(device.compute_capability == 80 ? 90 : 80, device.index);
  test::expect_error([&] { MlaLayer layer(random_weights(spec, 1), {.device = other_arch}); },
                     ErrorKind::invalid_argument,
                     {"MlaLayer: options.device: " + other_arch.name() + " asked for, but CUDA device"});
  test::expect_error([&] { MlaLayer layer(random_weights(spec, 1), {.device = Device::cuda(0, 99)}); },
                     ErrorKind::invalid_argument, {"MlaLayer: options.device: no CUDA device 99"});
  // Top-k past what the GPU indexer selects: the selector says which backend could run it.
  AttentionSpec wide = spec;
  wide.indexer->topk = 10000;
  test::expect_error([&] { MlaLayer layer(random_weights(wide, 1), {.device = device}); }, ErrorKind::unsupported,
                     {"MlaLayer: options.backend (none given): no valid attention backend for tiny on " +
                      device.name()});
  MlaLayer layer(random_weights(spec, 1), {.device = device});
  const LayerSegment seg{layer.add_request(), 2};
  DeviceBuffer x(random_hidden(1, 2, spec.hidden_size)), y(2 * spec.hidden_size * sizeof(float));
  test::expect_error(
      [&] {
        layer.forward({&seg, 1}, static_cast<const float*>(x.ptr), static_cast<float*>(y.ptr),
                      AttentionPath::unabsorbed);
      },
      ErrorKind::invalid_argument, {"MlaLayer: forward: the unabsorbed path runs on the CPU only"});
}

}  // namespace
}  // namespace smla
