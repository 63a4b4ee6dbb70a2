// Host side of the small-heads MLA attention kernel (attention_small_heads.cuh):
// its launch configuration on the current device, and its launch.
#pragma once

#include <cuda_runtime.h>

#include "cuda/mla/params.h"

namespace smla::cuda::mla::small {

constexpr int kSmallChunkKeys = 64;       // keys per pipeline stage (kChunkKeys)
constexpr int kMaxHeadsAutomatic = 32;    // the ops pick this kernel up to this many heads

struct SmallHeadsConfig {
  const void* fn = nullptr;
  int threads = 0, smem = 0, stages = 0, ctas_per_sm = 0, heads_per_cta = 0;
};

// The configuration for `num_heads` heads of format `f` on the current device
// (cached per device and kernel). The pipeline depth is the deepest that keeps
// the most CTAs resident per SM, or `stages` when it is > 0 (tests,
// benchmarks; an error when the device cannot fit it).
const SmallHeadsConfig& small_heads_config(CacheFormat f, bool paged, int num_heads, int stages = 0);

// Launches one attention of `p` (its split fields filled) with `cfg` on `stream`.
void launch_small_heads(const AttentionParams& p, const SmallHeadsConfig& cfg, cudaStream_t stream);

}  // namespace smla::cuda::mla::small
