// Host side of the MLA attention kernel: fills AttentionParams from checked
// args, takes the kernel and its depth from mla::choose_attention_kernel, picks the split over keys for this device,
// launches the attention and (when split) the combine kernel.
#include <algorithm>
#include <optional>

#include "cuda/common/runtime.h"
#include "cuda/kernels.h"
#include "cuda/mla/attention_kernel.cuh"
#include "cuda/mla/attention_small_heads.h"
#include "cuda/mla/attention_wgmma.h"
#include "cuda/mla/attention_wide.h"
#include "cuda/mla/kernel_choice.h"

namespace smla::cuda {

namespace {

using mla::AttentionParams;
using mla::CacheFormat;

using KernelFn = void (*)(AttentionParams);

// Pipeline depths compiled per format (see mla::chunks_in_flight).
constexpr int kHalfStages[] = {2, 3, 4};
constexpr int kFp8Stages[] = {1, 2, 3};

template <CacheFormat F, int kRope, bool kPaged, bool kTwoLists>
KernelFn kernel_for(int stages) {
  constexpr const int* depths = mla::is_fp8(F) ? kFp8Stages : kHalfStages;
  if (stages == depths[0]) return mla::attention_kernel<F, kRope, kPaged, depths[0], kTwoLists>;
  if (stages == depths[1]) return mla::attention_kernel<F, kRope, kPaged, depths[1], kTwoLists>;
  return mla::attention_kernel<F, kRope, kPaged, depths[2], kTwoLists>;
}

// `two_lists`: the instance that reads sparse_mla's two caches in one launch (sparse only).
KernelFn select_kernel(CacheFormat f, int rope, bool paged, int stages, bool two_lists) {
  return mla::instance_for(f, rope, paged, [stages, two_lists]<CacheFormat F, int kRope, bool kPaged>() {
    if constexpr (kPaged) return kernel_for<F, kRope, true, false>(stages);
    else return two_lists ? kernel_for<F, kRope, false, true>(stages) : kernel_for<F, kRope, false, false>(stages);
  });
}

// Both fp8_ds_mla forms are read alike: with no rope part the kernel fetches only the first 528 bytes of a row,
// which fp8_ds_mla and fp8_ds_mla_nope lay out the same way.
CacheFormat format_of(DType d) {
  switch (d) {
    case DType::bf16: return CacheFormat::bf16;
    case DType::f16: return CacheFormat::f16;
    case DType::fp8_ds_mla_v4: return CacheFormat::fp8_ds_mla_v4;
    default: return CacheFormat::fp8_ds_mla;
  }
}

// The kernel's geometry, from q's last dimension (checked: 576 or 512).
int rope_of(const TensorView& q) { return mla_head_for_qk_dim(q.size(-1))->rope_dim; }

void require_aligned(const char* op, const char* arg, const void* ptr, int64_t bytes_multiple,
                     std::initializer_list<int64_t> stride_bytes) {
  bool ok = reinterpret_cast<uintptr_t>(ptr) % bytes_multiple == 0;
  for (int64_t s : stride_bytes) ok = ok && s % bytes_multiple == 0;
  if (!ok)
    fail(std::string(op) + ": " + arg + ": the CUDA backend needs the data pointer and the outer strides to be " +
         std::to_string(bytes_multiple) + "-byte aligned");
}

// The cache the kernel gathers keys from (`arg`: its name in errors). One of no slots is never read (an extra
// cache of no blocks may have null data and any strides). An fp8_ds_mla_v4 cache's rows are 584 bytes apart by
// definition (the kernel addresses its values and scales per block), so only its blocks must be aligned.
void set_cache(AttentionParams& p, const char* op, const char* arg, const TensorView& cache) {
  const int64_t elem = static_cast<int64_t>(dtype_size(cache.dtype));
  p.cache = cache.ptr<uint8_t>();
  p.block_stride = cache.stride(0) * elem;
  p.row_stride = cache.stride(1) * elem;
  p.block_size = static_cast<int>(cache.size(1));
  p.num_blocks = static_cast<int>(cache.size(0));
  p.num_slots = cache.size(0) * cache.size(1);
  if (p.num_slots == 0) return;
  if (cache.dtype == DType::fp8_ds_mla_v4) require_aligned(op, arg, cache.data, 16, {p.block_stride});
  else require_aligned(op, arg, cache.data, 16, {p.block_stride, p.row_stride});
}

// Sparse attention's slots in that cache: indices [T, K] and their optional lengths [T].
void set_slot_list(AttentionParams& p, const TensorView& indices, const TensorView& topk_length) {
  p.indices = indices.ptr<int32_t>();
  p.indices_stride = indices.stride(0);
  p.topk = static_cast<int>(indices.size(1));
  p.topk_length = topk_length.defined() ? topk_length.ptr<int32_t>() : nullptr;
  p.topk_length_stride = topk_length.defined() ? topk_length.stride(0) : 0;
}

// The fields both ops share: query, cache, outputs, scale. `b`/`s` strides
// address (request, step); sparse attention passes s_q = 1.
void fill_common(AttentionParams& p, const char* op, const TensorView& q, int64_t q_sb, int64_t q_ss, const TensorView& cache,
                 const TensorView& out, int64_t o_sb, int64_t o_ss, const TensorView& lse, int64_t l_sb, int64_t l_ss,
                 const TensorView& sink, float softmax_scale) {
  p.q = q.ptr<uint16_t>();
  p.q_is_bf16 = q.dtype == DType::bf16;
#ifdef SMLA_TOPK_STAMPS
  p.stamps = step_stamp_buffer;
#endif
  p.q_stride_b = q_sb;
  p.q_stride_s = q_ss;
  p.q_stride_h = q.stride(-2);
  p.num_heads = static_cast<int>(q.size(-2));
  set_cache(p, op, "kv_cache", cache);
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
  require_aligned(op, "out", out.data, 8, {o_sb * 2, o_ss * 2, p.out_stride_h * 2});
}

struct LaunchConfig {
  KernelFn fn = nullptr;
  int smem = 0, ctas_per_sm = 0, stages = 0;
};

// The 16-head-tile kernel of `v` (mla::choose_attention_kernel's choice), opted in to its shared memory; its CTAs
// per SM as the driver counts them (what sparse_mla_plan reports, so a GPU test holds the choice's count to it).
LaunchConfig head_tile_config(CacheFormat f, int rope, bool paged, const mla::KernelVariant& v, bool two_lists) {
  const KernelFn fn = select_kernel(f, rope, paged, v.stages, two_lists);
  allow_dynamic_smem(reinterpret_cast<const void*>(fn), v.smem);
  return {fn, v.smem, resident_ctas_per_sm(reinterpret_cast<const void*>(fn), mla::kThreads, v.smem), v.stages};
}

// Workspace bytes of `splits` splits' partials: per split and row, the output, lse and max score (fp32; laid out
// by set_partials).
size_t split_partial_bytes(int splits, int64_t tokens, int heads) {
  return static_cast<size_t>(splits) * tokens * heads * (mla::kVDim + 2) * sizeof(float);
}

// Which kernel runs and how launch() splits the keys of `tokens` x `heads` query rows: a function of the args, the
// choice and the device only, so workspace_size() knows the partials' size before the call. The kernel, its depth
// and CTAs per SM are mla::choose_attention_kernel's (the one `smla explain` reports).
struct Plan {
  LaunchConfig head_tile;  // fn null unless the 16-head tile runs
  const mla::small::SmallHeadsConfig* small = nullptr;
  const mla::wide::WideConfig* wide = nullptr;
  const mla::wg::WgmmaConfig* wgmma = nullptr;
  int chunks_per_split = 1, num_splits = 1;
  int64_t ctas = 0;  // per split
  bool one_wave = false;  // every split's CTAs resident at once
  // Workspace bytes: split_partial_bytes, none for one split (it writes no partials).
  size_t partial_bytes(int64_t tokens, int heads) const {
    return num_splits > 1 ? split_partial_bytes(num_splits, tokens, heads) : 0;
  }
};

// The device's limits, and on sm_90 whether its loaded code has sm_90a's features (asked once per device).
mla::KernelLimits kernel_limits(const DeviceInfo& dev) {
  return {dev.compute_capability, dev.max_smem_per_block, dev.max_smem_per_sm, dev.max_threads_per_sm,
          dev.max_ctas_per_sm, dev.sm90a_code};
}

// `two_lists`: the 16-head-tile and wgmma kernels' instances that read sparse_mla's two caches in one launch, where
// there are (two_cache_plan).
Plan plan(CacheFormat f, int rope, bool paged, int64_t tokens, int heads, int num_keys, AttentionChoice choice,
          bool two_lists = false) {
  const DeviceInfo& dev = current_device();
  const mla::KernelDecision d = mla::choose_attention_kernel(kernel_limits(dev), {f, rope, paged, tokens, heads, choice});
  if (const std::string unused = mla::forced_fields_not_taken(choice); !unused.empty())
    throw Error(ErrorKind::invalid_argument, "MLA attention: " + unused);
  const mla::small::SmallHeadsShape shape{choice.stages, choice.heads_per_cta, choice.split_dims, choice.copy};
  // A forced kernel's configuration checks the forced shape first: its errors name a bad depth, heads per CTA or
  // dim split (invalid_argument), row copies the device lacks, or what does not fit.
  if (choice.kernel == AttentionKernel::small_heads) mla::small::small_heads_config(f, rope, paged, heads, shape);
  if (choice.kernel == AttentionKernel::wide_tile) mla::wide::wide_config(f, rope, paged, choice.stages);
  if (choice.kernel == AttentionKernel::wgmma)
    mla::wg::wgmma_config(f, rope, paged, false, choice.heads_per_cta > 0 ? choice.heads_per_cta : mla::wg::kWgmmaHeads);
  if (!d.ok()) {
    const mla::Rejection& last = d.rejected[static_cast<size_t>(d.num_rejected - 1)];
    throw Error(ErrorKind::unsupported, std::string("MLA attention: ") + mla::kernel_name(last.kernel) + ": " +
                                            mla::rejection_text(last, d.chosen, dev.compute_capability));
  }
  const mla::KernelVariant& v = d.chosen;
  Plan s;
  if (v.kernel == AttentionKernel::small_heads)
    s.small = &mla::small::small_heads_config(f, rope, paged, heads,
                                              {v.stages, v.heads_per_cta, v.split_dims,
                                               v.bulk_copies ? RowCopy::bulk : RowCopy::pieces});
  else if (v.kernel == AttentionKernel::wide_tile)
    s.wide = &mla::wide::wide_config(f, rope, paged, v.stages);
  else if (v.kernel == AttentionKernel::wgmma)
    s.wgmma = &mla::wg::wgmma_config(f, rope, paged, two_lists, v.heads_per_cta);
  else
    s.head_tile = head_tile_config(f, rope, paged, v, two_lists);
  const int chunk_keys = s.small   ? mla::small::kSmallChunkKeys
                         : s.wgmma ? mla::wg::kWgmmaChunkKeys
                                   : mla::kKeysPerChunk;
  s.ctas = tokens * ((heads + v.heads_per_cta - 1) / v.heads_per_cta);
  const int chunks = std::max(1, (num_keys + chunk_keys - 1) / chunk_keys);
  const int64_t slots = static_cast<int64_t>(dev.num_sms) * v.ctas_per_sm;
  const int splits = choice.splits > 0 ? std::min({choice.splits, chunks, mla::kMaxSplits})
                                        : mla::choose_splits(s.ctas, chunks, slots);
  s.chunks_per_split = (chunks + splits - 1) / splits;
  s.num_splits = (chunks + s.chunks_per_split - 1) / s.chunks_per_split;
  s.one_wave = s.ctas * s.num_splits <= slots;
  return s;
}

size_t partial_bytes(CacheFormat f, int rope, bool paged, int64_t tokens, int heads, int num_keys) {
  if (tokens == 0) return 0;
  return plan(f, rope, paged, tokens, heads, num_keys, {}).partial_bytes(tokens, heads);
}

// The caller's workspace was checked against the automatic plan; a forced choice may need more.
void require_workspace(const TensorView& workspace, size_t bytes, const char* op) {
  if (workspace.defined() && static_cast<size_t>(workspace.numel()) * dtype_size(workspace.dtype) < bytes)
    throw Error(ErrorKind::invalid_argument,
                std::string(op) + ": workspace: the forced kernel choice needs " + std::to_string(bytes) + " bytes");
}

// p.partial_* into `ws`: per split and row (token, head), the partial output, then the lses, then the maxima.
void set_partials(AttentionParams& p, float* ws) {
  const size_t rows = static_cast<size_t>(p.num_splits) * p.num_tokens * p.num_heads;
  p.partial_out = ws;
  p.partial_lse = ws + rows * mla::kVDim;
  p.partial_max = p.partial_lse + rows;
}

// `dependent`: as the programmatic dependent of the kernel before it (launch_kernel_args).
void launch_head_tile(const LaunchConfig& config, const AttentionParams& p, int64_t ctas, int splits,
                      cudaStream_t stream, bool dependent = false) {
  void* args[] = {const_cast<AttentionParams*>(&p)};
  launch_kernel_args(reinterpret_cast<const void*>(config.fn), dim3(static_cast<unsigned>(ctas), splits),
                     dim3(mla::kThreads), args, config.smem, stream, dependent, "smla MLA attention kernel");
}

// The attention kernel `s` chose over `s.num_splits` splits of one cache's keys: all of p's splits, or with
// sparse_mla's second cache those of one of the caches (p.num_splits counts them all).
void launch_planned(const Plan& s, const AttentionParams& p, cudaStream_t stream, bool dependent = false) {
  if (s.small) mla::small::launch_small_heads(p, *s.small, s.num_splits, stream, dependent);
  else if (s.wide) mla::wide::launch_wide(p, *s.wide, s.num_splits, stream, dependent);
  else if (s.wgmma) mla::wg::launch_wgmma(p, *s.wgmma, s.num_splits, stream, dependent);
  else launch_head_tile(s.head_tile, p, s.ctas, s.num_splits, stream, dependent);
}

void launch_combine(const AttentionParams& p, cudaStream_t stream) {
  // From SM90 on the combine is a programmatic dependent launch: with p.early_combine its launch overlaps the
  // attention's tail. CTAs that are all resident at kFewRowsCtasPerSm an SM merge kFewRowsBatch splits at a time (64
  // registers), more CTAs kManyRowsBatch (40 registers).
  const int64_t rows = static_cast<int64_t>(p.num_tokens) * p.num_heads;
  const int sms = current_device().num_sms, column_blocks = mla::combine_column_blocks(rows, p.num_splits, sms);
  const void* fn = rows * column_blocks <= int64_t{mla::kFewRowsCtasPerSm} * sms
                       ? reinterpret_cast<const void*>(mla::combine_kernel<mla::kFewRowsBatch>)
                       : reinterpret_cast<const void*>(mla::combine_kernel<mla::kManyRowsBatch>);
  void* args[] = {const_cast<AttentionParams*>(&p)};
  launch_kernel_args(fn, dim3(static_cast<unsigned>(rows), column_blocks), dim3(mla::kThreads), args, 0, stream, true,
                     "smla MLA combine kernel");
}

// `workspace`: the caller's (checked to hold partial_bytes) or absent.
void launch(AttentionParams& p, CacheFormat f, int rope, bool paged, int num_keys, const TensorView& workspace,
            const char* op, cudaStream_t stream, AttentionChoice choice, bool dependent = false) {
  if (p.num_tokens == 0) return;
  const Plan split = plan(f, rope, paged, p.num_tokens, p.num_heads, num_keys, choice);
  p.chunks_per_split = split.chunks_per_split;
  p.num_splits = split.num_splits;
  p.early_combine = p.num_splits > 1 && split.one_wave;
  std::optional<DefaultWorkspace> own;
  if (p.num_splits > 1) {
    const size_t bytes = split.partial_bytes(p.num_tokens, p.num_heads);
    require_workspace(workspace, bytes, op);
    set_partials(p, static_cast<float*>(workspace_or(workspace, own, stream, bytes, op)));
  }
  launch_planned(split, p, stream, dependent);
  if (p.num_splits > 1) launch_combine(p, stream);
}

// Sparse attention over two caches under one softmax (DeepSeek-V4's window cache and its compressed cache).
// DeepSeek-V4's bf16 / f16 head is the 512-wide rope-free geometry exactly: its score is q.k over all 512 values
// of the row (448 nope + 64 rope, which the score need not tell apart) and its value the whole row, so the kernels
// serve it unchanged.
// - Where the 16-head-tile kernel runs, or the wgmma kernel on a bf16, f16 or fp8_ds_mla_v4 cache, one launch reads
//   both lists (`one_launch`; mla::ExtraKeys, the wgmma kernel's two-list instance): a token's main chunks, then its
//   extra ones, are the chunks one plan splits, and only a split plan writes partials for a combine. (On an H200,
//   V4's decode of 128 tokens x 64 heads took 73.7 us as three launches: the window's, the compressed cache's and
//   the combine of their 32 MB of partials; 42.4 us as one.)
// - Otherwise (the small-heads and wide-tile kernels, the wgmma kernel's bulk-copied fp8_ds_mla rows) each cache's
//   keys run as the splits of one launch of the kernel its plan picks (the rules of one cache), the main cache's splits first, then the extra cache's, all writing partial rows (out, lse, max) into
//   one array that the combine merges as one list of splits. The kernel writes partials whenever num_splits > 1
//   (here always, each cache having at least one split) at split blockIdx.y of its partial pointers, so the extra
//   cache's launch gets pointers past the main cache's splits.
// Either way the sink is applied once, and a row with no valid key in either cache gets out 0, the empty lse and
// max_logits -inf, as with one cache.
struct TwoCachePlan {
  Plan main, extra;  // one_launch: `main` covers both lists, `extra` unused
  bool one_launch = false;
  int num_splits() const { return one_launch ? main.num_splits : main.num_splits + extra.num_splits; }
  size_t partial_bytes(int64_t tokens, int heads) const {
    return one_launch ? main.partial_bytes(tokens, heads) : split_partial_bytes(num_splits(), tokens, heads);
  }
};

TwoCachePlan two_cache_plan(CacheFormat f, int rope, int64_t tokens, int heads, int keys, int extra_keys,
                            AttentionChoice choice) {
  // Both lists' keys, each rounded up to 64 (a multiple of every kernel's chunk): the most chunks a token can have
  // in a launch over both.
  const auto rounded = [](int n) { return (std::max(n, 1) + 63) / 64 * 64; };
  const Plan both = plan(f, rope, false, tokens, heads, rounded(keys) + rounded(extra_keys), choice, true);
  if (both.head_tile.fn || (both.wgmma && mla::wg::two_lists_in_one_launch(f))) return {both, {}, true};
  auto one = [&](int num_keys) {
    Plan s = plan(f, rope, false, tokens, heads, num_keys, choice);
    if (s.num_splits > mla::kMaxSplits / 2) {  // the combine merges at most kMaxSplits: half for each cache
      AttentionChoice capped = choice;
      capped.splits = mla::kMaxSplits / 2;
      s = plan(f, rope, false, tokens, heads, num_keys, capped);
    }
    return s;
  };
  return {one(keys), one(extra_keys)};
}

TwoCachePlan two_cache_plan(const SparseMlaArgs& a, AttentionChoice choice) {
  return two_cache_plan(format_of(a.kv_cache.dtype), rope_of(a.q), a.q.size(0), static_cast<int>(a.q.size(1)),
                        static_cast<int>(a.indices.size(1)), static_cast<int>(a.extra_indices.size(1)), choice);
}

// The second cache is there when its indices are (a cache of no blocks may have null data: every index invalid).
bool has_extra_cache(const SparseMlaArgs& a) { return a.extra_indices.defined(); }

// `p`: filled for the main cache by sparse_mla.
void sparse_mla_two_caches(AttentionParams& p, const SparseMlaArgs& a, AttentionChoice choice, bool dependent) {
  const cudaStream_t stream = static_cast<cudaStream_t>(a.stream);
  const TwoCachePlan tp = two_cache_plan(a, choice);
  const size_t bytes = tp.partial_bytes(p.num_tokens, p.num_heads);
  require_workspace(a.workspace, bytes, "sparse_mla");
  std::optional<DefaultWorkspace> own;
  p.num_splits = tp.num_splits();
  if (bytes > 0) set_partials(p, static_cast<float*>(workspace_or(a.workspace, own, stream, bytes, "sparse_mla")));
  p.chunks_per_split = tp.main.chunks_per_split;

  AttentionParams e = p;
  set_cache(e, "sparse_mla", "extra_kv_cache", a.extra_kv_cache);
  set_slot_list(e, a.extra_indices, a.extra_topk_length);
  if (tp.one_launch) {
    p.extra = {e.cache,   e.block_stride,   e.row_stride, e.block_size,  e.num_slots,
               e.indices, e.indices_stride, e.topk,       e.topk_length, e.topk_length_stride};
    p.early_combine = p.num_splits > 1 && tp.main.one_wave;
    launch_planned(tp.main, p, stream, dependent);
    if (p.num_splits > 1) launch_combine(p, stream);
    return;
  }
  e.chunks_per_split = tp.extra.chunks_per_split;
  e.early_combine = tp.extra.one_wave;  // the combine is the extra cache's kernel's dependent, not the main one's
  const int64_t main_rows = static_cast<int64_t>(tp.main.num_splits) * p.num_tokens * p.num_heads;
  e.partial_out += main_rows * mla::kVDim;
  e.partial_lse += main_rows;
  e.partial_max += main_rows;

  launch_planned(tp.main, p, stream, dependent);
  launch_planned(tp.extra, e, stream);
  launch_combine(p, stream);
}

// `num_splits`: the plan's own, or all of the caches' where it is one cache's of two.
AttentionPlan plan_of(const Plan& s, int num_splits) {
  if (s.small) return {AttentionKernel::small_heads, s.small->stages, s.small->smem, s.small->ctas_per_sm, num_splits};
  if (s.wide) return {AttentionKernel::wide_tile, s.wide->stages, s.wide->smem, s.wide->ctas_per_sm, num_splits};
  if (s.wgmma) return {AttentionKernel::wgmma, 2, s.wgmma->smem, s.wgmma->ctas_per_sm, num_splits};
  return {AttentionKernel::head_tile, s.head_tile.stages, s.head_tile.smem, s.head_tile.ctas_per_sm, num_splits};
}

AttentionPlan plan_of(CacheFormat f, int rope, bool paged, int64_t tokens, int heads, int num_keys,
                      AttentionChoice choice) {
  const Plan s = plan(f, rope, paged, tokens, heads, num_keys, choice);
  return plan_of(s, s.num_splits);
}

}  // namespace

AttentionPlan sparse_mla_plan(const SparseMlaArgs& a, AttentionChoice choice) {
  if (has_extra_cache(a)) {
    const TwoCachePlan tp = two_cache_plan(a, choice);
    return plan_of(tp.main, tp.num_splits());
  }
  return plan_of(format_of(a.kv_cache.dtype), rope_of(a.q), false, a.q.size(0), static_cast<int>(a.q.size(1)),
                 static_cast<int>(a.indices.size(1)), choice);
}

AttentionPlan paged_mla_decode_plan(const PagedMlaDecodeArgs& a, AttentionChoice choice) {
  return plan_of(format_of(a.kv_cache.dtype), rope_of(a.q), true, a.q.size(0) * a.q.size(1),
                 static_cast<int>(a.q.size(2)), static_cast<int>(a.block_table.size(1) * a.kv_cache.size(1)), choice);
}

void sparse_mla(const SparseMlaArgs& a, AttentionChoice choice, AttentionLaunch how) {
  AttentionParams p{};
  fill_common(p, "sparse_mla", a.q, a.q.stride(0), 0, a.kv_cache, a.out, a.out.stride(0), 0, a.lse, a.lse.stride(0), 0,
              a.attn_sink, a.softmax_scale);
  p.num_tokens = static_cast<int>(a.q.size(0));
  p.s_q = 1;
  set_slot_list(p, a.indices, a.topk_length);
  p.empty_lse = a.empty_lse_plus_inf ? INFINITY : -INFINITY;
  if (a.max_logits.defined()) {
    p.max_logits = a.max_logits.ptr<float>();
    p.max_logits_stride_t = a.max_logits.stride(0);
    p.max_logits_stride_h = a.max_logits.stride(1);
  }
  const bool dependent = how == AttentionLaunch::after_own_kernel;
  if (has_extra_cache(a)) {
    if (p.num_tokens > 0) sparse_mla_two_caches(p, a, choice, dependent);
    return;
  }
  launch(p, format_of(a.kv_cache.dtype), rope_of(a.q), false, p.topk, a.workspace, "sparse_mla",
         static_cast<cudaStream_t>(a.stream), choice, dependent);
}

size_t sparse_mla_workspace_size(const SparseMlaArgs& a) {
  if (has_extra_cache(a))
    return a.q.size(0) == 0 ? 0 : two_cache_plan(a, {}).partial_bytes(a.q.size(0), static_cast<int>(a.q.size(1)));
  return partial_bytes(format_of(a.kv_cache.dtype), rope_of(a.q), false, a.q.size(0), static_cast<int>(a.q.size(1)),
                       static_cast<int>(a.indices.size(1)));
}

size_t paged_mla_decode_workspace_size(const PagedMlaDecodeArgs& a) {
  return partial_bytes(format_of(a.kv_cache.dtype), rope_of(a.q), true, a.q.size(0) * a.q.size(1),
                       static_cast<int>(a.q.size(2)), static_cast<int>(a.block_table.size(1) * a.kv_cache.size(1)));
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
  p.empty_lse = a.empty_lse_plus_inf ? INFINITY : -INFINITY;
  launch(p, format_of(a.kv_cache.dtype), rope_of(a.q), true, p.max_blocks * p.block_size, a.workspace,
         "paged_mla_decode", static_cast<cudaStream_t>(a.stream), choice);
}

}  // namespace smla::cuda
