// indexer_topk's first stage on the GPU: every visible position's score
//   score[t, s] = k_scale[s] * Σ_h weights[t, h] * q_scale[t, h] * ReLU(q[t, h] · k[s])
// One CTA per (token, run of 64-position tiles). Keys are gathered through the
// block table with cp.async into a ring of tiles; positions are the mma's M
// dimension (16 per warp), heads its N: the token's queries are B fragments
// that stay in registers for the whole run (up to 32 heads; more are read
// from shared memory per tile), so a key is read from shared memory once and
// meets every head there. Each warp gathers and computes its own 16 rows of
// every tile, so warps never wait for each other. ReLU, the head weights and
// the sum over heads happen on the accumulators; the key scale is applied to
// the finished score. On Hopper (sm_90a code), fp8 keys meet 17-64 heads of
// fp8 queries, or 33-64 of bf16 ones, through wgmma instead: the CTA's four
// warps are one warpgroup whose 64 rows meet all heads at once, the queries
// read by the tensor cores from shared memory (mma.sync read them there with
// one instruction per fragment).
// Tokens of one request (a decode step's draft tokens, a prefill chunk) read the same keys. Grouped (ScoreTokens;
// chosen where runs are long, see kMinGroupedRun; fp8 keys in blocks of multiples of 64, up to 64 heads), the CTAs
// of up to kGroupTokens consecutive
// tokens of one request share their tiles: each takes a part of the tile run and scores it for every token of the
// group, its queries one after the other against the tile in shared memory (wgmma, up to 32 heads: all of them in
// one batch), so each key is read from memory once a group instead of once a token; a token's products and sums are
// the same instructions as ungrouped.
//
// fp8 keys meet fp8 queries as they are where the arch multiplies e4m3
// natively (mma.sync on SM89 and SM12x, wgmma on Hopper): half the k-steps of
// bf16 and no conversion, but the tensor cores sum the products to about 13
// or 14 bits (docs/ops.md).
// Otherwise keys and queries meet as bf16 (fp32 accumulation, products
// exact): fp8 keys become bf16 A fragments in registers in three
// instructions per pair: the e4m3 bits land in a bf16 of value k * 2^-120
// (subnormal codes included), exactly; the queries' fragments carry 2^88 and
// the head weights 2^32 to make up for it (so queries up to 2^40 in
// magnitude are exact). The fp8 rows' dimensions are permuted so each lane
// reads 16 contiguous bytes; the queries' fragments use the same permutation
// (a dot product does not care about the order of its terms). fp8 and bf16
// queries are exact in bf16, f16 ones are rounded.
#include <cuda_fp8.h>

#include <algorithm>
#include <type_traits>

#include "cuda/common/mma.cuh"
#include "cuda/common/runtime.h"
#include "cuda/indexer/indexer_common.cuh"
#include "cuda/common/step_stamps.cuh"
#include "cuda/kernels.h"

namespace smla::cuda {

namespace {

constexpr int kDim = 128;           // index head dim
constexpr int kScoreThreads = 128;  // 4 warps x 16 positions
constexpr int kTile = 64;           // positions per pipeline stage
constexpr int64_t kMaxTilesPerCta = 64;
constexpr int kGroupTokens = 4;  // the most tokens a grouped CTA scores each tile for

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

enum class QKind { bf16, f16, fp8 };

// How keys meet queries in the mma: bf16 keys and queries (m16n8k16);
// fp8 keys made bf16 in registers, bf16 queries (m16n8k16, or Hopper's
// wgmma m64nNk16 with the queries in shared memory); fp8 keys and queries as
// they are (m16n8k32, SM89 on, or Hopper's wgmma m64nNk32).
enum class Mma { bf16, bf16_from_fp8, bf16_wgmma, fp8, fp8_wgmma };
__host__ __device__ constexpr bool fp8_keys(Mma m) { return m != Mma::bf16; }
__host__ __device__ constexpr bool e4m3_operands(Mma m) { return m == Mma::fp8 || m == Mma::fp8_wgmma; }
__host__ __device__ constexpr bool uses_wgmma(Mma m) { return m == Mma::bf16_wgmma || m == Mma::fp8_wgmma; }
// fp8 keys converted to bf16 carry 2^-120 (made up on the queries and the head weights).
__host__ __device__ constexpr bool scaled_keys(Mma m) { return m == Mma::bf16_from_fp8 || m == Mma::bf16_wgmma; }
// The mma's N: the heads padded to kNTiles x kGroups blocks of 8.
__host__ __device__ constexpr int head_columns(int n_tiles, int groups) { return 8 * n_tiles * groups; }
__host__ __device__ constexpr int k_steps(Mma m) { return kDim / (e4m3_operands(m) ? 32 : 16); }  // per key

struct ScoreParams {
  const void* q;
  QKind q_kind;
  int64_t q_stride_t, q_stride_h;  // elements
  bool q_aligned;                  // data and strides 16-byte aligned
  const float* q_scale;
  int64_t qs_stride_t, qs_stride_h;
  const float* weights;
  int64_t w_stride_t, w_stride_h;
  int heads, tokens;
  IndexCacheLayout cache;
  IndexRows rows;
  const int32_t* block_table;
  int64_t table_stride;
  int tiles_per_cta;
  float* scores;
  int64_t score_stride;
  int* histograms;  // null, or per token kCoarseBins counts its scores' coarse bins are added to (zeroed before)
  SMLA_STAMP_FIELD
};

// The key dimensions lane (g, c) (g = lane / 4, c = lane % 4) multiplies in
// k-step j: its A fragment holds dims d0 .. d0 + n - 1 and d1 .. d1 + n - 1
// of its rows (n = 4 for e4m3 operands, else 2). bf16 keys come through
// ldmatrix in the mma's own order; fp8 keys are read 4 bytes per k-step (8
// for e4m3 operands) from the lane's 32 contiguous bytes.
template <Mma kMma>
__device__ __forceinline__ int2 fragment_dims(int j, int c) {
  if constexpr (e4m3_operands(kMma)) return {32 * c + 8 * j, 32 * c + 8 * j + 4};
  else if constexpr (kMma != Mma::bf16) return {32 * c + 4 * j, 32 * c + 4 * j + 2};
  else return {16 * j + 2 * c, 16 * j + 8 + 2 * c};
}

// Where a key row comes from: its block (ok: a block of the cache) and its offset in it.
struct KeySource {
  const uint8_t* block;
  int offset;
  bool ok;
};

// Two e4m3 codes (bytes 0-1, or 2-3 when `high`) of `word` as a bf16x2 of
// value * 2^-120: each code with its sign byte-replicated above it (prmt),
// then the 7 exponent and mantissa bits moved to bf16's and the sign to bit 15.
__device__ __forceinline__ uint32_t e4m3x2_to_scaled_bf16x2(uint32_t word, bool high) {
  uint32_t r;
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(r) : "r"(word), "r"(high ? 0xb3a2u : 0x9180u));
  return (r << 4) & 0x87f087f0u;
}
// The powers of two that make up for the keys' 2^-120: on the queries and on the head weights (exact products).
constexpr float kFp8QueryScale = 0x1p88f, kFp8WeightScale = 0x1p32f;

template <int kNTiles, int kGroups, Mma kMma, int kTokens>
struct ScoreSmem {
  static constexpr bool kFp8 = fp8_keys(kMma);
  // Tiles in the ring (one in use, the rest in flight): as many as still let four CTAs (fp8 keys) or three
  // (bf16 keys) share an SM's 228 KB; grouped, beside kTokens tokens' queries, 3 or 4 (every arch's 99 KB).
  static constexpr int kStages = kTokens > 1 ? (e4m3_operands(kMma) ? 4 : 3) : kFp8 ? (kGroups == 1 ? 5 : 4) : 3;
  // +16 bytes per row: the 8 rows an ldmatrix (or a quarter warp's 16-byte loads) touches start in different banks
  static constexpr int kRowBytes = (kFp8 ? kDim : 2 * kDim) + 16;
  uint8_t keys[kStages][kTile][kRowBytes];
  float scale[kStages][kTile];  // the key's scale; -1: its block is outside the cache
  uint2 q[kTokens][kGroups][kNTiles][k_steps(kMma)][32];  // per token: B fragments, in lane order (wgmma: B itself)
  float head_weight[kTokens][kGroups * kNTiles * 8];       // per token: weight * query scale (0: padding)
  int visible[kTokens];                                    // per token: the positions it sees (grouped)
};

// The token's queries as the mma's B operand in shared memory (s.q), in 32-bit words: the byte offset of the word
// that holds head h's dims dim and dim + 1 as bf16 (e4m3 operands: the codes of dims dim .. dim + 3; dim a multiple
// of 2, or 4). Dims go where the A fragments put the keys' (fragment_dims): quad lane c, k-step j, pair `half`.
template <int kNTiles, int kGroups, Mma kMma>
__device__ __forceinline__ unsigned query_word_offset(unsigned h, unsigned dim) {  // unsigned: shifts and masks
  constexpr unsigned kSteps = k_steps(kMma), kStepDims = 32 / kSteps;  // permuted: a lane's 32 dims, k-step by k-step
  const unsigned c = kMma == Mma::bf16 ? dim % 8 / 2 : dim / 32;
  const unsigned j = kMma == Mma::bf16 ? dim / 16 : dim % 32 / kStepDims;
  const unsigned half = kMma == Mma::bf16 ? dim % 16 / 8 : dim % kStepDims / (kStepDims / 2);
  if constexpr (uses_wgmma(kMma)) {
    // K-major core matrices of 8 heads x 16 bytes: k-step j's block of N * 32 bytes holds, for each 8 heads (256
    // bytes), their bytes of the first register pairs then of the second (128 bytes each).
    return j * head_columns(kNTiles, kGroups) * 32 + h / 8 * 256 + half * 128 + h % 8 * 16 + 4 * c;
  } else {
    // s.q[grp][n][j][quad lane]: uint2 fragments of 8 heads (grp * kNTiles + n = h / 8), .x then .y.
    return 8 * (4 * (h % 8) + c + 32 * (j + kSteps * (h / 8))) + 4 * half;
  }
}

// 16 bytes of query values: one load where the rows are 16-byte aligned, else value by value (elements of kElem bytes).
template <int kElem>
__device__ __forceinline__ uint4 load_query_piece(const uint8_t* from, bool aligned) {
  if (aligned) return *reinterpret_cast<const uint4*>(from);
  uint32_t w[4] = {};
#pragma unroll
  for (int i = 0; i < 16; i += kElem)
    w[i / 4] |= (kElem == 1 ? uint32_t{from[i]} : uint32_t{*reinterpret_cast<const uint16_t*>(from + i)}) << 8 * (i % 4);
  return {w[0], w[1], w[2], w[3]};
}

// A token's queries as 16-byte pieces of its rows (elements of kElem bytes), a thread's in chunks of kChunk pieces:
// all of a chunk loaded before any is converted (a trip to memory per chunk; a value at a time made the set-up a
// chain of trips, ~6 µs per CTA, and per-value loads of one row by every CTA crowd its L2 lines).
template <int kNTiles, int kGroups, int kElem>
struct QueryPieces {
  static constexpr int kPieceValues = 16 / kElem, kPiecesPerHead = kDim / kPieceValues;
  static constexpr int kPieces = head_columns(kNTiles, kGroups) * kPiecesPerHead, kPerThread = kPieces / kScoreThreads;
  static constexpr int kChunk = kPerThread < 1 ? 1 : kPerThread < 4 ? kPerThread : 4;
  // This thread's pieces of the chunk from piece `first` on of token t's queries (zeros for padding heads).
  __device__ __forceinline__ static void load(const ScoreParams& p, int t, int first, uint4* raw) {
    const uint8_t* q = static_cast<const uint8_t*>(p.q) + t * p.q_stride_t * kElem;
#pragma unroll
    for (int k = 0; k < kChunk; ++k) {
      const unsigned piece = first + k * kScoreThreads + threadIdx.x, h = piece / kPiecesPerHead;
      const unsigned dim = piece % kPiecesPerHead * kPieceValues;
      raw[k] = piece < kPieces && h < static_cast<unsigned>(p.heads)
                   ? load_query_piece<kElem>(q + (h * p.q_stride_h + dim) * kElem, p.q_aligned)
                   : uint4{0, 0, 0, 0};
    }
  }
};

// Writes the token's queries into s.q, chunk by chunk (QueryPieces); the first chunk from `first_chunk` when given
// (loaded earlier by QueryPieces::load).
template <int kNTiles, int kGroups, Mma kMma, QKind kQ>
__device__ __forceinline__ void stage_queries(const ScoreParams& p, int t, uint8_t* b, const uint4* first_chunk) {
  constexpr int kElem = kQ == QKind::fp8 ? 1 : 2;
  using Pieces = QueryPieces<kNTiles, kGroups, kElem>;
  constexpr int kPieceValues = Pieces::kPieceValues, kPiecesPerHead = Pieces::kPiecesPerHead;
  constexpr int kPieces = Pieces::kPieces, kChunk = Pieces::kChunk;
  const auto value = [](const uint32_t(&in)[4], int i) {  // value i of a piece
    float v;
    if constexpr (kQ == QKind::fp8)
      v = __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(in[i / 4] >> 8 * (i % 4)),
                                                      __NV_E4M3)));
    else if constexpr (kQ == QKind::bf16) v = __uint_as_float(in[i / 2] >> 16 * (i % 2) << 16);
    else v = __half2float(__ushort_as_half(static_cast<uint16_t>(in[i / 2] >> 16 * (i % 2))));
    return scaled_keys(kMma) ? v * kFp8QueryScale : v;
  };
  for (int first = 0; first < kPieces; first += kChunk * kScoreThreads) {
    uint4 raw[kChunk];
    if (first == 0 && first_chunk != nullptr) {
#pragma unroll
      for (int k = 0; k < kChunk; ++k) raw[k] = first_chunk[k];
    } else {
      Pieces::load(p, t, first, raw);
    }
#pragma unroll
    for (int k = 0; k < kChunk; ++k) {
      const unsigned piece = first + k * kScoreThreads + threadIdx.x, h = piece / kPiecesPerHead;
      const unsigned dim = piece % kPiecesPerHead * kPieceValues;
      if (piece >= kPieces) continue;
      const uint32_t in[4] = {raw[k].x, raw[k].y, raw[k].z, raw[k].w};
      if constexpr (e4m3_operands(kMma)) {  // the codes as they are, 4 dims a word
#pragma unroll
        for (int i = 0; i < 4; ++i)
          *reinterpret_cast<uint32_t*>(b + query_word_offset<kNTiles, kGroups, kMma>(h, dim + 4 * i)) = in[i];
      } else {
#pragma unroll
        for (int i = 0; i < kPieceValues; i += 2)
          *reinterpret_cast<uint32_t*>(b + query_word_offset<kNTiles, kGroups, kMma>(h, dim + i)) =
              pack2<__nv_bfloat16>(value(in, i), value(in, i + 1));
      }
    }
  }
}

// f(std::integral_constant<int, c>{}) for c = min(n, kMax) (n >= 1): a count known at run time as a constant.
template <int kMax, typename F>
__device__ __forceinline__ void with_count(int n, F&& f) {
  if constexpr (kMax > 1)
    if (n < kMax) return with_count<kMax - 1>(n, f);
  f(std::integral_constant<int, kMax>{});
}

// Heads (kGroups x kNTiles x 8 of them, padded with zeros) are the mma's N.
// kRuns: every tile is one run of rows of one block, 16-byte aligned (block
// sizes that are multiples of 64, since tiles start 64-aligned). Registers
// are capped so that four CTAs share an SM. kTokens > 1: grouped (above).
template <int kNTiles, int kGroups, Mma kMma, bool kRuns, int kTokens>
__global__ void __launch_bounds__(kScoreThreads, 4) index_scores_kernel(const ScoreParams p) {
  using Smem = ScoreSmem<kNTiles, kGroups, kMma, kTokens>;
  constexpr int kStages = Smem::kStages, kSteps = k_steps(kMma);
  constexpr bool kFp8 = fp8_keys(kMma);
  constexpr int kHeadColumns = head_columns(kNTiles, kGroups);  // wgmma: 32 or 64, all at once
  static_assert(kHeadColumns <= kScoreThreads, "a thread per head column");
  static_assert(kTokens == 1 || (kFp8 && kRuns), "grouped tokens: fp8 keys in runs of whole tiles");
  extern __shared__ __align__(16) uint8_t smem_raw[];
  auto& s = *reinterpret_cast<Smem*>(smem_raw);
  SMLA_STAMP_START_END(p, kScoresFirstStart, kScoresLastEnd);
  // dsa_decode_step's top-k may launch now: it takes an SM only as one frees, and waits for every score.
  let_dependents_launch();
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, c = lane % 4;
  const int t = blockIdx.y;
  // The group: tokens t0 .. t0 + n_group - 1, the run of consecutive tokens of t's request inside t's window of
  // kTokens (tokens kTokens * (t / kTokens) on), which each of its CTAs finds alike; CTA (x, t), the group's
  // (t - t0)-th, takes that share of tile run x and scores it for every token of the group. Ungrouped: t alone.
  int t0 = t, n_group = 1;
  if constexpr (kTokens > 1) {
    const int window = t - t % kTokens, end = min(window + kTokens, p.tokens);
    const int32_t req = p.rows.request(t);
    while (t0 > window && p.rows.request(t0 - 1) == req) --t0;
    int last = t;
    while (last + 1 < end && p.rows.request(last + 1) == req) ++last;
    n_group = last - t0 + 1;
  }
  // Visible positions fit in int (context lengths are int32); the grid spans the table's capacity, which may not.
  // Tiles are read as far as the group's longest context; each token's scores are written up to its own.
  int ctx = 0, visible[kTokens];  // the group's tokens' positions (grouped: kept in s.visible with their queries)
#pragma unroll
  for (int u = 0; u < kTokens; ++u) {
    visible[u] = u < n_group ? static_cast<int>(p.rows.visible(t0 + u)) : 0;
    ctx = max(ctx, visible[u]);
  }
  const int part_tiles = (p.tiles_per_cta + n_group - 1) / n_group, run_first = blockIdx.x * p.tiles_per_cta;
  const int first_tile = run_first + (t - t0) * part_tiles;
  const int part_end = run_first + min((t - t0 + 1) * part_tiles, p.tiles_per_cta);
  if (first_tile >= part_end || static_cast<int64_t>(first_tile) * kTile >= ctx) return;
  const int begin = first_tile * kTile;
  const int n_tiles = min(part_end - first_tile, (ctx - begin + kTile - 1) / kTile);
  const int32_t* table = p.block_table + p.rows.request(t) * p.table_stride;
  const int block_size = p.cache.block_size;
  const auto in_cache = [&](int block) { return block >= 0 && block < p.cache.num_blocks; };

  // Each warp computes 16 rows of every tile and gathers those rows itself,
  // so warps wait only for their own copies (no CTA-wide barrier per tile).
  // issue(i) puts the warp's rows of tile i into ring slot i % kStages (if
  // the tile exists); a warp copy covers whole consecutive rows (few cache
  // lines per instruction); positions past the context or in a block outside
  // the cache are zero-filled and never used. With kRuns, lane i of every
  // warp looks the block of tile i (mod 32) up a chunk of 32 tiles before its
  // copies, so no copy waits for the block table; otherwise each row is looked up.
  constexpr int kRowBytes = kFp8 ? kDim : 2 * kDim, kPiecesPerRow = kRowBytes / 16;
  // A lane copies 16-byte piece lane % kPiecesPerRow of rows lane / kPiecesPerRow + k * kRowsPerCopy.
  constexpr int kRowsPerCopy = 32 / kPiecesPerRow, kCopies = 16 / kRowsPerCopy;
  const int lane_row = lane / kPiecesPerRow, lane_col = lane % kPiecesPerRow, first_row = warp * 16;
  const int64_t row_stride = kFp8 ? kDim : p.cache.row_stride;
  // kRuns: the block and first-row offset of tile 32 * chunk + lane, for the
  // chunk of 32 tiles being issued (cur) and the next one (next): each chunk
  // is looked up a chunk ahead.
  const auto run_of = [&](int i) {
    const int start = begin + i * kTile;
    return kRuns && i < n_tiles ? int2{table[start / block_size], start % block_size} : int2{-1, 0};
  };
  int2 cur_run = run_of(lane), next_run = run_of(lane + 32);
  // This thread's head's weight times its query scale for token tu (thread h: head h; 0 past the heads).
  const auto weight_times_scale = [&](int64_t tu) {
    if (tid >= p.heads) return 0.f;
    const float q_scale = p.q_scale ? p.q_scale[tu * p.qs_stride_t + tid * p.qs_stride_h] : 1.f;
    return p.weights[tu * p.w_stride_t + tid * p.w_stride_h] * q_scale;
  };
  // Up to 32 heads (a chunk of queries is all of them), every token's queries and this thread's head weight times
  // query scale are loaded now, with the block table, all at once: loaded after the keys' copies were issued, from a
  // cold L2 they waited behind those (one token of 128K, 17 MB of keys: the query stores took 24% of the kernel's
  // warp stall samples, H100), a grouped CTA's tokens one trip after another. More heads keep their registers for
  // the keys.
  constexpr bool kQFp8Only = e4m3_operands(kMma), kEarlyQueries = kGroups == 1;
  using FirstPieces = QueryPieces<kNTiles, kGroups, kQFp8Only ? 1 : 2>;  // the larger chunk of the two element sizes
  constexpr int kEarlyTokens = kEarlyQueries ? kTokens : 1;
  uint4 early_q[kEarlyTokens][FirstPieces::kChunk];
  float early_weight[kEarlyTokens];
  if constexpr (kEarlyQueries) {
#pragma unroll
    for (int u = 0; u < kTokens; ++u) {
      if (u >= n_group) break;
      if (kQFp8Only || p.q_kind == QKind::fp8) QueryPieces<kNTiles, kGroups, 1>::load(p, t0 + u, 0, early_q[u]);
      else FirstPieces::load(p, t0 + u, 0, early_q[u]);
      early_weight[u] = weight_times_scale(t0 + u);
    }
  }
  auto issue = [&](int i) {
    if (i < n_tiles) {
      const int slot = i % kStages, start = begin + i * kTile;
      const int rows_left = ctx - start - first_row;  // of the warp's 16 rows, those in the context
      uint8_t* dst = &s.keys[slot][first_row + lane_row][lane_col * 16];
      // Lanes 0-15: the scale of the warp's row `lane` (from `src`, its key's): the fp8 key's, 1 for bf16, -1 for
      // a block outside the cache, 0 past the context.
      const auto load_scale = [&](const KeySource& src) {
        float* scale = &s.scale[slot][first_row + lane];
        if (kFp8 && src.ok)
          cp_async_4(scale, src.block + static_cast<int64_t>(block_size) * kDim + src.offset * 4, true);
        else
          *scale = src.ok ? 1.f : lane < rows_left ? -1.f : 0.f;
      };
      if constexpr (kRuns) {
        if (i % 32 == 0 && i > 0) {  // issue() sees every i once, in order
          cur_run = next_run;
          next_run = run_of(i + 32 + lane);
        }
        const int block = __shfl_sync(0xffffffffu, cur_run.x, i % 32);
        const int offset = __shfl_sync(0xffffffffu, cur_run.y, i % 32) + first_row;
        const bool block_ok = in_cache(block);
        const uint8_t* data = p.cache.data + static_cast<int64_t>(block_ok ? block : 0) * p.cache.block_stride;
        const uint8_t* from = data + (offset + lane_row) * row_stride + lane_col * 16;
#pragma unroll
        for (int k = 0; k < kCopies; ++k)
          cp_async_16(dst + k * kRowsPerCopy * Smem::kRowBytes, from + k * kRowsPerCopy * row_stride,
                      block_ok && lane_row + k * kRowsPerCopy < rows_left);
        if (lane < 16) load_scale(KeySource{data, offset + lane, block_ok && lane < rows_left});
      } else {
        // Row r of the warp's: its block (ok: one of the cache's, and in the context) and its offset in that block.
        const auto source = [&](int r) {
          const int pos = start + first_row + r;
          const int block = r < rows_left ? table[pos / block_size] : -1;
          const bool ok = in_cache(block);
          return KeySource{p.cache.data + (ok ? block : 0) * p.cache.block_stride, pos % block_size, ok};
        };
#pragma unroll
        for (int k = 0; k < kCopies; ++k) {
          const KeySource src = source(lane_row + k * kRowsPerCopy);
          const uint8_t* from = src.block + src.offset * row_stride + lane_col * 16;
          uint8_t* to = dst + k * kRowsPerCopy * Smem::kRowBytes;
          if (!kFp8 || p.cache.block_stride % 16 == 0) {
            cp_async_16(to, from, src.ok);
          } else {  // fp8 blocks of a size that is not a multiple of 4 start 4-byte aligned only
            for (int w = 0; w < 4; ++w) cp_async_4(to + 4 * w, from + 4 * w, src.ok);
          }
        }
        if (lane < 16) load_scale(source(lane));
      }
    }
    cp_async_commit();  // empty groups keep the wait counts uniform
  };
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) issue(i);

  // Token t0 + u's queries as the mma's B operand in shared memory (e4m3 operands: fp8 queries), and each head's
  // weight times its query scale, a thread per head (one trip to memory; kEarlyQueries: loaded above). u a constant
  // (unrolled), so the early registers stay registers.
  const auto stage = [&](int u) {
    auto* b = reinterpret_cast<uint8_t*>(s.q[u]);
    const uint4* first = nullptr;
    if constexpr (kEarlyQueries) first = early_q[u];
    if constexpr (kQFp8Only) stage_queries<kNTiles, kGroups, kMma, QKind::fp8>(p, t0 + u, b, first);
    else if (p.q_kind == QKind::fp8) stage_queries<kNTiles, kGroups, kMma, QKind::fp8>(p, t0 + u, b, first);
    else if (p.q_kind == QKind::bf16) stage_queries<kNTiles, kGroups, kMma, QKind::bf16>(p, t0 + u, b, first);
    else stage_queries<kNTiles, kGroups, kMma, QKind::f16>(p, t0 + u, b, first);
    if (kTokens > 1 && tid == 0) s.visible[u] = visible[u];
    if (tid < kHeadColumns) {  // thread h: head h's
      float weight;
      if constexpr (kEarlyQueries) weight = early_weight[u];
      else weight = weight_times_scale(t0 + u);
      s.head_weight[u][tid] = weight * (scaled_keys(kMma) ? kFp8WeightScale : 1.f);
    }
  };
#pragma unroll
  for (int u = 0; u < kTokens; ++u)
    if (u < n_group) stage(u);
  if constexpr (uses_wgmma(kMma)) fence_shared_for_async_proxy();
  __syncthreads();
  // This lane's accumulator columns' weights, heads 8n + 2c and 8n + 2c + 1 of each group, of token u: in registers
  // for a CTA of one token, read per tile when grouped.
  using Weights = float[kGroups][kNTiles][2];
  const auto load_weights = [&](int u, Weights& w) {
#pragma unroll
    for (int grp = 0; grp < kGroups; ++grp)
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int r = 0; r < 2; ++r) w[grp][nt][r] = s.head_weight[u][(grp * kNTiles + nt) * 8 + 2 * c + r];
  };
  Weights w;
  load_weights(0, w);
  constexpr bool kQInRegisters = kGroups == 1 && !uses_wgmma(kMma) && kTokens == 1;
  uint2 bq[kQInRegisters ? kNTiles : 1][kQInRegisters ? kSteps : 1];
  if constexpr (kQInRegisters) {
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int j = 0; j < kSteps; ++j) bq[nt][j] = s.q[0][0][nt][j][lane];
  }

  constexpr uint64_t kTokenQueryStep = sizeof(s.q[0]) >> 4;  // descriptor units between tokens' B
  const uint64_t q_descriptor = wgmma_descriptor(s.q, 128, 256);  // wgmma: token 0's k-step 0's B
  // With histograms, launched as the dependent of the kernel that zeroes them: the first tiles are in flight.
  if (p.histograms != nullptr) wait_for_prerequisites();

  for (int i = 0; i < n_tiles; ++i) {
    cp_async_wait<kStages - 2>();
    __syncwarp();  // the warp's rows of tile i landed; its lanes are done with tile i - 1, whose slot is refilled next
    issue(i + kStages - 1);
    const int slot = i % kStages;
    const uint8_t(*keys)[Smem::kRowBytes] = s.keys[slot];

    // The lane's A fragments of k-steps kHalfSteps * half .. + kHalfSteps - 1 (one half of the dims).
    constexpr int kHalfSteps = kSteps / 2;
    const auto load_a = [&](int half, uint32_t(&a)[kHalfSteps][4]) {
      if constexpr (kFp8) {
        const uint4 lo = *reinterpret_cast<const uint4*>(&keys[warp * 16 + g][32 * c + 16 * half]);
        const uint4 hi = *reinterpret_cast<const uint4*>(&keys[warp * 16 + g + 8][32 * c + 16 * half]);
        const uint32_t wlo[4] = {lo.x, lo.y, lo.z, lo.w}, whi[4] = {hi.x, hi.y, hi.z, hi.w};
#pragma unroll
        for (int jj = 0; jj < kHalfSteps; ++jj) {
          if constexpr (e4m3_operands(kMma)) {  // rows g, g + 8: 4 codes each of dims fragment_dims(j).x, then .y
            a[jj][0] = wlo[2 * jj];
            a[jj][1] = whi[2 * jj];
            a[jj][2] = wlo[2 * jj + 1];
            a[jj][3] = whi[2 * jj + 1];
          } else {
            a[jj][0] = e4m3x2_to_scaled_bf16x2(wlo[jj], false);
            a[jj][1] = e4m3x2_to_scaled_bf16x2(whi[jj], false);
            a[jj][2] = e4m3x2_to_scaled_bf16x2(wlo[jj], true);
            a[jj][3] = e4m3x2_to_scaled_bf16x2(whi[jj], true);
          }
        }
      } else {
#pragma unroll
        for (int jj = 0; jj < kHalfSteps; ++jj)
          ldmatrix_x4(a[jj], &keys[warp * 16 + lane % 16][2 * (16 * (kHalfSteps * half + jj) + (lane / 16) * 8)]);
      }
    };
    // wgmma: the tokens of a batch (up to 32 heads: the group's 4, 64 accumulators a thread) meet the tile in one
    // batch of wgmmas and one wait (a wait a token left the tensor cores idle through each token's sums); the
    // tile's A fragments are made for the first batch, the second half while the tensor cores work on the first,
    // and kept for the others (no uninitialised accumulator is read: a token's first k-step overwrites them).
    constexpr int kBatch = uses_wgmma(kMma) && kGroups == 1 ? kTokens : 1;
    uint32_t a_tile[uses_wgmma(kMma) ? 2 : 1][kHalfSteps][4];
    float acc_batch[kBatch][uses_wgmma(kMma) ? kHeadColumns / 2 : 1];
    for (int u0 = 0; u0 < n_group; u0 += kBatch) {
      if constexpr (uses_wgmma(kMma)) {  // the four warps' rows are the warpgroup's 64
        constexpr WgmmaIn kIn = kMma == Mma::fp8_wgmma ? WgmmaIn::e4m3 : WgmmaIn::bf16;
        // The batch's size a constant: a branch between its wgmmas made ptxas fence them (C7519).
        with_count<kBatch>(n_group - u0, [&](auto count) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            if (u0 == 0) load_a(half, a_tile[half]);
            wgmma_fence();
#pragma unroll
            for (int b = 0; b < decltype(count)::value; ++b) {
              const uint64_t q_token = q_descriptor + (u0 + b) * kTokenQueryStep;
#pragma unroll
              for (int jj = 0; jj < kHalfSteps; ++jj) {
                const int j = kHalfSteps * half + jj;
                const uint64_t b_step = q_token + (j * kHeadColumns * 32 >> 4);
                wgmma<kIn, kHeadColumns>(acc_batch[b], a_tile[half][jj], b_step, j > 0);
              }
            }
          }
          wgmma_commit_and_wait();
        });
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {  // the group's tokens, one after the other against the tile
        const int u = u0 + b;
        if (u >= n_group) break;
        if constexpr (kTokens > 1) load_weights(u, w);
        float score[2] = {0.f, 0.f};  // this lane's rows g and g + 8 of the warp's 16 positions
        // ReLU, head weights and the sum over the heads of 8-column block nt of group grp (fused multiply-adds: one
        // instruction a head beside its ReLU).
        const auto add_heads = [&](int grp, int nt, const float* acc) {
          const float(&wn)[2] = w[grp][nt];
          score[0] = fmaf(wn[1], fmaxf(acc[1], 0.f), fmaf(wn[0], fmaxf(acc[0], 0.f), score[0]));
          score[1] = fmaf(wn[1], fmaxf(acc[3], 0.f), fmaf(wn[0], fmaxf(acc[2], 0.f), score[1]));
        };
        if constexpr (uses_wgmma(kMma)) {
#pragma unroll
          for (int n8 = 0; n8 < kHeadColumns / 8; ++n8) add_heads(n8 / kNTiles, n8 % kNTiles, &acc_batch[b][4 * n8]);
        } else {
          // Each A fragment meets the heads of kPassGroups groups before the next is made (more accumulators would
          // spill).
          constexpr int kPassGroups = kGroups < 2 ? kGroups : 2;
#pragma unroll
          for (int pass = 0; pass < kGroups / kPassGroups; ++pass) {
            float acc[kPassGroups][kNTiles][4] = {};
#pragma unroll
            for (int half = 0; half < 2; ++half) {  // half the A fragments live at a time
              uint32_t a[kHalfSteps][4];
              load_a(half, a);
#pragma unroll
              for (int pg = 0; pg < kPassGroups; ++pg)
#pragma unroll
                for (int jj = 0; jj < kHalfSteps; ++jj)
#pragma unroll
                  for (int nt = 0; nt < kNTiles; ++nt) {
                    const int j = kHalfSteps * half + jj;
                    const uint2 b = kQInRegisters ? bq[nt][j] : s.q[u][pass * kPassGroups + pg][nt][j][lane];
                    if constexpr (kMma == Mma::fp8) mma_16832_e4m3(acc[pg][nt], a[jj], {b.x, b.y});
                    else mma_16816<__nv_bfloat16>(acc[pg][nt], a[jj], {b.x, b.y});
                  }
            }
#pragma unroll
            for (int pg = 0; pg < kPassGroups; ++pg)
#pragma unroll
              for (int nt = 0; nt < kNTiles; ++nt) add_heads(pass * kPassGroups + pg, nt, acc[pg][nt]);
          }
        }
        // The other heads of rows g and g + 8 are in the quad's other lanes.
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          score[r] += __shfl_xor_sync(0xffffffffu, score[r], 1);
          score[r] += __shfl_xor_sync(0xffffffffu, score[r], 2);
        }
        // Lane c = 0 writes row g, c = 1 row g + 8, of token t0 + u, up to its own context.
        const int64_t tu = t0 + u;
        const int row = warp * 16 + g + 8 * (c & 1), pos = begin + i * kTile + row;
        const bool writes = c < 2 && pos < (kTokens > 1 ? s.visible[u] : ctx);
        const float sc = s.scale[slot][row], value = sc < 0.f ? -INFINITY : (c == 0 ? score[0] : score[1]) * sc;
        if (writes) p.scores[tu * p.score_stride + pos] = value;
        if (p.histograms != nullptr) {  // one atomic per bin among the warp's 16 scores (the pointer read when needed)
          const int bin = writes ? coarse_bin(value) : -1;
          const uint32_t same = __match_any_sync(0xffffffffu, bin);
          if (writes && lane == __ffs(same) - 1) atomicAdd(&p.histograms[tu * kCoarseBins + bin], __popc(same));
        }
      }
    }
  }
}

// Zeroes the histograms (kCoarseBins ints per token, one CTA per token) the scores kernel, launched as this
// kernel's dependent, adds to.
__global__ void __launch_bounds__(kScoreThreads) zero_histograms_kernel(int* histograms) {
  let_dependents_launch();
  int4* bins = reinterpret_cast<int4*>(histograms + static_cast<int64_t>(blockIdx.x) * kCoarseBins);
  for (int i = threadIdx.x; i < kCoarseBins / 4; i += kScoreThreads) bins[i] = make_int4(0, 0, 0, 0);
}

// Each token's tiles are split evenly among CTAs of at most kMaxTilesPerCta
// (long runs pay each CTA's ramp, its first tiles' latency, less often;
// on an H200 runs of up to 128 or 256 tiles were 10% slower than 64), as
// many CTAs as fill whole waves of the `slots` resident ones: a last wave of a
// few CTAs would cost as much as a full one. The tiles of a CTA's run.
int64_t run_tiles(int tokens, int64_t token_tiles, int64_t slots) {
  const int64_t waves = ceil_div(tokens * ceil_div(token_tiles, kMaxTilesPerCta), slots);
  const int64_t ctas_per_token = std::clamp<int64_t>(waves * slots / tokens, 1, token_tiles);
  return ceil_div(token_tiles, ctas_per_token);
}

// The kernel's resident CTAs on the whole GPU (at least 1).
template <int kNTiles, int kGroups, Mma kMma, bool kRuns, int kTokens>
int64_t resident_slots() {
  constexpr int smem = sizeof(ScoreSmem<kNTiles, kGroups, kMma, kTokens>);
  static_assert(smem <= 99 * 1024, "fits every arch's shared memory per block");
  const auto kernel = reinterpret_cast<const void*>(index_scores_kernel<kNTiles, kGroups, kMma, kRuns, kTokens>);
  allow_dynamic_smem(kernel, smem);
  return std::max<int64_t>(1, int64_t{current_device().num_sms} * resident_ctas_per_sm(kernel, kScoreThreads, smem));
}

template <int kNTiles, int kGroups, Mma kMma, bool kRuns, int kTokens>
void launch(const ScoreParams& p, int64_t capacity, cudaStream_t stream) {
  constexpr int smem = sizeof(ScoreSmem<kNTiles, kGroups, kMma, kTokens>);
  const auto kernel = index_scores_kernel<kNTiles, kGroups, kMma, kRuns, kTokens>;
  const int tokens = p.tokens;
  const int64_t token_tiles = ceil_div(capacity, kTile);
  ScoreParams q = p;
  // Grouped, a group's CTAs share their tokens' runs, so each CTA still scores about a run's tiles x one token: runs
  // of a multiple of kTokens tiles, so a group of 2 or 4 shares them evenly.
  const int64_t run = run_tiles(tokens, token_tiles, resident_slots<kNTiles, kGroups, kMma, kRuns, kTokens>());
  q.tiles_per_cta = static_cast<int>(std::min<int64_t>(ceil_div(run, kTokens) * kTokens, token_tiles));
  const dim3 grid(static_cast<unsigned>(ceil_div(token_tiles, q.tiles_per_cta)), tokens);
  if (q.histograms != nullptr)
    launch_kernel(zero_histograms_kernel, tokens, kScoreThreads, 0, stream, "smla indexer histogram zeroing kernel",
                  q.histograms);
  void* args[] = {&q};
  launch_kernel_args(reinterpret_cast<const void*>(kernel), grid, kScoreThreads, args, smem, stream,
                     q.histograms != nullptr, "smla indexer scores kernel");
}

// Whether the tiles are runs of whole blocks (kRuns: blocks of multiples of 64 keys, 16-byte aligned).
bool tiles_are_runs(const IndexCacheLayout& cache) { return cache.block_size % kTile == 0 && cache.block_stride % 16 == 0; }

// The tokens a CTA scores each tile for under `grouping` (kGroupTokens or 1), and the launch when `stream` is given
// (score_group_tokens asks without one). Automatic groups where runs are long: each token's run, as launched one token
// a CTA, of at least kMinGroupedRun tiles. There a group reads its keys once rather than once a token (H200, 8
// draft tokens of one request over 128K, runs of 32 tiles: 29.8 against 24.4 us; 8 requests of 2 tokens, runs of
// 64: 61.8 against 48.6); with runs of 1-4 tiles (8K contexts) the group's tokens, scored one after the other,
// lost (one token 2.9 against 4.4 us, 8 of one request 5.3 against 6.8).
constexpr int64_t kMinGroupedRun = 16;
template <int kNTiles, int kGroups, Mma kMma>
int launch(const ScoreParams& p, ScoreTokens grouping, int64_t capacity, const cudaStream_t* stream) {
  if (!tiles_are_runs(p.cache)) {
    if (stream != nullptr) launch<kNTiles, kGroups, kMma, false, 1>(p, capacity, *stream);
    return 1;
  }
  if constexpr (fp8_keys(kMma) && kGroups <= 2) {
    const bool group = grouping == ScoreTokens::grouped ||
                       (grouping == ScoreTokens::automatic && p.tokens > 1 &&
                        run_tiles(p.tokens, ceil_div(capacity, kTile),
                                  resident_slots<kNTiles, kGroups, kMma, true, 1>()) >= kMinGroupedRun);
    if (group) {
      if (stream != nullptr) launch<kNTiles, kGroups, kMma, true, kGroupTokens>(p, capacity, *stream);
      return kGroupTokens;
    }
  }
  if (stream != nullptr) launch<kNTiles, kGroups, kMma, true, 1>(p, capacity, *stream);
  return 1;
}

template <int kNTiles, int kGroups>
int launch(const ScoreParams& p, Mma mma, ScoreTokens grouping, int64_t capacity, const cudaStream_t* stream) {
  if (mma == Mma::bf16) return launch<kNTiles, kGroups, Mma::bf16>(p, grouping, capacity, stream);
  if (mma == Mma::fp8) return launch<kNTiles, kGroups, Mma::fp8>(p, grouping, capacity, stream);
  if (uses_wgmma(mma)) {
    if constexpr (kNTiles == 4 && kGroups <= 2) {
      if (mma == Mma::fp8_wgmma) return launch<kNTiles, kGroups, Mma::fp8_wgmma>(p, grouping, capacity, stream);
      return launch<kNTiles, kGroups, Mma::bf16_wgmma>(p, grouping, capacity, stream);
    } else {
      throw Error(ErrorKind::internal, "indexer_scores: wgmma chosen for a head count it does not take");
    }
  }
  return launch<kNTiles, kGroups, Mma::bf16_from_fp8>(p, grouping, capacity, stream);
}

// Heads padded to 8, 16 or 32 mma columns held in registers; more heads go in groups of 32 whose fragments are read
// from shared memory (64 heads in registers cost two of the four CTAs per SM, measured slower).
int launch(const ScoreParams& p, Mma mma, ScoreTokens grouping, int64_t capacity, const cudaStream_t* stream) {
  if (p.heads <= 8) return launch<1, 1>(p, mma, grouping, capacity, stream);
  if (p.heads <= 16) return launch<2, 1>(p, mma, grouping, capacity, stream);
  if (p.heads <= 32) return launch<4, 1>(p, mma, grouping, capacity, stream);
  if (p.heads <= 64) return launch<4, 2>(p, mma, grouping, capacity, stream);
  return launch<4, 4>(p, mma, grouping, capacity, stream);
}

// How the kernel multiplies for these args on the current device: `mma` if forced (checked), else as it sees fit.
// e4m3 operands need fp8 queries too (bf16 ones would be rounded), and pay where the arch multiplies them natively:
// mma.sync on SM89 and SM12x, wgmma on Hopper (17-64 heads). Otherwise fp8 keys go to bf16, on Hopper to wgmma for
// 33-64 heads (N = 64; measured on an H200: 128 tokens x 128K, 64 heads 873 µs against 1059 on mma.sync; with 32
// heads, whose queries mma.sync keeps in registers, wgmma was within run-to-run spread of it, 690-719 against
// 698-711 µs).
Mma pick_mma(const IndexerTopkArgs& a, ScoreMma mma) {
  const int cc = current_device().compute_capability, heads = static_cast<int>(a.q.size(1));
  const bool fp8_keys = a.index_cache.dtype == DType::fp8_e4m3, fp8_pair = fp8_keys && a.q.dtype == DType::fp8_e4m3;
  if (mma == ScoreMma::fp8)
    require(fp8_pair && fp8_mma_available(cc),
            "indexer_scores: e4m3 mma needs fp8 queries and keys and a GPU of compute capability 8.9 or more");
  const bool wgmma = fp8_keys && heads > 16 && heads <= 64 && wgmma_kernels_available();
  if (mma == ScoreMma::bf16_wgmma || mma == ScoreMma::fp8_wgmma)
    require(wgmma, "indexer_scores: wgmma needs an fp8 index cache, 17 to 64 heads and a Hopper GPU running the "
                   "library's sm_90a code");
  if (mma == ScoreMma::fp8_wgmma && !fp8_pair)
    fail("indexer_scores: e4m3 wgmma needs fp8 queries, got " + std::string(dtype_name(a.q.dtype)));
  const bool automatic = mma == ScoreMma::automatic;
  if (!fp8_keys) return Mma::bf16;
  if (fp8_pair && (mma == ScoreMma::fp8 || (automatic && fp8_mma_native(cc)))) return Mma::fp8;
  if (mma == ScoreMma::fp8_wgmma || (automatic && fp8_pair && wgmma)) return Mma::fp8_wgmma;
  if (mma == ScoreMma::bf16_wgmma || (automatic && wgmma && heads > 32)) return Mma::bf16_wgmma;
  return Mma::bf16_from_fp8;
}

ScoreParams score_params(const IndexerTopkArgs& a, float* scores, int* histograms) {
  ScoreParams p{};
  p.tokens = static_cast<int>(a.q.size(0));
  p.q = a.q.data;
  p.q_kind = a.q.dtype == DType::bf16 ? QKind::bf16 : a.q.dtype == DType::f16 ? QKind::f16 : QKind::fp8;
  p.q_stride_t = a.q.stride(0);
  p.q_stride_h = a.q.stride(1);
  const int64_t q_elem = static_cast<int64_t>(dtype_size(a.q.dtype));
  p.q_aligned = reinterpret_cast<uintptr_t>(p.q) % 16 == 0 && p.q_stride_t * q_elem % 16 == 0 &&
                p.q_stride_h * q_elem % 16 == 0;
  p.q_scale = a.q_scale.defined() ? a.q_scale.ptr<float>() : nullptr;
  p.qs_stride_t = a.q_scale.defined() ? a.q_scale.stride(0) : 0;
  p.qs_stride_h = a.q_scale.defined() ? a.q_scale.stride(1) : 0;
  p.weights = a.weights.ptr<float>();
  p.w_stride_t = a.weights.stride(0);
  p.w_stride_h = a.weights.stride(1);
  p.heads = static_cast<int>(a.q.size(1));
  p.cache = index_cache_layout(a.index_cache);
  p.rows = index_rows(a);
  p.block_table = a.block_table.ptr<int32_t>();
  p.table_stride = a.block_table.stride(0);
  p.scores = scores;
  p.score_stride = score_row_stride(a);
  p.histograms = histograms;
  return p;
}

}  // namespace

ScoreMma resolve_score_mma(const IndexerTopkArgs& args, ScoreMma mma) {
  switch (pick_mma(args, mma)) {
    case Mma::bf16_wgmma: return ScoreMma::bf16_wgmma;
    case Mma::fp8: return ScoreMma::fp8;
    case Mma::fp8_wgmma: return ScoreMma::fp8_wgmma;
    default: return ScoreMma::bf16;
  }
}

int score_group_tokens(const IndexerTopkArgs& a, ScoreTokens grouping, ScoreMma mma) {
  if (grouping == ScoreTokens::one) return 1;
  if (grouping == ScoreTokens::grouped) {
    const IndexCacheLayout cache = index_cache_layout(a.index_cache);
    const int64_t heads = a.q.size(1);
    if (!cache.fp8 || !tiles_are_runs(cache) || heads > 64)
      fail("indexer_scores: grouped tokens need an fp8 index cache of blocks of a multiple of 64 keys and at most 64 "
           "heads, got " + std::string(dtype_name(a.index_cache.dtype)) + " blocks of " +
           std::to_string(cache.block_size) + " and " + std::to_string(heads) + " heads");
    return kGroupTokens;
  }
  const int64_t capacity = index_capacity(a);
  if (a.q.size(0) == 0 || capacity == 0) return 1;  // nothing launched
  return launch(score_params(a, nullptr, nullptr), pick_mma(a, mma), grouping, capacity, nullptr);
}

void indexer_scores(const IndexerTopkArgs& a, float* scores, ScoreMma mma, int* histograms, ScoreTokens grouping) {
  const ScoreParams p = score_params(a, scores, histograms);
  require(reinterpret_cast<uintptr_t>(histograms) % 16 == 0, "indexer_scores: histograms must be 16-byte aligned");
  require(reinterpret_cast<uintptr_t>(p.cache.data) % 16 == 0 &&
              (p.cache.fp8 ? p.cache.block_stride % 4 == 0
                           : p.cache.block_stride % 16 == 0 && p.cache.row_stride % 16 == 0),
          "indexer_topk: index_cache: the CUDA backend needs 16-byte aligned data and bf16 rows, 4-byte aligned fp8 blocks");
  const int64_t capacity = index_capacity(a);
  if (grouping == ScoreTokens::grouped) score_group_tokens(a, grouping, mma);  // refused, naming why, if it cannot be
  if (p.tokens == 0 || capacity == 0) return;
  const auto stream = static_cast<cudaStream_t>(a.stream);
  launch(p, pick_mma(a, mma), grouping, capacity, &stream);
}

}  // namespace smla::cuda
