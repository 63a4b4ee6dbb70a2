// Host time per call of the C++ API (issue 17: <= 3 us): 10,000 back-to-back sparse_mla calls on a one-token
// problem (16 heads, top-k 64, bf16), with a caller workspace, on a non-blocking stream. The problem is so small
// that the GPU waits on the host, so the loop's wall time over the calls is the host's cost. Prints us/call;
// `bench_host_overhead out.json` also writes {"cpp_sparse_mla_us": ...}.
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <vector>

#include "smla/ops.h"

int main(int argc, char** argv) {
  using namespace smla;
  constexpr int64_t kBlocks = 4, kBlockSize = 64, kHeads = 16, kTopk = 64;
  constexpr int kCalls = 10000;
  const Device gpu = Device::cuda(0, 0);
  void *q, *cache, *indices, *out, *lse;
  cudaMalloc(&q, kHeads * kMlaQkDim * 2);
  cudaMalloc(&cache, kBlocks * kBlockSize * kMlaQkDim * 2);
  cudaMalloc(&indices, kTopk * 4);
  cudaMalloc(&out, kHeads * kMlaVDim * 2);
  cudaMalloc(&lse, kHeads * 4);
  cudaMemset(q, 0x3c, kHeads * kMlaQkDim * 2);
  cudaMemset(cache, 0x3c, kBlocks * kBlockSize * kMlaQkDim * 2);
  std::vector<int32_t> idx(kTopk);
  for (int i = 0; i < kTopk; ++i) idx[i] = i * 3;
  cudaMemcpy(indices, idx.data(), kTopk * 4, cudaMemcpyHostToDevice);
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);

  SparseMlaArgs a;
  a.q = TensorView(q, {1, kHeads, kMlaQkDim}, DType::bf16, gpu);
  a.kv_cache = TensorView(cache, {kBlocks, kBlockSize, kMlaQkDim}, DType::bf16, gpu);
  a.indices = TensorView(indices, {1, kTopk}, DType::i32, gpu);
  a.softmax_scale = 0.07f;
  a.out = TensorView(out, {1, kHeads, kMlaVDim}, DType::bf16, gpu);
  a.lse = TensorView(lse, {1, kHeads}, DType::f32, gpu);
  a.stream = stream;
  const size_t bytes = workspace_size(a);
  void* ws = nullptr;
  cudaMalloc(&ws, bytes > 0 ? bytes : 16);
  if (bytes > 0) a.workspace = TensorView(ws, {static_cast<int64_t>(bytes)}, DType::u8, gpu);

  for (int i = 0; i < 100; ++i) sparse_mla(a);  // warm up (lazy kernel attributes, caches)
  cudaStreamSynchronize(stream);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kCalls; ++i) sparse_mla(a);
  const auto end = std::chrono::steady_clock::now();
  cudaStreamSynchronize(stream);
  const double us = std::chrono::duration<double, std::micro>(end - start).count() / kCalls;
  std::printf("C++ API smla::sparse_mla (1 token, 16 heads, top-k 64, workspace %zu bytes): %.2f us/call\n", bytes, us);
  if (argc > 1) std::ofstream(argv[1]) << "{\"cpp_sparse_mla_us\": " << us << "}\n";
  return cudaGetLastError() == cudaSuccess ? 0 : 1;
}
