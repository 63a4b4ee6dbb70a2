// Host time per call of the C++ API (issue 17: <= 3 us): 10,000 sparse_mla calls on a one-token problem (16
// heads, top-k 64, bf16), with a caller workspace, on a non-blocking stream. Calls are enqueued in batches of 200
// behind a host function that holds the stream for 20 ms, so the GPU runs none of them while they are timed: the
// time is the host's alone (back to back, a kernel that takes longer on the GPU than its launch on the host would
// make the loop wait for the GPU). One 4-byte cudaMemsetAsync, timed the same way, is the floor of any enqueue; the
// same call with no tokens (checked and dispatched, nothing launched) is what the op adds to its launches.
// Also prints the back-to-back rate. `bench_host_overhead out.json` writes the figures as JSON.
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <thread>
#include <vector>

namespace {

// Mean host time of `call` in us over `calls` calls, enqueued in batches behind a 20 ms hold of `stream`.
template <class Call>
double held_us(cudaStream_t stream, int calls, Call call) {
  constexpr int kBatch = 200;  // well under the launch queue's depth
  double total = 0;
  for (int done = 0; done < calls; done += kBatch) {
    cudaLaunchHostFunc(
        stream, [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(20)); }, nullptr);
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < kBatch; ++i) call();
    total += std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
    cudaStreamSynchronize(stream);
  }
  return total / calls;
}

}  // namespace

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
  const double us = held_us(stream, kCalls, [&] { sparse_mla(a); });
  const double memset_us = held_us(stream, kCalls, [&] { cudaMemsetAsync(lse, 0, 4, stream); });
  SparseMlaArgs empty = a;  // no tokens: checks, backend and workspace checks, no launch
  empty.q.shape[0] = empty.indices.shape[0] = empty.out.shape[0] = empty.lse.shape[0] = 0;
  const double dispatch_us = held_us(stream, kCalls, [&] { sparse_mla(empty); });
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kCalls; ++i) sparse_mla(a);
  const auto end = std::chrono::steady_clock::now();
  cudaStreamSynchronize(stream);
  const double back_to_back_us = std::chrono::duration<double, std::micro>(end - start).count() / kCalls;
  std::printf("C++ API smla::sparse_mla (1 token, 16 heads, top-k 64, workspace %zu bytes): %.2f us/call of host "
              "time (one cudaMemsetAsync: %.2f us; the call with no tokens, nothing launched: %.2f us); back to back "
              "%.2f us/call\n",
              bytes, us, memset_us, dispatch_us, back_to_back_us);
  if (argc > 1)
    std::ofstream(argv[1]) << "{\"cpp_sparse_mla_us\": " << us << ", \"cpp_memset_async_us\": " << memset_us
                           << ", \"cpp_sparse_mla_no_tokens_us\": " << dispatch_us
                           << ", \"cpp_sparse_mla_back_to_back_us\": " << back_to_back_us << "}\n";
  return cudaGetLastError() == cudaSuccess ? 0 : 1;
}
