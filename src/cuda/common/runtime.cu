#include <algorithm>
#include <map>
#include <mutex>
#include <set>
#include <tuple>
#include <utility>

#include "cuda/common/runtime.h"

namespace smla::cuda {

namespace {

// What `compute()` gives for `key`, asked of the driver once and kept in `cache` (guarded by `mu`).
template <class Key, class Compute>
int remembered(std::map<Key, int>& cache, std::mutex& mu, const Key& key, Compute compute) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it == cache.end()) it = cache.emplace(key, compute()).first;
  return it->second;
}

}  // namespace

const DeviceInfo& current_device() {
  static std::mutex mu;
  static std::map<int, DeviceInfo> cache;
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(dev);
  if (it != cache.end()) return it->second;
  DeviceInfo d;
  d.index = dev;
  int major = 0, minor = 0;
  check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), "cudaDeviceGetAttribute");
  check_cuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev), "cudaDeviceGetAttribute");
  check_cuda(cudaDeviceGetAttribute(&d.num_sms, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute");
  check_cuda(cudaDeviceGetAttribute(&d.max_smem_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev),
             "cudaDeviceGetAttribute");
  check_cuda(cudaDeviceGetAttribute(&d.max_smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev),
             "cudaDeviceGetAttribute");
  d.compute_capability = major * 10 + minor;
  return cache.emplace(dev, d).first->second;
}

void allow_dynamic_smem(const void* kernel, int bytes) {
  static std::mutex mu;
  static std::set<std::tuple<int, const void*, int>> done;
  const auto key = std::make_tuple(current_device().index, kernel, bytes);
  std::lock_guard<std::mutex> lock(mu);
  if (done.count(key)) return;
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
             "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  done.insert(key);
}

int max_dynamic_smem(const void* kernel) {
  static std::mutex mu;
  static std::map<std::pair<int, const void*>, int> sizes;
  const DeviceInfo& dev = current_device();
  const int bytes = remembered(sizes, mu, std::make_pair(dev.index, kernel), [&] {
    cudaFuncAttributes attr{};
    check_cuda(cudaFuncGetAttributes(&attr, kernel), "cudaFuncGetAttributes");
    return dev.max_smem_per_block - static_cast<int>(attr.sharedSizeBytes);
  });
  allow_dynamic_smem(kernel, bytes);
  return bytes;
}

int resident_ctas_per_sm(const void* kernel, int threads, int smem) {
  static std::mutex mu;
  static std::map<std::tuple<int, const void*, int, int>, int> counts;
  return remembered(counts, mu, std::make_tuple(current_device().index, kernel, threads, smem), [&] {
    int n = 0;
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem),
               "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    return n;
  });
}

int max_active_clusters(const void* kernel, int threads, int smem, int ranks) {
  static std::mutex mu;
  static std::map<std::tuple<int, const void*, int, int, int>, int> counts;
  return remembered(counts, mu, std::make_tuple(current_device().index, kernel, threads, smem, ranks), [&] {
    cudaLaunchAttribute cluster{};
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = static_cast<unsigned>(ranks);
    cluster.val.clusterDim.y = cluster.val.clusterDim.z = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(static_cast<unsigned>(ranks));
    config.blockDim = dim3(static_cast<unsigned>(threads));
    config.dynamicSmemBytes = static_cast<size_t>(smem);
    config.attrs = &cluster;
    config.numAttrs = 1;
    int n = 0;
    check_cuda(cudaOccupancyMaxActiveClusters(&n, kernel, &config), "cudaOccupancyMaxActiveClusters");
    return n;
  });
}

void* workspace(cudaStream_t stream, size_t bytes, WorkspaceUse use) {
  struct Buffer {
    void* ptr = nullptr;
    size_t size = 0;
  };
  static std::mutex mu;
  static std::map<std::tuple<int, cudaStream_t, WorkspaceUse>, Buffer> buffers;
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  std::lock_guard<std::mutex> lock(mu);
  Buffer& b = buffers[{dev, stream, use}];
  if (b.size < bytes) {
    // The outgrown buffer is never freed: a CUDA graph captured earlier may
    // still point at it. Doubling keeps the number of such buffers small.
    const size_t size = std::max(bytes, 2 * b.size);
    void* p = nullptr;
    check_cuda(cudaMalloc(&p, size), "cudaMalloc (smla workspace)");
    b = {p, size};
  }
  return b.ptr;
}

}  // namespace smla::cuda

#include "cuda/common/device_guard.h"

namespace smla::cuda {

DeviceGuard::DeviceGuard(const Device& device) {
  check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
  if (device.index != previous_) check_cuda(cudaSetDevice(device.index), "cudaSetDevice");
  else previous_ = -1;
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0) cudaSetDevice(previous_);
}

}  // namespace smla::cuda
