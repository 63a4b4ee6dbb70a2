#pragma once

#include <optional>

#include "smla/types.h"

namespace smla::cuda {
// The first CUDA device with its compute capability, or nullopt when the
// runtime finds none (no driver, no GPU).
std::optional<Device> first_device();
// CUDA device `index` with its compute capability (the emulated arch's under SMLA_CUDA_EMULATE, a test mode), or
// nullopt when there is no such device.
std::optional<Device> device_at(int index);
}  // namespace smla::cuda
