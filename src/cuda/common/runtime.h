// Host-side CUDA helpers: error checks that throw smla::Error, per-device
// properties read once, and a grow-only workspace per (device, stream).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "smla/error.h"

namespace smla::cuda {

inline void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw Error(ErrorKind::internal, std::string(what) + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
}
// After a launch: configuration errors surface here, not at the next sync.
inline void check_launch(const char* kernel) { check_cuda(cudaGetLastError(), kernel); }

struct DeviceInfo {
  int index = 0;
  int compute_capability = 0;  // major*10 + minor
  int num_sms = 0;
  int max_smem_per_block = 0;  // opt-in limit, bytes
  int max_smem_per_sm = 0;
};
// The current device's properties (cached per device).
const DeviceInfo& current_device();

// Opts `kernel` in to `bytes` of dynamic shared memory on the current device
// (the driver call is made once per kernel, device and size: launches stay cheap).
void allow_dynamic_smem(const void* kernel, int bytes);
// All the shared memory the current device lets one block of `kernel` have
// beyond its static shared memory; `kernel` is opted in to it.
int max_dynamic_smem(const void* kernel);
// How many CTAs of `kernel` (`threads` each, `smem` bytes of dynamic shared
// memory) the current device keeps resident per SM (cached like the above).
int resident_ctas_per_sm(const void* kernel, int threads, int smem);
// How many clusters of `ranks` such CTAs the current device (SM90 on) runs at
// once: clusters must fit in one GPC, so this can be less than SMs / ranks.
int max_active_clusters(const void* kernel, int threads, int smem, int ranks);

// Scratch memory for `stream` on the current device, at least `bytes`. It
// grows (cudaMalloc) only when a larger size is first asked for, so
// steady-state calls — and CUDA-graph capture after a warm-up call of the
// same size — allocate nothing; outgrown buffers stay allocated, so a graph
// captured earlier never points at freed memory. Each `use` is a buffer of
// its own, for scratch that must live at the same time as another's.
enum class WorkspaceUse { primary, topk_lists };
void* workspace(cudaStream_t stream, size_t bytes, WorkspaceUse use = WorkspaceUse::primary);

}  // namespace smla::cuda
