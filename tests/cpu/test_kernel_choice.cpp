// The MLA attention kernel choice as data (cuda/mla/kernel_choice.h) and what `explain` says of it: pure
// functions of an arch's limits and the shape, so no GPU. tests/gpu/test_cuda_attention.cpp checks the same
// choice against the plan the ops make and the CTAs per SM against cudaOccupancy on a GPU.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cuda/emulation.h"
#include "cuda/mla/kernel_choice.h"
#include "smla/explain.h"

namespace smla::cuda::mla {
namespace {

constexpr const char* kArchs[] = {"sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120"};

KernelLimits limits_of(const char* arch) {
  const ArchLimits a = arch_limits(arch);
  return {a.compute_capability, a.max_smem_per_block, a.max_smem_per_sm, a.max_threads_per_sm, a.max_ctas_per_sm};
}

// The automatic rule restated from the thresholds and the shared-memory tables (each kernel's shallowest depth).
AttentionKernel expected_kernel(const KernelLimits& l, const KernelShape& s) {
  const int min_tokens = s.rope ? kSmallMinTokens : kSmallMinTokensNoRope;
  const int small_hpc = s.heads <= 8 ? 8 : 16;
  const bool v4 = s.format == CacheFormat::fp8_ds_mla_v4;  // never the dim split
  if ((s.format == CacheFormat::fp8_ds_mla || (v4 && kSmallAutomaticForV4)) && s.heads <= kSmallMaxHeads &&
      s.tokens >= min_tokens &&
      small_heads_smem(s.format, s.rope, small_hpc, small_hpc == 8 && !v4 ? 2 : 1, 2) <= l.max_smem_per_block)
    return AttentionKernel::small_heads;
  if (s.heads >= kWideMinHeads && s.tokens * s.heads >= kWideMinRows &&
      wide_smem(s.format, s.rope, 2) <= l.max_smem_per_block)
    return AttentionKernel::wide_tile;
  return AttentionKernel::head_tile;
}

TEST(KernelChoice, AutomaticOnEveryArch) {
  for (const char* arch : kArchs)
    for (CacheFormat f : {CacheFormat::bf16, CacheFormat::f16, CacheFormat::fp8_ds_mla, CacheFormat::fp8_ds_mla_v4})
      for (int rope : {0, 64})
        for (bool paged : {false, true})
          for (int heads : {1, 8, 16, 32, 64, 100, 128})
            for (int64_t tokens : {1, 15, 16, 63, 64, 4096}) {
              if (f == CacheFormat::fp8_ds_mla_v4 && rope) continue;
              const KernelLimits l = limits_of(arch);
              const KernelShape s{f, rope, paged, tokens, heads, {}};
              SCOPED_TRACE(std::string(arch) + " format " + std::to_string(static_cast<int>(f)) + " rope " +
                           std::to_string(rope) + " heads " + std::to_string(heads) + " tokens " +
                           std::to_string(tokens));
              const KernelDecision d = choose_attention_kernel(l, s);
              ASSERT_TRUE(d.ok());
              EXPECT_EQ(d.chosen.kernel, expected_kernel(l, s));
              EXPECT_LE(d.chosen.smem, l.max_smem_per_block);
              EXPECT_GE(d.chosen.ctas_per_sm, 1);
              EXPECT_EQ(d.chosen.ctas_per_sm, ctas_per_sm(l, d.chosen.threads, d.chosen.registers, d.chosen.smem));
              // Each other kernel once, with its reason; the wgmma kernel on sm_90 only, last, as forced only.
              EXPECT_EQ(d.num_rejected, l.compute_capability == 90 ? 3 : 2);
              for (int i = 0; i < d.num_rejected; ++i) {
                const Rejection& r = d.rejected[static_cast<size_t>(i)];
                EXPECT_NE(r.kernel, d.chosen.kernel);
                if (r.why == Rejected::smem) EXPECT_GT(r.need, l.max_smem_per_block);
                EXPECT_EQ(r.kernel == AttentionKernel::wgmma, i == 2);
                if (r.kernel == AttentionKernel::wgmma) EXPECT_EQ(r.why, Rejected::forced_only);
              }
            }
}

// Facts the tables give by hand: the wide tile's 192,512 B (bf16, 576-wide heads, depth 2) fit sm_90 and sm_100
// (depth 3: 230,016 B), neither sm_80's 166,912 nor the 99 KB archs' 101,376. 32 tokens of 128 heads are the
// fewest query rows x heads it takes; one token stays on the 16-head tile.
TEST(KernelChoice, WideTileWhereItFits) {
  const KernelShape dsv32_bf16{CacheFormat::bf16, 64, false, 32, 128, {}};
  KernelShape one_token = dsv32_bf16;
  one_token.tokens = 1;
  const KernelDecision latency = choose_attention_kernel(limits_of("sm_90"), one_token);
  EXPECT_EQ(latency.chosen.kernel, AttentionKernel::head_tile);
  ASSERT_GE(latency.num_rejected, 2);
  EXPECT_EQ(latency.rejected[1].kernel, AttentionKernel::wide_tile);
  EXPECT_EQ(rejection_text(latency.rejected[1], latency.chosen, 90),
            "not chosen: automatic from 4,096 query rows x heads on, here 128 (fewer run faster on the 16-head tile)");
  one_token.tokens = 31;
  EXPECT_EQ(choose_attention_kernel(limits_of("sm_90"), one_token).chosen.kernel, AttentionKernel::head_tile);
  for (const char* arch : {"sm_90", "sm_100"}) {
    const KernelDecision d = choose_attention_kernel(limits_of(arch), dsv32_bf16);
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
  // The small-heads kernel forced at 16 heads per CTA on bf16 rows (157 KB and more): sm_90 only of these.
  const KernelShape small{CacheFormat::bf16, 64, true, 1, 16, {AttentionKernel::small_heads, 0, 16}};
  EXPECT_TRUE(choose_attention_kernel(limits_of("sm_90"), small).ok());
  EXPECT_FALSE(choose_attention_kernel(limits_of("sm_86"), small).ok());
}

// The wgmma kernel: forced only (kWgmmaAutomatic), on sm_90 (sm_90a code) with 16-bit caches; 64 heads per CTA,
// 8 warps, 225 KB (576-wide heads) or 201 KB, one CTA per SM. Elsewhere a forced wgmma kernel is no choice, and
// why: the arch, or the cache format.
TEST(KernelChoice, WgmmaForcedOnHopperOnly) {
  static_assert(!kWgmmaAutomatic, "this test restates the rule while the kernel is forced only");
  for (CacheFormat f : {CacheFormat::bf16, CacheFormat::f16})
    for (int rope : {0, 64}) {
      const KernelShape s{f, rope, rope == 0, 2, 100, {AttentionKernel::wgmma}};
      const KernelDecision d = choose_attention_kernel(limits_of("sm_90"), s);
      ASSERT_TRUE(d.ok());
      EXPECT_EQ(d.chosen.kernel, AttentionKernel::wgmma);
      EXPECT_EQ(d.chosen.heads_per_cta, 64);
      EXPECT_EQ(d.chosen.threads, 256);
      EXPECT_EQ(d.chosen.smem, rope ? 230400 : 205824);
      EXPECT_EQ(d.chosen.ctas_per_sm, 1);
      EXPECT_EQ(variant_text(d.chosen), std::string("wgmma kernel (64 heads/CTA, 8 warps, depth 2, ") +
                                            (rope ? "230,400" : "205,824") + " B shared memory, 1 CTA/SM)");
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
    }
  const KernelDecision fp8 =
      choose_attention_kernel(limits_of("sm_90"), {CacheFormat::fp8_ds_mla, 64, false, 2, 64, {AttentionKernel::wgmma}});
  EXPECT_FALSE(fp8.ok());
  EXPECT_EQ(fp8.rejected[0].why, Rejected::cache_format);
  EXPECT_EQ(rejection_text(fp8.rejected[0], fp8.chosen, 90), "reads bf16 and f16 caches only");
  // Automatic: never chosen, named on sm_90 as forced only.
  const KernelDecision automatic = choose_attention_kernel(limits_of("sm_90"), {CacheFormat::bf16, 64, false, 128, 128, {}});
  EXPECT_EQ(automatic.chosen.kernel, AttentionKernel::wide_tile);
  const Rejection& last = automatic.rejected[static_cast<size_t>(automatic.num_rejected - 1)];
  EXPECT_EQ(last.kernel, AttentionKernel::wgmma);
  EXPECT_EQ(rejection_text(last, automatic.chosen, 90),
            "not chosen: forced only, until measured faster than the wide tile");
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
// strings) for decode and prefill, with each other kernel's reason.
struct NotesCase {
  const char* model;
  int tp;
  DType kv;
};

TEST(KernelChoice, ExplainNamesTheVariantOnEveryArch) {
  const Backend* mma = Registry::global().find("cuda_mma");
  ASSERT_NE(mma, nullptr);
  ASSERT_TRUE(static_cast<bool>(mma->capabilities().kernel_notes));
  for (const NotesCase& c : {NotesCase{"glm-5", 8, DType::fp8_ds_mla}, NotesCase{"glm-5", 8, DType::bf16},
                             NotesCase{"deepseek-v3.2", 1, DType::fp8_ds_mla}, NotesCase{"deepseek-v3.2", 1, DType::bf16}})
    for (const char* arch : kArchs) {
      const AttentionSpec spec = load_model_spec(c.model);
      RunSpec run;
      run.device = parse_device(arch);
      run.kv_cache_dtype = c.kv;
      run.tp = c.tp;
      SCOPED_TRACE(std::string(c.model) + " " + arch + " " + std::string(dtype_name(c.kv)));
      const std::vector<std::string> lines = mma->capabilities().kernel_notes(spec, run);
      // Per phase: the kernel, then the two others (on sm_90 the wgmma kernel too).
      ASSERT_EQ(lines.size(), std::string(arch) == "sm_90" ? 8u : 6u);
      const KernelLimits l = limits_of(arch);
      const CacheFormat f = c.kv == DType::bf16 ? CacheFormat::bf16 : CacheFormat::fp8_ds_mla;
      size_t at = 0;
      for (int64_t tokens : {1, 4096}) {
        const KernelShape s{f, 64, false, tokens, spec.num_heads / c.tp, {}};
        const KernelDecision d = choose_attention_kernel(l, s);
        ASSERT_EQ(d.chosen.kernel, expected_kernel(l, s));
        const std::string arch_text = std::string(arch) + (std::string(arch) == "sm_90" ? "a" : "");
        EXPECT_NE(lines[at].find(variant_text(d.chosen) + ", " + arch_text), std::string::npos) << lines[at];
        EXPECT_NE(lines[at].find(tokens == 1 ? "decode" : "prefill"), std::string::npos) << lines[at];
        ++at;
        for (int i = 0; i < d.num_rejected; ++i, ++at) {
          const Rejection& r = d.rejected[static_cast<size_t>(i)];
          EXPECT_EQ(lines[at], "  " + std::string(kernel_name(r.kernel)) + ": " +
                                   rejection_text(r, d.chosen, l.compute_capability));
        }
      }
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
    EXPECT_EQ(decode.rejected[0].why, Rejected::too_few_tokens);
    EXPECT_EQ(decode.rejected[1].why, Rejected::too_few_heads);
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
