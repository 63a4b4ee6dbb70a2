#include "cuda/mla/kernel_choice.h"

#include <algorithm>

namespace smla::cuda::mla {

namespace {

bool fp8(CacheFormat f) { return f == CacheFormat::fp8_ds_mla || f == CacheFormat::fp8_ds_mla_v4; }

constexpr int kHeadTileThreads = 128, kWideThreads = 256;

KernelVariant fit(const KernelLimits& l, const KernelShape& s, AttentionKernel k, int heads_per_cta, int threads,
                  int stages, int split_dims, int smem) {
  const int regs = kernel_registers(k, s.format, heads_per_cta, split_dims);
  const int ctas = smem > 0 && smem <= l.max_smem_per_block ? ctas_per_sm(l, threads, regs, smem) : 0;
  return {k, heads_per_cta, threads, stages, split_dims, smem, regs, ctas};
}

// The 16-head tile: the deepest depth that keeps two CTAs per SM (or the most any depth keeps: on an H200 one CTA
// with a deep pipeline lost to two with shallow ones, its softmax barriers idling the SM); never forced.
KernelVariant head_tile(const KernelLimits& l, const KernelShape& s) {
  std::array<KernelVariant, 4> fits{};
  int most = 0;
  for (int d = 1; d <= 4; ++d) {
    fits[d - 1] = fit(l, s, AttentionKernel::head_tile, kHeadsPerCtaTile, kHeadTileThreads, d, 0,
                      head_tile_smem(s.format, s.rope, d));
    most = std::max(most, fits[d - 1].ctas_per_sm);
  }
  KernelVariant best;
  for (const KernelVariant& v : fits)
    if (v.ctas_per_sm > 0 && v.ctas_per_sm >= std::min(2, most)) best = v;
  return best;
}

// The wide tile: the deepest depth that fits (one CTA per SM whatever the depth), or the one forced.
KernelVariant wide_tile(const KernelLimits& l, const KernelShape& s) {
  KernelVariant best;
  for (int d = 2; d <= 3; ++d) {
    if (s.forced.stages > 0 && d != s.forced.stages) continue;
    const KernelVariant v = fit(l, s, AttentionKernel::wide_tile, kWideHeadsPerCta, kWideThreads, d, 0,
                                wide_smem(s.format, s.rope, d));
    if (v.ctas_per_sm > 0) best = v;
  }
  return best;
}

// The small-heads kernel of one shape: the deepest depth that keeps the most CTAs per SM, or the one forced; rows by
// bulk copies where the arch has them, unless cp.async pieces are forced (bulk copies forced where there are none:
// no variant).
KernelVariant small_shape(const KernelLimits& l, const KernelShape& s, int heads_per_cta, int split_dims) {
  const int threads = (heads_per_cta == 16 ? 2 : split_dims) * 4 * 32;
  const bool bulk = small_heads_bulk_copies(s.format, l.compute_capability);
  if (s.forced.copy == RowCopy::bulk && !bulk) return {};
  KernelVariant best;
  for (int d = 2; d <= 4; ++d) {
    if (s.forced.stages > 0 && d != s.forced.stages) continue;
    const KernelVariant v = fit(l, s, AttentionKernel::small_heads, heads_per_cta, threads, d, split_dims,
                                small_heads_smem(s.format, s.rope, heads_per_cta, split_dims, d));
    if (v.ctas_per_sm > 0 && v.ctas_per_sm >= best.ctas_per_sm) best = v;
  }
  best.bulk_copies = best.ctas_per_sm > 0 && bulk && s.forced.copy != RowCopy::pieces;
  return best;
}

// 8 heads per CTA up to 8 heads, else 16; at 8, the output dims split between two warps per key slot where the
// unsplit CTAs leave fewer than 8 warps per SM and the split keeps as many CTAs (twice the warps, the same rows in
// flight), unless forced. With 8 warps either way (an H200's two CTAs) the unsplit kernel is faster: it issues a
// third fewer instructions per key (docs/performance.md, "The small-heads kernel's instructions per chunk").
// 16-bit rows never split the dims unless forced: on an H200 (one CTA per SM either way) the unsplit CTA of 4 warps
// took 85.3 us against 95.6 at 128 tokens x 8 heads, 32.9 against 34.4 at 32, and 81.2 against 88.0 with rope-free
// heads (docs/performance.md, "The runs in bench/results/h200-1ebeefc.json").
// fp8_ds_mla_v4 rows never split the dims (at 128 registers a thread that form spilled). 16 heads per CTA split
// them (each warp then holds all 16 heads, so a key fragment converted once feeds both head tiles) where forced or
// kSmallSixteenHeadsPerWarp and its shared memory fits the device (2 stages: fp8_ds_mla with rope 112 KB, not on
// the 99 KB archs), else run as two groups of 8 heads that each convert every row.
int split_16(const KernelLimits& l, const KernelShape& s) {
  if (s.forced.split_dims > 0) return s.forced.split_dims;
  const bool fits = small_heads_smem(s.format, s.rope, 16, 2, s.forced.stages > 0 ? s.forced.stages : 2) <=
                    l.max_smem_per_block;
  return kSmallSixteenHeadsPerWarp && s.format != CacheFormat::fp8_ds_mla_v4 && fits ? 2 : 1;
}
KernelVariant small_heads(const KernelLimits& l, const KernelShape& s) {
  const int hpc = s.forced.heads_per_cta > 0 ? s.forced.heads_per_cta : s.heads <= 8 ? 8 : 16;
  if (hpc == 16) return small_shape(l, s, 16, split_16(l, s));
  if (s.forced.split_dims > 0) return small_shape(l, s, 8, s.forced.split_dims);
  if (s.format != CacheFormat::fp8_ds_mla) return small_shape(l, s, 8, 1);
  const KernelVariant one = small_shape(l, s, 8, 1), two = small_shape(l, s, 8, 2);
  const bool split = two.ctas_per_sm > 0 && two.ctas_per_sm >= one.ctas_per_sm && one.ctas_per_sm * one.threads < 8 * 32;
  return split ? two : one;
}

// The wgmma kernels' heads per CTA: 64, or the keys-on-M form's where forced to 8, 16 or 32 over an fp8_ds_mla
// cache, or chosen (kWgmmaKeysOnMMaxHeads: its 32-head form for sparse attention of enough tokens; wgmma_few_tokens:
// 8 or 16 heads for a few tokens).
int wgmma_heads_per_cta(const KernelShape& s) {
  if (wgmma_keys_on_m(s.format, s.forced.heads_per_cta)) return s.forced.heads_per_cta;
  if (wgmma_few_tokens(s)) return s.heads <= 8 ? 8 : 16;
  const bool keys_on_m = s.forced.kernel == AttentionKernel::automatic && s.format == CacheFormat::fp8_ds_mla &&
                         !s.paged && s.heads <= kWgmmaKeysOnMMaxHeads && s.tokens >= kWgmmaKeysOnMMinTokens;
  return keys_on_m ? kWgmmaKeysOnMMaxHeads : kWgmmaHeadsPerCta;
}
// The wgmma kernels: Hopper only, with sm_90a code; 64-key chunks (16-bit rows: the pairs kernel; fp8 rows: the
// staged kernel or its keys-on-M form).
KernelVariant wgmma(const KernelLimits& l, const KernelShape& s) {
  if (l.compute_capability != 90 || !l.sm90a_code) return {};
  const int hpc = wgmma_heads_per_cta(s);
  const KernelVariant v = fit(l, s, AttentionKernel::wgmma, hpc, wgmma_threads(s.format, hpc),
                              wgmma_keys_on_m(s.format, hpc) ? wgmma_keys_stages(hpc) : 2, 0,
                              wgmma_smem(s.format, s.rope, hpc));
  return v.ctas_per_sm > 0 ? v : KernelVariant{};
}

KernelVariant variant(const KernelLimits& l, const KernelShape& s, AttentionKernel k) {
  switch (k) {
    case AttentionKernel::head_tile: return head_tile(l, s);
    case AttentionKernel::wide_tile: return wide_tile(l, s);
    case AttentionKernel::small_heads: return small_heads(l, s);
    case AttentionKernel::wgmma: return wgmma(l, s);
    case AttentionKernel::automatic: break;
  }
  return {};
}

// Why kernel `k` cannot run `s` at all (it is no variant): the wgmma kernel's arch or code, else its shared memory
// (`need`: the least it needs).
Rejection unfit(const KernelLimits& l, const KernelShape& s, AttentionKernel k, int need) {
  if (k == AttentionKernel::wgmma && l.compute_capability != 90) return {k, Rejected::arch};
  if (k == AttentionKernel::wgmma && !l.sm90a_code) return {k, Rejected::no_sm90a_code};
  if (k == AttentionKernel::small_heads && s.forced.copy == RowCopy::bulk &&
      !small_heads_bulk_copies(s.format, l.compute_capability))
    return {k, Rejected::arch};
  return {k, Rejected::smem, need, l.max_smem_per_block};
}

// The shallowest depth's shared memory: what a kernel that does not fit needs at least.
int least_smem(const KernelLimits& l, const KernelShape& s, AttentionKernel k) {
  const int d = s.forced.stages;
  switch (k) {
    case AttentionKernel::head_tile: return head_tile_smem(s.format, s.rope, fp8(s.format) ? 1 : 2);
    case AttentionKernel::wide_tile: return wide_smem(s.format, s.rope, d > 0 ? d : 2);
    case AttentionKernel::small_heads: {
      const int hpc = s.forced.heads_per_cta > 0 ? s.forced.heads_per_cta : s.heads <= 8 ? 8 : 16;
      return small_heads_smem(s.format, s.rope, hpc, hpc == 16 ? split_16(l, s) : s.forced.split_dims == 2 ? 2 : 1,
                              d > 0 ? d : 2);
    }
    case AttentionKernel::wgmma: return wgmma_smem(s.format, s.rope, wgmma_heads_per_cta(s));
    case AttentionKernel::automatic: break;
  }
  return 0;
}

// The heads and query rows x heads from which the wide rule's kernel `k` (the wgmma kernel or the wide tile) is
// automatic, and the rows it counts (the wgmma kernel: with its tile's padded heads).
int wide_rule_min_heads(AttentionKernel k, CacheFormat f) {
  return k == AttentionKernel::wgmma ? wgmma_min_heads(f) : kWideMinHeads;
}
int64_t wide_rule_min_rows(AttentionKernel k, int rope) {
  return k == AttentionKernel::wgmma ? wgmma_min_rows(rope) : kWideMinRows;
}
int64_t wide_rule_rows(AttentionKernel k, const KernelShape& s) {
  return k == AttentionKernel::wgmma ? wgmma_rows(s.tokens, s.heads) : s.tokens * s.heads;
}

std::string with_commas(int64_t v) {
  std::string s = std::to_string(v);
  for (int i = static_cast<int>(s.size()) - 3; i > 0; i -= 3) s.insert(static_cast<size_t>(i), ",");
  return s;
}

std::string arch_text(int cc) { return "sm_" + std::to_string(cc); }

}  // namespace

int kernel_registers(AttentionKernel kernel, CacheFormat f, int heads_per_cta, int split_dims) {
  switch (kernel) {
    case AttentionKernel::head_tile: return kHeadTileRegisters;
    case AttentionKernel::wide_tile: return kWideRegisters;
    case AttentionKernel::small_heads:
      return heads_per_cta == 16 ? kSmallHeads16Registers : split_dims == 2 ? kSmallHeadsSplitRegisters
                                                                            : kSmallHeads8Registers;
    case AttentionKernel::wgmma: return wgmma_registers(f, heads_per_cta);
    case AttentionKernel::automatic: break;
  }
  return 0;
}

int ctas_per_sm(const KernelLimits& l, int threads, int registers, int smem) {
  const int warps = (threads + 31) / 32;
  const int regs_per_warp = (registers * 32 + 255) / 256 * 256;
  const int by_regs = regs_per_warp > 0 ? kRegistersPerSm / regs_per_warp / warps : 0;
  const int per_cta = (smem + kReservedSmemPerCta + 127) / 128 * 128;
  return std::min({by_regs, l.max_smem_per_sm / per_cta, l.max_threads_per_sm / (32 * warps), l.max_ctas_per_sm});
}

bool sm90a_code_built() {
#if defined(SMLA_CUDA_SM90A)
  return true;
#else
  return false;
#endif
}

KernelDecision choose_attention_kernel(const KernelLimits& l, const KernelShape& s) {
  KernelDecision d;
  auto reject = [&](AttentionKernel k, Rejected why, int need = 0, int have = 0) {
    d.rejected[static_cast<size_t>(d.num_rejected++)] = {k, why, need, have};
  };
  // The automatic order: the wgmma kernel first where it runs (Hopper), as it takes fewer heads than the wide tile.
  constexpr AttentionKernel kOrder[] = {AttentionKernel::wgmma, AttentionKernel::small_heads,
                                        AttentionKernel::wide_tile, AttentionKernel::head_tile};
  if (s.forced.kernel != AttentionKernel::automatic) {
    d.chosen = variant(l, s, s.forced.kernel);
    if (!d.ok())
      d.rejected[static_cast<size_t>(d.num_rejected++)] =
          unfit(l, s, s.forced.kernel, least_smem(l, s, s.forced.kernel));
    for (AttentionKernel k : kOrder)
      if (k != s.forced.kernel && (k != AttentionKernel::wgmma || l.compute_capability == 90))
        reject(k, Rejected::forced_other);
    return d;
  }
  // The small-heads kernel's automatic reach for this cache format.
  const bool sixteen_bit = !fp8(s.format);
  const int small_max_heads = !sixteen_bit        ? kSmallMaxHeads
                              : split_16(l, s) == 2 ? kSmallMaxHeads16Bit
                                                    : kSmallMaxHeads16BitTwoGroups;
  const int min_tokens = std::max(s.rope ? kSmallMinTokens : kSmallMinTokensNoRope, sixteen_bit ? kSmallMinTokens16Bit : 0);
  for (AttentionKernel k : kOrder) {
    if (k == AttentionKernel::wgmma && l.compute_capability != 90) continue;  // named on Hopper only
    if (k == AttentionKernel::wgmma && !l.sm90a_code) {  // the lasting reasons first
      reject(k, Rejected::no_sm90a_code);
      continue;
    }
    if (k == AttentionKernel::wgmma && fp8(s.format) && !kWgmmaAutomaticForFp8) {
      reject(k, Rejected::cache_format);
      continue;
    }
    if (d.ok()) {  // need and have: the winner's thresholds
      const AttentionKernel won = d.chosen.kernel;
      const bool small = won == AttentionKernel::small_heads;
      reject(k, Rejected::other_kernel_won, small ? min_tokens : wide_rule_min_heads(won, s.format),
             small ? small_max_heads : static_cast<int>(wide_rule_min_rows(won, s.rope)));
      continue;
    }
    if (k == AttentionKernel::wgmma && wgmma_few_tokens(s)) {  // its keys-on-M form's own window
      d.chosen = variant(l, s, k);
      if (!d.ok()) d.rejected[static_cast<size_t>(d.num_rejected++)] = unfit(l, s, k, least_smem(l, s, k));
      continue;
    }
    if (k == AttentionKernel::small_heads) {
      if (s.format == CacheFormat::fp8_ds_mla_v4 && !kSmallAutomaticForV4) {
        reject(k, Rejected::cache_format);
        continue;
      }
      if (s.heads > small_max_heads) {
        reject(k, Rejected::too_many_heads, small_max_heads, s.heads);
        continue;
      }
      if (s.tokens < min_tokens) {
        reject(k, Rejected::too_few_tokens, min_tokens, static_cast<int>(std::min<int64_t>(s.tokens, min_tokens)));
        continue;
      }
    }
    const bool wide_rule = k == AttentionKernel::wide_tile || k == AttentionKernel::wgmma;
    if (wide_rule && s.heads < wide_rule_min_heads(k, s.format)) {
      reject(k, Rejected::too_few_heads, wide_rule_min_heads(k, s.format), s.heads);
      continue;
    }
    d.chosen = variant(l, s, k);
    if (!d.ok()) {
      d.rejected[static_cast<size_t>(d.num_rejected++)] = unfit(l, s, k, least_smem(l, s, k));
    } else if (const int64_t min_rows = wide_rule_min_rows(k, s.rope), rows = wide_rule_rows(k, s);
               wide_rule && rows < min_rows) {  // fits, but too few rows
      d.chosen = {};
      reject(k, Rejected::too_few_rows, static_cast<int>(min_rows), static_cast<int>(rows));
    }
  }
  return d;
}

int choose_splits(int64_t ctas, int chunks, int64_t slots) {
  const int most = std::max(1, std::min(chunks / 2, kMaxSplits));
  if (most == 1) return 1;
  if (ctas * chunks <= slots) return std::min(chunks, kMaxSplits);
  if (ctas * most <= slots) return most;  // one wave whatever the count: the loop's answer, without its divisions
  int best = 1;
  double best_fill = 0;
  for (int s = 1; s <= most && ctas * s <= 8 * slots + ctas; ++s) {
    const int64_t total = ctas * s, waves = (total + slots - 1) / slots;
    const double fill = static_cast<double>(total) / static_cast<double>(waves * slots);
    if (fill > best_fill + 1e-9) {
      best = s;
      best_fill = fill;
    }
  }
  return best;
}

std::string forced_fields_not_taken(const AttentionChoice& c) {
  const AttentionKernel k = c.kernel;
  if (k == AttentionKernel::automatic || k == AttentionKernel::small_heads) return "";
  std::string fields;
  const auto add = [&](bool set, const char* name) {
    if (set) fields += (fields.empty() ? "" : ", ") + std::string(name);
  };
  add(c.stages > 0 && k != AttentionKernel::wide_tile, "stages");
  add(c.heads_per_cta > 0 && k != AttentionKernel::wgmma, "heads_per_cta");
  add(c.split_dims > 0, "split_dims");
  add(c.copy != RowCopy::automatic, "copy");
  return fields.empty() ? ""
                        : std::string("the ") + kernel_name(k) + " was forced with " + fields +
                              ", which it does not take (the small-heads kernel takes each; the wide tile stages; the "
                              "wgmma kernel heads_per_cta)";
}

const char* kernel_name(AttentionKernel kernel) {
  switch (kernel) {
    case AttentionKernel::head_tile: return "16-head tile";
    case AttentionKernel::wide_tile: return "wide tile";
    case AttentionKernel::small_heads: return "small-heads kernel";
    case AttentionKernel::wgmma: return "wgmma kernel";
    case AttentionKernel::automatic: break;
  }
  return "none";
}

std::string variant_shape_text(const KernelVariant& v) {
  std::string t = std::to_string(v.heads_per_cta) + " heads/CTA, " + std::to_string(v.threads / 32) +
                  " warps, depth " + std::to_string(v.stages);
  if (v.split_dims == 2) t += ", output dims split over 2 warps";
  if (v.kernel == AttentionKernel::wgmma && v.heads_per_cta < kWgmmaHeadsPerCta) t += ", keys on M";
  if (v.bulk_copies) t += ", rows by bulk copy";
  return t + ", " + with_commas(v.smem) + " B shared memory, " + std::to_string(v.ctas_per_sm) + " CTA" +
         (v.ctas_per_sm == 1 ? "" : "s") + "/SM";
}

std::string variant_text(const KernelVariant& v) {
  return std::string(kernel_name(v.kernel)) + " (" + variant_shape_text(v) + ")";
}

std::string rejection_text(const Rejection& r, const KernelVariant& chosen, int cc) {
  const std::string won = chosen.kernel == AttentionKernel::automatic ? std::string("none")
                                                                       : std::string(kernel_name(chosen.kernel));
  switch (r.why) {
    case Rejected::forced_other: return "not chosen: the " + won + " was forced";
    case Rejected::cache_format:
      if (r.kernel == AttentionKernel::wgmma)
        return "not chosen: automatic for bf16 and f16 caches only (fp8 caches: forced only)";
      return "not chosen: automatic for fp8_ds_mla, bf16 and f16 caches only (fp8_ds_mla_v4: forced only)";
    case Rejected::arch:
      if (r.kernel == AttentionKernel::small_heads)
        return "bulk row copies need sm_90 or newer and a cache other than fp8_ds_mla_v4; this is " + arch_text(cc);
      return "needs sm_90a (wgmma); this is " + arch_text(cc);
    case Rejected::no_sm90a_code:
      return "needs sm_90a code (wgmma); this library's code for sm_90 has none (built without 90a, or PTX only)";
    case Rejected::too_many_heads:
      return "not chosen: automatic up to " + std::to_string(r.need) + " heads with this cache format, here " +
             std::to_string(r.have);
    case Rejected::too_few_tokens:
      return "not chosen: automatic from " + std::to_string(r.need) + " query rows on (memory-bound decode)";
    case Rejected::too_few_heads:
      return "not chosen: automatic from " + std::to_string(r.need) + " heads on, here " + std::to_string(r.have);
    case Rejected::too_few_rows:
      return "not chosen: automatic from " + with_commas(r.need) + " query rows x heads" +
             (r.kernel == AttentionKernel::wgmma ? " (heads padded to 64)" : "") + " on, here " + with_commas(r.have) +
             " (fewer run faster on the 16-head tile)";
    case Rejected::smem:
      return "needs " + with_commas(r.need) + " B of shared memory per block; " + arch_text(cc) + " allows " +
             with_commas(r.have);
    case Rejected::other_kernel_won:
      if (chosen.kernel == AttentionKernel::wgmma && chosen.heads_per_cta < kWgmmaKeysOnMMaxHeads)
        return "not chosen: fp8_ds_mla at " + std::to_string(kWgmmaFewTokensMinHeads) + "-" +
               std::to_string(kWgmmaFewTokensMaxHeads) + " heads and " + std::to_string(kWgmmaFewTokensMin) + "-" +
               std::to_string(kWgmmaFewTokensMax) + " query rows takes the wgmma kernel's keys-on-M form (sm_90a code)";
      if (chosen.kernel == AttentionKernel::small_heads)
        return "not chosen: this cache format at up to " + std::to_string(r.have) + " heads from " +
               std::to_string(r.need) + " query rows on takes the small-heads kernel";
      return "not chosen: " + std::to_string(r.need) + "+ heads at " + with_commas(r.have) + "+ query rows x heads" +
             (chosen.kernel == AttentionKernel::wgmma ? " (heads padded to 64) take the " + won + " (sm_90a code)"
                                                      : " take the " + won);
  }
  return {};
}

}  // namespace smla::cuda::mla
