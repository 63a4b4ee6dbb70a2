// Makes the tensors' GPU current for the duration of an op (as PyTorch's
// device guard does) and restores the caller's device afterwards.
#pragma once

#include "smla/types.h"

namespace smla::cuda {

class DeviceGuard {
 public:
  explicit DeviceGuard(const Device& device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace smla::cuda
