// The MLA / DSA operations. Each op takes one Args struct; the free functions
// below check it once (shapes, dtypes, devices, strides) and then call the
// backend, which trusts it. Outputs are caller-allocated views. docs/ops.md
// is the contract every backend follows.
#pragma once

#include "smla/types.h"

namespace smla {

class Backend;

// Limits of the ops whatever the backend (docs/ops.md): heads per call of the
// attention ops, and K, the top-k width of sparse_mla's indices and of
// indexer_topk. The checks hold args to them; backends declare at most these
// (Capabilities::heads, ::topk).
inline constexpr int kMaxHeads = 128;
inline constexpr int kMaxTopk = 65536;

// Scratch memory. The GPU ops that need it (sparse_mla and paged_mla_decode
// when they split a token's keys, indexer_topk, dsa_decode_step) take it from
// `workspace`: a 1-D uint8 tensor on the tensors' device, 16-byte aligned, of
// at least workspace_size(args) bytes, which depends only on the args' shapes
// and the device. Left absent, the library uses a buffer of its own per
// (device, stream), which cannot be allocated while the stream is capturing a
// CUDA graph (docs/ops.md, "Workspace").

// Writes latents and rope keys into the paged MLA cache.
struct WriteMlaCacheArgs {
  TensorView latent;        // [N, 512] f32 / f16 / bf16
  TensorView k_pe;          // [N, 64], same dtype as latent; absent or [N, 0] for heads with no rope part
  TensorView slot_mapping;  // [N] i64 physical slot (block * block_size + offset); negative = skip
  TensorView cache;         // [num_blocks, block_size, 576 | 512] bf16/f16, or [..., 656] fp8_ds_mla,
                            // or [..., 528] fp8_ds_mla_nope / [..., 584] fp8_ds_mla_v4 (no rope part)
  void* stream = nullptr;   // CUDA stream (cudaStream_t); ignored on the CPU
};

// The head write_mla_cache writes: rope 64, or none when k_pe is absent or of width 0 ([N, 0]).
MlaHead written_head(const WriteMlaCacheArgs& args);

// Sparse MLA: each query token attends to the cache slots in its row of `indices`.
struct SparseMlaArgs {
  TensorView q;            // [T, H, 576] bf16 / f16; [T, H, 512] for heads with no rope part
  TensorView kv_cache;     // [num_blocks, block_size, row]: bf16 / f16 rows as wide as q, fp8_ds_mla (656 bytes),
                           // or fp8_ds_mla_nope (528 bytes) / fp8_ds_mla_v4 (584 bytes, per block: MlaV4CacheLayout)
                           // for 512-wide q only; see MlaHead::cache_row
  TensorView indices;      // [T, K] i32 physical slots; < 0 or >= num_slots: invalid, never read
  TensorView topk_length;  // optional [T] i32: only the first topk_length[t] entries count
  // An optional second cache attended under the same softmax (FlashMLA's extra_k_cache: DeepSeek-V4's compressed
  // cache beside its window cache), with its own blocks and slot space; kv_cache's dtype and row. Backends that do
  // not declare Capabilities::extra_cache refuse it.
  TensorView extra_kv_cache;     // [extra_blocks, extra_block_size, row], as kv_cache
  TensorView extra_indices;      // [T, K2] i32 physical slots of extra_kv_cache; invalid ones as in indices
  TensorView extra_topk_length;  // optional [T] i32: only the first extra_topk_length[t] entries count
  TensorView attn_sink;    // optional [H] f32
  float softmax_scale = 0.f;
  TensorView out;          // [T, H, 512], q's dtype
  TensorView lse;          // [T, H] f32 (any strides), natural log; -inf for rows with no valid index
  TensorView max_logits;   // optional [T, H] f32 out (any strides): max of softmax_scale * q.k; -inf when none
  bool empty_lse_plus_inf = false;  // true: rows with no valid index get lse = +inf (FlashMLA's convention)
  TensorView workspace;    // optional, see above
  void* stream = nullptr;
};

// Dense paged decode: s_q new tokens per request, causal among themselves.
struct PagedMlaDecodeArgs {
  TensorView q;            // [B, s_q, H, 576 | 512] bf16 / f16
  TensorView kv_cache;     // as in SparseMlaArgs
  TensorView block_table;  // [B, max_blocks] i32
  TensorView seq_lens;     // [B] i32, context length including the s_q new tokens
  TensorView attn_sink;    // optional [H] f32
  float softmax_scale = 0.f;
  bool causal = true;      // token j of s_q sees positions < seq_len - s_q + j + 1
  TensorView out;          // [B, s_q, H, 512], q's dtype
  TensorView lse;          // [B, s_q, H] f32 (any strides)
  bool empty_lse_plus_inf = false;  // as in SparseMlaArgs
  TensorView workspace;    // optional, see above
  void* stream = nullptr;
};

// Writes indexer keys into the index cache.
struct WriteIndexCacheArgs {
  TensorView k;             // [N, 128] f32 / f16 / bf16
  TensorView slot_mapping;  // [N] i64; negative = skip
  TensorView cache;         // [num_blocks, block_size, 128] bf16, or [num_blocks, block_size, 132] fp8_e4m3
                            // (per block: all tokens' 128 fp8 bytes, then all tokens' fp32 scales)
  void* stream = nullptr;
};

// Lightning indexer scores and exact top-k over each token's visible context.
struct IndexerTopkArgs {
  TensorView q;             // [T, H_I, 128] bf16 / f16, or fp8_e4m3
  TensorView q_scale;       // [T, H_I] f32; required iff q is fp8_e4m3
  TensorView weights;       // [T, H_I] f32 (already includes H_I^-0.5 * 128^-0.5)
  TensorView index_cache;   // as in WriteIndexCacheArgs
  TensorView request_ids;   // [T] i32: row of block_table of each token
  TensorView block_table;   // [R, max_blocks] i32
  TensorView context_lens;  // [T] i32: token t sees logical positions [0, context_lens[t])
  TensorView topk;          // [T, K] i32 out: logical positions, best first (or see `sorted`); -1 padded
  bool sorted = true;       // false: the same positions in ascending position order (attention needs no order;
                            // the GPU then skips ordering them by score)
  TensorView workspace;     // optional, see above
  void* stream = nullptr;
};

// Logical positions -> physical slots through each token's block table row.
struct PositionsToSlotsArgs {
  TensorView positions;    // [T, K] i32; negative = invalid
  TensorView request_ids;  // [T] i32
  TensorView block_table;  // [R, max_blocks] i32
  int block_size = 0;
  TensorView slots;        // [T, K] i32 out: -1 for invalid positions, positions past the
                           // table's capacity, and negative block ids
  void* stream = nullptr;
};

// GLM-5.3-Flash's pooled index cache: the keys of each pool of `kpool` consecutive tokens compressed into one
// index key, per dimension a softmax over the pool of gate + ape weighting the keys, then (hadamard) rotated by the
// 128-point Walsh-Hadamard transform. Pool p of a request lives in the shared block table's block p * kpool /
// block_size at offset p % (block_size / kpool): the cache has block_size / kpool rows per block.
struct WritePooledIndexCacheArgs {
  TensorView k;             // [P, kpool, 128] f32 / f16 / bf16: the index keys of each pool's tokens, in order
  TensorView gate;          // [P, kpool, 128], k's dtype: each token's gate scores (x @ index_kpool_compress_gate^T)
  TensorView ape;           // [kpool, 128] f32: the learned per-position term (index_kpool_compress_ape)
  TensorView slot_mapping;  // [P] i64 pool slot (block * rows_per_block + offset); negative = skip
  TensorView cache;         // as in WriteIndexCacheArgs, block_size / kpool rows per block
  bool hadamard = true;     // rotate the pooled key (GLM-5.3-Flash does; its queries must then be rotated too)
  void* stream = nullptr;
};

// GLM-5.3-Flash's indexer queries, as its cached pool keys are rotated: each head's 128 values times 128^-0.5 H_128
// (Walsh-Hadamard), rounded to bf16, then for an fp8 q_out quantised with one ue8m0 (power-of-two) scale per head.
struct RotateIndexQArgs {
  TensorView q;        // [T, H_I, 128] f32 / f16 / bf16
  TensorView q_out;    // [T, H_I, 128] bf16, or fp8_e4m3 (then q_scale): indexer_topk's q
  TensorView q_scale;  // [T, H_I] f32 out, iff q_out is fp8_e4m3: indexer_topk's q_scale
  void* stream = nullptr;
};

// The top pools (indexer_topk over a pooled cache, context_lens counting whole pools) -> the logical positions the
// attention reads: each pool's kpool tokens, then the tokens of the incomplete last pool (always selected).
struct PoolsToPositionsArgs {
  TensorView pools;         // [T, Kp] i32 pool ids; negative, or not a whole pool of the context: none
  TensorView context_lens;  // [T] i32 tokens: token t sees positions [0, context_lens[t])
  int kpool = 0;
  TensorView positions;     // [T, Kp * kpool + kpool - 1] i32 out; -1 padded
  void* stream = nullptr;
};

// One DSA decode step: indexer_topk -> positions_to_slots -> sparse_mla, all
// three on `stream`. The MLA cache and the index cache share the block table
// and block size.
struct DsaDecodeStepArgs {
  IndexerTopkArgs indexer;  // its `topk` receives the logical positions; its `stream` null or `stream`,
                            // its `workspace` absent (the step's `workspace` serves all three steps)
  TensorView slots;         // [T, K] i32 out (workspace): the physical slots attended
  TensorView q;             // [T, H, 576 | 512]
  TensorView kv_cache;
  TensorView attn_sink;     // optional [H] f32
  float softmax_scale = 0.f;
  TensorView out;           // [T, H, 512]
  TensorView lse;           // [T, H]
  TensorView workspace;     // optional, see above
  void* stream = nullptr;
};

// The args of dsa_decode_step's three steps, each on `args.stream` with `args.workspace`, for
// backends and callers that run the steps themselves.
IndexerTopkArgs indexer_step(const DsaDecodeStepArgs& args);
PositionsToSlotsArgs slots_step(const DsaDecodeStepArgs& args);
SparseMlaArgs attention_step(const DsaDecodeStepArgs& args);

// Each function checks its Args and runs them on `backend`, or, when null, on
// the default backend for the tensors' device. Errors: smla::Error naming the
// argument at fault.
void write_mla_cache(const WriteMlaCacheArgs& args, const Backend* backend = nullptr);
void sparse_mla(const SparseMlaArgs& args, const Backend* backend = nullptr);
void paged_mla_decode(const PagedMlaDecodeArgs& args, const Backend* backend = nullptr);
void write_index_cache(const WriteIndexCacheArgs& args, const Backend* backend = nullptr);
void indexer_topk(const IndexerTopkArgs& args, const Backend* backend = nullptr);
void positions_to_slots(const PositionsToSlotsArgs& args, const Backend* backend = nullptr);
void write_pooled_index_cache(const WritePooledIndexCacheArgs& args, const Backend* backend = nullptr);
void pools_to_positions(const PoolsToPositionsArgs& args, const Backend* backend = nullptr);
void rotate_index_q(const RotateIndexQArgs& args, const Backend* backend = nullptr);
void dsa_decode_step(const DsaDecodeStepArgs& args, const Backend* backend = nullptr);

// Bytes of `workspace` the op needs for these args on `backend` (null: the
// default backend for the tensors' device); 0 when it needs none (the CPU
// backend never does). Checks the args as the op does.
size_t workspace_size(const SparseMlaArgs& args, const Backend* backend = nullptr);
size_t workspace_size(const PagedMlaDecodeArgs& args, const Backend* backend = nullptr);
size_t workspace_size(const IndexerTopkArgs& args, const Backend* backend = nullptr);
size_t workspace_size(const DsaDecodeStepArgs& args, const Backend* backend = nullptr);

// Where the overloads below get a workspace: called with the bytes the op
// needs (> 0), it returns a view of at least that many, as `workspace` must
// be, of memory of its own (fresh from an allocator: it is checked for rank,
// dtype, device, alignment and size, not for overlap with the args' tensors).
// A non-owning reference to a callable (no allocation of its own); the
// callable must outlive the call it is passed to.
class WorkspaceSource {
 public:
  template <class F>
  WorkspaceSource(const F& source)  // NOLINT(google-explicit-constructor): passed as a lambda
      : source_(&source), call_([](const void* s, size_t bytes) { return (*static_cast<const F*>(s))(bytes); }) {}
  TensorView operator()(size_t bytes) const { return call_(source_, bytes); }

 private:
  const void* source_;
  TensorView (*call_)(const void*, size_t);
};

// The ops above with `args.workspace`, when absent and the op needs one, from
// `workspace`, called once after the checks (never for an empty batch): the
// args are checked once, where workspace_size and then the op would check
// them twice. For callers whose scratch comes from their own allocator (the
// torch kernels: torch's caching allocator, which CUDA graphs capture). A
// workspace the args carry is used and checked as by the overloads above.
void sparse_mla(const SparseMlaArgs& args, const Backend* backend, WorkspaceSource workspace);
void paged_mla_decode(const PagedMlaDecodeArgs& args, const Backend* backend, WorkspaceSource workspace);
void indexer_topk(const IndexerTopkArgs& args, const Backend* backend, WorkspaceSource workspace);
void dsa_decode_step(const DsaDecodeStepArgs& args, const Backend* backend, WorkspaceSource workspace);

// The checks the functions above run, exposed for bindings and tests.
void check(const WriteMlaCacheArgs& args);
void check(const SparseMlaArgs& args);
void check(const PagedMlaDecodeArgs& args);
void check(const WriteIndexCacheArgs& args);
void check(const IndexerTopkArgs& args);
void check(const PositionsToSlotsArgs& args);
void check(const WritePooledIndexCacheArgs& args);
void check(const PoolsToPositionsArgs& args);
void check(const RotateIndexQArgs& args);
void check(const DsaDecodeStepArgs& args);

}  // namespace smla
