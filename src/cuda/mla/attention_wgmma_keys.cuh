// MLA attention on Hopper's warpgroup mma for few heads (8, 16 or 32 a CTA) over fp8_ds_mla caches (sm_90a; issue
// 16's memory-bound decode: GLM-5 under TP 8 runs 8 heads, DeepSeek-V3.2 16, under TP 4 32). The keys go on wgmma's
// M side and the heads on N (S^T = K Q^T, O^T = V^T P^T), so 8 heads fill an m64n8 tile with nothing padded, and O^T
// (512 dims x 16 heads at most) is 32 or 64 accumulator registers a thread of a math warpgroup, where the small-heads
// kernel's warps hold 128 each and so run two a scheduler.
//
// One CTA = one query token, kHeads heads and a range of 64-key chunks; three warpgroups (four for 32 heads: two math
// warpgroups of 16 heads each, sharing the key tile):
// - the last two warpgroups (the producers) gather each chunk's rows by bulk copies (one a row, the first producer
//   warpgroup's first 64 threads) into keys_stages staging buffers, and dequantise a landed chunk into the one key
//   tile (bf16 times each 128-dim tile's scale, wgmma's 128-byte swizzle: dequantise_chunk as the staged wgmma kernel
//   writes it), then reuse its staging buffer for the chunk keys_stages on;
// - warpgroup 0 (math; 0 and 1 for 32 heads) computes the chunk's scores S^T (64 keys x its heads, both operands in
//   shared memory), the chunk's maxima over its four warps (one named barrier), P^T into shared memory (bf16,
//   K-major), and O^T += V^T P^T with the key tile as A, transposed (its lines hold 64 dims of one key).
// The key tile is single (a second does not fit beside the staging buffers with 576-wide heads), in two halves that
// take turns apart (tile_full / tile_empty mbarriers per half): dims 0-255 (slabs 0-3) and the rest (slabs 4 on, the
// rope's included). So the producers dequantise the next chunk's first half while P V of this chunk's second half
// runs, and its second half while the next scores' first half run; keys_stages chunks' rows are in flight (three;
// two for 32 heads, whose queries take the third's room).
#pragma once

#include "cuda/mla/attention_kernel.cuh"
#include "cuda/mla/attention_wgmma.h"

namespace smla::cuda::mla::wg {

constexpr int kKeysChunk = 64;  // wgmma's M
constexpr int kKeysGatherWarps = kKeysChunk / 32;
constexpr int kKeysMathHeads = 16;  // the most heads of one math warpgroup
// A `heads`-head CTA's math warpgroups, staging buffers (chunks in flight) and threads (two producer warpgroups).
__host__ __device__ constexpr int keys_math_groups(int heads) { return heads > kKeysMathHeads ? 2 : 1; }
__host__ __device__ constexpr int keys_stages(int heads) { return heads > kKeysMathHeads ? 2 : 3; }
__host__ __device__ constexpr int keys_threads(int heads) { return (keys_math_groups(heads) + 2) * 128; }

// Shared memory, in bytes (the swizzled tiles 1024-byte aligned): the queries (kHeads rows, slabs of 64 dims), the
// key tile (64 rows), the staging buffers, P^T (kHeads rows of 64 keys, each math warpgroup's 8 or 16 in turn), the
// warps' per-head maxima and sums (per math warpgroup), the tile's valid flags and the staging buffers' (per
// buffer), the mbarriers.
constexpr int kKeysHalfSlabs = 4;  // the key tile's first half: slabs 0-3 (dequantise_chunk's units 0-15)
struct KeysLayout {
  int q = 0, k = 0, staging = 0, p = 0, stats = 0, tile_valid = 0, valid = 0, signals = 0, total = 0;
  __host__ __device__ constexpr KeysLayout(CacheFormat f, int rope, int heads) {
    const int dims = kLatent + rope;
    k = q + heads * dims * 2;
    staging = k + kKeysChunk * dims * 2;
    p = staging + keys_stages(heads) * kKeysChunk * staged_row_bytes(f, rope);
    stats = p + heads * 128;
    tile_valid = stats + 2 * 4 * heads * 4;
    valid = tile_valid + kKeysChunk * 4;
    signals = valid + keys_stages(heads) * kKeysChunk * 4;
    total = signals + (keys_stages(heads) + 4) * 8;
  }
};

enum KeysBarrier : int { kProducerWarps = 1, kMathWarps };  // kMathWarps + w: math warpgroup w's

template <CacheFormat F, int kRope, bool kPaged, int kHeads>
__global__ void __launch_bounds__(keys_threads(kHeads), 1) wgmma_keys_kernel(const AttentionParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(F == CacheFormat::fp8_ds_mla, "fp8_ds_mla caches");
  static_assert(kHeads == 8 || kHeads == 16 || kHeads == 32, "8 or 16 heads on wgmma's N, or two warpgroups of 16");
  using T = ComputeT<F>;
  constexpr WgmmaIn kIn = std::is_same_v<T, __half> ? WgmmaIn::f16 : WgmmaIn::bf16;
  using D = HeadDims<kRope>;
  constexpr int kMathGroups = keys_math_groups(kHeads), kStages = keys_stages(kHeads), kThreads = keys_threads(kHeads);
  constexpr int kWgHeads = kHeads / kMathGroups;  // a math warpgroup's: wgmma's N
  constexpr int kSlabs = D::kQkDim / 64, kHeadsPerThread = kWgHeads / 4, kAcc = kWgHeads / 2;
  constexpr KeysLayout L(F, kRope, kHeads);
  constexpr int kStagedBytes = staged_row_bytes(F, kRope), kStageBytes = kKeysChunk * kStagedBytes;
  static_assert(L.q % 1024 == 0 && L.k % 1024 == 0 && L.p % 1024 == 0, "the swizzled tiles' atoms");
  extern __shared__ __align__(1024) uint8_t smem[];
  uint8_t* const sq = smem + L.q;
  uint8_t* const sk = smem + L.k;
  uint8_t* const staging = smem + L.staging;
  uint8_t* const sp = smem + L.p;
  float* const stats = reinterpret_cast<float*>(smem + L.stats);  // per math warpgroup [warp][head] maxima, sums
  int* const tile_valid = reinterpret_cast<int*>(smem + L.tile_valid);
  int* const valid = reinterpret_cast<int*>(smem + L.valid);  // [stage][row]
  uint64_t* const staged = reinterpret_cast<uint64_t*>(smem + L.signals);
  uint64_t* const tile_full = staged + kStages;  // [half]
  uint64_t* const tile_empty = tile_full + 2;        // [half]

  // wg through a shuffle: ptxas then knows it uniform in each warp (see the staged kernel).
  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid / 128, 0), wtid = tid % 128, lane = tid % 32;
  const int warp = wtid / 32, g = lane / 4, c = lane % 4;
  const CtaWork w = cta_work(p, kHeads);
  const int t = w.t, h0 = w.h0, nh = w.nh, split = w.split, b = w.b, j = w.j;

  // The queries: kHeads rows of K-major B, slabs of kHeads lines (8-line groups 1024 bytes apart).
  stage_queries<T, kHeads, D::kPieces, kThreads>(p, w, sq, tid, [](int row, int piece) {
    return (piece / 8) * (kHeads * 128) + row * 128 + ((piece % 8) ^ (row % 8)) * 16;
  });
  fence_shared_for_async_proxy();
  // Everything from here reads what the kernel before may write (indices, cache) when dsa_decode_step launches
  // this one as the top-k's programmatic dependent; without that launch the wait returns at once.
  wait_for_prerequisites();
  const KeyRange keys = key_range<kPaged, false>(p, t, b, j, split, kKeysChunk);
  const ChunkRange range = keys.range;
  const int visible = range.visible, chunk_begin = range.begin, n_chunks = range.count;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) mbarrier_init(staged + s, kKeysGatherWarps);
    for (int half = 0; half < 2; ++half) {
      mbarrier_init(tile_full + half, 1);
      mbarrier_init(tile_empty + half, 128 * kMathGroups);
    }
    fence_mbarrier_init();
  }
  __syncthreads();  // the signals initialised, the queries staged

  // 32 heads: 512 threads start at 128 registers; the producers need fewer, the math warpgroups more (16 heads
  // each).
  constexpr int kProducerRegisters = 96, kMathRegisters = 65536 / 256 - kProducerRegisters;
  static_assert(kMathGroups == 1 || (kThreads == 512 && (kProducerRegisters + kMathRegisters) * 256 <= 65536 &&
                                     kMathRegisters % 8 == 0 && kMathRegisters <= 256),
                "the register pool of two producer and two math warpgroups, 128 registers a thread at launch");
  if (wg >= kMathGroups) {
    if constexpr (kMathGroups == 2) registers_decrease_to<kProducerRegisters>();
    // Producers. Thread ptid < 64 of the first producer warpgroup gathers row ptid of every chunk.
    const int ptid = tid - 128 * kMathGroups;
    const bool gathers = ptid < kKeysChunk;  // warp-uniform
    int64_t next_slot = gathers && n_chunks > 0
                            ? chunk_slot<kPaged, false, kKeysChunk>(p, t, b, chunk_begin, ptid, visible, keys.lists)
                            : -1;
    auto issue = [&](int i) {  // chunk i, if it exists, into staging buffer i % kStages
      if (i >= n_chunks || !gathers) return;
      const int chunk = chunk_begin + i, stage = i % kStages;
      const int64_t slot = next_slot;
      if (i + 1 < n_chunks) next_slot = slot_of<kPaged>(p, t, b, (chunk + 1) * kKeysChunk + ptid, visible);
      bulk_gather_row<kStagedBytes>(p, slot, staging + stage * kStageBytes + ptid * kStagedBytes,
                                    valid + stage * kKeysChunk + ptid, staged + stage);
    };
    for (int i = 0; i < kStages; ++i) issue(i);
    constexpr int kHalfUnits = kKeysHalfSlabs * 64 / 16;  // dequantise_chunk's 16-code units in the first half
    for (int i = 0; i < n_chunks; ++i) {
      const int stage = i % kStages;
      const uint8_t* const rows = staging + stage * kStageBytes;
      mbarrier_wait(staged + stage, (i / kStages) & 1);
      const int row = ptid % kKeysChunk;
      const bool invalid = !valid[stage * kKeysChunk + row];
      // Each half once the chunk before's products are done with it, then handed over.
      if (i > 0) mbarrier_wait(tile_empty, (i - 1) & 1);
      dequantise_chunk<F, T, kRope, 2 * 128, kKeysChunk, true, 0, kHalfUnits>(rows, reinterpret_cast<T*>(sk), ptid,
                                                                              invalid);
      fence_shared_for_async_proxy();
      named_barrier_sync(kProducerWarps, 2 * 128);  // the first half written
      if (ptid == 0) mbarrier_arrive(tile_full);
      if (i > 0) mbarrier_wait(tile_empty + 1, (i - 1) & 1);
      dequantise_chunk<F, T, kRope, 2 * 128, kKeysChunk, true, kHalfUnits>(rows, reinterpret_cast<T*>(sk), ptid,
                                                                           invalid);
      if (ptid < kKeysChunk) tile_valid[row] = !invalid;
      fence_shared_for_async_proxy();
      named_barrier_sync(kProducerWarps, 2 * 128);  // the second half written; the staging buffer read
      if (ptid == 0) mbarrier_arrive(tile_full + 1);
      issue(i + kStages);
    }
  } else {
    if constexpr (kMathGroups == 2) registers_increase_to<kMathRegisters>();
    // Math warpgroup wg: the CTA's heads wg kWgHeads on. Thread (warp, g, c) holds keys (and in O^T dims) 16 warp +
    // g, + 8 of each tile, and its warpgroup's heads 8 jn + 2c + e (jn < kWgHeads / 8, e < 2): head index hi = 2 jn
    // + e of its kHeadsPerThread.
    auto head_of = [&](int hi) { return 8 * (hi / 2) + 2 * c + hi % 2; };
    const int head0 = wg * kWgHeads, barrier = kMathGroups == 1 ? kMathWarps : kMathWarps + wg;
    float* const wmax = stats + wg * 8 * kWgHeads;  // [warp][head], then the sums [warp][head]
    uint8_t* const wp = sp + head0 * 128;           // this warpgroup's P^T
    float o[kVDim / 64][kAcc];
#pragma unroll
    for (int mt = 0; mt < kVDim / 64; ++mt)
#pragma unroll
      for (int e = 0; e < kAcc; ++e) o[mt][e] = 0.f;
    float m[kHeadsPerThread], l[kHeadsPerThread];
#pragma unroll
    for (int hi = 0; hi < kHeadsPerThread; ++hi) m[hi] = -INFINITY, l[hi] = 0.f;
    const uint64_t k_desc = wgmma_descriptor_swizzled(sk), q_desc = wgmma_descriptor_swizzled(sq + head0 * 128);
    const uint64_t p_desc = wgmma_descriptor_swizzled(wp);
    const int r0 = 16 * warp + g;
    // Scores over slabs [begin, end) into two accumulator sets by slab parity (two dependent chains, not one).
    auto scores = [&](float (&acc)[2][kAcc], int begin, int end) {
      wgmma_fence();
#pragma unroll
      for (int slab = begin; slab < end; ++slab)
#pragma unroll
        for (int ks = 0; ks < 4; ++ks)
          wgmma_ss_narrow<kIn, kWgHeads, false>(acc[slab % 2], k_desc + slab * (kSwizzledSlabBytes >> 4) + ks * 2,
                                              q_desc + slab * (kHeads * 128 >> 4) + ks * 2, slab >= 2 || ks > 0);
      wgmma_commit();
    };
    for (int i = 0; i < n_chunks; ++i) {
      float acc[2][kAcc];
      mbarrier_wait(tile_full, i & 1);
      scores(acc, 0, kKeysHalfSlabs);
      mbarrier_wait(tile_full + 1, i & 1);
      scores(acc, kKeysHalfSlabs, kSlabs);
      wgmma_wait();
      float s[kAcc];
#pragma unroll
      for (int e = 0; e < kAcc; ++e) s[e] = acc[0][e] + acc[1][e];

      // s[4jn + e]: key r0 + 8 (e / 2), head 8jn + 2c + e % 2.
      const bool valid0 = tile_valid[r0], valid1 = tile_valid[r0 + 8];
      float cmax[kHeadsPerThread];
#pragma unroll
      for (int hi = 0; hi < kHeadsPerThread; ++hi) {
        float& v0 = s[4 * (hi / 2) + hi % 2];
        float& v1 = s[4 * (hi / 2) + 2 + hi % 2];
        v0 = valid0 ? v0 * p.scale_log2 : -INFINITY;
        v1 = valid1 ? v1 * p.scale_log2 : -INFINITY;
        cmax[hi] = fmaxf(v0, v1);
#pragma unroll
        for (int x = 4; x < 32; x *= 2) cmax[hi] = fmaxf(cmax[hi], __shfl_xor_sync(0xffffffffu, cmax[hi], x));
        if (g == 0) wmax[warp * kWgHeads + head_of(hi)] = cmax[hi];
      }
      named_barrier_sync(barrier, 128);  // the warps' maxima
      float alpha[kHeadsPerThread], base[kHeadsPerThread];
#pragma unroll
      for (int hi = 0; hi < kHeadsPerThread; ++hi) {
        const int h = head_of(hi);
        const float cm =
            fmaxf(fmaxf(wmax[h], wmax[kWgHeads + h]), fmaxf(wmax[2 * kWgHeads + h], wmax[3 * kWgHeads + h]));
        const float m_new = fmaxf(m[hi], cm);
        base[hi] = m_new == -INFINITY ? 0.f : m_new;  // a head with nothing valid yet stays at zero
        alpha[hi] = exp2f(m[hi] - base[hi]);
        m[hi] = m_new;
        l[hi] *= alpha[hi];
      }
      // P^T (kHeads lines of the chunk's 64 keys, K-major B in the 128-byte swizzle).
#pragma unroll
      for (int hi = 0; hi < kHeadsPerThread; ++hi) {
        const int h = head_of(hi);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const float pv = exp2f(s[4 * (hi / 2) + 2 * half + hi % 2] - base[hi]);
          l[hi] += pv;
          const int key = r0 + 8 * half;
          *reinterpret_cast<T*>(wp + h * 128 + (((key / 8) ^ (h % 8)) * 16) + (key % 8) * 2) = from_float<T>(pv);
        }
      }
      fence_shared_for_async_proxy();
      named_barrier_sync(barrier, 128);  // P^T written (and the maxima read)
      bool moved = false;
#pragma unroll
      for (int hi = 0; hi < kHeadsPerThread; ++hi) moved |= alpha[hi] != 1.f;
      if (__any_sync(0xffffffffu, moved))
#pragma unroll
        for (int mt = 0; mt < kVDim / 64; ++mt)
#pragma unroll
          for (int e = 0; e < kAcc; ++e) o[mt][e] *= alpha[2 * (e / 4) + e % 2];
      // P V by halves of the tile: each half handed back as its products are done.
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kKeysChunk / 16; ++kk)
#pragma unroll
          for (int mt = half * kKeysHalfSlabs; mt < (half + 1) * kKeysHalfSlabs; ++mt)
            wgmma_ss_narrow<kIn, kWgHeads, true>(o[mt], k_desc + (mt * kSwizzledSlabBytes + kk * 16 * 128 >> 4),
                                               p_desc + kk * 2, true);
        wgmma_commit();
      }
      wgmma_wait_until<1>();
      mbarrier_arrive(tile_empty);
      wgmma_wait();
      mbarrier_arrive(tile_empty + 1);
    }

    // Each head's sum over the warps; its output row normalised, through shared memory (the staging buffers: every
    // chunk dequantised) so that a row's 512 dims are stored by the warpgroup's 128 threads together.
    float* const lsum = wmax + 4 * kWgHeads;
#pragma unroll
    for (int hi = 0; hi < kHeadsPerThread; ++hi) {
#pragma unroll
      for (int x = 4; x < 32; x *= 2) l[hi] += __shfl_xor_sync(0xffffffffu, l[hi], x);
      if (g == 0) lsum[warp * kWgHeads + head_of(hi)] = l[hi];
    }
    named_barrier_sync(barrier, 128);
    constexpr int kPitch = kVDim + 4;  // floats a row: a quad's heads in different banks
    static_assert(kHeads * kPitch * 4 <= kStages * kStageBytes, "the output rows fit in the staging buffers");
    float* const rows = reinterpret_cast<float*>(staging);
#pragma unroll
    for (int hi = 0; hi < kHeadsPerThread; ++hi) {
      const int h = head0 + head_of(hi);
      const float lt =
          lsum[h - head0] + lsum[kWgHeads + h - head0] + lsum[2 * kWgHeads + h - head0] + lsum[3 * kWgHeads + h - head0];
      const float scale = h < nh ? finish_head_row(p, t, b, j, split, h0 + h, m[hi], lt, warp == 0 && g == 0) : 0.f;
#pragma unroll
      for (int mt = 0; mt < kVDim / 64; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half)
          rows[h * kPitch + 64 * mt + r0 + 8 * half] = o[mt][4 * (hi / 2) + 2 * half + hi % 2] * scale;
    }
    named_barrier_sync(barrier, 128);
    for (int h = head0; h < min(nh, head0 + kWgHeads); ++h) {
      const float4 v = *reinterpret_cast<const float4*>(rows + h * kPitch + 4 * wtid);
      if (p.num_splits == 1) {
        uint32_t* const out = reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(p.out) + out_row_offset(p, b, j, h0 + h) +
                                                          4 * wtid);
        out[0] = p.q_is_bf16 ? pack2<__nv_bfloat16>(v.x, v.y) : pack2<__half>(v.x, v.y);
        out[1] = p.q_is_bf16 ? pack2<__nv_bfloat16>(v.z, v.w) : pack2<__half>(v.z, v.w);
      } else {
        *reinterpret_cast<float4*>(partial_row(p, t, split, h0 + h) + 4 * wtid) = v;
      }
    }
  }
  if (p.early_combine) let_dependents_launch();
#else
  __trap();  // sm_90a only: the host never launches it elsewhere
#endif
}

}  // namespace smla::cuda::mla::wg
