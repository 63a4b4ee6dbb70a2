// The emulated-arch test mode's table and refusals (cuda/emulation.h): pure functions, no GPU.
#include <gtest/gtest.h>

#include <string>

#include "cuda/emulation.h"
#include "smla/error.h"

namespace smla::cuda {
namespace {

const ArchLimits kH200 = arch_limits("sm_90");

// The message of the Error `f` throws, with its kind checked; fails when it throws none.
template <class F>
std::string error_of(F f, ErrorKind kind) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(static_cast<int>(e.kind()), static_cast<int>(kind)) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return {};
}

TEST(Emulation, ArchLimitsFromTheProgrammingGuide) {
  const ArchLimits a100 = arch_limits("sm_80");
  EXPECT_EQ(a100.compute_capability, 80);
  EXPECT_EQ(a100.max_smem_per_block, 163 * 1024);
  EXPECT_EQ(a100.max_smem_per_sm, 164 * 1024);
  EXPECT_EQ(a100.max_threads_per_sm, 2048);
  for (const char* name : {"sm_86", "sm_89", "sm_120"}) {
    SCOPED_TRACE(name);
    const ArchLimits a = arch_limits(name);
    EXPECT_EQ(a.max_smem_per_block, 99 * 1024);
    EXPECT_EQ(a.max_smem_per_sm, 100 * 1024);
    EXPECT_EQ(a.max_threads_per_sm, 1536);
  }
  EXPECT_EQ(arch_limits("sm_86").max_ctas_per_sm, 16);
  EXPECT_EQ(arch_limits("sm_89").max_ctas_per_sm, 24);
  EXPECT_EQ(arch_limits("sm_120").max_ctas_per_sm, 32);
  EXPECT_EQ(arch_limits("sm_120").compute_capability, 120);
  EXPECT_EQ(kH200.max_smem_per_block, 227 * 1024);
  // CTAs per cluster: none before SM90, non-portable 16 on Hopper, the portable 8 on SM120.
  for (const char* name : {"sm_80", "sm_86", "sm_89"}) EXPECT_EQ(arch_limits(name).max_cluster_ranks, 1) << name;
  EXPECT_EQ(kH200.max_cluster_ranks, 16);
  EXPECT_EQ(arch_limits("sm_120").max_cluster_ranks, 8);
  EXPECT_NE(error_of([] { arch_limits("sm_75"); }, ErrorKind::invalid_argument).find("sm_80, sm_86"),
            std::string::npos);
}

TEST(Emulation, OffUnlessSet) {
  EXPECT_FALSE(emulated_arch(nullptr, kH200).has_value());
  EXPECT_FALSE(emulated_arch("", kH200).has_value());
}

TEST(Emulation, HopperStandsInForEveryOtherArch) {
  for (const char* name : {"sm_80", "sm_86", "sm_89", "sm_100", "sm_120"}) {
    SCOPED_TRACE(name);
    const std::optional<ArchLimits> e = emulated_arch(name, kH200);
    ASSERT_TRUE(e.has_value());
    EXPECT_EQ(e->compute_capability, arch_limits(name).compute_capability);
    EXPECT_EQ(e->max_smem_per_block, arch_limits(name).max_smem_per_block);
    EXPECT_EQ(emulation_refusal(*e, kH200), "");
  }
}

TEST(Emulation, UnknownValuesAreErrorsNamingTheChoices) {
  for (const char* bad : {"sm_90", "sm_101", "sm86", "86", "SM_86", "sm_86 ", "1", "sm_75"}) {
    SCOPED_TRACE(bad);
    const std::string what = error_of([&] { emulated_arch(bad, kH200); }, ErrorKind::invalid_argument);
    EXPECT_NE(what.find("SMLA_CUDA_EMULATE"), std::string::npos) << what;
    EXPECT_NE(what.find("sm_80, sm_86, sm_89, sm_100, sm_120"), std::string::npos) << what;
    EXPECT_NE(what.find(std::string("'") + bad + "'"), std::string::npos) << what;
  }
}

TEST(Emulation, RefusesWhatTheRunningGpuCannotStandInFor) {
  struct Case {
    const char* emulated;
    ArchLimits native;
    const char* why;
  };
  const Case cases[] = {
      // An A100 lacks e4m3 mma.sync, which sm_89 and sm_120 choose.
      {"sm_89", arch_limits("sm_80"), "no e4m3 mma.sync"},
      {"sm_120", arch_limits("sm_80"), "no e4m3 mma.sync"},
      {"sm_120", arch_limits("sm_86"), "no e4m3 mma.sync"},
      // 99 KB per block cannot hold sm_80's 163 KB tiles.
      {"sm_80", arch_limits("sm_120"), "bytes of shared memory per block"},
      {"sm_80", arch_limits("sm_89"), "bytes of shared memory per block"},
      // An RTX 5090 keeps 1536 threads per SM: sm_80's occupancy of 2048 cannot be reproduced.
      {"sm_80", {120, 232448, 233472, 1536, 32}, "resident threads per SM"},
      // sm_120's 32 CTAs per SM on an sm_89 (24).
      {"sm_120", arch_limits("sm_89"), "resident CTAs per SM"},
      {"sm_86", {86, 101376, 65536, 1536, 16}, "bytes of shared memory per SM"},
      {"sm_80", {75, 65536, 65536, 1024, 16}, "older than sm_80"},
      // sm_100's 227 KB per block: only a Hopper (or an SM100) stands in for it.
      {"sm_100", arch_limits("sm_80"), "bytes of shared memory per block"},
      {"sm_100", arch_limits("sm_120"), "bytes of shared memory per block"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.emulated) + " on sm_" + std::to_string(c.native.compute_capability));
    EXPECT_NE(emulation_refusal(arch_limits(c.emulated), c.native).find(c.why), std::string::npos)
        << emulation_refusal(arch_limits(c.emulated), c.native);
    const std::string what = error_of([&] { emulated_arch(c.emulated, c.native); }, ErrorKind::unsupported);
    EXPECT_NE(what.find(c.why), std::string::npos) << what;
    EXPECT_NE(what.find(std::string("SMLA_CUDA_EMULATE=") + c.emulated), std::string::npos) << what;
  }
  // What it can: sm_86 on an A100 (more of everything), sm_89 on an RTX 5090, itself on its own arch.
  EXPECT_TRUE(emulated_arch("sm_86", arch_limits("sm_80")).has_value());
  EXPECT_TRUE(emulated_arch("sm_89", arch_limits("sm_120")).has_value());
  EXPECT_TRUE(emulated_arch("sm_120", arch_limits("sm_120")).has_value());
}

}  // namespace
}  // namespace smla::cuda
