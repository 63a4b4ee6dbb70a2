// The public op entry points: check once, then hand the args to a backend.
#include "smla/ops.h"

#include "smla/backend.h"
#include "smla/error.h"
#include "smla/select.h"

namespace smla {

namespace {
template <class Args, class Run>
void dispatch(const char* op, const Args& args, const Device& device, const Backend* backend, Run run) {
  check(args);
  const Backend& be = backend ? *backend : backend_for(device);
  // A backend given explicitly must run where the tensors are: the CPU one
  // would otherwise dereference device pointers.
  if (be.capabilities().device_kind != device.kind)
    fail(std::string(op) + ": backend '" + be.name() + "' does not run on " + device.name() +
         ", where the tensors are");
  run(be);
}
}  // namespace

void write_mla_cache(const WriteMlaCacheArgs& a, const Backend* b) {
  dispatch("write_mla_cache", a, a.cache.device, b, [&](const Backend& be) { be.write_mla_cache(a); });
}
void sparse_mla(const SparseMlaArgs& a, const Backend* b) {
  dispatch("sparse_mla", a, a.q.device, b, [&](const Backend& be) { be.sparse_mla(a); });
}
void paged_mla_decode(const PagedMlaDecodeArgs& a, const Backend* b) {
  dispatch("paged_mla_decode", a, a.q.device, b, [&](const Backend& be) { be.paged_mla_decode(a); });
}
void write_index_cache(const WriteIndexCacheArgs& a, const Backend* b) {
  dispatch("write_index_cache", a, a.cache.device, b, [&](const Backend& be) { be.write_index_cache(a); });
}
void indexer_topk(const IndexerTopkArgs& a, const Backend* b) {
  dispatch("indexer_topk", a, a.q.device, b, [&](const Backend& be) { be.indexer_topk(a); });
}
void positions_to_slots(const PositionsToSlotsArgs& a, const Backend* b) {
  dispatch("positions_to_slots", a, a.positions.device, b, [&](const Backend& be) { be.positions_to_slots(a); });
}
void dsa_decode_step(const DsaDecodeStepArgs& a, const Backend* b) {
  dispatch("dsa_decode_step", a, a.q.device, b, [&](const Backend& be) { be.dsa_decode_step(a); });
}

IndexerTopkArgs indexer_step(const DsaDecodeStepArgs& a) {
  IndexerTopkArgs ix = a.indexer;
  ix.stream = a.stream;
  return ix;
}

PositionsToSlotsArgs slots_step(const DsaDecodeStepArgs& a) {
  PositionsToSlotsArgs p;
  p.positions = a.indexer.topk;
  p.request_ids = a.indexer.request_ids;
  p.block_table = a.indexer.block_table;
  p.block_size = static_cast<int>(a.kv_cache.shape[1]);  // the MLA cache's; the index cache shares it
  p.slots = a.slots;
  p.stream = a.stream;
  return p;
}

SparseMlaArgs attention_step(const DsaDecodeStepArgs& a) {
  SparseMlaArgs s;
  s.q = a.q;
  s.kv_cache = a.kv_cache;
  s.indices = a.slots;
  s.attn_sink = a.attn_sink;
  s.softmax_scale = a.softmax_scale;
  s.out = a.out;
  s.lse = a.lse;
  s.stream = a.stream;
  return s;
}

void Backend::dsa_decode_step(const DsaDecodeStepArgs& a) const {
  indexer_topk(indexer_step(a));
  positions_to_slots(slots_step(a));
  sparse_mla(attention_step(a));
}

}  // namespace smla
