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

  // Fails unless the tensor has data (optional tensors: test defined() first).
  const ArgCheck& defined() const;
  // ndim and a readable shape pattern used in the message, e.g. "[T, H, 576]".
  const ArgCheck& rank(int ndim, std::string_view pattern) const;
  const ArgCheck& dtype_in(std::initializer_list<DType> allowed) const;
  const ArgCheck& dim(int d, int64_t expected, std::string_view meaning) const;
  const ArgCheck& dim_at_least(int d, int64_t min, std::string_view meaning) const;
  const ArgCheck& on(const Device& device) const;
  // The last dimension is contiguous (stride 1) and no stride is negative.
  const ArgCheck& inner_contiguous() const;

  [[noreturn]] void fail(const std::string& what) const;

 private:
  std::string_view op_, arg_;
  const TensorView& t_;
};

inline ArgCheck arg(std::string_view op, std::string_view name, const TensorView& t) { return {op, name, t}; }

// Same device kind and index for all tensors (compute capability ignored).
bool same_device(const Device& a, const Device& b);

}  // namespace smla::checks
