// The host side of the attention ops' launches, trimmed for host time per call (issue 17): inside a DeviceGuard,
// current_device() answers the guard's device without asking the driver, and outside one the driver's again; the
// head-tile kernel's launches (one split, and split keys with the combine) report their own errors only, not an
// error the caller's earlier call left pending (cudaGetLastError after a launch took that one as the launch's).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda/common/device_guard.h"
#include "cuda/common/runtime.h"
#include "cuda/kernels.h"
#include "gpu/gpu_util.h"
#include "smla/ops.h"
#include "support/test_util.h"

namespace smla {
namespace {

// The launch tests' problem: one token of 16 heads over a bf16 cache of 64 blocks of 64 slots, `topk` indices.
constexpr int64_t kHeads = 16, kBlocks = 64, kBlockSize = 64, kMaxTopk = 2048;
SparseMlaArgs one_token_args(const DeviceBuffer& q, const DeviceBuffer& kv, const DeviceBuffer& indices,
                             const DeviceBuffer& out, const DeviceBuffer& lse, int64_t topk) {
  SparseMlaArgs a;
  a.q = on_gpu(TensorView(nullptr, {1, kHeads, kMlaQkDim}, DType::bf16), q.ptr);
  a.kv_cache = on_gpu(TensorView(nullptr, {kBlocks, kBlockSize, kMlaQkDim}, DType::bf16), kv.ptr);
  a.indices = on_gpu(TensorView(nullptr, {1, topk}, DType::i32), indices.ptr);
  a.softmax_scale = 0.07f;
  a.out = on_gpu(TensorView(nullptr, {1, kHeads, kMlaVDim}, DType::bf16), out.ptr);
  a.lse = on_gpu(TensorView(nullptr, {1, kHeads}, DType::f32), lse.ptr);
  return a;
}

TEST(CudaLaunchPath, CurrentDeviceIsTheGuardsInsideAndTheDriversAfter) {
  int count = 0;
  CUDA_OK(cudaGetDeviceCount(&count));
  if (count < 2) GTEST_SKIP() << "needs two GPUs: with one, no guard changes the device";
  CUDA_OK(cudaSetDevice(1));
  EXPECT_EQ(cuda::current_device().index, 1);
  {
    const cuda::DeviceGuard outer(Device::cuda(0, 0));  // device 0 (any compute capability: the guard reads the index)
    int now = -1;
    CUDA_OK(cudaGetDevice(&now));
    EXPECT_EQ(now, 0);
    EXPECT_EQ(cuda::current_device().index, 0);
    {
      const cuda::DeviceGuard inner(Device::cuda(0, 1));  // device 1
      EXPECT_EQ(cuda::current_device().index, 1);
    }
    EXPECT_EQ(cuda::current_device().index, 0);  // the outer guard's again
  }
  int now = -1;
  CUDA_OK(cudaGetDevice(&now));
  EXPECT_EQ(now, 1);                           // the caller's device restored
  EXPECT_EQ(cuda::current_device().index, 1);  // and asked of the driver, not the last guard's
  CUDA_OK(cudaSetDevice(0));
  EXPECT_EQ(cuda::current_device().index, 0);
}

TEST(CudaLaunchPath, ACallersPendingErrorIsNotTheAttentionLaunchs) {
  test::Rng rng(17);
  const int64_t slots = kBlocks * kBlockSize;
  std::vector<float> q_f, kv_f;
  const auto q_bits = test::to_half_bits(test::random_floats(rng, kHeads * kMlaQkDim), DType::bf16, &q_f);
  const auto kv_bits = test::to_half_bits(test::random_floats(rng, slots * kMlaQkDim), DType::bf16, &kv_f);
  std::vector<int32_t> idx(kMaxTopk);
  for (int64_t i = 0; i < kMaxTopk; ++i) idx[i] = static_cast<int32_t>((i * 7 + 3) % slots);
  DeviceBuffer q(q_bits), kv(kv_bits), indices(idx), out(kHeads * kMlaVDim * 2), lse(kHeads * 4),
      ws(size_t{64} << 20);
  int count = 0;
  CUDA_OK(cudaGetDeviceCount(&count));

  for (const int64_t topk : {int64_t{64}, kMaxTopk}) {
    SCOPED_TRACE("top-k " + std::to_string(topk));
    SparseMlaArgs a = one_token_args(q, kv, indices, out, lse, topk);
    const size_t bytes = workspace_size(a, &gpu());
    ASSERT_LE(bytes, ws.bytes);
    a.workspace = on_gpu(TensorView(nullptr, {static_cast<int64_t>(bytes)}, DType::u8), ws.ptr);
    const cuda::AttentionPlan plan = cuda::sparse_mla_plan(a);
    EXPECT_EQ(plan.kernel, cuda::AttentionKernel::head_tile);
    EXPECT_EQ(plan.num_splits > 1, topk == kMaxTopk) << plan.num_splits << " splits";
    CUDA_OK(cudaMemset(out.ptr, 0xff, out.bytes));  // NaN until written
    CUDA_OK(cudaMemset(lse.ptr, 0xff, lse.bytes));

    // The caller's error, left pending (compute-sanitizer reports these three API errors, 6 for the two cases:
    // they are the test's own; memcheck it with --report-api-errors no).
    ASSERT_EQ(cudaSetDevice(count), cudaErrorInvalidDevice);
    ASSERT_EQ(cudaPeekAtLastError(), cudaErrorInvalidDevice);
    EXPECT_NO_THROW(sparse_mla(a, &gpu()));
    EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidDevice);  // still there for the caller, once
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaGetLastError());

    // The launches ran: the output matches the CPU backend's on the same inputs.
    SparseMlaArgs h = a;
    std::vector<uint16_t> out_cpu(kHeads * kMlaVDim);
    std::vector<float> lse_cpu(kHeads);
    h.q.data = const_cast<uint16_t*>(q_bits.data());
    h.kv_cache.data = const_cast<uint16_t*>(kv_bits.data());
    h.indices.data = idx.data();
    h.out.data = out_cpu.data();
    h.lse.data = lse_cpu.data();
    for (TensorView* v : {&h.q, &h.kv_cache, &h.indices, &h.out, &h.lse}) v->device = Device::cpu();
    h.workspace = TensorView();
    h.stream = nullptr;
    sparse_mla(h, &cpu());
    const auto out_gpu = out.download<uint16_t>();
    const auto lse_gpu = lse.download<float>();
    for (int64_t i = 0; i < kHeads * kMlaVDim; ++i)
      ASSERT_NEAR(test::half_bits_to_float(out_gpu[i], DType::bf16), test::half_bits_to_float(out_cpu[i], DType::bf16),
                  2e-2)
          << "element " << i;
    for (int64_t h_ = 0; h_ < kHeads; ++h_) EXPECT_NEAR(lse_gpu[h_], lse_cpu[h_], 1e-3) << "head " << h_;
  }
}

// The WorkspaceSource overload (one check of the args, then the source asked for workspace_size's bytes): the same
// bits as with a caller's workspace, the source asked once when the op splits and never when it needs none.
TEST(CudaLaunchPath, AWorkspaceFromASourceGivesTheCallersWorkspaceBits) {
  test::Rng rng(23);
  const int64_t slots = kBlocks * kBlockSize;
  const auto q_bits = test::to_half_bits(test::random_floats(rng, kHeads * kMlaQkDim), DType::bf16);
  const auto kv_bits = test::to_half_bits(test::random_floats(rng, slots * kMlaQkDim), DType::bf16);
  std::vector<int32_t> idx(kMaxTopk);
  for (int64_t i = 0; i < kMaxTopk; ++i) idx[i] = static_cast<int32_t>((i * 11 + 5) % slots);
  DeviceBuffer q(q_bits), kv(kv_bits), indices(idx), out(kHeads * kMlaVDim * 2), lse(kHeads * 4),
      ws(size_t{64} << 20);
  for (const int64_t topk : {int64_t{64}, kMaxTopk}) {
    SCOPED_TRACE("top-k " + std::to_string(topk));
    SparseMlaArgs a = one_token_args(q, kv, indices, out, lse, topk);
    const size_t bytes = workspace_size(a, &gpu());
    ASSERT_LE(bytes, ws.bytes);
    const TensorView whole = on_gpu(TensorView(nullptr, {static_cast<int64_t>(ws.bytes)}, DType::u8), ws.ptr);

    SparseMlaArgs callers = a;
    callers.workspace = on_gpu(TensorView(nullptr, {static_cast<int64_t>(bytes)}, DType::u8), ws.ptr);
    CUDA_OK(cudaMemset(out.ptr, 0xff, out.bytes));
    CUDA_OK(cudaMemset(lse.ptr, 0xff, lse.bytes));
    sparse_mla(callers, &gpu());
    CUDA_OK(cudaDeviceSynchronize());
    const auto want_out = out.download<uint16_t>();
    const auto want_lse = lse.download<float>();

    std::vector<size_t> asked;
    CUDA_OK(cudaMemset(out.ptr, 0xff, out.bytes));
    CUDA_OK(cudaMemset(lse.ptr, 0xff, lse.bytes));
    CUDA_OK(cudaMemset(ws.ptr, 0xff, ws.bytes));  // nothing of the first call's partials left to reuse
    sparse_mla(a, &gpu(), [&](size_t n) {
      asked.push_back(n);
      return whole;
    });
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(asked, bytes > 0 ? std::vector<size_t>{bytes} : std::vector<size_t>{});
    EXPECT_EQ(out.download<uint16_t>(), want_out);
    const auto got_lse = lse.download<float>();
    for (int64_t h = 0; h < kHeads; ++h) {
      ASSERT_TRUE(std::isfinite(want_lse[h])) << "head " << h;
      EXPECT_EQ(got_lse[h], want_lse[h]) << "head " << h;
    }
  }
}

}  // namespace
}  // namespace smla
