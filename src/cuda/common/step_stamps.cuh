// Timestamps of dsa_decode_step's kernels, to see where a step's time goes (bench_cuda stamps): compiled in
// only with SMLA_TOPK_STAMPS defined (CMake option of that name); otherwise every macro here is empty and the
// kernels are as shipped. Slots: see StepStamp (kernels.h).
#pragma once

#include "cuda/kernels.h"

#ifdef SMLA_TOPK_STAMPS
namespace smla::cuda {

inline unsigned long long* step_stamp_buffer = nullptr;  // set_step_stamps'

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// Slot `slot` of the CTA (0, 0)'s thread 0: the global time and the SM's clock.
__device__ __forceinline__ void stamp_first_cta(unsigned long long* s, int slot) {
  if (s == nullptr || blockIdx.x != 0 || blockIdx.y != 0 || threadIdx.x != 0) return;
  s[slot] = global_ns();
  s[kStepStamps + slot] = clock64();
}
// The earliest of the CTAs' starts (thread 0 of each).
__device__ __forceinline__ void stamp_earliest(unsigned long long* s, int slot) {
  if (s != nullptr && threadIdx.x == 0) atomicMin(&s[slot], global_ns());
}
// The latest of the warps' ends: stamped as the object goes out of scope (every return).
struct StampLatestOnExit {
  unsigned long long* s;
  int slot;
  __device__ ~StampLatestOnExit() {
    if (s != nullptr && threadIdx.x % 32 == 0) atomicMax(&s[slot], global_ns());
  }
};

}  // namespace smla::cuda
#define SMLA_STAMP_FIELD unsigned long long* stamps = step_stamp_buffer;
#define SMLA_STAMP(p, slot) stamp_first_cta((p).stamps, slot)
#define SMLA_STAMP_START_END(p, start, end) \
  stamp_earliest((p).stamps, start);        \
  const StampLatestOnExit stamp_on_exit_{(p).stamps, end}
#else
#define SMLA_STAMP_FIELD
#define SMLA_STAMP(p, slot) ((void)0)
#define SMLA_STAMP_START_END(p, start, end) ((void)0)
#endif
