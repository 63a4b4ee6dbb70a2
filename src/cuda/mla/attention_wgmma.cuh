// MLA attention on Hopper's warpgroup mma (sm_90a; issue 19's compute-bound shapes: 64-128 heads, prefill, dense
// decode): one CTA = one query token, kWgmmaHeads (64) heads and a range of 64-key chunks, two warpgroups. It
// calls the 16-head tile's steps (attention_kernel.cuh): cta_work, stage_queries, gather_row, chunk_range, store_head_row, the split
// partials and combine_kernel.
//
// The queries (64 x 576 16-bit values, 72 KB) and each chunk's 64 gathered keys sit in shared memory in wgmma's
// core matrices without swizzle (tile_piece_offset<true>: 8 rows x 16 bytes per 128-byte block), so one key tile is
// B of both products: K-major for S = Q K^T, MN-major (imm-trans-b) for O += P V, its first 512 dims being V.
// 16-bit caches: two key buffers, the gather of chunk c+1 runs while chunk c is multiplied (nothing is waited for
// inside a chunk but its own wgmma batches). fp8 caches (fp8_ds_mla, fp8_ds_mla_v4): one key tile and one staging
// buffer of 64 raw rows (42 KB at 656 bytes; two bf16 tiles and staging would not fit 227 KB); at each chunk all
// threads dequantise the staged rows into the tile (dequantise_chunk), then the gather of chunk c+1 into staging
// runs while chunk c is multiplied.
//
// Warpgroup w computes the scores of keys 32w..32w+31 of a chunk over all dims (m64n32k16, both operands in shared
// memory), then the two exchange their row maxima (a barrier) and their probabilities (bf16 A fragments, another),
// and each owns 256 of O's 512 columns (4 x m64n64k16 per 16 keys, P from registers; 128 fp32 accumulators a
// thread). Both hold the same row maxima (log2 domain, as the other kernels), each the sum over its own keys;
// the sums meet at the end. Heads past num_heads are zero queries, never stored.
#pragma once

#include <type_traits>

#include "cuda/mla/attention_kernel.cuh"
#include "cuda/mla/attention_wgmma.h"

namespace smla::cuda::mla::wg {

constexpr int kWarpgroups = 2, kWgmmaThreads = kWarpgroups * 128;
constexpr int kChunkKeys = kWgmmaChunkKeys, kGroupKeys = kChunkKeys / kWarpgroups;  // keys per chunk, and per warpgroup's scores
constexpr int kKeyBuffers = 2;
constexpr int kGatherParts = kWgmmaThreads / kChunkKeys;  // threads per gathered row
constexpr int kColumns = kVDim / kWarpgroups;             // O's columns per warpgroup
constexpr int kPWords = 2 * 4;                            // a thread's P fragments: 2 k-steps x 4 registers

// Shared memory, in bytes from the start (all offsets 16-byte aligned, the tiles 128-byte): the queries' tile, the
// key tiles (fp8: one, then the staging buffer), the exchanged P fragments, the exchanged row statistics and the
// chunks' valid flags.
struct WgmmaLayout {
  int q = 0, k = 0, staging = 0, p = 0, stats = 0, valid = 0, valid_sets = 0, total = 0;
  __host__ __device__ constexpr WgmmaLayout(CacheFormat f, int rope) {
    const int tile = kWgmmaHeads * (kLatent + rope) * 2;
    k = q + tile;
    staging = k + (is_fp8(f) ? 1 : kKeyBuffers) * tile;
    p = staging + (is_fp8(f) ? kChunkKeys * staged_row_bytes(f, rope) : 0);
    stats = p + kWarpgroups * kPWords * 128 * 4;
    valid = stats + kWarpgroups * kWgmmaHeads * 4;
    valid_sets = kKeyBuffers;  // the chunk in use and the one in flight
    total = valid + valid_sets * kChunkKeys * 4;
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
  uint32_t* const xp = reinterpret_cast<uint32_t*>(smem + L.p);   // [warpgroup][word][thread]
  float* const xstat = reinterpret_cast<float*>(smem + L.stats);  // [warpgroup][row]
  int* const valid = reinterpret_cast<int*>(smem + L.valid);

  const int tid = threadIdx.x, wg = tid / 128, wtid = tid % 128, lane = tid % 32;
  const int g = lane / 4, c = lane % 4;
  const int rows[2] = {(wtid / 32) * 16 + g, (wtid / 32) * 16 + g + 8};  // this thread's rows of the tile
  const CtaWork w = cta_work(p, kWgmmaHeads);
  const int t = w.t, h0 = w.h0, nh = w.nh, split = w.split, b = w.b, j = w.j;

  // The queries into their tile, made visible to wgmma.
  stage_queries<T, kWgmmaHeads, kPieces, kWgmmaThreads>(
      p, w, sq, tid, [](int row, int piece) { return tile_piece_offset<true>(row, piece, kRowBytes); });
  fence_shared_for_async_proxy();
  // Everything from here reads what the kernel before may write (indices, cache) when dsa_decode_step launches
  // this one as the top-k's programmatic dependent; without that launch the wait returns at once.
  wait_for_prerequisites();
  const ChunkRange range = chunk_range<kPaged>(p, t, b, j, split, kChunkKeys);
  const int visible = range.visible, chunk_begin = range.begin, n_chunks = range.count;

  // This thread's row of every chunk, its pieces my_part + kGatherParts k.
  const GatherLane gl = gather_lane<kGatherParts>(tid);
  const int my_row = gl.row, my_part = gl.part;
  int64_t next_slot = n_chunks > 0 ? slot_of<kPaged>(p, t, b, chunk_begin * kChunkKeys + my_row, visible) : -1;
  auto issue = [&](int i) {  // chunk i of this split, if it exists, into key buffer i % kKeyBuffers (fp8: staging)
    if constexpr (kFp8) {
      if (i < n_chunks)
        gather_row<F, kPaged, kGatherParts, kChunkKeys>(p, t, b, visible, chunk_begin + i, chunk_begin, n_chunks, my_row,
                                                        my_part, next_slot, staging, kStagedBytes, kStagedBytes / 16,
                                                        valid, L.valid_sets);
    } else {
      if (i < n_chunks)
        gather_row<F, kPaged, kGatherParts, kChunkKeys, true>(p, t, b, visible, chunk_begin + i, chunk_begin, n_chunks,
                                                              my_row, my_part, next_slot,
                                                              sk + (i % kKeyBuffers) * kTileBytes, kRowBytes, kPieces,
                                                              valid, L.valid_sets);
    }
    cp_async_commit();
  };
  issue(0);

  // o[n]: columns wg * 256 + 64n + 8jj + 2c (+1) of rows[0] (elements 4jj, 4jj + 1) and rows[1] (4jj + 2, + 3).
  float o[kColumns / 64][32];
#pragma unroll
  for (int n = 0; n < kColumns / 64; ++n)
#pragma unroll
    for (int e = 0; e < 32; ++e) o[n][e] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // l: this thread's share of its warpgroup's keys
  const uint64_t q_desc = wgmma_descriptor(sq, 128, kBlockRowsBytes);

  for (int i = 0; i < n_chunks; ++i) {
    cp_async_wait<0>();
    if constexpr (kFp8) {
      __syncthreads();  // chunk i is staged; chunk i-1's wgmma (each warpgroup waited for its own) left the tile
      dequantise_chunk<F, T, kRope, kWgmmaThreads, kChunkKeys, true>(staging, reinterpret_cast<T*>(sk), tid);
    }
    fence_shared_for_async_proxy();
    __syncthreads();  // chunk i is in its tile, visible to wgmma (the first time, the queries too); chunk i-1 is done
    issue(i + 1);     // into the buffer chunk i-1 used (fp8: staging, read into the tile above)
    const uint8_t* const kt = kFp8 ? sk : sk + (i % kKeyBuffers) * kTileBytes;

    // Scores of this warpgroup's 32 keys over all dims: s[4jj + e] row rows[e / 2], key 32wg + 8jj + 2c + e % 2.
    float s[16];
    wgmma_fence();
    const uint64_t k_desc = wgmma_descriptor(kt + wg * (kGroupKeys / 8) * kBlockRowsBytes, 128, kBlockRowsBytes);
#pragma unroll
    for (int ks = 0; ks < D::kQkDim / 16; ++ks) wgmma_ss_n32<kIn>(s, q_desc + 16 * ks, k_desc + 16 * ks, ks > 0);
    wgmma_commit_and_wait();

    const int* vmask = valid + ((chunk_begin + i) % L.valid_sets) * kChunkKeys + wg * kGroupKeys;
    float cmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int jj = 0; jj < kGroupKeys / 8; ++jj)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float& v = s[4 * jj + e];
        v = vmask[8 * jj + 2 * c + e % 2] ? v * p.scale_log2 : -INFINITY;
        cmax[e / 2] = fmaxf(cmax[e / 2], v);
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      cmax[r] = fmaxf(cmax[r], __shfl_xor_sync(0xffffffffu, cmax[r], 1));
      cmax[r] = fmaxf(cmax[r], __shfl_xor_sync(0xffffffffu, cmax[r], 2));
      if (c == 0) xstat[wg * kWgmmaHeads + rows[r]] = cmax[r];
    }
    __syncthreads();  // the maxima exchanged

    float alpha[2], base[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float m_new = fmaxf(m[r], fmaxf(cmax[r], xstat[(1 - wg) * kWgmmaHeads + rows[r]]));
      base[r] = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing valid yet stays at zero
      alpha[r] = exp2f(m[r] - base[r]);
      m[r] = m_new;
      l[r] *= alpha[r];
    }
    // P as A fragments of this warpgroup's two 16-key k-steps, and through shared memory the other's (the thread
    // of the same place there holds the same rows and key columns).
    uint32_t mine[2][4], theirs[2][4];
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        float& v = s[8 * kk + e];
        v = exp2f(v - base[(e / 2) % 2]);
        l[(e / 2) % 2] += v;
      }
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        mine[kk][r] = pack2<T>(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
        xp[(wg * kPWords + 4 * kk + r) * 128 + wtid] = mine[kk][r];
      }
    }
    __syncthreads();  // the probabilities exchanged
#pragma unroll
    for (int kk = 0; kk < 2; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) theirs[kk][r] = xp[((1 - wg) * kPWords + 4 * kk + r) * 128 + wtid];
    uint32_t pa[kChunkKeys / 16][4];  // the chunk's four k-steps: warpgroup 0's keys, then 1's
#pragma unroll
    for (int kk = 0; kk < 2; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        pa[kk][r] = wg == 0 ? mine[kk][r] : theirs[kk][r];
        pa[2 + kk][r] = wg == 0 ? theirs[kk][r] : mine[kk][r];
      }

    // O = alpha O + P V over this warpgroup's 256 columns. Waited for here: left running into the next chunk, its
    // accumulators' rescaling made ptxas serialise every wgmma (C7515).
#pragma unroll
    for (int n = 0; n < kColumns / 64; ++n)
#pragma unroll
      for (int e = 0; e < 32; ++e) o[n][e] *= alpha[(e / 2) % 2];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kChunkKeys / 16; ++kk)
#pragma unroll
      for (int n = 0; n < kColumns / 64; ++n) {
        const int col = wg * kColumns + 64 * n;
        const uint64_t v_desc = wgmma_descriptor(kt + 2 * kk * kBlockRowsBytes + (col / 8) * 128, kBlockRowsBytes, 128);
        wgmma<kIn, 64, true>(o[n], pa[kk], v_desc, true);
      }
    wgmma_commit_and_wait();
  }
  cp_async_wait<0>();

  // Each row's sum: over the thread's quad, then both warpgroups' keys.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    if (c == 0) xstat[wg * kWgmmaHeads + rows[r]] = l[r];
  }
  __syncthreads();  // (also after the last chunk's reads of the maxima)
#pragma unroll
  for (int r = 0; r < 2; ++r) l[r] = xstat[rows[r]] + xstat[kWgmmaHeads + rows[r]];
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
