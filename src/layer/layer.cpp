// MlaLayer: projections, norms and RoPE in fp32 (OpenBLAS), the caches and attention through the smla ops, the
// paged-cache block pool. The unabsorbed attention is in unabsorbed.cpp.
#include "smla/layer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>

#include "core/numeric.h"
#include "layer/layer_math.h"
#include "layer/unabsorbed.h"
#include "smla/error.h"
#include "smla/ops.h"

namespace smla {
namespace {

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (const int64_t d : shape) text += (text.size() > 1 ? ", " : "") + std::to_string(d);
  return text + "]";
}

void check_tensor(const WeightTensor& tensor, const char* name, std::vector<int64_t> expected) {
  if (tensor.shape != expected)
    fail(std::string("MlaLayer: weights.") + name + ": expected shape " + shape_text(expected) + ", got " +
         shape_text(tensor.shape));
  require(tensor.data.size() == uint64_t(tensor.numel()), std::string("MlaLayer: weights.") + name + ": shape " +
                                                              shape_text(expected) + " but " +
                                                              std::to_string(tensor.data.size()) + " values");
}

void check_weights(const AttentionWeights& w) {
  const AttentionSpec& s = w.spec;
  validate(s, "MlaLayer: spec");
  require(s.kv_lora_rank == kMlaLatentDim && s.qk_rope_head_dim == kMlaRopeDim,
          "MlaLayer: spec: the kernels need kv_lora_rank 512 and qk_rope_head_dim 64, got " +
              std::to_string(s.kv_lora_rank) + " and " + std::to_string(s.qk_rope_head_dim));
  const int64_t h = s.num_heads, hidden = s.hidden_size, qk = s.qk_head_dim();
  if (s.q_lora_rank > 0) {
    check_tensor(w.q_a, "q_a", {s.q_lora_rank, hidden});
    check_tensor(w.q_a_norm, "q_a_norm", {s.q_lora_rank});
    check_tensor(w.q_b, "q_b", {h * qk, s.q_lora_rank});
  } else {
    check_tensor(w.q, "q", {h * qk, hidden});
  }
  check_tensor(w.kv_a_mqa, "kv_a_mqa", {s.absorbed_qk_dim(), hidden});
  check_tensor(w.kv_a_norm, "kv_a_norm", {s.kv_lora_rank});
  check_tensor(w.kv_b, "kv_b", {h * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank});
  check_tensor(w.o, "o", {hidden, h * s.v_head_dim});
  if (!s.is_sparse()) return;
  const IndexerSpec& ix = *s.indexer;
  require(ix.head_dim == kIndexHeadDim && s.q_lora_rank > 0,
          "MlaLayer: spec: the indexer needs index_head_dim 128 and q_lora_rank > 0, got " +
              std::to_string(ix.head_dim) + " and " + std::to_string(s.q_lora_rank));
  check_tensor(w.indexer.wq_b, "indexer.wq_b", {int64_t(ix.heads) * ix.head_dim, s.q_lora_rank});
  check_tensor(w.indexer.wk, "indexer.wk", {ix.head_dim, hidden});
  check_tensor(w.indexer.k_norm, "indexer.k_norm", {ix.head_dim});
  check_tensor(w.indexer.k_norm_bias, "indexer.k_norm_bias", {ix.head_dim});
  check_tensor(w.indexer.weights_proj, "indexer.weights_proj", {ix.heads, hidden});
}

// Adds the seconds from construction to destruction to *sink (when there is one).
class PhaseTimer {
 public:
  explicit PhaseTimer(double* sink) : sink_(sink), start_(std::chrono::steady_clock::now()) {}
  ~PhaseTimer() {
    if (sink_) *sink_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  double* sink_;
  std::chrono::steady_clock::time_point start_;
};

std::vector<uint16_t> to_half(const std::vector<float>& values, DType dtype) {
  std::vector<uint16_t> out(values.size());
  for (size_t i = 0; i < values.size(); ++i)
    out[i] = dtype == DType::f16 ? numeric::float_to_f16(values[i]) : numeric::float_to_bf16(values[i]);
  return out;
}

}  // namespace

struct MlaLayer::State {
  AttentionWeights w;
  LayerOptions opt;
  float scale = 0;
  std::vector<float> inv_freq;
  DType q_dtype = DType::bf16;  // the attention query's type: the cache's 16-bit type
  int kv_row = 0, index_row = 0;
  std::vector<uint8_t> kv_cache, index_cache;
  std::vector<int32_t> free_blocks;  // a stack: the most recently freed block is reused first
  struct Request {
    bool live = false;
    int length = 0;
    std::vector<int32_t> blocks;
  };
  std::vector<Request> requests;

  const AttentionSpec& spec() const { return w.spec; }
  // Blocks the requests need to grow by the segments' tokens; throws, changing nothing, when the pool has too few.
  void reserve(std::span<const LayerSegment> segments);
  std::vector<int64_t> slots_of(const Request& r, int first, int count) const;
  TensorView kv_view() {
    return TensorView(kv_cache.data(), {opt.num_blocks, opt.block_size, kv_row}, opt.kv_cache_dtype);
  }
  TensorView index_view() {
    return TensorView(index_cache.data(), {opt.num_blocks, opt.block_size, index_row}, opt.index_cache_dtype);
  }
  Request& request(int id, const char* what) {
    require(id >= 0 && id < int(requests.size()) && requests[id].live,
            std::string("MlaLayer: ") + what + ": no live request " + std::to_string(id));
    return requests[id];
  }

  // One pass over rows [row0, row0 + n) of the call: each token's block-table row and position.
  struct Chunk {
    int64_t row0 = 0, n = 0;
    std::vector<int32_t> table_row, position;
  };
  void run_chunk(const Chunk& chunk, const float* hidden, float* out, const std::vector<int32_t>& table,
                 int max_blocks, AttentionPath path, LayerProfile* prof);
};

MlaLayer::MlaLayer(AttentionWeights weights, const LayerOptions& options) : state_(std::make_unique<State>()) {
  check_weights(weights);
  State& st = *state_;
  st.w = std::move(weights);
  st.opt = options;
  const AttentionSpec& s = st.spec();
  require(options.num_blocks > 0 && options.block_size > 0 && options.max_chunk_tokens > 0,
          "MlaLayer: options: num_blocks, block_size and max_chunk_tokens must be positive");
  const DType kv = options.kv_cache_dtype, ix = options.index_cache_dtype;
  require(kv == DType::bf16 || kv == DType::f16 || kv == DType::fp8_ds_mla,
          "MlaLayer: options.kv_cache_dtype: expected bfloat16, float16 or fp8_ds_mla, got " +
              std::string(dtype_name(kv)));
  require(ix == DType::bf16 || ix == DType::fp8_e4m3,
          "MlaLayer: options.index_cache_dtype: expected bfloat16 or fp8_e4m3, got " + std::string(dtype_name(ix)));
  st.scale = float(s.softmax_scale > 0 ? s.softmax_scale : reference_softmax_scale(s.qk_head_dim(), s.rope));
  st.inv_freq = layer::rope_inv_freq(s.rope, s.qk_rope_head_dim);
  st.q_dtype = kv == DType::f16 ? DType::f16 : DType::bf16;
  st.kv_row = kv == DType::fp8_ds_mla ? kFp8DsMlaRowBytes : kMlaQkDim;
  const int64_t slots = int64_t(options.num_blocks) * options.block_size;
  st.kv_cache.assign(slots * st.kv_row * dtype_size(kv), 0);
  if (s.is_sparse()) {
    st.index_row = ix == DType::fp8_e4m3 ? kFp8IndexRowBytes : kIndexHeadDim;
    st.index_cache.assign(slots * st.index_row * (ix == DType::fp8_e4m3 ? 1 : 2), 0);
  }
  for (int b = options.num_blocks - 1; b >= 0; --b) st.free_blocks.push_back(b);
}

MlaLayer::~MlaLayer() = default;
MlaLayer::MlaLayer(MlaLayer&&) noexcept = default;
MlaLayer& MlaLayer::operator=(MlaLayer&&) noexcept = default;

const AttentionSpec& MlaLayer::spec() const { return state_->spec(); }
int MlaLayer::free_blocks() const { return int(state_->free_blocks.size()); }
int MlaLayer::context_length(int request) const { return state_->request(request, "context_length").length; }

int MlaLayer::add_request() {
  state_->requests.push_back({true, 0, {}});
  return int(state_->requests.size()) - 1;
}

void MlaLayer::release_request(int request) {
  State::Request& r = state_->request(request, "release_request");
  state_->free_blocks.insert(state_->free_blocks.end(), r.blocks.rbegin(), r.blocks.rend());
  r = {};
}

void MlaLayer::State::reserve(std::span<const LayerSegment> segments) {
  const int bs = opt.block_size;
  int64_t need = 0;
  for (const LayerSegment& seg : segments)
    need += std::max<int64_t>(0, (int64_t(requests[seg.request].length) + seg.num_tokens + bs - 1) / bs -
                                     int64_t(requests[seg.request].blocks.size()));
  if (need > int64_t(free_blocks.size()))
    throw Error(ErrorKind::invalid_argument,
                "MlaLayer: KV cache full: the batch needs " + std::to_string(need) + " more blocks of " +
                    std::to_string(bs) + " tokens, " + std::to_string(free_blocks.size()) + " of " +
                    std::to_string(opt.num_blocks) + " are free");
  for (const LayerSegment& seg : segments) {
    Request& r = requests[seg.request];
    while (int64_t(r.blocks.size()) * bs < r.length + seg.num_tokens) {
      r.blocks.push_back(free_blocks.back());
      free_blocks.pop_back();
    }
  }
}

std::vector<int64_t> MlaLayer::State::slots_of(const Request& r, int first, int count) const {
  std::vector<int64_t> slots(count);
  for (int i = 0; i < count; ++i)
    slots[i] = int64_t(r.blocks[(first + i) / opt.block_size]) * opt.block_size + (first + i) % opt.block_size;
  return slots;
}

void MlaLayer::append_context(int request, int tokens, const float* latent, const float* k_pe,
                              const float* index_k) {
  State& st = *state_;
  State::Request& r = st.request(request, "append_context");
  require(tokens >= 0, "MlaLayer: append_context: negative tokens");
  require(index_k || !st.spec().is_sparse(), "MlaLayer: append_context: a DSA model needs index_k");
  const LayerSegment seg{request, tokens};
  st.reserve({&seg, 1});
  std::vector<int64_t> slots = st.slots_of(r, r.length, tokens);
  const TensorView slot_view(slots.data(), {tokens}, DType::i64);
  write_mla_cache({TensorView(const_cast<float*>(latent), {tokens, kMlaLatentDim}, DType::f32),
                   TensorView(const_cast<float*>(k_pe), {tokens, kMlaRopeDim}, DType::f32), slot_view, st.kv_view()},
                  st.opt.backend);
  if (st.spec().is_sparse())
    write_index_cache({TensorView(const_cast<float*>(index_k), {tokens, kIndexHeadDim}, DType::f32), slot_view,
                       st.index_view()},
                      st.opt.backend);
  r.length += tokens;
}

void MlaLayer::forward(std::span<const LayerSegment> segments, const float* hidden, float* out, AttentionPath path,
                       LayerProfile* profile) {
  State& st = *state_;
  const AttentionSpec& s = st.spec();
  int64_t tokens = 0;
  std::vector<bool> seen(st.requests.size());
  for (const LayerSegment& seg : segments) {
    const State::Request& r = st.request(seg.request, "forward: segments");
    require(!seen[seg.request], "MlaLayer: forward: request " + std::to_string(seg.request) + " appears twice");
    seen[seg.request] = true;
    require(seg.num_tokens >= 0, "MlaLayer: forward: segments: negative num_tokens");
    if (path == AttentionPath::unabsorbed) {
      require(r.length == 0, "MlaLayer: forward: the unabsorbed path runs new prompts only; request " +
                                 std::to_string(seg.request) + " has " + std::to_string(r.length) + " tokens");
      require(!s.is_sparse() || seg.num_tokens <= s.indexer->topk,
              "MlaLayer: forward: the unabsorbed path is dense; a DSA prompt must fit in top-k (" +
                  std::to_string(s.indexer->topk) + "), got " + std::to_string(seg.num_tokens) + " tokens");
    }
    tokens += seg.num_tokens;
  }
  st.reserve(segments);
  if (tokens == 0) return;

  int max_blocks = 1;
  for (const LayerSegment& seg : segments)
    max_blocks = std::max(max_blocks, int(st.requests[seg.request].blocks.size()));
  std::vector<int32_t> table(segments.size() * max_blocks, -1);
  for (size_t i = 0; i < segments.size(); ++i)
    std::ranges::copy(st.requests[segments[i].request].blocks, table.begin() + i * max_blocks);

  // Chunks end at max_chunk_tokens, and the unabsorbed path also at every segment's end (it sees whole prompts).
  State::Chunk chunk;
  int64_t row = 0;
  const auto flush = [&] {
    if (chunk.n) st.run_chunk(chunk, hidden, out, table, max_blocks, path, profile);
    chunk = {row, 0, {}, {}};
  };
  for (size_t i = 0; i < segments.size(); ++i) {
    State::Request& r = st.requests[segments[i].request];
    for (int t = 0; t < segments[i].num_tokens; ++t) {
      if (path == AttentionPath::absorbed && chunk.n == st.opt.max_chunk_tokens) flush();
      chunk.table_row.push_back(int32_t(i));
      chunk.position.push_back(r.length + t);
      ++chunk.n;
      ++row;
    }
    r.length += segments[i].num_tokens;
    if (path == AttentionPath::unabsorbed) flush();
  }
  flush();
}

void MlaLayer::State::run_chunk(const Chunk& chunk, const float* hidden, float* out, const std::vector<int32_t>& table,
                                int max_blocks, AttentionPath path, LayerProfile* prof) {
  const AttentionSpec& s = spec();
  const int64_t n = chunk.n, hidden_size = s.hidden_size, h = s.num_heads, nope = s.qk_nope_head_dim,
                rope = s.qk_rope_head_dim, qk = s.qk_head_dim(), v = s.v_head_dim, lora = s.kv_lora_rank,
                kv_rows = nope + v;
  const float* x = hidden + chunk.row0 * hidden_size;
  const int64_t segments = int64_t(table.size()) / max_blocks;
  TensorView block_table(const_cast<int32_t*>(table.data()), {segments, max_blocks}, DType::i32);
  TensorView request_ids(const_cast<int32_t*>(chunk.table_row.data()), {n}, DType::i32);
  const Backend* be = opt.backend;

  // Query and latent projections.
  std::vector<float> qr, q(n * h * qk), kva(n * s.absorbed_qk_dim());
  {
    PhaseTimer timer(prof ? &prof->projections : nullptr);
    if (s.q_lora_rank > 0) {
      qr.resize(n * s.q_lora_rank);
      layer::linear(x, hidden_size, w.q_a.data.data(), hidden_size, qr.data(), s.q_lora_rank, n, s.q_lora_rank,
                    hidden_size);
      layer::rms_norm(qr.data(), n, s.q_lora_rank, s.q_lora_rank, w.q_a_norm.data.data(), s.rms_norm_eps);
      layer::linear(qr.data(), s.q_lora_rank, w.q_b.data.data(), s.q_lora_rank, q.data(), h * qk, n, h * qk,
                    s.q_lora_rank);
    } else {
      layer::linear(x, hidden_size, w.q.data.data(), hidden_size, q.data(), h * qk, n, h * qk, hidden_size);
    }
    layer::linear(x, hidden_size, w.kv_a_mqa.data.data(), hidden_size, kva.data(), s.absorbed_qk_dim(), n,
                  s.absorbed_qk_dim(), hidden_size);
    layer::rms_norm(kva.data(), n, lora, s.absorbed_qk_dim(), w.kv_a_norm.data.data(), s.rms_norm_eps);
  }
  {
    PhaseTimer timer(prof ? &prof->rope : nullptr);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t head = 0; head < h; ++head)
        layer::apply_rope(&q[(t * h + head) * qk + nope], chunk.position[t], inv_freq, s.rope_style);
      layer::apply_rope(&kva[t * s.absorbed_qk_dim() + lora], chunk.position[t], inv_freq, s.rope_style);
    }
  }

  std::vector<int64_t> slot_mapping(n);
  for (int64_t t = 0; t < n; ++t) {
    const int32_t p = chunk.position[t];
    slot_mapping[t] = int64_t(table[chunk.table_row[t] * max_blocks + p / opt.block_size]) * opt.block_size +
                      p % opt.block_size;
  }
  TensorView slots_view(slot_mapping.data(), {n}, DType::i64);
  {
    PhaseTimer timer(prof ? &prof->cache_write : nullptr);
    write_mla_cache({TensorView(kva.data(), {n, lora}, {s.absorbed_qk_dim(), 1}, DType::f32),
                     TensorView(kva.data() + lora, {n, rope}, {s.absorbed_qk_dim(), 1}, DType::f32), slots_view,
                     kv_view()},
                    be);
  }

  // DSA: the lightning indexer chooses each token's attended positions.
  std::vector<float> qi, weights;  // the indexer's queries and head weights
  std::vector<int32_t> slots;
  int64_t topk = 0;
  if (s.is_sparse()) {
    const IndexerSpec& ix = *s.indexer;
    const int64_t hi = ix.heads, dim = ix.head_dim;
    qi.resize(n * hi * dim);
    weights.resize(n * hi);
    std::vector<float> ki(n * dim);
    {
      PhaseTimer timer(prof ? &prof->indexer : nullptr);
      layer::linear(qr.data(), s.q_lora_rank, w.indexer.wq_b.data.data(), s.q_lora_rank, qi.data(), hi * dim, n,
                    hi * dim, s.q_lora_rank);
      layer::linear(x, hidden_size, w.indexer.wk.data.data(), hidden_size, ki.data(), dim, n, dim, hidden_size);
      layer::layer_norm(ki.data(), n, dim, dim, w.indexer.k_norm.data.data(), w.indexer.k_norm_bias.data.data(),
                        1e-6);
      layer::linear(x, hidden_size, w.indexer.weights_proj.data.data(), hidden_size, weights.data(), hi, n, hi,
                    hidden_size);
      const float weight_scale = float(1.0 / std::sqrt(double(hi) * double(dim)));
      for (float& value : weights) value *= weight_scale;
      // Head layout [rope | nope]: rope first, unlike MLA's heads.
      for (int64_t t = 0; t < n; ++t) {
        for (int64_t head = 0; head < hi; ++head)
          layer::apply_rope(&qi[(t * hi + head) * dim], chunk.position[t], inv_freq, ix.rope_style);
        layer::apply_rope(&ki[t * dim], chunk.position[t], inv_freq, ix.rope_style);
      }
    }
    {
      PhaseTimer timer(prof ? &prof->cache_write : nullptr);
      write_index_cache({TensorView(ki.data(), {n, dim}, DType::f32), slots_view, index_view()}, be);
    }
  }
  if (s.is_sparse() && path == AttentionPath::absorbed) {
    PhaseTimer timer(prof ? &prof->topk : nullptr);
    const int64_t hi = s.indexer->heads, dim = s.indexer->head_dim;
    topk = s.indexer->topk;
    std::vector<uint16_t> qi_bf16 = to_half(qi, DType::bf16);
    std::vector<int32_t> context_lens(n), positions(n * topk);
    for (int64_t t = 0; t < n; ++t) context_lens[t] = chunk.position[t] + 1;
    slots.resize(n * topk);
    IndexerTopkArgs args;
    args.q = TensorView(qi_bf16.data(), {n, hi, dim}, DType::bf16);
    args.weights = TensorView(weights.data(), {n, hi}, DType::f32);
    args.index_cache = index_view();
    args.request_ids = request_ids;
    args.block_table = block_table;
    args.context_lens = TensorView(context_lens.data(), {n}, DType::i32);
    args.topk = TensorView(positions.data(), {n, topk}, DType::i32);
    indexer_topk(args, be);
    positions_to_slots({args.topk, request_ids, block_table, opt.block_size,
                        TensorView(slots.data(), {n, topk}, DType::i32)},
                       be);
  }

  std::vector<float> attn(n * h * v);  // per token and head, the value-space output before o_proj
  if (path == AttentionPath::unabsorbed) {
    PhaseTimer timer(prof ? &prof->attention : nullptr);
    layer::unabsorbed_attention(s, scale, w.kv_b.data.data(), q.data(), kva.data(), n, attn.data());
  } else {
    // q_lat = q_nope @ W_UK per head, next to the roped q_pe: one 576-wide latent query head.
    std::vector<float> q_abs(n * h * kMlaQkDim);
    {
      PhaseTimer timer(prof ? &prof->projections : nullptr);
      for (int64_t head = 0; head < h; ++head) {
        layer::matmul(&q[head * qk], h * qk, &w.kv_b.data[head * kv_rows * lora], lora, &q_abs[head * kMlaQkDim],
                      h * kMlaQkDim, n, lora, nope);
        for (int64_t t = 0; t < n; ++t)
          std::copy_n(&q[(t * h + head) * qk + nope], rope, &q_abs[(t * h + head) * kMlaQkDim + lora]);
      }
    }
    std::vector<uint16_t> q_half = to_half(q_abs, q_dtype), o_half(n * h * kMlaVDim);
    std::vector<float> lse(n * h);
    {
      PhaseTimer timer(prof ? &prof->attention : nullptr);
      const TensorView qv(q_half.data(), {n, h, kMlaQkDim}, q_dtype), ov(o_half.data(), {n, h, kMlaVDim}, q_dtype);
      if (s.is_sparse()) {
        SparseMlaArgs args;
        args.q = qv;
        args.kv_cache = kv_view();
        args.indices = TensorView(slots.data(), {n, topk}, DType::i32);
        args.softmax_scale = scale;
        args.out = ov;
        args.lse = TensorView(lse.data(), {n, h}, DType::f32);
        sparse_mla(args, be);
      } else {
        // paged_mla_decode takes the same number of new tokens per request: one call for the chunk when its
        // requests' runs are equally long (decode batches, single prompts), else one call per run.
        std::vector<int64_t> run_start = {0};
        for (int64_t t = 1; t < n; ++t)
          if (chunk.table_row[t] != chunk.table_row[t - 1]) run_start.push_back(t);
        run_start.push_back(n);
        const int64_t runs = int64_t(run_start.size()) - 1, len0 = run_start[1];
        bool uniform = true;
        for (int64_t r = 0; r < runs; ++r) uniform &= run_start[r + 1] - run_start[r] == len0;
        const auto call = [&](int64_t first_run, int64_t b, int64_t s_q) {
          const int64_t t0 = run_start[first_run];
          std::vector<int32_t> seq_lens(b), run_table(b * max_blocks);
          for (int64_t i = 0; i < b; ++i) {
            const int64_t t = run_start[first_run + i];
            seq_lens[i] = chunk.position[t + s_q - 1] + 1;
            std::copy_n(&table[chunk.table_row[t] * max_blocks], max_blocks, &run_table[i * max_blocks]);
          }
          PagedMlaDecodeArgs args;
          args.q = TensorView(&q_half[t0 * h * kMlaQkDim], {b, s_q, h, kMlaQkDim}, q_dtype);
          args.kv_cache = kv_view();
          args.block_table = TensorView(run_table.data(), {b, max_blocks}, DType::i32);
          args.seq_lens = TensorView(seq_lens.data(), {b}, DType::i32);
          args.softmax_scale = scale;
          args.out = TensorView(&o_half[t0 * h * kMlaVDim], {b, s_q, h, kMlaVDim}, q_dtype);
          args.lse = TensorView(&lse[t0 * h], {b, s_q, h}, DType::f32);
          paged_mla_decode(args, be);
        };
        if (uniform) {
          call(0, runs, len0);
        } else {
          for (int64_t r = 0; r < runs; ++r) call(r, 1, run_start[r + 1] - run_start[r]);
        }
      }
    }
    PhaseTimer timer(prof ? &prof->output : nullptr);
    std::vector<float> o_lat(o_half.size());
    for (size_t i = 0; i < o_half.size(); ++i)
      o_lat[i] = q_dtype == DType::f16 ? numeric::f16_to_float(o_half[i]) : numeric::bf16_to_float(o_half[i]);
    for (int64_t head = 0; head < h; ++head)
      layer::linear(&o_lat[head * kMlaVDim], h * kMlaVDim, &w.kv_b.data[(head * kv_rows + nope) * lora], lora,
                    &attn[head * v], h * v, n, v, lora);
  }
  PhaseTimer timer(prof ? &prof->output : nullptr);
  layer::linear(attn.data(), h * v, w.o.data.data(), h * v, out + chunk.row0 * hidden_size, hidden_size, n,
                hidden_size, h * v);
}

}  // namespace smla
