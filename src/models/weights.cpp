// One attention layer's weights from GGUF or safetensors into AttentionWeights, and kv_b between its single and
// split (k_b, v_b) forms. docs/models.md lists the tensor names of both formats.
#include "smla/weights.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <optional>
#include <string>

#include "core/random.h"
#include "models/gguf.h"
#include "models/safetensors.h"
#include "models/weight_slots.h"
#include "smla/error.h"

namespace smla {
namespace {

using models::Needed;
using models::shape_text;
using models::WeightSlot;

void require_consistent(const WeightTensor& tensor, std::string_view what) {
  require(tensor.numel() >= 0 && static_cast<uint64_t>(tensor.numel()) == tensor.data.size(),
          std::string(what) + ": shape " + shape_text(tensor.shape) + " does not match its " +
              std::to_string(tensor.data.size()) + " values");
}

int64_t heads(const AttentionSpec& s) { return s.num_heads; }
int64_t index_dim(const AttentionSpec& s) { return s.indexer ? s.indexer->head_dim : 0; }

const WeightSlot kSlots[] = {
    {"q", "attn_q.weight", "q_proj.weight", Needed::without_q_lora,
     [](AttentionWeights& w) -> WeightTensor& { return w.q; },
     [](const AttentionSpec& s) -> std::vector<int64_t> { return {heads(s) * s.qk_head_dim(), s.hidden_size}; }},
    {"q_a", "attn_q_a.weight", "q_a_proj.weight", Needed::with_q_lora,
     [](AttentionWeights& w) -> WeightTensor& { return w.q_a; },
     [](const AttentionSpec& s) -> std::vector<int64_t> { return {s.q_lora_rank, s.hidden_size}; }},
    {"q_a_norm", "attn_q_a_norm.weight", "q_a_layernorm.weight", Needed::with_q_lora,
     [](AttentionWeights& w) -> WeightTensor& { return w.q_a_norm; },
     [](const AttentionSpec& s) -> std::vector<int64_t> { return {s.q_lora_rank}; }},
    {"q_b", "attn_q_b.weight", "q_b_proj.weight", Needed::with_q_lora,
     [](AttentionWeights& w) -> WeightTensor& { return w.q_b; },
     [](const AttentionSpec& s) -> std::vector<int64_t> { return {heads(s) * s.qk_head_dim(), s.q_lora_rank}; }},
    {"kv_a_mqa", "attn_kv_a_mqa.weight", "kv_a_proj_with_mqa.weight", Needed::always,
     [](AttentionWeights& w) -> WeightTensor& { return w.kv_a_mqa; },
     [](const AttentionSpec& s) -> std::vector<int64_t> { return {s.absorbed_qk_dim(), s.hidden_size}; }},
    {"kv_a_norm", "attn_kv_a_norm.weight", "kv_a_layernorm.weight", Needed::always,
     [](AttentionWeights& w) -> WeightTensor& { return w.kv_a_norm; },
     [](const AttentionSpec& s) -> std::vector<int64_t> { return {s.kv_lora_rank}; }},
    {"kv_b", "attn_kv_b.weight", "kv_b_proj.weight", Needed::always,
     [](AttentionWeights& w) -> WeightTensor& { return w.kv_b; },
     [](const AttentionSpec& s) -> std::vector<int64_t> {
       return {heads(s) * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank};
     }},
    {"o", "attn_output.weight", "o_proj.weight", Needed::always,
     [](AttentionWeights& w) -> WeightTensor& { return w.o; },
     [](const AttentionSpec& s) -> std::vector<int64_t> { return {s.hidden_size, heads(s) * s.v_head_dim}; }},
    {"indexer.wq_b", "indexer.attn_q_b.weight", "indexer.wq_b.weight", Needed::sparse,
     [](AttentionWeights& w) -> WeightTensor& { return w.indexer.wq_b; },
     [](const AttentionSpec& s) -> std::vector<int64_t> { return {s.indexer->heads * index_dim(s), s.q_lora_rank}; }},
    {"indexer.wk", "indexer.attn_k.weight", "indexer.wk.weight", Needed::sparse,
     [](AttentionWeights& w) -> WeightTensor& { return w.indexer.wk; },
     [](const AttentionSpec& s) -> std::vector<int64_t> { return {index_dim(s), s.hidden_size}; }},
    {"indexer.k_norm", "indexer.k_norm.weight", "indexer.k_norm.weight", Needed::sparse,
     [](AttentionWeights& w) -> WeightTensor& { return w.indexer.k_norm; },
     [](const AttentionSpec& s) -> std::vector<int64_t> { return {index_dim(s)}; }},
    {"indexer.k_norm_bias", "indexer.k_norm.bias", "indexer.k_norm.bias", Needed::sparse,
     [](AttentionWeights& w) -> WeightTensor& { return w.indexer.k_norm_bias; },
     [](const AttentionSpec& s) -> std::vector<int64_t> { return {index_dim(s)}; }},
    {"indexer.weights_proj", "indexer.proj.weight", "indexer.weights_proj.weight", Needed::sparse,
     [](AttentionWeights& w) -> WeightTensor& { return w.indexer.weights_proj; },
     [](const AttentionSpec& s) -> std::vector<int64_t> { return {s.indexer->heads, s.hidden_size}; }},
    // GLM-5.3-Flash's pooled indexer; no GGUF converter names these yet, the GGUF names are smla's.
    {"indexer.kpool_ape", "indexer.kpool_compress_ape", "indexer.index_kpool_compress_ape", Needed::pooled,
     [](AttentionWeights& w) -> WeightTensor& { return w.indexer.kpool_ape; },
     [](const AttentionSpec& s) -> std::vector<int64_t> { return {s.indexer->kpool, index_dim(s)}; }},
    {"indexer.kpool_gate", "indexer.kpool_compress_gate", "indexer.index_kpool_compress_gate", Needed::pooled,
     [](AttentionWeights& w) -> WeightTensor& { return w.indexer.kpool_gate; },
     [](const AttentionSpec& s) -> std::vector<int64_t> { return {index_dim(s), s.hidden_size}; }},
};

// Fills every tensor the geometry needs from `read` (name -> tensor, nullopt when absent), checking each shape.
template <typename Read>
AttentionWeights read_layer(const AttentionSpec& spec, int layer, const std::string& source, const std::string& prefix,
                            bool gguf_names, Read&& read) {
  AttentionWeights weights;
  weights.spec = spec;
  weights.layer = layer;
  for (const WeightSlot& slot : kSlots) {
    if (!slot.needed_by(spec)) continue;
    const std::string name = prefix + (gguf_names ? slot.gguf : slot.hf);
    std::optional<WeightTensor> tensor = read(name);
    if (!tensor)
      fail(source + ": no tensor " + name + " for layer " + std::to_string(layer) + " (the model has " +
           std::to_string(spec.num_layers) + " layers)");
    const std::vector<int64_t> expected = slot.shape(spec);
    if (tensor->shape != expected)
      fail(source + ": tensor " + name + " has shape " + shape_text(tensor->shape) +
           ", but the model's geometry gives " + shape_text(expected));
    slot.field(weights) = std::move(*tensor);
  }
  return weights;
}

WeightTensor from_gguf(const gguf::Model& model, const gguf::Tensor& tensor) {
  WeightTensor out;
  out.shape.assign(tensor.dims.rbegin(), tensor.dims.rend());  // ggml lists the fastest dimension first
  out.data = gguf::dequantize(tensor, model.parts()[tensor.part].path);
  return out;
}

AttentionWeights load_gguf(const std::string& path, int layer) {
  const gguf::Model model = gguf::Model::open(path);
  const AttentionSpec spec = gguf::spec_from_gguf(model.metadata());
  const std::string prefix = "blk." + std::to_string(layer) + ".";
  return read_layer(spec, layer, path, prefix, true, [&](const std::string& name) -> std::optional<WeightTensor> {
    if (const gguf::Tensor* tensor = model.find_tensor(name)) return from_gguf(model, *tensor);
    if (name != prefix + "attn_kv_b.weight") return std::nullopt;
    // Files converted since 2025 store kv_b split for the absorbed form.
    const gguf::Tensor* k_b = model.find_tensor(prefix + "attn_k_b.weight");
    const gguf::Tensor* v_b = model.find_tensor(prefix + "attn_v_b.weight");
    if (!k_b && !v_b) return std::nullopt;
    if (!k_b || !v_b)
      fail(path + ": layer " + std::to_string(layer) + " has " +
           (k_b ? "attn_k_b but no attn_v_b" : "attn_v_b but no attn_k_b"));
    const WeightTensor k = from_gguf(model, *k_b), v = from_gguf(model, *v_b);
    const std::vector<int64_t> k_shape = {spec.num_heads, spec.kv_lora_rank, spec.qk_nope_head_dim};
    const std::vector<int64_t> v_shape = {spec.num_heads, spec.v_head_dim, spec.kv_lora_rank};
    if (k.shape != k_shape || v.shape != v_shape)
      fail(path + ": " + prefix + "attn_k_b.weight and attn_v_b.weight have shapes " + shape_text(k.shape) + " and " +
           shape_text(v.shape) + ", but the model's geometry gives " + shape_text(k_shape) + " and " +
           shape_text(v_shape));
    return merge_kv_b(k, v);
  });
}

AttentionWeights load_safetensors(const std::string& dir, int layer) {
  const AttentionSpec spec = spec_from_config_file((std::filesystem::path(dir) / "config.json").string());
  safetensors::Checkpoint checkpoint = safetensors::Checkpoint::open(dir);
  // A multimodal checkpoint (GLM-5.3-Flash's Glm5NextForConditionalGeneration) holds its text model under
  // model.language_model.
  std::string prefix = "model.layers." + std::to_string(layer) + ".self_attn.";
  const std::string nested = "model.language_model.layers." + std::to_string(layer) + ".self_attn.";
  if (!checkpoint.contains(prefix + "kv_a_proj_with_mqa.weight") &&
      checkpoint.contains(nested + "kv_a_proj_with_mqa.weight"))
    prefix = nested;
  return read_layer(spec, layer, checkpoint.listing(), prefix, false,
                    [&](const std::string& name) { return checkpoint.read(name); });
}

}  // namespace

int64_t WeightTensor::numel() const {
  if (shape.empty()) return 0;
  int64_t n = 1;
  for (const int64_t d : shape) n *= d;
  return n;
}

KvBSplit split_kv_b(const WeightTensor& kv_b, int num_heads, int qk_nope_head_dim, int v_head_dim) {
  require(num_heads > 0 && qk_nope_head_dim > 0 && v_head_dim > 0,
          "split_kv_b: num_heads, qk_nope_head_dim and v_head_dim must be positive");
  const int64_t h_count = num_heads, nope = qk_nope_head_dim, v = v_head_dim, rows = nope + v;
  require(kv_b.shape.size() == 2 && kv_b.shape[0] == h_count * rows && kv_b.shape[1] > 0,
          "split_kv_b: kv_b: expected shape [" + std::to_string(h_count * rows) + ", kv_lora_rank], got " +
              shape_text(kv_b.shape));
  require_consistent(kv_b, "split_kv_b: kv_b");
  const int64_t lora = kv_b.shape[1];
  KvBSplit out{{{h_count, lora, nope}, std::vector<float>(h_count * lora * nope)},
               {{h_count, v, lora}, std::vector<float>(h_count * v * lora)}};
  for (int64_t h = 0; h < h_count; ++h) {
    const float* head = kv_b.data.data() + h * rows * lora;
    for (int64_t n = 0; n < nope; ++n)
      for (int64_t c = 0; c < lora; ++c) out.k_b.data[(h * lora + c) * nope + n] = head[n * lora + c];
    std::copy_n(head + nope * lora, v * lora, out.v_b.data.data() + h * v * lora);
  }
  return out;
}

WeightTensor merge_kv_b(const WeightTensor& k_b, const WeightTensor& v_b) {
  require(k_b.shape.size() == 3 && v_b.shape.size() == 3 && k_b.shape[0] == v_b.shape[0] &&
              k_b.shape[1] == v_b.shape[2] && k_b.numel() > 0 && v_b.numel() > 0,
          "merge_kv_b: expected k_b [H, kv_lora_rank, nope] and v_b [H, v, kv_lora_rank], got " +
              shape_text(k_b.shape) + " and " + shape_text(v_b.shape));
  require_consistent(k_b, "merge_kv_b: k_b");
  require_consistent(v_b, "merge_kv_b: v_b");
  const int64_t h_count = k_b.shape[0], lora = k_b.shape[1], nope = k_b.shape[2], v = v_b.shape[1], rows = nope + v;
  WeightTensor kv_b{{h_count * rows, lora}, std::vector<float>(h_count * rows * lora)};
  for (int64_t h = 0; h < h_count; ++h) {
    float* head = kv_b.data.data() + h * rows * lora;
    for (int64_t n = 0; n < nope; ++n)
      for (int64_t c = 0; c < lora; ++c) head[n * lora + c] = k_b.data[(h * lora + c) * nope + n];
    std::copy_n(v_b.data.data() + h * v * lora, v * lora, head + nope * lora);
  }
  return kv_b;
}

AttentionWeights load_attention_weights(const std::string& path, int layer) {
  require(layer >= 0, "layer: expected a non-negative layer index, got " + std::to_string(layer));
  std::error_code ignored;
  if (std::filesystem::is_directory(path, ignored)) return load_safetensors(path, layer);
  std::string extension = std::filesystem::path(path).extension().string();
  std::ranges::transform(extension, extension.begin(), [](unsigned char c) { return std::tolower(c); });
  if (extension == ".gguf") return load_gguf(path, layer);
  fail(path + ": expected a .gguf file or a folder holding config.json and safetensors shards");
}

namespace {

// Rows [first, first + count) of a row-major tensor whose rows are `shape[0]`.
WeightTensor rows_of(const WeightTensor& t, int64_t first, int64_t count) {
  const int64_t width = t.numel() / t.shape[0];
  WeightTensor out{t.shape, {}};
  out.shape[0] = count;
  out.data.assign(t.data.begin() + first * width, t.data.begin() + (first + count) * width);
  return out;
}

// Columns [first, first + count) of a 2-D tensor.
WeightTensor columns_of(const WeightTensor& t, int64_t first, int64_t count) {
  WeightTensor out{{t.shape[0], count}, std::vector<float>(t.shape[0] * count)};
  for (int64_t r = 0; r < t.shape[0]; ++r)
    std::copy_n(t.data.begin() + r * t.shape[1] + first, count, out.data.begin() + r * count);
  return out;
}

}  // namespace

AttentionWeights random_attention_weights(const AttentionSpec& spec, uint64_t seed) {
  validate(spec, "random_attention_weights: spec");
  Xorshift64 rng = Xorshift64::seeded(seed);
  AttentionWeights weights;
  weights.spec = spec;
  for (const WeightSlot& slot : kSlots) {
    if (!slot.needed_by(spec)) continue;
    const std::vector<int64_t> shape = slot.shape(spec);
    WeightTensor& t = slot.field(weights);
    t.shape = shape;
    t.data.resize(t.numel());
    if (shape.size() == 1) {  // norm weights 1, the LayerNorm bias 0
      std::ranges::fill(t.data, std::string_view(slot.hf).ends_with(".bias") ? 0.f : 1.f);
      continue;
    }
    const float bound = float(std::sqrt(3.0 / double(shape[1])));
    for (float& x : t.data) x = rng.symmetric() * bound;
  }
  return weights;
}

AttentionWeights shard_attention_heads(AttentionWeights weights, int tp, int rank) {
  const AttentionSpec& s = weights.spec;
  require(tp > 0 && s.num_heads % tp == 0,
          "shard_attention_heads: tp " + std::to_string(tp) + " does not divide the " + std::to_string(s.num_heads) +
              " heads");
  require(rank >= 0 && rank < tp, "shard_attention_heads: rank: expected 0 to " + std::to_string(tp - 1) +
                                      ", got " + std::to_string(rank));
  for (const WeightSlot& slot : kSlots) {
    if (!slot.needed_by(s)) continue;
    const WeightTensor& t = slot.field(weights);
    require(t.shape == slot.shape(s), std::string("shard_attention_heads: ") + slot.hf + ": expected shape " +
                                          shape_text(slot.shape(s)) + ", got " + shape_text(t.shape));
    require_consistent(t, std::string("shard_attention_heads: ") + slot.hf);
  }
  const int64_t heads = s.num_heads / tp, first = int64_t(rank) * heads;
  const int64_t qk = s.qk_head_dim(), kv_rows = s.qk_nope_head_dim + s.v_head_dim;
  WeightTensor& q = s.q_lora_rank > 0 ? weights.q_b : weights.q;
  q = rows_of(q, first * qk, heads * qk);
  weights.kv_b = rows_of(weights.kv_b, first * kv_rows, heads * kv_rows);
  weights.o = columns_of(weights.o, first * s.v_head_dim, heads * s.v_head_dim);
  weights.spec.num_heads = int(heads);  // last: `s` refers to it
  return weights;
}

}  // namespace smla

namespace smla::models {

bool WeightSlot::needed_by(const AttentionSpec& spec) const {
  switch (needed) {
    case Needed::always: return true;
    case Needed::without_q_lora: return spec.q_lora_rank == 0;
    case Needed::with_q_lora: return spec.q_lora_rank > 0;
    case Needed::sparse: return spec.is_sparse();
    case Needed::pooled: return spec.is_sparse() && spec.indexer->kpool > 1;
  }
  return false;
}

std::span<const WeightSlot> weight_slots() { return kSlots; }

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (const int64_t d : shape) text += (text.size() > 1 ? ", " : "") + std::to_string(d);
  return text + "]";
}

}  // namespace smla::models
