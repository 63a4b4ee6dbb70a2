// write_index_cache, write_pooled_index_cache, rotate_index_q, positions_to_slots
// and pools_to_positions on the GPU: one warp per key row (or query head), one
// thread per position. Index values that the CPU backend rejects are
// skipped (or mapped to -1) here, never read or written out of bounds.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <string>

#include "cuda/common/runtime.h"
#include "cuda/indexer/indexer_common.cuh"
#include "cuda/kernels.h"

namespace smla::cuda {

namespace {

struct IndexWriteParams {
  const void* k;
  DType k_dtype;
  int64_t k_stride;  // elements
  const int64_t* slot_mapping;
  int64_t slot_stride, num_tokens, num_slots;
  IndexCacheLayout cache;
};

__device__ __forceinline__ float load(const void* base, int64_t i, DType d) {
  switch (d) {
    case DType::bf16: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
    case DType::f16: return __half2float(static_cast<const __half*>(base)[i]);
    default: return static_cast<const float*>(base)[i];
  }
}

// numeric::index_key_scale: max(amax, 1e-4) / 448 rounded up to a power of two.
__device__ __forceinline__ float index_key_scale(float amax) {
  const uint32_t u = __float_as_uint(fmaxf(amax, 1e-4f) / 448.f);
  return (u & 0x7fffffu) == 0 ? __uint_as_float(u) : __uint_as_float((u & 0x7f800000u) + 0x800000u);
}

// Stores one index key (dims lane * 4 + e of the warp) at `slot`: bf16, or fp8 e4m3 with its ue8m0 scale.
__device__ void store_index_key(const IndexCacheLayout& cache, int64_t slot, const float v[4], int lane) {
  const int64_t block = slot / cache.block_size, off = slot % cache.block_size;
  uint8_t* base = cache.data + block * cache.block_stride;
  if (cache.fp8) {
    float amax = 0.f;
    for (int e = 0; e < 4; ++e) amax = fmaxf(amax, fabsf(v[e]));
    for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float scale = index_key_scale(amax);
    for (int e = 0; e < 4; ++e)
      base[off * 128 + lane * 4 + e] = __nv_cvt_float_to_fp8(v[e] / scale, __NV_SATFINITE, __NV_E4M3);
    if (lane == 0) *reinterpret_cast<float*>(base + cache.block_size * 128 + off * 4) = scale;
  } else {
    __nv_bfloat16* row = reinterpret_cast<__nv_bfloat16*>(base + off * cache.row_stride);
    for (int e = 0; e < 4; ++e) row[lane * 4 + e] = __float2bfloat16_rn(v[e]);
  }
}

__global__ void write_index_cache_kernel(const IndexWriteParams p) {
  const int64_t token = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (token >= p.num_tokens) return;
  const int64_t slot = p.slot_mapping[token * p.slot_stride];
  if (slot < 0 || slot >= p.num_slots) return;
  const char* src = static_cast<const char*>(p.k) + token * p.k_stride * (p.k_dtype == DType::f32 ? 4 : 2);
  float v[4];
  for (int e = 0; e < 4; ++e) v[e] = load(src, lane * 4 + e, p.k_dtype);
  store_index_key(p.cache, slot, v, lane);
}

struct PooledWriteParams {
  const void* k;
  const void* gate;
  DType dtype;
  int64_t k_stride0, k_stride1, gate_stride0, gate_stride1;  // elements
  const float* ape;
  int64_t ape_stride;
  int kpool;
  bool hadamard;
  const int64_t* slot_mapping;
  int64_t slot_stride, num_pools, num_slots;
  IndexCacheLayout cache;
};

__device__ __forceinline__ float round_to_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// numeric::hadamard128 over a warp's 128 values (lane * 4 + e), the same butterflies in the same order (widths 1
// and 2 inside a lane, 4..64 across lanes), then 128^-0.5, each result rounded to bf16.
__device__ void hadamard128_bf16(float x[4], int lane) {
  for (int width = 1; width < 4; width *= 2)
    for (int e = 0; e < 4; ++e)
      if (!(e & width)) {
        const float a = x[e], b = x[e + width];
        x[e] = a + b;
        x[e + width] = a - b;
      }
  for (int lanes = 1; lanes < 32; lanes *= 2)
    for (int e = 0; e < 4; ++e) {
      const float other = __shfl_xor_sync(0xffffffffu, x[e], lanes);
      x[e] = (lane & lanes) ? other - x[e] : x[e] + other;
    }
  for (int e = 0; e < 4; ++e) x[e] = round_to_bf16(x[e] * 0.08838834764831845f);
}

// One warp per pool, 4 dims per lane (d = lane * 4 + e), the CPU's arithmetic in the CPU's order: per dimension
// the softmax over the pool of gate + ape weighting the keys, bf16, the Walsh-Hadamard butterflies (widths 1 and 2
// inside a lane, 4..64 across lanes), 128^-0.5, bf16, then stored as write_index_cache stores a key.
__global__ void write_pooled_index_cache_kernel(const PooledWriteParams p) {
  const int64_t pool = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (pool >= p.num_pools) return;
  const int64_t slot = p.slot_mapping[pool * p.slot_stride];
  if (slot < 0 || slot >= p.num_slots) return;
  float max_score[4], denom[4] = {}, x[4] = {};
  for (int e = 0; e < 4; ++e) max_score[e] = -INFINITY;
  auto score = [&](int m, int e) {
    const int d = lane * 4 + e;
    return load(p.gate, pool * p.gate_stride0 + m * p.gate_stride1 + d, p.dtype) + p.ape[m * p.ape_stride + d];
  };
  for (int m = 0; m < p.kpool; ++m)
    for (int e = 0; e < 4; ++e) max_score[e] = fmaxf(max_score[e], score(m, e));
  for (int m = 0; m < p.kpool; ++m)
    for (int e = 0; e < 4; ++e) {
      const float w = expf(score(m, e) - max_score[e]);
      denom[e] += w;
      x[e] += w * load(p.k, pool * p.k_stride0 + m * p.k_stride1 + lane * 4 + e, p.dtype);
    }
  for (int e = 0; e < 4; ++e) x[e] = round_to_bf16(x[e] / denom[e]);
  if (p.hadamard) hadamard128_bf16(x, lane);
  store_index_key(p.cache, slot, x, lane);
}

struct RotateQParams {
  const void* q;
  DType q_dtype;
  int64_t q_stride0, q_stride1;  // elements
  void* out;
  bool fp8;
  int64_t out_stride0, out_stride1;
  float* q_scale;
  int64_t scale_stride0, scale_stride1;
  int64_t tokens, heads;
};

// One warp per (token, head): the rotation, then bf16 out, or e4m3 with its ue8m0 scale (numeric::index_key_scale).
__global__ void rotate_index_q_kernel(const RotateQParams p) {
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= p.tokens * p.heads) return;
  const int64_t t = row / p.heads, h = row % p.heads;
  float x[4];
  for (int e = 0; e < 4; ++e) x[e] = load(p.q, t * p.q_stride0 + h * p.q_stride1 + lane * 4 + e, p.q_dtype);
  hadamard128_bf16(x, lane);
  const int64_t out = t * p.out_stride0 + h * p.out_stride1 + lane * 4;
  if (!p.fp8) {
    for (int e = 0; e < 4; ++e) static_cast<__nv_bfloat16*>(p.out)[out + e] = __float2bfloat16_rn(x[e]);
    return;
  }
  float amax = 0.f;
  for (int e = 0; e < 4; ++e) amax = fmaxf(amax, fabsf(x[e]));
  for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float scale = index_key_scale(amax);
  for (int e = 0; e < 4; ++e)
    static_cast<uint8_t*>(p.out)[out + e] = __nv_cvt_float_to_fp8(x[e] / scale, __NV_SATFINITE, __NV_E4M3);
  if (lane == 0) p.q_scale[t * p.scale_stride0 + h * p.scale_stride1] = scale;
}

struct PoolsToPositionsParams {
  const int32_t* pools;
  int64_t pools_stride;
  const int32_t* context_lens;
  int64_t ctx_stride;
  int kpool;
  int32_t* positions;
  int64_t positions_stride;
  int64_t tokens, kp, width;
};

// One thread per output position: a selected pool's token, or one of the tail's; a negative context has none.
__global__ void pools_to_positions_kernel(const PoolsToPositionsParams p) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= p.tokens * p.width) return;
  const int64_t t = i / p.width, c = i % p.width;
  const int64_t context = max(p.context_lens[t * p.ctx_stride], 0);
  const int64_t whole_pools = context / p.kpool;
  int64_t position = -1;
  if (c < p.kp * p.kpool) {
    const int64_t pool = p.pools[t * p.pools_stride + c / p.kpool];
    if (pool >= 0 && pool < whole_pools) position = pool * p.kpool + c % p.kpool;
  } else {
    const int64_t tail = whole_pools * p.kpool + c - p.kp * p.kpool;
    if (tail < context) position = tail;
  }
  p.positions[t * p.positions_stride + c] = static_cast<int32_t>(position);
}

struct SlotsParams {
  const int32_t* positions;
  int64_t pos_stride;
  const int32_t* request_ids;
  int64_t req_stride;
  SlotMap map;
  int32_t* slots;
  int64_t slots_stride;
  int64_t tokens, k;
};

__global__ void positions_to_slots_kernel(const SlotsParams p) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= p.tokens * p.k) return;
  const int64_t t = i / p.k, c = i % p.k;
  p.slots[t * p.slots_stride + c] = p.map.slot(p.request_ids[t * p.req_stride], p.positions[t * p.pos_stride + c]);
}

// The cache a writer stores keys into; an fp8 one must have 4-byte aligned blocks for its fp32 scales.
IndexCacheLayout writable_index_cache(const TensorView& cache, const char* op) {
  const IndexCacheLayout layout = index_cache_layout(cache);
  if (layout.fp8 && (reinterpret_cast<uintptr_t>(layout.data) % 4 != 0 || layout.block_stride % 4 != 0))
    fail(std::string(op) + ": cache: the fp8 scales need 4-byte aligned blocks");
  return layout;
}

// Launches `kernel(p)` on `stream` with a thread per item (a warp per row: 32 items a row), 256 threads a block;
// no launch when there are no items.
template <class Params>
void launch_per_item(void (*kernel)(Params), const Params& p, int64_t items, void* stream, const char* what) {
  if (items == 0) return;
  constexpr int kThreads = 256;
  const auto blocks = static_cast<unsigned>((items + kThreads - 1) / kThreads);
  launch_kernel(kernel, blocks, kThreads, 0, static_cast<cudaStream_t>(stream), what, p);
}

}  // namespace

void write_index_cache(const WriteIndexCacheArgs& a) {
  IndexWriteParams p{};
  p.k = a.k.data;
  p.k_dtype = a.k.dtype;
  p.k_stride = a.k.stride(0);
  p.slot_mapping = a.slot_mapping.ptr<int64_t>();
  p.slot_stride = a.slot_mapping.stride(0);
  p.num_tokens = a.k.size(0);
  p.num_slots = a.cache.size(0) * a.cache.size(1);
  p.cache = writable_index_cache(a.cache, "write_index_cache");
  launch_per_item(write_index_cache_kernel, p, p.num_tokens * 32, a.stream, "smla write_index_cache kernel");
}

void write_pooled_index_cache(const WritePooledIndexCacheArgs& a) {
  PooledWriteParams p{};
  p.k = a.k.data;
  p.gate = a.gate.data;
  p.dtype = a.k.dtype;
  p.k_stride0 = a.k.stride(0);
  p.k_stride1 = a.k.stride(1);
  p.gate_stride0 = a.gate.stride(0);
  p.gate_stride1 = a.gate.stride(1);
  p.ape = a.ape.ptr<float>();
  p.ape_stride = a.ape.stride(0);
  p.kpool = static_cast<int>(a.k.size(1));
  p.hadamard = a.hadamard;
  p.slot_mapping = a.slot_mapping.ptr<int64_t>();
  p.slot_stride = a.slot_mapping.stride(0);
  p.num_pools = a.k.size(0);
  p.num_slots = a.cache.size(0) * a.cache.size(1);
  p.cache = writable_index_cache(a.cache, "write_pooled_index_cache");
  launch_per_item(write_pooled_index_cache_kernel, p, p.num_pools * 32, a.stream,
                  "smla write_pooled_index_cache kernel");
}

void pools_to_positions(const PoolsToPositionsArgs& a) {
  PoolsToPositionsParams p{};
  p.pools = a.pools.ptr<int32_t>();
  p.pools_stride = a.pools.stride(0);
  p.context_lens = a.context_lens.ptr<int32_t>();
  p.ctx_stride = a.context_lens.stride(0);
  p.kpool = a.kpool;
  p.positions = a.positions.ptr<int32_t>();
  p.positions_stride = a.positions.stride(0);
  p.tokens = a.pools.size(0);
  p.kp = a.pools.size(1);
  p.width = a.positions.size(1);
  launch_per_item(pools_to_positions_kernel, p, p.tokens * p.width, a.stream, "smla pools_to_positions kernel");
}

void rotate_index_q(const RotateIndexQArgs& a) {
  RotateQParams p{};
  p.q = a.q.data;
  p.q_dtype = a.q.dtype;
  p.q_stride0 = a.q.stride(0);
  p.q_stride1 = a.q.stride(1);
  p.out = a.q_out.data;
  p.fp8 = a.q_out.dtype == DType::fp8_e4m3;
  p.out_stride0 = a.q_out.stride(0);
  p.out_stride1 = a.q_out.stride(1);
  if (p.fp8) {
    p.q_scale = a.q_scale.ptr<float>();
    p.scale_stride0 = a.q_scale.stride(0);
    p.scale_stride1 = a.q_scale.stride(1);
  }
  p.tokens = a.q.size(0);
  p.heads = a.q.size(1);
  launch_per_item(rotate_index_q_kernel, p, p.tokens * p.heads * 32, a.stream, "smla rotate_index_q kernel");
}

void positions_to_slots(const PositionsToSlotsArgs& a) {
  SlotsParams p{};
  p.positions = a.positions.ptr<int32_t>();
  p.pos_stride = a.positions.stride(0);
  p.request_ids = a.request_ids.ptr<int32_t>();
  p.req_stride = a.request_ids.stride(0);
  p.map = slot_map(a);
  p.slots = a.slots.ptr<int32_t>();
  p.slots_stride = a.slots.stride(0);
  p.tokens = a.positions.size(0);
  p.k = a.positions.size(1);
  launch_per_item(positions_to_slots_kernel, p, p.tokens * p.k, a.stream, "smla positions_to_slots kernel");
}

}  // namespace smla::cuda
