// random_attention_weights and shard_attention_heads: random weights fit MlaLayer's shape checks and repeat with
// their seed; the ranks' shards of a layer, run as layers, sum to the whole layer's output (o_proj's partial sums).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "smla/error.h"
#include "smla/layer.h"
#include "smla/weights.h"
#include "support/layer_util.h"
#include "support/test_util.h"

namespace smla {
namespace {

using test::tiny_spec;

std::vector<float> run_layer(AttentionWeights weights, const std::vector<float>& hidden) {
  MlaLayer layer(std::move(weights), {.num_blocks = 4, .block_size = 4});
  std::vector<float> out(hidden.size());
  const LayerSegment prompt{layer.add_request(), int(hidden.size() / layer.spec().hidden_size)};
  layer.forward({&prompt, 1}, hidden.data(), out.data(), AttentionPath::unabsorbed);  // fp32 throughout
  return out;
}

TEST(RandomWeights, FitTheLayerAndRepeatWithTheSeed) {
  for (const AttentionSpec& spec : {tiny_spec(true, 48), tiny_spec(false, 0)}) {
    const AttentionWeights a = random_attention_weights(spec, 3), b = random_attention_weights(spec, 3);
    EXPECT_EQ(a.q_b.data, b.q_b.data);
    EXPECT_EQ(a.o.data, b.o.data);
    EXPECT_NE(a.o.data, random_attention_weights(spec, 4).o.data);
    EXPECT_EQ(a.kv_a_norm.data, std::vector<float>(512, 1.f));
    const float bound = std::sqrt(3.f / float(spec.hidden_size));
    for (const float x : a.kv_a_mqa.data) ASSERT_LE(std::fabs(x), bound);
    EXPECT_NO_THROW(MlaLayer(a, {.num_blocks = 1, .block_size = 4}));  // every shape as the layer checks it
  }
  const AttentionWeights sparse = random_attention_weights(tiny_spec(true, 48), 1);
  EXPECT_EQ(sparse.indexer.k_norm_bias.data, std::vector<float>(128, 0.f));
  EXPECT_EQ(sparse.indexer.k_norm.data, std::vector<float>(128, 1.f));
}

TEST(ShardHeads, RanksSumToTheWholeLayer) {
  for (const AttentionSpec& spec : {tiny_spec(true, 48), tiny_spec(false, 0)}) {
    const AttentionWeights whole = random_attention_weights(spec, 5);
    test::Rng rng(9);
    const std::vector<float> hidden = test::random_floats(rng, size_t(6 * spec.hidden_size));
    const std::vector<float> want = run_layer(whole, hidden);
    std::vector<float> sum(want.size(), 0.f);
    for (int rank = 0; rank < 2; ++rank) {
      const AttentionWeights part = shard_attention_heads(whole, 2, rank);
      EXPECT_EQ(part.spec.num_heads, 2);
      EXPECT_EQ(part.o.shape, (std::vector<int64_t>{64, 2 * 48}));
      const std::vector<float> out = run_layer(part, hidden);
      for (size_t i = 0; i < sum.size(); ++i) sum[i] += out[i];
    }
    double max_abs = 0, max_err = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      max_abs = std::max(max_abs, double(std::fabs(want[i])));
      max_err = std::max(max_err, double(std::fabs(want[i] - sum[i])));
    }
    EXPECT_LT(max_err, 1e-5 * max_abs) << spec.model_type;
  }
}

TEST(ShardHeads, Errors) {
  const AttentionWeights whole = random_attention_weights(tiny_spec(true, 48), 1);
  test::expect_error([&] { shard_attention_heads(whole, 3, 0); }, ErrorKind::invalid_argument,
                     {"tp 3 does not divide the 4 heads"});
  test::expect_error([&] { shard_attention_heads(whole, 2, 2); }, ErrorKind::invalid_argument,
                     {"rank: expected 0 to 1, got 2"});
  AttentionWeights bad = whole;
  bad.kv_b.shape = {1, 1};
  test::expect_error([&] { shard_attention_heads(bad, 2, 0); }, ErrorKind::invalid_argument,
                     {"kv_b_proj.weight: expected shape [320, 512], got [1, 1]"});
}

}  // namespace
}  // namespace smla
