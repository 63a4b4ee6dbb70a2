// Host-side CUDA helpers: error checks that throw smla::Error, per-device
// properties read once, and the library's own workspace for callers that pass none.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <optional>
#include <string>
#include <type_traits>

#include "smla/error.h"
#include "smla/types.h"

namespace smla::cuda {

inline void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw Error(ErrorKind::internal, std::string(what) + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
}
// After a launch through cudaLaunchKernel / cudaLaunchKernelEx, from its result: configuration errors surface
// here, not at the next sync, and no cudaGetLastError is made on success (<<<>>> pushes and pops its
// configuration around a cudaLaunchKernel, and checking it takes cudaGetLastError, which would also take an error
// the caller left pending). A failed launch's error is cleared from cudaGetLastError.
inline void check_launched(cudaError_t e, const char* kernel) {
  if (e == cudaSuccess) return;
  cudaGetLastError();
  check_cuda(e, kernel);
}
// What the launch code knows of a device: under the emulated-arch test mode (cuda/emulation.h) the emulated
// arch's compute capability and limits, with the running GPU's SM count (a product's, not an arch's).
struct DeviceInfo {
  int index = 0;
  int compute_capability = 0;  // major*10 + minor
  int num_sms = 0;
  int max_smem_per_block = 0;  // opt-in limit, bytes
  int max_smem_per_sm = 0;
  int max_threads_per_sm = 0;
  int max_ctas_per_sm = 0;
  // CTAs per thread block cluster the arch may allow: 1 below SM90; SM90 on 16, of which a kernel gets what the
  // driver says (max_cluster_ranks()); an emulated arch's limit (8 on SM120).
  int max_cluster_ranks = 1;
  int native_compute_capability = 0;  // the running GPU's, when another arch is emulated; else 0
  // Whether the code the CUDA runtime loaded for this library on this device holds sm_90a's features (on sm_90
  // only; false while another arch is emulated): then the wgmma kernels have their wgmma body rather than a trap.
  bool sm90a_code = false;
};
// The current device's properties (cached per device; inside a DeviceGuard, the guard's device, not asked of the
// driver).
const DeviceInfo& current_device();
// Device `index`'s (cached alike).
const DeviceInfo& device_info(int index);

// Opts `kernel` in to `bytes` of dynamic shared memory on the current device
// (the driver call is made once per kernel, device and size: launches stay cheap).
void allow_dynamic_smem(const void* kernel, int bytes);
// All the shared memory the current device lets one block of `kernel` have
// beyond its static shared memory; `kernel` is opted in to it.
int max_dynamic_smem(const void* kernel);
// How many CTAs of `kernel` (`threads` each, `smem` bytes of dynamic shared
// memory) the current device keeps resident per SM (cached like the above;
// an emulated arch's limits on shared memory, threads and CTAs per SM apply).
int resident_ctas_per_sm(const void* kernel, int threads, int smem);
// How many clusters of `ranks` such CTAs the current device (SM90 on) runs at
// once: clusters must fit in one GPC, so this can be less than SMs / ranks.
int max_active_clusters(const void* kernel, int threads, int smem, int ranks);
// The most CTAs per cluster of such CTAs the current device runs: 1 below SM90, else the driver's answer, at most
// DeviceInfo::max_cluster_ranks. Past the portable 8 (Hopper: 16), `kernel` is let launch non-portable cluster sizes
// (once per device and kernel), which max_active_clusters and launches of more than 8 ranks need.
inline constexpr int kPortableClusterRanks = 8;
int max_cluster_ranks(const void* kernel, int threads, int smem);

// Launches `kernel` (its args as cudaLaunchKernel takes them), checked by check_launched; from SM90 on
// (current_device()) as the programmatic dependent of the kernel before it on `stream` when `dependent`: it may
// start while that kernel runs, and must wait (griddepcontrol.wait) before touching anything that kernel writes.
// Only ever after a kernel of the library's own in the same call, never after a caller's stream work.
inline void launch_kernel_args(const void* kernel, dim3 grid, dim3 block, void** args, size_t smem,
                               cudaStream_t stream, bool dependent, const char* what) {
  cudaLaunchAttribute pdl{};
  pdl.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &pdl;
  config.numAttrs = dependent && current_device().compute_capability >= 90 ? 1 : 0;
  check_launched(cudaLaunchKernelExC(&config, kernel, args), what);
}
// kernel<<<grid, block, smem, stream>>>(params...), checked by check_launched.
template <class... Params>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                   const char* what, std::type_identity_t<Params>... params) {
  void* args[] = {&params...};
  launch_kernel_args(reinterpret_cast<const void*>(kernel), grid, block, args, smem, stream, false, what);
}

// Scratch for an op called without a `workspace`: a buffer of at least
// `bytes` (null for 0) for `stream` on the current device, lent until the
// object is destroyed (after the op's launches). A stream's buffer is
// allocated (cudaMalloc) only when the stream first needs more than it has,
// never while the stream captures a CUDA graph: that is an smla::Error saying
// to pass a workspace or to call the op once on that stream first. At most
// kDefaultWorkspaceStreams streams per device keep a buffer; a new stream
// takes the buffer of the one least recently used (it is freed, after the
// device's pending work, unless it is lent or a graph was captured with it:
// graphs never point at freed memory).
inline constexpr int kDefaultWorkspaceStreams = 4;
class DefaultWorkspace {
 public:
  DefaultWorkspace(cudaStream_t stream, size_t bytes, const char* op);
  ~DefaultWorkspace();
  DefaultWorkspace(const DefaultWorkspace&) = delete;
  DefaultWorkspace& operator=(const DefaultWorkspace&) = delete;
  void* get() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
  int device_ = 0;
};

// The caller's workspace when given, else `fallback` (constructed only then).
inline void* workspace_or(const TensorView& given, std::optional<DefaultWorkspace>& fallback, cudaStream_t stream,
                          size_t bytes, const char* op) {
  if (given.defined()) return given.data;
  if (bytes == 0) return nullptr;
  return fallback.emplace(stream, bytes, op).get();
}

}  // namespace smla::cuda
