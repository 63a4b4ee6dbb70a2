// Models from GGUF and safetensors: the attention geometry from GGUF metadata, dequantisation against gguf-py, the
// weights of a layer from both formats, kv_b round trips, and one clear error for each kind of bad file. The files
// come from tests/models/make_fixtures.py (run by CTest first); tests/data/configs has the real configs.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "models/gguf.h"
#include "models/safetensors.h"
#include "smla/error.h"
#include "support/test_util.h"
#include "smla/spec.h"
#include "smla/weights.h"

namespace smla {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

const std::string kFixtures = SMLA_MODEL_FIXTURES;
const std::string kConfigs = std::string(SMLA_TEST_DATA_DIR) + "/configs";
const std::vector<std::string> kTinyModels = {"deepseek2", "deepseek2-legacy", "deepseek32", "glm-dsa"};

std::string fixture(const std::string& relative) { return kFixtures + "/" + relative; }

const json& manifest() {
  static const json root = [] {
    std::ifstream in(fixture("manifest.json"));
    return json::parse(in);
  }();
  return root;
}

std::vector<float> read_f32(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  std::vector<float> values(static_cast<size_t>(in.tellg()) / sizeof(float));
  in.seekg(0);
  in.read(reinterpret_cast<char*>(values.data()), static_cast<std::streamsize>(values.size() * sizeof(float)));
  return values;
}

// Bit for bit (NaN payloads and the sign of zero included), reporting the first difference.
void expect_same_bits(const std::vector<float>& expected, const std::vector<float>& actual, const std::string& what) {
  ASSERT_EQ(expected.size(), actual.size()) << what;
  for (size_t i = 0; i < expected.size(); ++i)
    if (std::bit_cast<uint32_t>(expected[i]) != std::bit_cast<uint32_t>(actual[i])) {
      ADD_FAILURE() << what << ": element " << i << " is " << actual[i] << ", expected " << expected[i];
      return;
    }
}

// Every field of a spec but its name, as text: a mismatch shows as a readable diff.
std::string fields(const AttentionSpec& s) {
  std::ostringstream out;
  out << std::setprecision(17) << s.model_type << " hidden " << s.hidden_size << " heads " << s.num_heads << " q_lora "
      << s.q_lora_rank << " kv_lora " << s.kv_lora_rank << " nope " << s.qk_nope_head_dim << " rope "
      << s.qk_rope_head_dim << " v " << s.v_head_dim << " layers " << s.num_layers << " mla_layers " << s.num_attention_layers << " eps " << s.rms_norm_eps
      << " theta " << s.rope.theta << " yarn " << s.rope.yarn << " factor " << s.rope.factor << " orig "
      << s.rope.original_max_position_embeddings << " beta " << s.rope.beta_fast << "/" << s.rope.beta_slow
      << " mscale " << s.rope.mscale << "/" << s.rope.mscale_all_dim << " style " << rope_style_name(s.rope_style)
      << " scale " << s.softmax_scale;
  if (s.indexer)
    out << " indexer " << s.indexer->heads << "x" << s.indexer->head_dim << " top " << s.indexer->topk << " "
        << rope_style_name(s.indexer->rope_style);
  return out.str();
}

using test::expect_error;

const WeightTensor& field(const AttentionWeights& w, const std::string& name) {
  static const std::map<std::string, std::function<const WeightTensor&(const AttentionWeights&)>> kFields = {
      {"q", [](const AttentionWeights& w) -> const WeightTensor& { return w.q; }},
      {"q_a", [](const AttentionWeights& w) -> const WeightTensor& { return w.q_a; }},
      {"q_a_norm", [](const AttentionWeights& w) -> const WeightTensor& { return w.q_a_norm; }},
      {"q_b", [](const AttentionWeights& w) -> const WeightTensor& { return w.q_b; }},
      {"kv_a_mqa", [](const AttentionWeights& w) -> const WeightTensor& { return w.kv_a_mqa; }},
      {"kv_a_norm", [](const AttentionWeights& w) -> const WeightTensor& { return w.kv_a_norm; }},
      {"kv_b", [](const AttentionWeights& w) -> const WeightTensor& { return w.kv_b; }},
      {"o", [](const AttentionWeights& w) -> const WeightTensor& { return w.o; }},
      {"indexer.wq_b", [](const AttentionWeights& w) -> const WeightTensor& { return w.indexer.wq_b; }},
      {"indexer.wk", [](const AttentionWeights& w) -> const WeightTensor& { return w.indexer.wk; }},
      {"indexer.k_norm", [](const AttentionWeights& w) -> const WeightTensor& { return w.indexer.k_norm; }},
      {"indexer.k_norm_bias", [](const AttentionWeights& w) -> const WeightTensor& { return w.indexer.k_norm_bias; }},
      {"indexer.weights_proj",
       [](const AttentionWeights& w) -> const WeightTensor& { return w.indexer.weights_proj; }},
  };
  return kFields.at(name)(w);
}

// Every tensor the script dumped for `format` ("gguf" or "hf") and `layer` equals what was loaded, shape and bits.
void expect_layer(const std::string& model, const std::string& format, const AttentionWeights& weights) {
  const std::string prefix = format + "." + std::to_string(weights.layer) + ".";
  int checked = 0;
  for (const auto& [name, shape] : manifest()[model]["expected"].items()) {
    if (!name.starts_with(prefix)) continue;
    const std::string what = model + " " + name;
    const WeightTensor& tensor = field(weights, name.substr(prefix.size()));
    EXPECT_EQ(tensor.shape, shape.get<std::vector<int64_t>>()) << what;
    expect_same_bits(read_f32(fixture("tiny/" + model + "/expected/" + name + ".f32")), tensor.data, what);
    ++checked;
  }
  EXPECT_GE(checked, 5) << model << " " << prefix;  // the legacy model's 5; 13 with the indexer
}

// --- The geometry ----------------------------------------------------------------------------------------------

TEST(GgufSpec, EqualsTheConfigJsonOfEachRealModel) {
  int compared = 0;
  for (const auto& entry : fs::directory_iterator(kConfigs)) {
    if (entry.path().extension() != ".json") continue;
    const std::string name = entry.path().stem().string();
    const AttentionSpec from_config = spec_from_config_file(entry.path().string());
    if (from_config.model_type.starts_with("glm5_next")) continue;  // GLM-5.3-Flash: no GGUF architecture for it
    if (from_config.model_type == "deepseek_v4") continue;           // smla reads no GGUF of DeepSeek-V4
    const AttentionSpec from_gguf = gguf::spec_from_gguf_file(fixture("specs/" + name + ".gguf"));
    EXPECT_EQ(fields(from_config), fields(from_gguf)) << name;
    ++compared;
  }
  EXPECT_EQ(compared, 6);
}

TEST(GgufSpec, Float32MetadataReadsBackAsTheConfigsDecimal) {
  // rms_norm_eps 1e-6 and 0.1 * mscale_all_dim are f32 in the file; the spec holds the decimals the config has.
  const AttentionSpec v3 = gguf::spec_from_gguf_file(fixture("specs/deepseek-v3.gguf"));
  EXPECT_EQ(v3.rms_norm_eps, 1e-6);
  EXPECT_EQ(v3.rope.mscale_all_dim, 1.0);
  EXPECT_EQ(v3.softmax_scale, preset("deepseek-v3")->softmax_scale);
  EXPECT_EQ(gguf::spec_from_gguf_file(fixture("specs/glm-5.gguf")).rms_norm_eps, 1e-5);
}

TEST(GgufSpec, Deepseek2IsToldApartByItsTokenizer) {
  EXPECT_EQ(gguf::spec_from_gguf_file(fixture("specs/deepseek-v3.gguf")).model_type, "deepseek_v3");
  EXPECT_EQ(gguf::spec_from_gguf_file(fixture("specs/kimi-k2.gguf")).model_type, "kimi_k2");
  EXPECT_EQ(gguf::spec_from_gguf_file(fixture("specs/glm-4.7-flash.gguf")).model_type, "glm4_moe_lite");
}

TEST(GgufSpec, TinyModelsSingleAndSplitEqualTheirConfigJson) {
  for (const std::string& model : kTinyModels) {
    const std::string config = fields(spec_from_config_file(fixture("tiny/" + model + "/hf/config.json")));
    EXPECT_EQ(config, fields(gguf::spec_from_gguf_file(fixture("tiny/" + model + "/model.gguf")))) << model;
    EXPECT_EQ(config, fields(gguf::spec_from_gguf_file(fixture(manifest()[model]["split"])))) << model;
  }
}

TEST(GgufSpec, LoadModelSpecOpensTheFirstPartOfASplitModel) {
  const std::string path = fixture(manifest()["glm-dsa"]["split"]);
  const AttentionSpec spec = load_model_spec(path);
  EXPECT_EQ(spec.name, path);
  EXPECT_EQ(spec.model_type, "glm_moe_dsa");
  ASSERT_TRUE(spec.is_sparse());
  EXPECT_EQ(spec.indexer->rope_style, RopeStyle::interleaved);
  EXPECT_EQ(spec.num_layers, 2);  // block_count 3 less the NextN layer
  expect_error([] { load_model_spec("no-such-model-00001-of-00002.gguf"); }, ErrorKind::invalid_argument,
               {"no GGUF file", "no-such-model-00001-of-00002.gguf"});
}

TEST(GgufModel, SplitPartsOpenAsOneModel) {
  const gguf::Model single = gguf::Model::open(fixture("tiny/glm-dsa/model.gguf"));
  const gguf::Model split = gguf::Model::open(fixture(manifest()["glm-dsa"]["split"]));
  ASSERT_EQ(split.parts().size(), 3u);
  size_t tensors = 0;
  for (const gguf::File& part : split.parts()) tensors += part.tensors.size();
  EXPECT_EQ(tensors, single.parts()[0].tensors.size());
  for (const gguf::Tensor& tensor : single.parts()[0].tensors) {
    const gguf::Tensor* other = split.find_tensor(tensor.name);
    ASSERT_NE(other, nullptr) << tensor.name;
    EXPECT_EQ(other->dims, tensor.dims);
    EXPECT_TRUE(std::ranges::equal(other->data, tensor.data)) << tensor.name;
  }
  EXPECT_GT(split.find_tensor("blk.2.attn_output.weight")->part, 0u);
}

// --- Dequantisation -----------------------------------------------------------------------------------------------

TEST(Dequantize, EachTypeMatchesGgufPyBitForBit) {
  const gguf::Model model = gguf::Model::open(fixture("quants.gguf"));
  int checked = 0;
  for (const auto& [name, shape] : manifest()["quants"].items()) {
    const gguf::Tensor* tensor = model.find_tensor(name);
    ASSERT_NE(tensor, nullptr) << name;
    expect_same_bits(read_f32(fixture("quants/" + name + ".f32")), gguf::dequantize(*tensor, "quants.gguf"), name);
    ++checked;
  }
  EXPECT_EQ(checked, 6);  // F32, F16, BF16, Q8_0, Q4_K, Q6_K
}

TEST(Dequantize, AnUnsupportedTypeIsNamed) {
  const gguf::Model model = gguf::Model::open(fixture("quants.gguf"));
  expect_error([&] { gguf::dequantize(*model.find_tensor("q4_0"), "quants.gguf"); }, ErrorKind::unsupported,
               {"quants.gguf", "\"q4_0\"", "Q4_0"});
}

// --- Weights ---------------------------------------------------------------------------------------------------

TEST(Weights, GgufLayersMatchGgufPy) {
  for (const std::string& model : kTinyModels)
    for (int layer = 0; layer < manifest()[model]["layers"].get<int>(); ++layer) {
      expect_layer(model, "gguf", load_attention_weights(fixture("tiny/" + model + "/model.gguf"), layer));
      expect_layer(model, "gguf", load_attention_weights(fixture(manifest()[model]["split"]), layer));
    }
}

TEST(Weights, SafetensorsLayersMatchTheStoredValues) {
  for (const std::string& model : kTinyModels)
    for (int layer = 0; layer < manifest()[model]["layers"].get<int>(); ++layer)
      expect_layer(model, "hf", load_attention_weights(fixture("tiny/" + model + "/hf"), layer));
}

TEST(Weights, DenseModelsHaveNoIndexerAndNoCompressionMeansQ) {
  const AttentionWeights legacy = load_attention_weights(fixture("tiny/deepseek2-legacy/model.gguf"), 1);
  EXPECT_TRUE(legacy.q_a.empty());
  EXPECT_EQ(legacy.q.shape, (std::vector<int64_t>{4 * 24, 256}));
  EXPECT_TRUE(legacy.indexer.wq_b.empty());
  const AttentionWeights sparse = load_attention_weights(fixture("tiny/deepseek32/model.gguf"), 0);
  EXPECT_TRUE(sparse.q.empty());
  EXPECT_EQ(sparse.indexer.weights_proj.shape, (std::vector<int64_t>{4, 256}));
}

TEST(Weights, ErrorsNameTheFileAndTheTensor) {
  const std::string glm = fixture("tiny/glm-dsa/model.gguf");
  expect_error([&] { load_attention_weights(glm, 7); }, ErrorKind::invalid_argument, {glm, "blk.7.attn_q_a.weight"});
  expect_error([&] { load_attention_weights(glm, -1); }, ErrorKind::invalid_argument, {"layer"});
  expect_error([&] { load_attention_weights(fixture("manifest.json"), 0); }, ErrorKind::invalid_argument,
               {"manifest.json", "expected a .gguf file or a folder"});
  expect_error([&] { load_attention_weights(fixture("tiny/glm-dsa/hf"), 5); }, ErrorKind::invalid_argument,
               {"model.safetensors.index.json", "model.layers.5.self_attn.q_a_proj.weight"});
  expect_error([&] { load_attention_weights(fixture("tiny/glm-dsa/expected"), 0); }, ErrorKind::io, {"config.json"});
  // A spec whose geometry the tensors do not fit: the deepseek32 weights read as GLM's shapes.
  const fs::path mixed = fs::path(testing::TempDir()) / "smla-mixed-checkpoint";
  fs::remove_all(mixed);
  fs::copy(fixture("tiny/deepseek32/hf"), mixed);
  fs::copy_file(fixture("tiny/glm-dsa/hf/config.json"), mixed / "config.json", fs::copy_options::overwrite_existing);
  expect_error([&] { load_attention_weights(mixed.string(), 0); }, ErrorKind::invalid_argument,
               {"q_b_proj.weight", "has shape [96, 64]", "geometry gives [128, 64]"});
  fs::remove_all(mixed);
}

// --- kv_b ------------------------------------------------------------------------------------------------------

WeightTensor random_tensor(std::vector<int64_t> shape, uint32_t seed) {
  WeightTensor tensor{std::move(shape), {}};
  tensor.data.resize(tensor.numel());
  uint32_t state = seed;
  for (float& value : tensor.data) {  // every bit pattern, NaN payloads and subnormals included
    state = state * 1664525u + 1013904223u;
    value = std::bit_cast<float>(state);
  }
  return tensor;
}

TEST(KvB, SplitAndMergeRoundTripBitForBit) {
  const int heads = 3, nope = 5, v = 7, lora = 4;
  const WeightTensor kv_b = random_tensor({heads * (nope + v), lora}, 1);
  const KvBSplit split = split_kv_b(kv_b, heads, nope, v);
  EXPECT_EQ(split.k_b.shape, (std::vector<int64_t>{heads, lora, nope}));
  EXPECT_EQ(split.v_b.shape, (std::vector<int64_t>{heads, v, lora}));
  // k_b[h][c][n] = kv_b[h (nope + v) + n][c]; v_b[h][j][c] = kv_b[h (nope + v) + nope + j][c].
  EXPECT_EQ(std::bit_cast<uint32_t>(split.k_b.data[(2 * lora + 3) * nope + 1]),
            std::bit_cast<uint32_t>(kv_b.data[(2 * (nope + v) + 1) * lora + 3]));
  EXPECT_EQ(std::bit_cast<uint32_t>(split.v_b.data[(1 * v + 6) * lora + 2]),
            std::bit_cast<uint32_t>(kv_b.data[(1 * (nope + v) + nope + 6) * lora + 2]));
  const WeightTensor merged = merge_kv_b(split.k_b, split.v_b);
  EXPECT_EQ(merged.shape, kv_b.shape);
  expect_same_bits(kv_b.data, merged.data, "merge(split(kv_b))");

  const WeightTensor k_b = random_tensor({heads, lora, nope}, 2), v_b = random_tensor({heads, v, lora}, 3);
  const KvBSplit again = split_kv_b(merge_kv_b(k_b, v_b), heads, nope, v);
  expect_same_bits(k_b.data, again.k_b.data, "split(merge(k_b, v_b)).k_b");
  expect_same_bits(v_b.data, again.v_b.data, "split(merge(k_b, v_b)).v_b");
}

TEST(KvB, SplittingALoadedLayerGivesBackTheFilesTensors) {
  const std::string path = fixture("tiny/glm-dsa/model.gguf");
  const AttentionWeights weights = load_attention_weights(path, 1);
  const KvBSplit split = split_kv_b(weights.kv_b, weights.spec.num_heads, weights.spec.qk_nope_head_dim,
                                    weights.spec.v_head_dim);
  const gguf::Model model = gguf::Model::open(path);
  expect_same_bits(gguf::dequantize(*model.find_tensor("blk.1.attn_k_b.weight"), path), split.k_b.data, "k_b");
  expect_same_bits(gguf::dequantize(*model.find_tensor("blk.1.attn_v_b.weight"), path), split.v_b.data, "v_b");
}

TEST(KvB, ShapesThatDoNotFitAreErrors) {
  expect_error([] { split_kv_b(random_tensor({10, 4}, 1), 3, 2, 2); }, ErrorKind::invalid_argument, {"[12,"});
  expect_error([] { split_kv_b(WeightTensor{{12, 4}, std::vector<float>(5)}, 3, 2, 2); },
               ErrorKind::invalid_argument, {"5 values"});
  expect_error([] { merge_kv_b(random_tensor({3, 4, 2}, 1), random_tensor({3, 2, 5}, 2)); },
               ErrorKind::invalid_argument, {"[3, 4, 2] and [3, 2, 5]"});
}

// --- Bad files -------------------------------------------------------------------------------------------------

struct BadFile {
  std::string file;
  ErrorKind kind;
  std::string says;
};

TEST(BadGguf, EachGivesOneClearError) {
  const BadFile kCases[] = {
      {"empty.gguf", ErrorKind::invalid_argument, "not a GGUF file"},
      {"bad-magic.gguf", ErrorKind::invalid_argument, "not a GGUF file"},
      {"version-1.gguf", ErrorKind::invalid_argument, "GGUF version 1 is not supported"},
      {"version-4.gguf", ErrorKind::invalid_argument, "GGUF version 4 is not supported"},
      {"big-endian.gguf", ErrorKind::unsupported, "big-endian"},
      {"truncated-header.gguf", ErrorKind::invalid_argument, "truncated: the metadata count"},
      {"truncated-metadata.gguf", ErrorKind::invalid_argument, "truncated"},
      {"truncated-tensor-infos.gguf", ErrorKind::invalid_argument, "truncated"},
      {"truncated-data.gguf", ErrorKind::invalid_argument, "run past the end of the file"},
      {"absurd-metadata-count.gguf", ErrorKind::invalid_argument, "1152921504606846976 metadata entries cannot fit"},
      {"absurd-tensor-count.gguf", ErrorKind::invalid_argument, "4611686018427387904 tensors cannot fit"},
      {"absurd-string-length.gguf", ErrorKind::invalid_argument, "string length 4611686018427387904 exceeds"},
      {"absurd-array-length.gguf", ErrorKind::invalid_argument, "an array of 2305843009213693952 i32 values"},
      {"unknown-value-type.gguf", ErrorKind::invalid_argument, "unknown value type 13"},
      {"bad-bool.gguf", ErrorKind::invalid_argument, "\"test.flag\": a bool must be 0 or 1, got 2"},
      {"duplicate-key.gguf", ErrorKind::invalid_argument, "metadata key \"test.aaaa\" appears twice"},
      {"duplicate-tensor.gguf", ErrorKind::invalid_argument, "tensor name \"tensor.a\" appears twice"},
      {"bad-alignment.gguf", ErrorKind::invalid_argument, "general.alignment: expected a power of two"},
      {"overlapping-tensors.gguf", ErrorKind::invalid_argument, "overlap"},
      {"tensor-out-of-file.gguf", ErrorKind::invalid_argument, "\"tensor.c\": its 68 bytes at data offset"},
      {"misaligned-tensor.gguf", ErrorKind::invalid_argument, "not a multiple of the alignment 64"},
      {"too-many-dims.gguf", ErrorKind::invalid_argument, "9 dimensions, at most 4"},
      {"unknown-tensor-type.gguf", ErrorKind::invalid_argument, "unknown ggml type 99"},
      {"partial-block.gguf", ErrorKind::invalid_argument, "rows of 33 values are not whole Q8_0 blocks of 32"},
      {"size-overflow.gguf", ErrorKind::invalid_argument, "\"tensor.b\": its size in bytes overflows 64 bits"},
      {"row-size-overflow.gguf", ErrorKind::invalid_argument, "\"tensor.a\": its size in bytes overflows 64 bits"},
  };
  for (const BadFile& bad : kCases) {
    SCOPED_TRACE(bad.file);
    const std::string path = fixture("bad/" + bad.file);
    expect_error([&] { gguf::Model::open(path); }, bad.kind, {path + ": ", bad.says});
  }
  // Every case above is one change to this file, which opens as version 3 and as version 2.
  EXPECT_EQ(gguf::Model::open(fixture("bad/base.gguf")).metadata().version, 3u);
  EXPECT_EQ(gguf::Model::open(fixture("bad/base-version-2.gguf")).metadata().version, 2u);
}

TEST(BadGguf, MetadataThatIsNotASupportedModel) {
  const std::string bad = fixture("bad/");
  expect_error([&] { gguf::spec_from_gguf_file(bad + "wrong-architecture.gguf"); }, ErrorKind::invalid_argument,
               {"wrong-architecture.gguf: general.architecture: expected one of deepseek2, deepseek32, glm-dsa",
                "\"llama\""});
  expect_error([&] { gguf::spec_from_gguf_file(bad + "missing-key.gguf"); }, ErrorKind::invalid_argument,
               {"missing-key.gguf: glm-dsa.attention.indexer.top_k: expected an integer, got no such key"});
  expect_error([&] { gguf::spec_from_gguf_file(bad + "linear-rope.gguf"); }, ErrorKind::invalid_argument,
               {"deepseek2.rope.scaling.type", "\"linear\""});
  expect_error([&] { load_attention_weights(bad + "wrong-architecture.gguf", 0); }, ErrorKind::invalid_argument,
               {"general.architecture"});
}

TEST(BadGguf, SplitModelsThatDoNotHoldTogether) {
  const std::string first = "glm-dsa-00001-of-00003.gguf";
  const std::string bad = fixture("bad/");
  expect_error([&] { gguf::Model::open(bad + "missing-part/" + first); }, ErrorKind::io,
               {"part 2 of 3 is missing", "missing-part/glm-dsa-00002-of-00003.gguf"});
  expect_error([&] { gguf::Model::open(bad + "split-count/" + first); }, ErrorKind::invalid_argument,
               {"glm-dsa-00003-of-00003.gguf: split.count is 4, but the first part says 3"});
  expect_error([&] { gguf::Model::open(bad + "split-no/" + first); }, ErrorKind::invalid_argument,
               {"glm-dsa-00003-of-00003.gguf: split.no is 1, expected 2 for part 3 of 3"});
  expect_error([&] { gguf::Model::open(bad + "tensors-count/" + first); }, ErrorKind::invalid_argument,
               {"split.tensors.count is i32 39, but the 3 parts hold 40 tensors"});
  expect_error([&] { gguf::Model::open(bad + "other-architecture/" + first); }, ErrorKind::invalid_argument,
               {"glm-dsa-00002-of-00003.gguf: general.architecture is \"llama\", but the first part says \"glm-dsa\""});
  expect_error([&] { gguf::Model::open(bad + "renamed/glm-dsa.gguf"); }, ErrorKind::invalid_argument,
               {"must be opened by its first part, named PREFIX-00001-of-00003.gguf"});
  expect_error([&] { gguf::Model::open(fixture("tiny/glm-dsa/split/glm-dsa-00002-of-00003.gguf")); },
               ErrorKind::invalid_argument, {"this is part 2 of 3", "open the first part"});
  expect_error([&] { load_model_spec(bad + "missing-part/" + first); }, ErrorKind::io, {"part 2 of 3 is missing"});
}

// --- Bad safetensors (built here: each is a few bytes of header) ---------------------------------------------

std::vector<uint8_t> safetensors_bytes(const std::string& header, size_t data_size, uint64_t declared = 0) {
  const uint64_t length = declared ? declared : header.size();
  std::vector<uint8_t> bytes(8 + header.size() + data_size, 0);
  std::memcpy(bytes.data(), &length, 8);
  std::memcpy(bytes.data() + 8, header.data(), header.size());
  return bytes;
}

TEST(BadSafetensors, EachGivesOneClearError) {
  const auto parse = [](std::vector<uint8_t> bytes) { safetensors::parse(bytes, "bad.safetensors"); };
  const auto bad = [&](const std::string& header, size_t data, const std::string& says, uint64_t declared = 0) {
    SCOPED_TRACE(header);
    expect_error([&] { parse(safetensors_bytes(header, data, declared)); }, ErrorKind::invalid_argument,
                 {"bad.safetensors: ", says});
  };
  expect_error([&] { parse({1, 2, 3}); }, ErrorKind::invalid_argument, {"bad.safetensors: truncated"});
  bad("{}", 0, "header length 1000 exceeds the file", 1000);
  bad("{\"a\": ", 0, "header: not valid JSON");
  bad("[1]", 0, "header: expected a JSON object");
  bad(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}})", 8, "run past the end of the data");
  bad(R"({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", 8, "takes 12");
  bad(R"({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 8]}})", 8, "shape: expected non-negative");
  bad(R"({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}})", 8, "unknown dtype \"Q4\"");
  bad(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}})", 8, "begin <= end");
  bad(R"({"a": {"dtype": "F32", "shape": [4611686018427387904, 8], "data_offsets": [0, 8]}})", 8, "more than 2^64");
  bad(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
          "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
      12, "tensors \"a\" and \"b\" overlap");

  const std::vector<uint8_t> fp8 =
      safetensors_bytes(R"({"w": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}})", 2);
  const safetensors::File file = safetensors::parse(fp8, "fp8.safetensors");
  expect_error([&] { safetensors::to_float(file.tensors.at("w"), "w", file.path); }, ErrorKind::unsupported,
               {"fp8.safetensors: tensor \"w\" has dtype F8_E4M3"});
}

TEST(BadSafetensors, AnIndexMustNameShardsInItsFolder) {
  const fs::path dir = fs::path(testing::TempDir()) / "smla-bad-index";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const auto write_index = [&](const std::string& text) {
    std::ofstream(dir / "model.safetensors.index.json") << text;
  };
  write_index(R"({"weight_map": {"w": "../elsewhere.safetensors"}})");
  expect_error([&] { safetensors::Checkpoint::open(dir.string()); }, ErrorKind::invalid_argument,
               {"weight_map: \"w\": expected a shard file name"});
  write_index(R"({"weight_map": {"w": "missing.safetensors"}})");
  safetensors::Checkpoint checkpoint = safetensors::Checkpoint::open(dir.string());
  EXPECT_FALSE(checkpoint.read("other").has_value());
  expect_error([&] { checkpoint.read("w"); }, ErrorKind::io, {"missing.safetensors"});
  write_index("{\"weight_map\": 3}");
  expect_error([&] { safetensors::Checkpoint::open(dir.string()); }, ErrorKind::invalid_argument, {"weight_map"});
  fs::remove_all(dir);
}

}  // namespace
}  // namespace smla
