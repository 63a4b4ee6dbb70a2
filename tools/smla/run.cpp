// `smla run`: the main job. Builds a paged cache of random latents (and
// indexer keys) for `batch` requests of `context` tokens, runs `steps` decode
// steps on the selected backend — DSA (indexer, top-k, sparse attention) for
// sparse models, dense paged decode otherwise — spot-checks sampled rows
// against the float64 reference, and reports the time split and bandwidth.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "commands.h"
#include "core/numeric.h"
#include "cpu/memory_bandwidth.h"
#include "options.h"
#include "reference/indexer_reference.h"
#include "reference/mla_reference.h"
#include "smla/error.h"
#include "smla/explain.h"

namespace smla::cli {

namespace {

struct JobOptions {
  RunOptions run;
  int batch = 32;
  int context = 8192;
  int steps = 64;
  uint64_t seed = 1;
};

// Fast deterministic random values in [-1, 1), never exactly zero.
class Random {
 public:
  explicit Random(uint64_t seed) : s_(seed * 0x9e3779b97f4a7c15ull + 1) {}
  float next() {
    s_ ^= s_ << 13;
    s_ ^= s_ >> 7;
    s_ ^= s_ << 17;
    const float v = static_cast<float>(static_cast<int64_t>(s_ >> 40) - (int64_t{1} << 23)) * 0x1p-23f;
    return v == 0.f ? 0x1p-24f : v;
  }
  std::vector<uint16_t> bf16(size_t n) {
    std::vector<uint16_t> v(n);
    for (auto& x : v) x = numeric::float_to_bf16(next());
    return v;
  }
  std::vector<uint16_t> half(size_t n, DType d) {
    std::vector<uint16_t> v(n);
    for (auto& x : v) x = d == DType::bf16 ? numeric::float_to_bf16(next()) : numeric::float_to_f16(next());
    return v;
  }

 private:
  uint64_t s_;
};

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Progress on a terminal (one updating bar), plain lines otherwise.
class Progress {
 public:
  Progress(int total, bool quiet) : total_(total), quiet_(quiet), tty_(isatty(STDERR_FILENO)) {}
  void update(int done, double step_ms) {
    if (quiet_) return;
    if (tty_) {
      const int width = 30, filled = width * done / total_;
      std::fprintf(stderr, "\r  [%s%s] step %d/%d  %.2f ms/step", std::string(filled, '#').c_str(),
                   std::string(width - filled, ' ').c_str(), done, total_, step_ms);
      if (done == total_) std::fprintf(stderr, "\n");
    } else if (done == total_ || done % std::max(1, total_ / 8) == 0) {
      std::fprintf(stderr, "  step %d/%d  %.2f ms/step\n", done, total_, step_ms);
    }
  }

 private:
  int total_;
  bool quiet_, tty_;
};

struct Timings {
  double write = 0, indexer = 0, slots = 0, attention = 0;  // seconds, summed over steps
  double total() const { return write + indexer + slots + attention; }
};

struct Report {
  Timings t;
  double bytes_indexer = 0, bytes_attention = 0;  // per run
  int checked_tokens = 0;
  double max_abs_err = 0;
  bool topk_match = true;
  std::string check_error;
};

int index_row_bytes(DType d) { return d == DType::bf16 ? 2 * kIndexHeadDim : kFp8IndexRowBytes; }
int mla_row_bytes(DType d) { return d == DType::fp8_ds_mla ? kFp8DsMlaRowBytes : 2 * kMlaQkDim; }

// The paged caches and block table shared by both jobs.
struct PagedCaches {
  int block_size, blocks_per_request;
  std::vector<int32_t> block_table;  // [batch, blocks_per_request]
  std::vector<uint8_t> mla, index;
  TensorView mla_view, index_view;

  PagedCaches(const JobOptions& o, DType kv, bool with_index) : block_size(o.run.block_size) {
    const int64_t capacity = static_cast<int64_t>(o.context) + o.steps;
    blocks_per_request = static_cast<int>((capacity + block_size - 1) / block_size);
    const int64_t blocks = static_cast<int64_t>(o.batch) * blocks_per_request;
    block_table.resize(blocks);
    std::iota(block_table.begin(), block_table.end(), 0);
    std::shuffle(block_table.begin(), block_table.end(), std::mt19937_64(o.seed));  // blocks scattered, as in serving
    const int row = kv == DType::fp8_ds_mla ? kFp8DsMlaRowBytes : kMlaQkDim;
    mla.resize(blocks * block_size * mla_row_bytes(kv));
    mla_view = TensorView(mla.data(), {blocks, block_size, row}, kv);
    if (with_index) {
      const DType idx = kv == DType::fp8_ds_mla ? DType::fp8_e4m3 : DType::bf16;
      index.resize(blocks * block_size * index_row_bytes(idx));
      index_view = TensorView(index.data(), {blocks, block_size, idx == DType::bf16 ? kIndexHeadDim : kFp8IndexRowBytes},
                              idx);
    }
  }

  int64_t slot(int request, int64_t pos) const {
    return static_cast<int64_t>(block_table[request * blocks_per_request + pos / block_size]) * block_size +
           pos % block_size;
  }
  TensorView table_view() {
    return TensorView(block_table.data(), {static_cast<int64_t>(block_table.size()) / blocks_per_request,
                                           blocks_per_request},
                      DType::i32);
  }

  // Writes positions [from, to) of every request through the library's cache writers.
  void write(const Backend& be, Random& rng, int batch, int64_t from, int64_t to) {
    const int64_t per_request = to - from, n = per_request * batch;
    const int64_t chunk = 4096;
    for (int64_t start = 0; start < n; start += chunk) {
      const int64_t m = std::min(chunk, n - start);
      std::vector<int64_t> slots(m);
      for (int64_t i = 0; i < m; ++i) {
        const int64_t k = start + i;
        slots[i] = slot(static_cast<int>(k / per_request), from + k % per_request);
      }
      auto latent = rng.bf16(m * kMlaLatentDim), kpe = rng.bf16(m * kMlaRopeDim);
      WriteMlaCacheArgs w;
      w.latent = TensorView(latent.data(), {m, kMlaLatentDim}, DType::bf16);
      w.k_pe = TensorView(kpe.data(), {m, kMlaRopeDim}, DType::bf16);
      w.slot_mapping = TensorView(slots.data(), {m}, DType::i64);
      w.cache = mla_view;
      write_mla_cache(w, &be);
      if (index_view.defined()) {
        auto keys = rng.bf16(m * kIndexHeadDim);
        WriteIndexCacheArgs wi;
        wi.k = TensorView(keys.data(), {m, kIndexHeadDim}, DType::bf16);
        wi.slot_mapping = w.slot_mapping;
        wi.cache = index_view;
        write_index_cache(wi, &be);
      }
    }
  }
};

// Tokens checked against the float64 reference after the last step.
std::vector<int64_t> sample_tokens(int batch) {
  std::vector<int64_t> s = {0, batch / 2, batch - 1};
  std::sort(s.begin(), s.end());
  s.erase(std::unique(s.begin(), s.end()), s.end());
  return s;
}

// One token's slice of a [T, ...] view.
TensorView row_of(TensorView v, int64_t t) {
  v.data = static_cast<char*>(v.data) + t * v.strides[0] * static_cast<int64_t>(dtype_size(v.dtype));
  v.shape[0] = 1;
  return v;
}

void compare_attention(const SparseMlaArgs& a, int64_t t, Report& r) {
  SparseMlaArgs one = a;
  for (TensorView* v : {&one.q, &one.indices, &one.out, &one.lse}) *v = row_of(*v, t);
  const reference::RefAttention ref = reference::ref_sparse_mla(one);
  const int64_t h = a.q.size(1);
  for (int64_t i = 0; i < h * kMlaVDim; ++i) {
    const uint16_t bits = one.out.ptr<uint16_t>()[i];
    const double got = one.out.dtype == DType::bf16 ? numeric::bf16_to_float(bits) : numeric::f16_to_float(bits);
    r.max_abs_err = std::max(r.max_abs_err, std::fabs(got - ref.out[i]));
  }
  for (int64_t i = 0; i < h; ++i)
    r.max_abs_err = std::max(r.max_abs_err, std::fabs(static_cast<double>(one.lse.ptr<float>()[i]) - ref.lse[i]));
}

Report run_sparse(const JobOptions& o, const AttentionSpec& spec, const RunSpec& run, const Backend& be, bool quiet) {
  Report r;
  Random rng(o.seed);
  const int B = o.batch, H = heads_per_rank(spec, run), HI = spec.indexer->heads, K = spec.indexer->topk;
  const DType kv = run.resolved_kv_cache_dtype();
  PagedCaches caches(o, kv, true);
  if (o.context > 1) caches.write(be, rng, B, 0, o.context - 1);

  std::vector<int32_t> request_ids(B), context_lens(B), topk(static_cast<size_t>(B) * K), slots(topk.size());
  std::iota(request_ids.begin(), request_ids.end(), 0);
  std::vector<uint16_t> out(static_cast<size_t>(B) * H * kMlaVDim);
  std::vector<float> lse(static_cast<size_t>(B) * H), weights(static_cast<size_t>(B) * HI);
  TensorView table = caches.table_view();

  Progress progress(o.steps, quiet);
  SparseMlaArgs attn;
  IndexerTopkArgs idx;
  std::vector<uint16_t> q, q_index;
  for (int s = 0; s < o.steps; ++s) {
    const int64_t pos = o.context - 1 + s;  // the new token of every request
    auto t0 = Clock::now();
    caches.write(be, rng, B, pos, pos + 1);
    r.t.write += seconds_since(t0);

    q = rng.half(static_cast<size_t>(B) * H * kMlaQkDim, run.q_dtype);
    q_index = rng.bf16(static_cast<size_t>(B) * HI * kIndexHeadDim);
    for (auto& w : weights) w = std::fabs(rng.next()) / std::sqrt(static_cast<float>(HI * kIndexHeadDim));
    std::fill(context_lens.begin(), context_lens.end(), static_cast<int32_t>(pos + 1));

    idx.q = TensorView(q_index.data(), {B, HI, kIndexHeadDim}, DType::bf16);
    idx.weights = TensorView(weights.data(), {B, HI}, DType::f32);
    idx.index_cache = caches.index_view;
    idx.request_ids = TensorView(request_ids.data(), {B}, DType::i32);
    idx.block_table = table;
    idx.context_lens = TensorView(context_lens.data(), {B}, DType::i32);
    idx.topk = TensorView(topk.data(), {B, K}, DType::i32);
    t0 = Clock::now();
    indexer_topk(idx, &be);
    r.t.indexer += seconds_since(t0);

    PositionsToSlotsArgs p2s;
    p2s.positions = idx.topk;
    p2s.request_ids = idx.request_ids;
    p2s.block_table = table;
    p2s.block_size = caches.block_size;
    p2s.slots = TensorView(slots.data(), {B, K}, DType::i32);
    t0 = Clock::now();
    positions_to_slots(p2s, &be);
    r.t.slots += seconds_since(t0);

    attn.q = TensorView(q.data(), {B, H, kMlaQkDim}, run.q_dtype);
    attn.kv_cache = caches.mla_view;
    attn.indices = p2s.slots;
    attn.softmax_scale = static_cast<float>(spec.softmax_scale);
    attn.out = TensorView(out.data(), {B, H, kMlaVDim}, run.q_dtype);
    attn.lse = TensorView(lse.data(), {B, H}, DType::f32);
    t0 = Clock::now();
    sparse_mla(attn, &be);
    r.t.attention += seconds_since(t0);

    r.bytes_indexer += static_cast<double>(B) * (pos + 1) * index_row_bytes(caches.index_view.dtype);
    r.bytes_attention += static_cast<double>(B) * std::min<int64_t>(K, pos + 1) * mla_row_bytes(kv);
    progress.update(s + 1, 1e3 * r.t.total() / (s + 1));
  }

  // Spot check of the last step: top-k sets and attention rows.
  for (int64_t t : sample_tokens(B)) {
    const std::vector<double> scores = reference::ref_indexer_scores(idx, t);
    const std::vector<int32_t> want = reference::ref_topk_of_scores(scores, K);
    // A position outside the reference's set is a mismatch unless its score
    // ties the k-th best within float rounding.
    const auto last = std::find(want.begin(), want.end(), -1);
    const double kth = scores[*(last - 1)];
    const auto valid = std::count_if(topk.begin() + t * K, topk.begin() + (t + 1) * K, [](int32_t g) { return g >= 0; });
    if (valid != last - want.begin()) r.topk_match = false;
    for (int64_t i = t * K; i < (t + 1) * K; ++i) {
      const int32_t g = topk[i];
      if (g < 0 || std::find(want.begin(), last, g) != last) continue;
      if (std::fabs(scores[g] - kth) > 1e-5 * std::fabs(kth) + 1e-7) r.topk_match = false;
    }
    compare_attention(attn, t, r);
    ++r.checked_tokens;
  }
  return r;
}

Report run_dense(const JobOptions& o, const AttentionSpec& spec, const RunSpec& run, const Backend& be, bool quiet) {
  Report r;
  Random rng(o.seed);
  const int B = o.batch, H = heads_per_rank(spec, run);
  const DType kv = run.resolved_kv_cache_dtype();
  PagedCaches caches(o, kv, false);
  if (o.context > 1) caches.write(be, rng, B, 0, o.context - 1);
  std::vector<int32_t> seq(B);
  std::vector<uint16_t> out(static_cast<size_t>(B) * H * kMlaVDim), q;
  std::vector<float> lse(static_cast<size_t>(B) * H);
  Progress progress(o.steps, quiet);
  PagedMlaDecodeArgs a;
  for (int s = 0; s < o.steps; ++s) {
    const int64_t pos = o.context - 1 + s;
    auto t0 = Clock::now();
    caches.write(be, rng, B, pos, pos + 1);
    r.t.write += seconds_since(t0);
    q = rng.half(static_cast<size_t>(B) * H * kMlaQkDim, run.q_dtype);
    std::fill(seq.begin(), seq.end(), static_cast<int32_t>(pos + 1));
    a.q = TensorView(q.data(), {B, 1, H, kMlaQkDim}, run.q_dtype);
    a.kv_cache = caches.mla_view;
    a.block_table = caches.table_view();
    a.seq_lens = TensorView(seq.data(), {B}, DType::i32);
    a.softmax_scale = static_cast<float>(spec.softmax_scale);
    a.out = TensorView(out.data(), {B, 1, H, kMlaVDim}, run.q_dtype);
    a.lse = TensorView(lse.data(), {B, 1, H}, DType::f32);
    t0 = Clock::now();
    paged_mla_decode(a, &be);
    r.t.attention += seconds_since(t0);
    r.bytes_attention += static_cast<double>(B) * (pos + 1) * mla_row_bytes(kv);
    progress.update(s + 1, 1e3 * r.t.total() / (s + 1));
  }
  // Spot check: the reference of the last step, on the sampled requests.
  for (int64_t b : sample_tokens(B)) {
    PagedMlaDecodeArgs one = a;
    for (TensorView* v : {&one.q, &one.block_table, &one.seq_lens, &one.out, &one.lse}) *v = row_of(*v, b);
    const reference::RefAttention ref = reference::ref_paged_mla_decode(one);
    for (int64_t i = 0; i < H * kMlaVDim; ++i) {
      const uint16_t bits = one.out.ptr<uint16_t>()[i];
      const double got = run.q_dtype == DType::bf16 ? numeric::bf16_to_float(bits) : numeric::f16_to_float(bits);
      r.max_abs_err = std::max(r.max_abs_err, std::fabs(got - ref.out[i]));
    }
    ++r.checked_tokens;
  }
  return r;
}

}  // namespace

Action add_run(CLI::App& app) {
  auto* sub = app.add_subcommand("run", "run decode steps of a model's attention on the chosen backend and report speed");
  auto o = std::make_shared<JobOptions>();
  add_run_options(*sub, o->run);
  sub->add_option("--batch", o->batch, "requests decoded together (one new token each per step)")->capture_default_str();
  sub->add_option("--context", o->context, "tokens already in each request's cache")->capture_default_str();
  sub->add_option("--steps", o->steps, "decode steps")->capture_default_str();
  sub->add_option("--seed", o->seed, "random seed")->capture_default_str();
  return [sub, o]() -> int {
    if (!sub->parsed()) return -1;
    require(o->batch >= 1, "--batch: expected a positive integer, got " + std::to_string(o->batch));
    require(o->context >= 1, "--context: expected a positive integer, got " + std::to_string(o->context));
    require(o->steps >= 1, "--steps: expected a positive integer, got " + std::to_string(o->steps));
    const Resolved res = resolve(o->run);
    const Selection sel = select(res.spec, res.run);
    if (!o->run.json) std::cout << explain_text(res.spec, res.run, sel) << "\n";
    if (!sel.chosen) {
      if (o->run.json) std::cout << explain_json(res.spec, res.run, sel);
      return 1;
    }
    const Backend& be = *sel.chosen;
    if (be.capabilities().device_kind != DeviceKind::cpu)
      throw Error(ErrorKind::unsupported, "smla run drives CPU backends in this version; '" + be.name() +
                                              "' runs through the C++/Python API and bench/bench_cuda_attention");

    const double bw = cpu::measure_read_bandwidth_gbs();
    if (!o->run.json)
      std::cout << "job        " << o->batch << " requests x " << o->context << " tokens of context, " << o->steps
                << " decode steps on " << be.name() << " (memory read bandwidth measured now: " << bw << " GB/s)\n";
    const bool sparse = res.spec.is_sparse();
    const Report r = sparse ? run_sparse(*o, res.spec, res.run, be, o->run.json)
                            : run_dense(*o, res.spec, res.run, be, o->run.json);

    const double step_ms = 1e3 * r.t.total() / o->steps;
    const double read_s = r.t.indexer + r.t.attention;
    const double gbs = (r.bytes_indexer + r.bytes_attention) / read_s / 1e9;
    const double tokens_per_s = o->batch * o->steps / r.t.total();
    const bool ok = r.topk_match && r.max_abs_err < 2e-2;
    if (o->run.json) {
      nlohmann::json j = {{"schema", "smla.run/1"},
                          {"model", res.spec.name},
                          {"backend", be.name()},
                          {"batch", o->batch},
                          {"context", o->context},
                          {"steps", o->steps},
                          {"ms_per_step",
                           {{"total", step_ms},
                            {"cache_write", 1e3 * r.t.write / o->steps},
                            {"indexer_topk", 1e3 * r.t.indexer / o->steps},
                            {"slots", 1e3 * r.t.slots / o->steps},
                            {"attention", 1e3 * r.t.attention / o->steps}}},
                          {"tokens_per_s", tokens_per_s},
                          {"cache_read_gbs", gbs},
                          {"memory_bandwidth_gbs", bw},
                          {"check", {{"tokens", r.checked_tokens}, {"max_abs_err", r.max_abs_err},
                                     {"topk_match", r.topk_match}, {"passed", ok}}}};
      std::cout << j.dump(2) << "\n";
    } else {
      auto ms = [&](double s) { return 1e3 * s / o->steps; };
      if (sparse)
        std::printf("\nper step   %.2f ms: cache write %.2f, indexer+top-k %.2f, slots %.2f, attention %.2f\n", step_ms,
                    ms(r.t.write), ms(r.t.indexer), ms(r.t.slots), ms(r.t.attention));
      else
        std::printf("\nper step   %.2f ms: cache write %.2f, paged attention %.2f\n", step_ms, ms(r.t.write),
                    ms(r.t.attention));
      std::printf("throughput %.0f tokens/s; cache bytes read %.1f GB/s = %.0f%% of the measured %.1f GB/s\n",
                  tokens_per_s, gbs, 100 * gbs / bw, bw);
      if (sparse)
        std::printf("           indexer %.1f GB/s, attention %.1f GB/s\n", r.bytes_indexer / r.t.indexer / 1e9,
                    r.bytes_attention / r.t.attention / 1e9);
      std::printf("check      %d sampled tokens vs the float64 reference: %s (max abs error %.2g%s)\n",
                  r.checked_tokens, ok ? "match" : "MISMATCH", r.max_abs_err,
                  sparse ? (r.topk_match ? ", top-k sets equal" : ", top-k sets differ") : "");
    }
    return ok ? 0 : 3;
  };
}

}  // namespace smla::cli
