// `smla run --layer N`: the whole attention layer (smla::MlaLayer, on the run's device) with random weights of the
// model's geometry, or layer N of a checkpoint (--weights), holding one tensor-parallel rank's heads. Each request's
// context is imported as random cache rows (append_context: a prefill of long contexts through the layer would take
// minutes on a CPU); then a prefill of --prompt tokens and --steps decode steps are timed, split into LayerProfile's
// phases. A short prompt through the layer (absorbed path) and through the same weights on the CPU's unabsorbed
// path checks it.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/text.h"
#include "models/gguf.h"
#include "run_job.h"
#include "smla/error.h"
#include "smla/layer.h"
#include "smla/select.h"
#include "smla/weights.h"

namespace smla::cli {

namespace {

// Context rows imported per append_context call.
constexpr int kContextChunk = 4096;

std::string str(int64_t v) { return std::to_string(v); }

// Runs `fn`, prefixing the message of any smla::Error it throws with `what`.
template <class F>
auto prefixed(const std::string& what, F&& fn) {
  try {
    return fn();
  } catch (const Error& e) {
    throw Error(e.kind(), what + e.what());
  }
}

// The layers --layer may name, and where that number comes from: a GGUF file's blocks (NextN layers included),
// else num_hidden_layers (0: the config does not say).
std::pair<int, std::string> layer_count(const JobOptions& o, const AttentionSpec& spec) {
  if (o.weights.empty()) return {spec.num_layers, "num_hidden_layers"};
  if (std::filesystem::is_directory(o.weights)) return {spec.num_layers, "config.json num_hidden_layers"};
  const gguf::Model model = gguf::Model::open(o.weights);
  const gguf::File& meta = model.metadata();
  // spec_from_gguf has read both keys: the architecture is a string, the block count an integer.
  const auto& arch = std::get<std::string>(meta.find("general.architecture")->data);
  const gguf::Value& blocks = *meta.find(arch + ".block_count");
  const auto* u = std::get_if<uint64_t>(&blocks.data);
  return {int(u ? int64_t(*u) : std::get<int64_t>(blocks.data)), "GGUF block_count, NextN layers included"};
}

// Throws unless --model, given with --weights, has the geometry of the weights' file.
void check_model_matches(const JobOptions& o, const AttentionSpec& file) {
  const AttentionSpec given = load_model_spec(o.common.model);
  std::string differences;
  const auto compare = [&](const char* field, int a, int b) {
    if (a != b) differences += (differences.empty() ? "" : ", ") + std::string(field) + " " + str(a) + " vs " + str(b);
  };
  compare("hidden_size", given.hidden_size, file.hidden_size);
  compare("num_heads", given.num_heads, file.num_heads);
  compare("q_lora_rank", given.q_lora_rank, file.q_lora_rank);
  compare("kv_lora_rank", given.kv_lora_rank, file.kv_lora_rank);
  compare("qk_nope_head_dim", given.qk_nope_head_dim, file.qk_nope_head_dim);
  compare("qk_rope_head_dim", given.qk_rope_head_dim, file.qk_rope_head_dim);
  compare("v_head_dim", given.v_head_dim, file.v_head_dim);
  const IndexerSpec none{};
  const IndexerSpec &gi = given.indexer.value_or(none), &fi = file.indexer.value_or(none);
  compare("index_n_heads", gi.heads, fi.heads);
  compare("index_head_dim", gi.head_dim, fi.head_dim);
  compare("index_topk", gi.topk, fi.topk);
  if (!differences.empty())
    fail("--model " + o.common.model + " does not match --weights " + o.weights + " (" + differences +
         "); leave --model out to take the model from the weights");
}

int64_t weight_values(const AttentionWeights& w) {
  int64_t values = 0;
  for (const WeightTensor* t : {&w.q, &w.q_a, &w.q_a_norm, &w.q_b, &w.kv_a_mqa, &w.kv_a_norm, &w.kv_b, &w.o,
                                &w.indexer.wq_b, &w.indexer.wk, &w.indexer.k_norm, &w.indexer.k_norm_bias,
                                &w.indexer.weights_proj})
    values += t->numel();
  return values;
}

// Rank 0's heads of the layer: read from --weights, or random with --model's geometry.
AttentionWeights rank_weights(const JobOptions& o, const AttentionSpec& spec, int tp) {
  if (o.weights.empty()) {
    AttentionSpec rank = spec;
    rank.num_heads = spec.num_heads / tp;
    return random_attention_weights(rank, o.seed + uint64_t(o.layer));
  }
  AttentionWeights whole = prefixed("--weights: ", [&] { return load_attention_weights(o.weights, o.layer); });
  return tp == 1 ? whole : shard_attention_heads(std::move(whole), tp, 0);
}

// LayerProfile's phases, as the report names them and as JSON keys.
struct Phase {
  const char* name;
  const char* key;
  double LayerProfile::*seconds;
  bool dsa_only;
};
constexpr Phase kPhases[] = {{"projections", "projections", &LayerProfile::projections, false},
                             {"RoPE", "rope", &LayerProfile::rope, false},
                             {"cache write", "cache_write", &LayerProfile::cache_write, false},
                             {"indexer", "indexer", &LayerProfile::indexer, true},
                             {"top-k", "topk", &LayerProfile::topk, true},
                             {"attention", "attention", &LayerProfile::attention, false},
                             {"output", "output", &LayerProfile::output, false}};

// A timed part of the job: its tokens, wall time and profile, summed over `calls` forward calls.
struct Timed {
  int tokens = 0, calls = 0;
  double seconds = 0;
  LayerProfile profile;
  // ms per call of a phase (nullptr: the time outside every phase).
  double ms(double LayerProfile::*phase) const {
    double s = seconds;
    if (phase) {
      s = profile.*phase;
    } else {
      for (const Phase& p : kPhases) s -= profile.*(p.seconds);
    }
    return 1e3 * s / calls;
  }
  double total_ms() const { return 1e3 * seconds / calls; }
  double tokens_per_s() const { return tokens / seconds; }
  nlohmann::json json(bool sparse) const {
    nlohmann::json ms_json;
    for (const Phase& p : kPhases)
      if (sparse || !p.dsa_only) ms_json[p.key] = ms(p.seconds);
    ms_json["other"] = ms(nullptr);
    ms_json["total"] = total_ms();
    return ms_json;
  }
};

struct Check {
  int tokens = 0;
  double error = 0, tolerance = 0;  // max |absorbed - unabsorbed| / max |unabsorbed|
  bool passed() const { return error <= tolerance; }  // false for NaN
};

// A new prompt of `tokens` through the layer (absorbed path, on its device) and through the same weights in a CPU
// layer on the unabsorbed path (fp32 throughout; it runs on the CPU only), each on a fresh request.
Check check_paths(MlaLayer& layer, AttentionWeights weights, Memory& mem, Random& rng, int tokens, DType kv) {
  const int64_t d = layer.spec().hidden_size;
  const std::vector<float> hidden = rng.floats(size_t(tokens * d));
  std::vector<float> want(hidden.size());
  {
    LayerOptions cpu;
    const int kpool = layer.spec().is_sparse() ? layer.spec().indexer->kpool : 1;
    cpu.num_blocks = 1;
    cpu.block_size = (tokens + kpool - 1) / kpool * kpool;  // a pooled indexer's pools share a block
    cpu.kv_cache_dtype = kv;
    cpu.index_cache_dtype = index_cache_dtype(kv);
    cpu.backend = &backend_for(Device::cpu());
    MlaLayer reference(std::move(weights), cpu);
    const LayerSegment prompt{reference.add_request(), tokens};
    reference.forward({&prompt, 1}, hidden.data(), want.data(), AttentionPath::unabsorbed);
  }
  const TensorView in = mem.empty({tokens, d}, DType::f32), out = mem.empty({tokens, d}, DType::f32);
  mem.upload(in, hidden.data());
  const LayerSegment prompt{layer.add_request(), tokens};
  layer.forward({&prompt, 1}, in.ptr<float>(), out.ptr<float>(), AttentionPath::absorbed);
  layer.release_request(prompt.request);
  std::vector<uint8_t> storage;
  const float* got = mem.on_host(out, storage).ptr<float>();
  double largest = 0, error = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    largest = std::max(largest, double(std::fabs(want[i])));
    error = std::max(error, double(std::fabs(got[i] - want[i])));
    if (std::isnan(got[i]) || std::isnan(want[i])) error = NAN;
  }
  // bf16 (f16) queries, cache rows and attention output: ~3e-3 of the output's size (docs/layer.md); fp8 rows more;
  // twice that for a GPU's bf16 weights and product inputs.
  const double tolerance = (is_fp8_mla_cache(kv) ? 5e-2 : 1e-2) * (layer.device().is_cuda() ? 2 : 1);
  return {tokens, error / largest, tolerance};
}

// Each request's first context - 1 positions as random cache rows, so that its first decode step attends to
// `context` tokens (as in the op job). A pooled indexer's rows are each token's index key and gate scores.
void fill_context(MlaLayer& layer, Memory& mem, Random& rng, const std::vector<LayerSegment>& batch, int tokens) {
  const AttentionSpec& spec = layer.spec();
  const int64_t rope = spec.qk_rope_head_dim,
                index_width = !spec.is_sparse() ? 0 : spec.indexer->kpool > 1 ? 2 * kIndexHeadDim : kIndexHeadDim;
  const int64_t chunk = std::max(1, std::min(kContextChunk, tokens));
  const TensorView latent = mem.empty({chunk, kMlaLatentDim}, DType::f32),
                   k_pe = rope ? mem.empty({chunk, rope}, DType::f32) : TensorView(),
                   index_k = index_width ? mem.empty({chunk, index_width}, DType::f32) : TensorView();
  for (const LayerSegment& seg : batch) {
    for (int from = 0; from < tokens; from += kContextChunk) {
      const int n = std::min(kContextChunk, tokens - from);
      mem.upload(first_rows(latent, n), rng.floats(size_t(n) * kMlaLatentDim).data());
      if (rope) mem.upload(first_rows(k_pe, n), rng.floats(size_t(n * rope)).data());
      if (index_width) mem.upload(first_rows(index_k, n), rng.floats(size_t(n * index_width)).data());
      layer.append_context(seg.request, n, latent.ptr<float>(), rope ? k_pe.ptr<float>() : nullptr,
                           index_width ? index_k.ptr<float>() : nullptr);
    }
  }
}

}  // namespace

Resolved resolve_layer_job(const JobOptions& o) {
  require(o.layer >= 0, "--layer: expected a layer index >= 0, got " + str(o.layer));
  require(o.prompt >= 1, "--prompt: expected a positive integer, got " + str(o.prompt));
  AttentionSpec spec;
  if (o.weights.empty()) {
    spec = load_model_spec(o.common.model);
  } else {
    std::error_code ec;
    const bool folder = std::filesystem::is_directory(o.weights, ec);
    if (!folder && !std::filesystem::exists(o.weights, ec))
      throw Error(ErrorKind::io, "--weights " + o.weights + ": no such file or folder");
    const std::string extension = lowercase(std::filesystem::path(o.weights).extension().string());
    require(folder || extension == ".gguf", "--weights " + o.weights +
                                                ": expected a .gguf file or a folder holding config.json and "
                                                "safetensors shards");
    if (folder && !std::filesystem::exists(std::filesystem::path(o.weights) / "config.json", ec))
      throw Error(ErrorKind::io, "--weights " + o.weights + ": the folder holds no config.json");
    spec = prefixed("--weights: ", [&] { return load_model_spec(o.weights); });
    if (o.model_given) check_model_matches(o, spec);
  }
  const auto [layers, source] = prefixed("--weights: ", [&] { return layer_count(o, spec); });
  if (layers > 0)
    require(o.layer < layers, "--layer " + str(o.layer) + ": expected 0 to " + str(layers - 1) + ", as " + spec.name +
                                  " has " + str(layers) + " layers (" + source + ")");
  Resolved res = resolve(o.common, std::move(spec));
  // MlaLayer's attention query takes the cache's 16-bit type: bf16 beside an fp8_ds_mla cache.
  const DType kv = res.run.resolved_kv_cache_dtype(), query = attention_query_dtype(kv);
  require(res.run.q_dtype == query, "--dtype " + std::string(dtype_name(res.run.q_dtype)) +
                                        ": the layer's attention query has the cache's 16-bit type, " +
                                        std::string(dtype_name(query)) + " with a " + std::string(dtype_name(kv)) +
                                        " cache");
  return res;
}

int run_layer(const JobOptions& o, const Resolved& res, const Backend& be, Memory& mem) {
  const AttentionSpec& spec = res.spec;
  const bool sparse = spec.is_sparse(), quiet = o.common.json;
  const int tp = res.run.tp, heads = heads_per_rank(spec, res.run), bs = res.run.block_size;
  const double bw = mem.bandwidth_gbs();

  AttentionWeights weights = rank_weights(o, spec, tp);
  const DType kv = res.run.resolved_kv_cache_dtype();
  const int check_tokens = sparse ? std::min(kLayerCheckTokens, spec.indexer->topk) : kLayerCheckTokens;
  const auto blocks = [bs](int64_t tokens) { return int((tokens + bs - 1) / bs); };
  LayerOptions options;
  options.num_blocks = o.batch * blocks(int64_t(o.context) + o.steps) + blocks(o.prompt) + blocks(check_tokens);
  options.block_size = bs;
  options.kv_cache_dtype = kv;
  options.index_cache_dtype = index_cache_dtype(kv);
  options.device = res.run.device;
  options.backend = &be;
  MlaLayer layer = [&] {
    try {
      return MlaLayer(weights, options);  // a copy: check_paths' reference layer takes the weights
    } catch (const Error& e) {  // e.g. a geometry the ops run but the layer does not
      throw Error(ErrorKind::unsupported, "--layer: " + spec.name + " cannot run as a whole layer: " + e.what());
    }
  }();
  const bool gpu = layer.device().is_cuda();
  const double w_bytes = double(weight_values(weights)) * (gpu ? 2 : 4);  // the layer holds bf16 on a GPU
  if (!quiet) {
    const std::string source = o.weights.empty() ? "with random weights (seed " + std::to_string(o.seed) + ")"
                                                 : "from " + o.weights;
    std::printf("job        layer %d %s: %d of %d heads (tp %d), %.1f MB of %s weights; %d requests x %d tokens of "
                "context, a %d-token prompt, %d decode steps on %s (memory bandwidth measured now: %.1f GB/s)\n",
                o.layer, source.c_str(), heads, spec.num_heads, tp, w_bytes / 1e6, gpu ? "bfloat16" : "float32",
                o.batch, o.context, o.prompt, o.steps, std::string(be.name()).c_str(), bw);
  }

  Random rng(o.seed);
  const Check check = check_paths(layer, std::move(weights), mem, rng, check_tokens, kv);  // first: it warms up too

  std::vector<LayerSegment> batch(o.batch);
  for (LayerSegment& seg : batch) seg = {layer.add_request(), 1};
  const double fill_s = timed(mem, [&] { fill_context(layer, mem, rng, batch, o.context - 1); });
  if (!quiet)
    std::printf("context    %lld cache rows imported with append_context in %.2f s\n",
                static_cast<long long>(o.batch) * (o.context - 1), fill_s);

  const int64_t d = spec.hidden_size;
  Timed prefill{o.prompt, 1};
  {
    const TensorView hidden = mem.empty({o.prompt, d}, DType::f32), out = mem.empty({o.prompt, d}, DType::f32);
    mem.upload(hidden, rng.floats(size_t(o.prompt * d)).data());
    const LayerSegment prompt{layer.add_request(), o.prompt};
    prefill.seconds = timed(mem, [&] {
      layer.forward({&prompt, 1}, hidden.ptr<float>(), out.ptr<float>(), AttentionPath::absorbed, &prefill.profile);
    });
    layer.release_request(prompt.request);
  }

  Timed decode{o.batch * o.steps, o.steps};
  double cache_bytes = 0;  // over all steps
  {
    const TensorView hidden = mem.empty({o.batch, d}, DType::f32), out = mem.empty({o.batch, d}, DType::f32);
    const int index_row = index_row_bytes(index_cache_dtype(kv)), mla_row = mla_row_bytes(kv);
    std::fflush(stdout);  // before the progress lines on stderr
    Progress progress(o.steps, quiet);
    for (int s = 0; s < o.steps; ++s) {
      mem.upload(hidden, rng.floats(size_t(o.batch * d)).data());
      decode.seconds += timed(mem, [&] {
        layer.forward(batch, hidden.ptr<float>(), out.ptr<float>(), AttentionPath::absorbed, &decode.profile);
      });
      const int64_t context = int64_t(o.context) + s;  // what each request's new token attends to
      cache_bytes += double(o.batch) * (sparse ? double(context) * index_row +
                                                     double(std::min<int64_t>(spec.indexer->topk, context)) * mla_row
                                               : double(context) * mla_row);
      progress.update(s + 1, 1e3 * decode.seconds / (s + 1));
    }
  }
  const double step_bytes = w_bytes + cache_bytes / o.steps;
  const double gbs = step_bytes / (decode.seconds / o.steps) / 1e9;

  if (o.common.json) {
    nlohmann::json j = {{"schema", "smla.run.layer/1"},
                        {"model", spec.name},
                        {"backend", be.name()},
                        {"layer", o.layer},
                        {"weights", o.weights.empty() ? "random" : o.weights},
                        {"tp", tp},
                        {"heads", heads},
                        {"weight_bytes", w_bytes},
                        {"kv_cache_dtype", dtype_name(kv)},
                        {"batch", o.batch},
                        {"context", o.context},
                        {"prompt", o.prompt},
                        {"steps", o.steps},
                        {"prefill", {{"ms", prefill.json(sparse)}, {"tokens_per_s", prefill.tokens_per_s()}}},
                        {"decode",
                         {{"ms_per_step", decode.json(sparse)},
                          {"tokens_per_s", decode.tokens_per_s()},
                          {"bytes_per_step", {{"weights", w_bytes}, {"cache", cache_bytes / o.steps}}},
                          {"read_gbs", gbs}}},
                        {"memory_bandwidth_gbs", bw},
                        {"check", {{"tokens", check.tokens}, {"max_rel_err", check.error},
                                   {"tolerance", check.tolerance}, {"passed", check.passed()}}}};
    std::cout << j.dump(2) << "\n";
  } else {
    const std::string pre = "prefill, " + str(o.prompt) + " tokens", dec = "decode step, " + str(o.batch) + " tokens";
    std::printf("\n%-14s%23s%27s\n", "", pre.c_str(), dec.c_str());
    const auto row = [&](const char* name, double LayerProfile::*phase) {
      const double p = prefill.ms(phase), q = decode.ms(phase);
      std::printf("  %-12s %12.2f ms %5.1f%% %16.2f ms %5.1f%%\n", name, p, 100 * p / prefill.total_ms(), q,
                  100 * q / decode.total_ms());
    };
    for (const Phase& p : kPhases)
      if (sparse || !p.dsa_only) row(p.name, p.seconds);
    row("other", nullptr);
    std::printf("  %-12s %12.2f ms %23.2f ms\n", "total", prefill.total_ms(), decode.total_ms());
    std::printf("throughput prefill %.0f tokens/s, decode %.0f tokens/s\n", prefill.tokens_per_s(),
                decode.tokens_per_s());
    std::printf("bytes      a decode step reads %.1f MB of weights + %.1f MB of cache: %.1f GB/s = %.0f%% of the "
                "measured %.1f GB/s\n",
                w_bytes / 1e6, cache_bytes / o.steps / 1e6, gbs, 100 * gbs / bw, bw);
    std::printf("check      a %d-token prompt, absorbed vs unabsorbed path: max error %.2g of the largest output "
                "(tolerance %.0e): %s\n",
                check.tokens, check.error, check.tolerance, check.passed() ? "match" : "MISMATCH");
  }
  return check.passed() ? 0 : 3;
}

}  // namespace smla::cli
