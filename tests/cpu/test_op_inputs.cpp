// Hostile but legal-looking op inputs, on every op: empty batches (numpy hands
// them out with zero strides, torch with null data) must just work and touch
// nothing; outputs that overlap an input or another output, or whose elements
// share memory, are refused with an error naming both arguments (docs/ops.md,
// "Aliasing").
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "smla/error.h"
#include "smla/ops.h"
#include "support/test_util.h"

namespace smla {
namespace {

using test::expect_error;
using test::Rng;

constexpr int64_t kTokens = 3, kHeads = 8, kTopk = 16, kBlocks = 4, kBlockSize = 16, kIndexHeads = 4;

// A zero-token view the way numpy exports one: every stride 0, data non-null.
TensorView empty_numpy_style(void* data, std::initializer_list<int64_t> shape, DType dtype) {
  TensorView v(data, shape, dtype);
  for (int d = 0; d < v.ndim; ++d) v.strides[d] = 0;
  return v;
}

// One DSA decode problem on the CPU with random data: every op's tensors, valid as given.
struct Problem {
  std::vector<uint16_t> q, kv_cache, index_q, index_cache, out, latent, k_pe, keys;
  std::vector<float> weights, lse;
  std::vector<int32_t> request_ids, block_table, context_lens, seq_lens, topk, slots;
  std::vector<int64_t> slot_mapping;
  DsaDecodeStepArgs step;

  Problem() {
    Rng rng(7);
    const auto bf16 = [&](size_t n) { return test::to_half_bits(test::random_floats(rng, n), DType::bf16); };
    q = bf16(kTokens * kHeads * kMlaQkDim);
    kv_cache = bf16(kBlocks * kBlockSize * kMlaQkDim);
    index_q = bf16(kTokens * kIndexHeads * kIndexHeadDim);
    index_cache = bf16(kBlocks * kBlockSize * kIndexHeadDim);
    latent = bf16(kTokens * kMlaLatentDim);
    k_pe = bf16(kTokens * kMlaRopeDim);
    keys = bf16(kTokens * kIndexHeadDim);
    weights = test::random_floats(rng, kTokens * kIndexHeads, 0.1f, 1.f);
    out.assign(kTokens * kHeads * kMlaVDim, 0x7fc0);
    lse.assign(kTokens * kHeads, 0.f);
    request_ids = {0, 0, 0};
    block_table = {2, 0, 3, 1};
    context_lens = {20, 40, 64};
    seq_lens = {5, 11, 16};  // paged_mla_decode's requests: one block each
    topk.assign(kTokens * kTopk, -7);
    slots.assign(kTokens * kTopk, -7);
    slot_mapping = {3, 17, 40};

    IndexerTopkArgs& ix = step.indexer;
    ix.q = TensorView(index_q.data(), {kTokens, kIndexHeads, kIndexHeadDim}, DType::bf16);
    ix.weights = TensorView(weights.data(), {kTokens, kIndexHeads}, DType::f32);
    ix.index_cache = TensorView(index_cache.data(), {kBlocks, kBlockSize, kIndexHeadDim}, DType::bf16);
    ix.request_ids = TensorView(request_ids.data(), {kTokens}, DType::i32);
    ix.block_table = TensorView(block_table.data(), {1, kBlocks}, DType::i32);
    ix.context_lens = TensorView(context_lens.data(), {kTokens}, DType::i32);
    ix.topk = TensorView(topk.data(), {kTokens, kTopk}, DType::i32);
    step.slots = TensorView(slots.data(), {kTokens, kTopk}, DType::i32);
    step.q = TensorView(q.data(), {kTokens, kHeads, kMlaQkDim}, DType::bf16);
    step.kv_cache = TensorView(kv_cache.data(), {kBlocks, kBlockSize, kMlaQkDim}, DType::bf16);
    step.softmax_scale = 0.1f;
    step.out = TensorView(out.data(), {kTokens, kHeads, kMlaVDim}, DType::bf16);
    step.lse = TensorView(lse.data(), {kTokens, kHeads}, DType::f32);
  }
  SparseMlaArgs sparse() const { return attention_step(step); }
  PositionsToSlotsArgs to_slots() const { return slots_step(step); }
  WriteMlaCacheArgs write_mla() {
    return {TensorView(latent.data(), {kTokens, kMlaLatentDim}, DType::bf16),
            TensorView(k_pe.data(), {kTokens, kMlaRopeDim}, DType::bf16),
            TensorView(slot_mapping.data(), {kTokens}, DType::i64), step.kv_cache};
  }
  WriteIndexCacheArgs write_index() {
    return {TensorView(keys.data(), {kTokens, kIndexHeadDim}, DType::bf16),
            TensorView(slot_mapping.data(), {kTokens}, DType::i64), step.indexer.index_cache};
  }
  PagedMlaDecodeArgs paged() const {
    PagedMlaDecodeArgs a;
    a.q = step.q;
    a.q.ndim = 4;  // [B = 3, s_q = 1, H, 576]
    a.q.shape = {kTokens, 1, kHeads, kMlaQkDim};
    a.q.strides = {kHeads * kMlaQkDim, kHeads * kMlaQkDim, kMlaQkDim, 1};
    a.kv_cache = step.kv_cache;
    a.block_table = TensorView(const_cast<int32_t*>(block_table.data()), {kTokens, 1}, DType::i32);
    a.seq_lens = TensorView(const_cast<int32_t*>(seq_lens.data()), {kTokens}, DType::i32);
    a.softmax_scale = 0.1f;
    a.out = step.out;
    a.out.ndim = 4;
    a.out.shape = {kTokens, 1, kHeads, kMlaVDim};
    a.out.strides = {kHeads * kMlaVDim, kHeads * kMlaVDim, kMlaVDim, 1};
    a.lse = TensorView(const_cast<float*>(lse.data()), {kTokens, 1, kHeads}, DType::f32);
    return a;
  }
};

TEST(OpInputs, ProblemIsValidAsGiven) {
  Problem p;
  EXPECT_NO_THROW(dsa_decode_step(p.step));
  EXPECT_NO_THROW(write_mla_cache(p.write_mla()));
  EXPECT_NO_THROW(write_index_cache(p.write_index()));
  EXPECT_NO_THROW(paged_mla_decode(p.paged()));
}

// Every op with zero tokens (rows to write), given as numpy gives them (zero strides) and as torch does (null
// data): no error, and the caches and every other output untouched.
TEST(OpInputs, EmptyBatchesJustWork) {
  for (const bool null_data : {false, true}) {
    SCOPED_TRACE(null_data ? "null data" : "zero strides");
    Problem p;
    const std::vector<uint16_t> kv_before = p.kv_cache, index_before = p.index_cache;
    uint8_t scratch[16] = {};
    void* data = null_data ? nullptr : scratch;
    const auto empty = [&](std::initializer_list<int64_t> shape, DType dtype) {
      return empty_numpy_style(data, shape, dtype);
    };
    DsaDecodeStepArgs s = p.step;
    IndexerTopkArgs& ix = s.indexer;
    ix.q = empty({0, kIndexHeads, kIndexHeadDim}, DType::bf16);
    ix.weights = empty({0, kIndexHeads}, DType::f32);
    ix.request_ids = empty({0}, DType::i32);
    ix.context_lens = empty({0}, DType::i32);
    ix.topk = empty({0, kTopk}, DType::i32);
    s.slots = empty({0, kTopk}, DType::i32);
    s.q = empty({0, kHeads, kMlaQkDim}, DType::bf16);
    s.out = empty({0, kHeads, kMlaVDim}, DType::bf16);
    s.lse = empty({0, kHeads}, DType::f32);
    EXPECT_NO_THROW(indexer_topk(ix));
    EXPECT_NO_THROW(positions_to_slots(slots_step(s)));
    EXPECT_NO_THROW(sparse_mla(attention_step(s)));
    EXPECT_NO_THROW(dsa_decode_step(s));

    PagedMlaDecodeArgs paged = p.paged();
    paged.q = empty({0, 1, kHeads, kMlaQkDim}, DType::bf16);
    paged.block_table = empty({0, 1}, DType::i32);
    paged.seq_lens = empty({0}, DType::i32);
    paged.out = empty({0, 1, kHeads, kMlaVDim}, DType::bf16);
    paged.lse = empty({0, 1, kHeads}, DType::f32);
    EXPECT_NO_THROW(paged_mla_decode(paged));
    // s_q = 0 with requests present.
    PagedMlaDecodeArgs no_new_tokens = p.paged();
    no_new_tokens.q = empty({kTokens, 0, kHeads, kMlaQkDim}, DType::bf16);
    no_new_tokens.out = empty({kTokens, 0, kHeads, kMlaVDim}, DType::bf16);
    no_new_tokens.lse = empty({kTokens, 0, kHeads}, DType::f32);
    EXPECT_NO_THROW(paged_mla_decode(no_new_tokens));

    WriteMlaCacheArgs w = p.write_mla();
    w.latent = empty({0, kMlaLatentDim}, DType::bf16);
    w.k_pe = empty({0, kMlaRopeDim}, DType::bf16);
    w.slot_mapping = empty({0}, DType::i64);
    EXPECT_NO_THROW(write_mla_cache(w));
    WriteIndexCacheArgs wi = p.write_index();
    wi.k = empty({0, kIndexHeadDim}, DType::bf16);
    wi.slot_mapping = empty({0}, DType::i64);
    EXPECT_NO_THROW(write_index_cache(wi));

    EXPECT_EQ(p.kv_cache, kv_before);
    EXPECT_EQ(p.index_cache, index_before);
    for (int32_t v : p.topk) EXPECT_EQ(v, -7);
    for (uint16_t v : p.out) EXPECT_EQ(v, 0x7fc0);
  }
}

// A cache of no blocks (numpy: zero strides) has no valid slot: every row is empty (out 0, lse -inf), no error.
TEST(OpInputs, CacheOfNoBlocks) {
  Problem p;
  SparseMlaArgs a = p.sparse();
  uint8_t scratch[16] = {};
  a.kv_cache = empty_numpy_style(scratch, {0, kBlockSize, kMlaQkDim}, DType::bf16);
  std::vector<int32_t> indices(kTokens * kTopk, 0);
  a.indices = TensorView(indices.data(), {kTokens, kTopk}, DType::i32);
  ASSERT_NO_THROW(sparse_mla(a));
  for (uint16_t v : p.out) EXPECT_EQ(v, 0);
  for (float v : p.lse) EXPECT_EQ(v, -std::numeric_limits<float>::infinity());
  IndexerTopkArgs ix = p.step.indexer;
  ix.index_cache = empty_numpy_style(scratch, {0, kBlockSize, kFp8IndexRowBytes}, DType::fp8_e4m3);
  std::vector<int32_t> lens(kTokens, 0);
  ix.context_lens = TensorView(lens.data(), {kTokens}, DType::i32);
  ASSERT_NO_THROW(indexer_topk(ix));
  for (int32_t v : p.topk) EXPECT_EQ(v, -1);
}

// A tensor shaped like `like` on another tensor's memory.
TensorView view_into(const TensorView& like, void* base, int64_t byte_offset = 0) {
  TensorView v = like;
  v.data = static_cast<uint8_t*>(base) + byte_offset;
  return v;
}

TEST(OpInputs, OutputOverlappingAnInputIsRefused) {
  Problem p;
  // out inside kv_cache: the first rows of the cache.
  SparseMlaArgs a = p.sparse();
  positions_to_slots(p.to_slots());
  a.out = view_into(a.out, p.kv_cache.data());
  expect_error([&] { sparse_mla(a); }, ErrorKind::invalid_argument, {"sparse_mla: out: overlaps input kv_cache"});
  // q right after out in one buffer: touching is fine, one element further back overlaps.
  std::vector<uint16_t> shared(p.out.size() + p.q.size());
  a = p.sparse();
  a.out = view_into(a.out, shared.data());
  a.q = view_into(a.q, shared.data() + p.out.size());
  EXPECT_NO_THROW(sparse_mla(a));
  a.q.data = shared.data() + p.out.size() - 1;
  expect_error([&] { sparse_mla(a); }, ErrorKind::invalid_argument, {"sparse_mla: out: overlaps input q"});
  // lse inside out (two outputs).
  a = p.sparse();
  a.lse = view_into(a.lse, p.out.data(), 64);
  expect_error([&] { sparse_mla(a); }, ErrorKind::invalid_argument, {"sparse_mla: lse: overlaps output out"});
  // indices read through a view of the output.
  a = p.sparse();
  a.indices = view_into(a.indices, p.lse.data());
  expect_error([&] { sparse_mla(a); }, ErrorKind::invalid_argument, {"sparse_mla: lse: overlaps input indices"});

  PagedMlaDecodeArgs paged = p.paged();
  paged.lse = view_into(paged.lse, p.seq_lens.data());
  expect_error([&] { paged_mla_decode(paged); }, ErrorKind::invalid_argument,
               {"paged_mla_decode: lse: overlaps input seq_lens"});

  WriteMlaCacheArgs w = p.write_mla();
  w.latent = view_into(w.latent, p.kv_cache.data(), 2 * kMlaQkDim);
  expect_error([&] { write_mla_cache(w); }, ErrorKind::invalid_argument,
               {"write_mla_cache: cache: overlaps input latent"});
  WriteIndexCacheArgs wi = p.write_index();
  wi.k = view_into(wi.k, p.index_cache.data());
  expect_error([&] { write_index_cache(wi); }, ErrorKind::invalid_argument,
               {"write_index_cache: cache: overlaps input k"});

  IndexerTopkArgs ix = p.step.indexer;
  ix.topk = TensorView(p.block_table.data(), {kTokens, 1}, DType::i32);
  ix.topk.shape[1] = 1;
  expect_error([&] { indexer_topk(ix); }, ErrorKind::invalid_argument,
               {"indexer_topk: topk: overlaps input block_table"});

  PositionsToSlotsArgs ps = p.to_slots();
  ps.slots = ps.positions;  // in place
  expect_error([&] { positions_to_slots(ps); }, ErrorKind::invalid_argument,
               {"positions_to_slots: slots: overlaps input positions"});

  // dsa_decode_step: one step's output against another step's tensors, which no step's own check sees.
  DsaDecodeStepArgs s = p.step;
  s.slots = s.indexer.topk;
  expect_error([&] { dsa_decode_step(s); }, ErrorKind::invalid_argument,
               {"dsa_decode_step: slots: overlaps output indexer.topk"});
  s = p.step;
  s.out = view_into(s.out, p.index_q.data());
  s.out.shape[0] = 1;
  s.out.shape[1] = 1;  // 512 values fit in index_q
  s.lse.shape = {1, 1};
  s.q.shape[0] = 1;
  s.q.shape[1] = 1;
  s.indexer.q.shape[0] = 1;
  s.indexer.weights.shape[0] = 1;
  s.indexer.request_ids.shape[0] = 1;
  s.indexer.context_lens.shape[0] = 1;
  s.indexer.topk.shape[0] = 1;
  s.slots.shape[0] = 1;
  expect_error([&] { dsa_decode_step(s); }, ErrorKind::invalid_argument,
               {"dsa_decode_step: out: overlaps input indexer.q"});
}

TEST(OpInputs, OutputsWhoseElementsShareMemoryAreRefused) {
  Problem p;
  SparseMlaArgs a = p.sparse();
  a.out.strides[0] = 0;  // every token's rows on the same memory (numpy's broadcast_to)
  expect_error([&] { sparse_mla(a); }, ErrorKind::invalid_argument,
               {"sparse_mla: out: elements share memory: dimension 0", "stride 0"});
  a = p.sparse();
  a.lse.strides = {1, 1};  // interleaved: [t, h] and [t + 1, h - 1] meet
  expect_error([&] { sparse_mla(a); }, ErrorKind::invalid_argument, {"sparse_mla: lse: elements share memory"});
  // A transposed or padded layout is fine: distinct addresses for every element.
  a = p.sparse();
  std::vector<float> wide(kHeads * (kTokens + 5));
  a.lse = TensorView(wide.data(), {kTokens, kHeads}, {1, kTokens + 5}, DType::f32);
  EXPECT_NO_THROW(sparse_mla(a));
  PositionsToSlotsArgs ps = p.to_slots();
  ps.slots.strides[0] = 0;
  expect_error([&] { positions_to_slots(ps); }, ErrorKind::invalid_argument,
               {"positions_to_slots: slots: elements share memory"});
  // A dimension of size 1 may have any stride.
  a = p.sparse();
  a.q.shape[0] = a.indices.shape[0] = a.out.shape[0] = a.lse.shape[0] = 1;
  a.out.strides[0] = 0;
  EXPECT_NO_THROW(sparse_mla(a));
}

}  // namespace
}  // namespace smla
