// Small checks for op arguments. Each throws smla::Error naming the argument
// and what was expected, e.g. "sparse_mla: q: expected 3 dimensions [T, H, 576], got [4, 576]".
#pragma once

#include <initializer_list>
#include <string>
#include <string_view>

#include "smla/error.h"
#include "smla/types.h"

namespace smla::checks {

// Prefixes every message with the op name and the argument name.
class ArgCheck {
 public:
  ArgCheck(std::string_view op, std::string_view arg, const TensorView& t) : op_(op), arg_(arg), t_(t) {}

  // Fails unless the tensor has data (optional tensors: test defined() first). A tensor with dimensions but no
  // elements may have null data (frameworks hand such tensors out for empty batches).
  const ArgCheck& defined() const;
  // ndim and a readable shape pattern used in the message, e.g. "[T, H, 576]".
  const ArgCheck& rank(int ndim, std::string_view pattern) const;
  const ArgCheck& dtype_in(std::initializer_list<DType> allowed) const;
  const ArgCheck& dim(int d, int64_t expected, std::string_view meaning) const;
  const ArgCheck& dim_at_least(int d, int64_t min, std::string_view meaning) const;
  const ArgCheck& on(const Device& device) const;
  // The last dimension is contiguous (stride 1) and no stride is negative. A tensor with no elements has no
  // layout to check (numpy gives empty arrays zero strides).
  const ArgCheck& inner_contiguous() const;
  // No stride is negative (any layout otherwise).
  const ArgCheck& no_negative_strides() const;

  // For outputs: no two elements share memory. Each dimension's stride must be at least the extent of the
  // dimensions with smaller strides (any permutation of a dense or padded layout passes; a stride 0 on a
  // dimension of size > 1, or interleaved dimensions, fail).
  const ArgCheck& no_self_overlap() const;

  [[noreturn]] void fail(const std::string& what) const;

 private:
  std::string_view op_, arg_;
  const TensorView& t_;
};

inline ArgCheck arg(std::string_view op, std::string_view name, const TensorView& t) { return {op, name, t}; }

// Same device kind and index for all tensors (compute capability ignored).
bool same_device(const Device& a, const Device& b);

// A tensor argument by name, for the overlap check.
struct Named {
  std::string_view name;
  const TensorView& tensor;
};
// Fails, naming both arguments, when an output's memory overlaps an input's or another output's: each tensor
// covers the bytes from its lowest to its highest element address (whatever its strides), and two such spans on
// one device must not meet. Absent tensors and tensors with no elements cover nothing. Outputs are checked for
// self-overlap too (ArgCheck::no_self_overlap).
void check_no_overlap(std::string_view op, std::initializer_list<Named> outputs, std::initializer_list<Named> inputs);

}  // namespace smla::checks
