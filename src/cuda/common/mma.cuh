// Tensor-core primitives: mma.sync m16n8k16 (fp32 accumulate), ldmatrix and
// cp.async, on every arch from SM80 on; mma.sync m16n8k32 on e4m3 from SM89
// on; Hopper's warpgroup mma (wgmma, bf16 or e4m3) in sm_90a code.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace smla::cuda {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// D = A (16x16, row) * B (16x8, col) + D, fp32 accumulators.
template <class T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// D = A (16x32, row) * B (32x8, col) + D on e4m3 values, fp32 accumulators.
// PTX has it from SM89 on; SM89 and SM12x run it natively (their tensor
// cores keep about 13 bits of the products' sum: not fp32-exact), SM90
// emulates it (converts to f16). Older archs trap: callers check first.
__device__ __forceinline__ void mma_16832_e4m3(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  __trap();
#endif
}
inline bool fp8_mma_available(int compute_capability) { return compute_capability >= 89; }
inline bool fp8_mma_native(int compute_capability) { return compute_capability == 89 || compute_capability / 10 == 12; }

// Hopper's warpgroup mma (sm_90a code only; elsewhere these trap, and callers
// check wgmma_available first). D (64 x N, fp32) = A (64 x K) * B (K x N) (+ D):
// bf16 (K = 16) or e4m3 (K = 32) values; A from the registers of the
// warpgroup's four warps (warp w holds rows 16w..16w+15 in mma.sync
// m16n8k16's A layout, m16n8k32's for e4m3), B in shared memory through
// descriptor `b`; d holds warp w's rows in mma.sync's accumulator layout, 8
// columns after 8 columns. e4m3 products are summed to about 14 bits, like
// other tensor cores' fp8 (docs/ops.md).
enum class WgmmaIn { bf16, f16, e4m3 };
// One wgmma's asm: `op` the instruction, `immediates` what follows the predicate scale-d (imm-scale-a,
// imm-scale-b, and for bf16 imm-trans-b).
#define SMLA_WGMMA_RS_N32(op, immediates)                                                                            \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n" op                                                    \
               " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, p" immediates   \
               ";\n}\n"                                                                                          \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),   \
                 "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),          \
                 "+f"(d[15])                                                                                       \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(static_cast<int>(accumulate)))
#define SMLA_WGMMA_RS_N64(op, immediates)                                                                            \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" op                                                    \
               " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26," \
               "%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p" immediates ";\n}\n"                               \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),   \
                 "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),          \
                 "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),        \
                 "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),        \
                 "+f"(d[29]), "+f"(d[30]), "+f"(d[31])                                                             \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(static_cast<int>(accumulate)))
// kMnMajorB (16-bit values only): B's N dimension is the contiguous one in its core matrices (imm-trans-b 1; the
// descriptor's leading offset then steps along K, its stride offset along N, as for K-major B).
template <WgmmaIn kIn, int N, bool kMnMajorB = false>
__device__ __forceinline__ void wgmma(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b, bool accumulate) {
  static_assert(N == 32 || N == 64, "wgmma is there for N 32 and 64");
  static_assert(!kMnMajorB || kIn != WgmmaIn::e4m3, "e4m3 wgmma takes K-major B only");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (kIn == WgmmaIn::bf16 && N == 32)
    SMLA_WGMMA_RS_N32("wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16", ", 1, 1, 0");
  else if constexpr (kIn == WgmmaIn::bf16 && kMnMajorB)
    SMLA_WGMMA_RS_N64("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16", ", 1, 1, 1");
  else if constexpr (kIn == WgmmaIn::bf16)
    SMLA_WGMMA_RS_N64("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16", ", 1, 1, 0");
  else if constexpr (kIn == WgmmaIn::f16 && kMnMajorB)
    SMLA_WGMMA_RS_N64("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16", ", 1, 1, 1");
  else if constexpr (kIn == WgmmaIn::f16)
    static_assert(kMnMajorB, "f16 wgmma from registers is there with MN-major B");
  else if constexpr (N == 32)
    SMLA_WGMMA_RS_N32("wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3", ", 1, 1");
  else
    SMLA_WGMMA_RS_N64("wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3", ", 1, 1");
#else
  __trap();
#endif
}
#undef SMLA_WGMMA_RS_N32
#undef SMLA_WGMMA_RS_N64

// D (64 x 64, fp32) = A (64 x 16) * B (16 x 64) (+ D) on 16-bit values, both operands in shared memory through
// K-major descriptors `a` and `b` (wgmma_descriptor); d as above.
template <WgmmaIn kIn>
__device__ __forceinline__ void wgmma_ss_n64(float (&d)[32], uint64_t a, uint64_t b, bool accumulate) {
  static_assert(kIn != WgmmaIn::e4m3, "16-bit values");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SMLA_WGMMA_SS_N64(op)                                                                                      \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" op                                                  \
               " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26," \
               "%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"                                               \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),   \
                 "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),          \
                 "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),        \
                 "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),        \
                 "+f"(d[29]), "+f"(d[30]), "+f"(d[31])                                                             \
               : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)))
  if constexpr (kIn == WgmmaIn::bf16) SMLA_WGMMA_SS_N64("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16");
  else SMLA_WGMMA_SS_N64("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16");
#undef SMLA_WGMMA_SS_N64
#else
  __trap();
#endif
}

// O (64 x 256, fp32) (+)= A (64 x 16) * B (16 x 256) on 16-bit values, B MN-major in the 128-byte swizzle through
// `b` (wgmma_descriptor_swizzled, its 64-column atoms `mn_atom_bytes` apart): A from registers (`a`, as wgmma
// above), or kSharedA from shared memory through the K-major descriptor `a_desc`. d[4j + e]: column 8j + 2c + e % 2
// of the warp's row g + 8 (e / 2), as four N-64 products' accumulators one after another.
#define SMLA_WGMMA_N256_OPERANDS \
  "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15," \
  "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31," \
  "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47," \
  "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63," \
  "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79," \
  "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95," \
  "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111," \
  "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"
#define SMLA_D8(i)                                                                                           \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])
#define SMLA_D128                                                                                                   \
  SMLA_D8(0), SMLA_D8(8), SMLA_D8(16), SMLA_D8(24), SMLA_D8(32), SMLA_D8(40), SMLA_D8(48), SMLA_D8(56), SMLA_D8(64), \
      SMLA_D8(72), SMLA_D8(80), SMLA_D8(88), SMLA_D8(96), SMLA_D8(104), SMLA_D8(112), SMLA_D8(120)
#define SMLA_WGMMA_N256_SS(type)                                                                                    \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\nwgmma.mma_async.sync.aligned.m64n256k16.f32." type     \
               " {" SMLA_WGMMA_N256_OPERANDS "}, %128, %129, p, 1, 1, 0, 1;\n}\n"                                   \
               : SMLA_D128                                                                                          \
               : "l"(a_desc), "l"(b), "r"(static_cast<int>(accumulate)))
#define SMLA_WGMMA_N256_RS(type)                                                                                    \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\nwgmma.mma_async.sync.aligned.m64n256k16.f32." type     \
               " {" SMLA_WGMMA_N256_OPERANDS "}, {%128,%129,%130,%131}, %132, p, 1, 1, 1;\n}\n"                    \
               : SMLA_D128                                                                                          \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(static_cast<int>(accumulate)))
template <WgmmaIn kIn, bool kSharedA>
__device__ __forceinline__ void wgmma_n256_mn_major_b(float (&d)[128], const uint32_t (&a)[4], uint64_t a_desc,
                                                      uint64_t b, bool accumulate) {
  static_assert(kIn != WgmmaIn::e4m3, "16-bit values");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (kSharedA && kIn == WgmmaIn::bf16) SMLA_WGMMA_N256_SS("bf16.bf16");
  else if constexpr (kSharedA) SMLA_WGMMA_N256_SS("f16.f16");
  else if constexpr (kIn == WgmmaIn::bf16) SMLA_WGMMA_N256_RS("bf16.bf16");
  else SMLA_WGMMA_N256_RS("f16.f16");
#else
  __trap();
#endif
}
#undef SMLA_WGMMA_N256_RS
#undef SMLA_WGMMA_N256_SS
#undef SMLA_D128
#undef SMLA_D8
#undef SMLA_WGMMA_N256_OPERANDS

// D (64 x N, fp32; N 8 or 16) (+)= A (64 x 16) * B (16 x N) on 16-bit values, both in shared memory through
// descriptors: A K-major, or kTransA M-major (imm-trans-a: lines along M, as wgmma_descriptor_swizzled describes an
// MN-major operand); B K-major. d as wgmma's above (d[4j + e]: column 8j + 2c + e % 2 of the warp's row g + 8 (e / 2)).
#define SMLA_WGMMA_NARROW(type, trans_a)                                                                            \
  if constexpr (N == 8)                                                                                             \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\nwgmma.mma_async.sync.aligned.m64n8k16.f32." type      \
                 " {%0,%1,%2,%3}, %4, %5, p, 1, 1, " trans_a ", 0;\n}\n"                                            \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                                   \
                 : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)));                                             \
  else                                                                                                              \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\nwgmma.mma_async.sync.aligned.m64n16k16.f32." type   \
                 " {%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, p, 1, 1, " trans_a ", 0;\n}\n"                                \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])   \
                 : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)))
template <WgmmaIn kIn, int N, bool kTransA>
__device__ __forceinline__ void wgmma_ss_narrow(float (&d)[N / 2], uint64_t a, uint64_t b, bool accumulate) {
  static_assert(kIn != WgmmaIn::e4m3 && (N == 8 || N == 16), "16-bit values, N 8 or 16");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (kIn == WgmmaIn::bf16) {
    if constexpr (kTransA) SMLA_WGMMA_NARROW("bf16.bf16", "1");
    else SMLA_WGMMA_NARROW("bf16.bf16", "0");
  } else {
    if constexpr (kTransA) SMLA_WGMMA_NARROW("f16.f16", "1");
    else SMLA_WGMMA_NARROW("f16.f16", "0");
  }
#else
  __trap();
#endif
}
#undef SMLA_WGMMA_NARROW

// An operand of wgmma in shared memory without swizzle (A or B K-major, or B MN-major): 8 x 16-byte core matrices,
// `k_stride` bytes apart along K and `n_stride` bytes apart along M or N (both multiples of 16, the start 16-byte
// aligned).
__device__ __forceinline__ uint64_t wgmma_descriptor(const void* smem, uint32_t k_stride, uint32_t n_stride) {
  return uint64_t{(smem_addr(smem) >> 4) & 0x3fffu} | uint64_t{(k_stride >> 4) & 0x3fffu} << 16 |
         uint64_t{(n_stride >> 4) & 0x3fffu} << 32;
}
// An operand of wgmma in shared memory in the 128-byte swizzle (lines of 64 16-bit values, 8 lines to a 1024-byte
// atom, 16-byte place k of line r at k ^ (r % 8); the atom 1024-byte aligned): A or B K-major (lines along K, 8-row
// groups of M or N 1024 bytes apart: the stride offset) or MN-major (B with imm-trans-b, A with imm-trans-a: lines
// along N or M, 8-row groups of K 1024 bytes apart, and atoms along N or M `mn_atom_bytes` apart: the leading offset,
// used where N or M spans more than one line, unused K-major). A K-step inside a line moves the start by 32 bytes (a
// `+ 2` on the descriptor).
__device__ __forceinline__ uint64_t wgmma_descriptor_swizzled(const void* smem, uint32_t mn_atom_bytes = 1024) {
  return uint64_t{(smem_addr(smem) >> 4) & 0x3fffu} | uint64_t{(mn_atom_bytes >> 4) & 0x3fffu} << 16 |
         uint64_t{1024 >> 4} << 32 | uint64_t{1} << 62;
}
// Before the first wgmma of a batch (its registers were written by ordinary instructions).
__device__ __forceinline__ void wgmma_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
// Ends the batch (wgmma_wait waits for it).
__device__ __forceinline__ void wgmma_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
// Waits for every batch committed: their accumulators are ready, their A registers free.
__device__ __forceinline__ void wgmma_wait() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#endif
}
// Waits until at most N of the batches committed are still running (the oldest first complete).
template <int N>
__device__ __forceinline__ void wgmma_wait_until() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// Ends the batch and waits for it.
__device__ __forceinline__ void wgmma_commit_and_wait() {
  wgmma_commit();
  wgmma_wait();
}
// Orders this thread's ordinary shared-memory accesses with the async proxy's: its stores before wgmma's reads, its
// reads before later bulk copies into the same bytes. A no-op below sm_90, which has neither.
__device__ __forceinline__ void fence_shared_for_async_proxy() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// Whether the current device may run wgmma: a Hopper GPU and a build with sm_90a code (wgmma_kernels_available()
// also asks whether the code the driver loaded has sm_90a's features).
inline bool wgmma_available(int compute_capability) {
#if defined(SMLA_CUDA_SM90A)
  return compute_capability == 90;
#else
  return false;
#endif
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// 16-byte asynchronous copy global -> shared; when `valid` is false nothing is
// read and the destination is zero-filled (src-size 0).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(valid ? 16 : 0));
}
// 8-byte variant, for fp8_ds_mla_v4's scales (8 bytes per token, 8-byte aligned).
__device__ __forceinline__ void cp_async_8(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(valid ? 8 : 0));
}
// 4-byte variant, for rows that are only 4-byte aligned (fp8 index caches
// whose block size is not a multiple of 4).
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(valid ? 4 : 0));
}
// Barrier `id` (1-15; 0 is __syncthreads') among `threads` threads (a multiple of 32), each of which reaches it.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// One-way signals between the warps of a CTA through an mbarrier in shared memory (sm_90+): each of `count`
// producer threads arrives after its shared-memory writes (a release), the consumers wait for the phase (an
// acquire). compute-sanitizer's racecheck orders the two, which it does not for a named barrier's bar.arrive.
// Waits name the phase by its parity, so a producer may be at most one phase ahead of a consumer's wait. sm_90+
// only (try_wait): the wgmma kernel's.
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, int count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.shared.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, int parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n.reg .pred done;\nsmla_wait:\n"
      "mbarrier.try_wait.parity.shared.b64 done, [%0], %1;\n"
      "@!done bra smla_wait;\n}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
#else
  __trap();
#endif
}
// One bulk copy of `bytes` (a multiple of 16, both addresses 16-byte aligned) global -> shared that completes its
// bytes on `bar`, whose phase expects them (mbarrier_expect_bytes): one instruction a row where cp.async takes one
// per 16 bytes. sm_90+ only.
__device__ __forceinline__ void mbarrier_expect_bytes(uint64_t* bar, int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void bulk_copy_to_shared(void* smem, const void* gmem, int bytes, uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_addr(smem)),
               "l"(gmem), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
#else
  __trap();
#endif
}
// One bulk copy of `bytes` (a multiple of 16, both addresses 16-byte aligned) shared -> global in this thread's bulk
// async-group, and the wait until every copy of the group has read its shared memory (so that it may be reused or
// the CTA end). The writes before it must be made visible to the async proxy (fence_shared_for_async_proxy by each
// writer, then a barrier). sm_90+ only.
__device__ __forceinline__ void bulk_copy_to_global(void* gmem, const void* smem, int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(gmem), "r"(smem_addr(smem)),
               "r"(bytes)
               : "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void bulk_copies_read_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.commit_group;\ncp.async.bulk.wait_group.read 0;\n" ::: "memory");
#else
  __trap();
#endif
}
// Makes this thread's mbarrier_init visible to bulk copies (the async proxy) that complete on the barriers. sm_90+.
__device__ __forceinline__ void fence_mbarrier_init() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#else
  __trap();
#endif
}
// Arrives on `bar` once every cp.async this thread issued before it has landed, as one of the arrivals the phase
// expects (noinc). sm_90+ only here (the wgmma kernels').
__device__ __forceinline__ void cp_async_arrive(uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
#else
  __trap();
#endif
}
// Hands registers between the warpgroups of a warp-specialised CTA (sm_90a): every warp of a warpgroup executes the
// same one; `decrease` returns registers to the CTA's pool, `increase` waits until it holds enough. kRegisters: per
// thread, a multiple of 8 in 24-256; the launch bounds set what each thread starts with.
template <int kRegisters>
__device__ __forceinline__ void registers_decrease_to() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
#endif
}
template <int kRegisters>
__device__ __forceinline__ void registers_increase_to() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
#endif
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

template <class T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

template <class T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }

template <class T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

}  // namespace smla::cuda
