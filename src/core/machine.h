// This machine's CUDA GPUs, as core asks for them without knowing the CUDA
// backend: defined where the backends are composed (src/registry.cpp).
#pragma once

#include <optional>

#include "smla/types.h"

namespace smla {

// CUDA device `index` with its compute capability; nullopt when there is no
// such device, no driver, or this build has no CUDA. (detect_device(), in
// smla/select.h, gives the first one.)
std::optional<Device> machine_cuda_device(int index);

}  // namespace smla
