// Where the backends meet core: the registry of the backends this build
// holds, and this machine's GPUs. Core (src/core) knows no backend; it reaches
// them only through Registry::global() and the functions of core/machine.h,
// defined here.
#include "core/machine.h"
#include "cpu/backend.h"
#include "cuda/backend.h"
#include "smla/select.h"
#ifdef SMLA_WITH_CUDA
#include "cuda/device_query.h"
#endif

namespace smla {

Registry& Registry::global() {
  static Registry registry = [] {
    Registry r;
    r.add(cpu::make_backend());
    r.add(cuda::make_backend());
    r.set_priority(DeviceKind::cpu, {"cpu"});
    r.set_priority(DeviceKind::cuda, {"cuda_mma"});
    return r;
  }();
  return registry;
}

std::optional<Device> machine_cuda_device(int index) {
#ifdef SMLA_WITH_CUDA
  return cuda::device_at(index);
#else
  return std::nullopt;
#endif
}

Device detect_device() {
#ifdef SMLA_WITH_CUDA
  if (auto d = cuda::first_device()) return *d;
#endif
  return Device::cpu();
}

}  // namespace smla
