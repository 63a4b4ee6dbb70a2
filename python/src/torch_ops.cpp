// smla._torch_ops: the torch.ops.smla kernels in C++, for CPU and CUDA tensors. python/smla/torch_ops.py defines
// the schemas and fakes (once) and the Python kernels every other device key falls back to, then loads this
// library, which registers these kernels for the CPU and CUDA keys: a call goes from torch's dispatcher straight
// to smla's C++ API, with no Python, DLPack capsule or nanobind call in between. Each kernel does what its Python
// twin does (python/smla/torch_ops.py, ops.py, flash_mla.py): the same argument checks and messages, outputs and
// scratch from torch's allocator on the inputs' device, the work on torch's current stream.
//
// Errors: smla's bad-input errors leave as c10::ValueError (Python ValueError), unsupported ones as
// c10::NotImplementedError, the rest as c10::Error (RuntimeError); python/smla/torch_ops.py turns the first two back
// into smla.InvalidArgumentError / smla.UnsupportedError for smla's own functions.
#include <ATen/EmptyTensor.h>
#include <ATen/core/DimVector.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#ifdef SMLA_TORCH_CUDA
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>

#include "smla/error.h"
#include "smla/ops.h"
#include "views.h"

namespace smla::python {

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

constexpr int64_t kLatentDim = 512;
constexpr int64_t kFp8NopeRowBytes = 528;  // fp8_ds_mla_nope: 512 e4m3 + 4 fp32 scales
constexpr int64_t kMaxTopk = 65536;        // as smla.ops._MAX_TOPK
constexpr double kFloat32Max = 3.4028234663852886e38;

// --- tensors --------------------------------------------------------------------------------------------------

// smla._arrays.is_8bit: how fp8 data arrives (uint8, int8, float8_*).
bool is_8bit(const Tensor& t) {
  return t.scalar_type() == at::kByte || t.scalar_type() == at::kChar ||
         (t.element_size() == 1 && t.is_floating_point());
}

// The DLPack dtype torch's exporter gives `t` (fp8 arrives as bytes, as smla.ops exports it).
DLDataType dl_dtype(const Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return {kDLFloat, 32, 1};
    case at::kHalf: return {kDLFloat, 16, 1};
    case at::kBFloat16: return {kDLBfloat, 16, 1};
    case at::kDouble: return {kDLFloat, 64, 1};
    case at::kInt: return {kDLInt, 32, 1};
    case at::kLong: return {kDLInt, 64, 1};
    case at::kShort: return {kDLInt, 16, 1};
    case at::kChar: return {kDLInt, 8, 1};
    case at::kByte: return {kDLUInt, 8, 1};
    case at::kBool: return {6, 8, 1};  // kDLBool (DLPack >= 0.8)
    default: break;
  }
  if (t.is_floating_point() && t.element_size() == 1) return {kDLUInt, 8, 1};  // fp8 as bytes
  return {kDLOpaqueHandle, static_cast<uint8_t>(8 * t.element_size()), 1};    // named as unsupported by view_of
}

// `t` as smla argument `name` (undefined: absent), its raw bytes read as `as` when given; fp8 tensors are read as
// fp8_e4m3 unless `as` says otherwise.
TensorView view(const Tensor& t, const char* name, std::optional<DType> as = std::nullopt) {
  if (!t.defined()) return {};
  DLTensor d{};
  d.data = t.data_ptr();
  d.device.device_type = t.is_cuda() ? kDLCUDA : t.is_cpu() ? kDLCPU : kDLExtDev;
  d.device.device_id = t.is_cuda() ? t.get_device() : 0;
  d.ndim = static_cast<int>(t.dim());
  d.dtype = dl_dtype(t);
  d.shape = const_cast<int64_t*>(t.sizes().data());
  d.strides = const_cast<int64_t*>(t.strides().data());
  if (!as && t.is_floating_point() && t.element_size() == 1) as = DType::fp8_e4m3;
  return view_of(d, name, as);
}
TensorView view(const OptTensor& t, const char* name) { return t ? view(*t, name) : TensorView{}; }

// `v` with dimension `dim` fixed at `index`: torch's select without making a tensor (no dispatcher call, no
// allocation: host time per call). An empty tensor's view has no data and keeps none, as torch's has.
TensorView selected(TensorView v, int dim, int64_t index) {
  if (v.data) v.data = static_cast<char*>(v.data) + index * v.strides[dim] * static_cast<int64_t>(dtype_size(v.dtype));
  for (int d = dim; d + 1 < v.ndim; ++d) {
    v.shape[d] = v.shape[d + 1];
    v.strides[d] = v.strides[d + 1];
  }
  v.ndim -= 1;
  return v;
}

// `v` with its last two dimensions swapped (torch's transpose(-1, -2), without making a tensor).
TensorView transposed(TensorView v) {
  std::swap(v.shape[v.ndim - 2], v.shape[v.ndim - 1]);
  std::swap(v.strides[v.ndim - 2], v.strides[v.ndim - 1]);
  return v;
}

// FlashMLA's 4-D cache (num_blocks, page_block_size, 1, d) as smla's 3-D one (its head count checked before).
TensorView without_head_axis(const TensorView& cache) { return cache.ndim == 4 ? selected(cache, 2, 0) : cache; }

// --- the checks smla.ops makes in Python before its C++ call, with its messages -----------------------------------

std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
  return out;
}

using Names = std::span<const std::string_view>;

bool one_of(std::string_view s, Names names) { return std::find(names.begin(), names.end(), s) != names.end(); }

// Python's repr of a str without quotes or backslashes in it.
std::string repr(std::string_view s) { return "'" + std::string(s) + "'"; }

// Python's repr of a float: the shortest round-trip digits, ".0" on integral values.
std::string repr(double v) {
  char buf[64];
  const auto end = std::to_chars(buf, buf + sizeof buf, v).ptr;
  std::string s(buf, end);
  if (s.find_first_of(".eni") == std::string::npos) s += ".0";
  return s;
}

// smla.ops' _MLA_FP8_ALIASES, _MLA_CACHE_DTYPES and _INDEX_CACHE_DTYPES, in their order (the messages list them).
constexpr std::string_view kMlaFp8Aliases[] = {"fp8", "fp8_e4m3", "float8_e4m3fn", "e4m3", "fp8_ds_mla"};
constexpr std::string_view kMlaCacheDtypes[] = {"auto", "bfloat16", "bf16", "float16", "fp16", "half",
                                                "fp8_ds_mla_nope", "fp8_ds_mla_v4", "fp8", "fp8_e4m3",
                                                "float8_e4m3fn", "e4m3", "fp8_ds_mla"};
constexpr std::string_view kIndexCacheDtypes[] = {"auto", "bfloat16", "bf16", "fp8", "fp8_e4m3", "float8_e4m3fn",
                                                  "e4m3"};
constexpr std::string_view kIndexFp8Aliases[] = {"fp8", "float8_e4m3fn", "e4m3"};

void check_name(std::string_view value, const char* name, Names allowed) {
  if (one_of(lower(value), allowed)) return;
  std::string list;
  for (std::string_view a : allowed) list += (list.empty() ? "" : ", ") + std::string(a);
  fail(std::string(name) + ": expected one of " + list + ", got " + repr(value));
}

DType parsed(const std::string& name, const char* arg) {
  const auto d = parse_dtype(name);
  if (!d) fail(std::string(arg) + ": unknown dtype '" + name + "'");
  return *d;
}

// smla.ops._mla_cache_dtype: the dtype to read an MLA cache as (none: its own).
std::optional<DType> mla_cache_dtype(const Tensor& cache, std::string_view kv_cache_dtype, const char* arg) {
  check_name(kv_cache_dtype, "kv_cache_dtype", kMlaCacheDtypes);
  const auto fp8_by_width = [&] {
    const int64_t width = cache.dim() > 0 ? cache.size(-1) : 0;
    return width == kFp8NopeRowBytes                ? DType::fp8_ds_mla_nope
           : width == MlaV4CacheLayout::kRowBytes ? DType::fp8_ds_mla_v4
                                                   : DType::fp8_ds_mla;
  };
  const std::string name = lower(kv_cache_dtype);
  if (name == "auto") return is_8bit(cache) ? std::optional(fp8_by_width()) : std::nullopt;
  if (one_of(name, kMlaFp8Aliases) && name != "fp8_ds_mla") return fp8_by_width();
  return parsed(name, arg);
}

// smla.ops._index_dtype: the dtype of an indexer tensor (q or cache); 8-bit data is fp8_e4m3.
std::optional<DType> index_dtype(const Tensor& x, std::string_view index_cache_dtype, const char* arg) {
  check_name(index_cache_dtype, "index_cache_dtype", kIndexCacheDtypes);
  const std::string name = lower(index_cache_dtype);
  if (name == "auto") return is_8bit(x) ? std::optional(DType::fp8_e4m3) : std::nullopt;
  if (one_of(name, kIndexFp8Aliases)) return DType::fp8_e4m3;
  return parsed(name, arg);
}

float softmax_scale_of(double value, const char* name = "softmax_scale") {
  if (!(value > 0.0 && value <= kFloat32Max))
    fail(std::string(name) + ": must be finite, > 0 and at most 3.402823e+38 (float32), got " + repr(value));
  return static_cast<float>(value);
}

int64_t int_in(int64_t value, const char* name, int64_t low, int64_t high) {
  if (value < low || value > high)
    fail(std::string(name) + ": expected an int from " + std::to_string(low) + " to " + std::to_string(high) +
         ", got " + std::to_string(value));
  return value;
}

// --- outputs, scratch, streams ----------------------------------------------------------------------------------

// An uninitialised tensor from the device's allocator (torch's caching allocator on a GPU), as at::empty makes it
// but without dispatching an operator of its own (host time per call): the kernels are registered for the CPU and
// CUDA keys only, so `options` names one of the two. (at::empty's NaN fill under torch's deterministic mode is not
// needed: the kernels write every element of their outputs, and no op relies on what scratch holds.)
Tensor new_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
#ifdef SMLA_TORCH_CUDA
  if (options.device().is_cuda()) return at::detail::empty_cuda(sizes, options);
#endif
  return at::detail::empty_cpu(sizes, options);
}

// smla.torch_ops._attention_out: out [..., 512] in q's dtype and lse [...] float32.
std::tuple<Tensor, Tensor> attention_out(const Tensor& q) {
  at::DimVector lead(q.sizes().begin(), q.sizes().end());  // on the stack: no allocation but the outputs'
  if (!lead.empty()) lead.pop_back();
  Tensor lse = new_empty(lead, q.options().dtype(at::kFloat));
  lead.push_back(kLatentDim);
  return {new_empty(lead, q.options()), lse};
}

Tensor topk_out(const Tensor& q, int64_t topk) {
  return new_empty({q.dim() > 0 ? q.size(0) : 0, int_in(topk, "topk", 1, kMaxTopk)}, q.options().dtype(at::kInt));
}

// The stream the op runs on: torch's current one on `ref`'s GPU (none on the CPU).
void* stream_of(const Tensor& ref) {
#ifdef SMLA_TORCH_CUDA
  if (ref.is_cuda()) return at::cuda::getCurrentCUDAStream(ref.get_device()).stream();
#endif
  return nullptr;
}

// Runs `op(a, backend, workspace)` on torch's current stream of q's device, with scratch, when the op needs any
// (a GPU op that splits; the CPU backend never does), from torch's caching allocator (capture-safe): the op checks
// its args once and then asks for the bytes (the WorkspaceSource overloads of smla/ops.h; workspace_size first
// would check them twice). The scratch tensor lives until the op has been enqueued (the allocator's stream
// semantics keep it for the kernels).
template <class Args, class Op>
void run_on_stream(Args& a, const Tensor& q, std::string_view backend, Op op) {
  a.stream = stream_of(q);
  Tensor workspace;
  const auto from_torch = [&](size_t bytes) {
    workspace = new_empty({static_cast<int64_t>(bytes)}, q.options().dtype(at::kByte));
    return view(workspace, "workspace");
  };
  op(a, backend_by_name(backend, a.q.device), WorkspaceSource(from_torch));
}

// Runs `body`, turning smla::Error into the c10 error Python sees as ValueError / NotImplementedError /
// RuntimeError, with smla's message as it is.
template <class Body>
auto translated(Body body) -> decltype(body()) {
  try {
    return body();
  } catch (const Error& e) {
    const c10::SourceLocation where{__func__, __FILE__, static_cast<uint32_t>(__LINE__)};
    switch (e.kind()) {
      case ErrorKind::invalid_argument: throw c10::ValueError(where, e.what());
      case ErrorKind::unsupported: throw c10::NotImplementedError(where, e.what());
      default: throw c10::Error(where, e.what());
    }
  }
}

// --- the kernels, one per schema in python/smla/torch_ops.py -----------------------------------------------------

void write_mla_cache_kernel(const Tensor& latent, const Tensor& k_pe, const Tensor& slot_mapping, const Tensor& cache,
                            c10::string_view kv_cache_dtype, c10::string_view backend) {
  translated([&] {
    WriteMlaCacheArgs a;
    a.latent = view(latent, "latent");
    a.k_pe = view(k_pe, "k_pe");
    a.slot_mapping = view(slot_mapping, "slot_mapping");
    a.cache = view(cache, "cache", mla_cache_dtype(cache, kv_cache_dtype, "cache"));
    a.stream = stream_of(cache);
    write_mla_cache(a, backend_by_name(backend, a.cache.device));
  });
}

// A second cache under the same softmax (SparseMlaArgs::extra_*), read as kv_cache is; all absent: none.
struct ExtraCache {
  OptTensor kv_cache, indices, topk_length;
};

// smla.ops._sparse_mla's arguments but its outputs (and stream), the caches read as kv_cache_dtype says.
SparseMlaArgs sparse_mla_args(const Tensor& q, const Tensor& kv_cache, const Tensor& indices,
                              const OptTensor& topk_length, const OptTensor& attn_sink, double softmax_scale,
                              std::string_view kv_cache_dtype, const ExtraCache& extra = {}) {
  const std::optional<DType> cache_dtype = mla_cache_dtype(kv_cache, kv_cache_dtype, "kv_cache");
  SparseMlaArgs a;
  a.softmax_scale = softmax_scale_of(softmax_scale);
  a.q = view(q, "q");
  a.kv_cache = view(kv_cache, "kv_cache", cache_dtype);
  a.indices = view(indices, "indices");
  a.topk_length = view(topk_length, "topk_length");
  a.attn_sink = view(attn_sink, "attn_sink");
  if (extra.kv_cache) a.extra_kv_cache = view(*extra.kv_cache, "extra_kv_cache", cache_dtype);
  a.extra_indices = view(extra.indices, "extra_indices");
  a.extra_topk_length = view(extra.topk_length, "extra_topk_length");
  return a;
}

void run_sparse_mla(SparseMlaArgs& a, const Tensor& q, std::string_view backend) {
  run_on_stream(a, q, backend, [](const auto& x, auto be, auto ws) { sparse_mla(x, be, ws); });
}

// sparse_mla.out: into the caller's out and lse, checked by smla as every output is (shape, dtype, device, the last
// dimension contiguous, no overlap with an input or each other) before anything is written.
void sparse_mla_out_kernel(const Tensor& q, const Tensor& kv_cache, const Tensor& indices,
                           const OptTensor& topk_length, const OptTensor& attn_sink, double softmax_scale,
                           c10::string_view kv_cache_dtype, c10::string_view backend, const OptTensor& extra_kv_cache,
                           const OptTensor& extra_indices, const OptTensor& extra_topk_length, const Tensor& out,
                           const Tensor& lse) {
  translated([&] {
    SparseMlaArgs a = sparse_mla_args(q, kv_cache, indices, topk_length, attn_sink, softmax_scale, kv_cache_dtype,
                                      {extra_kv_cache, extra_indices, extra_topk_length});
    a.out = view(out, "out");
    a.lse = view(lse, "lse");
    run_sparse_mla(a, q, backend);
  });
}

std::tuple<Tensor, Tensor> sparse_mla_kernel(const Tensor& q, const Tensor& kv_cache, const Tensor& indices,
                                             const OptTensor& topk_length, const OptTensor& attn_sink,
                                             double softmax_scale, c10::string_view kv_cache_dtype,
                                             c10::string_view backend, const OptTensor& extra_kv_cache,
                                             const OptTensor& extra_indices, const OptTensor& extra_topk_length) {
  auto [out, lse] = attention_out(q);
  sparse_mla_out_kernel(q, kv_cache, indices, topk_length, attn_sink, softmax_scale, kv_cache_dtype, backend,
                        extra_kv_cache, extra_indices, extra_topk_length, out, lse);
  return {out, lse};
}

// smla.ops._paged_mla_decode's arguments but its outputs (and stream).
PagedMlaDecodeArgs paged_mla_decode_args(const Tensor& q, const Tensor& kv_cache, const OptTensor& block_table,
                                         const OptTensor& seq_lens, const OptTensor& attn_sink, double softmax_scale,
                                         bool causal, std::string_view kv_cache_dtype) {
  const std::optional<DType> cache_dtype = mla_cache_dtype(kv_cache, kv_cache_dtype, "kv_cache");
  PagedMlaDecodeArgs a;
  a.softmax_scale = softmax_scale_of(softmax_scale);
  a.q = view(q, "q");
  a.kv_cache = view(kv_cache, "kv_cache", cache_dtype);
  a.block_table = view(block_table, "block_table");
  a.seq_lens = view(seq_lens, "seq_lens");
  a.attn_sink = view(attn_sink, "attn_sink");
  a.causal = causal;
  return a;
}

void run_paged_mla_decode(PagedMlaDecodeArgs& a, const Tensor& q, std::string_view backend) {
  run_on_stream(a, q, backend, [](const auto& x, auto be, auto ws) { paged_mla_decode(x, be, ws); });
}

// paged_mla_decode.out: into the caller's out and lse, checked as sparse_mla.out's are.
void paged_mla_decode_out_kernel(const Tensor& q, const Tensor& kv_cache, const Tensor& block_table,
                                 const Tensor& seq_lens, const OptTensor& attn_sink, double softmax_scale, bool causal,
                                 c10::string_view kv_cache_dtype, c10::string_view backend, const Tensor& out,
                                 const Tensor& lse) {
  translated([&] {
    PagedMlaDecodeArgs a =
        paged_mla_decode_args(q, kv_cache, block_table, seq_lens, attn_sink, softmax_scale, causal, kv_cache_dtype);
    a.out = view(out, "out");
    a.lse = view(lse, "lse");
    run_paged_mla_decode(a, q, backend);
  });
}

std::tuple<Tensor, Tensor> paged_mla_decode_kernel(const Tensor& q, const Tensor& kv_cache, const Tensor& block_table,
                                                   const Tensor& seq_lens, const OptTensor& attn_sink,
                                                   double softmax_scale, bool causal, c10::string_view kv_cache_dtype,
                                                   c10::string_view backend) {
  auto [out, lse] = attention_out(q);
  paged_mla_decode_out_kernel(q, kv_cache, block_table, seq_lens, attn_sink, softmax_scale, causal, kv_cache_dtype,
                              backend, out, lse);
  return {out, lse};
}

void write_index_cache_kernel(const Tensor& k, const Tensor& slot_mapping, const Tensor& cache,
                              c10::string_view index_cache_dtype, c10::string_view backend) {
  translated([&] {
    WriteIndexCacheArgs a;
    a.k = view(k, "k");
    a.slot_mapping = view(slot_mapping, "slot_mapping");
    a.cache = view(cache, "cache", index_dtype(cache, index_cache_dtype, "cache"));
    a.stream = stream_of(cache);
    write_index_cache(a, backend_by_name(backend, a.cache.device));
  });
}

// indexer_topk's arguments (stream aside), as indexer_topk and dsa_decode_step take them: the cache read as
// `index_cache_as`, top-k into `topk`.
IndexerTopkArgs indexer_args(const IndexerQueryNames& names, const Tensor& q, const OptTensor& q_scale,
                             const Tensor& weights, const Tensor& index_cache, std::optional<DType> index_cache_as,
                             const Tensor& request_ids, const Tensor& block_table, const Tensor& context_lens,
                             const Tensor& topk) {
  IndexerTopkArgs a;
  a.q = view(q, names.q, index_dtype(q, "auto", names.q));
  a.q_scale = view(q_scale, names.q_scale);
  a.weights = view(weights, names.weights);
  a.index_cache = view(index_cache, "index_cache", index_cache_as);
  a.request_ids = view(request_ids, "request_ids");
  a.block_table = view(block_table, "block_table");
  a.context_lens = view(context_lens, "context_lens");
  a.topk = view(topk, "topk");
  return a;
}

Tensor indexer_topk_kernel(const Tensor& q, const OptTensor& q_scale, const Tensor& weights, const Tensor& index_cache,
                           const Tensor& request_ids, const Tensor& block_table, const Tensor& context_lens,
                           int64_t topk, c10::string_view index_cache_dtype, c10::string_view backend, bool sorted) {
  return translated([&] {
    Tensor out = topk_out(q, topk);
    const std::optional<DType> index_cache_as = index_dtype(index_cache, index_cache_dtype, "index_cache");
    IndexerTopkArgs a = indexer_args(kIndexerTopkNames, q, q_scale, weights, index_cache, index_cache_as,
                                     request_ids, block_table, context_lens, out);
    a.sorted = sorted;
    run_on_stream(a, q, backend, [](const auto& x, auto be, auto ws) { indexer_topk(x, be, ws); });
    return out;
  });
}

Tensor positions_to_slots_kernel(const Tensor& positions, const Tensor& request_ids, const Tensor& block_table,
                                 int64_t block_size, c10::string_view backend) {
  return translated([&] {
    PositionsToSlotsArgs a;
    a.positions = view(positions, "positions");
    a.request_ids = view(request_ids, "request_ids");
    a.block_table = view(block_table, "block_table");
    a.block_size = static_cast<int>(int_in(block_size, "block_size", 1, INT32_MAX));
    Tensor slots = new_empty(positions.sizes(), positions.options().dtype(at::kInt));
    a.slots = view(slots, "slots");
    a.stream = stream_of(positions);
    positions_to_slots(a, backend_by_name(backend, a.positions.device));
    return slots;
  });
}

std::tuple<Tensor, Tensor, Tensor, Tensor> dsa_decode_step_kernel(
    const Tensor& q, const Tensor& kv_cache, const Tensor& index_q, const Tensor& index_weights,
    const Tensor& index_cache, const Tensor& request_ids, const Tensor& block_table, const Tensor& context_lens,
    const OptTensor& index_q_scale, const OptTensor& attn_sink, int64_t topk, double softmax_scale,
    c10::string_view kv_cache_dtype, c10::string_view index_cache_dtype, c10::string_view backend, bool sorted) {
  return translated([&] {
    auto [out, lse] = attention_out(q);
    Tensor positions = topk_out(q, topk), slots = topk_out(q, topk);
    DsaDecodeStepArgs a;
    const std::optional<DType> index_cache_as = index_dtype(index_cache, index_cache_dtype, "index_cache");
    const std::optional<DType> cache_dtype = mla_cache_dtype(kv_cache, kv_cache_dtype, "kv_cache");
    a.softmax_scale = softmax_scale_of(softmax_scale);
    a.indexer = indexer_args(kDecodeStepNames, index_q, index_q_scale, index_weights, index_cache, index_cache_as,
                             request_ids, block_table, context_lens, positions);
    a.indexer.sorted = sorted;
    a.slots = view(slots, "slots");
    a.q = view(q, "q");
    a.kv_cache = view(kv_cache, "kv_cache", cache_dtype);
    a.attn_sink = view(attn_sink, "attn_sink");
    a.out = view(out, "out");
    a.lse = view(lse, "lse");
    a.indexer.stream = stream_of(q);
    run_on_stream(a, q, backend, [](const auto& x, auto be, auto ws) { dsa_decode_step(x, be, ws); });
    return std::make_tuple(out, lse, positions, slots);
  });
}

// A shape as Python prints a tuple: "(4, 64, 1, 576)".
std::string py_tuple(at::IntArrayRef sizes) {
  std::string s = "(";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + (sizes.size() == 1 ? ",)" : ")");
}

// indices (b, s_q, topk) and topk_length (b,) or (b, s_q) against q's b and s_q, as smla.flash_mla._sparse_shapes
// checks them, with its messages (the per-token loop below takes each list's column j without bounds checks).
void check_sparse_shapes(int64_t b, int64_t s_q, const Tensor& indices, const OptTensor& lengths,
                         const char* indices_name, const char* lengths_name) {
  if (indices.dim() != 3 || indices.size(0) != b || indices.size(1) != s_q)
    fail(std::string(indices_name) + ": expected (batch_size, seq_len_q, topk) with q's batch_size " +
         std::to_string(b) + " and seq_len_q " + std::to_string(s_q) + ", got " + py_tuple(indices.sizes()));
  if (lengths && !(lengths->dim() == 1 && lengths->size(0) == b) &&
      !(lengths->dim() == 2 && lengths->size(0) == b && lengths->size(1) == s_q))
    fail(std::string(lengths_name) + ": expected (" + std::to_string(b) + ",) (per request) or (" +
         std::to_string(b) + ", " + std::to_string(s_q) + ") (per query token), got " + py_tuple(lengths->sizes()));
}

// MODEL1's extra cache, checked as smla.flash_mla._extra_cache checks it, with its messages.
ExtraCache flash_mla_extra_cache(int64_t b, int64_t s_q, const OptTensor& indices, const OptTensor& extra_k_cache,
                                 const OptTensor& extra_indices, const OptTensor& extra_topk_length) {
  if (!extra_k_cache && !extra_indices && !extra_topk_length) return {};
  if (!extra_k_cache || !extra_indices)
    fail("extra_k_cache and extra_indices_in_kvcache: give both or neither (extra_topk_length needs them too)");
  if (!indices) fail("extra_k_cache: only valid with indices (sparse attention)");
  check_sparse_shapes(b, s_q, *extra_indices, extra_topk_length, "extra_indices_in_kvcache", "extra_topk_length");
  if (extra_k_cache->dim() == 4 && extra_k_cache->size(2) != 1)
    fail("extra_k_cache: num_heads_k must be 1 (MLA), got " + py_tuple(extra_k_cache->sizes()));
  return {extra_k_cache, extra_indices, extra_topk_length};  // a 4-D cache: without_head_axis of its view
}

// A (b,) length list serves every new token j; a (b, s_q) one is taken per j.
TensorView lengths_of_token(const TensorView& lengths, int64_t j) {
  return lengths.ndim == 2 ? selected(lengths, 1, j) : lengths;
}

// smla.flash_mla: out (b, s_q, h_q, 512) and lse (b, h_q, s_q), the kernels writing lse through a (b, s_q, h_q)
// view, +inf where a query has nothing to attend. Sparse: one sparse_mla per new token j, whose tokens are the
// requests; a per-request topk_length (b,) serves every j, a (b, s_q) one is taken per j. FlashMLA's 4-D cache
// (num_blocks, page_block_size, 1, d) is viewed as smla's 3-D one (smla.flash_mla._cache_3d). The per-token
// slices are views made here, not torch tensors: no dispatcher call but the two outputs' allocations.
std::tuple<Tensor, Tensor> flash_mla_with_kvcache_kernel(
    const Tensor& q, const Tensor& k_cache, const OptTensor& block_table, const OptTensor& cache_seqlens,
    const OptTensor& indices, const OptTensor& topk_length, const OptTensor& attn_sink, double softmax_scale,
    bool causal, c10::string_view kv_cache_dtype, c10::string_view backend, const OptTensor& extra_k_cache,
    const OptTensor& extra_indices_in_kvcache, const OptTensor& extra_topk_length) {
  return translated([&] {
    // smla.flash_mla._check_shapes' checks, in its order: the wrapper reads no shape before this op on torch tensors.
    if (q.dim() != 4) fail("q: expected (batch_size, seq_len_q, num_heads_q, 576 | 512), got " + py_tuple(q.sizes()));
    if (k_cache.dim() == 4 && k_cache.size(2) != 1)
      fail("k_cache: num_heads_k must be 1 (MLA), got " + py_tuple(k_cache.sizes()));
    const int64_t b = q.size(0), s_q = q.size(1), h_q = q.size(2);
    if (indices) check_sparse_shapes(b, s_q, *indices, topk_length, "indices", "topk_length");
    const ExtraCache extra =
        flash_mla_extra_cache(b, s_q, indices, extra_k_cache, extra_indices_in_kvcache, extra_topk_length);
    Tensor out = new_empty({b, s_q, h_q, kLatentDim}, q.options());
    Tensor lse = new_empty({b, h_q, s_q}, q.options().dtype(at::kFloat));
    const TensorView out_view = view(out, "out"), lse_view = transposed(view(lse, "lse"));
    if (!indices) {
      PagedMlaDecodeArgs a = paged_mla_decode_args(q, k_cache, block_table, cache_seqlens, attn_sink, softmax_scale,
                                                   causal, kv_cache_dtype);
      a.kv_cache = without_head_axis(a.kv_cache);
      a.out = out_view;
      a.lse = lse_view;
      a.empty_lse_plus_inf = true;
      run_paged_mla_decode(a, q, backend);
      return std::make_tuple(out, lse);
    }
    SparseMlaArgs all = sparse_mla_args(q, k_cache, *indices, topk_length, attn_sink, softmax_scale, kv_cache_dtype,
                                        extra);
    all.kv_cache = without_head_axis(all.kv_cache);
    all.extra_kv_cache = without_head_axis(all.extra_kv_cache);
    all.empty_lse_plus_inf = true;
    for (int64_t j = 0; j < s_q; ++j) {
      SparseMlaArgs a = all;
      a.q = selected(all.q, 1, j);
      a.indices = selected(all.indices, 1, j);
      a.topk_length = lengths_of_token(all.topk_length, j);
      a.out = selected(out_view, 1, j);
      a.lse = selected(lse_view, 1, j);
      if (extra.kv_cache) {
        a.extra_indices = selected(all.extra_indices, 1, j);
        a.extra_topk_length = lengths_of_token(all.extra_topk_length, j);
      }
      run_sparse_mla(a, q, backend);
    }
    return std::make_tuple(out, lse);
  });
}

// flash_mla_sparse_fwd: out, max_logits and lse, all three from the kernel (+inf lse for empty rows).
std::tuple<Tensor, Tensor, Tensor> flash_mla_sparse_fwd_kernel(const Tensor& q, const Tensor& kv,
                                                               const Tensor& indices, const OptTensor& topk_length,
                                                               const OptTensor& attn_sink, double sm_scale,
                                                               c10::string_view backend) {
  return translated([&] {
    auto [out, lse] = attention_out(q);
    Tensor max_logits = new_empty(lse.sizes(), lse.options());
    // As smla.flash_mla._sparse_fwd_into checks them: kv is read as s_kv blocks of one token.
    if (kv.dim() != 3 || kv.size(1) != 1)
      fail("kv: expected (s_kv, 1, d_qk) (h_kv must be 1), got " + py_tuple(kv.sizes()));
    if (indices.dim() != 3 || indices.size(1) != 1)
      fail("indices: expected (s_q, 1, topk) (h_kv must be 1), got " + py_tuple(indices.sizes()));
    SparseMlaArgs a = sparse_mla_args(q, kv, indices, topk_length, attn_sink, sm_scale, "auto");
    a.indices = selected(a.indices, 1, 0);
    a.out = view(out, "out");
    a.lse = view(lse, "lse");
    a.max_logits = view(max_logits, "max_logits");
    a.empty_lse_plus_inf = true;
    run_sparse_mla(a, q, backend);
    return std::make_tuple(out, max_logits, lse);
  });
}

void register_kernels(torch::Library& m) {
  m.impl("write_mla_cache", TORCH_FN(write_mla_cache_kernel));
  m.impl("sparse_mla", TORCH_FN(sparse_mla_kernel));
  m.impl("sparse_mla.out", TORCH_FN(sparse_mla_out_kernel));
  m.impl("paged_mla_decode", TORCH_FN(paged_mla_decode_kernel));
  m.impl("paged_mla_decode.out", TORCH_FN(paged_mla_decode_out_kernel));
  m.impl("write_index_cache", TORCH_FN(write_index_cache_kernel));
  m.impl("indexer_topk", TORCH_FN(indexer_topk_kernel));
  m.impl("positions_to_slots", TORCH_FN(positions_to_slots_kernel));
  m.impl("dsa_decode_step", TORCH_FN(dsa_decode_step_kernel));
  m.impl("flash_mla_with_kvcache", TORCH_FN(flash_mla_with_kvcache_kernel));
  m.impl("flash_mla_sparse_fwd", TORCH_FN(flash_mla_sparse_fwd_kernel));
}

}  // namespace

}  // namespace smla::python

TORCH_LIBRARY_IMPL(smla, CPU, m) { smla::python::register_kernels(m); }
#ifdef SMLA_TORCH_CUDA
TORCH_LIBRARY_IMPL(smla, CUDA, m) { smla::python::register_kernels(m); }
#endif
