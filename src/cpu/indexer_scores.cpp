// Indexer scoring kernels. All three put heads in vector lanes, so each
// key's dot products for 8 or 16 heads finish in one accumulator without
// horizontal sums; only the final weighted sum over heads is reduced.
// - AVX-512: bf16 pairs through VDPBF16PS (products exact in fp32), keys
//   broadcast 32 bits at a time; a block of 16 / groups keys shares each
//   query load. fp8 keys are widened to bf16 (exact) first.
// - AVX2: fp32 FMA with keys widened to fp32.
// - portable: the same math in plain C++, one key at a time.
#include "cpu/indexer_scores.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <type_traits>

#include "core/numeric.h"

#if defined(__x86_64__) || defined(__i386__)
// GCC 12 warns about the intrinsics' own _mm*_undefined_* helpers (GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#define SMLA_X86 1
#define SMLA_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))
#define SMLA_TARGET_AVX2 __attribute__((target("avx2,fma")))
#endif

namespace smla::cpu::indexer {

namespace {

constexpr int kDim = kIndexHeadDim;
constexpr int kPairs = kDim / 2;
constexpr int kMaxKeysPerBlock = 16;

float q_value(const QueryRow& row, int h, int d) {
  const int64_t i = h * row.head_stride + d;
  switch (row.dtype) {
    case DType::bf16: return numeric::bf16_to_float(static_cast<const uint16_t*>(row.q)[i]);
    case DType::f16: return numeric::f16_to_float(static_cast<const uint16_t*>(row.q)[i]);
    default: return numeric::e4m3_to_float(static_cast<const uint8_t*>(row.q)[i]);
  }
}

// Scalar key widening for the fp32 kernels (vectorised by the compiler or cheap next to H_I * 128 FMAs).
void bf16_row_to_float(const uint16_t* src, float* dst) {
  for (int d = 0; d < kDim; ++d) dst[d] = numeric::bf16_to_float(src[d]);
}
void fp8_row_to_float(const uint8_t* src, float* dst) {
  const auto& table = numeric::e4m3_table();
  for (int d = 0; d < kDim; ++d) dst[d] = table[src[d]];
}

// Each kernel K (Portable, Avx2, Avx512 below) provides Q and Key, the packed
// query and key element types; kLanes heads per vector; kMaxGroups vectors
// of heads per chunk; keys_per_block(groups), the keys one dot() call scores;
// fp8_row(), widening an fp8 key to Key; and dot().
template <class K>
QueryLayout layout(int heads, DType q_dtype) {
  QueryLayout l;
  l.lanes = K::kLanes;
  const int groups = (heads + K::kLanes - 1) / K::kLanes;
  l.chunks = (groups + K::kMaxGroups - 1) / K::kMaxGroups;
  l.groups = (groups + l.chunks - 1) / l.chunks;  // equal chunks, so one block size serves all
  l.planes = std::is_same_v<typename K::Q, uint16_t> && q_dtype == DType::f16 ? 2 : 1;
  l.chunk_elems = static_cast<size_t>(l.planes) * kDim * l.groups * l.lanes;
  l.elem_size = sizeof(typename K::Q);
  return l;
}

// Query element of head lane `lane` in group `g`, dimension d, inside a chunk:
// bf16 kernels pair dimensions (2j, 2j+1) in each 32-bit lane; fp32 ones store [d][g][lane].
template <class K>
size_t q_index(const QueryLayout& l, int plane, int g, int lane, int d) {
  if constexpr (std::is_same_v<typename K::Q, uint16_t>)
    return ((static_cast<size_t>(plane) * kPairs + d / 2) * l.groups + g) * l.lanes * 2 + lane * 2 + d % 2;
  else
    return (static_cast<size_t>(d) * l.groups + g) * l.lanes + lane;
}

template <class K>
void pack(const QueryLayout& l, const QueryRow& row, void* query_v, float* weights) {
  using Q = typename K::Q;
  auto* query = static_cast<Q*>(query_v);
  std::fill(query, query + l.chunk_elems * l.chunks, Q{});
  std::fill(weights, weights + l.weight_count(), 0.f);  // padded heads: q = 0 and w = 0
  for (int h = 0; h < row.heads; ++h) {
    const int chunk = h / (l.groups * l.lanes), g = h / l.lanes % l.groups, lane = h % l.lanes;
    Q* dst = query + chunk * l.chunk_elems;
    weights[h] = row.weights[h] * (row.q_scale ? row.q_scale[h] : 1.f);
    for (int d = 0; d < kDim; ++d) {
      const float x = q_value(row, h, d);
      if constexpr (std::is_same_v<Q, uint16_t>) {
        // bf16 and fp8 values are exact in bf16; an f16 value is hi + lo exactly.
        const uint16_t hi = numeric::float_to_bf16(x);
        dst[q_index<K>(l, 0, g, lane, d)] = hi;
        if (l.planes == 2)
          dst[q_index<K>(l, 1, g, lane, d)] = numeric::float_to_bf16(x - numeric::bf16_to_float(hi));
      } else {
        dst[q_index<K>(l, 0, g, lane, d)] = x;
      }
    }
  }
}

// Scores [s0, s1) a block of keys at a time. A short last block repeats its
// last key and drops the extra results.
template <class K>
void score(const QueryLayout& l, const void* query_v, const float* weights, const IndexCacheView& c,
           const int32_t* blocks, int64_t s0, int64_t s1, uint32_t* keys) {
  using Key = typename K::Key;
  const auto* query = static_cast<const typename K::Q*>(query_v);
  static_assert(K::keys_per_block(1) <= kMaxKeysPerBlock);
  const int kb = K::keys_per_block(l.groups);
  alignas(64) Key scratch[kMaxKeysPerBlock][kDim];
  const Key* rows[kMaxKeysPerBlock];
  float scale[kMaxKeysPerBlock], partial[kMaxKeysPerBlock];
  // (block, offset) cursors instead of a division per key; the second runs
  // kPrefetch keys ahead so the rows of the next block are on their way.
  constexpr int64_t kPrefetch = 32;
  const int64_t row_bytes = c.fp8 ? kDim : c.row_stride, data_bytes = c.fp8 ? kDim : 2 * kDim;
  int64_t bi = s0 / c.block_size, off = s0 % c.block_size;
  int64_t ahead = std::min(s0 + kPrefetch, s1 - 1), pbi = ahead / c.block_size, poff = ahead % c.block_size;
  for (int64_t s = s0; s < s1; s += kb) {
    const int n = static_cast<int>(std::min<int64_t>(kb, s1 - s));
    for (int r = 0; r < n; ++r) {
      const uint8_t* pblock = c.base + blocks[pbi] * c.block_stride;
      for (int64_t line = 0; line < data_bytes; line += 64) __builtin_prefetch(pblock + poff * row_bytes + line);
      if (c.fp8) __builtin_prefetch(pblock + c.block_size * kDim + poff * sizeof(float));
      if (ahead + 1 < s1) {
        ++ahead;
        if (++poff == c.block_size) poff = 0, ++pbi;
      }

      const uint8_t* block = c.base + blocks[bi] * c.block_stride;
      partial[r] = 0.f;
      scale[r] = 1.f;
      if (c.fp8) {
        K::fp8_row(block + off * kDim, scratch[r]);
        std::memcpy(&scale[r], block + c.block_size * kDim + off * sizeof(float), sizeof(float));
        rows[r] = scratch[r];
      } else if constexpr (std::is_same_v<Key, uint16_t>) {
        rows[r] = reinterpret_cast<const uint16_t*>(block + off * c.row_stride);
      } else {
        bf16_row_to_float(reinterpret_cast<const uint16_t*>(block + off * c.row_stride), scratch[r]);
        rows[r] = scratch[r];
      }
      if (++off == c.block_size) off = 0, ++bi;
    }
    for (int r = n; r < kb; ++r) {  // results dropped
      rows[r] = rows[n - 1];
      partial[r] = 0.f;
    }
    for (int ch = 0; ch < l.chunks; ++ch)
      K::dot(l.groups, query + ch * l.chunk_elems, l.planes, weights + ch * l.groups * l.lanes, rows, partial);
    for (int r = 0; r < n; ++r) keys[s - s0 + r] = order_key(partial[r] * scale[r]);
  }
}

template <class K>
constexpr ScoreKernel make_kernel() {
  return {&layout<K>, &pack<K>, &score<K>};
}

struct Portable {
  using Q = float;
  using Key = float;
  static constexpr int kLanes = 8, kMaxGroups = 16;  // one chunk of up to 128 heads
  static constexpr int keys_per_block(int) { return 1; }
  static void fp8_row(const uint8_t* src, float* dst) { fp8_row_to_float(src, dst); }
  static void dot(int groups, const float* q, int, const float* w, const float* const* rows, float* partial) {
    const int heads = groups * kLanes;
    float acc[kLanes * kMaxGroups] = {};
    for (int d = 0; d < kDim; ++d) {
      const float k = rows[0][d];
      for (int h = 0; h < heads; ++h) acc[h] += q[d * heads + h] * k;
    }
    float sum = 0.f;
    for (int h = 0; h < heads; ++h) sum += w[h] * std::max(acc[h], 0.f);
    partial[0] += sum;
  }
};

#ifdef SMLA_X86

// Calls f.template operator()<G>() for the runtime group count g in 1..4.
template <class F>
void with_groups(int g, F&& f) {
  switch (g) {
    case 1: f.template operator()<1>(); break;
    case 2: f.template operator()<2>(); break;
    case 3: f.template operator()<3>(); break;
    default: f.template operator()<4>(); break;
  }
}

// Accumulator registers a dot() call keeps: keys per call = this / groups.
constexpr int kAvx2Accumulators = 8;  // enough FMAs in flight, room for the query registers

template <int G>
SMLA_TARGET_AVX2 void dot_avx2(const float* q, const float* w, const float* const* rows, float* partial) {
  constexpr int KB = kAvx2Accumulators / G;
  __m256 acc[KB][G];
#pragma GCC unroll 8
  for (int r = 0; r < KB; ++r)
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) acc[r][g] = _mm256_setzero_ps();
  for (int d = 0; d < kDim; ++d) {
    __m256 qv[G];
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) qv[g] = _mm256_load_ps(q + (d * G + g) * 8);
#pragma GCC unroll 8
    for (int r = 0; r < KB; ++r) {
      const __m256 k = _mm256_broadcast_ss(rows[r] + d);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) acc[r][g] = _mm256_fmadd_ps(qv[g], k, acc[r][g]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < KB; ++r) {
    __m256 f = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) f = _mm256_fmadd_ps(_mm256_max_ps(acc[r][g], _mm256_setzero_ps()),
                                                    _mm256_load_ps(w + g * 8), f);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(f), _mm256_extractf128_ps(f, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    partial[r] += _mm_cvtss_f32(s);
  }
}

struct Avx2 {
  using Q = float;
  using Key = float;
  static constexpr int kLanes = 8, kMaxGroups = 4;
  static constexpr int keys_per_block(int groups) { return kAvx2Accumulators / groups; }
  static void fp8_row(const uint8_t* src, float* dst) { fp8_row_to_float(src, dst); }
  static void dot(int groups, const float* q, int, const float* w, const float* const* rows, float* partial) {
    with_groups(groups, [&]<int G>() { dot_avx2<G>(q, w, rows, partial); });
  }
};

// bf16 bits of the e4m3 subnormals m * 2^-9, indexed by the 7-bit magnitude (m < 8).
constexpr auto kE4m3SubnormalBf16 = [] {
  std::array<uint16_t, 32> t{};
  for (int m = 0; m < 8; ++m) t[m] = static_cast<uint16_t>(std::bit_cast<uint32_t>(m * 0x1p-9f) >> 16);
  return t;
}();

// e4m3 -> bf16, exact and equal to numeric::e4m3_to_float: normals only need
// their exponent rebiased (7 -> 127), subnormals come from a table.
SMLA_TARGET_AVX512 void fp8_row_to_bf16_avx512(const uint8_t* src, uint16_t* dst) {
  const __m512i table = _mm512_loadu_si512(kE4m3SubnormalBf16.data());
  const __m512i mag_mask = _mm512_set1_epi16(0x7f), bias = _mm512_set1_epi16(120 << 7);
  for (int i = 0; i < kDim; i += 32) {
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    const __m512i mag = _mm512_and_si512(b, mag_mask);
    __m512i v = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), bias);
    v = _mm512_mask_permutexvar_epi16(v, _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8)), mag, table);
    v = _mm512_mask_mov_epi16(v, _mm512_cmpeq_epi16_mask(mag, mag_mask), _mm512_set1_epi16(0x7fc0));  // NaN
    const __m512i sign = _mm512_slli_epi16(_mm512_andnot_si512(mag_mask, b), 8);
    _mm512_storeu_si512(dst + i, _mm512_or_si512(v, sign));
  }
}

constexpr int kAvx512Accumulators = 16;  // cover VDPBF16PS latency, leave room for the query registers

template <int G>
SMLA_TARGET_AVX512 void dot_avx512(const uint16_t* q, int planes, const float* w, const uint16_t* const* rows,
                                   float* partial) {
  constexpr int KB = kAvx512Accumulators / G;
  __m512 acc[KB][G];
#pragma GCC unroll 16
  for (int r = 0; r < KB; ++r)
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
  for (int p = 0; p < planes; ++p) {
    const uint16_t* qp = q + static_cast<size_t>(p) * kPairs * G * 32;
    for (int j = 0; j < kPairs; ++j) {
      __m512bh qv[G];
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) qv[g] = (__m512bh)_mm512_load_si512(qp + (j * G + g) * 32);
#pragma GCC unroll 16
      for (int r = 0; r < KB; ++r) {
        int32_t pair;
        std::memcpy(&pair, rows[r] + 2 * j, sizeof pair);
        const __m512bh k = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], qv[g], k);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < KB; ++r) {
    __m512 f = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g)
      f = _mm512_fmadd_ps(_mm512_max_ps(acc[r][g], _mm512_setzero_ps()), _mm512_load_ps(w + g * 16), f);
    partial[r] += _mm512_reduce_add_ps(f);
  }
}

struct Avx512 {
  using Q = uint16_t;
  using Key = uint16_t;
  static constexpr int kLanes = 16, kMaxGroups = 4;
  static constexpr int keys_per_block(int groups) { return kAvx512Accumulators / groups; }
  static void fp8_row(const uint8_t* src, uint16_t* dst) { fp8_row_to_bf16_avx512(src, dst); }
  static void dot(int groups, const uint16_t* q, int planes, const float* w, const uint16_t* const* rows,
                  float* partial) {
    with_groups(groups, [&]<int G>() { dot_avx512<G>(q, planes, w, rows, partial); });
  }
};

#endif  // SMLA_X86

}  // namespace

const ScoreKernel& score_kernel(Isa isa) {
  static constexpr ScoreKernel portable = make_kernel<Portable>();
#ifdef SMLA_X86
  static constexpr ScoreKernel avx2 = make_kernel<Avx2>();
  static constexpr ScoreKernel avx512 = make_kernel<Avx512>();
  if (score_kernel_isa(isa) == Isa::avx512_bf16) return avx512;
  if (score_kernel_isa(isa) == Isa::avx2) return avx2;
#endif
  return portable;
}

void widen_fp8_key(Isa isa, const uint8_t* src, float* dst) {
#ifdef SMLA_X86
  if (score_kernel_isa(isa) == Isa::avx512_bf16) {
    uint16_t bf16[kDim];
    Avx512::fp8_row(src, bf16);
    for (int d = 0; d < kDim; ++d) dst[d] = numeric::bf16_to_float(bf16[d]);
    return;
  }
#endif
  Portable::fp8_row(src, dst);
}

}  // namespace smla::cpu::indexer
