#include "layer/layer_math.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <numbers>

namespace smla::layer {

void linear(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy, int64_t m, int64_t n,
            int64_t k, float alpha) {
  if (m == 0 || n == 0) return;
  // One row (a decode step): OpenBLAS 0.3.21's sgemm does not hand M = 1 to its faster gemv.
  if (m == 1) return cblas_sgemv(CblasRowMajor, CblasNoTrans, n, k, alpha, w, ldw, x, 1, 0.f, y, 1);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, alpha, x, ldx, w, ldw, 0.f, y, ldy);
}

void matmul(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy, int64_t m, int64_t n,
            int64_t k) {
  if (m == 0 || n == 0) return;
  if (m == 1) return cblas_sgemv(CblasRowMajor, CblasTrans, k, n, 1.f, w, ldw, x, 1, 0.f, y, 1);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, k, 1.f, x, ldx, w, ldw, 0.f, y, ldy);
}

void rms_norm(float* x, int64_t rows, int64_t dim, int64_t stride, const float* weight, double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = x + r * stride;
    double sum = 0;
    for (int64_t i = 0; i < dim; ++i) sum += double(row[i]) * row[i];
    const float inv = float(1.0 / std::sqrt(sum / dim + eps));
    for (int64_t i = 0; i < dim; ++i) row[i] = row[i] * inv * weight[i];
  }
}

void layer_norm(float* x, int64_t rows, int64_t dim, int64_t stride, const float* weight, const float* bias,
                double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = x + r * stride;
    double mean = 0, var = 0;
    for (int64_t i = 0; i < dim; ++i) mean += row[i];
    mean /= dim;
    for (int64_t i = 0; i < dim; ++i) var += (row[i] - mean) * (row[i] - mean);
    const double inv = 1.0 / std::sqrt(var / dim + eps);
    for (int64_t i = 0; i < dim; ++i) row[i] = float((row[i] - mean) * inv) * weight[i] + bias[i];
  }
}

std::vector<float> rope_inv_freq(const RopeSpec& rope, int dim) {
  const int half = dim / 2;
  std::vector<float> freq(half);
  for (int i = 0; i < half; ++i) freq[i] = float(1.0 / std::pow(rope.theta, 2.0 * i / dim));
  if (!rope.yarn || rope.factor == 1.0 || rope.original_max_position_embeddings <= 0) return freq;
  // The dimension whose wavelength fits `rotations` times into the original context.
  const auto correction_dim = [&](double rotations) {
    return dim * std::log(rope.original_max_position_embeddings / (rotations * 2 * std::numbers::pi)) /
           (2 * std::log(rope.theta));
  };
  const double low = std::max(std::floor(correction_dim(rope.beta_fast)), 0.0);
  double high = std::min(std::ceil(correction_dim(rope.beta_slow)), double(dim - 1));
  if (low == high) high += 0.001;
  for (int i = 0; i < half; ++i) {
    const float ramp = float(std::clamp((i - low) / (high - low), 0.0, 1.0));  // 0: keep, 1: interpolate
    freq[i] = freq[i] / float(rope.factor) * ramp + freq[i] * (1 - ramp);
  }
  return freq;
}

void apply_rope(float* x, int64_t position, const float* inv_freq, int64_t pairs, RopeStyle style) {
  for (int64_t i = 0; i < pairs; ++i) {
    // float32 angles, as both DeepSeek's reference and transformers compute them.
    const float angle = float(position) * inv_freq[i];
    const float c = std::cos(angle), s = std::sin(angle);
    float& a = style == RopeStyle::interleaved ? x[2 * i] : x[i];
    float& b = style == RopeStyle::interleaved ? x[2 * i + 1] : x[i + pairs];
    const float a0 = a, b0 = b;
    a = a0 * c - b0 * s;
    b = a0 * s + b0 * c;
  }
}

}  // namespace smla::layer
