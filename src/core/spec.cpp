#include "smla/spec.h"

#include <cmath>
#include <sstream>
#include <utility>

#include "smla/error.h"

namespace smla {

std::string_view rope_style_name(RopeStyle style) {
  return style == RopeStyle::interleaved ? "interleaved" : "half-split";
}

std::string_view op_name(Op op) {
  switch (op) {
    case Op::sparse_mla: return "sparse attention";
    case Op::paged_mla_decode: return "dense paged decode";
    case Op::indexer: return "indexer";
  }
  return "?";
}

std::vector<Op> OpSet::list() const {
  std::vector<Op> out;
  for (Op op : kAllOps)
    if (contains(op)) out.push_back(op);
  return out;
}

double reference_softmax_scale(int qk_head_dim, const RopeSpec& rope) {
  double scale = 1.0 / std::sqrt(static_cast<double>(qk_head_dim));
  // As in the DeepSeek reference: with YaRN and mscale_all_dim set, the
  // attention temperature is corrected by mscale^2.
  if (rope.yarn && rope.factor > 1.0 && rope.mscale_all_dim != 0.0) {
    const double mscale = 0.1 * rope.mscale_all_dim * std::log(rope.factor) + 1.0;
    scale *= mscale * mscale;
  }
  return scale;
}

namespace {
// A double as a message shows it: "nan", "inf", "1e+300", "0.0625".
std::string number_text(double v) {
  std::ostringstream o;
  o << v;
  return o.str();
}
}  // namespace

void validate(const AttentionSpec& s, std::string_view source) {
  const std::string src(source);
  auto positive = [&](int v, const char* field) {
    require(v > 0, src + ": " + field + " must be a positive integer, got " + std::to_string(v));
  };
  positive(s.num_heads, "num_attention_heads");
  // 0: no latent (DeepSeek-V4's shared KV head), whose value is the whole cached head.
  require(s.kv_lora_rank >= 0, src + ": kv_lora_rank must not be negative, got " + std::to_string(s.kv_lora_rank));
  positive(s.qk_nope_head_dim, "qk_nope_head_dim");
  positive(s.v_head_dim, "v_head_dim");
  require(s.sliding_window >= 0, src + ": sliding_window must not be negative, got " + std::to_string(s.sliding_window));
  require(s.compress_ratios.empty() || std::cmp_equal(s.compress_ratios.size(), s.num_layers),
          src + ": compress_ratios: expected one per layer (num_hidden_layers " + std::to_string(s.num_layers) +
              "), got " + std::to_string(s.compress_ratios.size()));
  for (int ratio : s.compress_ratios)
    require(ratio >= 0 && ratio <= kMaxSpecTopk,
            src + ": compress_ratios: each must be 0 (window only) to " + std::to_string(kMaxSpecTopk) + ", got " +
                std::to_string(ratio));
  // 0: a head with no rope part (GLM-5.3-Flash).
  require(s.qk_rope_head_dim >= 0,
          src + ": qk_rope_head_dim must not be negative, got " + std::to_string(s.qk_rope_head_dim));
  require(s.hidden_size >= 0, src + ": hidden_size must not be negative");
  require(s.q_lora_rank >= 0, src + ": q_lora_rank must not be negative");
  require(s.qk_rope_head_dim % 2 == 0,
          src + ": qk_rope_head_dim must be even (RoPE rotates pairs), got " + std::to_string(s.qk_rope_head_dim));
  require(s.rope.theta > 0, src + ": rope_theta must be positive");
  require(!s.rope.yarn || s.rope.factor >= 1.0, src + ": rope_scaling.factor must be >= 1");
  require(s.softmax_scale > 0 && std::isfinite(s.softmax_scale),
          src + ": softmax_scale must be finite and > 0, got " + number_text(s.softmax_scale));
  require(s.num_attention_layers >= 0 && s.num_attention_layers <= s.num_layers,
          src + ": the MLA layers (layer_types) must number 0 to num_hidden_layers (" + std::to_string(s.num_layers) +
              "), got " + std::to_string(s.num_attention_layers));
  if (s.indexer) {
    positive(s.indexer->heads, "index_n_heads");
    positive(s.indexer->head_dim, "index_head_dim");
    positive(s.indexer->topk, "index_topk");
    positive(s.indexer->kpool, "index_kpool");
    require(s.indexer->head_dim % 2 == 0 && s.indexer->head_dim > s.qk_rope_head_dim,
            src + ": index_head_dim must be even and larger than qk_rope_head_dim, got " +
                std::to_string(s.indexer->head_dim));
  }
  // Upper bounds, far above any real model: past them a config is damaged or hostile, and would fail only later,
  // in an allocation (a weight matrix of 2^31 rows).
  auto at_most = [&](int64_t v, int64_t max, const char* field) {
    require(v <= max, src + ": " + field + " must be at most " + std::to_string(max) + ", got " + std::to_string(v));
  };
  at_most(s.hidden_size, kMaxSpecWidth, "hidden_size");
  at_most(s.num_heads, kMaxSpecHeads, "num_attention_heads");
  at_most(s.q_lora_rank, kMaxSpecWidth, "q_lora_rank");
  at_most(s.kv_lora_rank, kMaxSpecWidth, "kv_lora_rank");
  at_most(s.qk_nope_head_dim, kMaxSpecHeadDim, "qk_nope_head_dim");
  at_most(s.qk_rope_head_dim, kMaxSpecHeadDim, "qk_rope_head_dim");
  at_most(s.v_head_dim, kMaxSpecHeadDim, "v_head_dim");
  at_most(s.num_layers, kMaxSpecLayers, "num_hidden_layers");
  at_most(s.sliding_window, kMaxSpecTopk, "sliding_window");
  if (s.indexer) {
    at_most(s.indexer->heads, kMaxSpecHeads, "index_n_heads");
    at_most(s.indexer->head_dim, kMaxSpecHeadDim, "index_head_dim");
    at_most(s.indexer->topk, kMaxSpecTopk, "index_topk");
    at_most(s.indexer->kpool, kMaxSpecTopk, "index_kpool");
  }
  // After the bounds: nope + rope cannot overflow.
  require(!s.is_shared_kv() || s.v_head_dim == s.qk_head_dim(),
          src + ": a head with no latent (kv_lora_rank 0) has its value the whole cached head: v_head_dim must be " +
              std::to_string(s.qk_head_dim()) + " (nope + rope), got " + std::to_string(s.v_head_dim));
  require(std::isfinite(s.rope.theta), src + ": rope_theta must be finite, got " + number_text(s.rope.theta));
  require(!s.rope.yarn || std::isfinite(s.rope.factor),
          src + ": rope_scaling.factor must be finite, got " + number_text(s.rope.factor));
  require(s.rms_norm_eps > 0 && std::isfinite(s.rms_norm_eps),
          src + ": rms_norm_eps must be finite and > 0, got " + number_text(s.rms_norm_eps));
}

OpSet needed_ops(const AttentionSpec& spec, const RunSpec& run) {
  if (!run.ops.empty()) return run.ops;
  if (spec.is_sparse()) return {Op::sparse_mla, Op::indexer};
  return {Op::paged_mla_decode};
}

int heads_per_rank(const AttentionSpec& spec, const RunSpec& run) {
  require(run.tp >= 1, "tp: tensor-parallel size must be >= 1, got " + std::to_string(run.tp));
  require(spec.num_heads % run.tp == 0, "tp: " + std::to_string(run.tp) + " does not divide the model's " +
                                            std::to_string(spec.num_heads) + " attention heads");
  return spec.num_heads / run.tp;
}

void validate(const AttentionSpec& spec, const RunSpec& run) {
  heads_per_rank(spec, run);
  require(run.block_size >= 1, "block-size: must be >= 1, got " + std::to_string(run.block_size));
  require(run.q_dtype == DType::bf16 || run.q_dtype == DType::f16,
          "dtype: query dtype must be bfloat16 or float16, got " + std::string(dtype_name(run.q_dtype)));
  const DType kv = run.resolved_kv_cache_dtype();
  require(is_mla_cache_dtype(kv), "kv-cache-dtype: must be " + dtype_names(kAllMlaCacheDTypes) + ", got " +
                                      std::string(dtype_name(kv)));
}

}  // namespace smla
