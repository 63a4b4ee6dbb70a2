// Instantiations and launch configuration of the wgmma MLA attention kernels (sm_90a code only, a trap elsewhere,
// which the host never launches): the pairs kernel for 16-bit caches, the staged one for fp8 caches.
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "cuda/common/runtime.h"
#include "cuda/kernels.h"
#include "cuda/mla/attention_wgmma.cuh"
#include "cuda/mla/attention_wgmma.h"
#include "cuda/mla/attention_wgmma_keys.cuh"
#include "cuda/mla/attention_wgmma_pairs.cuh"
#include "cuda/mla/kernel_choice.h"

namespace smla::cuda::mla::wg {

namespace {

using Kernel = void (*)(AttentionParams);

Kernel select(CacheFormat f, int rope, bool paged, bool two_lists, int heads_per_cta) {
  // [&]: a capture-less lambda's conversion to a function pointer draws nvcc warning 445 for each instance
  return instance_for(f, rope, paged, [&]<CacheFormat F, int kRope, bool kPaged>() {
    if constexpr (F == CacheFormat::fp8_ds_mla) {
      if (heads_per_cta == 8) return static_cast<Kernel>(wgmma_keys_kernel<F, kRope, kPaged, 8>);
      if (heads_per_cta == 16) return static_cast<Kernel>(wgmma_keys_kernel<F, kRope, kPaged, 16>);
      if (heads_per_cta == 32) return static_cast<Kernel>(wgmma_keys_kernel<F, kRope, kPaged, 32>);
    }
    if constexpr (F == CacheFormat::fp8_ds_mla_v4 && !kPaged)
      return two_lists ? static_cast<Kernel>(wgmma_attention_kernel<F, kRope, false, true>)
                       : static_cast<Kernel>(wgmma_attention_kernel<F, kRope, false>);
    else if constexpr (is_fp8(F)) return static_cast<Kernel>(wgmma_attention_kernel<F, kRope, kPaged>);
    else if constexpr (kPaged) return static_cast<Kernel>(wgmma_pairs_kernel<F, kRope, true>);
    else
      return two_lists ? static_cast<Kernel>(wgmma_pairs_kernel<F, kRope, false, true>)
                       : static_cast<Kernel>(wgmma_pairs_kernel<F, kRope, false>);
  });
}

// The CTA's threads and shared-memory bytes for format `f` and `heads` per CTA.
int cta_threads(CacheFormat f, int heads) {
  return wgmma_keys_on_m(f, heads) ? keys_threads(heads) : is_fp8(f) ? kWgmmaThreads : kPairThreads;
}
int cta_smem(CacheFormat f, int rope, int heads) {
  return wgmma_keys_on_m(f, heads) ? KeysLayout(f, rope, heads).total
         : is_fp8(f)         ? WgmmaLayout(f, rope).total
                             : PairLayout(rope).total;
}

// Why this device cannot run the kernel for `f`, or empty.
std::string unavailable(CacheFormat f, int rope, int heads) {
  const DeviceInfo& dev = current_device();
  if (!wgmma_available(dev.compute_capability))
    return "needs a Hopper GPU (sm_90) and the library's sm_90a code; this is sm_" +
           std::to_string(dev.compute_capability);
  if (!dev.sm90a_code)
    return "needs sm_90a code, and the code loaded for this sm_90 device has none (90-real SASS or older PTX)";
  if (cta_smem(f, rope, heads) > dev.max_smem_per_block)
    return "needs " + std::to_string(cta_smem(f, rope, heads)) +
           " bytes of shared memory per block; this device allows " + std::to_string(dev.max_smem_per_block);
  return {};
}

}  // namespace

const WgmmaConfig* find_wgmma_config(CacheFormat f, int rope, bool paged, bool two_lists, int heads_per_cta) {
  if (heads_per_cta != kWgmmaHeads && !wgmma_keys_on_m(f, heads_per_cta))
    throw Error(ErrorKind::invalid_argument, "MLA attention (wgmma kernel): heads per CTA must be " +
                                                 std::to_string(kWgmmaHeads) + ", or 8, 16 or 32 with an fp8_ds_mla cache");
  two_lists = two_lists && two_lists_in_one_launch(f) && !paged && !wgmma_keys_on_m(f, heads_per_cta);
  using Key = std::tuple<int, CacheFormat, int, bool, bool, int>;
  static std::mutex mu;
  static std::map<Key, WgmmaConfig> configs;  // nodes never move
  thread_local std::map<Key, const WgmmaConfig*> mine;  // no lock once seen
  const DeviceInfo& dev = current_device();
  const Key key = std::make_tuple(dev.index, f, rope, paged, two_lists, heads_per_cta);
  if (auto seen = mine.find(key); seen != mine.end()) return seen->second->fn != nullptr ? seen->second : nullptr;
  std::lock_guard<std::mutex> lock(mu);
  auto it = configs.find(key);
  if (it == configs.end()) {
    WgmmaConfig cfg;
    if (unavailable(f, rope, heads_per_cta).empty()) {
      const int bytes = cta_smem(f, rope, heads_per_cta), threads = cta_threads(f, heads_per_cta);
      const Kernel fn = select(f, rope, paged, two_lists, heads_per_cta);
      allow_dynamic_smem(reinterpret_cast<const void*>(fn), bytes);
      const int ctas = resident_ctas_per_sm(reinterpret_cast<const void*>(fn), threads, bytes);
      if (ctas > 0) cfg = {reinterpret_cast<const void*>(fn), threads, bytes, ctas, heads_per_cta};
    }
    it = configs.emplace(key, cfg).first;
  }
  mine[key] = &it->second;
  return it->second.fn != nullptr ? &it->second : nullptr;
}

const WgmmaConfig& wgmma_config(CacheFormat f, int rope, bool paged, bool two_lists, int heads_per_cta) {
  if (const WgmmaConfig* cfg = find_wgmma_config(f, rope, paged, two_lists, heads_per_cta)) return *cfg;
  const std::string why = unavailable(f, rope, heads_per_cta);
  throw Error(ErrorKind::unsupported, "MLA attention (wgmma kernel, sm_90a, " + std::to_string(heads_per_cta) +
                                          " heads per CTA) " + (why.empty() ? "cannot run on this device" : why));
}

void launch_wgmma(const AttentionParams& p, const WgmmaConfig& cfg, int splits, cudaStream_t stream, bool dependent) {
  const int head_blocks = (p.num_heads + cfg.heads_per_cta - 1) / cfg.heads_per_cta;
  const dim3 grid(static_cast<unsigned>(static_cast<int64_t>(p.num_tokens) * head_blocks), splits);
  void* args[] = {const_cast<AttentionParams*>(&p)};
  launch_kernel_args(cfg.fn, grid, dim3(cfg.threads), args, cfg.smem, stream, dependent,
                     "smla MLA attention kernel (wgmma)");
}

}  // namespace smla::cuda::mla::wg

namespace smla::cuda {
bool wgmma_kernels_available() {
  const DeviceInfo& dev = current_device();
  return wgmma_available(dev.compute_capability) && dev.sm90a_code;
}
}  // namespace smla::cuda
