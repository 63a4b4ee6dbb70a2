#include "memory.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include <unistd.h>

#include "cpu/memory_bandwidth.h"
#include "smla/error.h"
#ifdef SMLA_WITH_CUDA
#include "cuda/common/runtime.h"
#endif

namespace smla::cli {

namespace {
size_t bytes_of(const TensorView& v) { return static_cast<size_t>(v.numel()) * dtype_size(v.dtype); }

#ifdef SMLA_WITH_CUDA
using cuda::check_cuda;
#endif

[[noreturn]] void no_cuda() {
  throw Error(ErrorKind::unsupported, "this build of smla has no CUDA support (built without nvcc)");
}
}  // namespace

Memory::~Memory() {
#ifdef SMLA_WITH_CUDA
  if (start_) cudaEventDestroy(static_cast<cudaEvent_t>(start_));
  if (stop_) cudaEventDestroy(static_cast<cudaEvent_t>(stop_));
#endif
  for (void* p : blocks_) {
    if (device_.is_cpu()) std::free(p);
#ifdef SMLA_WITH_CUDA
    else cudaFree(p);
#endif
  }
}

TensorView Memory::empty(std::initializer_list<int64_t> shape, DType dtype) {
  TensorView v(nullptr, shape, dtype, device_);
  const size_t bytes = std::max<size_t>(bytes_of(v), 16);
  void* p = nullptr;
  if (device_.is_cpu()) {
    p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p) throw Error(ErrorKind::internal, "out of host memory (" + std::to_string(bytes) + " bytes)");
  } else {
#ifdef SMLA_WITH_CUDA
    check_cuda(cudaSetDevice(device_.index), "cudaSetDevice");
    check_cuda(cudaMalloc(&p, bytes), "cudaMalloc");
#else
    no_cuda();
#endif
  }
  blocks_.push_back(p);
  v.data = p;
  return v;
}

void Memory::upload(const TensorView& dst, const void* host) {
  if (device_.is_cpu()) {
    std::memcpy(dst.data, host, bytes_of(dst));
    return;
  }
#ifdef SMLA_WITH_CUDA
  check_cuda(cudaMemcpy(dst.data, host, bytes_of(dst), cudaMemcpyHostToDevice), "cudaMemcpy to the GPU");
#else
  no_cuda();
#endif
}

TensorView Memory::on_host(const TensorView& v, std::vector<uint8_t>& storage) {
  if (device_.is_cpu()) return v;
  TensorView h = v;
  storage.resize(bytes_of(v));
  h.data = storage.data();
  h.device = Device::cpu();
#ifdef SMLA_WITH_CUDA
  check_cuda(cudaMemcpy(storage.data(), v.data, storage.size(), cudaMemcpyDeviceToHost), "cudaMemcpy from the GPU");
#else
  no_cuda();
#endif
  return h;
}

void Memory::sync() {
#ifdef SMLA_WITH_CUDA
  if (device_.is_cuda()) check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
#endif
}

double Memory::time(const std::function<void()>& fn) {
  if (device_.is_cpu()) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
#ifdef SMLA_WITH_CUDA
  if (!start_) {
    cudaEvent_t start, stop;
    check_cuda(cudaEventCreate(&start), "cudaEventCreate");
    check_cuda(cudaEventCreate(&stop), "cudaEventCreate");
    start_ = start;
    stop_ = stop;
  }
  const auto start = static_cast<cudaEvent_t>(start_), stop = static_cast<cudaEvent_t>(stop_);
  check_cuda(cudaEventRecord(start, nullptr), "cudaEventRecord");
  fn();
  check_cuda(cudaEventRecord(stop, nullptr), "cudaEventRecord");
  check_cuda(cudaEventSynchronize(stop), "cudaEventSynchronize");
  float ms = 0;
  check_cuda(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
  return ms * 1e-3;
#else
  no_cuda();
#endif
}

double Memory::capacity_bytes() const {
  if (device_.is_cpu()) return double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGESIZE));
#ifdef SMLA_WITH_CUDA
  check_cuda(cudaSetDevice(device_.index), "cudaSetDevice");
  size_t free = 0, total = 0;
  check_cuda(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
  return double(total);
#else
  no_cuda();
#endif
}

double Memory::bandwidth_gbs() {
  if (device_.is_cpu()) return cpu::measure_read_bandwidth_gbs();
#ifdef SMLA_WITH_CUDA
  const size_t bytes = size_t{1} << 30;
  void *a = nullptr, *b = nullptr;
  check_cuda(cudaMalloc(&a, bytes), "cudaMalloc");
  check_cuda(cudaMalloc(&b, bytes), "cudaMalloc");
  cudaEvent_t start, stop;
  check_cuda(cudaEventCreate(&start), "cudaEventCreate");
  check_cuda(cudaEventCreate(&stop), "cudaEventCreate");
  float best = 1e30f;
  for (int i = 0; i < 5; ++i) {
    check_cuda(cudaEventRecord(start), "cudaEventRecord");
    check_cuda(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice), "cudaMemcpy");
    check_cuda(cudaEventRecord(stop), "cudaEventRecord");
    check_cuda(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    check_cuda(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    best = std::min(best, ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaFree(a);
  cudaFree(b);
  return 2.0 * bytes / (best * 1e-3) / 1e9;
#else
  no_cuda();
#endif
}

}  // namespace smla::cli
