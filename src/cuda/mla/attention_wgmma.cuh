// MLA attention on Hopper's warpgroup mma (sm_90a; issue 19's compute-bound shapes: 64-128 heads, prefill, dense
// decode): one CTA = one query token, kWgmmaHeads (64) heads and a range of 64-key chunks, two warpgroups with
// different roles. It calls the 16-head tile's steps (attention_kernel.cuh): cta_work, stage_queries, gather_row,
// chunk_range, store_head_row, the split partials and combine_kernel.
//
// The queries (64 x 576 16-bit values, 72 KB) and each chunk's 64 gathered keys sit in shared memory in wgmma's
// core matrices without swizzle (tile_piece_offset<true>: 8 rows x 16 bytes per 128-byte block), so one key tile is
// B of both products: K-major for S = Q K^T, MN-major (imm-trans-b) for O += P V, its first 512 dims being V.
//
// Roles (FlashMLA's sm90 decode splits the work the same way): warpgroup 0 computes a chunk's scores over all 64
// keys (m64n64k16, both operands in shared memory), its softmax, hands the probabilities (bf16 A fragments) and
// the rows' rescaling factors to warpgroup 1 through shared memory, and multiplies O's columns 0-255; warpgroup 1
// gathers the keys (cp.async, two threads a row) and multiplies columns 256-511 from the handed-over P. The two
// meet only at mbarrier signals and named barriers (below), so warpgroup 0's next scores run on the tensor cores
// while warpgroup 1's P V of the chunk before does, and the gather's cp.async issue (and its stalls) stays off
// warpgroup 0's path.
// 16-bit caches: two key buffers; the gather of chunk c+2 starts once both warpgroups' P V of chunk c are done.
// fp8 caches (fp8_ds_mla, fp8_ds_mla_v4): one key tile and one staging buffer of 64 raw rows (42 KB at 656 bytes;
// two bf16 tiles and staging would not fit 227 KB); at each chunk all threads dequantise the staged rows into the
// tile (dequantise_chunk), then warpgroup 1 gathers chunk c+1 into staging while chunk c is multiplied.
//
// Both warpgroups' accumulators hold 64 rows x 256 columns (128 fp32 a thread). The row maxima and sums (log2
// domain, as the other kernels) live in warpgroup 0 and reach warpgroup 1 at the end. Heads past num_heads are
// zero queries, never stored.
#pragma once

#include <type_traits>

#include "cuda/mla/attention_kernel.cuh"
#include "cuda/mla/attention_wgmma.h"

namespace smla::cuda::mla::wg {

constexpr int kWarpgroups = 2, kWgmmaThreads = kWarpgroups * 128;
constexpr int kChunkKeys = kWgmmaChunkKeys;
constexpr int kKeyBuffers = 2;
constexpr int kGatherParts = 128 / kChunkKeys;  // warpgroup 1's threads per gathered row
constexpr int kColumns = kVDim / kWarpgroups;   // O's columns per warpgroup
constexpr int kPWords = kChunkKeys / 16 * 4;    // a thread's P fragments: 4 k-steps x 4 registers

// Where one warpgroup tells the other and goes on, an mbarrier signal (mbarrier_arrive / mbarrier_wait, 128
// arrivals a phase): warpgroup 1 that a chunk's keys are in their buffer (keys_ready, 16-bit caches), warpgroup 0
// that a chunk's P and rescaling factors are in shared memory (p_ready) and that its P V of a chunk is done with
// key buffer b (keys_free[b], 16-bit caches). Where both wait, so that reads on one side come before writes on the
// other, named barriers of all kWgmmaThreads threads (0 is __syncthreads'): kPFree, each chunk from the second on
// before warpgroup 0 writes its P (warpgroup 1 is done with the chunk before's, which costs it nothing: it waits
// for that P next), and all threads around the fp8 dequantisation (kTileTurn). kPFree also keeps each signal's
// producer at most one phase ahead of its consumer's wait.
enum WgmmaBarrier : int { kPFree = 1, kTileTurn };
struct WgmmaSignals {
  uint64_t keys_ready, p_ready, keys_free[kKeyBuffers];
};

// Shared memory, in bytes from the start (all offsets 16-byte aligned, the tiles 128-byte): the queries' tile, the
// key tiles (fp8: one, then the staging buffer), the handed-over P fragments (at the end the rows' maxima and
// sums), the rows' rescaling factors and the chunks' valid flags.
struct WgmmaLayout {
  int q = 0, k = 0, staging = 0, p = 0, stats = 0, valid = 0, valid_sets = 0, signals = 0, total = 0;
  __host__ __device__ constexpr WgmmaLayout(CacheFormat f, int rope) {
    const int tile = kWgmmaHeads * (kLatent + rope) * 2;
    k = q + tile;
    staging = k + (is_fp8(f) ? 1 : kKeyBuffers) * tile;
    p = staging + (is_fp8(f) ? kChunkKeys * staged_row_bytes(f, rope) : 0);
    stats = p + kPWords * 128 * 4;
    valid = stats + kWgmmaHeads * 4;
    // Warpgroup 1 writes chunk c + 2's flags (16-bit caches) once warpgroup 0, done with chunk c's, has signalled
    // keys_free, and chunk c + 1's (fp8) after the kTileTurn of chunk c: two sets would do; three (256 bytes more)
    // are the layout the H200 runs measured and racechecked.
    valid_sets = kKeyBuffers + 1;
    signals = valid + valid_sets * kChunkKeys * 4;
    total = signals + static_cast<int>(sizeof(WgmmaSignals));
  }
};

template <CacheFormat F, int kRope, bool kPaged>
__global__ void __launch_bounds__(kWgmmaThreads, 1) wgmma_attention_kernel(const AttentionParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(F != CacheFormat::fp8_ds_mla_v4 || kRope == 0, "fp8_ds_mla_v4 holds 512-wide heads");
  constexpr bool kFp8 = is_fp8(F);
  using T = ComputeT<F>;
  constexpr WgmmaIn kIn = std::is_same_v<T, __half> ? WgmmaIn::f16 : WgmmaIn::bf16;
  using D = HeadDims<kRope>;
  constexpr int kPieces = D::kPieces, kRowBytes = D::kQkDim * 2, kTileBytes = kWgmmaHeads * kRowBytes;
  constexpr int kBlockRowsBytes = 8 * kRowBytes;  // from one block of 8 rows to the next
  constexpr WgmmaLayout L(F, kRope);
  constexpr int kStagedBytes = kFp8 ? staged_row_bytes(F, kRope) : 0;  // a staged fp8 row, 16-byte pieces
  extern __shared__ __align__(128) uint8_t smem[];
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
  stage_queries<T, kWgmmaHeads, kPieces, kWgmmaThreads, true>(
      p, w, sq, tid, [](int row, int piece) { return tile_piece_offset<true>(row, piece, kRowBytes); });
  fence_shared_for_async_proxy();
  // Everything from here reads what the kernel before may write (indices, cache) when dsa_decode_step launches
  // this one as the top-k's programmatic dependent; without that launch the wait returns at once.
  wait_for_prerequisites();
  const ChunkRange range = chunk_range<kPaged>(p, t, b, j, split, kChunkKeys);
  const int visible = range.visible, chunk_begin = range.begin, n_chunks = range.count;
  if (tid == 0) {
    mbarrier_init(&sig.keys_ready, 128);
    mbarrier_init(&sig.p_ready, 128);
    for (uint64_t& f : sig.keys_free) mbarrier_init(&f, 128);
  }
  __syncthreads();  // the queries staged, the signals initialised

  // Warpgroup 1's row of every chunk, its pieces my_part + kGatherParts k.
  const GatherLane gl = gather_lane<kGatherParts>(wtid);
  const int my_row = gl.row, my_part = gl.part;
  int64_t next_slot =
      wg == 1 && n_chunks > 0 ? slot_of<kPaged>(p, t, b, chunk_begin * kChunkKeys + my_row, visible) : -1;
  auto issue = [&](int i) {  // warpgroup 1: chunk i, if it exists, into key buffer i % kKeyBuffers (fp8: staging)
    if constexpr (kFp8) {
      if (i < n_chunks)
        gather_row<F, kPaged, kGatherParts, kChunkKeys>(p, t, b, visible, chunk_begin + i, chunk_begin, n_chunks,
                                                        my_row, my_part, next_slot, staging, kStagedBytes,
                                                        kStagedBytes / 16, valid, L.valid_sets);
    } else {
      if (i < n_chunks)
        gather_row<F, kPaged, kGatherParts, kChunkKeys, true>(p, t, b, visible, chunk_begin + i, chunk_begin, n_chunks,
                                                              my_row, my_part, next_slot,
                                                              sk + (i % kKeyBuffers) * kTileBytes, kRowBytes, kPieces,
                                                              valid, L.valid_sets);
    }
    cp_async_commit();
  };
  // fp8, both warpgroups: chunk i from staging into the tile, then the gather of chunk i + 1 into staging.
  auto tile_turn = [&](int i) {
    if constexpr (kFp8) {
      if (wg == 1) cp_async_wait<0>();
      named_barrier_sync(kTileTurn, kWgmmaThreads);  // chunk i staged; chunk i-1's products done with the tile
      dequantise_chunk<F, T, kRope, kWgmmaThreads, kChunkKeys, true>(staging, reinterpret_cast<T*>(sk), tid);
      fence_shared_for_async_proxy();
      named_barrier_sync(kTileTurn, kWgmmaThreads);  // chunk i in the tile, visible to wgmma; staging free
      if (wg == 1) issue(i + 1);
    }
  };
  auto key_tile = [&](int i) { return sk + (kFp8 ? 0 : (i % kKeyBuffers) * kTileBytes); };
  // O += P V over this warpgroup's columns of chunk i's tile `kt` (batched, not waited for).
  auto multiply_pv = [&](float (&o)[kColumns / 64][32], const uint32_t (&pa)[kChunkKeys / 16][4],
                         const uint8_t* kt) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kChunkKeys / 16; ++kk)
#pragma unroll
      for (int n = 0; n < kColumns / 64; ++n) {
        const int col = wg * kColumns + 64 * n;
        const uint64_t v_desc = wgmma_descriptor(kt + 2 * kk * kBlockRowsBytes + (col / 8) * 128, kBlockRowsBytes, 128);
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
    const uint64_t q_desc = wgmma_descriptor(sq, 128, kBlockRowsBytes);
    for (int i = 0; i < n_chunks; ++i) {
      if constexpr (kFp8) tile_turn(i);
      else mbarrier_wait(&sig.keys_ready, i & 1);
      const uint8_t* const kt = key_tile(i);

      // Scores of the chunk's 64 keys over all dims: s[4jj + e] row rows[e / 2], key 8jj + 2c + e % 2.
      float s[kChunkKeys / 2];
      wgmma_fence();
      const uint64_t k_desc = wgmma_descriptor(kt, 128, kBlockRowsBytes);
#pragma unroll
      for (int ks = 0; ks < D::kQkDim / 16; ++ks) wgmma_ss_n64<kIn>(s, q_desc + 16 * ks, k_desc + 16 * ks, ks > 0);
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

#pragma unroll
      for (int n = 0; n < kColumns / 64; ++n)
#pragma unroll
        for (int e = 0; e < 32; ++e) o[n][e] *= alpha[(e / 2) % 2];
      multiply_pv(o, pa, kt);
      wgmma_wait();
      if (!kFp8 && i + 2 < n_chunks) mbarrier_arrive(&sig.keys_free[i % kKeyBuffers]);
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
    if constexpr (kFp8) {
      issue(0);
    } else {
      issue(0);
      issue(1);
      if (n_chunks > 0) {
        cp_async_wait<1>();
        fence_shared_for_async_proxy();
        mbarrier_arrive(&sig.keys_ready);  // chunk 0 in its buffer
      }
    }
    for (int i = 0; i < n_chunks; ++i) {
      if constexpr (kFp8) tile_turn(i);
      if (i > 0) named_barrier_sync(kPFree, kWgmmaThreads);  // done with chunk i-1's P, factors and flags
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
      multiply_pv(o, pa, key_tile(i));
      if (!kFp8 && i + 1 < n_chunks) {
        cp_async_wait<0>();
        fence_shared_for_async_proxy();
        mbarrier_arrive(&sig.keys_ready);  // chunk i + 1 in its buffer
      }
      wgmma_wait();
      if (!kFp8 && i + 2 < n_chunks) {
        mbarrier_wait(&sig.keys_free[i % kKeyBuffers], (i / kKeyBuffers) & 1);  // both P V of chunk i done
        issue(i + 2);                                                    // into chunk i's buffer
      }
    }
    if (n_chunks > 0) named_barrier_sync(kPFree, kWgmmaThreads);  // done with the last P
    cp_async_wait<0>();
  }
  __syncthreads();  // the rows' maxima and sums in shared memory
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
