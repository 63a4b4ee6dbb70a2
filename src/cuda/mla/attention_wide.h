// Host side of the wide-head-tile MLA attention kernel (attention_wide.cuh): its launch configuration on the
// current device, and its launch.
#pragma once

#include <cuda_runtime.h>

#include "cuda/mla/params.h"

namespace smla::cuda::mla::wide {

constexpr int kWideHeads = 64;  // heads per CTA: each gathered row feeds all of them
// THE automatic rule: the ops pick this kernel from this many heads on, where the device fits it (not measured
// yet; below 64 heads a CTA pads its tile with zero queries).
constexpr int kMinHeadsAutomatic = 64;
// And from this many query rows x heads on: fewer leave its one CTA per token's 64 heads (queries 75 KB each)
// slower than the 16-head tile's four (H200, DeepSeek-V4 c4 decode, µs wide / 16-head tile: 64 heads x 1 token
// 24.5 / 15.4, x 32 tokens 53.4 / 50.4, x 64 tokens 70.7 / 88.4; 128 heads x 32 tokens 69.0 / 85.8).
constexpr int64_t kMinRowsAutomatic = 4096;

struct WideConfig {
  const void* fn = nullptr;
  int threads = 0, smem = 0, stages = 0, ctas_per_sm = 0;
};

// The configuration for format `f`, rope width `rope` (64 or 0) and key source (paged or a slot list) on the
// current device (cached per device): the deepest pipeline that fits, or `stages` (2 or 3) when forced; null
// where its shared memory cannot hold the kernel (it needs ~190 KB: sm_90 and sm_100 do, sm_80's 163 KB and the
// 99 KB of sm_86/89/120 do not). A forced depth out of range is an error.
const WideConfig* find_wide_config(CacheFormat f, int rope, bool paged, int stages = 0);
// The same, an error where the device cannot run it.
const WideConfig& wide_config(CacheFormat f, int rope, bool paged, int stages = 0);

// Launches one attention of `p` (its split fields filled) with `cfg` over `splits` splits of its keys (p's, or
// with sparse_mla's second cache one cache's share of them) on `stream`; `dependent`: as the programmatic
// dependent of the kernel before it (launch_kernel_args).
void launch_wide(const AttentionParams& p, const WideConfig& cfg, int splits, cudaStream_t stream, bool dependent);

}  // namespace smla::cuda::mla::wide
