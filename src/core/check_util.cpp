#include "core/check_util.h"

#include <array>
#include <cstdint>

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
  if (!t_.defined() && !(t_.ndim > 0 && t_.numel() == 0)) fail("is required but has no data (null pointer)");
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

const ArgCheck& ArgCheck::no_negative_strides() const {
  for (int d = 0; d < t_.ndim; ++d)
    if (t_.strides[d] < 0) fail("negative strides are not supported: dimension " + std::to_string(d));
  return *this;
}

const ArgCheck& ArgCheck::inner_contiguous() const {
  no_negative_strides();
  if (t_.numel() == 0) return *this;
  if (t_.ndim > 0 && t_.shape[t_.ndim - 1] > 1 && t_.strides[t_.ndim - 1] != 1)
    fail("the last dimension must be contiguous (stride 1), got stride " + std::to_string(t_.strides[t_.ndim - 1]));
  return *this;
}

const ArgCheck& ArgCheck::no_self_overlap() const {
  if (t_.numel() <= 1) return *this;
  // The dimensions of size > 1, by increasing stride (inserted in order: at most kMaxDims of them).
  std::array<int, TensorView::kMaxDims> dims{};
  int n = 0;
  for (int d = 0; d < t_.ndim; ++d) {
    if (t_.shape[d] <= 1) continue;
    int i = n++;
    for (; i > 0 && t_.strides[dims[i - 1]] > t_.strides[d]; --i) dims[i] = dims[i - 1];
    dims[i] = d;
  }
  int64_t extent = 1;  // elements spanned by the dimensions with smaller strides
  for (int i = 0; i < n; ++i) {
    const int d = dims[i];
    if (t_.strides[d] < extent)
      fail("elements share memory: dimension " + std::to_string(d) + " (size " + std::to_string(t_.shape[d]) +
           ") has stride " + std::to_string(t_.strides[d]) + ", less than the " + std::to_string(extent) +
           " elements its inner dimensions span; an output needs a distinct address for every element");
    extent += (t_.shape[d] - 1) * t_.strides[d];
  }
  return *this;
}

namespace {
struct ByteSpan {
  uintptr_t first = 0, last = 0;  // inclusive
  bool empty = true;
};

ByteSpan byte_span(const TensorView& t) {
  if (!t.defined() || t.numel() == 0) return {};
  int64_t low = 0, high = 0;  // element offsets of the lowest and highest element
  for (int d = 0; d < t.ndim; ++d) {
    const int64_t reach = (t.shape[d] - 1) * t.strides[d];
    (reach < 0 ? low : high) += reach;
  }
  const auto base = reinterpret_cast<uintptr_t>(t.data);
  const auto size = static_cast<int64_t>(dtype_size(t.dtype));
  return {base + static_cast<uintptr_t>(low * size), base + static_cast<uintptr_t>(high * size + size - 1), false};
}

bool overlap(const TensorView& a, const TensorView& b) {
  const ByteSpan x = byte_span(a), y = byte_span(b);
  return !x.empty && !y.empty && same_device(a.device, b.device) && x.first <= y.last && y.first <= x.last;
}
}  // namespace

void check_no_overlap(std::string_view op, std::initializer_list<Named> outputs, std::initializer_list<Named> inputs) {
  auto refuse = [&](const Named& out, const Named& other, std::string_view kind) {
    arg(op, out.name, out.tensor)
        .fail("overlaps " + std::string(kind) + " " + std::string(other.name) +
              " in memory; outputs must not share memory with the op's inputs or other outputs (docs/ops.md, "
              "\"Aliasing\")");
  };
  for (auto o = outputs.begin(); o != outputs.end(); ++o) {
    arg(op, o->name, o->tensor).no_self_overlap();
    for (const Named& in : inputs)
      if (overlap(o->tensor, in.tensor)) refuse(*o, in, "input");
    for (auto other = outputs.begin(); other != o; ++other)
      if (overlap(o->tensor, other->tensor)) refuse(*o, *other, "output");
  }
}

bool same_device(const Device& a, const Device& b) { return a.kind == b.kind && (a.is_cpu() || a.index == b.index); }

}  // namespace smla::checks
