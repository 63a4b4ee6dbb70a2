// The CPU instruction-set choice (cpu/isa.h): names, pinning, and the kernels
// attention and the indexer take from it.
#include "cpu/isa.h"

#include <gtest/gtest.h>

#include <optional>
#include <string>

#include "cpu/attention_kernels.h"
#include "cpu/indexer_scores.h"
#include "smla/error.h"
#include "support/test_util.h"

namespace smla {
namespace {

using cpu::Isa;

// Restores the detected set when a test ends, whatever it pinned.
struct Unpin {
  ~Unpin() { cpu::force_isa(std::nullopt); }
};

TEST(CpuIsa, NamesRoundTrip) {
  for (Isa isa : cpu::kAllIsas) EXPECT_EQ(cpu::isa_from_name(cpu::isa_name(isa)), isa);
  test::expect_error([] { cpu::isa_from_name("avx512bf16"); }, ErrorKind::invalid_argument,
                     {"instruction set 'avx512bf16'", "expected scalar, avx2, avx512 or avx512_bf16"});
}

// Every set up to the detected one can be pinned and is then the active one;
// a set above it is an unsupported error naming both and changes nothing.
TEST(CpuIsa, ForcePinsSupportedSetsAndRefusesOthers) {
  Unpin unpin;
  const Isa detected = cpu::detected_isa();
  EXPECT_EQ(cpu::active_isa(), detected);
  for (Isa isa : cpu::kAllIsas) {
    SCOPED_TRACE(std::string(cpu::isa_name(isa)));
    cpu::force_isa(Isa::scalar);
    if (isa <= detected) {
      EXPECT_TRUE(cpu::isa_supported(isa));
      cpu::force_isa(isa);
      EXPECT_EQ(cpu::active_isa(), isa);
    } else {
      EXPECT_FALSE(cpu::isa_supported(isa));
      test::expect_error([&] { cpu::force_isa(isa); }, ErrorKind::unsupported,
                         {"instruction set " + std::string(cpu::isa_name(isa)),
                          "this CPU supports up to " + std::string(cpu::isa_name(detected))});
      EXPECT_EQ(cpu::active_isa(), Isa::scalar);
    }
  }
  cpu::force_isa(std::nullopt);
  EXPECT_EQ(cpu::active_isa(), detected);
}

// Attention has a kernel per set; the indexer's scoring kernel is the best of
// its own sets that the pinned one includes.
TEST(CpuIsa, KernelsFollowThePinnedSet) {
  Unpin unpin;
  for (Isa isa : cpu::kAllIsas) {
    if (!cpu::isa_supported(isa)) continue;
    SCOPED_TRACE(std::string(cpu::isa_name(isa)));
    cpu::force_isa(isa);
#if defined(__x86_64__)
    EXPECT_EQ(cpu::attn::active_kernels().name, cpu::isa_name(isa));
#endif
    EXPECT_EQ(&cpu::indexer::score_kernel(cpu::active_isa()),
              &cpu::indexer::score_kernel(cpu::indexer::score_kernel_isa(isa)));
  }
  // AVX-512 without BF16 has no scoring kernel of its own: AVX2's runs.
  EXPECT_EQ(cpu::indexer::score_kernel_isa(Isa::avx512), Isa::avx2);
  for (Isa isa : cpu::indexer::kScoreKernelIsas) EXPECT_EQ(cpu::indexer::score_kernel_isa(isa), isa);
#if defined(__x86_64__)
  EXPECT_NE(&cpu::indexer::score_kernel(Isa::scalar), &cpu::indexer::score_kernel(Isa::avx2));
  EXPECT_NE(&cpu::indexer::score_kernel(Isa::avx2), &cpu::indexer::score_kernel(Isa::avx512_bf16));
#endif
  EXPECT_EQ(&cpu::indexer::score_kernel(Isa::avx512), &cpu::indexer::score_kernel(Isa::avx2));
}

}  // namespace
}  // namespace smla
