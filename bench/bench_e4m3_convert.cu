// Issue rate of e4m3 pair -> f16x2 conversions on one SM (docs/performance.md, "The small-heads kernel's
// instructions per chunk"): cvt.rn.f16x2.e4m3x2 (SASS F2FP, SM89+) against the integer form (PRMT with the
// codes' signs replicated, a shift, a LOP3: f16 bits sign << 15 | (code & 0x7f) << 7, the e4m3 value times 2^-8,
// subnormals included) and a LOP3 alone as the integer ALU's reference. Each SM runs 32 warps of 16 independent
// chains, every step feeding the next, so the pipe, not a latency, bounds the rate.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

namespace {

constexpr int kChains = 16, kThreads = 1024, kIters = 4096;

__device__ __forceinline__ uint32_t cvt_e4m3x2(uint32_t x) {
#if __CUDA_ARCH__ >= 890
  uint32_t r;
  asm volatile("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, lo;\n}\n" : "=r"(r) : "r"(x));
  return r;
#else
  return x;  // no such instruction before SM89 (main() skips it)
#endif
}
// Codes in bytes 0 and 2 -> f16x2: byte k, then its sign replicated over the next byte, shifted into place.
__device__ __forceinline__ uint32_t integer_e4m3x2(uint32_t x) {
  uint32_t y;
  asm volatile("prmt.b32 %0, %1, 0, 0xa280;\n" : "=r"(y) : "r"(x));
  return (y << 7) & 0xbf80bf80u;
}
__device__ __forceinline__ uint32_t lop3(uint32_t x) {
  uint32_t r;
  asm volatile("lop3.b32 %0, %1, 0x5a5a5a5a, 0x33, 0x96;\n" : "=r"(r) : "r"(x));
  return r;
}

// kMode 0: cvt; 1: integer form; 2: LOP3; 3: chains alternating cvt and the integer form.
template <int kMode>
__global__ void chains(uint32_t* out, long long* cycles) {
  uint32_t x[kChains];
  for (int i = 0; i < kChains; ++i) x[i] = threadIdx.x * 2654435761u + i * 40503u;
  __syncthreads();
  const long long start = clock64();
  for (int it = 0; it < kIters; ++it)
#pragma unroll
    for (int i = 0; i < kChains; ++i) {
      if constexpr (kMode == 0) x[i] = cvt_e4m3x2(x[i]);
      else if constexpr (kMode == 1) x[i] = integer_e4m3x2(x[i]);
      else if constexpr (kMode == 2) x[i] = lop3(x[i]);
      else x[i] = i % 2 ? cvt_e4m3x2(x[i]) : integer_e4m3x2(x[i]);
    }
  __syncthreads();
  const long long stop = clock64();
  uint32_t sum = 0;
  for (int i = 0; i < kChains; ++i) sum ^= x[i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = sum;  // keeps the chains alive
  if (threadIdx.x == 0) cycles[blockIdx.x] = stop - start;
}

#define CHECK(x)                                                                       \
  do {                                                                                 \
    if (cudaError_t e = (x); e != cudaSuccess) {                                       \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      return 1;                                                                        \
    }                                                                                  \
  } while (0)

}  // namespace

int main() {
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  uint32_t* out;
  long long* cycles;
  CHECK(cudaMalloc(&out, static_cast<size_t>(sms) * kThreads * sizeof(uint32_t)));
  CHECK(cudaMalloc(&cycles, sms * sizeof(long long)));
  const bool has_cvt = prop.major * 10 + prop.minor >= 89;
  void (*kernels[])(uint32_t*, long long*) = {chains<0>, chains<1>, chains<2>, chains<3>};
  const char* names[] = {"cvt.rn.f16x2.e4m3x2", "integer (PRMT, shift, LOP3)", "LOP3 alone", "half cvt, half integer"};
  std::printf("%s, %d SMs: results per clock per SM (a pair of codes, or one LOP3)\n", prop.name, sms);
  for (int mode = 0; mode < 4; ++mode) {
    if ((mode == 0 || mode == 3) && !has_cvt) continue;
    for (int rep = 0; rep < 2; ++rep) kernels[mode]<<<sms, kThreads>>>(out, cycles);  // the first warms up
    CHECK(cudaGetLastError());
    long long slowest = 0;
    for (int s = 0; s < sms; ++s) {
      long long c;
      CHECK(cudaMemcpy(&c, cycles + s, sizeof c, cudaMemcpyDeviceToHost));
      slowest = c > slowest ? c : slowest;
    }
    const double rate = static_cast<double>(kThreads) * kChains * kIters / static_cast<double>(slowest);
    std::printf("%-30s %6.1f\n", names[mode], rate);
  }
  CHECK(cudaFree(out));
  CHECK(cudaFree(cycles));
  return 0;
}
