// The launch-cost rows of bench_host_overhead: an empty kernel taking a parameter of sizeof(mla::AttentionParams)
// bytes (the attention kernels' one parameter), launched each way the library or a caller could launch it.
#include "launch_floor.h"

#include "cuda/mla/params.h"

namespace {

struct ParamsSized {
  unsigned char bytes[sizeof(smla::cuda::mla::AttentionParams)];
};

__global__ void empty_kernel(ParamsSized) {}

constexpr unsigned kThreads = 128;  // the head-tile kernel's

}  // namespace

cudaError_t launch_chevrons(cudaStream_t stream) {
  empty_kernel<<<1, kThreads, 0, stream>>>(ParamsSized{});
  return cudaSuccess;
}

cudaError_t allow_launch_smem(int bytes) {
  return cudaFuncSetAttribute(empty_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

cudaError_t launch_runtime(cudaStream_t stream, int smem) {
  ParamsSized p{};
  void* args[] = {&p};
  return cudaLaunchKernel(empty_kernel, dim3(1), dim3(kThreads), args, smem, stream);
}

cudaError_t launch_ex(cudaStream_t stream, bool pdl) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(1);
  config.blockDim = dim3(kThreads);
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&config, empty_kernel, ParamsSized{});
}

cudaError_t launch_driver(cudaStream_t stream) {
  static const CUfunction function = [] {
    cudaFunction_t f = nullptr;
    cudaGetFuncBySymbol(&f, reinterpret_cast<const void*>(empty_kernel));
    return reinterpret_cast<CUfunction>(f);
  }();
  ParamsSized p{};
  void* args[] = {&p};
  const CUresult r = cuLaunchKernel(function, 1, 1, 1, kThreads, 1, 1, 0, stream, args, nullptr);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorLaunchFailure;
}
