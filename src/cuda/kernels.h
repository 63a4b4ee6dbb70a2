// The CUDA backend's ops (compiled only with nvcc). Args arrive checked.
#pragma once

#include "smla/ops.h"

namespace smla::cuda {

void write_mla_cache(const WriteMlaCacheArgs& args);
// Which kernel the attention ops run: as mla::choose_attention_kernel picks it (cuda/mla/kernel_choice.h holds the
// thresholds and the runs behind them), the choice `smla explain` reports, or forced (tests, benchmarks). In its
// order: on sm_90 where the loaded code holds sm_90a's features, the wgmma kernel from 9 heads (16-bit caches) or 17
// (fp8) at 512 query rows x heads (heads padded to 64; 1024 for rope-free heads), 64 heads per CTA, but over an
// fp8_ds_mla cache (sparse) its keys-on-M form: 32 heads per CTA for 17-32 heads from 32 tokens, and 8 or 16 heads
// per CTA for 8-16 heads at 4-8 tokens of 576-wide heads (no threshold of its own there); else the small-heads
// kernel where the device fits it, fp8_ds_mla up to 32 heads from 16 query rows, 16-bit caches up to 16 heads (8
// where 16 heads a warp does not fit) from 32 (64 for rope-free heads in both); else the wide-tile kernel (64 heads
// per CTA) from 64 heads at 4096 query rows x heads, where it fits; else the 16-head-tile kernel. With sparse_mla's
// second cache the same rules. For the
// small-heads kernel, values > 0 force its pipeline depth (`stages`, 2-4), heads per CTA (8 or 16) and at 8 heads
// per CTA the split of the output dims between 1 or 2 warps (an error where the device cannot hold the result);
// for the wide-tile kernel, `stages` > 0 forces its pipeline depth (2 or 3). The wgmma kernel (sm_90a; 16-bit
// caches: the pairs kernel, a producer warpgroup and two 64-key tiles; fp8 caches: the staged kernel, one 64-key
// tile and a staging buffer) takes no `stages`; its `heads_per_cta` is 64 (or 0), or 8, 16 or 32 over an fp8_ds_mla
// cache, which forces the keys-on-M form (attention_wgmma_keys.cuh; any other value is an error).
// `splits` > 0 forces the number of splits of each row's keys (at most one per chunk of keys; 1: unsplit); a
// caller's workspace too small for the forced plan is an error. `copy` forces how the small-heads kernel copies its
// rows: 16-byte cp.async pieces (every arch) or one bulk copy a row (sm_90+, not fp8_ds_mla_v4: an error
// elsewhere); automatic takes bulk copies where they exist. A forced kernel given a field it does not take (the
// 16-head tile's `stages`, say) is an error (mla::forced_fields_not_taken).
enum class AttentionKernel { automatic, head_tile, small_heads, wide_tile, wgmma };
enum class RowCopy { automatic, pieces, bulk };
struct AttentionChoice {
  AttentionKernel kernel = AttentionKernel::automatic;
  int stages = 0, heads_per_cta = 0, split_dims = 0, splits = 0;
  RowCopy copy = RowCopy::automatic;
};
// How sparse_mla's attention kernel follows the work before it on the stream: in order (every caller's call), or
// as the programmatic dependent of the kernel before it (SM90+; dsa_decode_step alone, where that kernel is its own
// top-k): it starts as that kernel ends and waits for it before reading indices or the cache.
enum class AttentionLaunch { in_order, after_own_kernel };
void sparse_mla(const SparseMlaArgs& args, AttentionChoice choice = {}, AttentionLaunch how = AttentionLaunch::in_order);
void paged_mla_decode(const PagedMlaDecodeArgs& args, AttentionChoice choice = {});
// What those launch for these args and choice on the current device (tests, benchmarks): the kernel (head_tile,
// small_heads, wide_tile or wgmma), its pipeline depth, dynamic shared memory and resident CTAs per SM, and how many splits each row's
// keys take (> 1: partial results, then the combine kernel; with sparse_mla's second cache, both caches' splits,
// always at least 2).
struct AttentionPlan {
  AttentionKernel kernel = AttentionKernel::automatic;
  int stages = 0, smem = 0, ctas_per_sm = 0, num_splits = 1;
};
AttentionPlan sparse_mla_plan(const SparseMlaArgs& args, AttentionChoice choice = {});
// Whether the current device runs smla's wgmma kernels (attention and indexer scores): a Hopper GPU whose loaded
// code of the library holds sm_90a's features (DeviceInfo::sm90a_code: not so for a build of 90-real or
// only older PTX).
bool wgmma_kernels_available();
AttentionPlan paged_mla_decode_plan(const PagedMlaDecodeArgs& args, AttentionChoice choice = {});
void write_index_cache(const WriteIndexCacheArgs& args);
void positions_to_slots(const PositionsToSlotsArgs& args);
void write_pooled_index_cache(const WritePooledIndexCacheArgs& args);
void pools_to_positions(const PoolsToPositionsArgs& args);
void rotate_index_q(const RotateIndexQArgs& args);
void indexer_topk(const IndexerTopkArgs& args);
// The step in three kernels: the indexer's scores; the top-k, which writes the slots as well (no
// positions_to_slots kernel) and on SM90+, unless its rows are split into slices, is launched as the scores
// kernel's programmatic dependent (its launch overlaps the scores' last CTAs; it waits for them with
// griddepcontrol.wait); the attention, from SM90 on the top-k's programmatic dependent (AttentionLaunch). Then the
// combine where the attention splits its keys; rows split into slices (below SM90) add the slices' kernels. The
// top-k counts its histograms itself, as in indexer_topk: the scores kernel counting them (TopkFusion::histograms)
// was slower on the H200 (indexer_topk.cu, scores_then_topk, has the figures). The top-k's split and the attention's
// kernel as the ops pick them, or forced (tests, benchmarks; the overload after TopkSplit).
void dsa_decode_step(const DsaDecodeStepArgs& args);

// Bytes of `workspace` each op needs (Backend::workspace_size); the same args on the same device always give the
// same size. The ops use the args' workspace when given, else the library's (default_workspace).
size_t sparse_mla_workspace_size(const SparseMlaArgs& args);
size_t paged_mla_decode_workspace_size(const PagedMlaDecodeArgs& args);
size_t indexer_workspace_size(const IndexerTopkArgs& args);

// indexer_topk's two stages, for benchmarks: scores of every visible position
// into `scores` (fp32 device memory, 16-byte aligned, T rows
// score_row_stride apart), then the top-k.
int64_t index_capacity(const IndexerTopkArgs& args);    // max_blocks * block_size
int64_t score_row_stride(const IndexerTopkArgs& args);  // index_capacity rounded up to 4
// How the scores kernel multiplies fp8 keys: as it sees fit (fp8 queries: e4m3 operands where the arch multiplies
// them natively, mma.sync on SM89 and SM12x, wgmma on Hopper for 17-64 heads; bf16 queries: on Hopper wgmma for
// 33-64 heads), or forced (tests, benchmarks): converted to bf16 for mma.sync, converted to bf16 for wgmma (Hopper,
// sm_90a code: wgmma_kernels_available(); 17-64 heads), e4m3 mma.sync (SM89 on; SM90 and SM100 emulate it), or
// e4m3 wgmma (as bf16 wgmma, fp8 queries).
enum class ScoreMma { automatic, bf16, bf16_wgmma, fp8, fp8_wgmma };
// What `mma` comes to for these args on the current device (automatic resolved; bf16 keys and fp8 keys converted
// for mma.sync are both `bf16`); a forced kind they cannot take is an error, as in indexer_scores.
ScoreMma resolve_score_mma(const IndexerTopkArgs& args, ScoreMma mma = ScoreMma::automatic);
// How the scores kernel's CTAs take tokens: as it sees fit (grouped where each token's run of key tiles per CTA, as
// launched one token a CTA, is long: several tokens over long contexts); one token each; or grouped, where the CTAs of
// up to 4 consecutive tokens of one request (draft tokens, a prefill chunk) share their tiles, each key read from
// memory once a group and scored for each token, the same products and sums as one token's (the same scores, bit for
// bit). Grouped needs an fp8 index cache in blocks of a multiple of 64 keys and at most 64 heads (forced: an error
// otherwise; automatic: one token each there). Any request ids are fine: a group is a run of equal ones.
enum class ScoreTokens { automatic, one, grouped };
// The most tokens one of the scores kernel's CTAs scores each key tile for, as indexer_scores launches it for these
// args, `grouping` and `mma` on the current device (4 grouped, else 1); a forced grouping they cannot take is an error,
// as in indexer_scores.
int score_group_tokens(const IndexerTopkArgs& args, ScoreTokens grouping, ScoreMma mma = ScoreMma::automatic);
// `histograms` (null: none; else topk_histogram_bytes, 16-byte aligned): each token's counts of its scores' coarse
// bins too, for select_topk (TopkFusion::histograms): a kernel zeroes them, the scores kernel (its programmatic
// dependent from SM90 on) counts as it writes.
void indexer_scores(const IndexerTopkArgs& args, float* scores, ScoreMma mma = ScoreMma::automatic,
                    int* histograms = nullptr, ScoreTokens grouping = ScoreTokens::automatic);
size_t topk_histogram_bytes(const IndexerTopkArgs& args);
// How select_topk shares a row among CTAs: as it sees fit, or forced (tests, benchmarks): one CTA per row,
// slices of the row in more kernels passing through global memory, the CTAs of a thread block cluster (SM90+; 2-8,
// portable sizes), or of a cluster of exactly 16 (non-portable: where topk_max_cluster_ranks says 16, Hopper);
// one_cta_streamed: one CTA per row that never holds a short row in registers but reads it twice (as rows too
// long to hold), the way the held rows are checked and timed against.
enum class TopkSplit { automatic, one_cta, slices, cluster, cluster16, one_cta_streamed };
// The most CTAs per cluster select_topk's kernel for top-`k` runs with on the current device: 1 below SM90, 8 where
// only portable sizes run (SM120, also emulated), 16 on Hopper.
int topk_max_cluster_ranks(int k);
// Scratch select_topk needs for `split` (the slices' candidate lists; 0 for the other splits). `scratch` holds that
// many bytes, 16-byte aligned; null: the library's own for the args' stream.
size_t topk_scratch_bytes(const IndexerTopkArgs& args, TopkSplit split = TopkSplit::automatic);
// What select_topk does besides the positions, inside dsa_decode_step: `slots` (null: nothing) receives the
// slots of the chosen positions as positions_to_slots would map them (its positions must be args.topk, its request
// ids args.request_ids); `after_scores`: the scores kernel was the last launched on the stream, so the top-k may
// be launched as its programmatic dependent (SM90+, rows not split into slices); `histograms` (null: the top-k
// counts them itself): each row's coarse-bin counts as indexer_scores wrote them with these scores, read instead
// of a pass over the row (any split but slices: an error there, see topk_reads_histograms).
struct TopkFusion {
  const PositionsToSlotsArgs* slots = nullptr;
  bool after_scores = false;
  const int* histograms = nullptr;
};
// Whether select_topk with `split` takes TopkFusion::histograms for these args on the current device (every split
// but slices).
bool topk_reads_histograms(const IndexerTopkArgs& args, TopkSplit split = TopkSplit::automatic);
// Threads per CTA of select_topk's kernel with `split` for these args on the current device: 1024 where one CTA holds
// every row in registers (one CTA per row, every row at most 16384 positions, k <= 2048), else 512.
int topk_cta_threads(const IndexerTopkArgs& args, TopkSplit split = TopkSplit::automatic);
void select_topk(const IndexerTopkArgs& args, const float* scores, TopkSplit split = TopkSplit::automatic,
                 void* scratch = nullptr, const TopkFusion& fusion = {});
// dsa_decode_step with the top-k's split and the attention's kernel forced, as select_topk and sparse_mla force them
// (the same errors); a caller's workspace too small for the forced split or kernel is an error, each checked as its
// stage is launched (the attention's after the top-k has written its positions and slots).
void dsa_decode_step(const DsaDecodeStepArgs& args, TopkSplit split, AttentionChoice choice);

#ifdef SMLA_TOPK_STAMPS
// A build with SMLA_TOPK_STAMPS (bench_cuda stamps) records %globaltimer (ns) into `stamps` (device memory,
// 2 x kStepStamps words; null: none), then %clock64 of the same phases from kStepStamps on: the scores kernel's
// earliest CTA start (the driver sets it to ~0 first) and latest warp end; the top-k kernel's earliest CTA start
// (~0 first), its phases on the first CTA's thread 0 (token 0, rank 0), and its latest warp end. Within phases:
// kTopkSliceCounted and kTopkRanksCounted, a cluster's histogram path: rank 0's slice counted, then every rank's
// (the sum over the ranks still to come), else not stamped;
// kTopkCounted, a held row's classes counted and scanned (the compaction's writes still to come), a row not held
// compacted (a cluster's rank 0: its slice, before the ranks exchange their lists); kTopkOrdered, the
// chosen in their order (the stores still to come). Then the attention, where the step's is the 16-head-tile kernel
// (as in bench_cuda stamps' default one-token rows; the other kernels record none, e.g. the wgmma keys-on-M form that
// sm_90a code picks for 4-8 tokens of 8-16 heads over fp8_ds_mla, mla::wgmma_few_tokens): its earliest CTA start, on
// its first CTA (token 0, split 0, thread 0) the return of its wait for the top-k, its first chunk landed in shared
// memory, dequantised (fp8 caches) and attended, its keys done, its output (or partial) rows stored, and its latest
// warp end; the combine's earliest start, on its first CTA (thread 0) the wait's return, its splits loaded and
// merged, its row stored, and its latest warp end.
enum StepStamp : int {
  kScoresFirstStart, kScoresLastEnd,
  kTopkFirstStart, kTopkWaited, kTopkSliceCounted, kTopkRanksCounted, kTopkHistogram, kTopkPlan, kTopkCounted,
  kTopkCompacted, kTopkSelected, kTopkOrdered, kTopkStored, kTopkLastEnd,
  kAttnFirstStart, kAttnWaited, kAttnLanded, kAttnDequantised, kAttnFirstChunk, kAttnAttended, kAttnStored,
  kAttnLastEnd,
  kCombineFirstStart, kCombineWaited, kCombineMerged, kCombineStored, kCombineLastEnd,
  kStepStamps
};
void set_step_stamps(unsigned long long* stamps);
#endif

}  // namespace smla::cuda
