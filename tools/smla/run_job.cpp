#include "run_job.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>

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

DType index_cache_dtype(DType kv_cache) { return kv_cache == DType::fp8_ds_mla ? DType::fp8_e4m3 : DType::bf16; }
int index_row_bytes(DType d) { return d == DType::bf16 ? 2 * kIndexHeadDim : kFp8IndexRowBytes; }
int mla_row_bytes(DType d) { return d == DType::fp8_ds_mla ? kFp8DsMlaRowBytes : 2 * kMlaQkDim; }

}  // namespace smla::cli
