// GPU benchmark of the cuda_mma backend. Measures its ceilings in the same run
// (device-to-device copy bandwidth, cuBLAS bf16 GEMM rate), then for each
// attention config prints time, TFLOP/s (2*H*K*(576 or 512 + 512) per query
// token), GB/s of cache rows gathered and the fraction of the ceiling that
// bounds it; and for the indexer, the scores' GB/s of index-cache bytes and
// TFLOP/s (2*H_I*128 per position) and the top-k time per row. GLM-5.3-Flash
// (glm53f: rope-free heads of 512, the pooled indexer) and DeepSeek-V4 (dsv4:
// heads of 512 over a window cache and a compressed one, bf16 or the 584-byte
// fp8_ds_mla_v4) have rows of their own.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/common/mma.cuh"
#include "cuda/kernels.h"
#include "smla/error.h"
#include "smla/select.h"

namespace {

#define CHECK(x)                                                                   \
  do {                                                                             \
    cudaError_t e_ = (x);                                                          \
    if (e_ != cudaSuccess) {                                                       \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                \
    }                                                                              \
  } while (0)

// The current device's compute capability major (9: Hopper).
int device_major() {
  int device = 0, major = 0;
  CHECK(cudaGetDevice(&device));
  CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  return major;
}

// Time in ms of one call of fn: calls are queued back to back (no sync between
// them), so a kernel shorter than its host-side launch is not charged for the
// host; median over `trials` runs of `reps` calls, after warm-up.
template <class F>
double time_ms(F&& fn, int reps = 20, int trials = 5) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) fn();
  std::vector<float> ts;
  for (int trial = 0; trial < trials; ++trial) {
    CHECK(cudaEventRecord(a));
    for (int i = 0; i < reps; ++i) fn();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    ts.push_back(ms / reps);
  }
  CHECK(cudaGetLastError());
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  std::nth_element(ts.begin(), ts.begin() + ts.size() / 2, ts.end());
  return ts[ts.size() / 2];
}

// The stream the graph and cold timings run on (non-blocking: nothing of the legacy stream's in between).
cudaStream_t bench_stream() {
  static cudaStream_t s = [] {
    cudaStream_t created;
    CHECK(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking));
    return created;
  }();
  return s;
}

// Microseconds per call of fn(stream) as an engine runs a decode step: `reps` calls captured into one CUDA graph,
// replayed back to back (no host work per call); median of `trials` replays after a warm-up call (which makes the
// op's default workspace: capture cannot allocate) and a warm-up replay.
template <class F>
double graph_us(F&& fn, int reps = 20, int trials = 5) {
  const cudaStream_t s = bench_stream();
  fn(s);
  CHECK(cudaStreamSynchronize(s));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < reps; ++i) fn(s);
  CHECK(cudaStreamEndCapture(s, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  CHECK(cudaGraphLaunch(exec, s));
  std::vector<float> ts;
  for (int trial = 0; trial < trials; ++trial) {
    CHECK(cudaEventRecord(a, s));
    CHECK(cudaGraphLaunch(exec, s));
    CHECK(cudaEventRecord(b, s));
    CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    ts.push_back(1e3f * ms / reps);
  }
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  std::nth_element(ts.begin(), ts.begin() + ts.size() / 2, ts.end());
  return ts[ts.size() / 2];
}

// Microseconds of one call of fn(stream) alone, the GPU idle before it: from an event queued before the call to
// one after it, so the host's enqueueing counts; median of `trials` calls after a warm-up.
template <class F>
double cold_us(F&& fn, int trials = 21) {
  const cudaStream_t s = bench_stream();
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  fn(s);
  std::vector<float> ts;
  for (int trial = 0; trial < trials; ++trial) {
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaEventRecord(a, s));
    fn(s);
    CHECK(cudaEventRecord(b, s));
    CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    ts.push_back(1e3f * ms);
  }
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  std::nth_element(ts.begin(), ts.begin() + ts.size() / 2, ts.end());
  return ts[ts.size() / 2];
}

// Microseconds per call of fn(stream) that finds none of its data in L2, as each layer's step in a model does (every
// layer reads its own caches; replayed back to back, one layer's index keys and rows stay in L2): a CUDA graph of
// [a write of twice the L2, the call] replayed as graph_us does, less the same graph of the writes alone.
template <class F>
double l2_cold_graph_us(F&& fn) {
  static const size_t junk_bytes = [] {
    int dev = 0, l2 = 0;
    CHECK(cudaGetDevice(&dev));
    CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
    return 2 * static_cast<size_t>(l2);
  }();
  static void* junk = [] {
    void* p;
    CHECK(cudaMalloc(&p, junk_bytes));
    return p;
  }();
  const auto flush = [](cudaStream_t s) { CHECK(cudaMemsetAsync(junk, 0x5a, junk_bytes, s)); };
  return graph_us([&](cudaStream_t s) {
    flush(s);
    fn(s);
  }) - graph_us(flush);
}

double copy_bandwidth_gbs() {
  const size_t bytes = size_t{2} << 30;
  void *src, *dst;
  CHECK(cudaMalloc(&src, bytes));
  CHECK(cudaMalloc(&dst, bytes));
  CHECK(cudaMemset(src, 1, bytes));
  const double ms = time_ms([&] { CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice)); }, 10);
  CHECK(cudaFree(src));
  CHECK(cudaFree(dst));
  return 2.0 * bytes / (ms * 1e-3) / 1e9;  // read + written
}

// The benchmark's random data is drawn on the device from a counter-based hash (splitmix64's finaliser) of a seed
// and an element's index: a host generator took ~10 s of each bench_cuda invocation for a 1M-row cache and the GEMM's
// operands.
__device__ __forceinline__ uint64_t hash64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// n bf16 values uniform in [-1, 1).
__global__ void fill_uniform_bf16(__nv_bfloat16* x, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n; i += static_cast<size_t>(gridDim.x) * blockDim.x)
    x[i] = __float2bfloat16(static_cast<float>(hash64(seed << 40 ^ i) >> 40) * 0x1p-23f - 1.f);
}

double gemm_tflops() {
  const int n = 8192;
  const size_t elems = static_cast<size_t>(n) * n;
  __nv_bfloat16 *a, *b, *c;
  CHECK(cudaMalloc(&a, elems * 2));
  CHECK(cudaMalloc(&b, elems * 2));
  CHECK(cudaMalloc(&c, elems * 2));
  fill_uniform_bf16<<<1024, 256>>>(a, elems, 1);
  fill_uniform_bf16<<<1024, 256>>>(b, elems, 2);
  CHECK(cudaGetLastError());
  cublasHandle_t handle;
  cublasCreate(&handle);
  const float one = 1, zero = 0;
  const double ms = time_ms([&] {
    cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, a, CUDA_R_16BF, n, b, CUDA_R_16BF, n, &zero, c,
                 CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  }, 10);
  cublasDestroy(handle);
  CHECK(cudaFree(a));
  CHECK(cudaFree(b));
  CHECK(cudaFree(c));
  return 2.0 * n * n * n / (ms * 1e-3) / 1e12;
}

// The mma.sync ceiling (issue 19's yardstick for the mma.sync kernel family): bf16 m16n8k16 with fp32
// accumulators on registers only, kPeakChains independent accumulators per warp so the tensor pipe never waits
// on a result; each thread's sums are stored so nothing is optimised away.
constexpr int kPeakChains = 8, kPeakWarps = 8, kPeakIters = 4096;
__global__ void __launch_bounds__(kPeakWarps * 32) mma_peak_kernel(float* sums) {
  uint32_t a[4], b[2];
  for (int i = 0; i < 4; ++i) a[i] = 0x3f803f80u ^ ((threadIdx.x * 2654435761u >> (8 * i)) & 0x007f007fu);  // ~1
  b[0] = a[1] ^ 0x00010001u;
  b[1] = a[2] ^ 0x00020002u;
  float d[kPeakChains][4] = {};
  for (int it = 0; it < kPeakIters; ++it)
#pragma unroll
    for (int c = 0; c < kPeakChains; ++c) smla::cuda::mma_16816<__nv_bfloat16>(d[c], a, b);
  float sum = 0;
  for (int c = 0; c < kPeakChains; ++c) sum += d[c][0] + d[c][1] + d[c][2] + d[c][3];
  sums[blockIdx.x * blockDim.x + threadIdx.x] = sum;
}

double mma_sync_tflops() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int ctas = 4 * sms;  // 32 warps per SM
  float* sums;
  CHECK(cudaMalloc(&sums, sizeof(float) * ctas * kPeakWarps * 32));
  const double ms = time_ms([&] { mma_peak_kernel<<<ctas, kPeakWarps * 32>>>(sums); }, 10);
  CHECK(cudaGetLastError());
  CHECK(cudaFree(sums));
  const double mmas = double(ctas) * kPeakWarps * kPeakIters * kPeakChains;
  return mmas * 2 * 16 * 8 * 16 / (ms * 1e-3) / 1e12;
}

struct Ceilings {
  double copy_gbs, gemm_tflops, mma_tflops;
};

// Row r of a cache of format d, one thread a row: bf16 values of modest magnitude with random signs; fp8 rows random
// codes < 0x70 with random signs and scale 2^-4 (fp8_ds_mla_v4: per block, MlaV4CacheLayout), the rope part
// positive bf16 values.
__global__ void fill_cache_rows(uint8_t* data, int64_t n, smla::DType d, int qk_dim, int row_stride,
                                int64_t block_stride, int block_size) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (r >= n) return;
  auto random = [&](int i) { return hash64(static_cast<uint64_t>(r) << 12 ^ static_cast<uint64_t>(i)); };
  auto code = [](uint64_t h) { return static_cast<uint8_t>((h % 0x70) | ((h >> 32) & 0x80)); };
  auto rope = [](uint64_t h) { return static_cast<uint16_t>(0x3c00 + h % 256); };
  if (d == smla::DType::fp8_ds_mla_v4) {
    using V4 = smla::MlaV4CacheLayout;
    uint8_t* block = data + (r / block_size) * block_stride;
    uint8_t* values = block + (r % block_size) * V4::kValueBytes;  // V4::value_offset, a host function
    for (int i = 0; i < V4::kNopeDim; ++i) values[i] = code(random(i));
    for (int i = 0; i < V4::kRopeDim; ++i) reinterpret_cast<uint16_t*>(values + V4::kNopeDim)[i] = rope(random(1024 + i));
    uint8_t* scales = block + static_cast<int64_t>(block_size) * V4::kValueBytes + (r % block_size) * V4::kScaleBytes;
    for (int i = 0; i < V4::kScaleBytes; ++i) scales[i] = 127 - 4;
    return;
  }
  uint8_t* row = data + (r / block_size) * block_stride + (r % block_size) * row_stride;
  if (d == smla::DType::bf16) {
    for (int i = 0; i < qk_dim; ++i) {
      const uint64_t h = random(i);
      reinterpret_cast<uint16_t*>(row)[i] = rope(h) | static_cast<uint16_t>(((h >> 32) & 1) << 15);
    }
    return;
  }
  // either fp8 form (the envelope's rope part is unused with a rope-free head)
  for (int i = 0; i < 512; ++i) row[i] = code(random(i));
  for (int i = 0; i < 4; ++i) reinterpret_cast<float*>(row + 512)[i] = 0.0625f;
  if (d == smla::DType::fp8_ds_mla)
    for (int i = 0; i < 64; ++i) reinterpret_cast<uint16_t*>(row + 528)[i] = rope(random(1024 + i));
}

// One cache of `slots` rows in blocks of `block_size` shared by every config (random bf16 or fp8 rows) for heads of
// `head`'s width.
struct Cache {
  smla::DType dtype;
  int64_t slots;
  smla::MlaHead head;
  int block_size;
  void* data = nullptr;
  Cache(smla::DType d, int64_t n, smla::MlaHead mla_head = {}, int block = 64)
      : dtype(d), slots(n), head(mla_head), block_size(block) {
    const size_t bytes = static_cast<size_t>(n / block_size) * block_stride_bytes();
    CHECK(cudaMalloc(&data, bytes));
    CHECK(cudaMemset(data, 0, bytes));
    fill_cache_rows<<<(n + 255) / 256, 256>>>(static_cast<uint8_t*>(data), n, d, head.qk_dim(), row_stride_bytes(),
                                              block_stride_bytes(), block_size);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
  }
  ~Cache() { cudaFree(data); }
  // Bytes a row and a block take in memory (fp8_ds_mla_v4's blocks padded as FlashMLA pads them, to a multiple of
  // 576), and the bytes of a row the kernels read.
  int row_stride_bytes() const {
    return static_cast<int>(head.cache_row(dtype) * (dtype == smla::DType::bf16 ? 2 : 1));
  }
  int64_t block_stride_bytes() const {
    const int64_t bytes = static_cast<int64_t>(block_size) * row_stride_bytes();
    return dtype == smla::DType::fp8_ds_mla_v4 ? (bytes + 575) / 576 * 576 : bytes;
  }
  int row_bytes() const { return static_cast<int>(head.row_bytes_read(dtype)); }
  smla::TensorView view() const {
    const int64_t elem = dtype == smla::DType::bf16 ? 2 : 1;
    return smla::TensorView(data, {slots / block_size, block_size, head.cache_row(dtype)},
                            {block_stride_bytes() / elem, head.cache_row(dtype), 1}, dtype, smla::Device::cuda(90));
  }
};

// `n` sparse indices drawn uniformly from [0, range) by `rng`, on the device (cudaFree them).
int32_t* device_random_indices(std::mt19937_64& rng, size_t n, int64_t range) {
  std::vector<int32_t> idx(n);
  for (auto& i : idx) i = static_cast<int32_t>(rng() % range);
  int32_t* d;
  CHECK(cudaMalloc(&d, n * 4));
  CHECK(cudaMemcpy(d, idx.data(), n * 4, cudaMemcpyHostToDevice));
  return d;
}

void* device_random_half(size_t n) {
  std::vector<uint16_t> h(n);
  std::mt19937 rng(3);
  for (auto& x : h) x = (0x3800 + (rng() % 512)) | ((rng() & 1) << 15);
  void* d;
  CHECK(cudaMalloc(&d, n * 2));
  CHECK(cudaMemcpy(d, h.data(), n * 2, cudaMemcpyHostToDevice));
  return d;
}

// One attention row of the table, kept for --json.
struct AttentionRow {
  std::string config, cache, kernel;
  int tokens, heads, keys;
  double us, tflops, gbs, copy_frac, gemm_frac;
  double graph_us;  // < 0: not timed from a graph
};
std::vector<AttentionRow> attention_rows;

using smla::cuda::AttentionChoice;
using smla::cuda::AttentionKernel;

// "small/s3/h8/d2": the small-heads kernel forced to 3 stages, 8 heads per CTA, output dims split in 2; "/k8": the
// keys split 8 ways; "/pieces", "/bulk": its rows copied so.
std::string kernel_name(AttentionChoice k) {
  std::string n = k.kernel == AttentionKernel::automatic   ? "auto"
                  : k.kernel == AttentionKernel::head_tile ? "head-tile"
                  : k.kernel == AttentionKernel::wide_tile ? "wide"
                  : k.kernel == AttentionKernel::wgmma     ? "wgmma"
                                                           : "small";
  if (k.stages > 0) n += "/s" + std::to_string(k.stages);
  if (k.heads_per_cta > 0) n += "/h" + std::to_string(k.heads_per_cta);
  if (k.split_dims > 0) n += "/d" + std::to_string(k.split_dims);
  if (k.splits > 0) n += "/k" + std::to_string(k.splits);
  if (k.copy != smla::cuda::RowCopy::automatic) n += k.copy == smla::cuda::RowCopy::bulk ? "/bulk" : "/pieces";
  return n;
}

// `graph_us`: the same call replayed from a CUDA graph (latency rows, whose back-to-back calls wait on the host), or
// < 0 where not timed so; printed after the row, which stays the back-to-back time.
void report(const char* name, const char* kv, const std::string& kernel, int tokens, int heads, int keys, int qk_dim,
            double ms, double bytes, const Ceilings& c, double graph_us = -1) {
  const double tflops = 2.0 * heads * keys * (qk_dim + 512.0) * tokens / (ms * 1e-3) / 1e12;
  const double gbs = bytes / (ms * 1e-3) / 1e9;
  const double mem_frac = gbs / c.copy_gbs, compute_frac = tflops / c.gemm_tflops;
  std::printf("%-22s %-13s %-10s %6d %5d %6d %10.1f %9.1f %8.1f %6.0f%% %s", name, kv, kernel.c_str(), tokens,
              heads, keys, ms * 1e3, tflops, gbs, 100 * std::max(mem_frac, compute_frac),
              mem_frac >= compute_frac ? "memory" : "compute");
  if (graph_us >= 0) std::printf("  graph %.1f us", graph_us);
  std::printf("\n");
  attention_rows.push_back(
      {name, kv, kernel, tokens, heads, keys, ms * 1e3, tflops, gbs, mem_frac, compute_frac, graph_us});
}

// The op's own choices: the benchmarks call the public op then, else the CUDA function with the choice forced.
bool is_automatic(AttentionChoice k) {
  return k.kernel == AttentionKernel::automatic && k.stages == 0 && k.heads_per_cta == 0 && k.split_dims == 0 &&
         k.splits == 0 && k.copy == smla::cuda::RowCopy::automatic;
}

// Times `call` (the op as the backend runs it, or its CUDA function with a forced kernel); a forced kernel
// the device cannot run prints why instead.
template <class Call>
bool timed(AttentionChoice kernel, Call&& call, double& ms) {
  try {
    ms = time_ms(call);
    return true;
  } catch (const smla::Error& e) {
    std::printf("  (%s: %s)\n", kernel_name(kernel).c_str(), e.what());
    return false;
  }
}

// A second cache for sparse attention (DeepSeek-V4's compressed cache beside its window cache) and its top-k.
struct ExtraCache {
  const Cache* cache = nullptr;
  int topk = 0;
};

// Rows of at most this many tokens are latency rows: timed from a CUDA graph too.
constexpr int kLatencyTokens = 8;

// Sparse attention: each token's `topk` indices drawn from the first `context` slots (0: the whole cache,
// so the gathers miss L2; a prefill's 32K context is shared by its tokens); with `extra`, also `extra.topk` indices
// into its whole cache, under one softmax (keys and bytes count both lists).
void bench_sparse(const char* name, Cache& cache, int tokens, int heads, int topk, const Ceilings& c,
                  AttentionChoice kernel = {}, int64_t context = 0, ExtraCache extra = {}) {
  const smla::Backend& be = *smla::Registry::global().find("cuda_mma");
  const smla::Device dev = smla::Device::cuda(90);
  std::mt19937_64 rng(tokens * 131 + heads);
  int32_t* didx = device_random_indices(rng, static_cast<size_t>(tokens) * topk, context > 0 ? context : cache.slots);
  int32_t* dextra =
      extra.cache ? device_random_indices(rng, static_cast<size_t>(tokens) * extra.topk, extra.cache->slots) : nullptr;
  const int qk = cache.head.qk_dim();
  void* q = device_random_half(static_cast<size_t>(tokens) * heads * qk);
  void *out, *lse;
  CHECK(cudaMalloc(&out, static_cast<size_t>(tokens) * heads * 512 * 2));
  CHECK(cudaMalloc(&lse, static_cast<size_t>(tokens) * heads * 4));
  smla::SparseMlaArgs a;
  a.q = smla::TensorView(q, {tokens, heads, qk}, smla::DType::bf16, dev);
  a.kv_cache = cache.view();
  a.indices = smla::TensorView(didx, {tokens, topk}, smla::DType::i32, dev);
  if (extra.cache) {
    a.extra_kv_cache = extra.cache->view();
    a.extra_indices = smla::TensorView(dextra, {tokens, extra.topk}, smla::DType::i32, dev);
  }
  a.softmax_scale = 0.0625f;
  a.out = smla::TensorView(out, {tokens, heads, 512}, smla::DType::bf16, dev);
  a.lse = smla::TensorView(lse, {tokens, heads}, smla::DType::f32, dev);
  double ms = 0;
  const auto call = [&] {
    if (is_automatic(kernel)) smla::sparse_mla(a, &be);
    else smla::cuda::sparse_mla(a, kernel);
  };
  const bool ran = timed(kernel, call, ms);
  // A few tokens' calls queued back to back wait on the host's enqueueing (docs/performance.md, "Host time per
  // call"): those rows are also timed as an engine runs them, from a graph.
  const double graph = ran && tokens <= kLatencyTokens ? graph_us([&](cudaStream_t s) {
    a.stream = s;
    call();
  }) : -1;
  if (ran)
    report(name, std::string(smla::dtype_name(cache.dtype)).c_str(), kernel_name(kernel), tokens, heads,
           topk + extra.topk, qk, ms,
           static_cast<double>(tokens) *
               (static_cast<double>(topk) * cache.row_bytes() +
                (extra.cache ? static_cast<double>(extra.topk) * extra.cache->row_bytes() : 0.0)),
           c, graph);
  cudaFree(didx);
  cudaFree(dextra);
  cudaFree(q);
  cudaFree(out);
  cudaFree(lse);
}

// The gather ceiling: the rows a sparse call reads (the same cache, indices drawn as bench_sparse draws them), read
// by plain 16-byte loads with nothing else to do, 64 rows a CTA, every row's pieces spread over the CTA's threads
// and four loads in flight a thread. What random whole rows of this size can give at most, next to the copy
// bandwidth (sequential) the goals are stated against.
constexpr int kGatherRows = 64, kGatherThreads = 256;
__global__ void __launch_bounds__(kGatherThreads) gather_kernel(const uint8_t* cache, const int32_t* indices,
                                                               int row_stride, int pieces, unsigned* sink) {
  __shared__ int64_t offsets[kGatherRows];
  if (threadIdx.x < kGatherRows)
    offsets[threadIdx.x] = int64_t{indices[int64_t{blockIdx.x} * kGatherRows + threadIdx.x]} * row_stride;
  __syncthreads();
  uint4 acc{0, 0, 0, 0};
#pragma unroll 4
  for (int p = threadIdx.x; p < kGatherRows * pieces; p += kGatherThreads) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(cache + offsets[p / pieces]) + p % pieces);
    acc.x ^= v.x, acc.y ^= v.y, acc.z ^= v.z, acc.w ^= v.w;
  }
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x9e3779b9u) *sink = acc.x;  // keeps the loads; practically never taken
}

// The same rows through a pipeline like the small-heads kernel's, with no attention: one CTA per token and key split,
// its warps copying `rows`-row chunks into `kStages` shared-memory stages, then `spin` clock cycles a chunk standing
// in for the chunk's attention. With `spin` 0 it is what that pipeline shape and residency (`smem` bytes a CTA) can
// move at most; the kernel's time against it says how much its own work costs. How a chunk is copied and waited for:
//  - cta: the kernel's way today. Each row's 16-byte pieces by cp.async across a warp's lanes, rows interleaved over
//    the warps, then one CTA barrier a chunk (every warp waits for the chunk's slowest row);
//  - warp: the same copies, but each warp copies the rows it will read itself and waits only for them (no barrier
//    across warps);
//  - bulk: each warp's rows one bulk copy a row (cp.async.bulk, sm_90+) onto the warp's mbarrier of the stage.
enum class PipeSync { cta, warp, bulk };
template <int kStages, PipeSync kSync>
__global__ void pipelined_gather_kernel(const uint8_t* cache, const int32_t* indices, int topk, int row_stride,
                                        int row_bytes, int rows, int splits, int spin, unsigned* sink) {
  extern __shared__ __align__(16) uint8_t stages[];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int rows_per_warp = rows / warps, stage_bytes = rows * row_bytes, pieces = row_bytes / 16;
  const int chunks = topk / rows / splits;
  const int32_t* idx = indices + int64_t{blockIdx.x / splits} * topk + int64_t{blockIdx.x % splits} * chunks * rows;
  uint64_t* bars = reinterpret_cast<uint64_t*>(stages + kStages * stage_bytes) + warp * kStages;  // bulk: [stage]
  auto row_of = [&](int k) { return kSync == PipeSync::cta ? warp + warps * k : warp * rows_per_warp + k; };
  auto row_offset = [&](int i) -> int64_t {
    if (i >= chunks || lane >= rows_per_warp) return 0;
    return int64_t{__ldg(idx + i * rows + row_of(lane))} * row_stride;
  };
  if constexpr (kSync == PipeSync::bulk) {
    if (lane == 0)
      for (int st = 0; st < kStages; ++st) smla::cuda::mbarrier_init(&bars[st], 1);
    smla::cuda::fence_mbarrier_init();
    __syncwarp();
  }
  int64_t next = row_offset(0);
  auto issue = [&](int i) {
    uint8_t* stage = stages + (i % kStages) * stage_bytes;
    const int64_t mine = next;
    if (i < chunks) next = row_offset(i + 1);
    if constexpr (kSync == PipeSync::bulk) {
      if (i >= chunks) return;
      smla::cuda::fence_shared_for_async_proxy();  // this warp's reads of the stage's last chunk come first
      if (lane == 0) smla::cuda::mbarrier_expect_bytes(&bars[i % kStages], rows_per_warp * row_bytes);
      __syncwarp();
      if (lane < rows_per_warp)
        smla::cuda::bulk_copy_to_shared(stage + row_of(lane) * row_bytes, cache + mine, row_bytes,
                                        &bars[i % kStages]);
    } else {
      if (i < chunks)
        for (int k = 0; k < rows_per_warp; ++k) {
          const int64_t offset = __shfl_sync(0xffffffffu, mine, k);
          for (int pc = lane; pc < pieces; pc += 32)
            smla::cuda::cp_async_16(stage + row_of(k) * row_bytes + pc * 16, cache + offset + pc * 16, true);
        }
      smla::cuda::cp_async_commit();
    }
  };
  for (int i = 0; i < kStages - 1; ++i) issue(i);
  unsigned acc = 0;
  for (int i = 0; i < chunks; ++i) {
    if constexpr (kSync == PipeSync::bulk) {
      smla::cuda::mbarrier_wait(&bars[i % kStages], (i / kStages) & 1);
    } else {
      smla::cuda::cp_async_wait<kStages - 2>();
      if constexpr (kSync == PipeSync::cta) __syncthreads();  // chunk i landed; chunk i - 1's stage is free
      else __syncwarp();
    }
    // A word of one of the rows this thread's warp reads (all of them: cta), before its stage is refilled.
    acc ^= reinterpret_cast<const unsigned*>(stages + (i % kStages) * stage_bytes +
                                             row_of(lane % rows_per_warp) * row_bytes)[lane / rows_per_warp];
    __syncwarp();
    issue(i + kStages - 1);
    for (const long long t0 = clock64(); clock64() - t0 < spin;) {
    }
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

// How the gather ceiling is read: plain loads (stages 0), or the pipeline above with `stages` (2, 3, 4, 6 or 8),
// `threads` a CTA, `rows` a chunk, `splits` CTAs a token, `spin` cycles a chunk, at least `smem` bytes of shared
// memory a CTA, and a chunk copied and waited for as `sync` says.
struct GatherPipeline {
  int stages = 0, threads = 128, splits = 2, spin = 0, smem = 0, rows = kGatherRows;
  PipeSync sync = PipeSync::cta;
};

template <PipeSync kSync>
auto pipelined_gather(int stages) {
  return stages == 2   ? pipelined_gather_kernel<2, kSync>
         : stages == 3 ? pipelined_gather_kernel<3, kSync>
         : stages == 4 ? pipelined_gather_kernel<4, kSync>
         : stages == 6 ? pipelined_gather_kernel<6, kSync>
                       : pipelined_gather_kernel<8, kSync>;
}

void bench_gather(const char* name, Cache& cache, int tokens, int topk, const Ceilings& c, GatherPipeline pipe = {}) {
  std::mt19937_64 rng(tokens * 131 + 8);  // bench_sparse's draw for 8 heads
  int32_t* didx = device_random_indices(rng, static_cast<size_t>(tokens) * topk, cache.slots);
  unsigned* sink;
  CHECK(cudaMalloc(&sink, 4));
  const auto* rows = static_cast<const uint8_t*>(cache.data);
  const int pieces = cache.row_bytes() / 16;
  std::string kernel = "gather";
  double ms = 0;
  if (pipe.stages == 0) {
    const int ctas = tokens * topk / kGatherRows;
    ms = time_ms([&] { gather_kernel<<<ctas, kGatherThreads>>>(rows, didx, cache.row_stride_bytes(), pieces, sink); });
  } else {
    auto* fn = pipe.sync == PipeSync::cta    ? pipelined_gather<PipeSync::cta>(pipe.stages)
               : pipe.sync == PipeSync::warp ? pipelined_gather<PipeSync::warp>(pipe.stages)
                                             : pipelined_gather<PipeSync::bulk>(pipe.stages);
    const int smem = std::max(pipe.smem, pipe.stages * (pipe.rows * pieces * 16 + pipe.threads / 32 * 8));
    CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    int resident = 0;
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, fn, pipe.threads, smem));
    ms = time_ms([&] {
      fn<<<tokens * pipe.splits, pipe.threads, smem>>>(rows, didx, topk, cache.row_stride_bytes(), pieces * 16,
                                                       pipe.rows, pipe.splits, pipe.spin, sink);
    });
    static const char* const kSyncNames[] = {"cta", "warp", "bulk"};
    kernel = std::string("pipe/") + kSyncNames[static_cast<int>(pipe.sync)] + "/s" + std::to_string(pipe.stages) +
             "/r" + std::to_string(pipe.rows) + "/t" + std::to_string(pipe.threads) + "/k" +
             std::to_string(pipe.splits) + "/c" + std::to_string(resident) + "/w" + std::to_string(pipe.spin);
  }
  CHECK(cudaGetLastError());
  report(name, std::string(smla::dtype_name(cache.dtype)).c_str(), kernel, tokens, 0, topk, 0, ms,
         static_cast<double>(tokens) * topk * cache.row_bytes(), c);
  cudaFree(didx);
  cudaFree(sink);
}

void bench_paged(const char* name, Cache& cache, int batch, int context, int heads, const Ceilings& c,
                 AttentionChoice kernel = {}) {
  const smla::Backend& be = *smla::Registry::global().find("cuda_mma");
  const int max_blocks = context / cache.block_size;
  std::vector<int32_t> table(static_cast<size_t>(batch) * max_blocks), seq(batch, context);
  const int64_t blocks = cache.slots / cache.block_size;
  std::mt19937_64 rng(7);
  for (auto& t : table) t = static_cast<int32_t>(rng() % blocks);
  int32_t *dtable, *dseq;
  CHECK(cudaMalloc(&dtable, table.size() * 4));
  CHECK(cudaMalloc(&dseq, seq.size() * 4));
  CHECK(cudaMemcpy(dtable, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dseq, seq.data(), seq.size() * 4, cudaMemcpyHostToDevice));
  void* q = device_random_half(static_cast<size_t>(batch) * heads * 576);
  void *out, *lse;
  CHECK(cudaMalloc(&out, static_cast<size_t>(batch) * heads * 512 * 2));
  CHECK(cudaMalloc(&lse, static_cast<size_t>(batch) * heads * 4));
  const smla::Device dev = smla::Device::cuda(90);
  smla::PagedMlaDecodeArgs a;
  a.q = smla::TensorView(q, {batch, 1, heads, 576}, smla::DType::bf16, dev);
  a.kv_cache = cache.view();
  a.block_table = smla::TensorView(dtable, {batch, max_blocks}, smla::DType::i32, dev);
  a.seq_lens = smla::TensorView(dseq, {batch}, smla::DType::i32, dev);
  a.softmax_scale = 0.1352f;
  a.out = smla::TensorView(out, {batch, 1, heads, 512}, smla::DType::bf16, dev);
  a.lse = smla::TensorView(lse, {batch, 1, heads}, smla::DType::f32, dev);
  double ms = 0;
  const bool ran = timed(kernel, [&] {
    if (is_automatic(kernel)) smla::paged_mla_decode(a, &be);
    else smla::cuda::paged_mla_decode(a, kernel);
  }, ms);
  if (ran)
    report(name, std::string(smla::dtype_name(cache.dtype)).c_str(), kernel_name(kernel), batch, heads, context,
           576, ms,
           static_cast<double>(batch) * context * cache.row_bytes(), c);
  cudaFree(dtable);
  cudaFree(dseq);
  cudaFree(q);
  cudaFree(out);
  cudaFree(lse);
}

// One indexer config: decode (`tokens` requests, each with `context`
// positions of its own) or prefill (`tokens` new positions of one request,
// causal: the last sees `context`); fp8 or bf16 keys; fp8 queries with
// per-(token, head) scales (what DeepSeek-V3.2's indexer feeds its kernel)
// or bf16 ones; how the scores kernel multiplies, as it picks or forced.
// A pooled indexer (GLM-5.3-Flash, 4 tokens a key) is the same op over `context` pools, 16 a block of 64 tokens,
// selecting top-k / 4 pools.
struct IndexerConfig {
  const char* name;
  int tokens, heads, context;
  bool fp8_keys = true, fp8_queries = false, prefill = false;
  smla::cuda::ScoreMma mma = smla::cuda::ScoreMma::automatic;
  int topk = 2048, block_rows = 64;
};

// Blocks of `block_rows` positions scattered through the cache.
void bench_indexer(const IndexerConfig& cfg, const Ceilings& c) {
  const smla::Device dev = smla::Device::cuda(90);
  const int tokens = cfg.tokens, heads = cfg.heads, context = cfg.context;
  const bool fp8 = cfg.fp8_keys, prefill = cfg.prefill;
  const int bs = cfg.block_rows, blocks_per_req = context / bs, requests = prefill ? 1 : tokens, row = fp8 ? 132 : 256;
  const int64_t blocks = static_cast<int64_t>(requests) * blocks_per_req;
  const size_t cache_bytes = static_cast<size_t>(blocks) * bs * row;
  std::vector<uint8_t> h(static_cast<size_t>(bs) * row);
  std::mt19937 rng(5);
  if (fp8) {
    for (int i = 0; i < bs * 128; ++i) h[i] = static_cast<uint8_t>(rng() % 0x70) | (rng() & 0x80);
    for (int i = 0; i < bs; ++i) reinterpret_cast<float*>(h.data() + bs * 128)[i] = 1.f / 64;
  } else {
    for (size_t i = 0; i < h.size() / 2; ++i)
      reinterpret_cast<uint16_t*>(h.data())[i] = static_cast<uint16_t>(0x3c00 + rng() % 0x200) | ((rng() & 1) << 15);
  }
  uint8_t* cache;
  CHECK(cudaMalloc(&cache, cache_bytes));
  // The same random block everywhere (by doubling copies): the scores' time does not depend on the values.
  CHECK(cudaMemcpy(cache, h.data(), h.size(), cudaMemcpyHostToDevice));
  for (size_t done = h.size(); done < cache_bytes; done *= 2)
    CHECK(cudaMemcpy(cache + done, cache, std::min(done, cache_bytes - done), cudaMemcpyDeviceToDevice));
  std::vector<int32_t> table(blocks), req(tokens), ctx(tokens, context);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);
  double positions = 0;  // (token, visible position) pairs scored
  for (int t = 0; t < tokens; ++t) {
    req[t] = prefill ? 0 : t;
    if (prefill) ctx[t] = context - tokens + t + 1;
    positions += ctx[t];
  }
  std::vector<float> w(static_cast<size_t>(tokens) * heads), q_scale(w.size());
  for (auto& x : w) x = 0.01f + (rng() % 100) * 1e-4f;
  for (auto& x : q_scale) x = 1.f / (16 + rng() % 16);
  int32_t *dtable, *dreq, *dctx, *dout;
  float *dw, *dq_scale;
  const int topk = cfg.topk;
  CHECK(cudaMalloc(&dtable, table.size() * 4));
  CHECK(cudaMalloc(&dreq, req.size() * 4));
  CHECK(cudaMalloc(&dctx, ctx.size() * 4));
  CHECK(cudaMalloc(&dout, static_cast<size_t>(tokens) * topk * 4));
  CHECK(cudaMalloc(&dw, w.size() * 4));
  CHECK(cudaMalloc(&dq_scale, q_scale.size() * 4));
  CHECK(cudaMemcpy(dtable, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dreq, req.data(), req.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dctx, ctx.data(), ctx.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dw, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dq_scale, q_scale.data(), q_scale.size() * 4, cudaMemcpyHostToDevice));
  const size_t q_values = static_cast<size_t>(tokens) * heads * 128;
  void* q;
  if (cfg.fp8_queries) {
    std::vector<uint8_t> codes(q_values);
    for (auto& x : codes) x = static_cast<uint8_t>(rng() % 0x70) | (rng() & 0x80);
    CHECK(cudaMalloc(&q, q_values));
    CHECK(cudaMemcpy(q, codes.data(), q_values, cudaMemcpyHostToDevice));
  } else {
    q = device_random_half(q_values);
  }
  smla::IndexerTopkArgs a;
  a.q = smla::TensorView(q, {tokens, heads, 128}, cfg.fp8_queries ? smla::DType::fp8_e4m3 : smla::DType::bf16, dev);
  if (cfg.fp8_queries) a.q_scale = smla::TensorView(dq_scale, {tokens, heads}, smla::DType::f32, dev);
  a.weights = smla::TensorView(dw, {tokens, heads}, smla::DType::f32, dev);
  a.index_cache = smla::TensorView(cache, {blocks, bs, fp8 ? 132 : 128}, fp8 ? smla::DType::fp8_e4m3 : smla::DType::bf16, dev);
  a.request_ids = smla::TensorView(dreq, {tokens}, smla::DType::i32, dev);
  a.block_table = smla::TensorView(dtable, {requests, blocks_per_req}, smla::DType::i32, dev);
  a.context_lens = smla::TensorView(dctx, {tokens}, smla::DType::i32, dev);
  a.topk = smla::TensorView(dout, {tokens, topk}, smla::DType::i32, dev);
  const size_t score_floats = static_cast<size_t>(tokens) * smla::cuda::score_row_stride(a);
  float* scores;
  CHECK(cudaMalloc(&scores, score_floats * 4));
  const double ms_scores = time_ms([&] { smla::cuda::indexer_scores(a, scores, cfg.mma); });
  // Distinct scores for the top-k timing: random values, not the tied ones above.
  std::vector<float> hs(score_floats);
  for (auto& x : hs) x = static_cast<float>(rng()) / 4e9f;
  CHECK(cudaMemcpy(scores, hs.data(), hs.size() * 4, cudaMemcpyHostToDevice));
  const double ms_topk = time_ms([&] { smla::cuda::select_topk(a, scores); });
  // Decode reads every visible key once per token; a prefill's tokens share one request's keys.
  const double bytes = (prefill ? static_cast<double>(context) : positions) * row;
  const double gbs = bytes / (ms_scores * 1e-3) / 1e9;
  const double tflops = 2.0 * heads * 128 * positions / (ms_scores * 1e-3) / 1e12;
  std::printf("%-16s %-5s %-5s %6d %5d %7d %10.1f %8.1f %6.0f%% %8.1f %12.1f %12.2f\n", cfg.name, fp8 ? "fp8" : "bf16",
              cfg.fp8_queries ? "fp8" : "bf16", tokens, heads, context, ms_scores * 1e3, gbs, 100 * gbs / c.copy_gbs,
              tflops, ms_topk * 1e3, ms_topk * 1e3 / tokens);
  cudaFree(cache);
  cudaFree(dtable);
  cudaFree(dreq);
  cudaFree(dctx);
  cudaFree(dout);
  cudaFree(dw);
  cudaFree(dq_scale);
  cudaFree(q);
  cudaFree(scores);
}

// The top-k stage alone on distinct random scores, `tokens` rows of `context`
// positions: one CTA per row, rows split into slices, rows shared by a
// cluster's CTAs ("-" below SM90), and as select_topk decides (calls queued
// back to back, and replayed from a CUDA graph; also unsorted, the positions
// in position order, replayed from a graph); and by clusters of 16 CTAs
// (non-portable, Hopper; "-" elsewhere), queued and replayed from a graph; one CTA per row never holding it in
// registers (TopkSplit::one_cta_streamed: what the held rows save), replayed from a graph, sorted and unsorted.
struct TopkRow {
  int tokens, context;
  double unsplit_us, split_us, cluster_us, picked_us, graph_us, unsorted_graph_us;  // cluster -1: no clusters
  double cluster16_us, cluster16_graph_us;                                          // -1: no clusters of 16
  double streamed_graph_us, streamed_unsorted_graph_us;
};
std::vector<TopkRow> topk_rows;

void bench_topk(int tokens, int context) {
  const int topk = 2048;
  const smla::Device dev = smla::Device::cuda(90);
  std::vector<int32_t> req(tokens), ctx(tokens, context);
  std::iota(req.begin(), req.end(), 0);
  int32_t *dreq, *dctx, *dtable, *dout;
  float* scores;
  CHECK(cudaMalloc(&dreq, tokens * 4));
  CHECK(cudaMalloc(&dctx, tokens * 4));
  CHECK(cudaMalloc(&dtable, static_cast<size_t>(tokens) * (context / 64) * 4));
  CHECK(cudaMalloc(&dout, static_cast<size_t>(tokens) * topk * 4));
  CHECK(cudaMemcpy(dreq, req.data(), tokens * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dctx, ctx.data(), tokens * 4, cudaMemcpyHostToDevice));
  smla::IndexerTopkArgs a;
  a.q = smla::TensorView(nullptr, {tokens, 1, 128}, smla::DType::bf16, dev);
  a.index_cache = smla::TensorView(nullptr, {1, 64, 132}, smla::DType::fp8_e4m3, dev);
  a.request_ids = smla::TensorView(dreq, {tokens}, smla::DType::i32, dev);
  a.block_table = smla::TensorView(dtable, {tokens, context / 64}, smla::DType::i32, dev);
  a.context_lens = smla::TensorView(dctx, {tokens}, smla::DType::i32, dev);
  a.topk = smla::TensorView(dout, {tokens, topk}, smla::DType::i32, dev);
  std::vector<float> hs(static_cast<size_t>(tokens) * smla::cuda::score_row_stride(a));
  std::mt19937 rng(9);
  for (auto& x : hs) x = static_cast<float>(rng()) / 4e9f;
  CHECK(cudaMalloc(&scores, hs.size() * 4));
  CHECK(cudaMemcpy(scores, hs.data(), hs.size() * 4, cudaMemcpyHostToDevice));
  using smla::cuda::TopkSplit;
  const int major = device_major();
  const auto us = [&](TopkSplit split) { return 1e3 * time_ms([&] { smla::cuda::select_topk(a, scores, split); }); };
  const double one_cta = us(TopkSplit::one_cta), slices = us(TopkSplit::slices);
  char cluster[16] = "-";
  if (major >= 9) std::snprintf(cluster, sizeof cluster, "%.1f", us(TopkSplit::cluster));
  const double picked = us(TopkSplit::automatic);
  const auto graph_with = [&](bool sorted, TopkSplit split) {
    a.sorted = sorted;
    return graph_us([&](cudaStream_t s) {
      a.stream = s;
      smla::cuda::select_topk(a, scores, split);
    });
  };
  const double graph = graph_with(true, TopkSplit::automatic), unsorted = graph_with(false, TopkSplit::automatic);
  double cluster16 = -1, cluster16_graph = -1;
  char cluster16_cols[2][16] = {"-", "-"};
  if (smla::cuda::topk_max_cluster_ranks(topk) >= 16) {
    a.sorted = true;
    a.stream = nullptr;
    cluster16 = us(TopkSplit::cluster16);
    cluster16_graph = graph_with(true, TopkSplit::cluster16);
    std::snprintf(cluster16_cols[0], sizeof cluster16_cols[0], "%.1f", cluster16);
    std::snprintf(cluster16_cols[1], sizeof cluster16_cols[1], "%.1f", cluster16_graph);
  }
  const double streamed = graph_with(true, TopkSplit::one_cta_streamed);
  const double streamed_unsorted = graph_with(false, TopkSplit::one_cta_streamed);
  a.sorted = true;
  a.stream = nullptr;
  std::printf("%6d %7d %10.1f %10.1f %10s %10.1f %10.1f %10.1f %12.2f %10s %10s %10.1f %10.1f\n", tokens, context,
              one_cta, slices, cluster, picked, graph, unsorted, picked / tokens, cluster16_cols[0], cluster16_cols[1],
              streamed, streamed_unsorted);
  topk_rows.push_back({tokens, context, one_cta, slices, major >= 9 ? std::atof(cluster) : -1, picked, graph,
                       unsorted, cluster16, cluster16_graph, streamed, streamed_unsorted});
  for (void* ptr : {static_cast<void*>(dreq), static_cast<void*>(dctx), static_cast<void*>(dtable),
                    static_cast<void*>(dout), static_cast<void*>(scores)})
    cudaFree(ptr);
}

// The whole DSA decode step of GLM-5 under TP 8 (8 attention heads, 32 indexer heads with fp8 queries, top-k 2048,
// fp8 index keys of 132 B, an fp8_ds_mla cache), `tokens` requests of `context` positions each, over a shared block
// table of shuffled blocks with random keys (distinct scores). Each stage alone and the step, replayed from a CUDA
// graph; the three ops as separate calls (indexer_topk, positions_to_slots, sparse_mla) in a graph; the step as
// single cold calls; and the step replayed with sorted = false (the positions in position order). "counted": the
// scores kernel counting the top-k's histograms (with their zeroing kernel), the top-k reading them, and the step's
// kernels that way (not the library's: slower on the H200).
struct StepRow {
  int tokens, context, requests;
  double scores_us, topk_us, attention_us, ops_us, step_us, cold_us, unsorted_step_us;
  double counted_scores_us, counted_topk_us, counted_step_us;
  double unsorted_l2_cold_us, scores_l2_cold_us, attention_l2_cold_us;  // L2 emptied before each call
  double grouped_scores_us, one_scores_us;  // the scores kernel with grouped tokens forced, with one token a CTA forced
};
std::vector<StepRow> step_rows;

struct StepCaches {
  Cache mla{smla::DType::fp8_ds_mla, int64_t{1} << 20};  // 8 requests of 128K
  uint8_t* index = nullptr;                               // [blocks, 64, 132] fp8 keys, their scales 1/64
  int64_t blocks() const { return mla.slots / 64; }
  StepCaches() {
    const size_t bytes = static_cast<size_t>(blocks()) * 64 * 132;
    std::vector<uint8_t> h(bytes);
    uint64_t x = 88172645463325252ull;  // xorshift64: 138 MB of random codes in a blink
    for (int64_t b = 0; b < blocks(); ++b) {
      uint8_t* block = h.data() + b * 64 * 132;
      for (int i = 0; i < 64 * 128; ++i) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        block[i] = static_cast<uint8_t>((x & 0x7f) % 0x70) | static_cast<uint8_t>(x >> 8 & 0x80);
      }
      for (int i = 0; i < 64; ++i) reinterpret_cast<float*>(block + 64 * 128)[i] = 1.f / 64;
    }
    CHECK(cudaMalloc(&index, bytes));
    CHECK(cudaMemcpy(index, h.data(), bytes, cudaMemcpyHostToDevice));
  }
  ~StepCaches() { cudaFree(index); }
};

// One step's inputs over `caches`: `tokens` requests of `context` positions (GLM-5 TP8, as bench_step describes), or
// with `per_request` > 1, tokens / per_request requests of per_request consecutive positions each (multi-token
// decode: draft tokens) ending at `context`.
struct StepInputs {
  smla::DsaDecodeStepArgs a;
  float* scores;    // select_topk's input, for the top-k alone
  int* histograms;  // the scores' coarse-bin counts (indexer_scores with histograms)
  std::vector<void*> buffers;

  StepInputs(StepCaches& caches, int tokens, int context, int per_request = 1) {
    const smla::Device dev = smla::Device::cuda(90);
    const int heads = 8, index_heads = 32, topk = 2048, bs = 64, blocks_per_req = context / bs;
    const int requests = tokens / per_request;
    if (per_request < 1 || requests * per_request != tokens)
      throw std::invalid_argument("bench_step: " + std::to_string(tokens) + " tokens are not whole requests of " +
                                  std::to_string(per_request));
    std::mt19937 rng(tokens * 7 + context);
    std::vector<int32_t> perm(caches.blocks()), req(tokens), ctx(tokens);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    perm.resize(static_cast<size_t>(requests) * blocks_per_req);
    for (int t = 0; t < tokens; ++t) {
      req[t] = t / per_request;
      ctx[t] = context - (per_request - 1 - t % per_request);  // each token sees its request's ones before it
    }
    std::vector<uint8_t> codes(static_cast<size_t>(tokens) * index_heads * 128);
    for (auto& c : codes) c = static_cast<uint8_t>(rng() % 0x70) | (rng() & 0x80);
    std::vector<float> w(static_cast<size_t>(tokens) * index_heads), q_scale(w.size());
    for (auto& v : w) v = 0.01f + (rng() % 100) * 1e-4f;
    for (auto& v : q_scale) v = 1.f / (16 + rng() % 16);
    const auto upload = [&](const auto& v) {
      void* d;
      CHECK(cudaMalloc(&d, v.size() * sizeof(v[0])));
      CHECK(cudaMemcpy(d, v.data(), v.size() * sizeof(v[0]), cudaMemcpyHostToDevice));
      buffers.push_back(d);
      return d;
    };
    const auto alloc = [&](size_t bytes) {
      void* d;
      CHECK(cudaMalloc(&d, bytes));
      buffers.push_back(d);
      return d;
    };
    void *dtable = upload(perm), *dreq = upload(req), *dctx = upload(ctx), *dq_index = upload(codes),
         *dw = upload(w), *dq_scale = upload(q_scale);
    void* q = device_random_half(static_cast<size_t>(tokens) * heads * 576);
    buffers.push_back(q);
    void *dtopk = alloc(static_cast<size_t>(tokens) * topk * 4), *dslots = alloc(static_cast<size_t>(tokens) * topk * 4),
         *out = alloc(static_cast<size_t>(tokens) * heads * 512 * 2), *lse = alloc(static_cast<size_t>(tokens) * heads * 4);
    smla::IndexerTopkArgs& ix = a.indexer;
    ix.q = smla::TensorView(dq_index, {tokens, index_heads, 128}, smla::DType::fp8_e4m3, dev);
    ix.q_scale = smla::TensorView(dq_scale, {tokens, index_heads}, smla::DType::f32, dev);
    ix.weights = smla::TensorView(dw, {tokens, index_heads}, smla::DType::f32, dev);
    ix.index_cache = smla::TensorView(caches.index, {caches.blocks(), bs, 132}, smla::DType::fp8_e4m3, dev);
    ix.request_ids = smla::TensorView(dreq, {tokens}, smla::DType::i32, dev);
    ix.block_table = smla::TensorView(dtable, {requests, blocks_per_req}, smla::DType::i32, dev);
    ix.context_lens = smla::TensorView(dctx, {tokens}, smla::DType::i32, dev);
    ix.topk = smla::TensorView(dtopk, {tokens, topk}, smla::DType::i32, dev);
    a.slots = smla::TensorView(dslots, {tokens, topk}, smla::DType::i32, dev);
    a.q = smla::TensorView(q, {tokens, heads, 576}, smla::DType::bf16, dev);
    a.kv_cache = caches.mla.view();
    a.softmax_scale = 0.0625f;
    a.out = smla::TensorView(out, {tokens, heads, 512}, smla::DType::bf16, dev);
    a.lse = smla::TensorView(lse, {tokens, heads}, smla::DType::f32, dev);
    scores = static_cast<float*>(alloc(static_cast<size_t>(tokens) * smla::cuda::score_row_stride(ix) * 4));
    histograms = static_cast<int*>(alloc(smla::cuda::topk_histogram_bytes(ix)));
  }
  ~StepInputs() {
    for (void* ptr : buffers) cudaFree(ptr);
  }
  smla::DsaDecodeStepArgs on(cudaStream_t s) {
    a.stream = s;
    return a;
  }
};

// dsa_decode_step's launches with the scores kernel counting the top-k's histograms into `in.histograms` and the
// top-k reading them (the step's way in 91dc9f8, slower), the scores in `in.scores`.
void counted_step(StepInputs& in, cudaStream_t s) {
  const smla::DsaDecodeStepArgs step = in.on(s);
  const smla::IndexerTopkArgs ix = smla::indexer_step(step);
  const smla::PositionsToSlotsArgs slots = smla::slots_step(step);
  smla::cuda::indexer_scores(ix, in.scores, smla::cuda::ScoreMma::automatic, in.histograms);
  smla::cuda::select_topk(ix, in.scores, smla::cuda::TopkSplit::automatic, nullptr, {&slots, true, in.histograms});
  smla::cuda::sparse_mla(smla::attention_step(step), {}, smla::cuda::AttentionLaunch::after_own_kernel);
}

void bench_step(StepCaches& caches, int tokens, int context, int per_request = 1) {
  const smla::Backend& be = *smla::Registry::global().find("cuda_mma");
  StepInputs in(caches, tokens, context, per_request);
  float* scores = in.scores;
  const auto on = [&](cudaStream_t s) { return in.on(s); };
  StepRow r{tokens, context, tokens / per_request};
  const auto scores_alone = [&](cudaStream_t s) { smla::cuda::indexer_scores(smla::indexer_step(on(s)), scores); };
  r.scores_us = graph_us(scores_alone);
  r.scores_l2_cold_us = l2_cold_graph_us(scores_alone);
  const auto scores_with = [&](smla::cuda::ScoreTokens grouping) {
    return graph_us([&](cudaStream_t s) {
      smla::cuda::indexer_scores(smla::indexer_step(on(s)), scores, smla::cuda::ScoreMma::automatic, nullptr, grouping);
    });
  };
  r.grouped_scores_us = scores_with(smla::cuda::ScoreTokens::grouped);
  r.one_scores_us = scores_with(smla::cuda::ScoreTokens::one);
  r.topk_us = graph_us([&](cudaStream_t s) { smla::cuda::select_topk(smla::indexer_step(on(s)), scores); });
  smla::dsa_decode_step(on(nullptr), &be);  // slots for the attention alone
  const auto attention_alone = [&](cudaStream_t s) { smla::sparse_mla(smla::attention_step(on(s)), &be); };
  r.attention_us = graph_us(attention_alone);
  r.attention_l2_cold_us = l2_cold_graph_us(attention_alone);
  r.ops_us = graph_us([&](cudaStream_t s) {
    const smla::DsaDecodeStepArgs step = on(s);
    smla::indexer_topk(smla::indexer_step(step), &be);
    smla::positions_to_slots(smla::slots_step(step), &be);
    smla::sparse_mla(smla::attention_step(step), &be);
  });
  const auto step = [&](cudaStream_t s) { smla::dsa_decode_step(on(s), &be); };
  r.step_us = graph_us(step);
  r.cold_us = cold_us(step);
  in.a.indexer.sorted = false;
  r.unsorted_step_us = graph_us(step);
  r.unsorted_l2_cold_us = l2_cold_graph_us(step);
  in.a.indexer.sorted = true;
  using smla::cuda::TopkSplit;
  r.counted_scores_us = graph_us([&](cudaStream_t s) {
    smla::cuda::indexer_scores(smla::indexer_step(on(s)), scores, smla::cuda::ScoreMma::automatic, in.histograms);
  });
  r.counted_topk_us = graph_us([&](cudaStream_t s) {
    smla::cuda::select_topk(smla::indexer_step(on(s)), scores, TopkSplit::automatic, nullptr,
                            {nullptr, false, in.histograms});
  });
  r.counted_step_us = graph_us([&](cudaStream_t s) { counted_step(in, s); });
  std::printf("%6d %7d %5d %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f %12.0f %9.1f %9.1f %9.1f %10.1f %9.1f "
              "%9.1f %9.1f\n",
              tokens, context, r.requests, r.scores_us, r.topk_us, r.attention_us, r.ops_us, r.step_us, r.cold_us,
              r.unsorted_step_us, r.unsorted_l2_cold_us, 1e6 / (78 * r.step_us), r.counted_scores_us,
              r.counted_topk_us, r.counted_step_us, r.grouped_scores_us, r.one_scores_us, r.scores_l2_cold_us,
              r.attention_l2_cold_us);
  step_rows.push_back(r);
}

#ifdef SMLA_TOPK_STAMPS
// Where one step's time goes (a build with SMLA_TOPK_STAMPS): the step (`dsa_decode_step`), the step's kernels with
// the scores counting the top-k's histograms, and the top-k alone on the step's scores (counting, twice in a row, and
// reading the scores kernel's histograms), each replayed from a one-call CUDA graph `reps` times; per replay the
// stamps of StepStamp, printed as medians in µs from the scores kernel's first start (the step) or the top-k's
// (alone), then the top-k's phases from its CTA 0's clock (cycles, and µs at the SM clock the driver reports).
void bench_stamps(StepCaches& caches, int tokens, int context, bool sorted, int reps = 50) {
  using namespace smla::cuda;
  const smla::Backend& be = *smla::Registry::global().find("cuda_mma");
  StepInputs in(caches, tokens, context);
  in.a.indexer.sorted = sorted;
  unsigned long long* stamps;
  CHECK(cudaMalloc(&stamps, 2 * kStepStamps * sizeof(unsigned long long)));
  int clock_khz = 0;
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  const auto run = [&](const char* what, auto&& fn) {
    const cudaStream_t s = bench_stream();
    set_step_stamps(stamps);
    fn(s);  // warm-up (and the default workspace)
    CHECK(cudaStreamSynchronize(s));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    fn(s);
    CHECK(cudaStreamEndCapture(s, &graph));
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    std::vector<std::vector<double>> ns(kStepStamps), cycles(kStepStamps);
    std::vector<unsigned long long> h(2 * kStepStamps);
    for (int r = 0; r < reps; ++r) {
      std::fill(h.begin(), h.end(), 0ull);
      h[kScoresFirstStart] = h[kTopkFirstStart] = h[kAttnFirstStart] = h[kCombineFirstStart] = ~0ull;
      CHECK(cudaMemcpy(stamps, h.data(), h.size() * sizeof(h[0]), cudaMemcpyHostToDevice));
      CHECK(cudaGraphLaunch(exec, s));
      CHECK(cudaStreamSynchronize(s));
      CHECK(cudaMemcpy(h.data(), stamps, h.size() * sizeof(h[0]), cudaMemcpyDeviceToHost));
      const unsigned long long t0 = h[kScoresFirstStart] != ~0ull ? h[kScoresFirstStart] : h[kTopkFirstStart];
      for (int i = 0; i < kStepStamps; ++i) {
        const bool set = h[i] != 0 && h[i] != ~0ull;
        ns[i].push_back(set ? static_cast<double>(h[i] - t0) : NAN);
        const unsigned long long clock = h[kStepStamps + i], waited = h[kStepStamps + kTopkWaited];
        cycles[i].push_back(clock != 0 ? static_cast<double>(clock - waited) : NAN);
      }
    }
    set_step_stamps(nullptr);
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));
    const auto median = [](std::vector<double> v) {
      v.erase(std::remove_if(v.begin(), v.end(), [](double x) { return std::isnan(x); }), v.end());  // not stamped
      std::sort(v.begin(), v.end());
      return v.empty() ? NAN : v[v.size() / 2];
    };
    static const char* names[kStepStamps] = {
        "scores start", "scores end",    "top-k start",   "top-k waited",  "slice counted", "ranks counted",
        "histogram",    "plan",
        "counted",      "compacted",     "selected",      "ordered",       "stored",        "top-k end",
        "attn start",   "attn waited",   "attn landed",   "attn dequant",  "attn chunk 0",  "attn attended",
        "attn stored",  "attn end",
        "combine start", "combine waited", "combine merged", "combine stored", "combine end"};
    std::printf("%d x %d, %s, %s (us from the first kernel's start; CTA 0 clock from its wait: cycles / us at %.2f "
                "GHz)\n",
                tokens, context, sorted ? "sorted" : "unsorted", what, clock_khz / 1e6);
    for (int i = 0; i < kStepStamps; ++i) {
      const double c = median(cycles[i]);
      std::printf("  %-14s %8.2f", names[i], median(ns[i]) / 1e3);
      if (i >= kTopkWaited && i <= kTopkStored && !std::isnan(c))
        std::printf("   %8.0f cyc %7.2f us", c, c / (clock_khz / 1e3));
      std::printf("\n");
    }
  };
  run("step", [&](cudaStream_t s) { smla::dsa_decode_step(in.on(s), &be); });
  run("step, the scores counting", [&](cudaStream_t s) { counted_step(in, s); });
  indexer_scores(smla::indexer_step(in.on(nullptr)), in.scores, ScoreMma::automatic, in.histograms);
  CHECK(cudaDeviceSynchronize());
  run("top-k alone, counting", [&](cudaStream_t s) { select_topk(smla::indexer_step(in.on(s)), in.scores); });
  // The same kernel twice in a row, the second's phases (its stamps overwrite the first's): where the second runs on
  // the SM the first ran on (one CTA: likely), its instructions are in that SM's caches already.
  run("top-k alone twice, the second's phases", [&](cudaStream_t s) {
    select_topk(smla::indexer_step(in.on(s)), in.scores);
    select_topk(smla::indexer_step(in.on(s)), in.scores);
  });
  run("top-k alone, counted", [&](cudaStream_t s) {
    select_topk(smla::indexer_step(in.on(s)), in.scores, TopkSplit::automatic, nullptr,
                {nullptr, false, in.histograms});
  });
  CHECK(cudaFree(stamps));
}
#endif

}  // namespace

// `--json PATH`: the run's ceilings and its attention, top-k and step rows (none where a part ran none); 0, or 1
// where PATH cannot be written. An empty path writes nothing.
int write_json(const std::string& path, const cudaDeviceProp& prop, const Ceilings& c) {
  if (path.empty()) return 0;
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) return std::fprintf(stderr, "bench_cuda: cannot write %s\n", path.c_str()), 1;
  std::fprintf(f, "{\n  \"device\": \"%s\", \"sm\": %d, \"sms\": %d,\n", prop.name, prop.major * 10 + prop.minor,
               prop.multiProcessorCount);
  std::fprintf(f, "  \"ceilings\": {\"copy_gbs\": %.1f, \"gemm_tflops\": %.1f, \"mma_sync_tflops\": %.1f},\n",
               c.copy_gbs, c.gemm_tflops, c.mma_tflops);
  std::fprintf(f, "  \"units\": {\"us\": \"median microseconds per call\", "
                  "\"graph_us\": \"microseconds per call replayed from a CUDA graph\", "
                  "\"gbs\": \"cache rows gathered (tokens * keys * row "
                  "bytes) per second\", \"tflops\": \"2 * heads * keys * (576 or 512 + 512) * tokens per second\"},\n");
  std::fprintf(f, "  \"attention\": [\n");
  for (size_t i = 0; i < attention_rows.size(); ++i) {
    const AttentionRow& r = attention_rows[i];
    char graph[48] = "";
    if (r.graph_us >= 0) std::snprintf(graph, sizeof graph, ", \"graph_us\": %.2f", r.graph_us);
    std::fprintf(f,
                 "    {\"config\": \"%s\", \"cache\": \"%s\", \"kernel\": \"%s\", \"tokens\": %d, \"heads\": %d, "
                 "\"keys\": %d, \"us\": %.2f, \"tflops\": %.2f, \"gbs\": %.1f, \"copy_fraction\": %.4f, "
                 "\"gemm_fraction\": %.4f%s}%s\n",
                 r.config.c_str(), r.cache.c_str(), r.kernel.c_str(), r.tokens, r.heads, r.keys, r.us, r.tflops,
                 r.gbs, r.copy_frac, r.gemm_frac, graph, i + 1 < attention_rows.size() ? "," : "");
  }
  std::fprintf(f, "  ],\n  \"topk\": [\n");
  for (size_t i = 0; i < topk_rows.size(); ++i) {
    const TopkRow& r = topk_rows[i];
    std::fprintf(f,
                 "    {\"tokens\": %d, \"context\": %d, \"unsplit_us\": %.2f, \"split_us\": %.2f, "
                 "\"cluster_us\": %.2f, \"picked_us\": %.2f, \"graph_us\": %.2f, \"unsorted_graph_us\": %.2f, "
                 "\"cluster16_us\": %.2f, \"cluster16_graph_us\": %.2f, \"streamed_graph_us\": %.2f, "
                 "\"streamed_unsorted_graph_us\": %.2f}%s\n",
                 r.tokens, r.context, r.unsplit_us, r.split_us, r.cluster_us, r.picked_us, r.graph_us,
                 r.unsorted_graph_us, r.cluster16_us, r.cluster16_graph_us, r.streamed_graph_us,
                 r.streamed_unsorted_graph_us, i + 1 < topk_rows.size() ? "," : "");
  }
  std::fprintf(f, "  ],\n  \"dsa_decode_step\": [\n");
  for (size_t i = 0; i < step_rows.size(); ++i) {
    const StepRow& r = step_rows[i];
    std::fprintf(f,
                 "    {\"config\": \"glm5-tp8 fp8\", \"tokens\": %d, \"context\": %d, \"requests\": %d, "
                 "\"scores_us\": %.2f, "
                 "\"topk_us\": %.2f, \"attention_us\": %.2f, \"three_ops_us\": %.2f, \"step_us\": %.2f, "
                 "\"step_cold_us\": %.2f, \"step_unsorted_us\": %.2f, \"counted_scores_us\": %.2f, "
                 "\"counted_topk_us\": %.2f, \"counted_step_us\": %.2f, \"grouped_scores_us\": %.2f, "
                 "\"one_scores_us\": %.2f, \"step_unsorted_l2_cold_us\": %.2f, \"scores_l2_cold_us\": %.2f, "
                 "\"attention_l2_cold_us\": %.2f}%s\n",
                 r.tokens, r.context, r.requests, r.scores_us, r.topk_us, r.attention_us, r.ops_us, r.step_us,
                 r.cold_us, r.unsorted_step_us, r.counted_scores_us, r.counted_topk_us, r.counted_step_us,
                 r.grouped_scores_us, r.one_scores_us, r.unsorted_l2_cold_us, r.scores_l2_cold_us,
                 r.attention_l2_cold_us, i + 1 < step_rows.size() ? "," : "");
  }
  std::fprintf(f, "  ]\n}\n");
  std::fclose(f);
  return 0;
}

int main(int argc, char** argv) {
  // `bench_cuda attention|indexer|topk|step` runs one part (`glm53f`, `dsv4`: only GLM-5.3-Flash's, DeepSeek-V4's
  // attention rows); no argument: all. `bench_cuda sparse ...` one sparse config, `bench_cuda paged ...` one dense
  // paged decode config (below).
  // `bench_cuda indexer TOKENS HEADS CONTEXT [OPTION...]` runs one indexer decode config; options: bf16 (keys),
  // fp8q (fp8 queries), and to force how fp8 keys are multiplied: mma.sync or wgmma (as bf16), e4m3 or e4m3-wgmma
  // (fp8q only). `bench_cuda topk TOKENS
  // CONTEXT` one top-k config (unsplit, split, cluster, picked, then cluster16: in that order, each warmed up and
  // timed).
  // `bench_cuda step TOKENS CONTEXT [TOKENS_PER_REQUEST]` one step config (default 1: each token its own request).
  // `bench_cuda stamps [TOKENS CONTEXT]` (a build with SMLA_TOPK_STAMPS): where the step's and the top-k's time
  // goes, sorted and unsorted (default: 1 x 8K and 1 x 128K).
  // `--json PATH` (anywhere) also writes the ceilings and the attention, top-k and step rows as JSON.
  std::string json_path;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == "--json") {
      json_path = argv[i + 1];
      for (int k = i; k + 2 < argc; ++k) argv[k] = argv[k + 2];
      argc -= 2;
      break;
    }
  const std::string part = argc > 1 ? argv[1] : "";
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  if (part == "stamps") {
#ifdef SMLA_TOPK_STAMPS
    StepCaches caches;
    const auto shapes = argc >= 4 ? std::vector<std::pair<int, int>>{{std::atoi(argv[2]), std::atoi(argv[3])}}
                                  : std::vector<std::pair<int, int>>{{1, 8192}, {1, 131072}};
    for (const auto& [tokens, context] : shapes)
      for (bool sorted : {true, false}) bench_stamps(caches, tokens, context, sorted);
    return 0;
#else
    return std::fprintf(stderr, "bench_cuda stamps: build with -DSMLA_TOPK_STAMPS=ON\n"), 1;
#endif
  }
  const Ceilings c{copy_bandwidth_gbs(), gemm_tflops(), mma_sync_tflops()};
  std::printf("device: %s (sm_%d%d, %d SMs)\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount);
  std::printf("ceilings measured now: copy %.0f GB/s (read+write), cuBLAS bf16 GEMM %.0f TFLOP/s, mma.sync bf16 %.0f "
              "TFLOP/s\n\n",
              c.copy_gbs, c.gemm_tflops, c.mma_tflops);
  auto kernel_named = [](const std::string& k) {
    return k == "small"       ? AttentionKernel::small_heads
           : k == "head-tile" ? AttentionKernel::head_tile
           : k == "wide"      ? AttentionKernel::wide_tile
           : k == "wgmma"     ? AttentionKernel::wgmma
                              : AttentionKernel::automatic;
  };
  if (part == "sparse" && argc >= 6) {
    // `bench_cuda sparse TOKENS HEADS TOPK bf16|fp8 [auto|small|head-tile|wide|wgmma] [STAGES [HEADS_PER_CTA
    // [SPLIT_DIMS [SPLITS [auto|pieces|bulk]]]]]`: one sparse config (0, auto: as the op picks; the last, how the
    // small-heads kernel copies rows).
    const std::string copy = argc > 11 ? argv[11] : "auto";
    const AttentionChoice kernel{kernel_named(argc > 6 ? argv[6] : "auto"), argc > 7 ? std::atoi(argv[7]) : 0,
                                 argc > 8 ? std::atoi(argv[8]) : 0, argc > 9 ? std::atoi(argv[9]) : 0,
                                 argc > 10 ? std::atoi(argv[10]) : 0,
                                 copy == "pieces" ? smla::cuda::RowCopy::pieces
                                 : copy == "bulk" ? smla::cuda::RowCopy::bulk
                                                  : smla::cuda::RowCopy::automatic};
    Cache cache(std::string(argv[5]) == "fp8" ? smla::DType::fp8_ds_mla : smla::DType::bf16, int64_t{1} << 20);
    bench_sparse("sparse", cache, std::atoi(argv[2]), std::atoi(argv[3]), std::atoi(argv[4]), c, kernel);
    return write_json(json_path, prop, c);
  }
  if (part == "gather" && argc >= 5) {
    // `bench_cuda gather TOKENS TOPK bf16|fp8 [STAGES [THREADS [SPLITS [SPIN [SMEM [ROWS [cta|warp|bulk]]]]]]]`: the
    // gather ceiling of one sparse shape (its rows read, no attention), by plain loads or (STAGES 2, 3, 4, 6, 8)
    // through a pipeline of ROWS-row chunks (64 unless given).
    Cache cache(std::string(argv[4]) == "fp8" ? smla::DType::fp8_ds_mla : smla::DType::bf16, int64_t{1} << 20);
    GatherPipeline pipe;
    if (argc > 5) pipe.stages = std::atoi(argv[5]);
    if (argc > 6) pipe.threads = std::atoi(argv[6]);
    if (argc > 7) pipe.splits = std::atoi(argv[7]);
    if (argc > 8) pipe.spin = std::atoi(argv[8]);
    if (argc > 9) pipe.smem = std::atoi(argv[9]);
    if (argc > 10) pipe.rows = std::atoi(argv[10]);
    const std::string sync = argc > 11 ? argv[11] : "cta";
    pipe.sync = sync == "warp" ? PipeSync::warp : sync == "bulk" ? PipeSync::bulk : PipeSync::cta;
    const int warps = pipe.threads / 32, topk = std::atoi(argv[3]);
    const bool stages_ok = pipe.stages == 0 || pipe.stages == 2 || pipe.stages == 3 || pipe.stages == 4 ||
                           pipe.stages == 6 || pipe.stages == 8;
    if (!stages_ok || (sync != "cta" && sync != "warp" && sync != "bulk") ||
        (pipe.sync == PipeSync::bulk && device_major() < 9) ||
        (pipe.stages != 0 &&
         (pipe.threads % 32 || pipe.threads > 1024 || pipe.threads < 32 || pipe.rows < 1 || pipe.rows % warps ||
          pipe.rows / warps > 32 || pipe.splits < 1 || topk % (pipe.rows * pipe.splits))))
      return std::fprintf(stderr, "bench_cuda gather: STAGES 2, 3, 4, 6 or 8; THREADS a multiple of 32 whose warps "
                                  "divide ROWS, at most 32 rows a warp; TOPK a multiple of ROWS x SPLITS; cta, warp "
                                  "or bulk (sm_90+)\n"), 2;
    bench_gather("gather ceiling", cache, std::atoi(argv[2]), topk, c, pipe);
    return write_json(json_path, prop, c);
  }
  if (part == "paged" && argc >= 6) {
    // `bench_cuda paged BATCH CONTEXT HEADS bf16|fp8 [auto|small|head-tile|wide|wgmma [STAGES [HEADS_PER_CTA]]]`:
    // one dense paged decode config.
    Cache cache(std::string(argv[5]) == "fp8" ? smla::DType::fp8_ds_mla : smla::DType::bf16, int64_t{1} << 20);
    bench_paged("paged", cache, std::atoi(argv[2]), std::atoi(argv[3]), std::atoi(argv[4]), c,
                {kernel_named(argc > 6 ? argv[6] : "auto"), argc > 7 ? std::atoi(argv[7]) : 0,
                 argc > 8 ? std::atoi(argv[8]) : 0});
    return write_json(json_path, prop, c);
  }
  if (part == "dsv4" && argc >= 5) {
    // `bench_cuda dsv4 TOKENS HEADS bf16|fp8 [auto|small|head-tile|wide|wgmma]`: one DeepSeek-V4 c4 decode row (the
    // window cache's 128 entries beside the ratio-4 cache's top-512, as the table below).
    const smla::DType kv = std::string(argv[4]) == "fp8" ? smla::DType::fp8_ds_mla_v4 : smla::DType::bf16;
    const smla::MlaHead v4{0};
    Cache window(kv, int64_t{1} << 20, v4), c4(kv, int64_t{1} << 20, v4);
    bench_sparse("dsv4 decode c4", window, std::atoi(argv[2]), std::atoi(argv[3]), 128, c,
                 {kernel_named(argc > 5 ? argv[5] : "auto")}, 0, {&c4, 512});
    return write_json(json_path, prop, c);
  }
  const bool all_attention = part.empty() || part == "attention";
  if (all_attention || part == "glm53f" || part == "dsv4") {
    std::printf("%-22s %-13s %-10s %6s %5s %6s %10s %9s %8s %7s %s\n", "config", "cache", "kernel", "tokens", "heads",
                "keys", "us", "TFLOP/s", "GB/s", "ceil%", "bound");
    const int64_t slots = int64_t{1} << 20;  // 1.2 GB of bf16 rows: gathers miss L2
    const AttentionChoice head_tile{AttentionKernel::head_tile, 0}, wide{AttentionKernel::wide_tile, 0},
        wgmma{AttentionKernel::wgmma};
    // The wgmma kernel's rows where it runs (Hopper, sm_90a code).
    const bool wgmma_rows = smla::cuda::wgmma_kernels_available();
    for (smla::DType kv : {smla::DType::bf16, smla::DType::fp8_ds_mla}) {
      if (!all_attention) break;
      Cache cache(kv, slots);
      for (int t : {32, 128}) bench_gather("gather ceiling", cache, t, 2048, c);
      for (int t : {1, 8, 32, 64, 128}) bench_sparse("glm5-tp8 decode", cache, t, 8, 2048, c);
      for (int t : {1, 32, 128}) bench_sparse("dsv32-tp8 decode", cache, t, 16, 2048, c);
      for (int h : {1, 4, 20, 32}) bench_sparse("decode (heads)", cache, 128, h, 2048, c);
      // The same goal shapes on each kernel forced, and each pipeline depth of the small-heads one.
      for (int h : {8, 16})
        for (int t : {1, 8, 128}) {
          bench_sparse("decode (head tile)", cache, t, h, 2048, c, head_tile);
          bench_sparse("decode (small heads)", cache, t, h, 2048, c, {AttentionKernel::small_heads});
        }
      for (int h : {8, 16})
        for (int stages : {2, 3, 4})
          bench_sparse("decode (depth)", cache, 128, h, 2048, c, {AttentionKernel::small_heads, stages});
      // The small-heads kernel's rows copied by 16-byte cp.async pieces (every arch's way; bulk copies from sm_90 on).
      for (int h : {8, 16})
        for (int t : {32, 128})
          bench_sparse("decode (cp.async rows)", cache, t, h, 2048, c,
                       {AttentionKernel::small_heads, 0, 0, 0, 0, smla::cuda::RowCopy::pieces});
      for (int t : {32, 128}) {
        bench_sparse("decode (dims unsplit)", cache, t, 8, 2048, c, {AttentionKernel::small_heads, 0, 8, 1});
        bench_sparse("decode (dims split)", cache, t, 8, 2048, c, {AttentionKernel::small_heads, 0, 8, 2});
        bench_sparse("decode (8 heads/CTA)", cache, t, 16, 2048, c, {AttentionKernel::small_heads, 0, 8, 0});
        bench_sparse("decode (16 heads/CTA)", cache, t, 16, 2048, c, {AttentionKernel::small_heads, 0, 16, 0});
      }
      // The wgmma kernel's keys-on-M form (fp8_ds_mla, forced: 8, 16 or 32 heads per CTA) at the goal shapes.
      if (wgmma_rows && kv == smla::DType::fp8_ds_mla) {
        for (int h : {8, 16, 32})
          for (int t : {1, 8, 32, 128})
            bench_sparse("decode (keys on M)", cache, t, h, 2048, c, {AttentionKernel::wgmma, 0, h});
        for (int h : {8, 16})
          bench_sparse("prefill 32K (keys on M)", cache, 4096, h, 2048, c, {AttentionKernel::wgmma, 0, h}, 32768);
        bench_paged("dense paged (keys on M)", cache, 128, 8192, 16, c, {AttentionKernel::wgmma, 0, 16});
      }
      // One token's latency against the number of key splits (the op picks 64 for 2048 keys: one chunk of 32 each).
      for (int splits : {1, 4, 8, 16, 32, 64}) bench_sparse("1 token (splits)", cache, 1, 8, 2048, c, {{}, 0, 0, 0, splits});
      // The compute-bound rows (issue 19) as the op picks, then on the 16-head-tile, wide-tile and wgmma kernels forced.
      for (int h : {64, 128})
        for (int t : {64, 128})
          for (AttentionChoice k : {AttentionChoice{}, head_tile, wide, wgmma})
            if (k.kernel != AttentionKernel::wgmma || wgmma_rows) bench_sparse("decode (compute)", cache, t, h, 2048, c, k);
      for (int stages : {2, 3}) bench_sparse("decode (wide depth)", cache, 128, 128, 2048, c, {AttentionKernel::wide_tile, stages});
      for (int h : {8, 16}) bench_sparse("prefill 32K", cache, 4096, h, 2048, c, {}, 32768);
      if (kv == smla::DType::bf16)
        for (int h : {64, 128})
          for (AttentionChoice k : {AttentionChoice{}, head_tile, wide, wgmma})
            if (k.kernel != AttentionKernel::wgmma || wgmma_rows) bench_sparse("prefill", cache, 4096, h, 2048, c, k);
      for (int h : {16, 128}) bench_paged("dense paged decode", cache, 128, 8192, h, c);
      bench_paged("dense paged (head tile)", cache, 128, 8192, 16, c, head_tile);
      bench_paged("dense paged (head tile)", cache, 128, 8192, 128, c, head_tile);
      bench_paged("dense paged (wide)", cache, 128, 8192, 128, c, wide);
      if (wgmma_rows) bench_paged("dense paged (wgmma)", cache, 128, 8192, 128, c, wgmma);
    }
    // GLM-5.3-Flash under TP 8: 8 rope-free heads of 512; its pooled top-k attends 2048 tokens of whole pools and
    // up to 3 of the incomplete last one.
    for (smla::DType kv : {smla::DType::bf16, smla::DType::fp8_ds_mla, smla::DType::fp8_ds_mla_nope}) {
      if (part == "dsv4") break;
      Cache cache(kv, slots, smla::MlaHead{0});
      for (int t : {1, 8, 32, 64, 128}) bench_sparse("glm53f-tp8 decode", cache, t, 8, 2048 + 3, c);
      for (int t : {1, 8, 32, 128}) {  // each kernel forced
        bench_sparse("glm53f (head tile)", cache, t, 8, 2048 + 3, c, head_tile);
        bench_sparse("glm53f (small heads)", cache, t, 8, 2048 + 3, c, {AttentionKernel::small_heads});
      }
      for (int stages : {2, 3, 4})
        bench_sparse("glm53f (depth)", cache, 128, 8, 2048 + 3, c, {AttentionKernel::small_heads, stages});
      for (int split_dims : {1, 2})
        bench_sparse("glm53f (dims)", cache, 128, 8, 2048 + 3, c, {AttentionKernel::small_heads, 0, 8, split_dims});
    }
    // DeepSeek-V4 decode as vLLM's deepseek_v4 runs it (FlashMLA's MODEL1 call): heads of 512 (64: V4-Flash; 128),
    // the window cache's 128 entries (blocks of 64) beside a compressed cache: the ratio-4 one's indexer top-k 512
    // (blocks of 256 / 4 = 64) or every entry of the ratio-128 one (1024 at 128K tokens, blocks of 256 / 128 = 2).
    for (smla::DType kv : {smla::DType::bf16, smla::DType::fp8_ds_mla_v4}) {
      if (part == "glm53f") break;
      const smla::MlaHead v4{0};
      Cache window(kv, slots, v4), c4(kv, slots, v4), c128(kv, slots / 4, v4, 2);
      for (int h : {64, 128})
        for (int t : {1, 32, 64, 128}) {
          bench_sparse("dsv4 decode c4", window, t, h, 128, c, {}, 0, {&c4, 512});
          bench_sparse("dsv4 decode c128", window, t, h, 128, c, {}, 0, {&c128, 1024});
        }
      // Under tensor parallelism (V4-Flash's 64 heads over 8 or 4 GPUs): 8 and 16 heads on each kernel forced.
      for (int h : {8, 16})
        for (int t : {1, 32, 128})
          for (AttentionKernel k : {AttentionKernel::small_heads, AttentionKernel::head_tile}) {
            bench_sparse("dsv4 decode c4 (small heads)", window, t, h, 128, c, {k}, 0, {&c4, 512});
            bench_sparse("dsv4 decode c128 (small heads)", window, t, h, 128, c, {k}, 0, {&c128, 1024});
          }
      for (int h : {64, 128}) bench_sparse("dsv4 decode window", window, 128, h, 128, c);
      for (int h : {64, 128}) bench_sparse("dsv4 prefill c4", window, 4096, h, 128, c, {}, 0, {&c4, 512});
    }
  }
  if (part.empty() || part == "indexer") {
    std::printf("\nindexer (index cache fp8: 132 B/position, bf16: 256; top-k 2048 of distinct random scores)\n");
    std::printf("%-16s %-5s %-5s %6s %5s %7s %10s %8s %7s %8s %12s %12s\n", "config", "cache", "q", "tokens", "heads",
                "context", "scores us", "GB/s", "copy%", "TFLOP/s", "top-k us", "top-k us/row");
    using smla::cuda::ScoreMma;
    if (argc >= 5) {
      IndexerConfig cfg{"decode", std::atoi(argv[2]), std::atoi(argv[3]), std::atoi(argv[4])};
      for (int i = 5; i < argc; ++i) {
        const std::string option = argv[i];
        if (option == "bf16") cfg.fp8_keys = false;
        else if (option == "fp8q") cfg.fp8_queries = true;
        else if (option == "mma.sync") cfg.mma = ScoreMma::bf16;
        else if (option == "wgmma") cfg.mma = ScoreMma::bf16_wgmma;
        else if (option == "e4m3") cfg.mma = ScoreMma::fp8;
        else if (option == "e4m3-wgmma") cfg.mma = ScoreMma::fp8_wgmma;
        else return std::fprintf(stderr, "bench_cuda indexer: unknown option %s\n", option.c_str()), 2;
      }
      bench_indexer(cfg, c);
      return write_json(json_path, prop, c);
    }
    for (bool fp8_queries : {true, false})
      for (int heads : {32, 64})
        for (int tokens : {1, 32, 128})
          for (int context : {8192, 32768, 131072}) {
            IndexerConfig cfg{heads == 32 ? "glm5 decode" : "dsv32 decode", tokens, heads, context};
            cfg.fp8_queries = fp8_queries;
            bench_indexer(cfg, c);
          }
    for (int tokens : {1, 128}) {
      IndexerConfig cfg{"glm5 decode", tokens, 32, 131072};
      cfg.fp8_keys = false;
      bench_indexer(cfg, c);
    }
    for (bool fp8_queries : {true, false})
      for (int heads : {32, 64}) {
        IndexerConfig cfg{"prefill", 4096, heads, 8192};
        cfg.fp8_queries = fp8_queries;
        cfg.prefill = true;
        bench_indexer(cfg, c);
      }
    bench_indexer({"topk 64 rows", 64, 64, 131072}, c);
    // GLM-5.3-Flash: 32 heads over one key per pool of 4 tokens (context 8K, 32K, 128K tokens), top 512 pools.
    for (int tokens : {1, 32, 128})
      for (int pools : {2048, 8192, 32768}) {
        IndexerConfig cfg{"glm53f pools", tokens, 32, pools};
        cfg.fp8_queries = true;
        cfg.topk = 512;
        cfg.block_rows = 16;
        bench_indexer(cfg, c);
      }
  }
  if (part.empty() || part == "topk") {
    std::printf("\ntop-k 2048 of distinct random scores: one CTA per row, rows split among CTAs, rows shared by a "
                "cluster's CTAs (SM90+), as select_topk picks; by clusters of 16 CTAs (Hopper), queued and graph; one "
                "CTA never holding the row, graph, sorted and unsorted\n");
    std::printf("%6s %7s %10s %10s %10s %10s %10s %10s %12s %10s %10s %10s %10s\n", "tokens", "context", "unsplit us",
                "split us", "cluster us", "picked us", "graph us", "unsorted", "us/row", "cl16 us", "cl16 graph",
                "streamed", "str unsort");
    if (argc >= 4) {
      bench_topk(std::atoi(argv[2]), std::atoi(argv[3]));
      return write_json(json_path, prop, c);
    }
    for (int context : {8192, 16384, 32768, 131072})
      for (int tokens : {1, 8, 16, 32, 64, 128})
        if (context != 16384 || tokens <= 8) bench_topk(tokens, context);  // 16K: the longest rows held in registers
  }
  if (part.empty() || part == "step") {
    std::printf("\ndsa_decode_step, GLM-5 TP8 (8 heads, 32 indexer heads fp8 q, top-k 2048, fp8 index keys, "
                "fp8_ds_mla cache); us per call from a CUDA graph replayed back to back, unless cold; 3 ops: "
                "indexer_topk + positions_to_slots + sparse_mla as separate calls; step unsorted: sorted = false "
                "(graph); counted: the scores counting the top-k's histograms and the top-k reading them; step cntd: the "
                "step's kernels that way (off in the library: slower; graph); sc grouped / sc one: the scores with grouped "
                "tokens forced (the CTAs of up to 4 tokens of one request sharing their key tiles) / one token a CTA "
                "forced (scores: as the ops choose); unsrt L2 0 / sc L2 0 / attn L2 0: the step unsorted / the scores / "
                "the attention, each call after a write of twice the L2 (as each layer's step of a model finds its "
                "caches; graph, less the writes alone); "
                "fewer reqs than tokens: consecutive positions of each request (multi-token decode)\n");
    std::printf("%6s %7s %5s %9s %9s %9s %9s %9s %9s %9s %9s %12s %9s %9s %9s %10s %9s %9s %9s\n", "tokens",
                "context", "reqs", "scores", "top-k", "attention", "3 ops", "step", "cold step", "unsorted",
                "unsrt L2 0", "tok/s 78 L", "sc count", "tk counted", "step cntd", "sc grouped", "sc one", "sc L2 0",
                "attn L2 0");
    StepCaches caches;
    if (argc >= 4) {  // one config: TOKENS CONTEXT [TOKENS_PER_REQUEST]
      bench_step(caches, std::atoi(argv[2]), std::atoi(argv[3]), argc >= 5 ? std::atoi(argv[4]) : 1);
      return write_json(json_path, prop, c);
    }
    for (int context : {8192, 131072}) {
      for (int tokens : {1, 8}) bench_step(caches, tokens, context);
      bench_step(caches, 8, context, 8);   // one request's 8 tokens
      bench_step(caches, 16, context, 2);  // 8 requests of 2 (one draft token each)
    }
  }
  return write_json(json_path, prop, c);
}
