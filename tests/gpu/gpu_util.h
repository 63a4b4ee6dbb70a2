// Helpers for the GPU tests: device copies of host buffers and views of them.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "cuda/common/runtime.h"
#include "cuda/kernels.h"
#include "cuda/mla/attention_wgmma.h"
#include "cuda/mla/attention_wide.h"
#include "cuda/mla/kernel_choice.h"
#include "smla/select.h"

namespace smla {

#define CUDA_OK(x) ASSERT_EQ((x), cudaSuccess) << #x

inline const Backend& cpu() { return *Registry::global().find("cpu"); }
inline const Backend& gpu() { return *Registry::global().find("cuda_mma"); }

inline cuda::mla::CacheFormat cache_format_of(DType kv) {
  using cuda::mla::CacheFormat;
  return kv == DType::bf16            ? CacheFormat::bf16
         : kv == DType::f16           ? CacheFormat::f16
         : kv == DType::fp8_ds_mla_v4 ? CacheFormat::fp8_ds_mla_v4
                                      : CacheFormat::fp8_ds_mla;
}

// Whether the wgmma kernel runs this device's automatic choices for a `kv` cache: Hopper with sm_90a code; 16-bit
// caches, fp8 ones while kWgmmaAutomaticForFp8.
inline bool wgmma_automatic_here(DType kv, int rope, bool paged) {
  const cuda::mla::CacheFormat f = cache_format_of(kv);
  const bool sixteen_bit = f == cuda::mla::CacheFormat::bf16 || f == cuda::mla::CacheFormat::f16;
  return (sixteen_bit || cuda::mla::kWgmmaAutomaticForFp8) && cuda::wgmma_kernels_available() &&
         cuda::mla::wg::find_wgmma_config(f, rope, paged) != nullptr;
}

// Whether the ops pick the wgmma kernel by themselves for `tokens` query rows of `heads` heads: where it runs, from
// wgmma_min_heads heads on at wgmma_min_rows query rows x heads padded to its 64-head tile (ahead of the small-heads
// kernel), and in its keys-on-M form's few-token window (wgmma_few_tokens).
inline bool automatic_wgmma(DType kv, int rope, bool paged, int heads, int64_t tokens) {
  if (!wgmma_automatic_here(kv, rope, paged)) return false;
  return cuda::mla::wgmma_few_tokens({cache_format_of(kv), rope, paged, tokens, heads, {}}) ||
         (heads >= cuda::mla::wgmma_min_heads(cache_format_of(kv)) &&
          cuda::mla::wgmma_rows(tokens, heads) >= cuda::mla::wgmma_min_rows(rope));
}

// The attention kernel the ops pick by themselves for `tokens` query rows of `heads` heads over a `kv` cache (`rope`:
// 64 or 0; `paged`: paged_mla_decode) where the small-heads kernel does not serve: the wgmma kernel where it runs
// (automatic_wgmma), else the 16-head tile there; elsewhere the wide-tile kernel from its rule's heads and rows x heads
// on where the device holds it; else the 16-head-tile kernel.
inline cuda::AttentionKernel automatic_many_heads_kernel(DType kv, int rope, bool paged, int heads, int64_t tokens) {
  if (wgmma_automatic_here(kv, rope, paged))
    return automatic_wgmma(kv, rope, paged, heads, tokens) ? cuda::AttentionKernel::wgmma
                                                           : cuda::AttentionKernel::head_tile;
  if (heads < cuda::mla::wide::kMinHeadsAutomatic) return cuda::AttentionKernel::head_tile;
  return tokens * heads >= cuda::mla::wide::kMinRowsAutomatic &&
                 cuda::mla::wide::find_wide_config(cache_format_of(kv), rope, paged)
             ? cuda::AttentionKernel::wide_tile
             : cuda::AttentionKernel::head_tile;
}

// Whether the current device's shared memory holds the small-heads kernel at 8 heads for cache format `f` (rope
// width `rope`) at its shallowest depth, dims split or not: a 16-bit cache's 64-key stages do not fit the 99 KB
// archs.
inline bool small_heads_fit(cuda::mla::CacheFormat f, int rope) {
  const int limit = cuda::current_device().max_smem_per_block;
  return cuda::mla::small_heads_smem(f, rope, 8, 1, 2) <= limit || cuda::mla::small_heads_smem(f, rope, 8, 2, 2) <= limit;
}

// Device copy of a host buffer; freed at scope exit.
struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  explicit DeviceBuffer(size_t n) : bytes(n) { EXPECT_EQ(cudaMalloc(&ptr, std::max<size_t>(n, 16)), cudaSuccess); }
  template <class T>
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size() * sizeof(T)) {
    EXPECT_EQ(cudaMemcpy(ptr, host.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cudaFree(ptr); }
  template <class T>
  std::vector<T> download() const {
    std::vector<T> v(bytes / sizeof(T));
    EXPECT_EQ(cudaMemcpy(v.data(), ptr, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }
};

// The CUDA graph of what `enqueue()` puts on `stream`, captured in `mode` and instantiated; destroyed at scope exit.
class CapturedGraph {
 public:
  template <class Enqueue>
  CapturedGraph(cudaStream_t stream, cudaStreamCaptureMode mode, Enqueue enqueue) {
    EXPECT_EQ(cudaStreamBeginCapture(stream, mode), cudaSuccess);
    enqueue();
    EXPECT_EQ(cudaStreamEndCapture(stream, &graph_), cudaSuccess);
    EXPECT_EQ(cudaGraphInstantiate(&exec_, graph_, 0), cudaSuccess);
  }
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  ~CapturedGraph() {
    if (exec_) EXPECT_EQ(cudaGraphExecDestroy(exec_), cudaSuccess);
    if (graph_) EXPECT_EQ(cudaGraphDestroy(graph_), cudaSuccess);
  }
  cudaGraphExec_t exec() const { return exec_; }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

// The block stride (bytes) FlashMLA gives an fp8_ds_mla_v4 cache of `block_size` tokens: block_size * 584 rounded
// up to a multiple of 576 (so blocks are 16-byte aligned, as the CUDA backend needs).
inline int64_t v4_block_stride(int64_t block_size) {
  return (block_size * MlaV4CacheLayout::kRowBytes + 575) / 576 * 576;
}

// The same view, pointing at device memory.
inline TensorView on_gpu(TensorView v, void* data) {
  v.data = data;
  v.device = Device::cuda(0, 0);
  return v;
}

}  // namespace smla
