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

// Pipeline depths compiled (mla::chunks_in_flight): 16-bit caches 2 or 3 key buffers (1 or 2 chunks in flight),
// fp8 2 or 3 staging buffers (2 or 3 in flight). Beside the queries' 75 KB, 2 take 188 KB (bf16) / 193 KB (fp8),
// 3 take 225 KB / 213 KB: sm_90 and sm_100 hold either, one CTA per SM.
constexpr int kMinStages = 2, kMaxStages = 3;

using Kernel = void (*)(AttentionParams);

template <CacheFormat F, int kRope, bool kPaged>
Kernel kernel_for(int stages) {
  return stages == 3 ? wide_attention_kernel<F, kRope, kPaged, 3> : wide_attention_kernel<F, kRope, kPaged, 2>;
}

Kernel select(CacheFormat f, int rope, bool paged, int stages) {
  return instance_for(f, rope, paged, [stages]<CacheFormat F, int kRope, bool kPaged>() {
    return kernel_for<F, kRope, kPaged>(stages);
  });
}

}  // namespace

const WideConfig* find_wide_config(CacheFormat f, int rope, bool paged, int stages) {
  if (stages != 0 && (stages < kMinStages || stages > kMaxStages))
    throw Error(ErrorKind::invalid_argument, "MLA attention (wide-tile kernel): stages must be " +
                                                 std::to_string(kMinStages) + "-" + std::to_string(kMaxStages) +
                                                 " (0: as the kernel sees fit)");
  using Key = std::tuple<int, CacheFormat, int, bool, int>;
  static std::mutex mu;
  static std::map<Key, WideConfig> configs;  // nodes never move
  thread_local std::map<Key, const WideConfig*> mine;  // no lock once seen
  const DeviceInfo& dev = current_device();
  const Key key = std::make_tuple(dev.index, f, rope, paged, stages);
  if (auto seen = mine.find(key); seen != mine.end()) return seen->second->fn != nullptr ? seen->second : nullptr;
  std::lock_guard<std::mutex> lock(mu);
  auto it = configs.find(key);
  if (it == configs.end()) {
    WideConfig cfg;  // the deepest pipeline that fits (one CTA per SM whatever the depth), or the one forced
    for (int s = kMinStages; s <= kMaxStages; ++s) {
      if (stages != 0 && s != stages) continue;
      const int bytes = WideLayout(f, s, rope).total;
      if (bytes > dev.max_smem_per_block) continue;
      const Kernel fn = select(f, rope, paged, s);
      allow_dynamic_smem(reinterpret_cast<const void*>(fn), bytes);
      const int ctas = resident_ctas_per_sm(reinterpret_cast<const void*>(fn), kWideThreads, bytes);
      if (ctas > 0) cfg = {reinterpret_cast<const void*>(fn), kWideThreads, bytes, s, ctas};
    }
    it = configs.emplace(key, cfg).first;
  }
  mine[key] = &it->second;
  return it->second.fn != nullptr ? &it->second : nullptr;
}

const WideConfig& wide_config(CacheFormat f, int rope, bool paged, int stages) {
  if (const WideConfig* cfg = find_wide_config(f, rope, paged, stages)) return *cfg;
  const int shallowest = stages != 0 ? stages : kMinStages;
  throw Error(ErrorKind::unsupported, "MLA attention (wide-tile kernel, " + std::to_string(kWideHeads) +
                                          " heads per CTA, " + std::to_string(shallowest) + " stages) needs " +
                                          std::to_string(WideLayout(f, shallowest, rope).total) +
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
