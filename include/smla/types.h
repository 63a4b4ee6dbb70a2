// Core value types: element types, devices and a non-owning tensor view that
// converts to and from DLPack's DLTensor.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <dlpack/dlpack.h>

namespace smla {

// Element types. fp8_ds_mla is the packed MLA cache format (656 bytes per
// token: 512 e4m3 latents, 4 fp32 tile scales, 64 bf16 rope values); tensors
// of it are viewed as bytes, so its element size is 1.
enum class DType : uint8_t { f32, f16, bf16, fp8_e4m3, fp8_ds_mla, i32, i64, u8 };

// Bytes per element of a tensor of this dtype.
size_t dtype_size(DType dtype);
// Canonical name ("bfloat16", "float16", "float32", "fp8_e4m3", "fp8_ds_mla", "int32", ...).
std::string_view dtype_name(DType dtype);
// Parses a canonical name or a common alias (bf16, fp16, half, f32, ...); nullopt if unknown.
std::optional<DType> parse_dtype(std::string_view name);

// Bytes per token of one row of the MLA latent cache in the given format.
inline constexpr int kMlaLatentDim = 512;  // kv_lora_rank the kernels are built for
inline constexpr int kMlaRopeDim = 64;     // qk_rope_head_dim
inline constexpr int kMlaQkDim = kMlaLatentDim + kMlaRopeDim;  // 576, absorbed head size
inline constexpr int kMlaVDim = kMlaLatentDim;                 // 512, absorbed value size
inline constexpr int kFp8DsMlaRowBytes = kMlaLatentDim + 4 * 4 + kMlaRopeDim * 2;  // 656
inline constexpr int kIndexHeadDim = 128;
inline constexpr int kFp8IndexRowBytes = kIndexHeadDim + 4;  // 132: 128 e4m3 + one fp32 scale

enum class DeviceKind : uint8_t { cpu, cuda };

// A device. For CUDA, `compute_capability` is major*10 + minor (sm_90 -> 90,
// sm_120 -> 120); it is 0 on the CPU.
struct Device {
  DeviceKind kind = DeviceKind::cpu;
  int index = 0;
  int compute_capability = 0;

  static Device cpu() { return {}; }
  static Device cuda(int compute_capability, int index = 0) {
    return {DeviceKind::cuda, index, compute_capability};
  }
  bool is_cpu() const { return kind == DeviceKind::cpu; }
  bool is_cuda() const { return kind == DeviceKind::cuda; }
  // "cpu" or "sm_90".
  std::string name() const;
  friend bool operator==(const Device&, const Device&) = default;
};

// Parses "cpu", "cuda" (compute capability unknown), "sm_80", "sm_120", "cuda:1".
// Throws smla::Error naming `what` on anything else.
Device parse_device(std::string_view text, std::string_view what = "device");

// A non-owning, strided view of a tensor: data, shape, strides in elements,
// dtype and device. Copies are cheap; the memory belongs to the caller.
struct TensorView {
  static constexpr int kMaxDims = 6;

  void* data = nullptr;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> strides{};  // in elements
  DType dtype = DType::f32;
  Device device{};

  // A contiguous (row-major) view.
  TensorView(void* data, std::initializer_list<int64_t> shape, DType dtype, Device device = Device::cpu());
  // A strided view; `strides` has one entry per dimension.
  TensorView(void* data, std::initializer_list<int64_t> shape, std::initializer_list<int64_t> strides, DType dtype,
             Device device = Device::cpu());
  TensorView() = default;

  // Views a DLTensor (byte_offset folded into data, null strides meaning
  // contiguous). fp8 tensors arrive from DLPack 0.6 as uint8; pass the dtype
  // to reinterpret them (fp8_e4m3 or fp8_ds_mla). Throws smla::Error naming
  // `what` if the dtype or device has no smla equivalent.
  static TensorView from_dlpack(const DLTensor& tensor, std::string_view what = "tensor",
                                std::optional<DType> reinterpret_as = std::nullopt);
  // A DLTensor describing this view. It points into this object's shape and
  // strides, so the view must outlive it.
  DLTensor to_dlpack();

  bool defined() const { return data != nullptr; }
  int64_t size(int dim) const { return shape[dim < 0 ? dim + ndim : dim]; }
  int64_t stride(int dim) const { return strides[dim < 0 ? dim + ndim : dim]; }
  int64_t numel() const;
  bool is_contiguous() const;
  // "[2, 8, 576] bfloat16 on cpu"
  std::string describe() const;

  template <class T>
  T* ptr() const { return static_cast<T*>(data); }
};

}  // namespace smla
