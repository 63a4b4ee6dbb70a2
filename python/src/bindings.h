// Shared pieces of the _smla extension module: tensor import (DLPack, no
// copies) and the registration functions of each part.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <string>
#include <vector>

#include "smla/backend.h"
#include "smla/types.h"
#include "views.h"  // backend_by_name

namespace smla::python {

namespace nb = nanobind;

// Views Python tensors as smla::TensorViews without copying them. An argument
// is any DLPack-capable object (numpy, torch, cupy, a DLPack capsule) or a
// tuple (object, "dtype name") that reads the object's raw bytes as that smla
// dtype: fp8 data travels as 8-bit integers, numpy's bfloat16 as uint16. A
// tuple over a float tensor only checks that it already has that dtype.
// The imported arrays stay referenced until the Importer is destroyed, which
// must happen while the GIL is held.
class Importer {
 public:
  // A tensor the op only reads; None gives an undefined (absent) view.
  TensorView input(nb::handle obj, const char* name);
  // A tensor the op writes: it must be writable.
  TensorView output(nb::handle obj, const char* name);

 private:
  std::vector<nb::ndarray<nb::ro>> inputs_;
  std::vector<nb::ndarray<>> outputs_;
};

// What C++ sees of a tensor (data pointer, shape, strides, dtype, device):
// the tests use it to check that no copy was made.
nb::dict tensor_info(nb::handle obj);

void bind_errors(nb::module_& m);
void bind_specs(nb::module_& m);
void bind_explain(nb::module_& m);
void bind_ops(nb::module_& m);

}  // namespace smla::python
