// MlaLayer: the chunk algorithm (projections, norms and RoPE through layer::Compute on the layer's device, the caches
// and attention through the smla ops), the paged-cache block pool, the device and backend choice. The unabsorbed
// attention is in unabsorbed.cpp.
#include "smla/layer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>

#include "layer/compute.h"
#include "layer/layer_math.h"
#include "layer/unabsorbed.h"
#include "smla/error.h"
#include "smla/ops.h"
#include "smla/select.h"
#ifdef SMLA_WITH_CUDA
#include "cuda/device_query.h"
#endif

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
          "MlaLayer: spec: the layer needs kv_lora_rank 512 and qk_rope_head_dim 64 (heads with no rope part and "
          "pooled indexers, GLM-5.3-Flash's, are not in MlaLayer yet), got " +
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

// The chunk's scratch buffers (Compute::scratch ids).
enum Scratch : int { kQr, kQ, kKva, kQAbs, kQHalf, kOHalf, kLse, kOLat, kAttn, kIndexQ, kIndexQHalf, kIndexK,
                     kIndexWeights, kTopk, kSlots };

// Host arrays packed into one buffer (each 8-byte aligned), so that a chunk's bookkeeping reaches the device in one
// copy.
class HostPack {
 public:
  template <class T>
  size_t add(const std::vector<T>& values) {
    const size_t offset = (bytes_.size() + 7) / 8 * 8;
    bytes_.resize(offset + values.size() * sizeof(T));
    if (!values.empty()) std::memcpy(bytes_.data() + offset, values.data(), values.size() * sizeof(T));
    return offset;
  }
  std::span<const std::byte> bytes() const { return bytes_; }

 private:
  std::vector<std::byte> bytes_;
};

// The device the options name; a CUDA device gets its compute capability from the GPU.
Device resolve_device(const LayerOptions& o) {
  if (o.device.is_cpu()) {
    require(o.stream == nullptr, "MlaLayer: options.stream: a CUDA stream needs a CUDA options.device, got cpu");
    return o.device;
  }
#ifdef SMLA_WITH_CUDA
  const std::optional<Device> found = cuda::device_at(o.device.index);
  require(found.has_value(), "MlaLayer: options.device: no CUDA device " + std::to_string(o.device.index) +
                                 " on this machine (cudaGetDeviceCount)");
  require(o.device.compute_capability == 0 || o.device.compute_capability == found->compute_capability,
          "MlaLayer: options.device: " + o.device.name() + " asked for, but CUDA device " +
              std::to_string(o.device.index) + " is " + found->name());
  return *found;
#else
  fail("MlaLayer: options.device: " + o.device.name() + " needs smla built with CUDA; this build runs on the CPU only");
#endif
}

// options.backend when it can run the layer on `device`, else the selector's choice.
const Backend& resolve_backend(const AttentionSpec& s, const LayerOptions& o, const Device& device, DType q_dtype) {
  RunSpec run;
  run.q_dtype = q_dtype;
  run.kv_cache_dtype = o.kv_cache_dtype;
  run.block_size = o.block_size;
  run.device = device;
  if (!o.backend) {
    try {
      return select_backend(s, run);
    } catch (const Error& e) {
      throw Error(e.kind(), std::string("MlaLayer: options.backend (none given): ") + e.what());
    }
  }
  const std::string name = o.backend->name();
  require(o.backend->capabilities().device_kind == device.kind,
          "MlaLayer: options.backend: '" + name + "' runs on " + (device.is_cpu() ? "CUDA GPUs" : "the CPU") +
              ", not on options.device " + device.name());
  std::string reasons;
  for (const std::string& reason : validate(o.backend->capabilities(), s, run)) reasons += "; " + reason;
  if (!reasons.empty())
    throw Error(ErrorKind::unsupported, "MlaLayer: options.backend: '" + name + "' cannot run " + s.name + " on " +
                                            device.name() + ": " + reasons.substr(2));
  return *o.backend;
}

}  // namespace

struct MlaLayer::State {
  AttentionSpec spec;
  LayerOptions opt;
  const Backend* backend = nullptr;
  std::unique_ptr<layer::Compute> compute;
  struct Weights {
    layer::Matrix q, q_a, q_b, kv_a_mqa, kv_b, o, index_wq_b, index_wk, index_weights_proj;
    const float *q_a_norm = nullptr, *kv_a_norm = nullptr, *index_k_norm = nullptr, *index_k_norm_bias = nullptr;
  } w;
  float scale = 0;
  const float* inv_freq = nullptr;  // RoPE frequencies, rope_pairs of them
  int64_t rope_pairs = 0;
  DType q_dtype = DType::bf16;  // the attention query's type: the cache's 16-bit type
  int kv_row = 0, index_row = 0;
  void* kv_cache = nullptr;
  void* index_cache = nullptr;
  std::vector<int32_t> free_blocks;  // a stack: the most recently freed block is reused first
  struct Request {
    bool live = false;
    int length = 0;
    std::vector<int32_t> blocks;
  };
  std::vector<Request> requests;

  // Blocks the requests need to grow by the segments' tokens; throws, changing nothing, when the pool has too few.
  void reserve(std::span<const LayerSegment> segments);
  std::vector<int64_t> slots_of(const Request& r, int first, int count) const;
  TensorView kv_view() const {
    return TensorView(kv_cache, {opt.num_blocks, opt.block_size, kv_row}, opt.kv_cache_dtype, compute->device());
  }
  TensorView index_view() const {
    return TensorView(index_cache, {opt.num_blocks, opt.block_size, index_row}, opt.index_cache_dtype,
                      compute->device());
  }
  Request& request(int id, const char* what) {
    require(id >= 0 && id < int(requests.size()) && requests[id].live,
            std::string("MlaLayer: ") + what + ": no live request " + std::to_string(id));
    return requests[id];
  }
  template <class T>
  T* buffer(Scratch id, int64_t count) {
    return static_cast<T*>(compute->scratch(id, size_t(count) * sizeof(T)));
  }
  // Runs `work`, adding its seconds to prof->*field when profiling. The device is synchronised before and after,
  // so that asynchronous (GPU) work is counted in its own phase; without a profile nothing waits.
  template <class Work>
  void phase(LayerProfile* prof, double LayerProfile::*field, Work&& work) {
    if (!prof) return work();
    compute->synchronize();
    const auto start = std::chrono::steady_clock::now();
    work();
    compute->synchronize();
    prof->*field += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
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
  st.spec = weights.spec;
  st.opt = options;
  const AttentionSpec& s = st.spec;
  require(options.num_blocks > 0 && options.block_size > 0 && options.max_chunk_tokens > 0,
          "MlaLayer: options: num_blocks, block_size and max_chunk_tokens must be positive");
  const DType kv = options.kv_cache_dtype, ix = options.index_cache_dtype;
  require(kv == DType::bf16 || kv == DType::f16 || kv == DType::fp8_ds_mla,
          "MlaLayer: options.kv_cache_dtype: expected bfloat16, float16 or fp8_ds_mla, got " +
              std::string(dtype_name(kv)));
  require(ix == DType::bf16 || ix == DType::fp8_e4m3,
          "MlaLayer: options.index_cache_dtype: expected bfloat16 or fp8_e4m3, got " + std::string(dtype_name(ix)));
  st.q_dtype = kv == DType::f16 ? DType::f16 : DType::bf16;
  const Device device = resolve_device(options);
  st.backend = &resolve_backend(s, options, device, st.q_dtype);
#ifdef SMLA_WITH_CUDA
  st.compute = device.is_cuda() ? layer::make_cuda_compute(device, options.stream) : layer::make_cpu_compute();
#else
  st.compute = layer::make_cpu_compute();
#endif
  layer::Compute& c = *st.compute;

  const auto matrix = [&](WeightTensor& t) { return t.empty() ? layer::Matrix{} : c.matrix(std::move(t)); };
  const auto vector = [&](WeightTensor& t) { return t.empty() ? nullptr : c.vector(std::move(t.data)); };
  State::Weights& w = st.w;
  w.q = matrix(weights.q);
  w.q_a = matrix(weights.q_a);
  w.q_b = matrix(weights.q_b);
  w.kv_a_mqa = matrix(weights.kv_a_mqa);
  w.kv_b = matrix(weights.kv_b);
  w.o = matrix(weights.o);
  w.index_wq_b = matrix(weights.indexer.wq_b);
  w.index_wk = matrix(weights.indexer.wk);
  w.index_weights_proj = matrix(weights.indexer.weights_proj);
  w.q_a_norm = vector(weights.q_a_norm);
  w.kv_a_norm = vector(weights.kv_a_norm);
  w.index_k_norm = vector(weights.indexer.k_norm);
  w.index_k_norm_bias = vector(weights.indexer.k_norm_bias);
  std::vector<float> inv_freq = layer::rope_inv_freq(s.rope, s.qk_rope_head_dim);
  st.rope_pairs = int64_t(inv_freq.size());
  st.inv_freq = c.vector(std::move(inv_freq));

  st.scale = float(s.softmax_scale > 0 ? s.softmax_scale : reference_softmax_scale(s.qk_head_dim(), s.rope));
  st.kv_row = kv == DType::fp8_ds_mla ? kFp8DsMlaRowBytes : kMlaQkDim;
  const int64_t slots = int64_t(options.num_blocks) * options.block_size;
  st.kv_cache = c.allocate_zeroed(slots * st.kv_row * dtype_size(kv));
  if (s.is_sparse()) {
    st.index_row = ix == DType::fp8_e4m3 ? kFp8IndexRowBytes : kIndexHeadDim;
    st.index_cache = c.allocate_zeroed(slots * st.index_row * (ix == DType::fp8_e4m3 ? 1 : 2));
  }
  for (int b = options.num_blocks - 1; b >= 0; --b) st.free_blocks.push_back(b);
}

MlaLayer::~MlaLayer() = default;
MlaLayer::MlaLayer(MlaLayer&&) noexcept = default;
MlaLayer& MlaLayer::operator=(MlaLayer&&) noexcept = default;

const AttentionSpec& MlaLayer::spec() const { return state_->spec; }
const Backend& MlaLayer::backend() const { return *state_->backend; }
Device MlaLayer::device() const { return state_->compute->device(); }
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
  require(index_k || !st.spec.is_sparse(), "MlaLayer: append_context: a DSA model needs index_k");
  if (tokens == 0) return;
  const LayerSegment seg{request, tokens};
  st.reserve({&seg, 1});
  const Device dev = st.compute->device();
  const std::vector<int64_t> slots = st.slots_of(r, r.length, tokens);
  const TensorView slot_view(st.compute->stage(std::as_bytes(std::span(slots))), {tokens}, DType::i64, dev);
  write_mla_cache({TensorView(const_cast<float*>(latent), {tokens, kMlaLatentDim}, DType::f32, dev),
                   TensorView(const_cast<float*>(k_pe), {tokens, kMlaRopeDim}, DType::f32, dev), slot_view,
                   st.kv_view(), st.compute->stream()},
                  st.backend);
  if (st.spec.is_sparse())
    write_index_cache({TensorView(const_cast<float*>(index_k), {tokens, kIndexHeadDim}, DType::f32, dev), slot_view,
                       st.index_view(), st.compute->stream()},
                      st.backend);
  r.length += tokens;
}

void MlaLayer::forward(std::span<const LayerSegment> segments, const float* hidden, float* out, AttentionPath path,
                       LayerProfile* profile) {
  State& st = *state_;
  const AttentionSpec& s = st.spec;
  require(path == AttentionPath::absorbed || st.compute->device().is_cpu(),
          "MlaLayer: forward: the unabsorbed path runs on the CPU only, not on options.device " +
              st.compute->device().name());
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
  const AttentionSpec& s = spec;
  layer::Compute& c = *compute;
  const Device dev = c.device();
  void* const stream = c.stream();
  const int64_t n = chunk.n, hidden_size = s.hidden_size, h = s.num_heads, nope = s.qk_nope_head_dim,
                rope = s.qk_rope_head_dim, qk = s.qk_head_dim(), v = s.v_head_dim, lora = s.kv_lora_rank,
                kv_rows = nope + v, kva_dim = s.absorbed_qk_dim(), q_lora = s.q_lora_rank;
  const float* x = hidden + chunk.row0 * hidden_size;
  const int64_t segments = int64_t(table.size()) / max_blocks;
  const bool paged = !s.is_sparse() && path == AttentionPath::absorbed;

  // The chunk's bookkeeping, computed here and staged on the device in one copy: each token's cache slot and
  // context length; for dense models the runs of consecutive tokens of one request, which paged_mla_decode takes.
  std::vector<int64_t> slot_mapping(n);
  std::vector<int32_t> context_lens(n);
  for (int64_t t = 0; t < n; ++t) {
    const int32_t p = chunk.position[t];
    slot_mapping[t] = int64_t(table[chunk.table_row[t] * max_blocks + p / opt.block_size]) * opt.block_size +
                      p % opt.block_size;
    context_lens[t] = p + 1;
  }
  std::vector<int64_t> run_start;
  std::vector<int32_t> run_seq_lens, run_table;
  if (paged) {
    run_start.push_back(0);
    for (int64_t t = 1; t < n; ++t)
      if (chunk.table_row[t] != chunk.table_row[t - 1]) run_start.push_back(t);
    run_start.push_back(n);
    for (size_t r = 0; r + 1 < run_start.size(); ++r) {
      run_seq_lens.push_back(chunk.position[run_start[r + 1] - 1] + 1);
      const auto row = table.begin() + chunk.table_row[run_start[r]] * max_blocks;
      run_table.insert(run_table.end(), row, row + max_blocks);
    }
  }
  HostPack pack;
  const size_t at_slots = pack.add(slot_mapping), at_positions = pack.add(chunk.position),
               at_rows = pack.add(chunk.table_row), at_context = pack.add(context_lens), at_table = pack.add(table),
               at_seq_lens = pack.add(run_seq_lens), at_run_table = pack.add(run_table);
  std::byte* const staged = static_cast<std::byte*>(c.stage(pack.bytes()));
  const int32_t* positions = reinterpret_cast<const int32_t*>(staged + at_positions);
  const TensorView slots_view(staged + at_slots, {n}, DType::i64, dev);
  const TensorView request_ids(staged + at_rows, {n}, DType::i32, dev);
  const TensorView block_table(staged + at_table, {segments, max_blocks}, DType::i32, dev);

  // Query and latent projections, then RoPE.
  float* const qr = q_lora > 0 ? buffer<float>(kQr, n * q_lora) : nullptr;
  float* const q = buffer<float>(kQ, n * h * qk);
  float* const kva = buffer<float>(kKva, n * kva_dim);
  phase(prof, &LayerProfile::projections, [&] {
    if (q_lora > 0) {
      c.linear(x, hidden_size, w.q_a, qr, q_lora, n);
      c.rms_norm(qr, n, q_lora, q_lora, w.q_a_norm, s.rms_norm_eps);
      c.linear(qr, q_lora, w.q_b, q, h * qk, n);
    } else {
      c.linear(x, hidden_size, w.q, q, h * qk, n);
    }
    c.linear(x, hidden_size, w.kv_a_mqa, kva, kva_dim, n);
    c.rms_norm(kva, n, lora, kva_dim, w.kv_a_norm, s.rms_norm_eps);
  });
  phase(prof, &LayerProfile::rope, [&] {
    c.rope(q + nope, n, h, h * qk, qk, positions, inv_freq, rope_pairs, s.rope_style);
    c.rope(kva + lora, n, 1, kva_dim, 0, positions, inv_freq, rope_pairs, s.rope_style);
  });
  phase(prof, &LayerProfile::cache_write, [&] {
    write_mla_cache({TensorView(kva, {n, lora}, {kva_dim, 1}, DType::f32, dev),
                     TensorView(kva + lora, {n, rope}, {kva_dim, 1}, DType::f32, dev), slots_view, kv_view(), stream},
                    backend);
  });

  // DSA: the lightning indexer chooses each token's attended positions.
  int32_t* slots = nullptr;
  int64_t topk = 0;
  if (s.is_sparse()) {
    const IndexerSpec& ix = *s.indexer;
    const int64_t hi = ix.heads, dim = ix.head_dim;
    float* const qi = buffer<float>(kIndexQ, n * hi * dim);
    float* const ki = buffer<float>(kIndexK, n * dim);
    float* const weights = buffer<float>(kIndexWeights, n * hi);
    phase(prof, &LayerProfile::indexer, [&] {
      c.linear(qr, q_lora, w.index_wq_b, qi, hi * dim, n);
      c.linear(x, hidden_size, w.index_wk, ki, dim, n);
      c.layer_norm(ki, n, dim, dim, w.index_k_norm, w.index_k_norm_bias, 1e-6);
      c.linear(x, hidden_size, w.index_weights_proj, weights, hi, n, float(1.0 / std::sqrt(double(hi) * dim)));
      // Head layout [rope | nope]: rope first, unlike MLA's heads.
      c.rope(qi, n, hi, hi * dim, dim, positions, inv_freq, rope_pairs, ix.rope_style);
      c.rope(ki, n, 1, dim, 0, positions, inv_freq, rope_pairs, ix.rope_style);
    });
    phase(prof, &LayerProfile::cache_write, [&] {
      write_index_cache({TensorView(ki, {n, dim}, DType::f32, dev), slots_view, index_view(), stream}, backend);
    });
    if (path == AttentionPath::absorbed) {
      topk = ix.topk;
      uint16_t* const qi_half = buffer<uint16_t>(kIndexQHalf, n * hi * dim);
      int32_t* const top = buffer<int32_t>(kTopk, n * topk);
      slots = buffer<int32_t>(kSlots, n * topk);
      phase(prof, &LayerProfile::topk, [&] {
        c.to_half(qi, qi_half, n * hi * dim, DType::bf16);
        IndexerTopkArgs args;
        args.q = TensorView(qi_half, {n, hi, dim}, DType::bf16, dev);
        args.weights = TensorView(weights, {n, hi}, DType::f32, dev);
        args.index_cache = index_view();
        args.request_ids = request_ids;
        args.block_table = block_table;
        args.context_lens = TensorView(staged + at_context, {n}, DType::i32, dev);
        args.topk = TensorView(top, {n, topk}, DType::i32, dev);
        args.stream = stream;
        indexer_topk(args, backend);
        positions_to_slots({args.topk, request_ids, block_table, opt.block_size,
                            TensorView(slots, {n, topk}, DType::i32, dev), stream},
                           backend);
      });
    }
  }

  float* const attn = buffer<float>(kAttn, n * h * v);  // per token and head, the value-space output before o_proj
  if (path == AttentionPath::unabsorbed) {
    // CPU only (forward checks it), where the matrices are the fp32 weights.
    phase(prof, &LayerProfile::attention, [&] {
      layer::unabsorbed_attention(s, scale, static_cast<const float*>(w.kv_b.data), q, kva, n, attn);
    });
  } else {
    float* const q_abs = buffer<float>(kQAbs, n * h * kMlaQkDim);
    phase(prof, &LayerProfile::projections, [&] {
      // q_lat = q_nope @ W_UK per head, next to the roped q_pe: one 576-wide latent query head.
      c.matmul_per_head({q, h * qk, qk}, w.kv_b, {0, nope, kv_rows}, {q_abs, h * kMlaQkDim, kMlaQkDim}, n, h);
      c.copy_rows(q + nope, qk, q_abs + lora, kMlaQkDim, n * h, rope);
    });
    uint16_t* const q_half = buffer<uint16_t>(kQHalf, n * h * kMlaQkDim);
    uint16_t* const o_half = buffer<uint16_t>(kOHalf, n * h * kMlaVDim);
    float* const lse = buffer<float>(kLse, n * h);
    phase(prof, &LayerProfile::attention, [&] {
      c.to_half(q_abs, q_half, n * h * kMlaQkDim, q_dtype);
      if (s.is_sparse()) {
        SparseMlaArgs args;
        args.q = TensorView(q_half, {n, h, kMlaQkDim}, q_dtype, dev);
        args.kv_cache = kv_view();
        args.indices = TensorView(slots, {n, topk}, DType::i32, dev);
        args.softmax_scale = scale;
        args.out = TensorView(o_half, {n, h, kMlaVDim}, q_dtype, dev);
        args.lse = TensorView(lse, {n, h}, DType::f32, dev);
        args.stream = stream;
        sparse_mla(args, backend);
        return;
      }
      // paged_mla_decode takes the same number of new tokens per request: one call for the chunk when its runs are
      // equally long (decode batches, single prompts), else one call per run.
      const int64_t runs = int64_t(run_start.size()) - 1, len0 = run_start[1];
      bool uniform = true;
      for (int64_t r = 0; r < runs; ++r) uniform &= run_start[r + 1] - run_start[r] == len0;
      const auto call = [&](int64_t first_run, int64_t b, int64_t s_q) {
        const int64_t t0 = run_start[first_run];
        PagedMlaDecodeArgs args;
        args.q = TensorView(q_half + t0 * h * kMlaQkDim, {b, s_q, h, kMlaQkDim}, q_dtype, dev);
        args.kv_cache = kv_view();
        args.block_table = TensorView(staged + at_run_table + first_run * max_blocks * sizeof(int32_t),
                                      {b, max_blocks}, DType::i32, dev);
        args.seq_lens = TensorView(staged + at_seq_lens + first_run * sizeof(int32_t), {b}, DType::i32, dev);
        args.softmax_scale = scale;
        args.out = TensorView(o_half + t0 * h * kMlaVDim, {b, s_q, h, kMlaVDim}, q_dtype, dev);
        args.lse = TensorView(lse + t0 * h, {b, s_q, h}, DType::f32, dev);
        args.stream = stream;
        paged_mla_decode(args, backend);
      };
      if (uniform) {
        call(0, runs, len0);
      } else {
        for (int64_t r = 0; r < runs; ++r) call(r, 1, run_start[r + 1] - run_start[r]);
      }
    });
    phase(prof, &LayerProfile::output, [&] {
      float* const o_lat = buffer<float>(kOLat, n * h * kMlaVDim);
      c.to_float(o_half, q_dtype, o_lat, n * h * kMlaVDim);
      c.linear_per_head({o_lat, h * kMlaVDim, kMlaVDim}, w.kv_b, {nope, v, kv_rows}, {attn, h * v, v}, n, h);
    });
  }
  phase(prof, &LayerProfile::output,
        [&] { c.linear(attn, h * v, w.o, out + chunk.row0 * hidden_size, hidden_size, n); });
}

}  // namespace smla
