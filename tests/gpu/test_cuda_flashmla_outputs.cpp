// The outputs FlashMLA's layouts need, from the CUDA kernels: sparse_mla's max_logits against the float64
// reference, lse +inf for rows with nothing to attend (empty_lse_plus_inf), lse and max_logits written through
// transposed views; with the keys split over CTAs (a caller workspace, the combine kernel) and without.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "gpu_util.h"
#include "reference/mla_reference.h"
#include "smla/ops.h"
#include "support/test_util.h"

namespace smla {
namespace {

using test::Rng;
constexpr double kInf = std::numeric_limits<double>::infinity();

struct Case {
  int64_t tokens, heads, topk;
  bool expect_split;
};

void run_case(const Case& c) {
  SCOPED_TRACE("T " + std::to_string(c.tokens) + ", H " + std::to_string(c.heads) + ", K " + std::to_string(c.topk));
  constexpr int64_t kBlocks = 64, kBlockSize = 64, kSlots = kBlocks * kBlockSize;
  const int64_t T = c.tokens, H = c.heads, K = c.topk;
  Rng rng(T * 1000 + K);
  const auto cache = test::to_half_bits(test::random_floats(rng, kSlots * kMlaQkDim), DType::bf16);
  const auto q = test::to_half_bits(test::random_floats(rng, T * H * kMlaQkDim, -2.f, 2.f), DType::bf16);
  std::vector<int32_t> indices(T * K);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k)
      indices[t * K + k] = t == T - 1 ? -1 : rng() % 9 == 0 ? int32_t{kSlots} : static_cast<int32_t>(rng() % kSlots);
  DeviceBuffer d_cache(cache), d_q(q), d_indices(indices);
  DeviceBuffer d_out(T * H * kMlaVDim * 2), d_lse(T * H * 4), d_max(T * H * 4), d_lse_plain(T * H * 4);
  const Device gpu0 = Device::cuda(0, 0);

  SparseMlaArgs a;
  a.q = TensorView(d_q.ptr, {T, H, kMlaQkDim}, DType::bf16, gpu0);
  a.kv_cache = TensorView(d_cache.ptr, {kBlocks, kBlockSize, kMlaQkDim}, DType::bf16, gpu0);
  a.indices = TensorView(d_indices.ptr, {T, K}, DType::i32, gpu0);
  a.softmax_scale = 0.05f;
  a.out = TensorView(d_out.ptr, {T, H, kMlaVDim}, DType::bf16, gpu0);
  a.lse = TensorView(d_lse.ptr, {T, H}, {1, T}, DType::f32, gpu0);  // [T, H] views of [H, T] buffers
  a.max_logits = TensorView(d_max.ptr, {T, H}, {1, T}, DType::f32, gpu0);
  a.empty_lse_plus_inf = true;
  const size_t bytes = workspace_size(a, &gpu());
  if (c.expect_split) EXPECT_GT(bytes, 0u) << "meant to split the keys";
  DeviceBuffer ws(bytes);
  if (bytes) a.workspace = TensorView(ws.ptr, {static_cast<int64_t>(bytes)}, DType::u8, gpu0);
  CUDA_OK(cudaMemset(d_max.ptr, 0x7f, T * H * 4));
  CUDA_OK(cudaMemset(d_lse.ptr, 0x7f, T * H * 4));
  sparse_mla(a, &gpu());
  CUDA_OK(cudaDeviceSynchronize());
  const auto out = d_out.download<uint16_t>();
  const auto lse = d_lse.download<float>(), max_logits = d_max.download<float>();

  // The same call with the default layout and convention: the same out, the same lse but for empty rows.
  SparseMlaArgs plain = a;
  plain.lse = TensorView(d_lse_plain.ptr, {T, H}, DType::f32, gpu0);
  plain.max_logits = TensorView();
  plain.empty_lse_plus_inf = false;
  sparse_mla(plain, &gpu());
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(d_out.download<uint16_t>(), out);
  const auto lse_plain = d_lse_plain.download<float>();

  // The float64 reference on host copies.
  SparseMlaArgs host = a;
  host.q = TensorView(const_cast<uint16_t*>(q.data()), {T, H, kMlaQkDim}, DType::bf16);
  host.kv_cache = TensorView(const_cast<uint16_t*>(cache.data()), {kBlocks, kBlockSize, kMlaQkDim}, DType::bf16);
  host.indices = TensorView(indices.data(), {T, K}, DType::i32);
  const reference::RefAttention ref = reference::ref_sparse_mla(host);
  std::vector<double> got_out(out.size());
  for (size_t i = 0; i < out.size(); ++i) got_out[i] = test::half_bits_to_float(out[i], DType::bf16);
  EXPECT_EQ(test::compare(ref.out, got_out, std::max(1e-3, 0x1p-8 * 2.0), 2.01 / 128, 1 - 5e-6), "");
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const double want_lse = ref.lse[t * H + h], want_max = ref.max_logits[t * H + h];
      const float got_lse = lse[h * T + t], got_max = max_logits[h * T + t];
      if (t == T - 1) {  // nothing to attend
        EXPECT_EQ(got_lse, kInf);
        EXPECT_EQ(want_lse, kInf);
        EXPECT_EQ(lse_plain[t * H + h], -kInf);
        EXPECT_EQ(got_max, -kInf);
        continue;
      }
      EXPECT_NEAR(got_lse, want_lse, 1e-5 + 8.01 / 65536 * std::fabs(want_lse)) << t << "," << h;
      EXPECT_NEAR(got_max, want_max, 1e-5 + 8.01 / 65536 * std::fabs(want_max)) << t << "," << h;
      EXPECT_EQ(lse_plain[t * H + h], got_lse) << t << "," << h;
    }
}

TEST(CudaFlashMlaOutputs, SplitKeysWithACallerWorkspace) { run_case({3, 20, 4096, true}); }
TEST(CudaFlashMlaOutputs, ManyTokens) { run_case({200, 16, 128, false}); }

}  // namespace
}  // namespace smla
