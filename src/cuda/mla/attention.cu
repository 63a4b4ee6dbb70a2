// Host side of the MLA attention kernel: fills AttentionParams from checked
// args, picks the pipeline depth and the split over keys for this device,
// launches the attention and (when split) the combine kernel.
#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "cuda/common/runtime.h"
#include "cuda/kernels.h"
#include "cuda/mla/attention_kernel.cuh"
#include "cuda/mla/attention_small_heads.h"

namespace smla::cuda {

namespace {

using mla::AttentionParams;
using mla::CacheFormat;

using KernelFn = void (*)(AttentionParams);

// Pipeline depths compiled per format (see mla::chunks_in_flight).
constexpr int kHalfStages[] = {2, 3, 4};
constexpr int kFp8Stages[] = {1, 2, 3};

template <CacheFormat F, bool kPaged>
KernelFn kernel_for(int stages) {
  constexpr const int* depths = F == CacheFormat::fp8_ds_mla ? kFp8Stages : kHalfStages;
  if (stages == depths[0]) return mla::attention_kernel<F, kPaged, depths[0]>;
  if (stages == depths[1]) return mla::attention_kernel<F, kPaged, depths[1]>;
  return mla::attention_kernel<F, kPaged, depths[2]>;
}

KernelFn select_kernel(CacheFormat f, bool paged, int stages) {
  switch (f) {
    case CacheFormat::bf16: return paged ? kernel_for<CacheFormat::bf16, true>(stages) : kernel_for<CacheFormat::bf16, false>(stages);
    case CacheFormat::f16: return paged ? kernel_for<CacheFormat::f16, true>(stages) : kernel_for<CacheFormat::f16, false>(stages);
    case CacheFormat::fp8_ds_mla:
      return paged ? kernel_for<CacheFormat::fp8_ds_mla, true>(stages) : kernel_for<CacheFormat::fp8_ds_mla, false>(stages);
  }
  return nullptr;
}

CacheFormat format_of(DType d) {
  return d == DType::bf16 ? CacheFormat::bf16 : d == DType::f16 ? CacheFormat::f16 : CacheFormat::fp8_ds_mla;
}

void require_aligned(const char* op, const char* arg, const void* ptr, int64_t bytes_multiple,
                     std::initializer_list<int64_t> stride_bytes) {
  bool ok = reinterpret_cast<uintptr_t>(ptr) % bytes_multiple == 0;
  for (int64_t s : stride_bytes) ok = ok && s % bytes_multiple == 0;
  if (!ok)
    fail(std::string(op) + ": " + arg + ": the CUDA backend needs the data pointer and the outer strides to be " +
         std::to_string(bytes_multiple) + "-byte aligned");
}

// The fields both ops share: query, cache, outputs, scale. `b`/`s` strides
// address (request, step); sparse attention passes s_q = 1.
void fill_common(AttentionParams& p, const char* op, const TensorView& q, int64_t q_sb, int64_t q_ss, const TensorView& cache,
                 const TensorView& out, int64_t o_sb, int64_t o_ss, const TensorView& lse, int64_t l_sb, int64_t l_ss,
                 const TensorView& sink, float softmax_scale) {
  const int64_t row_elem = cache.dtype == DType::fp8_ds_mla ? 1 : 2;
  p.q = q.ptr<uint16_t>();
  p.q_is_bf16 = q.dtype == DType::bf16;
  p.q_stride_b = q_sb;
  p.q_stride_s = q_ss;
  p.q_stride_h = q.stride(-2);
  p.num_heads = static_cast<int>(q.size(-2));
  p.cache = cache.ptr<uint8_t>();
  p.block_stride = cache.stride(0) * row_elem;
  p.row_stride = cache.stride(1) * row_elem;
  p.block_size = static_cast<int>(cache.size(1));
  p.num_blocks = static_cast<int>(cache.size(0));
  p.num_slots = cache.size(0) * cache.size(1);
  p.attn_sink = sink.defined() ? sink.ptr<float>() : nullptr;
  p.scale_log2 = softmax_scale * 1.4426950408889634f;
  p.out = out.data;
  p.out_stride_b = o_sb;
  p.out_stride_s = o_ss;
  p.out_stride_h = out.stride(-2);
  p.lse = lse.ptr<float>();
  p.lse_stride_b = l_sb;
  p.lse_stride_s = l_ss;
  p.lse_stride_h = lse.stride(-1);

  require_aligned(op, "q", q.data, 16, {q_sb * 2, q_ss * 2, p.q_stride_h * 2});
  require_aligned(op, "kv_cache", cache.data, 16, {p.block_stride, p.row_stride});
  require_aligned(op, "out", out.data, 8, {o_sb * 2, o_ss * 2, p.out_stride_h * 2});
}

struct LaunchConfig {
  KernelFn fn = nullptr;
  int smem = 0, ctas_per_sm = 0;
};

// Pipeline depth from this device's shared memory, chosen once per (device,
// format, op). Measured on an H200: one CTA per SM with a deep pipeline loses
// to two CTAs with shallow ones (a lone CTA's softmax barriers idle the SM),
// so the rule is: the deepest pipeline that still fits two CTAs per SM (or
// the most the device allows).
const LaunchConfig& launch_config(CacheFormat f, bool paged) {
  static std::mutex mu;
  static std::map<std::tuple<int, CacheFormat, bool>, LaunchConfig> configs;
  const DeviceInfo& dev = current_device();
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple(dev.index, f, paged);
  if (auto it = configs.find(key); it != configs.end()) return it->second;
  std::vector<LaunchConfig> fits;
  int most = 0;
  for (int stages : f == CacheFormat::fp8_ds_mla ? kFp8Stages : kHalfStages) {
    const int bytes = mla::SmemLayout(f, stages).total;
    if (bytes > dev.max_smem_per_block) continue;
    KernelFn k = select_kernel(f, paged, stages);
    check_cuda(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
               "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
    int ctas = 0;
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, k, mla::kThreads, bytes),
               "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    if (ctas == 0) continue;
    fits.push_back({k, bytes, ctas});
    most = std::max(most, ctas);
  }
  if (fits.empty())
    throw Error(ErrorKind::unsupported, "MLA attention needs " + std::to_string(mla::SmemLayout(f, 2).total) +
                                            " bytes of shared memory per block; this device allows " +
                                            std::to_string(dev.max_smem_per_block));
  LaunchConfig best;
  for (const LaunchConfig& c : fits)  // depths ascend, so the last that fits wins
    if (c.ctas_per_sm >= std::min(2, most)) best = c;
  return configs.emplace(key, best).first->second;
}

// How many ways to split each (token, head group)'s keys: the count whose CTAs
// fill the GPU's resident slots in whole waves best (a last wave half full
// leaves half the GPU idle: 384 CTAs on 264 slots ran at ~70%), the smallest
// such count on ties (each split costs a partial row and a combine). Each
// split keeps at least `min_chunks` chunks.
int choose_splits(int64_t ctas, int chunks, int64_t slots, int min_chunks) {
  const int most = std::max(1, std::min(chunks / min_chunks, mla::kMaxSplits));
  int best = 1;
  double best_fill = 0;
  for (int s = 1; s <= most && ctas * s <= 8 * slots + ctas; ++s) {
    const int64_t total = ctas * s, waves = (total + slots - 1) / slots;
    const double fill = static_cast<double>(total) / static_cast<double>(waves * slots);
    if (fill > best_fill + 1e-9) {
      best = s;
      best_fill = fill;
    }
  }
  return best;
}

// The small-heads kernel serves fp8_ds_mla caches up to 32 heads from 16 query
// tokens on (memory-bound decode) where the device fits it; the rest goes to
// the 16-head-tile kernel, which on an H200 ran bf16 decode and fp8 decode of
// 1-8 tokens faster (docs/performance.md).
void launch(AttentionParams& p, CacheFormat f, bool paged, int num_keys, cudaStream_t stream, AttentionChoice choice) {
  if (p.num_tokens == 0) return;
  const DeviceInfo& dev = current_device();
  const mla::small::SmallHeadsShape shape{choice.stages, choice.heads_per_cta, choice.split_dims};
  const mla::small::SmallHeadsConfig* small_cfg = nullptr;
  if (choice.kernel == AttentionKernel::small_heads)
    small_cfg = &mla::small::small_heads_config(f, paged, p.num_heads, shape);
  else if (choice.kernel == AttentionKernel::automatic && f == CacheFormat::fp8_ds_mla &&
           p.num_heads <= mla::small::kMaxHeadsAutomatic && p.num_tokens >= mla::small::kMinTokensAutomatic)
    small_cfg = mla::small::find_small_heads_config(f, paged, p.num_heads, shape);
  const bool small = small_cfg != nullptr;
  const LaunchConfig* cfg = small ? nullptr : &launch_config(f, paged);

  const int heads_per_cta = small ? small_cfg->heads_per_cta : mla::kHeadsPerCta;
  const int chunk_keys = small ? mla::small::kSmallChunkKeys : mla::kKeysPerChunk;
  const int ctas_per_sm = small ? small_cfg->ctas_per_sm : cfg->ctas_per_sm;
  const int64_t ctas = static_cast<int64_t>(p.num_tokens) * ((p.num_heads + heads_per_cta - 1) / heads_per_cta);
  const int chunks = std::max(1, (num_keys + chunk_keys - 1) / chunk_keys);
  // The small-heads kernel's 64-key chunks are worth a CTA each.
  const int splits = choose_splits(ctas, chunks, static_cast<int64_t>(dev.num_sms) * ctas_per_sm, small ? 1 : 2);
  p.chunks_per_split = (chunks + splits - 1) / splits;
  p.num_splits = (chunks + p.chunks_per_split - 1) / p.chunks_per_split;
  if (p.num_splits > 1) {
    const size_t rows = static_cast<size_t>(p.num_splits) * p.num_tokens * p.num_heads;
    float* ws = static_cast<float*>(workspace(stream, rows * (mla::kVDim + 1) * sizeof(float)));
    p.partial_out = ws;
    p.partial_lse = ws + rows * mla::kVDim;
  }
  if (small) {
    mla::small::launch_small_heads(p, *small_cfg, stream);
  } else {
    cfg->fn<<<dim3(static_cast<unsigned>(ctas), p.num_splits), mla::kThreads, cfg->smem, stream>>>(p);
    check_launch("smla MLA attention kernel");
  }
  if (p.num_splits > 1) {
    mla::combine_kernel<<<static_cast<unsigned>(p.num_tokens) * p.num_heads, mla::kThreads, 0, stream>>>(p);
    check_launch("smla MLA combine kernel");
  }
}

}  // namespace

void sparse_mla(const SparseMlaArgs& a, AttentionChoice choice) {
  AttentionParams p{};
  fill_common(p, "sparse_mla", a.q, a.q.stride(0), 0, a.kv_cache, a.out, a.out.stride(0), 0, a.lse, a.lse.stride(0), 0,
              a.attn_sink, a.softmax_scale);
  p.num_tokens = static_cast<int>(a.q.size(0));
  p.s_q = 1;
  p.indices = a.indices.ptr<int32_t>();
  p.indices_stride = a.indices.stride(0);
  p.topk = static_cast<int>(a.indices.size(1));
  p.topk_length = a.topk_length.defined() ? a.topk_length.ptr<int32_t>() : nullptr;
  if (a.topk_length.defined())
    require(a.topk_length.stride(0) == 1, "sparse_mla: topk_length: the CUDA backend needs it contiguous");
  launch(p, format_of(a.kv_cache.dtype), false, p.topk, static_cast<cudaStream_t>(a.stream), choice);
}

void paged_mla_decode(const PagedMlaDecodeArgs& a, AttentionChoice choice) {
  AttentionParams p{};
  fill_common(p, "paged_mla_decode", a.q, a.q.stride(0), a.q.stride(1), a.kv_cache, a.out, a.out.stride(0),
              a.out.stride(1), a.lse, a.lse.stride(0), a.lse.stride(1), a.attn_sink, a.softmax_scale);
  p.s_q = static_cast<int>(a.q.size(1));
  p.num_tokens = static_cast<int>(a.q.size(0)) * p.s_q;
  p.block_table = a.block_table.ptr<int32_t>();
  p.block_table_stride = a.block_table.stride(0);
  p.max_blocks = static_cast<int>(a.block_table.size(1));
  p.seq_lens = a.seq_lens.ptr<int32_t>();
  require(a.seq_lens.stride(0) == 1, "paged_mla_decode: seq_lens: the CUDA backend needs it contiguous");
  p.causal = a.causal;
  launch(p, format_of(a.kv_cache.dtype), true, p.max_blocks * p.block_size, static_cast<cudaStream_t>(a.stream), choice);
}

}  // namespace smla::cuda
