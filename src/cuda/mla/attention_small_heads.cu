// Instantiations and launch configuration of the small-heads MLA attention kernel.
#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "cuda/common/runtime.h"
#include "cuda/mla/attention_small_heads.cuh"
#include "cuda/mla/attention_small_heads.h"
#include "cuda/mla/kernel_choice.h"

namespace smla::cuda::mla::small {

static_assert(kSmallChunkKeys == kChunkKeys, "attention_small_heads.h mirrors the kernel's chunk");

namespace {

using Kernel = void (*)(AttentionParams, int, bool);

// 8-head blocks x dim split compiled: 8 heads on 4 or 8 warps; 16 heads on 8, as two groups of 4 warps (split 1)
// or as 16 heads a warp with the dims split (split 2). fp8_ds_mla_v4 rows are not read with the output dims split:
// at 128 registers a thread that form spilled (sm_90a: 12-28 bytes).
template <CacheFormat F>
constexpr bool kSplitsDims = F != CacheFormat::fp8_ds_mla_v4;
template <CacheFormat F, bool kPaged, int kRope>
Kernel kernel_for(int blocks, int split_dims) {
  if constexpr (!kSplitsDims<F>) {
    return blocks == 2 ? small_heads_kernel<F, kPaged, 2, 1, kRope> : small_heads_kernel<F, kPaged, 1, 1, kRope>;
  } else {
    if (blocks == 2)
      return split_dims == 2 ? small_heads_kernel<F, kPaged, 1, 2, kRope, 2>
                             : small_heads_kernel<F, kPaged, 2, 1, kRope>;
    return split_dims == 2 ? small_heads_kernel<F, kPaged, 1, 2, kRope> : small_heads_kernel<F, kPaged, 1, 1, kRope>;
  }
}

Kernel select(CacheFormat f, bool paged, int rope, int blocks, int split_dims) {
  return instance_for(f, rope, paged, [blocks, split_dims]<CacheFormat F, int kRope, bool kPaged>() {
    return kernel_for<F, kPaged, kRope>(blocks, split_dims);
  });
}

template <CacheFormat F, int kRope>
int smem_bytes(int blocks, int split_dims, int stages) {
  if (blocks == 2)
    return split_dims == 2 ? Layout<F, kRope, 1, 2, 2>(stages).total : Layout<F, kRope, 2, 1>(stages).total;
  return split_dims == 2 ? Layout<F, kRope, 1, 2>(stages).total : Layout<F, kRope, 1, 1>(stages).total;
}

int smem_bytes(CacheFormat f, int rope, int blocks, int split_dims, int stages) {
  if (f == CacheFormat::fp8_ds_mla_v4) return smem_bytes<CacheFormat::fp8_ds_mla_v4, 0>(blocks, split_dims, stages);
  if (f == CacheFormat::fp8_ds_mla)
    return rope ? smem_bytes<CacheFormat::fp8_ds_mla, 64>(blocks, split_dims, stages)
                : smem_bytes<CacheFormat::fp8_ds_mla, 0>(blocks, split_dims, stages);
  // bf16 and f16 rows are laid out alike
  return rope ? smem_bytes<CacheFormat::bf16, 64>(blocks, split_dims, stages)
              : smem_bytes<CacheFormat::bf16, 0>(blocks, split_dims, stages);
}

}  // namespace

namespace {

// 16 heads per CTA unforced: 16 heads a warp (dims split) where kSixteenHeadsPerWarpAutomatic and that layout fits
// the device (find_small_heads_config), else two groups; fp8_ds_mla_v4 never splits the dims.
int automatic_split_16(CacheFormat f) {
  return kSixteenHeadsPerWarpAutomatic && f != CacheFormat::fp8_ds_mla_v4 ? 2 : 1;
}

// The deepest pipeline that keeps the most CTAs of `fn` resident per SM, or
// exactly `stages` when > 0; fn null when none fits the device. `blocks`: 8-head blocks per CTA (1 or 2).
SmallHeadsConfig deepest(Kernel fn, CacheFormat f, int rope, int blocks, int split_dims, int stages) {
  const int threads = std::max(blocks, split_dims) * kKeySlots * 32;  // 16 heads: 8 warps either way
  // The kernel is opted in to all the device allows once: configurations of
  // other depths, made in any order, then launch it with less.
  const int limit = max_dynamic_smem(reinterpret_cast<const void*>(fn));
  SmallHeadsConfig best;
  for (int s = 2; s <= kMaxStages; ++s) {
    if (stages > 0 && s != stages) continue;
    const int bytes = smem_bytes(f, rope, blocks, split_dims, s);
    if (bytes > limit) continue;
    const int ctas = resident_ctas_per_sm(reinterpret_cast<const void*>(fn), threads, bytes);
    // Depths ascend: a deeper pipeline wins unless it costs resident CTAs.
    if (ctas > 0 && ctas >= best.ctas_per_sm)
      best = {reinterpret_cast<const void*>(fn), threads, bytes, s, ctas, blocks * kHeadsPerGroup, split_dims};
  }
  return best;
}

}  // namespace

const SmallHeadsConfig* find_small_heads_config(CacheFormat f, int rope, bool paged, int num_heads,
                                               SmallHeadsShape shape) {
  if (f == CacheFormat::fp8_ds_mla_v4 && shape.split_dims == 2)
    throw Error(ErrorKind::unsupported,
                "MLA attention (small-heads kernel) does not split the output dims over fp8_ds_mla_v4 caches");
  if ((shape.stages != 0 && (shape.stages < 2 || shape.stages > kMaxStages)) ||
      (shape.heads_per_cta != 0 && shape.heads_per_cta != 8 && shape.heads_per_cta != 16) ||
      (shape.split_dims != 0 && shape.split_dims != 1 && shape.split_dims != 2))
    throw Error(ErrorKind::invalid_argument, "MLA attention (small-heads kernel): stages must be 2-4, heads per CTA "
                                             "8 or 16, dim split 1 or 2 (0: as the kernel sees fit)");
  const DeviceInfo& dev = current_device();
  const bool bulk_possible = mla::small_heads_bulk_copies(f, dev.compute_capability);
  if (shape.copy == RowCopy::bulk && !bulk_possible)
    throw Error(ErrorKind::unsupported, "MLA attention (small-heads kernel): bulk row copies need sm_90 or newer and "
                                        "a cache other than fp8_ds_mla_v4");
  const bool bulk = bulk_possible && shape.copy != RowCopy::pieces;
  using Key = std::tuple<int, CacheFormat, int, bool, int, int, int, bool>;
  static std::mutex mu;
  static std::map<Key, SmallHeadsConfig> configs;  // nodes never move
  thread_local std::map<Key, const SmallHeadsConfig*> mine;  // no lock once seen
  const int groups = shape.heads_per_cta == 8 || (shape.heads_per_cta == 0 && num_heads <= kHeadsPerGroup) ? 1 : 2;
  const Key key = std::make_tuple(dev.index, f, rope, paged, groups, shape.split_dims, shape.stages, bulk);
  if (auto seen = mine.find(key); seen != mine.end()) return seen->second->fn != nullptr ? seen->second : nullptr;
  std::lock_guard<std::mutex> lock(mu);
  auto it = configs.find(key);
  if (it == configs.end()) {
    SmallHeadsConfig cfg;
    if (groups == 2) {
      const int split_dims = shape.split_dims != 0 ? shape.split_dims : automatic_split_16(f);
      cfg = deepest(select(f, paged, rope, 2, split_dims), f, rope, 2, split_dims, shape.stages);
      if (cfg.fn == nullptr && shape.split_dims == 0 && split_dims == 2)  // as mla::choose_attention_kernel does
        cfg = deepest(select(f, paged, rope, 2, 1), f, rope, 2, 1, shape.stages);
    } else if (shape.split_dims != 0 || f == CacheFormat::fp8_ds_mla_v4) {  // forced, or never split (kSplitsDims)
      const int split_dims = shape.split_dims != 0 ? shape.split_dims : 1;
      cfg = deepest(select(f, paged, rope, 1, split_dims), f, rope, 1, split_dims, shape.stages);
    } else {
      // Split the output dims (8 warps per CTA, each key slot's two warps
      // sharing the scores' dims) where the unsplit CTAs leave fewer than 8
      // warps per SM and the split keeps as many CTAs, as
      // mla::choose_attention_kernel does (kernel_choice.cpp says why).
      cfg = deepest(select(f, paged, rope, 1, 1), f, rope, 1, 1, shape.stages);
      const SmallHeadsConfig split = deepest(select(f, paged, rope, 1, 2), f, rope, 1, 2, shape.stages);
      if (split.fn != nullptr &&
          (cfg.fn == nullptr || (split.ctas_per_sm >= cfg.ctas_per_sm && cfg.ctas_per_sm * cfg.threads < 8 * 32)))
        cfg = split;
    }
    cfg.bulk = bulk;
    it = configs.emplace(key, cfg).first;
  }
  mine[key] = &it->second;
  return it->second.fn != nullptr ? &it->second : nullptr;
}

const SmallHeadsConfig& small_heads_config(CacheFormat f, int rope, bool paged, int num_heads,
                                           SmallHeadsShape shape) {
  if (const SmallHeadsConfig* cfg = find_small_heads_config(f, rope, paged, num_heads, shape)) return *cfg;
  const int groups = shape.heads_per_cta == 8 || (shape.heads_per_cta == 0 && num_heads <= kHeadsPerGroup) ? 1 : 2;
  const int stages = shape.stages > 0 ? shape.stages : 2;
  // Unforced, the last layout tried (16 heads: the two groups, the smaller), as explain names it.
  const int split_dims = shape.split_dims != 0 ? shape.split_dims : 1;
  const int bytes = smem_bytes(f, rope, groups, split_dims, stages);
  throw Error(ErrorKind::unsupported, "MLA attention (small-heads kernel, " + std::to_string(stages) +
                                          " stages) needs " + std::to_string(bytes) +
                                          " bytes of shared memory per block; this device allows " +
                                          std::to_string(current_device().max_smem_per_block));
}

void launch_small_heads(const AttentionParams& p, const SmallHeadsConfig& cfg, int splits, cudaStream_t stream,
                        bool dependent) {
  const int head_blocks = (p.num_heads + cfg.heads_per_cta - 1) / cfg.heads_per_cta;
  const dim3 grid(static_cast<unsigned>(static_cast<int64_t>(p.num_tokens) * head_blocks), splits);
  int stages = cfg.stages;
  bool bulk = cfg.bulk;
  void* args[] = {const_cast<AttentionParams*>(&p), &stages, &bulk};
  launch_kernel_args(cfg.fn, grid, dim3(cfg.threads), args, cfg.smem, stream, dependent,
                     "smla MLA attention kernel (small heads)");
}

}  // namespace smla::cuda::mla::small
