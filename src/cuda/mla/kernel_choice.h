// Which MLA attention kernel runs, as data: one pure function of an arch's limits and the attention's shape (no
// CUDA call), used both by the ops' plan (attention.cu: it decides) and by `smla explain` (it names the variant
// that will run and why the others were not chosen). Plain C++: the CPU build and its tests have it.
//
// The shared memory each kernel needs is a table here, checked against the kernels' own layouts at compile time
// (kernel_choice_check.cu); the registers per thread are a bound per kernel, checked against the compiled kernels'
// by a GPU test (cudaFuncGetAttributes), as is each choice's CTAs per SM against cudaOccupancy.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "cuda/kernels.h"
#include "cuda/mla/params.h"

namespace smla::cuda::mla {

// What the choice reads of a device (cuda::DeviceInfo or an arch's cuda::ArchLimits).
struct KernelLimits {
  int compute_capability = 0;  // major*10 + minor
  int max_smem_per_block = 0;  // opt-in, bytes
  int max_smem_per_sm = 0;
  int max_threads_per_sm = 0;
  int max_ctas_per_sm = 0;
  // Whether the code the CUDA runtime loaded for this device holds sm_90a's features (wgmma): not the arch (an
  // sm_90 GPU runs 90-real SASS or PTX JIT-compiled from compute_80 without them) but what the library's fatbin
  // gave it; wg::sm90a_code_loaded() asks the driver, explain takes the build's arch list (sm90a_code_built()).
  bool sm90a_code = false;
};
inline constexpr int kRegistersPerSm = 65536;  // every arch from SM80 on
inline constexpr int kReservedSmemPerCta = 1024;  // the system's share of each CTA's shared memory (SM80 on)

// The automatic rules' thresholds (kernel_choice_check.cu holds the kernels' own constants equal): the small-heads
// kernel up to 32 heads, from 16 query rows on (576-wide heads) or 64 (512-wide; on an H200 at 8 heads the 16-head
// tile took 42.1 against 46.3 us at 32 tokens, 75.3 against 64.2 at 64); the wide tile from 64 heads on.
inline constexpr int kSmallMaxHeads = 32, kSmallMinTokens = 16, kSmallMinTokensNoRope = 64, kWideMinHeads = 64;
// 16-bit caches (bf16, f16) take it from 32 query rows on (512-wide heads: 64), where their rows are 1152 bytes: up
// to 16 heads where 16 heads a warp fits (kSmallSixteenHeadsPerWarp; 178 KB at 2 stages, so sm_90 and sm_100), else
// up to 8. On an H200 at top-k 2048 (bf16): 8 heads, 99.0 against the 16-head tile's 117.0 us at 128 tokens and
// 36.4 against 37.6 at 32 (run of e9ab362); 16 heads as two groups of 8 lost (32 tokens 44.4 against 39.6; dense
// decode of batch 128 at 8K, 365.9 against 357.3), 16 heads a warp won (run of 620aa84: 32 tokens 36.5 against
// 39.2, 128 tokens 92.2 against 118.8, dense decode of batch 128 at 8K 341.8 against 375.5).
inline constexpr int kSmallMaxHeads16Bit = 16, kSmallMaxHeads16BitTwoGroups = 8, kSmallMinTokens16Bit = 32;
// The wide tile also needs this many query rows x heads (wide::kMinRowsAutomatic says why).
inline constexpr int64_t kWideMinRows = 4096;
// The wgmma kernel in its place needs far fewer: from 512 on it beat the 16-head tile on an H200 (sparse_mla, top-k
// 2048, one launch, µs 16-head tile / wgmma; run of 83b863a): bf16 128 heads x 4 tokens 36.4 / 24.9, x 8 67.0 / 27.0,
// x 31 203.9 / 57.2; 64 heads x 8 36.2 / 26.7, x 31 152.9 / 45.0; fp8_ds_mla 128 x 8 69.1 / 34.1, 64 x 8 36.2 /
// 27.9. Below it lost (64 heads x 4 tokens: 25.2 / 30.6 bf16, 24.4 / 29.7 fp8) but for single tokens (within 10%).
// DeepSeek-V4's 512-wide heads (640-1152 keys a token) favour the 16-head tile a little longer: at 512 rows 19.8 /
// 22.1 (64 x 8, bf16) and 19.6 / 21.9 (128 x 4), from 1024 on the wgmma kernel (64 x 16: 26.9 / 19.4 bf16, 29.0 /
// 24.4 fp8_ds_mla_v4): kWgmmaMinRowsNoRope.
inline constexpr int64_t kWgmmaMinRows = 512, kWgmmaMinRowsNoRope = 1024;
inline constexpr int64_t wgmma_min_rows(int rope) { return rope ? kWgmmaMinRows : kWgmmaMinRowsNoRope; }
// Unlike the wide tile, the wgmma kernel is automatic from 17 heads on (fp8 caches) or 9 (16-bit caches), its
// 64-row head tile padded: on an H200 (top-k 2048, µs as the op picked before / wgmma forced; runs of 8b5956e and
// 2a7a782) it beat the small-heads kernel and the 16-head tile at every size measured from 20 heads on: 20 heads x
// 128 tokens bf16 211.1 / 86.0, fp8_ds_mla 165.3 / 128.1; 32 x 128 212.2 / 86.1, 166.5 / 126.9; 48 x 128 319.9 /
// 87.6, 337.3 / 129.7; x 32 tokens 65.0-105.1 / 38.5-42.1 (bf16), 54.0-115.6 / 44.5-50.8 (fp8); x 8 tokens
// 24.0-31.7 / 21.3-22.6, 23.0-31.6 / 22.4-24.2; prefill 4096 x 32 bf16 6202 / 2575; dense paged 128 x 8192 x 32
// heads bf16 723 / 296, fp8 633 / 464. At 16 heads fp8_ds_mla the small-heads kernel won (86.9 against 126.1 at 128
// tokens); bf16 at 12 and 16 heads the wgmma kernel (128 tokens 93.7 / 84.4-84.6, 32 tokens 37.8-38.0 / 36.5-38.0,
// 8 tokens 18.2-20.8 / 18.5, paged 128 x 8192 x 16 313.3 / 294.6, prefill 4096 x 16 2667 / 2523), at 8 heads
// neither (32 tokens 33.5 / 34.5, 128 tokens 85.9 / 84.3). Its query rows x heads count the padded heads
// (wgmma_rows, below).
inline constexpr int kWgmmaMinHeadsFp8 = 17, kWgmmaMinHeads16Bit = 9;
constexpr int wgmma_min_heads(CacheFormat f) {
  return f == CacheFormat::bf16 || f == CacheFormat::f16 ? kWgmmaMinHeads16Bit : kWgmmaMinHeadsFp8;
}
// Whether fp8_ds_mla_v4 caches (512-wide) take the small-heads kernel automatically as rope-free fp8_ds_mla rows
// do: off (small::kAutomaticForV4 says why).
inline constexpr bool kSmallAutomaticForV4 = false;
// Whether 16 heads per CTA take the small-heads kernel's 16-heads-a-warp layout (dims split) unless forced, where
// it fits (small::kSixteenHeadsPerWarpAutomatic).
inline constexpr bool kSmallSixteenHeadsPerWarp = true;
inline constexpr int kHeadsPerCtaTile = 16, kWideHeadsPerCta = 64, kWgmmaHeadsPerCta = 64;
// Query rows x heads as the wgmma kernel counts them: with its tile's padded heads below kWgmmaHeadsPerCta.
inline constexpr int64_t wgmma_rows(int64_t tokens, int heads) {
  return tokens * (heads < kWgmmaHeadsPerCta ? kWgmmaHeadsPerCta : heads);
}
// The wgmma kernel (sm_90a code) takes the wide tile's place under the same head and row thresholds: on an H200 it
// was 9-11% faster on every bf16 row, and with fp8 caches (dequantised into its key tile) 22-28% faster (run of
// e9ab362; docs/performance.md). The switch for fp8 caches: tests and explain follow it.
inline constexpr bool kWgmmaAutomaticForFp8 = true;
// Where the wgmma kernel runs sparse attention over an fp8_ds_mla cache for at most 32 heads (17-32: below, the
// small-heads kernel) and at least 32 tokens, its keys-on-M form's 32 heads per CTA instead of the 64-head tile. On an
// H200 (top-k 2048, µs 64-head tile / keys on M, 32 heads; run of 0cf284d): 128 tokens 20 heads 126.7 / 114.7, 24
// 127.2 / 115.5, 32 128.1 / 114.2; 32 tokens 46.1 / 44.5 and 45.0 / 43.6; prefill 4096 x 32 3781.5 / 3510.0; at 8
// tokens it lost (19.2 / 19.8, 19.5 / 21.5); dense paged decode not measured at these heads (16 heads lost).
inline constexpr int kWgmmaKeysOnMMaxHeads = 32, kWgmmaKeysOnMMinTokens = 32;
// Registers per thread, at most, over every instance and arch (ptxas -v; the wide tile's are capped at 255 by its
// launch bounds of one CTA per SM, the small-heads kernel's with the dim split at 128 by its bounds of two).
inline constexpr int kHeadTileRegisters = 177, kWideRegisters = 255, kSmallHeads16Registers = 255,
                     kSmallHeads8Registers = 255, kSmallHeadsSplitRegisters = 128;

// The attention's shape: cache format, rope width (64 or 0), paged (dense decode) or a slot list (sparse), query
// rows, heads per rank, and what a test or benchmark forces (AttentionChoice: kernel, depth, small-heads shape).
struct KernelShape {
  CacheFormat format = CacheFormat::bf16;
  int rope = 64;
  bool paged = false;
  int64_t tokens = 1;
  int heads = 16;
  AttentionChoice forced;
};

// And where, not forced, it runs sparse attention over an fp8_ds_mla cache with 576-wide heads for 8-16 heads at 4-8
// query tokens, as 8 or 16 heads per CTA (the heads rounded up; no head or row threshold of the wgmma kernel's own):
// on an H100 (top-k 2048, µs from a CUDA graph, the op's choice before, the 16-head tile / keys on M; run of f15e63e)
// 8 heads x 4 tokens 11.4 / 10.0, x 8 13.8 / 12.3; 16 heads x 4 14.8 / 12.6, x 8 17.4 / 15.6; it lost at 1 and 2
// tokens (8 heads 7.7 / 8.8, 8.2 / 9.2) and tied at 16 (one launch, 20.6 / 20.9 at 8 heads, where the small-heads
// kernel took 19.2).
inline constexpr int kWgmmaFewTokensMinHeads = 8, kWgmmaFewTokensMaxHeads = 16;
inline constexpr int64_t kWgmmaFewTokensMin = 4, kWgmmaFewTokensMax = 8;
constexpr bool wgmma_few_tokens(const KernelShape& s) {
  return s.forced.kernel == AttentionKernel::automatic && s.format == CacheFormat::fp8_ds_mla && s.rope && !s.paged &&
         s.heads >= kWgmmaFewTokensMinHeads && s.heads <= kWgmmaFewTokensMaxHeads && s.tokens >= kWgmmaFewTokensMin &&
         s.tokens <= kWgmmaFewTokensMax;
}

// One compiled variant: its kernel, heads per CTA, threads, pipeline depth, the small-heads kernel's dim split
// (1 or 2; 0 for the others), dynamic shared memory, registers per thread (a bound), resident CTAs per SM, and
// whether the small-heads kernel copies its rows by bulk copies (sm_90+, not fp8_ds_mla_v4) or cp.async pieces.
struct KernelVariant {
  AttentionKernel kernel = AttentionKernel::automatic;  // automatic: none
  int heads_per_cta = 0, threads = 0, stages = 0, split_dims = 0, smem = 0, registers = 0, ctas_per_sm = 0;
  bool bulk_copies = false;
};

// Why a kernel was not chosen. `need`/`have`: shared memory in bytes (smem), heads or tokens (the automatic rules;
// other_kernel_won: the chosen kernel's thresholds: the small-heads kernel's tokens and heads, the others' heads and
// query rows x heads).
enum class Rejected {
  forced_other,      // another kernel was forced
  cache_format,      // the small-heads kernel: not fp8_ds_mla_v4 (automatically); wgmma: not fp8 (ditto), each while switched off
  arch,              // the wgmma kernel: sm_90 only; the small-heads kernel's bulk row copies forced: sm_90+
  no_sm90a_code,     // the wgmma kernel on sm_90 where the loaded code lacks sm_90a's features
  too_many_heads,    // the small-heads kernel: more heads than its automatic reach for the cache format
  too_few_tokens,    // the small-heads kernel: fewer query rows than it pays off at
  too_few_heads,     // the wide tile: fewer heads than kWideMinHeads; the wgmma kernel: than wgmma_min_heads
  too_few_rows,      // the wide tile: fewer query rows x heads than kWideMinRows; the wgmma kernel: wgmma_rows
  smem,              // needs more shared memory per block than the arch allows
  other_kernel_won,  // valid, but the kernel chosen comes first for this shape
};
struct Rejection {
  AttentionKernel kernel = AttentionKernel::automatic;
  Rejected why = Rejected::forced_other;
  int need = 0, have = 0;
};

// The choice: `chosen` (kernel automatic when nothing fits: `rejected` says why), and the other kernels' rejections
// (at most one each). No allocation: the ops call it at every launch.
struct KernelDecision {
  KernelVariant chosen;
  std::array<Rejection, 4> rejected{};
  int num_rejected = 0;
  bool ok() const { return chosen.kernel != AttentionKernel::automatic; }
};

// THE choice. Automatic: on sm_90 with sm_90a code the wgmma kernel (16-bit caches, fp8 ones while
// kWgmmaAutomaticForFp8) from wgmma_min_heads heads on at wgmma_rows >= wgmma_min_rows, and in wgmma_few_tokens's
// window (its keys-on-M form, 8 or 16 heads per CTA); else the small-heads kernel
// for fp8_ds_mla caches (and fp8_ds_mla_v4 ones while kSmallAutomaticForV4) up to kSmallMaxHeads heads from
// kSmallMinTokens query rows on (kSmallMinTokensNoRope for 512-wide heads), for 16-bit caches up to
// kSmallMaxHeads16Bit heads from kSmallMinTokens16Bit (or that), where it fits; else from wide::kMinHeadsAutomatic
// heads on the wide tile where it fits from wide::kMinRowsAutomatic query rows x heads; else the 16-head tile.
// Depths: the 16-head tile the deepest that keeps two CTAs per SM (or the most that fit), the wide tile the deepest
// that fits, the small-heads kernel the deepest that keeps the most CTAs per SM (at 8 heads the dim split where the
// unsplit CTAs leave fewer than 8 warps per SM and it keeps as many CTAs).
// A forced kernel or depth is taken as given; one that does not fit is no choice (not ok()).
KernelDecision choose_attention_kernel(const KernelLimits& limits, const KernelShape& shape);

// What a forced kernel is given that it does not take, as an error's text ("" where nothing): the 16-head tile takes
// no depth (it picks its own), heads per CTA, dim split or row copy; the wide tile no heads per CTA, dim split or
// row copy; the wgmma kernel no depth, dim split or row copy (its heads per CTA: wg::wgmma_config checks them). An
// automatic choice's fields apply where the kernel chosen takes them.
std::string forced_fields_not_taken(const AttentionChoice& choice);

// How many ways the ops split each (token, head group)'s `chunks` chunks of keys when `ctas` CTAs a split share
// `slots` resident CTA slots (SMs x CTAs per SM). Keys of fewer than four chunks stay whole (a split of fewer than
// two chunks costs its combine more than it saves). Where a split of one chunk each still fits in one wave (one
// token: 64 splits of a 32-key chunk), that: latency is all there is (H200, one token of 8 heads, top-k 2048: 64
// one-chunk splits 10.0 us fp8 / 8.8 bf16, 32 two-chunk splits 12.8 / 10.4). Otherwise the count whose CTAs fill
// the slots in whole waves best (a last wave half full leaves half the GPU idle: 384 CTAs on 264 slots ran at
// ~70%), the smallest such count on ties (each split costs a partial row and a combine), each split keeping at least
// two chunks: on an H200, 33 one-chunk splits of the small-heads kernel (fp8, 8 rope-free heads, top-k 2051, 32
// tokens: several waves) took 117 us, 2.4x the 576-wide heads' 49 us at four chunks a split.
int choose_splits(int64_t ctas, int chunks, int64_t slots);

// "wide tile", "16-head tile", "small-heads kernel", "wgmma kernel".
const char* kernel_name(AttentionKernel kernel);
// "wide tile (64 heads/CTA, 8 warps, depth 3, 192,512 B shared memory, 1 CTA/SM)": the kernel's name, then its
// shape (variant_shape_text).
std::string variant_text(const KernelVariant& v);
std::string variant_shape_text(const KernelVariant& v);
// Why `r.kernel` is not `chosen`, e.g. "not chosen: 64+ heads take the wide tile", "needs 192,512 B of shared
// memory per block; sm_120 allows 101,376".
std::string rejection_text(const Rejection& r, const KernelVariant& chosen, int compute_capability);

// Whether the small-heads kernel can copy rows of format `f` by bulk copies on compute capability `cc`.
constexpr bool small_heads_bulk_copies(CacheFormat f, int cc) { return cc >= 90 && f != CacheFormat::fp8_ds_mla_v4; }

// The dynamic shared memory of each kernel at depth `stages` (0: that depth is not compiled), from tables that
// kernel_choice_check.cu holds equal to the kernels' layouts. f16 rows are laid out as bf16 ones.
namespace tables {
// Table rows: [format: 16-bit, fp8_ds_mla, fp8_ds_mla_v4][rope 0, 64][depth - first depth]; 0: not compiled.
constexpr int format_row(CacheFormat f) { return f == CacheFormat::fp8_ds_mla ? 1 : f == CacheFormat::fp8_ds_mla_v4 ? 2 : 0; }

// 16-head tile, depths 1-4 (16-bit caches compile 2-4, fp8 1-3).
inline constexpr int kHeadTileSmem[3][2][4] = {{{0, 77504, 110912, 144320}, {0, 85696, 123200, 160704}},
                                        {{61120, 78144, 95168, 0}, {69312, 90432, 111552, 0}},
                                        {{63168, 82240, 101312, 0}, {0, 0, 0, 0}}};
// Wide tile, depths 2-3.
inline constexpr int kWideSmem[3][2][2] = {{{176128, 209536}, {192512, 230016}},
                                    {{176768, 193792}, {197248, 218368}},
                                    {{180864, 199936}, {0, 0}}};
// Small heads, depths 2-4, by [format][rope][shape: 16 heads in two groups, 8 heads on 4 warps, 8 heads on 8 warps
// (the output dims split), 16 heads a warp on 8 warps (dims split); never split for fp8_ds_mla_v4].
inline constexpr int kSmallSmem[3][2][4][3] = {
    {{{150976, 217792, 284608}, {142368, 209184, 276000}, {146464, 213280, 280096}, {159168, 225984, 292800}},
     {{169408, 244416, 319424}, {159776, 234784, 309792}, {163872, 238880, 313888}, {177600, 252608, 327616}}},
    {{{85440, 119488, 153536}, {76832, 110880, 144928}, {80928, 114976, 149024}, {93632, 127680, 161728}},
     {{103872, 146112, 188352}, {94240, 136480, 178720}, {98336, 140576, 182816}, {112064, 154304, 196544}}},
    {{{93632, 131776, 169920}, {85024, 123168, 161312}, {0, 0, 0}, {0, 0, 0}},
     {{0, 0, 0}, {0, 0, 0}, {0, 0, 0}, {0, 0, 0}}}};

}  // namespace tables
constexpr int head_tile_smem(CacheFormat f, int rope, int stages) {
  if (stages < 1 || stages > 4) return 0;
  return tables::kHeadTileSmem[tables::format_row(f)][rope ? 1 : 0][stages - 1];
}

constexpr int wide_smem(CacheFormat f, int rope, int stages) {
  if (stages < 2 || stages > 3) return 0;
  return tables::kWideSmem[tables::format_row(f)][rope ? 1 : 0][stages - 2];
}

// The wgmma kernels (16-bit caches: the pairs kernel, the queries, two key tiles and two P tiles; fp8 caches: the
// staged kernel, the queries, one key tile and a staging buffer), by [format][rope 0, 64].
inline constexpr int kWgmmaSmem[3][2] = {{214632, 231016}, {173840, 198416}, {177936, 0}};
// The keys-on-M form for fp8_ds_mla caches (8, 16 or 32 heads per CTA on wgmma's N, 32 as two math warpgroups; the
// queries, one key tile, three staging buffers, two for 32 heads), by [rope 0, 64][8, 16, 32 heads].
inline constexpr int kWgmmaKeysSmem[2][3] = {{177464, 186936, 171824}, {211256, 221752, 200496}};
constexpr bool wgmma_keys_on_m(CacheFormat f, int heads_per_cta) {
  return f == CacheFormat::fp8_ds_mla && (heads_per_cta == 8 || heads_per_cta == 16 || heads_per_cta == 32);
}
// Its staging buffers: the depth explain names.
constexpr int wgmma_keys_stages(int heads_per_cta) { return heads_per_cta == 32 ? 2 : 3; }
constexpr int wgmma_smem(CacheFormat f, int rope, int heads_per_cta = kWgmmaHeadsPerCta) {
  return wgmma_keys_on_m(f, heads_per_cta) ? kWgmmaKeysSmem[rope ? 1 : 0][heads_per_cta / 16]
                                           : kWgmmaSmem[tables::format_row(f)][rope ? 1 : 0];
}
// Their threads (the pairs kernel and the keys-on-M form: two warpgroups and a third, a fourth for 32 heads) and
// registers per thread at launch (the launch bounds of one CTA per SM: 65536 / threads rounded down to 8, or 255).
constexpr int wgmma_threads(CacheFormat f, int heads_per_cta = kWgmmaHeadsPerCta) {
  if (wgmma_keys_on_m(f, heads_per_cta)) return heads_per_cta == 32 ? 512 : 384;
  return tables::format_row(f) == 0 ? 384 : 256;
}
constexpr int wgmma_registers(CacheFormat f, int heads_per_cta = kWgmmaHeadsPerCta) {
  const int threads = wgmma_threads(f, heads_per_cta);
  return threads == 256 ? 255 : 65536 / threads / 8 * 8;
}

constexpr int small_heads_smem(CacheFormat f, int rope, int heads_per_cta, int split_dims, int stages) {
  if (stages < 2 || stages > 4) return 0;
  return tables::kSmallSmem[tables::format_row(f)][rope ? 1 : 0]
                           [heads_per_cta == 16 ? (split_dims == 2 ? 3 : 0) : split_dims == 2 ? 2 : 1][stages - 2];
}

// Registers per thread, at most, of each kernel's instances for cache format `f` (the GPU test checks them against
// the compiled ones).
int kernel_registers(AttentionKernel kernel, CacheFormat f, int heads_per_cta, int split_dims);
// Resident CTAs per SM of `threads`-thread CTAs with `registers` each and `smem` dynamic bytes, as cudaOccupancy
// counts them (registers in 256-register units per warp; each CTA's shared memory plus the system's 1 KB in
// 128-byte units).
int ctas_per_sm(const KernelLimits& limits, int threads, int registers, int smem);

// Whether this build's CUDA arch list holds sm_90a code (SASS or PTX; false without CUDA): what `explain`, which
// describes an arch rather than a loaded library, takes for KernelLimits::sm90a_code on sm_90.
bool sm90a_code_built();

}  // namespace smla::cuda::mla
