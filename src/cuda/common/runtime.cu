#include <algorithm>
#include <map>
#include <mutex>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include "cuda/common/runtime.h"

namespace smla::cuda {

namespace {

// What `compute()` gives for `key`, asked of the driver once and kept in `cache` (guarded by `mu`); each thread
// then keeps its own copy, so later calls take no lock.
template <class Key, class Compute>
int remembered(std::map<Key, int>& cache, std::mutex& mu, const Key& key, Compute compute) {
  thread_local std::map<std::pair<const void*, Key>, int> mine;  // by (cache, key): one per call site
  const auto my_key = std::make_pair(static_cast<const void*>(&cache), key);
  if (auto it = mine.find(my_key); it != mine.end()) return it->second;
  int value = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(key);
    if (it == cache.end()) it = cache.emplace(key, compute()).first;
    value = it->second;
  }
  mine.emplace(my_key, value);
  return value;
}

// The properties the kernels need of device `dev`, from the driver.
DeviceInfo query_device(int dev) {
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
  return d;
}

}  // namespace

const DeviceInfo& current_device() {
  static std::mutex mu;
  static std::map<int, DeviceInfo> cache;  // its nodes never move: threads keep pointers to them
  thread_local int my_index = -1;
  thread_local const DeviceInfo* mine = nullptr;
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  if (dev == my_index) return *mine;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(dev);
  if (it == cache.end()) it = cache.emplace(dev, query_device(dev)).first;
  my_index = dev;
  mine = &it->second;
  return *mine;
}

void allow_dynamic_smem(const void* kernel, int bytes) {
  static std::mutex mu;
  static std::set<std::tuple<int, const void*, int>> done;
  thread_local std::set<std::tuple<int, const void*, int>> seen_here;  // no lock once this thread has seen it
  const auto key = std::make_tuple(current_device().index, kernel, bytes);
  if (seen_here.count(key)) return;
  std::lock_guard<std::mutex> lock(mu);
  if (!done.count(key)) {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
               "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
    done.insert(key);
  }
  seen_here.insert(key);
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

namespace {

struct StreamBuffer {
  cudaStream_t stream = nullptr;
  void* ptr = nullptr;
  size_t size = 0;
  int lent = 0;           // DefaultWorkspace objects using it now
  bool captured = false;  // a graph was captured with it: never freed
  uint64_t last_use = 0;
};

std::mutex workspace_mu;
std::map<int, std::vector<StreamBuffer>> workspace_buffers;  // by device, at most kDefaultWorkspaceStreams each
uint64_t workspace_clock = 0;

// Lets `b`'s memory go: freed unless a graph may still use it. cudaFree waits for the device's pending work,
// so kernels queued earlier with this buffer finish first.
void give_up(StreamBuffer& b) {
  if (b.ptr && !b.captured) check_cuda(cudaFree(b.ptr), "cudaFree (smla default workspace)");
  b = StreamBuffer{};
}

}  // namespace

DefaultWorkspace::DefaultWorkspace(cudaStream_t stream, size_t bytes, const char* op) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
  check_cuda(cudaGetDevice(&device_), "cudaGetDevice");
  std::lock_guard<std::mutex> lock(workspace_mu);
  std::vector<StreamBuffer>& buffers = workspace_buffers[device_];
  auto it = std::find_if(buffers.begin(), buffers.end(), [&](const StreamBuffer& b) { return b.stream == stream; });
  if (it == buffers.end() || it->size < bytes) {
    if (capture != cudaStreamCaptureStatusNone)
      throw Error(ErrorKind::invalid_argument,
                  std::string(op) + ": workspace: the stream is capturing a CUDA graph and the library's own "
                  "workspace for it would have to be allocated (" + std::to_string(bytes) + " bytes). Pass a "
                  "`workspace` of workspace_size(args) bytes (the way to capture), or call the op once on this "
                  "stream before capturing");
    if (it == buffers.end()) {
      if (buffers.size() < kDefaultWorkspaceStreams) {
        it = buffers.insert(buffers.end(), StreamBuffer{});
      } else {
        it = std::min_element(buffers.begin(), buffers.end(), [](const StreamBuffer& a, const StreamBuffer& b) {
          return (a.lent > 0) < (b.lent > 0) || ((a.lent > 0) == (b.lent > 0) && a.last_use < b.last_use);
        });
        if (it->lent > 0) it = buffers.insert(buffers.end(), StreamBuffer{});  // all lent: one more for now
      }
    }
    if (it->lent > 0) it->captured = true;  // another thread's call on this stream still uses it: kept, not freed
    give_up(*it);
    // Doubling keeps the number of reallocations small while one stream's sizes grow.
    const size_t size = std::max(bytes, 2 * it->size);
    void* p = nullptr;
    check_cuda(cudaMalloc(&p, size), "cudaMalloc (smla default workspace)");
    *it = StreamBuffer{stream, p, size};
  }
  it->lent += 1;
  it->last_use = ++workspace_clock;
  if (capture != cudaStreamCaptureStatusNone) it->captured = true;
  ptr_ = it->ptr;
}

DefaultWorkspace::~DefaultWorkspace() {
  std::lock_guard<std::mutex> lock(workspace_mu);
  for (StreamBuffer& b : workspace_buffers[device_])
    if (b.ptr == ptr_ && b.lent > 0) {
      b.lent -= 1;
      return;
    }
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
