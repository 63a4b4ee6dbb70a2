// The tensors of a `smla run` job on its device: host memory on the CPU, CUDA
// memory on a GPU. Data is made on the host and uploaded; results are
// downloaded for the spot checks.
#pragma once

#include <functional>
#include <initializer_list>
#include <vector>

#include "smla/types.h"

namespace smla::cli {

class Memory {
 public:
  explicit Memory(Device device) : device_(device) {}
  ~Memory();
  Memory(const Memory&) = delete;
  Memory& operator=(const Memory&) = delete;

  const Device& device() const { return device_; }
  // A new contiguous, uninitialised tensor on the device.
  TensorView empty(std::initializer_list<int64_t> shape, DType dtype);
  // Copies `host` (the tensor's bytes, contiguous) into `dst`.
  void upload(const TensorView& dst, const void* host);
  // A host view of `v`: `v` itself on the CPU, else a copy kept in `storage`.
  TensorView on_host(const TensorView& v, std::vector<uint8_t>& storage);
  // Waits for the work queued on the device, so host timers measure it.
  void sync();
  // Seconds `fn` takes, the device's work included: the host clock on the
  // CPU; on a GPU, events on the default stream around it, from the end of the
  // work queued before to the end of fn's (no host synchronisation latency).
  double time(const std::function<void()>& fn);
  // Bytes of memory the device has in all: the machine's physical memory on
  // the CPU, the GPU's memory on a GPU.
  double capacity_bytes() const;
  // The device's memory bandwidth measured now, GB/s: all cores reading on
  // the CPU; a device-to-device copy (bytes read + written) on a GPU.
  double bandwidth_gbs();

 private:
  Device device_;
  std::vector<void*> blocks_;
  void *start_ = nullptr, *stop_ = nullptr;  // cudaEvent_t, created on first use
};

}  // namespace smla::cli
