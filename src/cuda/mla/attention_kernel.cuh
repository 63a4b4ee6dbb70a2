// MLA attention on tensor cores (mma.sync, SM80+): one CTA = one query token,
// 16 heads (one mma row tile) and a range of 32-key chunks. The selected
// cache rows are gathered with cp.async into shared memory (fp8 rows are
// staged and dequantised there: fp8_ds_mla's, and fp8_ds_mla_v4's, whose
// scales lie apart from the values at the block's end). The head is 576 wide
// (rope 64) or 512 (no rope part), a template parameter. Scores: each warp
// holds a quarter of the query dims in registers and computes partial scores
// for all 32 keys (four independent accumulator chains, no query reloads); the
// partials are summed in the fp32 online softmax (log2 domain). P*V: each warp
// owns 128 output columns.
#pragma once

#include <cuda_fp8.h>

#include <cfloat>

#include "cuda/common/griddep.cuh"
#include "cuda/common/step_stamps.cuh"
#include "cuda/common/mma.cuh"
#include "cuda/mla/params.h"
#include "smla/types.h"

namespace smla::cuda::mla {

constexpr int kThreads = 128;          // 4 warps
constexpr int kHeadsPerCta = 16;       // one mma row tile
constexpr int kKeysPerChunk = 32;      // 4 warps x 8 keys for the scores
constexpr int kVDim = 512, kLatent = 512;
constexpr int kSRow = kKeysPerChunk + 4;       // fp32 scores row
constexpr int kPRow = kKeysPerChunk + 8;       // 16-bit probabilities row (80 bytes, 16-byte aligned)

// The sizes that follow from the rope width: 64 (576-wide heads, mla::HeadDims<64>) or 0 (512-wide).
template <int kRope>
struct HeadDims {
  static_assert(kRope == 0 || kRope == 64, "the kernel is built for rope 64 or none");
  static constexpr int kQkDim = kLatent + kRope;
  static constexpr int kRowElems = kQkDim + 8;     // +16 bytes per row: ldmatrix rows hit distinct banks
  static constexpr int kPieces = kQkDim * 2 / 16;  // 16-byte pieces of a 16-bit row (72 | 64)
  // The bytes of an fp8 row the kernel reads: 512 e4m3 | 4 fp32 scales | 64 bf16 rope when there is one
  // (656 | 528); with rope 0 an fp8_ds_mla row's rope part is never fetched.
  static constexpr int kFp8RowBytes = kLatent + 16 + 2 * kRope;  // 41 | 33 16-byte pieces
  static constexpr int kDimsPerWarp = kQkDim / 4;                // 144 | 128 = 9 | 8 k-steps of 16
};

__host__ __device__ constexpr int row_elems(int rope) {
  return rope ? HeadDims<64>::kRowElems : HeadDims<0>::kRowElems;
}
__host__ __device__ constexpr int fp8_row_bytes(int rope) {
  return rope ? HeadDims<64>::kFp8RowBytes : HeadDims<0>::kFp8RowBytes;
}

template <CacheFormat F>
using ComputeT = std::conditional_t<F == CacheFormat::f16, __half, __nv_bfloat16>;

__host__ __device__ constexpr bool is_fp8(CacheFormat f) {
  return f == CacheFormat::fp8_ds_mla || f == CacheFormat::fp8_ds_mla_v4;
}

// How an fp8 row is staged in shared memory and dequantised: the first kE4m3 dims are e4m3 codes (byte d is dim
// d), each scaled by scale(row, d); the rest are 16-bit values from byte kTail. kStagedBytes: a staged row.
template <CacheFormat F, int kRope>
struct Fp8Row;
// fp8_ds_mla: the row's first fp8_row_bytes, as in the cache: 512 e4m3 | 4 fp32 scales | 64 bf16 rope (if kRope).
// scales(row): the row's scales, one per tile of kTileUnits 16-byte pieces of codes; scale_of(scales, tile).
template <int kRope>
struct Fp8Row<CacheFormat::fp8_ds_mla, kRope> {
  static constexpr int kE4m3 = kLatent, kTail = kLatent + 16, kStagedBytes = HeadDims<kRope>::kFp8RowBytes;
  static constexpr int kTileUnits = 128 / 16;
  __device__ static float4 scales(const uint8_t* row) { return *reinterpret_cast<const float4*>(row + kLatent); }
  __device__ static float scale_of(const float4& s, int tile) {
    return tile == 0 ? s.x : tile == 1 ? s.y : tile == 2 ? s.z : s.w;
  }
};
// fp8_ds_mla_v4 (512-wide heads): the token's 576 value bytes (448 e4m3 | 64 bf16 rope), then its 8 scale bytes
// (7 ue8m0 and the pad), gathered from the block's end into one more 16-byte piece.
// A ue8m0 scale byte: 2^(e - 127) (e = 0 the denormal 2^-127), 255 NaN, as the CPU backend reads it.
__device__ __forceinline__ float ue8m0_to_float(uint32_t e) {
  return __uint_as_float(e == 255 ? 0x7fc00000u : e == 0 ? 0x00400000u : e << 23);
}
template <>
struct Fp8Row<CacheFormat::fp8_ds_mla_v4, 0> {
  using V4 = MlaV4CacheLayout;
  static constexpr int kE4m3 = V4::kNopeDim, kTail = V4::kNopeDim, kStagedBytes = V4::kValueBytes + 16;
  static constexpr int kTileUnits = V4::kTile / 16;
  __device__ static uint2 scales(const uint8_t* row) { return *reinterpret_cast<const uint2*>(row + V4::kValueBytes); }
  __device__ static float scale_of(const uint2& s, int tile) {
    return ue8m0_to_float(((tile < 4 ? s.x : s.y) >> (8 * (tile % 4))) & 0xffu);
  }
};
__host__ __device__ constexpr int staged_row_bytes(CacheFormat f, int rope) {
  return f == CacheFormat::fp8_ds_mla_v4 ? Fp8Row<CacheFormat::fp8_ds_mla_v4, 0>::kStagedBytes : fp8_row_bytes(rope);
}

// Pipeline depth: 16-bit caches are gathered straight into `stages` key
// buffers (stages - 1 chunks in flight while one is used); fp8 rows land in
// `stages` staging buffers and are dequantised into one key buffer (stages
// chunks in flight).
__host__ __device__ constexpr int chunks_in_flight(CacheFormat f, int stages) {
  return is_fp8(f) ? stages : stages - 1;
}

// Shared-memory layout, in bytes from the start (all offsets 16-byte aligned).
// The queries pass through the last key buffer once, before it is first used.
struct SmemLayout {
  int k = 0, staging = 0, s = 0, p = 0, stats = 0, valid = 0, valid_sets = 0, total = 0, q = 0;
  __host__ __device__ constexpr SmemLayout(CacheFormat f, int stages, int rope) {
    const bool fp8 = is_fp8(f);
    const int k_buffers = fp8 ? 1 : stages;
    q = (k_buffers - 1) * kKeysPerChunk * row_elems(rope) * 2;
    staging = k + k_buffers * kKeysPerChunk * row_elems(rope) * 2;
    s = staging + (fp8 ? stages * kKeysPerChunk * staged_row_bytes(f, rope) : 0);
    p = s + 4 * kHeadsPerCta * kSRow * 4;  // one partial-score tile per warp
    stats = p + kHeadsPerCta * kPRow * 2;
    valid = stats + 3 * kHeadsPerCta * 4;
    valid_sets = chunks_in_flight(f, stages) + 1;  // the chunk in use and those in flight
    total = valid + valid_sets * kKeysPerChunk * 4;
  }
};

__device__ __forceinline__ float bits_to_float(uint16_t v, bool is_bf16) {
  return is_bf16 ? __bfloat162float(__ushort_as_bfloat16(v)) : __half2float(__ushort_as_half(v));
}

// Eight query values (bf16 or f16 bits) in the compute type T.
template <typename T>
__device__ __forceinline__ uint4 query_piece(uint4 raw, bool is_bf16) {
  auto convert = [&](uint32_t two) {
    return pack2<T>(bits_to_float(static_cast<uint16_t>(two), is_bf16),
                    bits_to_float(static_cast<uint16_t>(two >> 16), is_bf16));
  };
  return make_uint4(convert(raw.x), convert(raw.y), convert(raw.z), convert(raw.w));
}

// slot_of in two steps, for kernels that load a key's entry early and resolve it once the load has landed:
// slot_entry loads key `key`'s index (sparse) or block (paged) for token (b, j, t), -1 past the visible keys;
// entry_slot makes it the physical slot, or -1 when it must not be read.
template <bool kPaged>
__device__ __forceinline__ int32_t slot_entry(const AttentionParams& p, int t, int b, int key, int visible) {
  if (key >= visible) return -1;
  if constexpr (kPaged) return p.block_table[b * p.block_table_stride + key / p.block_size];
  else return p.indices[t * p.indices_stride + key];
}
// Whether block-table entry `entry` names one of the cache's blocks.
__device__ __forceinline__ bool block_entry_valid(const AttentionParams& p, int32_t entry) {
  return entry >= 0 && entry < p.num_blocks;
}
template <bool kPaged>
__device__ __forceinline__ int64_t entry_slot(const AttentionParams& p, int key, int32_t entry) {
  if constexpr (kPaged) {
    if (!block_entry_valid(p, entry)) return -1;
    return static_cast<int64_t>(entry) * p.block_size + key % p.block_size;
  } else {
    return (entry >= 0 && entry < p.num_slots) ? entry : -1;
  }
}
// Physical slot of key `key` of token (b, j, t), or -1 when it must not be read.
template <bool kPaged>
__device__ __forceinline__ int64_t slot_of(const AttentionParams& p, int t, int b, int key, int visible) {
  return entry_slot<kPaged>(p, key, slot_entry<kPaged>(p, t, b, key, visible));
}

// The extra list's entry for key `key` of token t (slot_entry's), -1 past its `visible` keys.
__device__ __forceinline__ int32_t extra_entry(const AttentionParams& p, int t, int key, int visible) {
  return key < visible ? p.extra.indices[t * p.extra.indices_stride + key] : -1;
}
// Physical slot of row `row` of chunk `chunk` (kChunkKeys keys) of token (b, j, t), or -1 when it must not be read.
template <bool kPaged, bool kTwoLists, int kChunkKeys>
__device__ __forceinline__ int64_t chunk_slot(const AttentionParams& p, int t, int b, int chunk, int row, int visible,
                                              const ListChunks& lists) {
  if (kTwoLists && chunk >= lists.main_chunks) {
    return list_slot(list_cache(p, true),
                     extra_entry(p, t, (chunk - lists.main_chunks) * kChunkKeys + row, lists.extra_visible));
  }
  return slot_of<kPaged>(p, t, b, chunk * kChunkKeys + row, visible);
}

// The kernel's steps, in the order it runs them. Each compiles to the same
// SASS as the code it replaced (scripts/compare-sass.py): gather_row's scalars
// are const references, as the lambda before it captured them, because passed
// by value nvcc ordered the index arithmetic differently in every kernel.

// Where 16-byte piece `piece` of row `row` lies in wgmma's K-major layout with the 128-byte swizzle, the wgmma
// kernels' tiles of kSwizzledTileRows rows: the dims in slabs of 64 16-bit values (128 bytes of a row,
// kSwizzledTileRows x 128 bytes a slab), a row's line of a slab at 128 bytes from the row before, its piece k at
// 16-byte place k ^ (row % 8). So the 8 pieces of one row's line, and one piece of 8 consecutive rows, each fall in 8
// different bank groups.
constexpr int kSwizzledTileRows = 64, kSwizzledSlabBytes = kSwizzledTileRows * 128;
__host__ __device__ constexpr int swizzled_piece_offset(int row, int piece) {
  return (piece / 8) * kSwizzledSlabBytes + row * 128 + ((piece % 8) ^ (row % 8)) * 16;
}
// The wgmma kernels' scores: S (+)= Q K^T over the 64-dim slabs [kBegin, kEnd) of the swizzled query tile `q_desc`
// and key tile `k_desc` (m64n64k16, both in shared memory; 32 bytes a k-step inside a slab's lines): issued, not
// committed. `accumulate` false: the first product overwrites s.
template <WgmmaIn kIn, int kBegin, int kEnd>
__device__ __forceinline__ void swizzled_scores(float (&s)[32], uint64_t q_desc, uint64_t k_desc, bool accumulate) {
#pragma unroll
  for (int slab = kBegin; slab < kEnd; ++slab)
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      const uint64_t step = slab * (kSwizzledSlabBytes >> 4) + ks * 2;
      wgmma_ss_n64<kIn>(s, q_desc + step, k_desc + step, accumulate || slab > kBegin || ks > 0);
    }
}

// Whether a row of this warp moved its running maximum (a factor of O's rows other than 1): where none did, O's
// rescaling is skipped (the maxima settle after the first chunks, and those multiplies sit between the products on
// O).
__device__ __forceinline__ bool warp_rows_moved(const float (&factor)[2]) {
  return __any_sync(0xffffffffu, factor[0] != 1.f || factor[1] != 1.f);
}
// O's rows (wgmma's accumulator order: element e of a thread's row rows[(e / 2) % 2]) times their factors.
template <int kN>
__device__ __forceinline__ void scale_rows(float (&o)[kN], const float (&factor)[2]) {
#pragma unroll
  for (int e = 0; e < kN; ++e) o[e] *= factor[(e / 2) % 2];
}

// A chunk's row by one bulk copy (sm_90+; every lane of the warp calls it, a row each): `kBytes` of the cache's slot
// `slot` (-1: none, not copied) into `dst`, completing on `bar`; the row's valid flag into `*flag`, written before
// lane 0's arrival (expecting the warp's bytes) releases it.
template <int kBytes>
__device__ __forceinline__ void bulk_gather_row(const AttentionParams& p, int64_t slot, uint8_t* dst, int* flag,
                                                uint64_t* bar) {
  *flag = slot >= 0;
  const int copied = __popc(__ballot_sync(0xffffffffu, slot >= 0));
  __syncwarp();  // the warp's flags before its arrival
  if (threadIdx.x % 32 == 0) mbarrier_expect_bytes(bar, copied * kBytes);
  __syncwarp();  // the bytes expected before any lands
  if (slot >= 0) {
    const int s32 = static_cast<int>(slot);  // indices are int32
    bulk_copy_to_shared(dst, p.cache + (s32 / p.block_size) * p.block_stride + (s32 % p.block_size) * p.row_stride,
                        kBytes, bar);
  }
}

// The row of a chunk and the part of it (kParts threads share a row) that thread `tid` gathers. A warp's 16-byte
// cp.async writes shared memory in four wavefronts of 8 lanes, each conflict-free only when its 8 pieces land in 8
// different 16-byte bank groups. Key rows here are 16 bytes apart in banks (rows of 16 mod 128 bytes: padded
// 16-bit rows, fp8 rows of 656 bytes), so with 2 or 4 parts the 8 lanes take one piece of 8 consecutive rows (two
// rows' 4 pieces each collided), and with 8 parts the 8 consecutive pieces of one row (one 128-byte line). Either
// way a warp instruction still reads whole 32- to 128-byte runs of its rows.
struct GatherLane {
  int row, part;
};
template <int kParts>
__device__ __forceinline__ GatherLane gather_lane(int tid) {
  static_assert(kParts == 2 || kParts == 4 || kParts == 8, "gather_lane: 2, 4 or 8 threads a row");
  if constexpr (kParts == 8) return {tid / 8, tid % 8};
  else return {tid / (8 * kParts) * 8 + tid % 8, tid % (8 * kParts) / 8};
}

// Gathers row `row` of chunk `chunk` (kChunkKeys keys) into `dst` (rows `dst_row_bytes` long): this thread's
// 16-byte pieces (`part`, part + kParts, ... below `pieces`: kParts threads share a row) one
// cp.async each (fp8_ds_mla_v4: the last piece is the token's 8 scale bytes,
// from the block's end); an invalid row is zero-filled, never read, and
// marked so in the chunk's set of `valid`. The row's slot was loaded a chunk
// earlier (`next_slot`; this loads the next chunk's, if the split has one), so
// the index load's latency is off the critical path. kTwoLists: chunks from lists.main_chunks on are the extra
// list's, read from its cache.
template <CacheFormat F, bool kPaged, int kParts = 4, int kChunkKeys = kKeysPerChunk, bool kTwoLists = false>
__device__ __forceinline__ void gather_row(const AttentionParams& p, const int& t, const int& b, const int& visible,
                                           int chunk, const int& chunk_begin, const int& n_chunks, const int& row,
                                           const int& part, int64_t& next_slot, uint8_t* dst, int dst_row_bytes,
                                           int pieces, int* valid, int valid_sets, const ListChunks& lists = {}) {
  constexpr bool kV4 = F == CacheFormat::fp8_ds_mla_v4;
  const int64_t slot = next_slot;
  if (chunk + 1 < chunk_begin + n_chunks)
    next_slot = chunk_slot<kPaged, kTwoLists, kChunkKeys>(p, t, b, chunk + 1, row, visible, lists);
  const ListCache c = list_cache(p, kTwoLists && chunk >= lists.main_chunks);
  const uint8_t *src = c.data, *scales = c.data;  // the row (fp8_ds_mla_v4: the values, and the scales)
  if (slot >= 0) {
    if constexpr (kV4) {
      using V4 = MlaV4CacheLayout;
      const int64_t offset = slot % c.block_size;
      src += (slot / c.block_size) * c.block_stride;
      scales = src + c.block_size * V4::kValueBytes + offset * V4::kScaleBytes;
      src += offset * V4::kValueBytes;
    } else {
      src += (slot / c.block_size) * c.block_stride + (slot % c.block_size) * c.row_stride;
    }
  }
  for (int piece = part; piece < pieces; piece += kParts) {
    uint8_t* to = dst + row * dst_row_bytes + piece * 16;
    if (kV4 && piece == pieces - 1) cp_async_8(to, scales, slot >= 0);
    else cp_async_16(to, src + piece * 16, slot >= 0);
  }
  if (part == 0) valid[(chunk % valid_sets) * kChunkKeys + row] = slot >= 0;
}

// Two e4m3 codes (the low or, kHigh, the high 16 bits of `codes`, low byte
// first) -> f16x2, exactly: one instruction from SM89 on (the half picked by
// the instruction itself, no shift).
template <bool kHigh = false>
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t codes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint32_t r;
  if constexpr (kHigh)
    asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, hi;\n}\n" : "=r"(r) : "r"(codes));
  else
    asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, lo;\n}\n" : "=r"(r) : "r"(codes));
  return r;
#else
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(kHigh ? codes >> 16 : codes), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | static_cast<uint32_t>(h.y) << 16;
#endif
}
// Two e4m3 codes of `codes` (as e4m3x2_to_f16x2 picks them) times `scale`, rounded once to T.
template <typename T, bool kHigh>
__device__ __forceinline__ uint32_t scaled_e4m3x2(uint32_t codes, float scale) {
  const uint32_t h = e4m3x2_to_f16x2<kHigh>(codes);
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
  return pack2<T>(f.x * scale, f.y * scale);
}

// Dequantises a chunk of kChunkKeys staged fp8 rows into the key rows `keys`, all threads
// together (the CTA's kCtaThreads; Fp8Row: e4m3 codes times their tile's scale, then the 16-bit values): rows of
// kRowElems, or (kSwizzled) the wgmma kernel's swizzled tile. A thread keeps one row and takes every
// kGroups-th 16-byte unit of it (16 codes, or 8 16-bit values), so a warp's lanes read and write one unit of
// consecutive rows: distinct bank groups, as staged and key rows are an odd number of 16-byte pieces apart (or 8
// rows' same piece lie at 8 swizzled places). It loads kBatch units before converting them, with no
// division or branch per unit: 424 instructions a thread for a chunk of 576-wide rows in the 16-head tile (sm_90a),
// where a piece at a time took about 750, each piece's loads, conversion and store one dependent chain.
// `invalid`: this thread's row is not one to read (the wgmma kernel's staging holds whatever was there): zeros.
// Only units [kUnitBegin, kUnitEnd) of each row where given (-1: to the last; units of 16 codes come first, then
// those of 8 16-bit values), kUnitBegin a multiple of the threads a row.
template <CacheFormat F, typename T, int kRope, int kCtaThreads = kThreads, int kChunkKeys = kKeysPerChunk,
          bool kSwizzled = false, int kUnitBegin = 0, int kUnitEnd = -1>
__device__ __forceinline__ void dequantise_chunk(const uint8_t* rows, T* keys, int tid, bool invalid = false) {
  using D = HeadDims<kRope>;
  using R = Fp8Row<F, kRope>;
  static_assert(kCtaThreads % kChunkKeys == 0, "dequantise_chunk: the same number of threads for every row");
  constexpr int kGroups = kCtaThreads / kChunkKeys;  // threads a row
  constexpr int kCodeUnits = R::kE4m3 / 16, kAllUnits = kCodeUnits + (D::kQkDim - R::kE4m3) / 8;
  constexpr int kEnd = kUnitEnd < 0 ? kAllUnits : kUnitEnd, kUnits = kEnd - kUnitBegin;
  static_assert(kUnitBegin % kGroups == 0 && kUnits > 0 && kEnd <= kAllUnits, "dequantise_chunk: a unit range");
  constexpr int kPerThread = (kUnits + kGroups - 1) / kGroups;
  constexpr int kBatch = 2;  // units loaded before any is converted: 4 took the wide and wgmma kernels to 255 registers
  const int row = tid % kChunkKeys, first = tid / kChunkKeys;  // this thread's units: first + k * kGroups on
  const uint8_t* src = rows + row * R::kStagedBytes;
  // Whether unit k of this thread exists and holds codes; known at compile time where kGroups divides the counts.
  constexpr int kRangeCodeUnits = kCodeUnits < kUnitBegin ? 0 : (kCodeUnits < kEnd ? kCodeUnits : kEnd) - kUnitBegin;
  const auto exists = [&](int k) { return kUnits % kGroups == 0 || first + k * kGroups < kUnits; };
  const auto holds_codes = [&](int k) {
    return kRangeCodeUnits % kGroups == 0 ? k < kRangeCodeUnits / kGroups : first + k * kGroups < kRangeCodeUnits;
  };
  const auto store = [&](int piece, const uint4& v) {
    if constexpr (kSwizzled)
      *reinterpret_cast<uint4*>(reinterpret_cast<uint8_t*>(keys) + swizzled_piece_offset(row, piece)) = v;
    else
      *reinterpret_cast<uint4*>(keys + row * D::kRowElems + piece * 8) = v;
  };
  const auto scales = R::scales(src);
  const uint32_t keep = invalid ? 0u : ~0u;  // codes and 16-bit values masked, and the scale 0 (it may be NaN)
#pragma unroll
  for (int k0 = 0; k0 < kPerThread; k0 += kBatch) {
    uint4 raw[kBatch];
#pragma unroll
    for (int k = k0; k < k0 + kBatch && k < kPerThread; ++k) {
      const int u = kUnitBegin + first + k * kGroups;
      if (exists(k)) {
        raw[k - k0] = *reinterpret_cast<const uint4*>(src + (holds_codes(k) ? u * 16 : R::kTail + (u - kCodeUnits) * 16));
        raw[k - k0] = make_uint4(raw[k - k0].x & keep, raw[k - k0].y & keep, raw[k - k0].z & keep, raw[k - k0].w & keep);
      }
    }
#pragma unroll
    for (int k = k0; k < k0 + kBatch && k < kPerThread; ++k) {
      const int u = kUnitBegin + first + k * kGroups;
      const uint4& r = raw[k - k0];
      if (!exists(k)) continue;
      if (holds_codes(k)) {  // dims 16u .. 16u + 15: output pieces 2u and 2u + 1
        const int tile =
            R::kTileUnits % kGroups == 0 ? (kUnitBegin + k * kGroups) / R::kTileUnits : u / R::kTileUnits;
        const float s = invalid ? 0.f : R::scale_of(scales, tile);
        store(2 * u, make_uint4(scaled_e4m3x2<T, false>(r.x, s), scaled_e4m3x2<T, true>(r.x, s),
                                scaled_e4m3x2<T, false>(r.y, s), scaled_e4m3x2<T, true>(r.y, s)));
        store(2 * u + 1, make_uint4(scaled_e4m3x2<T, false>(r.z, s), scaled_e4m3x2<T, true>(r.z, s),
                                    scaled_e4m3x2<T, false>(r.w, s), scaled_e4m3x2<T, true>(r.w, s)));
      } else {
        store(2 * kCodeUnits + u - kCodeUnits, r);  // 8 16-bit values as cached
      }
    }
  }
}

// Scores, step 1: this warp's partial scores of the 16 heads x 32 keys of
// `kt` (row-major [32][kRowElems]) over its quarter of the query dims (`qa`),
// into its tile of `ss`. Four independent accumulator chains.
template <typename T, int kRope>
__device__ __forceinline__ void partial_scores(const T* kt, const uint32_t (&qa)[HeadDims<kRope>::kDimsPerWarp / 16][4],
                                               float* ss, int warp, int lane) {
  using D = HeadDims<kRope>;
  float acc[4][4] = {};  // partial scores of keys 8n..8n+7 over this warp's dims
#pragma unroll
  for (int ks = 0; ks < D::kDimsPerWarp / 16; ++ks) {
    const int dim = warp * D::kDimsPerWarp + ks * 16;
#pragma unroll
    for (int n = 0; n < 4; n += 2) {
      uint32_t bk[4];  // keys 8n..8n+15, dims dim..dim+15
      ldmatrix_x4(bk, kt + (n * 8 + lane % 8 + (lane / 16) * 8) * D::kRowElems + dim + ((lane / 8) % 2) * 8);
      mma_16816<T>(acc[n], qa[ks], {bk[0], bk[1]});
      mma_16816<T>(acc[n + 1], qa[ks], {bk[2], bk[3]});
    }
  }
  const int g = lane / 4;
  float* part = ss + warp * kHeadsPerCta * kSRow;
#pragma unroll
  for (int n = 0; n < 4; ++n) {
    const int c = n * 8 + (lane % 4) * 2;
    part[g * kSRow + c] = acc[n][0];
    part[g * kSRow + c + 1] = acc[n][1];
    part[(g + 8) * kSRow + c] = acc[n][2];
    part[(g + 8) * kSRow + c + 1] = acc[n][3];
  }
}

// What a CTA of `heads_per_cta` heads works on (blockIdx.x: token x head group, blockIdx.y: split): query token t
// (request b, step j), heads h0 .. h0 + nh - 1 and split `split` of its keys.
struct CtaWork {
  int t, h0, nh, split, b, j;
};
__device__ __forceinline__ CtaWork cta_work(const AttentionParams& p, int heads_per_cta) {
  const int head_groups = (p.num_heads + heads_per_cta - 1) / heads_per_cta;
  const int t = blockIdx.x / head_groups, h0 = (blockIdx.x % head_groups) * heads_per_cta;
  return {t, h0, min(heads_per_cta, p.num_heads - h0), static_cast<int>(blockIdx.y), t / p.s_q, t % p.s_q};
}

// The CTA's first query row (head w.h0 of its token), rows p.q_stride_h elements apart.
__device__ __forceinline__ const uint16_t* cta_queries(const AttentionParams& p, const CtaWork& w) {
  return p.q + w.b * p.q_stride_b + w.j * p.q_stride_s + w.h0 * p.q_stride_h;
}

// The CTA's queries (kRows rows of kPieces 16-byte pieces, rows past w.nh zero) in the compute type T, into
// `dst + offset(row, piece)`; the CTA's kCtaThreads threads together, row after row (8 consecutive threads read a
// 128-byte line). Each thread issues all its loads before it stores any: one memory round trip, where a loop of load
// then store took one a piece (64 KB of queries, ~11 pieces a thread in the wgmma kernels: several microseconds of
// a CTA that reads 640 keys). Before wait_for_prerequisites: no kernel the attention follows writes them.
template <typename T, int kRows, int kPieces, int kCtaThreads, class Offset>
__device__ __forceinline__ void stage_queries(const AttentionParams& p, const CtaWork& w, uint8_t* dst, int tid,
                                              Offset offset) {
  constexpr int kTotal = kRows * kPieces, kPerThread = (kTotal + kCtaThreads - 1) / kCtaThreads;
  const uint16_t* const q = cta_queries(p, w);
  uint4 raw[kPerThread];
#pragma unroll
  for (int r = 0; r < kPerThread; ++r) {
    const int i = tid + r * kCtaThreads, row = i / kPieces, piece = i % kPieces;
    raw[r] = i < kTotal && row < w.nh ? *reinterpret_cast<const uint4*>(q + row * p.q_stride_h + piece * 8)
                                      : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int r = 0; r < kPerThread; ++r) {
    const int i = tid + r * kCtaThreads;
    if (i < kTotal) *reinterpret_cast<uint4*>(dst + offset(i / kPieces, i % kPieces)) = query_piece<T>(raw[r], p.q_is_bf16);
  }
}

// stage_queries by cp.async, where the queries are in the compute type already (no conversion): kThreads threads'
// copies issued and committed, not waited for (cp_async_wait<0>, fence_shared_for_async_proxy and a barrier of
// those threads before the queries are read), so that other work (a producer's first gather) overlaps them.
template <int kRows, int kPieces, int kThreads, class Offset>
__device__ __forceinline__ void copy_queries(const AttentionParams& p, const CtaWork& w, uint8_t* dst, int tid,
                                             Offset offset) {
  const uint16_t* const q = cta_queries(p, w);
  for (int i = tid; i < kRows * kPieces; i += kThreads) {
    const int row = i / kPieces, piece = i % kPieces;
    cp_async_16(dst + offset(row, piece), q + (row < w.nh ? row : 0) * p.q_stride_h + piece * 8, row < w.nh);
  }
  cp_async_commit();
}

// The end of a split for head h: the factor of its output row (1 / its sum `l`, and the sink where the keys are not
// split), and, where `stats`, the row's lse and max score (`m`, log2 units) into lse / max_logits or the split's
// partial ones.
__device__ __forceinline__ float finish_head_row(const AttentionParams& p, int t, int b, int j, int split, int h,
                                                 float m, float l, bool stats) {
  const float ln2 = 0.6931471805599453f;
  const float lse2 = l > 0.f ? m + log2f(l) : -INFINITY;
  float scale = l > 0.f ? 1.f / l : 0.f;
  if (p.num_splits == 1) {
    if (p.attn_sink && l > 0.f) scale /= 1.f + expf(p.attn_sink[h] - lse2 * ln2);
    if (stats) {
      p.lse[b * p.lse_stride_b + j * p.lse_stride_s + h * p.lse_stride_h] = l > 0.f ? lse2 * ln2 : p.empty_lse;
      if (p.max_logits) p.max_logits[t * p.max_logits_stride_t + h * p.max_logits_stride_h] = m * ln2;
    }
  } else if (stats) {
    const int64_t row = (static_cast<int64_t>(split) * p.num_tokens + t) * p.num_heads + h;
    p.partial_lse[row] = lse2;
    p.partial_max[row] = m;
  }
  return scale;
}

// Where head h's output row starts: out's (an element offset, 16-bit) or the split's partial row (floats).
__device__ __forceinline__ int64_t out_row_offset(const AttentionParams& p, int b, int j, int h) {
  return b * p.out_stride_b + j * p.out_stride_s + h * p.out_stride_h;
}
__device__ __forceinline__ float* partial_row(const AttentionParams& p, int t, int split, int h) {
  return p.partial_out + ((static_cast<int64_t>(split) * p.num_tokens + t) * p.num_heads + h) * kVDim;
}

// The end of a split: head h's row of this warp's 128 output columns, which this thread holds in rows 2 * half and
// 2 * half + 1 of `o` (n-tile n at columns col0 + 8n, col0 + 8n + 1), normalised (finish_head_row), into out, or the
// split's partial row.
__device__ __forceinline__ void store_head_row(const AttentionParams& p, const float (&o)[16][4], int half, int t,
                                               int b, int j, int split, int h, int col0, float m, float l,
                                               bool stats) {
  const float scale = finish_head_row(p, t, b, j, split, h, m, l, stats);
  if (p.num_splits == 1) {
    uint16_t* const out = static_cast<uint16_t*>(p.out) + out_row_offset(p, b, j, h);
#pragma unroll
    for (int n = 0; n < 16; ++n) {
      const uint32_t v = p.q_is_bf16 ? pack2<__nv_bfloat16>(o[n][2 * half] * scale, o[n][2 * half + 1] * scale)
                                     : pack2<__half>(o[n][2 * half] * scale, o[n][2 * half + 1] * scale);
      *reinterpret_cast<uint32_t*>(out + col0 + n * 8) = v;
    }
  } else {
    float* const po = partial_row(p, t, split, h);
#pragma unroll
    for (int n = 0; n < 16; ++n)
      *reinterpret_cast<float2*>(po + col0 + n * 8) = make_float2(o[n][2 * half] * scale, o[n][2 * half + 1] * scale);
  }
}

// The end of a split in the wgmma kernels: a warpgroup's 256 output columns from `col0` (its thread's quad
// position c included: col0 + 2c) of its 64 rows, `o_at(i)` the thread's element i of them in wgmma's accumulator
// order (4j + e: column 8j + 2c + e % 2 of row rows[e / 2]), through store_head_row; rows at or past `nh` are
// padding. `stats`: this thread writes its rows' lse and max score.
template <class OAt>
__device__ __forceinline__ void store_warpgroup_rows(const AttentionParams& p, OAt o_at, const int (&rows)[2], int nh,
                                                     int t, int b, int j, int split, int h0, int col0,
                                                     const float (&m)[2], const float (&l)[2], bool stats) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (rows[r] >= nh) continue;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float cols[16][4];  // 128 columns in store_head_row's order
#pragma unroll
      for (int n = 0; n < 16; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) cols[n][e] = o_at(64 * half + 4 * n + e);
      store_head_row(p, cols, r, t, b, j, split, h0 + rows[r], col0 + 128 * half, m[r], l[r], stats && half == 0);
    }
  }
}

// store_warpgroup_rows through shared memory (sm_90, the wgmma kernels), where the keys are not split: the
// warpgroup's 64 rows x 256 columns (from `col0`, this thread's c not included) normalised into `stage`
// (kStagedRowsBytes: row after row, at a pitch that puts a quad's 8 rows in different banks), then one bulk copy a
// row into out. In place of 64 4-byte stores a thread, which queued behind each other: the pairs kernel's last phase
// was 15% of its stall samples at DeepSeek-V4's 640 keys (ncu, stalls on the store queue); 8-9% faster there. Not for
// a split's partial rows: at 1-16 tokens, where splits run, the stage's barrier and copies lengthened each CTA more
// than the fp32 stores did (7-12%). out's rows must be 16-byte aligned (`stores_staged`; store_warpgroup_rows
// otherwise). `barrier`: a named barrier id this warpgroup alone uses.
constexpr int kStagedColumns = kVDim / 2;                        // a warpgroup's
constexpr int kStagedPitch = kStagedColumns * 2 + 16;            // bytes a 16-bit row, + 16: 4 banks on
constexpr int kStagedRowsBytes = 64 * kStagedPitch;              // a warpgroup's stage
__device__ __forceinline__ bool stores_staged(const AttentionParams& p) {
  const auto strides = static_cast<uintptr_t>(p.out_stride_b | p.out_stride_s | p.out_stride_h);
  return p.num_splits == 1 && ((reinterpret_cast<uintptr_t>(p.out) | strides * 2) & 15) == 0;
}
template <class OAt>
__device__ __forceinline__ void store_warpgroup_rows_staged(const AttentionParams& p, OAt o_at, const int (&rows)[2],
                                                            int nh, int t, int b, int j, int h0, int col0,
                                                            const float (&m)[2], const float (&l)[2], bool stats,
                                                            uint8_t* stage, int wtid, int barrier) {
  const int c = wtid % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float scale = rows[r] < nh ? finish_head_row(p, t, b, j, 0, h0 + rows[r], m[r], l[r], stats) : 0.f;
    uint8_t* const row = stage + rows[r] * kStagedPitch + 4 * c;
#pragma unroll
    for (int jj = 0; jj < 32; ++jj) {
      const float v0 = o_at(4 * jj + 2 * r) * scale, v1 = o_at(4 * jj + 2 * r + 1) * scale;
      *reinterpret_cast<uint32_t*>(row + 16 * jj) = p.q_is_bf16 ? pack2<__nv_bfloat16>(v0, v1) : pack2<__half>(v0, v1);
    }
  }
  fence_shared_for_async_proxy();
  named_barrier_sync(barrier, 128);
  if (wtid < nh) {  // nh <= 64
    bulk_copy_to_global(static_cast<uint16_t*>(p.out) + out_row_offset(p, b, j, h0 + wtid) + col0,
                        stage + wtid * kStagedPitch, kStagedColumns * 2);
    bulk_copies_read_wait();
  }
}

// kTwoLists: sparse_mla's two caches in one launch (p.extra; key_range).
template <CacheFormat F, int kRope, bool kPaged, int kStages, bool kTwoLists = false>
__global__ void __launch_bounds__(kThreads) attention_kernel(const AttentionParams p) {
  static_assert(!(kTwoLists && kPaged), "two key lists are sparse_mla's");
  using T = ComputeT<F>;
  using D = HeadDims<kRope>;
  constexpr int kRowElems = D::kRowElems, kPieces = D::kPieces, kDimsPerWarp = D::kDimsPerWarp;
  constexpr bool kFp8 = is_fp8(F), kV4 = F == CacheFormat::fp8_ds_mla_v4;
  static_assert(!kV4 || kRope == 0, "fp8_ds_mla_v4 holds 512-wide heads");
  constexpr int kFp8RowBytes = kFp8 ? staged_row_bytes(F, kRope) : 0, kFp8Pieces = kFp8RowBytes / 16;
  constexpr SmemLayout L(F, kStages, kRope);
  extern __shared__ __align__(16) uint8_t smem[];
  T* sk = reinterpret_cast<T*>(smem + L.k);
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
  SMLA_STAMP_START_END(p, kAttnFirstStart, kAttnLastEnd);

  // The queries' loads first, each thread all its pieces before storing any (one memory round trip, which bounds
  // the latency of few-chunk splits), issued before the wait below; they are converted after the gather starts.
  const uint16_t* q = p.q + b * p.q_stride_b + j * p.q_stride_s + h0 * p.q_stride_h;
  constexpr int kQPerThread = (kHeadsPerCta * kPieces + kThreads - 1) / kThreads;
  uint4 q_raw[kQPerThread];
#pragma unroll
  for (int r = 0; r < kQPerThread; ++r) {
    const int i = tid + r * kThreads, row = i / kPieces;
    q_raw[r] = i < kHeadsPerCta * kPieces && row < nh
                   ? *reinterpret_cast<const uint4*>(q + row * p.q_stride_h + (i % kPieces) * 8)
                   : make_uint4(0, 0, 0, 0);
  }
  if (tid < kHeadsPerCta) {
    row_max[tid] = -INFINITY;
    row_sum[tid] = 0.f;
  }
  // Everything from here reads what the kernel before may write (indices, cache) when dsa_decode_step launches
  // this one as the top-k's programmatic dependent; without that launch the wait returns at once.
  wait_for_prerequisites();
  SMLA_STAMP(p, kAttnWaited);
  const KeyRange keys = key_range<kPaged, kTwoLists>(p, t, b, j, split, kKeysPerChunk);
  const ChunkRange range = keys.range;
  const ListChunks lists = keys.lists;
  const int visible = range.visible, chunk_begin = range.begin, n_chunks = range.count;

  // This thread's row of every chunk, its pieces my_part + 4k.
  const GatherLane gl = gather_lane<4>(tid);
  const int my_row = gl.row, my_part = gl.part;
  int64_t next_slot =
      n_chunks > 0 ? chunk_slot<kPaged, kTwoLists, kKeysPerChunk>(p, t, b, chunk_begin, my_row, visible, lists) : -1;

  float o[16][4];  // this warp's 128 output columns (16 n-tiles), rows g and g+8
#pragma unroll
  for (int n = 0; n < 16; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;

  // One chunk: scores, online softmax, O += P V, with keys in `kt` (row-major [32][kRowElems]).
  // The softmax and P V stay inline: as device functions they changed the
  // PTX with every signature tried (P V on every arch, the softmax on
  // sm_100/120), as did the query staging and the output writes below.
  uint32_t qa[kDimsPerWarp / 16][4];  // this warp's query fragments (A operand), loaded once

  auto attend = [&](const T* kt, const int* vmask) {
    partial_scores<T, kRope>(kt, qa, ss, warp, lane);
    __syncthreads();

    {  // 8 threads per head row, 4 keys each
      const int r = tid / 8, c0 = (tid % 8) * 4;
      float v[4], cmax = -INFINITY;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int at = r * kSRow + c0 + e;
        const float score = (ss[at] + ss[at + kHeadsPerCta * kSRow]) + (ss[at + 2 * kHeadsPerCta * kSRow] + ss[at + 3 * kHeadsPerCta * kSRow]);
        v[e] = vmask[c0 + e] ? score * p.scale_log2 : -INFINITY;
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

    const int g = lane / 4;
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

  // Chunk c lives in buffer c % kStages (key buffers, or fp8 staging).
  constexpr int kAhead = chunks_in_flight(F, kStages);
  constexpr int kBufBytes = kFp8 ? kKeysPerChunk * kFp8RowBytes : kKeysPerChunk * kRowElems * 2;
  uint8_t* const bufs = smem + (kFp8 ? L.staging : L.k);
  auto issue = [&](int i) {  // chunk i of this split, if it exists
    if (i < n_chunks)
      gather_row<F, kPaged, 4, kKeysPerChunk, kTwoLists>(
          p, t, b, visible, chunk_begin + i, chunk_begin, n_chunks, my_row, my_part, next_slot,
          bufs + (i % kStages) * kBufBytes, kFp8 ? kFp8RowBytes : kRowElems * 2, kFp8 ? kFp8Pieces : kPieces, valid,
          L.valid_sets, lists);
    cp_async_commit();  // empty groups keep the wait counts uniform
  };
#pragma unroll
  for (int i = 0; i < kAhead; ++i) issue(i);

  // Queries, converted to the compute type, pass through shared memory (the
  // last key buffer, not yet in use) into registers; rows past the last head
  // are zero.
  T* sq = reinterpret_cast<T*>(smem + L.q);
#pragma unroll
  for (int r = 0; r < kQPerThread; ++r) {
    const int i = tid + r * kThreads;
    if (i < kHeadsPerCta * kPieces)
      *reinterpret_cast<uint4*>(sq + (i / kPieces) * kRowElems + (i % kPieces) * 8) = query_piece<T>(q_raw[r], p.q_is_bf16);
  }
  __syncthreads();
#pragma unroll
  for (int ks = 0; ks < kDimsPerWarp / 16; ++ks)
    ldmatrix_x4(qa[ks], sq + (lane % 16) * kRowElems + warp * kDimsPerWarp + ks * 16 + (lane / 16) * 8);
  // The loop's first barrier orders these reads before the buffer is reused.
  for (int i = 0; i < n_chunks; ++i) {
    cp_async_wait<kAhead - 1>();
    __syncthreads();  // chunk i has landed; every warp is done with chunk i-1
    if (i == 0) SMLA_STAMP(p, kAttnLanded);
    const int* vmask = valid + ((chunk_begin + i) % L.valid_sets) * kKeysPerChunk;
    if constexpr (kFp8) {
      dequantise_chunk<F, T, kRope>(bufs + (i % kStages) * kBufBytes, sk, tid);
      __syncthreads();  // staging buffer i % kStages is free again
      if (i == 0) SMLA_STAMP(p, kAttnDequantised);
      issue(i + kAhead);
      attend(sk, vmask);
    } else {
      issue(i + kAhead);  // into the buffer chunk i-1 used
      attend(reinterpret_cast<const T*>(bufs + (i % kStages) * kBufBytes), vmask);
    }
    if (i == 0) SMLA_STAMP(p, kAttnFirstChunk);
  }
  cp_async_wait<0>();
  __syncthreads();  // row statistics final (also when this split had no chunks)
  SMLA_STAMP(p, kAttnAttended);
  if (p.early_combine) let_dependents_launch();  // the combine: placed while the partials are written

  const int g = lane / 4;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = g + half * 8;
    if (r < nh)
      store_head_row(p, o, half, t, b, j, split, h0 + r, warp * 128 + (lane % 4) * 2, row_max[r], row_sum[r],
                     warp == 0 && lane % 4 == 0);
  }
  SMLA_STAMP(p, kAttnStored);
}

// Merges the splits of each (token, head): out = sum_s w_s * out_s with
// w_s = 2^(lse_s - lse), lse = log2 sum_s 2^lse_s; applies the sink.
// A row's 512 columns go to gridDim.y CTAs (1, 2, 4 or 8: combine_column_blocks); a CTA's threads are split into
// groups that each cover its columns, one float4 per thread, and merge every groups-th split. A thread issues the
// loads of kBatch splits (partial row, lse, max) before using any, so at 8 splits per thread a row's whole merge is
// one round trip to memory (32 splits one after another took ~0.7 us each); the groups' online-softmax states then
// meet in shared memory. kBatch 8 takes 64 registers a thread, so an SM holds half the threads it could: rows too
// many to be resident at once take kBatch 2 at 40 registers (H200, DeepSeek-V4 decode of 128 tokens x 64 heads over
// two caches: 169.6 us with batches of 8, 157.2 with the earlier combine's one split at a time at 32 registers).
constexpr int kMaxColumnBlocks = 8, kFewRowsBatch = 8, kManyRowsBatch = 2;
// Resident CTAs an SM is asked to hold (registers: 64 | 40 a thread): the few rows' batches of 8 run while every
// CTA is resident at once.
constexpr int kFewRowsCtasPerSm = 8, kManyRowsCtasPerSm = 12;

// Column blocks per row for `rows` rows of `splits` splits on `num_sms` SMs: spread the columns while the rows alone
// leave SMs idle, and further while a thread would merge more than one batch of splits one after another (a round
// trip each) and every CTA stays resident at kFewRowsCtasPerSm an SM. On an H200, 8 tokens x 16 heads over 32 splits
// (128 rows on 2 blocks: two batches a thread) took 18.2 us against 16.2 with 16 splits (one batch).
inline int combine_column_blocks(int64_t rows, int splits, int num_sms) {
  int blocks = 1;
  while (blocks < kMaxColumnBlocks &&
         (rows * blocks < num_sms ||
          (splits > kFewRowsBatch * blocks && rows * blocks * 2 <= int64_t{kFewRowsCtasPerSm} * num_sms)))
    blocks *= 2;
  return blocks;
}

// static: the small-heads kernel's file includes this header too. Launched
// as a programmatic dependent of the attention kernel from SM90 on: where the
// attention lets it (p.early_combine) its CTAs start while the attention's last
// ones run, and they wait here for its results.
template <int kBatch>
static __global__ void __launch_bounds__(kThreads, kBatch == kManyRowsBatch ? kManyRowsCtasPerSm : kFewRowsCtasPerSm)
    combine_kernel(const AttentionParams p) {
  static_assert(kThreads == kVDim / 4, "a CTA's threads cover a row's float4 columns once");
  SMLA_STAMP_START_END(p, kCombineFirstStart, kCombineLastEnd);
  wait_for_prerequisites();
  SMLA_STAMP(p, kCombineWaited);
  __shared__ float4 group_acc[kThreads];
  __shared__ float group_max[kMaxColumnBlocks], group_sum[kMaxColumnBlocks], group_logit[kMaxColumnBlocks];
  // blockIdx.x is the row (token t, head h); gridDim.y column blocks (a power of 2) split its 128 float4 columns, so
  // a CTA's threads form gridDim.y groups of kThreads / gridDim.y, each covering the CTA's columns once. Shifts, not
  // divisions: this kernel is a chain of dependent steps where every instruction before the loads is latency.
  const int row = blockIdx.x, t = row / p.num_heads, h = row - t * p.num_heads;
  const int b = t / p.s_q, j = t - b * p.s_q;
  const int groups = gridDim.y, log_quads = 7 - (31 - __clz(groups));  // kThreads = 2^7
  const int quads = 1 << log_quads;
  const int group = threadIdx.x >> log_quads, lane_col = threadIdx.x & (quads - 1);
  const int col = (blockIdx.y * quads + lane_col) * 4;

  // This thread's online softmax over splits group, group + groups, ...: max (m), sum of 2^(lse - m) (l), and the
  // partial rows weighted alike (acc); `logit`: their largest score, for max_logits. Each batch's loads go out
  // together (kBatch splits: one round trip); the pointers advance by a batch's splits, so no 64-bit product is
  // formed per split.
  const int64_t rows = static_cast<int64_t>(p.num_tokens) * p.num_heads;  // per split
  const int64_t step = rows * groups;                                     // between a group's splits
  const float* lse_at = p.partial_lse + group * rows + row;
  const float* max_at = p.max_logits ? p.partial_max + group * rows + row : nullptr;
  const float4* out_at = reinterpret_cast<const float4*>(p.partial_out + (group * rows + row) * kVDim + col);
  const int64_t out_step = step * (kVDim / 4);
  float m = -INFINITY, l = 0.f, logit = -INFINITY;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s0 = group; s0 < p.num_splits; s0 += kBatch * groups) {
    float lse[kBatch], top[kBatch];
    float4 v[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const bool in = s0 + i * groups < p.num_splits;
      lse[i] = in ? lse_at[i * step] : -INFINITY;
      top[i] = in && max_at ? max_at[i * step] : -INFINITY;
      v[i] = in ? out_at[i * out_step] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    lse_at += kBatch * step;
    if (max_at) max_at += kBatch * step;
    out_at += kBatch * out_step;
    float m_new = m;
#pragma unroll
    for (int i = 0; i < kBatch; ++i) m_new = fmaxf(m_new, lse[i]);
    const float base = m_new == -INFINITY ? 0.f : m_new;  // empty splits (lse -inf) weigh 0
    const float alpha = exp2f(m - base);
    l *= alpha;
    acc = make_float4(acc.x * alpha, acc.y * alpha, acc.z * alpha, acc.w * alpha);
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const float w = exp2f(lse[i] - base);
      l += w;
      acc = make_float4(acc.x + w * v[i].x, acc.y + w * v[i].y, acc.z + w * v[i].z, acc.w + w * v[i].w);
      logit = fmaxf(logit, top[i]);
    }
    m = m_new;
  }
  SMLA_STAMP(p, kCombineMerged);
  group_acc[threadIdx.x] = acc;
  if (lane_col == 0) {  // a group's threads merged the same splits: the same m, l and logit
    group_max[group] = m;
    group_sum[group] = l;
    group_logit[group] = logit;
  }
  __syncthreads();
  if (threadIdx.x >= quads) return;

  float gmax = -INFINITY, max_score = -INFINITY;
#pragma unroll
  for (int g = 0; g < kMaxColumnBlocks; ++g)
    if (g < groups) {
      gmax = fmaxf(gmax, group_max[g]);
      max_score = fmaxf(max_score, group_logit[g]);
    }
  const float base = gmax == -INFINITY ? 0.f : gmax;
  float wsum = 0.f;
  acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int g = 0; g < kMaxColumnBlocks; ++g)
    if (g < groups) {
      const float w = exp2f(group_max[g] - base);
      const float4 a = group_acc[g * quads + threadIdx.x];
      wsum += w * group_sum[g];
      acc = make_float4(acc.x + w * a.x, acc.y + w * a.y, acc.z + w * a.z, acc.w + w * a.w);
    }
  const float ln2 = 0.6931471805599453f;
  const float lse2 = wsum > 0.f ? gmax + log2f(wsum) : -INFINITY;
  float scale = wsum > 0.f ? 1.f / wsum : 0.f;
  if (p.attn_sink && wsum > 0.f) scale /= 1.f + expf(p.attn_sink[h] - lse2 * ln2);
  uint16_t* out = static_cast<uint16_t*>(p.out) + b * p.out_stride_b + j * p.out_stride_s + h * p.out_stride_h + col;
  const uint32_t lo = p.q_is_bf16 ? pack2<__nv_bfloat16>(acc.x * scale, acc.y * scale)
                                  : pack2<__half>(acc.x * scale, acc.y * scale);
  const uint32_t hi = p.q_is_bf16 ? pack2<__nv_bfloat16>(acc.z * scale, acc.w * scale)
                                  : pack2<__half>(acc.z * scale, acc.w * scale);
  *reinterpret_cast<uint2*>(out) = make_uint2(lo, hi);
  if (blockIdx.y == 0 && threadIdx.x == 0) {
    p.lse[b * p.lse_stride_b + j * p.lse_stride_s + h * p.lse_stride_h] = wsum > 0.f ? lse2 * ln2 : p.empty_lse;
    if (p.max_logits) p.max_logits[t * p.max_logits_stride_t + h * p.max_logits_stride_h] = max_score * ln2;
  }
  SMLA_STAMP(p, kCombineStored);
}

}  // namespace smla::cuda::mla
