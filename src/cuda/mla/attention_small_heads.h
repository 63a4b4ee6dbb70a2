// Host side of the small-heads MLA attention kernel (attention_small_heads.cuh):
// its launch configuration on the current device, and its launch.
#pragma once

#include <cuda_runtime.h>

#include "cuda/kernels.h"
#include "cuda/mla/params.h"

namespace smla::cuda::mla::small {

constexpr int kSmallChunkKeys = 64;       // keys per pipeline stage (kChunkKeys)
// The ops pick this kernel for fp8 caches up to this many heads, from this many query tokens on (576-wide heads)
// or from kMinTokensAutomaticNoRope (rope-free 512-wide ones; on an H200 at 8 heads the 16-head-tile kernel took
// 42.1 against 46.3 us at 32 tokens, 75.3 against 64.2 at 64).
constexpr int kMaxHeadsAutomatic = 32, kMinTokensAutomatic = 16, kMinTokensAutomaticNoRope = 64;
// 16-bit caches: up to 16 heads where 16 heads a warp fits (else 8), from 32 query tokens on (or
// kMinTokensAutomaticNoRope); kernel_choice.h says why.
constexpr int kMaxHeadsAutomatic16Bit = 16, kMaxHeadsAutomatic16BitTwoGroups = 8, kMinTokensAutomatic16Bit = 32;
// Whether fp8_ds_mla_v4 caches (one or two) take it automatically as rope-free fp8_ds_mla rows do. Off: on an
// H200 (ef245df) with it on, CudaPagedDecodeV4.MatchesCpu (74 requests x 16 heads) found one output of 606208
// 13% off the CPU's (-0.0221 against -0.0195): in P V the kernel scales a 128-dim tile's values to f16 by powers
// of two relative to the warp's largest ue8m0 scale, so a tile scaled far below its neighbour loses its low bits.
// It was also slower than the 16-head tile on every V4 row timed (same run, fp8_ds_mla_v4, window 128 + c4 512:
// 128 tokens x 8 heads 80.3 against 63.8 us, 1 token 46.6 against 16.3). Forced, the kernel serves V4 (its tests
// pass) with that caveat.
constexpr bool kAutomaticForV4 = false;
// Whether 16 heads per CTA run as 16 heads a warp with the output dims split (each fp8 key fragment converted once
// for both 8-head tiles) unless forced, where its shared memory fits, instead of two groups of 4 warps with 8 heads
// each (each group converting every row). On an H200, fp8_ds_mla, 128 tokens x 16 heads: 98.0 against 103.2 us;
// 32 tokens 37.4 against 37.9 (docs/performance.md).
constexpr bool kSixteenHeadsPerWarpAutomatic = true;

struct SmallHeadsConfig {
  const void* fn = nullptr;
  int threads = 0, smem = 0, stages = 0, ctas_per_sm = 0, heads_per_cta = 0, split_dims = 0;
  bool bulk = false;  // rows by bulk copies (else 16-byte cp.async pieces)
};

// What tests and benchmarks may force (0: as the kernel sees fit): the pipeline
// depth (2-4), heads per CTA (8 or 16) and whether the output dims are split
// between two warps per key slot (2) or not (1). 16 heads per CTA: split, each
// warp holds all 16 heads; unsplit, two groups of 4 warps hold 8 heads each
// (unforced: kSixteenHeadsPerWarpAutomatic picks; fp8_ds_mla_v4 never splits), and how rows are copied
// (automatic: bulk copies where mla::small_heads_bulk_copies says the device has them).
struct SmallHeadsShape {
  int stages = 0, heads_per_cta = 0, split_dims = 0;
  RowCopy copy = RowCopy::automatic;
};

// The configuration for `num_heads` heads of format `f` and rope width `rope`
// (64: 576-wide heads; 0: rope-free 512-wide ones, of whose fp8 rows only the
// first 528 bytes are read, laid out alike in fp8_ds_mla and fp8_ds_mla_nope)
// on the current device (cached per device and shape): 8 heads per CTA up to 8 heads, else 16; the
// deepest pipeline that keeps the most CTAs resident per SM; at 8 heads the
// output dims split between two warps where the unsplit CTAs leave fewer
// than 8 warps per SM and the split keeps as many CTAs (the 99 KB archs; not an H200). Null when the device's shared memory cannot hold it (bf16 rows
// need 160 KB, 142 KB rope-free); an invalid forced shape is an error.
// fp8_ds_mla_v4 caches (rope 0) take fp8_ds_mla's shared memory with a rope part, and never split the output dims
// (forcing that is an error).
const SmallHeadsConfig* find_small_heads_config(CacheFormat f, int rope, bool paged, int num_heads,
                                               SmallHeadsShape shape = {});
// The same, an error where the device cannot run it.
const SmallHeadsConfig& small_heads_config(CacheFormat f, int rope, bool paged, int num_heads,
                                           SmallHeadsShape shape = {});

// Launches one attention of `p` (its split fields filled) with `cfg` on `stream`, `splits` splits of its keys (p's
// num_splits, or fewer where they are one cache's of several); `dependent`: as the programmatic dependent of the
// kernel before it (launch_kernel_args).
void launch_small_heads(const AttentionParams& p, const SmallHeadsConfig& cfg, int splits, cudaStream_t stream,
                        bool dependent);

}  // namespace smla::cuda::mla::small
