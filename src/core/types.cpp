#include "smla/types.h"

#include <algorithm>
#include <charconv>
#include <sstream>

#include "core/text.h"
#include "smla/error.h"

namespace smla {

namespace {

struct DTypeInfo {
  DType dtype;
  size_t size;
  std::string_view name;
};

constexpr DTypeInfo kDTypes[] = {
    {DType::f32, 4, "float32"},        {DType::f16, 2, "float16"}, {DType::bf16, 2, "bfloat16"},
    {DType::fp8_e4m3, 1, "fp8_e4m3"},  {DType::fp8_ds_mla, 1, "fp8_ds_mla"},
    {DType::i32, 4, "int32"},          {DType::i64, 8, "int64"},   {DType::u8, 1, "uint8"},
    {DType::fp8_ds_mla_nope, 1, "fp8_ds_mla_nope"}, {DType::fp8_ds_mla_v4, 1, "fp8_ds_mla_v4"},
};

struct Alias {
  std::string_view alias;
  DType dtype;
};
constexpr Alias kAliases[] = {
    {"f32", DType::f32},       {"fp32", DType::f32},          {"float", DType::f32},
    {"f16", DType::f16},       {"fp16", DType::f16},          {"half", DType::f16},
    {"bf16", DType::bf16},     {"fp8", DType::fp8_e4m3},      {"float8_e4m3fn", DType::fp8_e4m3},
    {"e4m3", DType::fp8_e4m3}, {"fp8_ds_mla", DType::fp8_ds_mla},
};

const DTypeInfo& info(DType dtype) {
  for (const auto& i : kDTypes)
    if (i.dtype == dtype) return i;
  throw Error(ErrorKind::internal, "unknown DType value " + std::to_string(static_cast<int>(dtype)));
}

}  // namespace

size_t dtype_size(DType dtype) { return info(dtype).size; }
std::string_view dtype_name(DType dtype) { return info(dtype).name; }

std::optional<DType> parse_dtype(std::string_view name) {
  const std::string n = lowercase(name);
  for (const auto& i : kDTypes)
    if (n == i.name) return i.dtype;
  for (const auto& a : kAliases)
    if (n == a.alias) return a.dtype;
  return std::nullopt;
}

std::string dtype_names(std::span<const DType> dtypes) {
  std::string s;
  for (size_t i = 0; i < dtypes.size(); ++i) {
    if (i) s += i + 1 == dtypes.size() ? " or " : ", ";
    s += dtype_name(dtypes[i]);
  }
  return s;
}

std::string Device::name() const {
  if (is_cpu()) return "cpu";
  if (compute_capability == 0) return "cuda";
  return "sm_" + std::to_string(compute_capability);
}

Device parse_device(std::string_view text, std::string_view what) {
  const std::string t = lowercase(text);
  auto bad = [&]() -> Device {
    fail(std::string(what) + ": '" + std::string(text) +
         "' is not a device; expected cpu, cuda, cuda:N or sm_XY (e.g. sm_80, sm_90, sm_120)");
  };
  auto parse_int = [](std::string_view s, int& v) {
    auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    return ec == std::errc() && p == s.data() + s.size() && !s.empty();
  };
  if (t == "cpu") return Device::cpu();
  if (t == "cuda") return Device::cuda(0);
  int v = 0;
  if (t.rfind("cuda:", 0) == 0) {
    if (!parse_int(std::string_view(t).substr(5), v) || v < 0) return bad();
    return Device::cuda(0, v);
  }
  if (t.rfind("sm_", 0) == 0) {
    // sm_90a / sm_100a name arch-specific feature sets of the same device.
    std::string_view digits = std::string_view(t).substr(3);
    if (!digits.empty() && (digits.back() == 'a' || digits.back() == 'f')) digits.remove_suffix(1);
    if (!parse_int(digits, v) || v < 10 || v > 999) return bad();
    return Device::cuda(v);
  }
  return bad();
}

TensorView::TensorView(void* data_, std::initializer_list<int64_t> shape_, DType dtype_, Device device_)
    : data(data_), dtype(dtype_), device(device_) {
  if (shape_.size() > kMaxDims) fail("TensorView: at most " + std::to_string(kMaxDims) + " dimensions");
  ndim = static_cast<int>(shape_.size());
  std::copy(shape_.begin(), shape_.end(), shape.begin());
  int64_t s = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    strides[d] = s;
    s *= shape[d];
  }
}

TensorView::TensorView(void* data_, std::initializer_list<int64_t> shape_, std::initializer_list<int64_t> strides_,
                       DType dtype_, Device device_)
    : TensorView(data_, shape_, dtype_, device_) {
  require(strides_.size() == shape_.size(), "TensorView: strides and shape differ in length");
  std::copy(strides_.begin(), strides_.end(), strides.begin());
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t s = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != s) return false;
    s *= shape[d];
  }
  return true;
}

std::string TensorView::describe() const {
  std::ostringstream o;
  o << '[';
  for (int d = 0; d < ndim; ++d) o << (d ? ", " : "") << shape[d];
  o << "] " << dtype_name(dtype) << " on " << device.name();
  return o.str();
}

TensorView TensorView::from_dlpack(const DLTensor& t, std::string_view what, std::optional<DType> reinterpret_as) {
  // Messages are built only on failure: this runs for every tensor of every call from Python (host time).
  const auto w = [&] { return std::string(what); };
  TensorView v;
  if (t.ndim < 0 || t.ndim > kMaxDims)
    fail(w() + ": " + std::to_string(t.ndim) + " dimensions, at most " + std::to_string(kMaxDims) + " supported");
  if (t.dtype.lanes != 1) fail(w() + ": vector dtypes (lanes != 1) are not supported");
  const int bits = t.dtype.bits;
  std::optional<DType> dt;
  switch (t.dtype.code) {
    case kDLFloat: dt = bits == 32 ? std::optional(DType::f32) : bits == 16 ? std::optional(DType::f16) : std::nullopt; break;
    case kDLBfloat: dt = bits == 16 ? std::optional(DType::bf16) : std::nullopt; break;
    case kDLInt: dt = bits == 32 ? std::optional(DType::i32) : bits == 64 ? std::optional(DType::i64) : std::nullopt; break;
    case kDLUInt: dt = bits == 8 ? std::optional(DType::u8) : std::nullopt; break;
    default: break;
  }
  if (!dt)
    fail(w() + ": DLPack dtype (code " + std::to_string(t.dtype.code) + ", " + std::to_string(bits) +
         " bits) has no smla equivalent");
  if (reinterpret_as) {
    if (dtype_size(*reinterpret_as) != dtype_size(*dt))
      fail(w() + ": cannot view " + std::string(dtype_name(*dt)) + " as " + std::string(dtype_name(*reinterpret_as)));
    dt = reinterpret_as;
  }
  switch (t.device.device_type) {
    case kDLCPU: case kDLCUDAHost: v.device = Device::cpu(); break;
    case kDLCUDA: case kDLCUDAManaged: v.device = Device::cuda(0, t.device.device_id); break;
    default: fail(w() + ": DLPack device type " + std::to_string(t.device.device_type) + " is not cpu or cuda");
  }
  v.dtype = *dt;
  v.ndim = t.ndim;
  v.data = static_cast<char*>(t.data) + t.byte_offset;
  int64_t s = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    v.shape[d] = t.shape[d];
    v.strides[d] = t.strides ? t.strides[d] : s;
    s *= t.shape[d];
  }
  return v;
}

DLTensor TensorView::to_dlpack() {
  DLTensor t{};
  t.data = data;
  t.device.device_type = device.is_cpu() ? kDLCPU : kDLCUDA;
  t.device.device_id = device.index;
  t.ndim = ndim;
  switch (dtype) {
    case DType::f32: t.dtype = {kDLFloat, 32, 1}; break;
    case DType::f16: t.dtype = {kDLFloat, 16, 1}; break;
    case DType::bf16: t.dtype = {kDLBfloat, 16, 1}; break;
    case DType::i32: t.dtype = {kDLInt, 32, 1}; break;
    case DType::i64: t.dtype = {kDLInt, 64, 1}; break;
    // DLPack 0.6 has no fp8 code: fp8 tensors travel as bytes.
    case DType::fp8_e4m3: case DType::fp8_ds_mla: case DType::fp8_ds_mla_nope: case DType::fp8_ds_mla_v4:
    case DType::u8:
      t.dtype = {kDLUInt, 8, 1};
      break;
  }
  t.shape = shape.data();
  t.strides = strides.data();
  t.byte_offset = 0;
  return t;
}

}  // namespace smla
