#include "reference/mla_reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/numeric.h"

namespace smla::reference {

namespace {

double read_value(const TensorView& t, int64_t offset) {
  switch (t.dtype) {
    case DType::f32: return t.ptr<float>()[offset];
    case DType::f16: return numeric::f16_to_float(t.ptr<uint16_t>()[offset]);
    case DType::bf16: return numeric::bf16_to_float(t.ptr<uint16_t>()[offset]);
    default: return std::nan("");
  }
}

const uint8_t* cache_row_bytes(const TensorView& cache, int64_t slot) {
  const int64_t block = slot / cache.shape[1], offset = slot % cache.shape[1];
  const int64_t element = block * cache.strides[0] + offset * cache.strides[1];
  return cache.ptr<uint8_t>() + element * static_cast<int64_t>(dtype_size(cache.dtype));
}

// One query token: q[h] (576 or 512 values per head) against `rows` (as wide), natural-log lse (`empty_lse`
// without rows).
void attend(const std::vector<std::vector<double>>& q, const std::vector<std::vector<double>>& rows, double scale,
            const TensorView& sink, double empty_lse, double* out, double* lse, double* max_logits) {
  for (size_t h = 0; h < q.size(); ++h) {
    double* o = out + h * kMlaVDim;
    std::fill(o, o + kMlaVDim, 0.0);
    if (rows.empty()) {
      lse[h] = empty_lse;
      max_logits[h] = -std::numeric_limits<double>::infinity();
      continue;
    }
    std::vector<double> s(rows.size());
    for (size_t i = 0; i < rows.size(); ++i) {
      double dot = 0;
      for (size_t d = 0; d < q[h].size(); ++d) dot += q[h][d] * rows[i][d];
      s[i] = dot * scale;
    }
    const double m = *std::max_element(s.begin(), s.end());
    max_logits[h] = m;
    double sum = 0;
    for (double x : s) sum += std::exp(x - m);
    lse[h] = m + std::log(sum);
    for (size_t i = 0; i < rows.size(); ++i)
      for (int d = 0; d < kMlaVDim; ++d) o[d] += std::exp(s[i] - lse[h]) * rows[i][d];
    if (sink.defined()) {
      const double factor = 1.0 / (1.0 + std::exp(sink.ptr<float>()[h * sink.strides[0]] - lse[h]));
      for (int d = 0; d < kMlaVDim; ++d) o[d] *= factor;
    }
  }
}

double empty_lse(bool plus_inf) {
  return plus_inf ? std::numeric_limits<double>::infinity() : -std::numeric_limits<double>::infinity();
}

// q heads of a token whose first element is at `offset`, each q's last dimension wide.
std::vector<std::vector<double>> query(const TensorView& q, int64_t offset, int64_t heads, int64_t head_stride) {
  const int64_t qk_dim = q.shape[q.ndim - 1];
  std::vector<std::vector<double>> heads_q(heads, std::vector<double>(qk_dim));
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t d = 0; d < qk_dim; ++d) heads_q[h][d] = read_value(q, offset + h * head_stride + d);
  return heads_q;
}

// fp8_ds_mla_v4 (MlaV4CacheLayout, spelt out again): the block of `slot`, its token's 576 value bytes (448 e4m3, 64
// bf16) at offset * 576, its 7 ue8m0 scale bytes at block_size * 576 + offset * 8.
struct V4Token {
  uint8_t* values;
  uint8_t* scales;
};
V4Token v4_token(const TensorView& cache, int64_t slot) {
  const int64_t block_size = cache.shape[1], offset = slot % block_size;
  uint8_t* block = cache.ptr<uint8_t>() + (slot / block_size) * cache.strides[0];
  return {block + offset * 576, block + block_size * 576 + offset * 8};
}

// The e4m3 byte nearest to x (|x| <= 448), ties to the even code, by search over all finite codes.
uint8_t nearest_e4m3(double x) {
  uint8_t best = 0;
  double best_error = std::numeric_limits<double>::infinity();
  for (int code = 0; code < 256; ++code) {
    const double v = numeric::e4m3_to_float(static_cast<uint8_t>(code));
    if (std::isnan(v) || std::signbit(v) != std::signbit(x)) continue;
    const double error = std::fabs(v - x);
    if (error < best_error || (error == best_error && code % 2 == 0)) best = static_cast<uint8_t>(code), best_error = error;
  }
  return best;
}

void ref_write_v4_token(const TensorView& cache, int64_t slot, const float* x) {
  const V4Token token = v4_token(cache, slot);
  for (int tile = 0; tile < 7; ++tile) {
    double amax = 0;
    for (int d = tile * 64; d < (tile + 1) * 64; ++d) amax = std::max(amax, std::fabs(double(x[d])));
    const int exponent = static_cast<int>(std::ceil(std::log2(std::max(amax / 448.0, 1e-4))));
    token.scales[tile] = static_cast<uint8_t>(exponent + 127);
    for (int d = tile * 64; d < (tile + 1) * 64; ++d) token.values[d] = nearest_e4m3(std::ldexp(double(x[d]), -exponent));
  }
  for (int d = 448; d < 512; ++d) {
    const uint16_t bits = numeric::float_to_bf16(x[d]);
    std::memcpy(token.values + 448 + 2 * (d - 448), &bits, 2);
  }
}

MlaHead head_of(const TensorView& q) { return MlaHead{static_cast<int>(q.shape[q.ndim - 1]) - kMlaLatentDim}; }

}  // namespace

std::vector<double> ref_cache_row(const TensorView& cache, int64_t slot, MlaHead head) {
  const uint8_t* row = cache_row_bytes(cache, slot);
  std::vector<double> v(head.qk_dim());
  if (cache.dtype == DType::fp8_ds_mla_v4) {
    const V4Token token = v4_token(cache, slot);
    for (int d = 0; d < 448; ++d) {
      const uint8_t e = token.scales[d / 64];
      v[d] = numeric::e4m3_to_float(token.values[d]) * (e == 255 ? std::nan("") : std::ldexp(1.0, e - 127));
    }
    for (int d = 448; d < 512; ++d) {
      uint16_t bits;
      std::memcpy(&bits, token.values + 448 + 2 * (d - 448), 2);
      v[d] = numeric::bf16_to_float(bits);
    }
  } else if (cache.dtype == DType::fp8_ds_mla || cache.dtype == DType::fp8_ds_mla_nope) {
    float scales[4];
    std::memcpy(scales, row + kMlaLatentDim, sizeof scales);
    for (int d = 0; d < kMlaLatentDim; ++d) v[d] = double(numeric::e4m3_to_float(row[d])) * scales[d / 128];
    for (int d = 0; d < head.rope_dim; ++d) {
      uint16_t bits;
      std::memcpy(&bits, row + kMlaLatentDim + sizeof scales + 2 * d, 2);
      v[kMlaLatentDim + d] = numeric::bf16_to_float(bits);
    }
  } else {
    for (int d = 0; d < head.qk_dim(); ++d) {
      uint16_t bits;
      std::memcpy(&bits, row + 2 * d, 2);
      v[d] = cache.dtype == DType::bf16 ? numeric::bf16_to_float(bits) : numeric::f16_to_float(bits);
    }
  }
  return v;
}

void ref_write_mla_cache(const WriteMlaCacheArgs& a) {
  for (int64_t i = 0; i < a.latent.shape[0]; ++i) {
    const int64_t slot = a.slot_mapping.ptr<int64_t>()[i * a.slot_mapping.strides[0]];
    if (slot < 0) continue;
    const MlaHead head{a.k_pe.defined() && a.k_pe.numel() > 0 ? kMlaRopeDim : 0};
    float x[kMlaQkDim];
    for (int d = 0; d < kMlaLatentDim; ++d) x[d] = float(read_value(a.latent, i * a.latent.strides[0] + d));
    for (int d = 0; d < head.rope_dim; ++d)
      x[kMlaLatentDim + d] = float(read_value(a.k_pe, i * a.k_pe.strides[0] + d));
    if (a.cache.dtype == DType::fp8_ds_mla_v4) {
      ref_write_v4_token(a.cache, slot, x);
      continue;
    }
    auto* row = const_cast<uint8_t*>(cache_row_bytes(a.cache, slot));
    if (a.cache.dtype != DType::fp8_ds_mla && a.cache.dtype != DType::fp8_ds_mla_nope) {
      for (int d = 0; d < head.qk_dim(); ++d) {
        const uint16_t bits = a.cache.dtype == DType::bf16 ? numeric::float_to_bf16(x[d]) : numeric::float_to_f16(x[d]);
        std::memcpy(row + 2 * d, &bits, 2);
      }
      continue;
    }
    for (int tile = 0; tile < 4; ++tile) {
      float amax = 0;
      for (int d = tile * 128; d < (tile + 1) * 128; ++d) amax = std::max(amax, std::fabs(x[d]));
      const float scale = numeric::ds_mla_tile_scale(amax);
      for (int d = tile * 128; d < (tile + 1) * 128; ++d) row[d] = numeric::float_to_e4m3(x[d] / scale);
      std::memcpy(row + kMlaLatentDim + 4 * tile, &scale, 4);
    }
    for (int d = 0; d < head.rope_dim; ++d) {
      const uint16_t bits = numeric::float_to_bf16(x[kMlaLatentDim + d]);
      std::memcpy(row + kMlaLatentDim + 16 + 2 * d, &bits, 2);
    }
  }
}

RefAttention ref_sparse_mla(const SparseMlaArgs& a) {
  const int64_t tokens = a.q.shape[0], heads = a.q.shape[1], topk = a.indices.shape[1];
  const int64_t num_slots = a.kv_cache.shape[0] * a.kv_cache.shape[1];
  RefAttention r{std::vector<double>(tokens * heads * kMlaVDim), std::vector<double>(tokens * heads),
                 std::vector<double>(tokens * heads)};
  for (int64_t t = 0; t < tokens; ++t) {
    int64_t len = topk;
    if (a.topk_length.defined()) len = a.topk_length.ptr<int32_t>()[t * a.topk_length.strides[0]];
    std::vector<std::vector<double>> rows;
    for (int64_t k = 0; k < len; ++k) {
      const int64_t slot = a.indices.ptr<int32_t>()[t * a.indices.strides[0] + k];
      if (slot >= 0 && slot < num_slots) rows.push_back(ref_cache_row(a.kv_cache, slot, head_of(a.q)));
    }
    // The extra cache's rows join the same softmax.
    if (a.extra_indices.defined()) {
      const int64_t extra_slots = a.extra_kv_cache.shape[0] * a.extra_kv_cache.shape[1];
      int64_t extra_len = a.extra_indices.shape[1];
      if (a.extra_topk_length.defined())
        extra_len = a.extra_topk_length.ptr<int32_t>()[t * a.extra_topk_length.strides[0]];
      for (int64_t k = 0; k < extra_len; ++k) {
        const int64_t slot = a.extra_indices.ptr<int32_t>()[t * a.extra_indices.strides[0] + k];
        if (slot >= 0 && slot < extra_slots) rows.push_back(ref_cache_row(a.extra_kv_cache, slot, head_of(a.q)));
      }
    }
    attend(query(a.q, t * a.q.strides[0], heads, a.q.strides[1]), rows, a.softmax_scale, a.attn_sink,
           empty_lse(a.empty_lse_plus_inf), &r.out[t * heads * kMlaVDim], &r.lse[t * heads], &r.max_logits[t * heads]);
  }
  return r;
}

RefAttention ref_paged_mla_decode(const PagedMlaDecodeArgs& a) {
  const int64_t batch = a.q.shape[0], s_q = a.q.shape[1], heads = a.q.shape[2];
  const int64_t block_size = a.kv_cache.shape[1];
  RefAttention r{std::vector<double>(batch * s_q * heads * kMlaVDim), std::vector<double>(batch * s_q * heads),
                 std::vector<double>(batch * s_q * heads)};
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t seq_len = a.seq_lens.ptr<int32_t>()[b * a.seq_lens.strides[0]];
    for (int64_t j = 0; j < s_q; ++j) {
      const int64_t visible = a.causal ? seq_len - s_q + j + 1 : seq_len;
      std::vector<std::vector<double>> rows;
      for (int64_t pos = 0; pos < visible; ++pos) {
        const int64_t block = a.block_table.ptr<int32_t>()[b * a.block_table.strides[0] + pos / block_size];
        rows.push_back(ref_cache_row(a.kv_cache, block * block_size + pos % block_size, head_of(a.q)));
      }
      const int64_t t = b * s_q + j;
      attend(query(a.q, b * a.q.strides[0] + j * a.q.strides[1], heads, a.q.strides[2]), rows, a.softmax_scale,
             a.attn_sink, empty_lse(a.empty_lse_plus_inf), &r.out[t * heads * kMlaVDim], &r.lse[t * heads],
             &r.max_logits[t * heads]);
    }
  }
  return r;
}

}  // namespace smla::reference
