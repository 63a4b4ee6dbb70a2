// CPU indexer_topk at decode: T tokens, each of its own request with `context`
// cached keys, K = 2048, block size 64 with shuffled blocks. Prints µs per
// call, GB/s of index-cache bytes read, that as a share of the read bandwidth
// measured in the same run (before and after the table; the larger is used),
// GFLOP/s (2 * H_I * 128 per token and position) as a share of this CPU's
// bf16 dot-product peak (also measured here), and the top-k selection alone
// (on random keys, spread over tokens as the op does).
//
//   bench_cpu_indexer [scalar|avx2|avx512|avx512_bf16] [quick]
// (pins an instruction set, at most the detected one, whose scoring kernel runs:
// portable for scalar, AVX2 for avx2 and avx512, AVX-512 BF16 for avx512_bf16;
// default: the detected set; quick: T = 1 only)
#include <omp.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "core/random.h"
#include "cpu/indexer.h"
#include "cpu/indexer_scores.h"
#include "cpu/isa.h"
#include "cpu/memory_bandwidth.h"
#include "smla/ops.h"

namespace {

using namespace smla;
using Clock = std::chrono::steady_clock;

constexpr int64_t kBlockSize = 64, kTopk = 2048;
constexpr int64_t kMaxTokens = 16, kMaxContext = 128 * 1024;

// A cache of kMaxTokens * kMaxContext keys: random bf16 in (-1, 1), or random
// non-NaN e4m3 bytes with power-of-two scales.
std::vector<uint8_t> make_cache(DType dtype) {
  const int64_t blocks = kMaxTokens * kMaxContext / kBlockSize;
  const int64_t row = dtype == DType::bf16 ? 256 : kFp8IndexRowBytes;
  std::vector<uint8_t> bytes(blocks * kBlockSize * row);
  Xorshift64 rng(0x9e3779b97f4a7c15ull);
  if (dtype == DType::bf16) {
    for (size_t i = 0; i < bytes.size(); i += 2) {
      const uint16_t bits = numeric::float_to_bf16(static_cast<float>(rng.next() % 2001) / 1000.f - 1.f);
      std::memcpy(&bytes[i], &bits, 2);
    }
    return bytes;
  }
  for (int64_t b = 0; b < blocks; ++b) {
    uint8_t* block = bytes.data() + b * kBlockSize * row;
    for (int64_t i = 0; i < kBlockSize * 128; ++i) block[i] = static_cast<uint8_t>(rng.next() % 0x7e) | (rng.next() & 0x80);
    for (int64_t i = 0; i < kBlockSize; ++i) {
      const float scale = std::ldexp(1.f, -8 - static_cast<int>(rng.next() % 3));
      std::memcpy(block + kBlockSize * 128 + i * 4, &scale, 4);
    }
  }
  return bytes;
}

#if defined(__x86_64__)
// GFLOP/s of back-to-back VDPBF16PS (2 * 32 flops each), the ceiling of the
// AVX-512 kernel whose inner loop is nothing else: one thread's best of three
// runs times the thread count (the units are per core; one thread measures
// them without waiting on a core another process holds).
__attribute__((target("avx512f,avx512bf16"))) double dpbf16_peak_gflops() {
  constexpr long kIters = 10'000'000;
  double best = 0;
  for (int run = 0; run < 3; ++run) {
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
    __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3c00);
    const auto t0 = Clock::now();
    for (long it = 0; it < kIters; ++it) {
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
      asm volatile("" : "+v"(a));  // keeps the loop from being folded
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    float sum = 0;
    for (int i = 0; i < 16; ++i) sum += _mm512_reduce_add_ps(acc[i]);
    if (sum == 1.f) std::printf(" ");  // keeps the results live
    best = std::max(best, kIters * 16 * 64.0 / seconds / 1e9);
  }
  return best * omp_get_max_threads();
}
#endif

template <class F>
double best_seconds(F&& f) {
  f();  // warm up: scratch buffers grow, pages fault in
  double best = 1e30, total = 0;
  for (int rep = 0; rep < 20 && (rep < 3 || total < 0.5); ++rep) {
    const auto t0 = Clock::now();
    f();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    best = std::min(best, s);
    total += s;
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string isa = argc > 1 ? argv[1] : "";
  const bool quick = argc > 2 && std::string(argv[2]) == "quick";
  if (!isa.empty()) cpu::force_isa(cpu::isa_from_name(isa));
  double bandwidth = cpu::measure_read_bandwidth_gbs();
  double peak = 0;
#if defined(__x86_64__)
  if (cpu::isa_supported(cpu::Isa::avx512_bf16)) peak = dpbf16_peak_gflops();
#endif
  std::printf("threads %d, isa %s (scoring kernel: %s's), read bandwidth %.1f GB/s, bf16 dot peak %.0f GFLOP/s\n",
              omp_get_max_threads(), std::string(cpu::isa_name(cpu::active_isa())).c_str(),
              std::string(cpu::isa_name(cpu::indexer::score_kernel_isa(cpu::active_isa()))).c_str(), bandwidth, peak);
  std::printf("K = %lld, block size %lld, one request per token\n\n", static_cast<long long>(kTopk),
              static_cast<long long>(kBlockSize));
  std::printf("| cache | H_I | T | context | µs/call | GB/s | %% of bw | GFLOP/s | %% of peak | top-k µs |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  struct Row {
    const char* cache;
    int64_t heads, tokens, context;
    double seconds, topk_seconds;
  };
  std::vector<Row> rows;

  std::mt19937_64 rng(1);
  for (DType cache_dtype : {DType::bf16, DType::fp8_e4m3}) {
    std::vector<uint8_t> cache = make_cache(cache_dtype);
    const int64_t blocks = kMaxTokens * kMaxContext / kBlockSize;
    const int64_t row = cache_dtype == DType::bf16 ? 128 : kFp8IndexRowBytes;
    std::vector<int32_t> ids(blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    const TensorView cache_view(cache.data(), {blocks, kBlockSize, row}, cache_dtype);
    for (int64_t heads : {32, 64})
      for (int64_t tokens : {1, 4, 16}) {
        if (quick && tokens > 1) break;
        for (int64_t context : {8 * 1024, 32 * 1024, 128 * 1024}) {
          const int64_t max_blocks = context / kBlockSize;
          std::vector<int32_t> table(ids.begin(), ids.begin() + tokens * max_blocks), request_ids(tokens),
              context_lens(tokens, static_cast<int32_t>(context)), topk(tokens * kTopk);
          std::iota(request_ids.begin(), request_ids.end(), 0);
          std::vector<uint16_t> q(tokens * heads * 128);
          for (auto& v : q) v = numeric::float_to_bf16(static_cast<float>(rng() % 2001) / 1000.f - 1.f);
          std::vector<float> weights(tokens * heads);
          for (auto& w : weights) w = static_cast<float>(rng() % 2001) / 1000.f - 1.f;

          IndexerTopkArgs a;
          a.q = TensorView(q.data(), {tokens, heads, 128}, DType::bf16);
          a.weights = TensorView(weights.data(), {tokens, heads}, DType::f32);
          a.index_cache = cache_view;
          a.request_ids = TensorView(request_ids.data(), {tokens}, DType::i32);
          a.block_table = TensorView(table.data(), {tokens, max_blocks}, DType::i32);
          a.context_lens = TensorView(context_lens.data(), {tokens}, DType::i32);
          a.topk = TensorView(topk.data(), {tokens, kTopk}, DType::i32);
          const double seconds = best_seconds([&] { indexer_topk(a); });

          // The selection alone, distributed over tokens as the op does it.
          std::vector<uint32_t> keys(tokens * context);
          for (auto& k : keys) k = cpu::indexer::order_key(static_cast<float>(rng() % 1000000) * 1e-3f);
          const double topk_seconds = best_seconds([&] {
#pragma omp parallel for schedule(dynamic, 1)
            for (int64_t t = 0; t < tokens; ++t)
              cpu::indexer::select_topk(keys.data() + t * context, context, kTopk, topk.data() + t * kTopk);
          });

          rows.push_back({cache_dtype == DType::bf16 ? "bf16" : "fp8", heads, tokens, context, seconds, topk_seconds});
        }
      }
  }
  // Bandwidth again after the runs; the larger reading is the ceiling.
  bandwidth = std::max(bandwidth, cpu::measure_read_bandwidth_gbs());
  for (const Row& r : rows) {
    const double bytes = static_cast<double>(r.tokens * r.context) * (std::string(r.cache) == "bf16" ? 256 : 132);
    const double gflops = 2.0 * r.heads * 128 * r.tokens * r.context / r.seconds / 1e9;
    std::printf("| %s | %lld | %lld | %lldK | %.0f | %.1f | %.0f%% | %.0f | %.0f%% | %.0f |\n", r.cache,
                static_cast<long long>(r.heads), static_cast<long long>(r.tokens),
                static_cast<long long>(r.context / 1024), r.seconds * 1e6, bytes / r.seconds / 1e9,
                100 * bytes / r.seconds / 1e9 / bandwidth, gflops, peak > 0 ? 100 * gflops / peak : 0.0,
                r.topk_seconds * 1e6);
  }
  std::printf("\nread bandwidth used for %% of bw: %.1f GB/s (larger of before and after)\n", bandwidth);
  return 0;
}
