// Every GPU op inside a serving engine: captured into a CUDA graph on a brand-new non-blocking stream with a
// caller-owned workspace, replayed on new inputs (equal bit for bit to an eager call on them, different from the
// first inputs' result); capture without a workspace after a warm-up on another stream (a clear error, the
// capture still valid); and 1,000 short-lived streams that leave the device's free memory where it was.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "cuda/mla/attention_small_heads.h"
#include "gpu_util.h"
#include "smla/error.h"
#include "smla/ops.h"
#include "support/test_util.h"

namespace smla {
namespace {

using test::Rng;

// One device buffer with two host versions of its contents (inputs), or an output (poisoned before each run).
struct Buffer {
  std::unique_ptr<DeviceBuffer> dev;
  std::vector<uint8_t> a, b;
  bool output = false;
};

// An op over device buffers: `run(stream, workspace)` calls it; `size()` is its workspace_size.
struct OpCase {
  std::string name;
  std::vector<Buffer> buffers;
  std::function<void(cudaStream_t, TensorView)> run;
  std::function<size_t()> size;

  template <class T>
  void* input(const std::vector<T>& a, const std::vector<T>& b) {
    Buffer buf;
    buf.a.resize(a.size() * sizeof(T));
    buf.b.resize(b.size() * sizeof(T));
    std::memcpy(buf.a.data(), a.data(), buf.a.size());
    std::memcpy(buf.b.data(), b.data(), buf.b.size());
    buf.dev = std::make_unique<DeviceBuffer>(buf.a.size());
    buffers.push_back(std::move(buf));
    return buffers.back().dev->ptr;
  }
  template <class T>
  void* same_input(const std::vector<T>& v) { return input(v, v); }
  void* output(size_t bytes) {
    Buffer buf;
    buf.output = true;
    buf.dev = std::make_unique<DeviceBuffer>(bytes);
    buffers.push_back(std::move(buf));
    return buffers.back().dev->ptr;
  }
  void load(bool second) {
    for (Buffer& b : buffers)
      if (!b.output) ASSERT_EQ(cudaMemcpy(b.dev->ptr, (second ? b.b : b.a).data(), b.a.size(), cudaMemcpyHostToDevice),
                               cudaSuccess);
  }
  void poison() {
    for (Buffer& b : buffers)
      if (b.output) ASSERT_EQ(cudaMemset(b.dev->ptr, 0x7f, b.dev->bytes), cudaSuccess);
  }
  std::vector<std::vector<uint8_t>> outputs() const {
    std::vector<std::vector<uint8_t>> v;
    for (const Buffer& b : buffers)
      if (b.output) v.push_back(b.dev->download<uint8_t>());
    return v;
  }
};

std::vector<uint16_t> bf16(Rng& rng, size_t n) { return test::to_half_bits(test::random_floats(rng, n), DType::bf16); }
Device gpu0() { return Device::cuda(0, 0); }
TensorView view(void* p, std::initializer_list<int64_t> shape, DType dtype) {
  return TensorView(p, shape, dtype, gpu0());
}

constexpr int64_t kBlocks = 64, kBlockSize = 64, kSlots = kBlocks * kBlockSize;  // 4096 slots
constexpr int64_t kHeads = 16, kIndexHeads = 32, kTopk = 2048;

std::vector<int32_t> random_slots(Rng& rng, int64_t n) {
  std::vector<int32_t> v(n);
  for (auto& x : v) x = rng() % 9 == 0 ? -1 : static_cast<int32_t>(rng() % kSlots);
  return v;
}
std::vector<int64_t> distinct_slots(Rng& rng, int64_t n) {
  std::vector<int64_t> v(kSlots);
  std::iota(v.begin(), v.end(), 0);
  std::shuffle(v.begin(), v.end(), rng);
  v.resize(n);
  return v;
}
std::vector<int32_t> shuffled_table(Rng& rng) {
  std::vector<int32_t> t(kBlocks);
  std::iota(t.begin(), t.end(), 0);
  std::shuffle(t.begin(), t.end(), rng);
  return t;
}

// The ops, each on one token or request with a long enough context that the attention splits its keys (so the
// workspace is used) and the indexer scores 4096 positions.
std::vector<std::unique_ptr<OpCase>> all_ops() {
  std::vector<std::unique_ptr<OpCase>> ops;
  Rng rng(2024);
  const auto cache = bf16(rng, kSlots * kMlaQkDim), cache2 = bf16(rng, kSlots * kMlaQkDim);
  const auto index_cache = bf16(rng, kSlots * kIndexHeadDim), index_cache2 = bf16(rng, kSlots * kIndexHeadDim);
  const auto table = shuffled_table(rng);

  {
    auto c = std::make_unique<OpCase>();
    c->name = "write_mla_cache";
    const int64_t n = 8;
    const std::vector<int64_t> slots = distinct_slots(rng, n);  // a slot written twice has no fixed winner
    WriteMlaCacheArgs a;
    a.latent = view(c->input(bf16(rng, n * kMlaLatentDim), bf16(rng, n * kMlaLatentDim)), {n, kMlaLatentDim}, DType::bf16);
    a.k_pe = view(c->input(bf16(rng, n * kMlaRopeDim), bf16(rng, n * kMlaRopeDim)), {n, kMlaRopeDim}, DType::bf16);
    a.slot_mapping = view(c->same_input(slots), {n}, DType::i64);
    a.cache = view(c->output(kSlots * kMlaQkDim * 2), {kBlocks, kBlockSize, kMlaQkDim}, DType::bf16);
    c->run = [a](cudaStream_t s, TensorView) mutable {
      a.stream = s;
      write_mla_cache(a, &gpu());
    };
    c->size = [] { return size_t{0}; };
    ops.push_back(std::move(c));
  }
  {
    auto c = std::make_unique<OpCase>();
    c->name = "sparse_mla";
    SparseMlaArgs a;
    a.q = view(c->input(bf16(rng, kHeads * kMlaQkDim), bf16(rng, kHeads * kMlaQkDim)), {1, kHeads, kMlaQkDim},
               DType::bf16);
    a.kv_cache = view(c->input(cache, cache2), {kBlocks, kBlockSize, kMlaQkDim}, DType::bf16);
    a.indices = view(c->input(random_slots(rng, kTopk), random_slots(rng, kTopk)), {1, kTopk}, DType::i32);
    a.softmax_scale = 0.07f;
    a.out = view(c->output(kHeads * kMlaVDim * 2), {1, kHeads, kMlaVDim}, DType::bf16);
    a.lse = view(c->output(kHeads * 4), {1, kHeads}, DType::f32);
    a.max_logits = view(c->output(kHeads * 4), {1, kHeads}, DType::f32);
    c->run = [a](cudaStream_t s, TensorView ws) mutable {
      a.stream = s;
      a.workspace = ws;
      sparse_mla(a, &gpu());
    };
    c->size = [a] { return workspace_size(a, &gpu()); };
    ops.push_back(std::move(c));
  }
  {
    auto c = std::make_unique<OpCase>();
    c->name = "paged_mla_decode";
    PagedMlaDecodeArgs a;
    a.q = view(c->input(bf16(rng, kHeads * kMlaQkDim), bf16(rng, kHeads * kMlaQkDim)), {1, 1, kHeads, kMlaQkDim},
               DType::bf16);
    a.kv_cache = view(c->input(cache, cache2), {kBlocks, kBlockSize, kMlaQkDim}, DType::bf16);
    a.block_table = view(c->same_input(table), {1, kBlocks}, DType::i32);
    a.seq_lens = view(c->input(std::vector<int32_t>{3000}, std::vector<int32_t>{2500}), {1}, DType::i32);
    a.softmax_scale = 0.07f;
    a.out = view(c->output(kHeads * kMlaVDim * 2), {1, 1, kHeads, kMlaVDim}, DType::bf16);
    a.lse = view(c->output(kHeads * 4), {1, 1, kHeads}, DType::f32);
    c->run = [a](cudaStream_t s, TensorView ws) mutable {
      a.stream = s;
      a.workspace = ws;
      paged_mla_decode(a, &gpu());
    };
    c->size = [a] { return workspace_size(a, &gpu()); };
    ops.push_back(std::move(c));
  }
  {
    auto c = std::make_unique<OpCase>();
    c->name = "write_index_cache";
    const int64_t n = 8;
    const std::vector<int64_t> slots = distinct_slots(rng, n);
    WriteIndexCacheArgs a;
    a.k = view(c->input(bf16(rng, n * kIndexHeadDim), bf16(rng, n * kIndexHeadDim)), {n, kIndexHeadDim}, DType::bf16);
    a.slot_mapping = view(c->same_input(slots), {n}, DType::i64);
    a.cache = view(c->output(kSlots * kIndexHeadDim * 2), {kBlocks, kBlockSize, kIndexHeadDim}, DType::bf16);
    c->run = [a](cudaStream_t s, TensorView) mutable {
      a.stream = s;
      write_index_cache(a, &gpu());
    };
    c->size = [] { return size_t{0}; };
    ops.push_back(std::move(c));
  }
  const auto indexer_args = [&](OpCase& c) {
    IndexerTopkArgs a;
    a.q = view(c.input(bf16(rng, kIndexHeads * kIndexHeadDim), bf16(rng, kIndexHeads * kIndexHeadDim)),
               {1, kIndexHeads, kIndexHeadDim}, DType::bf16);
    a.weights = view(c.input(test::random_floats(rng, kIndexHeads), test::random_floats(rng, kIndexHeads)),
                     {1, kIndexHeads}, DType::f32);
    a.index_cache = view(c.input(index_cache, index_cache2), {kBlocks, kBlockSize, kIndexHeadDim}, DType::bf16);
    a.request_ids = view(c.same_input(std::vector<int32_t>{0}), {1}, DType::i32);
    a.block_table = view(c.same_input(table), {1, kBlocks}, DType::i32);
    a.context_lens = view(c.input(std::vector<int32_t>{4000}, std::vector<int32_t>{3900}), {1}, DType::i32);
    a.topk = view(c.output(kTopk * 4), {1, kTopk}, DType::i32);
    return a;
  };
  {
    auto c = std::make_unique<OpCase>();
    c->name = "indexer_topk";
    IndexerTopkArgs a = indexer_args(*c);
    c->run = [a](cudaStream_t s, TensorView ws) mutable {
      a.stream = s;
      a.workspace = ws;
      indexer_topk(a, &gpu());
    };
    c->size = [a] { return workspace_size(a, &gpu()); };
    ops.push_back(std::move(c));
  }
  {
    auto c = std::make_unique<OpCase>();
    c->name = "positions_to_slots";
    std::vector<int32_t> pos_a(kTopk), pos_b(kTopk);
    for (auto& p : pos_a) p = static_cast<int32_t>(rng() % kSlots);
    for (auto& p : pos_b) p = static_cast<int32_t>(rng() % kSlots);
    PositionsToSlotsArgs a;
    a.positions = view(c->input(pos_a, pos_b), {1, kTopk}, DType::i32);
    a.request_ids = view(c->same_input(std::vector<int32_t>{0}), {1}, DType::i32);
    a.block_table = view(c->same_input(table), {1, kBlocks}, DType::i32);
    a.block_size = kBlockSize;
    a.slots = view(c->output(kTopk * 4), {1, kTopk}, DType::i32);
    c->run = [a](cudaStream_t s, TensorView) mutable {
      a.stream = s;
      positions_to_slots(a, &gpu());
    };
    c->size = [] { return size_t{0}; };
    ops.push_back(std::move(c));
  }
  {
    auto c = std::make_unique<OpCase>();
    c->name = "dsa_decode_step";
    DsaDecodeStepArgs a;
    a.indexer = indexer_args(*c);
    a.slots = view(c->output(kTopk * 4), {1, kTopk}, DType::i32);
    a.q = view(c->input(bf16(rng, kHeads * kMlaQkDim), bf16(rng, kHeads * kMlaQkDim)), {1, kHeads, kMlaQkDim},
               DType::bf16);
    a.kv_cache = view(c->input(cache, cache2), {kBlocks, kBlockSize, kMlaQkDim}, DType::bf16);
    a.softmax_scale = 0.07f;
    a.out = view(c->output(kHeads * kMlaVDim * 2), {1, kHeads, kMlaVDim}, DType::bf16);
    a.lse = view(c->output(kHeads * 4), {1, kHeads}, DType::f32);
    c->run = [a](cudaStream_t s, TensorView ws) mutable {
      a.stream = s;
      a.workspace = ws;
      dsa_decode_step(a, &gpu());
    };
    c->size = [a] { return workspace_size(a, &gpu()); };
    ops.push_back(std::move(c));
  }
  // GLM-5.3-Flash's pooled indexer: pools of 4 tokens into an fp8 index cache of 16 pools a block (kSlots pools).
  constexpr int64_t kpool = 4, pool_rows = kBlockSize / kpool;
  {
    auto c = std::make_unique<OpCase>();
    c->name = "write_pooled_index_cache";
    const int64_t n = 8;
    const std::vector<int64_t> slots = distinct_slots(rng, n);
    const int64_t values = n * kpool * kIndexHeadDim;
    WritePooledIndexCacheArgs a;
    a.k = view(c->input(bf16(rng, values), bf16(rng, values)), {n, kpool, kIndexHeadDim}, DType::bf16);
    a.gate = view(c->input(bf16(rng, values), bf16(rng, values)), {n, kpool, kIndexHeadDim}, DType::bf16);
    a.ape = view(c->same_input(test::random_floats(rng, kpool * kIndexHeadDim)), {kpool, kIndexHeadDim}, DType::f32);
    a.slot_mapping = view(c->same_input(slots), {n}, DType::i64);
    a.cache = view(c->output(kSlots * kFp8IndexRowBytes), {kSlots / pool_rows, pool_rows, kFp8IndexRowBytes},
                   DType::fp8_e4m3);
    c->run = [a](cudaStream_t s, TensorView) mutable {
      a.stream = s;
      write_pooled_index_cache(a, &gpu());
    };
    c->size = [] { return size_t{0}; };
    ops.push_back(std::move(c));
  }
  {
    auto c = std::make_unique<OpCase>();
    c->name = "rotate_index_q";
    const int64_t values = kIndexHeads * kIndexHeadDim;
    RotateIndexQArgs a;
    a.q = view(c->input(bf16(rng, values), bf16(rng, values)), {1, kIndexHeads, kIndexHeadDim}, DType::bf16);
    a.q_out = view(c->output(values), {1, kIndexHeads, kIndexHeadDim}, DType::fp8_e4m3);
    a.q_scale = view(c->output(kIndexHeads * 4), {1, kIndexHeads}, DType::f32);
    c->run = [a](cudaStream_t s, TensorView) mutable {
      a.stream = s;
      rotate_index_q(a, &gpu());
    };
    c->size = [] { return size_t{0}; };
    ops.push_back(std::move(c));
  }
  {
    auto c = std::make_unique<OpCase>();
    c->name = "pools_to_positions";
    const int64_t kp = kTopk / kpool;
    std::vector<int32_t> pools_a(kp), pools_b(kp);
    for (auto& p : pools_a) p = static_cast<int32_t>(rng() % 1000);
    for (auto& p : pools_b) p = static_cast<int32_t>(rng() % 1000);
    PoolsToPositionsArgs a;
    a.pools = view(c->input(pools_a, pools_b), {1, kp}, DType::i32);
    a.context_lens = view(c->input(std::vector<int32_t>{4001}, std::vector<int32_t>{3902}), {1}, DType::i32);
    a.kpool = kpool;
    a.positions = view(c->output((kTopk + kpool - 1) * 4), {1, kTopk + kpool - 1}, DType::i32);
    c->run = [a](cudaStream_t s, TensorView) mutable {
      a.stream = s;
      pools_to_positions(a, &gpu());
    };
    c->size = [] { return size_t{0}; };
    ops.push_back(std::move(c));
  }
  return ops;
}

TensorView workspace_view(const DeviceBuffer& b, size_t bytes) {
  return view(b.ptr, {static_cast<int64_t>(bytes)}, DType::u8);
}

// `op` run eagerly, then captured on a brand-new non-blocking stream with a caller-owned workspace, replayed on its
// second inputs: equal bit for bit to an eager call on them, different from the first inputs' result.
void expect_replays(OpCase& op) {
  const size_t bytes = op.size();
  EXPECT_EQ(op.size(), bytes) << "workspace_size is deterministic";
  DeviceBuffer ws(bytes);
  const TensorView workspace = bytes ? workspace_view(ws, bytes) : TensorView{};
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  op.load(false);
  op.poison();
  op.run(stream, workspace);
  CUDA_OK(cudaStreamSynchronize(stream));
  const auto first = op.outputs();

  // Captured on a brand-new stream, the first thing it runs. Global mode: any unsafe call in the op
  // (allocation, synchronisation) invalidates the capture.
  cudaStream_t capturing = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&capturing, cudaStreamNonBlocking));
  const CapturedGraph graph(capturing, cudaStreamCaptureModeGlobal, [&] { op.run(capturing, workspace); });

  op.load(true);
  op.poison();
  CUDA_OK(cudaGraphLaunch(graph.exec(), capturing));
  CUDA_OK(cudaStreamSynchronize(capturing));
  const auto replayed = op.outputs();
  op.poison();
  op.run(capturing, workspace);
  CUDA_OK(cudaStreamSynchronize(capturing));
  const auto eager = op.outputs();
  EXPECT_TRUE(replayed == eager) << "the replay differs from an eager call on the same inputs";
  EXPECT_FALSE(replayed == first) << "the replay did not read the new inputs";

  CUDA_OK(cudaStreamDestroy(capturing));
  CUDA_OK(cudaStreamDestroy(stream));
}

TEST(CudaCapture, EveryOpReplaysOnANewNonBlockingStreamWithACallerWorkspace) {
  for (auto& op : all_ops()) {
    SCOPED_TRACE(op->name);
    if (op->name == "sparse_mla" || op->name == "paged_mla_decode" || op->name == "indexer_topk" ||
        op->name == "dsa_decode_step")
      EXPECT_GT(op->size(), 0u) << "the problem is meant to need scratch";
    expect_replays(*op);
  }
}

// Every attention kernel the device runs (real or emulated), forced (the ops above take the one the automatic choice
// makes for 16 heads): sparse_mla and paged_mla_decode over a bf16 and an fp8_ds_mla cache, 64 heads of two tokens,
// the keys split (so the combine runs too), captured and replayed as above. The workspace is what the forced plan's
// splits need.
TEST(CudaCapture, EveryAttentionKernelReplaysInAGraph) {
  constexpr int64_t kTokens = 2, kWideHeads = 64;
  Rng rng(77);
  const auto table = shuffled_table(rng);
  for (cuda::AttentionKernel kernel : {cuda::AttentionKernel::small_heads, cuda::AttentionKernel::head_tile,
                                       cuda::AttentionKernel::wide_tile, cuda::AttentionKernel::wgmma})
    for (DType kv : {DType::bf16, DType::fp8_ds_mla})
      for (bool paged : {false, true}) {
        SCOPED_TRACE(std::string(cuda::mla::kernel_name(kernel)) + (paged ? ", paged, " : ", sparse, ") +
                     std::string(dtype_name(kv)));
        // Only the kernels this device (or the arch it emulates) holds: the wgmma kernel on Hopper with sm_90a
        // code; 64 heads of the small-heads kernel (16 a CTA) and the wide tile within its shared memory.
        const auto f = kv == DType::bf16 ? cuda::mla::CacheFormat::bf16 : cuda::mla::CacheFormat::fp8_ds_mla;
        if (kernel == cuda::AttentionKernel::wgmma && !cuda::wgmma_kernels_available()) continue;
        if (kernel == cuda::AttentionKernel::small_heads &&
            !cuda::mla::small::find_small_heads_config(f, kMlaRopeDim, paged, kWideHeads))
          continue;
        if (kernel == cuda::AttentionKernel::wide_tile && !cuda::mla::wide::find_wide_config(f, kMlaRopeDim, paged))
          continue;
        const cuda::AttentionChoice choice{kernel, 0, 0, 0, 4};  // four splits of each row's keys
        const int64_t row = MlaHead{kMlaRopeDim}.cache_row(kv), row_bytes = row * static_cast<int64_t>(dtype_size(kv));
        const auto random_cache = [&] {  // bf16 rows, or fp8_ds_mla rows: e4m3 codes (no NaN), scales, bf16 rope
          std::vector<uint8_t> c(static_cast<size_t>(kSlots * row_bytes));
          const auto values = bf16(rng, c.size() / 2);
          std::memcpy(c.data(), values.data(), c.size());
          if (kv == DType::fp8_ds_mla)
            for (int64_t slot = 0; slot < kSlots; ++slot) {
              uint8_t* row = c.data() + slot * row_bytes;
              for (int d = 0; d < kMlaLatentDim; ++d) row[d] = static_cast<uint8_t>(rng() % 0x7f | (rng() & 0x80));
              for (int t = 0; t < 4; ++t) {
                const float scale = 0.005f + 0.001f * static_cast<float>(rng() % 40);
                std::memcpy(row + kMlaLatentDim + 4 * t, &scale, 4);
              }
            }
          return c;
        };
        const auto cache = random_cache(), cache2 = random_cache();
        OpCase c;
        const auto q = [&] {
          return c.input(bf16(rng, kTokens * kWideHeads * kMlaQkDim), bf16(rng, kTokens * kWideHeads * kMlaQkDim));
        };
        const TensorView kv_cache = view(c.input(cache, cache2), {kBlocks, kBlockSize, row}, kv);
        // The op's run, and the workspace its forced plan's splits need (partial outputs, lses and maxima).
        const auto finish = [&](auto a, auto plan_of, auto call) {
          a.kv_cache = kv_cache;
          a.softmax_scale = 0.07f;
          const int splits = plan_of(a, choice).num_splits;
          EXPECT_EQ(splits, 4);
          c.run = [a, choice, call](cudaStream_t s, TensorView ws) mutable {
            a.stream = s;
            a.workspace = ws;
            call(a, choice);
          };
          c.size = [splits] { return size_t{4} * splits * kTokens * kWideHeads * (kMlaVDim + 2); };
        };
        if (!paged) {
          SparseMlaArgs a;
          a.q = view(q(), {kTokens, kWideHeads, kMlaQkDim}, DType::bf16);
          a.indices = view(c.input(random_slots(rng, kTokens * kTopk), random_slots(rng, kTokens * kTopk)),
                           {kTokens, kTopk}, DType::i32);
          a.out = view(c.output(kTokens * kWideHeads * kMlaVDim * 2), {kTokens, kWideHeads, kMlaVDim}, DType::bf16);
          a.lse = view(c.output(kTokens * kWideHeads * 4), {kTokens, kWideHeads}, DType::f32);
          finish(a, [](const SparseMlaArgs& x, cuda::AttentionChoice ch) { return cuda::sparse_mla_plan(x, ch); },
                 [](const SparseMlaArgs& x, cuda::AttentionChoice ch) { cuda::sparse_mla(x, ch); });
        } else {
          PagedMlaDecodeArgs a;
          a.q = view(q(), {kTokens, 1, kWideHeads, kMlaQkDim}, DType::bf16);
          a.block_table = view(c.same_input([&] {
                                 std::vector<int32_t> t(table);
                                 t.insert(t.end(), table.rbegin(), table.rend());
                                 return t;
                               }()),
                               {kTokens, kBlocks}, DType::i32);
          a.seq_lens = view(c.input(std::vector<int32_t>{3000, 4096}, std::vector<int32_t>{2500, 4000}), {kTokens},
                            DType::i32);
          a.out = view(c.output(kTokens * kWideHeads * kMlaVDim * 2), {kTokens, 1, kWideHeads, kMlaVDim}, DType::bf16);
          a.lse = view(c.output(kTokens * kWideHeads * 4), {kTokens, 1, kWideHeads}, DType::f32);
          finish(
              a, [](const PagedMlaDecodeArgs& x, cuda::AttentionChoice ch) { return cuda::paged_mla_decode_plan(x, ch); },
              [](const PagedMlaDecodeArgs& x, cuda::AttentionChoice ch) { cuda::paged_mla_decode(x, ch); });
        }
        expect_replays(c);
      }
}

// Without a workspace, warmed up on another stream: the library's own workspace for the capturing stream would
// have to be allocated. The op says so (naming `workspace`, how to fix it) and the capture stays valid: an op with
// a workspace captured after it replays correctly.
TEST(CudaCapture, DefaultWorkspaceNeverAllocatesWhileCapturing) {
  for (auto& op : all_ops()) {
    if (op->size() == 0) continue;
    SCOPED_TRACE(op->name);
    cudaStream_t warm = nullptr, stream = nullptr;
    CUDA_OK(cudaStreamCreateWithFlags(&warm, cudaStreamNonBlocking));
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    op->load(false);
    op->run(warm, TensorView{});
    CUDA_OK(cudaStreamSynchronize(warm));

    DeviceBuffer ws(op->size());
    const CapturedGraph graph(stream, cudaStreamCaptureModeGlobal, [&] {
      // (dsa_decode_step's first step to need scratch, indexer_topk, is the one to say so)
      test::expect_error([&] { op->run(stream, TensorView{}); }, ErrorKind::invalid_argument,
                         {": workspace: the stream is capturing a CUDA graph", "workspace_size"});
      cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
      CUDA_OK(cudaStreamIsCapturing(stream, &status));
      EXPECT_EQ(status, cudaStreamCaptureStatusActive) << "the capture was invalidated";
      op->run(stream, workspace_view(ws, op->size()));
    });
    op->poison();
    CUDA_OK(cudaGraphLaunch(graph.exec(), stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    const auto replayed = op->outputs();
    op->poison();
    op->run(stream, workspace_view(ws, op->size()));
    CUDA_OK(cudaStreamSynchronize(stream));
    EXPECT_TRUE(replayed == op->outputs());
    CUDA_OK(cudaGetLastError());

    CUDA_OK(cudaStreamDestroy(stream));
    CUDA_OK(cudaStreamDestroy(warm));
  }
}

// 1,000 short-lived streams, each calling every op once without a workspace: the library keeps buffers for a
// few streams only, so the device's free memory ends where it was (an unbounded per-stream workspace would hold
// at least 1,000 x 2 MiB here).
TEST(CudaCapture, StreamChurnLeavesFreeMemoryWhereItWas) {
  auto ops = all_ops();
  for (auto& op : ops) op->load(false);
  const auto call_all = [&](cudaStream_t s) {
    for (auto& op : ops) op->run(s, TensorView{});
  };
  // Warm up: the library's lazily made state (kernel attributes, a few streams' buffers) exists before measuring.
  for (int i = 0; i < 8; ++i) {  // twice the streams the library keeps buffers for
    cudaStream_t s = nullptr;
    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    call_all(s);
    CUDA_OK(cudaStreamSynchronize(s));
    CUDA_OK(cudaStreamDestroy(s));
  }
  CUDA_OK(cudaDeviceSynchronize());
  size_t free_before = 0, total = 0;
  CUDA_OK(cudaMemGetInfo(&free_before, &total));
  for (int i = 0; i < 1000; ++i) {
    cudaStream_t s = nullptr;
    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    call_all(s);
    CUDA_OK(cudaStreamDestroy(s));
  }
  CUDA_OK(cudaDeviceSynchronize());
  size_t free_after = 0;
  CUDA_OK(cudaMemGetInfo(&free_after, &total));
  const double lost_mib = (static_cast<double>(free_before) - static_cast<double>(free_after)) / (1 << 20);
  EXPECT_LE(lost_mib, 16.0) << "free memory fell by " << lost_mib << " MiB over 1,000 streams";
}

}  // namespace
}  // namespace smla
