// The emulated-arch test mode (SMLA_CUDA_EMULATE, cuda/emulation.h): `make test-gpu` runs test_gpu once natively
// and once per emulated arch (tests/gpu/CMakeLists.txt). These tests make sure the mode is what the environment
// says and really moves the launch decisions: the device the launch code and the registry see, the shapes forced
// beyond its shared memory, the occupancy of every plan within its limits, and the instructions it may choose.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "cuda/common/runtime.h"
#include "cuda/device_query.h"
#include "cuda/emulation.h"
#include "cuda/kernels.h"
#include "cuda/mla/kernel_choice.h"
#include "gpu/gpu_util.h"
#include "smla/error.h"

namespace smla {
namespace {

constexpr int kReservedSmemPerCta = 1024;  // what the system keeps of each CTA's shared memory (SM80 on)

// The running GPU's own limits, from the driver.
cuda::ArchLimits native_limits() {
  int dev = 0;
  EXPECT_EQ(cudaGetDevice(&dev), cudaSuccess);
  auto attribute = [dev](cudaDeviceAttr what) {
    int v = 0;
    EXPECT_EQ(cudaDeviceGetAttribute(&v, what, dev), cudaSuccess);
    return v;
  };
  return {attribute(cudaDevAttrComputeCapabilityMajor) * 10 + attribute(cudaDevAttrComputeCapabilityMinor),
          attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin), attribute(cudaDevAttrMaxSharedMemoryPerMultiprocessor),
          attribute(cudaDevAttrMaxThreadsPerMultiProcessor), attribute(cudaDevAttrMaxBlocksPerMultiprocessor)};
}

// The emulated arch's name, or empty when the mode is off.
std::string emulated_name() {
  const char* v = std::getenv(cuda::kEmulateEnv);
  return v ? v : "";
}

// Where the running GPU cannot stand in for the arch the mode names (an A100 for sm_89 or sm_120: no e4m3 mma.sync;
// a 99 KB GPU for sm_80: cuda::emulation_refusal), the run's every test is skipped with the reason, and ctest counts
// the entry as skipped (its SKIP_REGULAR_EXPRESSION, tests/gpu/CMakeLists.txt), rather than each test failing on
// the library's refusal.
class EmulationEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    const std::string name = emulated_name();
    cuda::ArchLimits emulated;
    try {
      if (name.empty()) return;
      emulated = cuda::arch_limits(name);
    } catch (const Error&) {
      return;  // no such arch: every test fails on the library's error, which names the archs
    }
    const std::string why = cuda::emulation_refusal(emulated, native_limits());
    if (why.empty()) return;
    std::printf("smla-test: every test skipped: %s=%s: %s\n", cuda::kEmulateEnv, name.c_str(), why.c_str());
    GTEST_SKIP() << why;
  }
};
[[maybe_unused]] ::testing::Environment* const kEmulationEnvironment =
    ::testing::AddGlobalTestEnvironment(new EmulationEnvironment);

TEST(CudaEmulation, DeviceIsWhatTheEnvironmentSays) {
  const cuda::ArchLimits native = native_limits();
  const cuda::DeviceInfo& d = cuda::current_device();
  const std::string name = emulated_name();
  SCOPED_TRACE(name.empty() ? std::string("native") : name);
  const cuda::ArchLimits want = name.empty() ? native : cuda::arch_limits(name);
  EXPECT_EQ(d.compute_capability, want.compute_capability);
  EXPECT_EQ(d.max_smem_per_block, want.max_smem_per_block);
  EXPECT_EQ(d.max_smem_per_sm, want.max_smem_per_sm);
  EXPECT_EQ(d.max_threads_per_sm, want.max_threads_per_sm);
  EXPECT_EQ(d.max_ctas_per_sm, want.max_ctas_per_sm);
  if (!name.empty()) EXPECT_EQ(d.max_cluster_ranks, want.max_cluster_ranks);
  EXPECT_EQ(d.native_compute_capability, name.empty() ? 0 : native.compute_capability);
  // The registry and `explain` see the same arch.
  const std::optional<Device> seen = cuda::device_at(d.index);
  ASSERT_TRUE(seen.has_value());
  EXPECT_EQ(seen->compute_capability, want.compute_capability);
  // Hopper's instructions are for Hopper only.
  if (!name.empty()) EXPECT_FALSE(cuda::wgmma_kernels_available());
}

// Shape-only args (the plans read no data): `tokens` x `heads` queries of 576 (512 for fp8_ds_mla_v4) over top-k
// `topk`.
SparseMlaArgs sparse_shape(DType kv, int tokens, int heads, int topk) {
  const MlaHead head{kv == DType::fp8_ds_mla_v4 ? 0 : kMlaRopeDim};
  SparseMlaArgs a;
  a.q = TensorView(nullptr, {tokens, heads, head.qk_dim()}, DType::bf16);
  a.kv_cache = TensorView(nullptr, {64, 64, static_cast<int64_t>(head.cache_row(kv))}, kv);
  a.indices = TensorView(nullptr, {tokens, topk}, DType::i32);
  return a;
}

// Every plan the attention ops make keeps within the device's limits as the launch code sees them: its shared
// memory per block, and its resident CTAs' shared memory per SM. With the emulation a no-op (the H200's 227 KB
// and up to 4 CTAs of ~50 KB per SM), the 99 KB archs' limits are broken.
TEST(CudaEmulation, PlansKeepToTheDevicesSharedMemory) {
  const cuda::DeviceInfo& d = cuda::current_device();
  int plans = 0;
  for (DType kv : {DType::bf16, DType::f16, DType::fp8_ds_mla, DType::fp8_ds_mla_v4})
    for (cuda::AttentionKernel kernel : {cuda::AttentionKernel::automatic, cuda::AttentionKernel::head_tile,
                                         cuda::AttentionKernel::small_heads, cuda::AttentionKernel::wide_tile})
      for (int heads : {8, 16, 64}) {
        if (kernel == cuda::AttentionKernel::small_heads && heads > 32) continue;
        SCOPED_TRACE(std::string(dtype_name(kv)) + " kernel " + std::to_string(static_cast<int>(kernel)) +
                     " heads " + std::to_string(heads));
        cuda::AttentionPlan plan;
        try {
          plan = cuda::sparse_mla_plan(sparse_shape(kv, 64, heads, 2048), {kernel});
        } catch (const Error& e) {
          // Only a forced small-heads kernel (16-bit rows, or 16 heads per CTA, on the 99 KB archs) or wide-tile
          // kernel (~190 KB: sm_90 and sm_100 only) may be beyond the device, never on an H200.
          EXPECT_TRUE(kernel == cuda::AttentionKernel::small_heads || kernel == cuda::AttentionKernel::wide_tile)
              << e.what();
          EXPECT_NE(std::string(e.what()).find("this device allows " + std::to_string(d.max_smem_per_block)),
                    std::string::npos)
              << e.what();
          EXPECT_LT(d.max_smem_per_block, 227 * 1024) << e.what();
          continue;
        }
        ++plans;
        EXPECT_GT(plan.smem, 0);
        EXPECT_LE(plan.smem, d.max_smem_per_block);
        EXPECT_GE(plan.ctas_per_sm, 1);
        EXPECT_LE(plan.ctas_per_sm, d.max_ctas_per_sm);
        EXPECT_LE(plan.ctas_per_sm * (plan.smem + kReservedSmemPerCta), d.max_smem_per_sm)
            << plan.ctas_per_sm << " CTAs of " << plan.smem << " bytes";
        EXPECT_GE(plan.num_splits, 1);
      }
  EXPECT_GE(plans, 24);
}

// Where the archs must choose otherwise than an H200, from their shared memory: the small-heads kernel's bf16 rows
// at 16 heads (two 64-row stages, 167232 bytes, 175424 with the dims split; measured on the H200) fit an H200 but neither an A100 (166912 bytes
// per block) nor the 99 KB archs; its fp8 rows at 8 heads (42240 bytes a stage, 13728 more with the dims split) run
// two 2-stage CTAs per SM on an H200 (228 KB), one 3-stage CTA on an A100 (164 KB per SM; 4 stages do not fit
// 163 KB), one 2-stage CTA on SM86/89/120 (3 stages do not fit 99 KB).
TEST(CudaEmulation, SharedMemoryDecidesTheSmallHeadsPipeline) {
  const cuda::DeviceInfo& d = cuda::current_device();
  const cuda::AttentionChoice small{cuda::AttentionKernel::small_heads};
  const cuda::AttentionPlan fp8 = cuda::sparse_mla_plan(sparse_shape(DType::fp8_ds_mla, 64, 8, 2048), small);
  if (d.max_smem_per_block <= 166912) {
    try {
      cuda::sparse_mla_plan(sparse_shape(DType::bf16, 64, 16, 2048), small);
      ADD_FAILURE() << "bf16 small-heads kernel planned on a device of " << d.max_smem_per_block << " bytes per block";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::unsupported);
      EXPECT_NE(std::string(e.what()).find("this device allows " + std::to_string(d.max_smem_per_block)),
                std::string::npos)
          << e.what();
    }
  }
  if (d.max_smem_per_block == 101376) {
    EXPECT_EQ(fp8.stages, 2);
    EXPECT_EQ(fp8.ctas_per_sm, 1);
  } else if (d.compute_capability == 80) {
    EXPECT_EQ(fp8.stages, 3);
    EXPECT_EQ(fp8.ctas_per_sm, 1);
  } else if (d.compute_capability == 90 || d.compute_capability == 100) {  // 227 KB a block
    EXPECT_GT(cuda::sparse_mla_plan(sparse_shape(DType::bf16, 64, 16, 2048), small).smem, 101376);
    EXPECT_EQ(fp8.stages, 2);
    EXPECT_EQ(fp8.ctas_per_sm, 2);
  } else {
    GTEST_SKIP() << "no expectations written for sm_" << d.compute_capability;
  }
}

// The 16-head-tile kernel's pipeline: the deepest that keeps two CTAs per SM, or the most the device allows. bf16
// rows take 37504 bytes a stage (+10688), fp8 rows 21120 (+48192): an H200 runs 2 bf16 stages or 3 fp8 ones, two
// CTAs per SM; an A100 one CTA of 4 bf16 stages (two of 2 stages need 173 KB of its 164) or two of 1 fp8 stage; the
// 99 KB archs one CTA of 2 stages for both (3 do not fit). (Figures of today's layouts: SmemLayout, Layout.)
TEST(CudaEmulation, SharedMemoryDecidesTheHeadTilePipeline) {
  const cuda::DeviceInfo& d = cuda::current_device();
  struct Want {
    int bf16_stages, bf16_ctas, fp8_stages, fp8_ctas;
  } want{};
  if ((d.compute_capability == 90 || d.compute_capability == 100) && d.max_smem_per_sm == 233472) want = {2, 2, 3, 2};
  else if (d.compute_capability == 80 && d.max_smem_per_sm == 167936) want = {4, 1, 1, 2};
  else if (d.max_smem_per_block == 101376 && d.max_smem_per_sm == 102400) want = {2, 1, 2, 1};
  else GTEST_SKIP() << "no expectations written for sm_" << d.compute_capability;
  const cuda::AttentionChoice head_tile{cuda::AttentionKernel::head_tile};
  const cuda::AttentionPlan bf16 = cuda::sparse_mla_plan(sparse_shape(DType::bf16, 64, 16, 2048), head_tile);
  const cuda::AttentionPlan fp8 = cuda::sparse_mla_plan(sparse_shape(DType::fp8_ds_mla, 64, 16, 2048), head_tile);
  EXPECT_EQ(bf16.stages, want.bf16_stages);
  EXPECT_EQ(bf16.ctas_per_sm, want.bf16_ctas);
  EXPECT_EQ(fp8.stages, want.fp8_stages);
  EXPECT_EQ(fp8.ctas_per_sm, want.fp8_ctas);
}

// Shape-only indexer args: `tokens` fp8 queries of `heads` heads over an fp8 index cache.
IndexerTopkArgs indexer_shape(int tokens, int heads) {
  IndexerTopkArgs a;
  a.q = TensorView(nullptr, {tokens, heads, 128}, DType::fp8_e4m3);
  a.index_cache = TensorView(nullptr, {64, 64, 132}, DType::fp8_e4m3);
  a.block_table = TensorView(nullptr, {tokens, 64}, DType::i32);
  a.topk = TensorView(nullptr, {tokens, 2048}, DType::i32);
  return a;
}

// Instruction choices follow the emulated arch: e4m3 mma.sync where SM89 and SM12x multiply fp8 natively, bf16
// mma.sync on SM80/86/100, no wgmma off Hopper and no thread block clusters below SM90.
TEST(CudaEmulation, InstructionChoicesFollowTheArch) {
  const int cc = cuda::current_device().compute_capability;
  const bool native_fp8 = cc == 89 || cc / 10 == 12;
  for (int heads : {8, 32, 64}) {
    SCOPED_TRACE("heads " + std::to_string(heads));
    const cuda::ScoreMma used = cuda::resolve_score_mma(indexer_shape(4, heads));
    if (native_fp8) EXPECT_EQ(used, cuda::ScoreMma::fp8);
    else if (cc == 90 && cuda::wgmma_kernels_available() && heads > 16) EXPECT_EQ(used, cuda::ScoreMma::fp8_wgmma);
    else EXPECT_EQ(used, cuda::ScoreMma::bf16);
    if (cc < 89) EXPECT_THROW(cuda::resolve_score_mma(indexer_shape(4, heads), cuda::ScoreMma::fp8), Error);
  }
  if (cc < 90)
    EXPECT_THROW(cuda::topk_scratch_bytes(indexer_shape(4, 8), cuda::TopkSplit::cluster), Error);
  else
    EXPECT_NO_THROW(cuda::topk_scratch_bytes(indexer_shape(4, 8), cuda::TopkSplit::cluster));
  // Clusters of 16 (non-portable) on Hopper and an emulated SM100, the portable 8 on SM120, none below SM90.
  const int ranks = cuda::topk_max_cluster_ranks(2048);
  if (cc < 90) EXPECT_EQ(ranks, 1);
  else if (!emulated_name().empty()) EXPECT_EQ(ranks, cuda::arch_limits(emulated_name()).max_cluster_ranks);
  else if (cc == 90) EXPECT_EQ(ranks, 16);
  if (ranks < 16) {
    try {
      cuda::topk_scratch_bytes(indexer_shape(4, 8), cuda::TopkSplit::cluster16);
      ADD_FAILURE() << "cluster16 accepted on a device that runs clusters of at most " << ranks;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("cluster16"), std::string::npos) << e.what();
    }
  } else {
    EXPECT_NO_THROW(cuda::topk_scratch_bytes(indexer_shape(4, 8), cuda::TopkSplit::cluster16));
  }
}

// The kernel choice as data (cuda/mla/kernel_choice.h) is the plan's, natively and on every emulated arch: for each
// cache format, head width, key source, head count, query rows and forced kernel, the plan runs the kernel, depth
// and shared memory mla::choose_attention_kernel names (or refuses where it names none), and the plan's CTAs per
// SM, which the driver counts (cudaOccupancy, within an emulated arch's limits), equal the ones the choice computes
// from the kernels' register bounds and shared memory.
TEST(CudaEmulation, PlanIsTheKernelChoice) {
  const cuda::DeviceInfo& d = cuda::current_device();
  // sm_90a code: what the driver loaded (emulating sm_90 on another GPU loads no sm_90a code).
  const cuda::mla::KernelLimits limits{d.compute_capability, d.max_smem_per_block, d.max_smem_per_sm,
                                       d.max_threads_per_sm, d.max_ctas_per_sm, cuda::wgmma_kernels_available()};
  int plans = 0;
  for (DType kv : {DType::bf16, DType::f16, DType::fp8_ds_mla, DType::fp8_ds_mla_v4})
    for (int rope : {kMlaRopeDim, 0})
      for (bool paged : {false, true})
        for (cuda::AttentionKernel kernel : {cuda::AttentionKernel::automatic, cuda::AttentionKernel::head_tile,
                                             cuda::AttentionKernel::small_heads, cuda::AttentionKernel::wide_tile,
                                             cuda::AttentionKernel::wgmma})
          for (int heads : {1, 8, 16, 32, 64, 128})
            for (int tokens : {1, 16, 64, 256}) {
              if (kv == DType::fp8_ds_mla_v4 && rope != 0) continue;
              if (kernel == cuda::AttentionKernel::small_heads && heads > 32) continue;
              const MlaHead head{rope};
              const int64_t row = head.cache_row(kv);
              const cuda::AttentionChoice choice{kernel};
              const TensorView q(nullptr, {tokens, heads, head.qk_dim()}, DType::bf16);
              const TensorView cache(nullptr, {64, 64, row}, kv);
              cuda::AttentionPlan plan;
              SCOPED_TRACE(std::string(dtype_name(kv)) + " rope " + std::to_string(rope) + (paged ? " paged" : "") +
                           " kernel " + std::to_string(static_cast<int>(kernel)) + " heads " +
                           std::to_string(heads) + " tokens " + std::to_string(tokens));
              const cuda::mla::CacheFormat f = kv == DType::bf16   ? cuda::mla::CacheFormat::bf16
                                               : kv == DType::f16  ? cuda::mla::CacheFormat::f16
                                               : kv == DType::fp8_ds_mla ? cuda::mla::CacheFormat::fp8_ds_mla
                                                                         : cuda::mla::CacheFormat::fp8_ds_mla_v4;
              const cuda::mla::KernelDecision want =
                  cuda::mla::choose_attention_kernel(limits, {f, rope, paged, tokens, heads, choice});
              try {
                if (paged) {
                  PagedMlaDecodeArgs a;
                  a.q = TensorView(nullptr, {tokens, 1, heads, head.qk_dim()}, DType::bf16);
                  a.kv_cache = cache;
                  a.block_table = TensorView(nullptr, {tokens, 32}, DType::i32);
                  plan = cuda::paged_mla_decode_plan(a, choice);
                } else {
                  SparseMlaArgs a;
                  a.q = q;
                  a.kv_cache = cache;
                  a.indices = TensorView(nullptr, {tokens, 2048}, DType::i32);
                  plan = cuda::sparse_mla_plan(a, choice);
                }
              } catch (const Error& e) {
                EXPECT_FALSE(want.ok()) << e.what();
                continue;
              }
              ASSERT_TRUE(want.ok());
              ++plans;
              EXPECT_EQ(plan.kernel, want.chosen.kernel);
              EXPECT_EQ(plan.stages, want.chosen.stages);
              EXPECT_EQ(plan.smem, want.chosen.smem);
              EXPECT_EQ(plan.ctas_per_sm, want.chosen.ctas_per_sm);
            }
  EXPECT_GE(plans, 400);
}

}  // namespace
}  // namespace smla
