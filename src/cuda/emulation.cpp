#include "cuda/emulation.h"

#include <iterator>

#include "smla/error.h"

namespace smla::cuda {

namespace {

struct NamedArch {
  const char* name;
  ArchLimits limits;
  bool emulated;  // the test mode offers it (Hopper is the GPU it runs on, not an arch it stands in for)
};
// The CUDA programming guide's table: opt-in shared memory per block, shared memory per SM, resident threads and
// CTAs per SM; and CTAs per cluster (none before SM90; 8 portable, 16 on the data-center GPUs that allow non-portable
// sizes: on a real GPU the driver's answer counts, this only for an emulated arch).
constexpr NamedArch kArchs[] = {
    {"sm_80", {80, 166912, 167936, 2048, 32, 1}, true},   // A100: 163 KB per block, 164 KB per SM
    {"sm_86", {86, 101376, 102400, 1536, 16, 1}, true},   // RTX 30xx, A10, A40: 99 KB, 100 KB
    {"sm_89", {89, 101376, 102400, 1536, 24, 1}, true},   // RTX 40xx, L4, L40S
    {"sm_90", {90, 232448, 233472, 2048, 32, 16}, false},  // H100, H200: 227 KB, 228 KB
    {"sm_100", {100, 232448, 233472, 2048, 32, 16}, true},  // B200: Hopper's limits, no wgmma (no tcgen05 in smla)
    {"sm_120", {120, 101376, 102400, 1536, 32, 8}, true},  // RTX 50xx, RTX PRO 6000 Blackwell
};

std::string arch_name(int cc) { return "sm_" + std::to_string(cc); }

std::string emulated_names() {
  std::string s;
  for (const NamedArch& a : kArchs)
    if (a.emulated) s += (s.empty() ? "" : ", ") + std::string(a.name);
  return s;
}

const NamedArch* find(std::string_view name) {
  for (const NamedArch& a : kArchs)
    if (name == a.name) return &a;
  return nullptr;
}

}  // namespace

ArchLimits arch_limits(std::string_view name) {
  if (const NamedArch* a = find(name)) return a->limits;
  std::string known;
  for (const NamedArch& a : kArchs) known += (known.empty() ? "" : ", ") + std::string(a.name);
  throw Error(ErrorKind::invalid_argument, "arch '" + std::string(name) + "' is none of " + known);
}

std::string emulation_refusal(const ArchLimits& emulated, const ArchLimits& native) {
  const std::string running = "the running GPU (" + arch_name(native.compute_capability) + ")";
  if (native.compute_capability < 80) return running + " is older than sm_80, the oldest arch smla runs on";
  // Instructions: e4m3 mma.sync (sm_89, sm_120) is checked, GPUs before 8.9 lack it; wgmma is never chosen for an
  // emulated arch. sm_100 and sm_120 also take what every arch from 9.0 on does (clusters, bulk copies,
  // programmatic dependent launches), unchecked here: sm_100's 227 KB a block and sm_120's e4m3 mma.sync with 32
  // resident CTAs per SM (an SM89 has 24) leave only GPUs of 9.0 on to stand in for them.
  const bool fp8_mma = emulated.compute_capability == 89 || emulated.compute_capability / 10 == 12;
  if (fp8_mma && native.compute_capability < 89)
    return running + " has no e4m3 mma.sync, which " + arch_name(emulated.compute_capability) + " runs (sm_89 on)";
  auto less = [&](const char* what, int have, int need) {
    return running + " has " + std::to_string(have) + " " + what + ", " + arch_name(emulated.compute_capability) +
           " " + std::to_string(need);
  };
  if (native.max_smem_per_block < emulated.max_smem_per_block)
    return less("bytes of shared memory per block", native.max_smem_per_block, emulated.max_smem_per_block);
  if (native.max_smem_per_sm < emulated.max_smem_per_sm)
    return less("bytes of shared memory per SM", native.max_smem_per_sm, emulated.max_smem_per_sm);
  if (native.max_threads_per_sm < emulated.max_threads_per_sm)
    return less("resident threads per SM", native.max_threads_per_sm, emulated.max_threads_per_sm);
  if (native.max_ctas_per_sm < emulated.max_ctas_per_sm)
    return less("resident CTAs per SM", native.max_ctas_per_sm, emulated.max_ctas_per_sm);
  return {};
}

std::optional<ArchLimits> emulated_arch(const char* value, const ArchLimits& native) {
  if (value == nullptr || *value == '\0') return std::nullopt;
  const NamedArch* a = find(value);
  if (a == nullptr || !a->emulated)
    throw Error(ErrorKind::invalid_argument, std::string(kEmulateEnv) + " (a test mode): expected one of " +
                                                 emulated_names() + ", got '" + value + "'");
  if (const std::string why = emulation_refusal(a->limits, native); !why.empty())
    throw Error(ErrorKind::unsupported, std::string(kEmulateEnv) + "=" + value + ": " + why + ": it cannot stand in");
  return a->limits;
}

}  // namespace smla::cuda
