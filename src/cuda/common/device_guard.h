// Makes the tensors' GPU current for the duration of an op (as PyTorch's
// device guard does) and restores the caller's device afterwards. Meanwhile
// current_device() answers without asking the driver (so code inside must not
// change the device itself).
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
  int previous_ = -1;  // the caller's device to restore, -1 when it is this one
  int outer_ = -1;     // the enclosing guard's device, -1 outside any
};

}  // namespace smla::cuda
