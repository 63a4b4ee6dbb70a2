// The MLA attention kernel choice as data (cuda/mla/kernel_choice.h) and what `explain` says of it: pure
// functions of an arch's limits and the shape, so no GPU. tests/gpu/test_cuda_attention.cpp checks the same
// choice against the plan the ops make and the CTAs per SM against cudaOccupancy on a GPU.
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cuda/emulation.h"
#include "cuda/mla/kernel_choice.h"
#include "smla/explain.h"

namespace smla::cuda::mla {
namespace {

constexpr const char* kArchs[] = {"sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120"};

// `sm90a_code`: whether the loaded code has sm_90a's features (on sm_90 only).
KernelLimits limits_of(const char* arch, bool sm90a_code = true) {
  const ArchLimits a = arch_limits(arch);
  return {a.compute_capability, a.max_smem_per_block, a.max_smem_per_sm, a.max_threads_per_sm, a.max_ctas_per_sm,
          sm90a_code && a.compute_capability == 90};
}

// The automatic rule restated from the thresholds and the shared-memory tables (each kernel's shallowest depth).
AttentionKernel expected_kernel(const KernelLimits& l, const KernelShape& s) {
  const bool sixteen_bit = s.format == CacheFormat::bf16 || s.format == CacheFormat::f16;
  const bool few_tokens = s.format == CacheFormat::fp8_ds_mla && s.rope && !s.paged && s.heads >= 8 &&
                          s.heads <= 16 && s.tokens >= 4 && s.tokens <= 8;
  if (few_tokens && l.compute_capability == 90 && l.sm90a_code) return AttentionKernel::wgmma;
  if (s.heads >= wgmma_min_heads(s.format) && wgmma_rows(s.tokens, s.heads) >= wgmma_min_rows(s.rope) &&
      l.compute_capability == 90 && l.sm90a_code && (sixteen_bit || kWgmmaAutomaticForFp8))
    return AttentionKernel::wgmma;
  const int min_tokens = std::max(s.rope ? kSmallMinTokens : kSmallMinTokensNoRope, sixteen_bit ? kSmallMinTokens16Bit : 0);
  const int small_hpc = s.heads <= 8 ? 8 : 16;
  const bool v4 = s.format == CacheFormat::fp8_ds_mla_v4;  // never the dim split
  // 16-bit caches: past 8 heads only as 16 heads a warp (its 2 stages fit).
  const bool sixteen_a_warp =
      kSmallSixteenHeadsPerWarp && small_heads_smem(s.format, s.rope, 16, 2, 2) <= l.max_smem_per_block;
  const int small_max_heads =
      !sixteen_bit ? kSmallMaxHeads : sixteen_a_warp ? kSmallMaxHeads16Bit : kSmallMaxHeads16BitTwoGroups;
  if ((s.format == CacheFormat::fp8_ds_mla || (v4 && kSmallAutomaticForV4) || sixteen_bit) &&
      s.heads <= small_max_heads && s.tokens >= min_tokens &&
      (small_heads_smem(s.format, s.rope, small_hpc, 1, 2) <= l.max_smem_per_block ||
       (!v4 && (small_hpc == 8 || kSmallSixteenHeadsPerWarp) &&
        small_heads_smem(s.format, s.rope, small_hpc, 2, 2) <= l.max_smem_per_block)))
    return AttentionKernel::small_heads;
  if (s.heads >= kWideMinHeads && s.tokens * s.heads >= kWideMinRows &&
      wide_smem(s.format, s.rope, 2) <= l.max_smem_per_block)
    return AttentionKernel::wide_tile;
  return AttentionKernel::head_tile;
}

// On sm_90 also without sm_90a code (a library of 90-real SASS or older PTX): the wgmma kernel is then named first
// with that reason.
TEST(KernelChoice, AutomaticOnEveryArch) {
  for (const char* arch : kArchs)
    for (bool sm90a_code : {true, false})
      for (CacheFormat f : {CacheFormat::bf16, CacheFormat::f16, CacheFormat::fp8_ds_mla, CacheFormat::fp8_ds_mla_v4})
        for (int rope : {0, 64})
          for (bool paged : {false, true})
            for (int heads : {1, 8, 9, 12, 16, 17, 20, 32, 48, 64, 100, 128})
              for (int64_t tokens : {1, 3, 4, 7, 8, 9, 15, 16, 31, 32, 63, 64, 4096}) {
                if (f == CacheFormat::fp8_ds_mla_v4 && rope) continue;
                const KernelLimits l = limits_of(arch, sm90a_code);
                const KernelShape s{f, rope, paged, tokens, heads, {}};
                SCOPED_TRACE(std::string(arch) + (sm90a_code ? "" : " without sm_90a code") + " format " +
                             std::to_string(static_cast<int>(f)) + " rope " + std::to_string(rope) + " heads " +
                             std::to_string(heads) + " tokens " + std::to_string(tokens));
                const KernelDecision d = choose_attention_kernel(l, s);
                ASSERT_TRUE(d.ok());
                EXPECT_EQ(d.chosen.kernel, expected_kernel(l, s));
                EXPECT_LE(d.chosen.smem, l.max_smem_per_block);
                EXPECT_GE(d.chosen.ctas_per_sm, 1);
                EXPECT_EQ(d.chosen.ctas_per_sm, ctas_per_sm(l, d.chosen.threads, d.chosen.registers, d.chosen.smem));
                // Each other kernel once, with its reason; the wgmma kernel on sm_90 only, first.
                EXPECT_EQ(d.num_rejected, l.compute_capability == 90 ? 3 : 2);
                const bool sixteen_bit = f == CacheFormat::bf16 || f == CacheFormat::f16;
                for (int i = 0; i < d.num_rejected; ++i) {
                  const Rejection& r = d.rejected[static_cast<size_t>(i)];
                  EXPECT_NE(r.kernel, d.chosen.kernel);
                  if (r.why == Rejected::smem) EXPECT_GT(r.need, l.max_smem_per_block);
                  EXPECT_EQ(r.kernel == AttentionKernel::wgmma,
                            l.compute_capability == 90 && d.chosen.kernel != AttentionKernel::wgmma && i == 0);
                  if (r.kernel != AttentionKernel::wgmma) continue;
                  const Rejected why = !sm90a_code                  ? Rejected::no_sm90a_code
                                       : !sixteen_bit && !kWgmmaAutomaticForFp8 ? Rejected::cache_format
                                       : heads < wgmma_min_heads(f) ? Rejected::too_few_heads
                                                                    : Rejected::too_few_rows;
                  EXPECT_EQ(r.why, why);
                }
                // Where the wgmma kernel runs, the wide tile (after the small-heads kernel) is named as beaten by it.
                if (d.chosen.kernel == AttentionKernel::wgmma)
                  EXPECT_EQ(rejection_text(d.rejected[1], d.chosen, 90),
                            d.chosen.heads_per_cta < 32
                                ? std::string("not chosen: fp8_ds_mla at 8-16 heads and 4-8 query rows takes the wgmma "
                                              "kernel's keys-on-M form (sm_90a code)")
                                : "not chosen: " + std::to_string(wgmma_min_heads(f)) + "+ heads at " +
                                      (rope ? "512" : "1,024") +
                                      "+ query rows x heads (heads padded to 64) take the wgmma kernel (sm_90a code)");
              }
}

// Facts the tables give by hand: the wide tile's 192,512 B (bf16, 576-wide heads, depth 2) fit sm_90 and sm_100
// (depth 3: 230,016 B), neither sm_80's 166,912 nor the 99 KB archs' 101,376. 32 tokens of 128 heads are the
// fewest query rows x heads it takes; one token stays on the 16-head tile. (sm_90 here without sm_90a code: with
// it the wgmma kernel takes these, WgmmaAutomaticOnHopper.)
TEST(KernelChoice, WideTileWhereItFits) {
  const KernelShape dsv32_bf16{CacheFormat::bf16, 64, false, 32, 128, {}};
  KernelShape one_token = dsv32_bf16;
  one_token.tokens = 1;
  const KernelDecision latency = choose_attention_kernel(limits_of("sm_90", false), one_token);
  EXPECT_EQ(latency.chosen.kernel, AttentionKernel::head_tile);
  ASSERT_EQ(latency.num_rejected, 3);
  EXPECT_EQ(latency.rejected[2].kernel, AttentionKernel::wide_tile);
  EXPECT_EQ(rejection_text(latency.rejected[2], latency.chosen, 90),
            "not chosen: automatic from 4,096 query rows x heads on, here 128 (fewer run faster on the 16-head tile)");
  one_token.tokens = 31;
  EXPECT_EQ(choose_attention_kernel(limits_of("sm_90", false), one_token).chosen.kernel, AttentionKernel::head_tile);
  for (const char* arch : {"sm_90", "sm_100"}) {
    const KernelDecision d = choose_attention_kernel(limits_of(arch, false), dsv32_bf16);
    EXPECT_EQ(d.chosen.kernel, AttentionKernel::wide_tile) << arch;
    EXPECT_EQ(d.chosen.stages, 3);
    EXPECT_EQ(d.chosen.smem, 230016);
    EXPECT_EQ(d.chosen.ctas_per_sm, 1);
    EXPECT_EQ(d.chosen.heads_per_cta, 64);
  }
  const KernelDecision rtx = choose_attention_kernel(limits_of("sm_120"), dsv32_bf16);
  EXPECT_EQ(rtx.chosen.kernel, AttentionKernel::head_tile);
  bool named = false;
  for (int i = 0; i < rtx.num_rejected; ++i)
    if (rtx.rejected[static_cast<size_t>(i)].kernel == AttentionKernel::wide_tile) {
      EXPECT_EQ(rejection_text(rtx.rejected[static_cast<size_t>(i)], rtx.chosen, 120),
                "needs 192,512 B of shared memory per block; sm_120 allows 101,376");
      named = true;
    }
  EXPECT_TRUE(named);
  EXPECT_EQ(choose_attention_kernel(limits_of("sm_80"), dsv32_bf16).chosen.kernel, AttentionKernel::head_tile);
}

TEST(KernelChoice, ForcedKernelsAndDepths) {
  KernelShape s{CacheFormat::fp8_ds_mla, 64, false, 4, 128, {AttentionKernel::wide_tile, 2}};
  KernelDecision d = choose_attention_kernel(limits_of("sm_90"), s);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d.chosen.kernel, AttentionKernel::wide_tile);
  EXPECT_EQ(d.chosen.stages, 2);
  EXPECT_EQ(d.chosen.smem, wide_smem(CacheFormat::fp8_ds_mla, 64, 2));
  for (int i = 0; i < d.num_rejected; ++i) EXPECT_EQ(d.rejected[static_cast<size_t>(i)].why, Rejected::forced_other);
  // Forced where it does not fit: no choice, and why.
  d = choose_attention_kernel(limits_of("sm_120"), s);
  EXPECT_FALSE(d.ok());
  EXPECT_EQ(d.rejected[0].kernel, AttentionKernel::wide_tile);
  EXPECT_EQ(d.rejected[0].why, Rejected::smem);
  EXPECT_EQ(d.rejected[0].need, wide_smem(CacheFormat::fp8_ds_mla, 64, 2));
  // A depth the kernel does not compile is no choice either (the ops report it as a bad argument).
  s.forced.stages = 4;
  EXPECT_FALSE(choose_attention_kernel(limits_of("sm_90"), s).ok());
  // The small-heads kernel forced at 16 heads per CTA on bf16 rows (160 KB and more): sm_90 only of these.
  const KernelShape small{CacheFormat::bf16, 64, true, 1, 16, {AttentionKernel::small_heads, 0, 16}};
  EXPECT_TRUE(choose_attention_kernel(limits_of("sm_90"), small).ok());
  EXPECT_FALSE(choose_attention_kernel(limits_of("sm_86"), small).ok());
}

// How the ops split a row's keys: whole below four chunks, one chunk a split where that fits one wave, else the
// count that fills the slots in whole waves best (the smallest on ties), at least two chunks a split.
TEST(KernelChoice, SplitsFillWholeWaves) {
  EXPECT_EQ(choose_splits(1, 1, 264), 1);
  EXPECT_EQ(choose_splits(1, 3, 264), 1);     // fewer than four chunks: whole
  EXPECT_EQ(choose_splits(1, 64, 264), 64);   // one token of 8 heads, top-k 2048 in 32-key chunks: 64 one-chunk splits
  EXPECT_EQ(choose_splits(1, 2048, 264), 264);   // one token of top-k 65536: one whole wave of 7-8-chunk splits
  EXPECT_EQ(choose_splits(1, 2048, 4096), 1024);  // one chunk a split would fit: the most the combine merges
  EXPECT_EQ(choose_splits(8, 64, 264), 32);   // 512 one-chunk CTAs do not fit one wave; 32 two-chunk splits do
  // 384 CTAs on 264 slots: 2 splits fill 3 waves 97%; 4 and 6 fill them as well (ties: the smallest), beyond 6 the
  // search stops (at most 8 waves' worth).
  EXPECT_EQ(choose_splits(384, 64, 264), 2);
  for (int64_t ctas : {1, 7, 64, 128, 300, 5000})
    for (int chunks : {4, 5, 64, 65, 2048})
      for (int64_t slots : {132, 264, 528}) {
        const int s = choose_splits(ctas, chunks, slots);
        SCOPED_TRACE(std::to_string(ctas) + " CTAs, " + std::to_string(chunks) + " chunks, " + std::to_string(slots) +
                     " slots: " + std::to_string(s) + " splits");
        EXPECT_GE(s, 1);
        EXPECT_LE(s, std::min(chunks, kMaxSplits));
        if (ctas * chunks > slots) EXPECT_LE(s, chunks / 2);  // two chunks a split at least, unless one wave holds all
        else EXPECT_EQ(s, std::min(chunks, kMaxSplits));        // else one chunk a split
      }
}

// A forced kernel given a field it does not take is refused (the ops raise invalid_argument with this text), not
// run as if the field were not there; the small-heads kernel and an automatic choice take every field.
TEST(KernelChoice, ForcedFieldsAKernelDoesNotTake) {
  using K = AttentionKernel;
  for (const AttentionChoice& fine :
       {AttentionChoice{K::automatic, 3, 16, 2, 4, RowCopy::pieces}, AttentionChoice{K::small_heads, 3, 16, 2, 4, RowCopy::bulk},
        AttentionChoice{K::wide_tile, 3, 0, 0, 4}, AttentionChoice{K::wgmma, 0, 32, 0, 4}, AttentionChoice{K::head_tile, 0, 0, 0, 4}})
    EXPECT_EQ(forced_fields_not_taken(fine), "") << kernel_name(fine.kernel);
  EXPECT_EQ(forced_fields_not_taken({K::head_tile, 3}),
            "the 16-head tile was forced with stages, which it does not take (the small-heads kernel takes each; the "
            "wide tile stages; the wgmma kernel heads_per_cta)");
  EXPECT_NE(forced_fields_not_taken({K::head_tile, 0, 16, 2, 0, RowCopy::pieces}).find("with heads_per_cta, split_dims, copy,"),
            std::string::npos);
  EXPECT_NE(forced_fields_not_taken({K::wide_tile, 2, 64}).find("wide tile was forced with heads_per_cta,"),
            std::string::npos);
  EXPECT_NE(forced_fields_not_taken({K::wgmma, 2, 64, 0, 0, RowCopy::bulk}).find("wgmma kernel was forced with stages, copy,"),
            std::string::npos);
}

// The wgmma kernel forced: on sm_90 with sm_90a code, every cache format; 64 heads per CTA; for 16-bit caches the
// pairs kernel (12 warps, two key tiles and two P tiles: 226 KB for 576-wide heads, 210 KB for 512-wide ones), for
// fp8 ones the staged kernel (8 warps, one key tile and a staging buffer: 194 KB, 170 KB or 174 KB), one CTA per SM. Elsewhere a forced wgmma kernel is no choice, and why: the arch, or the code loaded on
// sm_90.
TEST(KernelChoice, WgmmaForcedOnHopperWithSm90aCode) {
  for (CacheFormat f : {CacheFormat::bf16, CacheFormat::f16})
    for (int rope : {0, 64}) {
      const KernelShape s{f, rope, rope == 0, 2, 100, {AttentionKernel::wgmma}};
      const KernelDecision d = choose_attention_kernel(limits_of("sm_90"), s);
      ASSERT_TRUE(d.ok());
      EXPECT_EQ(d.chosen.kernel, AttentionKernel::wgmma);
      EXPECT_EQ(d.chosen.heads_per_cta, 64);
      EXPECT_EQ(d.chosen.threads, 384);
      EXPECT_EQ(d.chosen.smem, rope ? 231016 : 214632);
      EXPECT_EQ(d.chosen.ctas_per_sm, 1);
      EXPECT_EQ(variant_text(d.chosen), std::string("wgmma kernel (64 heads/CTA, 12 warps, depth 2, ") +
                                            (rope ? "231,016" : "214,632") + " B shared memory, 1 CTA/SM)");
      ASSERT_EQ(d.num_rejected, 3);
      for (int i = 0; i < d.num_rejected; ++i) EXPECT_EQ(d.rejected[static_cast<size_t>(i)].why, Rejected::forced_other);
      for (const char* arch : {"sm_80", "sm_86", "sm_89", "sm_100", "sm_120"}) {
        const KernelDecision off = choose_attention_kernel(limits_of(arch), s);
        EXPECT_FALSE(off.ok()) << arch;
        ASSERT_GE(off.num_rejected, 1);
        EXPECT_EQ(off.rejected[0].kernel, AttentionKernel::wgmma);
        EXPECT_EQ(off.rejected[0].why, Rejected::arch);
        EXPECT_EQ(rejection_text(off.rejected[0], off.chosen, limits_of(arch).compute_capability),
                  "needs sm_90a (wgmma); this is " + std::string(arch));
      }
      const KernelDecision no_code = choose_attention_kernel(limits_of("sm_90", false), s);
      EXPECT_FALSE(no_code.ok());
      ASSERT_GE(no_code.num_rejected, 1);
      EXPECT_EQ(no_code.rejected[0].why, Rejected::no_sm90a_code);
      EXPECT_EQ(rejection_text(no_code.rejected[0], no_code.chosen, 90),
                "needs sm_90a code (wgmma); this library's code for sm_90 has none (built without 90a, or PTX only)");
    }
  for (const auto& [f, rope, smem] : {std::tuple{CacheFormat::fp8_ds_mla, 64, 198416},
                                      {CacheFormat::fp8_ds_mla, 0, 173840}, {CacheFormat::fp8_ds_mla_v4, 0, 177936}}) {
    const KernelDecision fp8 = choose_attention_kernel(limits_of("sm_90"), {f, rope, false, 2, 64, {AttentionKernel::wgmma}});
    ASSERT_TRUE(fp8.ok());
    EXPECT_EQ(fp8.chosen.kernel, AttentionKernel::wgmma);
    EXPECT_EQ(fp8.chosen.smem, smem);
    EXPECT_EQ(fp8.chosen.threads, 256);
    EXPECT_EQ(fp8.chosen.ctas_per_sm, 1);
  }
}

// The wgmma kernel's keys-on-M form, forced with 8, 16 or 32 heads per CTA over an fp8_ds_mla cache (sparse or paged,
// both rope widths): three warpgroups and three staging buffers (32 heads: four warpgroups, two buffers), one CTA per
// SM on sm_90 with sm_90a code; 64 heads per CTA otherwise (the staged kernel).
TEST(KernelChoice, WgmmaKeysOnMForced) {
  for (int hpc : {8, 16, 32})
    for (int rope : {0, 64})
      for (bool paged : {false, true}) {
        const KernelShape s{CacheFormat::fp8_ds_mla, rope, paged, 128, 8, {AttentionKernel::wgmma, 0, hpc}};
        const KernelDecision d = choose_attention_kernel(limits_of("sm_90"), s);
        ASSERT_TRUE(d.ok());
        EXPECT_EQ(d.chosen.kernel, AttentionKernel::wgmma);
        EXPECT_EQ(d.chosen.heads_per_cta, hpc);
        EXPECT_EQ(d.chosen.threads, hpc == 32 ? 512 : 384);
        EXPECT_EQ(d.chosen.stages, hpc == 32 ? 2 : 3);
        const int smem = rope ? (hpc == 8 ? 211256 : hpc == 16 ? 221752 : 200496)
                              : (hpc == 8 ? 177464 : hpc == 16 ? 186936 : 171824);
        const char* smem_text = rope ? (hpc == 8 ? "211,256" : hpc == 16 ? "221,752" : "200,496")
                                     : (hpc == 8 ? "177,464" : hpc == 16 ? "186,936" : "171,824");
        EXPECT_EQ(d.chosen.smem, smem);
        EXPECT_EQ(d.chosen.ctas_per_sm, 1);
        std::string text = "wgmma kernel (";
        text += std::to_string(hpc);
        text += hpc == 32 ? " heads/CTA, 16 warps, depth 2, keys on M, " : " heads/CTA, 12 warps, depth 3, keys on M, ";
        text += smem_text;
        text += " B shared memory, 1 CTA/SM)";
        EXPECT_EQ(variant_text(d.chosen), text);
        EXPECT_FALSE(choose_attention_kernel(limits_of("sm_90", false), s).ok());
        EXPECT_FALSE(choose_attention_kernel(limits_of("sm_120"), s).ok());
      }
  const KernelDecision staged =
      choose_attention_kernel(limits_of("sm_90"), {CacheFormat::bf16, 64, false, 128, 8, {AttentionKernel::wgmma, 0, 8}});
  ASSERT_TRUE(staged.ok());
  EXPECT_EQ(staged.chosen.heads_per_cta, 64);
}

// Chosen, not forced: sparse attention over fp8_ds_mla for 17-32 heads from 32 tokens on takes the keys-on-M form's
// 32 heads per CTA on Hopper; fewer tokens, more heads, dense paged decode, other formats and a forced wgmma kernel
// keep the 64-head tile, and 16 heads the small-heads kernel.
TEST(KernelChoice, WgmmaKeysOnMChosenFor17To32HeadsFromThirtyTwoTokens) {
  const auto chosen = [](CacheFormat f, bool paged, int64_t tokens, int heads, AttentionChoice forced = {}) {
    const KernelDecision d = choose_attention_kernel(limits_of("sm_90"), {f, 64, paged, tokens, heads, forced});
    EXPECT_TRUE(d.ok());
    return d.chosen;
  };
  for (int heads : {17, 20, 32})
    for (int64_t tokens : {32, 128, 4096}) {
      const KernelVariant v = chosen(CacheFormat::fp8_ds_mla, false, tokens, heads);
      EXPECT_EQ(v.kernel, AttentionKernel::wgmma) << heads << " heads, " << tokens << " tokens";
      EXPECT_EQ(v.heads_per_cta, 32) << heads << " heads, " << tokens << " tokens";
      EXPECT_NE(variant_text(v).find("keys on M"), std::string::npos);
    }
  EXPECT_EQ(chosen(CacheFormat::fp8_ds_mla, false, 31, 32).heads_per_cta, 64);
  EXPECT_EQ(chosen(CacheFormat::fp8_ds_mla, false, 128, 33).heads_per_cta, 64);
  EXPECT_EQ(chosen(CacheFormat::fp8_ds_mla, true, 128, 32).heads_per_cta, 64);
  EXPECT_EQ(chosen(CacheFormat::bf16, false, 128, 32).heads_per_cta, 64);
  EXPECT_EQ(chosen(CacheFormat::fp8_ds_mla, false, 128, 32, {AttentionKernel::wgmma}).heads_per_cta, 64);
  EXPECT_EQ(chosen(CacheFormat::fp8_ds_mla, false, 128, 16).kernel, AttentionKernel::small_heads);
  EXPECT_FALSE(choose_attention_kernel(limits_of("sm_120"), {CacheFormat::fp8_ds_mla, 64, false, 128, 32, {}})
                   .chosen.kernel == AttentionKernel::wgmma);
}

// Chosen, not forced: sparse attention over fp8_ds_mla (576-wide heads) for 8-16 heads at 4-8 tokens takes the
// keys-on-M form with the heads rounded up to 8 or 16 per CTA on Hopper; 1-3 and 9+ tokens, 7 and 17 heads, rope-free
// heads, dense paged decode, bf16 caches, a forced kernel and other archs do not.
TEST(KernelChoice, WgmmaKeysOnMChosenFor8To16HeadsAt4To8Tokens) {
  const auto chosen = [](const char* arch, CacheFormat f, int rope, bool paged, int64_t tokens, int heads,
                         AttentionChoice forced = {}) {
    const KernelDecision d = choose_attention_kernel(limits_of(arch), {f, rope, paged, tokens, heads, forced});
    EXPECT_TRUE(d.ok());
    return d;
  };
  for (int heads : {8, 9, 12, 16})
    for (int64_t tokens : {4, 5, 8}) {
      const KernelDecision d = chosen("sm_90", CacheFormat::fp8_ds_mla, 64, false, tokens, heads);
      SCOPED_TRACE(std::to_string(heads) + " heads, " + std::to_string(tokens) + " tokens");
      EXPECT_EQ(d.chosen.kernel, AttentionKernel::wgmma);
      EXPECT_EQ(d.chosen.heads_per_cta, heads <= 8 ? 8 : 16);
      EXPECT_EQ(d.chosen.threads, 384);
      EXPECT_NE(variant_text(d.chosen).find("keys on M"), std::string::npos);
      ASSERT_EQ(d.num_rejected, 3);
      for (int i = 0; i < d.num_rejected; ++i) {
        EXPECT_EQ(d.rejected[static_cast<size_t>(i)].why, Rejected::other_kernel_won);
        EXPECT_EQ(rejection_text(d.rejected[static_cast<size_t>(i)], d.chosen, 90),
                  "not chosen: fp8_ds_mla at 8-16 heads and 4-8 query rows takes the wgmma kernel's keys-on-M form "
                  "(sm_90a code)");
      }
    }
  for (int64_t tokens : {1, 3, 9, 16})
    EXPECT_NE(chosen("sm_90", CacheFormat::fp8_ds_mla, 64, false, tokens, 8).chosen.kernel, AttentionKernel::wgmma)
        << tokens << " tokens";
  for (int heads : {7, 17})
    EXPECT_NE(chosen("sm_90", CacheFormat::fp8_ds_mla, 64, false, 8, heads).chosen.heads_per_cta,
              heads <= 8 ? 8 : 16)
        << heads << " heads";
  EXPECT_NE(chosen("sm_90", CacheFormat::fp8_ds_mla, 0, false, 8, 8).chosen.kernel, AttentionKernel::wgmma);
  EXPECT_NE(chosen("sm_90", CacheFormat::fp8_ds_mla, 64, true, 8, 8).chosen.kernel, AttentionKernel::wgmma);
  EXPECT_NE(chosen("sm_90", CacheFormat::bf16, 64, false, 8, 8).chosen.kernel, AttentionKernel::wgmma);
  EXPECT_EQ(chosen("sm_90", CacheFormat::fp8_ds_mla, 64, false, 8, 8, {AttentionKernel::head_tile}).chosen.kernel,
            AttentionKernel::head_tile);
  EXPECT_EQ(chosen("sm_90", CacheFormat::fp8_ds_mla, 64, false, 8, 8, {AttentionKernel::wgmma}).chosen.heads_per_cta,
            64);
  EXPECT_NE(chosen("sm_120", CacheFormat::fp8_ds_mla, 64, false, 8, 8).chosen.kernel, AttentionKernel::wgmma);
  EXPECT_FALSE(choose_attention_kernel(limits_of("sm_90", false), {CacheFormat::fp8_ds_mla, 64, false, 8, 8, {}})
                   .chosen.kernel == AttentionKernel::wgmma);
}

// Automatic on sm_90: the wgmma kernel wherever the wide tile would run with a 16-bit cache (DeepSeek-V3.2's 128
// heads from 32 tokens on, 64 heads from 64, prefill, paged), for fp8 caches too (kWgmmaAutomaticForFp8; the wide
// tile while it is off), and from 9 heads (16-bit caches) or 17 (fp8) on at 512 query rows x padded heads; the wide
// tile where the code has no sm_90a features, the 16-head tile below the rows; each time the wgmma kernel is named
// (first) with why not.
TEST(KernelChoice, WgmmaAutomaticOnHopper) {
  const KernelLimits hopper = limits_of("sm_90"), no_code = limits_of("sm_90", false);
  for (CacheFormat f : {CacheFormat::bf16, CacheFormat::f16})
    for (bool paged : {false, true})
      for (const auto& [tokens, heads] : {std::pair<int64_t, int>{32, 128}, {64, 64}, {128, 128}, {4096, 128}}) {
        const KernelShape s{f, 64, paged, tokens, heads, {}};
        const KernelDecision d = choose_attention_kernel(hopper, s);
        EXPECT_EQ(d.chosen.kernel, AttentionKernel::wgmma);
        EXPECT_EQ(d.chosen.smem, 231016);
        EXPECT_EQ(d.chosen.ctas_per_sm, 1);
        const KernelDecision old = choose_attention_kernel(no_code, s);
        EXPECT_EQ(old.chosen.kernel, AttentionKernel::wide_tile);
        ASSERT_EQ(old.num_rejected, 3);
        EXPECT_EQ(old.rejected[0].kernel, AttentionKernel::wgmma);
        EXPECT_EQ(old.rejected[0].why, Rejected::no_sm90a_code);
      }
  const KernelDecision fp8 = choose_attention_kernel(hopper, {CacheFormat::fp8_ds_mla, 64, false, 128, 128, {}});
  if (kWgmmaAutomaticForFp8) {
    EXPECT_EQ(fp8.chosen.kernel, AttentionKernel::wgmma);
  } else {
    EXPECT_EQ(fp8.chosen.kernel, AttentionKernel::wide_tile);
    EXPECT_EQ(fp8.rejected[0].kernel, AttentionKernel::wgmma);
    EXPECT_EQ(rejection_text(fp8.rejected[0], fp8.chosen, 90),
              "not chosen: automatic for bf16 and f16 caches only (fp8 caches: forced only)");
  }
  const KernelDecision one = choose_attention_kernel(hopper, {CacheFormat::bf16, 64, false, 1, 128, {}});
  EXPECT_EQ(one.chosen.kernel, AttentionKernel::head_tile);
  EXPECT_EQ(one.rejected[0].kernel, AttentionKernel::wgmma);
  EXPECT_EQ(rejection_text(one.rejected[0], one.chosen, 90),
            "not chosen: automatic from 512 query rows x heads (heads padded to 64) on, here 128 (fewer run faster on "
            "the 16-head tile)");
  // From kWgmmaMinRows on: 4 tokens of 128 heads, 8 of 64 (the wide tile's rule would wait for 4096); 512-wide heads
  // (DeepSeek-V4) from kWgmmaMinRowsNoRope.
  for (const auto& [tokens, heads] : {std::pair{4, 128}, std::pair{8, 64}}) {
    EXPECT_EQ(choose_attention_kernel(hopper, {CacheFormat::bf16, 64, false, tokens, heads, {}}).chosen.kernel,
              AttentionKernel::wgmma);
    EXPECT_EQ(choose_attention_kernel(hopper, {CacheFormat::bf16, 0, false, tokens, heads, {}}).chosen.kernel,
              AttentionKernel::head_tile);
    EXPECT_EQ(choose_attention_kernel(hopper, {CacheFormat::fp8_ds_mla_v4, 0, false, 2 * tokens, heads, {}}).chosen.kernel,
              kWgmmaAutomaticForFp8 ? AttentionKernel::wgmma : AttentionKernel::head_tile);
  }
  EXPECT_EQ(choose_attention_kernel(hopper, {CacheFormat::bf16, 64, false, 7, 64, {}}).chosen.kernel,
            AttentionKernel::head_tile);
  // From wgmma_min_heads on (17 with fp8 caches, 9 with 16-bit ones), its 64-head tile padded: 8 tokens of up to 63
  // heads (512 rows), 16 without rope; ahead of the small-heads kernel (which takes fp8 caches up to 32 heads
  // elsewhere).
  for (CacheFormat f : {CacheFormat::bf16, CacheFormat::fp8_ds_mla})
    for (int heads : {17, 20, 32, 48}) {
      EXPECT_EQ(choose_attention_kernel(hopper, {f, 64, false, 8, heads, {}}).chosen.kernel, AttentionKernel::wgmma);
      EXPECT_EQ(choose_attention_kernel(hopper, {f, 64, true, 128, heads, {}}).chosen.kernel, AttentionKernel::wgmma);
      EXPECT_EQ(choose_attention_kernel(hopper, {f, 0, false, 16, heads, {}}).chosen.kernel, AttentionKernel::wgmma);
      EXPECT_EQ(choose_attention_kernel(hopper, {f, 0, false, 15, heads, {}}).chosen.kernel, AttentionKernel::head_tile);
      const KernelDecision seven = choose_attention_kernel(hopper, {f, 64, false, 7, heads, {}});
      EXPECT_EQ(seven.chosen.kernel, AttentionKernel::head_tile);
      EXPECT_EQ(rejection_text(seven.rejected[0], seven.chosen, 90),
                "not chosen: automatic from 512 query rows x heads (heads padded to 64) on, here 448 (fewer run "
                "faster on the 16-head tile)");
    }
  const KernelDecision prefill = choose_attention_kernel(hopper, {CacheFormat::bf16, 64, false, 4096, 32, {}});
  EXPECT_EQ(prefill.chosen.kernel, AttentionKernel::wgmma);
  EXPECT_EQ(rejection_text(prefill.rejected[0], prefill.chosen, 90),
            "not chosen: 9+ heads at 512+ query rows x heads (heads padded to 64) take the wgmma kernel (sm_90a code)");
  for (int heads : {9, 12, 16}) {
    EXPECT_EQ(choose_attention_kernel(hopper, {CacheFormat::bf16, 64, false, 128, heads, {}}).chosen.kernel,
              AttentionKernel::wgmma);
    EXPECT_EQ(choose_attention_kernel(hopper, {CacheFormat::f16, 64, true, 8, heads, {}}).chosen.kernel,
              AttentionKernel::wgmma);
  }
  EXPECT_EQ(choose_attention_kernel(hopper, {CacheFormat::bf16, 64, false, 128, 8, {}}).chosen.kernel,
            AttentionKernel::small_heads);
  // 16 heads stay with the small-heads kernel (fp8_ds_mla: 86.9 against 126.1 us at 128 tokens on an H200).
  const KernelDecision few = choose_attention_kernel(hopper, {CacheFormat::fp8_ds_mla, 64, false, 128, 16, {}});
  EXPECT_EQ(few.chosen.kernel, AttentionKernel::small_heads);
  EXPECT_EQ(few.rejected[0].why, Rejected::too_few_heads);
  EXPECT_EQ(rejection_text(few.rejected[0], few.chosen, 90), "not chosen: automatic from 17 heads on, here 16");
  // Another arch never names it.
  for (const char* arch : {"sm_80", "sm_100", "sm_120"}) {
    const KernelDecision d = choose_attention_kernel(limits_of(arch), {CacheFormat::bf16, 64, false, 4096, 128, {}});
    for (int i = 0; i < d.num_rejected; ++i)
      EXPECT_NE(d.rejected[static_cast<size_t>(i)].kernel, AttentionKernel::wgmma) << arch;
  }
}

// The 16-head tile keeps two CTAs per SM where a depth allows it: deeper pipelines only while they do.
TEST(KernelChoice, HeadTileDepthKeepsTwoCtasPerSm) {
  for (const char* arch : kArchs)
    for (CacheFormat f : {CacheFormat::bf16, CacheFormat::fp8_ds_mla}) {
      const KernelLimits l = limits_of(arch);
      const KernelDecision d = choose_attention_kernel(l, {f, 64, true, 1, 16, {}});
      ASSERT_EQ(d.chosen.kernel, AttentionKernel::head_tile);
      EXPECT_GE(d.chosen.ctas_per_sm, 1);
      const int deeper = head_tile_smem(f, 64, d.chosen.stages + 1);
      if (deeper > 0 && deeper <= l.max_smem_per_block)  // the next depth fits but keeps fewer than two CTAs
        EXPECT_LT(ctas_per_sm(l, 128, kHeadTileRegisters, deeper), std::min(2, d.chosen.ctas_per_sm + 1)) << arch;
    }
}

// explain: the CUDA backend's notes name the kernel choose_attention_kernel picks (from its data, not per-case
// strings) for decode and prefill, or for the query rows per call the run names, with each other kernel's reason.
struct NotesCase {
  const char* model;
  int tp;
  DType kv;
};

TEST(KernelChoice, ExplainNamesTheVariantOnEveryArch) {
  const Backend* mma = Registry::global().find("cuda_mma");
  ASSERT_NE(mma, nullptr);
  ASSERT_TRUE(static_cast<bool>(mma->capabilities().kernel_choices));
  for (const NotesCase& c : {NotesCase{"glm-5", 8, DType::fp8_ds_mla}, NotesCase{"glm-5", 8, DType::bf16},
                             NotesCase{"deepseek-v3.2", 1, DType::fp8_ds_mla}, NotesCase{"deepseek-v3.2", 1, DType::bf16}})
    for (const char* arch : kArchs)
      for (const std::vector<int64_t>& given : {std::vector<int64_t>{}, std::vector<int64_t>{2, 8, 64, 512}}) {
        const AttentionSpec spec = load_model_spec(c.model);
        RunSpec run;
        run.device = parse_device(arch);
        run.kv_cache_dtype = c.kv;
        run.tp = c.tp;
        run.query_tokens = given;
        SCOPED_TRACE(std::string(c.model) + " " + arch + " " + std::string(dtype_name(c.kv)) + " " +
                     std::to_string(given.size()) + " row counts given");
        const std::vector<KernelChoice> choices = mma->capabilities().kernel_choices(spec, run);
        const KernelLimits l = limits_of(arch, sm90a_code_built());  // explain: the build's arch list
        const CacheFormat f = c.kv == DType::bf16 ? CacheFormat::bf16 : CacheFormat::fp8_ds_mla;
        const std::vector<int64_t> rows = given.empty() ? std::vector<int64_t>{1, 4096} : given;
        ASSERT_EQ(choices.size(), rows.size());
        for (size_t i = 0; i < rows.size(); ++i) {
          const KernelChoice& k = choices[i];
          const KernelShape s{f, 64, false, rows[i], spec.num_heads / c.tp, {}};
          const KernelDecision d = choose_attention_kernel(l, s);
          ASSERT_EQ(d.chosen.kernel, expected_kernel(l, s));
          EXPECT_EQ(k.query_tokens, rows[i]);
          EXPECT_EQ(k.phase, given.empty() ? (rows[i] == 1 ? "decode" : "prefill") : "");
          EXPECT_EQ(k.kernel, kernel_name(d.chosen.kernel));
          EXPECT_EQ(k.arch, std::string(arch) + (l.sm90a_code ? "a" : ""));
          EXPECT_EQ(k.heads_per_cta, d.chosen.heads_per_cta);
          EXPECT_EQ(k.warps, d.chosen.threads / 32);
          EXPECT_EQ(k.stages, d.chosen.stages);
          EXPECT_EQ(k.smem_bytes, d.chosen.smem);
          EXPECT_EQ(k.ctas_per_sm, d.chosen.ctas_per_sm);
          EXPECT_EQ(k.kernel + " (" + k.shape + ")", variant_text(d.chosen));
          // Every other kernel (on sm_90 the wgmma kernel too), with its reason.
          ASSERT_EQ(d.num_rejected, std::string(arch) == "sm_90" ? 3 : 2);
          ASSERT_EQ(k.others.size(), static_cast<size_t>(d.num_rejected));
          for (int j = 0; j < d.num_rejected; ++j) {
            const Rejection& r = d.rejected[static_cast<size_t>(j)];
            EXPECT_EQ(k.others[static_cast<size_t>(j)].kernel, kernel_name(r.kernel));
            EXPECT_EQ(k.others[static_cast<size_t>(j)].reason, rejection_text(r, d.chosen, l.compute_capability));
          }
        }
      }
}

// How the small-heads kernel copies its rows: one bulk copy a row from sm_90 on (not fp8_ds_mla_v4 rows, whose
// 8 scale bytes are no bulk copy), 16-byte cp.async pieces elsewhere or where forced; bulk copies forced where there
// are none: no choice. Explain names the bulk copies.
TEST(KernelChoice, SmallHeadsRowCopies) {
  for (const char* arch : kArchs) {
    const KernelLimits l = limits_of(arch);
    const bool bulk = l.compute_capability >= 90;
    SCOPED_TRACE(arch);
    for (CacheFormat f : {CacheFormat::bf16, CacheFormat::fp8_ds_mla, CacheFormat::fp8_ds_mla_v4}) {
      const int rope = f == CacheFormat::fp8_ds_mla_v4 ? 0 : 64;
      KernelShape s{f, rope, false, 128, 8, {AttentionKernel::small_heads}};
      const KernelDecision automatic = choose_attention_kernel(l, s);
      if (!automatic.ok()) {  // bf16 rows on the 99 KB archs
        EXPECT_EQ(automatic.rejected[0].why, Rejected::smem);
        continue;
      }
      const bool expected = bulk && f != CacheFormat::fp8_ds_mla_v4;
      EXPECT_EQ(automatic.chosen.bulk_copies, expected);
      EXPECT_EQ(variant_text(automatic.chosen).find("rows by bulk copy") != std::string::npos, expected);
      s.forced.copy = RowCopy::pieces;
      const KernelDecision pieces = choose_attention_kernel(l, s);
      ASSERT_TRUE(pieces.ok());
      EXPECT_FALSE(pieces.chosen.bulk_copies);
      EXPECT_EQ(pieces.chosen.smem, automatic.chosen.smem);  // one layout for both
      s.forced.copy = RowCopy::bulk;
      const KernelDecision forced = choose_attention_kernel(l, s);
      EXPECT_EQ(forced.ok(), expected);
      if (forced.ok()) EXPECT_TRUE(forced.chosen.bulk_copies);
    }
    // The other kernels copy no rows so.
    const KernelDecision tile = choose_attention_kernel(l, {CacheFormat::bf16, 64, false, 1, 16, {}});
    EXPECT_FALSE(tile.chosen.bulk_copies);
  }
}

// glm-5 at tp 8 (8 heads per rank) with an fp8 cache: the small-heads kernel in prefill (8 heads per CTA; the dim
// split where one unsplit CTA of 4 warps is all an SM holds: the 99 KB archs and sm_80's 3 stages, not sm_90/100's
// two), the 16-head tile in one-token decode, on every arch (the small-heads kernel fits 99 KB at 8 heads).
TEST(KernelChoice, Glm5Tp8Fp8) {
  for (const char* arch : kArchs) {
    const KernelLimits l = limits_of(arch);
    const KernelDecision decode = choose_attention_kernel(l, {CacheFormat::fp8_ds_mla, 64, false, 1, 8, {}});
    EXPECT_EQ(decode.chosen.kernel, AttentionKernel::head_tile) << arch;
    const size_t small_at = l.compute_capability == 90 ? 1 : 0;  // after the wgmma kernel (too few heads)
    EXPECT_EQ(decode.rejected[small_at].kernel, AttentionKernel::small_heads);
    EXPECT_EQ(decode.rejected[small_at].why, Rejected::too_few_tokens);
    EXPECT_EQ(decode.rejected[decode.num_rejected - 1].kernel, AttentionKernel::wide_tile);
    EXPECT_EQ(decode.rejected[decode.num_rejected - 1].why, Rejected::too_few_heads);
    const KernelDecision prefill = choose_attention_kernel(l, {CacheFormat::fp8_ds_mla, 64, false, 4096, 8, {}});
    EXPECT_EQ(prefill.chosen.kernel, AttentionKernel::small_heads) << arch;
    EXPECT_EQ(prefill.chosen.heads_per_cta, 8);
    const bool two_ctas = std::string(arch) == "sm_90" || std::string(arch) == "sm_100";
    EXPECT_EQ(prefill.chosen.split_dims, two_ctas ? 1 : 2) << arch;
    EXPECT_EQ(prefill.chosen.ctas_per_sm, two_ctas ? 2 : 1) << arch;
  }
}

}  // namespace
}  // namespace smla::cuda::mla
