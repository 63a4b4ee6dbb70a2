// Host time per call of the C++ API (issue 17: <= 3 us): 10,000 sparse_mla calls on a one-token problem (16
// heads, top-k 64, a bf16 cache of 8192 slots), with a caller workspace, on a non-blocking stream. Calls are enqueued in batches of 200
// behind a host function that holds the stream for 20 ms, so the GPU runs none of them while they are timed: the
// time is the host's alone (back to back, a kernel that takes longer on the GPU than its launch on the host would
// make the loop wait for the GPU). One 4-byte cudaMemsetAsync, timed the same way, is the floor of any enqueue; the
// same call with no tokens (checked and dispatched, nothing launched) is what the op adds to its launches.
// Also prints the back-to-back rate, and rows that split the call's time: workspace_size (checks and the split
// plan), the backend's smla::cuda::sparse_mla inside one device guard (plan, parameters, launch: no checks), the
// call on a top-k of 2048 (split keys, then the combine kernel: a PDL launch from SM90 on; its workspace sized by
// workspace_size per call, or from a WorkspaceSource, as a binding with its own allocator does), an empty kernel of the
// attention kernel's parameter size launched by each route (launch_floor.h), and cudaGetDevice / cudaGetLastError
// alone. `bench_host_overhead out.json` writes the figures as JSON.
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <thread>
#include <vector>

#include "cuda/common/device_guard.h"
#include "cuda/kernels.h"
#include "cuda/mla/params.h"
#include "launch_floor.h"

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

// Mean time of `call` in us over `calls` calls back to back (calls that enqueue nothing).
template <class Call>
double loop_us(int calls, Call call) {
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < calls; ++i) call();
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() / calls;
}

}  // namespace

#include "smla/ops.h"

int main(int argc, char** argv) {
  using namespace smla;
  constexpr int64_t kBlocks = 128, kBlockSize = 64, kHeads = 16, kTopk = 64, kSplitTopk = 2048;
  constexpr int kCalls = 10000;
  const Device gpu = Device::cuda(0, 0);
  void *q, *cache, *indices, *out, *lse;
  cudaMalloc(&q, kHeads * kMlaQkDim * 2);
  cudaMalloc(&cache, kBlocks * kBlockSize * kMlaQkDim * 2);
  cudaMalloc(&indices, kSplitTopk * 4);
  cudaMalloc(&out, kHeads * kMlaVDim * 2);
  cudaMalloc(&lse, kHeads * 4);
  cudaMemset(q, 0x3c, kHeads * kMlaQkDim * 2);
  cudaMemset(cache, 0x3c, kBlocks * kBlockSize * kMlaQkDim * 2);
  std::vector<int32_t> idx(kSplitTopk);
  for (int i = 0; i < kSplitTopk; ++i) idx[i] = static_cast<int32_t>(i * 3 % (kBlocks * kBlockSize));
  cudaMemcpy(indices, idx.data(), kSplitTopk * 4, cudaMemcpyHostToDevice);
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

  SparseMlaArgs split = a;  // top-k 2048: the keys split (a partial row per split), then the combine kernel
  split.indices.shape[1] = kSplitTopk;
  const size_t split_bytes = workspace_size(split);
  void* split_ws = nullptr;
  cudaMalloc(&split_ws, split_bytes);
  split.workspace = TensorView(split_ws, {static_cast<int64_t>(split_bytes)}, DType::u8, gpu);
  const int splits = cuda::sparse_mla_plan(split).num_splits;
  const int smem = cuda::sparse_mla_plan(a).smem;  // the attention kernel's dynamic shared memory

  bool launched = true;  // every route's launches succeeded
  auto check = [&](cudaError_t e) { launched = launched && e == cudaSuccess; };
  check(allow_launch_smem(smem));
  for (int i = 0; i < 100; ++i) {  // warm up (lazy kernel loading and attributes, caches)
    sparse_mla(a);
    sparse_mla(split);
    check(launch_chevrons(stream));
    check(launch_runtime(stream));
    check(launch_runtime(stream, smem));
    check(launch_ex(stream, false));
    check(launch_ex(stream, true));
    check(launch_driver(stream));
  }
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

  struct Row {
    const char* key;  // in the JSON: cpp_<key>_us
    const char* label;
    double us;
  };
  std::vector<Row> rows;
  rows.push_back({"workspace_size", "smla::workspace_size (checks, device guard, split plan)",
                  loop_us(kCalls, [&] { (void)workspace_size(a); })});
  {
    const cuda::DeviceGuard guard(gpu);  // as the backend calls it, the guard made once outside the loop
    rows.push_back({"cuda_sparse_mla", "smla::cuda::sparse_mla in a guard (plan, params, launch)",
                    held_us(stream, kCalls, [&] { cuda::sparse_mla(a); })});
  }
  rows.push_back({"sparse_mla_split", "smla::sparse_mla, top-k 2048 (splits + combine)",
                  held_us(stream, kCalls, [&] { sparse_mla(split); })});
  {
    // How a binding whose scratch comes from its own allocator calls it (the torch kernels): workspace_size, then the
    // op (two checks, two split plans: before), against the WorkspaceSource overload (one of each: now).
    SparseMlaArgs unsized = split;
    unsized.workspace = TensorView();
    rows.push_back({"sparse_mla_split_sized", "  the same as workspace_size, then the op",
                    held_us(stream, kCalls, [&] {
                      SparseMlaArgs sized = unsized;
                      sized.workspace = TensorView(split_ws, {static_cast<int64_t>(workspace_size(unsized))},
                                                   DType::u8, gpu);
                      sparse_mla(sized);
                    })});
    const auto source = [&](size_t n) { return TensorView(split_ws, {static_cast<int64_t>(n)}, DType::u8, gpu); };
    rows.push_back({"sparse_mla_split_source", "  the same, its workspace from a WorkspaceSource",
                    held_us(stream, kCalls, [&] { sparse_mla(unsized, nullptr, source); })});
  }
  rows.push_back({"launch_chevrons", "empty kernel, <<<>>>",
                  held_us(stream, kCalls, [&] { check(launch_chevrons(stream)); })});
  rows.push_back({"launch_runtime", "empty kernel, cudaLaunchKernel",
                  held_us(stream, kCalls, [&] { check(launch_runtime(stream)); })});
  rows.push_back({"launch_runtime_smem", "empty kernel, cudaLaunchKernel, the attention's shared memory",
                  held_us(stream, kCalls, [&] { check(launch_runtime(stream, smem)); })});
  rows.push_back({"launch_ex", "empty kernel, cudaLaunchKernelEx",
                  held_us(stream, kCalls, [&] { check(launch_ex(stream, false)); })});
  rows.push_back({"launch_ex_pdl", "empty kernel, cudaLaunchKernelEx + PDL attribute",
                  held_us(stream, kCalls, [&] { check(launch_ex(stream, true)); })});
  rows.push_back({"launch_driver", "empty kernel, cuLaunchKernel (driver)",
                  held_us(stream, kCalls, [&] { check(launch_driver(stream)); })});
  int device = -1;
  rows.push_back({"get_device", "cudaGetDevice", loop_us(kCalls, [&] { cudaGetDevice(&device); })});
  rows.push_back({"get_last_error", "cudaGetLastError", loop_us(kCalls, [&] { check(cudaGetLastError()); })});
  cudaStreamSynchronize(stream);

  std::printf("C++ API smla::sparse_mla (1 token, 16 heads, top-k 64, workspace %zu bytes): %.2f us/call of host "
              "time (one cudaMemsetAsync: %.2f us; the call with no tokens, nothing launched: %.2f us); back to back "
              "%.2f us/call\n",
              bytes, us, memset_us, dispatch_us, back_to_back_us);
  for (const Row& r : rows) std::printf("  %-58s %6.2f us\n", r.label, r.us);
  std::printf("  (top-k 2048: %d splits; empty kernels take a %zu-byte parameter, as the attention kernels; the "
              "attention's shared memory: %d bytes)\n",
              splits, sizeof(cuda::mla::AttentionParams), smem);
  if (argc > 1) {
    std::ofstream json(argv[1]);
    json << "{\"cpp_sparse_mla_us\": " << us << ", \"cpp_memset_async_us\": " << memset_us
         << ", \"cpp_sparse_mla_no_tokens_us\": " << dispatch_us
         << ", \"cpp_sparse_mla_back_to_back_us\": " << back_to_back_us << ", \"cpp_split_count\": " << splits;
    for (const Row& r : rows) json << ", \"cpp_" << r.key << "_us\": " << r.us;
    json << "}\n";
  }
  if (!launched) std::fprintf(stderr, "bench_host_overhead: a launch failed\n");
  return launched && cudaGetLastError() == cudaSuccess ? 0 : 1;
}
