// The attention geometry (AttentionSpec) from a GGUF file's metadata.
#include "models/gguf.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <string_view>

#include "models/gguf_text.h"
#include "smla/error.h"

namespace smla::gguf {

namespace {

struct Architecture {
  std::string_view name;
  std::string_view model_type;
  bool sparse;
  RopeStyle indexer_rope;  // GGUF has no key for it: DeepSeek-V3.2 rotates half-split, GLM-5 interleaved
};
constexpr Architecture kArchitectures[] = {
    {"deepseek2", "deepseek_v3", false, RopeStyle::half_split},
    {"deepseek32", "deepseek_v32", true, RopeStyle::half_split},
    {"glm-dsa", "glm_moe_dsa", true, RopeStyle::interleaved},
};

// A float read back as the shortest decimal that rounds to it (for f32: 1e-6 stays the double 1e-6 a config.json
// holds, not 9.99999997e-7), times 10^shift applied to the decimal exponent so that no rounding creeps in.
double decimal(const Value& value, int shift) {
  const double stored = std::get<double>(value.data);
  char text[64];
  const std::to_chars_result printed =
      value.type == ValueType::f32
          ? std::to_chars(text, text + sizeof text, static_cast<float>(stored), std::chars_format::scientific)
          : std::to_chars(text, text + sizeof text, stored, std::chars_format::scientific);
  const std::string_view digits(text, printed.ptr);
  const size_t e = digits.find('e');
  int exponent = 0;
  std::from_chars(digits.data() + e + 1 + (digits[e + 1] == '+'), digits.data() + digits.size(), exponent);
  const std::string shifted = std::string(digits.substr(0, e)) + "e" + std::to_string(exponent + shift);
  double result = 0;
  std::from_chars(shifted.data(), shifted.data() + shifted.size(), result);
  return result;
}

// The metadata of one file, read with messages "<path>: <key>: <what was expected>, got <what>".
class Metadata {
 public:
  explicit Metadata(const File& file) : file_(file) {}

  [[noreturn]] void reject(std::string_view key, std::string_view expected, const std::string& got) const {
    fail(file_.path + ": " + std::string(key) + ": " + std::string(expected) + ", got " + got);
  }
  const Value* find(std::string_view key) const { return file_.find(key); }

  template <typename Int>
  std::optional<Int> integer(std::string_view key, Int min) const {
    const Value* value = find(key);
    if (!value) return std::nullopt;
    constexpr Int kMax = std::numeric_limits<Int>::max();
    const std::string expected = "expected an integer from " + std::to_string(min) + " to " + std::to_string(kMax);
    if (const auto* u = std::get_if<uint64_t>(&value->data); u && *u <= static_cast<uint64_t>(kMax) &&
                                                              static_cast<Int>(*u) >= min)
      return static_cast<Int>(*u);
    if (const auto* i = std::get_if<int64_t>(&value->data); i && *i >= min && *i <= kMax) return static_cast<Int>(*i);
    reject(key, expected, describe(*value));
  }

  int required_int(std::string_view key, int min) const {
    if (const std::optional<int> value = integer(key, min)) return *value;
    reject(key, "expected an integer", "no such key");
  }

  template <typename Int>
  Int optional_int(std::string_view key, Int fallback, Int min) const {
    return integer(key, min).value_or(fallback);
  }

  // A finite number; f32/f64 through decimal(), times 10^shift.
  double optional_real(std::string_view key, double fallback, int shift = 0) const {
    const Value* value = find(key);
    if (!value) return fallback;
    if (const auto* u = std::get_if<uint64_t>(&value->data)) return static_cast<double>(*u) * std::pow(10.0, shift);
    if (const auto* i = std::get_if<int64_t>(&value->data)) return static_cast<double>(*i) * std::pow(10.0, shift);
    if (!std::holds_alternative<double>(value->data) || !std::isfinite(std::get<double>(value->data)))
      reject(key, "expected a finite number", describe(*value));
    return decimal(*value, shift);
  }

  std::optional<std::string> optional_string(std::string_view key) const {
    const Value* value = find(key);
    if (!value) return std::nullopt;
    if (const auto* text = std::get_if<std::string>(&value->data)) return *text;
    reject(key, "expected a string", describe(*value));
  }

 private:
  const File& file_;
};

RopeSpec read_rope(const Metadata& meta, const std::string& arch) {
  RopeSpec rope;
  rope.theta = meta.optional_real(arch + ".rope.freq_base", rope.theta);
  const std::string type_key = arch + ".rope.scaling.type";
  const std::optional<std::string> type = meta.optional_string(type_key);
  if (!type || *type == "none") return rope;
  // Anything else (linear, longrope, ...) would change the positions in a way RopeSpec cannot express.
  if (*type != "yarn") meta.reject(type_key, R"(expected "yarn" or "none")", "string " + printable(*type));
  const std::string scaling = arch + ".rope.scaling.";
  rope.yarn = true;
  rope.factor = meta.optional_real(scaling + "factor", rope.factor);
  rope.original_max_position_embeddings =
      meta.optional_int<int64_t>(scaling + "original_context_length", rope.original_max_position_embeddings, 0);
  rope.beta_fast = meta.optional_real(scaling + "yarn_beta_fast", rope.beta_fast);
  rope.beta_slow = meta.optional_real(scaling + "yarn_beta_slow", rope.beta_slow);
  // The converter stores 0.1 * mscale_all_dim here for this family; mscale has no key and all the family's
  // configs set 1.0, RopeSpec's default.
  rope.mscale_all_dim = meta.optional_real(scaling + "yarn_log_multiplier", rope.mscale_all_dim, 1);
  return rope;
}

}  // namespace

AttentionSpec spec_from_gguf(const File& file) {
  const Metadata meta(file);
  const std::optional<std::string> arch_name = meta.optional_string("general.architecture");
  const auto arch = std::ranges::find(kArchitectures, arch_name.value_or(""), &Architecture::name);
  if (arch == std::end(kArchitectures))
    meta.reject("general.architecture", "expected one of deepseek2, deepseek32, glm-dsa",
                arch_name ? "string " + printable(*arch_name) : "no such key");
  const std::string a = std::string(arch->name);

  AttentionSpec spec;
  spec.name = file.path;
  spec.model_type = std::string(arch->model_type);
  if (arch->name == "deepseek2") {
    // One architecture holds DeepSeek-V3/R1, Kimi-K2 and GLM-4.7-Flash; the tokenizer tells them apart.
    const std::string pre = meta.optional_string("tokenizer.ggml.pre").value_or("");
    if (pre == "kimi-k2") spec.model_type = "kimi_k2";
    if (pre == "glm4") spec.model_type = "glm4_moe_lite";
  }
  spec.hidden_size = meta.required_int(a + ".embedding_length", 1);
  spec.num_heads = meta.required_int(a + ".attention.head_count", 1);
  spec.q_lora_rank = meta.optional_int(a + ".attention.q_lora_rank", 0, 0);
  spec.kv_lora_rank = meta.required_int(a + ".attention.kv_lora_rank", 1);
  const std::string key_length = a + ".attention.key_length", value_length = a + ".attention.value_length";
  const int key = meta.required_int(key_length, 1);
  const int value = meta.required_int(value_length, 1);
  if (meta.find(a + ".attention.key_length_mla")) {
    // MLA stored as MQA: one latent head [c | k_pe] of kv_lora + rope, value c; the per-head sizes in *_mla.
    if (value != spec.kv_lora_rank)
      meta.reject(value_length, "expected kv_lora_rank (" + num(spec.kv_lora_rank) + ")", num(value));
    if (key <= spec.kv_lora_rank)
      meta.reject(key_length, "expected kv_lora_rank + qk_rope_head_dim (more than " + num(spec.kv_lora_rank) + ")",
                  num(key));
    spec.qk_rope_head_dim = key - spec.kv_lora_rank;
    const std::string key_mla = a + ".attention.key_length_mla";
    const int qk_head_dim = meta.required_int(key_mla, 1);
    if (qk_head_dim <= spec.qk_rope_head_dim)
      meta.reject(key_mla, "expected qk_nope_head_dim + qk_rope_head_dim (more than " +
                               num(spec.qk_rope_head_dim) + ")", num(qk_head_dim));
    spec.qk_nope_head_dim = qk_head_dim - spec.qk_rope_head_dim;
    spec.v_head_dim = meta.required_int(a + ".attention.value_length_mla", 1);
  } else {
    // Files converted before llama.cpp stored MLA as MQA: per-head sizes, the RoPE part in rope.dimension_count.
    spec.qk_rope_head_dim = meta.required_int(a + ".rope.dimension_count", 1);
    if (key <= spec.qk_rope_head_dim)
      meta.reject(key_length, "expected qk_nope_head_dim + qk_rope_head_dim (more than " +
                                  num(spec.qk_rope_head_dim) + ")", num(key));
    spec.qk_nope_head_dim = key - spec.qk_rope_head_dim;
    spec.v_head_dim = value;
  }
  // block_count includes the NextN (multi-token prediction) layers that deepseek32 and glm-dsa files carry.
  const int blocks = meta.required_int(a + ".block_count", 0);
  const std::string nextn_key = a + ".nextn_predict_layers";
  const int nextn = meta.optional_int(nextn_key, 0, 0);
  if (nextn > blocks) meta.reject(nextn_key, "expected at most block_count (" + num(blocks) + ")", num(nextn));
  spec.num_layers = blocks - nextn;
  spec.num_attention_layers = spec.num_layers;  // the architectures read here have no linear-attention layers
  const std::string eps_key = a + ".attention.layer_norm_rms_epsilon";
  spec.rms_norm_eps = meta.optional_real(eps_key, spec.rms_norm_eps);
  if (!(spec.rms_norm_eps > 0)) meta.reject(eps_key, "expected a positive number", describe(*meta.find(eps_key)));
  spec.rope = read_rope(meta, a);
  spec.rope_style = RopeStyle::interleaved;  // MLA's RoPE is interleaved in every architecture here
  if (arch->sparse) {
    const std::string indexer = a + ".attention.indexer.";
    spec.indexer = IndexerSpec{.heads = meta.required_int(indexer + "head_count", 1),
                               .head_dim = meta.required_int(indexer + "key_length", 1),
                               .topk = meta.required_int(indexer + "top_k", 1),
                               .rope_style = arch->indexer_rope};
  }
  spec.softmax_scale = reference_softmax_scale(spec.qk_head_dim(), spec.rope);
  validate(spec, file.path);
  return spec;
}

AttentionSpec spec_from_gguf_file(const std::string& path) { return spec_from_gguf(Model::open(path).metadata()); }

}  // namespace smla::gguf
