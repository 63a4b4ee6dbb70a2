// Model specs: the built-in presets, the config.json parser and load_model_spec.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "smla/error.h"
#include "support/test_util.h"
#include "smla/spec.h"

namespace smla {
namespace {

using nlohmann::json;

std::string fixture_path(const std::string& name) {
  return std::string(SMLA_TEST_DATA_DIR) + "/configs/" + name + ".json";
}

json fixture_json(const std::string& name) {
  std::ifstream in(fixture_path(name));
  return json::parse(in);
}

AttentionSpec parse(const json& config) { return spec_from_config_json(config.dump(), "test.json"); }

// Every field but the name, which says where a spec came from.
void expect_same_spec(const AttentionSpec& expected, const AttentionSpec& actual) {
  EXPECT_EQ(expected.model_type, actual.model_type);
  EXPECT_EQ(expected.hidden_size, actual.hidden_size);
  EXPECT_EQ(expected.num_heads, actual.num_heads);
  EXPECT_EQ(expected.q_lora_rank, actual.q_lora_rank);
  EXPECT_EQ(expected.kv_lora_rank, actual.kv_lora_rank);
  EXPECT_EQ(expected.qk_nope_head_dim, actual.qk_nope_head_dim);
  EXPECT_EQ(expected.qk_rope_head_dim, actual.qk_rope_head_dim);
  EXPECT_EQ(expected.v_head_dim, actual.v_head_dim);
  EXPECT_EQ(expected.num_layers, actual.num_layers);
  EXPECT_EQ(expected.num_attention_layers, actual.num_attention_layers);
  EXPECT_EQ(expected.rms_norm_eps, actual.rms_norm_eps);
  EXPECT_EQ(expected.rope.theta, actual.rope.theta);
  EXPECT_EQ(expected.rope.yarn, actual.rope.yarn);
  EXPECT_EQ(expected.rope.factor, actual.rope.factor);
  EXPECT_EQ(expected.rope.original_max_position_embeddings, actual.rope.original_max_position_embeddings);
  EXPECT_EQ(expected.rope.beta_fast, actual.rope.beta_fast);
  EXPECT_EQ(expected.rope.beta_slow, actual.rope.beta_slow);
  EXPECT_EQ(expected.rope.mscale, actual.rope.mscale);
  EXPECT_EQ(expected.rope.mscale_all_dim, actual.rope.mscale_all_dim);
  EXPECT_EQ(expected.rope_style, actual.rope_style);
  ASSERT_EQ(expected.indexer.has_value(), actual.indexer.has_value());
  if (expected.indexer) {
    EXPECT_EQ(expected.indexer->heads, actual.indexer->heads);
    EXPECT_EQ(expected.indexer->head_dim, actual.indexer->head_dim);
    EXPECT_EQ(expected.indexer->topk, actual.indexer->topk);
    EXPECT_EQ(expected.indexer->rope_style, actual.indexer->rope_style);
    EXPECT_EQ(expected.indexer->kpool, actual.indexer->kpool);
    EXPECT_EQ(expected.indexer->always_select_tail, actual.indexer->always_select_tail);
  }
  EXPECT_EQ(expected.softmax_scale, actual.softmax_scale);
  EXPECT_EQ(expected.sliding_window, actual.sliding_window);
  EXPECT_EQ(expected.compress_ratios, actual.compress_ratios);
}

// Runs `action`, expecting a one-line smla::Error of `kind` whose message contains `fragment`.
using test::expect_error;

void expect_config_error(const std::string& text, const std::string& fragment) {
  expect_error([&] { spec_from_config_json(text, "bad.json"); }, ErrorKind::invalid_argument, {fragment});
}

// The DeepSeek reference scale with YaRN: (nope + rope)^-0.5 * (0.1 * ln(factor) + 1)^2.
double yarn_scale(int qk_head_dim, double factor) {
  const double mscale = 0.1 * std::log(factor) + 1.0;
  return mscale * mscale / std::sqrt(qk_head_dim);
}

TEST(Presets, NamesAreTheSevenSupportedModels) {
  EXPECT_EQ(preset_names(), (std::vector<std::string>{"glm-5", "deepseek-v3.2", "deepseek-v3", "kimi-k2",
                                                      "glm-4.7-flash", "glm-5.3-flash", "deepseek-v4-flash"}));
}

TEST(Presets, EachEqualsItsFixtureConfig) {
  for (const std::string& name : preset_names()) {
    SCOPED_TRACE(name);
    const std::optional<AttentionSpec> built_in = preset(name);
    ASSERT_TRUE(built_in.has_value());
    EXPECT_EQ(built_in->name, name);
    const AttentionSpec parsed = spec_from_config_file(fixture_path(name));
    EXPECT_EQ(parsed.name, fixture_path(name));
    expect_same_spec(*built_in, parsed);
  }
}

TEST(Presets, LookupIsCaseInsensitive) {
  const std::optional<AttentionSpec> glm5 = preset("GLM-5");
  ASSERT_TRUE(glm5.has_value());
  EXPECT_EQ(glm5->name, "glm-5");
  ASSERT_TRUE(preset("DeepSeek-V3.2").has_value());
  EXPECT_FALSE(preset("llama-3").has_value());
}

TEST(SoftmaxScale, MatchesTheReferenceForEachModel) {
  const AttentionSpec deepseek_v3 = spec_from_config_file(fixture_path("deepseek-v3"));
  EXPECT_NEAR(deepseek_v3.softmax_scale, 0.1352, 5e-5);
  EXPECT_NEAR(deepseek_v3.softmax_scale, yarn_scale(192, 40), 1e-15);
  EXPECT_EQ(spec_from_config_file(fixture_path("deepseek-v3.2")).softmax_scale, deepseek_v3.softmax_scale);
  EXPECT_EQ(spec_from_config_file(fixture_path("glm-5")).softmax_scale, 0.0625);
  EXPECT_EQ(spec_from_config_file(fixture_path("glm-4.7-flash")).softmax_scale, 0.0625);
  const AttentionSpec kimi = spec_from_config_file(fixture_path("kimi-k2"));
  EXPECT_NEAR(kimi.softmax_scale, yarn_scale(192, 64), 1e-15);
  EXPECT_NEAR(kimi.softmax_scale, 0.14468, 5e-6);
}

TEST(ConfigJson, DeepseekV4SharedKvHead) {
  const AttentionSpec v4 = spec_from_config_file(fixture_path("deepseek-v4-flash"));
  EXPECT_TRUE(v4.is_shared_kv());
  EXPECT_EQ(v4.kv_lora_rank, 0);
  EXPECT_EQ(v4.qk_nope_head_dim, 448);
  EXPECT_EQ(v4.qk_rope_head_dim, 64);
  EXPECT_EQ(v4.v_head_dim, 512);  // the value is the whole cached head, rope dims included
  EXPECT_EQ(v4.absorbed_qk_dim(), 512);
  EXPECT_EQ(v4.absorbed_v_dim(), 512);
  EXPECT_EQ(v4.softmax_scale, 1.0 / std::sqrt(512.0));  // no YaRN mscale: V4's scale is head_dim^-0.5
  EXPECT_FALSE(v4.rope.yarn);
  EXPECT_EQ(v4.rope.theta, 1e4);
  EXPECT_EQ(v4.sliding_window, 128);
  // 43 layers (the fixture's 44th ratio is the MTP layer's): 2 window-only, then ratio 4 and 128 alternating.
  ASSERT_EQ(v4.compress_ratios.size(), 43u);
  EXPECT_EQ(std::ranges::count(v4.compress_ratios, 0), 2);
  EXPECT_EQ(std::ranges::count(v4.compress_ratios, 4), 21);
  EXPECT_EQ(std::ranges::count(v4.compress_ratios, 128), 20);
  EXPECT_EQ(v4.compress_ratios[2], 4);
  EXPECT_EQ(v4.compress_ratios[3], 128);
  ASSERT_TRUE(v4.indexer.has_value());
  EXPECT_EQ(v4.indexer->topk, 512);
  EXPECT_EQ(v4.indexer->rope_style, RopeStyle::interleaved);
}

TEST(ConfigJson, DeepseekV4LayerTypesAndDerivedRope) {
  // transformers' DeepseekV4Config: layer_types + compress_rates instead of compress_ratios, the rope width from
  // partial_rotary_factor (default 64 / 512).
  json config = fixture_json("deepseek-v4-flash");
  const std::vector<int> ratios = parse(config).compress_ratios;
  json types = json::array();
  for (int ratio : ratios)
    types.push_back(ratio == 0 ? "sliding_attention"
                               : ratio == 4 ? "compressed_sparse_attention" : "heavily_compressed_attention");
  config.erase("compress_ratios");
  config.erase("qk_rope_head_dim");
  config["layer_types"] = types;
  expect_same_spec(*preset("deepseek-v4-flash"), parse(config));

  config["compress_rates"] = {{"heavily_compressed_attention", 64}};
  std::vector<int> custom = ratios;
  std::ranges::replace(custom, 128, 64);
  EXPECT_EQ(parse(config).compress_ratios, custom);

  config["partial_rotary_factor"] = 0.1875;
  EXPECT_EQ(parse(config).qk_rope_head_dim, 96);
  EXPECT_EQ(parse(config).qk_nope_head_dim, 416);
}

TEST(ConfigJson, DeepseekV4BadInputNamesTheField) {
  const json good = fixture_json("deepseek-v4-flash");
  auto expect_bad = [&](const std::function<void(json&)>& edit, const std::string& fragment) {
    json config = good;
    edit(config);
    SCOPED_TRACE(fragment);
    expect_config_error(config.dump(), fragment);
  };
  expect_bad([](json& c) { c.erase("head_dim"); }, "head_dim: expected an integer, got no such field");
  expect_bad([](json& c) { c["head_dim"] = 1; }, "head_dim: expected an integer from 2 to 4096");
  expect_bad([](json& c) { c["qk_rope_head_dim"] = 512; }, "qk_rope_head_dim: expected a positive integer below head_dim");
  expect_bad([](json& c) { c["qk_rope_head_dim"] = 63; }, "qk_rope_head_dim must be even");
  expect_bad([](json& c) { c["num_key_value_heads"] = 8; }, "num_key_value_heads: expected 1");
  expect_bad([](json& c) { c["sliding_window"] = 0; }, "sliding_window: expected a positive integer");
  expect_bad([](json& c) { c.erase("compress_ratios"); }, "compress_ratios: expected an array of per-layer ratios");
  expect_bad([](json& c) { c["compress_ratios"] = {0, 4}; }, "compress_ratios: expected at least one entry per layer");
  expect_bad([](json& c) { c["compress_ratios"][5] = -4; }, "compress_ratios: expected ratios >= 0");
  expect_bad([](json& c) { c["compress_ratios"][5] = "4"; }, "compress_ratios: expected an integer");
  expect_bad([](json& c) { c["partial_rotary_factor"] = 1.5; c.erase("qk_rope_head_dim"); },
             "partial_rotary_factor: expected a number between 0 and 1");
  expect_bad(
      [](json& c) {
        c.erase("compress_ratios");
        c["layer_types"] = json::array();
        for (int i = 0; i < 43; ++i) c["layer_types"].push_back(i ? "compressed_sparse_attention" : "full_attention");
      },
      "layer_types: expected sliding_attention, compressed_sparse_attention or heavily_compressed_attention");
  expect_bad(
      [](json& c) {
        c.erase("compress_ratios");
        c["layer_types"] = json::array();
        for (int i = 0; i < 43; ++i) c["layer_types"].push_back("compressed_sparse_attention");
        c["compress_rates"] = {{"compressed_sparse_attention", 0}};
      },
      "compress_rates.compressed_sparse_attention: expected a positive compress ratio");

  // The spec's own checks: a head without a latent has its value the whole head.
  AttentionSpec narrow_value = *preset("deepseek-v4-flash");
  narrow_value.v_head_dim = 448;
  expect_error([&] { validate(narrow_value, "v4"); }, ErrorKind::invalid_argument,
               {"v4: a head with no latent (kv_lora_rank 0) has its value the whole cached head: v_head_dim must be 512"});
  AttentionSpec short_ratios = *preset("deepseek-v4-flash");
  short_ratios.compress_ratios.pop_back();
  expect_error([&] { validate(short_ratios, "v4"); }, ErrorKind::invalid_argument,
               {"compress_ratios: expected one per layer (num_hidden_layers 43), got 42"});
}

TEST(ConfigJson, KimiK25ReadsTheNestedTextConfig) {
  const AttentionSpec nested = spec_from_config_file(fixture_path("kimi-k2.5-nested"));
  EXPECT_EQ(nested.model_type, "kimi_k2");
  expect_same_spec(*preset("kimi-k2"), nested);
}

// GLM-5.3-Flash: the multimodal wrapper (text under text_config), the flat text config, and a flat config under
// the wrapper's type all read the same; 512-wide heads, a pooled indexer, 11 MLA layers among 45.
TEST(ConfigJson, Glm53FlashNestedAndFlat) {
  const AttentionSpec nested = spec_from_config_file(fixture_path("glm-5.3-flash"));
  const AttentionSpec flat = spec_from_config_file(fixture_path("glm-5.3-flash-text"));
  expect_same_spec(*preset("glm-5.3-flash"), nested);
  expect_same_spec(nested, flat);
  json flat_wrapper_type = fixture_json("glm-5.3-flash-text");
  flat_wrapper_type["model_type"] = "glm5_next";
  EXPECT_EQ(parse(flat_wrapper_type).model_type, "glm5_next");
  EXPECT_EQ(nested.model_type, "glm5_next_text");
  EXPECT_EQ(nested.qk_rope_head_dim, 0);
  EXPECT_EQ(nested.absorbed_qk_dim(), 512);
  EXPECT_EQ(nested.absorbed_v_dim(), 512);
  EXPECT_EQ(nested.softmax_scale, 0.0625);  // (256 + 0)^-0.5
  EXPECT_EQ(nested.num_layers, 45);
  EXPECT_EQ(nested.num_attention_layers, 11);
  EXPECT_TRUE(nested.is_hybrid());
  ASSERT_TRUE(nested.indexer.has_value());
  EXPECT_EQ(nested.indexer->heads, 32);
  EXPECT_EQ(nested.indexer->topk, 2048);
  EXPECT_EQ(nested.indexer->kpool, 4);
  EXPECT_TRUE(nested.indexer->always_select_tail);
  // The other models: one key per token, every layer an MLA layer.
  for (const char* name : {"glm-5", "deepseek-v3.2", "deepseek-v3"}) {
    const AttentionSpec other = spec_from_config_file(fixture_path(name));
    EXPECT_FALSE(other.is_hybrid()) << name;
    if (other.indexer) EXPECT_EQ(other.indexer->kpool, 1) << name;
  }
}

// Without layer_types the MLA layers are those linear_attn_config.kda_layers leaves.
TEST(ConfigJson, Glm53FlashLayerCountFromKdaLayers) {
  json config = fixture_json("glm-5.3-flash-text");
  config.erase("layer_types");
  EXPECT_EQ(parse(config).num_attention_layers, 11);
  config.erase("linear_attn_config");
  EXPECT_EQ(parse(config).num_attention_layers, 45);
}

TEST(ConfigJson, Glm53FlashBadInputNamesTheField) {
  const json text = fixture_json("glm-5.3-flash-text");
  auto with = [&](const char* field, const json& value) {
    json config = text;
    config[field] = value;
    return config.dump();
  };
  json without_kpool = text;
  without_kpool.erase("index_kpool");
  expect_config_error(without_kpool.dump(), "index_kpool: expected an integer, got no such field");
  expect_config_error(with("index_kpool", 0), "index_kpool: expected a positive integer");
  expect_config_error(with("index_kpool_always_select_tail", 1), "index_kpool_always_select_tail");
  expect_config_error(with("layer_types", json::array({"linear_attention"})), "layer_types: expected one entry per layer");
  expect_config_error(with("layer_types", "linear_attention"), "layer_types: expected an array");
  json numbers = json::array();
  for (int i = 0; i < 45; ++i) numbers.push_back(i);
  expect_config_error(with("layer_types", numbers), "layer_types: expected layer type names");
  expect_config_error(with("layer_types", json(std::vector<std::string>(45, "linear_attention"))),
                      "layer_types: expected at least one MLA layer");
  json all_kda = text;
  all_kda.erase("layer_types");
  all_kda["linear_attn_config"]["kda_layers"] = numbers;
  expect_config_error(all_kda.dump(), "linear_attn_config.kda_layers: expected at least one MLA layer");
  AttentionSpec more_mla_than_layers = *preset("glm-5.3-flash");
  more_mla_than_layers.num_attention_layers = 46;
  expect_error([&] { validate(more_mla_than_layers, "spec"); }, ErrorKind::invalid_argument,
               {"spec: the MLA layers (layer_types) must number 0 to num_hidden_layers (45), got 46"});
  expect_config_error(with("qk_rope_head_dim", -2), "qk_rope_head_dim must not be negative");
  json nested = fixture_json("glm-5.3-flash");
  nested["text_config"]["index_n_heads"] = "32";
  expect_config_error(nested.dump(), "text_config.index_n_heads");
}

TEST(ConfigJson, RopeParametersAndRopeScalingAgree) {
  // DeepSeek-V3 with its YaRN in newer transformers' rope_parameters form.
  json deepseek = fixture_json("deepseek-v3");
  json parameters = deepseek["rope_scaling"];
  parameters.erase("type");
  parameters["rope_type"] = "yarn";
  parameters["rope_theta"] = deepseek["rope_theta"];
  deepseek.erase("rope_scaling");
  deepseek.erase("rope_theta");
  deepseek["rope_parameters"] = parameters;
  expect_same_spec(*preset("deepseek-v3"), parse(deepseek));

  // GLM-5 with the older top-level rope_theta and a null rope_scaling.
  json glm = fixture_json("glm-5");
  glm["rope_theta"] = glm["rope_parameters"]["rope_theta"];
  glm["rope_scaling"] = nullptr;
  glm.erase("rope_parameters");
  expect_same_spec(*preset("glm-5"), parse(glm));
}

TEST(ConfigJson, RopeStyles) {
  const AttentionSpec glm5 = spec_from_config_file(fixture_path("glm-5"));
  const AttentionSpec deepseek_v32 = spec_from_config_file(fixture_path("deepseek-v3.2"));
  ASSERT_TRUE(glm5.indexer && deepseek_v32.indexer);
  EXPECT_EQ(glm5.indexer->rope_style, RopeStyle::interleaved);
  EXPECT_EQ(deepseek_v32.indexer->rope_style, RopeStyle::half_split);
  EXPECT_EQ(glm5.rope_style, RopeStyle::interleaved);
  EXPECT_EQ(deepseek_v32.rope_style, RopeStyle::interleaved);

  json not_interleaved = fixture_json("glm-5");
  not_interleaved["rope_interleave"] = false;
  EXPECT_EQ(parse(not_interleaved).rope_style, RopeStyle::half_split);

  // Without the key each family keeps its own indexer RoPE.
  json glm_default = fixture_json("glm-5");
  glm_default.erase("indexer_rope_interleave");
  EXPECT_EQ(parse(glm_default).indexer->rope_style, RopeStyle::interleaved);
  json glm_half = fixture_json("glm-5");
  glm_half["indexer_rope_interleave"] = false;
  EXPECT_EQ(parse(glm_half).indexer->rope_style, RopeStyle::half_split);
}

TEST(ConfigJson, DenseModelsHaveNoIndexer) {
  for (const char* name : {"deepseek-v3", "kimi-k2", "glm-4.7-flash"}) {
    SCOPED_TRACE(name);
    EXPECT_FALSE(spec_from_config_file(fixture_path(name)).is_sparse());
  }
  EXPECT_TRUE(spec_from_config_file(fixture_path("glm-5")).is_sparse());
}

TEST(ConfigJson, OptionalFieldsTakeTheirDefaults) {
  json config = fixture_json("deepseek-v3");
  config["q_lora_rank"] = nullptr;  // DeepSeek-V2-Lite writes null: no query compression
  config.erase("num_hidden_layers");
  config.erase("rms_norm_eps");
  const AttentionSpec spec = parse(config);
  EXPECT_EQ(spec.q_lora_rank, 0);
  EXPECT_EQ(spec.num_layers, 0);
  EXPECT_EQ(spec.rms_norm_eps, 1e-6);
  config.erase("q_lora_rank");
  EXPECT_EQ(parse(config).q_lora_rank, 0);
}

TEST(ConfigJson, BadInputNamesTheField) {
  const json glm5 = fixture_json("glm-5");
  auto with = [&](const char* field, const json& value) {
    json config = glm5;
    config[field] = value;
    return config.dump();
  };
  auto without = [&](const char* field) {
    json config = glm5;
    config.erase(field);
    return config.dump();
  };

  expect_config_error(R"({"model_type": "glm_moe_dsa", "hidden_size": })", "byte");
  expect_config_error("[1, 2]", "top level");
  expect_config_error(without("num_attention_heads"), "num_attention_heads");
  expect_config_error(with("num_attention_heads", "64"), "num_attention_heads: expected an integer, got string");
  expect_config_error(with("num_attention_heads", 64.5), "num_attention_heads: expected an integer");
  expect_config_error(with("num_attention_heads", 0), "num_attention_heads");
  expect_config_error(with("num_attention_heads", -8), "num_attention_heads");
  expect_config_error(with("num_attention_heads", 1ll << 40), "num_attention_heads");
  expect_config_error(with("qk_rope_head_dim", 63), "qk_rope_head_dim");
  expect_config_error(with("model_type", "llama"), "model_type");
  expect_config_error(with("model_type", "llama"), "llama");
  expect_config_error(without("model_type"), "model_type");
  expect_config_error(without("index_topk"), "index_topk");
  expect_config_error(with("indexer_rope_interleave", "yes"), "indexer_rope_interleave");
  expect_config_error(with("rope_parameters", {{"rope_type", "linear"}, {"factor", 4}}), "rope_parameters.rope_type");
  expect_config_error(with("rope_scaling", "yarn"), "rope_scaling: expected an object");

  json nested = fixture_json("kimi-k2.5-nested");
  nested["text_config"]["hidden_size"] = "7168";
  expect_config_error(nested.dump(), "text_config.hidden_size");
}

TEST(ConfigJson, MissingFileIsAnIoError) {
  const std::string path = fixture_path("no-such-model");
  expect_error([&] { spec_from_config_file(path); }, ErrorKind::io, {path});
}

TEST(LoadModelSpec, ByPresetName) {
  const AttentionSpec spec = load_model_spec("GLM-5");
  EXPECT_EQ(spec.name, "glm-5");
  expect_same_spec(*preset("glm-5"), spec);
}

TEST(LoadModelSpec, ByConfigPathOrDirectory) {
  const AttentionSpec by_path = load_model_spec(fixture_path("deepseek-v3.2"));
  EXPECT_EQ(by_path.name, fixture_path("deepseek-v3.2"));
  expect_same_spec(*preset("deepseek-v3.2"), by_path);

  const std::filesystem::path dir = std::filesystem::path(testing::TempDir()) / "smla-test-models-glm-5";
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(fixture_path("glm-5"), dir / "config.json",
                             std::filesystem::copy_options::overwrite_existing);
  expect_same_spec(*preset("glm-5"), load_model_spec(dir.string()));
  std::filesystem::remove_all(dir);
}

TEST(LoadModelSpec, MissingGgufNamesTheFile) {
  expect_error([] { load_model_spec("GLM-5-Q4_K_M.gguf"); }, ErrorKind::invalid_argument, {"GLM-5-Q4_K_M.gguf"});
}

TEST(LoadModelSpec, UnknownNameListsThePresets) {
  expect_error([] { load_model_spec("llama-3"); }, ErrorKind::invalid_argument, {"neither a preset"});
  expect_error([] { load_model_spec("llama-3"); }, ErrorKind::invalid_argument, {"glm-4.7-flash"});
}

}  // namespace
}  // namespace smla
