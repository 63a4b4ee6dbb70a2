// write_mla_cache on the GPU: one warp per token. fp8 rows are quantised
// exactly as the CPU backend does (power-of-two tile scales,
// round-to-nearest-even e4m3), so both produce the same bytes. With no k_pe
// (a head with no rope part) only the latent is written: 512 values, or the
// first 528 bytes of an fp8 row (an fp8_ds_mla row's rope bytes stay as they are),
// or DeepSeek-V4's token of an fp8_ds_mla_v4 block (its pad byte stays as it is).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "cuda/common/runtime.h"
#include "cuda/kernels.h"
#include "smla/types.h"

namespace smla::cuda {

namespace {

struct CacheWriteParams {
  const void* latent;
  const void* k_pe;
  DType src_dtype;
  int64_t latent_stride, k_pe_stride;  // elements
  const int64_t* slot_mapping;
  int64_t slot_stride;
  int64_t num_tokens, num_slots;
  int rope_dim;  // 64, or 0 without k_pe
  uint8_t* cache;
  DType cache_dtype;
  int64_t block_stride, row_stride;  // bytes
  int block_size;
};

__device__ __forceinline__ float load(const void* base, int64_t i, DType d) {
  switch (d) {
    case DType::bf16: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
    case DType::f16: return __half2float(static_cast<const __half*>(base)[i]);
    default: return static_cast<const float*>(base)[i];
  }
}

// Smallest power of two >= x (x > 0, normal), exact on the bits.
__device__ __forceinline__ float pow2_ceil(float x) {
  const uint32_t u = __float_as_uint(x);
  return (u & 0x7fffffu) == 0 ? x : __uint_as_float((u & 0x7f800000u) + 0x800000u);
}

// The tile scale of `amax` (power of two) and its ue8m0 byte, as fp8_ds_mla's rule gives it.
__device__ __forceinline__ float tile_scale(float amax) { return pow2_ceil(fmaxf(amax / 448.f, 1e-4f)); }

// DeepSeek-V4's token `offset` of the fp8_ds_mla_v4 block at `block` from the 512 latent values `c`: 7 tiles of 64
// e4m3 values (a lane holds 2 of each), their ue8m0 scales at the block's end, the last 64 values as bf16.
__device__ void write_v4_token(const CacheWriteParams& p, const void* c, uint8_t* block, int64_t offset, int lane) {
  using V4 = MlaV4CacheLayout;
  uint8_t* values = block + offset * V4::kValueBytes;
  uint8_t* scales = block + p.block_size * V4::kValueBytes + offset * V4::kScaleBytes;
  for (int tile = 0; tile < V4::kTiles; ++tile) {
    float v[2], amax = 0.f;
    for (int e = 0; e < 2; ++e) {
      v[e] = load(c, tile * V4::kTile + lane * 2 + e, p.src_dtype);
      amax = fmaxf(amax, fabsf(v[e]));
    }
    for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    const float scale = tile_scale(amax);
    for (int e = 0; e < 2; ++e)
      values[tile * V4::kTile + lane * 2 + e] = __nv_cvt_float_to_fp8(v[e] / scale, __NV_SATFINITE, __NV_E4M3);
    if (lane == 0) scales[tile] = static_cast<uint8_t>(__float_as_uint(scale) >> 23);  // ue8m0: the exponent byte
  }
  __nv_bfloat16* rope = reinterpret_cast<__nv_bfloat16*>(values + V4::kNopeDim);
  for (int i = lane; i < V4::kRopeDim; i += 32) rope[i] = __float2bfloat16_rn(load(c, V4::kNopeDim + i, p.src_dtype));
}

__global__ void write_mla_cache_kernel(const CacheWriteParams p) {
  const int64_t token = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (token >= p.num_tokens) return;
  const int64_t slot = p.slot_mapping[token * p.slot_stride];
  if (slot < 0 || slot >= p.num_slots) return;  // skipped, never written out of bounds
  uint8_t* block = p.cache + (slot / p.block_size) * p.block_stride;
  uint8_t* row = block + (slot % p.block_size) * p.row_stride;
  const void* c = static_cast<const char*>(p.latent) + token * p.latent_stride * (p.src_dtype == DType::f32 ? 4 : 2);
  const void* kpe = static_cast<const char*>(p.k_pe) + token * p.k_pe_stride * (p.src_dtype == DType::f32 ? 4 : 2);

  if (p.cache_dtype == DType::fp8_ds_mla_v4) {
    write_v4_token(p, c, block, slot % p.block_size, lane);
  } else if (p.cache_dtype == DType::fp8_ds_mla || p.cache_dtype == DType::fp8_ds_mla_nope) {
    for (int tile = 0; tile < 4; ++tile) {
      float v[4], amax = 0.f;
      for (int e = 0; e < 4; ++e) {
        v[e] = load(c, tile * 128 + lane * 4 + e, p.src_dtype);
        amax = fmaxf(amax, fabsf(v[e]));
      }
      for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
      const float scale = tile_scale(amax);
      for (int e = 0; e < 4; ++e)
        row[tile * 128 + lane * 4 + e] = __nv_cvt_float_to_fp8(v[e] / scale, __NV_SATFINITE, __NV_E4M3);
      if (lane == 0) reinterpret_cast<float*>(row + 512)[tile] = scale;
    }
    __nv_bfloat16* rope = reinterpret_cast<__nv_bfloat16*>(row + 528);
    for (int i = lane; i < p.rope_dim; i += 32) rope[i] = __float2bfloat16_rn(load(kpe, i, p.src_dtype));
  } else if (p.cache_dtype == DType::bf16) {
    __nv_bfloat16* out = reinterpret_cast<__nv_bfloat16*>(row);
    for (int i = lane; i < 512; i += 32) out[i] = __float2bfloat16_rn(load(c, i, p.src_dtype));
    for (int i = lane; i < p.rope_dim; i += 32) out[512 + i] = __float2bfloat16_rn(load(kpe, i, p.src_dtype));
  } else {
    __half* out = reinterpret_cast<__half*>(row);
    for (int i = lane; i < 512; i += 32) out[i] = __float2half_rn(load(c, i, p.src_dtype));
    for (int i = lane; i < p.rope_dim; i += 32) out[512 + i] = __float2half_rn(load(kpe, i, p.src_dtype));
  }
}

}  // namespace

void write_mla_cache(const WriteMlaCacheArgs& a) {
  CacheWriteParams p{};
  const int64_t elem = static_cast<int64_t>(dtype_size(a.cache.dtype));
  p.rope_dim = written_head(a).rope_dim;
  p.latent = a.latent.data;
  p.k_pe = a.k_pe.data;
  p.src_dtype = a.latent.dtype;
  p.latent_stride = a.latent.stride(0);
  p.k_pe_stride = p.rope_dim ? a.k_pe.stride(0) : 0;
  p.slot_mapping = a.slot_mapping.ptr<int64_t>();
  p.slot_stride = a.slot_mapping.stride(0);
  p.num_tokens = a.latent.size(0);
  p.num_slots = a.cache.size(0) * a.cache.size(1);
  p.cache = a.cache.ptr<uint8_t>();
  p.cache_dtype = a.cache.dtype;
  p.block_stride = a.cache.stride(0) * elem;
  p.row_stride = a.cache.stride(1) * elem;
  p.block_size = static_cast<int>(a.cache.size(1));
  if (is_fp8_mla_cache(a.cache.dtype))
    require(reinterpret_cast<uintptr_t>(p.cache) % 4 == 0 && p.row_stride % 4 == 0 && p.block_stride % 4 == 0,
            "write_mla_cache: cache: the fp8 tile scales need 4-byte aligned rows");
  if (a.cache.dtype == DType::fp8_ds_mla_v4)
    require(reinterpret_cast<uintptr_t>(p.cache) % 2 == 0 && p.block_stride % 2 == 0,
            "write_mla_cache: cache: fp8_ds_mla_v4's bf16 rope values need 2-byte aligned blocks");
  if (p.num_tokens == 0) return;
  constexpr int kThreads = 256;
  const int64_t blocks = (p.num_tokens * 32 + kThreads - 1) / kThreads;
  launch_kernel(write_mla_cache_kernel, static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(a.stream),
                "smla write_mla_cache kernel", p);
}

}  // namespace smla::cuda
