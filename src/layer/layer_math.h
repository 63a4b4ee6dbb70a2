// Dense building blocks of the attention layer on the CPU: GEMMs through OpenBLAS, the norms and RoPE (and the
// RoPE frequencies both devices use).
#pragma once

#include <cstdint>
#include <vector>

#include "smla/spec.h"

namespace smla::layer {

// y[m, n] = alpha * Σ_k x[m, k] * w[n, k]: a PyTorch Linear with weight w [n, k]. Leading dimensions in floats.
void linear(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy, int64_t m, int64_t n,
            int64_t k, float alpha = 1.f);
// y[m, n] = Σ_k x[m, k] * w[k, n].
void matmul(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy, int64_t m, int64_t n,
            int64_t k);

// x = x / rms(x) * weight over `dim` values of each of `rows` rows `stride` apart.
void rms_norm(float* x, int64_t rows, int64_t dim, int64_t stride, const float* weight, double eps);
// x = (x - mean) / sqrt(var + eps) * weight + bias.
void layer_norm(float* x, int64_t rows, int64_t dim, int64_t stride, const float* weight, const float* bias,
                double eps);

// RoPE frequencies for `dim` rotated values: theta^(-2i/dim), with YaRN's correction when the spec has it (as in
// DeepSeek's reference: frequencies below the correction range are divided by the factor, a linear ramp between).
std::vector<float> rope_inv_freq(const RopeSpec& rope, int dim);
// Rotates x[0, 2 * pairs) in place for `position`.
void apply_rope(float* x, int64_t position, const float* inv_freq, int64_t pairs, RopeStyle style);

}  // namespace smla::layer
