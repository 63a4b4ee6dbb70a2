// `smla run` without --layer, the main job: the attention ops alone. Builds a
// paged cache of random latents (and indexer keys, one per token or, for a
// pooled indexer, one per pool of kpool tokens) for `batch` requests of
// `context` tokens, runs `steps` decode steps on the selected backend — DSA
// (indexer, top-k, sparse attention) for sparse models, each op timed alone
// and, with a plain indexer, also dsa_decode_step as one call; dense paged
// decode otherwise — spot-checks sampled rows against the float64 reference,
// and reports the time split and bandwidth.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#if SMLA_WITH_CUDA
#include "cuda/kernels.h"
#endif
#include "reference/indexer_reference.h"
#include "reference/mla_reference.h"
#include "run_job.h"
#include "smla/error.h"
#include "smla/ops.h"

namespace smla::cli {

namespace {

#if SMLA_WITH_CUDA
constexpr bool kWithCuda = true;
#else
constexpr bool kWithCuda = false;
#endif

struct Timings {
  // Seconds, summed over steps, each op timed alone. `write` is the cache writers (latent and, for DSA, index
  // keys); `indexer` the whole indexer_topk op, or its scores alone when `topk` (the selection) is timed apart.
  // `step`: dsa_decode_step (scores, top-k, slots, attention) as one call on the same inputs, as an engine calls
  // it, where it was timed (a plain DSA indexer), else 0; not in total(), which sums the ops called apart.
  double write = 0, indexer = 0, topk = 0, slots = 0, attention = 0, step = 0;
  double total() const { return write + indexer + topk + slots + attention; }
  bool split() const { return topk > 0; }
  bool one_call() const { return step > 0; }
  // What a user waits per layer: the cache writes and the one-call step where it was timed, else every op.
  double user_step() const { return one_call() ? write + step : total(); }
};

struct Report {
  Timings t;
  // An error of NaN (a NaN output) counts as infinite, so the check fails.
  void note_error(double e) { max_abs_err = std::max(max_abs_err, std::isnan(e) ? INFINITY : e); }
  double step_data_s = 0;  // host time generating and uploading the steps' inputs, before the timed loop
  double bytes_indexer = 0, bytes_attention = 0;  // per run
  int checked_tokens = 0;
  double max_abs_err = 0;
  bool topk_match = true;
  bool step_matches_ops = true;  // the one-call step's out and lse are the ops' bit for bit (Timings::step)
};

// A block table for `batch` requests of up to `entries` rows each, its blocks shuffled (scattered, as in serving),
// on the host and on the run's device.
struct BlockTable {
  int block_size, blocks_per_request;
  std::vector<int32_t> block_table;  // [batch, blocks_per_request], host copy
  TensorView table;

  BlockTable(Memory& mem, int batch, int64_t entries, int block_size_, uint64_t seed)
      : block_size(block_size_),
        blocks_per_request(static_cast<int>(std::max<int64_t>(1, (entries + block_size - 1) / block_size))) {
    block_table.resize(static_cast<size_t>(batch) * blocks_per_request);
    std::iota(block_table.begin(), block_table.end(), 0);
    std::shuffle(block_table.begin(), block_table.end(), std::mt19937_64(seed));
    table = mem.empty({batch, blocks_per_request}, DType::i32);
    mem.upload(table, block_table.data());
  }
  int64_t blocks() const { return static_cast<int64_t>(block_table.size()); }
  // The physical slot of a request's row `entry`.
  int64_t slot(int request, int64_t entry) const {
    return static_cast<int64_t>(block_table[request * blocks_per_request + entry / block_size]) * block_size +
           entry % block_size;
  }
};

// The paged caches and block table of the sparse and the dense job, on the run's device. A pooled index cache
// (kpool > 1) holds block_size / kpool pools per block of the shared table.
struct PagedCaches : BlockTable {
  static constexpr int64_t kChunk = 4096;  // tokens written per cache-writer call
  Memory& mem;
  MlaHead head;
  int kpool;
  TensorView mla_view, index_view;
  TensorView latent, k_pe, keys, gates, ape, slot_mapping;  // staging for the writers; ape: the pool's learned term

  PagedCaches(Memory& m, const JobOptions& o, DType kv, MlaHead h, bool with_index, int kpool_, Random& rng)
      : BlockTable(m, o.batch, int64_t(o.context) + o.steps, o.common.run.block_size, o.seed),
        mem(m),
        head(h),
        kpool(kpool_) {
    mla_view = mem.empty({blocks(), block_size, head.cache_row(kv)}, kv);
    latent = mem.empty({kChunk, kMlaLatentDim}, DType::bf16);
    if (head.rope_dim > 0) k_pe = mem.empty({kChunk, head.rope_dim}, DType::bf16);  // else absent: no rope part
    slot_mapping = mem.empty({kChunk}, DType::i64);
    if (with_index) {
      const DType idx = index_cache_dtype(kv);
      const int index_row = idx == DType::bf16 ? kIndexHeadDim : kFp8IndexRowBytes;
      index_view = mem.empty({blocks(), block_size / kpool, index_row}, idx);
      keys = mem.empty({kChunk, kIndexHeadDim}, DType::bf16);
      if (kpool > 1) {
        gates = mem.empty({kChunk, kIndexHeadDim}, DType::bf16);
        ape = mem.empty({kpool, kIndexHeadDim}, DType::f32);
        mem.upload(ape, rng.floats(size_t(kpool) * kIndexHeadDim).data());
      }
    }
  }

  // The pooled index cache's slot of a request's pool: the block of the pool's tokens, block_size / kpool rows.
  int64_t pool_slot(int request, int64_t pool) const {
    const int64_t rows = block_size / kpool;
    return static_cast<int64_t>(block_table[request * blocks_per_request + pool * kpool / block_size]) * rows +
           pool % rows;
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
      w.slot_mapping = first_rows(slot_mapping, m);
      w.cache = mla_view;
      mem.upload(w.latent, rng.bf16(m * kMlaLatentDim).data());
      if (k_pe.defined()) {
        w.k_pe = first_rows(k_pe, m);
        mem.upload(w.k_pe, rng.bf16(m * head.rope_dim).data());
      }
      mem.upload(w.slot_mapping, slots.data());
      write_mla_cache(w, &be);
      if (index_view.defined() && kpool == 1) {
        const WriteIndexCacheArgs wi{first_rows(keys, m), w.slot_mapping, index_view};
        mem.upload(wi.k, rng.bf16(m * kIndexHeadDim).data());
        write_index_cache(wi, &be);
      }
    }
    if (index_view.defined() && kpool > 1) write_pools(be, rng, batch, from, to);
  }

  // The pools that positions [from, to) complete, each from kpool tokens' random keys and gates.
  void write_pools(const Backend& be, Random& rng, int batch, int64_t from, int64_t to) {
    const int64_t first = (from + kpool - 1) / kpool, last = to / kpool;  // pools [first, last) complete here
    const int64_t per_request = last - first, n = per_request * batch, per_call = kChunk / kpool;
    for (int64_t start = 0; start < n; start += per_call) {
      const int64_t m = std::min(per_call, n - start);
      std::vector<int64_t> slots(m);
      for (int64_t i = 0; i < m; ++i)
        slots[i] = pool_slot(static_cast<int>((start + i) / per_request), first + (start + i) % per_request);
      const WritePooledIndexCacheArgs w{pools_of(keys, m), pools_of(gates, m), ape, first_rows(slot_mapping, m),
                                        index_view};
      mem.upload(w.k, rng.bf16(m * kpool * kIndexHeadDim).data());
      mem.upload(w.gate, rng.bf16(m * kpool * kIndexHeadDim).data());
      mem.upload(w.slot_mapping, slots.data());
      write_pooled_index_cache(w, &be);
    }
  }

  // The first m pools of a contiguous [rows, 128] staging buffer, as [m, kpool, 128].
  TensorView pools_of(TensorView v, int64_t m) const {
    v.ndim = 3;
    v.shape = {m, kpool, kIndexHeadDim, 0, 0, 0};
    v.strides = {kpool * kIndexHeadDim, kIndexHeadDim, 1, 0, 0, 0};
    return v;
  }
};

// Rows [start, start + n) of a contiguous [N, ...] view.
TensorView rows_of(TensorView v, int64_t start, int64_t n) {
  v.data = static_cast<char*>(v.data) + start * v.strides[0] * static_cast<int64_t>(dtype_size(v.dtype));
  v.shape[0] = n;
  return v;
}

// Every step's new data, generated on the host and uploaded before the timed loop, so that the loop runs the ops
// alone: kVariants sets of the per-token inputs (new cache rows, queries, indexer weights), used in turn (the
// values do not change an op's time), and each step's own slots and context lengths.
struct StepData {
  static constexpr int64_t kVariants = 4;
  int64_t batch, variants, kpool;
  TensorView latent, k_pe, keys, slot_mapping;  // [variants * B, ...] rows; slot_mapping [steps * B]
  TensorView q, index_q, weights, context_lens;  // [variants * B, ...]; context_lens [steps * B]
  // Pooled indexer: each step's pool slots ([steps * B]; -1 when the step completes no pool), the completed pool's
  // keys and gates ([variants * B, kpool, 128]) and the whole pools each token sees ([steps * B]).
  TensorView pool_slots, pool_keys, pool_gates, pool_lens;
  std::vector<bool> completes_pool;  // per step

  StepData(Memory& mem, Random& rng, const JobOptions& o, const PagedCaches& caches, int heads, DType q_dtype,
           int index_heads)
      : batch(o.batch), variants(std::min<int64_t>(kVariants, o.steps)), kpool(caches.kpool) {
    const int64_t rows = variants * batch, steps = int64_t(o.steps) * batch;
    const bool sparse = index_heads > 0;
    const MlaHead head = caches.head;
    latent = mem.empty({rows, kMlaLatentDim}, DType::bf16);
    q = mem.empty({rows, heads, head.qk_dim()}, q_dtype);
    mem.upload(latent, rng.bf16(size_t(rows) * kMlaLatentDim).data());
    if (head.rope_dim > 0) {
      k_pe = mem.empty({rows, head.rope_dim}, DType::bf16);
      mem.upload(k_pe, rng.bf16(size_t(rows) * head.rope_dim).data());
    }
    mem.upload(q, rng.half(size_t(rows) * heads * head.qk_dim(), q_dtype).data());
    std::vector<int64_t> slots(steps), pools(steps);
    std::vector<int32_t> lens(steps), whole(steps);
    for (int64_t i = 0; i < steps; ++i) {
      const int64_t pos = o.context - 1 + i / batch;  // the new token of request i % batch at step i / batch
      slots[i] = caches.slot(static_cast<int>(i % batch), pos);
      lens[i] = static_cast<int32_t>(pos + 1);
      whole[i] = static_cast<int32_t>((pos + 1) / kpool);
      pools[i] = (pos + 1) % kpool == 0 ? caches.pool_slot(static_cast<int>(i % batch), pos / kpool) : -1;
    }
    for (int s = 0; s < o.steps; ++s) completes_pool.push_back(pools[int64_t(s) * batch] >= 0);
    slot_mapping = mem.empty({steps}, DType::i64);
    context_lens = mem.empty({steps}, DType::i32);
    mem.upload(slot_mapping, slots.data());
    mem.upload(context_lens, lens.data());
    if (!sparse) return;
    if (kpool > 1) {
      pool_slots = mem.empty({steps}, DType::i64);
      pool_lens = mem.empty({steps}, DType::i32);
      pool_keys = mem.empty({rows, kpool, kIndexHeadDim}, DType::bf16);
      pool_gates = mem.empty({rows, kpool, kIndexHeadDim}, DType::bf16);
      mem.upload(pool_slots, pools.data());
      mem.upload(pool_lens, whole.data());
      mem.upload(pool_keys, rng.bf16(size_t(rows) * kpool * kIndexHeadDim).data());
      mem.upload(pool_gates, rng.bf16(size_t(rows) * kpool * kIndexHeadDim).data());
    }
    keys = mem.empty({rows, kIndexHeadDim}, DType::bf16);
    index_q = mem.empty({rows, index_heads, kIndexHeadDim}, DType::bf16);
    weights = mem.empty({rows, index_heads}, DType::f32);
    mem.upload(keys, rng.bf16(size_t(rows) * kIndexHeadDim).data());
    mem.upload(index_q, rng.bf16(size_t(rows) * index_heads * kIndexHeadDim).data());
    std::vector<float> w(size_t(rows) * index_heads);
    for (auto& x : w) x = std::fabs(rng.next()) / std::sqrt(static_cast<float>(index_heads * kIndexHeadDim));
    mem.upload(weights, w.data());
  }

  // Step s's rows of a per-token input ([variants * B, ...]) and of a per-step one ([steps * B]).
  TensorView variant(const TensorView& v, int s) const { return rows_of(v, (s % variants) * batch, batch); }
  TensorView step(const TensorView& v, int s) const { return rows_of(v, int64_t(s) * batch, batch); }

  // Step s's cache writes: its new tokens' rows at their slots.
  WriteMlaCacheArgs mla_write(const TensorView& cache, int s) const {
    return {variant(latent, s), k_pe.defined() ? variant(k_pe, s) : TensorView{}, step(slot_mapping, s), cache};
  }
  WriteIndexCacheArgs index_write(const TensorView& cache, int s) const {
    return {variant(keys, s), step(slot_mapping, s), cache};
  }
  WritePooledIndexCacheArgs pool_write(const TensorView& cache, const TensorView& ape, int s) const {
    return {variant(pool_keys, s), variant(pool_gates, s), ape, step(pool_slots, s), cache};
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
  for (TensorView* v : {&one.topk_length, &one.extra_indices, &one.extra_topk_length})
    if (v->defined()) *v = row_of(*v, t);
  const reference::RefAttention ref = reference::ref_sparse_mla(one);
  const int64_t h = a.q.size(1);
  for (int64_t i = 0; i < h * kMlaVDim; ++i) {
    const uint16_t bits = one.out.ptr<uint16_t>()[i];
    const double got = one.out.dtype == DType::bf16 ? numeric::bf16_to_float(bits) : numeric::f16_to_float(bits);
    r.note_error(std::fabs(got - ref.out[i]));
  }
  for (int64_t i = 0; i < h; ++i) r.note_error(std::fabs(static_cast<double>(one.lse.ptr<float>()[i]) - ref.lse[i]));
}

// The sampled tokens' top-k (host views of the op's args; `k` per token) against the reference's sets: a position
// outside the reference's set is a mismatch unless its score ties the k-th best within float rounding.
void check_topk(const IndexerTopkArgs& hidx, int k, Report& r) {
  const int32_t* topk = hidx.topk.ptr<int32_t>();
  for (int64_t t : sample_tokens(static_cast<int>(hidx.q.shape[0]))) {
    const std::vector<double> scores = reference::ref_indexer_scores(hidx, t);
    const std::vector<int32_t> want = reference::ref_topk_of_scores(scores, k);
    const auto last = std::find(want.begin(), want.end(), -1);
    const auto valid = std::count_if(topk + t * k, topk + (t + 1) * k, [](int32_t g) { return g >= 0; });
    if (valid != last - want.begin()) r.topk_match = false;
    if (last == want.begin()) continue;  // nothing to choose from
    const double kth = scores[*(last - 1)];
    for (int64_t i = t * k; i < (t + 1) * k; ++i) {
      const int32_t g = topk[i];
      if (g < 0 || std::find(want.begin(), last, g) != last) continue;
      if (std::fabs(scores[g] - kth) > 1e-5 * std::fabs(kth) + 1e-7) r.topk_match = false;
    }
  }
}

Report run_sparse(const JobOptions& o, const AttentionSpec& spec, const RunSpec& run, const Backend& be, Memory& mem,
                  bool quiet) {
  Report r;
  Random rng(o.seed);
  const int B = o.batch, H = heads_per_rank(spec, run), HI = spec.indexer->heads, K = spec.indexer->topk;
  const int kpool = spec.indexer->kpool, KP = K / kpool, width = KP * kpool + (kpool - 1);  // pools; positions
  // (The selection has already refused a block size that is not a multiple of kpool.)
  if (K % kpool != 0)
    fail("--model: the pooled indexer selects whole pools: index_topk " + std::to_string(K) +
         " must be a multiple of index_kpool " + std::to_string(kpool));
  const DType kv = run.resolved_kv_cache_dtype();
  const MlaHead head = spec_head(spec);
  PagedCaches caches(mem, o, kv, head, true, kpool, rng);
  if (o.context > 1) caches.write(be, rng, B, 0, o.context - 1);

  const auto t0 = Clock::now();
  const StepData data(mem, rng, o, caches, H, run.q_dtype, HI);
  r.step_data_s = seconds_since(t0);

  std::vector<int32_t> request_ids(B);
  std::iota(request_ids.begin(), request_ids.end(), 0);
  IndexerTopkArgs idx;
  idx.index_cache = caches.index_view;
  idx.request_ids = mem.empty({B}, DType::i32);
  idx.block_table = caches.table;
  idx.topk = mem.empty({B, KP}, DType::i32);
  idx.sorted = false;  // as the layer (and smla's vLLM plugin) asks: the attention needs no order
  mem.upload(idx.request_ids, request_ids.data());
  PoolsToPositionsArgs p2p;  // pooled: the top pools -> their tokens and the tail's
  p2p.pools = idx.topk;
  p2p.kpool = kpool;
  if (kpool > 1) p2p.positions = mem.empty({B, width}, DType::i32);
  PositionsToSlotsArgs p2s;
  p2s.positions = kpool > 1 ? p2p.positions : idx.topk;
  p2s.request_ids = idx.request_ids;
  p2s.block_table = caches.table;
  p2s.block_size = caches.block_size;
  p2s.slots = mem.empty({B, width}, DType::i32);
  SparseMlaArgs attn;
  attn.kv_cache = caches.mla_view;
  attn.indices = p2s.slots;
  attn.softmax_scale = static_cast<float>(spec.softmax_scale);
  attn.out = mem.empty({B, H, head.v_dim()}, run.q_dtype);
  attn.lse = mem.empty({B, H}, DType::f32);
  // With a plain indexer (dsa_decode_step has no pooled form), the step also as one call, as an engine calls it: on
  // the ops' inputs, into outputs of its own.
  const bool one_call = kpool == 1;
  DsaDecodeStepArgs fused;
  if (one_call) {
    fused.indexer = idx;
    fused.indexer.topk = mem.empty({B, K}, DType::i32);
    fused.slots = mem.empty({B, K}, DType::i32);
    fused.kv_cache = attn.kv_cache;
    fused.softmax_scale = attn.softmax_scale;
    fused.out = mem.empty({B, H, head.v_dim()}, run.q_dtype);
    fused.lse = mem.empty({B, H}, DType::f32);
  }

  // On the CUDA backend the op's two stages (scores, then the selection) are timed apart: the same kernels
  // indexer_topk runs one after the other, with a scores buffer of their own.
  const bool split_indexer = kWithCuda && be.name() == "cuda_mma";
  TensorView scores;
#if SMLA_WITH_CUDA
  if (split_indexer) scores = mem.empty({B, cuda::score_row_stride(idx)}, DType::f32);
#endif

  // Step s's inputs, into the ops' args and the one-call step's.
  const auto set_inputs = [&](int s) {
    idx.q = data.variant(data.index_q, s);
    idx.weights = data.variant(data.weights, s);
    idx.context_lens = data.step(kpool > 1 ? data.pool_lens : data.context_lens, s);
    p2p.context_lens = data.step(data.context_lens, s);
    attn.q = data.variant(data.q, s);
    fused.indexer.q = idx.q;
    fused.indexer.weights = idx.weights;
    fused.indexer.context_lens = idx.context_lens;
    fused.q = attn.q;
  };
  if (one_call) {  // its workspace, made once (none on the CPU)
    set_inputs(0);
    if (const size_t bytes = workspace_size(fused, &be); bytes > 0)
      fused.workspace = mem.empty({static_cast<int64_t>(bytes)}, DType::u8);
  }

  // Step s, each op timed alone into `t`, then the one-call step.
  const auto step = [&](int s, Timings& t) {
    const WriteMlaCacheArgs mla_write = data.mla_write(caches.mla_view, s);
    t.write += timed(mem, [&] { write_mla_cache(mla_write, &be); });
    if (kpool == 1) {
      const WriteIndexCacheArgs index_write = data.index_write(caches.index_view, s);
      t.write += timed(mem, [&] { write_index_cache(index_write, &be); });
    } else if (data.completes_pool[s]) {  // an engine keeps the pool's tokens until the last one arrives
      const WritePooledIndexCacheArgs pool_write = data.pool_write(caches.index_view, caches.ape, s);
      t.write += timed(mem, [&] { write_pooled_index_cache(pool_write, &be); });
    }
    set_inputs(s);
    if (split_indexer) {
#if SMLA_WITH_CUDA
      t.indexer += timed(mem, [&] { cuda::indexer_scores(idx, scores.ptr<float>()); });
      t.topk += timed(mem, [&] { cuda::select_topk(idx, scores.ptr<float>()); });
#endif
    } else {
      t.indexer += timed(mem, [&] { indexer_topk(idx, &be); });
    }
    if (kpool > 1) t.slots += timed(mem, [&] { pools_to_positions(p2p, &be); });
    t.slots += timed(mem, [&] { positions_to_slots(p2s, &be); });
    t.attention += timed(mem, [&] { sparse_mla(attn, &be); });
    if (one_call) t.step += timed(mem, [&] { dsa_decode_step(fused, &be); });
  };
  Timings warm_up;
  step(0, warm_up);  // untimed: first calls allocate (per-thread scratch on the CPU, the default workspace on a GPU)

  Progress progress(o.steps, quiet);
  for (int s = 0; s < o.steps; ++s) {
    const int64_t pos = o.context - 1 + s;  // the new token of every request
    step(s, r.t);
    const int64_t whole_pools = (pos + 1) / kpool, attended = std::min<int64_t>(KP, whole_pools) * kpool +
                                                                    (pos + 1) % kpool;  // pools, then the tail
    r.bytes_indexer += static_cast<double>(B) * whole_pools * index_row_bytes(caches.index_view.dtype);
    r.bytes_attention += static_cast<double>(B) * attended * mla_row_bytes(kv, head);
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
  check_topk(hidx, KP, r);  // top-k of positions, or of pools when pooled
  for (int64_t t : sample_tokens(B)) {
    compare_attention(hattn, t, r);
    ++r.checked_tokens;
  }
  // The one-call step ran the same kernels on the same inputs: its out and lse must be the ops', bit for bit.
  if (one_call) {
    std::vector<uint8_t> own;
    const auto same = [&](const TensorView& v, const TensorView& ops) {
      return std::memcmp(mem.on_host(v, own).data, ops.data, v.numel() * dtype_size(v.dtype)) == 0;
    };
    r.step_matches_ops = same(fused.out, hattn.out) && same(fused.lse, hattn.lse);
  }
  return r;
}

Report run_dense(const JobOptions& o, const AttentionSpec& spec, const RunSpec& run, const Backend& be, Memory& mem,
                 bool quiet) {
  Report r;
  Random rng(o.seed);
  const int B = o.batch, H = heads_per_rank(spec, run);
  const DType kv = run.resolved_kv_cache_dtype();
  const MlaHead head = spec_head(spec);
  PagedCaches caches(mem, o, kv, head, false, 1, rng);
  if (o.context > 1) caches.write(be, rng, B, 0, o.context - 1);
  const auto t0 = Clock::now();
  const StepData data(mem, rng, o, caches, H, run.q_dtype, 0);
  r.step_data_s = seconds_since(t0);
  PagedMlaDecodeArgs a;
  a.kv_cache = caches.mla_view;
  a.block_table = caches.table;
  a.softmax_scale = static_cast<float>(spec.softmax_scale);
  a.out = mem.empty({B, 1, H, head.v_dim()}, run.q_dtype);
  a.lse = mem.empty({B, 1, H}, DType::f32);
  const auto step = [&](int s, Timings& t) {
    const WriteMlaCacheArgs mla_write = data.mla_write(caches.mla_view, s);
    t.write += timed(mem, [&] { write_mla_cache(mla_write, &be); });
    a.q = data.variant(data.q, s);
    a.q.ndim = 4;  // [B, s_q = 1, H, 576 | 512]
    a.q.shape = {B, 1, H, head.qk_dim(), 0, 0};
    a.q.strides = {H * head.qk_dim(), H * head.qk_dim(), head.qk_dim(), 1, 0, 0};
    a.seq_lens = data.step(data.context_lens, s);
    t.attention += timed(mem, [&] { paged_mla_decode(a, &be); });
  };
  Timings warm_up;
  step(0, warm_up);  // untimed: first calls allocate (per-thread scratch on the CPU, the default workspace on a GPU)

  Progress progress(o.steps, quiet);
  for (int s = 0; s < o.steps; ++s) {
    const int64_t pos = o.context - 1 + s;
    step(s, r.t);
    r.bytes_attention += static_cast<double>(B) * (pos + 1) * mla_row_bytes(kv, head);
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
      r.note_error(std::fabs(got - ref.out[i]));
    }
    ++r.checked_tokens;
  }
  return r;
}

// DeepSeek-V4's caches for the job: per request a window of the last `window` tokens (a ring of slots through
// its own blocks) and, for each compress ratio r > 0 of the model, a compressed cache of one entry per complete group
// of r tokens (written as each group completes; its content the model's compressor's, random here) with, for the
// ratio the indexer serves (4), one index key per entry. Each layer of a model has caches of its own, read cold:
// `copies` of them (up to the kind's layers, as many as make kColdBytes) share one block table and are used in turn,
// step by step, so a GPU's L2 does not keep a few MB of window between steps.
struct V4Paged : BlockTable {
  static constexpr double kColdBytes = 256e6;  // well past an H200's 50 MB of L2, and a CPU's last-level cache
  int64_t entries;
  std::vector<TensorView> caches, indexes;  // the copies (indexes: none without an index cache)

  V4Paged(Memory& mem, const JobOptions& o, int64_t entries_, DType kv, MlaHead head, bool with_index, int layers,
          uint64_t seed)
      : BlockTable(mem, o.batch, entries_, o.common.run.block_size, seed), entries(entries_) {
    const DType idx = index_cache_dtype(kv);
    const int index_row = idx == DType::bf16 ? kIndexHeadDim : kFp8IndexRowBytes;
    const double bytes = double(blocks()) * block_size *
                         (mla_row_bytes(kv, head) + (with_index ? index_row_bytes(idx) : 0));
    const int copies = static_cast<int>(std::clamp<double>(std::ceil(kColdBytes / bytes), 1, std::max(layers, 1)));
    for (int c = 0; c < copies; ++c) {
      caches.push_back(mem.empty({blocks(), block_size, head.cache_row(kv)}, kv));
      if (with_index) indexes.push_back(mem.empty({blocks(), block_size, index_row}, idx));
    }
  }
  const TensorView& cache(int step) const { return caches[step % caches.size()]; }
  TensorView index(int step) const { return indexes.empty() ? TensorView{} : indexes[step % indexes.size()]; }
};

// One kind of V4 layer (its compress ratio: 0 the window only) in the job: how many layers of the model run it, and
// its step's times and bytes.
struct V4Kind {
  int ratio = 0, layers = 0;
  Report r;
};

// The V4 job: each step of `steps`, the new token of every request is written into the window cache (and, completing
// a group, into the compressed cache), then the layer's attention runs over the window and its compressed entries
// (ratio 4: the indexer's top-k of them; others: all) under one softmax, each op timed alone; each kind of layer in
// turn, with caches of its own.
std::vector<V4Kind> run_v4(const JobOptions& o, const AttentionSpec& spec, const RunSpec& run, const Backend& be,
                           Memory& mem, bool quiet) {
  Random rng(o.seed);
  const int B = o.batch, H = heads_per_rank(spec, run), W = spec.sliding_window;
  const DType kv = run.resolved_kv_cache_dtype();
  const MlaHead head = spec_head(spec);
  std::map<int, int> layers_per_ratio;
  for (int ratio : spec.compress_ratios) ++layers_per_ratio[ratio];
  if (spec.compress_ratios.empty()) layers_per_ratio[0] = spec.num_layers;  // a window in every layer, nothing else
  require(W > 0 && spec.num_layers > 0,
          "--model " + spec.name + ": smla run needs DeepSeek-V4's window (sliding_window " + std::to_string(W) +
              ") and its layers (num_hidden_layers " + std::to_string(spec.num_layers) + ") to be above 0");
  const int64_t last = int64_t(o.context) - 1 + o.steps;  // positions [0, last) when the job ends
  const auto indexed = [&](int ratio) { return ratio == 4 && spec.indexer.has_value(); };
  for (const auto& [ratio, layers] : layers_per_ratio)
    if (ratio > 0 && !indexed(ratio))  // every entry attended: one list, at most kMaxTopk
      require(last / ratio <= kMaxTopk,
              "--context " + std::to_string(o.context) + " + --steps " + std::to_string(o.steps) + ": the layers of " +
                  "compress ratio " + std::to_string(ratio) + " would attend " + std::to_string(last / ratio) +
                  " compressed entries, more than the " + std::to_string(kMaxTopk) + " sparse_mla takes");

  // Writes new random rows (and index keys) at `slots` through the library's writers, kChunk at a time: their seconds.
  constexpr int64_t kChunk = 4096;
  const int64_t staged = std::max<int64_t>(B, kChunk);
  const TensorView latent = mem.empty({staged, kMlaLatentDim}, DType::bf16),
                   keys = mem.empty({staged, kIndexHeadDim}, DType::bf16), mapping = mem.empty({staged}, DType::i64);
  const auto write_rows = [&](const TensorView& cache, const TensorView& index, const std::vector<int64_t>& slots) {
    double seconds = 0;
    for (size_t first = 0; first < slots.size(); first += staged) {
      const int64_t n = std::min<int64_t>(staged, static_cast<int64_t>(slots.size() - first));
      const WriteMlaCacheArgs w{first_rows(latent, n), {}, first_rows(mapping, n), cache};
      mem.upload(w.latent, rng.bf16(size_t(n) * kMlaLatentDim).data());
      mem.upload(w.slot_mapping, slots.data() + first);
      seconds += timed(mem, [&] { write_mla_cache(w, &be); });
      if (index.defined()) {
        const WriteIndexCacheArgs wi{first_rows(keys, n), w.slot_mapping, index};
        mem.upload(wi.k, rng.bf16(size_t(n) * kIndexHeadDim).data());
        seconds += timed(mem, [&] { write_index_cache(wi, &be); });
      }
    }
    return seconds;
  };
  // Every slot of every copy written before the first step (the window's whole ring, every entry the steps will
  // reach), so no attended slot is memory never written; the steps then write theirs as they come.
  const auto fill = [&](const V4Paged& p) {
    std::vector<int64_t> slots;
    for (int b = 0; b < B; ++b)
      for (int64_t e = 0; e < p.entries; ++e) slots.push_back(p.slot(b, e));
    for (size_t c = 0; c < p.caches.size(); ++c) write_rows(p.caches[c], p.index(static_cast<int>(c)), slots);
  };

  // The steps' queries (kVariants sets, in turn) and host-built lists: the window's slots (the token's last W
  // positions, -1 padded), the indexed ratio's entry counts and the other ratios' every entry.
  const auto t0 = Clock::now();
  const int variants = std::min(4, o.steps);
  const TensorView q = mem.empty({int64_t(variants) * B, H, head.qk_dim()}, run.q_dtype);
  mem.upload(q, rng.half(size_t(variants) * B * H * head.qk_dim(), run.q_dtype).data());
  const int HI = spec.indexer ? spec.indexer->heads : 0, K = spec.indexer ? spec.indexer->topk : 0;
  TensorView index_q, weights;
  if (HI > 0) {
    index_q = mem.empty({int64_t(variants) * B, HI, kIndexHeadDim}, DType::bf16);
    weights = mem.empty({int64_t(variants) * B, HI}, DType::f32);
    mem.upload(index_q, rng.bf16(size_t(variants) * B * HI * kIndexHeadDim).data());
    std::vector<float> w(size_t(variants) * B * HI);
    for (auto& x : w) x = std::fabs(rng.next()) / std::sqrt(static_cast<float>(HI * kIndexHeadDim));
    mem.upload(weights, w.data());
  }
  const int64_t steps_rows = int64_t(o.steps) * B;
  const auto upload_i32 = [&](const std::vector<int32_t>& v, int64_t cols) {
    const TensorView t = cols > 0 ? mem.empty({steps_rows, cols}, DType::i32) : mem.empty({steps_rows}, DType::i32);
    mem.upload(t, v.data());
    return t;
  };
  const double queries_s = seconds_since(t0);
  std::vector<V4Kind> kinds;
  for (const auto& [ratio, layers] : layers_per_ratio) {
    V4Kind k{ratio, layers, {}};
    // The kind's caches (one block table per cache kind and ratio, so the lists below hold for every copy).
    const V4Paged window(mem, o, W, kv, head, false, layers, o.seed);
    std::optional<V4Paged> comp;
    if (ratio > 0) comp.emplace(mem, o, last / ratio, kv, head, indexed(ratio), layers, o.seed + ratio);
    fill(window);
    if (comp) fill(*comp);
    const auto lists_t0 = Clock::now();
    std::vector<int32_t> window_slots(size_t(steps_rows) * W, -1), counts(steps_rows), every;
    const int64_t most = ratio > 0 ? std::max<int64_t>(last / ratio, 1) : 0;
    if (ratio > 0 && !indexed(ratio)) every.assign(size_t(steps_rows) * most, -1);
    for (int s = 0; s < o.steps; ++s)
      for (int b = 0; b < B; ++b) {
        const int64_t pos = o.context - 1 + s, row = int64_t(s) * B + b;
        for (int64_t i = 0; i < W && pos - i >= 0; ++i)
          window_slots[row * W + i] = static_cast<int32_t>(window.slot(b, (pos - i) % W));
        if (ratio == 0) continue;
        counts[row] = static_cast<int32_t>((pos + 1) / ratio);
        if (!indexed(ratio))
          for (int64_t e = 0; e < counts[row]; ++e) every[row * most + e] = static_cast<int32_t>(comp->slot(b, e));
      }
    const TensorView window_indices = upload_i32(window_slots, W);
    const TensorView entry_counts = upload_i32(counts, 0);
    const TensorView all_entries = every.empty() ? TensorView{} : upload_i32(every, most);
    k.r.step_data_s = queries_s + seconds_since(lists_t0);

    std::vector<int32_t> request_ids(B);
    std::iota(request_ids.begin(), request_ids.end(), 0);
    const TensorView requests = mem.empty({B}, DType::i32);
    mem.upload(requests, request_ids.data());
    SparseMlaArgs attn;
    attn.softmax_scale = static_cast<float>(spec.softmax_scale);
    attn.out = mem.empty({B, H, head.v_dim()}, run.q_dtype);
    attn.lse = mem.empty({B, H}, DType::f32);
    IndexerTopkArgs idx;
    PositionsToSlotsArgs p2s;
    if (indexed(ratio)) {
      idx.request_ids = requests;
      idx.block_table = comp->table;
      idx.topk = mem.empty({B, K}, DType::i32);
      idx.sorted = false;  // the attention needs no order
      p2s = {idx.topk, requests, comp->table, comp->block_size, mem.empty({B, K}, DType::i32)};
    }
    // Step s: its caches (copy s of each), the writes (the window's row, a completed group's entry), then the ops.
    std::vector<int64_t> slots(B);
    const auto step = [&](int s, Timings& t) {
      const int64_t pos = o.context - 1 + s;
      attn.kv_cache = window.cache(s);
      for (int b = 0; b < B; ++b) slots[b] = window.slot(b, pos % W);
      t.write += write_rows(attn.kv_cache, {}, slots);
      attn.q = rows_of(q, int64_t(s % variants) * B, B);
      attn.indices = rows_of(window_indices, int64_t(s) * B, B);
      if (ratio > 0) {
        attn.extra_kv_cache = comp->cache(s);
        if ((pos + 1) % ratio == 0) {
          for (int b = 0; b < B; ++b) slots[b] = comp->slot(b, (pos + 1) / ratio - 1);
          t.write += write_rows(attn.extra_kv_cache, comp->index(s), slots);
        }
      }
      if (indexed(ratio)) {
        idx.index_cache = comp->index(s);
        idx.q = rows_of(index_q, int64_t(s % variants) * B, B);
        idx.weights = rows_of(weights, int64_t(s % variants) * B, B);
        idx.context_lens = rows_of(entry_counts, int64_t(s) * B, B);
        t.indexer += timed(mem, [&] { indexer_topk(idx, &be); });
        t.slots += timed(mem, [&] { positions_to_slots(p2s, &be); });
        attn.extra_indices = p2s.slots;
      } else if (ratio > 0) {
        attn.extra_indices = rows_of(all_entries, int64_t(s) * B, B);
      }
      t.attention += timed(mem, [&] { sparse_mla(attn, &be); });
    };
    Timings warm_up;
    step(0, warm_up);  // untimed: first calls allocate
    Progress progress(o.steps, quiet);
    for (int s = 0; s < o.steps; ++s) {
      const int64_t pos = o.context - 1 + s;
      step(s, k.r.t);
      const int64_t entries = ratio > 0 ? (pos + 1) / ratio : 0;
      const int64_t extra = indexed(ratio) ? std::min<int64_t>(K, entries) : entries;
      if (indexed(ratio)) k.r.bytes_indexer += double(B) * entries * index_row_bytes(idx.index_cache.dtype);
      k.r.bytes_attention += double(B) * (std::min<int64_t>(W, pos + 1) + extra) * mla_row_bytes(kv, head);
      progress.update(s + 1, 1e3 * k.r.t.total() / (s + 1));
    }

    // Spot check of the last step on the host: the indexer's top-k sets (ratio 4) and the attention rows.
    std::vector<std::vector<uint8_t>> copies(14);
    int c = 0;
    SparseMlaArgs h = attn;
    for (TensorView* v : {&h.q, &h.kv_cache, &h.indices, &h.out, &h.lse}) *v = mem.on_host(*v, copies[c++]);
    if (ratio > 0)
      for (TensorView* v : {&h.extra_kv_cache, &h.extra_indices}) *v = mem.on_host(*v, copies[c++]);
    if (indexed(ratio)) {
      IndexerTopkArgs hidx = idx;
      for (TensorView* v : {&hidx.q, &hidx.weights, &hidx.index_cache, &hidx.request_ids, &hidx.block_table,
                            &hidx.context_lens, &hidx.topk})
        *v = mem.on_host(*v, copies[c++]);
      check_topk(hidx, K, k.r);
    }
    for (int64_t t : sample_tokens(B)) {
      compare_attention(h, t, k.r);
      ++k.r.checked_tokens;
    }
    kinds.push_back(std::move(k));
  }
  return kinds;
}

// The V4 job's report as one layer's: the kinds' times and bytes weighted by their layer counts (so a step is the
// mean layer's, and the per-user line sums every layer's), their checks together (the same sampled tokens in each).
Report mean_layer(const std::vector<V4Kind>& kinds) {
  Report m;
  double layers = 0;
  for (const V4Kind& k : kinds) layers += k.layers;
  for (const V4Kind& k : kinds) {
    const double w = k.layers / layers;
    m.t.write += w * k.r.t.write;
    m.t.indexer += w * k.r.t.indexer;
    m.t.slots += w * k.r.t.slots;
    m.t.attention += w * k.r.t.attention;
    m.bytes_indexer += w * k.r.bytes_indexer;
    m.bytes_attention += w * k.r.bytes_attention;
    m.step_data_s += k.r.step_data_s;
    m.checked_tokens = k.r.checked_tokens;  // the same tokens in each kind
    m.note_error(k.r.max_abs_err);
    m.topk_match = m.topk_match && k.r.topk_match;
  }
  return m;
}

// Whether any kind of V4 layer ran the indexer's top-k (its ratio-4 layers).
bool layers_with_topk(const std::vector<V4Kind>& kinds) {
  return std::any_of(kinds.begin(), kinds.end(), [](const V4Kind& k) { return k.r.t.indexer > 0; });
}

}  // namespace

int run_ops(const JobOptions& o, const Resolved& res, const Backend& be, Memory& mem) {
  const double bw = mem.bandwidth_gbs();
  if (!o.common.json)
    std::cout << "job        " << o.batch << " requests x " << o.context << " tokens of context, " << o.steps
              << " decode steps on " << be.name() << " (memory bandwidth measured now: " << bw << " GB/s)\n";
  // DeepSeek-V4: a window cache in every layer and a compressed one beside it in most, each kind of layer timed.
  const bool v4 = res.spec.sliding_window > 0 || res.spec.has_compressed_cache();
  const bool sparse = res.spec.is_sparse();
  const std::vector<V4Kind> kinds = v4 ? run_v4(o, res.spec, res.run, be, mem, o.common.json) : std::vector<V4Kind>{};
  const Report r = v4       ? mean_layer(kinds)
                   : sparse ? run_sparse(o, res.spec, res.run, be, mem, o.common.json)
                            : run_dense(o, res.spec, res.run, be, mem, o.common.json);

  const double step_ms = 1e3 * r.t.total() / o.steps;
  const double read_s = r.t.indexer + r.t.topk + r.t.attention;
  const double gbs = (r.bytes_indexer + r.bytes_attention) / read_s / 1e9;
  const double tokens_per_s = o.batch * o.steps / r.t.total();
  const bool ok = r.topk_match && r.max_abs_err < 2e-2 && r.step_matches_ops;
  // What one user waits for per generated token: this step (Timings::user_step: the cache writes and the one-call
  // step where it was timed, else every op above) once per layer that runs this attention; attention alone, so an
  // upper bound on the tokens/s a whole model gives a user.
  const AttentionSpec& spec = res.spec;
  const int layers = spec.num_attention_layers > 0 ? spec.num_attention_layers : spec.num_layers;
  const double token_ms = 1e3 * r.t.user_step() / o.steps * layers;
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
                        {"step_data_s", r.step_data_s},
                        {"cache_read_gbs", gbs},
                        {"memory_bandwidth_gbs", bw},
                        {"check", {{"tokens", r.checked_tokens}, {"max_abs_err", r.max_abs_err},
                                   {"topk_match", r.topk_match}, {"passed", ok}}}};
    if (r.t.split()) {
      j["ms_per_step"]["indexer_scores"] = 1e3 * r.t.indexer / o.steps;
      j["ms_per_step"]["topk"] = 1e3 * r.t.topk / o.steps;
    }
    if (r.t.one_call()) {
      j["ms_per_step"]["dsa_decode_step"] = 1e3 * r.t.step / o.steps;
      j["check"]["step_matches_ops"] = r.step_matches_ops;
    }
    if (layers > 0)
      j["per_user"] = {{"layers", layers}, {"ms_per_token", token_ms}, {"tokens_per_s", 1e3 / token_ms}};
    for (const V4Kind& k : kinds)
      j["layer_kinds"].push_back({{"compress_ratio", k.ratio},
                                  {"layers", k.layers},
                                  {"ms_per_step",
                                   {{"total", 1e3 * k.r.t.total() / o.steps},
                                    {"cache_write", 1e3 * k.r.t.write / o.steps},
                                    {"indexer_topk", 1e3 * k.r.t.indexer / o.steps},
                                    {"slots", 1e3 * k.r.t.slots / o.steps},
                                    {"attention", 1e3 * k.r.t.attention / o.steps}}}});
    std::cout << j.dump(2) << "\n";
  } else {
    // Steps under a millisecond (a few tokens on a GPU) in microseconds, so that each op keeps its digits.
    const bool us = step_ms < 1;
    const char* unit = us ? "us" : "ms";
    auto per_step = [&](double s) { return (us ? 1e6 : 1e3) * s / o.steps; };
    const double step = per_step(r.t.total());
    if (sparse && r.t.split())
      std::printf("\nper step   %.2f %s: cache write %.2f, indexer %.2f, top-k %.2f, slots %.2f, attention %.2f\n",
                  step, unit, per_step(r.t.write), per_step(r.t.indexer), per_step(r.t.topk), per_step(r.t.slots),
                  per_step(r.t.attention));
    else if (sparse)
      std::printf("\nper step   %.2f %s: cache write %.2f, indexer+top-k %.2f, slots %.2f, attention %.2f\n", step,
                  unit, per_step(r.t.write), per_step(r.t.indexer), per_step(r.t.slots), per_step(r.t.attention));
    else
      std::printf("\nper step   %.2f %s: cache write %.2f, paged attention %.2f\n", step, unit, per_step(r.t.write),
                  per_step(r.t.attention));
    if (r.t.one_call())
      std::printf("step       dsa_decode_step as one call: %.2f %s (the ops above called apart: %.2f)\n",
                  per_step(r.t.step), unit, per_step(r.t.total() - r.t.write));
    for (const V4Kind& k : kinds)  // the step above is their mean over the model's layers
      std::printf("           %2d layers, %-33s %.2f %s: cache write %.2f, indexer+top-k %.2f, slots %.2f, "
                  "attention %.2f\n",
                  k.layers,
                  (k.ratio == 0 ? std::string("window only:")
                                : "window + 1/" + std::to_string(k.ratio) + " compressed" +
                                      (k.ratio == 4 && sparse ? " (top-k):" : ":"))
                      .c_str(),
                  per_step(k.r.t.total()), unit, per_step(k.r.t.write), per_step(k.r.t.indexer),
                  per_step(k.r.t.slots), per_step(k.r.t.attention));
    std::printf("throughput %.0f tokens/s; cache bytes read %.1f GB/s = %.0f%% of the measured %.1f GB/s\n",
                tokens_per_s, gbs, 100 * gbs / bw, bw);
    if (sparse && r.t.indexer > 0)
      std::printf("           indexer %.1f GB/s%s, attention %.1f GB/s\n", r.bytes_indexer / r.t.indexer / 1e9,
                  r.t.split() ? " (scores alone)" : "",
                  r.bytes_attention / r.t.attention / 1e9);
    if (layers > 0)
      std::printf("per user   a token runs this step in each of the %d attention layers: %.2f %s (%s) x %d = %.3f ms, "
                  "at most %.1f tokens/s for one user (attention alone)\n",
                  layers, per_step(r.t.user_step()), unit,
                  r.t.one_call() ? "cache write + dsa_decode_step as one call" : "per step above", layers, token_ms,
                  1e3 / token_ms);
    else
      std::printf("per user   unknown: the model does not say how many layers it has (num_hidden_layers)\n");
    if (v4)
      std::printf("host       each op timed alone (%s); the steps' queries, indexer queries and weights and the lists "
                  "of slots were generated and uploaded before the timed loop, in %.2f s, each step's new cache rows "
                  "between the timed ops; neither counted above\n",
                  mem.device().is_cpu() ? "host clock" : "CUDA events", r.step_data_s);
    else
      std::printf("host       each op timed alone (%s); the steps' inputs (new cache rows, queries%s) were generated "
                  "and uploaded before the timed loop, in %.2f s, not counted above\n",
                  mem.device().is_cpu() ? "host clock" : "CUDA events", sparse ? ", indexer queries and weights" : "",
                  r.step_data_s);
    const bool topk_ran = sparse && (!v4 || layers_with_topk(kinds));
    std::printf("check      %d sampled tokens%s vs the float64 reference: %s (max abs error %.2g%s)%s\n",
                r.checked_tokens, v4 ? " in each kind of layer" : "", ok ? "match" : "MISMATCH", r.max_abs_err,
                topk_ran ? (r.topk_match ? ", top-k sets equal" : ", top-k sets differ") : "",
                !r.t.one_call()        ? ""
                : r.step_matches_ops ? "; dsa_decode_step's out and lse equal the ops' bit for bit"
                                     : "; dsa_decode_step's out and lse DIFFER from the ops'");
  }
  return ok ? 0 : 3;
}

}  // namespace smla::cli
