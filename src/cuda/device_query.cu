#include <cuda_runtime.h>

#include "cuda/common/runtime.h"
#include "cuda/device_query.h"

namespace smla::cuda {

std::optional<Device> first_device() { return device_at(0); }

std::optional<Device> device_at(int index) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear the sticky "no device" error for later callers
    return std::nullopt;
  }
  int major = 0, minor = 0;
  if (index < 0 || index >= count ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, index) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, index) != cudaSuccess)
    return std::nullopt;
  // The launch code's view: an emulated arch's under the test mode (cuda/emulation.h), so explain and the
  // backend checks see the arch whose decisions run.
  return Device::cuda(device_info(index).compute_capability, index);
}

}  // namespace smla::cuda
