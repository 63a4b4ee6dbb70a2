// Internals of the CPU indexer, exposed for tests and benchmarks: the
// instruction-set choice and the exact top-k selection.
#pragma once

#include <bit>
#include <cstdint>
#include <optional>

namespace smla::cpu::indexer {

// Scoring kernels: AVX-512 (with BF16 dot products), AVX2+FMA, or portable C++.
enum class Isa { portable, avx2, avx512 };
const char* isa_name(Isa isa);
// The best kernel this CPU can run.
Isa best_isa();
bool isa_supported(Isa isa);
// The kernel indexer_topk uses: best_isa() unless forced. Forcing is for
// tests and benchmarks (not thread-safe against concurrent indexer calls);
// forcing an unsupported Isa throws smla::Error.
Isa active_isa();
void force_isa(std::optional<Isa> isa);

// Monotone map of a score to an unsigned key: a > b (as floats) iff key(a) >
// key(b); -0 and +0 share a key, so they tie.
inline uint32_t order_key(float score) {
  const uint32_t u = std::bit_cast<uint32_t>(score + 0.0f);  // -0 + 0 = +0
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Writes the positions of the min(k, n) largest keys of keys[0, n) to out,
// largest first, equal keys by ascending position; out[min(k, n), k) = -1.
// Exact and never sorts the whole row: keys under a floor estimated from a
// sample are dropped in one pass, a radix select finds the m-th largest of
// the rest, and only the m survivors are (radix) sorted.
void select_topk(const uint32_t* keys, int64_t n, int64_t k, int32_t* out);

}  // namespace smla::cpu::indexer
