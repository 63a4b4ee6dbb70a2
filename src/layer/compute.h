// The dense math of the attention layer behind one interface, so that MlaLayer's chunk algorithm is written once:
// the CPU implementation (fp32 weights, OpenBLAS) and the CUDA one (bf16 weights, cuBLAS, small kernels). Every
// pointer an operation takes is in the device's memory; the device runs the operations in order (on a GPU: one
// stream), so results are ready for the next operation without waiting.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "smla/spec.h"
#include "smla/weights.h"

namespace smla::layer {

// A weight matrix [rows, cols] (a PyTorch Linear weight [out, in]) in the form the device multiplies: fp32 on the
// CPU, bf16 on a GPU.
struct Matrix {
  const void* data = nullptr;
  int64_t rows = 0, cols = 0;
};

// One operand per head: head h's rows start at data + h * head_stride, `ld` floats apart.
struct HeadOperand {
  float* data = nullptr;
  int64_t ld = 0, head_stride = 0;
};
// Head h's block of a matrix: `count` rows starting at row h * period + first.
struct HeadRows {
  int64_t first = 0, count = 0, period = 0;
};

class Compute {
 public:
  virtual ~Compute() = default;
  virtual Device device() const = 0;
  virtual void* stream() const = 0;  // the CUDA stream the operations (and the layer's ops) run on; null on the CPU

  // Weights, prepared once and owned by this object: a matrix for the products, a vector (norm weights and biases,
  // RoPE frequencies) stays fp32.
  virtual Matrix matrix(WeightTensor tensor) = 0;
  virtual const float* vector(std::vector<float> values) = 0;
  // Zeroed memory owned by this object (the caches).
  virtual void* allocate_zeroed(size_t bytes) = 0;
  // Scratch buffer `id` of at least `bytes`, contents undefined; it moves when the same id asks for more.
  virtual void* scratch(int id, size_t bytes) = 0;
  // A copy of host bytes in the device's memory (on a GPU one asynchronous copy), valid until the next call.
  virtual void* stage(std::span<const std::byte> host) = 0;
  // Waits until every operation issued so far has finished (profiling only: nothing else needs it).
  virtual void synchronize() = 0;

  // y[m, w.rows] = alpha * x[m, w.cols] @ w^T (ldx, ldy in floats).
  virtual void linear(const float* x, int64_t ldx, const Matrix& w, float* y, int64_t ldy, int64_t m,
                      float alpha = 1.f) = 0;
  // Per head h < heads, with W_h the head's rows of w:  y_h[m, rows.count] = x_h[m, w.cols] @ W_h^T.
  virtual void linear_per_head(HeadOperand x, const Matrix& w, HeadRows rows, HeadOperand y, int64_t m,
                               int64_t heads) = 0;
  // Per head h < heads:  y_h[m, w.cols] = x_h[m, rows.count] @ W_h.
  virtual void matmul_per_head(HeadOperand x, const Matrix& w, HeadRows rows, HeadOperand y, int64_t m,
                               int64_t heads) = 0;

  // x = x / rms(x) * weight, over `dim` values of each of `rows` rows `stride` floats apart.
  virtual void rms_norm(float* x, int64_t rows, int64_t dim, int64_t stride, const float* weight, double eps) = 0;
  // x = (x - mean) / sqrt(var + eps) * weight + bias.
  virtual void layer_norm(float* x, int64_t rows, int64_t dim, int64_t stride, const float* weight,
                          const float* bias, double eps) = 0;
  // RoPE on 2 * pairs values at x + t * token_stride + head * head_stride, for every token t < tokens (at
  // positions[t]) and head < heads, with frequencies inv_freq[pairs].
  virtual void rope(float* x, int64_t tokens, int64_t heads, int64_t token_stride, int64_t head_stride,
                    const int32_t* positions, const float* inv_freq, int64_t pairs, RopeStyle style) = 0;

  // `count` values between fp32 and bf16 / f16 (`half` is the 16-bit type).
  virtual void to_half(const float* x, void* y, int64_t count, DType half) = 0;
  virtual void to_float(const void* x, DType half, float* y, int64_t count) = 0;
  // dst[r, 0:cols] = src[r, 0:cols] for r < rows, rows src_ld and dst_ld floats apart.
  virtual void copy_rows(const float* src, int64_t src_ld, float* dst, int64_t dst_ld, int64_t rows,
                         int64_t cols) = 0;
  // dst[dst_rows[i], 0:cols] = src[src_rows[i], 0:cols] for i < count (a null index array: row i), rows src_ld and
  // dst_ld floats apart; the index arrays are in the device's memory.
  virtual void copy_indexed_rows(const float* src, int64_t src_ld, const int64_t* src_rows, float* dst,
                                 int64_t dst_ld, const int64_t* dst_rows, int64_t count, int64_t cols) = 0;
};

std::unique_ptr<Compute> make_cpu_compute();
#ifdef SMLA_WITH_CUDA
// `device` is a resolved CUDA device (index and compute capability); `stream` a cudaStream_t or null.
std::unique_ptr<Compute> make_cuda_compute(const Device& device, void* stream);
#endif

}  // namespace smla::layer
