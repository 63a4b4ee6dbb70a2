#include "views.h"

#include <string>

#include "smla/error.h"
#include "smla/select.h"

namespace smla::python {

namespace {

// DLPack codes of the 8/6/4-bit float types (DLPack >= 1.1); frameworks that
// export fp8 natively use them, older ones refuse, so callers pass bytes.
bool is_small_float_code(uint8_t code) { return code >= 7 && code <= 17; }

}  // namespace

TensorView view_of(DLTensor t, const char* name, std::optional<DType> as) {
  std::optional<DType> reinterpret;
  if (as) {
    const bool raw = t.dtype.code == kDLUInt || t.dtype.code == kDLInt || is_small_float_code(t.dtype.code);
    if (raw && t.dtype.bits == 8 && dtype_size(*as) == 1) {
      t.dtype.code = kDLUInt;
      reinterpret = as;
    } else if (raw && t.dtype.bits == 16 && (*as == DType::bf16 || *as == DType::f16)) {
      t.dtype.code = *as == DType::bf16 ? kDLBfloat : kDLFloat;
    }
  }
  TensorView v = TensorView::from_dlpack(t, name, reinterpret);
  if (as && v.dtype != *as)
    fail(std::string(name) + ": is " + std::string(dtype_name(v.dtype)) + ", not " + std::string(dtype_name(*as)));
  return v;
}

const Backend* backend_by_name(std::string_view name, const Device& device) {
  if (name.empty()) return nullptr;
  const Registry& registry = Registry::global();
  const Backend* b = registry.find(name);
  if (!b) {
    std::string names;
    for (const auto& n : registry.names()) names += (names.empty() ? "" : ", ") + n;
    fail("backend: unknown backend '" + std::string(name) + "'; this build has " + names);
  }
  // The ops trust a backend they are given: one for another device kind would
  // dereference memory it cannot reach.
  if (b->capabilities().device_kind != device.kind)
    throw Error(ErrorKind::unsupported, "backend: " + std::string(name) + " does not run on tensors on " +
                                            (device.is_cpu() ? std::string("the CPU") : "a CUDA GPU"));
  return b;
}

}  // namespace smla::python
