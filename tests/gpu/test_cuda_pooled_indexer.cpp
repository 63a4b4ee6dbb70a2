// The pooled indexer of GLM-5.3-Flash on the GPU against the CPU backend:
// write_pooled_index_cache (same bytes but for rare one-step differences of
// the exponential), pools_to_positions and rotate_index_q (identical), and the
// pipeline write -> indexer_topk over pools -> pools_to_positions for a causal
// prefill chunk.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <set>
#include <string>

#include "core/numeric.h"
#include "gpu_util.h"
#include "reference/indexer_reference.h"
#include "smla/ops.h"
#include "support/test_util.h"

namespace smla {
namespace {

int64_t cache_row(DType c) { return c == DType::bf16 ? kIndexHeadDim : kFp8IndexRowBytes; }

TEST(CudaPooledIndexer, WritePooledIndexCacheMatchesCpu) {
  test::Rng rng(90);
  for (DType src : {DType::f32, DType::bf16, DType::f16})
    for (DType c : {DType::bf16, DType::fp8_e4m3})
      for (int kpool : {1, 4, 7})
        for (bool hadamard : {true, false}) {
          SCOPED_TRACE(std::string(dtype_name(src)) + " -> " + std::string(dtype_name(c)) + " kpool " +
                       std::to_string(kpool) + (hadamard ? " rotated" : ""));
          const int pools = 70, blocks = 8, rows = 16, row_stride = 136;  // token rows padded; one spare row a pool
          const int64_t pool_stride = (kpool + 1) * row_stride;
          std::vector<float> kv = test::random_floats(rng, pools * pool_stride, -3.f, 3.f);
          std::vector<float> gv = test::random_floats(rng, pools * pool_stride, -4.f, 4.f);
          std::vector<float> ape = test::random_floats(rng, kpool * kIndexHeadDim, -2.f, 2.f);
          const std::vector<uint8_t> k = test::to_bytes(kv, src), gate = test::to_bytes(gv, src);
          std::vector<int64_t> slots(pools);
          for (int i = 0; i < pools; ++i) slots[i] = i % 11 == 3 ? -1 : (i * 37) % (blocks * rows);
          // 0xff: NaN in bf16, in e4m3 and in the fp32 scales.
          std::vector<uint8_t> want(blocks * rows * cache_row(c) * dtype_size(c), 0xff);
          WritePooledIndexCacheArgs a;
          a.k = TensorView(const_cast<uint8_t*>(k.data()), {pools, kpool, kIndexHeadDim}, {pool_stride, row_stride, 1},
                           src);
          a.gate = TensorView(const_cast<uint8_t*>(gate.data()), {pools, kpool, kIndexHeadDim},
                              {pool_stride, row_stride, 1}, src);
          a.ape = TensorView(ape.data(), {kpool, kIndexHeadDim}, DType::f32);
          a.slot_mapping = TensorView(slots.data(), {pools}, DType::i64);
          a.cache = TensorView(want.data(), {blocks, rows, cache_row(c)}, c);
          a.hadamard = hadamard;
          write_pooled_index_cache(a, &cpu());
          DeviceBuffer dk(k), dg(gate), da(ape), ds(slots), dc(std::vector<uint8_t>(want.size(), 0xff));
          WritePooledIndexCacheArgs g = a;
          g.k = on_gpu(a.k, dk.ptr);
          g.gate = on_gpu(a.gate, dg.ptr);
          g.ape = on_gpu(a.ape, da.ptr);
          g.slot_mapping = on_gpu(a.slot_mapping, ds.ptr);
          g.cache = on_gpu(a.cache, dc.ptr);
          write_pooled_index_cache(g, &gpu());
          CUDA_OK(cudaDeviceSynchronize());
          const std::vector<uint8_t> got = dc.download<uint8_t>();
          // The arithmetic is the CPU's in the CPU's order; only expf may differ from the CPU's by an ulp, which
          // rarely moves a rounding to bf16 or e4m3 by one step (and, once in a while, the row's scale).
          int64_t differing = 0;
          for (int64_t s = 0; s < blocks * rows; ++s) {
            TensorView gv_cache = a.cache;
            gv_cache.data = const_cast<uint8_t*>(got.data());
            double gs, cs;
            const std::vector<double> gk = reference::ref_index_key(gv_cache, s / rows, s % rows, &gs);
            const std::vector<double> ck = reference::ref_index_key(a.cache, s / rows, s % rows, &cs);
            for (int d = 0; d < kIndexHeadDim; ++d) {
              const double gval = gk[d] * gs, cval = ck[d] * cs;
              if (std::isnan(cval)) {  // an unwritten slot: untouched on both
                EXPECT_TRUE(std::isnan(gval)) << "slot " << s;
                continue;
              }
              if (gval == cval) continue;
              ++differing;
              const double step = c == DType::bf16 ? 0x1p-7 * std::fabs(cval) : 0x1p-3 * std::fabs(cval) + cs * 0x1p-9;
              EXPECT_LE(std::fabs(gval - cval), 2 * step) << "slot " << s << " dim " << d;
            }
          }
          EXPECT_LE(differing, blocks * rows * kIndexHeadDim / 100) << "values differing from the CPU's";
        }
}

TEST(CudaPooledIndexer, PoolsToPositionsMatchesCpu) {
  test::Rng rng(91);
  for (int kpool : {1, 4, 5}) {
    const int tokens = 50, kp = 512 / kpool, width = kp * kpool + kpool - 1;
    std::vector<int32_t> pools(tokens * kp), ctx(tokens);
    for (int t = 0; t < tokens; ++t) ctx[t] = t < 6 ? t : static_cast<int32_t>(rng() % 5000);
    for (auto& p : pools) p = static_cast<int32_t>(rng() % 1300) - 10;  // negatives, and pools past the context
    std::vector<int32_t> want(tokens * width, 7);
    PoolsToPositionsArgs a;
    a.pools = TensorView(pools.data(), {tokens, kp}, DType::i32);
    a.context_lens = TensorView(ctx.data(), {tokens}, DType::i32);
    a.kpool = kpool;
    a.positions = TensorView(want.data(), {tokens, width}, DType::i32);
    pools_to_positions(a, &cpu());
    DeviceBuffer dp(pools), dctx(ctx), dout(std::vector<int32_t>(want.size(), 7));
    PoolsToPositionsArgs g = a;
    g.pools = on_gpu(a.pools, dp.ptr);
    g.context_lens = on_gpu(a.context_lens, dctx.ptr);
    g.positions = on_gpu(a.positions, dout.ptr);
    pools_to_positions(g, &gpu());
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(dout.download<int32_t>(), want) << "kpool " << kpool;
  }
}

TEST(CudaPooledIndexer, RotateIndexQSameBytesAsCpu) {
  // The CPU's arithmetic in the CPU's order (butterflies, 128^-0.5, bf16, ue8m0 scale, e4m3): identical bytes.
  test::Rng rng(93);
  const int tokens = 37, heads = 32, head_stride = 136;
  for (DType src : {DType::f32, DType::bf16, DType::f16})
    for (DType out_dtype : {DType::bf16, DType::fp8_e4m3}) {
      SCOPED_TRACE(std::string(dtype_name(src)) + " -> " + std::string(dtype_name(out_dtype)));
      std::vector<float> values = test::random_floats(rng, tokens * heads * head_stride, -6.f, 6.f);
      for (int d = 0; d < head_stride; ++d) values[d] *= 1e-4f;  // a tiny head: the 1e-4 floor of the scale
      const std::vector<uint8_t> q = test::to_bytes(values, src);
      std::vector<uint8_t> want(tokens * heads * kIndexHeadDim * dtype_size(out_dtype), 0xab);
      std::vector<float> want_scale(tokens * heads, -1.f);
      RotateIndexQArgs a;
      a.q = TensorView(const_cast<uint8_t*>(q.data()), {tokens, heads, kIndexHeadDim},
                       {heads * head_stride, head_stride, 1}, src);
      a.q_out = TensorView(want.data(), {tokens, heads, kIndexHeadDim}, out_dtype);
      if (out_dtype == DType::fp8_e4m3) a.q_scale = TensorView(want_scale.data(), {tokens, heads}, DType::f32);
      rotate_index_q(a, &cpu());
      DeviceBuffer dq(q), dout(std::vector<uint8_t>(want.size(), 0xab)),
          dscale(std::vector<float>(want_scale.size(), -1.f));
      RotateIndexQArgs g = a;
      g.q = on_gpu(a.q, dq.ptr);
      g.q_out = on_gpu(a.q_out, dout.ptr);
      if (out_dtype == DType::fp8_e4m3) g.q_scale = on_gpu(a.q_scale, dscale.ptr);
      rotate_index_q(g, &gpu());
      CUDA_OK(cudaDeviceSynchronize());
      EXPECT_EQ(dout.download<uint8_t>(), want);
      if (out_dtype == DType::fp8_e4m3) EXPECT_EQ(dscale.download<float>(), want_scale);
    }
}

// GLM-5.3-Flash's shapes: kpool 4, 32 index heads, top-k 2048 tokens = 512 pools, pages of 64 (16 pools a page),
// one request of 5000 tokens (its last pool cut), its last 8 tokens a causal prefill chunk. Everything on the GPU
// (pooled cache written there too), against the CPU on the same inputs: the tails are identical and the selected
// pools agree but for swaps of near-equal scores.
TEST(CudaPooledIndexer, PipelineMatchesCpu) {
  test::Rng rng(92);
  constexpr int kpool = 4, heads = 32, kp = 2048 / kpool, block_size = 64, rows = block_size / kpool;
  constexpr int length = 5001, queries = 8, whole = length / kpool;
  constexpr int max_blocks = (length + block_size - 1) / block_size, num_blocks = max_blocks + 7;
  for (DType c : {DType::bf16, DType::fp8_e4m3}) {
    SCOPED_TRACE(dtype_name(c));
    std::vector<int32_t> table(max_blocks), perm(num_blocks);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::copy(perm.begin(), perm.begin() + max_blocks, table.begin());
    const std::vector<uint8_t> k =
        test::to_bytes(test::random_floats(rng, whole * kpool * kIndexHeadDim, -3.f, 3.f), DType::bf16);
    const std::vector<uint8_t> gate =
        test::to_bytes(test::random_floats(rng, whole * kpool * kIndexHeadDim, -3.f, 3.f), DType::bf16);
    std::vector<float> ape = test::random_floats(rng, kpool * kIndexHeadDim, -1.f, 1.f);
    std::vector<int64_t> slots(whole);
    for (int p = 0; p < whole; ++p) slots[p] = int64_t{table[p * kpool / block_size]} * rows + p % rows;
    const std::vector<uint8_t> q =
        test::to_bytes(test::random_floats(rng, queries * heads * kIndexHeadDim), DType::bf16);
    std::vector<float> weights = test::random_floats(rng, queries * heads, 0.1f, 1.f);
    std::vector<int32_t> req(queries, 0), ctx(queries), pool_ctx(queries);
    for (int j = 0; j < queries; ++j) {
      ctx[j] = length - queries + j + 1;
      pool_ctx[j] = ctx[j] / kpool;
    }
    const int width = kp * kpool + kpool - 1;
    std::vector<uint8_t> cache(num_blocks * rows * cache_row(c) * dtype_size(c), 0xff);
    std::vector<int32_t> top(queries * kp, 5), positions(queries * width, 5);

    WritePooledIndexCacheArgs w;
    w.k = TensorView(const_cast<uint8_t*>(k.data()), {whole, kpool, kIndexHeadDim}, DType::bf16);
    w.gate = TensorView(const_cast<uint8_t*>(gate.data()), {whole, kpool, kIndexHeadDim}, DType::bf16);
    w.ape = TensorView(ape.data(), {kpool, kIndexHeadDim}, DType::f32);
    w.slot_mapping = TensorView(slots.data(), {whole}, DType::i64);
    w.cache = TensorView(cache.data(), {num_blocks, rows, cache_row(c)}, c);
    IndexerTopkArgs ix;
    ix.q = TensorView(const_cast<uint8_t*>(q.data()), {queries, heads, kIndexHeadDim}, DType::bf16);
    ix.weights = TensorView(weights.data(), {queries, heads}, DType::f32);
    ix.index_cache = w.cache;
    ix.request_ids = TensorView(req.data(), {queries}, DType::i32);
    ix.block_table = TensorView(table.data(), {1, max_blocks}, DType::i32);
    ix.context_lens = TensorView(pool_ctx.data(), {queries}, DType::i32);
    ix.topk = TensorView(top.data(), {queries, kp}, DType::i32);
    PoolsToPositionsArgs e;
    e.pools = ix.topk;
    e.context_lens = TensorView(ctx.data(), {queries}, DType::i32);
    e.kpool = kpool;
    e.positions = TensorView(positions.data(), {queries, width}, DType::i32);
    write_pooled_index_cache(w, &cpu());
    indexer_topk(ix, &cpu());
    pools_to_positions(e, &cpu());

    DeviceBuffer dk(k), dg(gate), da(ape), ds(slots), dc(std::vector<uint8_t>(cache.size(), 0xff)), dq(q),
        dw(weights), dr(req), dt(table), dpc(pool_ctx), dctx(ctx), dtop(std::vector<int32_t>(top.size(), 5)),
        dpos(std::vector<int32_t>(positions.size(), 5));
    WritePooledIndexCacheArgs gw = w;
    gw.k = on_gpu(w.k, dk.ptr);
    gw.gate = on_gpu(w.gate, dg.ptr);
    gw.ape = on_gpu(w.ape, da.ptr);
    gw.slot_mapping = on_gpu(w.slot_mapping, ds.ptr);
    gw.cache = on_gpu(w.cache, dc.ptr);
    IndexerTopkArgs gix = ix;
    gix.q = on_gpu(ix.q, dq.ptr);
    gix.weights = on_gpu(ix.weights, dw.ptr);
    gix.index_cache = gw.cache;
    gix.request_ids = on_gpu(ix.request_ids, dr.ptr);
    gix.block_table = on_gpu(ix.block_table, dt.ptr);
    gix.context_lens = on_gpu(ix.context_lens, dpc.ptr);
    gix.topk = on_gpu(ix.topk, dtop.ptr);
    PoolsToPositionsArgs ge = e;
    ge.pools = gix.topk;
    ge.context_lens = on_gpu(e.context_lens, dctx.ptr);
    ge.positions = on_gpu(e.positions, dpos.ptr);
    write_pooled_index_cache(gw, &gpu());
    indexer_topk(gix, &gpu());
    pools_to_positions(ge, &gpu());
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<int32_t> got = dpos.download<int32_t>();
    for (int j = 0; j < queries; ++j) {
      SCOPED_TRACE("token " + std::to_string(j));
      std::set<int32_t> cpu_pools, gpu_pools;
      for (int i = 0; i < kp * kpool; ++i) {
        const int32_t cp = positions[j * width + i], gp = got[j * width + i];
        ASSERT_TRUE(gp >= 0 && gp < pool_ctx[j] * kpool) << "column " << i << ": " << gp;
        EXPECT_EQ(gp % kpool, i % kpool) << "column " << i << ": a pool's tokens in order";
        if (i % kpool == 0) {
          cpu_pools.insert(cp / kpool);
          gpu_pools.insert(gp / kpool);
        }
      }
      EXPECT_EQ(static_cast<int>(gpu_pools.size()), kp) << "each pool once";
      std::vector<int32_t> common;
      std::set_intersection(cpu_pools.begin(), cpu_pools.end(), gpu_pools.begin(), gpu_pools.end(),
                            std::back_inserter(common));
      EXPECT_GE(static_cast<int>(common.size()), kp * 97 / 100) << "pools selected by both";
      for (int i = kp * kpool; i < width; ++i)  // the tail: identical
        EXPECT_EQ(got[j * width + i], positions[j * width + i]) << "column " << i;
    }
  }
}

}  // namespace
}  // namespace smla
