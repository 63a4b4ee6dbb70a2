// Validation reasons, selection order, forced backends and the "smallest
// change" suggestion, on registries of declared (fake) backends.
#include <gtest/gtest.h>

#include <cstdlib>

#include "smla/error.h"
#include "smla/select.h"
#include "support/test_util.h"

namespace smla {
namespace {

class DeclaredBackend final : public Backend {
 public:
  explicit DeclaredBackend(Capabilities c) : caps_(std::move(c)) {}
  const Capabilities& capabilities() const override { return caps_; }
  void write_mla_cache(const WriteMlaCacheArgs&) const override { unused(); }
  void sparse_mla(const SparseMlaArgs&) const override { unused(); }
  void paged_mla_decode(const PagedMlaDecodeArgs&) const override { unused(); }
  void write_index_cache(const WriteIndexCacheArgs&) const override { unused(); }
  void indexer_topk(const IndexerTopkArgs&) const override { unused(); }
  void positions_to_slots(const PositionsToSlotsArgs&) const override { unused(); }

 private:
  [[noreturn]] static void unused() { throw Error(ErrorKind::internal, "selection tests run no ops"); }
  Capabilities caps_;
};

// Shaped like today's Hopper/Blackwell sparse kernels: the restrictions users hit.
Capabilities hopper_sparse() {
  Capabilities c;
  c.name = "hopper_sparse";
  c.description = "sparse MLA for sm_90/sm_100";
  c.device_kind = DeviceKind::cuda;
  c.compute_capability = {90, 109};
  c.q_dtypes = {DType::bf16};
  c.kv_cache_dtypes = {DType::fp8_ds_mla};
  c.head_counts = {64, 128};
  c.block_size = {64, 64};
  c.topk = {64, 65536};
  c.topk_multiple = 64;
  c.ops = {Op::sparse_mla, Op::indexer};
  return c;
}

Capabilities everywhere_gpu() {
  Capabilities c;
  c.name = "mma_sparse";
  c.description = "mma.sync kernels";
  c.device_kind = DeviceKind::cuda;
  c.compute_capability = {80, 129};
  c.q_dtypes = {DType::bf16, DType::f16};
  c.kv_cache_dtypes = {DType::bf16, DType::f16, DType::fp8_ds_mla};
  c.heads = {1, 128};
  c.block_size = {1, 1 << 20};
  c.topk = {1, 65536};
  c.ops = {Op::sparse_mla, Op::paged_mla_decode, Op::indexer};
  return c;
}

Capabilities cpu_like() {
  Capabilities c = everywhere_gpu();
  c.name = "cpu_like";
  c.device_kind = DeviceKind::cpu;
  c.compute_capability = {0, 0};
  return c;
}

// GLM-5's geometry, written out so these tests do not depend on the presets.
AttentionSpec glm5() {
  AttentionSpec s;
  s.name = "glm-5";
  s.model_type = "glm_moe_dsa";
  s.num_heads = 64;
  s.q_lora_rank = 2048;
  s.kv_lora_rank = 512;
  s.qk_nope_head_dim = 192;
  s.qk_rope_head_dim = 64;
  s.v_head_dim = 256;
  s.indexer = IndexerSpec{32, 128, 2048, RopeStyle::interleaved};
  s.softmax_scale = 0.0625;
  return s;
}

RunSpec on(const char* device, DType q = DType::bf16, std::optional<DType> kv = std::nullopt, int tp = 1) {
  RunSpec r;
  r.device = parse_device(device);
  r.q_dtype = q;
  r.kv_cache_dtype = kv;
  r.tp = tp;
  return r;
}

bool has_reason(const std::vector<std::string>& reasons, const std::string& text) {
  for (const auto& r : reasons)
    if (r.find(text) != std::string::npos) return true;
  return false;
}

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += x + " | ";
  return s;
}

class Select : public ::testing::Test {
 protected:
  void SetUp() override {
    unsetenv("SMLA_BACKEND");
    registry.add(std::make_unique<DeclaredBackend>(cpu_like()));
    registry.add(std::make_unique<DeclaredBackend>(everywhere_gpu()));
    registry.add(std::make_unique<DeclaredBackend>(hopper_sparse()));
    registry.set_priority(DeviceKind::cuda, {"hopper_sparse", "mma_sparse"});
    registry.set_priority(DeviceKind::cpu, {"cpu_like"});
  }
  Registry registry;
};

TEST(Validate, EveryDeclaredFieldGivesItsReason) {
  const Capabilities c = hopper_sparse();
  const auto r = validate(c, glm5(), on("sm_120", DType::f16, DType::bf16, 8));
  EXPECT_TRUE(has_reason(r, "needs sm_90 to sm_10x, device is sm_120 (compute capability 12.0)")) << joined(r);
  EXPECT_TRUE(has_reason(r, "query dtype float16 not supported (supports bfloat16)")) << joined(r);
  EXPECT_TRUE(has_reason(r, "kv-cache dtype bfloat16 not supported (supports fp8_ds_mla)")) << joined(r);
  EXPECT_TRUE(has_reason(r, "8 heads per rank not supported (supports 64, 128)")) << joined(r);
  EXPECT_EQ(r.size(), 4u) << joined(r);

  EXPECT_TRUE(validate(c, glm5(), on("sm_90", DType::bf16, DType::fp8_ds_mla)).empty());
  EXPECT_TRUE(has_reason(validate(c, glm5(), on("cpu")), "runs on CUDA GPUs (sm_90 to sm_10x), not on the CPU"));
  EXPECT_TRUE(has_reason(validate(cpu_like(), glm5(), on("sm_90")), "runs on the CPU, not on a CUDA GPU (sm_90)"));
  EXPECT_TRUE(has_reason(validate(c, glm5(), on("cuda", DType::bf16, DType::fp8_ds_mla)), "compute capability unknown"));
}

TEST(Validate, BlockSizeTopkOpsSinksHeadDimsAndRule) {
  Capabilities c = hopper_sparse();
  RunSpec run = on("sm_90", DType::bf16, DType::fp8_ds_mla);
  run.block_size = 16;
  EXPECT_TRUE(has_reason(validate(c, glm5(), run), "block size 16 not supported (supports 64)"));

  AttentionSpec odd_topk = glm5();
  odd_topk.indexer->topk = 100;
  EXPECT_TRUE(has_reason(validate(c, odd_topk, on("sm_90", DType::bf16, DType::fp8_ds_mla)),
                         "top-k 100 not supported (supports 64-65536 (multiple of 64))"));

  AttentionSpec dense = glm5();
  dense.indexer.reset();
  EXPECT_TRUE(has_reason(validate(c, dense, on("sm_90", DType::bf16, DType::fp8_ds_mla)),
                         "does not implement dense paged decode"));

  run.block_size = 64;
  run.attn_sink = true;
  EXPECT_TRUE(has_reason(validate(c, glm5(), run), "does not support attention sinks"));

  AttentionSpec wide = glm5();
  wide.kv_lora_rank = 1024;
  EXPECT_TRUE(has_reason(validate(everywhere_gpu(), wide, on("sm_90")), "absorbed head size 1088 / 1024 not supported (supports 576 / 512)"));

  c.combination_rule = [](const AttentionSpec&, const RunSpec& r) {
    return r.tp > 1 ? std::vector<std::string>{"no tensor parallelism"} : std::vector<std::string>{};
  };
  EXPECT_TRUE(has_reason(validate(c, glm5(), on("sm_90", DType::bf16, DType::fp8_ds_mla, 2)), "no tensor parallelism"));
}

// GLM-5.3-Flash's geometry: 512-wide heads need a declaration that lists them, its indexer one that pools, and
// the compact rope-free fp8 cache fits only heads without a rope part.
TEST(Validate, HeadsWithoutRopePart) {
  AttentionSpec glm53 = glm5();
  glm53.qk_nope_head_dim = 256;
  glm53.qk_rope_head_dim = 0;
  glm53.indexer->kpool = 4;
  Capabilities c = everywhere_gpu();
  EXPECT_TRUE(has_reason(validate(c, glm53, on("sm_120")), "absorbed head size 512 / 512 not supported"));
  EXPECT_TRUE(has_reason(validate(c, glm53, on("sm_120")), "does not implement the pooled indexer (index_kpool 4)"));
  c.qk_head_dims = {kMlaQkDim, kMlaLatentDim};
  c.kv_cache_dtypes.push_back(DType::fp8_ds_mla_nope);
  c.pooled_indexer = true;
  EXPECT_EQ(validate(c, glm53, on("sm_120")), std::vector<std::string>{});
  EXPECT_EQ(validate(c, glm53, on("sm_120", DType::bf16, DType::fp8_ds_mla_nope)), std::vector<std::string>{});
  EXPECT_EQ(validate(c, glm53, on("sm_120", DType::bf16, DType::fp8_ds_mla)), std::vector<std::string>{});
  EXPECT_TRUE(has_reason(validate(c, glm5(), on("sm_120", DType::bf16, DType::fp8_ds_mla_nope)),
                         "kv-cache dtype fp8_ds_mla_nope has no rope part, the model's head has rope 64"));
  RunSpec sparse_only = on("sm_120");
  sparse_only.ops = {Op::sparse_mla};  // without the indexer the pooling does not matter
  c.pooled_indexer = false;
  EXPECT_EQ(validate(c, glm53, sparse_only), std::vector<std::string>{});
}

// DeepSeek-V4: a 512-wide shared-KV head (rope inside) needs a backend that attends its two caches under one
// softmax; neither fp8_ds_mla form holds its head, whatever the backend declares.
TEST(Validate, SharedKvHeadsWithTwoCaches) {
  const AttentionSpec v4 = *preset("deepseek-v4-flash");
  Capabilities c = everywhere_gpu();
  c.qk_head_dims = {kMlaQkDim, kMlaLatentDim};
  c.kv_cache_dtypes.push_back(DType::fp8_ds_mla_nope);
  const std::string two_caches = "does not implement sparse attention over two caches";
  EXPECT_EQ(validate(c, v4, on("sm_90")),
            std::vector<std::string>{two_caches + " (the window cache and the compressed cache under one softmax, "
                                                  "as deepseek_v4 needs)"});
  c.extra_cache = true;
  EXPECT_EQ(validate(c, v4, on("sm_90")), std::vector<std::string>{});
  for (DType fp8 : {DType::fp8_ds_mla, DType::fp8_ds_mla_nope})
    EXPECT_TRUE(has_reason(validate(c, v4, on("sm_90", DType::bf16, fp8)),
                           "kv-cache dtype " + std::string(dtype_name(fp8)) +
                               " cannot hold a deepseek_v4 head (its fp8 cache is FlashMLA's 584-byte MODEL1 layout"));
  // Its own fp8 cache (fp8_ds_mla_v4) where the backend declares it, and for its head only.
  EXPECT_TRUE(has_reason(validate(c, v4, on("sm_90", DType::bf16, DType::fp8_ds_mla_v4)),
                         "kv-cache dtype fp8_ds_mla_v4 not supported (supports "));
  c.kv_cache_dtypes.push_back(DType::fp8_ds_mla_v4);
  EXPECT_EQ(validate(c, v4, on("sm_90", DType::bf16, DType::fp8_ds_mla_v4)), std::vector<std::string>{});
  EXPECT_EQ(validate(c, glm5(), on("sm_90", DType::bf16, DType::fp8_ds_mla_v4)),
            std::vector<std::string>{"kv-cache dtype fp8_ds_mla_v4 is DeepSeek-V4's cache (a 512-wide head of 448 + "
                                     "64 rope values); a glm_moe_dsa head is cached as fp8_ds_mla"});
  // The window-only rule is about the model's caches: a V4-shaped head without compressed caches needs no extra one.
  AttentionSpec window_only = v4;
  window_only.compress_ratios.clear();
  c.extra_cache = false;
  EXPECT_EQ(validate(c, window_only, on("sm_90")), std::vector<std::string>{});
  // Only sparse attention reads the caches: the indexer alone runs anywhere it did.
  RunSpec indexer_only = on("sm_90");
  indexer_only.ops = {Op::indexer};
  EXPECT_EQ(validate(c, v4, indexer_only), std::vector<std::string>{});
}

TEST_F(Select, WalksThePriorityListAndReportsEveryCandidate) {
  Selection s = select(glm5(), on("sm_90", DType::bf16, DType::fp8_ds_mla), registry);
  ASSERT_NE(s.chosen, nullptr);
  EXPECT_EQ(s.chosen->name(), "hopper_sparse");
  ASSERT_EQ(s.candidates.size(), 3u);
  EXPECT_EQ(s.candidates[0].backend->name(), "hopper_sparse");
  EXPECT_EQ(s.candidates[1].backend->name(), "mma_sparse");
  EXPECT_TRUE(s.candidates[1].valid());
  EXPECT_EQ(s.candidates[2].backend->name(), "cpu_like");
  EXPECT_FALSE(s.candidates[2].valid());
  EXPECT_FALSE(s.forced);

  // fp16 on sm_120: the Hopper kernel is rejected, the mma one takes it.
  s = select(glm5(), on("sm_120", DType::f16), registry);
  ASSERT_NE(s.chosen, nullptr);
  EXPECT_EQ(s.chosen->name(), "mma_sparse");
  EXPECT_EQ(s.candidates[0].reasons.size(), 3u) << joined(s.candidates[0].reasons);

  s = select(glm5(), on("cpu"), registry);
  ASSERT_NE(s.chosen, nullptr);
  EXPECT_EQ(s.chosen->name(), "cpu_like");
  EXPECT_EQ(s.candidates[0].backend->name(), "cpu_like");
}

TEST_F(Select, ForcedBackends) {
  RunSpec run = on("sm_90", DType::bf16, DType::fp8_ds_mla);
  run.backend = "mma_sparse";
  Selection s = select(glm5(), run, registry);
  EXPECT_EQ(s.chosen->name(), "mma_sparse");
  EXPECT_TRUE(s.forced);

  run = on("sm_120", DType::f16);
  run.backend = "hopper_sparse";
  try {
    select(glm5(), run, registry);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::unsupported);
    const std::string m = e.what();
    EXPECT_NE(m.find("backend 'hopper_sparse' was forced"), std::string::npos) << m;
    EXPECT_NE(m.find("query dtype float16 not supported"), std::string::npos) << m;
  }

  run.backend = "flash";
  try {
    select(glm5(), run, registry);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("valid names: cpu_like, mma_sparse, hopper_sparse"), std::string::npos)
        << e.what();
  }

  // The environment variable forces too; the API argument wins over it.
  setenv("SMLA_BACKEND", "mma_sparse", 1);
  s = select(glm5(), on("sm_90", DType::bf16, DType::fp8_ds_mla), registry);
  EXPECT_EQ(s.chosen->name(), "mma_sparse");
  EXPECT_TRUE(s.forced);
  run = on("sm_90", DType::bf16, DType::fp8_ds_mla);
  run.backend = "hopper_sparse";
  EXPECT_EQ(select(glm5(), run, registry).chosen->name(), "hopper_sparse");
  setenv("SMLA_BACKEND", "nope", 1);
  test::expect_error([&] { select(glm5(), on("sm_90"), registry); }, ErrorKind::invalid_argument,
                     {"backend: unknown backend 'nope' (from SMLA_BACKEND)"});
  unsetenv("SMLA_BACKEND");
}

TEST(Suggest, SmallestChangeToTheRun) {
  Registry r;
  r.add(std::make_unique<DeclaredBackend>(hopper_sparse()));
  r.set_priority(DeviceKind::cuda, {"hopper_sparse"});

  // Only the cache dtype is wrong.
  Selection s = select(glm5(), on("sm_90", DType::bf16), r);
  EXPECT_EQ(s.chosen, nullptr);
  EXPECT_EQ(s.suggestion, "use --kv-cache-dtype fp8_ds_mla (backend hopper_sparse would then be valid)");

  // Only the query dtype is wrong.
  s = select(glm5(), on("sm_90", DType::f16, DType::fp8_ds_mla), r);
  EXPECT_EQ(s.suggestion, "use --dtype bfloat16 (backend hopper_sparse would then be valid)");

  // 8 heads per rank under tp 8: tp 1 gives the 64 heads the kernel accepts.
  s = select(glm5(), on("sm_90", DType::bf16, DType::fp8_ds_mla, 8), r);
  EXPECT_EQ(s.suggestion, "use --tp 1 (backend hopper_sparse would then be valid)");

  RunSpec bs = on("sm_90", DType::bf16, DType::fp8_ds_mla);
  bs.block_size = 16;
  EXPECT_EQ(select(glm5(), bs, r).suggestion, "use --block-size 64 (backend hopper_sparse would then be valid)");

  // Two things wrong: no single change helps.
  s = select(glm5(), on("sm_90", DType::f16, DType::bf16), r);
  EXPECT_EQ(s.chosen, nullptr);
  EXPECT_EQ(s.suggestion, "");

  // Wrong arch: nothing in the run can fix it... unless a CPU backend exists.
  EXPECT_EQ(select(glm5(), on("sm_120", DType::bf16, DType::fp8_ds_mla), r).suggestion, "");
  r.add(std::make_unique<DeclaredBackend>(cpu_like()));
  EXPECT_EQ(select(glm5(), on("sm_120", DType::bf16, DType::fp8_ds_mla), r).suggestion,
            "use --device cpu (backend cpu_like would then be valid)");
  // A cheaper change on a lower-priority backend wins over a device change.
  EXPECT_EQ(select(glm5(), on("sm_90", DType::bf16), r).suggestion,
            "use --kv-cache-dtype fp8_ds_mla (backend hopper_sparse would then be valid)");
}

TEST(Suggest, AnFp8CacheAskedForGetsAnotherFp8Layout) {
  // A backend declaring a 16-bit cache first: an fp8 cache it cannot take (DeepSeek-V4's layout for GLM-5) is
  // answered with its fp8 layout, not with a cache of twice the bytes; a 16-bit one with a 16-bit one.
  Capabilities both = hopper_sparse();
  both.kv_cache_dtypes = {DType::bf16, DType::f16, DType::fp8_ds_mla};
  Registry r;
  r.add(std::make_unique<DeclaredBackend>(both));
  r.set_priority(DeviceKind::cuda, {"hopper_sparse"});
  EXPECT_EQ(select(glm5(), on("sm_90", DType::bf16, DType::fp8_ds_mla_v4), r).suggestion,
            "use --kv-cache-dtype fp8_ds_mla (backend hopper_sparse would then be valid)");
  both.kv_cache_dtypes = {DType::fp8_ds_mla, DType::f16};
  Registry r16;
  r16.add(std::make_unique<DeclaredBackend>(both));
  r16.set_priority(DeviceKind::cuda, {"hopper_sparse"});
  EXPECT_EQ(select(glm5(), on("sm_90", DType::bf16, DType::bf16), r16).suggestion,
            "use --kv-cache-dtype float16 (backend hopper_sparse would then be valid)");
}

TEST(RunSpecChecks, TpThatDoesNotDivideTheHeadsIsBadInput) {
  Registry r;
  r.add(std::make_unique<DeclaredBackend>(cpu_like()));
  try {
    select(glm5(), on("cpu", DType::bf16, std::nullopt, 3), r);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("tp: 3 does not divide the model's 64 attention heads"), std::string::npos)
        << e.what();
  }
}

TEST(Registry, GlobalHoldsTheCpuBackend) {
  const Registry& g = Registry::global();
  ASSERT_NE(g.find("cpu"), nullptr);
  EXPECT_EQ(&backend_for(Device::cpu()), g.find("cpu"));
  Selection s = select(glm5(), on("cpu"));
  ASSERT_NE(s.chosen, nullptr);
  EXPECT_EQ(s.chosen->name(), "cpu");
  Registry dup;
  dup.add(std::make_unique<DeclaredBackend>(cpu_like()));
  EXPECT_THROW(dup.add(std::make_unique<DeclaredBackend>(cpu_like())), Error);
}

// The backend an op runs on when given none: the first of the device kind's priority list that runs on that kind,
// kept up to date as backends are added and the lists change (the ops look nothing up by name per call).
TEST_F(Select, BackendForFollowsThePriorityLists) {
  EXPECT_EQ(backend_for(Device::cuda(90), registry).name(), "hopper_sparse");
  EXPECT_EQ(backend_for(Device::cpu(), registry).name(), "cpu_like");
  registry.set_priority(DeviceKind::cuda, {"cpu_like", "mma_sparse"});  // a CPU backend is skipped for a GPU
  EXPECT_EQ(backend_for(Device::cuda(90), registry).name(), "mma_sparse");
  registry.set_priority(DeviceKind::cuda, {});  // then the registration order
  EXPECT_EQ(backend_for(Device::cuda(90), registry).name(), "mma_sparse");
  Registry cpu_only;
  EXPECT_THROW(backend_for(Device::cpu(), cpu_only), Error);
  cpu_only.add(std::make_unique<DeclaredBackend>(cpu_like()));
  EXPECT_EQ(backend_for(Device::cpu(), cpu_only).name(), "cpu_like");
  try {
    backend_for(Device::cuda(90), cpu_only);
    ADD_FAILURE() << "no GPU backend, yet one was returned";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::unsupported);
    EXPECT_NE(std::string(e.what()).find("no backend in this build runs on"), std::string::npos) << e.what();
  }
}

// The ops' limits and cache formats are written once (smla/ops.h, smla/types.h): every backend declares at most
// them, the CPU backend (the reference) all of them, and the messages list them.
TEST(Registry, BackendsDeclareTheOpsLimitsAndCacheFormats) {
  for (const Backend* b : Registry::global().all()) {
    SCOPED_TRACE(b->name());
    const Capabilities& c = b->capabilities();
    for (DType d : c.kv_cache_dtypes) EXPECT_TRUE(is_mla_cache_dtype(d)) << dtype_name(d);
    EXPECT_LE(c.heads.max, kMaxHeads);
    EXPECT_LE(c.topk.max, kMaxTopk);
  }
  const Capabilities& cpu = Registry::global().find("cpu")->capabilities();
  // The CPU backend reads every cache format, DeepSeek-V4's fp8_ds_mla_v4 too.
  EXPECT_EQ(cpu.kv_cache_dtypes, std::vector<DType>(std::begin(kAllMlaCacheDTypes), std::end(kAllMlaCacheDTypes)));
  EXPECT_EQ(cpu.heads.max, kMaxHeads);
  EXPECT_EQ(cpu.topk.max, kMaxTopk);
  EXPECT_EQ(dtype_names(kMlaCacheDTypes), "bfloat16, float16, fp8_ds_mla or fp8_ds_mla_nope");
  RunOptions o;
  o.device = "cpu";
  o.kv_cache_dtype = "fp8";
  test::expect_error([&] { make_run_spec(glm5(), o, OptionNames::cli); }, ErrorKind::invalid_argument,
                     {"--kv-cache-dtype: expected auto, bfloat16, float16, fp8_ds_mla, fp8_ds_mla_nope or "
                      "fp8_ds_mla_v4, got 'fp8'"});
}

TEST(Ops, AnExplicitBackendMustRunWhereTheTensorsAre) {
  // GPU-tagged views at bogus addresses: the check must stop before any access.
  const Device gpu = Device::cuda(90);
  auto* bogus = reinterpret_cast<void*>(uintptr_t{0x1000});
  PositionsToSlotsArgs a;
  a.positions = TensorView(bogus, {1, 4}, DType::i32, gpu);
  a.request_ids = TensorView(bogus, {1}, DType::i32, gpu);
  a.block_table = TensorView(bogus, {1, 2}, DType::i32, gpu);
  a.block_size = 16;
  a.slots = TensorView(static_cast<char*>(bogus) + 64, {1, 4}, DType::i32, gpu);  // an output apart from the inputs
  try {
    positions_to_slots(a, Registry::global().find("cpu"));
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("positions_to_slots: backend 'cpu' does not run on sm_90"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace smla
