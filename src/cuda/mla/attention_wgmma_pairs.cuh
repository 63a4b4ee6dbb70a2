// MLA attention on Hopper's warpgroup mma for 16-bit caches (bf16, f16; sm_90a): one CTA = one query token,
// kWgmmaHeads (64) heads and a range of 64-key chunks, taken two at a time (a pair): three warpgroups. It calls the
// 16-head tile's steps (attention_kernel.cuh): cta_work, copy_queries / stage_queries, key_range, slot_entry,
// store_warpgroup_rows(_staged), the split partials and combine_kernel.
//
// The schedule is FlashMLA's sm90 sparse prefill's ("alternate blocks"), written anew here:
// - warpgroup 2, the producer, gathers the rows of a pair's two chunks by cp.async pieces (8 threads a row, a
//   128-byte line each) straight into two key tiles in wgmma's 128-byte swizzle, each tile in two halves with their
//   own ready and free signals: the left half (dims 0-255, V's columns of warpgroup 0) and the right one (dims
//   256-575, V's other columns and the rope);
// - warpgroup 0 takes the pair's first chunk (tile 0), warpgroup 1 its second (tile 1): each computes its chunk's
//   scores over all dims (m64n64k16, both operands in shared memory) and softmax, so the two score products run on
//   the tensor cores at once;
// - O's 512 columns are split between them (warpgroup w: 256w..256w+255), so each multiplies both chunks' P by its
//   columns of V: its own P from registers, the other's from shared memory. The two agree on each row's maximum
//   first: warpgroup 0 hands its new maximum over, warpgroup 1 takes the larger of that and its own and hands it
//   back, and warpgroup 0 rescales its P and O to it. A half tile is given back as soon as both products that read
//   it are done, so the producer refills it while the rest of the pair is still multiplied.
// Every hand-over is an mbarrier signal of one phase a pair (the consumer waits for the pair's parity): a producer
// of one is never more than a phase ahead of its consumer, as each waits for the other's signal of the pair before.
// With a rope part, warpgroup 0's P for warpgroup 1 lies in its tile's rope slab (tile 0's rope is used by its
// scores only, done by then; the slab is free again once warpgroup 1's product from it is), which keeps the CTA in
// 227 KB.
#pragma once

#include <type_traits>

#include "cuda/mla/attention_kernel.cuh"
#include "cuda/mla/attention_wgmma.h"

namespace smla::cuda::mla::wg {

constexpr int kPairThreads = 384, kPairMathThreads = 256;  // two math warpgroups and the producer
// Named barriers (0 is __syncthreads'): both math warpgroups; warpgroup w's staged output rows: kPairOutputBarrier + w.
constexpr int kPairMathBarrier = 1, kPairOutputBarrier = 2;
constexpr int kLeftSlabs = 4;                              // the left half of a key tile: dims 0-255
constexpr int kProducerParts = 8;                          // the producer's threads a row: a 128-byte line each
constexpr int kProducerRows = kWgmmaChunkKeys * kProducerParts / 128;  // its rows of a chunk per thread
// Registers per thread once the producer has handed its share over (setmaxnreg; multiples of 8): the launch gives
// each of the 384 threads 168 (65536 / 384 rounded down to 8); the math warpgroups hold O's half (128), the scores
// or probabilities (32) and P's A fragments (16), the producer two pairs' rows (ptxas, sm_90a: with P V as four
// m64n64k16 a k-step, 216 / 72 spilled 768 bytes and serialised the wgmmas; with one m64n256k16, 216 / 72 nothing,
// where the producer's 56 had spilled).
constexpr int kPairLaunchRegisters = 168, kPairMathRegisters = 216, kPairProducerRegisters = 72;
static_assert(2 * kPairMathRegisters + kPairProducerRegisters == 3 * kPairLaunchRegisters &&
                  kPairLaunchRegisters * kPairThreads <= 65536,
              "the pairs kernel's registers: the producer gives the math warpgroups what it does not use");

struct PairSignals {
  uint64_t ready[2][2], free[2][2];  // [tile][half]: the producer's copies landed | both products done with them
  uint64_t max[2];                   // warpgroup w's rows' maxima of the pair in shared memory
  uint64_t p[2];                     // warpgroup w's P of the pair in shared memory
  uint64_t valid;                    // the pair's valid flags
};

// Shared memory, in bytes from the start (the tiles 1024-byte aligned): the queries, the two key tiles, the two P
// tiles (64 heads x 64 keys, one swizzled slab each; with a rope part, P 0 is tile 0's rope slab), the rows'
// maxima of each warpgroup, their sums, the pair's valid flags and the signals.
struct PairLayout {
  int tile = 0, q = 0, k = 0, p0 = 0, p1 = 0, max = 0, sum = 0, valid = 0, signals = 0, total = 0;
  __host__ __device__ constexpr explicit PairLayout(int rope) {
    tile = kWgmmaHeads * (kLatent + rope) * 2;
    k = q + tile;
    p1 = k + 2 * tile;
    p0 = rope ? k + (kLatent / 64) * kSwizzledSlabBytes : p1 + kSwizzledSlabBytes;
    max = (rope ? p1 : p0) + kSwizzledSlabBytes;
    sum = max + 2 * kWgmmaHeads * 4;
    valid = sum + 2 * kWgmmaHeads * 4;
    signals = valid + 2 * kWgmmaChunkKeys * 4;
    total = signals + static_cast<int>(sizeof(PairSignals));
  }
};

// kTwoLists: sparse_mla's two caches in one launch (p.extra; key_range), the producer alone telling them apart.
template <CacheFormat F, int kRope, bool kPaged, bool kTwoLists = false>
__global__ void __launch_bounds__(kPairThreads, 1) wgmma_pairs_kernel(const AttentionParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(!is_fp8(F), "16-bit caches");
  static_assert(!(kTwoLists && kPaged), "two key lists are sparse_mla's");
  using T = ComputeT<F>;
  constexpr WgmmaIn kIn = std::is_same_v<T, __half> ? WgmmaIn::f16 : WgmmaIn::bf16;
  using D = HeadDims<kRope>;
  constexpr int kSlabs = D::kQkDim / 64, kKeys = kWgmmaChunkKeys;
  constexpr PairLayout L(kRope);
  constexpr float kNoMax = -1e30f;  // a row's maximum before any valid key: finite, so no inf - inf
  extern __shared__ __align__(1024) uint8_t smem[];
  uint8_t* const sq = smem + L.q;
  // Key tile `chunk` of a pair, and warpgroup w's P tile (arithmetic, not arrays of pointers: those went to the stack).
  const auto tile = [&](int chunk) { return smem + L.k + chunk * L.tile; };
  const auto ptile = [&](int w) { return smem + (w ? L.p1 : L.p0); };
  float* const xmax = reinterpret_cast<float*>(smem + L.max);  // [warpgroup][row]
  float* const xsum = reinterpret_cast<float*>(smem + L.sum);  // [warpgroup][row]
  int* const valid = reinterpret_cast<int*>(smem + L.valid);   // [chunk of the pair][key]
  PairSignals& sig = *reinterpret_cast<PairSignals*>(smem + L.signals);

  // wg through a shuffle: ptxas then knows it uniform in each warp (see attention_wgmma.cuh).
  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid / 128, 0), wtid = tid % 128, lane = tid % 32;
  const int g = lane / 4, c = lane % 4;
  const int rows[2] = {(wtid / 32) * 16 + g, (wtid / 32) * 16 + g + 8};  // a math thread's rows of the tile
  const CtaWork w = cta_work(p, kWgmmaHeads);
  const int t = w.t, h0 = w.h0, nh = w.nh, split = w.split, b = w.b, j = w.j;

  // The queries: copied by the math warpgroups where they are in the compute type, waited for before their first
  // scores, so that the producer's first pair is gathered meanwhile; through registers, converted, otherwise.
  const auto q_offset = [](int row, int piece) { return swizzled_piece_offset(row, piece); };
  const bool q_copied = p.q_is_bf16 == std::is_same_v<T, __nv_bfloat16>;
  if (!q_copied) {
    stage_queries<T, kWgmmaHeads, D::kPieces, kPairThreads>(p, w, sq, tid, q_offset);
    fence_shared_for_async_proxy();
  } else if (wg < 2) {
    copy_queries<kWgmmaHeads, D::kPieces, kPairMathThreads>(p, w, sq, tid, q_offset);
  }
  // Everything from here reads what the kernel before may write (indices, cache) when dsa_decode_step launches
  // this one as the top-k's programmatic dependent; without that launch the wait returns at once.
  wait_for_prerequisites();
  const KeyRange keys = key_range<kPaged, kTwoLists>(p, t, b, j, split, kKeys);
  const ChunkRange range = keys.range;
  const int main_chunks = keys.lists.main_chunks, extra_visible = keys.lists.extra_visible;  // two lists
  const int visible = range.visible, chunk_begin = range.begin, n_chunks = range.count;
  const int pairs = (n_chunks + 1) / 2;  // an odd count's last pair has an empty second chunk
  if (tid == 0) {
    for (int k = 0; k < 2; ++k)
      for (int h = 0; h < 2; ++h) {
        mbarrier_init(&sig.ready[k][h], 128);
        mbarrier_init(&sig.free[k][h], 128);
      }
    for (int k = 0; k < 2; ++k) {
      mbarrier_init(&sig.max[k], 128);
      mbarrier_init(&sig.p[k], 128);
    }
    mbarrier_init(&sig.valid, 128);
  }
  __syncthreads();  // the signals initialised (and converted queries staged)

  if (wg == 2) {  // the producer: rows first + 16 r of each chunk, its 16-byte piece `part` of each slab's line
    registers_decrease_to<kPairProducerRegisters>();
    const int first = wtid / kProducerParts, part = wtid % kProducerParts;
    // A pair's rows: their cache entries (index, or block of the table), loaded a pair ahead so that they land while
    // the pair before is copied; then, once its copies are issued, each row's block and place in it (-1: not read),
    // so that a copy's address is two multiply-adds (a 64-bit division a row in the copies' path made this kernel a
    // third slower); no division of the slot at all for a block table (the entry is the block) or where the blocks
    // lie one after another, as they usually do.
    int entries[2][kProducerRows], blocks[2][kProducerRows], places[2][kProducerRows];
    // Whether chunk `chunk` of pair k is the extra list's (two lists: past the main list's chunks), and its key r.
    const auto from_extra = [&](int k, int chunk) { return kTwoLists && chunk_begin + 2 * k + chunk >= main_chunks; };
    const auto key_of = [&](int k, int chunk, int r) {
      return (chunk_begin + 2 * k + chunk - (from_extra(k, chunk) ? main_chunks : 0)) * kKeys + first + 16 * r;
    };
    const auto load_entries = [&](int k) {
#pragma unroll
      for (int chunk = 0; chunk < 2; ++chunk) {
        const bool extra = from_extra(k, chunk);
#pragma unroll
        for (int r = 0; r < kProducerRows; ++r) {
          const int key = key_of(k, chunk, r);
          entries[chunk][r] = 2 * k + chunk >= n_chunks ? -1
                              : extra ? extra_entry(p, t, key, extra_visible)
                                      : slot_entry<kPaged>(p, t, b, key, visible);
        }
      }
    };
    const auto resolve = [&](int k) {
#pragma unroll
      for (int chunk = 0; chunk < 2; ++chunk)
#pragma unroll
        for (int r = 0; r < kProducerRows; ++r) {
          if constexpr (kPaged) {  // the entry is the block (entry_slot's slot, divided by the block size again)
            const int entry = entries[chunk][r];
            const bool read = block_entry_valid(p, entry);
            blocks[chunk][r] = read ? entry : 0;
            places[chunk][r] = read ? key_of(k, chunk, r) % p.block_size : -1;
          } else {
            const ListCache c = list_cache(p, from_extra(k, chunk));
            const int slot = list_slot(c, entries[chunk][r]);
            // Blocks one after another (the usual cache): the slot is the row's place in the first.
            const bool flat = c.block_stride == static_cast<int64_t>(c.block_size) * c.row_stride;
            const int block = slot < 0 || flat ? 0 : slot / c.block_size;
            blocks[chunk][r] = block;
            places[chunk][r] = slot < 0 ? -1 : slot - block * c.block_size;
          }
        }
    };
    if (pairs > 0) {
      load_entries(0);
      resolve(0);
    }
    for (int k = 0; k < pairs; ++k) {
      if (k + 1 < pairs) load_entries(k + 1);
      const int parity = (k & 1) ^ 1;  // the pair before's release (a fresh barrier's passes at once)
      // In the order the math warpgroups read them: each its own tile's first half (tile 0's left, tile 1's right),
      // then the other halves.
#pragma unroll
      for (int step = 0; step < 4; ++step) {
        const int chunk = step % 2, half = step == 1 || step == 2;
        mbarrier_wait(&sig.free[chunk][half], parity);
        const int begin = half ? kLeftSlabs : 0, end = half ? kSlabs : kLeftSlabs;
        const ListCache c = list_cache(p, from_extra(k, chunk));
#pragma unroll
        for (int r = 0; r < kProducerRows; ++r) {
          const int row = first + 16 * r, place = places[chunk][r];
          const uint8_t* const src =
              c.data + blocks[chunk][r] * c.block_stride + (place < 0 ? 0 : place) * c.row_stride + part * 16;
          uint8_t* const dst = tile(chunk) + swizzled_piece_offset(row, part);  // slab 0's piece; slab s 8 KB on
#pragma unroll
          for (int slab = begin; slab < end; ++slab)
            cp_async_16(dst + slab * kSwizzledSlabBytes, src + slab * 128, place >= 0);
        }
        cp_async_arrive(&sig.ready[chunk][half]);
      }
      if (part == 0)  // the last free signal waited for came after both warpgroups' use of the pair before's flags
#pragma unroll
        for (int chunk = 0; chunk < 2; ++chunk)
#pragma unroll
          for (int r = 0; r < kProducerRows; ++r) valid[chunk * kKeys + first + 16 * r] = places[chunk][r] >= 0;
      mbarrier_arrive(&sig.valid);
      if (k + 1 < pairs) resolve(k + 1);
    }
    return;  // every copy it issued is waited for by the math warpgroups
  }
  registers_increase_to<kPairMathRegisters>();
  if (q_copied) {  // every math thread's query copies landed, visible to wgmma
    cp_async_wait<0>();
    fence_shared_for_async_proxy();
    named_barrier_sync(kPairMathBarrier, kPairMathThreads);
  }

  const uint64_t q_desc = wgmma_descriptor_swizzled(sq);
  const uint64_t k_desc[2] = {wgmma_descriptor_swizzled(tile(0)), wgmma_descriptor_swizzled(tile(1))};
  const auto acquire = [&](int chunk, int half, int k) {
    mbarrier_wait(&sig.ready[chunk][half], k & 1);
    fence_shared_for_async_proxy();  // cp.async wrote the tile as ordinary stores
  };
  // O's columns 256 wg + 8jj + 2c (+1) of rows[0] (elements 4jj, 4jj + 1) and rows[1] (4jj + 2, + 3).
  float o[128];
#pragma unroll
  for (int e = 0; e < 128; ++e) o[e] = 0.f;
  float m[2] = {kNoMax, kNoMax}, l[2] = {0.f, 0.f};  // l: this thread's share of its rows' sums
  float s[32];  // scores, then probabilities: s[4jj + e] row rows[e / 2], key 8jj + 2c + e % 2
  uint32_t pa[4][4];  // P as the A fragments of the chunk's four 16-key k-steps

  // Scale and mask the chunk's scores; each row's maximum among them.
  const auto masked_max = [&](const int* vmask, float (&cmax)[2]) {
    cmax[0] = cmax[1] = -INFINITY;
#pragma unroll
    for (int jj = 0; jj < 8; ++jj)
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
    }
  };
  // The rows' new maxima: O and the sums rescaled to them, the probabilities and their A fragments.
  const auto exponentiate = [&](const float (&m_new)[2]) {
    const float alpha[2] = {exp2f(m[0] - m_new[0]), exp2f(m[1] - m_new[1])};
    if (warp_rows_moved(alpha)) scale_rows(o, alpha);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      m[r] = m_new[r];
      l[r] *= alpha[r];
    }
#pragma unroll
    for (int e = 0; e < 32; ++e) {
      s[e] = exp2f(s[e] - m[(e / 2) % 2]);
      l[(e / 2) % 2] += s[e];
    }
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) pa[kk][r] = pack2<T>(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
  };
  // P's fragments into this warpgroup's P tile (K-major, swizzled: fragment r of k-step kk is row rows[r % 2], keys
  // 16kk + 8(r / 2) + 2c, + 1), for the other warpgroup's product.
  const auto hand_over_p = [&]() {
    uint8_t* const dst = ptile(wg);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r)
        *reinterpret_cast<uint32_t*>(dst + rows[r % 2] * 128 + (((2 * kk + r / 2) ^ g) << 4) + 4 * c) = pa[kk][r];
    fence_shared_for_async_proxy();
    mbarrier_arrive(&sig.p[wg]);
  };
  // O += P V over this warpgroup's columns of key tile `chunk` (slabs 4 wg.. 4 wg + 3, one m64n256k16 a 16-key
  // k-step): P from registers, or (kShared) the other warpgroup's P tile. Issued and committed, not waited for.
  const auto multiply_pv = [&](int chunk, auto shared) {
    constexpr bool kShared = decltype(shared)::value;
    wgmma_fence();
    const uint64_t p_desc = wgmma_descriptor_swizzled(ptile(chunk));
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {  // keys 16kk.. from line 16kk of each slab
      const uint64_t v_desc =
          wgmma_descriptor_swizzled(tile(chunk) + 4 * wg * kSwizzledSlabBytes + 16 * kk * 128, kSwizzledSlabBytes);
      wgmma_n256_mn_major_b<kIn, kShared>(o, pa[kk], p_desc + 2 * kk, v_desc, true);
    }
    wgmma_commit();
  };
  using FromRegisters = std::false_type;
  using FromShared = std::true_type;

  if (wg == 0) {
    if (pairs > 0) {
      acquire(0, 0, 0);
      wgmma_fence();
      swizzled_scores<kIn, 0, kLeftSlabs>(s, q_desc, k_desc[0], false);
      acquire(0, 1, 0);
      swizzled_scores<kIn, kLeftSlabs, kSlabs>(s, q_desc, k_desc[0], true);
      wgmma_commit_and_wait();
    }
    for (int k = 0; k < pairs; ++k) {
      const int parity = k & 1;
      mbarrier_wait(&sig.valid, parity);
      float cmax[2];
      masked_max(valid, cmax);
      const float m_new[2] = {fmaxf(m[0], cmax[0]), fmaxf(m[1], cmax[1])};
      exponentiate(m_new);
      if (c == 0)
#pragma unroll
        for (int r = 0; r < 2; ++r) xmax[rows[r]] = m[r];
      mbarrier_arrive(&sig.max[0]);
      multiply_pv(0, FromRegisters{});
      wgmma_wait();
      mbarrier_arrive(&sig.free[0][0]);
      // Warpgroup 1's maxima, the pair's: P and O rescaled to them; P to warpgroup 1.
      mbarrier_wait(&sig.max[1], parity);
      float beta[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float m_pair = xmax[kWgmmaHeads + rows[r]];
        beta[r] = exp2f(m[r] - m_pair);
        m[r] = m_pair;
        l[r] *= beta[r];
      }
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r)
          pa[kk][r] = pack2<T>(s[8 * kk + 2 * r] * beta[r % 2], s[8 * kk + 2 * r + 1] * beta[r % 2]);
      hand_over_p();
      if (warp_rows_moved(beta)) scale_rows(o, beta);
      mbarrier_wait(&sig.p[1], parity);
      multiply_pv(1, FromShared{});
      wgmma_wait();  // tile 1's left half given back before the wait for the next pair's rows
      mbarrier_arrive(&sig.free[1][0]);
      if (k + 1 < pairs) {
        acquire(0, 0, k + 1);
        wgmma_fence();
        swizzled_scores<kIn, 0, kLeftSlabs>(s, q_desc, k_desc[0], false);
        acquire(0, 1, k + 1);
        swizzled_scores<kIn, kLeftSlabs, kSlabs>(s, q_desc, k_desc[0], true);
        wgmma_commit_and_wait();
      }
    }
  } else {
    for (int k = 0; k < pairs; ++k) {
      const int parity = k & 1;
      acquire(1, 1, k);
      wgmma_fence();
      swizzled_scores<kIn, kLeftSlabs, kSlabs>(s, q_desc, k_desc[1], false);
      acquire(1, 0, k);
      swizzled_scores<kIn, 0, kLeftSlabs>(s, q_desc, k_desc[1], true);
      wgmma_commit_and_wait();
      mbarrier_wait(&sig.valid, parity);
      float cmax[2];
      masked_max(valid + kKeys, cmax);
      // The pair's maxima: warpgroup 0's new ones (never below this warpgroup's old) and this chunk's.
      mbarrier_wait(&sig.max[0], parity);
      const float m_new[2] = {fmaxf(xmax[rows[0]], cmax[0]), fmaxf(xmax[rows[1]], cmax[1])};
      exponentiate(m_new);
      if (c == 0)
#pragma unroll
        for (int r = 0; r < 2; ++r) xmax[kWgmmaHeads + rows[r]] = m[r];
      mbarrier_arrive(&sig.max[1]);
      multiply_pv(1, FromRegisters{});
      hand_over_p();
      wgmma_wait();  // tile 1's right half given back before the wait for warpgroup 0's P: refilled sooner
      mbarrier_arrive(&sig.free[1][1]);
      mbarrier_wait(&sig.p[0], parity);
      multiply_pv(0, FromShared{});
      wgmma_wait();
      mbarrier_arrive(&sig.free[0][1]);
    }
  }

  // Each row's sum over both warpgroups' keys (over the thread's quad, then the other warpgroup's).
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    if (c == 0) xsum[wg * kWgmmaHeads + rows[r]] = l[r];
  }
  named_barrier_sync(kPairMathBarrier, kPairMathThreads);
  float l_row[2], m_row[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_row[r] = xsum[rows[r]] + xsum[kWgmmaHeads + rows[r]];
    m_row[r] = l_row[r] > 0.f ? m[r] : -INFINITY;
  }
  if (p.early_combine) let_dependents_launch();  // the combine: placed while the partials are written

  // The key tiles are free (every product waited for, every copy landed): warpgroup w's rows staged in tile w.
  static_assert(kStagedRowsBytes <= L.tile, "a warpgroup's output rows fit in a key tile");
  if (stores_staged(p))
    store_warpgroup_rows_staged(p, [&](int i) { return o[i]; }, rows, nh, t, b, j, h0, 256 * wg, m_row, l_row,
                                wg == 0 && c == 0, tile(wg), wtid, kPairOutputBarrier + wg);
  else
    store_warpgroup_rows(p, [&](int i) { return o[i]; }, rows, nh, t, b, j, split, h0, 256 * wg + 2 * c, m_row, l_row,
                         wg == 0 && c == 0);
#else
  __trap();  // sm_90a only: the host never launches it elsewhere
#endif
}

}  // namespace smla::cuda::mla::wg
