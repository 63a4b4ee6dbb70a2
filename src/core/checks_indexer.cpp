// Argument checks of the indexer ops and of dsa_decode_step. Metadata only:
// these run before any backend and never read tensor data.
#include <string>

#include "core/check_util.h"
#include "smla/ops.h"

namespace smla {

namespace {

using checks::arg;

constexpr int kMaxIndexHeads = 128;
constexpr int kMaxKpool = 128;  // tokens per pooled index key

// The index cache: [nb, bs, 128] bf16, or [nb, bs, 132] fp8_e4m3 whose blocks
// are byte arrays (all tokens' 128 fp8 bytes, then all tokens' fp32 scales),
// so the whole block must be contiguous; only the block stride may be padded.
void check_index_cache(std::string_view op, const TensorView& cache, const Device& device) {
  const auto c = arg(op, "index cache", cache);
  c.defined().rank(3, "[num_blocks, block_size, 128 | 132]").dtype_in({DType::bf16, DType::fp8_e4m3}).on(device);
  c.dim_at_least(1, 1, "block_size");
  if (cache.dtype == DType::bf16) {
    c.dim(2, kIndexHeadDim, "index head dim for bfloat16").inner_contiguous();
    return;
  }
  c.dim(2, kFp8IndexRowBytes, "bytes per token for fp8_e4m3: 128 values + fp32 scale").inner_contiguous();
  if (cache.numel() == 0) return;  // no blocks: no layout to check
  const int64_t block_bytes = cache.shape[1] * kFp8IndexRowBytes;
  if (cache.strides[1] != kFp8IndexRowBytes || (cache.shape[0] > 1 && cache.strides[0] < block_bytes))
    c.fail("fp8_e4m3 blocks must be contiguous (stride of dimension 1 = 132, block stride >= block_size * 132), got " +
           cache.describe() + " with strides [" + std::to_string(cache.strides[0]) + ", " +
           std::to_string(cache.strides[1]) + ", " + std::to_string(cache.strides[2]) + "]");
}

// A [T] int32 vector such as request_ids or context_lens.
void check_token_vector(std::string_view op, std::string_view name, const TensorView& t, int64_t tokens,
                        const Device& device) {
  arg(op, name, t).defined().rank(1, "[T]").dtype_in({DType::i32}).dim(0, tokens, "T").on(device).inner_contiguous();
}

void check_block_table(std::string_view op, const TensorView& t, const Device& device) {
  arg(op, "block_table", t).defined().rank(2, "[R, max_blocks]").dtype_in({DType::i32}).on(device).inner_contiguous();
}

// positions / topk / slots: [T, K] int32 with K in 1..65536.
void check_topk_matrix(std::string_view op, std::string_view name, const TensorView& t, int64_t tokens,
                       const Device& device) {
  const auto c = arg(op, name, t);
  c.defined().rank(2, "[T, K]").dtype_in({DType::i32}).dim(0, tokens, "T").on(device).inner_contiguous();
  c.dim_at_least(1, 1, "K");
  if (t.shape[1] > kMaxTopk)
    c.fail("dimension 1 (K) must be <= " + std::to_string(kMaxTopk) + ", got " + t.describe());
}

// An indexer query q: [T, H_I, 128] of one of `dtypes`, with 1 to 128 heads.
void check_index_query(std::string_view op, const TensorView& q, std::initializer_list<DType> dtypes) {
  const auto c = arg(op, "q", q);
  c.defined().rank(3, "[T, H_I, 128]").dtype_in(dtypes).inner_contiguous();
  c.dim_at_least(1, 1, "H_I").dim(2, kIndexHeadDim, "index head dim");
  if (q.shape[1] > kMaxIndexHeads)
    c.fail("dimension 1 (H_I) must be <= " + std::to_string(kMaxIndexHeads) + ", got " + q.describe());
}

// q_scale, one scale per token and head of `q` (named `q_name`): [T, H_I] float32 when q is fp8_e4m3, else absent.
void check_q_scale(std::string_view op, const TensorView& q_scale, std::string_view q_name, const TensorView& q,
                   const Device& device) {
  const auto c = arg(op, "q_scale", q_scale);
  if (q.dtype == DType::fp8_e4m3) {
    c.defined().rank(2, "[T, H_I]").dtype_in({DType::f32}).dim(0, q.shape[0], "T").dim(1, q.shape[1], "H_I");
    c.on(device);
  } else if (q_scale.defined()) {
    c.fail("must be absent unless " + std::string(q_name) + " is fp8_e4m3 (" + std::string(q_name) + " is " +
           std::string(dtype_name(q.dtype)) + ")");
  }
}

}  // namespace

void check(const WriteIndexCacheArgs& a) {
  constexpr std::string_view op = "write_index_cache";
  const Device device = a.cache.device;
  check_index_cache(op, a.cache, device);
  arg(op, "k", a.k).defined().rank(2, "[N, 128]").dtype_in({DType::f32, DType::f16, DType::bf16}).on(device);
  arg(op, "k", a.k).dim(1, kIndexHeadDim, "index head dim").inner_contiguous();
  arg(op, "slot_mapping", a.slot_mapping).defined().rank(1, "[N]").dtype_in({DType::i64});
  arg(op, "slot_mapping", a.slot_mapping).dim(0, a.k.shape[0], "N").on(device).inner_contiguous();
  checks::check_no_overlap(op, {{"cache", a.cache}}, {{"k", a.k}, {"slot_mapping", a.slot_mapping}});
}

void check(const IndexerTopkArgs& a) {
  constexpr std::string_view op = "indexer_topk";
  const Device device = a.q.device;
  check_index_query(op, a.q, {DType::bf16, DType::f16, DType::fp8_e4m3});
  const int64_t tokens = a.q.shape[0], heads = a.q.shape[1];
  check_q_scale(op, a.q_scale, "q", a.q, device);
  // The CPU scorer reads a token's scales as a row (rotate_index_q writes through both strides).
  if (a.q_scale.defined()) arg(op, "q_scale", a.q_scale).inner_contiguous();
  arg(op, "weights", a.weights).defined().rank(2, "[T, H_I]").dtype_in({DType::f32}).on(device).inner_contiguous();
  arg(op, "weights", a.weights).dim(0, tokens, "T").dim(1, heads, "H_I");
  check_index_cache(op, a.index_cache, device);
  check_token_vector(op, "request_ids", a.request_ids, tokens, device);
  check_block_table(op, a.block_table, device);
  check_token_vector(op, "context_lens", a.context_lens, tokens, device);
  check_topk_matrix(op, "topk", a.topk, tokens, device);
  checks::check_no_overlap(op, {{"topk", a.topk}, {"workspace", a.workspace}},
                           {{"q", a.q}, {"q_scale", a.q_scale}, {"weights", a.weights}, {"index_cache", a.index_cache},
                            {"request_ids", a.request_ids}, {"block_table", a.block_table},
                            {"context_lens", a.context_lens}});
}

void check(const PositionsToSlotsArgs& a) {
  constexpr std::string_view op = "positions_to_slots";
  const Device device = a.positions.device;
  check_topk_matrix(op, "positions", a.positions, a.positions.shape[0], device);
  const int64_t tokens = a.positions.shape[0];
  check_token_vector(op, "request_ids", a.request_ids, tokens, device);
  check_block_table(op, a.block_table, device);
  if (a.block_size <= 0) fail(std::string(op) + ": block_size: must be > 0, got " + std::to_string(a.block_size));
  check_topk_matrix(op, "slots", a.slots, tokens, device);
  arg(op, "slots", a.slots).dim(1, a.positions.shape[1], "K, as in positions");
  checks::check_no_overlap(
      op, {{"slots", a.slots}}, {{"positions", a.positions}, {"request_ids", a.request_ids}, {"block_table", a.block_table}});
}

void check(const WritePooledIndexCacheArgs& a) {
  constexpr std::string_view op = "write_pooled_index_cache";
  const Device device = a.cache.device;
  check_index_cache(op, a.cache, device);
  const auto k = arg(op, "k", a.k);
  k.defined().rank(3, "[P, kpool, 128]").dtype_in({DType::f32, DType::f16, DType::bf16}).on(device);
  k.dim_at_least(1, 1, "kpool").dim(2, kIndexHeadDim, "index head dim").inner_contiguous();
  const int64_t pools = a.k.shape[0], kpool = a.k.shape[1];
  if (kpool > kMaxKpool)
    k.fail("dimension 1 (kpool) must be <= " + std::to_string(kMaxKpool) + ", got " + a.k.describe());
  const auto g = arg(op, "gate", a.gate);
  g.defined().rank(3, "[P, kpool, 128]").dtype_in({a.k.dtype}).on(device).inner_contiguous();
  g.dim(0, pools, "P, as k").dim(1, kpool, "kpool, as k").dim(2, kIndexHeadDim, "index head dim");
  const auto e = arg(op, "ape", a.ape);
  e.defined().rank(2, "[kpool, 128]").dtype_in({DType::f32}).dim(0, kpool, "kpool, as k").on(device);
  e.dim(1, kIndexHeadDim, "index head dim").inner_contiguous();
  arg(op, "slot_mapping", a.slot_mapping).defined().rank(1, "[P]").dtype_in({DType::i64});
  arg(op, "slot_mapping", a.slot_mapping).dim(0, pools, "P").on(device).inner_contiguous();
  checks::check_no_overlap(op, {{"cache", a.cache}},
                           {{"k", a.k}, {"gate", a.gate}, {"ape", a.ape}, {"slot_mapping", a.slot_mapping}});
}

void check(const PoolsToPositionsArgs& a) {
  constexpr std::string_view op = "pools_to_positions";
  const Device device = a.pools.device;
  check_topk_matrix(op, "pools", a.pools, a.pools.shape[0], device);
  const int64_t tokens = a.pools.shape[0];
  check_token_vector(op, "context_lens", a.context_lens, tokens, device);
  if (a.kpool < 1 || a.kpool > kMaxKpool)
    fail(std::string(op) + ": kpool: must be in [1, " + std::to_string(kMaxKpool) + "], got " +
         std::to_string(a.kpool));
  const int64_t width = a.pools.shape[1] * a.kpool + a.kpool - 1;
  if (width > kMaxTopk)
    fail(std::string(op) + ": positions: Kp * kpool + kpool - 1 = " + std::to_string(width) + " must be <= " +
         std::to_string(kMaxTopk));
  check_topk_matrix(op, "positions", a.positions, tokens, device);
  arg(op, "positions", a.positions).dim(1, width, "Kp * kpool + kpool - 1, the pools' tokens and the tail's");
  checks::check_no_overlap(op, {{"positions", a.positions}}, {{"pools", a.pools}, {"context_lens", a.context_lens}});
}

void check(const RotateIndexQArgs& a) {
  constexpr std::string_view op = "rotate_index_q";
  const Device device = a.q.device;
  check_index_query(op, a.q, {DType::f32, DType::f16, DType::bf16});
  const int64_t tokens = a.q.shape[0], heads = a.q.shape[1];
  const auto out = arg(op, "q_out", a.q_out);
  out.defined().rank(3, "[T, H_I, 128]").dtype_in({DType::bf16, DType::fp8_e4m3}).on(device).inner_contiguous();
  out.dim(0, tokens, "T, as q").dim(1, heads, "H_I, as q").dim(2, kIndexHeadDim, "index head dim");
  check_q_scale(op, a.q_scale, "q_out", a.q_out, device);
  checks::check_no_overlap(op, {{"q_out", a.q_out}, {"q_scale", a.q_scale}}, {{"q", a.q}});
}

void check(const DsaDecodeStepArgs& a) {
  constexpr std::string_view op = "dsa_decode_step";
  // The steps' own checks, their messages prefixed with this op's name.
  auto step = [&](const auto& args) {
    try {
      check(args);
    } catch (const Error& e) {
      throw Error(e.kind(), std::string(op) + ": " + e.what());
    }
  };
  step(indexer_step(a));
  // One stream for the whole step: the indexer on another would race with the steps that read its output.
  if (a.indexer.stream != nullptr && a.indexer.stream != a.stream)
    fail(std::string(op) + ": indexer.stream: the step runs on `stream`; leave indexer.stream null or set it to "
         "the same stream, got two different streams");
  if (a.indexer.workspace.ndim > 0 || a.indexer.workspace.defined())
    fail(std::string(op) + ": indexer.workspace: the step's `workspace` serves all three steps; leave "
         "indexer.workspace absent");
  const TensorView& topk = a.indexer.topk;
  check_topk_matrix(op, "slots", a.slots, topk.shape[0], a.indexer.q.device);
  arg(op, "slots", a.slots).dim(1, topk.shape[1], "K, as in indexer.topk");

  step(attention_step(a));

  // positions_to_slots maps through the shared block table with the MLA cache's block size.
  const TensorView& ic = a.indexer.index_cache;
  if (a.kv_cache.shape[0] != ic.shape[0] || a.kv_cache.shape[1] != ic.shape[1])
    arg(op, "kv_cache", a.kv_cache)
        .fail("must have the index cache's num_blocks and block_size (they share the block table), got " +
              a.kv_cache.describe() + " and index cache " + ic.describe());
  // What the steps' own checks cannot see: one step's output against another step's tensors.
  const IndexerTopkArgs& ix = a.indexer;
  checks::check_no_overlap(op,
                           {{"indexer.topk", ix.topk}, {"slots", a.slots}, {"out", a.out}, {"lse", a.lse},
                            {"workspace", a.workspace}},
                           {{"indexer.q", ix.q}, {"indexer.q_scale", ix.q_scale}, {"indexer.weights", ix.weights},
                            {"indexer.index_cache", ix.index_cache}, {"indexer.request_ids", ix.request_ids},
                            {"indexer.block_table", ix.block_table}, {"indexer.context_lens", ix.context_lens},
                            {"q", a.q}, {"kv_cache", a.kv_cache}, {"attn_sink", a.attn_sink}});
}

}  // namespace smla
