// Built-in presets: the attention geometry of the supported checkpoints, kept as C++ data so that naming a model
// needs no file at run time. Each preset equals what spec_from_config_json gives for the model's config.json
// (tests/data/configs), name aside; test_models checks this field by field.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "core/text.h"
#include "smla/spec.h"

namespace smla {
namespace {

// The YaRN extension DeepSeek-V3 and Kimi-K2 use: a 4K-trained context stretched `factor` times.
RopeSpec yarn_rope(double theta, double factor, double beta_fast) {
  return {.theta = theta,
          .yarn = true,
          .factor = factor,
          .original_max_position_embeddings = 4096,
          .beta_fast = beta_fast,
          .beta_slow = 1.0,
          .mscale = 1.0,
          .mscale_all_dim = 1.0};
}

// DeepSeek-V3's geometry, which V3.2 and Kimi-K2 share apart from the heads, the RoPE and the indexer.
AttentionSpec deepseek_v3_geometry(std::string name, std::string model_type, int num_heads, RopeSpec rope) {
  return {.name = std::move(name),
          .model_type = std::move(model_type),
          .hidden_size = 7168,
          .num_heads = num_heads,
          .q_lora_rank = 1536,
          .kv_lora_rank = 512,
          .qk_nope_head_dim = 128,
          .qk_rope_head_dim = 64,
          .v_head_dim = 128,
          .num_layers = 61,
          .rms_norm_eps = 1e-6,
          .rope = rope,
          .indexer = std::nullopt};
}

// The derived fields: the reference scale, and every layer an attention layer unless the preset says otherwise.
AttentionSpec completed(AttentionSpec spec) {
  spec.softmax_scale = reference_softmax_scale(spec.qk_head_dim(), spec.rope);
  if (spec.num_attention_layers == 0) spec.num_attention_layers = spec.num_layers;
  return spec;
}

std::vector<AttentionSpec> make_presets() {
  AttentionSpec glm5{.name = "glm-5",
                     .model_type = "glm_moe_dsa",
                     .hidden_size = 6144,
                     .num_heads = 64,
                     .q_lora_rank = 2048,
                     .kv_lora_rank = 512,
                     .qk_nope_head_dim = 192,
                     .qk_rope_head_dim = 64,
                     .v_head_dim = 256,
                     .num_layers = 78,
                     .rms_norm_eps = 1e-5,
                     .rope = {.theta = 1e6},
                     .indexer = IndexerSpec{.heads = 32, .head_dim = 128, .topk = 2048,
                                            .rope_style = RopeStyle::interleaved}};

  AttentionSpec deepseek_v32 = deepseek_v3_geometry("deepseek-v3.2", "deepseek_v32", 128, yarn_rope(1e4, 40, 32));
  // DeepSeek-V3.2's indexer rotates the half-split way, unlike its MLA.
  deepseek_v32.indexer = IndexerSpec{.heads = 64, .head_dim = 128, .topk = 2048, .rope_style = RopeStyle::half_split};

  // The fixture for GLM-4.7-Flash carries no num_hidden_layers or rms_norm_eps, so the preset keeps the defaults.
  AttentionSpec glm47_flash{.name = "glm-4.7-flash",
                            .model_type = "glm4_moe_lite",
                            .hidden_size = 2048,
                            .num_heads = 20,
                            .q_lora_rank = 768,
                            .kv_lora_rank = 512,
                            .qk_nope_head_dim = 192,
                            .qk_rope_head_dim = 64,
                            .v_head_dim = 256,
                            .rope = {.theta = 1e6},
                            .indexer = std::nullopt};

  // GLM-5.3-Flash: no rope part (absorbed head 512), a pooled indexer, 11 MLA layers among 45 (the rest Kimi
  // delta attention). Its config (tests/data/configs/glm-5.3-flash.json) sets no rope_theta: the default stays.
  AttentionSpec glm53_flash{.name = "glm-5.3-flash",
                            .model_type = "glm5_next_text",
                            .hidden_size = 4096,
                            .num_heads = 64,
                            .q_lora_rank = 1536,
                            .kv_lora_rank = 512,
                            .qk_nope_head_dim = 256,
                            .qk_rope_head_dim = 0,
                            .v_head_dim = 256,
                            .num_layers = 45,
                            .num_attention_layers = 11,
                            .rms_norm_eps = 1e-5,
                            .indexer = IndexerSpec{.heads = 32, .head_dim = 128, .topk = 2048,
                                                   .rope_style = RopeStyle::interleaved, .kpool = 4,
                                                   .always_select_tail = true}};

  // DeepSeek-V4-Flash: no latent; q and the one shared KV head are 512 wide (448 nope + 64 rope) and the value is the
  // whole cached head. Layers 0 and 1 attend a 128-token window only; then ratio-4 (indexer top-k 512) and
  // ratio-128 compressed caches alternate beside it.
  std::vector<int> v4_ratios = {0, 0};
  for (int layer = 2; layer < 43; ++layer) v4_ratios.push_back(layer % 2 == 0 ? 4 : 128);
  AttentionSpec deepseek_v4_flash{.name = "deepseek-v4-flash",
                                  .model_type = "deepseek_v4",
                                  .hidden_size = 4096,
                                  .num_heads = 64,
                                  .q_lora_rank = 1024,
                                  .kv_lora_rank = 0,
                                  .qk_nope_head_dim = 448,
                                  .qk_rope_head_dim = 64,
                                  .v_head_dim = 512,
                                  .num_layers = 43,
                                  .rms_norm_eps = 1e-6,
                                  .rope = {.theta = 1e4},
                                  .indexer = IndexerSpec{.heads = 64, .head_dim = 128, .topk = 512,
                                                         .rope_style = RopeStyle::interleaved},
                                  .sliding_window = 128,
                                  .compress_ratios = std::move(v4_ratios)};

  std::vector<AttentionSpec> presets = {
      glm5,
      deepseek_v32,
      deepseek_v3_geometry("deepseek-v3", "deepseek_v3", 128, yarn_rope(1e4, 40, 32)),
      deepseek_v3_geometry("kimi-k2", "kimi_k2", 64, yarn_rope(5e4, 64, 1)),
      glm47_flash,
      glm53_flash,
      deepseek_v4_flash,
  };
  std::ranges::transform(presets, presets.begin(), completed);
  return presets;
}

const std::vector<AttentionSpec>& all_presets() {
  static const std::vector<AttentionSpec> presets = make_presets();
  return presets;
}

}  // namespace

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const AttentionSpec& spec : all_presets()) names.push_back(spec.name);
  return names;
}

std::optional<AttentionSpec> preset(std::string_view name) {
  const std::string wanted = lowercase(name);
  for (const AttentionSpec& spec : all_presets())
    if (spec.name == wanted) return spec;
  return std::nullopt;
}

}  // namespace smla
