// The layer's math on the CPU: fp32 weights as given, OpenBLAS products, the norms and RoPE of layer_math.cpp.
#include <cstring>
#include <deque>

#include "core/numeric.h"
#include "layer/compute.h"
#include "layer/layer_math.h"

namespace smla::layer {
namespace {

class CpuCompute final : public Compute {
 public:
  Device device() const override { return Device::cpu(); }
  void* stream() const override { return nullptr; }

  Matrix matrix(WeightTensor tensor) override {
    const WeightTensor& t = weights_.emplace_back(std::move(tensor));
    return {t.data.data(), t.shape[0], t.shape[1]};
  }
  const float* vector(std::vector<float> values) override { return vectors_.emplace_back(std::move(values)).data(); }
  void* allocate_zeroed(size_t bytes) override { return owned_.emplace_back(bytes, std::byte{0}).data(); }
  void* scratch(int id, size_t bytes) override {
    if (size_t(id) >= scratch_.size()) scratch_.resize(id + 1);
    if (scratch_[id].size() < bytes) scratch_[id].resize(bytes);
    return scratch_[id].data();
  }
  void* stage(std::span<const std::byte> host) override {
    staged_.assign(host.begin(), host.end());
    return staged_.data();
  }
  void synchronize() override {}

  void linear(const float* x, int64_t ldx, const Matrix& w, float* y, int64_t ldy, int64_t m, float alpha) override {
    layer::linear(x, ldx, floats(w), w.cols, y, ldy, m, w.rows, w.cols, alpha);
  }
  void linear_per_head(HeadOperand x, const Matrix& w, HeadRows rows, HeadOperand y, int64_t m,
                       int64_t heads) override {
    for (int64_t h = 0; h < heads; ++h)
      layer::linear(x.data + h * x.head_stride, x.ld, head_block(w, rows, h), w.cols, y.data + h * y.head_stride, y.ld,
                    m, rows.count, w.cols);
  }
  void matmul_per_head(HeadOperand x, const Matrix& w, HeadRows rows, HeadOperand y, int64_t m,
                       int64_t heads) override {
    for (int64_t h = 0; h < heads; ++h)
      layer::matmul(x.data + h * x.head_stride, x.ld, head_block(w, rows, h), w.cols, y.data + h * y.head_stride, y.ld,
                    m, w.cols, rows.count);
  }

  void rms_norm(float* x, int64_t rows, int64_t dim, int64_t stride, const float* weight, double eps) override {
    layer::rms_norm(x, rows, dim, stride, weight, eps);
  }
  void layer_norm(float* x, int64_t rows, int64_t dim, int64_t stride, const float* weight, const float* bias,
                  double eps) override {
    layer::layer_norm(x, rows, dim, stride, weight, bias, eps);
  }
  void rope(float* x, int64_t tokens, int64_t heads, int64_t token_stride, int64_t head_stride,
            const int32_t* positions, const float* inv_freq, int64_t pairs, RopeStyle style) override {
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t h = 0; h < heads; ++h)
        apply_rope(x + t * token_stride + h * head_stride, positions[t], inv_freq, pairs, style);
  }

  void to_half(const float* x, void* y, int64_t count, DType half) override {
    uint16_t* out = static_cast<uint16_t*>(y);
    for (int64_t i = 0; i < count; ++i)
      out[i] = half == DType::f16 ? numeric::float_to_f16(x[i]) : numeric::float_to_bf16(x[i]);
  }
  void to_float(const void* x, DType half, float* y, int64_t count) override {
    const uint16_t* in = static_cast<const uint16_t*>(x);
    for (int64_t i = 0; i < count; ++i)
      y[i] = half == DType::f16 ? numeric::f16_to_float(in[i]) : numeric::bf16_to_float(in[i]);
  }
  void copy_rows(const float* src, int64_t src_ld, float* dst, int64_t dst_ld, int64_t rows, int64_t cols) override {
    for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * dst_ld, src + r * src_ld, cols * sizeof(float));
  }
  void copy_indexed_rows(const float* src, int64_t src_ld, const int64_t* src_rows, float* dst, int64_t dst_ld,
                         const int64_t* dst_rows, int64_t count, int64_t cols) override {
    for (int64_t i = 0; i < count; ++i)
      std::memcpy(dst + (dst_rows ? dst_rows[i] : i) * dst_ld, src + (src_rows ? src_rows[i] : i) * src_ld,
                  cols * sizeof(float));
  }

 private:
  static const float* floats(const Matrix& w) { return static_cast<const float*>(w.data); }
  static const float* head_block(const Matrix& w, HeadRows rows, int64_t h) {
    return floats(w) + (h * rows.period + rows.first) * w.cols;
  }

  std::deque<WeightTensor> weights_;  // deques: elements never move, so the pointers handed out stay valid
  std::deque<std::vector<float>> vectors_;
  std::deque<std::vector<std::byte>> owned_;
  std::vector<std::vector<std::byte>> scratch_;
  std::vector<std::byte> staged_;
};

}  // namespace

std::unique_ptr<Compute> make_cpu_compute() { return std::make_unique<CpuCompute>(); }

}  // namespace smla::layer
