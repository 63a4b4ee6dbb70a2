// Measures this machine's memory read bandwidth, the ceiling the CPU kernels
// are compared against (benchmarks and `smla run` print both in one run).
#pragma once

#include <cstddef>

namespace smla::cpu {

// Best-of-`repeats` GB/s (1e9 bytes/s) of all threads reading a `bytes`-sized
// buffer that does not fit in cache.
double measure_read_bandwidth_gbs(size_t bytes = size_t{512} << 20, int repeats = 5);

}  // namespace smla::cpu
