#pragma once

#include <memory>

#include "smla/backend.h"

namespace smla::cuda {

// The GPU indexer's top-k selects at most this many positions per token.
inline constexpr int kMaxIndexerTopk = 8192;

// The mma.sync backend for compute capability 8.0 through 12.x. In a build
// without nvcc it is still registered, so `explain` shows it and says why it
// cannot run; its ops then throw.
std::unique_ptr<Backend> make_backend();
}  // namespace smla::cuda
