#include "run_job.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <limits>
#include <string>

#include "smla/error.h"

namespace smla::cli {

Progress::Progress(int total, bool quiet) : total_(total), quiet_(quiet), tty_(isatty(STDERR_FILENO)) {}

void Progress::update(int done, double step_ms) {
  if (quiet_) return;
  if (tty_) {
    const int width = 30, filled = width * done / total_;
    std::fprintf(stderr, "\r  [%s%s] step %d/%d  %.2f ms/step", std::string(filled, '#').c_str(),
                 std::string(width - filled, ' ').c_str(), done, total_, step_ms);
    if (done == total_) std::fprintf(stderr, "\n");
  } else if (done == total_ || done % std::max(1, total_ / 8) == 0) {
    std::fprintf(stderr, "  step %d/%d  %.2f ms/step\n", done, total_, step_ms);
  }
}

void check_job_fits(const JobOptions& o, const Resolved& res, const Memory& mem) {
  const int64_t bs = res.run.block_size;
  const auto slots_for = [bs](int64_t tokens) { return (tokens + bs - 1) / bs * bs; };  // whole blocks
  const std::string n = std::to_string(o.batch), c = std::to_string(o.context), s = std::to_string(o.steps);
  std::string what = "--batch " + n + " x (--context " + c + " + --steps " + s + ")";
  int64_t slots = int64_t(o.batch) * slots_for(int64_t(o.context) + o.steps);
  double other_bytes = 0;  // the layer job's prompt in and out (f32 hidden states); the layer itself needs more
  if (o.layer_job) {
    slots += slots_for(o.prompt) + slots_for(kLayerCheckTokens);
    what += " + --prompt " + std::to_string(o.prompt);
    other_bytes = 2.0 * double(o.prompt) * res.spec.hidden_size * sizeof(float);
  }
  // Block tables and slot numbers are int32 (ops.h).
  constexpr int64_t kMaxSlots = std::numeric_limits<int32_t>::max();
  require(slots <= kMaxSlots, what + " needs " + std::to_string(slots) + " cache slots (whole blocks of " +
                                  std::to_string(bs) + "), more than the " + std::to_string(kMaxSlots) +
                                  " that int32 slot numbers reach; lower --batch or --context");
  const DType kv = res.run.resolved_kv_cache_dtype();
  const double row = mla_row_bytes(kv, spec_head(res.spec)) +
                     (res.spec.is_sparse() ? index_row_bytes(index_cache_dtype(kv)) : 0);
  const double bytes = double(slots) * row + other_bytes, have = mem.capacity_bytes();
  const std::string memory = mem.device().is_cpu() ? "host memory" : "GPU memory";
  if (bytes > have) {
    char text[160];
    std::snprintf(text, sizeof text, "%.0f bytes (%.1f GB) of %s, more than the %.1f GB this machine has", bytes,
                  bytes / 1e9, memory.c_str(), have / 1e9);
    fail("out of " + memory + ": " + what + " needs at least " + text + "; lower " +
         (o.layer_job ? "--batch, --context or --prompt" : "--batch or --context"));
  }
}

DType index_cache_dtype(DType kv_cache) {
  return is_fp8_mla_cache(kv_cache) || kv_cache == DType::fp8_ds_mla_v4 ? DType::fp8_e4m3 : DType::bf16;
}
int index_row_bytes(DType d) { return d == DType::bf16 ? 2 * kIndexHeadDim : kFp8IndexRowBytes; }
MlaHead spec_head(const AttentionSpec& spec) {
  const std::optional<MlaHead> head = mla_head_for_qk_dim(spec.absorbed_qk_dim());
  require(head.has_value(), "--model: absorbed head size " + std::to_string(spec.absorbed_qk_dim()) +
                                " is not one the attention ops take (576 or 512)");
  return *head;
}
int mla_row_bytes(DType d, MlaHead head) {
  return static_cast<int>(head.cache_row(d) * (d == DType::bf16 || d == DType::f16 ? 2 : 1));
}

}  // namespace smla::cli
