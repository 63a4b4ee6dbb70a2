// Reads a model's attention geometry from a Hugging Face config.json. Bad input becomes one smla::Error line,
// "<source>: <field>: <what was expected>, got <what>"; no nlohmann exception leaves this file.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "core/text.h"
#include "models/gguf.h"
#include "smla/error.h"
#include "smla/spec.h"

namespace smla {
namespace {

using nlohmann::json;

constexpr std::string_view kModelTypes[] = {"deepseek_v3",   "deepseek_v32", "glm_moe_dsa",    "kimi_k2",
                                            "glm4_moe_lite", "glm5_next",    "glm5_next_text", "deepseek_v4"};
// The model types whose checkpoints carry the DSA lightning indexer.
constexpr std::string_view kSparseModelTypes[] = {"deepseek_v32", "glm_moe_dsa", "glm5_next", "glm5_next_text",
                                                  "deepseek_v4"};
// DeepSeek-V4 (transformers' DeepseekV4Config): no latent, one shared KV head, window + compressed caches.
constexpr std::string_view kDeepseekV4 = "deepseek_v4";
// V4's layer types and their compress ratios when compress_rates does not say (transformers' defaults).
constexpr std::pair<std::string_view, int> kV4LayerTypes[] = {
    {"sliding_attention", 0}, {"compressed_sparse_attention", 4}, {"heavily_compressed_attention", 128}};
// GLM-5.3-Flash (vLLM's Glm5NextTextConfig): a pooled indexer and hybrid layers. "glm5_next" is the multimodal
// wrapper; a flat config of that type carries the text fields at the top level.
constexpr std::string_view kPooledIndexerModelTypes[] = {"glm5_next", "glm5_next_text"};
// The `layer_types` entry of a layer that does not run MLA (GLM-5.3-Flash's Kimi delta attention layers).
constexpr std::string_view kLinearAttentionLayer = "linear_attention";

template <typename Range>
std::string join(const Range& items) {
  std::string out;
  for (const auto& item : items) out += (out.empty() ? "" : ", ") + std::string(item);
  return out;
}

// A JSON value, shown briefly for an error message.
std::string describe(const json& value) {
  switch (value.type()) {
    case json::value_t::null: return "null";
    case json::value_t::object: return "an object";
    case json::value_t::array: return "an array";
    case json::value_t::boolean: return "boolean " + value.dump();
    case json::value_t::string: {
      // ASCII-escaped, so that shortening it cannot split a UTF-8 sequence.
      std::string text = value.dump(-1, ' ', true);
      if (text.size() > 40) text = text.substr(0, 36) + "...\"";
      return "string " + text;
    }
    default: return "number " + value.dump();
  }
}

// One JSON object of the config, with the prefix that names its fields in messages ("", "text_config.", ...).
struct Section {
  const json& object;
  std::string prefix;
  const std::string& source;

  [[noreturn]] void reject(std::string_view key, std::string_view expected, std::string_view got) const {
    fail(source + ": " + prefix + std::string(key) + ": " + std::string(expected) + ", got " + std::string(got));
  }

  // The field's value; nullptr when absent or null (Hugging Face writes null for "not set").
  const json* find_set(std::string_view key) const {
    const auto it = object.find(std::string(key));
    return it == object.end() || it->is_null() ? nullptr : &*it;
  }

  template <typename Int>
  Int to_integer(std::string_view key, const json& value) const {
    if (!value.is_number_integer()) reject(key, "expected an integer", describe(value));
    constexpr Int kMin = std::numeric_limits<Int>::min();
    constexpr Int kMax = std::numeric_limits<Int>::max();
    // The parser stores non-negative integers as unsigned, negative ones as signed.
    const bool fits = value.is_number_unsigned() ? value.get<uint64_t>() <= static_cast<uint64_t>(kMax)
                                                 : value.get<int64_t>() >= kMin;
    if (!fits)
      reject(key, "expected an integer from " + std::to_string(kMin) + " to " + std::to_string(kMax), describe(value));
    return static_cast<Int>(value.get<int64_t>());
  }

  int required_int(std::string_view key) const {
    const json* value = find_set(key);
    if (!value) reject(key, "expected an integer", object.contains(std::string(key)) ? "null" : "no such field");
    return to_integer<int>(key, *value);
  }

  template <typename Int>
  Int optional_int(std::string_view key, Int fallback) const {
    const json* value = find_set(key);
    return value ? to_integer<Int>(key, *value) : fallback;
  }

  double optional_number(std::string_view key, double fallback) const {
    const json* value = find_set(key);
    if (!value) return fallback;
    if (!value->is_number()) reject(key, "expected a number", describe(*value));
    return value->get<double>();
  }

  bool optional_bool(std::string_view key, bool fallback) const {
    const json* value = find_set(key);
    if (!value) return fallback;
    if (!value->is_boolean()) reject(key, "expected true or false", describe(*value));
    return value->get<bool>();
  }

  std::optional<Section> subsection(std::string_view key) const {
    const json* value = find_set(key);
    if (!value) return std::nullopt;
    if (!value->is_object()) reject(key, "expected an object", describe(*value));
    return Section{*value, prefix + std::string(key) + ".", source};
  }
};

std::string read_model_type(const Section& config) {
  const std::string expected = "expected one of " + join(kModelTypes);
  const json* value = config.find_set("model_type");
  if (!value) config.reject("model_type", expected, "no such field");
  if (value->is_string() && std::ranges::find(kModelTypes, value->get<std::string>()) != std::end(kModelTypes))
    return value->get<std::string>();
  config.reject("model_type", expected, describe(*value));
}

// Layers that run MLA: those `layer_types` does not mark linear attention, else those linear_attn_config's
// kda_layers leaves, else all.
int read_attention_layers(const Section& config, int num_layers) {
  if (const json* types = config.find_set("layer_types")) {
    if (!types->is_array()) config.reject("layer_types", "expected an array of layer type names", describe(*types));
    if (std::cmp_not_equal(types->size(), num_layers))
      config.reject("layer_types",
                    "expected one entry per layer (num_hidden_layers " + std::to_string(num_layers) + ")",
                    "an array of " + std::to_string(types->size()));
    int attention = 0;
    for (const json& type : *types) {
      if (!type.is_string()) config.reject("layer_types", "expected layer type names (strings)", describe(type));
      attention += type.get<std::string>() != kLinearAttentionLayer;
    }
    if (attention == 0 && num_layers > 0)
      config.reject("layer_types", "expected at least one MLA layer", "only \"linear_attention\" layers");
    return attention;
  }
  if (const std::optional<Section> linear = config.subsection("linear_attn_config")) {
    const json* kda = linear->find_set("kda_layers");
    if (kda && !kda->is_array()) linear->reject("kda_layers", "expected an array of layer numbers", describe(*kda));
    if (kda && std::cmp_greater(kda->size(), num_layers))
      linear->reject("kda_layers", "expected at most num_hidden_layers (" + std::to_string(num_layers) + ") entries",
                     "an array of " + std::to_string(kda->size()));
    if (kda && std::cmp_equal(kda->size(), num_layers) && num_layers > 0)
      linear->reject("kda_layers", "expected at least one MLA layer", "every layer listed");
    if (kda) return num_layers - static_cast<int>(kda->size());
  }
  return num_layers;
}

// DeepSeek-V4's head: head_dim wide (nope + rope) for q and the one KV head, no latent (kv_lora_rank 0), the value the
// whole head. Older checkpoints give qk_rope_head_dim; transformers derives it from partial_rotary_factor (64 / 512).
void read_shared_kv_head(const Section& config, AttentionSpec& spec) {
  const int head_dim = config.required_int("head_dim");
  if (head_dim < 2 || head_dim > kMaxSpecHeadDim)
    config.reject("head_dim", "expected an integer from 2 to " + std::to_string(kMaxSpecHeadDim),
                  describe(head_dim));
  const double partial = config.optional_number("partial_rotary_factor", 64.0 / 512.0);
  if (!(partial > 0 && partial < 1))
    config.reject("partial_rotary_factor", "expected a number between 0 and 1", describe(partial));
  const int rope = config.optional_int("qk_rope_head_dim", static_cast<int>(head_dim * partial));
  if (rope <= 0 || rope >= head_dim)
    config.reject("qk_rope_head_dim", "expected a positive integer below head_dim (" + std::to_string(head_dim) + ")",
                  describe(rope));
  if (const int kv_heads = config.optional_int("num_key_value_heads", 1); kv_heads != 1)
    config.reject("num_key_value_heads", "expected 1 (one shared KV head)", describe(kv_heads));
  spec.kv_lora_rank = 0;
  spec.qk_nope_head_dim = head_dim - rope;
  spec.qk_rope_head_dim = rope;
  spec.v_head_dim = head_dim;
}

// DeepSeek-V4's per-layer compress ratios: the checkpoint's compress_ratios (which may go on for the MTP layers: the
// first num_hidden_layers are the model's), else layer_types mapped through compress_rates.
std::vector<int> read_compress_ratios(const Section& config, int num_layers) {
  if (const json* ratios = config.find_set("compress_ratios")) {
    if (!ratios->is_array()) config.reject("compress_ratios", "expected an array of integers", describe(*ratios));
    if (std::cmp_less(ratios->size(), num_layers))
      config.reject("compress_ratios",
                    "expected at least one entry per layer (num_hidden_layers " + std::to_string(num_layers) + ")",
                    "an array of " + std::to_string(ratios->size()));
    std::vector<int> out;
    for (int i = 0; i < num_layers; ++i) {
      const int ratio = config.to_integer<int>("compress_ratios", (*ratios)[i]);
      if (ratio < 0) config.reject("compress_ratios", "expected ratios >= 0 (0: the window only)", describe(ratio));
      out.push_back(ratio);
    }
    return out;
  }
  const json* types = config.find_set("layer_types");
  if (!types)
    config.reject("compress_ratios", "expected an array of per-layer ratios (or layer_types)", "no such field");
  const std::optional<Section> rates = config.subsection("compress_rates");
  std::vector<int> out;
  for (const json& type : *types) {  // read_attention_layers has checked: strings, one per layer
    const auto known = std::ranges::find(kV4LayerTypes, type.get<std::string>(), &std::pair<std::string_view, int>::first);
    if (known == std::end(kV4LayerTypes))
      config.reject("layer_types",
                    "expected sliding_attention, compressed_sparse_attention or heavily_compressed_attention",
                    describe(type));
    const int ratio =
        rates && known->second > 0 ? rates->optional_int(known->first, known->second) : known->second;
    if (ratio < 1 && known->second > 0)
      rates->reject(known->first, "expected a positive compress ratio", describe(ratio));
    out.push_back(ratio);
  }
  return out;
}

// "rope_type" (newer transformers) or "type" (older); absent means plain RoPE.
bool is_yarn(const Section& scaling) {
  for (const char* key : {"rope_type", "type"}) {
    const json* value = scaling.find_set(key);
    if (!value) continue;
    // Anything else (linear, dynamic, ...) would change the positions in a way RopeSpec cannot express.
    if (*value == "yarn") return true;
    if (*value == "default") return false;
    scaling.reject(key, R"(expected "yarn" or "default")", describe(*value));
  }
  return false;
}

RopeSpec read_rope(const Section& config) {
  RopeSpec rope;
  // Newer transformers keep rope_theta and the scaling in rope_parameters; older configs have rope_theta and
  // rope_scaling at the top level.
  const std::optional<Section> parameters = config.subsection("rope_parameters");
  const std::optional<Section> scaling = config.subsection("rope_scaling");
  if (parameters) rope.theta = parameters->optional_number("rope_theta", rope.theta);
  rope.theta = config.optional_number("rope_theta", rope.theta);

  const std::optional<Section>& extension = scaling ? scaling : parameters;
  if (!extension || !is_yarn(*extension)) return rope;
  rope.yarn = true;
  rope.factor = extension->optional_number("factor", rope.factor);
  rope.original_max_position_embeddings =
      extension->optional_int("original_max_position_embeddings", rope.original_max_position_embeddings);
  rope.beta_fast = extension->optional_number("beta_fast", rope.beta_fast);
  rope.beta_slow = extension->optional_number("beta_slow", rope.beta_slow);
  rope.mscale = extension->optional_number("mscale", rope.mscale);
  rope.mscale_all_dim = extension->optional_number("mscale_all_dim", rope.mscale_all_dim);
  return rope;
}

AttentionSpec spec_from_json(const json& root, const std::string& source) {
  if (!root.is_object()) fail(source + ": top level: expected a JSON object, got " + describe(root));
  const Section top{root, "", source};
  // Multimodal configs (Kimi-K2.5's "kimi_k25") nest the text model, model_type included, under text_config.
  const Section config = top.subsection("text_config").value_or(top);

  AttentionSpec spec;
  spec.name = source;
  spec.model_type = read_model_type(config);
  spec.hidden_size = config.required_int("hidden_size");
  spec.num_heads = config.required_int("num_attention_heads");
  spec.q_lora_rank = config.optional_int("q_lora_rank", 0);  // absent or null: no query compression
  const bool v4 = spec.model_type == kDeepseekV4;
  if (v4) {
    read_shared_kv_head(config, spec);
  } else {
    spec.kv_lora_rank = config.required_int("kv_lora_rank");
    spec.qk_nope_head_dim = config.required_int("qk_nope_head_dim");
    spec.qk_rope_head_dim = config.required_int("qk_rope_head_dim");
    spec.v_head_dim = config.required_int("v_head_dim");
  }
  spec.num_layers = config.optional_int("num_hidden_layers", spec.num_layers);
  if (spec.num_layers < 0)
    config.reject("num_hidden_layers", "expected a non-negative integer", describe(spec.num_layers));
  spec.num_attention_layers = read_attention_layers(config, spec.num_layers);
  spec.rms_norm_eps = config.optional_number("rms_norm_eps", spec.rms_norm_eps);
  if (!(spec.rms_norm_eps > 0))
    config.reject("rms_norm_eps", "expected a positive number", describe(spec.rms_norm_eps));
  spec.rope = read_rope(config);
  if (v4) {
    // The window layers' RoPE is plain rope_theta; V4's YaRN (rope_scaling, with compress_rope_theta) belongs to the
    // compressed caches' keys, which reach the attention ops already rotated, and it leaves the scale head_dim^-0.5.
    spec.rope = RopeSpec{.theta = spec.rope.theta};
    spec.sliding_window = config.optional_int("sliding_window", 128);  // transformers' default
    if (spec.sliding_window < 1)
      config.reject("sliding_window", "expected a positive integer", describe(spec.sliding_window));
    spec.compress_ratios = read_compress_ratios(config, spec.num_layers);
  }
  spec.rope_style = config.optional_bool("rope_interleave", true) ? RopeStyle::interleaved : RopeStyle::half_split;
  if (std::ranges::find(kSparseModelTypes, spec.model_type) != std::end(kSparseModelTypes)) {
    // DeepSeek-V3.2's indexer rotates half-split; GLM's interleaved (transformers'
    // glm_moe_dsa always does; GLM-5's config also says so explicitly); DeepSeek-V4's shares the
    // attention's interleaved rotary.
    const bool interleaved = spec.model_type.starts_with("glm") || v4;
    spec.indexer = IndexerSpec{
        .heads = config.required_int("index_n_heads"),
        .head_dim = config.required_int("index_head_dim"),
        .topk = config.required_int("index_topk"),
        .rope_style = config.optional_bool("indexer_rope_interleave", interleaved) ? RopeStyle::interleaved
                                                                             : RopeStyle::half_split,
    };
    if (std::ranges::find(kPooledIndexerModelTypes, spec.model_type) != std::end(kPooledIndexerModelTypes)) {
      // Required: vLLM's config class would default a missing one to 16, not to the checkpoint's value.
      spec.indexer->kpool = config.required_int("index_kpool");
      if (spec.indexer->kpool < 1)
        config.reject("index_kpool", "expected a positive integer", describe(spec.indexer->kpool));
      spec.indexer->always_select_tail = config.optional_bool("index_kpool_always_select_tail", true);
    }
  }
  spec.softmax_scale = reference_softmax_scale(spec.qk_head_dim(), spec.rope);
  validate(spec, source);
  return spec;
}

// nlohmann's what() without its "[json.exception.parse_error.101] " tag, kept short.
std::string parser_message(const json::exception& error) {
  std::string text = error.what();
  if (const size_t tag_end = text.find("] "); text.starts_with("[json.exception.") && tag_end != std::string::npos)
    text.erase(0, tag_end + 2);
  if (text.size() > 160) text = text.substr(0, 157) + "...";
  return text;
}

}  // namespace

AttentionSpec spec_from_config_json(std::string_view json_text, std::string_view source) {
  const std::string src(source);
  json root;
  try {
    root = json::parse(json_text.data(), json_text.data() + json_text.size());
  } catch (const json::parse_error& error) {
    fail(src + ": JSON text: expected valid JSON, got a syntax error at byte " + std::to_string(error.byte) + " (" +
         parser_message(error) + ")");
  } catch (const json::exception& error) {  // e.g. a number too large for a double
    fail(src + ": JSON text: expected valid JSON, got " + parser_message(error));
  }
  return spec_from_json(root, src);
}

AttentionSpec spec_from_config_file(const std::string& path) {
  std::error_code ignored;
  // An ifstream opens a directory without complaint and then reads nothing.
  if (std::filesystem::is_directory(path, ignored))
    throw Error(ErrorKind::io, path + ": cannot read the config: it is a directory, expected a config.json file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(ErrorKind::io, path + ": cannot open the config: " + std::generic_category().message(errno));
  const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  if (in.bad())
    throw Error(ErrorKind::io, path + ": cannot read the config: " + std::generic_category().message(errno));
  return spec_from_config_json(text, path);
}

AttentionSpec load_model_spec(std::string_view model) {
  if (std::optional<AttentionSpec> spec = preset(model)) return *spec;
  const std::string name(model);
  const std::string presets = "a preset (" + join(preset_names()) + ")";
  namespace fs = std::filesystem;
  const fs::path path(name);
  std::error_code ignored;
  if (lowercase(name).ends_with(".gguf")) {
    if (!fs::is_regular_file(path, ignored))
      fail("model: no GGUF file \"" + name + "\"; pass " + presets + ", a config.json or an existing .gguf file");
    return gguf::spec_from_gguf_file(name);  // the first part of a split model opens the others
  }
  if (path.extension() == ".json" && fs::is_regular_file(path, ignored)) return spec_from_config_file(name);
  if (fs::is_directory(path, ignored) && fs::is_regular_file(path / "config.json", ignored))
    return spec_from_config_file((path / "config.json").string());
  fail("model: expected " + presets + ", a config.json or a directory holding one, got \"" + name +
       "\", which is neither a preset nor a readable config.json");
}

}  // namespace smla
