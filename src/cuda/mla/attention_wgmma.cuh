// MLA attention on Hopper's warpgroup mma (sm_90a; issue 19's compute-bound shapes: 64-128 heads, prefill, dense
// decode): one CTA = one query token, kWgmmaHeads (64) heads and a range of 64-key chunks, warpgroups with different
// roles. It calls the 16-head tile's steps (attention_kernel.cuh): cta_work, stage_queries, gather_row,
// chunk_range, store_head_row, the split partials and combine_kernel.
//
// The queries (64 x 576 16-bit values, 72 KB) and each chunk's 64 gathered keys sit in shared memory in wgmma's
// 128-byte swizzle (tile_piece_offset<true>: slabs of 64 dims, a row's 128 bytes of a slab one line), so one key
// tile is B of both products: K-major for S = Q K^T, MN-major (imm-trans-b) for O += P V, its first 512 dims being V.
//
// The math (FlashMLA's sm90 decode splits it the same way): warpgroup 0 computes a chunk's scores over all 64 keys
// (m64n64k16, both operands in shared memory), its softmax, hands the probabilities (bf16 A fragments) and the
// rows' rescaling factors to warpgroup 1 through shared memory, and multiplies O's columns 0-255; warpgroup 1
// multiplies columns 256-511 from the handed-over P. They meet only at an mbarrier signal and a named barrier
// (below), so warpgroup 0's next scores run on the tensor cores while warpgroup 1's P V of the chunk before does.
//
// The keys, two ways:
// - 16-bit rows (has_producer): a third warpgroup, the producer, gathers each chunk's rows by cp.async pieces
//   straight into one of two key tiles (Q and two tiles: 216 KB), chunk c + 1 while the math warpgroups use chunk
//   c, and hands them over by the tile's `full` mbarrier; the math warpgroups give it back by its `empty` one. 8
//   threads a row, so a warp's cp.async reads 4 whole 128-byte lines (one piece of 16 rows, as the core-matrix
//   tiles before the swizzle took it, made this kernel 33% slower than the staged one below). The producer needs
//   few registers (setmaxnreg gives them to the math warpgroups), and the tensor cores never wait for a turn of
//   the tile.
// - fp8 rows: they land in a staging buffer as they lie in the cache, one cp.async.bulk a row onto the `staged`
//   mbarrier (issued by warpgroup 1's first 64 threads, a row each); fp8_ds_mla_v4 rows keep cp.async pieces (their
//   8 scale bytes lie at the block's end, no 16-byte bulk copy). At each chunk all threads dequantise the staged
//   rows into the one key tile, writing zeros for the chunk's invalid rows (never copied, so staging holds whatever
//   was there), then warpgroup 1 gathers chunk c + 1 into staging while chunk c is multiplied. (A second key tile
//   and the staging buffer would not fit 227 KB.)
#pragma once

#include <type_traits>

#include "cuda/mla/attention_kernel.cuh"
#include "cuda/mla/attention_wgmma.h"

namespace smla::cuda::mla::wg {

constexpr int kMathThreads = 256;  // the two math warpgroups
constexpr int kChunkKeys = kWgmmaChunkKeys;
constexpr int kGatherParts = 128 / kChunkKeys;  // warpgroup 1's threads per staged row (fp8_ds_mla_v4's pieces)
constexpr int kProducerParts = 8;               // the producer's threads per row: a 128-byte line a row
static_assert(kWgmmaHeads == kSwizzledTileRows && kChunkKeys == kSwizzledTileRows, "the tiles' rows");
constexpr int kColumns = kVDim / 2;             // O's columns per math warpgroup
constexpr int kPWords = kChunkKeys / 16 * 4;    // a thread's P fragments: 4 k-steps x 4 registers
// Registers per thread once the producer has handed its share over (setmaxnreg; a multiple of 8 each): the launch
// gives each of the 384 threads 168 (65536 / 384 rounded down to 8), and the three warpgroups' counts add up to
// three times that. Warpgroup 0 holds its half of O, the scores and P; warpgroup 1 its half of O and P; the
// producer only addresses (ptxas: 232 / 184 / 88 spilled 1.7 KB, 224 / 208 / 72 nothing).
constexpr int kLaunchRegisters = 168, kScoresRegisters = 224, kValuesRegisters = 208, kProducerRegisters = 72;
static_assert(kScoresRegisters + kValuesRegisters + kProducerRegisters == 3 * kLaunchRegisters &&
                  kLaunchRegisters * wgmma_threads(CacheFormat::bf16) <= 65536,
              "the wgmma kernel's registers: the producer gives the math warpgroups what it does not use");

// Whether rows of format `f` are gathered by one bulk copy each (fp8_ds_mla's; 16-bit rows go by the producer's
// cp.async pieces straight into the key tiles, fp8_ds_mla_v4's by cp.async pieces into staging).
__host__ __device__ constexpr bool bulk_rows(CacheFormat f) { return f == CacheFormat::fp8_ds_mla; }

// Where one warpgroup tells the others and goes on, mbarrier signals: warpgroup 0 to warpgroup 1 that a chunk's P
// and rescaling factors are in shared memory (p_ready, 128 arrivals a phase); with a producer, that key tile t holds
// its chunk (full[t]: the producer's 128 threads, each once its cp.async pieces have landed) and that the math
// warpgroups are done with it (empty[t], their 256 threads); fp8 rows: `staged`, a chunk's bulk-copied rows have
// landed (warpgroup 1's two gathering warps arrive with the bytes they expect). Where both math warpgroups wait, so
// that reads on one side come before writes on the other, named barriers of their kMathThreads threads (0 is
// __syncthreads'): kPFree, each chunk from the second on before warpgroup 0 writes its P (warpgroup 1 is done with
// the chunk before's, which costs it nothing: it waits for that P next), around the turn of the staged rows into
// the key tile (kTileTurn), and kMathDone before the output. kPFree also keeps p_ready's producer at most one phase
// ahead of its consumer.
enum WgmmaBarrier : int { kPFree = 1, kTileTurn, kMathDone };
struct WgmmaSignals {
  uint64_t p_ready, staged, full[2], empty[2];
};
constexpr int kStagedArrivals = kChunkKeys / 32;  // the gathering warps

// Shared memory, in bytes from the start (all offsets 16-byte aligned, the tiles 128-byte): the queries' tile, the
// key tiles (two with a producer, else one and the staging buffer), the handed-over P fragments (at the end the
// rows' maxima and sums), the rows' rescaling factors and the chunks' valid flags (two sets: a chunk's are written
// while the chunk before is in use).
struct WgmmaLayout {
  int tile_bytes = 0, q = 0, k = 0, staging = 0, p = 0, stats = 0, valid = 0, signals = 0, total = 0;
  static constexpr int valid_sets = 2;
  __host__ __device__ constexpr WgmmaLayout(CacheFormat f, int rope) {
    tile_bytes = kWgmmaHeads * (kLatent + rope) * 2;
    k = q + tile_bytes;
    staging = k + (has_producer(f) ? 2 : 1) * tile_bytes;
    p = staging + (has_producer(f) ? 0 : kChunkKeys * staged_row_bytes(f, rope));
    stats = p + kPWords * 128 * 4;
    valid = stats + kWgmmaHeads * 4;
    signals = valid + valid_sets * kChunkKeys * 4;
    total = signals + static_cast<int>(sizeof(WgmmaSignals));
  }
};

template <CacheFormat F, int kRope, bool kPaged>
__global__ void __launch_bounds__(wgmma_threads(F), 1) wgmma_attention_kernel(const AttentionParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(F != CacheFormat::fp8_ds_mla_v4 || kRope == 0, "fp8_ds_mla_v4 holds 512-wide heads");
  constexpr bool kProducer = has_producer(F);
  using T = ComputeT<F>;
  constexpr WgmmaIn kIn = std::is_same_v<T, __half> ? WgmmaIn::f16 : WgmmaIn::bf16;
  using D = HeadDims<kRope>;
  constexpr int kPieces = D::kPieces;
  constexpr int kSlabBytes = kSwizzledTileRows * 128;  // from one 64-dim slab of a tile to the next
  constexpr WgmmaLayout L(F, kRope);
  constexpr int kStagedBytes = kProducer ? 0 : staged_row_bytes(F, kRope);  // from one staged row to the next
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

  // The queries into their tile, made visible to wgmma.
  stage_queries<T, kWgmmaHeads, kPieces, wgmma_threads(F)>(
      p, w, sq, tid, [](int row, int piece) { return tile_piece_offset<true>(row, piece, 0); });
  fence_shared_for_async_proxy();
  // Everything from here reads what the kernel before may write (indices, cache) when dsa_decode_step launches
  // this one as the top-k's programmatic dependent; without that launch the wait returns at once.
  wait_for_prerequisites();
  const ChunkRange range = chunk_range<kPaged>(p, t, b, j, split, kChunkKeys);
  const int visible = range.visible, chunk_begin = range.begin, n_chunks = range.count;
  if (tid == 0) {
    mbarrier_init(&sig.p_ready, 128);
    mbarrier_init(&sig.staged, kStagedArrivals);  // bulk copies only
    for (int k = 0; k < 2; ++k) {
      mbarrier_init(&sig.full[k], 128);
      mbarrier_init(&sig.empty[k], kMathThreads);
    }
  }
  __syncthreads();  // the queries staged, the signals initialised

  // Chunk i's key tile, its set of valid flags and its use of the tile (a tile's uses alternate their parity).
  const auto tile_of = [&](int i) { return kProducer ? (chunk_begin + i) % 2 : 0; };
  const auto flags_of = [&](int i) -> const int* { return valid + ((chunk_begin + i) % L.valid_sets) * kChunkKeys; };

  if constexpr (kProducer) {
    if (wg == 2) {  // the producer: each chunk's rows into a free key tile, rows first + 16 r of each chunk
      registers_decrease_to<kProducerRegisters>();
      constexpr int kRowsEach = kChunkKeys * kProducerParts / 128;
      const int first = wtid / kProducerParts, part = wtid % kProducerParts;
      int64_t next_slot[kRowsEach];
#pragma unroll
      for (int r = 0; r < kRowsEach; ++r)
        next_slot[r] = n_chunks > 0 ? slot_of<kPaged>(p, t, b, chunk_begin * kChunkKeys + first + 16 * r, visible) : -1;
      for (int i = 0; i < n_chunks; ++i) {
        const int k = tile_of(i);
        mbarrier_wait(&sig.empty[k], ((i / 2) & 1) ^ 1);  // a tile's first use waits for nothing
#pragma unroll
        for (int r = 0; r < kRowsEach; ++r)
          gather_row<F, kPaged, kProducerParts, kChunkKeys, true>(p, t, b, visible, chunk_begin + i, chunk_begin,
                                                                 n_chunks, first + 16 * r, part, next_slot[r],
                                                                 sk + k * L.tile_bytes, 0, kPieces, valid,
                                                                 L.valid_sets);
        cp_async_arrive(&sig.full[k]);  // once the pieces have landed
        mbarrier_arrive(&sig.full[k]);  // the flags
      }
      return;  // every piece it issued is waited for by the math warpgroups
    }
    if (wg == 0) registers_increase_to<kScoresRegisters>();
    else registers_increase_to<kValuesRegisters>();
  }

  // fp8 rows, warpgroup 1: chunk i, if it exists, into staging (a row a thread by bulk copies, thread wtid <
  // kChunkKeys row wtid; cp.async pieces, gather_lane's row and its pieces my_part + kGatherParts k).
  const GatherLane gl = bulk_rows(F) ? GatherLane{wtid, 0} : gather_lane<kGatherParts>(wtid);
  const int my_row = gl.row, my_part = gl.part;
  const bool gathers = !kProducer && wg == 1 && (!bulk_rows(F) || wtid < kChunkKeys);  // warp-uniform
  int64_t next_slot = gathers && n_chunks > 0 ? slot_of<kPaged>(p, t, b, chunk_begin * kChunkKeys + my_row, visible) : -1;
  auto issue = [&](int i) {
    if constexpr (bulk_rows(F)) {
      if (i >= n_chunks || !gathers) return;
      const int chunk = chunk_begin + i;
      const int64_t slot = next_slot;
      if (i + 1 < n_chunks) next_slot = slot_of<kPaged>(p, t, b, (chunk + 1) * kChunkKeys + my_row, visible);
      valid[(chunk % L.valid_sets) * kChunkKeys + my_row] = slot >= 0;
      const int copied = __popc(__ballot_sync(0xffffffffu, slot >= 0));
      __syncwarp();  // the warp's flags before its arrival
      if (lane == 0) mbarrier_expect_bytes(&sig.staged, copied * kStagedBytes);
      __syncwarp();  // the bytes expected before any lands
      if (slot >= 0) {
        const int s32 = static_cast<int>(slot);  // indices are int32
        bulk_copy_to_shared(staging + my_row * kStagedBytes,
                            p.cache + (s32 / p.block_size) * p.block_stride + (s32 % p.block_size) * p.row_stride,
                            kStagedBytes, &sig.staged);
      }
    } else if constexpr (!kProducer) {
      if (i < n_chunks)
        gather_row<F, kPaged, kGatherParts, kChunkKeys>(p, t, b, visible, chunk_begin + i, chunk_begin, n_chunks,
                                                        my_row, my_part, next_slot, staging, kStagedBytes,
                                                        kStagedBytes / 16, valid, L.valid_sets);
      cp_async_commit();
    }
  };
  // The math warpgroups: chunk i's key tile, once it holds the chunk and this warpgroup's wgmma may read it.
  // fp8 rows: both dequantise chunk i from staging into the tile (zeros for its invalid rows), then warpgroup 1
  // gathers chunk i + 1 into staging.
  auto acquire = [&](int i) -> const uint8_t* {
    if constexpr (kProducer) {
      mbarrier_wait(&sig.full[tile_of(i)], (i / 2) & 1);
      fence_shared_for_async_proxy();  // cp.async wrote the tile as ordinary stores
      return sk + tile_of(i) * L.tile_bytes;
    } else {
      if constexpr (bulk_rows(F)) mbarrier_wait(&sig.staged, i & 1);
      else if (wg == 1) cp_async_wait<0>();
      named_barrier_sync(kTileTurn, kMathThreads);  // chunk i staged; chunk i-1's products done with the tile
      const bool invalid = !flags_of(i)[tid % kChunkKeys];
      dequantise_chunk<F, T, kRope, kMathThreads, kChunkKeys, true>(staging, reinterpret_cast<T*>(sk), tid, invalid);
      fence_shared_for_async_proxy();
      named_barrier_sync(kTileTurn, kMathThreads);  // chunk i in the tile, visible to wgmma; staging free
      if (wg == 1) issue(i + 1);
      return sk;
    }
  };
  // The math warpgroups, each once its products of chunk i are done: the tile back to the producer.
  auto release = [&](int i) {
    if constexpr (kProducer) mbarrier_arrive(&sig.empty[tile_of(i)]);
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
        const uint64_t v_desc = wgmma_descriptor_swizzled(kt + (col / 64) * kSlabBytes + 16 * kk * 128);
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
      const uint8_t* const kt = acquire(i);

      // Scores of the chunk's 64 keys over all dims: s[4jj + e] row rows[e / 2], key 8jj + 2c + e % 2.
      float s[kChunkKeys / 2];
      wgmma_fence();
      const uint64_t k_desc = wgmma_descriptor_swizzled(kt);
#pragma unroll
      for (int ks = 0; ks < D::kQkDim / 16; ++ks) {  // k-step ks: slab ks / 4, 32 bytes a step inside its lines
        const uint64_t step = (ks / 4) * (kSlabBytes >> 4) + (ks % 4) * 2;
        wgmma_ss_n64<kIn>(s, q_desc + step, k_desc + step, ks > 0);
      }
      wgmma_commit_and_wait();

      const int* vmask = flags_of(i);
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
      if (i > 0) named_barrier_sync(kPFree, kMathThreads);
#pragma unroll
      for (int kk = 0; kk < kChunkKeys / 16; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r) xp[(4 * kk + r) * 128 + wtid] = pa[kk][r];
      if (c == 0)
#pragma unroll
        for (int r = 0; r < 2; ++r) xstat[rows[r]] = alpha[r];
      mbarrier_arrive(&sig.p_ready);

#pragma unroll
      for (int n = 0; n < kColumns / 64; ++n)
#pragma unroll
        for (int e = 0; e < 32; ++e) o[n][e] *= alpha[(e / 2) % 2];
      multiply_pv(o, pa, kt);
      wgmma_wait();
      release(i);
    }
    if (n_chunks > 0) named_barrier_sync(kPFree, kMathThreads);  // the last P read
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
    if constexpr (!kProducer) issue(0);
    for (int i = 0; i < n_chunks; ++i) {
      const uint8_t* const kt = acquire(i);
      if (i > 0) named_barrier_sync(kPFree, kMathThreads);  // done with chunk i-1's P, factors and flags
      mbarrier_wait(&sig.p_ready, i & 1);
      uint32_t pa[kChunkKeys / 16][4];
#pragma unroll
      for (int kk = 0; kk < kChunkKeys / 16; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r) pa[kk][r] = xp[(4 * kk + r) * 128 + wtid];
      const float alpha[2] = {xstat[rows[0]], xstat[rows[1]]};

#pragma unroll
      for (int n = 0; n < kColumns / 64; ++n)
#pragma unroll
        for (int e = 0; e < 32; ++e) o[n][e] *= alpha[(e / 2) % 2];
      multiply_pv(o, pa, kt);
      wgmma_wait();
      release(i);
    }
    if (n_chunks > 0) named_barrier_sync(kPFree, kMathThreads);  // done with the last P
    cp_async_wait<0>();
  }
  named_barrier_sync(kMathDone, kMathThreads);  // the rows' maxima and sums in shared memory
  const float m[2] = {xml[rows[0]], xml[rows[1]]};
  const float l[2] = {xml[kWgmmaHeads + rows[0]], xml[kWgmmaHeads + rows[1]]};
  if (p.early_combine) let_dependents_launch();  // the combine: placed while the partials are written

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (rows[r] >= nh) continue;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float cols[16][4];  // 128 columns in store_head_row's order
#pragma unroll
      for (int n = 0; n < 16; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) cols[n][e] = o[2 * half + n / 8][4 * (n % 8) + e];
      store_head_row(p, cols, r, t, b, j, split, h0 + rows[r], wg * kColumns + 128 * half + 2 * c, m[r], l[r],
                     wg == 0 && half == 0 && c == 0);
    }
  }
#else
  __trap();  // sm_90a only: the host never launches it elsewhere
#endif
}

}  // namespace smla::cuda::mla::wg
