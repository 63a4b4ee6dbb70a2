// Hostile op inputs on the CUDA backend (the CPU side is tests/cpu/test_op_inputs.cpp): every op with an empty
// batch, given as numpy (zero strides) and torch (null data) give them, launches nothing, raises nothing and leaves
// the caches alone; an output overlapping an input is refused before any kernel runs.
#include <cstdint>
#include <string>
#include <vector>

#include "gpu_util.h"
#include "smla/error.h"
#include "smla/ops.h"

namespace smla {
namespace {

constexpr int64_t kHeads = 8, kTopk = 16, kBlocks = 4, kBlockSize = 16, kIndexHeads = 4;

TensorView empty_view(void* data, std::initializer_list<int64_t> shape, DType dtype, bool zero_strides) {
  TensorView v(data, shape, dtype, Device::cuda(0, 0));
  if (zero_strides)
    for (int d = 0; d < v.ndim; ++d) v.strides[d] = 0;
  return v;
}

std::vector<uint16_t> pattern(size_t n) {
  std::vector<uint16_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint16_t>(0x3c00 + i % 977);
  return v;
}

TEST(CudaOpInputs, EmptyBatchesLaunchNothing) {
  const std::vector<uint16_t> kv_host = pattern(kBlocks * kBlockSize * kMlaQkDim),
                              index_host = pattern(kBlocks * kBlockSize * kIndexHeadDim);
  DeviceBuffer kv(kv_host), index(index_host), table(std::vector<int32_t>{2, 0, 3, 1}), scratch(64);
  const TensorView kv_cache = on_gpu(TensorView(nullptr, {kBlocks, kBlockSize, kMlaQkDim}, DType::bf16), kv.ptr);
  const TensorView index_cache =
      on_gpu(TensorView(nullptr, {kBlocks, kBlockSize, kIndexHeadDim}, DType::bf16), index.ptr);
  const TensorView block_table = on_gpu(TensorView(nullptr, {1, kBlocks}, DType::i32), table.ptr);
  for (const bool null_data : {false, true}) {
    SCOPED_TRACE(null_data ? "null data" : "zero strides");
    void* data = null_data ? nullptr : scratch.ptr;
    const auto empty = [&](std::initializer_list<int64_t> shape, DType dtype) {
      return empty_view(data, shape, dtype, !null_data);
    };
    DsaDecodeStepArgs s;
    IndexerTopkArgs& ix = s.indexer;
    ix.q = empty({0, kIndexHeads, kIndexHeadDim}, DType::bf16);
    ix.weights = empty({0, kIndexHeads}, DType::f32);
    ix.index_cache = index_cache;
    ix.request_ids = empty({0}, DType::i32);
    ix.block_table = block_table;
    ix.context_lens = empty({0}, DType::i32);
    ix.topk = empty({0, kTopk}, DType::i32);
    s.slots = empty({0, kTopk}, DType::i32);
    s.q = empty({0, kHeads, kMlaQkDim}, DType::bf16);
    s.kv_cache = kv_cache;
    s.softmax_scale = 0.1f;
    s.out = empty({0, kHeads, kMlaVDim}, DType::bf16);
    s.lse = empty({0, kHeads}, DType::f32);
    EXPECT_NO_THROW(indexer_topk(ix, &gpu()));
    EXPECT_NO_THROW(positions_to_slots(slots_step(s), &gpu()));
    EXPECT_NO_THROW(sparse_mla(attention_step(s), &gpu()));
    EXPECT_NO_THROW(dsa_decode_step(s, &gpu()));
    PagedMlaDecodeArgs paged;
    paged.q = empty({0, 1, kHeads, kMlaQkDim}, DType::bf16);
    paged.kv_cache = kv_cache;
    paged.block_table = empty({0, kBlocks}, DType::i32);
    paged.seq_lens = empty({0}, DType::i32);
    paged.softmax_scale = 0.1f;
    paged.out = empty({0, 1, kHeads, kMlaVDim}, DType::bf16);
    paged.lse = empty({0, 1, kHeads}, DType::f32);
    EXPECT_NO_THROW(paged_mla_decode(paged, &gpu()));
    EXPECT_NO_THROW(write_mla_cache({empty({0, kMlaLatentDim}, DType::bf16), empty({0, kMlaRopeDim}, DType::bf16),
                                     empty({0}, DType::i64), kv_cache},
                                    &gpu()));
    EXPECT_NO_THROW(write_index_cache({empty({0, kIndexHeadDim}, DType::f32), empty({0}, DType::i64), index_cache},
                                      &gpu()));
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaGetLastError());  // no launch of an empty grid
    EXPECT_EQ(kv.download<uint16_t>(), kv_host);
    EXPECT_EQ(index.download<uint16_t>(), index_host);
  }
}

TEST(CudaOpInputs, OutputInsideTheCacheIsRefusedBeforeAnyKernel) {
  const std::vector<uint16_t> kv_host = pattern(kBlocks * kBlockSize * kMlaQkDim);
  DeviceBuffer kv(kv_host), q(pattern(2 * kHeads * kMlaQkDim)), indices(std::vector<int32_t>(2 * kTopk, 3)),
      lse(2 * kHeads * sizeof(float));
  SparseMlaArgs a;
  a.q = on_gpu(TensorView(nullptr, {2, kHeads, kMlaQkDim}, DType::bf16), q.ptr);
  a.kv_cache = on_gpu(TensorView(nullptr, {kBlocks, kBlockSize, kMlaQkDim}, DType::bf16), kv.ptr);
  a.indices = on_gpu(TensorView(nullptr, {2, kTopk}, DType::i32), indices.ptr);
  a.softmax_scale = 0.1f;
  a.out = on_gpu(TensorView(nullptr, {2, kHeads, kMlaVDim}, DType::bf16), kv.ptr);  // the cache's first rows
  a.lse = on_gpu(TensorView(nullptr, {2, kHeads}, DType::f32), lse.ptr);
  try {
    sparse_mla(a, &gpu());
    FAIL() << "an out inside kv_cache was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("sparse_mla: out: overlaps input kv_cache"), std::string::npos) << e.what();
  }
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(kv.download<uint16_t>(), kv_host);
}

}  // namespace
}  // namespace smla
