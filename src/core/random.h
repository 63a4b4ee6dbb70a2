// The one seeded generator smla uses for random weights, the CLI's job data
// and the benchmarks' inputs: Marsaglia's xorshift64, fast enough to fill
// gigabytes and the same sequence on every platform.
#pragma once

#include <cstdint>

namespace smla {

class Xorshift64 {
 public:
  // The generator for a user-facing seed: seeds 0, 1, 2, ... map to states
  // far apart, none of them 0 (a state xorshift would keep forever).
  static Xorshift64 seeded(uint64_t seed) { return Xorshift64(seed * 0x9e3779b97f4a7c15ull + 1); }
  // Starts from `state` as it is (must be nonzero).
  explicit Xorshift64(uint64_t state) : state_(state) {}

  uint64_t next() {
    state_ ^= state_ << 13;
    state_ ^= state_ >> 7;
    state_ ^= state_ << 17;
    return state_;
  }
  // Uniform in [-1, 1) on a grid of 2^-23, from the top 24 bits of next().
  float symmetric() { return static_cast<float>(next() >> 40) * 0x1p-23f - 1.f; }

 private:
  uint64_t state_;
};

}  // namespace smla
