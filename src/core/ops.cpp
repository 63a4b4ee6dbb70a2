// The public op entry points: check once, then hand the args to a backend.
#include "smla/ops.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "core/check_util.h"
#include "smla/backend.h"
#include "smla/error.h"
#include "smla/select.h"

namespace smla {

namespace {

// Checks `args` and picks the backend that runs them.
template <class Args>
const Backend& checked_backend(const char* op, const Args& args, const Device& device, const Backend* backend) {
  check(args);
  const Backend& be = backend ? *backend : backend_for(device);
  // A backend given explicitly must run where the tensors are: the CPU one
  // would otherwise dereference device pointers.
  if (be.capabilities().device_kind != device.kind)
    fail(std::string(op) + ": backend '" + be.name() + "' does not run on " + device.name() +
         ", where the tensors are");
  return be;
}

bool absent(const TensorView& workspace) { return workspace.ndim == 0 && !workspace.defined(); }

// A workspace: 1-D uint8 on the op's device, 16-byte aligned, of at least
// `need` bytes. A zero-sized one may have null data.
void check_workspace(const char* op, const TensorView& ws, const Device& device, size_t need) {
  const auto a = checks::arg(op, "workspace", ws);
  a.rank(1, "[bytes]").dtype_in({DType::u8}).on(device).inner_contiguous();
  if (!ws.defined() && ws.shape[0] > 0) a.defined();
  if (reinterpret_cast<uintptr_t>(ws.data) % 16 != 0) a.fail("must be 16-byte aligned");
  if (static_cast<size_t>(ws.shape[0]) < need)
    a.fail("too small: these args need " + std::to_string(need) + " bytes (workspace_size), got " +
           std::to_string(ws.shape[0]));
}

// An empty batch (no tokens, no rows to write) is checked like any other, then has nothing to do: the backend is
// not called (on a GPU a grid of zero blocks would be a launch error).
bool empty_batch(const WriteMlaCacheArgs& a) { return a.latent.shape[0] == 0; }
bool empty_batch(const SparseMlaArgs& a) { return a.q.shape[0] == 0; }
bool empty_batch(const PagedMlaDecodeArgs& a) { return a.q.shape[0] == 0 || a.q.shape[1] == 0; }
bool empty_batch(const WriteIndexCacheArgs& a) { return a.k.shape[0] == 0; }
bool empty_batch(const IndexerTopkArgs& a) { return a.q.shape[0] == 0; }
bool empty_batch(const PositionsToSlotsArgs& a) { return a.positions.shape[0] == 0; }
bool empty_batch(const DsaDecodeStepArgs& a) { return a.q.shape[0] == 0; }
bool empty_batch(const WritePooledIndexCacheArgs& a) { return a.k.shape[0] == 0; }
bool empty_batch(const PoolsToPositionsArgs& a) { return a.pools.shape[0] == 0; }
bool empty_batch(const RotateIndexQArgs& a) { return a.q.shape[0] == 0; }

template <class Args, class Run>
void dispatch(const char* op, const Args& args, const Device& device, const Backend* backend, Run run) {
  const Backend& be = checked_backend(op, args, device, backend);
  if (!empty_batch(args)) run(be);
}

// `run(be, args)` with the caller's workspace (checked against what `be` needs) or, absent, one from `source` when
// given and the op needs one, or none (the backend finds its own).
template <class Args, class Run>
void dispatch_with_workspace(const char* op, const Args& args, const Device& device, const Backend* backend, Run run,
                             const WorkspaceSource* source = nullptr) {
  const Backend& be = checked_backend(op, args, device, backend);
  if (!absent(args.workspace)) check_workspace(op, args.workspace, device, be.workspace_size(args));
  if (empty_batch(args)) return;
  const size_t need = source && absent(args.workspace) ? be.workspace_size(args) : 0;
  if (need == 0) return run(be, args);
  Args with = args;
  with.workspace = (*source)(need);
  check_workspace(op, with.workspace, device, need);
  run(be, with);
}

// The checks accept every MLA cache format; a backend runs those it declares (Capabilities::kv_cache_dtypes).
void require_cache_dtype(const char* op, const char* name, const TensorView& cache, const Backend& be) {
  const std::vector<DType>& dtypes = be.capabilities().kv_cache_dtypes;
  if (std::find(dtypes.begin(), dtypes.end(), cache.dtype) == dtypes.end())
    throw Error(ErrorKind::unsupported, std::string(op) + ": " + name + ": backend '" + be.name() +
                                            "' does not read " + std::string(dtype_name(cache.dtype)) +
                                            " caches (it reads " + dtype_names(dtypes) + ")");
}

}  // namespace

void write_mla_cache(const WriteMlaCacheArgs& a, const Backend* b) {
  dispatch("write_mla_cache", a, a.cache.device, b, [&](const Backend& be) {
    require_cache_dtype("write_mla_cache", "cache", a.cache, be);
    be.write_mla_cache(a);
  });
}
void write_index_cache(const WriteIndexCacheArgs& a, const Backend* b) {
  dispatch("write_index_cache", a, a.cache.device, b, [&](const Backend& be) { be.write_index_cache(a); });
}
void positions_to_slots(const PositionsToSlotsArgs& a, const Backend* b) {
  dispatch("positions_to_slots", a, a.positions.device, b, [&](const Backend& be) { be.positions_to_slots(a); });
}
void write_pooled_index_cache(const WritePooledIndexCacheArgs& a, const Backend* b) {
  dispatch("write_pooled_index_cache", a, a.cache.device, b,
           [&](const Backend& be) { be.write_pooled_index_cache(a); });
}
void pools_to_positions(const PoolsToPositionsArgs& a, const Backend* b) {
  dispatch("pools_to_positions", a, a.pools.device, b, [&](const Backend& be) { be.pools_to_positions(a); });
}
void rotate_index_q(const RotateIndexQArgs& a, const Backend* b) {
  dispatch("rotate_index_q", a, a.q.device, b, [&](const Backend& be) { be.rotate_index_q(a); });
}

namespace {

void sparse_mla_from(const SparseMlaArgs& a, const Backend* b, const WorkspaceSource* source) {
  dispatch_with_workspace("sparse_mla", a, a.q.device, b, [](const Backend& be, const SparseMlaArgs& x) {
    require_cache_dtype("sparse_mla", "kv_cache", x.kv_cache, be);
    if ((x.extra_kv_cache.defined() || x.extra_indices.defined()) && !be.capabilities().extra_cache)
      throw Error(ErrorKind::unsupported, "sparse_mla: extra_kv_cache: backend '" + be.name() +
                                              "' does not attend a second cache (Capabilities::extra_cache)");
    be.sparse_mla(x);
  }, source);
}
void paged_mla_decode_from(const PagedMlaDecodeArgs& a, const Backend* b, const WorkspaceSource* source) {
  dispatch_with_workspace("paged_mla_decode", a, a.q.device, b, [](const Backend& be, const PagedMlaDecodeArgs& x) {
    require_cache_dtype("paged_mla_decode", "kv_cache", x.kv_cache, be);
    be.paged_mla_decode(x);
  }, source);
}
void indexer_topk_from(const IndexerTopkArgs& a, const Backend* b, const WorkspaceSource* source) {
  dispatch_with_workspace("indexer_topk", a, a.q.device, b,
                          [](const Backend& be, const IndexerTopkArgs& x) { be.indexer_topk(x); }, source);
}
void dsa_decode_step_from(const DsaDecodeStepArgs& a, const Backend* b, const WorkspaceSource* source) {
  dispatch_with_workspace("dsa_decode_step", a, a.q.device, b, [](const Backend& be, const DsaDecodeStepArgs& x) {
    require_cache_dtype("dsa_decode_step", "kv_cache", x.kv_cache, be);
    be.dsa_decode_step(x);
  }, source);
}

}  // namespace

void sparse_mla(const SparseMlaArgs& a, const Backend* b) { sparse_mla_from(a, b, nullptr); }
void sparse_mla(const SparseMlaArgs& a, const Backend* b, WorkspaceSource source) { sparse_mla_from(a, b, &source); }
void paged_mla_decode(const PagedMlaDecodeArgs& a, const Backend* b) { paged_mla_decode_from(a, b, nullptr); }
void paged_mla_decode(const PagedMlaDecodeArgs& a, const Backend* b, WorkspaceSource source) {
  paged_mla_decode_from(a, b, &source);
}
void indexer_topk(const IndexerTopkArgs& a, const Backend* b) { indexer_topk_from(a, b, nullptr); }
void indexer_topk(const IndexerTopkArgs& a, const Backend* b, WorkspaceSource source) {
  indexer_topk_from(a, b, &source);
}
void dsa_decode_step(const DsaDecodeStepArgs& a, const Backend* b) { dsa_decode_step_from(a, b, nullptr); }
void dsa_decode_step(const DsaDecodeStepArgs& a, const Backend* b, WorkspaceSource source) {
  dsa_decode_step_from(a, b, &source);
}

size_t workspace_size(const SparseMlaArgs& a, const Backend* b) {
  return checked_backend("sparse_mla", a, a.q.device, b).workspace_size(a);
}
size_t workspace_size(const PagedMlaDecodeArgs& a, const Backend* b) {
  return checked_backend("paged_mla_decode", a, a.q.device, b).workspace_size(a);
}
size_t workspace_size(const IndexerTopkArgs& a, const Backend* b) {
  return checked_backend("indexer_topk", a, a.q.device, b).workspace_size(a);
}
size_t workspace_size(const DsaDecodeStepArgs& a, const Backend* b) {
  return checked_backend("dsa_decode_step", a, a.q.device, b).workspace_size(a);
}

IndexerTopkArgs indexer_step(const DsaDecodeStepArgs& a) {
  IndexerTopkArgs ix = a.indexer;
  ix.workspace = a.workspace;
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
  s.workspace = a.workspace;
  s.stream = a.stream;
  return s;
}

size_t Backend::workspace_size(const DsaDecodeStepArgs& a) const {
  return std::max(workspace_size(indexer_step(a)), workspace_size(attention_step(a)));
}

void Backend::write_pooled_index_cache(const WritePooledIndexCacheArgs&) const {
  throw Error(ErrorKind::unsupported, "write_pooled_index_cache: backend '" + name() +
                                          "' does not implement the pooled indexer");
}
void Backend::pools_to_positions(const PoolsToPositionsArgs&) const {
  throw Error(ErrorKind::unsupported, "pools_to_positions: backend '" + name() +
                                          "' does not implement the pooled indexer");
}

void Backend::rotate_index_q(const RotateIndexQArgs&) const {
  throw Error(ErrorKind::unsupported, "rotate_index_q: backend '" + name() + "' does not implement the pooled indexer");
}

void Backend::dsa_decode_step(const DsaDecodeStepArgs& a) const {
  indexer_topk(indexer_step(a));
  positions_to_slots(slots_step(a));
  sparse_mla(attention_step(a));
}

}  // namespace smla
