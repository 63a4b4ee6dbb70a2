// indexer_topk on the GPU: the scores kernel (indexer_scores.cu) writes every
// visible position's score to a workspace row per token, then one CTA per
// token selects the exact top-k without sorting the row:
//   1. a 4096-bin histogram of the scores rounded to fp16 (a monotone map, so
//      the bins are ordered as the scores are) finds the bin holding the
//      k-th largest;
//   2. a second pass over the row compacts, in position order, the positions
//      in higher bins (all selected) and those in that bin (candidates) into
//      shared memory;
//   3. the candidates that complete the k (equal scores: the lowest positions)
//      are picked by ranking each against the others (up to 512 of them), else
//      by an exact radix select over their fp32 order keys;
//   4. a stable radix sort by key orders the k best first, equal scores
//      toward the lower position — the CPU backend's result; or, unsorted,
//      a merge of the chosen (runs each in position order) puts them in
//      position order (a held row's: one scan, below).
// Step 1's counts may come from the scores kernel instead (TopkFusion::histograms, any split but slices): it counts
// each row's bins as it writes the scores, so the top-k reads 16 KB per row rather than the row (a cluster's ranks
// each read the whole row's, none sums). indexer_topk and dsa_decode_step leave it off, as it was slower
// (scores_then_topk, below); tests and bench_cuda step run it through select_topk.
// A row of at most kHeldRow (16384) positions that one CTA has alone is read
// from memory once, into registers (HeldRow), each thread's positions
// consecutive: steps 1 and 2 take the scores from there (the compaction one
// block scan of per-thread counts), not from two passes over the row; unsorted,
// the chosen candidates are marked in a bitmap of positions and one more scan
// of per-thread counts places every chosen position in position order. Where
// every row is held and k <= 2048, the CTA has 1024 threads (kWideThreads).
// Each phase's time on the H200 follows the instructions its warps execute
// (see docs/performance.md), so loops over a thread's items have no branch per
// item and rarely-long loops are not unrolled.
// When the candidates do not fit in shared memory (many equal scores), the
// exact radix select runs over the row itself instead (four more passes).
// Long rows of tokens too few to fill the GPU with one CTA each share steps
// 1-2 among CTAs that each take a slice of the row. On SM90+ the CTAs (ranks)
// of a thread block cluster share it through distributed shared memory: each
// builds its slice's histogram, each sums a share of the bins over all of
// them and hands the sums to all (so every rank finds the same bin), each
// compacts its slice into its own shared memory and pushes the lists into
// rank 0's after those of the ranks before it (so in position order); rank 0
// goes on alone with steps 3-4. Below SM90 (no clusters) three more kernels pass
// through global memory: one writes each slice's histogram; a second (one CTA
// per token) sums them, finds the bin and gives each slice its offsets in the
// token's lists; a third compacts each slice there; the per-token CTA then
// copies the lists instead of reading the row.
#include <cooperative_groups.h>
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>
#include <cuda_fp16.h>

#include <algorithm>
#include <optional>

#include "cuda/backend.h"
#include "cuda/common/mma.cuh"
#include "cuda/common/runtime.h"
#include "cuda/indexer/indexer_common.cuh"
#include "cuda/common/step_stamps.cuh"
#include "cuda/kernels.h"

namespace smla::cuda {

namespace {

// Threads per CTA: kThreads, but kWideThreads for a held row (below) of top-k <= 2048: a phase's time follows the
// instructions each warp issues, 16 warps issuing about one every 2 cycles per scheduler (H200), so twice the warps
// with half the items each should hide more of that latency (not yet measured: docs/performance.md, issue 23).
// Helpers take the CTA's threads as kBlock.
constexpr int kThreads = 512, kWideThreads = 1024;
constexpr int kFineCopies = 8, kFineBins = 257;  // 8-bit radix digits; 8 copies (thread % 8) cut same-address atomics
constexpr int kRun = 16;                         // consecutive positions per thread per compaction chunk
constexpr int kFewCopies = 2;                    // of a run's, read again rather than tested in registers
constexpr int kHeldRow = 16384;                  // the longest row one CTA holds in registers
static_assert(kFineCopies * kFineBins <= kCoarseBins, "the fine histograms reuse the coarse one's memory");

template <int kBlock>
using Scan = cub::BlockScan<int, kBlock>;

// Thread block clusters exist from SM90 on; the host launches clusters of
// more than one CTA only there, so on older archs these are never reached.
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cooperative_groups::this_cluster().sync();
#else
  __trap();
#endif
}
// Where `p`, in this CTA's shared memory, lies in the shared memory of the cluster's CTA `rank`.
template <class T>
__device__ __forceinline__ T* rank_shared(T* p, int rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return cooperative_groups::this_cluster().map_shared_rank(p, rank);
#else
  __trap();
  return p;
#endif
}

struct Entry {
  uint32_t key;  // order key of the score
  int32_t pos;   // -1: no position
};

// Monotone map of a score to an unsigned key (as the CPU backend's order_key):
// a > b iff key(a) > key(b); -0 and +0 tie.
__device__ __forceinline__ uint32_t order_key(float v) {
  const uint32_t u = __float_as_uint(v + 0.0f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// hist[0, kCoarseBins) = 0 (hist 16-byte aligned), by 16-byte stores (a fixed count a thread: a loop to a bound
// the compiler cannot see through compiles to ~60 instructions).
template <int kBlock>
__device__ __forceinline__ void zero_bins(int* hist) {
  constexpr int kPer = kCoarseBins / 4 / kBlock;
  static_assert(kPer * 4 * kBlock == kCoarseBins, "whole 16-byte pieces per thread");
#pragma unroll
  for (int k = 0; k < kPer; ++k) reinterpret_cast<int4*>(hist)[k * kBlock + threadIdx.x] = make_int4(0, 0, 0, 0);
}

// hist[0, kCoarseBins) = counted[0, kCoarseBins) (both 16-byte aligned), every load issued before the first store.
template <int kBlock>
__device__ __forceinline__ void copy_bins(const int* counted, int* hist) {
  constexpr int kPer = kCoarseBins / 4 / kBlock;
  static_assert(kPer * 4 * kBlock == kCoarseBins, "whole 16-byte pieces per thread");
  int4 piece[kPer];
#pragma unroll
  for (int k = 0; k < kPer; ++k) piece[k] = reinterpret_cast<const int4*>(counted)[k * kBlock + threadIdx.x];
#pragma unroll
  for (int k = 0; k < kPer; ++k) reinterpret_cast<int4*>(hist)[k * kBlock + threadIdx.x] = piece[k];
}

// Calls f(value) for the row's n scores: each thread loads kBatch 16-byte
// pieces (those the row has) before it uses the first (f's shared-memory
// atomics would otherwise keep the next load from being issued: one load in
// flight per thread, a trip to memory each); 64 KB in flight per CTA (a CTA of 1024 threads has half the
// registers a thread).
template <int kBlock, class F>
__device__ __forceinline__ void for_each_score(const float* row, int64_t n, F&& f) {
  constexpr int kBatch = 4096 / kBlock;
  const float4* row4 = reinterpret_cast<const float4*>(row);
  const int64_t n4 = n / 4;
  for (int64_t i = threadIdx.x; i < n4; i += kBatch * kBlock) {
    float4 v[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b)
      if (i + b * kBlock < n4) v[b] = row4[i + b * kBlock];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (i + b * kBlock >= n4) break;
      f(v[b].x);
      f(v[b].y);
      f(v[b].z);
      f(v[b].w);
    }
  }
  for (int64_t j = 4 * n4 + threadIdx.x; j < n; j += kBlock) f(row[j]);
}

// Positions [first, first + count) of a row's scores (rows start 16-byte
// aligned, see score_row_stride; `first` is a multiple of 4). Items are the
// scores themselves, classified as they are (an entry is made only of those
// copied); a chunk's scores are fetched into registers a chunk ahead.
struct RowSource {
  const float* row;
  int count, first = 0;
  using Item = float;
  using Fetched = float4[kRun / 4];
  __device__ __forceinline__ float item(int i) const { return row[first + i]; }
  __device__ __forceinline__ void fetch(int i0, Fetched& v) const {
    if (i0 + kRun <= count) {
#pragma unroll
      for (int q = 0; q < kRun / 4; ++q) v[q] = reinterpret_cast<const float4*>(row + first + i0)[q];
    }
  }
  __device__ __forceinline__ void load(int i0, const Fetched& v, float (&x)[kRun]) const {
    if (i0 + kRun <= count) {
#pragma unroll
      for (int q = 0; q < kRun / 4; ++q) {
        x[4 * q] = v[q].x;
        x[4 * q + 1] = v[q].y;
        x[4 * q + 2] = v[q].z;
        x[4 * q + 3] = v[q].w;
      }
    } else {
#pragma unroll
      for (int j = 0; j < kRun; ++j) x[j] = i0 + j < count ? row[first + i0 + j] : 0.f;
    }
  }
  __device__ __forceinline__ Entry entry(int i, float v) const { return {order_key(v), first + i}; }
};

// Entries already in shared memory (nothing to fetch ahead).
struct ListSource {
  const Entry* list;
  int count;
  using Item = Entry;
  struct Fetched {};
  __device__ __forceinline__ Entry item(int i) const { return list[i]; }
  __device__ __forceinline__ void fetch(int, Fetched&) const {}
  __device__ __forceinline__ void load(int i0, const Fetched&, Entry (&x)[kRun]) const {
#pragma unroll
    for (int j = 0; j < kRun; ++j) x[j] = i0 + j < count ? list[i0 + j] : Entry{0, -1};
  }
  __device__ __forceinline__ Entry entry(int, const Entry& e) const { return e; }
};

// Where compact keeps its warps' counts: two sets, used by turns, so one CTA
// barrier per chunk suffices.
template <int kBlock>
using WarpTotals = int[2][kBlock / 32];

// Copies, in source order, the entries whose items `classify` puts in class
// 1 to first[] and those in class 2 to second[] (only the first second_limit
// of them). Each thread classifies its run of kRun consecutive items into two
// bit masks (no branches); a scan over the warp's lanes (shuffles) and the
// warps' totals give each run its place. The caller synchronises before it
// reads the copies or calls again. Returns how many items of each class
// there were (all of class 2, beyond second_limit too).
template <int kBlock, class Source, class Classify>
__device__ int2 compact(const Source& src, Classify classify, Entry* first, Entry* second, int second_limit,
                        WarpTotals<kBlock>& totals) {
  constexpr int kChunk = kRun * kBlock, kWarps = kBlock / 32;
  static_assert(kChunk < (1 << 16), "a chunk's counts of both classes fit in one int");
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, mine = kRun * threadIdx.x;
  int first_base = 0, second_base = 0, turn = 0;
  typename Source::Fetched next;
  src.fetch(mine, next);
  for (int base = 0; base < src.count; base += kChunk, turn ^= 1) {
    typename Source::Item x[kRun];
    src.load(base + mine, next, x);
    src.fetch(base + kChunk + mine, next);
    const int valid = src.count - (base + mine);  // items of the run before the source's end
    uint32_t ones = 0, twos = 0;
#pragma unroll
    for (int j = 0; j < kRun; ++j) {
      const int c = classify(x[j]);
      ones |= static_cast<uint32_t>(j < valid && c == 1) << j;
      twos |= static_cast<uint32_t>(j < valid && c == 2) << j;
    }
    const int counts = __popc(ones) | (__popc(twos) << 16);
    int upto = counts;  // inclusive over the warp's lanes
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int v = __shfl_up_sync(0xffffffffu, upto, d);
      if (lane >= d) upto += v;
    }
    if (lane == 31) totals[turn][warp] = upto;
    __syncthreads();
    int before = upto - counts, total = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const int t = totals[turn][w];
      total += t;
      before += w < warp ? t : 0;
    }
    int at1 = first_base + (before & 0xffff), at2 = second_base + (before >> 16);
    // A run with few items to copy reads them again (a cache hit each, one after the other); one with more copies
    // them from the registers (testing every item costs less than a chain of trips to memory).
    const auto copy = [&](int j, const typename Source::Item& v) {
      const Entry e = src.entry(base + mine + j, v);
      if ((ones >> j) & 1) {
        first[at1++] = e;
      } else {
        if (at2 < second_limit) second[at2] = e;
        ++at2;
      }
    };
    const uint32_t copied = ones | twos;
    if (__popc(copied) > kFewCopies) {
#pragma unroll
      for (int j = 0; j < kRun; ++j)
        if ((copied >> j) & 1) copy(j, x[j]);
    } else {
      for (uint32_t left = copied; left != 0; left &= left - 1) {
        const int j = __ffs(left) - 1;
        copy(j, src.item(base + mine + j));
      }
    }
    first_base += total & 0xffff;
    second_base += total >> 16;
  }
  return make_int2(first_base, second_base);
}

// What the split path's plan says of a token's row: the bin of the want-th largest, how many lie above it and in
// it, and whether the candidates fit the per-token CTA's shared memory (if not, it selects over the row).
struct RowPlan {
  int bin, above, in_bin, fits;
  // The split path's plans go on with two offsets per slice: see slice_offsets.
};
constexpr int kPlanInts = sizeof(RowPlan) / sizeof(int);

// Compacts a row's scores in bins above plan.bin to first[] and those in it to second[] (bin b holds the half
// keys b * 16 .. b * 16 + 15).
template <int kBlock>
__device__ int2 compact_by_bin(const RowSource& src, const RowPlan& plan, Entry* first, Entry* second,
                               int second_limit, WarpTotals<kBlock>& totals) {
  const uint32_t lowest_in = static_cast<uint32_t>(plan.bin) << 4, lowest_above = lowest_in + 16;
  const auto by_bin = [&](float v) {
    const uint32_t key = half_key(v);
    return key >= lowest_above ? 1 : key >= lowest_in ? 2 : 0;
  };
  return compact<kBlock>(src, by_bin, first, second, second_limit, totals);
}

// A row of at most kHeldRow scores, read once into registers (one CTA of kBlock threads per row): thread i holds
// `pieces` (at most kPieces) consecutive 16-byte pieces, positions [first, first + 4 * pieces) with first = 4 *
// pieces * i, so the CTA's position order is that of (thread, item) and a compaction in position order is one scan
// of the threads' counts. Every load is issued before any is used. The loops over the items have no branch per item
// (the phases' time goes with the instructions each warp issues): items past the row's end are masked out by
// `valid`.
template <int kBlock>
struct HeldRow {
  static constexpr int kPieces = kHeldRow / (4 * kBlock);
  static_assert(4 * kPieces <= 32, "a thread's items are the bits of one word");
  float4 piece[kPieces];
  int pieces, first;
  uint32_t valid;  // the bits (see for_each) of the thread's items that lie in the row

  __device__ __forceinline__ HeldRow(const float* row, int n)
      : pieces((n + 4 * kBlock - 1) / (4 * kBlock)), first(4 * pieces * threadIdx.x) {
    const int items = max(0, min(4 * pieces, n - first));
    valid = items >= 32 ? ~0u : (1u << items) - 1;
#pragma unroll
    for (int g = 0; g < kPieces; ++g) {
      piece[g] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (g < pieces && first + 4 * g < n) piece[g] = reinterpret_cast<const float4*>(row + first)[g];
    }
  }
  // The score of item `bit` (see for_each) by a tree of selects over the registers, one level a bit of the piece's
  // index, highest first: an indexed read of `piece` (or a chain of compares, which the compiler makes one) puts it
  // in local memory.
  __device__ __forceinline__ float score_of(int bit) const {
    static_assert((kPieces & (kPieces - 1)) == 0, "whole levels of selects");
    float4 v[kPieces];
#pragma unroll
    for (int g = 0; g < kPieces; ++g) v[g] = piece[g];
#pragma unroll
    for (int half = kPieces / 2; half >= 1; half /= 2)
#pragma unroll
      for (int g = 0; g < half; ++g) v[g] = (bit >> 2) & half ? v[g + half] : v[g];
    const int c = bit & 3;
    return c == 0 ? v[0].x : c == 1 ? v[0].y : c == 2 ? v[0].z : v[0].w;
  }
  // Calls f(bit, score) for each of the thread's items, those past the row's end too (bit 4g + c: item c of piece
  // g, position first + bit), in position order.
  template <class F>
  __device__ __forceinline__ void for_each(F&& f) const {
#pragma unroll
    for (int g = 0; g < kPieces; ++g) {
      if (g >= pieces) break;  // the same for the whole CTA
      f(4 * g, piece[g].x);
      f(4 * g + 1, piece[g].y);
      f(4 * g + 2, piece[g].z);
      f(4 * g + 3, piece[g].w);
    }
  }
};

// The coarse histogram of a held row (hist zeroed): an item past the row's end adds 0.
template <int kBlock>
__device__ __forceinline__ void held_histogram(const HeldRow<kBlock>& r, int* hist) {
  r.for_each([&](int bit, float v) { atomicAdd(&hist[coarse_bin(v)], static_cast<int>((r.valid >> bit) & 1)); });
}

// A held row's items in bins above the plan's (selected) and in it (candidates), as bit masks of HeldRow::for_each's
// bits; the thread's first position.
struct HeldClasses {
  uint32_t selected = 0, candidates = 0;
  int first = 0;
};

// compact_by_bin for a held row, from the registers: each thread counts its items of either class (16-bit fields:
// selected low, candidates high; at most kHeldRow each), one block scan gives it their places (then it calls
// counted()), and it writes them in position order: the candidates, and the selected only if `selected_too` (the
// unsorted order takes them from the returned classes), in a loop over the set bits (a store per item took ~19
// instructions an item, SASS, every item, where about one in four is written; reading the items written again from
// memory made the sorted order's writes slower on the H200, the row likely not in L1). The caller synchronises
// before it reads the copies.
template <int kBlock, class Counted>
__device__ HeldClasses compact_held(const HeldRow<kBlock>& r, const RowPlan& plan, Entry* first, Entry* second,
                                    bool selected_too, typename Scan<kBlock>::TempStorage& scan, Counted counted) {
  static_assert(kHeldRow < (1 << 16), "a class's count over the row fits 16 bits");
  const uint32_t lowest_in = static_cast<uint32_t>(plan.bin) << 4, lowest_above = lowest_in + 16;
  HeldClasses classes;
  classes.first = r.first;
  r.for_each([&](int bit, float v) {
    const uint32_t key = half_key(v);
    classes.selected |= static_cast<uint32_t>(key >= lowest_above) << bit;
    classes.candidates |= static_cast<uint32_t>(key - lowest_in < 16) << bit;
  });
  classes.selected &= r.valid;
  classes.candidates &= r.valid;
  int before;
  Scan<kBlock>(scan).ExclusiveSum(__popc(classes.selected) | __popc(classes.candidates) << 16, before);
  counted();
  const auto write = [&](uint32_t bits, Entry* to) {
    for (; bits != 0; bits &= bits - 1) {
      const int bit = __ffs(bits) - 1;
      *to++ = Entry{order_key(r.score_of(bit)), r.first + bit};
    }
  };
  write(classes.candidates, second + (before >> 16));
  if (selected_too) write(classes.selected, first + (before & 0xffff));
  return classes;
}

// The bin of hist[0, bins) in which the want-th largest falls, counting from
// the top, and how many lie in the bins above it: result[0], result[1].
template <int kBlock>
__device__ void find_from_top(const int* hist, int bins, int want, typename Scan<kBlock>::TempStorage& scan,
                              int* result) {
  const int per = (bins + kBlock - 1) / kBlock;
  const int hi = bins - static_cast<int>(threadIdx.x) * per;  // this thread's bins: [hi - per, hi)
  int local = 0;
  for (int b = hi - 1; b >= max(hi - per, 0); --b) local += hist[b];
  int before;
  Scan<kBlock>(scan).ExclusiveSum(local, before);
  if (before < want && want <= before + local) {
    int above = before, b = hi - 1;
    while (above + hist[b] < want) above += hist[b--];
    result[0] = b;
    result[1] = above;
  }
  __syncthreads();
}

// The plan of a row from its coarse histogram (every thread gets it).
template <int kBlock>
__device__ RowPlan plan_from_histogram(const int* hist, int want, int list_capacity,
                                       typename Scan<kBlock>::TempStorage& scan, int* result) {
  find_from_top<kBlock>(hist, kCoarseBins, want, scan, result);
  const int bin = result[0];
  return {bin, result[1], hist[bin], want + hist[bin] <= list_capacity};
}

// Exact radix select, 8 bits at a time from the top: the key of the want-th
// largest of the keys for_each_key visits (threshold), and how many keys
// equal to it complete the want (remaining). Every key lies in [lowest,
// highest]: the digits above the highest where those two differ are known
// (candidates of one coarse bin share the top one or two), so the rounds
// start below them (none when lowest == highest).
template <int kBlock, class ForEachKey>
__device__ void radix_select(ForEachKey for_each_key, int want, int* hist, typename Scan<kBlock>::TempStorage& scan,
                             int* result,
                             uint32_t& threshold, int& remaining, uint32_t lowest = 0, uint32_t highest = ~0u) {
  const int top = lowest == highest ? -8 : (31 - __clz(lowest ^ highest)) / 8 * 8;  // shift of the first digit
  uint32_t mask = top == -8 ? ~0u : top == 24 ? 0u : ~0u << (top + 8);
  uint32_t prefix = lowest & mask;
  remaining = want;
  for (int shift = top; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < kFineCopies * kFineBins; i += kBlock) hist[i] = 0;
    __syncthreads();
    int* mine = hist + (threadIdx.x % kFineCopies) * kFineBins;
    for_each_key([&](uint32_t key) {
      if ((key & mask) == prefix) atomicAdd(&mine[(key >> shift) & 0xff], 1);
    });
    __syncthreads();
    for (int b = threadIdx.x; b < 256; b += kBlock)
      for (int c = 1; c < kFineCopies; ++c) hist[b] += hist[c * kFineBins + b];
    __syncthreads();
    find_from_top<kBlock>(hist, 256, remaining, scan, result);
    prefix |= static_cast<uint32_t>(result[0]) << shift;
    remaining -= result[1];
    mask |= 0xffu << shift;
    __syncthreads();  // result and hist are rewritten next round
  }
  threshold = prefix;
}

constexpr int kMaxBucket = 64;  // the most entries in one bucket that place_by_counting takes

// store(in_order) with in_order[j] = ordered[j * kBlock + threadIdx.x], -1 from want on.
template <int kBlock, int kItems, class Store>
__device__ __forceinline__ void store_striped(const int* ordered, int want, Store store) {
  int32_t in_order[kItems];
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int i = j * kBlock + threadIdx.x;
    in_order[j] = i < want ? ordered[i] : -1;
  }
  store(in_order);
}

// Step 4 without radix passes, where that pays: the chosen entries (keys[j], positions[j] of blocked items i <
// want) fall in kCoarseBins buckets by the top bits of their key less `lowest` (the lowest chosen; `bits`: the
// width of the highest less it). A bucket's place is the count of chosen in higher buckets; an entry's, its
// bucket's plus the count of its bucket's entries that go before it (a higher key, or the same key at a lower
// position: the order of the stable sort). Calls store(in_order) with the positions in their places, striped
// (thread i the places i, i + kBlock, ...: coalesced stores; -1 from want on); returns false, having stored
// nothing, when a bucket holds more than kMaxBucket (many equal or close keys: the radix sort costs less then).
// Uses hist (16-byte aligned) and scan, and in the free list memory `bucketed` (want entries) and `cursor`
// (kCoarseBins ints, then want more).
template <int kBlock, int kSortItems, class Store>
__device__ bool place_by_counting(const uint32_t (&keys)[kSortItems], const int32_t (&positions)[kSortItems], int want,
                                  uint32_t lowest, int bits, int* hist, typename Scan<kBlock>::TempStorage& scan,
                                  int* largest, Entry* bucketed, int* cursor, Store store) {
  constexpr int kPer = kCoarseBins / kBlock, kPieces = kPer / 4;
  static_assert(kPieces * 4 == kPer, "a thread's buckets are whole 16-byte pieces");
  const int shift = max(0, bits - 12);  // (key - lowest) >> shift < 2^12
  zero_bins<kBlock>(hist);
  if (threadIdx.x == 0) *largest = 0;
  __syncthreads();
  int bucket[kSortItems];
#pragma unroll
  for (int j = 0; j < kSortItems; ++j) {
    bucket[j] = threadIdx.x * kSortItems + j < want ? static_cast<int>((keys[j] - lowest) >> shift) : -1;
    if (bucket[j] >= 0) atomicAdd(&hist[bucket[j]], 1);
  }
  __syncthreads();
  // This thread's kPer buckets [first, first + kPer), counted from the top: their places (in hist, and the cursors'
  // starts) and the largest. Read and written as 16-byte pieces: word by word, threads kPer words apart would
  // meet in a quarter of the banks.
  const int first = kCoarseBins - (static_cast<int>(threadIdx.x) + 1) * kPer;
  int4* counts = reinterpret_cast<int4*>(hist + first);
  int n[kPer];
#pragma unroll
  for (int q = 0; q < kPieces; ++q) {
    const int4 c = counts[q];
    n[4 * q] = c.x;
    n[4 * q + 1] = c.y;
    n[4 * q + 2] = c.z;
    n[4 * q + 3] = c.w;
  }
  int local = 0, most = 0;
#pragma unroll
  for (int b = 0; b < kPer; ++b) {
    local += n[b];
    most = max(most, n[b]);
  }
  int before;
  Scan<kBlock>(scan).ExclusiveSum(local, before);
  most = __reduce_max_sync(0xffffffffu, most);
  if (threadIdx.x % 32 == 0) atomicMax(largest, most);
  int at[kPer];
#pragma unroll
  for (int b = kPer - 1; b >= 0; --b) {
    at[b] = before;
    before += n[b];
  }
#pragma unroll
  for (int q = 0; q < kPieces; ++q)
    counts[q] = reinterpret_cast<int4*>(cursor + first)[q] =
        make_int4(at[4 * q], at[4 * q + 1], at[4 * q + 2], at[4 * q + 3]);
  __syncthreads();
  if (*largest > kMaxBucket) return false;
#pragma unroll
  for (int j = 0; j < kSortItems; ++j)
    if (bucket[j] >= 0) bucketed[atomicAdd(&cursor[bucket[j]], 1)] = {keys[j], positions[j]};
  __syncthreads();
  int* ordered = cursor + kCoarseBins;
#pragma unroll
  for (int j = 0; j < kSortItems; ++j) {
    if (bucket[j] < 0) continue;
    const int end = cursor[bucket[j]];
    int place = hist[bucket[j]];
#pragma unroll 1  // a bucket holds one or two entries mostly: unrolled, this loop was most of the function's code
    for (int m = place; m < end; ++m) {
      const Entry e = bucketed[m];
      place += e.key > keys[j] || (e.key == keys[j] && e.pos < positions[j]);
    }
    ordered[place] = positions[j];
  }
  __syncthreads();
  store_striped<kBlock, kSortItems>(ordered, want, store);
  return true;
}

// Step 4 for sorted = false. The chosen, at(0 .. want - 1), are three runs [0, second), [second, third), [third,
// want), each in position order, no position twice: an entry's place among all in position order is its index in
// its run plus, for each other run, how many entries there lie at lower positions (a binary search). The places go
// through `ordered` (want ints, overwriting the runs once all are read) to store(in_order) as in place_by_counting.
template <int kBlock, int kItems, class At, class Store>
__device__ void place_by_position(At at, int want, int second, int third, int* ordered, Store store) {
  const int starts[4] = {0, second, third, want};
  int place[kItems], position[kItems];
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int i = j * kBlock + threadIdx.x;
    if (i >= want) continue;
    position[j] = at(i).pos;
    place[j] = 0;
#pragma unroll
    for (int r = 0; r < 3; ++r) {
      int lo = starts[r], hi = starts[r + 1];
      if (lo <= i && i < hi) {
        place[j] += i - lo;
        continue;
      }
      while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (at(mid).pos < position[j]) lo = mid + 1;
        else hi = mid;
      }
      place[j] += lo - starts[r];
    }
  }
  __syncthreads();  // every run read
#pragma unroll
  for (int j = 0; j < kItems; ++j)
    if (j * kBlock + threadIdx.x < want) ordered[place[j]] = position[j];
  __syncthreads();
  store_striped<kBlock, kItems>(ordered, want, store);
}

// Step 4 for sorted = false on a held row: the chosen are its selected items and the candidates rest[0, need). Those
// are marked in `marks` (a bit per position of the row, kMarkWords words zeroed); each thread's chosen items, its
// selected and marked candidates, are consecutive positions, so one block scan of their counts gives their places
// in position order. The places go through `ordered` (want ints, over `rest`: written once it is read) to
// store(in_order) as in place_by_counting.
constexpr int kMarkWords = kHeldRow / 32 + 1;  // one more: a thread's bits may straddle the last word
template <int kBlock, int kItems, class Store>
__device__ void place_held(const HeldClasses& classes, const Entry* rest, int need, int want, uint32_t* marks,
                           typename Scan<kBlock>::TempStorage& scan, int* ordered, Store store) {
  for (int i = threadIdx.x; i < need; i += kBlock) atomicOr(&marks[rest[i].pos / 32], 1u << (rest[i].pos % 32));
  __syncthreads();
  const int word = classes.first / 32, offset = classes.first % 32;
  const uint32_t marked = offset == 0 ? marks[word] : marks[word] >> offset | marks[word + 1] << (32 - offset);
  uint32_t chosen = classes.selected | (classes.candidates & marked);
  int place;
  Scan<kBlock>(scan).ExclusiveSum(__popc(chosen), place);
  for (; chosen != 0; chosen &= chosen - 1) ordered[place++] = classes.first + __ffs(chosen) - 1;
  __syncthreads();
  store_striped<kBlock, kItems>(ordered, want, store);
}

constexpr int kTableInShared = 2048;  // block-table entries the top-k copies for its fused slots, at most

constexpr int kMinSlice = 16384;      // positions per slice CTA of a shared row, at least (unless forced)
constexpr int kMinSharedRow = 32768;  // positions of a row a cluster shares, at least (unless forced)
constexpr int kMinRankSlice = 4096;   // positions per rank of a cluster, at least
constexpr int kWideRanks = 16;  // a non-portable cluster (Hopper): TopkSplit::cluster16's, and see plan_topk
static_assert(kWideRanks <= 32, "a warp's lanes load the counts of every rank before theirs");

struct TopkParams {
  const float* scores;
  int64_t score_stride;
  IndexRows rows;
  int k;
  int32_t* out;
  int64_t out_stride;
  int32_t* slots = nullptr;  // fused positions_to_slots: the chosen positions' slots too
  int64_t slots_stride = 0;
  SlotMap slot_map;
  int list_capacity;  // entries of the dynamic shared memory
  int ranks = 1;      // CTAs per token: a cluster's when more than one
  bool sorted = true;  // false: the chosen in position order (IndexerTopkArgs::sorted)
  bool hold = true;    // false: no row held in registers (TopkSplit::one_cta_streamed)
  bool wide = false;   // launched with kWideThreads (see plan_topk)
  // The split path (slices > 0): per token, `slices` histograms of kCoarseBins, a plan (RowPlan then two
  // offsets per slice) and a list of entries (the selected, then from kMaxIndexerTopk on the candidates).
  int slices;
  int64_t slice_len;  // a multiple of 4, so every slice starts 16-byte aligned
  int* slice_hists;
  int* plans;
  Entry* lists;
  int64_t list_stride;  // entries per token: kMaxIndexerTopk selected, then list_capacity candidates
  const int* histograms = nullptr;  // TopkFusion::histograms (not with slices)
  SMLA_STAMP_FIELD

  __device__ int* plan(int t) const { return plans + static_cast<int64_t>(t) * (kPlanInts + 2 * slices); }
  // How many selected ([0]) and candidates ([1]) the slices before slice s hold.
  __device__ int* slice_offsets(int t, int s) const { return plan(t) + kPlanInts + 2 * s; }
};

// Split path, step 1: the coarse histogram of slice blockIdx.x of token blockIdx.y's row.
__global__ void __launch_bounds__(kThreads) slice_histogram_kernel(const TopkParams p) {
  __shared__ int hist[kCoarseBins];
  const int t = blockIdx.y;
  const int64_t n = p.rows.visible(t), first = blockIdx.x * p.slice_len;
  for (int i = threadIdx.x; i < kCoarseBins; i += kThreads) hist[i] = 0;
  __syncthreads();
  if (first < n)
    for_each_score<kThreads>(p.scores + t * p.score_stride + first, min(p.slice_len, n - first),
                   [&](float v) { atomicAdd(&hist[coarse_bin(v)], 1); });
  __syncthreads();
  int* out = p.slice_hists + (static_cast<int64_t>(t) * p.slices + blockIdx.x) * kCoarseBins;
  for (int i = threadIdx.x; i < kCoarseBins; i += kThreads) out[i] = hist[i];
}

// Split path, step 2: token blockIdx.x's plan: the slice histograms summed,
// the bin of the want-th largest, and for each slice how many selected and
// candidates the slices before it hold (its offsets in the lists).
__global__ void __launch_bounds__(kThreads) row_plan_kernel(const TopkParams p) {
  __shared__ int hist[kCoarseBins];
  __shared__ Scan<kThreads>::TempStorage scan;
  __shared__ int result[2];
  const int t = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int want = static_cast<int>(min(static_cast<int64_t>(p.k), p.rows.visible(t)));
  if (want == 0) return;  // topk_kernel needs no plan
  const int* h = p.slice_hists + static_cast<int64_t>(t) * p.slices * kCoarseBins;
  for (int b = threadIdx.x; b < kCoarseBins; b += kThreads) {
    int sum = 0;
    for (int s = 0; s < p.slices; ++s) sum += h[s * kCoarseBins + b];
    hist[b] = sum;
  }
  __syncthreads();
  const RowPlan plan = plan_from_histogram<kThreads>(hist, want, p.list_capacity, scan, result);
  // Each warp counts a slice's selected and candidates.
  for (int s = warp; s < p.slices; s += kThreads / 32) {
    int selected = 0;
    for (int b = plan.bin + 1 + lane; b < kCoarseBins; b += 32) selected += h[s * kCoarseBins + b];
    for (int o = 16; o > 0; o /= 2) selected += __shfl_xor_sync(0xffffffffu, selected, o);
    if (lane == 0) {
      p.slice_offsets(t, s)[0] = selected;
      p.slice_offsets(t, s)[1] = h[s * kCoarseBins + plan.bin];
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // counts -> offsets (at most 2 x SMs slices, see select_topk)
    int selected = 0, candidates = 0;
    for (int s = 0; s < p.slices; ++s) {
      int* offsets = p.slice_offsets(t, s);
      const int sel = offsets[0], cand = offsets[1];
      offsets[0] = selected;
      offsets[1] = candidates;
      selected += sel;
      candidates += cand;
    }
    *reinterpret_cast<RowPlan*>(p.plan(t)) = plan;
  }
}

// Split path, step 3: slice blockIdx.x's selected positions and candidates,
// compacted in position order into token blockIdx.y's lists at the offsets
// of its plan.
__global__ void __launch_bounds__(kThreads, 2) slice_compact_kernel(const TopkParams p) {
  __shared__ WarpTotals<kThreads> totals;
  const int t = blockIdx.y, slice = blockIdx.x;
  const int64_t n = p.rows.visible(t), first = slice * p.slice_len;
  if (min(static_cast<int64_t>(p.k), n) == 0 || first >= n) return;
  const int* plan = p.plan(t);
  const RowPlan row = *reinterpret_cast<const RowPlan*>(plan);
  if (!row.fits) return;
  const int selected_before = p.slice_offsets(t, slice)[0], candidates_before = p.slice_offsets(t, slice)[1];
  Entry* list = p.lists + t * p.list_stride;
  compact_by_bin<kThreads>(
      RowSource{p.scores + t * p.score_stride, static_cast<int>(min(p.slice_len, n - first)), static_cast<int>(first)},
      row, list + selected_before, list + kMaxIndexerTopk + candidates_before, row.in_bin - candidates_before, totals);
}

// One CTA per SM (its list takes the shared memory), told to ptxas so that it does not cap the registers lower
// (for SM120 it chose 64 and spilled). kBlock: kThreads, or kWideThreads (held rows only, top-k <= 2048).
template <int kSortItems, int kBlock>
__global__ void __launch_bounds__(kBlock, 1) topk_kernel(const TopkParams p) {
  using Sort = cub::BlockRadixSort<uint32_t, kBlock, kSortItems, int32_t>;
  // The entry list, and once the chosen entries are in registers, the sort's scratch.
  extern __shared__ __align__(16) uint8_t smem_raw[];
  Entry* list = reinterpret_cast<Entry*>(smem_raw);
  __shared__ __align__(16) int hist[kCoarseBins];
  __shared__ typename Scan<kBlock>::TempStorage scan;
  __shared__ WarpTotals<kBlock> totals;
  __shared__ int result[2];
  __shared__ uint32_t key_range[2];  // the lowest and highest key chosen
  __shared__ int2 counts;            // a cluster rank's selected and candidates
  __shared__ uint32_t candidate_range[2];  // the lowest and highest key of the candidates
  __shared__ int largest_bucket;           // place_by_counting's
  __shared__ int32_t table[kTableInShared];  // the fused slots' block-table row, when it fits
  SMLA_STAMP_START_END(p, kTopkFirstStart, kTopkLastEnd);
  // The wide kernel runs only where one CTA holds every row (plan_topk): the split paths compiled out (in registers
  // they would spill).
  constexpr bool kHeldOnly = kBlock == kWideThreads;
  const int ranks = kHeldOnly ? 1 : p.ranks, slices = kHeldOnly ? 0 : p.slices;
  if (threadIdx.x == 0) {
    key_range[0] = candidate_range[0] = 0xffffffffu;
    key_range[1] = candidate_range[1] = 0;
  }
  // Token t's row is shared by ranks CTAs (a cluster's when more than one),
  // rank r taking positions [r * len, (r + 1) * len) (maybe none). Its length and request are read while the
  // scores kernel may still run: they are not its output (it was launched once the stream's earlier work was done).
  const int t = blockIdx.x / ranks, rank = blockIdx.x % ranks;
  const float* row = p.scores + t * p.score_stride;
  const int64_t n = p.rows.visible(t);
  const int want = static_cast<int>(min(static_cast<int64_t>(p.k), n));
  int32_t* out = p.out + t * p.out_stride;
  int32_t* slots = p.slots + t * p.slots_stride;
  // The row's coarse histogram: counted by the scores kernel (read once they are done), else here from zero (zeroed
  // while the scores kernel may still run).
  const int* counted = p.histograms == nullptr ? nullptr : p.histograms + static_cast<int64_t>(t) * kCoarseBins;
  if (counted == nullptr) zero_bins<kBlock>(hist);
  // The fused slots' block-table row (an input too) into shared memory, when it fits, for the stores at the end: their
  // table loads then wait on no trip to memory (with the slots, an 8K row's stores took ~1 us longer: H200 stamps).
  // Asynchronously, waited for only before those stores: a 128K row's 2048 entries copied by loads and stores held
  // the kernel ~1.6 us before it even waited for the scores (H200 stamps, one 128K row in the step).
  const int32_t request = p.rows.request(t);
  const bool known_request = request >= 0 && request < p.slot_map.num_requests;
  const int64_t table_blocks =
      p.slots == nullptr || rank != 0 || !known_request
          ? 0
          : min(p.slot_map.max_blocks, (n + p.slot_map.block_size - 1) / p.slot_map.block_size);
  const bool table_shared = table_blocks > 0 && table_blocks <= kTableInShared;
  if (table_shared) {
    for (int i = threadIdx.x; i < table_blocks; i += kBlock)
      cp_async_4(&table[i], &p.slot_map.block_table[request * p.slot_map.table_stride + i], true);
    cp_async_commit();
  }
  wait_for_prerequisites();  // launched as the scores kernel's dependent: every score written
  SMLA_STAMP(p, kTopkWaited);
  // The attention, the step's next kernel, may launch now (its CTAs wait for this kernel's end): its launch
  // overlaps this one.
  let_dependents_launch();
  if (want == 0) {
    cp_async_wait<0>();  // (k = 0: its table copy, if any, unused)
    if (rank == 0)
      for (int i = threadIdx.x; i < p.k; i += kBlock) {
        out[i] = -1;
        if (p.slots) slots[i] = -1;
      }
    return;
  }
  const int64_t len = ((n + ranks - 1) / ranks + 3) / 4 * 4, first = min(n, rank * len);
  const RowSource whole{row, static_cast<int>(n)}, slice{row, static_cast<int>(min(n, first + len) - first),
                                                         static_cast<int>(first)};
  // A row one CTA has alone and that fits in registers is read once, into them: steps 1 and 2 take it from there.
  const bool held = kHeldOnly || (p.hold && ranks == 1 && slices == 0 && n <= kHeldRow);
  HeldClasses held_classes;  // a held row's, for the unsorted order
  // Past the fine histograms, which step 3 may count in hist: the unsorted order's marks (see place_held).
  uint32_t* marks = reinterpret_cast<uint32_t*>(hist) + kCoarseBins - kMarkWords;
  static_assert(kFineCopies * kFineBins <= kCoarseBins - kMarkWords, "the marks and the fine histograms apart");

  // 1. Coarse histogram: the bin of the want-th largest (the split path's plan has it).
  RowPlan plan;
  if (slices > 0) {
    plan = *reinterpret_cast<const RowPlan*>(p.plan(t));
  } else if (held) {
    const HeldRow<kBlock> scores(row, static_cast<int>(n));
    if (counted != nullptr) {
      copy_bins<kBlock>(counted, hist);
    } else {
      __syncthreads();  // hist zeroed
      held_histogram(scores, hist);
    }
    __syncthreads();
    SMLA_STAMP(p, kTopkHistogram);
    plan = plan_from_histogram<kBlock>(hist, want, p.list_capacity, scan, result);
    __syncthreads();  // result and hist (marks) are reused below
    SMLA_STAMP(p, kTopkPlan);
    if (plan.fits) {  // 2., here while the scores are in registers
      held_classes = compact_held(scores, plan, list, list + plan.above, p.sorted, scan,
                                  [&] { SMLA_STAMP(p, kTopkCounted); });
      if (!p.sorted) {
#pragma unroll
        for (int k = 0; k < (kMarkWords + kBlock - 1) / kBlock; ++k)
          if (k * kBlock + threadIdx.x < kMarkWords) marks[k * kBlock + threadIdx.x] = 0;
      }
    }
  } else if (counted != nullptr) {  // every rank reads the whole row's
    copy_bins<kBlock>(counted, hist);
    __syncthreads();
    SMLA_STAMP(p, kTopkHistogram);
    plan = plan_from_histogram<kBlock>(hist, want, p.list_capacity, scan, result);
    __syncthreads();  // hist, result and the list are reused below
    SMLA_STAMP(p, kTopkPlan);
  } else {
    __syncthreads();  // hist zeroed
    for_each_score<kBlock>(row + slice.first, slice.count, [&](float v) { atomicAdd(&hist[coarse_bin(v)], 1); });
    const int* total = hist;
    if (ranks > 1) {
#ifdef SMLA_TOPK_STAMPS
      __syncthreads();  // the whole CTA's slice, not thread 0's share
#endif
      SMLA_STAMP(p, kTopkSliceCounted);
      cluster_sync();  // every rank's histogram is complete
      SMLA_STAMP(p, kTopkRanksCounted);
      // The sum of all ranks' histograms, into every rank's list memory (unused until step 2): each rank sums
      // its share of the bins over the ranks and writes the sums to all of them (1 / ranks of the traffic of
      // every rank reading every histogram).
      int* summed = reinterpret_cast<int*>(list);
      const int share = (kCoarseBins + ranks - 1) / ranks;
      for (int b = rank * share + threadIdx.x; b < min((rank + 1) * share, kCoarseBins); b += kBlock) {
        int sum = 0;
        for (int r = 0; r < ranks; ++r) sum += rank_shared(hist, r)[b];
        for (int r = 0; r < ranks; ++r) rank_shared(summed, r)[b] = sum;
      }
      total = summed;
      cluster_sync();  // every share delivered; no rank rewrites or leaves its hist while another reads it
    } else {
      __syncthreads();
    }
    SMLA_STAMP(p, kTopkHistogram);
    plan = plan_from_histogram<kBlock>(total, want, p.list_capacity, scan, result);
    __syncthreads();  // hist, result and the list are reused below
    SMLA_STAMP(p, kTopkPlan);
  }
  const int above = plan.above, in_bin = plan.in_bin;

  // The chosen entries end up in list[0, listed) and rest[0, want - listed), in that order three runs each in
  // position order: [0, second_run), [second_run, third_run), [third_run, want) (see place_by_position); but for a
  // held row unsorted, list[0, above) is not written (place_held takes those from held_classes).
  Entry* rest;
  int listed = above, second_run = above, third_run = want;
  if (plan.fits) {
    // 2. Higher bins: selected; the bin itself: candidates.
    Entry* candidates = list + above;
    if (slices > 0) {  // slice_compact_kernel listed them
      const Entry* listed_by_slices = p.lists + t * p.list_stride;
      for (int i = threadIdx.x; i < above; i += kBlock) list[i] = listed_by_slices[i];
      for (int i = threadIdx.x; i < in_bin; i += kBlock) candidates[i] = listed_by_slices[kMaxIndexerTopk + i];
    } else if (!held) {  // (a held row's were compacted in step 1)
      // Every rank lists its slice at the same places (a slice has at most `above` selected).
      const int2 wrote = compact_by_bin<kBlock>(slice, plan, list, candidates, in_bin, totals);
      SMLA_STAMP(p, kTopkCounted);
      if (ranks > 1) {
        if (threadIdx.x == 0) counts = wrote;
        cluster_sync();  // every rank's counts are known
        // Each rank pushes its lists into rank 0's after those of the ranks before it: position order. Every warp
        // sums the counts of the ranks before this one, lane r loading rank r's (at most kWideRanks, fewer than 32):
        // one trip through the cluster, not one a rank.
        const int lane = threadIdx.x % 32;
        int2 before = lane < rank ? *rank_shared(&counts, lane) : make_int2(0, 0);
#pragma unroll
        for (int o = 16; o > 0; o /= 2) {
          before.x += __shfl_xor_sync(0xffffffffu, before.x, o);
          before.y += __shfl_xor_sync(0xffffffffu, before.y, o);
        }
        const int selected_before = before.x, candidates_before = before.y;
        if (rank > 0) {
          Entry* to = rank_shared(list, 0);
          for (int i = threadIdx.x; i < wrote.x; i += kBlock) to[selected_before + i] = list[i];
          for (int i = threadIdx.x; i < wrote.y; i += kBlock) to[above + candidates_before + i] = candidates[i];
        }
        cluster_sync();  // rank 0 has every list
        if (rank != 0) return;
      }
    }
    __syncthreads();
    SMLA_STAMP(p, kTopkCompacted);
    // 3. The candidates that complete the want: few (at most kThreads), each ranked by counting those that go
    // before it (a higher key, or the same at a lower position), the need best put in that order (equal keys in
    // position order, as step 4 wants them); else by a radix select.
    const int need = want - above;
    rest = candidates;
    if (need < in_bin && in_bin <= kThreads) {
      rest = candidates + in_bin;
      // Each candidate's rank: the candidates that go before it, counted by comparing (key, ~position) as one 64-bit
      // number (positions are distinct). A thread takes `per` consecutive candidates; `share` neighbouring lanes (a
      // power of 2 up to 32, as many as the CTA has threads for) count them against every share-th candidate and sum
      // by shuffles. Few candidates (8 lanes or more each) go one a thread; more, kRanked a thread, each candidate
      // read then meeting kRanked: one a thread, 304 candidates (a 128K row's) took ~3.3 µs, kRanked ~2.0 (H200).
      // The held rows' CTA (16K positions at most: few candidates, 1024 threads) ranks one a thread: with kRanked
      // in its code, though never reached, its 8K and 16K rows took ~0.7 µs longer.
      constexpr int kRanked = kHeldOnly ? 1 : 4;
      const auto order = [](const Entry& x) {
        return static_cast<uint64_t>(x.key) << 32 | static_cast<uint32_t>(~x.pos);
      };
      const int per = 8 * in_bin <= kBlock ? 1 : kRanked, groups = (in_bin + per - 1) / per;
      const int share = 1 << (31 - __clz(min(32, max(1, kBlock / groups))));
      const int group = threadIdx.x / share, first = group * per;
      uint64_t mine[kRanked];
      int count[kRanked];
#pragma unroll
      for (int j = 0; j < kRanked; ++j) {
        mine[j] = j < per && first + j < in_bin ? order(candidates[first + j]) : ~uint64_t{0};  // none: counts nothing
        count[j] = 0;
      }
      if (group < groups) {
#pragma unroll 4  // loads in flight together
        for (int m = threadIdx.x % share; m < in_bin; m += share) {
          const uint64_t other = order(candidates[m]);
#pragma unroll
          for (int j = 0; j < kRanked; ++j) count[j] += other > mine[j];
        }
      }
#pragma unroll
      for (int j = 0; j < kRanked; ++j)
        if (j < per)
          for (int o = share / 2; o > 0; o /= 2) count[j] += __shfl_xor_sync(0xffffffffu, count[j], o);  // a share's
      uint32_t chosen = 0;  // bit j: candidate first + j completes the want (on a share's first lane)
#pragma unroll
      for (int j = 0; j < kRanked; ++j)
        chosen |= static_cast<uint32_t>(j < per && threadIdx.x % share == 0 && first + j < in_bin && count[j] < need)
                  << j;
      if (p.sorted) {
#pragma unroll
        for (int j = 0; j < kRanked; ++j)
          if ((chosen >> j) & 1) rest[count[j]] = candidates[first + j];
      } else {  // in the candidates' (position) order: each after the chosen before it (groups in thread order)
        int place;
        Scan<kBlock>(scan).ExclusiveSum(__popc(chosen), place);
#pragma unroll
        for (int j = 0; j < kRanked; ++j)
          if ((chosen >> j) & 1) rest[place++] = candidates[first + j];
      }
      __syncthreads();
    } else if (need < in_bin) {
      const ListSource cand{candidates, in_bin};
      uint32_t lowest = 0xffffffffu, highest = 0;
      for (int i = threadIdx.x; i < in_bin; i += kBlock) {
        lowest = min(lowest, candidates[i].key);
        highest = max(highest, candidates[i].key);
      }
      lowest = __reduce_min_sync(0xffffffffu, lowest);
      highest = __reduce_max_sync(0xffffffffu, highest);
      if (threadIdx.x % 32 == 0) {
        atomicMin(&candidate_range[0], lowest);
        atomicMax(&candidate_range[1], highest);
      }
      __syncthreads();
      uint32_t threshold;
      int remaining;
      radix_select<kBlock>(
          [&](auto&& f) {
            for (int i = threadIdx.x; i < in_bin; i += kBlock) f(candidates[i].key);
          },
          need, hist, scan, result, threshold, remaining, candidate_range[0], candidate_range[1]);
      rest = candidates + in_bin;
      compact<kBlock>(
          cand, [&](const Entry& e) { return e.key > threshold ? 1 : e.key == threshold ? 2 : 0; }, rest,
          rest + (need - remaining), remaining, totals);
      __syncthreads();
      third_run = above + need - remaining;
    }
  } else {
    // Too many candidates for shared memory: the exact select over the row, by rank 0 alone (past step 1's last
    // cluster barrier, no rank reads another's shared memory).
    if (rank != 0) return;
    uint32_t threshold;
    int remaining;
    radix_select<kBlock>([&](auto&& f) { for_each_score<kBlock>(row, n, [&](float v) { f(order_key(v)); }); }, want,
                         hist, scan, result, threshold, remaining);
    const auto by_threshold = [&](float v) {
      const uint32_t key = order_key(v);
      return key > threshold ? 1 : key == threshold ? 2 : 0;
    };
    compact<kBlock>(whole, by_threshold, list, list + (want - remaining), remaining, totals);
    __syncthreads();
    listed = want;
    rest = list + want;
    second_run = want - remaining;
  }
  SMLA_STAMP(p, kTopkSelected);
  if (table_shared) {  // (uniform: rank 0's; the other ranks have left)
    cp_async_wait<0>();
    __syncthreads();
  }

  // Stores the positions of ranks j * kBlock + threadIdx.x (every rank < p.k: k <= kSortItems * kBlock) and,
  // fused, their slots: every block-table load issued before the first slot store (a store might alias the table).
  // One code path for either copy of the row, by a generic load (the two inlined apart were twice the code).
  const int32_t* table_row = table_shared    ? table
                             : known_request ? p.slot_map.block_table + request * p.slot_map.table_stride
                                             : nullptr;
  const auto store = [&](const int32_t (&position)[kSortItems]) {
    SMLA_STAMP(p, kTopkOrdered);
#pragma unroll
    for (int j = 0; j < kSortItems; ++j)
      if (j * kBlock + threadIdx.x < p.k) out[j * kBlock + threadIdx.x] = position[j];
    if (p.slots == nullptr) {
      SMLA_STAMP(p, kTopkStored);
      return;
    }
    int32_t slot[kSortItems];
#pragma unroll
    for (int j = 0; j < kSortItems; ++j)
      slot[j] = p.slot_map.slot_in(table_row, request, position[j]);
#pragma unroll
    for (int j = 0; j < kSortItems; ++j)
      if (j * kBlock + threadIdx.x < p.k) slots[j * kBlock + threadIdx.x] = slot[j];
    SMLA_STAMP(p, kTopkStored);
  };
  if (!p.sorted && held && plan.fits) {
    place_held<kBlock, kSortItems>(held_classes, rest, want - above, want, marks, scan, reinterpret_cast<int*>(list),
                                   store);
    return;
  }
  if (!p.sorted) {
    place_by_position<kBlock, kSortItems>([&](int i) { return i < listed ? list[i] : rest[i - listed]; }, want,
                                          second_run, third_run, reinterpret_cast<int*>(list), store);
    return;
  }

  // 4. Best first: by counting where no bucket of close keys holds many (k <= 2048), else by a radix sort. Equal
  // keys are in position order in both parts and no key is in both, so a stable sort leaves equal scores toward
  // the lower position. It sorts the keys less the lowest chosen, on as many bits as the highest then needs; the padding
  // past `want` (key 0 too) stays last, being last already.
  uint32_t keys[kSortItems];
  int32_t positions[kSortItems];
  uint32_t lowest = 0xffffffffu, highest = 0;
#pragma unroll
  for (int j = 0; j < kSortItems; ++j) {
    const int i = threadIdx.x * kSortItems + j;
    const Entry e = i < listed ? list[i] : i < want ? rest[i - listed] : Entry{0, -1};
    keys[j] = e.key;
    positions[j] = e.pos;
    if (i < want) {
      lowest = min(lowest, e.key);
      highest = max(highest, e.key);
    }
  }
  lowest = __reduce_min_sync(0xffffffffu, lowest);
  highest = __reduce_max_sync(0xffffffffu, highest);
  if (threadIdx.x % 32 == 0) {
    atomicMin(&key_range[0], lowest);
    atomicMax(&key_range[1], highest);
  }
  __syncthreads();  // the key range is known; the counting's or the sort's scratch overwrites the list
  const int bits = max(1, 32 - __clz(static_cast<int>(key_range[1] - key_range[0])));
  if constexpr (kSortItems * kBlock <= 2048) {
    if (place_by_counting<kBlock>(keys, positions, want, key_range[0], bits, hist, scan, &largest_bucket, list,
                          reinterpret_cast<int*>(list + kSortItems * kBlock), store))
      return;
  }
#pragma unroll
  for (int j = 0; j < kSortItems; ++j) keys[j] = threadIdx.x * kSortItems + j < want ? keys[j] - key_range[0] : 0;
  Sort(*reinterpret_cast<typename Sort::TempStorage*>(smem_raw))
      .SortDescendingBlockedToStriped(keys, positions, 0, bits);
#pragma unroll
  for (int j = 0; j < kSortItems; ++j)
    if (j * kBlock + threadIdx.x >= want) positions[j] = -1;
  store(positions);
}

// Where the split path's scratch goes: per token, the slice histograms, then the plans, then (16-byte aligned)
// the lists.
struct TopkScratch {
  size_t plans = 0, lists = 0, total = 0;
};
TopkScratch scratch_layout(const TopkParams& p, int tokens) {
  TopkScratch s;
  if (p.slices == 0) return s;
  s.plans = static_cast<size_t>(tokens) * p.slices * kCoarseBins * sizeof(int);
  s.lists = (s.plans + static_cast<size_t>(tokens) * (kPlanInts + 2 * p.slices) * sizeof(int) + 15) / 16 * 16;
  s.total = s.lists + static_cast<size_t>(tokens) * p.list_stride * sizeof(Entry);
  return s;
}

template <int kSortItems, int kBlock>
const void* topk_kernel_ptr() {
  static_assert(sizeof(typename cub::BlockRadixSort<uint32_t, kBlock, kSortItems, int32_t>::TempStorage) <=
                    kMaxIndexerTopk * sizeof(Entry),
                "the sort's scratch fits where the list is");
  return reinterpret_cast<const void*>(topk_kernel<kSortItems, kBlock>);
}
// The kernel select_topk launches for top-k (TopkParams::wide: the held rows' of kWideThreads, k <= 2048).
const void* topk_kernel_for(int k, bool wide = false) {
  if (wide) return topk_kernel_ptr<2048 / kWideThreads, kWideThreads>();
  return k <= 2048 ? topk_kernel_ptr<2048 / kThreads, kThreads>()
                   : topk_kernel_ptr<kMaxIndexerTopk / kThreads, kThreads>();
}

// p.ranks is the most CTAs per token wanted; fewer (down to min_ranks) when the device could not run every
// token's cluster at once (a second wave would cost more than smaller clusters). `scratch`: scratch_layout(p).total
// bytes when p.slices > 0.
// after_scores: launched as the programmatic dependent of the kernel before it (see TopkFusion).
template <int kSortItems, int kBlock>
void launch_topk(TopkParams p, int tokens, int min_ranks, bool after_scores, cudaStream_t stream, uint8_t* scratch) {
  const auto kernel = topk_kernel<kSortItems, kBlock>;
  const int smem = max_dynamic_smem(reinterpret_cast<const void*>(kernel));
  while (p.ranks > min_ranks &&
         tokens > max_active_clusters(reinterpret_cast<const void*>(kernel), kBlock, smem, p.ranks))
    --p.ranks;
  if (p.slices > 0) {
    const TopkScratch layout = scratch_layout(p, tokens);
    p.slice_hists = reinterpret_cast<int*>(scratch);
    p.plans = reinterpret_cast<int*>(scratch + layout.plans);
    p.lists = reinterpret_cast<Entry*>(scratch + layout.lists);
    const dim3 slices(p.slices, tokens);
    launch_kernel(slice_histogram_kernel, slices, kThreads, 0, stream, "smla indexer top-k histogram kernel", p);
    launch_kernel(row_plan_kernel, tokens, kThreads, 0, stream, "smla indexer top-k plan kernel", p);
    launch_kernel(slice_compact_kernel, slices, kThreads, 0, stream, "smla indexer top-k compaction kernel", p);
  }
  // All ranks of a cluster get the same shared memory. No cluster attribute on one CTA per token (below SM90 too);
  // the dependent launch only straight after the scores (not after the slice kernels).
  cudaLaunchAttribute attrs[2]{};
  unsigned num_attrs = 0;
  if (p.ranks > 1) {
    attrs[num_attrs].id = cudaLaunchAttributeClusterDimension;
    attrs[num_attrs].val.clusterDim.x = p.ranks;
    attrs[num_attrs].val.clusterDim.y = attrs[num_attrs].val.clusterDim.z = 1;
    ++num_attrs;
  }
  if (after_scores && p.slices == 0) {
    attrs[num_attrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[num_attrs].val.programmaticStreamSerializationAllowed = 1;
    ++num_attrs;
  }
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(p.ranks * tokens);  // x, not y: more than 65535 tokens stay possible
  config.blockDim = dim3(kBlock);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attrs;
  config.numAttrs = num_attrs;
  check_launched(cudaLaunchKernelEx(&config, kernel, p), "smla indexer top-k kernel");
}

// How select_topk shares each row among CTAs for these args on the current device, with the sizes that follow
// (no pointers): the same args on the same device always give the same plan, so the scratch it needs is known
// before the call.
TopkParams plan_topk(const IndexerTopkArgs& a, TopkSplit split) {
  const int tokens = static_cast<int>(a.q.size(0));
  const int k = static_cast<int>(a.topk.size(1));
  if (k > kMaxIndexerTopk)
    fail("indexer_topk: topk: the CUDA backend selects at most " + std::to_string(kMaxIndexerTopk) +
         " positions per token, got " + std::to_string(k));
  TopkParams p{};
  p.score_stride = score_row_stride(a);
  p.rows = index_rows(a);
  p.k = k;
  p.out_stride = a.topk.stride(0);
  p.sorted = a.sorted;
  // The list takes what shared memory is left (at least 8192 entries on every arch from SM80 on).
  const void* kernel = topk_kernel_for(k);
  const int smem = max_dynamic_smem(kernel);
  p.list_capacity = smem / static_cast<int>(sizeof(Entry));
  require(p.list_capacity >= kMaxIndexerTopk, "indexer_topk: the device has too little shared memory per block");
  if (tokens == 0) return p;
  // Sharing rows pays when the rows are long and one CTA per token leaves most SMs idle. On SM90+: rows of at
  // least kMinSharedRow positions by a cluster of up to one CTA per SM per token, at least kMinRankSlice positions
  // per rank (forced: at least 2 ranks, so tests reach the cluster path on short rows too), as many as run at once
  // (H200, one token: a 32K row 28.0 µs on 2 ranks, 24.4 on 8; an 8K row 12.8 on one CTA, 15.9 on 2), at most the
  // portable 8; kWideRanks (16) where the device runs them, the row has 16 x kMinRankSlice positions and every
  // token's cluster of 16 runs at once (H200, graph-timed: one token's 128K row 21.5 µs on 16 ranks, 23.5 on 8;
  // eight tokens' clusters of 16 take two waves, 32.7 against 23.9; a 32K row 23.9 against 23.2). cluster16:
  // exactly 16, even in a second wave. Below SM90,
  // slices (measured on an H200 before clusters: rows of 128K for 1-32 tokens 34-42 µs split against 57-58
  // unsplit, for 64 tokens 63 against 58; rows of 32K or less never faster split) of at least kMinSlice positions,
  // about two CTAs per SM in all.
  const int64_t capacity = index_capacity(a);
  const DeviceInfo& dev = current_device();
  const int sms = dev.num_sms;
  const bool clusters = dev.compute_capability >= 90;
  if ((split == TopkSplit::cluster || split == TopkSplit::cluster16) && !clusters)
    fail(std::string("select_topk: TopkSplit::") + (split == TopkSplit::cluster ? "cluster" : "cluster16") +
         " needs thread block clusters (SM90 or newer); the device is sm_" + std::to_string(dev.compute_capability));
  // The most ranks the device runs a cluster of this kernel with (Hopper: 16, 8 of them portable; 1 below SM90).
  const int most_ranks = max_cluster_ranks(kernel, kThreads, smem);
  const int portable_ranks = std::min(most_ranks, kPortableClusterRanks);
  if (split == TopkSplit::automatic) {
    if (clusters) {
      p.ranks = capacity < kMinSharedRow ? 1
                                         : static_cast<int>(std::clamp<int64_t>(
                                               std::min<int64_t>(sms / tokens, capacity / kMinRankSlice), 1,
                                               portable_ranks));
      if (most_ranks >= kWideRanks && capacity / kMinRankSlice >= kWideRanks && sms / tokens >= kWideRanks &&
          tokens <= max_active_clusters(kernel, kThreads, smem, kWideRanks))
        p.ranks = kWideRanks;
      split = p.ranks > 1 ? TopkSplit::cluster : TopkSplit::one_cta;
    } else {
      split = capacity >= 65536 && 4 * tokens <= sms ? TopkSplit::slices : TopkSplit::one_cta;
    }
  } else if (split == TopkSplit::cluster) {
    p.ranks = static_cast<int>(
        std::clamp<int64_t>(std::min<int64_t>(sms / tokens, (capacity + kMinRankSlice - 1) / kMinRankSlice), 2,
                            std::max(2, portable_ranks)));
  } else if (split == TopkSplit::cluster16) {
    if (most_ranks < kWideRanks)
      fail("select_topk: TopkSplit::cluster16 needs clusters of " + std::to_string(kWideRanks) +
           " CTAs (non-portable: Hopper); the device (sm_" + std::to_string(dev.compute_capability) + ") runs at most " +
           std::to_string(most_ranks));
    p.ranks = kWideRanks;
  }
  p.hold = split != TopkSplit::one_cta_streamed;
  if (split == TopkSplit::slices) {
    const int64_t most = std::max<int64_t>(1, (capacity + kMinSlice - 1) / kMinSlice);
    p.slices = static_cast<int>(std::clamp<int64_t>((2 * sms + tokens - 1) / tokens, 1, most));
    p.slice_len = (capacity + p.slices - 1) / p.slices;
    p.slice_len = (p.slice_len + 3) / 4 * 4;
    p.list_stride = kMaxIndexerTopk + p.list_capacity;
  }
  // Every row held in registers by one CTA (top-k <= 2048): the kernel of kWideThreads, its own list capacity.
  if (p.hold && p.ranks == 1 && p.slices == 0 && capacity <= kHeldRow && k <= 2048) {
    p.wide = true;
    p.list_capacity = max_dynamic_smem(topk_kernel_for(k, true)) / static_cast<int>(sizeof(Entry));
    require(p.list_capacity >= kMaxIndexerTopk, "indexer_topk: the device has too little shared memory per block");
  }
  return p;
}

// Bytes of the scores (T rows of score_row_stride floats, at least 4 floats each), rounded to 256.
size_t score_bytes(const IndexerTopkArgs& a) {
  const size_t floats = static_cast<size_t>(a.q.size(0)) * std::max<int64_t>(score_row_stride(a), 4);
  return (floats * sizeof(float) + 255) / 256 * 256;
}

}  // namespace

int64_t index_capacity(const IndexerTopkArgs& a) { return a.block_table.size(1) * a.index_cache.size(1); }
int64_t score_row_stride(const IndexerTopkArgs& a) { return (index_capacity(a) + 3) / 4 * 4; }

int topk_max_cluster_ranks(int k) {
  const void* kernel = topk_kernel_for(k);
  return max_cluster_ranks(kernel, kThreads, max_dynamic_smem(kernel));
}

size_t topk_scratch_bytes(const IndexerTopkArgs& a, TopkSplit split) {
  return scratch_layout(plan_topk(a, split), static_cast<int>(a.q.size(0))).total;
}

bool topk_reads_histograms(const IndexerTopkArgs& a, TopkSplit split) { return plan_topk(a, split).slices == 0; }

int topk_cta_threads(const IndexerTopkArgs& a, TopkSplit split) {
  return plan_topk(a, split).wide ? kWideThreads : kThreads;
}

size_t topk_histogram_bytes(const IndexerTopkArgs& a) {
  return static_cast<size_t>(a.q.size(0)) * kCoarseBins * sizeof(int);
}

void select_topk(const IndexerTopkArgs& a, const float* scores, TopkSplit split, void* scratch,
                 const TopkFusion& fusion) {
  require(reinterpret_cast<uintptr_t>(scores) % 16 == 0, "select_topk: scores must be 16-byte aligned");
  TopkParams p = plan_topk(a, split);
  const int tokens = static_cast<int>(a.q.size(0));
  if (fusion.histograms != nullptr) {
    require(p.slices == 0, "select_topk: TopkFusion::histograms: rows split into slices count their own");
    require(reinterpret_cast<uintptr_t>(fusion.histograms) % 16 == 0,
            "select_topk: TopkFusion::histograms must be 16-byte aligned");
    p.histograms = fusion.histograms;
  }
  if (fusion.slots != nullptr) {
    const PositionsToSlotsArgs& s = *fusion.slots;
    require(s.positions.data == a.topk.data && s.request_ids.data == a.request_ids.data &&
                s.request_ids.stride(0) == a.request_ids.stride(0) && s.slots.size(0) == tokens &&
                s.slots.size(1) == a.topk.size(1),
            "select_topk: the fused slots must map args.topk's [T, K] positions through args.request_ids");
    p.slots = s.slots.ptr<int32_t>();
    p.slots_stride = s.slots.stride(0);
    p.slot_map = slot_map(s);
  }
  if (tokens == 0) return;
  p.scores = scores;
  p.out = a.topk.ptr<int32_t>();
  const auto stream = static_cast<cudaStream_t>(a.stream);
  std::optional<DefaultWorkspace> own;
  if (scratch == nullptr) scratch = workspace_or(TensorView{}, own, stream, scratch_layout(p, tokens).total, "indexer_topk");
  auto* bytes = static_cast<uint8_t*>(scratch);
  const int min_ranks = split == TopkSplit::cluster16 ? kWideRanks : split == TopkSplit::cluster ? 2 : 1;
  const bool after_scores = fusion.after_scores && current_device().compute_capability >= 90;
  if (p.wide) launch_topk<2048 / kWideThreads, kWideThreads>(p, tokens, min_ranks, after_scores, stream, bytes);
  else if (p.k <= 2048) launch_topk<2048 / kThreads, kThreads>(p, tokens, min_ranks, after_scores, stream, bytes);
  else launch_topk<kMaxIndexerTopk / kThreads, kThreads>(p, tokens, min_ranks, after_scores, stream, bytes);
}

#ifdef SMLA_TOPK_STAMPS
void set_step_stamps(unsigned long long* stamps) { step_stamp_buffer = stamps; }
#endif

// indexer_topk's workspace: the scores, then the top-k's scratch.
size_t indexer_workspace_size(const IndexerTopkArgs& a) { return score_bytes(a) + topk_scratch_bytes(a); }

namespace {

// The top-k counts its histograms itself here: the scores kernel counting them (indexer_scores' `histograms`, read
// through TopkFusion::histograms) was slower on the H200 (run of 91dc9f8, the step from a graph: one token of 8K
// 25.7 us against 25.2, of 128K 60.9 against 35.4, eight of 128K 109.1 against 87.8; the scores kernel with the
// counting and its zeroing kernel 34.0 us against 7.7 at 128K, its atomics queueing on the few bins a row's scores
// fall in). Tests and bench_cuda step still run that way through select_topk.
void scores_then_topk(const IndexerTopkArgs& a, const TopkFusion& fusion, TopkSplit split = TopkSplit::automatic) {
  const size_t bytes = score_bytes(a) + topk_scratch_bytes(a, split);
  // The ops checked a caller's workspace against the automatic split's needs; a forced split may need more.
  if (split != TopkSplit::automatic && a.workspace.defined() &&
      static_cast<size_t>(a.workspace.numel()) * dtype_size(a.workspace.dtype) < bytes)
    fail("indexer_topk: workspace: the forced top-k split needs " + std::to_string(bytes) + " bytes");
  std::optional<DefaultWorkspace> own;
  auto* ws = static_cast<uint8_t*>(workspace_or(a.workspace, own, static_cast<cudaStream_t>(a.stream), bytes,
                                                "indexer_topk"));
  auto* scores = reinterpret_cast<float*>(ws);
  indexer_scores(a, scores);
  TopkFusion f = fusion;
  f.after_scores = f.after_scores && a.q.size(0) > 0 && index_capacity(a) > 0;  // else no scores kernel ran
  select_topk(a, scores, split, ws + score_bytes(a), f);
}

}  // namespace

void indexer_topk(const IndexerTopkArgs& a) { scores_then_topk(a, {}); }

void dsa_decode_step(const DsaDecodeStepArgs& a) { dsa_decode_step(a, TopkSplit::automatic, {}); }

void dsa_decode_step(const DsaDecodeStepArgs& a, TopkSplit split, AttentionChoice choice) {
  const PositionsToSlotsArgs slots = slots_step(a);
  scores_then_topk(indexer_step(a), {&slots, true}, split);
  // The top-k kernel just launched (for any token) is the attention's predecessor: a programmatic dependent of it.
  cuda::sparse_mla(attention_step(a), choice, AttentionLaunch::after_own_kernel);
}

}  // namespace smla::cuda
