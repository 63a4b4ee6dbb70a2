// Internals of the CPU indexer, exposed for tests and benchmarks: the exact
// top-k selection. Its scoring kernel follows cpu::active_isa() (cpu/isa.h).
#pragma once

#include <bit>
#include <cstdint>

namespace smla::cpu::indexer {

// Monotone map of a score to an unsigned key: a > b (as floats) iff key(a) >
// key(b); -0 and +0 share a key, so they tie.
inline uint32_t order_key(float score) {
  const uint32_t u = std::bit_cast<uint32_t>(score + 0.0f);  // -0 + 0 = +0
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Writes the positions of the min(k, n) largest keys of keys[0, n) to out,
// largest first, equal keys by ascending position (sorted = false: the same
// positions in ascending order); out[min(k, n), k) = -1.
// Exact and never sorts the whole row: keys under a floor estimated from a
// sample are dropped in one pass, a radix select finds the m-th largest of
// the rest, and only the m survivors are (radix) sorted, if sorted.
void select_topk(const uint32_t* keys, int64_t n, int64_t k, int32_t* out, bool sorted = true);

}  // namespace smla::cpu::indexer
