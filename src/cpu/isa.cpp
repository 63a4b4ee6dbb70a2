#include "cpu/isa.h"

#include <atomic>
#include <string>

#include "smla/error.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace smla::cpu {

namespace {

Isa detect() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  unsigned eax, ebx, ecx, edx;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C);
  const bool avx2 = f16c && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (avx512 && __builtin_cpu_supports("avx512bf16")) return Isa::avx512_bf16;
  if (avx512) return Isa::avx512;
  if (avx2) return Isa::avx2;
#endif
  return Isa::scalar;
}

std::atomic<int> forced_isa{-1};

}  // namespace

std::string_view isa_name(Isa isa) {
  switch (isa) {
    case Isa::scalar: return "scalar";
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
    case Isa::avx512_bf16: return "avx512_bf16";
  }
  return "?";
}

Isa isa_from_name(std::string_view name) {
  for (Isa isa : kAllIsas)
    if (isa_name(isa) == name) return isa;
  fail("instruction set '" + std::string(name) + "': expected scalar, avx2, avx512 or avx512_bf16");
}

Isa detected_isa() {
  static const Isa isa = detect();
  return isa;
}

bool isa_supported(Isa isa) { return isa <= detected_isa(); }

void force_isa(std::optional<Isa> isa) {
  if (isa && !isa_supported(*isa))
    throw Error(ErrorKind::unsupported, "instruction set " + std::string(isa_name(*isa)) + ": this CPU supports up to " +
                                            std::string(isa_name(detected_isa())));
  forced_isa.store(isa ? static_cast<int>(*isa) : -1, std::memory_order_relaxed);
}

Isa active_isa() {
  const int forced = forced_isa.load(std::memory_order_relaxed);
  return forced < 0 ? detected_isa() : static_cast<Isa>(forced);
}

}  // namespace smla::cpu
