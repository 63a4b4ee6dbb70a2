// What a run needs to know: the model's attention geometry (AttentionSpec)
// and the deployment choices (RunSpec).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "smla/types.h"

namespace smla {

// How rotary embeddings pair dimensions: interleaved pairs (2i, 2i+1), or the
// half-split ("neox") form that pairs i with i + d/2.
enum class RopeStyle : uint8_t { interleaved, half_split };
std::string_view rope_style_name(RopeStyle style);

struct RopeSpec {
  double theta = 10000.0;
  // YaRN context extension; factor == 1 (or yarn == false) means none.
  bool yarn = false;
  double factor = 1.0;
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 1.0;
  double mscale_all_dim = 0.0;
};

struct IndexerSpec {
  int heads = 0;      // index_n_heads
  int head_dim = 0;   // index_head_dim (128)
  int topk = 0;       // index_topk
  RopeStyle rope_style = RopeStyle::half_split;
  // GLM-5.3-Flash's pooled indexer: the keys of each pool of `kpool` consecutive tokens are compressed into one
  // cached key and top-k selects pools (index_kpool; 1: one key per token, DeepSeek-V3.2 and GLM-5). With
  // always_select_tail the incomplete last pool is always attended (index_kpool_always_select_tail).
  int kpool = 1;
  bool always_select_tail = false;
  friend bool operator==(const IndexerSpec&, const IndexerSpec&) = default;
};

// A model's attention geometry, as the checkpoint defines it (all heads, not per rank).
struct AttentionSpec {
  std::string name;        // preset name or config path, for display
  std::string model_type;  // Hugging Face model_type ("glm_moe_dsa", ...)
  int hidden_size = 0;
  int num_heads = 0;
  int q_lora_rank = 0;  // 0: no query compression (q projected from hidden directly)
  int kv_lora_rank = 0;
  int qk_nope_head_dim = 0;
  int qk_rope_head_dim = 0;
  int v_head_dim = 0;
  int num_layers = 0;
  // Layers that run this attention; hybrid models (GLM-5.3-Flash: `layer_types`) run linear attention in the rest.
  // 0: not given, every layer (the config reader and the presets always set it).
  int num_attention_layers = 0;
  double rms_norm_eps = 1e-6;
  RopeSpec rope;
  RopeStyle rope_style = RopeStyle::interleaved;  // MLA's RoPE
  std::optional<IndexerSpec> indexer;           // DSA models only
  double softmax_scale = 0.0;                   // includes the YaRN mscale^2
  // DeepSeek-V4's caches: every layer attends its last `sliding_window` tokens (the window cache) and, where its
  // compress ratio is above 0, one compressed entry per `ratio` older tokens (a second cache, under one softmax with
  // the first); ratio-4 layers pick their compressed entries with the indexer's top-k. 0 / empty for other models.
  int sliding_window = 0;
  std::vector<int> compress_ratios = {};  // one per layer (num_layers entries), 0: the window only

  bool is_sparse() const { return indexer.has_value(); }
  int qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  bool is_hybrid() const { return num_attention_layers > 0 && num_attention_layers < num_layers; }
  // kv_lora_rank 0: no latent to absorb into (DeepSeek-V4). Queries and the one shared KV head are qk_head_dim wide
  // (nope + rope) and the value is the whole cached vector, rope dims included (v_head_dim == qk_head_dim).
  bool is_shared_kv() const { return kv_lora_rank == 0; }
  bool has_compressed_cache() const { return !compress_ratios.empty(); }
  // The kernels see one KV head: [c | k_pe] (576, or 512 with no rope part) with value c (512); for a shared-KV
  // model the head itself (512 = 448 + rope 64) with value the same 512.
  int absorbed_qk_dim() const { return is_shared_kv() ? qk_head_dim() : kv_lora_rank + qk_rope_head_dim; }
  int absorbed_v_dim() const { return is_shared_kv() ? v_head_dim : kv_lora_rank; }
};

// The softmax scale the reference math gives: (nope + rope)^-0.5, times
// mscale^2 with YaRN, mscale = 0.1 * mscale_all_dim * ln(factor) + 1.
double reference_softmax_scale(int qk_head_dim, const RopeSpec& rope);

// The largest sizes validate() accepts, far above any real model: a width (hidden_size, the LoRA ranks), heads
// (attention or indexer), a head dimension, layers and the indexer's top-k (and pool size).
inline constexpr int kMaxSpecWidth = 1 << 17;
inline constexpr int kMaxSpecHeads = 1024;
inline constexpr int kMaxSpecHeadDim = 4096;
inline constexpr int kMaxSpecLayers = 10000;
inline constexpr int kMaxSpecTopk = 1 << 20;

// Checks the geometry (positive sizes within the bounds above, even RoPE dims, finite scales, ...). Throws smla::Error
// naming the field; `source` prefixes the message (e.g. the config path).
void validate(const AttentionSpec& spec, std::string_view source);

// Built-in presets: "glm-5", "deepseek-v3.2", "deepseek-v3", "kimi-k2", "glm-4.7-flash", "glm-5.3-flash",
// "deepseek-v4-flash".
std::vector<std::string> preset_names();
std::optional<AttentionSpec> preset(std::string_view name);

// Parses a Hugging Face config.json (text or file). Throws smla::Error naming
// the field at fault.
AttentionSpec spec_from_config_json(std::string_view json_text, std::string_view source = "config.json");
AttentionSpec spec_from_config_file(const std::string& path);

// A preset name, a config.json path (or a folder holding one), or a GGUF file
// (the first part of a split model opens all parts).
AttentionSpec load_model_spec(std::string_view model);

enum class Op : uint32_t {
  sparse_mla = 1u << 0,        // sparse attention over selected slots
  paged_mla_decode = 1u << 1,  // dense paged decode
  indexer = 1u << 2,           // lightning indexer + top-k
};
std::string_view op_name(Op op);
inline constexpr Op kAllOps[] = {Op::sparse_mla, Op::paged_mla_decode, Op::indexer};

class OpSet {
 public:
  constexpr OpSet() = default;
  constexpr OpSet(std::initializer_list<Op> ops) {
    for (Op op : ops) bits_ |= static_cast<uint32_t>(op);
  }
  constexpr OpSet& add(Op op) {
    bits_ |= static_cast<uint32_t>(op);
    return *this;
  }
  constexpr bool contains(Op op) const { return bits_ & static_cast<uint32_t>(op); }
  constexpr bool empty() const { return bits_ == 0; }
  std::vector<Op> list() const;
  friend constexpr bool operator==(OpSet, OpSet) = default;

 private:
  uint32_t bits_ = 0;
};

// How the model is run: dtypes, cache layout, device, sharding, needed ops.
struct RunSpec {
  DType q_dtype = DType::bf16;
  std::optional<DType> kv_cache_dtype;  // nullopt: "auto", the query dtype
  int block_size = 64;
  Device device = Device::cpu();
  int tp = 1;                   // tensor-parallel size; heads are split across ranks
  OpSet ops;                    // empty: derived from the model (see needed_ops)
  bool attn_sink = false;       // attention sinks needed
  std::string backend;          // force a backend by name (empty: choose)
  // Query rows per call that explain shows the CUDA attention kernel for (its choice follows them: a decode batch's
  // tokens, a prefill's length); empty: 1 (decode) and 4096 (prefill).
  std::vector<int64_t> query_tokens;

  DType resolved_kv_cache_dtype() const { return kv_cache_dtype.value_or(q_dtype); }
};

// Ops the run needs: RunSpec::ops if set, else sparse attention + indexer for
// DSA models and dense paged decode for dense ones.
OpSet needed_ops(const AttentionSpec& spec, const RunSpec& run);
// Heads each rank runs. Throws smla::Error if tp does not divide the heads.
int heads_per_rank(const AttentionSpec& spec, const RunSpec& run);
// Checks the run options against the model (tp divides heads, block size > 0, ...).
void validate(const AttentionSpec& spec, const RunSpec& run);

}  // namespace smla
