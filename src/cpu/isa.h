// The instruction sets the CPU kernels are built for: detected once, and
// pinned lower by tests and benchmarks. Attention and the indexer both choose
// their kernels from active_isa().
#pragma once

#include <optional>
#include <string_view>

namespace smla::cpu {

// In increasing order; each set includes the ones before it.
//   avx2:        AVX2, FMA, F16C
//   avx512:      + AVX-512 F, BW, VL, DQ
//   avx512_bf16: + AVX512_BF16
enum class Isa { scalar, avx2, avx512, avx512_bf16 };
inline constexpr Isa kAllIsas[] = {Isa::scalar, Isa::avx2, Isa::avx512, Isa::avx512_bf16};

std::string_view isa_name(Isa isa);
// The set named `name` ("scalar", "avx2", "avx512", "avx512_bf16"); an
// invalid_argument Error listing the names otherwise.
Isa isa_from_name(std::string_view name);

// The best set this CPU (and OS) supports.
Isa detected_isa();
bool isa_supported(Isa isa);

// Pins the kernels to `isa` for tests and benchmarks (not thread-safe against
// concurrent kernel calls); nullopt restores detected_isa(). Pinning a set
// this CPU lacks is an unsupported Error naming it.
void force_isa(std::optional<Isa> isa);
// detected_isa(), or the pinned set.
Isa active_isa();

}  // namespace smla::cpu
