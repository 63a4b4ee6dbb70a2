// What `smla run`'s two jobs share: their options, random data, timers, progress and the bytes a cache row takes.
// run_ops.cpp runs the attention ops alone (the default job), run_layer.cpp the whole layer (--layer).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "core/random.h"
#include "memory.h"
#include "options.h"
#include "smla/backend.h"

namespace smla::cli {

struct JobOptions {
  CommonOptions common;
  bool model_given = false;  // --model on the command line (not its default)
  int batch = 32;
  int context = 8192;
  int steps = 64;
  uint64_t seed = 1;
  bool layer_job = false;  // --layer given
  int layer = 0;
  std::string weights;  // the layer job's checkpoint (empty: random weights)
  int prompt = 512;     // the layer job's prefill prompt, tokens
};

// Fast deterministic random values in [-1, 1), never exactly zero.
class Random {
 public:
  explicit Random(uint64_t seed) : gen_(Xorshift64::seeded(seed)) {}
  float next() {
    const float v = gen_.symmetric();
    return v == 0.f ? 0x1p-24f : v;
  }
  std::vector<float> floats(size_t n) {
    std::vector<float> v(n);
    for (auto& x : v) x = next();
    return v;
  }
  std::vector<uint16_t> bf16(size_t n) { return half(n, DType::bf16); }
  std::vector<uint16_t> half(size_t n, DType d) {
    std::vector<uint16_t> v(n);
    for (auto& x : v) x = d == DType::bf16 ? numeric::float_to_bf16(next()) : numeric::float_to_f16(next());
    return v;
  }

 private:
  Xorshift64 gen_;
};

using Clock = std::chrono::steady_clock;
inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Seconds `fn` takes, the device's queued work included (Memory::time).
inline double timed(Memory& mem, const std::function<void()>& fn) { return mem.time(fn); }

// Progress on a terminal (one updating bar), plain lines otherwise; nothing when quiet.
class Progress {
 public:
  Progress(int total, bool quiet);
  void update(int done, double step_ms);

 private:
  int total_;
  bool quiet_, tty_;
};

// A tensor's first `n` rows (a staging buffer used for a shorter chunk).
inline TensorView first_rows(TensorView v, int64_t n) {
  v.shape[0] = n;
  return v;
}

// The index cache's type beside a latent cache of type `kv_cache`: fp8_e4m3 beside an fp8 form, else bf16.
DType index_cache_dtype(DType kv_cache);
// Bytes one token's row (or one pool's, for a pooled index cache) takes in the index cache and in the latent cache.
int index_row_bytes(DType index_cache);
int mla_row_bytes(DType kv_cache, MlaHead head = MlaHead{});
// The absorbed head the model's attention ops compute with: 576 or 512 wide (DeepSeek-V4's shared 448 + 64 head,
// like a rope-free one, is 512).
MlaHead spec_head(const AttentionSpec& spec);

// The layer job's self-check prompt, tokens (at most top-k for DSA models).
inline constexpr int kLayerCheckTokens = 16;

// Throws smla::Error naming the options unless the job's caches fit the library's int32 slot numbers and, with the
// layer job's prompt, the device's memory: a clear message instead of an allocation failure deep inside the job.
void check_job_fits(const JobOptions& o, const Resolved& res, const Memory& mem);

// The jobs, after the backend is chosen; each prints its report and returns the exit status (3: the check failed).
int run_ops(const JobOptions& o, const Resolved& res, const Backend& be, Memory& mem);
int run_layer(const JobOptions& o, const Resolved& res, const Backend& be, Memory& mem);

// The layer job's model and run: the spec from --weights (checked against --model when both are given) or --model,
// --layer within the model's layers, a device the layer runs on. Throws smla::Error naming the option at fault.
Resolved resolve_layer_job(const JobOptions& o);

}  // namespace smla::cli
