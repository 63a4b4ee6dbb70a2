// Host side of the wgmma MLA attention kernel (attention_wgmma.cuh, sm_90a): its launch configuration on the
// current device, and its launch.
#pragma once

#include <cuda_runtime.h>

#include "cuda/mla/params.h"

namespace smla::cuda::mla::wg {

constexpr int kWgmmaHeads = 64;  // heads per CTA: the wgmma's M (whether the ops pick it: kernel_choice.h)
constexpr int kWgmmaChunkKeys = 64;  // keys per pipeline stage

struct WgmmaConfig {
  const void* fn = nullptr;
  int threads = 0, smem = 0, ctas_per_sm = 0, heads_per_cta = kWgmmaHeads;
};

// The configuration for format `f` (any cache format), rope width `rope` (64 or 0), key source and heads per CTA
// (kWgmmaHeads, or 8 / 16 / 32 where mla::wgmma_keys_on_m: the keys-on-M form, attention_wgmma_keys.cuh) on the current device (cached per device); null where the device cannot
// run it (not a Hopper GPU, no sm_90a code loaded, or too little shared memory). `two_lists`: the instance that reads
// sparse_mla's two caches in one launch (ExtraKeys; sparse only, the formats of two_lists_in_one_launch, 64 heads).
const WgmmaConfig* find_wgmma_config(CacheFormat f, int rope, bool paged, bool two_lists = false,
                                     int heads_per_cta = kWgmmaHeads);
// The same, an error naming what is missing.
const WgmmaConfig& wgmma_config(CacheFormat f, int rope, bool paged, bool two_lists = false,
                                int heads_per_cta = kWgmmaHeads);
// Whether the wgmma kernel reads both of sparse_mla's caches in one launch for format `f`: the pairs kernel (16-bit
// caches) and the staged one where it gathers by cp.async (fp8_ds_mla_v4) do; fp8_ds_mla's bulk-copied rows run
// one launch a cache.
constexpr bool two_lists_in_one_launch(CacheFormat f) { return f != CacheFormat::fp8_ds_mla; }

// Launches one attention of `p` (its split fields filled) with `cfg` over `splits` splits of its keys on `stream`;
// `dependent`: as the programmatic dependent of the kernel before it (launch_kernel_args).
void launch_wgmma(const AttentionParams& p, const WgmmaConfig& cfg, int splits, cudaStream_t stream, bool dependent);

}  // namespace smla::cuda::mla::wg
