// CPU sparse MLA decode benchmark: time per call, cache bytes read (valid rows
// x row bytes), that rate as a share of the read bandwidth measured in the
// same run, GFLOP/s (2 * (576 + 512) flops per head per row), and the time of
// the same call when its rows are already in cache (the arithmetic alone).
//
//   bench_cpu_attention [--quick] [--isa scalar|avx2|avx512|avx512_bf16]
//
// --quick: T = 1 only, fewer trials. --isa: pin a lower instruction set (at most the detected one).
//
// The cache holds 256K slots (302 MB bf16, 172 MB fp8), far beyond the L3, and
// every timed call reads a fresh random index set, so rows come from DRAM. Times are the best of 5 trials
// (2 with --quick) of the median call time: on a shared machine other work only adds time.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "cpu/attention_kernels.h"
#include "cpu/isa.h"
#include "cpu/memory_bandwidth.h"
#include "smla/ops.h"

namespace {

using namespace smla;

constexpr int64_t kBlockSize = 64, kNumBlocks = 4096;  // 256K slots
constexpr int64_t kTopk = 2048;
constexpr int32_t kHotSlots = 2048;  // 2.3 MB of bf16 rows: stays in L2 + L3

struct Config {
  int heads;
  int64_t tokens;
  DType cache;
};

std::vector<uint8_t> make_cache(DType dtype, std::mt19937_64& rng) {
  const int64_t slots = kBlockSize * kNumBlocks;
  const int64_t row = dtype == DType::fp8_ds_mla ? kFp8DsMlaRowBytes : kMlaQkDim;  // elements
  std::vector<uint8_t> cache(slots * row * dtype_size(dtype));
  // Written through write_mla_cache in chunks, from random latents.
  constexpr int64_t kChunk = 8192;
  std::vector<float> latent(kChunk * kMlaLatentDim), rope(kChunk * kMlaRopeDim);
  std::vector<int64_t> slot_ids(kChunk);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  for (auto& x : latent) x = dist(rng);
  for (auto& x : rope) x = dist(rng);
  TensorView view(cache.data(), {kNumBlocks, kBlockSize, row}, dtype);
  for (int64_t s0 = 0; s0 < slots; s0 += kChunk) {
    for (int64_t i = 0; i < kChunk; ++i) slot_ids[i] = s0 + i;
    write_mla_cache({TensorView(latent.data(), {kChunk, kMlaLatentDim}, DType::f32),
                     TensorView(rope.data(), {kChunk, kMlaRopeDim}, DType::f32),
                     TensorView(slot_ids.data(), {kChunk}, DType::i64), view});
  }
  return cache;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Seconds per sparse_mla call, cycling through `sets` index sets of [T, K]. The machine may be shared and
// other work only adds time, so this is the best of several trials, each the median of its calls.
double time_call(SparseMlaArgs a, const std::vector<int32_t>& indices, int sets, bool quick) {
  const int64_t tokens = a.q.shape[0];
  int call = 0;
  const auto run = [&] {
    a.indices = TensorView(const_cast<int32_t*>(indices.data()) + (call++ % sets) * tokens * kTopk,
                           {tokens, kTopk}, DType::i32);
    const auto t0 = std::chrono::steady_clock::now();
    sparse_mla(a);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  run();  // warm-up: scratch buffers, page faults
  run();
  double best = 1e30;
  for (int trial = 0; trial < (quick ? 2 : 5); ++trial) {
    std::vector<double> times;
    double total = 0;
    while (times.size() < 3 || (total < (quick ? 0.1 : 0.3) && times.size() < 200)) total += times.emplace_back(run());
    best = std::min(best, median(times));
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--isa") == 0 && i + 1 < argc) {
      cpu::force_isa(cpu::isa_from_name(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: %s [--quick] [--isa scalar|avx2|avx512|avx512_bf16]\n", argv[0]);
      return 2;
    }
  }
  std::mt19937_64 rng(42);
  const double bandwidth = cpu::measure_read_bandwidth_gbs();
  std::printf("kernels: %s; measured read bandwidth: %.1f GB/s; cache %lld slots; topk %lld\n\n",
              std::string(cpu::attn::active_kernels().name).c_str(), bandwidth,
              static_cast<long long>(kBlockSize * kNumBlocks), static_cast<long long>(kTopk));
  std::printf("| heads | T  | cache      | us/call | GB/s  | %% of bw | GFLOP/s | us, rows in cache |\n");
  std::printf("|------:|---:|------------|--------:|------:|--------:|--------:|------------------:|\n");

  for (DType cache_dtype : {DType::bf16, DType::fp8_ds_mla}) {
    std::vector<uint8_t> cache = make_cache(cache_dtype, rng);
    const int64_t row_bytes = cache_dtype == DType::fp8_ds_mla ? kFp8DsMlaRowBytes : 2 * kMlaQkDim;
    const TensorView cache_view(cache.data(), {kNumBlocks, kBlockSize, row_bytes / int64_t(dtype_size(cache_dtype))},
                                cache_dtype);
    for (int heads : {8, 64})
      for (int64_t tokens : {1, 4, 16, 64}) {
        if (quick && tokens > 1) break;
        // Enough distinct index sets that one pass over them reads >= 512 MB: no L3 reuse between calls.
        const int64_t set_bytes = tokens * kTopk * row_bytes;
        const int sets = static_cast<int>(std::clamp<int64_t>((int64_t{512} << 20) / set_bytes, 4, 256));
        std::vector<int32_t> indices(sets * tokens * kTopk);
        std::uniform_int_distribution<int32_t> slot(0, static_cast<int32_t>(kBlockSize * kNumBlocks - 1));
        for (auto& i : indices) i = slot(rng);
        std::vector<uint16_t> q(tokens * heads * kMlaQkDim), out(tokens * heads * kMlaVDim);
        std::uniform_real_distribution<float> dist(-1.f, 1.f);
        for (auto& x : q) x = numeric::float_to_bf16(dist(rng));
        std::vector<float> lse(tokens * heads);
        SparseMlaArgs a;
        a.q = TensorView(q.data(), {tokens, heads, kMlaQkDim}, DType::bf16);
        a.kv_cache = cache_view;
        a.softmax_scale = 0.1352f;
        a.out = TensorView(out.data(), {tokens, heads, kMlaVDim}, DType::bf16);
        a.lse = TensorView(lse.data(), {tokens, heads}, DType::f32);

        const double t = time_call(a, indices, sets, quick);
        // The same call with every row cache-resident (indices within the first kHotSlots slots): its
        // arithmetic alone, the floor the DRAM-bound time would reach if transfers overlapped fully.
        std::vector<int32_t> hot(tokens * kTopk);
        std::uniform_int_distribution<int32_t> hot_slot(0, kHotSlots - 1);
        for (auto& i : hot) i = hot_slot(rng);
        const double t_hot = time_call(a, hot, 1, quick);
        const double bytes = static_cast<double>(tokens * kTopk * row_bytes);
        const double flops = 2.0 * tokens * kTopk * heads * (kMlaQkDim + kMlaVDim);
        std::printf("| %5d | %2lld | %-10s | %7.1f | %5.1f | %6.1f%% | %7.1f | %7.1f |\n", heads,
                    static_cast<long long>(tokens), std::string(dtype_name(cache_dtype)).c_str(), t * 1e6,
                    bytes / t / 1e9, 100.0 * bytes / t / 1e9 / bandwidth, flops / t / 1e9, t_hot * 1e6);
        std::fflush(stdout);
      }
  }
  return 0;
}
