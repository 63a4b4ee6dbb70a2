// Compile-time checks that kernel_choice.h's tables and thresholds are the kernels' own: every compiled depth's
// shared memory equals its layout's, and the automatic rules' constants equal the kernels' headers'. No code.
#include "cuda/mla/attention_kernel.cuh"
#include "cuda/mla/attention_small_heads.cuh"
#include "cuda/mla/attention_small_heads.h"
#include "cuda/mla/attention_wgmma.cuh"
#include "cuda/mla/attention_wgmma_keys.cuh"
#include "cuda/mla/attention_wgmma_pairs.cuh"
#include "cuda/mla/attention_wide.cuh"
#include "cuda/mla/kernel_choice.h"

namespace smla::cuda::mla {

namespace {

constexpr CacheFormat kFormats[] = {CacheFormat::bf16, CacheFormat::f16, CacheFormat::fp8_ds_mla,
                                    CacheFormat::fp8_ds_mla_v4};

// The 16-head tile compiles depths 2-4 (16-bit caches) or 1-3 (fp8); the wide tile 2-3; fp8_ds_mla_v4 rope-free only.
constexpr bool tile_layouts_match() {
  for (CacheFormat f : kFormats)
    for (int rope : {0, kMlaRopeDim}) {
      const bool compiled = f != CacheFormat::fp8_ds_mla_v4 || rope == 0;
      for (int s = 1; s <= 4; ++s) {
        const bool head_depth = compiled && (is_fp8(f) ? s <= 3 : s >= 2);
        if (head_tile_smem(f, rope, s) != (head_depth ? SmemLayout(f, s, rope).total : 0)) return false;
        const bool wide_depth = compiled && s >= 2 && s <= 3;
        if (wide_smem(f, rope, s) != (wide_depth ? wide::WideLayout(f, s, rope).total : 0)) return false;
      }
    }
  return true;
}

template <CacheFormat F, int kRope>
constexpr bool small_layouts_match() {
  for (int s = 2; s <= 4; ++s)
    if (small_heads_smem(F, kRope, 16, 1, s) != small::Layout<F, kRope, 2, 1>(s).total ||
        small_heads_smem(F, kRope, 16, 2, s) != small::Layout<F, kRope, 1, 2, 2>(s).total ||
        small_heads_smem(F, kRope, 8, 1, s) != small::Layout<F, kRope, 1, 1>(s).total ||
        small_heads_smem(F, kRope, 8, 2, s) != small::Layout<F, kRope, 1, 2>(s).total)
      return false;
  return true;
}

static_assert(tile_layouts_match(), "kernel_choice.h: the tile kernels' shared-memory table");
static_assert(wgmma_smem(CacheFormat::bf16, 0) == wg::PairLayout(0).total &&
                  wgmma_smem(CacheFormat::f16, kMlaRopeDim) == wg::PairLayout(kMlaRopeDim).total &&
                  wgmma_smem(CacheFormat::fp8_ds_mla, 0) == wg::WgmmaLayout(CacheFormat::fp8_ds_mla, 0).total &&
                  wgmma_smem(CacheFormat::fp8_ds_mla, kMlaRopeDim) ==
                      wg::WgmmaLayout(CacheFormat::fp8_ds_mla, kMlaRopeDim).total &&
                  wgmma_smem(CacheFormat::fp8_ds_mla_v4, 0) == wg::WgmmaLayout(CacheFormat::fp8_ds_mla_v4, 0).total &&
                  wgmma_smem(CacheFormat::fp8_ds_mla_v4, kMlaRopeDim) == 0,
              "kernel_choice.h: the wgmma kernel's shared-memory table");
// The keys-on-M form's table, threads, depth and heads per CTA, for each of its head counts and rope widths.
constexpr bool keys_form_matches(int heads) {
  for (int rope : {0, kMlaRopeDim})
    if (wgmma_smem(CacheFormat::fp8_ds_mla, rope, heads) != wg::KeysLayout(CacheFormat::fp8_ds_mla, rope, heads).total)
      return false;
  return wgmma_threads(CacheFormat::fp8_ds_mla, heads) == wg::keys_threads(heads) &&
         wgmma_keys_stages(heads) == wg::keys_stages(heads) &&
         wgmma_registers(CacheFormat::fp8_ds_mla, heads) * wg::keys_threads(heads) <= kRegistersPerSm &&
         wgmma_keys_on_m(CacheFormat::fp8_ds_mla, heads);
}
static_assert(keys_form_matches(8) && keys_form_matches(16) && keys_form_matches(32) &&
                  !wgmma_keys_on_m(CacheFormat::bf16, 8) && !wgmma_keys_on_m(CacheFormat::fp8_ds_mla, 64) &&
                  !wgmma_keys_on_m(CacheFormat::fp8_ds_mla, 12),
              "kernel_choice.h: the wgmma kernel's keys-on-M form (shared memory, threads, depth, heads per CTA)");
static_assert(small_layouts_match<CacheFormat::bf16, 0>() && small_layouts_match<CacheFormat::bf16, 64>() &&
                  small_layouts_match<CacheFormat::f16, 0>() && small_layouts_match<CacheFormat::f16, 64>() &&
                  small_layouts_match<CacheFormat::fp8_ds_mla, 0>() &&
                  small_layouts_match<CacheFormat::fp8_ds_mla, 64>(),
              "kernel_choice.h: the small-heads kernel's shared-memory table");
constexpr bool v4_small_layouts_match() {  // rope-free, and never the dim split
  for (int s = 2; s <= 4; ++s)
    if (small_heads_smem(CacheFormat::fp8_ds_mla_v4, 0, 16, 1, s) !=
            small::Layout<CacheFormat::fp8_ds_mla_v4, 0, 2, 1>(s).total ||
        small_heads_smem(CacheFormat::fp8_ds_mla_v4, 0, 8, 1, s) !=
            small::Layout<CacheFormat::fp8_ds_mla_v4, 0, 1, 1>(s).total ||
        small_heads_smem(CacheFormat::fp8_ds_mla_v4, 0, 8, 2, s) != 0 ||
        small_heads_smem(CacheFormat::fp8_ds_mla_v4, 0, 16, 2, s) != 0)
      return false;
  return true;
}
static_assert(v4_small_layouts_match(), "kernel_choice.h: the small-heads kernel's fp8_ds_mla_v4 shared memory");
static_assert(kHeadsPerCtaTile == kHeadsPerCta && kWideHeadsPerCta == wide::kWideHeads &&
                  kWgmmaHeadsPerCta == wg::kWgmmaHeads &&
                  kWideMinHeads == wide::kMinHeadsAutomatic && kWideMinRows == wide::kMinRowsAutomatic && kSmallMaxHeads == small::kMaxHeadsAutomatic &&
                  kSmallMinTokens == small::kMinTokensAutomatic &&
                  kSmallMinTokensNoRope == small::kMinTokensAutomaticNoRope &&
                  kSmallMaxHeads16Bit == small::kMaxHeadsAutomatic16Bit &&
                  kSmallMaxHeads16BitTwoGroups == small::kMaxHeadsAutomatic16BitTwoGroups &&
                  kSmallMinTokens16Bit == small::kMinTokensAutomatic16Bit &&
                  kSmallAutomaticForV4 == small::kAutomaticForV4 &&
                  kSmallSixteenHeadsPerWarp == small::kSixteenHeadsPerWarpAutomatic,
              "kernel_choice.h: the automatic rules' thresholds");
static_assert(kWideRegisters * wide::kWideThreads <= kRegistersPerSm, "the wide tile's launch bounds: one CTA per SM");
static_assert(wgmma_threads(CacheFormat::bf16) == wg::kPairThreads &&
                  wgmma_threads(CacheFormat::fp8_ds_mla) == wg::kWgmmaThreads &&
                  wgmma_registers(CacheFormat::bf16) == wg::kPairLaunchRegisters &&
                  wgmma_registers(CacheFormat::bf16) * wg::kPairThreads <= kRegistersPerSm &&
                  wgmma_registers(CacheFormat::fp8_ds_mla) * wg::kWgmmaThreads <= kRegistersPerSm,
              "kernel_choice.h: the wgmma kernels' threads and launch bounds");

}  // namespace

}  // namespace smla::cuda::mla
