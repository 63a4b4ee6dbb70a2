// MLA attention on tensor cores (mma.sync, SM80+): one CTA = one query token,
// 16 heads (one mma row tile) and a range of 32-key chunks. The selected
// cache rows are gathered with cp.async into shared memory (fp8 rows are
// dequantised there), scores and P*V run on m16n8k16 with fp32 accumulators,
// the softmax is online in fp32 (log2 domain).
#pragma once

#include <cuda_fp8.h>

#include <cfloat>

#include "cuda/common/mma.cuh"
#include "cuda/mla/params.h"

namespace smla::cuda::mla {

constexpr int kThreads = 128;          // 4 warps
constexpr int kHeadsPerCta = 16;       // one mma row tile
constexpr int kKeysPerChunk = 32;      // 4 warps x 8 keys for the scores
constexpr int kQkDim = 576, kVDim = 512, kLatent = 512, kRope = 64;
constexpr int kRowElems = kQkDim + 8;  // +16 bytes per row: ldmatrix rows hit distinct banks
constexpr int kPieces = kQkDim * 2 / 16;  // 16-byte pieces of a 16-bit row (72)
constexpr int kFp8RowBytes = 656;
constexpr int kFp8Pieces = kFp8RowBytes / 16;  // 41
constexpr int kSRow = kKeysPerChunk + 4;       // fp32 scores row
constexpr int kPRow = kKeysPerChunk + 8;       // 16-bit probabilities row (80 bytes, 16-byte aligned)

template <CacheFormat F>
using ComputeT = std::conditional_t<F == CacheFormat::f16, __half, __nv_bfloat16>;

// Shared-memory layout, in bytes from the start (all offsets 16-byte aligned).
struct SmemLayout {
  int q, k, staging, s, p, stats, valid, total;
  __host__ __device__ constexpr SmemLayout(CacheFormat f, int stages) : q(0), k(0), staging(0), s(0), p(0), stats(0), valid(0), total(0) {
    const bool fp8 = f == CacheFormat::fp8_ds_mla;
    const int k_buffers = fp8 ? 1 : stages;
    const int valid_sets = fp8 ? 2 : stages;
    q = 0;
    k = q + kHeadsPerCta * kRowElems * 2;
    staging = k + k_buffers * kKeysPerChunk * kRowElems * 2;
    s = staging + (fp8 ? kKeysPerChunk * kFp8RowBytes : 0);
    p = s + kHeadsPerCta * kSRow * 4;
    stats = p + kHeadsPerCta * kPRow * 2;
    valid = stats + 3 * kHeadsPerCta * 4;
    total = valid + valid_sets * kKeysPerChunk * 4;
  }
};

__device__ __forceinline__ float bits_to_float(uint16_t v, bool is_bf16) {
  return is_bf16 ? __bfloat162float(__ushort_as_bfloat16(v)) : __half2float(__ushort_as_half(v));
}

// Physical slot of key `key` of token (b, j, t), or -1 when it must not be read.
template <bool kPaged>
__device__ __forceinline__ int64_t slot_of(const AttentionParams& p, int t, int b, int key, int visible) {
  if (key >= visible) return -1;
  if constexpr (kPaged) {
    const int32_t block = p.block_table[b * p.block_table_stride + key / p.block_size];
    if (block < 0 || block >= p.num_blocks) return -1;
    return static_cast<int64_t>(block) * p.block_size + key % p.block_size;
  } else {
    const int32_t idx = p.indices[t * p.indices_stride + key];
    return (idx >= 0 && idx < p.num_slots) ? idx : -1;
  }
}

template <CacheFormat F, bool kPaged, int kStages>
__global__ void __launch_bounds__(kThreads) attention_kernel(const AttentionParams p) {
  using T = ComputeT<F>;
  constexpr bool kFp8 = F == CacheFormat::fp8_ds_mla;
  constexpr SmemLayout L(F, kStages);
  extern __shared__ __align__(16) uint8_t smem[];
  T* sq = reinterpret_cast<T*>(smem + L.q);
  T* sk = reinterpret_cast<T*>(smem + L.k);
  uint8_t* staging = smem + L.staging;
  float* ss = reinterpret_cast<float*>(smem + L.s);
  T* sp = reinterpret_cast<T*>(smem + L.p);
  float* row_max = reinterpret_cast<float*>(smem + L.stats);
  float* row_sum = row_max + kHeadsPerCta;
  float* row_alpha = row_sum + kHeadsPerCta;
  int* valid = reinterpret_cast<int*>(smem + L.valid);

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int head_groups = (p.num_heads + kHeadsPerCta - 1) / kHeadsPerCta;
  const int t = blockIdx.x / head_groups;
  const int h0 = (blockIdx.x % head_groups) * kHeadsPerCta;
  const int nh = min(kHeadsPerCta, p.num_heads - h0);
  const int split = blockIdx.y;
  const int b = t / p.s_q, j = t % p.s_q;

  // Keys this token may see; everything at or past `visible` is invalid.
  int visible;
  if constexpr (kPaged) {
    const int seq = p.seq_lens[b];
    visible = p.causal ? seq - p.s_q + j + 1 : seq;
    visible = max(0, min(visible, p.max_blocks * p.block_size));
  } else {
    visible = p.topk_length ? max(0, min(p.topk_length[t], p.topk)) : p.topk;
  }
  const int total_chunks = (visible + kKeysPerChunk - 1) / kKeysPerChunk;
  const int chunk_begin = split * p.chunks_per_split;
  const int n_chunks = max(0, min(p.chunks_per_split, total_chunks - chunk_begin));

  // Queries -> shared memory in the compute type; rows past the last head are zero.
  const uint16_t* q = p.q + b * p.q_stride_b + j * p.q_stride_s + h0 * p.q_stride_h;
  for (int i = tid; i < kHeadsPerCta * kPieces; i += kThreads) {
    const int row = i / kPieces, piece = i % kPieces;
    uint4 raw = make_uint4(0, 0, 0, 0);
    if (row < nh) raw = *reinterpret_cast<const uint4*>(q + row * p.q_stride_h + piece * 8);
    const uint16_t* in = reinterpret_cast<const uint16_t*>(&raw);
    uint4 conv;
    uint32_t* outw = reinterpret_cast<uint32_t*>(&conv);
    for (int e = 0; e < 4; ++e)
      outw[e] = pack2<T>(bits_to_float(in[2 * e], p.q_is_bf16), bits_to_float(in[2 * e + 1], p.q_is_bf16));
    *reinterpret_cast<uint4*>(sq + row * kRowElems + piece * 8) = conv;
  }
  if (tid < kHeadsPerCta) {
    row_max[tid] = -INFINITY;
    row_sum[tid] = 0.f;
  }

  // Gathers chunk `chunk` (its 32 rows) into `dst`: 4 threads per row, each
  // 16-byte piece one cp.async; invalid rows are zero-filled, never read.
  auto gather = [&](int chunk, uint8_t* dst, int dst_row_bytes, int pieces, int* valid_out) {
    const int row = tid / 4, part = tid % 4;
    const int key = chunk * kKeysPerChunk + row;
    const int64_t slot = slot_of<kPaged>(p, t, b, key, visible);
    const uint8_t* src = p.cache;
    if (slot >= 0) src += (slot / p.block_size) * p.block_stride + (slot % p.block_size) * p.row_stride;
    for (int piece = part; piece < pieces; piece += 4)
      cp_async_16(dst + row * dst_row_bytes + piece * 16, src + piece * 16, slot >= 0);
    if (part == 0) valid_out[row] = slot >= 0;
  };

  // fp8_ds_mla rows: 512 e4m3 latents, 4 fp32 tile scales, 64 bf16 rope values -> bf16.
  auto dequantise = [&]() {
    for (int i = tid; i < kKeysPerChunk * kPieces; i += kThreads) {
      const int row = i / kPieces, piece = i % kPieces;
      const uint8_t* src = staging + row * kFp8RowBytes;
      uint4 out;
      if (piece < kLatent / 8) {
        const float scale = reinterpret_cast<const float*>(src + kLatent)[piece / 16];
        const uint2 codes = *reinterpret_cast<const uint2*>(src + piece * 8);
        const __nv_fp8x2_storage_t* c2 = reinterpret_cast<const __nv_fp8x2_storage_t*>(&codes);
        uint32_t* ow = reinterpret_cast<uint32_t*>(&out);
        for (int e = 0; e < 4; ++e) {
          const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(c2[e], __NV_E4M3)));
          ow[e] = pack2<T>(f.x * scale, f.y * scale);
        }
      } else {
        out = *reinterpret_cast<const uint4*>(src + kLatent + 16 + (piece - kLatent / 8) * 16);
      }
      *reinterpret_cast<uint4*>(sk + row * kRowElems + piece * 8) = out;
    }
  };

  float o[16][4];  // this warp's 128 output columns (16 n-tiles), rows g and g+8
#pragma unroll
  for (int n = 0; n < 16; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;

  // One chunk: scores, online softmax, O += P V, with keys in `kt` (row-major [32][kRowElems]).
  auto attend = [&](const T* kt, const int* vmask) {
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 2
    for (int kk = 0; kk < kQkDim; kk += 32) {
      uint32_t a0[4], a1[4], bk[4];
      ldmatrix_x4(a0, sq + (lane % 16) * kRowElems + kk + (lane / 16) * 8);
      ldmatrix_x4(a1, sq + (lane % 16) * kRowElems + kk + 16 + (lane / 16) * 8);
      ldmatrix_x4(bk, kt + (warp * 8 + lane % 8) * kRowElems + kk + (lane / 8) * 8);
      mma_16816<T>(acc, a0, {bk[0], bk[1]});
      mma_16816<T>(acc, a1, {bk[2], bk[3]});
    }
    const int g = lane / 4, c = warp * 8 + (lane % 4) * 2;
    ss[g * kSRow + c] = acc[0];
    ss[g * kSRow + c + 1] = acc[1];
    ss[(g + 8) * kSRow + c] = acc[2];
    ss[(g + 8) * kSRow + c + 1] = acc[3];
    __syncthreads();

    {  // 8 threads per head row, 4 keys each
      const int r = tid / 8, c0 = (tid % 8) * 4;
      float v[4], cmax = -INFINITY;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        v[e] = vmask[c0 + e] ? ss[r * kSRow + c0 + e] * p.scale_log2 : -INFINITY;
        cmax = fmaxf(cmax, v[e]);
      }
#pragma unroll
      for (int off = 1; off < 8; off *= 2) cmax = fmaxf(cmax, __shfl_xor_sync(0xffffffffu, cmax, off));
      const float m_old = row_max[r];
      const float m_new = fmaxf(m_old, cmax);
      const float base = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing valid yet stays at zero
      float psum = 0.f;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        v[e] = exp2f(v[e] - base);
        psum += v[e];
      }
#pragma unroll
      for (int off = 1; off < 8; off *= 2) psum += __shfl_xor_sync(0xffffffffu, psum, off);
      uint2 packed = make_uint2(pack2<T>(v[0], v[1]), pack2<T>(v[2], v[3]));
      *reinterpret_cast<uint2*>(sp + r * kPRow + c0) = packed;
      __syncwarp();
      if (tid % 8 == 0) {
        const float alpha = exp2f(m_old - base);
        row_alpha[r] = alpha;
        row_sum[r] = row_sum[r] * alpha + psum;
        row_max[r] = m_new;
      }
    }
    __syncthreads();

    const float al0 = row_alpha[g], al1 = row_alpha[g + 8];
#pragma unroll
    for (int n = 0; n < 16; ++n) {
      o[n][0] *= al0;
      o[n][1] *= al0;
      o[n][2] *= al1;
      o[n][3] *= al1;
    }
#pragma unroll
    for (int ks = 0; ks < kKeysPerChunk; ks += 16) {
      uint32_t a[4];
      ldmatrix_x4(a, sp + (lane % 16) * kPRow + ks + (lane / 16) * 8);
#pragma unroll
      for (int n2 = 0; n2 < 8; ++n2) {
        const int col0 = warp * 128 + n2 * 16;
        uint32_t bv[4];
        ldmatrix_x4_trans(bv, kt + (ks + lane % 8 + ((lane / 8) % 2) * 8) * kRowElems + col0 + (lane / 16) * 8);
        mma_16816<T>(o[2 * n2], a, {bv[0], bv[1]});
        mma_16816<T>(o[2 * n2 + 1], a, {bv[2], bv[3]});
      }
    }
  };

  if constexpr (kFp8) {
    if (n_chunks > 0) gather(chunk_begin, staging, kFp8RowBytes, kFp8Pieces, valid);
    cp_async_commit();
    for (int i = 0; i < n_chunks; ++i) {
      cp_async_wait<0>();
      __syncthreads();  // staging holds chunk i; every warp is done with the previous chunk's keys
      dequantise();
      int* vm = valid + (i % 2) * kKeysPerChunk;
      __syncthreads();
      if (i + 1 < n_chunks)
        gather(chunk_begin + i + 1, staging, kFp8RowBytes, kFp8Pieces, valid + ((i + 1) % 2) * kKeysPerChunk);
      cp_async_commit();
      attend(sk, vm);
    }
  } else {
    constexpr int kStageBytes = kKeysPerChunk * kRowElems * 2;
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < n_chunks)
        gather(chunk_begin + s, smem + L.k + s * kStageBytes, kRowElems * 2, kPieces, valid + s * kKeysPerChunk);
      cp_async_commit();
    }
    for (int i = 0; i < n_chunks; ++i) {
      cp_async_wait<kStages - 2>();
      __syncthreads();  // chunk i has landed; every warp is done with chunk i-1's stage
      const int next = i + kStages - 1;
      if (next < n_chunks)
        gather(chunk_begin + next, smem + L.k + (next % kStages) * kStageBytes, kRowElems * 2, kPieces,
               valid + (next % kStages) * kKeysPerChunk);
      cp_async_commit();
      attend(reinterpret_cast<const T*>(smem + L.k + (i % kStages) * kStageBytes), valid + (i % kStages) * kKeysPerChunk);
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // row statistics final (also when this split had no chunks)

  const int g = lane / 4;
  const float ln2 = 0.6931471805599453f;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = g + half * 8;
    if (r >= nh) continue;
    const int h = h0 + r;
    const float l = row_sum[r];
    const float lse2 = l > 0.f ? row_max[r] + log2f(l) : -INFINITY;
    float scale = l > 0.f ? 1.f / l : 0.f;
    if (p.num_splits == 1) {
      if (p.attn_sink && l > 0.f) scale /= 1.f + expf(p.attn_sink[h] - lse2 * ln2);
      const int64_t ob = b * p.out_stride_b + j * p.out_stride_s + h * p.out_stride_h;
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        const int col = warp * 128 + n * 8 + (lane % 4) * 2;
        const uint32_t v = p.q_is_bf16 ? pack2<__nv_bfloat16>(o[n][2 * half] * scale, o[n][2 * half + 1] * scale)
                                       : pack2<__half>(o[n][2 * half] * scale, o[n][2 * half + 1] * scale);
        *reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(p.out) + ob + col) = v;
      }
      if (warp == 0 && lane % 4 == 0)
        p.lse[b * p.lse_stride_b + j * p.lse_stride_s + h * p.lse_stride_h] = lse2 * ln2;
    } else {
      float* po = p.partial_out + ((static_cast<int64_t>(split) * p.num_tokens + t) * p.num_heads + h) * kVDim;
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        const int col = warp * 128 + n * 8 + (lane % 4) * 2;
        *reinterpret_cast<float2*>(po + col) = make_float2(o[n][2 * half] * scale, o[n][2 * half + 1] * scale);
      }
      if (warp == 0 && lane % 4 == 0)
        p.partial_lse[(static_cast<int64_t>(split) * p.num_tokens + t) * p.num_heads + h] = lse2;
    }
  }
}

// Merges the splits of each (token, head): out = sum_s w_s * out_s with
// w_s = 2^(lse_s - lse), lse = log2 sum_s 2^lse_s; applies the sink.
__global__ void __launch_bounds__(kThreads) combine_kernel(const AttentionParams p) {
  const int t = blockIdx.x / p.num_heads, h = blockIdx.x % p.num_heads;
  const int b = t / p.s_q, j = t % p.s_q;
  const int64_t stride = static_cast<int64_t>(p.num_tokens) * p.num_heads;
  const int64_t row = static_cast<int64_t>(t) * p.num_heads + h;
  float gmax = -INFINITY;
  for (int s = 0; s < p.num_splits; ++s) gmax = fmaxf(gmax, p.partial_lse[s * stride + row]);
  float wsum = 0.f;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  const int col = threadIdx.x * 4;
  if (gmax != -INFINITY) {
    for (int s = 0; s < p.num_splits; ++s) {
      const float w = exp2f(p.partial_lse[s * stride + row] - gmax);
      if (w == 0.f) continue;
      wsum += w;
      const float4 v = *reinterpret_cast<const float4*>(p.partial_out + (s * stride + row) * kVDim + col);
      acc[0] += w * v.x;
      acc[1] += w * v.y;
      acc[2] += w * v.z;
      acc[3] += w * v.w;
    }
  }
  const float ln2 = 0.6931471805599453f;
  const float lse2 = wsum > 0.f ? gmax + log2f(wsum) : -INFINITY;
  float scale = wsum > 0.f ? 1.f / wsum : 0.f;
  if (p.attn_sink && wsum > 0.f) scale /= 1.f + expf(p.attn_sink[h] - lse2 * ln2);
  uint16_t* out = static_cast<uint16_t*>(p.out) + b * p.out_stride_b + j * p.out_stride_s + h * p.out_stride_h + col;
  const uint32_t lo = p.q_is_bf16 ? pack2<__nv_bfloat16>(acc[0] * scale, acc[1] * scale)
                                  : pack2<__half>(acc[0] * scale, acc[1] * scale);
  const uint32_t hi = p.q_is_bf16 ? pack2<__nv_bfloat16>(acc[2] * scale, acc[3] * scale)
                                  : pack2<__half>(acc[2] * scale, acc[3] * scale);
  *reinterpret_cast<uint2*>(out) = make_uint2(lo, hi);
  if (threadIdx.x == 0) p.lse[b * p.lse_stride_b + j * p.lse_stride_s + h * p.lse_stride_h] = lse2 * ln2;
}

}  // namespace smla::cuda::mla
