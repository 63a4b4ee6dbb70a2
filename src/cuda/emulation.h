// Emulated-arch test mode: SMLA_CUDA_EMULATE=sm_80|sm_86|sm_89|sm_100|sm_120 makes the CUDA backend's launch code
// see that arch (compute capability, shared memory per block and per SM, resident threads and CTAs per SM) on the
// GPU it runs on, so a Hopper GPU executes the tiles, pipeline depths, splits and instruction choices of the others:
// mma.sync only, never wgmma (sm_90 only); e4m3 mma.sync where SM89 and SM12x take it; and for sm_100 and sm_120, as
// for every arch from 9.0 on, the top-k's thread block clusters (up to 16 and 8 CTAs), the small-heads kernel's bulk
// row copies and programmatic dependent launches, none of which sm_80/86/89 get. A test mode, never for serving: the
// device code that runs is the running GPU's build, so numerics of native e4m3 sums and speed are the running
// GPU's (docs/gpu-testing.md, "Emulated archs"). Plain C++ (no CUDA), so the CPU tests check it.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace smla::cuda {

inline constexpr const char* kEmulateEnv = "SMLA_CUDA_EMULATE";

// What the launch code reads of an arch: the CUDA programming guide's "Technical Specifications per Compute
// Capability", with the largest shared-memory carveout.
struct ArchLimits {
  int compute_capability = 0;  // major*10 + minor
  int max_smem_per_block = 0;  // opt-in limit, bytes
  int max_smem_per_sm = 0;     // bytes
  int max_threads_per_sm = 0;
  int max_ctas_per_sm = 0;
  int max_cluster_ranks = 1;  // CTAs per thread block cluster, at most: 1 below SM90, 8 (portable), 16 (non-portable)
};

// The limits of the arch named `name` ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120"); an Error naming the
// known archs otherwise.
ArchLimits arch_limits(std::string_view name);
// Why a GPU with limits `native` cannot stand in for `emulated` (an instruction it lacks, less shared memory, fewer
// resident threads or CTAs per SM); empty when it can.
std::string emulation_refusal(const ArchLimits& emulated, const ArchLimits& native);
// The arch to emulate for the environment value `value` (null or empty: the mode is off) on a GPU with limits
// `native`: an Error when the value names no arch the mode emulates or the GPU cannot stand in for it.
std::optional<ArchLimits> emulated_arch(const char* value, const ArchLimits& native);

}  // namespace smla::cuda
