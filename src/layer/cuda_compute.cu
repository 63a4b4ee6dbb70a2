// The layer's math on a CUDA GPU: weights converted once to bf16, products through cuBLAS (bf16 inputs, fp32
// accumulation and output), small kernels for the norms, RoPE and conversions. Everything runs on one stream; the
// host waits only for the copy a staging buffer is about to be reused for, and when profiling.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "core/numeric.h"
#include "cuda/common/device_guard.h"
#include "cuda/common/runtime.h"
#include "layer/compute.h"

namespace smla::layer {
namespace {

using cuda::check_cuda;
using cuda::launch_kernel;

void check_cublas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw Error(ErrorKind::internal, std::string("MlaLayer: ") + what + ": " + cublasGetStatusString(status));
}

constexpr int kThreads = 256;

int blocks_for(int64_t count) { return int(std::min<int64_t>((count + kThreads - 1) / kThreads, 1 << 16)); }

// The sum over the block, in every thread. `partial` holds one float per warp.
__device__ float block_sum(float value, float* partial) {
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) partial[warp] = value;
  __syncthreads();
  value = lane < int(blockDim.x / 32) ? partial[lane] : 0.f;
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  __syncthreads();  // `partial` may be written again by the next call
  return value;
}

// One block per row.
__global__ void rms_norm_kernel(float* x, int64_t dim, int64_t stride, const float* weight, float eps) {
  __shared__ float partial[kThreads / 32];
  float* row = x + blockIdx.x * stride;
  float sum = 0.f;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) sum += row[i] * row[i];
  const float inv = rsqrtf(block_sum(sum, partial) / float(dim) + eps);
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) row[i] = row[i] * inv * weight[i];
}

__global__ void layer_norm_kernel(float* x, int64_t dim, int64_t stride, const float* weight, const float* bias,
                                  float eps) {
  __shared__ float partial[kThreads / 32];
  float* row = x + blockIdx.x * stride;
  float sum = 0.f;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) sum += row[i];
  const float mean = block_sum(sum, partial) / float(dim);
  float squares = 0.f;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) squares += (row[i] - mean) * (row[i] - mean);
  const float inv = rsqrtf(block_sum(squares, partial) / float(dim) + eps);
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) row[i] = (row[i] - mean) * inv * weight[i] + bias[i];
}

// One thread per rotated pair; float32 angles, as the CPU path and the references compute them.
__global__ void rope_kernel(float* x, int64_t tokens, int64_t heads, int64_t token_stride, int64_t head_stride,
                            const int32_t* positions, const float* inv_freq, int64_t pairs, bool interleaved) {
  const int64_t total = tokens * heads * pairs;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = idx % pairs, head = idx / pairs % heads, t = idx / (pairs * heads);
    float s, c;
    sincosf(float(positions[t]) * inv_freq[i], &s, &c);
    float* v = x + t * token_stride + head * head_stride;
    float& a = interleaved ? v[2 * i] : v[i];
    float& b = interleaved ? v[2 * i + 1] : v[i + pairs];
    const float a0 = a, b0 = b;
    a = a0 * c - b0 * s;
    b = a0 * s + b0 * c;
  }
}

template <class Half>
__device__ Half from_float(float v);
template <>
__device__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __half from_float(float v) { return __float2half_rn(v); }

// y[r, 0:cols] (rows contiguous) = x[r, 0:cols] (rows ldx apart), rounded to Half.
template <class Half>
__global__ void to_half_kernel(const float* x, int64_t ldx, Half* y, int64_t rows, int64_t cols) {
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < rows * cols;
       idx += int64_t(gridDim.x) * blockDim.x)
    y[idx] = from_float<Half>(x[idx / cols * ldx + idx % cols]);
}

// One thread per value: row i of dst (dst_rows[i], or i) takes row i of src (src_rows[i], or i).
__global__ void copy_indexed_rows_kernel(const float* src, int64_t src_ld, const int64_t* src_rows, float* dst,
                                         int64_t dst_ld, const int64_t* dst_rows, int64_t count, int64_t cols) {
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < count * cols;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = idx / cols, c = idx % cols;
    dst[(dst_rows ? dst_rows[i] : i) * dst_ld + c] = src[(src_rows ? src_rows[i] : i) * src_ld + c];
  }
}

template <class Half>
__global__ void to_float_kernel(const Half* x, float* y, int64_t count) {
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < count;
       idx += int64_t(gridDim.x) * blockDim.x)
    y[idx] = float(x[idx]);
}

// Device memory that grows on demand; the old block is freed in stream order, after the work that uses it.
struct StreamBuffer {
  void* ptr = nullptr;
  size_t size = 0;
  void* reserve(size_t bytes, cudaStream_t stream) {
    if (bytes <= size) return ptr;
    const size_t grown = std::max(bytes, 2 * size);
    if (ptr) check_cuda(cudaFreeAsync(ptr, stream), "MlaLayer: cudaFreeAsync");
    ptr = nullptr;
    size = 0;
    check_cuda(cudaMallocAsync(&ptr, grown, stream), "MlaLayer: cudaMallocAsync (scratch)");
    size = grown;
    return ptr;
  }
};

class CudaCompute final : public Compute {
 public:
  CudaCompute(const Device& device, void* stream) : device_(device), stream_(static_cast<cudaStream_t>(stream)) {
    const cuda::DeviceGuard guard(device_);
    check_cublas(cublasCreate(&cublas_), "cublasCreate");
    check_cublas(cublasSetStream(cublas_, stream_), "cublasSetStream");
    check_cuda(cudaEventCreateWithFlags(&staged_copy_, cudaEventDisableTiming), "MlaLayer: cudaEventCreate");
  }
  ~CudaCompute() override {
    const cuda::DeviceGuard guard(device_);
    cudaStreamSynchronize(stream_);  // nothing still running may use what is freed below
    for (StreamBuffer* b : all_scratch())
      if (b->ptr) cudaFreeAsync(b->ptr, stream_);
    cudaStreamSynchronize(stream_);
    for (void* p : owned_) cudaFree(p);
    cudaFreeHost(pinned_);
    cudaEventDestroy(staged_copy_);
    cublasDestroy(cublas_);
    cudaGetLastError();  // a failure here has no one to report to: leave no error for the next launch check
  }
  CudaCompute(const CudaCompute&) = delete;
  CudaCompute& operator=(const CudaCompute&) = delete;

  Device device() const override { return device_; }
  void* stream() const override { return stream_; }

  Matrix matrix(WeightTensor tensor) override {
    std::vector<uint16_t> bf16(tensor.data.size());
    for (size_t i = 0; i < bf16.size(); ++i) bf16[i] = numeric::float_to_bf16(tensor.data[i]);
    return {upload(bf16.data(), bf16.size() * sizeof(uint16_t)), tensor.shape[0], tensor.shape[1]};
  }
  const float* vector(std::vector<float> values) override {
    return static_cast<const float*>(upload(values.data(), values.size() * sizeof(float)));
  }
  void* allocate_zeroed(size_t bytes) override {
    const cuda::DeviceGuard guard(device_);
    void* p = allocate(bytes);
    check_cuda(cudaMemsetAsync(p, 0, bytes, stream_), "MlaLayer: cudaMemsetAsync");
    return p;
  }
  void* scratch(int id, size_t bytes) override {
    const cuda::DeviceGuard guard(device_);
    if (size_t(id) >= scratch_.size()) scratch_.resize(id + 1);
    return scratch_[id].reserve(bytes, stream_);
  }
  void* stage(std::span<const std::byte> host) override {
    const cuda::DeviceGuard guard(device_);
    // The pinned buffer is rewritten only once the previous copy out of it has run.
    check_cuda(cudaEventSynchronize(staged_copy_), "MlaLayer: cudaEventSynchronize");
    if (pinned_size_ < host.size()) {
      const size_t grown = std::max(host.size(), 2 * pinned_size_);
      check_cuda(cudaFreeHost(pinned_), "MlaLayer: cudaFreeHost");
      pinned_ = nullptr;
      pinned_size_ = 0;
      check_cuda(cudaMallocHost(&pinned_, grown), "MlaLayer: cudaMallocHost");
      pinned_size_ = grown;
    }
    std::memcpy(pinned_, host.data(), host.size());
    void* device = staged_.reserve(std::max<size_t>(host.size(), 1), stream_);
    check_cuda(cudaMemcpyAsync(device, pinned_, host.size(), cudaMemcpyHostToDevice, stream_),
               "MlaLayer: cudaMemcpyAsync (chunk bookkeeping)");
    check_cuda(cudaEventRecord(staged_copy_, stream_), "MlaLayer: cudaEventRecord");
    return device;
  }
  void synchronize() override { check_cuda(cudaStreamSynchronize(stream_), "MlaLayer: cudaStreamSynchronize"); }

  void linear(const float* x, int64_t ldx, const Matrix& w, float* y, int64_t ldy, int64_t m, float alpha) override {
    if (m == 0) return;
    const cuda::DeviceGuard guard(device_);
    const __nv_bfloat16* xb = to_bf16(x, ldx, m, w.cols);
    // Row-major y = x w^T is column-major y^T = w x^T: w [rows, cols] read transposed.
    const float beta = 0.f;
    check_cublas(cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, int(w.rows), int(m), int(w.cols), &alpha, w.data,
                              CUDA_R_16BF, int(w.cols), xb, CUDA_R_16BF, int(w.cols), &beta, y, CUDA_R_32F, int(ldy),
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 "cublasGemmEx (linear)");
  }
  void linear_per_head(HeadOperand x, const Matrix& w, HeadRows rows, HeadOperand y, int64_t m,
                       int64_t heads) override {
    per_head(CUBLAS_OP_T, int(rows.count), int(w.cols), x, w, rows, y, m, heads);
  }
  void matmul_per_head(HeadOperand x, const Matrix& w, HeadRows rows, HeadOperand y, int64_t m,
                       int64_t heads) override {
    per_head(CUBLAS_OP_N, int(w.cols), int(rows.count), x, w, rows, y, m, heads);
  }

  void rms_norm(float* x, int64_t rows, int64_t dim, int64_t stride, const float* weight, double eps) override {
    if (rows == 0) return;
    const cuda::DeviceGuard guard(device_);
    launch_kernel(rms_norm_kernel, unsigned(rows), kThreads, 0, stream_, "MlaLayer: rms_norm_kernel", x, dim, stride,
                  weight, float(eps));
  }
  void layer_norm(float* x, int64_t rows, int64_t dim, int64_t stride, const float* weight, const float* bias,
                  double eps) override {
    if (rows == 0) return;
    const cuda::DeviceGuard guard(device_);
    launch_kernel(layer_norm_kernel, unsigned(rows), kThreads, 0, stream_, "MlaLayer: layer_norm_kernel", x, dim,
                  stride, weight, bias, float(eps));
  }
  void rope(float* x, int64_t tokens, int64_t heads, int64_t token_stride, int64_t head_stride,
            const int32_t* positions, const float* inv_freq, int64_t pairs, RopeStyle style) override {
    const int64_t total = tokens * heads * pairs;
    if (total == 0) return;
    const cuda::DeviceGuard guard(device_);
    launch_kernel(rope_kernel, blocks_for(total), kThreads, 0, stream_, "MlaLayer: rope_kernel", x, tokens, heads,
                  token_stride, head_stride, positions, inv_freq, pairs, style == RopeStyle::interleaved);
  }

  void to_half(const float* x, void* y, int64_t count, DType half) override {
    if (count == 0) return;
    const cuda::DeviceGuard guard(device_);
    if (half == DType::f16)
      launch_kernel(to_half_kernel<__half>, blocks_for(count), kThreads, 0, stream_, "MlaLayer: to_half_kernel", x,
                    count, static_cast<__half*>(y), 1, count);
    else
      launch_kernel(to_half_kernel<__nv_bfloat16>, blocks_for(count), kThreads, 0, stream_,
                    "MlaLayer: to_half_kernel", x, count, static_cast<__nv_bfloat16*>(y), 1, count);
  }
  void to_float(const void* x, DType half, float* y, int64_t count) override {
    if (count == 0) return;
    const cuda::DeviceGuard guard(device_);
    if (half == DType::f16)
      launch_kernel(to_float_kernel<__half>, blocks_for(count), kThreads, 0, stream_, "MlaLayer: to_float_kernel",
                    static_cast<const __half*>(x), y, count);
    else
      launch_kernel(to_float_kernel<__nv_bfloat16>, blocks_for(count), kThreads, 0, stream_,
                    "MlaLayer: to_float_kernel", static_cast<const __nv_bfloat16*>(x), y, count);
  }
  void copy_indexed_rows(const float* src, int64_t src_ld, const int64_t* src_rows, float* dst, int64_t dst_ld,
                         const int64_t* dst_rows, int64_t count, int64_t cols) override {
    if (count == 0 || cols == 0) return;
    const cuda::DeviceGuard guard(device_);
    launch_kernel(copy_indexed_rows_kernel, blocks_for(count * cols), kThreads, 0, stream_,
                  "MlaLayer: copy_indexed_rows_kernel", src, src_ld, src_rows, dst, dst_ld, dst_rows, count, cols);
  }
  void copy_rows(const float* src, int64_t src_ld, float* dst, int64_t dst_ld, int64_t rows, int64_t cols) override {
    if (rows == 0) return;
    const cuda::DeviceGuard guard(device_);
    check_cuda(cudaMemcpy2DAsync(dst, dst_ld * sizeof(float), src, src_ld * sizeof(float), cols * sizeof(float), rows,
                                 cudaMemcpyDeviceToDevice, stream_),
               "MlaLayer: cudaMemcpy2DAsync");
  }

 private:
  void* allocate(size_t bytes) {
    void* p = nullptr;
    check_cuda(cudaMalloc(&p, std::max<size_t>(bytes, 1)), "MlaLayer: cudaMalloc");
    owned_.push_back(p);
    return p;
  }
  const void* upload(const void* host, size_t bytes) {
    const cuda::DeviceGuard guard(device_);
    void* p = allocate(bytes);
    check_cuda(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice), "MlaLayer: cudaMemcpy (weights)");
    return p;
  }
  // x[rows, cols] (rows ldx apart) as contiguous bf16, the products' input type.
  const __nv_bfloat16* to_bf16(const float* x, int64_t ldx, int64_t rows, int64_t cols) {
    auto* y = static_cast<__nv_bfloat16*>(gemm_input_.reserve(rows * cols * sizeof(__nv_bfloat16), stream_));
    launch_kernel(to_half_kernel<__nv_bfloat16>, blocks_for(rows * cols), kThreads, 0, stream_,
                  "MlaLayer: to_half_kernel (product input)", x, ldx, y, rows, cols);
    return y;
  }
  // Per head h: y_h = x_h @ op(W_h), as one strided-batched product. Column-major, that is y_h^T = op(W_h)^T x_h^T
  // with W_h read in place from the bf16 matrix; `out` and `inner` are op(W_h)'s column and row counts.
  void per_head(cublasOperation_t op, int out, int inner, HeadOperand x, const Matrix& w, HeadRows rows,
                HeadOperand y, int64_t m, int64_t heads) {
    if (m == 0 || heads == 0) return;
    const cuda::DeviceGuard guard(device_);
    // Whole rows of x go through the conversion (every head's block sits in them), so head strides are unchanged.
    const __nv_bfloat16* xb = to_bf16(x.data, x.ld, m, x.ld);
    const auto* wb = static_cast<const __nv_bfloat16*>(w.data) + rows.first * w.cols;
    const float alpha = 1.f, beta = 0.f;
    check_cublas(cublasGemmStridedBatchedEx(cublas_, op, CUBLAS_OP_N, out, int(m), inner, &alpha, wb, CUDA_R_16BF,
                                            int(w.cols), rows.period * w.cols, xb, CUDA_R_16BF, int(x.ld),
                                            x.head_stride, &beta, y.data, CUDA_R_32F, int(y.ld), y.head_stride,
                                            int(heads), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 "cublasGemmStridedBatchedEx (per head)");
  }
  std::vector<StreamBuffer*> all_scratch() {
    std::vector<StreamBuffer*> out = {&staged_, &gemm_input_};
    for (StreamBuffer& b : scratch_) out.push_back(&b);
    return out;
  }

  Device device_;
  cudaStream_t stream_;
  cublasHandle_t cublas_ = nullptr;
  std::vector<void*> owned_;  // weights and caches
  std::vector<StreamBuffer> scratch_;
  StreamBuffer staged_, gemm_input_;
  void* pinned_ = nullptr;  // host side of stage()
  size_t pinned_size_ = 0;
  cudaEvent_t staged_copy_ = nullptr;  // the last copy out of pinned_
};

}  // namespace

std::unique_ptr<Compute> make_cuda_compute(const Device& device, void* stream) {
  return std::make_unique<CudaCompute>(device, stream);
}

}  // namespace smla::layer
