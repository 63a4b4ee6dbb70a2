// The CPU attention kernels, built once per instruction set from one generic
// body (attention_kernels.inc) plus an AVX512-BF16 kernel, and chosen at run
// time. Target regions (rather than -m flags on whole files) keep AVX code out
// of the inline functions this file shares with the rest of the library.
#include "cpu/attention_kernels.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/numeric.h"

#if defined(__x86_64__)
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12 flags the _mm512_undefined_* operands inside its own intrinsics (GCC bug 105593).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#define SMLA_X86 1
#endif

#define SMLA_PRAGMA(x) _Pragma(#x)
#if defined(__clang__)
#define SMLA_TARGET_BEGIN(isa) SMLA_PRAGMA(clang attribute push(__attribute__((target(isa))), apply_to = function))
#define SMLA_TARGET_END SMLA_PRAGMA(clang attribute pop)
#define SMLA_UNROLL SMLA_PRAGMA(unroll)
#else
#define SMLA_TARGET_BEGIN(isa) SMLA_PRAGMA(GCC push_options) SMLA_PRAGMA(GCC target(isa))
#define SMLA_TARGET_END SMLA_PRAGMA(GCC pop_options)
#define SMLA_UNROLL SMLA_PRAGMA(GCC unroll 16)
#endif

namespace smla::cpu::attn {
namespace {

// e^x as 2^n * e^r, x = n ln2 + r, |r| <= ln2/2 (Cody-Waite split of ln2), degree-6
// Taylor polynomial for e^r: relative error < 2e-7. Below kExpMin the result is 0.
constexpr float kExpMin = -87.3f;  // e^kExpMin is just above FLT_MIN: 2^n stays normal
constexpr float kLog2e = 1.44269504f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[] = {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};

namespace scalar {

struct V {
  using T = float;
  static constexpr int W = 1, kRowBlock = 4, kAccHeads = 4, kColVecs = 4;
  static T load(const float* p) { return *p; }
  static void store(float* p, T x) { *p = x; }
  static T zero() { return 0.f; }
  static T set1(float x) { return x; }
  static T add(T a, T b) { return a + b; }
  static T sub(T a, T b) { return a - b; }
  static T mul(T a, T b) { return a * b; }
  static T max(T a, T b) { return a > b ? a : b; }
  static T fma(T a, T b, T c) { return a * b + c; }
  static float hsum(T x) { return x; }
  static float hmax(T x) { return x; }
  static T exp(T x) { return std::exp(x); }
  static T load_bf16(const void* p) { return numeric::bf16_to_float(bits16(p)); }
  static T load_f16(const void* p) { return numeric::f16_to_float(bits16(p)); }
  static T load_e4m3(const void* p, float scale) {
    return numeric::e4m3_to_float(*static_cast<const uint8_t*>(p)) * scale;
  }
  static void store_bf16(void* p, T x) { put16(p, numeric::float_to_bf16(x)); }
  static void store_f16(void* p, T x) { put16(p, numeric::float_to_f16(x)); }

 private:
  static uint16_t bits16(const void* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return h;
  }
  static void put16(void* p, uint16_t h) { std::memcpy(p, &h, 2); }
};

#include "cpu/attention_kernels.inc"

}  // namespace scalar

#if SMLA_X86

SMLA_TARGET_BEGIN("avx2,fma,f16c")
namespace avx2 {

struct V {
  using T = __m256;
  static constexpr int W = 8, kRowBlock = 2, kAccHeads = 2, kColVecs = 4;  // 16 ymm registers
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, T x) { _mm256_storeu_ps(p, x); }
  static T zero() { return _mm256_setzero_ps(); }
  static T set1(float x) { return _mm256_set1_ps(x); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T max(T a, T b) { return _mm256_max_ps(a, b); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static float hsum(T x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static float hmax(T x) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
  }
  static T exp(T x) {
    const T xc = _mm256_max_ps(set1(kExpMin), x);  // max returns its second operand for NaN: NaN stays
    const T n = _mm256_round_ps(mul(xc, set1(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const T r = _mm256_fnmadd_ps(n, set1(kLn2Lo), _mm256_fnmadd_ps(n, set1(kLn2Hi), xc));
    T p = set1(kExpPoly[0]);
    for (int i = 1; i < 7; ++i) p = fma(p, r, set1(kExpPoly[i]));
    const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(mul(p, _mm256_castsi256_ps(pow2n)), _mm256_cmp_ps(x, set1(kExpMin), _CMP_NLT_UQ));
  }
  static T load_bf16(const void* p) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
  }
  static T load_f16(const void* p) { return _mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(p))); }
  // numeric::e4m3_to_float, lane-wise: normals rebias the exponent, subnormals are man * 2^-9, 0x7f is NaN.
  static T load_e4m3(const void* p, float scale) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(static_cast<const __m128i*>(p)));
    const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi32(0x7f));
    const T normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23)));
    const T subnormal = mul(_mm256_cvtepi32_ps(mag), set1(0x1p-9f));
    T v = _mm256_blendv_ps(normal, subnormal, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag)));
    v = _mm256_blendv_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)),
                         _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7f))));
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
    return mul(_mm256_or_ps(v, _mm256_castsi256_ps(sign)), set1(scale));
  }
  // numeric::float_to_bf16, lane-wise.
  static void store_bf16(void* p, T x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded =
        _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i nan =
        _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    const __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(static_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  // numeric::float_to_f16: the hardware conversion is the same rounding; NaN becomes sign | 0x7e00 as there.
  static void store_f16(void* p, T x) {
    const __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m256i quiet = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 16),
                                                           _mm256_set1_epi32(0x8000)),
                                          _mm256_set1_epi32(0x7e00));
    const __m128i nan16 = _mm_packs_epi32(_mm256_castsi256_si128(nan), _mm256_extracti128_si256(nan, 1));
    const __m128i quiet16 = _mm_packus_epi32(_mm256_castsi256_si128(quiet), _mm256_extracti128_si256(quiet, 1));
    _mm_storeu_si128(static_cast<__m128i*>(p), _mm_blendv_epi8(h, quiet16, nan16));
  }
};

#include "cpu/attention_kernels.inc"

}  // namespace avx2
SMLA_TARGET_END

SMLA_TARGET_BEGIN("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace avx512 {

struct V {
  using T = __m512;
  static constexpr int W = 16, kRowBlock = 4, kAccHeads = 4, kColVecs = 4;
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, T x) { _mm512_storeu_ps(p, x); }
  static T zero() { return _mm512_setzero_ps(); }
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T max(T a, T b) { return _mm512_max_ps(a, b); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static float hsum(T x) { return _mm512_reduce_add_ps(x); }
  static float hmax(T x) { return _mm512_reduce_max_ps(x); }
  static T exp(T x) {
    const T xc = _mm512_max_ps(set1(kExpMin), x);  // NaN stays (max returns its second operand)
    const T n = _mm512_roundscale_ps(mul(xc, set1(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const T r = _mm512_fnmadd_ps(n, set1(kLn2Lo), _mm512_fnmadd_ps(n, set1(kLn2Hi), xc));
    T p = set1(kExpPoly[0]);
    for (int i = 1; i < 7; ++i) p = fma(p, r, set1(kExpPoly[i]));
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, set1(kExpMin), _CMP_NLT_UQ), _mm512_scalef_ps(p, n));
  }
  static T load_bf16(const void* p) {
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
  }
  static T load_f16(const void* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(p))); }
  // numeric::e4m3_to_float, lane-wise (see the AVX2 version).
  static T load_e4m3(const void* p, float scale) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
    const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7f));
    const T normal = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23)));
    const T subnormal = mul(_mm512_cvtepi32_ps(mag), set1(0x1p-9f));
    __m512i v = _mm512_castps_si512(_mm512_mask_blend_ps(_mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8)), normal,
                                                         subnormal));
    v = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7f)), v,
                                _mm512_set1_epi32(0x7fc00000));
    v = _mm512_or_si512(v, _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24));
    return mul(_mm512_castsi512_ps(v), set1(scale));
  }
  // numeric::float_to_bf16, lane-wise.
  static void store_bf16(void* p, T x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded =
        _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    const __mmask16 nan =
        _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    _mm256_storeu_si256(static_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet)));
  }
  // numeric::float_to_f16 (see the AVX2 version).
  static void store_f16(void* p, T x) {
    const __m256i h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
    const __m256i sign = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16));
    const __m256i quiet = _mm256_or_si256(_mm256_and_si256(sign, _mm256_set1_epi16(int16_t(0x8000))),
                                          _mm256_set1_epi16(0x7e00));
    _mm256_storeu_si256(static_cast<__m256i*>(p),
                        _mm256_mask_blend_epi16(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), h, quiet));
  }
  // Sixteen horizontal sums at once (a transpose-and-add tree, 45 instructions instead of 16
  // reductions): lane 4h + r of the result is the sum of acc[4r + h], i.e. S[h][r].
  static void reduce_scores(const T* a, float scale, float* S, int ld) {
    T b[8], c[4], d[2];
    SMLA_UNROLL for (int k = 0; k < 8; ++k) {
      const T x = a[2 * k], y = a[2 * k + 1];
      b[k] = add(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xee));
    }
    SMLA_UNROLL for (int k = 0; k < 4; ++k) {
      const T x = b[2 * k], y = b[2 * k + 1];
      c[k] = add(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xdd));
    }
    SMLA_UNROLL for (int k = 0; k < 2; ++k) {
      const T x = c[2 * k], y = c[2 * k + 1];
      d[k] = add(_mm512_shuffle_ps(x, y, 0x44), _mm512_shuffle_ps(x, y, 0xee));
    }
    const T e = mul(add(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xdd)), set1(scale));
    _mm_storeu_ps(S, _mm512_castps512_ps128(e));
    _mm_storeu_ps(S + ld, _mm512_extractf32x4_ps(e, 1));
    _mm_storeu_ps(S + 2 * ld, _mm512_extractf32x4_ps(e, 2));
    _mm_storeu_ps(S + 3 * ld, _mm512_extractf32x4_ps(e, 3));
  }
};

#include "cpu/attention_kernels.inc"

}  // namespace avx512
SMLA_TARGET_END

SMLA_TARGET_BEGIN("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
namespace avx512bf16 {

using avx512::kChunk;
using avx512::V;
static_assert(kChunk % 32 == 0, "P rows are packed 32 at a time");

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }
inline __m512i as_i(__m512bh x) { return (__m512i)x; }

// vpermt2w indices that interleave two rows' 16-bit values into pairs (a[j], b[j]).
constexpr std::array<uint16_t, 32> pair_index(int first) {
  std::array<uint16_t, 32> idx{};
  for (int i = 0; i < 16; ++i) {
    idx[2 * i] = static_cast<uint16_t>(first + i);
    idx[2 * i + 1] = static_cast<uint16_t>(32 + first + i);
  }
  return idx;
}
alignas(64) constexpr std::array<uint16_t, 32> kPairsLo = pair_index(0), kPairsHi = pair_index(16);

// dst[j] = (a[j], b[j]) for the 512 latents of two rows: the operand layout of vdpbf16ps.
inline void interleave_pairs(const uint16_t* a, const uint16_t* b, uint32_t* dst) {
  const __m512i lo = _mm512_load_si512(kPairsLo.data()), hi = _mm512_load_si512(kPairsHi.data());
  for (int c = 0; c < kMlaVDim; c += 32) {
    const __m512i va = _mm512_loadu_si512(a + c), vb = _mm512_loadu_si512(b + c);
    _mm512_storeu_si512(dst + c, _mm512_permutex2var_epi16(va, lo, vb));
    _mm512_storeu_si512(dst + c + 16, _mm512_permutex2var_epi16(va, hi, vb));
  }
}

// bf16 bits of m * 2^-9 (the e4m3 subnormals) at index m = 1..7.
constexpr std::array<uint16_t, 32> e4m3_subnormals_bf16() {
  std::array<uint16_t, 32> t{};
  for (int m = 1; m < 8; ++m) {
    const int e = m >= 4 ? 2 : m >= 2 ? 1 : 0;  // floor(log2 m)
    t[m] = static_cast<uint16_t>(((127 - 9 + e) << 7) | ((m << (7 - e)) & 0x7f));
  }
  return t;
}
alignas(64) constexpr std::array<uint16_t, 32> kE4m3Subnormals = e4m3_subnormals_bf16();

// 32 e4m3 values times 2^k as bf16, in 16-bit lanes: the scale is folded into the exponent, so this is
// exact (the value e4m3 * 2^k stays a normal bf16 for k in [-117, 119]) and does twice the work per
// instruction of converting through fp32. Same bits as numeric::e4m3_to_float(x) * 2^k rounded to bf16.
inline __m512i e4m3_to_bf16_pow2(const uint8_t* p, int k) {
  const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i mag = _mm512_and_si512(w, _mm512_set1_epi16(0x7f));
  // Normal: exponent field e + 120 + k, mantissa m << 4. Subnormal (mag < 8): a table, then + k on the exponent.
  const __m512i normal = _mm512_slli_epi16(mag, 4);
  const __m512i subnormal = _mm512_sub_epi16(_mm512_permutexvar_epi16(mag, _mm512_load_si512(kE4m3Subnormals.data())),
                                             _mm512_set1_epi16(120 << 7));
  __m512i v = _mm512_mask_blend_epi16(_mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8)), normal, subnormal);
  const __m512i exponent = _mm512_set1_epi16(static_cast<int16_t>((120 + k) << 7));
  v = _mm512_maskz_add_epi16(_mm512_test_epi16_mask(mag, mag), v, exponent);  // zero stays zero
  v = _mm512_mask_mov_epi16(v, _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7f)), _mm512_set1_epi16(0x7fc0));
  return _mm512_or_si512(v, _mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x80)), 8));
}

// An fp8 row (fp8_ds_mla, fp8_ds_mla_nope) as bf16, exactly; false (row unfinished) when a tile scale is not a
// power of two in range, which bf16 could not hold exactly. The quantiser only writes powers of two.
inline bool dequant_row_bf16(const uint8_t* row, uint16_t* dst, MlaHead head) {
  float scales[4];
  std::memcpy(scales, row + kMlaLatentDim, sizeof scales);
  for (int tile = 0; tile < 4; ++tile) {
    const uint32_t u = std::bit_cast<uint32_t>(scales[tile]);
    const int k = static_cast<int>(u >> 23) - 127;
    if ((u & 0x807fffffu) != 0 || k < -117 || k > 119) return false;
    for (int d = tile * 128; d < (tile + 1) * 128; d += 32)
      _mm512_storeu_si512(dst + d, e4m3_to_bf16_pow2(row + d, k));
  }
  std::memcpy(dst + kMlaLatentDim, row + kMlaLatentDim + sizeof scales, size_t(head.rope_dim) * 2);
  return true;
}

// bf16 queries against bf16 (or exactly-bf16 fp8) rows with vdpbf16ps: 32 multiply-adds per instruction,
// twice the fp32 FMA rate. Rows are used in place (bf16) or dequantised once into kb_ (fp8). Like FlashMLA,
// P is rounded to bf16 for the P.V product; the softmax sums keep fp32 P.
template <DType kCache>
class Bf16Kernel {
 public:
  static constexpr int kRowAlign = 4;
  static size_t workspace_floats(int hp) { return kRowsFloats + kKbFloats + kViFloats + size_t(hp) * kChunk / 2; }

  Bf16Kernel(const AttendJob& j, float* ws)
      : hp_(padded_heads(j.heads)),
        head_(j.head),
        rows_(reinterpret_cast<const uint16_t**>(ws)),
        kb_(reinterpret_cast<uint16_t*>(ws + kRowsFloats)),
        vi_(reinterpret_cast<uint32_t*>(ws + kRowsFloats + kKbFloats)),
        pb_(vi_ + kViFloats) {
    for (int h = 0; h < hp_; ++h)
      q_[h] = h < j.heads ? static_cast<const uint16_t*>(j.q) + h * j.q_head_stride : avx512::kZeroRow;
  }

  bool load(const uint8_t* const* rows, int n, int n_pad) {
    for (int r = 0; r < n; ++r) {
      if constexpr (kCache == DType::fp8_ds_mla) {
        if (!dequant_row_bf16(rows[r], kb_ + r * kMlaQkDim, head_)) return false;
        rows_[r] = kb_ + r * kMlaQkDim;
      } else {
        rows_[r] = reinterpret_cast<const uint16_t*>(rows[r]);
      }
    }
    for (int r = n; r < n_pad; ++r) rows_[r] = avx512::kZeroRow;
    for (int rp = 0; rp < n_pad / 2; ++rp) interleave_pairs(rows_[2 * rp], rows_[2 * rp + 1], vi_ + rp * kMlaVDim);
    return true;
  }

  void scores(float* S, float scale, int n_pad) const {
    for (int rb = 0; rb < n_pad; rb += 4)
      for (int hb = 0; hb < hp_; hb += kHeadBlock) {
        __m512 acc[16];
        SMLA_UNROLL for (auto& a : acc) a = _mm512_setzero_ps();
        for (int d = 0; d < head_.qk_dim(); d += 32) {
          __m512i k[4];
          SMLA_UNROLL for (int r = 0; r < 4; ++r) k[r] = _mm512_loadu_si512(rows_[rb + r] + d);
          SMLA_UNROLL for (int h = 0; h < 4; ++h) {
            const __m512bh q = as_bh(_mm512_loadu_si512(q_[hb + h] + d));
            SMLA_UNROLL for (int r = 0; r < 4; ++r) acc[r * 4 + h] = _mm512_dpbf16_ps(acc[r * 4 + h], q, as_bh(k[r]));
          }
        }
        V::reduce_scores(acc, scale, S + hb * kChunk + rb, kChunk);
      }
  }

  void accumulate(const float* P, const float* alpha, float* acc, int, int n_pad) const {
    for (int h = 0; h < hp_; ++h)
      for (int r = 0; r < n_pad; r += 32) {
        const float* p = P + h * kChunk + r;
        _mm512_storeu_si512(pb_ + (h * kChunk + r) / 2,
                            as_i(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + 16), _mm512_loadu_ps(p))));
      }
    for (int cb = 0; cb < kMlaVDim; cb += 64)
      for (int hb = 0; hb < hp_; hb += 4) {
        __m512 a[4][4];
        SMLA_UNROLL for (int h = 0; h < 4; ++h) {
          const __m512 al = _mm512_set1_ps(alpha[hb + h]);
          SMLA_UNROLL for (int c = 0; c < 4; ++c)
            a[h][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (hb + h) * kMlaVDim + cb + 16 * c), al);
        }
        for (int rp = 0; rp < n_pad / 2; ++rp) {
          const uint32_t* v = vi_ + rp * kMlaVDim + cb;
          __m512bh vv[4];
          SMLA_UNROLL for (int c = 0; c < 4; ++c) vv[c] = as_bh(_mm512_loadu_si512(v + 16 * c));
          SMLA_UNROLL for (int h = 0; h < 4; ++h) {
            const __m512bh p = as_bh(_mm512_set1_epi32(static_cast<int>(pb_[(hb + h) * kChunk / 2 + rp])));
            SMLA_UNROLL for (int c = 0; c < 4; ++c) a[h][c] = _mm512_dpbf16_ps(a[h][c], p, vv[c]);
          }
        }
        SMLA_UNROLL for (int h = 0; h < 4; ++h)
          SMLA_UNROLL for (int c = 0; c < 4; ++c)
            _mm512_storeu_ps(acc + (hb + h) * kMlaVDim + cb + 16 * c, a[h][c]);
      }
  }

 private:
  static constexpr size_t kRowsFloats = kChunk * sizeof(void*) / sizeof(float);
  static constexpr size_t kKbFloats = kChunk * kMlaQkDim / 2;
  static constexpr size_t kViFloats = kChunk / 2 * kMlaVDim;

  int hp_;
  MlaHead head_;
  const uint16_t* q_[padded_heads(kMaxHeads)];
  const uint16_t** rows_;  // [kChunk] the chunk's rows (in the cache, in kb_, or the zero row)
  uint16_t* kb_;           // [kChunk][576] dequantised fp8 rows
  uint32_t* vi_;           // [kChunk / 2][512] latent pairs of rows (2i, 2i + 1)
  uint32_t* pb_;           // [hp][kChunk / 2] P pairs in bf16
};

size_t workspace_bytes(int heads) {
  const int hp = padded_heads(heads);
  return std::max(avx512::workspace_bytes(heads),
                  (Bf16Kernel<DType::bf16>::workspace_floats(hp) + avx512::softmax_floats(hp)) * sizeof(float));
}

// The bf16 kernel only where it is exact: bf16 queries, and bf16 rows or fp8 rows with power-of-two scales
// (checked as rows load; a job that meets another scale starts over in the fp32 kernel).
void attend(const AttendJob& j) {
  const bool exact = j.q_dtype == DType::bf16 &&
                     (j.cache_dtype == DType::bf16 ? avx512::attend_rows<Bf16Kernel<DType::bf16>>(j)
                      : is_fp8_mla_cache(j.cache_dtype) ? avx512::attend_rows<Bf16Kernel<DType::fp8_ds_mla>>(j)
                                                           : false);
  if (!exact) avx512::attend(j);
}

}  // namespace avx512bf16
SMLA_TARGET_END

#endif  // SMLA_X86

}  // namespace

const Kernels& active_kernels() {
  static const Kernels scalar_kernels{"scalar", scalar::workspace_bytes, scalar::attend, scalar::finalize};
#if SMLA_X86
  static const Kernels avx2_kernels{"avx2", avx2::workspace_bytes, avx2::attend, avx2::finalize};
  static const Kernels avx512_kernels{"avx512", avx512::workspace_bytes, avx512::attend, avx512::finalize};
  static const Kernels bf16_kernels{"avx512_bf16", avx512bf16::workspace_bytes, avx512bf16::attend,
                                    avx512::finalize};
#endif
  switch (active_isa()) {
#if SMLA_X86
    case Isa::avx512_bf16: return bf16_kernels;
    case Isa::avx512: return avx512_kernels;
    case Isa::avx2: return avx2_kernels;
#endif
    default: return scalar_kernels;
  }
}

}  // namespace smla::cpu::attn
