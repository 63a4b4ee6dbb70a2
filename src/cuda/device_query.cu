#include <cuda_runtime.h>

#include "cuda/device_query.h"

namespace smla::cuda {

std::optional<Device> first_device() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear the sticky "no device" error for later callers
    return std::nullopt;
  }
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0) != cudaSuccess)
    return std::nullopt;
  return Device::cuda(major * 10 + minor, 0);
}

}  // namespace smla::cuda
