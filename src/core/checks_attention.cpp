// Argument checks of the attention ops (write_mla_cache, sparse_mla,
// paged_mla_decode). They read metadata only, never tensor data (GPU memory is
// not host-readable): index values are the backends' business.
#include <cmath>
#include <string>
#include <string_view>

#include "core/check_util.h"
#include "smla/ops.h"

namespace smla {

namespace {

using checks::arg;

constexpr int kMaxHeads = 128;
constexpr int64_t kMaxTopk = 65536;

// Frameworks hand out null data for empty tensors: only a non-empty tensor must have data.
void require_data(std::string_view op, std::string_view name, const TensorView& t) {
  if (!t.defined() && !(t.ndim > 0 && t.numel() == 0)) arg(op, name, t).defined();
}

// [num_blocks, block_size, 576] bf16/f16 or [num_blocks, block_size, 656] fp8_ds_mla; rows and blocks may be padded.
void check_cache(std::string_view op, std::string_view name, const TensorView& c, const Device& device) {
  require_data(op, name, c);
  const auto a = arg(op, name, c);
  a.rank(3, "[num_blocks, block_size, 576 | 656]")
      .dtype_in({DType::bf16, DType::f16, DType::fp8_ds_mla})
      .on(device)
      .inner_contiguous()
      .dim_at_least(1, 1, "block_size");
  if (c.dtype == DType::fp8_ds_mla) a.dim(2, kFp8DsMlaRowBytes, "fp8_ds_mla row: 512 e4m3 + 4 fp32 scales + 64 bf16");
  else a.dim(2, kMlaQkDim, "row: c (512) + k_pe (64)");
  const int64_t row = c.shape[2];
  const int64_t row_stride = c.shape[1] > 1 ? c.strides[1] : row;
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

}  // namespace

void check(const WriteMlaCacheArgs& a) {
  constexpr std::string_view op = "write_mla_cache";
  const Device& device = a.cache.device;
  check_cache(op, "cache", a.cache, device);
  require_data(op, "latent", a.latent);
  arg(op, "latent", a.latent)
      .rank(2, "[N, 512]")
      .dtype_in({DType::f32, DType::f16, DType::bf16})
      .dim(1, kMlaLatentDim, "kv_lora_rank")
      .on(device)
      .inner_contiguous();
  const int64_t n = a.latent.shape[0];
  require_data(op, "k_pe", a.k_pe);
  arg(op, "k_pe", a.k_pe)
      .rank(2, "[N, 64]")
      .dtype_in({a.latent.dtype})
      .dim(0, n, "N, as latent")
      .dim(1, kMlaRopeDim, "rope dim")
      .on(device)
      .inner_contiguous();
  require_data(op, "slot_mapping", a.slot_mapping);
  arg(op, "slot_mapping", a.slot_mapping)
      .rank(1, "[N]")
      .dtype_in({DType::i64})
      .dim(0, n, "N, as latent")
      .on(device)
      .inner_contiguous();
}

void check(const SparseMlaArgs& a) {
  constexpr std::string_view op = "sparse_mla";
  const Device& device = a.q.device;
  require_data(op, "q", a.q);
  arg(op, "q", a.q)
      .rank(3, "[T, H, 576]")
      .dtype_in({DType::bf16, DType::f16})
      .dim(2, kMlaQkDim, "absorbed head size: 512 + 64")
      .inner_contiguous();
  check_heads(op, "q", a.q, 1);
  const int64_t tokens = a.q.shape[0], heads = a.q.shape[1];
  check_cache(op, "kv_cache", a.kv_cache, device);
  require_data(op, "indices", a.indices);
  const auto indices = arg(op, "indices", a.indices);
  indices.rank(2, "[T, K]").dtype_in({DType::i32}).dim(0, tokens, "T, as q").on(device).inner_contiguous();
  if (a.indices.shape[1] < 1 || a.indices.shape[1] > kMaxTopk)
    indices.fail("dimension 1 (K) must be in 1.." + std::to_string(kMaxTopk) + ", got " + a.indices.describe());
  if (a.topk_length.defined())
    arg(op, "topk_length", a.topk_length)
        .rank(1, "[T]")
        .dtype_in({DType::i32})
        .dim(0, tokens, "T, as q")
        .on(device)
        .inner_contiguous();
  check_sink(op, a.attn_sink, heads, device);
  check_scale(op, a.softmax_scale);
  require_data(op, "out", a.out);
  arg(op, "out", a.out)
      .rank(3, "[T, H, 512]")
      .dtype_in({a.q.dtype})
      .dim(0, tokens, "T, as q")
      .dim(1, heads, "H, as q")
      .dim(2, kMlaVDim, "value size")
      .on(device)
      .inner_contiguous();
  require_data(op, "lse", a.lse);
  arg(op, "lse", a.lse)
      .rank(2, "[T, H]")
      .dtype_in({DType::f32})
      .dim(0, tokens, "T, as q")
      .dim(1, heads, "H, as q")
      .on(device)
      .inner_contiguous();
}

void check(const PagedMlaDecodeArgs& a) {
  constexpr std::string_view op = "paged_mla_decode";
  const Device& device = a.q.device;
  require_data(op, "q", a.q);
  arg(op, "q", a.q)
      .rank(4, "[B, s_q, H, 576]")
      .dtype_in({DType::bf16, DType::f16})
      .dim(3, kMlaQkDim, "absorbed head size: 512 + 64")
      .inner_contiguous();
  check_heads(op, "q", a.q, 2);
  const int64_t batch = a.q.shape[0], s_q = a.q.shape[1], heads = a.q.shape[2];
  check_cache(op, "kv_cache", a.kv_cache, device);
  require_data(op, "block_table", a.block_table);
  arg(op, "block_table", a.block_table)
      .rank(2, "[B, max_blocks]")
      .dtype_in({DType::i32})
      .dim(0, batch, "B, as q")
      .on(device)
      .inner_contiguous();
  require_data(op, "seq_lens", a.seq_lens);
  arg(op, "seq_lens", a.seq_lens).rank(1, "[B]").dtype_in({DType::i32}).dim(0, batch, "B, as q").on(device)
      .inner_contiguous();
  check_sink(op, a.attn_sink, heads, device);
  check_scale(op, a.softmax_scale);
  require_data(op, "out", a.out);
  arg(op, "out", a.out)
      .rank(4, "[B, s_q, H, 512]")
      .dtype_in({a.q.dtype})
      .dim(0, batch, "B, as q")
      .dim(1, s_q, "s_q, as q")
      .dim(2, heads, "H, as q")
      .dim(3, kMlaVDim, "value size")
      .on(device)
      .inner_contiguous();
  require_data(op, "lse", a.lse);
  arg(op, "lse", a.lse)
      .rank(3, "[B, s_q, H]")
      .dtype_in({DType::f32})
      .dim(0, batch, "B, as q")
      .dim(1, s_q, "s_q, as q")
      .dim(2, heads, "H, as q")
      .on(device)
      .inner_contiguous();
}

}  // namespace smla
