#include "smla/explain.h"

#include <cmath>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/describe.h"

namespace smla {

namespace {

std::string fmt(double v, const char* f = "%.6g") {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

std::string device_text(const Device& d) {
  if (d.is_cpu() || d.compute_capability == 0) return d.name();
  return d.name() + " (compute capability " + compute_capability_text(d.compute_capability) + ")";
}

std::string kv_text(const RunSpec& run) {
  return std::string(dtype_name(run.resolved_kv_cache_dtype())) + (run.kv_cache_dtype ? "" : " (auto)");
}

// ", 1, 8 and 64 query rows per call" where the run names them (the CUDA backend's kernel lines follow them).
std::string query_tokens_text(const RunSpec& run) {
  std::string t;
  const size_t n = run.query_tokens.size();
  for (size_t i = 0; i < n; ++i)
    t += (i == 0 ? ", " : i + 1 == n ? " and " : ", ") + std::to_string(run.query_tokens[i]);
  return n == 0 ? t : t + " query row" + (n == 1 && run.query_tokens[0] == 1 ? "" : "s") + " per call";
}

// The kernels a chosen backend reports (Capabilities::kernel_choices; none where it reports none).
std::vector<KernelChoice> kernel_choices(const Backend& b, const AttentionSpec& s, const RunSpec& run) {
  const auto& report = b.capabilities().kernel_choices;
  return report ? report(s, run) : std::vector<KernelChoice>{};
}

// The lines explain prints under a chosen backend for its kernels: "kernel decode (1 query row): 16-head tile
// (16 heads/CTA, ...), sm_90a" ("kernel (8 query rows): ..." for rows the run names), then "  wgmma kernel: not
// chosen: ..." for each other kernel.
std::vector<std::string> kernel_note_lines(const std::vector<KernelChoice>& choices) {
  std::vector<std::string> lines;
  for (const KernelChoice& c : choices) {
    const std::string rows = std::to_string(c.query_tokens) + " query row" + (c.query_tokens == 1 ? "" : "s");
    lines.push_back("kernel " + (c.phase.empty() ? "" : c.phase + " ") + "(" + rows + "): " + c.kernel +
                    (c.shape.empty() ? "" : " (" + c.shape + ")") + ", " + c.arch);
    for (const KernelChoice::Other& o : c.others) lines.push_back("  " + o.kernel + ": " + o.reason);
  }
  return lines;
}

std::string ops_text(OpSet ops) {
  std::string s;
  for (Op op : ops.list()) s += (s.empty() ? "" : ", ") + std::string(op_name(op));
  return s;
}

// A backend's ops with what it leaves out of them: "sparse attention (one cache), dense paged decode, indexer".
std::string declared_ops_text(const Capabilities& c) {
  std::string s;
  for (Op op : c.ops.list()) {
    s += (s.empty() ? "" : ", ") + std::string(op_name(op));
    if (op == Op::sparse_mla && !c.extra_cache) s += " (one cache)";
    if (op == Op::indexer && !c.pooled_indexer) s += " (not pooled)";
  }
  return s;
}

// "0.0625 (= 256^-0.5)" or "0.135234 (= 192^-0.5 x mscale^2 1.87385, YaRN factor 40)"
std::string scale_text(const AttentionSpec& s) {
  const double plain = 1.0 / std::sqrt(static_cast<double>(s.qk_head_dim()));
  std::string t = fmt(s.softmax_scale) + " (= " + std::to_string(s.qk_head_dim()) + "^-0.5";
  if (std::fabs(s.softmax_scale / plain - 1.0) > 1e-9)
    t += " x mscale^2 " + fmt(s.softmax_scale / plain) + ", YaRN factor " + fmt(s.rope.factor);
  return t + ")";
}

// DeepSeek-V4's caches: "window of 128 tokens in every layer; a compressed cache beside it (...): r = 4 in 21
// layers, r = 128 in 20 layers (...); the window only in 2 layers".
std::string caches_text(const AttentionSpec& s) {
  std::map<int, int> layers_per_ratio;
  for (int ratio : s.compress_ratios) ++layers_per_ratio[ratio];
  std::string t = "window of " + std::to_string(s.sliding_window) + " tokens in every layer";
  std::string compressed;
  for (const auto& [ratio, layers] : layers_per_ratio) {
    if (ratio == 0) continue;
    compressed += (compressed.empty() ? "" : ", ") + std::string("r = ") + std::to_string(ratio) + " in " +
                  std::to_string(layers) + " layer" + (layers == 1 ? "" : "s");
  }
  // As vLLM's deepseek_v4 runs them: the indexer picks the entries of the ratio-4 caches, the others are all attended.
  if (!compressed.empty())
    t += "; a compressed cache beside it (one entry per r tokens): " + compressed +
         (s.indexer ? " (r = 4: the indexer's top-" + std::to_string(s.indexer->topk) + "; others: every entry)"
                    : "");
  if (const auto window_only = layers_per_ratio.find(0); window_only != layers_per_ratio.end())
    t += "; the window only in " + std::to_string(window_only->second) + " layer" + (window_only->second == 1 ? "" : "s");
  return t;
}

}  // namespace

std::string explain_text(const AttentionSpec& s, const RunSpec& run, const Selection& sel) {
  std::ostringstream o;
  const int hpr = s.num_heads / std::max(run.tp, 1);
  o << "model      " << s.name << " (" << s.model_type << "): " << s.num_heads << " heads, q_lora " << s.q_lora_rank;
  if (s.is_shared_kv())
    o << ", head " << s.qk_head_dim() << " (nope " << s.qk_nope_head_dim << " + rope " << s.qk_rope_head_dim
      << "), one shared KV head, no latent";
  else
    o << ", kv_lora " << s.kv_lora_rank << ", qk_nope " << s.qk_nope_head_dim << ", qk_rope " << s.qk_rope_head_dim
      << ", v " << s.v_head_dim;
  if (s.is_hybrid())
    o << ", layers " << s.num_layers << " (" << s.num_attention_layers << " MLA, "
      << s.num_layers - s.num_attention_layers << " linear attention)";
  o << "\n";
  const bool rope = s.qk_rope_head_dim > 0;
  if (s.is_shared_kv())
    o << "kernel     head size " << s.absorbed_qk_dim() << " (nope " << s.qk_nope_head_dim << " + rope "
      << s.qk_rope_head_dim << ", nothing absorbed), value " << s.absorbed_v_dim()
      << " (the whole cached head, rope dims included); softmax scale " << scale_text(s) << "\n";
  else
    o << "kernel     absorbed head size " << s.absorbed_qk_dim() << " (kv_lora " << s.kv_lora_rank
      << (rope ? " + rope " + std::to_string(s.qk_rope_head_dim) : std::string(", no rope part")) << "), value "
      << s.absorbed_v_dim() << "; softmax scale " << scale_text(s) << "\n";
  if (s.has_compressed_cache()) o << "caches     " << caches_text(s) << "\n";
  if (rope)
    o << "rope       theta " << fmt(s.rope.theta, "%.10g") << ", " << rope_style_name(s.rope_style)
      << (s.rope.yarn ? ", YaRN factor " + fmt(s.rope.factor) + " over " +
                            std::to_string(s.rope.original_max_position_embeddings)
                      : std::string())
      << "\n";
  else
    o << "rope       none (no rope part)\n";
  if (s.indexer) {
    o << "indexer    " << s.indexer->heads << " heads x " << s.indexer->head_dim << ", top-k " << s.indexer->topk
      << (rope ? ", RoPE " + std::string(rope_style_name(s.indexer->rope_style)) : std::string(", no RoPE"));
    if (s.indexer->kpool > 1)
      o << ", one key per pool of " << s.indexer->kpool << " tokens (top-k picks pools"
        << (s.indexer->always_select_tail ? "; the incomplete last pool always attended)" : ")");
    o << "\n";
  } else
    o << "indexer    none (dense attention)\n";
  o << "run        device " << device_text(run.device) << ", dtype " << dtype_name(run.q_dtype) << ", kv cache "
    << kv_text(run) << ", block size " << run.block_size << ", tp " << run.tp << " -> " << hpr
    << " heads per rank" << query_tokens_text(run) << "\n";
  o << "needs      " << ops_text(needed_ops(s, run)) << (run.attn_sink ? ", attention sinks" : "") << "\n\n";

  o << "backends (in priority order for " << run.device.name() << "):\n";
  size_t width = 0;
  for (const auto& c : sel.candidates) width = std::max(width, c.backend->name().size());
  for (const auto& c : sel.candidates) {
    std::string name = c.backend->name();
    name.resize(width, ' ');
    o << "  " << name << "  ";
    if (c.backend == sel.chosen) {
      o << "CHOSEN" << (sel.forced ? " (forced)" : "") << "    " << c.backend->capabilities().description << "\n";
      for (const std::string& line : kernel_note_lines(kernel_choices(*c.backend, s, run)))
        o << std::string(width + 4, ' ') << line << "\n";
    }
    else if (c.valid())
      o << "valid     (a higher-priority backend was chosen)\n";
    else
      for (size_t i = 0; i < c.reasons.size(); ++i)
        o << (i ? std::string(width + 4, ' ') + "          " : "rejected: ") << c.reasons[i] << "\n";
  }
  o << "\n";
  if (sel.chosen)
    o << "result     " << sel.chosen->name() << "\n";
  else {
    o << "result     no valid backend for " << s.name << " on " << run.device.name() << "\n";
    o << "suggestion " << (sel.suggestion.empty() ? "none: no single change to the run makes a backend valid"
                                                   : sel.suggestion)
      << "\n";
  }
  return o.str();
}

std::string explain_json(const AttentionSpec& s, const RunSpec& run, const Selection& sel) {
  using nlohmann::json;
  const bool has_rope = s.qk_rope_head_dim > 0;  // as the text says: no rope part, no RoPE (the indexer's too)
  json rope = nullptr;
  if (has_rope) rope = {{"theta", s.rope.theta}, {"style", rope_style_name(s.rope_style)}, {"yarn", nullptr}};
  if (has_rope && s.rope.yarn)
    rope["yarn"] = {{"factor", s.rope.factor},
                    {"original_max_position_embeddings", s.rope.original_max_position_embeddings},
                    {"beta_fast", s.rope.beta_fast},
                    {"beta_slow", s.rope.beta_slow},
                    {"mscale", s.rope.mscale},
                    {"mscale_all_dim", s.rope.mscale_all_dim}};
  json indexer = nullptr;
  if (s.indexer)
    indexer = {{"heads", s.indexer->heads},
               {"head_dim", s.indexer->head_dim},
               {"topk", s.indexer->topk},
               {"rope_style", has_rope ? json(rope_style_name(s.indexer->rope_style)) : json(nullptr)},
               {"kpool", s.indexer->kpool},
               {"always_select_tail", s.indexer->always_select_tail}};
  json model = {{"name", s.name},
                {"model_type", s.model_type},
                {"hidden_size", s.hidden_size},
                {"num_heads", s.num_heads},
                {"q_lora_rank", s.q_lora_rank},
                {"kv_lora_rank", s.kv_lora_rank},
                {"qk_nope_head_dim", s.qk_nope_head_dim},
                {"qk_rope_head_dim", s.qk_rope_head_dim},
                {"v_head_dim", s.v_head_dim},
                {"num_layers", s.num_layers},
                {"num_attention_layers", s.num_attention_layers},
                {"absorbed_qk_dim", s.absorbed_qk_dim()},
                {"absorbed_v_dim", s.absorbed_v_dim()},
                {"shared_kv", s.is_shared_kv()},
                {"sliding_window", s.sliding_window},
                {"compress_ratios", s.compress_ratios},
                {"softmax_scale", s.softmax_scale},
                {"rope", rope},
                {"indexer", indexer}};
  json ops = json::array();
  for (Op op : needed_ops(s, run).list()) ops.push_back(op_name(op));
  json run_j = {{"device", run.device.name()},
                {"compute_capability", run.device.compute_capability},
                {"dtype", dtype_name(run.q_dtype)},
                {"kv_cache_dtype", dtype_name(run.resolved_kv_cache_dtype())},
                {"kv_cache_dtype_auto", !run.kv_cache_dtype.has_value()},
                {"block_size", run.block_size},
                {"tp", run.tp},
                {"heads_per_rank", s.num_heads / std::max(run.tp, 1)},
                {"ops", ops},
                {"attn_sink", run.attn_sink},
                {"query_tokens", run.query_tokens}};
  json candidates = json::array();
  for (const auto& c : sel.candidates) {
    const bool chosen = c.backend == sel.chosen;
    const std::vector<KernelChoice> choices = chosen ? kernel_choices(*c.backend, s, run) : std::vector<KernelChoice>{};
    json kernels = json::array();
    for (const KernelChoice& k : choices) {
      json others = json::array();
      for (const KernelChoice::Other& o : k.others) others.push_back({{"kernel", o.kernel}, {"reason", o.reason}});
      kernels.push_back({{"query_tokens", k.query_tokens},
                         {"phase", k.phase.empty() ? json(nullptr) : json(k.phase)},
                         {"kernel", k.kernel},
                         {"arch", k.arch},
                         {"heads_per_cta", k.heads_per_cta},
                         {"warps", k.warps},
                         {"stages", k.stages},
                         {"smem_bytes", k.smem_bytes},
                         {"ctas_per_sm", k.ctas_per_sm},
                         {"shape", k.shape},
                         {"others", others}});
    }
    candidates.push_back({{"name", c.backend->name()},
                          {"description", c.backend->capabilities().description},
                          {"valid", c.valid()},
                          {"chosen", chosen},
                          {"reasons", c.reasons},
                          {"kernel_notes", kernel_note_lines(choices)},
                          {"kernels", kernels}});
  }
  json out = {{"schema", "smla.explain/1"},
              {"model", model},
              {"run", run_j},
              {"candidates", candidates},
              {"chosen", sel.chosen ? json(sel.chosen->name()) : json(nullptr)},
              {"forced", sel.forced},
              {"suggestion", sel.suggestion.empty() ? json(nullptr) : json(sel.suggestion)}};
  return out.dump(2) + "\n";
}

std::string support_matrix_markdown(const Registry& registry) {
  std::ostringstream o;
  o << "| backend | device | query dtypes | KV-cache dtypes | head sizes | heads per rank | block sizes | top-k | ops "
       "| sinks |\n"
    << "|---|---|---|---|---|---|---|---|---|---|\n";
  for (const Backend* b : registry.all()) {
    const Capabilities& c = b->capabilities();
    o << "| " << c.name << " | "
      << (c.device_kind == DeviceKind::cpu ? std::string("CPU") : describe_compute_capabilities(c.compute_capability))
      << " | " << describe_dtypes(c.q_dtypes) << " | " << describe_dtypes(c.kv_cache_dtypes) << " | "
      << describe_head_sizes(c) << " | " << describe_heads(c) << " | " << describe_block_sizes(c) << " | "
      << describe_topk(c) << " | " << declared_ops_text(c) << " | "
      << (c.attn_sink ? "yes" : "no") << " |\n";
  }
  return o.str();
}

}  // namespace smla
