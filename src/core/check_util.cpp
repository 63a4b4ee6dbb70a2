#include "core/check_util.h"

namespace smla::checks {

namespace {
std::string dtypes_text(std::initializer_list<DType> allowed) {
  std::string s;
  size_t i = 0;
  for (DType d : allowed) {
    if (i++) s += i == allowed.size() ? " or " : ", ";
    s += dtype_name(d);
  }
  return s;
}
}  // namespace

void ArgCheck::fail(const std::string& what) const {
  smla::fail(std::string(op_) + ": " + std::string(arg_) + ": " + what);
}

const ArgCheck& ArgCheck::defined() const {
  if (!t_.defined()) fail("is required but has no data (null pointer)");
  return *this;
}

const ArgCheck& ArgCheck::rank(int ndim, std::string_view pattern) const {
  if (t_.ndim != ndim)
    fail("expected " + std::to_string(ndim) + " dimensions " + std::string(pattern) + ", got " + t_.describe());
  for (int d = 0; d < t_.ndim; ++d)
    if (t_.shape[d] < 0) fail("negative size in dimension " + std::to_string(d) + ": " + t_.describe());
  return *this;
}

const ArgCheck& ArgCheck::dtype_in(std::initializer_list<DType> allowed) const {
  for (DType d : allowed)
    if (t_.dtype == d) return *this;
  fail("expected dtype " + dtypes_text(allowed) + ", got " + std::string(dtype_name(t_.dtype)));
}

const ArgCheck& ArgCheck::dim(int d, int64_t expected, std::string_view meaning) const {
  if (t_.shape[d] != expected)
    fail("dimension " + std::to_string(d) + " (" + std::string(meaning) + ") must be " + std::to_string(expected) +
         ", got " + t_.describe());
  return *this;
}

const ArgCheck& ArgCheck::dim_at_least(int d, int64_t min, std::string_view meaning) const {
  if (t_.shape[d] < min)
    fail("dimension " + std::to_string(d) + " (" + std::string(meaning) + ") must be >= " + std::to_string(min) +
         ", got " + t_.describe());
  return *this;
}

const ArgCheck& ArgCheck::on(const Device& device) const {
  if (!same_device(t_.device, device))
    fail("is on " + t_.device.name() + (t_.device.is_cuda() ? ":" + std::to_string(t_.device.index) : "") +
         " but the op runs on " + device.name());
  return *this;
}

const ArgCheck& ArgCheck::inner_contiguous() const {
  for (int d = 0; d < t_.ndim; ++d)
    if (t_.strides[d] < 0) fail("negative strides are not supported: dimension " + std::to_string(d));
  if (t_.ndim > 0 && t_.shape[t_.ndim - 1] > 1 && t_.strides[t_.ndim - 1] != 1)
    fail("the last dimension must be contiguous (stride 1), got stride " + std::to_string(t_.strides[t_.ndim - 1]));
  return *this;
}

bool same_device(const Device& a, const Device& b) { return a.kind == b.kind && (a.is_cpu() || a.index == b.index); }

}  // namespace smla::checks
