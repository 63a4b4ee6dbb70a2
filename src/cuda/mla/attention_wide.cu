// Instantiations and launch configuration of the wide-head-tile MLA attention kernel.
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "cuda/common/runtime.h"
#include "cuda/mla/attention_wide.cuh"
#include "cuda/mla/attention_wide.h"

namespace smla::cuda::mla::wide {

namespace {

// Pipeline depth (mla::chunks_in_flight): 16-bit caches two key buffers (one chunk in flight), fp8 two staging
// buffers (two chunks in flight); with the queries' 75 KB that is all ~190 KB of shared memory allows.
constexpr int kStages = 2;

using Kernel = void (*)(AttentionParams);

template <CacheFormat F>
Kernel kernel_for(int rope, bool paged) {
  if constexpr (F != CacheFormat::fp8_ds_mla_v4) {  // which holds 512-wide heads only (checked)
    if (rope)
      return paged ? wide_attention_kernel<F, kMlaRopeDim, true, kStages>
                   : wide_attention_kernel<F, kMlaRopeDim, false, kStages>;
  }
  return paged ? wide_attention_kernel<F, 0, true, kStages> : wide_attention_kernel<F, 0, false, kStages>;
}

Kernel select(CacheFormat f, int rope, bool paged) {
  switch (f) {
    case CacheFormat::bf16: return kernel_for<CacheFormat::bf16>(rope, paged);
    case CacheFormat::f16: return kernel_for<CacheFormat::f16>(rope, paged);
    case CacheFormat::fp8_ds_mla: return kernel_for<CacheFormat::fp8_ds_mla>(rope, paged);
    case CacheFormat::fp8_ds_mla_v4: return kernel_for<CacheFormat::fp8_ds_mla_v4>(rope, paged);
  }
  return nullptr;
}

}  // namespace

const WideConfig* find_wide_config(CacheFormat f, int rope, bool paged) {
  using Key = std::tuple<int, CacheFormat, int, bool>;
  static std::mutex mu;
  static std::map<Key, WideConfig> configs;  // nodes never move
  thread_local std::map<Key, const WideConfig*> mine;  // no lock once seen
  const DeviceInfo& dev = current_device();
  const Key key = std::make_tuple(dev.index, f, rope, paged);
  if (auto seen = mine.find(key); seen != mine.end()) return seen->second->fn != nullptr ? seen->second : nullptr;
  std::lock_guard<std::mutex> lock(mu);
  auto it = configs.find(key);
  if (it == configs.end()) {
    WideConfig cfg;
    const int bytes = WideLayout(f, kStages, rope).total;
    if (bytes <= dev.max_smem_per_block) {
      const Kernel fn = select(f, rope, paged);
      allow_dynamic_smem(reinterpret_cast<const void*>(fn), bytes);
      const int ctas = resident_ctas_per_sm(reinterpret_cast<const void*>(fn), kWideThreads, bytes);
      if (ctas > 0) cfg = {reinterpret_cast<const void*>(fn), kWideThreads, bytes, kStages, ctas};
    }
    it = configs.emplace(key, cfg).first;
  }
  mine[key] = &it->second;
  return it->second.fn != nullptr ? &it->second : nullptr;
}

const WideConfig& wide_config(CacheFormat f, int rope, bool paged) {
  if (const WideConfig* cfg = find_wide_config(f, rope, paged)) return *cfg;
  throw Error(ErrorKind::unsupported, "MLA attention (wide-tile kernel, " + std::to_string(kWideHeads) +
                                          " heads per CTA) needs " +
                                          std::to_string(WideLayout(f, kStages, rope).total) +
                                          " bytes of shared memory per block; this device allows " +
                                          std::to_string(current_device().max_smem_per_block));
}

void launch_wide(const AttentionParams& p, const WideConfig& cfg, int splits, cudaStream_t stream, bool dependent) {
  const int head_blocks = (p.num_heads + kWideHeads - 1) / kWideHeads;
  const dim3 grid(static_cast<unsigned>(static_cast<int64_t>(p.num_tokens) * head_blocks), splits);
  void* args[] = {const_cast<AttentionParams*>(&p)};
  launch_kernel_args(cfg.fn, grid, dim3(cfg.threads), args, cfg.smem, stream, dependent,
                     "smla MLA attention kernel (wide tile)");
}

}  // namespace smla::cuda::mla::wide
