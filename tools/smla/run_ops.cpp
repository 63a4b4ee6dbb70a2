// `smla run` without --layer, the main job: the attention ops alone. Builds a
// paged cache of random latents (and indexer keys) for `batch` requests of
// `context` tokens, runs `steps` decode steps on the selected backend — DSA
// (indexer, top-k, sparse attention) for sparse models, dense paged decode
// otherwise — spot-checks sampled rows against the float64 reference, and
// reports the time split and bandwidth.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#if SMLA_WITH_CUDA
#include "cuda/kernels.h"
#endif
#include "reference/indexer_reference.h"
#include "reference/mla_reference.h"
#include "run_job.h"
#include "smla/ops.h"

namespace smla::cli {

namespace {

#if SMLA_WITH_CUDA
constexpr bool kWithCuda = true;
#else
constexpr bool kWithCuda = false;
#endif

struct Timings {
  // Seconds, summed over steps. `indexer` is the whole indexer_topk op, or its scores alone when `topk` (the
  // selection) is timed apart.
  double write = 0, indexer = 0, topk = 0, slots = 0, attention = 0;
  double total() const { return write + indexer + topk + slots + attention; }
  bool split() const { return topk > 0; }
};

struct Report {
  Timings t;
  double bytes_indexer = 0, bytes_attention = 0;  // per run
  int checked_tokens = 0;
  double max_abs_err = 0;
  bool topk_match = true;
};

// The paged caches and block table of the sparse and the dense job, on the run's device.
struct PagedCaches {
  static constexpr int64_t kChunk = 4096;  // tokens written per cache-writer call
  Memory& mem;
  int block_size, blocks_per_request;
  std::vector<int32_t> block_table;  // [batch, blocks_per_request], host copy
  TensorView table, mla_view, index_view;
  TensorView latent, k_pe, keys, slot_mapping;  // staging for the writers

  PagedCaches(Memory& m, const JobOptions& o, DType kv, bool with_index) : mem(m), block_size(o.common.run.block_size) {
    const int64_t capacity = static_cast<int64_t>(o.context) + o.steps;
    blocks_per_request = static_cast<int>((capacity + block_size - 1) / block_size);
    const int64_t blocks = static_cast<int64_t>(o.batch) * blocks_per_request;
    block_table.resize(blocks);
    std::iota(block_table.begin(), block_table.end(), 0);
    std::shuffle(block_table.begin(), block_table.end(), std::mt19937_64(o.seed));  // blocks scattered, as in serving
    table = mem.empty({o.batch, blocks_per_request}, DType::i32);
    mem.upload(table, block_table.data());
    mla_view = mem.empty({blocks, block_size, kv == DType::fp8_ds_mla ? kFp8DsMlaRowBytes : kMlaQkDim}, kv);
    latent = mem.empty({kChunk, kMlaLatentDim}, DType::bf16);
    k_pe = mem.empty({kChunk, kMlaRopeDim}, DType::bf16);
    slot_mapping = mem.empty({kChunk}, DType::i64);
    if (with_index) {
      const DType idx = index_cache_dtype(kv);
      index_view = mem.empty({blocks, block_size, idx == DType::bf16 ? kIndexHeadDim : kFp8IndexRowBytes}, idx);
      keys = mem.empty({kChunk, kIndexHeadDim}, DType::bf16);
    }
  }

  int64_t slot(int request, int64_t pos) const {
    return static_cast<int64_t>(block_table[request * blocks_per_request + pos / block_size]) * block_size +
           pos % block_size;
  }

  // Writes positions [from, to) of every request through the library's cache writers.
  void write(const Backend& be, Random& rng, int batch, int64_t from, int64_t to) {
    const int64_t per_request = to - from, n = per_request * batch;
    for (int64_t start = 0; start < n; start += kChunk) {
      const int64_t m = std::min(kChunk, n - start);
      std::vector<int64_t> slots(m);
      for (int64_t i = 0; i < m; ++i) {
        const int64_t k = start + i;
        slots[i] = slot(static_cast<int>(k / per_request), from + k % per_request);
      }
      WriteMlaCacheArgs w;
      w.latent = first_rows(latent, m);
      w.k_pe = first_rows(k_pe, m);
      w.slot_mapping = first_rows(slot_mapping, m);
      w.cache = mla_view;
      mem.upload(w.latent, rng.bf16(m * kMlaLatentDim).data());
      mem.upload(w.k_pe, rng.bf16(m * kMlaRopeDim).data());
      mem.upload(w.slot_mapping, slots.data());
      write_mla_cache(w, &be);
      if (index_view.defined()) {
        WriteIndexCacheArgs wi;
        wi.k = first_rows(keys, m);
        wi.slot_mapping = w.slot_mapping;
        wi.cache = index_view;
        mem.upload(wi.k, rng.bf16(m * kIndexHeadDim).data());
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

Report run_sparse(const JobOptions& o, const AttentionSpec& spec, const RunSpec& run, const Backend& be, Memory& mem,
                  bool quiet) {
  Report r;
  Random rng(o.seed);
  const int B = o.batch, H = heads_per_rank(spec, run), HI = spec.indexer->heads, K = spec.indexer->topk;
  const DType kv = run.resolved_kv_cache_dtype();
  PagedCaches caches(mem, o, kv, true);
  if (o.context > 1) caches.write(be, rng, B, 0, o.context - 1);

  std::vector<int32_t> request_ids(B), context_lens(B);
  std::iota(request_ids.begin(), request_ids.end(), 0);
  std::vector<float> weights(static_cast<size_t>(B) * HI);
  IndexerTopkArgs idx;
  idx.q = mem.empty({B, HI, kIndexHeadDim}, DType::bf16);
  idx.weights = mem.empty({B, HI}, DType::f32);
  idx.index_cache = caches.index_view;
  idx.request_ids = mem.empty({B}, DType::i32);
  idx.block_table = caches.table;
  idx.context_lens = mem.empty({B}, DType::i32);
  idx.topk = mem.empty({B, K}, DType::i32);
  mem.upload(idx.request_ids, request_ids.data());
  PositionsToSlotsArgs p2s;
  p2s.positions = idx.topk;
  p2s.request_ids = idx.request_ids;
  p2s.block_table = caches.table;
  p2s.block_size = caches.block_size;
  p2s.slots = mem.empty({B, K}, DType::i32);
  SparseMlaArgs attn;
  attn.q = mem.empty({B, H, kMlaQkDim}, run.q_dtype);
  attn.kv_cache = caches.mla_view;
  attn.indices = p2s.slots;
  attn.softmax_scale = static_cast<float>(spec.softmax_scale);
  attn.out = mem.empty({B, H, kMlaVDim}, run.q_dtype);
  attn.lse = mem.empty({B, H}, DType::f32);

  // On the CUDA backend the op's two stages (scores, then the selection) are timed apart: the same kernels
  // indexer_topk runs one after the other, with a scores buffer of their own.
  const bool split_indexer = kWithCuda && be.name() == "cuda_mma";
  TensorView scores;
#if SMLA_WITH_CUDA
  if (split_indexer) scores = mem.empty({B, cuda::score_row_stride(idx)}, DType::f32);
#endif

  Progress progress(o.steps, quiet);
  for (int s = 0; s < o.steps; ++s) {
    const int64_t pos = o.context - 1 + s;  // the new token of every request
    r.t.write += timed(mem, [&] { caches.write(be, rng, B, pos, pos + 1); });
    for (auto& w : weights) w = std::fabs(rng.next()) / std::sqrt(static_cast<float>(HI * kIndexHeadDim));
    std::fill(context_lens.begin(), context_lens.end(), static_cast<int32_t>(pos + 1));
    mem.upload(attn.q, rng.half(static_cast<size_t>(B) * H * kMlaQkDim, run.q_dtype).data());
    mem.upload(idx.q, rng.bf16(static_cast<size_t>(B) * HI * kIndexHeadDim).data());
    mem.upload(idx.weights, weights.data());
    mem.upload(idx.context_lens, context_lens.data());

    if (split_indexer) {
#if SMLA_WITH_CUDA
      r.t.indexer += timed(mem, [&] { cuda::indexer_scores(idx, scores.ptr<float>()); });
      r.t.topk += timed(mem, [&] { cuda::select_topk(idx, scores.ptr<float>()); });
#endif
    } else {
      r.t.indexer += timed(mem, [&] { indexer_topk(idx, &be); });
    }
    r.t.slots += timed(mem, [&] { positions_to_slots(p2s, &be); });
    r.t.attention += timed(mem, [&] { sparse_mla(attn, &be); });
    r.bytes_indexer += static_cast<double>(B) * (pos + 1) * index_row_bytes(caches.index_view.dtype);
    r.bytes_attention += static_cast<double>(B) * std::min<int64_t>(K, pos + 1) * mla_row_bytes(kv);
    progress.update(s + 1, 1e3 * r.t.total() / (s + 1));
  }

  // Spot check of the last step on the host: top-k sets and attention rows.
  std::vector<std::vector<uint8_t>> copies(9);
  IndexerTopkArgs hidx = idx;
  for (auto [v, c] : {std::pair{&hidx.q, 0}, {&hidx.weights, 1}, {&hidx.index_cache, 2}, {&hidx.request_ids, 3},
                      {&hidx.block_table, 4}, {&hidx.context_lens, 5}, {&hidx.topk, 6}})
    *v = mem.on_host(*v, copies[c]);
  SparseMlaArgs hattn = attn;
  std::vector<std::vector<uint8_t>> more(5);
  for (auto [v, c] : {std::pair{&hattn.q, 0}, {&hattn.kv_cache, 1}, {&hattn.indices, 2}, {&hattn.out, 3},
                      {&hattn.lse, 4}})
    *v = mem.on_host(*v, more[c]);
  const int32_t* topk = hidx.topk.ptr<int32_t>();
  for (int64_t t : sample_tokens(B)) {
    const std::vector<double> scores = reference::ref_indexer_scores(hidx, t);
    const std::vector<int32_t> want = reference::ref_topk_of_scores(scores, K);
    // A position outside the reference's set is a mismatch unless its score
    // ties the k-th best within float rounding.
    const auto last = std::find(want.begin(), want.end(), -1);
    const double kth = scores[*(last - 1)];
    const auto valid = std::count_if(topk + t * K, topk + (t + 1) * K, [](int32_t g) { return g >= 0; });
    if (valid != last - want.begin()) r.topk_match = false;
    for (int64_t i = t * K; i < (t + 1) * K; ++i) {
      const int32_t g = topk[i];
      if (g < 0 || std::find(want.begin(), last, g) != last) continue;
      if (std::fabs(scores[g] - kth) > 1e-5 * std::fabs(kth) + 1e-7) r.topk_match = false;
    }
    compare_attention(hattn, t, r);
    ++r.checked_tokens;
  }
  return r;
}

Report run_dense(const JobOptions& o, const AttentionSpec& spec, const RunSpec& run, const Backend& be, Memory& mem,
                 bool quiet) {
  Report r;
  Random rng(o.seed);
  const int B = o.batch, H = heads_per_rank(spec, run);
  const DType kv = run.resolved_kv_cache_dtype();
  PagedCaches caches(mem, o, kv, false);
  if (o.context > 1) caches.write(be, rng, B, 0, o.context - 1);
  std::vector<int32_t> seq(B);
  PagedMlaDecodeArgs a;
  a.q = mem.empty({B, 1, H, kMlaQkDim}, run.q_dtype);
  a.kv_cache = caches.mla_view;
  a.block_table = caches.table;
  a.seq_lens = mem.empty({B}, DType::i32);
  a.softmax_scale = static_cast<float>(spec.softmax_scale);
  a.out = mem.empty({B, 1, H, kMlaVDim}, run.q_dtype);
  a.lse = mem.empty({B, 1, H}, DType::f32);
  Progress progress(o.steps, quiet);
  for (int s = 0; s < o.steps; ++s) {
    const int64_t pos = o.context - 1 + s;
    r.t.write += timed(mem, [&] { caches.write(be, rng, B, pos, pos + 1); });
    std::fill(seq.begin(), seq.end(), static_cast<int32_t>(pos + 1));
    mem.upload(a.q, rng.half(static_cast<size_t>(B) * H * kMlaQkDim, run.q_dtype).data());
    mem.upload(a.seq_lens, seq.data());
    r.t.attention += timed(mem, [&] { paged_mla_decode(a, &be); });
    r.bytes_attention += static_cast<double>(B) * (pos + 1) * mla_row_bytes(kv);
    progress.update(s + 1, 1e3 * r.t.total() / (s + 1));
  }
  // Spot check: the reference of the last step, on the sampled requests.
  std::vector<std::vector<uint8_t>> copies(6);
  PagedMlaDecodeArgs h = a;
  for (auto [v, c] : {std::pair{&h.q, 0}, {&h.kv_cache, 1}, {&h.block_table, 2}, {&h.seq_lens, 3}, {&h.out, 4},
                      {&h.lse, 5}})
    *v = mem.on_host(*v, copies[c]);
  for (int64_t b : sample_tokens(B)) {
    PagedMlaDecodeArgs one = h;
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

int run_ops(const JobOptions& o, const Resolved& res, const Backend& be, Memory& mem) {
  const double bw = mem.bandwidth_gbs();
  if (!o.common.json)
    std::cout << "job        " << o.batch << " requests x " << o.context << " tokens of context, " << o.steps
              << " decode steps on " << be.name() << " (memory bandwidth measured now: " << bw << " GB/s)\n";
  const bool sparse = res.spec.is_sparse();
  const Report r = sparse ? run_sparse(o, res.spec, res.run, be, mem, o.common.json)
                          : run_dense(o, res.spec, res.run, be, mem, o.common.json);

  const double step_ms = 1e3 * r.t.total() / o.steps;
  const double read_s = r.t.indexer + r.t.topk + r.t.attention;
  const double gbs = (r.bytes_indexer + r.bytes_attention) / read_s / 1e9;
  const double tokens_per_s = o.batch * o.steps / r.t.total();
  const bool ok = r.topk_match && r.max_abs_err < 2e-2;
  if (o.common.json) {
    nlohmann::json j = {{"schema", "smla.run/1"},
                        {"model", res.spec.name},
                        {"backend", be.name()},
                        {"batch", o.batch},
                        {"context", o.context},
                        {"steps", o.steps},
                        {"ms_per_step",
                         {{"total", step_ms},
                          {"cache_write", 1e3 * r.t.write / o.steps},
                          {"indexer_topk", 1e3 * (r.t.indexer + r.t.topk) / o.steps},
                          {"slots", 1e3 * r.t.slots / o.steps},
                          {"attention", 1e3 * r.t.attention / o.steps}}},
                        {"tokens_per_s", tokens_per_s},
                        {"cache_read_gbs", gbs},
                        {"memory_bandwidth_gbs", bw},
                        {"check", {{"tokens", r.checked_tokens}, {"max_abs_err", r.max_abs_err},
                                   {"topk_match", r.topk_match}, {"passed", ok}}}};
    if (r.t.split()) {
      j["ms_per_step"]["indexer_scores"] = 1e3 * r.t.indexer / o.steps;
      j["ms_per_step"]["topk"] = 1e3 * r.t.topk / o.steps;
    }
    std::cout << j.dump(2) << "\n";
  } else {
    auto ms = [&](double s) { return 1e3 * s / o.steps; };
    if (sparse && r.t.split())
      std::printf("\nper step   %.2f ms: cache write %.2f, indexer %.2f, top-k %.2f, slots %.2f, attention %.2f\n",
                  step_ms, ms(r.t.write), ms(r.t.indexer), ms(r.t.topk), ms(r.t.slots), ms(r.t.attention));
    else if (sparse)
      std::printf("\nper step   %.2f ms: cache write %.2f, indexer+top-k %.2f, slots %.2f, attention %.2f\n", step_ms,
                  ms(r.t.write), ms(r.t.indexer), ms(r.t.slots), ms(r.t.attention));
    else
      std::printf("\nper step   %.2f ms: cache write %.2f, paged attention %.2f\n", step_ms, ms(r.t.write),
                  ms(r.t.attention));
    std::printf("throughput %.0f tokens/s; cache bytes read %.1f GB/s = %.0f%% of the measured %.1f GB/s\n",
                tokens_per_s, gbs, 100 * gbs / bw, bw);
    if (sparse)
      std::printf("           indexer %.1f GB/s%s, attention %.1f GB/s\n", r.bytes_indexer / r.t.indexer / 1e9,
                  r.t.split() ? " (scores alone)" : "",
                  r.bytes_attention / r.t.attention / 1e9);
    std::printf("check      %d sampled tokens vs the float64 reference: %s (max abs error %.2g%s)\n",
                r.checked_tokens, ok ? "match" : "MISMATCH", r.max_abs_err,
                sparse ? (r.topk_match ? ", top-k sets equal" : ", top-k sets differ") : "");
  }
  return ok ? 0 : 3;
}

}  // namespace smla::cli
