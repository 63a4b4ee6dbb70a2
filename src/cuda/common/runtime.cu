#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include "cuda/common/runtime.h"
#include "cuda/common/device_guard.h"
#include "cuda/emulation.h"

namespace smla::cuda {

namespace {

constexpr int kReservedSmemPerCta = 1024;  // cudaDevAttrReservedSharedMemoryPerBlock, SM80 on

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

// What the runtime loaded on a device, told by the one thing a query of the loaded function reports that differs
// between the two bodies: its static shared memory (an array with sm_90a's features, none without). Not a launch
// (no sync, no allocation: a first query inside a stream capture is as safe as the other attribute queries there),
// not the build's arch list (the loaded image may be 90-real SASS or PTX of an older arch JIT-compiled, e.g. the
// Python package's compute_80 PTX or CUDA_FORCE_PTX_JIT), and not binaryVersion/ptxVersion (90 for sm_90 and
// sm_90a alike). Every translation unit of the library is built for the same arch list, so the runtime picks this
// probe's code as it picks the wgmma kernels'. Never launched.
__global__ void sm90a_code_probe(int* never_written) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kMarkWords = 32;
  __shared__ int mark[kMarkWords];
  mark[threadIdx.x % kMarkWords] = static_cast<int>(threadIdx.x);
  __syncthreads();
  never_written[threadIdx.x] = mark[(threadIdx.x + 1) % kMarkWords];
#endif
}

// Whether `device`'s loaded code holds sm_90a's features (the probe's attributes, asked with it current).
bool sm90a_code_loaded(const Device& device) {
  const DeviceGuard current(device);
  cudaFuncAttributes attr{};
  check_cuda(cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(sm90a_code_probe)), "cudaFuncGetAttributes");
  return attr.sharedSizeBytes > 0;
}

// The properties the kernels need of device `dev`, from the driver; under the emulated-arch test mode, the
// emulated arch's in their place (an Error where the GPU cannot stand in for it).
DeviceInfo query_device(int dev) {
  DeviceInfo d;
  d.index = dev;
  auto attribute = [dev](cudaDeviceAttr what) {
    int v = 0;
    check_cuda(cudaDeviceGetAttribute(&v, what, dev), "cudaDeviceGetAttribute");
    return v;
  };
  d.compute_capability =
      attribute(cudaDevAttrComputeCapabilityMajor) * 10 + attribute(cudaDevAttrComputeCapabilityMinor);
  d.num_sms = attribute(cudaDevAttrMultiProcessorCount);
  d.max_smem_per_block = attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin);
  d.max_smem_per_sm = attribute(cudaDevAttrMaxSharedMemoryPerMultiprocessor);
  d.max_threads_per_sm = attribute(cudaDevAttrMaxThreadsPerMultiProcessor);
  d.max_ctas_per_sm = attribute(cudaDevAttrMaxBlocksPerMultiprocessor);
  d.max_cluster_ranks = d.compute_capability >= 90 ? 16 : 1;  // the driver tells each kernel's (max_cluster_ranks)
  static const char* const emulate = std::getenv(kEmulateEnv);  // read once
  const ArchLimits native{d.compute_capability, d.max_smem_per_block, d.max_smem_per_sm, d.max_threads_per_sm,
                          d.max_ctas_per_sm, d.max_cluster_ranks};
  if (const std::optional<ArchLimits> e = emulated_arch(emulate, native)) {
    std::fprintf(stderr,
                 "smla: %s=%s: TEST MODE, not for serving: device %d (sm_%d) runs the launch decisions of sm_%d "
                 "(%d bytes of shared memory per block, %d per SM)\n",
                 kEmulateEnv, emulate, dev, d.compute_capability, e->compute_capability, e->max_smem_per_block,
                 e->max_smem_per_sm);
    d.native_compute_capability = d.compute_capability;
    d.compute_capability = e->compute_capability;
    d.max_smem_per_block = e->max_smem_per_block;
    d.max_smem_per_sm = e->max_smem_per_sm;
    d.max_threads_per_sm = e->max_threads_per_sm;
    d.max_ctas_per_sm = e->max_ctas_per_sm;
    d.max_cluster_ranks = e->max_cluster_ranks;
  }
  d.sm90a_code = d.compute_capability == 90 && sm90a_code_loaded(Device::cuda(d.compute_capability, dev));
  return d;
}

}  // namespace

const DeviceInfo& device_info(int index) {
  static std::mutex mu;
  static std::map<int, DeviceInfo> cache;  // its nodes never move: threads keep pointers to them
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(index);
  if (it == cache.end()) it = cache.emplace(index, query_device(index)).first;
  return it->second;
}

namespace {

// The device of this thread's innermost DeviceGuard (current while the guard lives), -1 outside any: inside an op
// current_device() needs no cudaGetDevice.
thread_local int guarded_device = -1;

// device_info through this thread's last answer: no lock when it asks for the same device again.
const DeviceInfo& device_info_here(int index) {
  thread_local int my_index = -1;
  thread_local const DeviceInfo* mine = nullptr;
  if (index != my_index) {
    mine = &device_info(index);
    my_index = index;
  }
  return *mine;
}

}  // namespace

const DeviceInfo& current_device() {
  int dev = guarded_device;
  if (dev < 0) check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  return device_info_here(dev);
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
  const DeviceInfo& dev = current_device();
  return remembered(counts, mu, std::make_tuple(dev.index, kernel, threads, smem), [&] {
    int n = 0;
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem),
               "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    if (dev.native_compute_capability == 0) return n;
    // An emulated arch: the running GPU's count (registers: 64K per SM on every arch from SM80 on) within the
    // emulated shared memory (each CTA's static and dynamic bytes plus the 1 KB the system reserves, in 128-byte
    // units), threads and CTAs per SM.
    cudaFuncAttributes attr{};
    check_cuda(cudaFuncGetAttributes(&attr, kernel), "cudaFuncGetAttributes");
    const int per_cta = (smem + static_cast<int>(attr.sharedSizeBytes) + kReservedSmemPerCta + 127) / 128 * 128;
    const int warps = (threads + 31) / 32;
    return std::min({n, dev.max_smem_per_sm / per_cta, dev.max_threads_per_sm / (32 * warps), dev.max_ctas_per_sm});
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

int max_cluster_ranks(const void* kernel, int threads, int smem) {
  static std::mutex mu;
  static std::map<std::tuple<int, const void*, int, int>, int> sizes;
  const DeviceInfo& dev = current_device();
  return remembered(sizes, mu, std::make_tuple(dev.index, kernel, threads, smem), [&] {
    if (dev.max_cluster_ranks <= 1) return 1;
    if (dev.max_cluster_ranks > kPortableClusterRanks)
      check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1),
                 "cudaFuncSetAttribute(NonPortableClusterSizeAllowed)");
    cudaLaunchConfig_t config{};  // no cluster dimension (the call ignores it); the grid: one of the largest
    config.gridDim = dim3(static_cast<unsigned>(dev.max_cluster_ranks));
    config.blockDim = dim3(static_cast<unsigned>(threads));
    config.dynamicSmemBytes = static_cast<size_t>(smem);
    int n = 0;
    check_cuda(cudaOccupancyMaxPotentialClusterSize(&n, kernel, &config), "cudaOccupancyMaxPotentialClusterSize");
    return std::clamp(n, 1, dev.max_cluster_ranks);
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
  device_ = current_device().index;
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

DeviceGuard::DeviceGuard(const Device& device) : outer_(guarded_device) {
  check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
  if (device.index != previous_) check_cuda(cudaSetDevice(device.index), "cudaSetDevice");
  else previous_ = -1;
  guarded_device = device.index;
}

DeviceGuard::~DeviceGuard() {
  guarded_device = outer_;
  if (previous_ >= 0) cudaSetDevice(previous_);
}

}  // namespace smla::cuda
