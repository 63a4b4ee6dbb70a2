// indexer_topk on the GPU, in two kernels with no host synchronisation:
//   1. scores: one CTA per (token, 512 positions); the token's index queries
//      sit in shared memory, the keys of 64 positions at a time are gathered
//      through the block table with cp.async (fp8 keys dequantised to bf16),
//      q.k runs on mma.sync (bf16, fp32 accumulate), and ReLU, the head
//      weights and the sum over heads are applied in registers. Scores go to
//      a workspace row per token.
//   2. top-k: one CTA per token; an exact radix select on the scores' order
//      keys finds the k-th largest, the survivors (equal scores: the lowest
//      positions) are compacted in position order and sorted by (score desc,
//      position asc) — the same result as the CPU backend.
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>
#include <cuda_fp8.h>

#include <algorithm>

#include "cuda/backend.h"
#include "cuda/common/mma.cuh"
#include "cuda/common/runtime.h"
#include "cuda/kernels.h"

namespace smla::cuda {

namespace {

constexpr int kDim = 128;            // index head dim
constexpr int kRow = kDim + 8;       // bf16 elements per shared key/query row (+16 bytes: no bank conflicts)
constexpr int kScoreThreads = 128;   // 4 warps x 16 positions
constexpr int kTile = 64;            // positions per pipeline step
constexpr int kTilesPerCta = 8;      // 512 positions per CTA

enum class QKind { bf16, f16, fp8 };

struct ScoreParams {
  const void* q;
  QKind q_kind;
  int64_t q_stride_t, q_stride_h;
  const float* q_scale;
  int64_t qs_stride_t, qs_stride_h;
  const float* weights;
  int64_t w_stride_t, w_stride_h;
  int heads;
  const uint8_t* cache;
  bool fp8_cache;
  int64_t block_stride, row_stride;  // bytes (row stride: bf16 cache)
  int block_size, num_blocks;
  const int32_t* request_ids;
  int64_t req_stride;
  int num_requests;
  const int32_t* block_table;
  int64_t table_stride;
  int max_blocks;
  const int32_t* context_lens;
  int64_t ctx_stride;
  int64_t capacity;
  float* scores;  // [T, capacity]
};

// Positions token t may see (0 when its request id is out of range).
__device__ __forceinline__ int64_t visible_positions(const int32_t* context_lens, int64_t ctx_stride,
                                                     const int32_t* request_ids, int64_t req_stride,
                                                     int num_requests, int64_t capacity, int t) {
  const int32_t req = request_ids[t * req_stride];
  if (req < 0 || req >= num_requests) return 0;
  return max(int64_t{0}, min(static_cast<int64_t>(context_lens[t * ctx_stride]), capacity));
}

__device__ __forceinline__ float q_value(const ScoreParams& p, const void* row, int d) {
  switch (p.q_kind) {
    case QKind::bf16: return __bfloat162float(static_cast<const __nv_bfloat16*>(row)[d]);
    case QKind::f16: return __half2float(static_cast<const __half*>(row)[d]);
    default: {
      const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<const __nv_fp8_storage_t*>(row)[d], __NV_E4M3);
      return __half2float(__half(h));
    }
  }
}

// Tiles in flight: fp8 keys land in kFp8Stages staging buffers and are
// dequantised into one key tile; bf16 keys land in kBf16Stages key tiles
// (one in use, the rest in flight).
constexpr int kFp8Stages = 4, kBf16Stages = 3;

template <int kMTiles, bool kFp8>
struct ScoreSmem {
  static constexpr int kStages = kFp8 ? kFp8Stages : kBf16Stages;
  __nv_bfloat16 q[kMTiles * 16][kRow];
  __nv_bfloat16 k[kFp8 ? 1 : kStages][kTile][kRow];  // bf16 keys (gathered, or dequantised)
  uint8_t staging[kFp8 ? kStages : 1][kTile][kDim];  // fp8 keys as gathered
  float scale[kStages][kTile];                       // key scales as gathered (-1: bad block)
  float tile_scale[kTile];                           // the scales of the fp8 tile in use
};

template <int kMTiles, bool kFp8>
__global__ void __launch_bounds__(kScoreThreads) index_scores_kernel(const ScoreParams p) {
  using Smem = ScoreSmem<kMTiles, kFp8>;
  constexpr int kStages = Smem::kStages;
  constexpr int kAhead = kFp8 ? kStages : kStages - 1;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  auto& s = *reinterpret_cast<Smem*>(smem_raw);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int t = blockIdx.y;
  const int64_t ctx = visible_positions(p.context_lens, p.ctx_stride, p.request_ids, p.req_stride, p.num_requests,
                                        p.capacity, t);
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kTile * kTilesPerCta;
  if (begin >= ctx) return;
  const int n_tiles = static_cast<int>(min(static_cast<int64_t>(kTilesPerCta), (ctx - begin + kTile - 1) / kTile));
  const int32_t req = p.request_ids[t * p.req_stride];

  // Issues tile i into buffer i % kStages (if the tile exists): 2 threads per
  // position; positions past the context or in a block outside the cache are
  // zero-filled and never read.
  const int my_row = tid / 2, my_half = tid % 2;
  auto issue = [&](int i) {
    if (i < n_tiles) {
      const int64_t pos = begin + static_cast<int64_t>(i) * kTile + my_row;
      const int buf = i % kStages;
      int64_t block = -1;
      if (pos < ctx) block = p.block_table[req * p.table_stride + pos / p.block_size];
      const bool ok = block >= 0 && block < p.num_blocks;
      const int64_t off = pos % p.block_size;
      const uint8_t* blk = p.cache + (ok ? block : 0) * p.block_stride;
      if constexpr (kFp8) {
        const uint8_t* src = blk + off * kDim;
        if (p.block_stride % 16 == 0) {
          for (int piece = my_half; piece < kDim / 16; piece += 2)
            cp_async_16(&s.staging[buf][my_row][piece * 16], src + piece * 16, ok);
        } else {  // blocks of a size that is not a multiple of 4 start 4-byte aligned only
          for (int word = my_half; word < kDim / 4; word += 2)
            cp_async_4(&s.staging[buf][my_row][word * 4], src + word * 4, ok);
        }
        if (my_half == 0) {
          if (ok) cp_async_4(&s.scale[buf][my_row], blk + static_cast<int64_t>(p.block_size) * kDim + off * 4, true);
          else s.scale[buf][my_row] = pos < ctx ? -1.f : 0.f;
        }
      } else {
        for (int piece = my_half; piece < kDim * 2 / 16; piece += 2)
          cp_async_16(&s.k[buf][my_row][piece * 8], blk + off * p.row_stride + piece * 16, ok);
        if (my_half == 0) s.scale[buf][my_row] = ok ? 1.f : (pos < ctx ? -1.f : 0.f);
      }
    }
    cp_async_commit();  // empty groups keep the wait counts uniform
  };
#pragma unroll
  for (int i = 0; i < kAhead; ++i) issue(i);

  // Queries of this token (bf16), and each thread's head weights for its rows g, g+8 of every m-tile.
  const char* qrow = static_cast<const char*>(p.q) + t * p.q_stride_t * (p.q_kind == QKind::fp8 ? 1 : 2);
  for (int i = tid; i < kMTiles * 16 * kDim; i += kScoreThreads) {
    const int h = i / kDim, d = i % kDim;
    const float v = h < p.heads ? q_value(p, qrow + h * p.q_stride_h * (p.q_kind == QKind::fp8 ? 1 : 2), d) : 0.f;
    s.q[h][d] = __float2bfloat16_rn(v);
  }
  float w[kMTiles][2];
#pragma unroll
  for (int m = 0; m < kMTiles; ++m)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int h = m * 16 + lane / 4 + r * 8;
      w[m][r] = h < p.heads ? p.weights[t * p.w_stride_t + h * p.w_stride_h] *
                                  (p.q_scale ? p.q_scale[t * p.qs_stride_t + h * p.qs_stride_h] : 1.f)
                            : 0.f;
    }

  for (int i = 0; i < n_tiles; ++i) {
    cp_async_wait<kAhead - 1>();
    __syncthreads();  // tile i landed (and the queries are in); everyone is done with tile i-1
    const int buf = i % kStages;
    __nv_bfloat16(*keys)[kRow] = s.k[kFp8 ? 0 : buf];
    const float* scales = kFp8 ? s.tile_scale : s.scale[buf];
    if constexpr (kFp8) {  // e4m3 -> bf16 is exact; the scale is applied to the score
      for (int j = tid; j < kTile * kDim / 8; j += kScoreThreads) {
        const int row = j / (kDim / 8), c = (j % (kDim / 8)) * 8;
        const uint2 codes = *reinterpret_cast<const uint2*>(&s.staging[buf][row][c]);
        const __nv_fp8x2_storage_t* c2 = reinterpret_cast<const __nv_fp8x2_storage_t*>(&codes);
        uint4 out;
        uint32_t* ow = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(c2[e], __NV_E4M3)));
          ow[e] = pack2<__nv_bfloat16>(f.x, f.y);
        }
        *reinterpret_cast<uint4*>(&keys[row][c]) = out;
      }
      if (tid < kTile) s.tile_scale[tid] = s.scale[buf][tid];
      __syncthreads();  // staging buffer `buf` is free again
    }
    issue(i + kAhead);

    float acc[kMTiles][2][4] = {};
#pragma unroll
    for (int ks = 0; ks < kDim / 16; ++ks) {
      uint32_t b[4];  // positions warp*16 .. +15, dims ks*16 .. +15
      ldmatrix_x4(b, &keys[warp * 16 + lane % 8 + (lane / 16) * 8][ks * 16 + ((lane / 8) % 2) * 8]);
#pragma unroll
      for (int m = 0; m < kMTiles; ++m) {
        uint32_t a[4];
        ldmatrix_x4(a, &s.q[m * 16 + lane % 16][ks * 16 + (lane / 16) * 8]);
        mma_16816<__nv_bfloat16>(acc[m][0], a, {b[0], b[1]});
        mma_16816<__nv_bfloat16>(acc[m][1], a, {b[2], b[3]});
      }
    }
    // score = sum over heads of w * ReLU(q.k); rows g, g+8 here, the other rows in lanes ^4, ^8, ^16.
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      float s0 = 0.f, s1 = 0.f;
#pragma unroll
      for (int m = 0; m < kMTiles; ++m) {
        s0 += w[m][0] * fmaxf(acc[m][n][0], 0.f) + w[m][1] * fmaxf(acc[m][n][2], 0.f);
        s1 += w[m][0] * fmaxf(acc[m][n][1], 0.f) + w[m][1] * fmaxf(acc[m][n][3], 0.f);
      }
#pragma unroll
      for (int o = 4; o < 32; o *= 2) {
        s0 += __shfl_xor_sync(0xffffffffu, s0, o);
        s1 += __shfl_xor_sync(0xffffffffu, s1, o);
      }
      if (lane < 4) {
        const int row = warp * 16 + n * 8 + lane * 2;
        const int64_t pos = begin + static_cast<int64_t>(i) * kTile + row;
        float* out = p.scores + t * p.capacity + pos;
        const float sc0 = scales[row], sc1 = scales[row + 1];
        if (pos < ctx) out[0] = sc0 < 0.f ? -INFINITY : s0 * sc0;
        if (pos + 1 < ctx) out[1] = sc1 < 0.f ? -INFINITY : s1 * sc1;
      }
    }
  }
}

// ---- exact top-k -------------------------------------------------------------

constexpr int kTopkThreads = 1024;

// Monotone map of a score to an unsigned key (as the CPU backend's order_key):
// a > b iff key(a) > key(b); -0 and +0 tie.
__device__ __forceinline__ uint32_t order_key(float v) {
  const uint32_t u = __float_as_uint(v + 0.0f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

struct TopkParams {
  const float* scores;
  int64_t capacity;
  const int32_t* context_lens;
  int64_t ctx_stride;
  const int32_t* request_ids;
  int64_t req_stride;
  int num_requests;
  int k;
  int32_t* out;
  int64_t out_stride;
};

template <int kItems>
__global__ void __launch_bounds__(kTopkThreads) topk_kernel(const TopkParams p) {
  using Sort = cub::BlockRadixSort<uint64_t, kTopkThreads, kItems>;
  using Scan = cub::BlockScan<int, kTopkThreads>;
  // The survivors and, once they are in registers, the sort's scratch share
  // the dynamic shared memory.
  extern __shared__ __align__(16) uint8_t smem_raw[];
  auto* sort_storage = reinterpret_cast<typename Sort::TempStorage*>(smem_raw);
  uint64_t* selected = reinterpret_cast<uint64_t*>(smem_raw);
  __shared__ typename Scan::TempStorage scan_storage;
  // Eight copies of the histogram (lane % 8 picks one): similar scores share
  // their top bits, and eight copies cut the same-address atomics 8-fold.
  constexpr int kCopies = 8, kBins = 257;  // 257: copies start in different banks
  __shared__ int hist[kCopies * kBins];
  __shared__ uint32_t s_prefix;
  __shared__ int s_remaining;

  const int t = blockIdx.x, tid = threadIdx.x;
  const float* row = p.scores + t * p.capacity;
  const int64_t n = visible_positions(p.context_lens, p.ctx_stride, p.request_ids, p.req_stride, p.num_requests,
                                      p.capacity, t);
  const int want = static_cast<int>(min(static_cast<int64_t>(p.k), n));

  // Radix select, 8 bits at a time from the top: the key of the want-th largest.
  uint32_t prefix = 0, mask = 0;
  int remaining = want;
  for (int shift = 24; shift >= 0 && want > 0; shift -= 8) {
    for (int i = tid; i < kCopies * kBins; i += kTopkThreads) hist[i] = 0;
    __syncthreads();
    int* my_hist = hist + (tid % kCopies) * kBins;
    for (int64_t i = tid; i < n; i += kTopkThreads) {
      const uint32_t key = order_key(row[i]);
      if ((key & mask) == prefix) atomicAdd(&my_hist[(key >> shift) & 0xff], 1);
    }
    __syncthreads();
    for (int b = tid; b < 256; b += kTopkThreads)
      for (int c = 1; c < kCopies; ++c) hist[b] += hist[c * kBins + b];
    __syncthreads();
    if (tid == 0) {
      int above = 0, digit = 255;
      while (above + hist[digit] < remaining) above += hist[digit--];
      s_prefix = prefix | (static_cast<uint32_t>(digit) << shift);
      s_remaining = remaining - above;
    }
    __syncthreads();
    prefix = s_prefix;
    remaining = s_remaining;
    mask |= 0xffu << shift;
    __syncthreads();
  }
  const uint32_t threshold = prefix;  // keys > threshold are all in; `remaining` of the keys == threshold are

  // Compaction in position order: each thread scans a contiguous segment.
  const int64_t seg = (n + kTopkThreads - 1) / kTopkThreads;
  const int64_t lo = min(n, tid * seg), hi = min(n, lo + seg);
  int gt = 0, eq = 0;
  for (int64_t i = lo; i < hi && want > 0; ++i) {
    const uint32_t key = order_key(row[i]);
    gt += key > threshold;
    eq += key == threshold;
  }
  int gt_before, eq_before, gt_total;
  Scan(scan_storage).ExclusiveSum(gt, gt_before, gt_total);
  __syncthreads();
  Scan(scan_storage).ExclusiveSum(eq, eq_before);
  for (int i = tid; i < kTopkThreads * kItems; i += kTopkThreads) selected[i] = 0;
  __syncthreads();
  for (int64_t i = lo; i < hi && want > 0; ++i) {
    const uint32_t key = order_key(row[i]);
    // (key, position) packed so that a larger value ranks first: higher key, then lower position.
    const uint64_t packed = (static_cast<uint64_t>(key) << 32) | (0xffffffffu - static_cast<uint32_t>(i));
    if (key > threshold) selected[gt_before++] = packed;
    else if (key == threshold && eq_before < remaining) selected[gt_total + eq_before++] = packed;
  }
  __syncthreads();

  uint64_t items[kItems];
#pragma unroll
  for (int j = 0; j < kItems; ++j) items[j] = selected[tid * kItems + j];
  __syncthreads();
  Sort(*sort_storage).SortDescendingBlockedToStriped(items);
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int rank = j * kTopkThreads + tid;
    if (rank < p.k)
      p.out[t * p.out_stride + rank] = rank < want ? static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(items[j])) : -1;
  }
}

template <int kMTiles, bool kFp8>
void launch_scores(const ScoreParams& p, int tokens, cudaStream_t stream) {
  constexpr int smem = sizeof(ScoreSmem<kMTiles, kFp8>);
  static_assert(smem <= 99 * 1024, "fits every arch's shared memory per block");
  check_cuda(cudaFuncSetAttribute(index_scores_kernel<kMTiles, kFp8>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
             "cudaFuncSetAttribute(index_scores_kernel)");
  const int64_t per_cta = kTile * kTilesPerCta;
  const dim3 grid(static_cast<unsigned>((p.capacity + per_cta - 1) / per_cta), tokens);
  index_scores_kernel<kMTiles, kFp8><<<grid, kScoreThreads, smem, stream>>>(p);
  check_launch("smla indexer scores kernel");
}

template <int kMTiles>
void launch_scores(const ScoreParams& p, int tokens, cudaStream_t stream) {
  if (p.fp8_cache) launch_scores<kMTiles, true>(p, tokens, stream);
  else launch_scores<kMTiles, false>(p, tokens, stream);
}

template <int kItems>
void launch_topk(const TopkParams& p, int tokens, cudaStream_t stream) {
  const int smem = static_cast<int>(std::max(sizeof(typename cub::BlockRadixSort<uint64_t, kTopkThreads, kItems>::TempStorage),
                                             sizeof(uint64_t) * kTopkThreads * kItems));
  check_cuda(cudaFuncSetAttribute(topk_kernel<kItems>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
             "cudaFuncSetAttribute(topk_kernel)");
  topk_kernel<kItems><<<tokens, kTopkThreads, smem, stream>>>(p);
  check_launch("smla indexer top-k kernel");
}

}  // namespace

void indexer_scores(const IndexerTopkArgs& a, float* scores) {
  const int tokens = static_cast<int>(a.q.size(0));
  ScoreParams p{};
  p.q = a.q.data;
  p.q_kind = a.q.dtype == DType::bf16 ? QKind::bf16 : a.q.dtype == DType::f16 ? QKind::f16 : QKind::fp8;
  p.q_stride_t = a.q.stride(0);
  p.q_stride_h = a.q.stride(1);
  p.q_scale = a.q_scale.defined() ? a.q_scale.ptr<float>() : nullptr;
  p.qs_stride_t = a.q_scale.defined() ? a.q_scale.stride(0) : 0;
  p.qs_stride_h = a.q_scale.defined() ? a.q_scale.stride(1) : 0;
  p.weights = a.weights.ptr<float>();
  p.w_stride_t = a.weights.stride(0);
  p.w_stride_h = a.weights.stride(1);
  p.heads = static_cast<int>(a.q.size(1));
  p.cache = a.index_cache.ptr<uint8_t>();
  p.fp8_cache = a.index_cache.dtype == DType::fp8_e4m3;
  const int64_t elem = p.fp8_cache ? 1 : 2;
  p.block_stride = a.index_cache.stride(0) * elem;
  p.row_stride = a.index_cache.stride(1) * elem;
  p.block_size = static_cast<int>(a.index_cache.size(1));
  p.num_blocks = static_cast<int>(a.index_cache.size(0));
  p.request_ids = a.request_ids.ptr<int32_t>();
  p.req_stride = a.request_ids.stride(0);
  p.num_requests = static_cast<int>(a.block_table.size(0));
  p.block_table = a.block_table.ptr<int32_t>();
  p.table_stride = a.block_table.stride(0);
  p.max_blocks = static_cast<int>(a.block_table.size(1));
  p.context_lens = a.context_lens.ptr<int32_t>();
  p.ctx_stride = a.context_lens.stride(0);
  p.capacity = index_capacity(a);
  p.scores = scores;
  require(reinterpret_cast<uintptr_t>(p.cache) % 16 == 0 &&
              (p.fp8_cache ? p.block_stride % 4 == 0 : p.block_stride % 16 == 0 && p.row_stride % 16 == 0),
          "indexer_topk: index_cache: the CUDA backend needs 16-byte aligned data and bf16 rows, 4-byte aligned fp8 blocks");
  if (tokens == 0 || p.capacity == 0) return;
  const auto stream = static_cast<cudaStream_t>(a.stream);
  const int m_tiles = (p.heads + 15) / 16;  // heads padded to 1, 2, 4 or 8 mma row tiles
  if (m_tiles <= 1) launch_scores<1>(p, tokens, stream);
  else if (m_tiles <= 2) launch_scores<2>(p, tokens, stream);
  else if (m_tiles <= 4) launch_scores<4>(p, tokens, stream);
  else launch_scores<8>(p, tokens, stream);
}

void select_topk(const IndexerTopkArgs& a, const float* scores) {
  const int tokens = static_cast<int>(a.q.size(0));
  const int k = static_cast<int>(a.topk.size(1));
  require(k <= kMaxIndexerTopk, "indexer_topk: topk: the CUDA backend selects at most " +
                                    std::to_string(kMaxIndexerTopk) + " positions per token, got " + std::to_string(k));
  if (tokens == 0) return;
  TopkParams tp{};
  tp.scores = scores;
  tp.capacity = index_capacity(a);
  tp.context_lens = a.context_lens.ptr<int32_t>();
  tp.ctx_stride = a.context_lens.stride(0);
  tp.request_ids = a.request_ids.ptr<int32_t>();
  tp.req_stride = a.request_ids.stride(0);
  tp.num_requests = static_cast<int>(a.block_table.size(0));
  tp.k = k;
  tp.out = a.topk.ptr<int32_t>();
  tp.out_stride = a.topk.stride(0);
  const auto stream = static_cast<cudaStream_t>(a.stream);
  if (k <= kTopkThreads * 2) launch_topk<2>(tp, tokens, stream);
  else launch_topk<8>(tp, tokens, stream);
}

int64_t index_capacity(const IndexerTopkArgs& a) { return a.block_table.size(1) * a.index_cache.size(1); }

void indexer_topk(const IndexerTopkArgs& a) {
  const size_t rows = static_cast<size_t>(a.q.size(0)) * std::max<int64_t>(index_capacity(a), 1);
  float* scores = static_cast<float*>(workspace(static_cast<cudaStream_t>(a.stream), rows * sizeof(float)));
  indexer_scores(a, scores);
  select_topk(a, scores);
}

}  // namespace smla::cuda
