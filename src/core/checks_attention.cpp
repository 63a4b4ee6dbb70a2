// Argument checks of the attention ops (write_mla_cache, sparse_mla,
// paged_mla_decode). They read metadata only, never tensor data (GPU memory is
// not host-readable): index values are the backends' business.
#include <cmath>
#include <span>
#include <string>
#include <string_view>

#include "core/check_util.h"
#include "smla/ops.h"

namespace smla {

namespace {

using checks::arg;

// The head geometry q's last dimension `dim` implies (576: rope 64, 512: no rope part).
MlaHead head_of_q(std::string_view op, const TensorView& q, int dim) {
  const std::optional<MlaHead> head = mla_head_for_qk_dim(q.shape[dim]);
  if (!head)
    arg(op, "q", q).fail("dimension " + std::to_string(dim) +
                         " (absorbed head size) must be 576 (512 latent + 64 rope) or 512 (latent only, no rope " +
                         "part), got " + q.describe());
  return *head;
}

std::string row_meaning(DType dtype, MlaHead head) {
  if (dtype == DType::fp8_ds_mla)
    return head.rope_dim ? "fp8_ds_mla row: 512 e4m3 + 4 fp32 scales + 64 bf16 rope"
                         : "fp8_ds_mla row: 512 e4m3 + 4 fp32 scales + 64 bf16 rope (unused: no rope part)";
  if (dtype == DType::fp8_ds_mla_nope) return "fp8_ds_mla_nope row: 512 e4m3 + 4 fp32 scales";
  if (dtype == DType::fp8_ds_mla_v4) return "fp8_ds_mla_v4 row: 448 e4m3 + 64 bf16 rope + 7 ue8m0 scales + 1 pad";
  return head.rope_dim ? "row: c (512) + k_pe (64)" : "row: c (512), no rope part";
}

// [num_blocks, block_size, row] with the row `head` implies for the cache's dtype (MlaHead::cache_row): bf16/f16
// 576 or 512, fp8_ds_mla 656, fp8_ds_mla_nope 528 and fp8_ds_mla_v4 584 (512-wide heads only); rows and blocks
// may be padded, except fp8_ds_mla_v4's rows (its layout is per block: MlaV4CacheLayout).
void check_cache(std::string_view op, std::string_view name, const TensorView& c, const Device& device, MlaHead head) {
  const auto a = arg(op, name, c);
  a.defined()
      .rank(3, head.rope_dim ? "[num_blocks, block_size, 576 | 656]"
                             : "[num_blocks, block_size, 512 | 656 | 528 | 584]")
      .dtype_in(kAllMlaCacheDTypes)
      .on(device)
      .inner_contiguous()
      .dim_at_least(1, 1, "block_size");
  if (head.cache_row(c.dtype) == 0)
    a.fail((c.dtype == DType::fp8_ds_mla_v4 ? "fp8_ds_mla_v4 holds DeepSeek-V4's 512-wide heads (its rope part inside "
                                              "the 512)"
                                            : "fp8_ds_mla_nope has no rope part") +
           std::string(", but the head is ") + std::to_string(head.qk_dim()) + " wide (rope " +
           std::to_string(head.rope_dim) + "); use fp8_ds_mla, got " + c.describe());
  a.dim(2, head.cache_row(c.dtype), row_meaning(c.dtype, head));
  if (c.numel() == 0) return;  // no blocks: no layout to check (numpy gives zero strides), every index invalid
  const int64_t row = c.shape[2];
  const int64_t row_stride = c.shape[1] > 1 ? c.strides[1] : row;
  if (c.dtype == DType::fp8_ds_mla_v4 && row_stride != row)
    a.fail("row stride " + std::to_string(row_stride) + " must be 584: fp8_ds_mla_v4 lays its tokens out per block " +
           "(values, then scales), so its rows cannot be padded (the block stride may be)");
  if (row_stride < row)
    a.fail("row stride " + std::to_string(row_stride) + " is smaller than the row (" + std::to_string(row) +
           " elements): rows would overlap");
  if (c.shape[0] > 1 && c.strides[0] < c.shape[1] * row_stride)
    a.fail("block stride " + std::to_string(c.strides[0]) + " is smaller than block_size x row stride (" +
           std::to_string(c.shape[1] * row_stride) + "): blocks would overlap");
}

void check_heads(std::string_view op, std::string_view name, const TensorView& q, int dim) {
  const int64_t h = q.shape[dim];
  if (h < 1 || h > kMaxHeads)
    arg(op, name, q).fail("dimension " + std::to_string(dim) + " (heads) must be in 1.." + std::to_string(kMaxHeads) +
                          ", got " + q.describe());
}

void check_scale(std::string_view op, float scale) {
  if (!(std::isfinite(scale) && scale > 0.f))
    fail(std::string(op) + ": softmax_scale: must be finite and > 0, got " + std::to_string(scale));
}

void check_sink(std::string_view op, const TensorView& sink, int64_t heads, const Device& device) {
  if (!sink.defined()) return;
  arg(op, "attn_sink", sink).rank(1, "[H]").dtype_in({DType::f32}).dim(0, heads, "heads").on(device).inner_contiguous();
}

// One of q's leading dimensions as an output repeats it: its size, and what it is in messages ("T, as q").
struct LeadingDim {
  int64_t size;
  std::string_view meaning;
};

// t's first dims.size() dimensions are q's leading ones (its rank already checked).
void check_leading_dims(const checks::ArgCheck& t, std::span<const LeadingDim> dims) {
  for (size_t d = 0; d < dims.size(); ++d) t.dim(static_cast<int>(d), dims[d].size, dims[d].meaning);
}

// An attention op's out [<q's leading dimensions>, 512] in q's dtype; `pattern`: its shape in messages.
void check_out(std::string_view op, const TensorView& out, DType q_dtype, std::string_view pattern,
               std::span<const LeadingDim> dims, const Device& device) {
  const auto a = arg(op, "out", out);
  a.defined().rank(static_cast<int>(dims.size()) + 1, pattern).dtype_in({q_dtype});
  check_leading_dims(a, dims);
  a.dim(static_cast<int>(dims.size()), kMlaVDim, "value size").on(device).inner_contiguous();
}

// A float32 statistic per query row and head (lse, max_logits) [<q's leading dimensions>], with any strides
// (FlashMLA's layouts are views of ours).
void check_row_stat(std::string_view op, std::string_view name, const TensorView& t, std::string_view pattern,
                    std::span<const LeadingDim> dims, const Device& device) {
  const auto a = arg(op, name, t);
  a.defined().rank(static_cast<int>(dims.size()), pattern).dtype_in({DType::f32});
  check_leading_dims(a, dims);
  a.on(device).no_negative_strides();
}

}  // namespace

// The rope width is k_pe's: an absent k_pe, or one of width 0, writes a head with no rope part (an empty batch's
// [0, 64] k_pe, null data from torch, has one).
MlaHead written_head(const WriteMlaCacheArgs& a) {
  const bool has_rope = (a.k_pe.defined() || a.k_pe.ndim > 0) && !(a.k_pe.ndim == 2 && a.k_pe.shape[1] == 0);
  return MlaHead{has_rope ? kMlaRopeDim : 0};
}

void check(const WriteMlaCacheArgs& a) {
  constexpr std::string_view op = "write_mla_cache";
  const Device& device = a.cache.device;
  const MlaHead head = written_head(a);
  const bool has_rope = head.rope_dim > 0;
  check_cache(op, "cache", a.cache, device, head);
  arg(op, "latent", a.latent)
      .defined()
      .rank(2, "[N, 512]")
      .dtype_in({DType::f32, DType::f16, DType::bf16})
      .dim(1, kMlaLatentDim, "kv_lora_rank")
      .on(device)
      .inner_contiguous();
  const int64_t n = a.latent.shape[0];
  if (has_rope)
    arg(op, "k_pe", a.k_pe)
        .defined()
        .rank(2, "[N, 64]")
        .dtype_in({a.latent.dtype})
        .dim(0, n, "N, as latent")
        .dim(1, kMlaRopeDim, "rope dim")
        .on(device)
        .inner_contiguous();
  arg(op, "slot_mapping", a.slot_mapping)
      .defined()
      .rank(1, "[N]")
      .dtype_in({DType::i64})
      .dim(0, n, "N, as latent")
      .on(device)
      .inner_contiguous();
  checks::check_no_overlap(op, {{"cache", a.cache}},
                           {{"latent", a.latent}, {"k_pe", a.k_pe}, {"slot_mapping", a.slot_mapping}});
}

// A cache's slots per token, indices [T, K] i32 with K (named `k`) in 1..kMaxTopk, and their optional lengths [T].
void check_slot_list(std::string_view op, checks::Named indices, checks::Named lengths, std::string_view k,
                     int64_t tokens, const Device& device) {
  const auto list = arg(op, indices.name, indices.tensor);
  list.defined().rank(2, "[T, " + std::string(k) + "]").dtype_in({DType::i32}).dim(0, tokens, "T, as q").on(device)
      .inner_contiguous();
  if (indices.tensor.shape[1] < 1 || indices.tensor.shape[1] > kMaxTopk)
    list.fail("dimension 1 (" + std::string(k) + ") must be in 1.." + std::to_string(kMaxTopk) + ", got " +
              indices.tensor.describe());
  if (lengths.tensor.defined())
    arg(op, lengths.name, lengths.tensor)
        .rank(1, "[T]")
        .dtype_in({DType::i32})
        .dim(0, tokens, "T, as q")
        .on(device)
        .no_negative_strides();
}

void check(const SparseMlaArgs& a) {
  constexpr std::string_view op = "sparse_mla";
  const Device& device = a.q.device;
  arg(op, "q", a.q).defined().rank(3, "[T, H, 576 | 512]").dtype_in({DType::bf16, DType::f16}).inner_contiguous();
  const MlaHead head = head_of_q(op, a.q, 2);
  check_heads(op, "q", a.q, 1);
  const int64_t tokens = a.q.shape[0], heads = a.q.shape[1];
  check_cache(op, "kv_cache", a.kv_cache, device, head);
  check_slot_list(op, {"indices", a.indices}, {"topk_length", a.topk_length}, "K", tokens, device);
  // The extra cache comes with its indices; its lengths need both.
  const bool extra = a.extra_kv_cache.defined() || a.extra_kv_cache.ndim > 0;
  if (extra || a.extra_indices.defined() || a.extra_indices.ndim > 0 || a.extra_topk_length.defined()) {
    if (!extra) arg(op, "extra_kv_cache", a.extra_kv_cache).fail("is required with extra_indices / extra_topk_length");
    check_cache(op, "extra_kv_cache", a.extra_kv_cache, device, head);
    if (a.extra_kv_cache.dtype != a.kv_cache.dtype)
      arg(op, "extra_kv_cache", a.extra_kv_cache)
          .fail("must have kv_cache's dtype (" + std::string(dtype_name(a.kv_cache.dtype)) + "), got " +
                a.extra_kv_cache.describe());
    check_slot_list(op, {"extra_indices", a.extra_indices}, {"extra_topk_length", a.extra_topk_length}, "K2", tokens,
                    device);
  }
  check_sink(op, a.attn_sink, heads, device);
  check_scale(op, a.softmax_scale);
  const LeadingDim rows[] = {{tokens, "T, as q"}, {heads, "H, as q"}};
  check_out(op, a.out, a.q.dtype, "[T, H, 512]", rows, device);
  check_row_stat(op, "lse", a.lse, "[T, H]", rows, device);
  if (a.max_logits.defined() || a.max_logits.ndim > 0)
    check_row_stat(op, "max_logits", a.max_logits, "[T, H]", rows, device);
  checks::check_no_overlap(
      op, {{"out", a.out}, {"lse", a.lse}, {"max_logits", a.max_logits}, {"workspace", a.workspace}},
      {{"q", a.q}, {"kv_cache", a.kv_cache}, {"indices", a.indices}, {"topk_length", a.topk_length},
       {"extra_kv_cache", a.extra_kv_cache}, {"extra_indices", a.extra_indices},
       {"extra_topk_length", a.extra_topk_length}, {"attn_sink", a.attn_sink}});
}

void check(const PagedMlaDecodeArgs& a) {
  constexpr std::string_view op = "paged_mla_decode";
  const Device& device = a.q.device;
  arg(op, "q", a.q).defined().rank(4, "[B, s_q, H, 576 | 512]").dtype_in({DType::bf16, DType::f16}).inner_contiguous();
  const MlaHead head = head_of_q(op, a.q, 3);
  check_heads(op, "q", a.q, 2);
  const int64_t batch = a.q.shape[0], s_q = a.q.shape[1], heads = a.q.shape[2];
  check_cache(op, "kv_cache", a.kv_cache, device, head);
  arg(op, "block_table", a.block_table)
      .defined()
      .rank(2, "[B, max_blocks]")
      .dtype_in({DType::i32})
      .dim(0, batch, "B, as q")
      .on(device)
      .inner_contiguous();
  arg(op, "seq_lens", a.seq_lens).defined().rank(1, "[B]").dtype_in({DType::i32}).dim(0, batch, "B, as q").on(device)
      .inner_contiguous();
  check_sink(op, a.attn_sink, heads, device);
  check_scale(op, a.softmax_scale);
  const LeadingDim rows[] = {{batch, "B, as q"}, {s_q, "s_q, as q"}, {heads, "H, as q"}};
  check_out(op, a.out, a.q.dtype, "[B, s_q, H, 512]", rows, device);
  check_row_stat(op, "lse", a.lse, "[B, s_q, H]", rows, device);
  checks::check_no_overlap(op, {{"out", a.out}, {"lse", a.lse}, {"workspace", a.workspace}},
                           {{"q", a.q}, {"kv_cache", a.kv_cache}, {"block_table", a.block_table},
                            {"seq_lens", a.seq_lens}, {"attn_sink", a.attn_sink}});
}

}  // namespace smla
