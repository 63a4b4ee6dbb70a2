// The CPU backend: runs every op on any machine; the embedded default and the
// reference the GPU backends are tested against.
#include "cpu/backend.h"

#include <iterator>

#include "cpu/kernels.h"

namespace smla::cpu {

namespace {

Capabilities cpu_capabilities() {
  Capabilities c;
  c.name = "cpu";
  c.description = "portable CPU kernels (OpenMP, AVX-512/AVX2 when present)";
  c.device_kind = DeviceKind::cpu;
  c.q_dtypes = {DType::bf16, DType::f16};
  c.kv_cache_dtypes = {std::begin(kAllMlaCacheDTypes), std::end(kAllMlaCacheDTypes)};
  c.heads = {1, kMaxHeads};
  c.qk_head_dims = {kMlaQkDim, kMlaLatentDim};
  c.block_size = {1, 1 << 20};
  c.topk = {1, kMaxTopk};
  c.ops = {Op::sparse_mla, Op::paged_mla_decode, Op::indexer};
  c.pooled_indexer = true;
  c.extra_cache = true;
  c.attn_sink = true;
  return c;
}

class CpuBackend final : public Backend {
 public:
  const Capabilities& capabilities() const override { return caps_; }
  void write_mla_cache(const WriteMlaCacheArgs& a) const override { cpu::write_mla_cache(a); }
  void sparse_mla(const SparseMlaArgs& a) const override { cpu::sparse_mla(a); }
  void paged_mla_decode(const PagedMlaDecodeArgs& a) const override { cpu::paged_mla_decode(a); }
  void write_index_cache(const WriteIndexCacheArgs& a) const override { cpu::write_index_cache(a); }
  void indexer_topk(const IndexerTopkArgs& a) const override { cpu::indexer_topk(a); }
  void positions_to_slots(const PositionsToSlotsArgs& a) const override { cpu::positions_to_slots(a); }
  void write_pooled_index_cache(const WritePooledIndexCacheArgs& a) const override {
    cpu::write_pooled_index_cache(a);
  }
  void pools_to_positions(const PoolsToPositionsArgs& a) const override { cpu::pools_to_positions(a); }
  void rotate_index_q(const RotateIndexQArgs& a) const override { cpu::rotate_index_q(a); }

 private:
  Capabilities caps_ = cpu_capabilities();
};

}  // namespace

std::unique_ptr<Backend> make_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace smla::cpu
