// Programmatic dependent launch between smla's own kernels of one call (griddepcontrol, SM90+; no-ops below, where
// the host never asks for it). A kernel launched as the dependent of the one before it on the stream
// (launch_kernel_args with `dependent`) starts early and waits (wait_for_prerequisites) for that kernel's
// completion and memory before reading anything it writes; without such a launch the wait returns at once. A kernel
// lets its dependent launch once all its CTAs have called let_dependents_launch (or exited); the dependent still
// waits for all of it.
#pragma once

namespace smla::cuda {

__device__ __forceinline__ void let_dependents_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_prerequisites() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

}  // namespace smla::cuda
