// DLPack import of Python tensors into smla::TensorViews, zero-copy.
#include <nanobind/stl/string.h>

#include <optional>
#include <string>

#include "bindings.h"
#include "views.h"
#include "smla/error.h"

namespace smla::python {

namespace {

struct Split {
  nb::handle array;
  std::optional<DType> as;
};

Split split(nb::handle obj, const char* name) {
  if (!nb::isinstance<nb::tuple>(obj)) return {obj, std::nullopt};
  auto t = nb::borrow<nb::tuple>(obj);
  require(t.size() == 2 && nb::isinstance<nb::str>(t[1]),
          std::string(name) + ": expected a tensor or a (tensor, dtype name) pair");
  const std::string dtype = nb::cast<std::string>(t[1]);
  auto dt = parse_dtype(dtype);
  if (!dt) fail(std::string(name) + ": unknown dtype '" + dtype + "'");
  return {t[0], dt};
}

template <class Array>
TensorView import_tensor(nb::handle obj, const char* name, std::vector<Array>& keep, bool writable) {
  if (obj.is_none()) return {};
  const Split s = split(obj, name);
  Array a;
  if (!nb::try_cast(s.array, a, false)) {
    const std::string type = nb::cast<std::string>(nb::type_name(s.array.type()));
    fail(std::string(name) + ": expected a " + (writable ? "writable " : "") +
         "DLPack-capable tensor (numpy, torch, cupy, ...), got " + type);
  }
  DLTensor t{};
  t.data = const_cast<void*>(static_cast<const void*>(a.data()));  // byte_offset already applied
  t.device.device_type = static_cast<DLDeviceType>(a.device_type());
  t.device.device_id = a.device_id();
  t.ndim = static_cast<int>(a.ndim());
  t.dtype.code = a.dtype().code;
  t.dtype.bits = a.dtype().bits;
  t.dtype.lanes = a.dtype().lanes;
  t.shape = const_cast<int64_t*>(a.shape_ptr());
  t.strides = const_cast<int64_t*>(a.stride_ptr());
  keep.push_back(std::move(a));
  return view_of(t, name, s.as);
}

}  // namespace

TensorView Importer::input(nb::handle obj, const char* name) { return import_tensor(obj, name, inputs_, false); }
TensorView Importer::output(nb::handle obj, const char* name) { return import_tensor(obj, name, outputs_, true); }

nb::dict tensor_info(nb::handle obj) {
  Importer imp;
  const TensorView v = imp.input(obj, "tensor");
  nb::list shape, strides;
  for (int d = 0; d < v.ndim; ++d) {
    shape.append(v.shape[d]);
    strides.append(v.strides[d]);
  }
  nb::dict info;
  info["data"] = reinterpret_cast<uintptr_t>(v.data);
  info["shape"] = nb::tuple(shape);
  info["strides"] = nb::tuple(strides);
  info["dtype"] = std::string(dtype_name(v.dtype));
  info["device"] = v.device.is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(v.device.index);
  return info;
}

}  // namespace smla::python
