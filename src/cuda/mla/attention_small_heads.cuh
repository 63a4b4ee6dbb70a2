// MLA attention for few heads per token (1-16 per CTA; the memory-bound
// decode of tensor-parallel shards: GLM-5 TP8 runs 8 heads, DeepSeek-V3.2 16).
//
// One CTA = one query token, up to kGroups x kHeadTiles x 8 heads and a range of 64-key
// chunks. Keys go on the mma's M side and heads on N (S^T = K Q^T, O^T =
// V^T P^T), so 8 heads fill an n8 tile with nothing wasted. Each warp owns 16
// keys of every chunk and all 512 output dims of its head group (kHeadTiles n8
// tiles of heads: 16 heads share each converted key fragment): it runs its
// own online softmax with no barrier but its key slot's one per chunk of the
// pipeline, and the warps of a group are merged once at the end. fp8_ds_mla
// rows are dequantised from shared memory straight into mma fragments (e4m3
// pairs -> f16x2, one instruction from SM89 on, for both products); their
// per-128-dim scales are applied to the fp32 scores and folded into P for
// P V. fp8_ds_mla_v4 rows (448 e4m3 dims in 7 tiles of 64 with power-of-two
// scales, then 64 bf16 dims) are read as fp8_ds_mla's with a rope part: the
// 16-bit dims in the rope's place (the eighth 64-dim tile's), their scales
// applied per 64 dims to the scores and, in P V, to the
// values (the dims of one mma span two tiles). Dims inside a thread's fragments are permuted (the dot products do not
// care) so every operand is one 16-byte shared load.
//
// A chunk's rows land in shared memory as they lie in the cache, each an odd number of 16-byte pieces from the
// next, so the loads below (8 lanes a bank cycle: rows g, g+1 at pieces 2c, 2c+1; rows 2c, 2c+1 at piece g;
// ldmatrix's 8 rows at one piece) each hit 8 different bank groups (fp8_ds_mla_v4's scores: 2-way conflicts). That lets a row be one bulk copy (sm_90+:
// cp.async.bulk, one instruction a row onto an mbarrier; on an H200 a bare pipeline of them moves 83% of copy
// bandwidth where 16-byte cp.async pieces move 64%), else 16-byte cp.async pieces. The 16 rows of a key slot are
// read only by the slot's warps, which copy them and wait for them alone: no barrier across the CTA a chunk.
#pragma once

#include <cuda_fp8.h>

#include "cuda/common/mma.cuh"
#include "cuda/mla/attention_kernel.cuh"
#include "cuda/mla/params.h"

namespace smla::cuda::mla::small {

constexpr int kHeadsPerGroup = 8;  // the mma's N
constexpr int kKeySlots = 4;       // warps of a group that own different keys of a chunk
constexpr int kKeysPerWarp = 16;   // the mma's M
constexpr int kChunkKeys = kKeySlots * kKeysPerWarp;
constexpr int kMaxStages = 4;  // cp_async_wait_dynamic's deepest count is stages - 2
// The running max of a head moves only when a score passes it by more than
// this (log2 units): P stays <= 2^8, and O is rescaled rarely. Only where P
// is f16 (fp8 and f16 caches): a bf16 P of up to 2^8 rounds a key that
// dominates the softmax by up to 2^-9 of its weight (the CPU backend's P of
// that key is 1, exact), so with bf16 caches the base follows the max.
template <CacheFormat F>
constexpr float kMaxSlack = F == CacheFormat::bf16 ? 0.f : 8.f;
// fp8_ds_mla_v4's P V: values are scaled by 2^kV4ValueExp over their tile's largest scale (448 * 2^7 < 65504,
// f16's largest), and its 128-dim tile kV4TailTile ends in the 64 bf16 dims.
constexpr int kV4ValueExp = 7, kV4TailTile = MlaV4CacheLayout::kTiles / 2;

// Row geometry for rope width kRope (64 for DeepSeek/GLM-5's MLA; 0 for a rope-free 512-wide head). A row in a
// stage is the cache's row: fp8_ds_mla its 512 e4m3 latent bytes, 4 float scales, the bf16 rope (rope-free: the
// first 528 bytes); fp8_ds_mla_v4 its 448 e4m3 bytes and 64 bf16 dims, then its 8 scale bytes (from the block's
// end); 16-bit rows the latent then the rope.
template <CacheFormat F, int kRope>
struct Geometry {
  static constexpr bool kFp8 = is_fp8(F), kV4 = F == CacheFormat::fp8_ds_mla_v4;
  static_assert(!kV4 || kRope == 0, "fp8_ds_mla_v4 holds 512-wide heads");
  static constexpr int kLatentDims = kV4 ? MlaV4CacheLayout::kNopeDim : kLatent;  // before the 16-bit tail
  static constexpr int kTailDims = kV4 ? MlaV4CacheLayout::kRopeDim : kRope;
  static constexpr int kLatentSteps = kLatentDims / 16;
  static constexpr int kTileBytes = kFp8 ? 128 : 256;  // a 128-dim latent tile (V4: 3.5 of them)
  // The bytes of one copy from the cache (V4: the values; its scales are an 8-byte copy of their own).
  static constexpr int kCopyBytes =
      kV4 ? MlaV4CacheLayout::kValueBytes : kFp8 ? kLatent + 16 + 2 * kRope : 2 * (kLatent + kRope);
  static constexpr int kScaleOffset = kV4 ? MlaV4CacheLayout::kValueBytes : kLatent;  // fp8 only
  static constexpr int kTailOffset = kV4 ? MlaV4CacheLayout::kNopeDim : kFp8 ? kLatent + 16 : 2 * kLatent;
  // 16-byte pieces of a cache row as the gather reads them (V4: its values, then its scales).
  static constexpr int kGlobalPieces = kV4 ? kCopyBytes / 16 + 1 : kCopyBytes / 16;
  // From one row to the next in a stage: an odd number of pieces.
  static constexpr int kRowStride = 16 * (kGlobalPieces | 1);
  static constexpr int kQkSteps = (kLatentDims + kTailDims) / 16;  // score k-steps
  static constexpr int kStageBytes = kChunkKeys * (kRowStride + 4);  // rows, valid flags
  static_assert(kCopyBytes % 16 == 0 && kTailOffset % 16 == 0, "rows and their tails are whole pieces");
};

// Shared memory: `stages` pipeline stages (the merge buffers reuse them once
// the loop is done), then the query fragments, the warps' softmax stats,
// when the output dims are split the two halves' partial scores, and the bulk
// copies' mbarriers ([key slot][stage]).
template <CacheFormat F, int kRope, int kGroups, int kSplitDims, int kHeadTiles = 1>
struct Layout {
  using G = Geometry<F, kRope>;
  static constexpr int kGroupHeads = kHeadTiles * kHeadsPerGroup;
  static constexpr int kMergeBytes = kGroups * (kKeySlots / 2) * kGroupHeads * kVDim * 4;
  static constexpr int kQBytes = kGroups * kHeadTiles * G::kQkSteps * 32 * 8;
  // fp8 queries' largest |q| per warp and head (the prologue's): from here on into the stats, unused until the merge.
  static constexpr int kQMaxBytes = kGroups * kGroupHeads * 4;
  static constexpr int kStatBytes = kGroups * kKeySlots * kGroupHeads * 3 * 4;
  // Per warp of a split: its lanes' 4 partial scores per head tile (16 keys x 8 heads).
  static constexpr int kExchangeBytes = kSplitDims == 2 ? kGroups * kKeySlots * 2 * 32 * 16 * kHeadTiles : 0;
  static constexpr int kBarrierBytes = kKeySlots * kMaxStages * 8;
  int q = 0, q_max = 0, stats = 0, exchange = 0, barriers = 0, total = 0;
  __host__ __device__ constexpr explicit Layout(int stages) {
    q = stages * G::kStageBytes > kMergeBytes ? stages * G::kStageBytes : kMergeBytes;
    q_max = q + kQBytes;
    stats = q_max + kQMaxBytes;
    exchange = stats + kStatBytes;
    barriers = exchange + kExchangeBytes;
    total = barriers + kBarrierBytes;
  }
};

// Where (head, dim) of a merge slot ([8 heads][512 dims] fp32) lies. A lane holds heads 2c, 2c+1, so unswizzled
// its lane column c put the warp's stores 1024 floats apart, in the same banks (ncu: 16-way conflicts). Each head's
// dims are XOR-swizzled by c: fp8 lanes store dims 4q..4q+3 of their 16 of a tile as one float4 and c picks which
// of the 4 (g's parity the other half of the banks); 16-bit lanes store dims g and g + 8 of a 16-dim tile one by
// one and c picks the 8-float block among 4.
template <bool kFp8>
__device__ __forceinline__ int merge_index(int head, int dim) {
  return head * kVDim + (dim ^ ((head >> 1 & 3) << (kFp8 ? 2 : 3)));
}

// The piece of a 128-byte group that lane column c reads for the scores, half h of two: 2c + h, so rows g and g+1
// (an odd number of pieces apart) fall in 8 bank groups. fp8_ds_mla_v4: 4h + c, each half one 64-dim scale tile
// (2-way conflicts).
template <CacheFormat F>
__host__ __device__ constexpr int score_piece_index(int c, int h) {
  return F == CacheFormat::fp8_ds_mla_v4 ? 4 * h + c : 2 * c + h;
}
// The dims of score k-step `ks` that lane column c holds in its fragments:
// d0..d0+1 in the first register, d0+2..d0+3 in the second.
template <CacheFormat F>
__host__ __device__ constexpr int score_dim(int ks, int c) {
  if ((F == CacheFormat::fp8_ds_mla && ks < kLatent / 16) ||
      (F == CacheFormat::fp8_ds_mla_v4 && ks < MlaV4CacheLayout::kNopeDim / 16))  // a piece = 16 e4m3 dims = 4 k-steps
    return 128 * (ks / 8) + 16 * score_piece_index<F>(c, (ks / 4) % 2) + 4 * (ks % 4);
  return 64 * (ks / 4) + 8 * score_piece_index<F>(c, (ks / 2) % 2) + 4 * (ks % 2);  // a piece = 8 16-bit dims
}

__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t v) {
  uint32_t r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(v));
  return r;
}
__device__ __forceinline__ uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}
__device__ __forceinline__ void cp_async_wait_dynamic(int pending) {
  switch (pending) {
    case 0: cp_async_wait<0>(); break;
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    default: cp_async_wait<3>(); break;
  }
}

// kSplitDims 2: the warps of a group are 4 key slots x 2 halves of the output
// dims. The two warps of a key slot each compute the scores over half the
// query dims and add the other's partial sums (through shared memory, a
// barrier of the pair); each keeps half of O^T, so twice the warps fit in the
// registers for about the same instructions in all.
// kHeadTiles 2 (16 heads, with the dims split: O^T of 16 heads x 256 dims, as many registers as 8 x 512): each
// key fragment converted from fp8 (or loaded) once feeds both head tiles' mma, where two groups of 8 heads
// converted every row twice.
template <CacheFormat F, bool kPaged, int kGroups, int kSplitDims, int kRope = 64, int kHeadTiles = 1>
__global__ void __launch_bounds__(kGroups * kKeySlots * kSplitDims * 32, kSplitDims == 2 && kHeadTiles == 1 ? 2 : 1)
    small_heads_kernel(const AttentionParams p, int stages, bool bulk) {
  using T = ComputeT<F>;
  using G = Geometry<F, kRope>;
  constexpr bool kFp8 = G::kFp8, kV4 = G::kV4;
  constexpr int kWarpsPerGroup = kKeySlots * kSplitDims;
  constexpr int kWarps = kGroups * kWarpsPerGroup, kThreadsPerCta = kWarps * 32;
  constexpr int NT = kHeadTiles, kGroupHeads = NT * kHeadsPerGroup, kHeadBlocks = kGroups * NT;
  // 128 registers a thread (two CTAs of 8 warps per SM): the gather and the query loads are arranged to fit.
  constexpr bool kTightRegisters = kSplitDims == 2 && NT == 1;
  static_assert(NT == 1 || (kSplitDims == 2 && kGroups == 1 && !G::kV4), "16 heads a warp split the dims");
  // A key slot's 16 rows are copied by the slot's warps (each group's, each dim half's): kRowsPerWarp each.
  constexpr int kSlotWarps = kGroups * kSplitDims, kRowsPerWarp = kKeysPerWarp / kSlotWarps;
  constexpr int kLatentSteps = G::kLatentSteps, kTileSteps = 128 / 16;
  constexpr int kMTiles = kVDim / 16 / kSplitDims;  // this warp's 16-dim tiles of O^T
  constexpr int kScaleTiles = 4 / kSplitDims;       // ... and its fp8 128-dim scale tiles
  static_assert(kRowsPerWarp >= 1 && kRowsPerWarp <= 32, "a lane holds each of its warp's rows");
  const Layout<F, kRope, kGroups, kSplitDims, NT> L(stages);
  extern __shared__ __align__(16) uint8_t smem[];
  uint2* qfrag = reinterpret_cast<uint2*>(smem + L.q);
  float* stats = reinterpret_cast<float*>(smem + L.stats);      // [group][key slot][base, sum, max][head]

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int group = warp / kWarpsPerGroup, wig = warp % kWarpsPerGroup;
  const int slot_k = wig % kKeySlots, half_d = wig / kKeySlots;
  const int g = lane / 4, c = lane % 4;
  const int cta_heads = kGroups * kGroupHeads;
  const int head_blocks = (p.num_heads + cta_heads - 1) / cta_heads;
  const int t = blockIdx.x / head_blocks;
  const int h0 = (blockIdx.x % head_blocks) * cta_heads;
  const int nh = min(cta_heads, p.num_heads - h0);
  const bool group_active = group * kGroupHeads < nh;
  const int split = blockIdx.y;
  const int b = t / p.s_q, j = t % p.s_q;
  const int kr = slot_k * kKeysPerWarp;  // this warp's first row of each chunk
  const int slot_warp = warp / kKeySlots;  // which of the slot's warps this is

  // Bulk copies: one mbarrier per key slot and stage, whose phase completes when each of the slot's warps has
  // arrived with its rows' bytes expected and those bytes have landed.
  uint64_t* const slot_barriers = reinterpret_cast<uint64_t*>(smem + L.barriers) + slot_k * kMaxStages;
  if (bulk) {
    if (tid < kKeySlots * kMaxStages) {
      mbarrier_init(reinterpret_cast<uint64_t*>(smem + L.barriers) + tid, kSlotWarps);
      fence_mbarrier_init();
    }
    __syncthreads();
  }

  // Everything from here reads what the kernel before may write (indices, cache) when dsa_decode_step launches
  // this one as the top-k's programmatic dependent; without that launch the wait returns at once. Paged decode is
  // never launched so (and its fp8 form spilled more with the wait).
  if constexpr (!kPaged) wait_for_prerequisites();
  const ChunkRange range = chunk_range<kPaged>(p, t, b, j, split, kChunkKeys);
  const int visible = range.visible, chunk_begin = range.begin, n_chunks = range.count;

  // Gather: the slot's warp w copies rows kr + w kRowsPerWarp, ... of each chunk. Lane l holds the byte offset of
  // the warp's l-th row (-1: invalid, then zero-filled and never read), resolved a chunk ahead from the row's index
  // (or block) loaded two chunks ahead, so the load has landed by then (resolved as loaded, every chunk's issue
  // waited a memory round trip: ncu, 7% of the stall samples at 128 tokens on one compare); fp8_ds_mla_v4: also the
  // row's place in its block, which finds its scales at the block's end.
  int next_in_block = 0;
  auto chunk_row = [&](int k) { return kr + slot_warp * kRowsPerWarp + k; };
  auto row_key = [&](int chunk) { return chunk * kChunkKeys + chunk_row(lane); };
  auto entry_for = [&](int chunk) -> int32_t {
    return lane < kRowsPerWarp ? slot_entry<kPaged>(p, t, b, row_key(chunk), visible) : -1;
  };
  auto offset_for = [&](int chunk, int32_t entry) -> int64_t {
    const int64_t slot = entry_slot<kPaged>(p, row_key(chunk), entry);
    if (slot < 0) return -1;
    const int s32 = static_cast<int>(slot);  // indices are int32
    const int64_t block = (s32 / p.block_size) * p.block_stride;
    if constexpr (kV4) {
      next_in_block = s32 % p.block_size;
      return block + next_in_block * MlaV4CacheLayout::kValueBytes;
    }
    return block + (s32 % p.block_size) * p.row_stride;
  };
  const int32_t first_entry = n_chunks > 0 ? entry_for(chunk_begin) : -1;
  int32_t next_entry = n_chunks > 1 ? entry_for(chunk_begin + 1) : -1;  // both loads in flight
  // Query fragments (the B operand of S^T = K Q^T), in the permuted dim order
  // of score_dim; heads past the last are 0. fp8 caches: the latent dims are
  // multiplied as f16 (e4m3 codes convert to f16 in one instruction), so each
  // head's latent query is scaled by a power of two that puts its largest
  // value in [2^14, 2^15): exact in f16 down to 2^-24 of that value.
  // Entry e = (8-head block, k-step, lane) holds 4 values. Each thread loads
  // all its entries before using any: one memory round trip per CTA, not one
  // per entry (a split of few chunks is otherwise mostly this prologue). Loaded
  // with the first chunks' row indices, so the two round trips overlap; the
  // dim-split kernels load them after the gather's first chunks are issued
  // (held across the gather's set-up they cost those kernels spills).
  const uint16_t* q = p.q + b * p.q_stride_b + j * p.q_stride_s;
  constexpr int kQEntries = kHeadBlocks * G::kQkSteps * 32;
  constexpr int kQPerThread = (kQEntries + kThreadsPerCta - 1) / kThreadsPerCta;
  auto head_of = [](int e) { return (e / (32 * G::kQkSteps)) * kHeadsPerGroup + (e % 32) / 4; };
  auto is_latent = [](int e) { return (e / 32) % G::kQkSteps < kLatentSteps; };
  uint2 q_raw[kQPerThread];
  auto load_queries = [&] {
#pragma unroll
    for (int r = 0; r < kQPerThread; ++r) {
      const int e = tid + r * kThreadsPerCta, h = head_of(e);
      q_raw[r] = e < kQEntries && h < nh ? *reinterpret_cast<const uint2*>(q + (h0 + h) * p.q_stride_h +
                                                                            score_dim<F>((e / 32) % G::kQkSteps, e % 4))
                                         : make_uint2(0, 0);
    }
  };
  if constexpr (!kTightRegisters) load_queries();
  int64_t next_offset = offset_for(chunk_begin, first_entry);
  constexpr int kLanePieces = (G::kGlobalPieces + 31) / 32;
  // Rows unrolled at once: all of them, but 4 at 128 registers a thread (the dim split), where the shuffled
  // offsets of all rows held live made the fp8 kernels spill on sm_80.
  constexpr int kGatherUnroll = kTightRegisters ? 4 : kRowsPerWarp;
  // Chunk i of this split into `stage` (its mbarrier `bar` for bulk copies), if it exists. Per chunk the row offsets
  // become a mask of the valid rows and offsets with 0 for the invalid ones, so a row costs a shuffle, an add and its
  // copies (bulk: one copy by the row's lane; an invalid row zeroed by the warp before the warp's arrival).
  auto issue = [&](int i, uint8_t* stage, uint64_t* bar) {
    if (i < n_chunks) {
      const int64_t offsets = next_offset;
      const int in_blocks = next_in_block;
      if (i + 1 < n_chunks) {
        next_offset = offset_for(chunk_begin + i + 1, next_entry);
        if (i + 2 < n_chunks) next_entry = entry_for(chunk_begin + i + 2);
      }
      const uint32_t valid_rows = __ballot_sync(0xffffffffu, offsets >= 0) & ((1u << kRowsPerWarp) - 1);
      if (lane < kRowsPerWarp) reinterpret_cast<int*>(stage + kChunkKeys * G::kRowStride)[chunk_row(lane)] = offsets >= 0;
      if (bulk && !kV4) {
        if (valid_rows != (1u << kRowsPerWarp) - 1) {
          for (uint32_t invalid = ~valid_rows & ((1u << kRowsPerWarp) - 1); invalid != 0; invalid &= invalid - 1)
            for (int pc = lane; pc < G::kRowStride / 16; pc += 32)
              reinterpret_cast<uint4*>(stage + chunk_row(__ffs(invalid) - 1) * G::kRowStride)[pc] = make_uint4(0, 0, 0, 0);
          __syncwarp();  // the zeros before this warp's arrival
        }
        if (lane == 0) mbarrier_expect_bytes(bar, __popc(valid_rows) * G::kCopyBytes);
        __syncwarp();  // the bytes expected before any lands
        if (offsets >= 0) bulk_copy_to_shared(stage + chunk_row(lane) * G::kRowStride, p.cache + offsets, G::kCopyBytes, bar);
        return;
      }
      const uint8_t* const lane_src = p.cache + 16 * lane;
      const int64_t row_offsets = offsets >= 0 ? offsets : 0;
#pragma unroll kGatherUnroll
      for (int k = 0; k < kRowsPerWarp; ++k) {
        const bool valid = valid_rows >> k & 1;
        const int64_t offset = __shfl_sync(0xffffffffu, row_offsets, k);
        uint8_t* const row = stage + chunk_row(k) * G::kRowStride + 16 * lane;
#pragma unroll
        for (int jp = 0; jp < kLanePieces; ++jp) {
          const int pc = lane + 32 * jp;
          if constexpr (kV4) {
            using V4 = MlaV4CacheLayout;
            // Every lane takes part in the shuffle; the scale piece's lane uses it: block + block_size * 576 + i * 8.
            const int in_block = jp == kLanePieces - 1 ? __shfl_sync(0xffffffffu, in_blocks, k) : 0;
            if (pc == G::kGlobalPieces - 1)
              cp_async_8(row + 512 * jp,
                         p.cache + offset + static_cast<int64_t>(p.block_size) * V4::kValueBytes -
                             in_block * (V4::kValueBytes - V4::kScaleBytes),
                         valid);
            else if (pc < G::kGlobalPieces)
              cp_async_16(row + 512 * jp, lane_src + offset + 512 * jp, valid);
          } else if (pc < G::kGlobalPieces) {
            cp_async_16(row + 512 * jp, lane_src + offset + 512 * jp, valid);
          }
        }
      }
    }
    if (!bulk || kV4) cp_async_commit();  // empty groups keep the wait counts uniform
  };
  for (int i = 0; i < stages - 1; ++i) issue(i, smem + i * G::kStageBytes, slot_barriers + i);

  if constexpr (kTightRegisters) load_queries();
  auto q_values = [&](uint2 raw, float (&v)[4]) {
    v[0] = bits_to_float(static_cast<uint16_t>(raw.x), p.q_is_bf16);
    v[1] = bits_to_float(static_cast<uint16_t>(raw.x >> 16), p.q_is_bf16);
    v[2] = bits_to_float(static_cast<uint16_t>(raw.y), p.q_is_bf16);
    v[3] = bits_to_float(static_cast<uint16_t>(raw.y >> 16), p.q_is_bf16);
  };
  // A thread's entries are all of one head per 8-head block (head_of: lane l holds head l / 4 of the entry's block,
  // which is the same for a warp's 32 entries).
  auto group_of = [](int e) { return e / (32 * G::kQkSteps); };
  float q_up[kHeadBlocks] = {};  // fp8: head g's power of two in each 8-head block
  float q_unscale[NT][2];        // fp8: 1 / that of heads 2c, 2c+1 of each of this warp's head tiles
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) q_unscale[nt][0] = q_unscale[nt][1] = 1.f;
  if constexpr (kFp8) {
    // Each head's largest |q| (int bits, NaN above inf): over the thread's entries, the 4 lanes of the head, then
    // the warps through shared memory: no atomics, one barrier.
    constexpr int kCtaHeads = kHeadBlocks * kHeadsPerGroup;
    using Lt = Layout<F, kRope, kGroups, kSplitDims, NT>;
    static_assert(kWarps * kCtaHeads * 4 <= Lt::kQMaxBytes + Lt::kStatBytes, "the q maxima fit");
    int q_bits[kHeadBlocks] = {};
#pragma unroll
    for (int r = 0; r < kQPerThread; ++r) {
      const int e = tid + r * kThreadsPerCta;
      if (e >= kQEntries || !is_latent(e)) continue;
      float v[4];
      q_values(q_raw[r], v);
      const float m = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
      for (int gi = 0; gi < kHeadBlocks; ++gi)
        if (group_of(e) == gi) q_bits[gi] = max(q_bits[gi], __float_as_int(m));
    }
    int* q_max = reinterpret_cast<int*>(smem + L.q_max);  // [warp][CTA head]
#pragma unroll
    for (int gi = 0; gi < kHeadBlocks; ++gi) {
      q_bits[gi] = max(q_bits[gi], __shfl_xor_sync(0xffffffffu, q_bits[gi], 1));
      q_bits[gi] = max(q_bits[gi], __shfl_xor_sync(0xffffffffu, q_bits[gi], 2));
      if (c == 0) q_max[warp * kCtaHeads + gi * kHeadsPerGroup + g] = q_bits[gi];
    }
    __syncthreads();
    auto scale_of = [&](int head) {  // the power of two that puts a CTA head's largest |q| in [2^14, 2^15)
      int bits = 0;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) bits = max(bits, q_max[w * kCtaHeads + head]);
      const float m = __int_as_float(bits);
      return m > 0.f && m <= FLT_MAX ? ldexpf(1.f, max(-126, min(126, 14 - ilogbf(m)))) : 1.f;
    };
#pragma unroll
    for (int gi = 0; gi < kHeadBlocks; ++gi) q_up[gi] = scale_of(gi * kHeadsPerGroup + g);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) q_unscale[nt][e] = 1.f / scale_of(group * kGroupHeads + nt * kHeadsPerGroup + 2 * c + e);
  }
#pragma unroll
  for (int r = 0; r < kQPerThread; ++r) {
    const int e = tid + r * kThreadsPerCta;
    if (e >= kQEntries) continue;
    float v[4];
    q_values(q_raw[r], v);
    if (kFp8 && is_latent(e)) {
      float sc = q_up[0];
#pragma unroll
      for (int gi = 1; gi < kHeadBlocks; ++gi)
        if (group_of(e) == gi) sc = q_up[gi];
      qfrag[e] = make_uint2(pack2<__half>(v[0] * sc, v[1] * sc), pack2<__half>(v[2] * sc, v[3] * sc));
    } else {
      qfrag[e] = make_uint2(pack2<T>(v[0], v[1]), pack2<T>(v[2], v[3]));
    }
  }
  // Head tile nt of this warp's group: my_q + nt * kQTile.
  constexpr int kQTile = G::kQkSteps * 32;
  const uint2* my_q = qfrag + group * NT * kQTile + lane;
  __syncthreads();  // the query fragments written; the q maxima read

  // This warp's O^T (dims x heads): kMTiles tiles of 16 dims by NT tiles of 8 heads; thread (g, c) holds heads
  // 2c, 2c+1 of each head tile. Which dims a tile's rows are depends on the format (see the merge).
  float o[kMTiles][NT][4];
#pragma unroll
  for (int i = 0; i < kMTiles; ++i)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) o[i][nt][0] = o[i][nt][1] = o[i][nt][2] = o[i][nt][3] = 0.f;
  // Heads 2c, 2c+1 of each head tile: the softmax's base (the running max, moved lazily), the sum of this lane's
  // P, the exact max score.
  float m[NT][2], l_part[NT][2], top[NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) m[nt][e] = -INFINITY, l_part[nt][e] = 0.f, top[nt][e] = -INFINITY;
  // fp8 P V runs in f16 with each key's scale folded into P over a power of
  // two per 128-dim tile: P * scale * 2^(133 - e) for e the largest biased
  // exponent of the tile's scales this warp has met (at least 6). With P <=
  // 2^kMaxSlack<F> that stays below 2^15, inside f16's range; O's tiles hold
  // O * 2^(133 - e) and are rescaled when e grows (rarely: scales settle).
  int tile_exp[kScaleTiles];
#pragma unroll
  for (int tt = 0; tt < kScaleTiles; ++tt) tile_exp[tt] = 6;

  // Byte offsets in a stage, fixed per thread, so the loads below take immediate offsets (128 bytes per group,
  // 8 rows per kRowStride * 8): scores read pieces score_piece_index(c, 0) and (c, 1) of each group of rows kr+g
  // and kr+g+8;
  constexpr int kStride = G::kRowStride;
  const int s_row = (kr + g) * kStride;
  const int s_piece[2] = {16 * score_piece_index<F>(c, 0), 16 * score_piece_index<F>(c, 1)};
  // fp8 P V reads piece g of rows kr+2c, kr+2c+1 (and 8 rows on);
  const int v_off0 = (kr + 2 * c) * kStride + 16 * g, v_off1 = v_off0 + kStride;
  // 16-bit P V: ldmatrix rows kr + (lane / 16) * 8 + lane % 8, pieces 2q + (lane / 8) % 2 of each group.
  const int ld_row = kr + (lane / 16) * 8 + lane % 8;
  int ld_off[4];
#pragma unroll
  for (int q4 = 0; q4 < 4; ++q4)
    ld_off[q4] = ld_row * kStride + 16 * (2 * q4 + (lane / 8) % 2) + half_d * (kMTiles / 4) * 128;
  // The score dims this warp sums: the latent's 128-dim tiles tile0 .. tile0 + kScoreTiles - 1 and 32-dim halves
  // rope_half0 .. of each 64-dim rope group (all of them, or its half's when the dims are split).
  constexpr int kScoreTiles = 4 / kSplitDims, kRopeHalves = 2 / kSplitDims;
  const int tile0 = half_d * kScoreTiles, rope_half0 = half_d * kRopeHalves;
  const int s_lat = s_row + tile0 * G::kTileBytes;           // a tile is 1 (fp8) or 2 (16-bit) 128-byte groups
  const uint2* const q_lat = my_q + tile0 * kTileSteps * 32;  // ... and kTileSteps k-steps
  auto attend = [&](const uint8_t* stage) {
    const uint8_t* rows = stage;
    const int* valid = reinterpret_cast<const int*>(stage + kChunkKeys * kStride);
    auto load = [&](int offset) { return *reinterpret_cast<const uint4*>(rows + offset); };
    // Piece score_piece_index(c, h) of 128-byte group `grp` (from `base`) of row kr+g (second: kr+g+8).
    auto score_piece = [&](int base, int grp, int h, bool second) {
      return load(base + s_piece[h] + 128 * grp + (second ? 8 * kStride : 0));
    };
    // Scores: acc[0 .. kScoreTiles - 1] this warp's latent tiles (each with its fp8 scale), acc[kScoreTiles] the
    // rope; [nt] the head tile.
    float acc[kScoreTiles + 1][NT][4] = {};
    auto latent_step = [&](float (&d)[NT][4], const uint32_t (&a)[4], int ks) {  // ks: from the warp's first tile
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const uint2 qb = q_lat[nt * kQTile + ks * 32];
        if constexpr (kFp8) mma_16816<__half>(d[nt], a, {qb.x, qb.y});
        else mma_16816<T>(d[nt], a, {qb.x, qb.y});
      }
    };
    const int r0 = kr + g, r1 = kr + g + 8;
    // fp8_ds_mla_v4: the scale byte (biased exponent) of a row's 64-dim tile (the eighth byte is the pad).
    auto v4_exponent = [&](int row, int v4_tile) -> int { return rows[row * kStride + G::kScaleOffset + v4_tile]; };
    if constexpr (kFp8) {
#pragma unroll
      for (int tt = 0; tt < kScoreTiles; ++tt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int v4_tile = 2 * (tile0 + tt) + half;  // fp8_ds_mla_v4's 64-dim tile
          if (kV4 && v4_tile >= MlaV4CacheLayout::kTiles) continue;  // its bf16 dims are the tail's
          const uint4 x0 = score_piece(s_lat, tt, half, false), x1 = score_piece(s_lat, tt, half, true);
          const uint32_t w0[4] = {x0.x, x0.y, x0.z, x0.w}, w1[4] = {x1.x, x1.y, x1.z, x1.w};
          float v4_acc[NT][4] = {};
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const uint32_t a[4] = {e4m3x2_to_f16x2(w0[k]), e4m3x2_to_f16x2(w1[k]), e4m3x2_to_f16x2<true>(w0[k]),
                                   e4m3x2_to_f16x2<true>(w1[k])};
            if constexpr (kV4) latent_step(v4_acc, a, 8 * tt + 4 * half + k);
            else latent_step(acc[tt], a, 8 * tt + 4 * half + k);
          }
          if constexpr (kV4) {  // each 64-dim tile's scale on its fp32 partial scores
            const float s0 = ue8m0_to_float(v4_exponent(r0, v4_tile)), s1 = ue8m0_to_float(v4_exponent(r1, v4_tile));
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
              acc[tt][nt][0] += v4_acc[nt][0] * s0;
              acc[tt][nt][1] += v4_acc[nt][1] * s0;
              acc[tt][nt][2] += v4_acc[nt][2] * s1;
              acc[tt][nt][3] += v4_acc[nt][3] * s1;
            }
          }
        }
    } else {
#pragma unroll
      for (int grp = 0; grp < 2 * kScoreTiles; ++grp)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const uint4 x0 = score_piece(s_lat, grp, half, false), x1 = score_piece(s_lat, grp, half, true);
          latent_step(acc[grp / 2], {x0.x, x1.x, x0.y, x1.y}, 4 * grp + 2 * half);
          latent_step(acc[grp / 2], {x0.z, x1.z, x0.w, x1.w}, 4 * grp + 2 * half + 1);
        }
    }
#pragma unroll
    for (int grp = 0; grp < G::kTailDims / 64; ++grp)
#pragma unroll
      for (int rh = 0; rh < kRopeHalves; ++rh) {
        const int half = rope_half0 + rh;
        const uint4 x0 = score_piece(s_row + G::kTailOffset, grp, half, false);
        const uint4 x1 = score_piece(s_row + G::kTailOffset, grp, half, true);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const uint2* qk = my_q + nt * kQTile + (kLatentSteps + 4 * grp + 2 * half) * 32;
          mma_16816<T>(acc[kScoreTiles][nt], {x0.x, x1.x, x0.y, x1.y}, {qk[0].x, qk[0].y});
          mma_16816<T>(acc[kScoreTiles][nt], {x0.z, x1.z, x0.w, x1.w}, {qk[32].x, qk[32].y});
        }
      }

    // s[nt][0..1]: key r0, heads 2c, 2c+1 of head tile nt; s[nt][2..3]: key r1.
    float s[NT][4];
    float4 sc0 = make_float4(1.f, 1.f, 1.f, 1.f), sc1 = sc0;  // fp8_ds_mla_v4: applied above
    if constexpr (kFp8 && !kV4) {
      sc0 = *reinterpret_cast<const float4*>(rows + r0 * kStride + G::kScaleOffset);
      sc1 = *reinterpret_cast<const float4*>(rows + r1 * kStride + G::kScaleOffset);
    }
    const float sc0v[4] = {sc0.x, sc0.y, sc0.z, sc0.w}, sc1v[4] = {sc1.x, sc1.y, sc1.z, sc1.w};
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float* sc = e < 2 ? sc0v : sc1v;
        float latent = acc[0][nt][e] * sc[tile0];
#pragma unroll
        for (int tt = 1; tt < kScoreTiles; ++tt) latent += acc[tt][nt][e] * sc[tile0 + tt];
        s[nt][e] = latent * q_unscale[nt][e % 2] + acc[kScoreTiles][nt][e];
      }
    if constexpr (kSplitDims == 2) {  // add the other half's partial scores (lane l of both holds the same keys, heads)
      float4* mine = reinterpret_cast<float4*>(smem + L.exchange) +
                     ((group * kKeySlots + slot_k) * 2 + half_d) * NT * 32 + lane;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) mine[nt * 32] = make_float4(s[nt][0], s[nt][1], s[nt][2], s[nt][3]);
      named_barrier_sync(1 + group * kKeySlots + slot_k, 64);  // the key slot's two warps
      const float4* other = half_d ? mine - NT * 32 : mine + NT * 32;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const float4 x = other[nt * 32];
        s[nt][0] += x.x;
        s[nt][1] += x.y;
        s[nt][2] += x.z;
        s[nt][3] += x.w;
      }
    }
    const bool v0 = valid[r0], v1 = valid[r1];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      s[nt][0] = v0 ? s[nt][0] * p.scale_log2 : -INFINITY;
      s[nt][1] = v0 ? s[nt][1] * p.scale_log2 : -INFINITY;
      s[nt][2] = v1 ? s[nt][2] * p.scale_log2 : -INFINITY;
      s[nt][3] = v1 ? s[nt][3] * p.scale_log2 : -INFINITY;
    }

    // Online softmax per head column, over the 16 keys of lanes with the same
    // c; the max moves (and O is rescaled) only past kMaxSlack<F>.
    float cmax[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        cmax[nt][e] = fmaxf(s[nt][e], s[nt][e + 2]);
        for (int off = 4; off < 32; off *= 2)
          cmax[nt][e] = fmaxf(cmax[nt][e], __shfl_xor_sync(0xffffffffu, cmax[nt][e], off));
        top[nt][e] = fmaxf(top[nt][e], cmax[nt][e]);
      }
    bool grows = false;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) grows = grows || cmax[nt][0] > m[nt][0] + kMaxSlack<F> || cmax[nt][1] > m[nt][1] + kMaxSlack<F>;
    if (__any_sync(0xffffffffu, grows)) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        float alpha[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float m_new = fmaxf(m[nt][e], cmax[nt][e]);
          alpha[e] = m_new == -INFINITY ? 1.f : exp2f(m[nt][e] - m_new);
          l_part[nt][e] *= alpha[e];
          m[nt][e] = m_new;
        }
#pragma unroll
        for (int i = 0; i < kMTiles; ++i) {
          o[i][nt][0] *= alpha[0];
          o[i][nt][1] *= alpha[1];
          o[i][nt][2] *= alpha[0];
          o[i][nt][3] *= alpha[1];
        }
      }
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float base = m[nt][e] == -INFINITY ? 0.f : m[nt][e];  // nothing valid yet: stays at zero
        s[nt][e] = exp2f(s[nt][e] - base);
        s[nt][e + 2] = exp2f(s[nt][e + 2] - base);
        l_part[nt][e] += s[nt][e] + s[nt][e + 2];
      }

    // P^T of head tile nt as the B operand (keys x heads): P rows are keys here, so each 8x8 half is transposed in
    // registers.
    auto p_fragment = [&](int nt, auto one, float scale0, float scale1) {
      using U = decltype(one);
      return uint2{movmatrix_trans(pack2<U>(s[nt][0] * scale0, s[nt][1] * scale0)),
                   movmatrix_trans(pack2<U>(s[nt][2] * scale1, s[nt][3] * scale1))};
    };
    // fp8 values of rows kr+2c, kr+2c+1, kr+2c+8, kr+2c+9 at piece g of `tile` (16 dims of 4 keys), as byte pairs
    // (key kr+2c, kr+2c+1 in lo01/hi01; kr+2c+8, kr+2c+9 in lo23/hi23) per dim: [k] holds dims 4k, 4k+1 (lo) and
    // 4k+2, 4k+3 (hi), e4m3x2_to_f16x2's operands for the P V mma's A.
    struct KeyPairs {
      uint32_t lo01[4], hi01[4], lo23[4], hi23[4];
    };
    auto key_pairs = [&](int tile) {
      const uint4 x0 = load(v_off0 + 128 * tile), x1 = load(v_off1 + 128 * tile);
      const uint4 x2 = load(v_off0 + 128 * tile + 8 * kStride), x3 = load(v_off1 + 128 * tile + 8 * kStride);
      const uint32_t w0[4] = {x0.x, x0.y, x0.z, x0.w}, w1[4] = {x1.x, x1.y, x1.z, x1.w};
      const uint32_t w2[4] = {x2.x, x2.y, x2.z, x2.w}, w3[4] = {x3.x, x3.y, x3.z, x3.w};
      KeyPairs kp;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        kp.lo01[k] = byte_perm(w0[k], w1[k], 0x5140), kp.hi01[k] = byte_perm(w0[k], w1[k], 0x7362);
        kp.lo23[k] = byte_perm(w2[k], w3[k], 0x5140), kp.hi23[k] = byte_perm(w2[k], w3[k], 0x7362);
      }
      return kp;
    };
    if constexpr (kV4) {
      // Each key's scale, per 64 dims, is applied to its values (the 16 dims a lane holds in an mma's A are of one
      // tile, those of its 8 rows of two): code * 2^(e - tile_exp + kV4ValueExp) in f16, e the key's biased scale
      // exponent and tile_exp the largest this warp has met in the 128-dim tile (so at most 448 * 2^7 < 65504,
      // exact down to f16's 2^-24); P stays unscaled. In the last tile, lanes g >= 4 hold the bf16 tail's dims
      // instead (converted to f16, unscaled), and their O is never rescaled.
      const uint2 pt = p_fragment(0, __half{}, 1.f, 1.f);  // one head tile (NT 1)
      // Scale bytes of the keys of this lane's A columns: kr+2c, kr+2c+1, kr+2c+8, kr+2c+9.
      const uint8_t* const key_scales = rows + (kr + 2 * c) * kStride + G::kScaleOffset;
      auto hmul2 = [](uint32_t a, uint32_t b) {
        uint32_t r;
        asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
        return r;
      };
      auto bf16x2_to_f16x2 = [](uint32_t x) { return pack2<__half>(__uint_as_float(x << 16), __uint_as_float(x & 0xffff0000u)); };
#pragma unroll
      for (int tt = 0; tt < kScaleTiles; ++tt) {
        const int tile = half_d * kScaleTiles + tt;
        const bool tail = tile == kV4TailTile;  // its second 64 dims are the bf16 tail (warp-uniform)
        // The largest exponent of the tile's scales over the warp's 16 keys (a NaN scale, 255, left out).
        int e = max(min(v4_exponent(r0, 2 * tile), 254), min(v4_exponent(r1, 2 * tile), 254));
        if (!tail) e = max(e, max(min(v4_exponent(r0, 2 * tile + 1), 254), min(v4_exponent(r1, 2 * tile + 1), 254)));
        for (int off = 4; off < 32; off *= 2) e = max(e, __shfl_xor_sync(0xffffffffu, e, off));
        const bool tail_lane = tail && g >= 4;
        if (e > tile_exp[tt]) {  // warp-uniform
          const float f = tail_lane ? 1.f : exp2f(static_cast<float>(tile_exp[tt] - e));
#pragma unroll
          for (int i = 8 * tt; i < 8 * tt + 8; ++i)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) o[i][nt][0] *= f, o[i][nt][1] *= f, o[i][nt][2] *= f, o[i][nt][3] *= f;
          tile_exp[tt] = e;
        }
        auto multiplier = [&](int key) -> uint32_t {  // f16 bits of this lane's tile's factor for key kr+2c+key
          const int ek = key_scales[key * kStride + 2 * tile + g / 4], d = ek - tile_exp[tt] + kV4ValueExp;
          if (ek == 255) return 0x7e00u;  // a NaN scale, as the CPU backend reads it
          return d >= -14 ? static_cast<uint32_t>(d + 15) << 10 : d >= -24 ? 1u << (d + 24) : 0u;
        };
        const uint32_t m01 = multiplier(0) | multiplier(1) << 16, m23 = multiplier(8) | multiplier(9) << 16;
        const KeyPairs kp = key_pairs(tile);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const uint32_t lo01 = kp.lo01[k], hi01 = kp.hi01[k], lo23 = kp.lo23[k], hi23 = kp.hi23[k];
          uint32_t a_lo[4] = {hmul2(e4m3x2_to_f16x2(lo01), m01), hmul2(e4m3x2_to_f16x2<true>(lo01), m01),
                              hmul2(e4m3x2_to_f16x2(lo23), m23), hmul2(e4m3x2_to_f16x2<true>(lo23), m23)};
          uint32_t a_hi[4] = {hmul2(e4m3x2_to_f16x2(hi01), m01), hmul2(e4m3x2_to_f16x2<true>(hi01), m01),
                              hmul2(e4m3x2_to_f16x2(hi23), m23), hmul2(e4m3x2_to_f16x2<true>(hi23), m23)};
          if (tail) {  // warp-uniform; lanes g >= 4 take the tail's dims 4k, 4k+1 (a_lo) and 4k+2, 4k+3 (a_hi)
            // Dims 4k..4k+3 of the lane's 16 (tail pieces 2(g - 4), +1): 8 bytes of piece k / 2 of each row.
            auto load8 = [&](int row) {
              return *reinterpret_cast<const uint2*>(rows + row * kStride + G::kTailOffset + 16 * (2 * (g % 4) + k / 2) +
                                                     8 * (k % 2));
            };
            const uint2 y0 = load8(kr + 2 * c), y1 = load8(kr + 2 * c + 1), y2 = load8(kr + 2 * c + 8),
                        y3 = load8(kr + 2 * c + 9);
            if (tail_lane) {  // keys paired per dim
              a_lo[0] = bf16x2_to_f16x2(byte_perm(y0.x, y1.x, 0x5410));
              a_lo[1] = bf16x2_to_f16x2(byte_perm(y0.x, y1.x, 0x7632));
              a_lo[2] = bf16x2_to_f16x2(byte_perm(y2.x, y3.x, 0x5410));
              a_lo[3] = bf16x2_to_f16x2(byte_perm(y2.x, y3.x, 0x7632));
              a_hi[0] = bf16x2_to_f16x2(byte_perm(y0.y, y1.y, 0x5410));
              a_hi[1] = bf16x2_to_f16x2(byte_perm(y0.y, y1.y, 0x7632));
              a_hi[2] = bf16x2_to_f16x2(byte_perm(y2.y, y3.y, 0x5410));
              a_hi[3] = bf16x2_to_f16x2(byte_perm(y2.y, y3.y, 0x7632));
            }
          }
          mma_16816<__half>(o[8 * tt + 2 * k][0], a_lo, {pt.x, pt.y});
          mma_16816<__half>(o[8 * tt + 2 * k + 1][0], a_hi, {pt.x, pt.y});
        }
      }
    } else if constexpr (kFp8) {
#pragma unroll
      for (int tt = 0; tt < kScaleTiles; ++tt) {
        const int tile = half_d * kScaleTiles + tt;
        // The tile's largest scale exponent over the warp's 16 keys (lanes of one g hold the same two keys).
        int e = max(static_cast<int>(__float_as_uint(sc0v[tile]) >> 23 & 0xff),
                    static_cast<int>(__float_as_uint(sc1v[tile]) >> 23 & 0xff));
        for (int off = 4; off < 32; off *= 2) e = max(e, __shfl_xor_sync(0xffffffffu, e, off));
        if (e > tile_exp[tt]) {  // warp-uniform
          const float f = exp2f(static_cast<float>(tile_exp[tt] - e));
#pragma unroll
          for (int i = 8 * tt; i < 8 * tt + 8; ++i)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) o[i][nt][0] *= f, o[i][nt][1] *= f, o[i][nt][2] *= f, o[i][nt][3] *= f;
          tile_exp[tt] = e;
        }
        const float up = __uint_as_float(static_cast<uint32_t>(260 - tile_exp[tt]) << 23);  // 2^(133 - e)
        uint2 pt[NT];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) pt[nt] = p_fragment(nt, __half{}, sc0v[tile] * up, sc1v[tile] * up);
        const KeyPairs kp = key_pairs(tile);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const uint32_t lo01 = kp.lo01[k], hi01 = kp.hi01[k], lo23 = kp.lo23[k], hi23 = kp.hi23[k];
          // Each half converted where its mmas use it: only one half's fragment live at a time.
          const uint32_t a_lo[4] = {e4m3x2_to_f16x2(lo01), e4m3x2_to_f16x2<true>(lo01), e4m3x2_to_f16x2(lo23),
                                    e4m3x2_to_f16x2<true>(lo23)};
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) mma_16816<__half>(o[8 * tt + 2 * k][nt], a_lo, {pt[nt].x, pt[nt].y});
          const uint32_t a_hi[4] = {e4m3x2_to_f16x2(hi01), e4m3x2_to_f16x2<true>(hi01), e4m3x2_to_f16x2(hi23),
                                    e4m3x2_to_f16x2<true>(hi23)};
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) mma_16816<__half>(o[8 * tt + 2 * k + 1][nt], a_hi, {pt[nt].x, pt[nt].y});
        }
      }
    } else {
      uint2 pt[NT];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) pt[nt] = p_fragment(nt, T{}, 1.f, 1.f);
#pragma unroll
      for (int i = 0; i < kMTiles; ++i) {
        uint32_t a[4];
        ldmatrix_x4_trans(a, rows + ld_off[i % 4] + 128 * (i / 4));
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mma_16816<T>(o[i][nt], a, {pt[nt].x, pt[nt].y});
      }
    }
  };

  // The key slot's warps meet (barriers 9-12; the dim split's exchange takes 1-8).
  auto slot_sync = [&] {
    if constexpr (kSlotWarps == 1) __syncwarp();
    else named_barrier_sync(9 + slot_k, kSlotWarps * 32);
  };
  // read_at: chunk i's stage, in bytes; stage its index, parity its bulk phase.
  for (int i = 0, read_at = 0, stage = 0, parity = 0; i < n_chunks; ++i) {
    uint8_t* const refill = smem + (read_at > 0 ? read_at : stages * G::kStageBytes) - G::kStageBytes;  // chunk i-1's
    uint64_t* const refill_barrier = slot_barriers + (stage > 0 ? stage : stages) - 1;
    if (bulk && !kV4) {
      fence_shared_for_async_proxy();  // this thread's reads of chunk i-1 before the copies into its stage
      slot_sync();                 // the slot's warps are done with chunk i-1
      issue(i + stages - 1, refill, refill_barrier);
      mbarrier_wait(slot_barriers + stage, parity);  // chunk i has landed
    } else {
      cp_async_wait_dynamic(stages - 2);
      slot_sync();  // chunk i has landed (each warp's copies); the slot's warps are done with chunk i-1
      issue(i + stages - 1, refill, refill_barrier);
    }
    if (group_active) attend(smem + read_at);
    read_at += G::kStageBytes;
    if (++stage == stages) read_at = 0, stage = 0, parity ^= 1;
  }
  cp_async_wait<0>();

  // Merge the group's key slots: each warp scales its O^T to the group's max,
  // then a tree of adds through shared memory leaves the sum in merge slot 0
  // (the two dim halves of a key slot hold disjoint dims of the same slots).
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e)
      for (int off = 4; off < 32; off *= 2) l_part[nt][e] += __shfl_xor_sync(0xffffffffu, l_part[nt][e], off);
  constexpr int kStatRow = 3 * kGroupHeads;  // one key slot's stats
  float* my_stats = stats + group * kKeySlots * kStatRow;
  if (lane < 4 && half_d == 0)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int h = nt * kHeadsPerGroup + 2 * c + e;
        my_stats[slot_k * kStatRow + h] = m[nt][e];
        my_stats[slot_k * kStatRow + kGroupHeads + h] = l_part[nt][e];
        my_stats[slot_k * kStatRow + 2 * kGroupHeads + h] = top[nt][e];
      }
  __syncthreads();  // stats published; every warp is done with the stages
  float row_max[NT][2], row_sum[NT][2], row_top[NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int h = nt * kHeadsPerGroup + 2 * c + e;
      float mx = -INFINITY, tp = -INFINITY;
      for (int w = 0; w < kKeySlots; ++w) {
        mx = fmaxf(mx, my_stats[w * kStatRow + h]);
        tp = fmaxf(tp, my_stats[w * kStatRow + 2 * kGroupHeads + h]);
      }
      float sum = 0.f;
      for (int w = 0; w < kKeySlots; ++w) {
        const float mw = my_stats[w * kStatRow + h];
        sum += mw == -INFINITY ? 0.f : my_stats[w * kStatRow + kGroupHeads + h] * exp2f(mw - mx);
      }
      row_max[nt][e] = mx;
      row_sum[nt][e] = sum;
      row_top[nt][e] = tp;
      const float f = m[nt][e] == -INFINITY ? 0.f : exp2f(m[nt][e] - mx);
#pragma unroll
      for (int i = 0; i < kMTiles; ++i) {
        // fp8: O's tile back from its power of two (not fp8_ds_mla_v4's bf16 tail)
        float fi = f;
        if constexpr (kV4) {
          if (!(half_d * kScaleTiles + i / 8 == kV4TailTile && g >= 4)) fi = ldexpf(f, tile_exp[i / 8] - 127 - kV4ValueExp);
        } else if constexpr (kFp8) {
          fi = ldexpf(f, tile_exp[i / 8] - 133);
        }
        o[i][nt][e] *= fi;
        o[i][nt][e + 2] *= fi;
      }
    }
  // Slot s of this group: [kGroupHeads heads][512 dims] fp32. o[i][nt][e] is head 8 nt + 2c + e % 2's dim
  //   fp8:    128 (half_d kScaleTiles + i / 8) + 16 g + 2 (i % 8) + e / 2,
  //   16-bit: 16 (half_d kMTiles + i) + g + 8 (e / 2),
  // at merge_index of those. Its XOR touches only dim bits that the compile-time i and e pick (fp8: 2 (i % 8) for
  // i even; 16-bit: 16 (i % 2) + 8 (e / 2)), so its 4 outcomes are fixed per thread here and the accesses take
  // immediate offsets (computed per access, the bf16 instances spilled).
  float* merge = reinterpret_cast<float*>(smem) + group * (kKeySlots / 2) * kGroupHeads * kVDim;
  constexpr int kSwizzleShift = kFp8 ? 2 : 3;
  int swz[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) swz[k] = (k ^ c) << kSwizzleShift;
  // (Heads 8 nt + 2c, +1 swizzle by c as heads 2c, 2c+1 do.)
  auto visit = [&](float* slot, bool add) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      float* const heads = slot + (nt * kHeadsPerGroup + 2 * c) * kVDim;  // this lane's heads of head tile nt
      if constexpr (kFp8) {  // dims 4q..4q+3 of a lane's 16: o[i][e], o[i][e + 2], o[i + 1][e], o[i + 1][e + 2] (i even)
#pragma unroll
        for (int i = 0; i < kMTiles; i += 2)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float4* at = reinterpret_cast<float4*>(heads + e * kVDim + 128 * (half_d * kScaleTiles + i / 8) + 16 * g +
                                                   swz[(i % 8) / 2]);
            float(&a)[4] = o[i][nt];
            float(&b)[4] = o[i + 1][nt];
            if (add) {
              const float4 v = *at;
              a[e] += v.x, a[e + 2] += v.y, b[e] += v.z, b[e + 2] += v.w;
            } else {
              *at = make_float4(a[e], a[e + 2], b[e], b[e + 2]);
            }
          }
      } else {
#pragma unroll
        for (int i = 0; i < kMTiles; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float* at = heads + (e % 2) * kVDim + 16 * half_d * kMTiles + 32 * (i / 2) + g + swz[2 * (i % 2) + e / 2];
            if (add) o[i][nt][e] += *at;
            else *at = o[i][nt][e];
          }
      }
    }
  };
  for (int half = kKeySlots / 2; half >= 1; half /= 2) {
    if (slot_k >= half && slot_k < 2 * half) visit(merge + (slot_k - half) * kGroupHeads * kVDim, false);
    __syncthreads();
    if (slot_k < half) visit(merge + slot_k * kGroupHeads * kVDim, true);
    __syncthreads();
  }
  if (slot_k == 0) visit(merge, false);
  const float ln2 = 0.6931471805599453f;
  if (slot_k == 0 && half_d == 0 && lane < 4)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {  // each head's lse, output scale and max for the write-out, in key slot 0's stats
        const int hw = nt * kHeadsPerGroup + 2 * c + e, hl = group * kGroupHeads + hw;
        const float l = row_sum[nt][e], lse2 = l > 0.f ? row_max[nt][e] + log2f(l) : -INFINITY;
        float scale = l > 0.f ? 1.f / l : 0.f;
        if (p.num_splits == 1 && p.attn_sink && l > 0.f && hl < nh) scale /= 1.f + expf(p.attn_sink[h0 + hl] - lse2 * ln2);
        // unsplit: the lse and max logit as stored (natural log); split: the partial row's, in log2 units
        my_stats[hw] = p.num_splits > 1 ? lse2 : l > 0.f ? lse2 * ln2 : p.empty_lse;
        my_stats[kGroupHeads + hw] = scale;
        my_stats[2 * kGroupHeads + hw] = p.num_splits > 1 ? row_top[nt][e] : row_top[nt][e] * ln2;
      }
  __syncthreads();

  // Write-out, 4 dims per thread: the normalised output (or this split's partial row) and the lse.
  for (int e = tid; e < nh * (kVDim / 4); e += kThreadsPerCta) {
    const int hl = e / (kVDim / 4), col = (e % (kVDim / 4)) * 4;
    const int gi = hl / kGroupHeads, hg = hl % kGroupHeads, h = h0 + hl;
    const float* st = stats + gi * kKeySlots * kStatRow;
    const float scale = st[kGroupHeads + hg];
    const float4 v = *reinterpret_cast<const float4*>(reinterpret_cast<const float*>(smem) +
                                                      gi * (kKeySlots / 2) * kGroupHeads * kVDim +
                                                      merge_index<kFp8>(hg, col));
    if (p.num_splits == 1) {
      uint16_t* out =
          static_cast<uint16_t*>(p.out) + b * p.out_stride_b + j * p.out_stride_s + h * p.out_stride_h + col;
      const uint32_t lo =
          p.q_is_bf16 ? pack2<__nv_bfloat16>(v.x * scale, v.y * scale) : pack2<__half>(v.x * scale, v.y * scale);
      const uint32_t hi =
          p.q_is_bf16 ? pack2<__nv_bfloat16>(v.z * scale, v.w * scale) : pack2<__half>(v.z * scale, v.w * scale);
      *reinterpret_cast<uint2*>(out) = make_uint2(lo, hi);
      if (col == 0) {
        p.lse[b * p.lse_stride_b + j * p.lse_stride_s + h * p.lse_stride_h] = st[hg];
        if (p.max_logits) p.max_logits[t * p.max_logits_stride_t + h * p.max_logits_stride_h] = st[2 * kGroupHeads + hg];
      }
    } else {
      const int64_t row = (static_cast<int64_t>(split) * p.num_tokens + t) * p.num_heads + h;
      *reinterpret_cast<float4*>(p.partial_out + row * kVDim + col) =
          make_float4(v.x * scale, v.y * scale, v.z * scale, v.w * scale);
      if (col == 0) {
        p.partial_lse[row] = st[hg];
        p.partial_max[row] = st[2 * kGroupHeads + hg];
      }
    }
  }
}

}  // namespace smla::cuda::mla::small
