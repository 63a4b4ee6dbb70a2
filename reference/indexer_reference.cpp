#include "reference/indexer_reference.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "core/numeric.h"

namespace smla::reference {

namespace {

const uint8_t* address(const TensorView& t, std::initializer_list<int64_t> index) {
  int64_t offset = 0, d = 0;
  for (int64_t i : index) offset += i * t.strides[d++];
  return static_cast<const uint8_t*>(t.data) + offset * static_cast<int64_t>(dtype_size(t.dtype));
}

float read_f32(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, sizeof f);
  return f;
}

}  // namespace

double element(const TensorView& t, std::initializer_list<int64_t> index) {
  const uint8_t* p = address(t, index);
  auto read = [p](auto value) {
    std::memcpy(&value, p, sizeof value);
    return value;
  };
  switch (t.dtype) {
    case DType::f32: return read(0.f);
    case DType::f16: return numeric::f16_to_float(read(uint16_t{}));
    case DType::bf16: return numeric::bf16_to_float(read(uint16_t{}));
    case DType::fp8_e4m3: return numeric::e4m3_to_float(*p);
    case DType::i32: return read(int32_t{});
    case DType::i64: return static_cast<double>(read(int64_t{}));
    default: return std::numeric_limits<double>::quiet_NaN();
  }
}

namespace {

// Stores one index key at `slot` of an index cache: bf16, or fp8 e4m3 with its ue8m0 scale.
void store_index_key(const TensorView& cache, int64_t slot, const std::vector<double>& key) {
  const int64_t block_size = cache.shape[1];
  const int64_t block = slot / block_size, offset = slot % block_size;
  uint8_t* base = const_cast<uint8_t*>(address(cache, {block, 0, 0}));
  if (cache.dtype == DType::bf16) {
    for (int64_t d = 0; d < kIndexHeadDim; ++d) {
      const uint16_t bits = numeric::float_to_bf16(static_cast<float>(key[d]));
      std::memcpy(const_cast<uint8_t*>(address(cache, {block, offset, d})), &bits, sizeof bits);
    }
    return;
  }
  double amax = 0;
  for (int64_t d = 0; d < kIndexHeadDim; ++d) amax = std::max(amax, std::fabs(key[d]));
  const float scale = numeric::index_key_scale(static_cast<float>(amax));
  for (int64_t d = 0; d < kIndexHeadDim; ++d)
    base[offset * kIndexHeadDim + d] = numeric::float_to_e4m3(static_cast<float>(key[d] / scale));
  std::memcpy(base + block_size * kIndexHeadDim + offset * 4, &scale, sizeof scale);
}

}  // namespace

void ref_write_index_cache(const WriteIndexCacheArgs& a) {
  for (int64_t i = 0; i < a.k.shape[0]; ++i) {
    const int64_t slot = static_cast<int64_t>(element(a.slot_mapping, {i}));
    if (slot < 0) continue;
    std::vector<double> key(kIndexHeadDim);
    for (int64_t d = 0; d < kIndexHeadDim; ++d) key[d] = element(a.k, {i, d});
    store_index_key(a.cache, slot, key);
  }
}

namespace {

// 128^-0.5 * H_128 x, H_128[i][j] = (-1)^popcount(i & j).
std::vector<double> hadamard(const std::vector<double>& x) {
  std::vector<double> y(kIndexHeadDim);
  for (int64_t i = 0; i < kIndexHeadDim; ++i) {
    double sum = 0;
    for (int64_t j = 0; j < kIndexHeadDim; ++j) sum += (std::popcount(static_cast<unsigned>(i & j)) % 2 ? -1 : 1) * x[j];
    y[i] = sum / std::sqrt(128.0);
  }
  return y;
}

}  // namespace

std::vector<double> ref_pooled_index_key(const WritePooledIndexCacheArgs& a, int64_t p) {
  const int64_t kpool = a.k.shape[1];
  std::vector<double> pooled(kIndexHeadDim);
  for (int64_t d = 0; d < kIndexHeadDim; ++d) {
    double max_score = -std::numeric_limits<double>::infinity();
    for (int64_t m = 0; m < kpool; ++m)
      max_score = std::max(max_score, element(a.gate, {p, m, d}) + element(a.ape, {m, d}));
    double denom = 0, sum = 0;
    for (int64_t m = 0; m < kpool; ++m) {
      const double w = std::exp(element(a.gate, {p, m, d}) + element(a.ape, {m, d}) - max_score);
      denom += w;
      sum += w * element(a.k, {p, m, d});
    }
    pooled[d] = sum / denom;
  }
  return a.hadamard ? hadamard(pooled) : pooled;
}

std::vector<double> ref_rotated_index_q(const RotateIndexQArgs& a, int64_t t, int64_t h) {
  std::vector<double> q(kIndexHeadDim);
  for (int64_t d = 0; d < kIndexHeadDim; ++d) q[d] = element(a.q, {t, h, d});
  return hadamard(q);
}

void ref_write_pooled_index_cache(const WritePooledIndexCacheArgs& a) {
  for (int64_t p = 0; p < a.k.shape[0]; ++p) {
    const int64_t slot = static_cast<int64_t>(element(a.slot_mapping, {p}));
    if (slot >= 0) store_index_key(a.cache, slot, ref_pooled_index_key(a, p));
  }
}

void ref_pools_to_positions(const PoolsToPositionsArgs& a) {
  const int64_t kp = a.pools.shape[1], kpool = a.kpool;
  for (int64_t t = 0; t < a.pools.shape[0]; ++t) {
    const int64_t context = static_cast<int64_t>(element(a.context_lens, {t}));
    const int64_t whole_pools = context / kpool;
    auto put = [&](int64_t column, int64_t value) {
      const int32_t v = static_cast<int32_t>(value);
      std::memcpy(const_cast<uint8_t*>(address(a.positions, {t, column})), &v, sizeof v);
    };
    for (int64_t i = 0; i < kp; ++i) {
      const int64_t pool = static_cast<int64_t>(element(a.pools, {t, i}));
      for (int64_t m = 0; m < kpool; ++m) put(i * kpool + m, pool >= 0 && pool < whole_pools ? pool * kpool + m : -1);
    }
    for (int64_t m = 0; m < kpool - 1; ++m)
      put(kp * kpool + m, whole_pools * kpool + m < context ? whole_pools * kpool + m : -1);
  }
}

std::vector<double> ref_index_key(const TensorView& cache, int64_t block, int64_t offset, double* scale) {
  std::vector<double> key(kIndexHeadDim);
  *scale = 1;
  if (cache.dtype == DType::bf16) {
    for (int64_t d = 0; d < kIndexHeadDim; ++d) key[d] = element(cache, {block, offset, d});
    return key;
  }
  const uint8_t* base = address(cache, {block, 0, 0});
  *scale = read_f32(base + cache.shape[1] * kIndexHeadDim + offset * 4);
  for (int64_t d = 0; d < kIndexHeadDim; ++d) key[d] = numeric::e4m3_to_float(base[offset * kIndexHeadDim + d]);
  return key;
}

std::vector<double> ref_indexer_scores(const IndexerTopkArgs& a, int64_t t) {
  const int64_t heads = a.q.shape[1], block_size = a.index_cache.shape[1];
  const int64_t request = static_cast<int64_t>(element(a.request_ids, {t}));
  const int64_t context = static_cast<int64_t>(element(a.context_lens, {t}));
  std::vector<double> scores(context);
  for (int64_t s = 0; s < context; ++s) {
    const int64_t block = static_cast<int64_t>(element(a.block_table, {request, s / block_size}));
    double k_scale;
    const std::vector<double> key = ref_index_key(a.index_cache, block, s % block_size, &k_scale);
    double score = 0;
    for (int64_t h = 0; h < heads; ++h) {
      double dot = 0;
      for (int64_t d = 0; d < kIndexHeadDim; ++d) dot += element(a.q, {t, h, d}) * key[d];
      const double q_scale = a.q.dtype == DType::fp8_e4m3 ? element(a.q_scale, {t, h}) : 1.0;
      score += element(a.weights, {t, h}) * q_scale * std::max(dot, 0.0);
    }
    scores[s] = score * k_scale;
  }
  return scores;
}

std::vector<int32_t> ref_topk_of_scores(const std::vector<double>& scores, int64_t k) {
  std::vector<int32_t> order(scores.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t x, int32_t y) { return scores[x] > scores[y]; });
  order.resize(static_cast<size_t>(k), -1);
  return order;
}

void ref_indexer_topk(const IndexerTopkArgs& a) {
  const int64_t k = a.topk.shape[1];
  for (int64_t t = 0; t < a.q.shape[0]; ++t) {
    const std::vector<int32_t> best = ref_topk_of_scores(ref_indexer_scores(a, t), k);
    for (int64_t i = 0; i < k; ++i)
      std::memcpy(const_cast<uint8_t*>(address(a.topk, {t, i})), &best[i], sizeof(int32_t));
  }
}

void ref_positions_to_slots(const PositionsToSlotsArgs& a) {
  const int64_t block_size = a.block_size, max_blocks = a.block_table.shape[1];
  for (int64_t t = 0; t < a.positions.shape[0]; ++t) {
    const int64_t request = static_cast<int64_t>(element(a.request_ids, {t}));
    for (int64_t i = 0; i < a.positions.shape[1]; ++i) {
      const int64_t pos = static_cast<int64_t>(element(a.positions, {t, i}));
      int64_t slot = -1;
      if (pos >= 0 && pos < max_blocks * block_size) {
        const int64_t block = static_cast<int64_t>(element(a.block_table, {request, pos / block_size}));
        if (block >= 0) slot = block * block_size + pos % block_size;
      }
      if (slot > std::numeric_limits<int32_t>::max()) slot = -1;
      const int32_t value = static_cast<int32_t>(slot);
      std::memcpy(const_cast<uint8_t*>(address(a.slots, {t, i})), &value, sizeof value);
    }
  }
}

}  // namespace smla::reference
