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
#include "models/weight_slots.h"
#include "smla/error.h"
#include "smla/ops.h"
#include "smla/select.h"
#ifdef SMLA_WITH_CUDA
#include "cuda/device_query.h"
#endif

namespace smla {
namespace {

using models::shape_text;

void check_tensor(const WeightTensor& tensor, const std::string& name, const std::vector<int64_t>& expected) {
  if (tensor.shape != expected)
    fail("MlaLayer: weights." + name + ": expected shape " + shape_text(expected) + ", got " +
         shape_text(tensor.shape));
  require(tensor.data.size() == uint64_t(tensor.numel()), "MlaLayer: weights." + name + ": shape " +
                                                              shape_text(expected) + " but " +
                                                              std::to_string(tensor.data.size()) + " values");
}

// The geometry the layer runs and every tensor's shape (the readers' table, models/weight_slots.h).
void check_weights(AttentionWeights& w) {
  const AttentionSpec& s = w.spec;
  validate(s, "MlaLayer: spec");
  require(s.kv_lora_rank == kMlaLatentDim && (s.qk_rope_head_dim == kMlaRopeDim || s.qk_rope_head_dim == 0),
          "MlaLayer: spec: the layer needs kv_lora_rank 512 and qk_rope_head_dim 64 or 0, got " +
              std::to_string(s.kv_lora_rank) + " and " + std::to_string(s.qk_rope_head_dim));
  if (s.is_sparse()) {
    const IndexerSpec& ix = *s.indexer;
    require(ix.head_dim == kIndexHeadDim && s.q_lora_rank > 0,
            "MlaLayer: spec: the indexer needs index_head_dim 128 and q_lora_rank > 0, got " +
                std::to_string(ix.head_dim) + " and " + std::to_string(s.q_lora_rank));
    require(ix.kpool == 1 || ix.always_select_tail,
            "MlaLayer: spec: a pooled indexer (index_kpool " + std::to_string(ix.kpool) +
                ") needs index_kpool_always_select_tail true: the layer always attends the incomplete last pool");
    require(ix.topk % ix.kpool == 0,
            "MlaLayer: spec: index_topk " + std::to_string(ix.topk) + " must be a multiple of index_kpool " +
                std::to_string(ix.kpool) + " (top-k picks index_topk / index_kpool pools)");
  }
  for (const models::WeightSlot& slot : models::weight_slots())
    if (slot.needed_by(s)) check_tensor(slot.field(w), slot.field_name, slot.shape(s));
}

// The chunk's scratch buffers (Compute::scratch ids).
enum Scratch : int { kQr, kQ, kKva, kQAbs, kQHalf, kOHalf, kLse, kOLat, kAttn, kIndexQ, kIndexQHalf, kIndexK,
                     kIndexWeights, kTopk, kSlots, kPoolTokens, kPoolTopk };

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
    layer::Matrix q, q_a, q_b, kv_a_mqa, kv_b, o, index_wq_b, index_wk, index_weights_proj, index_kpool_gate;
    const float *q_a_norm = nullptr, *kv_a_norm = nullptr, *index_k_norm = nullptr, *index_k_norm_bias = nullptr,
                *index_kpool_ape = nullptr;
  } w;
  float scale = 0;
  const float* inv_freq = nullptr;  // RoPE frequencies, rope_pairs of them
  int64_t rope_pairs = 0;
  DType q_dtype = DType::bf16;  // the attention query's type: the cache's 16-bit type
  int kv_row = 0, index_row = 0;
  void* kv_cache = nullptr;
  void* index_cache = nullptr;
  // A pooled indexer (kpool > 1) caches one key per pool of kpool tokens: block_size / kpool index rows per block.
  // Until its pool is whole, a token's index key and gate scores wait in `pool_pending` ([slots, 256] f32, by token
  // slot): a pool's tokens may arrive in different forward calls.
  int64_t kpool = 1;
  float* pool_pending = nullptr;
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
    return TensorView(index_cache, {opt.num_blocks, opt.block_size / kpool, index_row}, opt.index_cache_dtype,
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
  // The pools that tokens at `positions` (cache slots `slots`) make whole: each one's pool slot in the index cache
  // and its tokens' slots in pool_pending.
  struct PoolWrites {
    std::vector<int64_t> pool_slots, token_slots;
  };
  PoolWrites pools_completed(std::span<const int32_t> positions, std::span<const int64_t> slots) const;
  // What the phases of a chunk share: its rows and its bookkeeping, staged on the device in one copy.
  struct Staged;
  Staged stage(const Chunk& chunk, const float* hidden, float* out, const std::vector<int32_t>& table,
               int max_blocks, AttentionPath path);
  void run_chunk(const Chunk& chunk, const float* hidden, float* out, const std::vector<int32_t>& table,
                 int max_blocks, AttentionPath path, LayerProfile* prof);
  // The phases of run_chunk.
  void project(const Staged& st, LayerProfile* prof);
  void write_latents(const Staged& st, LayerProfile* prof);
  TensorView select_tokens(const Staged& st, AttentionPath path, LayerProfile* prof);
  TensorView select_pooled(const Staged& st, AttentionPath path, LayerProfile* prof);
  void index_queries(const Staged& st, float* qi, float* weights);
  void index_topk(const Staged& st, uint16_t* q, float* weights, const TensorView& context_lens,
                  const TensorView& topk);
  void write_pooled_keys(const float* keys, int64_t n, const int64_t* token_slots, int64_t pools,
                         const int64_t* pool_token_slots, const TensorView& pool_slots);
  void attend_unabsorbed(const Staged& st, LayerProfile* prof);
  void attend_absorbed(const Staged& st, const TensorView& indices, LayerProfile* prof);
  void project_out(const Staged& st, LayerProfile* prof);
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
  // The cache formats that hold the layer's head (fp8_ds_mla_nope only without a rope part). Not fp8_ds_mla_v4:
  // its 448 e4m3 + 64 bf16 split is DeepSeek-V4's head, which the layer does not run (V4 has no 512-wide latent).
  const MlaHead head{s.qk_rope_head_dim};
  std::vector<DType> caches;
  for (DType d : kMlaCacheDTypes)
    if (head.cache_row(d) != 0) caches.push_back(d);
  require(std::ranges::find(caches, kv) != caches.end(),
          "MlaLayer: options.kv_cache_dtype: expected " + dtype_names(caches) + ", got " + std::string(dtype_name(kv)));
  require(ix == DType::bf16 || ix == DType::fp8_e4m3,
          "MlaLayer: options.index_cache_dtype: expected bfloat16 or fp8_e4m3, got " + std::string(dtype_name(ix)));
  st.q_dtype = attention_query_dtype(kv);
  st.kpool = s.is_sparse() ? s.indexer->kpool : 1;
  require(options.block_size % st.kpool == 0,
          "MlaLayer: options.block_size: a pooled indexer needs a multiple of index_kpool " + std::to_string(st.kpool) +
              " (a pool's tokens share a block), got " + std::to_string(options.block_size));
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
  w.index_kpool_gate = matrix(weights.indexer.kpool_gate);
  w.q_a_norm = vector(weights.q_a_norm);
  w.kv_a_norm = vector(weights.kv_a_norm);
  w.index_k_norm = vector(weights.indexer.k_norm);
  w.index_k_norm_bias = vector(weights.indexer.k_norm_bias);
  w.index_kpool_ape = vector(weights.indexer.kpool_ape);
  std::vector<float> inv_freq = layer::rope_inv_freq(s.rope, s.qk_rope_head_dim);
  st.rope_pairs = int64_t(inv_freq.size());
  st.inv_freq = c.vector(std::move(inv_freq));

  st.scale = float(s.softmax_scale > 0 ? s.softmax_scale : reference_softmax_scale(s.qk_head_dim(), s.rope));
  st.kv_row = int(head.cache_row(kv));
  const int64_t slots = int64_t(options.num_blocks) * options.block_size;
  st.kv_cache = c.allocate_zeroed(slots * st.kv_row * dtype_size(kv));
  if (s.is_sparse()) {
    st.index_row = ix == DType::fp8_e4m3 ? kFp8IndexRowBytes : kIndexHeadDim;
    st.index_cache = c.allocate_zeroed(slots / st.kpool * st.index_row * (ix == DType::fp8_e4m3 ? 1 : 2));
    if (st.kpool > 1)
      st.pool_pending = static_cast<float*>(c.allocate_zeroed(slots * 2 * kIndexHeadDim * sizeof(float)));
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
  const int rope = st.spec.qk_rope_head_dim;
  require(k_pe || rope == 0, "MlaLayer: append_context: a head with a rope part needs k_pe");
  if (tokens == 0) return;
  const LayerSegment seg{request, tokens};
  st.reserve({&seg, 1});
  const Device dev = st.compute->device();
  const std::vector<int64_t> slots = st.slots_of(r, r.length, tokens);
  std::vector<int32_t> positions(tokens);
  for (int i = 0; i < tokens; ++i) positions[i] = r.length + i;
  const State::PoolWrites pools = st.kpool > 1 ? st.pools_completed(positions, slots) : State::PoolWrites{};
  HostPack pack;
  const size_t at_slots = pack.add(slots), at_pool_slots = pack.add(pools.pool_slots),
               at_pool_tokens = pack.add(pools.token_slots);
  std::byte* const staged = static_cast<std::byte*>(st.compute->stage(pack.bytes()));
  const TensorView slot_view(staged + at_slots, {tokens}, DType::i64, dev);
  write_mla_cache({TensorView(const_cast<float*>(latent), {tokens, kMlaLatentDim}, DType::f32, dev),
                   rope ? TensorView(const_cast<float*>(k_pe), {tokens, rope}, DType::f32, dev) : TensorView(),
                   slot_view, st.kv_view(), st.compute->stream()},
                  st.backend);
  if (st.kpool > 1) {
    const int64_t completed = int64_t(pools.pool_slots.size());
    st.write_pooled_keys(index_k, tokens, reinterpret_cast<const int64_t*>(staged + at_slots), completed,
                         reinterpret_cast<const int64_t*>(staged + at_pool_tokens),
                         TensorView(staged + at_pool_slots, {completed}, DType::i64, dev));
  } else if (st.spec.is_sparse()) {
    write_index_cache({TensorView(const_cast<float*>(index_k), {tokens, kIndexHeadDim}, DType::f32, dev), slot_view,
                       st.index_view(), st.compute->stream()},
                      st.backend);
  }
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
    if (seen[seg.request]) fail("MlaLayer: forward: request " + std::to_string(seg.request) + " appears twice");
    seen[seg.request] = true;
    require(seg.num_tokens >= 0, "MlaLayer: forward: segments: negative num_tokens");
    if (path == AttentionPath::unabsorbed) {
      if (r.length != 0)
        fail("MlaLayer: forward: the unabsorbed path runs new prompts only; request " + std::to_string(seg.request) +
             " has " + std::to_string(r.length) + " tokens");
      if (s.is_sparse() && seg.num_tokens > s.indexer->topk)
        fail("MlaLayer: forward: the unabsorbed path is dense; a DSA prompt must fit in top-k (" +
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

struct MlaLayer::State::Staged {
  int64_t n = 0;
  const float* x = nullptr;  // the chunk's hidden rows
  float* out = nullptr;      // its output rows
  const int32_t* positions = nullptr;
  TensorView slots;          // [n] i64: each token's cache slot
  TensorView request_ids;    // [n] i32: each token's block-table row
  TensorView block_table;    // [segments, max_blocks] i32
  TensorView context_lens;   // [n] i32: the positions each token sees
  // A pooled indexer: the whole pools each token sees, and the pools the chunk completes (PoolWrites, staged).
  TensorView pool_context_lens;
  TensorView pool_slots;
  const int64_t* pool_token_slots = nullptr;
  // Dense models (paged_mla_decode): the runs of consecutive tokens of one request, each run's context length and
  // block-table row.
  std::vector<int64_t> run_start;
  const std::byte* run_seq_lens = nullptr;
  const std::byte* run_table = nullptr;
  int max_blocks = 0;
};

MlaLayer::State::PoolWrites MlaLayer::State::pools_completed(std::span<const int32_t> positions,
                                                             std::span<const int64_t> slots) const {
  // A pool never straddles a block (kpool divides block_size), so its tokens' slots are consecutive, and its index
  // cache row is its first token's slot / kpool.
  PoolWrites pools;
  for (size_t t = 0; t < positions.size(); ++t) {
    if ((positions[t] + 1) % kpool != 0) continue;
    const int64_t first = slots[t] - (kpool - 1);
    pools.pool_slots.push_back(first / kpool);
    for (int64_t j = 0; j < kpool; ++j) pools.token_slots.push_back(first + j);
  }
  return pools;
}

MlaLayer::State::Staged MlaLayer::State::stage(const Chunk& chunk, const float* hidden, float* out,
                                               const std::vector<int32_t>& table, int max_blocks, AttentionPath path) {
  const int64_t n = chunk.n;
  Staged st;
  st.n = n;
  st.x = hidden + chunk.row0 * spec.hidden_size;
  st.out = out + chunk.row0 * spec.hidden_size;
  st.max_blocks = max_blocks;
  std::vector<int64_t> slot_mapping(n);
  std::vector<int32_t> context_lens(n), pool_context_lens;
  for (int64_t t = 0; t < n; ++t) {
    const int32_t p = chunk.position[t];
    slot_mapping[t] = int64_t(table[chunk.table_row[t] * max_blocks + p / opt.block_size]) * opt.block_size +
                      p % opt.block_size;
    context_lens[t] = p + 1;
    if (kpool > 1) pool_context_lens.push_back(int32_t((p + 1) / kpool));
  }
  const PoolWrites pools = kpool > 1 ? pools_completed(chunk.position, slot_mapping) : PoolWrites{};
  std::vector<int32_t> run_seq_lens, run_table;
  if (!spec.is_sparse() && path == AttentionPath::absorbed) {
    st.run_start.push_back(0);
    for (int64_t t = 1; t < n; ++t)
      if (chunk.table_row[t] != chunk.table_row[t - 1]) st.run_start.push_back(t);
    st.run_start.push_back(n);
    for (size_t r = 0; r + 1 < st.run_start.size(); ++r) {
      run_seq_lens.push_back(chunk.position[st.run_start[r + 1] - 1] + 1);
      const auto row = table.begin() + chunk.table_row[st.run_start[r]] * max_blocks;
      run_table.insert(run_table.end(), row, row + max_blocks);
    }
  }
  HostPack pack;
  const size_t at_slots = pack.add(slot_mapping), at_positions = pack.add(chunk.position),
               at_rows = pack.add(chunk.table_row), at_context = pack.add(context_lens), at_table = pack.add(table),
               at_seq_lens = pack.add(run_seq_lens), at_run_table = pack.add(run_table),
               at_pool_context = pack.add(pool_context_lens), at_pool_slots = pack.add(pools.pool_slots),
               at_pool_tokens = pack.add(pools.token_slots);
  std::byte* const staged = static_cast<std::byte*>(compute->stage(pack.bytes()));
  const Device dev = compute->device();
  const int64_t segments = int64_t(table.size()) / max_blocks;
  st.positions = reinterpret_cast<const int32_t*>(staged + at_positions);
  st.slots = TensorView(staged + at_slots, {n}, DType::i64, dev);
  st.request_ids = TensorView(staged + at_rows, {n}, DType::i32, dev);
  st.block_table = TensorView(staged + at_table, {segments, max_blocks}, DType::i32, dev);
  st.context_lens = TensorView(staged + at_context, {n}, DType::i32, dev);
  st.run_seq_lens = staged + at_seq_lens;
  st.run_table = staged + at_run_table;
  if (kpool > 1) {
    st.pool_context_lens = TensorView(staged + at_pool_context, {n}, DType::i32, dev);
    st.pool_slots = TensorView(staged + at_pool_slots, {int64_t(pools.pool_slots.size())}, DType::i64, dev);
    st.pool_token_slots = reinterpret_cast<const int64_t*>(staged + at_pool_tokens);
  }
  return st;
}

void MlaLayer::State::run_chunk(const Chunk& chunk, const float* hidden, float* out, const std::vector<int32_t>& table,
                                int max_blocks, AttentionPath path, LayerProfile* prof) {
  const Staged st = stage(chunk, hidden, out, table, max_blocks, path);
  project(st, prof);
  write_latents(st, prof);
  // DSA: the indexer chooses each token's attended slots (and writes its cache on either path).
  const TensorView indices = !spec.is_sparse() ? TensorView()
                             : kpool > 1       ? select_pooled(st, path, prof)
                                               : select_tokens(st, path, prof);
  if (path == AttentionPath::unabsorbed) {
    attend_unabsorbed(st, prof);
  } else {
    attend_absorbed(st, indices, prof);
  }
  project_out(st, prof);
}

// Query and latent projections, the norms, then RoPE on the rope parts (none for heads without one).
void MlaLayer::State::project(const Staged& st, LayerProfile* prof) {
  const AttentionSpec& s = spec;
  layer::Compute& c = *compute;
  const int64_t n = st.n, hidden_size = s.hidden_size, h = s.num_heads, nope = s.qk_nope_head_dim,
                qk = s.qk_head_dim(), lora = s.kv_lora_rank, kva_dim = s.absorbed_qk_dim(), q_lora = s.q_lora_rank;
  float* const qr = q_lora > 0 ? buffer<float>(kQr, n * q_lora) : nullptr;
  float* const q = buffer<float>(kQ, n * h * qk);
  float* const kva = buffer<float>(kKva, n * kva_dim);
  phase(prof, &LayerProfile::projections, [&] {
    if (q_lora > 0) {
      c.linear(st.x, hidden_size, w.q_a, qr, q_lora, n);
      c.rms_norm(qr, n, q_lora, q_lora, w.q_a_norm, s.rms_norm_eps);
      c.linear(qr, q_lora, w.q_b, q, h * qk, n);
    } else {
      c.linear(st.x, hidden_size, w.q, q, h * qk, n);
    }
    c.linear(st.x, hidden_size, w.kv_a_mqa, kva, kva_dim, n);
    c.rms_norm(kva, n, lora, kva_dim, w.kv_a_norm, s.rms_norm_eps);
  });
  if (rope_pairs == 0) return;
  phase(prof, &LayerProfile::rope, [&] {
    c.rope(q + nope, n, h, h * qk, qk, st.positions, inv_freq, rope_pairs, s.rope_style);
    c.rope(kva + lora, n, 1, kva_dim, 0, st.positions, inv_freq, rope_pairs, s.rope_style);
  });
}

void MlaLayer::State::write_latents(const Staged& st, LayerProfile* prof) {
  const int64_t n = st.n, lora = spec.kv_lora_rank, rope = spec.qk_rope_head_dim, kva_dim = spec.absorbed_qk_dim();
  float* const kva = buffer<float>(kKva, n * kva_dim);
  const Device dev = compute->device();
  phase(prof, &LayerProfile::cache_write, [&] {
    write_mla_cache({TensorView(kva, {n, lora}, {kva_dim, 1}, DType::f32, dev),
                     rope ? TensorView(kva + lora, {n, rope}, {kva_dim, 1}, DType::f32, dev) : TensorView(),
                     st.slots, kv_view(), compute->stream()},
                    backend);
  });
}

// DeepSeek-V3.2's and GLM-5's lightning indexer: one cached key per token, RoPE on its first 64 values.
TensorView MlaLayer::State::select_tokens(const Staged& st, AttentionPath path, LayerProfile* prof) {
  const AttentionSpec& s = spec;
  layer::Compute& c = *compute;
  const Device dev = c.device();
  const IndexerSpec& ix = *s.indexer;
  const int64_t n = st.n, hi = ix.heads, dim = ix.head_dim, hidden_size = s.hidden_size;
  float* const qi = buffer<float>(kIndexQ, n * hi * dim);
  float* const ki = buffer<float>(kIndexK, n * dim);
  float* const weights = buffer<float>(kIndexWeights, n * hi);
  phase(prof, &LayerProfile::indexer, [&] {
    index_queries(st, qi, weights);
    c.linear(st.x, hidden_size, w.index_wk, ki, dim, n);
    c.layer_norm(ki, n, dim, dim, w.index_k_norm, w.index_k_norm_bias, 1e-6);
    // Head layout [rope | nope]: rope first, unlike MLA's heads.
    c.rope(qi, n, hi, hi * dim, dim, st.positions, inv_freq, rope_pairs, ix.rope_style);
    c.rope(ki, n, 1, dim, 0, st.positions, inv_freq, rope_pairs, ix.rope_style);
  });
  phase(prof, &LayerProfile::cache_write, [&] {
    write_index_cache({TensorView(ki, {n, dim}, DType::f32, dev), st.slots, index_view(), compute->stream()},
                      backend);
  });
  if (path != AttentionPath::absorbed) return {};
  const int64_t topk = ix.topk;
  uint16_t* const qi_half = buffer<uint16_t>(kIndexQHalf, n * hi * dim);
  const TensorView positions(buffer<int32_t>(kTopk, n * topk), {n, topk}, DType::i32, dev);
  const TensorView slots(buffer<int32_t>(kSlots, n * topk), {n, topk}, DType::i32, dev);
  phase(prof, &LayerProfile::topk, [&] {
    c.to_half(qi, qi_half, n * hi * dim, DType::bf16);
    index_topk(st, qi_half, weights, st.context_lens, positions);
    positions_to_slots({positions, st.request_ids, st.block_table, opt.block_size, slots, c.stream()}, backend);
  });
  return slots;
}

// GLM-5.3-Flash's pooled indexer (no RoPE): keys and gate scores per token, one cached key per whole pool of kpool
// tokens; top-k picks index_topk / kpool pools, which attend with their tokens and those of the incomplete last pool.
TensorView MlaLayer::State::select_pooled(const Staged& st, AttentionPath path, LayerProfile* prof) {
  const AttentionSpec& s = spec;
  layer::Compute& c = *compute;
  const Device dev = c.device();
  const IndexerSpec& ix = *s.indexer;
  const int64_t n = st.n, hi = ix.heads, dim = ix.head_dim, hidden_size = s.hidden_size;
  float* const qi = buffer<float>(kIndexQ, n * hi * dim);
  float* const keys = buffer<float>(kIndexK, n * 2 * dim);  // per token: the key, then the gate scores
  float* const weights = buffer<float>(kIndexWeights, n * hi);
  phase(prof, &LayerProfile::indexer, [&] {
    index_queries(st, qi, weights);
    c.linear(st.x, hidden_size, w.index_wk, keys, 2 * dim, n);
    c.layer_norm(keys, n, dim, 2 * dim, w.index_k_norm, w.index_k_norm_bias, 1e-6);
    c.linear(st.x, hidden_size, w.index_kpool_gate, keys + dim, 2 * dim, n);
  });
  phase(prof, &LayerProfile::cache_write, [&] {
    write_pooled_keys(keys, n, static_cast<const int64_t*>(st.slots.data), st.pool_slots.shape[0], st.pool_token_slots,
                      st.pool_slots);
  });
  if (path != AttentionPath::absorbed) return {};
  const int64_t top_pools = ix.topk / kpool, width = top_pools * kpool + kpool - 1;
  uint16_t* const qi_half = buffer<uint16_t>(kIndexQHalf, n * hi * dim);
  const TensorView pools(buffer<int32_t>(kPoolTopk, n * top_pools), {n, top_pools}, DType::i32, dev);
  const TensorView positions(buffer<int32_t>(kTopk, n * width), {n, width}, DType::i32, dev);
  const TensorView slots(buffer<int32_t>(kSlots, n * width), {n, width}, DType::i32, dev);
  phase(prof, &LayerProfile::topk, [&] {
    // The cached pool keys are Hadamard-rotated; rotating the queries too keeps every q.k.
    rotate_index_q({TensorView(qi, {n, hi, dim}, DType::f32, dev), TensorView(qi_half, {n, hi, dim}, DType::bf16, dev),
                    TensorView(), c.stream()},
                   backend);
    index_topk(st, qi_half, weights, st.pool_context_lens, pools);
    pools_to_positions({pools, st.context_lens, int(kpool), positions, c.stream()}, backend);
    positions_to_slots({positions, st.request_ids, st.block_table, opt.block_size, slots, c.stream()}, backend);
  });
  return slots;
}

// Both indexers' queries qi [n, heads, head_dim] (from q_a's normed rows) and head weights [n, heads] (scaled by
// 1 / sqrt(heads * head_dim)).
void MlaLayer::State::index_queries(const Staged& st, float* qi, float* weights) {
  const IndexerSpec& ix = *spec.indexer;
  const int64_t n = st.n, hi = ix.heads, dim = ix.head_dim, q_lora = spec.q_lora_rank;
  compute->linear(buffer<float>(kQr, n * q_lora), q_lora, w.index_wq_b, qi, hi * dim, n);
  compute->linear(st.x, spec.hidden_size, w.index_weights_proj, weights, hi, n,
                  float(1.0 / std::sqrt(double(hi) * dim)));
}

// The indexer's top-k over the index cache (tokens, or pools) for the chunk's rows: q [n, heads, head_dim] bf16,
// weights [n, heads]; context_lens [n]: the cache rows each one sees.
void MlaLayer::State::index_topk(const Staged& st, uint16_t* q, float* weights, const TensorView& context_lens,
                                 const TensorView& topk) {
  const IndexerSpec& ix = *spec.indexer;
  const Device dev = compute->device();
  IndexerTopkArgs args;
  args.q = TensorView(q, {st.n, ix.heads, ix.head_dim}, DType::bf16, dev);
  args.weights = TensorView(weights, {st.n, ix.heads}, DType::f32, dev);
  args.index_cache = index_view();
  args.request_ids = st.request_ids;
  args.block_table = st.block_table;
  args.context_lens = context_lens;
  args.topk = topk;
  args.sorted = false;  // only the layer's attention reads them: no order needed, and the GPU's top-k is faster so
  args.stream = compute->stream();
  indexer_topk(args, backend);
}

// keys [n, 256] (index key, gate scores) of tokens at token_slots go to pool_pending; then each completed pool's
// kpool rows (pool_token_slots [pools * kpool]) are pooled into its index cache row (pool_slots [pools]).
void MlaLayer::State::write_pooled_keys(const float* keys, int64_t n, const int64_t* token_slots, int64_t pools,
                                        const int64_t* pool_token_slots, const TensorView& pool_slots) {
  layer::Compute& c = *compute;
  const Device dev = c.device();
  constexpr int64_t dim = kIndexHeadDim, row = 2 * kIndexHeadDim;
  c.copy_indexed_rows(keys, row, nullptr, pool_pending, row, token_slots, n, row);
  if (pools == 0) return;
  float* const gathered = buffer<float>(kPoolTokens, pools * kpool * row);
  c.copy_indexed_rows(pool_pending, row, pool_token_slots, gathered, row, nullptr, pools * kpool, row);
  WritePooledIndexCacheArgs args;
  args.k = TensorView(gathered, {pools, kpool, dim}, {kpool * row, row, 1}, DType::f32, dev);
  args.gate = TensorView(gathered + dim, {pools, kpool, dim}, {kpool * row, row, 1}, DType::f32, dev);
  args.ape = TensorView(const_cast<float*>(w.index_kpool_ape), {kpool, dim}, DType::f32, dev);
  args.slot_mapping = pool_slots;
  args.cache = index_view();
  args.stream = c.stream();
  write_pooled_index_cache(args, backend);
}

void MlaLayer::State::attend_unabsorbed(const Staged& st, LayerProfile* prof) {
  const AttentionSpec& s = spec;
  const int64_t n = st.n;
  // CPU only (forward checks it), where the matrices are the fp32 weights.
  phase(prof, &LayerProfile::attention, [&] {
    layer::unabsorbed_attention(s, scale, static_cast<const float*>(w.kv_b.data),
                                buffer<float>(kQ, n * s.num_heads * s.qk_head_dim()),
                                buffer<float>(kKva, n * s.absorbed_qk_dim()), n,
                                buffer<float>(kAttn, n * s.num_heads * s.v_head_dim));
  });
}

// W_UK folded into the query, attention over the latent cache (sparse_mla over `indices`, or paged_mla_decode for
// dense models), W_UV applied to the latent output.
void MlaLayer::State::attend_absorbed(const Staged& st, const TensorView& indices, LayerProfile* prof) {
  const AttentionSpec& s = spec;
  layer::Compute& c = *compute;
  const Device dev = c.device();
  void* const stream = c.stream();
  const int64_t n = st.n, h = s.num_heads, nope = s.qk_nope_head_dim, rope = s.qk_rope_head_dim,
                qk = s.qk_head_dim(), v = s.v_head_dim, lora = s.kv_lora_rank, kv_rows = nope + v,
                head = s.absorbed_qk_dim();
  const float* const q = buffer<float>(kQ, n * h * qk);
  float* const q_abs = buffer<float>(kQAbs, n * h * head);
  phase(prof, &LayerProfile::projections, [&] {
    // q_lat = q_nope @ W_UK per head, next to the roped q_pe (if any): one latent query head.
    c.matmul_per_head({const_cast<float*>(q), h * qk, qk}, w.kv_b, {0, nope, kv_rows}, {q_abs, h * head, head}, n, h);
    if (rope > 0) c.copy_rows(q + nope, qk, q_abs + lora, head, n * h, rope);
  });
  uint16_t* const q_half = buffer<uint16_t>(kQHalf, n * h * head);
  uint16_t* const o_half = buffer<uint16_t>(kOHalf, n * h * kMlaVDim);
  float* const lse = buffer<float>(kLse, n * h);
  phase(prof, &LayerProfile::attention, [&] {
    c.to_half(q_abs, q_half, n * h * head, q_dtype);
    if (s.is_sparse()) {
      SparseMlaArgs args;
      args.q = TensorView(q_half, {n, h, head}, q_dtype, dev);
      args.kv_cache = kv_view();
      args.indices = indices;
      args.softmax_scale = scale;
      args.out = TensorView(o_half, {n, h, kMlaVDim}, q_dtype, dev);
      args.lse = TensorView(lse, {n, h}, DType::f32, dev);
      args.stream = stream;
      sparse_mla(args, backend);
      return;
    }
    // paged_mla_decode takes the same number of new tokens per request: one call for the chunk when its runs are
    // equally long (decode batches, single prompts), else one call per run.
    const std::vector<int64_t>& run_start = st.run_start;
    const int64_t runs = int64_t(run_start.size()) - 1, len0 = run_start[1];
    bool uniform = true;
    for (int64_t r = 0; r < runs; ++r) uniform &= run_start[r + 1] - run_start[r] == len0;
    const auto call = [&](int64_t first_run, int64_t b, int64_t s_q) {
      const int64_t t0 = run_start[first_run];
      PagedMlaDecodeArgs args;
      args.q = TensorView(q_half + t0 * h * head, {b, s_q, h, head}, q_dtype, dev);
      args.kv_cache = kv_view();
      args.block_table = TensorView(const_cast<std::byte*>(st.run_table) + first_run * st.max_blocks * sizeof(int32_t),
                                    {b, st.max_blocks}, DType::i32, dev);
      args.seq_lens = TensorView(const_cast<std::byte*>(st.run_seq_lens) + first_run * sizeof(int32_t), {b},
                                 DType::i32, dev);
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
    c.linear_per_head({o_lat, h * kMlaVDim, kMlaVDim}, w.kv_b, {nope, v, kv_rows},
                      {buffer<float>(kAttn, n * h * v), h * v, v}, n, h);
  });
}

void MlaLayer::State::project_out(const Staged& st, LayerProfile* prof) {
  const int64_t n = st.n, hv = int64_t(spec.num_heads) * spec.v_head_dim;
  phase(prof, &LayerProfile::output,
        [&] { compute->linear(buffer<float>(kAttn, n * hv), hv, w.o, st.out, spec.hidden_size, n); });
}

}  // namespace smla
