// Validation derives every reason from the Capabilities declaration; nothing
// here knows about particular backends.
#include <algorithm>
#include <sstream>

#include "core/describe.h"
#include "smla/backend.h"

namespace smla {

namespace {

template <class T, class Name>
std::string join(const std::vector<T>& items, Name name) {
  std::string s;
  for (size_t i = 0; i < items.size(); ++i) s += (i ? ", " : "") + std::string(name(items[i]));
  return s;
}

std::string range_text(const IntRange& r) {
  return r.min == r.max ? std::to_string(r.min) : std::to_string(r.min) + "-" + std::to_string(r.max);
}

bool contains(const std::vector<DType>& v, DType d) { return std::find(v.begin(), v.end(), d) != v.end(); }

}  // namespace

std::string compute_capability_text(int cc) { return std::to_string(cc / 10) + "." + std::to_string(cc % 10); }

std::string describe_compute_capabilities(const IntRange& r) {
  // An upper bound of X9 means "every minor version of X": sm_129 reads sm_12x.
  const std::string max = r.max % 10 == 9 ? std::to_string(r.max / 10) + "x" : std::to_string(r.max);
  return "sm_" + std::to_string(r.min) + (r.max == r.min ? "" : " to sm_" + max);
}

std::string describe_heads(const Capabilities& c) {
  if (!c.head_counts.empty()) return join(c.head_counts, [](int h) { return std::to_string(h); });
  return range_text(c.heads);
}

std::string describe_head_sizes(const Capabilities& c) {
  const auto number = [](int d) { return std::to_string(d); };
  return join(c.qk_head_dims, number) + " / " + join(c.v_head_dims, number);
}

std::string describe_block_sizes(const Capabilities& c) {
  std::string s = range_text(c.block_size);
  if (c.block_size_multiple > 1) s += " (multiple of " + std::to_string(c.block_size_multiple) + ")";
  return s;
}

std::string describe_topk(const Capabilities& c) {
  std::string s = range_text(c.topk);
  if (c.topk_multiple > 1) s += " (multiple of " + std::to_string(c.topk_multiple) + ")";
  return s;
}

std::string describe_dtypes(const std::vector<DType>& v) { return join(v, dtype_name); }

std::vector<std::string> validate(const Capabilities& c, const AttentionSpec& spec, const RunSpec& run) {
  std::vector<std::string> reasons;
  auto add = [&](std::string r) { reasons.push_back(std::move(r)); };

  const Device& dev = run.device;
  if (c.device_kind != dev.kind) {
    add(c.device_kind == DeviceKind::cpu ? "runs on the CPU, not on a CUDA GPU (" + dev.name() + ")"
                                          : "runs on CUDA GPUs (" + describe_compute_capabilities(c.compute_capability) +
                                                "), not on the CPU");
  } else if (dev.is_cuda()) {
    if (dev.compute_capability == 0)
      add("device compute capability unknown: pass --device sm_XY");
    else if (!c.compute_capability.contains(dev.compute_capability))
      add("needs " + describe_compute_capabilities(c.compute_capability) + ", device is " + dev.name() +
          " (compute capability " + compute_capability_text(dev.compute_capability) + ")");
  }

  if (!contains(c.q_dtypes, run.q_dtype))
    add("query dtype " + std::string(dtype_name(run.q_dtype)) + " not supported (supports " +
        describe_dtypes(c.q_dtypes) + ")");
  const DType kv = run.resolved_kv_cache_dtype();
  if (!contains(c.kv_cache_dtypes, kv))
    add("kv-cache dtype " + std::string(dtype_name(kv)) + " not supported (supports " +
        describe_dtypes(c.kv_cache_dtypes) + ")");

  if (spec.num_heads % std::max(run.tp, 1) == 0) {
    const int h = spec.num_heads / std::max(run.tp, 1);
    const bool ok = c.head_counts.empty()
                        ? c.heads.contains(h)
                        : std::find(c.head_counts.begin(), c.head_counts.end(), h) != c.head_counts.end();
    if (!ok) add(std::to_string(h) + " heads per rank not supported (supports " + describe_heads(c) + ")");
  }

  const int qk = spec.absorbed_qk_dim(), v = spec.absorbed_v_dim();
  if (std::find(c.qk_head_dims.begin(), c.qk_head_dims.end(), qk) == c.qk_head_dims.end() ||
      std::find(c.v_head_dims.begin(), c.v_head_dims.end(), v) == c.v_head_dims.end())
    add("absorbed head size " + std::to_string(qk) + " / " + std::to_string(v) + " not supported (supports " +
        describe_head_sizes(c) + ")");

  // Geometry rules, not a backend's: a shared-KV head (DeepSeek-V4) keeps its rope dims inside the 512 and fp8
  // caches it in its own 584-byte layout (fp8_ds_mla_v4), which neither fp8_ds_mla form is and which holds no other
  // head; the compact one has no room for a rope part.
  if (spec.is_shared_kv() && is_fp8_mla_cache(kv))
    add("kv-cache dtype " + std::string(dtype_name(kv)) + " cannot hold a " + spec.model_type +
        " head (its fp8 cache is FlashMLA's 584-byte MODEL1 layout: use fp8_ds_mla_v4, or bfloat16)");
  else if (!spec.is_shared_kv() && kv == DType::fp8_ds_mla_v4)
    add("kv-cache dtype fp8_ds_mla_v4 is DeepSeek-V4's cache (a 512-wide head of 448 + 64 rope values); a " +
        spec.model_type + " head is cached as fp8_ds_mla" + (spec.qk_rope_head_dim ? "" : " or fp8_ds_mla_nope"));
  else if (MlaHead{spec.qk_rope_head_dim}.cache_row(kv) == 0 && is_fp8_mla_cache(kv))
    add("kv-cache dtype " + std::string(dtype_name(kv)) + " has no rope part, the model's head has rope " +
        std::to_string(spec.qk_rope_head_dim) + " (use fp8_ds_mla)");

  if (!c.block_size.contains(run.block_size) || run.block_size % std::max(c.block_size_multiple, 1) != 0)
    add("block size " + std::to_string(run.block_size) + " not supported (supports " + describe_block_sizes(c) + ")");

  const OpSet ops = needed_ops(spec, run);
  for (Op op : ops.list())
    if (!c.ops.contains(op)) add("does not implement " + std::string(op_name(op)));

  if (ops.contains(Op::indexer) && spec.indexer && spec.indexer->kpool > 1) {
    const int kpool = spec.indexer->kpool;
    if (!c.pooled_indexer) add("does not implement the pooled indexer (index_kpool " + std::to_string(kpool) + ")");
    // A geometry rule: the pooled index cache shares the block table, block_size / kpool pools a block.
    if (run.block_size % kpool != 0)
      add("block size " + std::to_string(run.block_size) + " is not a multiple of index_kpool " +
          std::to_string(kpool) + " (the pooled index cache holds block_size / kpool pools a block)");
  }
  if (ops.contains(Op::sparse_mla) && spec.indexer) {
    const int k = spec.indexer->topk;
    if (!c.topk.contains(k) || k % std::max(c.topk_multiple, 1) != 0)
      add("top-k " + std::to_string(k) + " not supported (supports " + describe_topk(c) + ")");
  }
  if (ops.contains(Op::sparse_mla) && spec.has_compressed_cache() && !c.extra_cache)
    add("does not implement sparse attention over two caches (the window cache and the compressed cache under one "
        "softmax, as " + spec.model_type + " needs)");
  if (run.attn_sink && !c.attn_sink) add("does not support attention sinks");

  if (c.combination_rule)
    for (auto& r : c.combination_rule(spec, run)) add(std::move(r));
  return reasons;
}

}  // namespace smla
