// Selection and its explanation, the backends' declarations, the device.
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bindings.h"
#include "smla/error.h"
#include "smla/explain.h"
#include "smla/select.h"

namespace smla::python {

namespace {

nb::tuple range(const IntRange& r) { return nb::make_tuple(r.min, r.max); }

nb::list dtype_names(const std::vector<DType>& v) {
  nb::list l;
  for (DType d : v) l.append(std::string(dtype_name(d)));
  return l;
}

nb::dict capabilities(const Capabilities& c) {
  nb::dict d;
  d["name"] = c.name;
  d["description"] = c.description;
  d["device"] = c.device_kind == DeviceKind::cpu ? "cpu" : "cuda";
  d["compute_capability"] = c.device_kind == DeviceKind::cpu ? nb::none() : nb::object(range(c.compute_capability));
  d["q_dtypes"] = dtype_names(c.q_dtypes);
  d["kv_cache_dtypes"] = dtype_names(c.kv_cache_dtypes);
  d["heads"] = range(c.heads);
  d["head_counts"] = nb::cast(c.head_counts);
  d["qk_head_dims"] = nb::cast(c.qk_head_dims);
  d["v_head_dims"] = nb::cast(c.v_head_dims);
  d["block_size"] = range(c.block_size);
  d["block_size_multiple"] = c.block_size_multiple;
  d["topk"] = range(c.topk);
  d["topk_multiple"] = c.topk_multiple;
  nb::list ops;
  for (Op op : c.ops.list()) ops.append(std::string(op_name(op)));
  d["ops"] = ops;
  d["extra_cache"] = c.extra_cache;
  d["attn_sink"] = c.attn_sink;
  return d;
}

// Op names as op_name() gives them -> an OpSet; empty stays empty (the model's own needs).
OpSet parse_ops(const std::vector<std::string>& names) {
  OpSet ops;
  for (const std::string& n : names) {
    const Op* found = nullptr;
    for (const Op& op : kAllOps)
      if (op_name(op) == n) found = &op;
    if (!found) {
      std::string valid;
      for (Op op : kAllOps) valid += (valid.empty() ? "'" : ", '") + std::string(op_name(op)) + "'";
      fail("ops: expected op names among " + valid + ", got '" + n + "'");
    }
    ops.add(*found);
  }
  return ops;
}

}  // namespace

void bind_explain(nb::module_& m) {
  using nb::arg;
  m.def(
      "explain",
      [](const AttentionSpec& spec, const std::string& device, const std::string& dtype,
         const std::string& kv_cache_dtype, int block_size, int tp, const std::string& backend, bool attn_sink,
         const std::vector<std::string>& ops, const std::vector<int64_t>& query_tokens) {
        RunSpec run =
            make_run_spec(spec, {device, dtype, kv_cache_dtype, block_size, tp, backend, attn_sink, query_tokens});
        run.ops = parse_ops(ops);
        const Selection sel = select(spec, run);
        return nb::make_tuple(explain_text(spec, run, sel), explain_json(spec, run, sel));
      },
      arg("spec"), arg("device"), arg("dtype"), arg("kv_cache_dtype"), arg("block_size"), arg("tp"), arg("backend"),
      arg("attn_sink"), arg("ops") = std::vector<std::string>{}, arg("query_tokens") = std::vector<int64_t>{},
      "(text, json) of the selection for this run, as `smla explain` prints them. `ops` (op names as explain "
      "prints them) replaces the ops the model needs, e.g. {'sparse attention'} for an engine with its own indexer; "
      "`query_tokens` the query rows per call the CUDA backend's kernel lines name (empty: 1 and 4096).");

  m.def("backends", [] {
    nb::list l;
    for (const Backend* b : Registry::global().all()) l.append(capabilities(b->capabilities()));
    return l;
  });
  m.def("support_matrix", [] { return support_matrix_markdown(); },
        "A Markdown table of every backend's declared capabilities (what `smla backends` prints).");
  m.def("detect_device", [] { return detect_device().name(); },
        "'cpu', or the first CUDA GPU as 'sm_XY' when this build has CUDA and the runtime finds one.");
}

}  // namespace smla::python
