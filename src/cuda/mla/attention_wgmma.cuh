// MLA attention on Hopper's warpgroup mma for fp8 caches (fp8_ds_mla, fp8_ds_mla_v4; sm_90a; issue 19's
// compute-bound shapes: 64-128 heads, prefill, dense decode; 16-bit caches take the pairs kernel,
// attention_wgmma_pairs.cuh): one CTA = one query token, kWgmmaHeads (64) heads and a range of 64-key chunks, two
// warpgroups with different roles. It calls the 16-head tile's steps (attention_kernel.cuh): cta_work,
// stage_queries, gather_row, chunk_range, dequantise_chunk, store_warpgroup_rows, the split partials and
// combine_kernel.
//
// The queries (64 x 576 16-bit values, 72 KB) and each chunk's 64 dequantised keys sit in shared memory in wgmma's
// 128-byte swizzle (swizzled_piece_offset: slabs of 64 dims, a row's 128 bytes of a slab one line), so one key
// tile is B of both products: K-major for S = Q K^T, MN-major (imm-trans-b) for O += P V, its first 512 dims being V.
//
// Roles (FlashMLA's sm90 decode splits the work the same way): warpgroup 0 computes a chunk's scores over all 64
// keys (m64n64k16, both operands in shared memory), its softmax, hands the probabilities (bf16 A fragments) and
// the rows' rescaling factors to warpgroup 1 through shared memory, and multiplies O's columns 0-255; warpgroup 1
// gathers the keys and multiplies columns 256-511 from the handed-over P. The two meet only at an mbarrier signal
// and named barriers (below), so warpgroup 0's next scores run on the tensor cores while warpgroup 1's P V of the
// chunk before does.
// Rows land in a staging buffer as they lie in the cache, one cp.async.bulk a row onto the `staged` mbarrier
// (issued by warpgroup 1's first 64 threads, a row each): the cp.async pieces they replaced, 41 16-byte copies a
// row each to another cache line, kept the load/store unit busy and warpgroup 1's P V waiting behind them (ncu: 34%
// of the stalls on the registers of those copies). fp8_ds_mla_v4 rows keep cp.async pieces: their 8 scale bytes lie
// at the block's end, no 16-byte bulk copy. At each chunk all threads dequantise the staged rows into the one key
// tile, writing zeros for the chunk's invalid rows (never copied, so staging holds whatever was there), then
// warpgroup 1 gathers chunk c+1 into staging while chunk c is multiplied. (A second key tile and the staging
// buffer would not fit 227 KB.)
#pragma once

#include <type_traits>

#include "cuda/mla/attention_kernel.cuh"
#include "cuda/mla/attention_wgmma.h"

namespace smla::cuda::mla::wg {

constexpr int kWarpgroups = 2, kWgmmaThreads = kWarpgroups * 128;
constexpr int kChunkKeys = kWgmmaChunkKeys;
constexpr int kGatherParts = 128 / kChunkKeys;  // warpgroup 1's threads per gathered row (cp.async pieces)
constexpr int kColumns = kVDim / kWarpgroups;   // O's columns per warpgroup
constexpr int kPWords = kChunkKeys / 16 * 4;    // a thread's P fragments: 4 k-steps x 4 registers
static_assert(kWgmmaHeads == kSwizzledTileRows && kChunkKeys == kSwizzledTileRows, "the tiles' rows");

// Whether rows of format `f` are gathered by one bulk copy each (fp8_ds_mla's; see above).
__host__ __device__ constexpr bool bulk_rows(CacheFormat f) { return f != CacheFormat::fp8_ds_mla_v4; }

// Where one warpgroup tells the other and goes on, an mbarrier signal: warpgroup 0 to warpgroup 1 that a chunk's
// P and rescaling factors are in shared memory (p_ready, 128 arrivals a phase). `staged`: a chunk's bulk-copied
// rows have landed (warpgroup 1's two gathering warps arrive with the bytes they expect). Where both wait, so that
// reads on one side come before writes on the other, named barriers of all kWgmmaThreads threads (0 is
// __syncthreads'): kPFree, each chunk from the second on before warpgroup 0 writes its P (warpgroup 1 is done with
// the chunk before's, which costs it nothing: it waits for that P next), and around the turn of the staged rows
// into the key tile (kTileTurn). kPFree also keeps p_ready's producer at most one phase ahead of its consumer.
enum WgmmaBarrier : int { kPFree = 1, kTileTurn, kOutputRows };  // kOutputRows + w: warpgroup w's staged rows
struct WgmmaSignals {
  uint64_t p_ready, staged;
};
constexpr int kStagedArrivals = kChunkKeys / 32;  // the gathering warps

// Shared memory, in bytes from the start (all offsets 16-byte aligned, the tiles 128-byte): the queries' tile, the
// key tile, the staging buffer, the handed-over P fragments (at the end the rows' maxima and sums), the rows'
// rescaling factors and the chunks' valid flags.
struct WgmmaLayout {
  int q = 0, k = 0, staging = 0, p = 0, stats = 0, valid = 0, valid_sets = 0, signals = 0, total = 0;
  __host__ __device__ constexpr WgmmaLayout(CacheFormat f, int rope) {
    const int tile = kWgmmaHeads * (kLatent + rope) * 2;
    k = q + tile;
    staging = k + tile;
    p = staging + kChunkKeys * staged_row_bytes(f, rope);
    stats = p + kPWords * 128 * 4;
    valid = stats + kWgmmaHeads * 4;
    // Warpgroup 1 writes chunk c + 1's flags after the turn of chunk c, when every thread is done with chunk c - 1's:
    // two sets.
    valid_sets = 2;
    signals = valid + valid_sets * kChunkKeys * 4;
    total = signals + static_cast<int>(sizeof(WgmmaSignals));
  }
};

// kTwoLists: sparse_mla's two caches in one launch (p.extra; key_range), for the cp.async gather only.
template <CacheFormat F, int kRope, bool kPaged, bool kTwoLists = false>
__global__ void __launch_bounds__(kWgmmaThreads, 1) wgmma_attention_kernel(const AttentionParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(is_fp8(F), "fp8 caches (16-bit ones take the pairs kernel)");
  static_assert(!kTwoLists || (!kPaged && !bulk_rows(F)), "two key lists: sparse_mla's, gathered by cp.async");
  static_assert(F != CacheFormat::fp8_ds_mla_v4 || kRope == 0, "fp8_ds_mla_v4 holds 512-wide heads");
  using T = ComputeT<F>;
  constexpr WgmmaIn kIn = std::is_same_v<T, __half> ? WgmmaIn::f16 : WgmmaIn::bf16;
  using D = HeadDims<kRope>;
  constexpr int kPieces = D::kPieces;
  constexpr WgmmaLayout L(F, kRope);
  constexpr int kStagedBytes = staged_row_bytes(F, kRope);  // a row's bytes read from the cache, and staged
  extern __shared__ __align__(1024) uint8_t smem[];  // the swizzle's atoms: 1024-byte aligned
  uint8_t* const sq = smem + L.q;
  uint8_t* const sk = smem + L.k;
  uint8_t* const staging = smem + L.staging;
  uint32_t* const xp = reinterpret_cast<uint32_t*>(smem + L.p);   // [word][thread of a warpgroup]
  float* const xstat = reinterpret_cast<float*>(smem + L.stats);  // [row]: the rescaling factors
  float* const xml = reinterpret_cast<float*>(smem + L.p);        // [max, sum][row], once P is done with
  int* const valid = reinterpret_cast<int*>(smem + L.valid);
  WgmmaSignals& sig = *reinterpret_cast<WgmmaSignals*>(smem + L.signals);

  // wg through a shuffle: ptxas then knows it uniform in each warp, and keeps the wgmma batches of the branches on
  // it asynchronous (a plain tid / 128 made it serialise every wgmma, C7520).
  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid / 128, 0), wtid = tid % 128, lane = tid % 32;
  const int g = lane / 4, c = lane % 4;
  const int rows[2] = {(wtid / 32) * 16 + g, (wtid / 32) * 16 + g + 8};  // this thread's rows of the tile
  const CtaWork w = cta_work(p, kWgmmaHeads);
  const int t = w.t, h0 = w.h0, nh = w.nh, split = w.split, b = w.b, j = w.j;

  // The queries into their tile: copied by cp.async where they are in the compute type (waited for at the first
  // tile turn, so that the first chunk's gather overlaps them), through registers, converted, otherwise; made
  // visible to wgmma.
  const auto q_offset = [](int row, int piece) { return swizzled_piece_offset(row, piece); };
  if (p.q_is_bf16 == std::is_same_v<T, __nv_bfloat16>) {
    copy_queries<kWgmmaHeads, kPieces, kWgmmaThreads>(p, w, sq, tid, q_offset);
  } else {
    stage_queries<T, kWgmmaHeads, kPieces, kWgmmaThreads>(p, w, sq, tid, q_offset);
    fence_shared_for_async_proxy();
  }
  // Everything from here reads what the kernel before may write (indices, cache) when dsa_decode_step launches
  // this one as the top-k's programmatic dependent; without that launch the wait returns at once.
  wait_for_prerequisites();
  const KeyRange keys = key_range<kPaged, kTwoLists>(p, t, b, j, split, kChunkKeys);
  const ChunkRange range = keys.range;
  const ListChunks lists = keys.lists;
  const int visible = range.visible, chunk_begin = range.begin, n_chunks = range.count;
  if (tid == 0) {
    mbarrier_init(&sig.p_ready, 128);
    mbarrier_init(&sig.staged, kStagedArrivals);  // bulk copies only
  }
  __syncthreads();  // the signals initialised (and converted queries staged)

  // Warpgroup 1's row of every chunk: bulk copies, thread wtid < kChunkKeys row wtid; cp.async pieces, gather_lane's
  // row and its pieces my_part + kGatherParts k.
  const GatherLane gl = bulk_rows(F) ? GatherLane{wtid, 0} : gather_lane<kGatherParts>(wtid);
  const int my_row = gl.row, my_part = gl.part;
  const bool gathers = wg == 1 && (!bulk_rows(F) || wtid < kChunkKeys);  // warp-uniform
  int64_t next_slot =
      gathers && n_chunks > 0 ? chunk_slot<kPaged, kTwoLists, kChunkKeys>(p, t, b, chunk_begin, my_row, visible, lists)
                              : -1;
  auto issue = [&](int i) {  // warpgroup 1: chunk i, if it exists, into staging
    if constexpr (bulk_rows(F)) {
      if (i >= n_chunks || !gathers) return;
      const int chunk = chunk_begin + i;
      const int64_t slot = next_slot;
      if (i + 1 < n_chunks) next_slot = slot_of<kPaged>(p, t, b, (chunk + 1) * kChunkKeys + my_row, visible);
      bulk_gather_row<kStagedBytes>(p, slot, staging + my_row * kStagedBytes,
                                    valid + (chunk % L.valid_sets) * kChunkKeys + my_row, &sig.staged);
    } else {
      if (i < n_chunks)
        gather_row<F, kPaged, kGatherParts, kChunkKeys, kTwoLists>(p, t, b, visible, chunk_begin + i, chunk_begin,
                                                                   n_chunks, my_row, my_part, next_slot, staging,
                                                                   kStagedBytes, kStagedBytes / 16, valid,
                                                                   L.valid_sets, lists);
      cp_async_commit();
    }
  };
  // Both warpgroups: chunk i dequantised from staging into the key tile (zeros for its invalid rows), then
  // warpgroup 1's gather of chunk i + 1 into staging.
  auto tile_turn = [&](int i) {
    if constexpr (bulk_rows(F)) mbarrier_wait(&sig.staged, i & 1);
    if (i == 0 || (!bulk_rows(F) && wg == 1)) cp_async_wait<0>();  // the queries' copies; chunk i's pieces
    named_barrier_sync(kTileTurn, kWgmmaThreads);  // chunk i staged; chunk i-1's products done with the tile
    const bool invalid = !valid[((chunk_begin + i) % L.valid_sets) * kChunkKeys + tid % kChunkKeys];
    dequantise_chunk<F, T, kRope, kWgmmaThreads, kChunkKeys, true>(staging, reinterpret_cast<T*>(sk), tid, invalid);
    fence_shared_for_async_proxy();
    named_barrier_sync(kTileTurn, kWgmmaThreads);  // chunk i in the tile, visible to wgmma; staging free
    if (wg == 1) issue(i + 1);
  };
  // O += P V over this warpgroup's columns of chunk i's tile `kt` (batched, not waited for).
  auto multiply_pv = [&](float (&o)[kColumns / 64][32], const uint32_t (&pa)[kChunkKeys / 16][4],
                         const uint8_t* kt) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kChunkKeys / 16; ++kk)
#pragma unroll
      for (int n = 0; n < kColumns / 64; ++n) {
        const int col = wg * kColumns + 64 * n;  // slab col / 64; its keys 16kk.. from line 16kk
        const uint64_t v_desc = wgmma_descriptor_swizzled(kt + (col / 64) * kSwizzledSlabBytes + 16 * kk * 128);
        wgmma<kIn, 64, true>(o[n], pa[kk], v_desc, true);
      }
    wgmma_commit();
  };

  // o[n]: columns wg * 256 + 64n + 8jj + 2c (+1) of rows[0] (elements 4jj, 4jj + 1) and rows[1] (4jj + 2, + 3).
  float o[kColumns / 64][32];
#pragma unroll
  for (int n = 0; n < kColumns / 64; ++n)
#pragma unroll
    for (int e = 0; e < 32; ++e) o[n][e] = 0.f;

  if (wg == 0) {
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // l: this thread's share of its rows' keys
    const uint64_t q_desc = wgmma_descriptor_swizzled(sq);
    for (int i = 0; i < n_chunks; ++i) {
      tile_turn(i);
      const uint8_t* const kt = sk;

      // Scores of the chunk's 64 keys over all dims: s[4jj + e] row rows[e / 2], key 8jj + 2c + e % 2.
      float s[kChunkKeys / 2];
      wgmma_fence();
      swizzled_scores<kIn, 0, D::kQkDim / 64>(s, q_desc, wgmma_descriptor_swizzled(kt), false);
      wgmma_commit_and_wait();

      const int* vmask = valid + ((chunk_begin + i) % L.valid_sets) * kChunkKeys;
      float cmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int jj = 0; jj < kChunkKeys / 8; ++jj)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float& v = s[4 * jj + e];
          v = vmask[8 * jj + 2 * c + e % 2] ? v * p.scale_log2 : -INFINITY;
          cmax[e / 2] = fmaxf(cmax[e / 2], v);
        }
      float alpha[2], base[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        cmax[r] = fmaxf(cmax[r], __shfl_xor_sync(0xffffffffu, cmax[r], 1));
        cmax[r] = fmaxf(cmax[r], __shfl_xor_sync(0xffffffffu, cmax[r], 2));
        const float m_new = fmaxf(m[r], cmax[r]);
        base[r] = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing valid yet stays at zero
        alpha[r] = exp2f(m[r] - base[r]);
        m[r] = m_new;
        l[r] *= alpha[r];
      }
      // P as A fragments of the chunk's four 16-key k-steps.
      uint32_t pa[kChunkKeys / 16][4];
#pragma unroll
      for (int kk = 0; kk < kChunkKeys / 16; ++kk) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          float& v = s[8 * kk + e];
          v = exp2f(v - base[(e / 2) % 2]);
          l[(e / 2) % 2] += v;
        }
#pragma unroll
        for (int r = 0; r < 4; ++r) pa[kk][r] = pack2<T>(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
      }
      // To warpgroup 1 (its thread of the same place holds the same rows and key columns), once it is done with
      // the chunk before's.
      if (i > 0) named_barrier_sync(kPFree, kWgmmaThreads);
#pragma unroll
      for (int kk = 0; kk < kChunkKeys / 16; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r) xp[(4 * kk + r) * 128 + wtid] = pa[kk][r];
      if (c == 0)
#pragma unroll
        for (int r = 0; r < 2; ++r) xstat[rows[r]] = alpha[r];
      mbarrier_arrive(&sig.p_ready);

      if (warp_rows_moved(alpha))
#pragma unroll
        for (int n = 0; n < kColumns / 64; ++n) scale_rows(o[n], alpha);
      multiply_pv(o, pa, kt);
      wgmma_wait();
    }
    if (n_chunks > 0) named_barrier_sync(kPFree, kWgmmaThreads);  // the last P read
    // Each row's maximum and sum (over the thread's quad) for both warpgroups.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
      if (c == 0) {
        xml[rows[r]] = m[r];
        xml[kWgmmaHeads + rows[r]] = l[r];
      }
    }
  } else {
    issue(0);
    for (int i = 0; i < n_chunks; ++i) {
      tile_turn(i);
      if (i > 0) named_barrier_sync(kPFree, kWgmmaThreads);  // done with chunk i-1's P, factors and flags
      mbarrier_wait(&sig.p_ready, i & 1);
      uint32_t pa[kChunkKeys / 16][4];
#pragma unroll
      for (int kk = 0; kk < kChunkKeys / 16; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r) pa[kk][r] = xp[(4 * kk + r) * 128 + wtid];
      const float alpha[2] = {xstat[rows[0]], xstat[rows[1]]};

      if (warp_rows_moved(alpha))
#pragma unroll
        for (int n = 0; n < kColumns / 64; ++n) scale_rows(o[n], alpha);
      multiply_pv(o, pa, sk);
      wgmma_wait();
    }
    if (n_chunks > 0) named_barrier_sync(kPFree, kWgmmaThreads);  // done with the last P
  }
  cp_async_wait<0>();  // every copy landed (the queries', where no chunk waited for them)
  __syncthreads();     // the rows' maxima and sums in shared memory
  const float m[2] = {xml[rows[0]], xml[rows[1]]};
  const float l[2] = {xml[kWgmmaHeads + rows[0]], xml[kWgmmaHeads + rows[1]]};
  if (p.early_combine) let_dependents_launch();  // the combine: placed while the partials are written

  // The key tile and the staging buffer are free (every product waited for, every copy landed): the output rows
  // staged there, warpgroup w's from L.k + w kStagedRowsBytes.
  static_assert(2 * kStagedRowsBytes <= L.p - L.k, "the output rows fit in the key tile and the staging buffer");
  const auto o_at = [&](int i) { return o[i / 32][i % 32]; };
  if (stores_staged(p))
    store_warpgroup_rows_staged(p, o_at, rows, nh, t, b, j, h0, wg * kColumns, m, l, wg == 0 && c == 0,
                                smem + L.k + wg * kStagedRowsBytes, wtid, kOutputRows + wg);
  else
    store_warpgroup_rows(p, o_at, rows, nh, t, b, j, split, h0, wg * kColumns + 2 * c, m, l, wg == 0 && c == 0);
#else
  __trap();  // sm_90a only: the host never launches it elsewhere
#endif
}

}  // namespace smla::cuda::mla::wg
