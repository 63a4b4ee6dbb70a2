// The ops, one binding each: tensors in (DLPack, no copies), outputs
// allocated by the caller (python/smla/ops.py), the GIL released while the op
// runs. Argument names match include/smla/ops.h so messages read the same.
#include <nanobind/stl/string.h>

#include <cstdint>
#include <string>

#include "bindings.h"
#include "smla/ops.h"

namespace smla::python {

namespace {

void* as_stream(uintptr_t stream) { return reinterpret_cast<void*>(stream); }

// `workspace` as the Python caller gave it: None (the library's own), a uint8 tensor, or a callable that takes a
// byte count and returns one (a DLPack capsule too), called only when the op needs scratch for these args. That is
// how the torch ops take it from torch's caching allocator, which is safe in CUDA-graph capture.
template <class Args>
void attach_workspace(Importer& imp, nb::handle workspace, Args& a, const Backend* backend, const Device& device) {
  if (workspace.is_none()) return;
  if (!PyCallable_Check(workspace.ptr())) {
    a.workspace = imp.output(workspace, "workspace");
    return;
  }
  if (device.is_cpu()) return;  // the CPU backend needs none
  const size_t bytes = workspace_size(a, backend);
  if (bytes > 0) a.workspace = imp.output(workspace(bytes), "workspace");
}

// Ends every binding: `a` on `stream`, on the backend named `backend` (empty: the default for `device`), with the
// caller's `workspace` attached where the op takes scratch (its Args have a workspace), then `op` without the GIL:
// CPU ops can take a while and other Python threads may run meanwhile; nothing in it touches Python objects.
template <class Args>
void launch(void (*op)(const Args&, const Backend*), Args& a, const Device& device, uintptr_t stream,
            const std::string& backend, Importer& imp, nb::handle workspace = nb::none()) {
  a.stream = as_stream(stream);
  const Backend* be = backend_by_name(backend, device);
  if constexpr (requires { a.workspace; }) attach_workspace(imp, workspace, a, be, device);
  nb::gil_scoped_release release;
  op(a, be);
}

// indexer_topk's arguments (stream aside), as indexer_topk and dsa_decode_step take them.
IndexerTopkArgs import_indexer(Importer& imp, const IndexerQueryNames& names, nb::handle q, nb::handle q_scale,
                               nb::handle weights, nb::handle index_cache, nb::handle request_ids,
                               nb::handle block_table, nb::handle context_lens, nb::handle topk) {
  IndexerTopkArgs a;
  a.q = imp.input(q, names.q);
  a.q_scale = imp.input(q_scale, names.q_scale);
  a.weights = imp.input(weights, names.weights);
  a.index_cache = imp.input(index_cache, "index_cache");
  a.request_ids = imp.input(request_ids, "request_ids");
  a.block_table = imp.input(block_table, "block_table");
  a.context_lens = imp.input(context_lens, "context_lens");
  a.topk = imp.output(topk, "topk");
  return a;
}

}  // namespace

void bind_ops(nb::module_& m) {
  using nb::arg;
  const auto obj = [](const char* name) { return arg(name).none(); };

  m.def(
      "write_mla_cache",
      [](nb::handle latent, nb::handle k_pe, nb::handle slot_mapping, nb::handle cache, uintptr_t stream,
         const std::string& backend) {
        Importer imp;
        WriteMlaCacheArgs a;
        a.latent = imp.input(latent, "latent");
        a.k_pe = imp.input(k_pe, "k_pe");
        a.slot_mapping = imp.input(slot_mapping, "slot_mapping");
        a.cache = imp.output(cache, "cache");
        launch(write_mla_cache, a, a.cache.device, stream, backend, imp);
      },
      arg("latent"), arg("k_pe"), arg("slot_mapping"), arg("cache"), arg("stream") = 0, arg("backend") = "");

  m.def(
      "sparse_mla",
      [](nb::handle q, nb::handle kv_cache, nb::handle indices, nb::handle topk_length, nb::handle attn_sink,
         float softmax_scale, nb::handle out, nb::handle lse, uintptr_t stream, const std::string& backend,
         nb::handle max_logits, bool empty_lse_plus_inf, nb::handle workspace, nb::handle extra_kv_cache,
         nb::handle extra_indices, nb::handle extra_topk_length) {
        Importer imp;
        SparseMlaArgs a;
        a.q = imp.input(q, "q");
        a.kv_cache = imp.input(kv_cache, "kv_cache");
        a.indices = imp.input(indices, "indices");
        a.topk_length = imp.input(topk_length, "topk_length");
        a.extra_kv_cache = imp.input(extra_kv_cache, "extra_kv_cache");
        a.extra_indices = imp.input(extra_indices, "extra_indices");
        a.extra_topk_length = imp.input(extra_topk_length, "extra_topk_length");
        a.attn_sink = imp.input(attn_sink, "attn_sink");
        a.softmax_scale = softmax_scale;
        a.out = imp.output(out, "out");
        a.lse = imp.output(lse, "lse");
        a.max_logits = imp.output(max_logits, "max_logits");
        a.empty_lse_plus_inf = empty_lse_plus_inf;
        launch(sparse_mla, a, a.q.device, stream, backend, imp, workspace);
      },
      arg("q"), arg("kv_cache"), arg("indices"), obj("topk_length"), obj("attn_sink"), arg("softmax_scale"),
      arg("out"), arg("lse"), arg("stream") = 0, arg("backend") = "", obj("max_logits") = nb::none(),
      arg("empty_lse_plus_inf") = false, obj("workspace") = nb::none(), obj("extra_kv_cache") = nb::none(),
      obj("extra_indices") = nb::none(), obj("extra_topk_length") = nb::none());

  m.def(
      "paged_mla_decode",
      [](nb::handle q, nb::handle kv_cache, nb::handle block_table, nb::handle seq_lens, nb::handle attn_sink,
         float softmax_scale, bool causal, nb::handle out, nb::handle lse, uintptr_t stream,
         const std::string& backend, bool empty_lse_plus_inf, nb::handle workspace) {
        Importer imp;
        PagedMlaDecodeArgs a;
        a.q = imp.input(q, "q");
        a.kv_cache = imp.input(kv_cache, "kv_cache");
        a.block_table = imp.input(block_table, "block_table");
        a.seq_lens = imp.input(seq_lens, "seq_lens");
        a.attn_sink = imp.input(attn_sink, "attn_sink");
        a.softmax_scale = softmax_scale;
        a.causal = causal;
        a.out = imp.output(out, "out");
        a.lse = imp.output(lse, "lse");
        a.empty_lse_plus_inf = empty_lse_plus_inf;
        launch(paged_mla_decode, a, a.q.device, stream, backend, imp, workspace);
      },
      arg("q"), arg("kv_cache"), arg("block_table"), arg("seq_lens"), obj("attn_sink"), arg("softmax_scale"),
      arg("causal"), arg("out"), arg("lse"), arg("stream") = 0, arg("backend") = "",
      arg("empty_lse_plus_inf") = false, obj("workspace") = nb::none());

  m.def(
      "write_index_cache",
      [](nb::handle k, nb::handle slot_mapping, nb::handle cache, uintptr_t stream, const std::string& backend) {
        Importer imp;
        WriteIndexCacheArgs a;
        a.k = imp.input(k, "k");
        a.slot_mapping = imp.input(slot_mapping, "slot_mapping");
        a.cache = imp.output(cache, "cache");
        launch(write_index_cache, a, a.cache.device, stream, backend, imp);
      },
      arg("k"), arg("slot_mapping"), arg("cache"), arg("stream") = 0, arg("backend") = "");

  m.def(
      "indexer_topk",
      [](nb::handle q, nb::handle q_scale, nb::handle weights, nb::handle index_cache, nb::handle request_ids,
         nb::handle block_table, nb::handle context_lens, nb::handle topk, uintptr_t stream,
         const std::string& backend, nb::handle workspace, bool sorted) {
        Importer imp;
        IndexerTopkArgs a = import_indexer(imp, kIndexerTopkNames, q, q_scale, weights, index_cache, request_ids,
                                           block_table, context_lens, topk);
        a.sorted = sorted;
        launch(indexer_topk, a, a.q.device, stream, backend, imp, workspace);
      },
      arg("q"), obj("q_scale"), arg("weights"), arg("index_cache"), arg("request_ids"), arg("block_table"),
      arg("context_lens"), arg("topk"), arg("stream") = 0, arg("backend") = "", obj("workspace") = nb::none(),
      arg("sorted") = true);

  m.def(
      "positions_to_slots",
      [](nb::handle positions, nb::handle request_ids, nb::handle block_table, int block_size, nb::handle slots,
         uintptr_t stream, const std::string& backend) {
        Importer imp;
        PositionsToSlotsArgs a;
        a.positions = imp.input(positions, "positions");
        a.request_ids = imp.input(request_ids, "request_ids");
        a.block_table = imp.input(block_table, "block_table");
        a.block_size = block_size;
        a.slots = imp.output(slots, "slots");
        launch(positions_to_slots, a, a.positions.device, stream, backend, imp);
      },
      arg("positions"), arg("request_ids"), arg("block_table"), arg("block_size"), arg("slots"), arg("stream") = 0,
      arg("backend") = "");

  m.def(
      "write_pooled_index_cache",
      [](nb::handle k, nb::handle gate, nb::handle ape, nb::handle slot_mapping, nb::handle cache, bool hadamard,
         uintptr_t stream, const std::string& backend) {
        Importer imp;
        WritePooledIndexCacheArgs a;
        a.k = imp.input(k, "k");
        a.gate = imp.input(gate, "gate");
        a.ape = imp.input(ape, "ape");
        a.slot_mapping = imp.input(slot_mapping, "slot_mapping");
        a.cache = imp.output(cache, "cache");
        a.hadamard = hadamard;
        launch(write_pooled_index_cache, a, a.cache.device, stream, backend, imp);
      },
      arg("k"), arg("gate"), arg("ape"), arg("slot_mapping"), arg("cache"), arg("hadamard") = true,
      arg("stream") = 0, arg("backend") = "");

  m.def(
      "pools_to_positions",
      [](nb::handle pools, nb::handle context_lens, int kpool, nb::handle positions, uintptr_t stream,
         const std::string& backend) {
        Importer imp;
        PoolsToPositionsArgs a;
        a.pools = imp.input(pools, "pools");
        a.context_lens = imp.input(context_lens, "context_lens");
        a.kpool = kpool;
        a.positions = imp.output(positions, "positions");
        launch(pools_to_positions, a, a.pools.device, stream, backend, imp);
      },
      arg("pools"), arg("context_lens"), arg("kpool"), arg("positions"), arg("stream") = 0, arg("backend") = "");

  m.def(
      "rotate_index_q",
      [](nb::handle q, nb::handle q_out, nb::handle q_scale, uintptr_t stream, const std::string& backend) {
        Importer imp;
        RotateIndexQArgs a;
        a.q = imp.input(q, "q");
        a.q_out = imp.output(q_out, "q_out");
        a.q_scale = imp.output(q_scale, "q_scale");
        launch(rotate_index_q, a, a.q.device, stream, backend, imp);
      },
      arg("q"), arg("q_out"), obj("q_scale"), arg("stream") = 0, arg("backend") = "");

  m.def(
      "dsa_decode_step",
      [](nb::handle index_q, nb::handle index_q_scale, nb::handle index_weights, nb::handle index_cache,
         nb::handle request_ids, nb::handle block_table, nb::handle context_lens, nb::handle topk, nb::handle slots,
         nb::handle q, nb::handle kv_cache, nb::handle attn_sink, float softmax_scale, nb::handle out, nb::handle lse,
         uintptr_t stream, const std::string& backend, nb::handle workspace, bool sorted) {
        Importer imp;
        DsaDecodeStepArgs a;
        a.indexer = import_indexer(imp, kDecodeStepNames, index_q, index_q_scale, index_weights, index_cache,
                                   request_ids, block_table, context_lens, topk);
        a.indexer.sorted = sorted;
        a.indexer.stream = as_stream(stream);
        a.slots = imp.output(slots, "slots");
        a.q = imp.input(q, "q");
        a.kv_cache = imp.input(kv_cache, "kv_cache");
        a.attn_sink = imp.input(attn_sink, "attn_sink");
        a.softmax_scale = softmax_scale;
        a.out = imp.output(out, "out");
        a.lse = imp.output(lse, "lse");
        launch(dsa_decode_step, a, a.q.device, stream, backend, imp, workspace);
      },
      arg("index_q"), obj("index_q_scale"), arg("index_weights"), arg("index_cache"), arg("request_ids"),
      arg("block_table"), arg("context_lens"), arg("topk"), arg("slots"), arg("q"), arg("kv_cache"),
      obj("attn_sink"), arg("softmax_scale"), arg("out"), arg("lse"), arg("stream") = 0, arg("backend") = "",
      obj("workspace") = nb::none(), arg("sorted") = true);

  m.def("tensor_info", &tensor_info, arg("tensor"),
        "What C++ sees of a tensor: data pointer, shape, strides (elements), dtype, device.");
}

}  // namespace smla::python
