// Instantiations and launch configuration of the small-heads MLA attention kernel.
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "cuda/common/runtime.h"
#include "cuda/mla/attention_small_heads.cuh"
#include "cuda/mla/attention_small_heads.h"

namespace smla::cuda::mla::small {

static_assert(kSmallChunkKeys == kChunkKeys, "attention_small_heads.h mirrors the kernel's chunk");

namespace {

constexpr int kMaxStages = 4;  // cp_async_wait_dynamic's deepest count is stages - 2

using Kernel = void (*)(AttentionParams, int);

template <CacheFormat F, bool kPaged>
Kernel kernel_for(int groups) {
  return groups == 1 ? small_heads_kernel<F, kPaged, 1> : small_heads_kernel<F, kPaged, 2>;
}

Kernel select(CacheFormat f, bool paged, int groups) {
  switch (f) {
    case CacheFormat::bf16: return paged ? kernel_for<CacheFormat::bf16, true>(groups) : kernel_for<CacheFormat::bf16, false>(groups);
    case CacheFormat::f16: return paged ? kernel_for<CacheFormat::f16, true>(groups) : kernel_for<CacheFormat::f16, false>(groups);
    case CacheFormat::fp8_ds_mla:
      return paged ? kernel_for<CacheFormat::fp8_ds_mla, true>(groups) : kernel_for<CacheFormat::fp8_ds_mla, false>(groups);
  }
  return nullptr;
}

int smem_bytes(CacheFormat f, int groups, int stages) {
  switch (f) {
    case CacheFormat::fp8_ds_mla:
      return groups == 1 ? Layout<CacheFormat::fp8_ds_mla, 64, 1>(stages).total
                         : Layout<CacheFormat::fp8_ds_mla, 64, 2>(stages).total;
    default:  // bf16 and f16 rows are laid out alike
      return groups == 1 ? Layout<CacheFormat::bf16, 64, 1>(stages).total : Layout<CacheFormat::bf16, 64, 2>(stages).total;
  }
}

}  // namespace

const SmallHeadsConfig& small_heads_config(CacheFormat f, bool paged, int num_heads, int stages) {
  static std::mutex mu;
  static std::map<std::tuple<int, CacheFormat, bool, int, int>, SmallHeadsConfig> configs;
  const DeviceInfo& dev = current_device();
  const int groups = num_heads <= kHeadsPerGroup ? 1 : 2;
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple(dev.index, f, paged, groups, stages);
  if (auto it = configs.find(key); it != configs.end()) return it->second;

  const Kernel fn = select(f, paged, groups);
  const int threads = groups * kWarpsPerGroup * 32;
  SmallHeadsConfig best;
  for (int s = 2; s <= kMaxStages; ++s) {
    if (stages > 0 && s != stages) continue;
    const int bytes = smem_bytes(f, groups, s);
    if (bytes > dev.max_smem_per_block) continue;
    allow_dynamic_smem(reinterpret_cast<const void*>(fn), bytes);
    const int ctas = resident_ctas_per_sm(reinterpret_cast<const void*>(fn), threads, bytes);
    // Depths ascend: a deeper pipeline wins unless it costs resident CTAs.
    if (ctas > 0 && ctas >= best.ctas_per_sm)
      best = {reinterpret_cast<const void*>(fn), threads, bytes, s, ctas, groups * kHeadsPerGroup};
  }
  if (best.fn == nullptr)
    throw Error(ErrorKind::unsupported, "MLA attention (small-heads kernel, " + std::to_string(stages > 0 ? stages : 2) +
                                            " stages) needs " + std::to_string(smem_bytes(f, groups, stages > 0 ? stages : 2)) +
                                            " bytes of shared memory per block; this device allows " +
                                            std::to_string(dev.max_smem_per_block));
  return configs.emplace(key, best).first->second;
}

void launch_small_heads(const AttentionParams& p, const SmallHeadsConfig& cfg, cudaStream_t stream) {
  const int head_blocks = (p.num_heads + cfg.heads_per_cta - 1) / cfg.heads_per_cta;
  const dim3 grid(static_cast<unsigned>(static_cast<int64_t>(p.num_tokens) * head_blocks), p.num_splits);
  reinterpret_cast<Kernel>(const_cast<void*>(cfg.fn))<<<grid, cfg.threads, cfg.smem, stream>>>(p, cfg.stages);
  check_launch("smla MLA attention kernel (small heads)");
}

}  // namespace smla::cuda::mla::small
