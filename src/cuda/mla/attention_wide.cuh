// MLA attention for many heads on tensor cores (mma.sync, SM80+; issue 19's compute-bound shapes: 64-128 heads,
// prefill): one CTA = one query token, kWideHeads (64) heads and a range of 32-key chunks, 8 warps. Each gathered
// row (and each fp8 dequantisation) feeds all 64 heads, against 16 in the 16-head-tile kernel
// (attention_kernel.cuh), whose steps it calls: gather_row, dequantise_chunk, chunk_range, store_head_row, the
// split partials and combine_kernel. The queries stay in shared memory (64 x 584 16-bit values, 75 KB).
//
// Warp w is (head half w / 4, quarter w % 4). Scores: each warp computes its 32 heads x 32 keys over its quarter
// of the query dims (per 16 dims two A and two B ldmatrix feed 8 mma); the quarters' partials meet in the fp32
// online softmax (log2 domain, 4 threads per head row). P V: each warp owns its 32 heads x its quarter's 128 output
// columns (128 fp32 accumulators a thread). Heads past num_heads are zero queries, never stored.
#pragma once

#include "cuda/mla/attention_kernel.cuh"
#include "cuda/mla/attention_wide.h"

namespace smla::cuda::mla::wide {

constexpr int kWarps = 8, kWideThreads = kWarps * 32;
constexpr int kWarpHeads = 32;                           // two mma row tiles
constexpr int kQuarters = kWarps * kWarpHeads / kWideHeads;  // warps per head half: dims (scores), columns (P V)
constexpr int kRowThreads = kWideThreads / kWideHeads;   // softmax: threads per head row
constexpr int kRowKeys = kKeysPerChunk / kRowThreads;    // and keys per thread
constexpr int kGatherParts = kWideThreads / kKeysPerChunk;  // threads per gathered row
static_assert(kQuarters == 4 && kVDim / kQuarters == 128, "a warp's P V columns are 16 n-tiles (store_head_row)");
static_assert(kRowKeys == 8, "a thread's probabilities are one 16-byte store");

// Shared memory, in bytes from the start (all offsets 16-byte aligned): the queries, the key buffers (16-bit
// caches: `stages`; fp8: one, plus `stages` staging buffers), the quarters' partial scores, P, the row statistics
// and the chunks' valid flags.
struct WideLayout {
  int q = 0, k = 0, staging = 0, s = 0, p = 0, stats = 0, valid = 0, valid_sets = 0, total = 0;
  __host__ __device__ constexpr WideLayout(CacheFormat f, int stages, int rope) {
    const bool fp8 = is_fp8(f);
    const int row_bytes = row_elems(rope) * 2;
    k = q + kWideHeads * row_bytes;
    staging = k + (fp8 ? 1 : stages) * kKeysPerChunk * row_bytes;
    s = staging + (fp8 ? stages * kKeysPerChunk * staged_row_bytes(f, rope) : 0);
    p = s + kQuarters * kWideHeads * kSRow * 4;
    stats = p + kWideHeads * kPRow * 2;
    valid = stats + 3 * kWideHeads * 4;
    valid_sets = chunks_in_flight(f, stages) + 1;  // the chunk in use and those in flight
    total = valid + valid_sets * kKeysPerChunk * 4;
  }
};

template <CacheFormat F, int kRope, bool kPaged, int kStages>
__global__ void __launch_bounds__(kWideThreads, 1) wide_attention_kernel(const AttentionParams p) {
  using T = ComputeT<F>;
  using D = HeadDims<kRope>;
  constexpr int kRowElems = D::kRowElems, kPieces = D::kPieces, kDims = D::kDimsPerWarp;  // kDims: a quarter's
  constexpr bool kFp8 = is_fp8(F);
  static_assert(F != CacheFormat::fp8_ds_mla_v4 || kRope == 0, "fp8_ds_mla_v4 holds 512-wide heads");
  constexpr int kFp8RowBytes = kFp8 ? staged_row_bytes(F, kRope) : 0;
  constexpr WideLayout L(F, kStages, kRope);
  extern __shared__ __align__(16) uint8_t smem[];
  T* sq = reinterpret_cast<T*>(smem + L.q);
  T* sk = reinterpret_cast<T*>(smem + L.k);
  float* ss = reinterpret_cast<float*>(smem + L.s);
  T* sp = reinterpret_cast<T*>(smem + L.p);
  float* row_max = reinterpret_cast<float*>(smem + L.stats);
  float* row_sum = row_max + kWideHeads;
  float* row_alpha = row_sum + kWideHeads;
  int* valid = reinterpret_cast<int*>(smem + L.valid);

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int half = warp / kQuarters, quarter = warp % kQuarters;
  const CtaWork w = cta_work(p, kWideHeads);
  const int t = w.t, h0 = w.h0, nh = w.nh, split = w.split, b = w.b, j = w.j;

  // The queries into shared memory, rows kRowElems apart.
  stage_queries<T, kWideHeads, kPieces, kWideThreads>(p, w, reinterpret_cast<uint8_t*>(sq), tid,
                                                      [](int row, int piece) { return (row * kRowElems + piece * 8) * 2; });
  if (tid < kWideHeads) {
    row_max[tid] = -INFINITY;
    row_sum[tid] = 0.f;
  }
  // Everything from here reads what the kernel before may write (indices, cache) when dsa_decode_step launches
  // this one as the top-k's programmatic dependent; without that launch the wait returns at once.
  wait_for_prerequisites();
  const ChunkRange range = chunk_range<kPaged>(p, t, b, j, split, kKeysPerChunk);
  const int visible = range.visible, chunk_begin = range.begin, n_chunks = range.count;

  // This thread's row of every chunk, its pieces my_part + kGatherParts k.
  const GatherLane gl = gather_lane<kGatherParts>(tid);
  const int my_row = gl.row, my_part = gl.part;
  int64_t next_slot = n_chunks > 0 ? slot_of<kPaged>(p, t, b, chunk_begin * kKeysPerChunk + my_row, visible) : -1;

  // Chunk c lives in buffer c % kStages (key buffers, or fp8 staging).
  constexpr int kAhead = chunks_in_flight(F, kStages);
  constexpr int kBufBytes = kFp8 ? kKeysPerChunk * kFp8RowBytes : kKeysPerChunk * kRowElems * 2;
  uint8_t* const bufs = smem + (kFp8 ? L.staging : L.k);
  auto issue = [&](int i) {  // chunk i of this split, if it exists
    if (i < n_chunks)
      gather_row<F, kPaged, kGatherParts>(p, t, b, visible, chunk_begin + i, chunk_begin, n_chunks, my_row, my_part,
                                          next_slot, bufs + (i % kStages) * kBufBytes,
                                          kFp8 ? kFp8RowBytes : kRowElems * 2, kFp8 ? kFp8RowBytes / 16 : kPieces,
                                          valid, L.valid_sets);
    cp_async_commit();  // empty groups keep the wait counts uniform
  };
#pragma unroll
  for (int i = 0; i < kAhead; ++i) issue(i);

  const int g = lane / 4;
  const int my_heads = half * kWarpHeads;  // this warp's first row of the tile
  float o[2][16][4];  // this warp's 128 output columns of its rows my_heads + 16m + g and + 8
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int n = 0; n < 16; ++n) o[m][n][0] = o[m][n][1] = o[m][n][2] = o[m][n][3] = 0.f;

  // The loop's first barrier also orders the queries' stores and the statistics' initial values before any use.
  for (int i = 0; i < n_chunks; ++i) {
    cp_async_wait<kAhead - 1>();
    __syncthreads();  // chunk i has landed; every warp is done with chunk i-1
    const int* vmask = valid + ((chunk_begin + i) % L.valid_sets) * kKeysPerChunk;
    const T* kt;  // the chunk's keys, row-major [32][kRowElems]
    if constexpr (kFp8) {
      dequantise_chunk<F, T, kRope, kWideThreads>(bufs + (i % kStages) * kBufBytes, sk, tid);
      __syncthreads();  // staging buffer i % kStages is free again
      issue(i + kAhead);
      kt = sk;
    } else {
      issue(i + kAhead);  // into the buffer chunk i-1 used
      kt = reinterpret_cast<const T*>(bufs + (i % kStages) * kBufBytes);
    }

    {  // Scores: this warp's 32 heads x 32 keys over its quarter of the dims, into its quarter's partial tile.
      float acc[2][4][4] = {};
#pragma unroll
      for (int ks = 0; ks < kDims / 16; ++ks) {
        const int dim = quarter * kDims + ks * 16;
        uint32_t qa[2][4];
#pragma unroll
        for (int m = 0; m < 2; ++m)
          ldmatrix_x4(qa[m], sq + (my_heads + m * 16 + lane % 16) * kRowElems + dim + (lane / 16) * 8);
#pragma unroll
        for (int n = 0; n < 4; n += 2) {
          uint32_t bk[4];  // keys 8n..8n+15, dims dim..dim+15
          ldmatrix_x4(bk, kt + (n * 8 + lane % 8 + (lane / 16) * 8) * kRowElems + dim + ((lane / 8) % 2) * 8);
#pragma unroll
          for (int m = 0; m < 2; ++m) {
            mma_16816<T>(acc[m][n], qa[m], {bk[0], bk[1]});
            mma_16816<T>(acc[m][n + 1], qa[m], {bk[2], bk[3]});
          }
        }
      }
      float* part = ss + quarter * kWideHeads * kSRow;
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        const int r = my_heads + m * 16 + g;
#pragma unroll
        for (int n = 0; n < 4; ++n) {
          const int c = n * 8 + (lane % 4) * 2;
          *reinterpret_cast<float2*>(part + r * kSRow + c) = make_float2(acc[m][n][0], acc[m][n][1]);
          *reinterpret_cast<float2*>(part + (r + 8) * kSRow + c) = make_float2(acc[m][n][2], acc[m][n][3]);
        }
      }
    }
    __syncthreads();

    {  // Online softmax: kRowThreads threads per head row, kRowKeys keys each.
      const int r = tid / kRowThreads, c0 = (tid % kRowThreads) * kRowKeys;
      float v[kRowKeys], cmax = -INFINITY;
#pragma unroll
      for (int e = 0; e < kRowKeys; ++e) {
        const int at = r * kSRow + c0 + e;
        constexpr int kTile = kWideHeads * kSRow;
        const float score = (ss[at] + ss[at + kTile]) + (ss[at + 2 * kTile] + ss[at + 3 * kTile]);
        v[e] = vmask[c0 + e] ? score * p.scale_log2 : -INFINITY;
        cmax = fmaxf(cmax, v[e]);
      }
#pragma unroll
      for (int off = 1; off < kRowThreads; off *= 2) cmax = fmaxf(cmax, __shfl_xor_sync(0xffffffffu, cmax, off));
      const float m_old = row_max[r];
      const float m_new = fmaxf(m_old, cmax);
      const float base = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing valid yet stays at zero
      float psum = 0.f;
#pragma unroll
      for (int e = 0; e < kRowKeys; ++e) {
        v[e] = exp2f(v[e] - base);
        psum += v[e];
      }
#pragma unroll
      for (int off = 1; off < kRowThreads; off *= 2) psum += __shfl_xor_sync(0xffffffffu, psum, off);
      *reinterpret_cast<uint4*>(sp + r * kPRow + c0) =
          make_uint4(pack2<T>(v[0], v[1]), pack2<T>(v[2], v[3]), pack2<T>(v[4], v[5]), pack2<T>(v[6], v[7]));
      __syncwarp();  // every thread of the row has read row_max
      if (tid % kRowThreads == 0) {
        const float alpha = exp2f(m_old - base);
        row_alpha[r] = alpha;
        row_sum[r] = row_sum[r] * alpha + psum;
        row_max[r] = m_new;
      }
    }
    __syncthreads();

    // O = alpha O + P V over this warp's rows and 128 columns.
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      const float al0 = row_alpha[my_heads + m * 16 + g], al1 = row_alpha[my_heads + m * 16 + g + 8];
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        o[m][n][0] *= al0;
        o[m][n][1] *= al0;
        o[m][n][2] *= al1;
        o[m][n][3] *= al1;
      }
    }
#pragma unroll
    for (int ks = 0; ks < kKeysPerChunk; ks += 16) {
      uint32_t a[2][4];
#pragma unroll
      for (int m = 0; m < 2; ++m)
        ldmatrix_x4(a[m], sp + (my_heads + m * 16 + lane % 16) * kPRow + ks + (lane / 16) * 8);
#pragma unroll
      for (int n2 = 0; n2 < 8; ++n2) {
        const int col0 = quarter * 128 + n2 * 16;
        uint32_t bv[4];
        ldmatrix_x4_trans(bv, kt + (ks + lane % 8 + ((lane / 8) % 2) * 8) * kRowElems + col0 + (lane / 16) * 8);
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          mma_16816<T>(o[m][2 * n2], a[m], {bv[0], bv[1]});
          mma_16816<T>(o[m][2 * n2 + 1], a[m], {bv[2], bv[3]});
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // row statistics final (also when this split had no chunks)
  if (p.early_combine) let_dependents_launch();  // the combine: placed while the partials are written

#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = my_heads + m * 16 + g + hf * 8;
      if (r < nh)
        store_head_row(p, o[m], hf, t, b, j, split, h0 + r, quarter * 128 + (lane % 4) * 2, row_max[r], row_sum[r],
                       quarter == 0 && lane % 4 == 0);
    }
}

}  // namespace smla::cuda::mla::wide
