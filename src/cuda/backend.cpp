// The CUDA backend that works on every NVIDIA GPU from SM80 to SM120: tensor
// cores through mma.sync (m16n8k16) and cp.async gathers everywhere; on Hopper,
// where the loaded code holds sm_90a's features, wgmma kernels for the attention
// and the indexer's scores; the scores also take e4m3 mma.sync (SM89, SM12x).
// No tcgen05.
#include "cuda/backend.h"

#include <iterator>
#include <vector>

#include "cuda/emulation.h"
#include "cuda/mla/kernel_choice.h"
#include "smla/error.h"

#ifdef SMLA_WITH_CUDA
#include "cuda/common/device_guard.h"
#include "cuda/kernels.h"
#endif

namespace smla::cuda {

namespace {

// The attention kernel mla::choose_attention_kernel picks on the run's arch for each of the run's query rows per call
// (by default one decode token and a prefill of 4096), with why each other was not chosen.
std::vector<KernelChoice> attention_kernel_choices(const AttentionSpec& spec, const RunSpec& run) {
  const int cc = run.device.compute_capability;
  ArchLimits arch;  // the table's arch of this major with the highest minor not above cc's (sm_121: sm_120's)
  for (const char* name : {"sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120"}) {
    const ArchLimits a = arch_limits(name);
    if (a.compute_capability / 10 == cc / 10 && a.compute_capability <= cc) arch = a;
  }
  if (arch.compute_capability == 0) return {};
  // An arch, not a loaded library: whether sm_90 runs sm_90a code is the build's arch list's answer.
  const bool sm90a = arch.compute_capability == 90 && mla::sm90a_code_built();
  const mla::KernelLimits limits{arch.compute_capability, arch.max_smem_per_block, arch.max_smem_per_sm,
                                 arch.max_threads_per_sm, arch.max_ctas_per_sm, sm90a};
  const DType kv = run.resolved_kv_cache_dtype();
  const mla::CacheFormat format = kv == DType::bf16 ? mla::CacheFormat::bf16
                                  : kv == DType::f16 ? mla::CacheFormat::f16
                                  : kv == DType::fp8_ds_mla_v4 ? mla::CacheFormat::fp8_ds_mla_v4
                                                               : mla::CacheFormat::fp8_ds_mla;
  const int rope = spec.absorbed_qk_dim() == kMlaQkDim ? kMlaRopeDim : 0;
  std::vector<KernelChoice> choices;
  const bool given = !run.query_tokens.empty();  // rows the user named: no phase guessed from them
  for (int64_t tokens : given ? run.query_tokens : std::vector<int64_t>{1, 4096}) {
    const mla::KernelDecision d =
        mla::choose_attention_kernel(limits, {format, rope, !spec.indexer, tokens, heads_per_rank(spec, run), {}});
    const mla::KernelVariant& v = d.chosen;
    KernelChoice c{tokens, given ? "" : tokens == 1 ? "decode" : "prefill", d.ok() ? mla::kernel_name(v.kernel) : "none",
                   "sm_" + std::to_string(arch.compute_capability) + (sm90a ? "a" : "")};
    if (d.ok()) {
      c.heads_per_cta = v.heads_per_cta;
      c.warps = v.threads / 32;
      c.stages = v.stages;
      c.smem_bytes = v.smem;
      c.ctas_per_sm = v.ctas_per_sm;
      c.shape = mla::variant_shape_text(v);
    }
    for (int i = 0; i < d.num_rejected; ++i) {
      const mla::Rejection& r = d.rejected[static_cast<size_t>(i)];
      c.others.push_back({mla::kernel_name(r.kernel), mla::rejection_text(r, v, arch.compute_capability)});
    }
    choices.push_back(std::move(c));
  }
  return choices;
}

Capabilities mma_capabilities() {
  Capabilities c;
  c.name = "cuda_mma";
  c.description = "tensor cores (mma.sync; wgmma with sm_90a code), every arch from sm_80 to sm_120";
  c.device_kind = DeviceKind::cuda;
  c.compute_capability = {80, 129};
  c.q_dtypes = {DType::bf16, DType::f16};
  c.kv_cache_dtypes = {std::begin(kAllMlaCacheDTypes), std::end(kAllMlaCacheDTypes)};  // DeepSeek-V4's fp8 too
  c.heads = {1, kMaxHeads};
  c.qk_head_dims = {kMlaQkDim, kMlaLatentDim};
  c.block_size = {1, 1 << 20};
  c.topk = {1, kMaxIndexerTopk};  // the indexer's top-k; sparse_mla itself takes any K up to kMaxTopk
  c.ops = {Op::sparse_mla, Op::paged_mla_decode, Op::indexer};
  c.pooled_indexer = true;
  c.attn_sink = true;
  // sparse_mla's second cache (DeepSeek-V4), in every cache format the kernel reads, FlashMLA's 584-byte fp8 MODEL1
  // cache (fp8_ds_mla_v4) included.
  c.extra_cache = true;
  c.kernel_choices = attention_kernel_choices;
#ifndef SMLA_WITH_CUDA
  c.combination_rule = [](const AttentionSpec&, const RunSpec&) {
    return std::vector<std::string>{"not compiled into this build of smla (built without nvcc)"};
  };
#endif
  return c;
}

class MmaBackend final : public Backend {
 public:
  const Capabilities& capabilities() const override { return caps_; }
#ifdef SMLA_WITH_CUDA
  void write_mla_cache(const WriteMlaCacheArgs& a) const override {
    DeviceGuard g(a.cache.device);
    cuda::write_mla_cache(a);
  }
  void sparse_mla(const SparseMlaArgs& a) const override {
    DeviceGuard g(a.q.device);
    cuda::sparse_mla(a);
  }
  void paged_mla_decode(const PagedMlaDecodeArgs& a) const override {
    DeviceGuard g(a.q.device);
    cuda::paged_mla_decode(a);
  }
  void write_index_cache(const WriteIndexCacheArgs& a) const override {
    DeviceGuard g(a.cache.device);
    cuda::write_index_cache(a);
  }
  void indexer_topk(const IndexerTopkArgs& a) const override {
    DeviceGuard g(a.q.device);
    cuda::indexer_topk(a);
  }
  void positions_to_slots(const PositionsToSlotsArgs& a) const override {
    DeviceGuard g(a.positions.device);
    cuda::positions_to_slots(a);
  }
  void dsa_decode_step(const DsaDecodeStepArgs& a) const override {
    DeviceGuard g(a.q.device);
    cuda::dsa_decode_step(a);
  }
  void write_pooled_index_cache(const WritePooledIndexCacheArgs& a) const override {
    DeviceGuard g(a.cache.device);
    cuda::write_pooled_index_cache(a);
  }
  void pools_to_positions(const PoolsToPositionsArgs& a) const override {
    DeviceGuard g(a.pools.device);
    cuda::pools_to_positions(a);
  }
  void rotate_index_q(const RotateIndexQArgs& a) const override {
    DeviceGuard g(a.q.device);
    cuda::rotate_index_q(a);
  }
  size_t workspace_size(const SparseMlaArgs& a) const override {
    DeviceGuard g(a.q.device);
    return cuda::sparse_mla_workspace_size(a);
  }
  size_t workspace_size(const PagedMlaDecodeArgs& a) const override {
    DeviceGuard g(a.q.device);
    return cuda::paged_mla_decode_workspace_size(a);
  }
  size_t workspace_size(const IndexerTopkArgs& a) const override {
    DeviceGuard g(a.q.device);
    return cuda::indexer_workspace_size(a);
  }
  using Backend::workspace_size;  // dsa_decode_step: the default, the largest of its steps'
#else
  void write_mla_cache(const WriteMlaCacheArgs&) const override { not_built(); }
  void sparse_mla(const SparseMlaArgs&) const override { not_built(); }
  void paged_mla_decode(const PagedMlaDecodeArgs&) const override { not_built(); }
  void write_index_cache(const WriteIndexCacheArgs&) const override { not_built(); }
  void indexer_topk(const IndexerTopkArgs&) const override { not_built(); }
  void positions_to_slots(const PositionsToSlotsArgs&) const override { not_built(); }
  void write_pooled_index_cache(const WritePooledIndexCacheArgs&) const override { not_built(); }
  void pools_to_positions(const PoolsToPositionsArgs&) const override { not_built(); }
  void rotate_index_q(const RotateIndexQArgs&) const override { not_built(); }
#endif

 private:
  [[noreturn]] static void not_built() {
    throw Error(ErrorKind::unsupported, "cuda_mma: this build of smla has no CUDA support (built without nvcc)");
  }
  Capabilities caps_ = mma_capabilities();
};

}  // namespace

std::unique_ptr<Backend> make_backend() { return std::make_unique<MmaBackend>(); }

}  // namespace smla::cuda
