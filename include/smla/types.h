// Core value types: element types, devices and a non-owning tensor view that
// converts to and from DLPack's DLTensor.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include <dlpack/dlpack.h>

namespace smla {

// Element types. fp8_ds_mla is the packed MLA cache format (656 bytes per
// token: 512 e4m3 latents, 4 fp32 tile scales, 64 bf16 rope values);
// fp8_ds_mla_nope is the same without the rope part (528 bytes per token), for
// heads with no rope part. fp8_ds_mla_v4 is DeepSeek-V4's (FlashMLA's MODEL1)
// cache of its 512-wide heads (448 + 64 rope): 584 bytes per token, laid out per
// block (MlaV4CacheLayout). Tensors of these are viewed as bytes, so their
// element size is 1.
enum class DType : uint8_t { f32, f16, bf16, fp8_e4m3, fp8_ds_mla, i32, i64, u8, fp8_ds_mla_nope, fp8_ds_mla_v4 };

// Bytes per element of a tensor of this dtype.
size_t dtype_size(DType dtype);
// Canonical name ("bfloat16", "float16", "float32", "fp8_e4m3", "fp8_ds_mla", "int32", ...).
std::string_view dtype_name(DType dtype);
// Parses a canonical name or a common alias (bf16, fp16, half, f32, ...); nullopt if unknown.
std::optional<DType> parse_dtype(std::string_view name);
// Canonical names for a message: "bfloat16, float16 or fp8_ds_mla".
std::string dtype_names(std::span<const DType> dtypes);

// The absorbed MLA head the attention kernels compute with: one latent KV head
// of kv_lora_rank values followed by a rope part of 64 values (DeepSeek, GLM-5,
// Kimi) or none (GLM-5.3-Flash); the value is the latent.
inline constexpr int kMlaLatentDim = 512;  // kv_lora_rank the kernels are built for
inline constexpr int kMlaRopeDim = 64;     // qk_rope_head_dim, when there is a rope part
inline constexpr int kMlaQkDim = kMlaLatentDim + kMlaRopeDim;  // 576, absorbed head size with rope
inline constexpr int kMlaVDim = kMlaLatentDim;                 // 512, absorbed value size
inline constexpr int kFp8MlaScalesBytes = 4 * 4;               // one fp32 scale per 128 latents
inline constexpr int kFp8DsMlaRowBytes = kMlaLatentDim + kFp8MlaScalesBytes + kMlaRopeDim * 2;  // 656
inline constexpr int kFp8DsMlaNopeRowBytes = kMlaLatentDim + kFp8MlaScalesBytes;                 // 528

// fp8_ds_mla_v4 (DeepSeek-V4, FlashMLA's MODEL1): a token's 512 values are 448 "nope" values as e4m3 in 7 tiles of
// 64, each tile with a ue8m0 (power-of-two, stored as exponent + 127) scale, then 64 rope values as bf16. Within a
// block, all tokens' 576-byte value parts come first (token t at t * 576), then all tokens' 8 scale bytes (7 scales
// and a pad byte, token t at block_size * 576 + t * 8). The cache is viewed as [num_blocks, block_size, 584] bytes
// with row stride 584; FlashMLA pads each block to a multiple of 576 bytes (the block stride).
struct MlaV4CacheLayout {
  static constexpr int kNopeDim = 448, kTile = 64, kTiles = kNopeDim / kTile, kRopeDim = 64;
  static constexpr int kValueBytes = kNopeDim + 2 * kRopeDim;    // 576
  static constexpr int kScaleBytes = kTiles + 1;                 // 8
  static constexpr int kRowBytes = kValueBytes + kScaleBytes;    // 584
  // Byte offsets of token `t`'s values and scales from its block's start.
  static constexpr int64_t value_offset(int64_t t) { return t * kValueBytes; }
  static constexpr int64_t scale_offset(int64_t block_size, int64_t t) {
    return block_size * kValueBytes + t * kScaleBytes;
  }
};

// One absorbed-head geometry: the rope width (64 or 0) fixes the rest. The
// checks, the CPU kernels, the reference and the CUDA launch code all read it.
struct MlaHead {
  int rope_dim = kMlaRopeDim;

  constexpr int latent_dim() const { return kMlaLatentDim; }
  constexpr int qk_dim() const { return kMlaLatentDim + rope_dim; }  // q's last dimension
  constexpr int v_dim() const { return kMlaVDim; }                   // out's last dimension
  // The last dimension of a latent cache of `cache_dtype` that holds this head:
  // elements for bf16/f16 rows [c | k_pe], bytes for the fp8 forms; 0 when the
  // dtype cannot hold it (not a cache dtype, or fp8_ds_mla_nope with a rope part).
  constexpr int64_t cache_row(DType cache_dtype) const {
    switch (cache_dtype) {
      case DType::bf16: case DType::f16: return qk_dim();
      // The envelope engines allocate whatever the head: with rope 0 its rope part is never read.
      case DType::fp8_ds_mla: return kFp8DsMlaRowBytes;
      case DType::fp8_ds_mla_nope: return rope_dim == 0 ? kFp8DsMlaNopeRowBytes : 0;
      // DeepSeek-V4's 512-wide head: its rope part is inside the 512 (the last 64 values), stored as bf16.
      case DType::fp8_ds_mla_v4: return rope_dim == 0 ? MlaV4CacheLayout::kRowBytes : 0;
      default: return 0;
    }
  }
  // Bytes of one cache row of `cache_dtype` the kernels read (the envelope's rope part is skipped at rope 0).
  constexpr int64_t row_bytes_read(DType cache_dtype) const {
    if (cache_dtype == DType::fp8_ds_mla_v4) return MlaV4CacheLayout::kRowBytes - 1;  // all but the pad byte
    return cache_dtype == DType::bf16 || cache_dtype == DType::f16 ? 2 * qk_dim()
                                                                    : kFp8DsMlaNopeRowBytes + 2 * rope_dim;
  }
  friend constexpr bool operator==(MlaHead, MlaHead) = default;
};
inline constexpr MlaHead kMlaHeads[] = {MlaHead{kMlaRopeDim}, MlaHead{0}};  // every geometry the kernels take
// The geometry whose q is `qk_dim` wide (576 or 512); nullopt for any other width.
constexpr std::optional<MlaHead> mla_head_for_qk_dim(int64_t qk_dim) {
  for (MlaHead h : kMlaHeads)
    if (h.qk_dim() == qk_dim) return h;
  return std::nullopt;
}
// True for the MLA cache formats that store the latent as e4m3 with tile scales in each row (fp8_ds_mla_v4, laid
// out per block, is not one of them).
constexpr bool is_fp8_mla_cache(DType d) { return d == DType::fp8_ds_mla || d == DType::fp8_ds_mla_nope; }
// The MLA cache formats of rows (MlaHead::cache_row gives each one's row) every backend takes; backends declare
// theirs (Capabilities::kv_cache_dtypes) from it.
inline constexpr DType kMlaCacheDTypes[] = {DType::bf16, DType::f16, DType::fp8_ds_mla, DType::fp8_ds_mla_nope};
// Every MLA cache format the ops' checks accept: those and DeepSeek-V4's fp8 cache (the CPU and CUDA backends
// declare it). The CLI and the spec read it.
inline constexpr DType kAllMlaCacheDTypes[] = {DType::bf16, DType::f16, DType::fp8_ds_mla, DType::fp8_ds_mla_nope,
                                               DType::fp8_ds_mla_v4};
constexpr bool is_mla_cache_dtype(DType d) {
  for (DType c : kAllMlaCacheDTypes)
    if (c == d) return true;
  return false;
}
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
