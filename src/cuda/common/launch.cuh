// Kernel launches of the library. Where a kernel's code is SM90 code, it is
// launched as a programmatic dependent of the kernel before it in the stream
// (programmatic dependent launch): its CTAs may be placed once every CTA of
// that kernel has called start_next_kernel() (or exited), so the launch
// latency hides behind that kernel's tail, and each CTA waits in
// wait_for_previous_kernel(), before it touches global memory, until that
// kernel has finished and its writes are visible. Every kernel launched by
// launch_kernel() calls wait_for_previous_kernel() first; short kernels call
// start_next_kernel() right after it, long ones when their main loop is done
// (waiting CTAs placed beside running ones slowed compute-bound attention by
// 2-3% on an H200).
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "cuda/common/runtime.h"

namespace smla::cuda {

__device__ __forceinline__ void wait_for_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void start_next_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

struct LaunchShape {
  dim3 grid, block;
  size_t smem = 0;
  cudaStream_t stream = nullptr;
  int cluster = 1;  // CTAs per thread block cluster (SM90 on); 1: no cluster
};

// Launches kernel(args...) with `shape`; `what` names it in errors.
template <class... Params, class... Args>
void launch_kernel(const char* what, void (*kernel)(Params...), const LaunchShape& shape, Args&&... args) {
  cudaLaunchAttribute attrs[2]{};
  unsigned n = 0;
  if (waits_for_previous_kernel(reinterpret_cast<const void*>(kernel))) {
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (shape.cluster > 1) {
    attrs[n].id = cudaLaunchAttributeClusterDimension;
    attrs[n].val.clusterDim.x = static_cast<unsigned>(shape.cluster);
    attrs[n].val.clusterDim.y = attrs[n].val.clusterDim.z = 1;
    ++n;
  }
  cudaLaunchConfig_t config{};
  config.gridDim = shape.grid;
  config.blockDim = shape.block;
  config.dynamicSmemBytes = shape.smem;
  config.stream = shape.stream;
  config.attrs = attrs;
  config.numAttrs = n;
  check_cuda(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...), what);
}

}  // namespace smla::cuda
